"""Gemini: chunk-based ZeRO-3 with device / CPU / NVMe placement.

```python
cfg = GeminiConfig(placement="auto", offload_tier="nvme", offload_dir="/nvme/run1", device_memory_budget="20GB")
model, optimizer = setup_gemini(model, optimizer, cfg, group=None)   # or core_parallel.setup(...)
```
"""

from __future__ import annotations

from .config import OFFLOAD_TIERS, GeminiConfig, parse_bytes
from .engine import collective_reads, setup_gemini
from .layout import ChunkSpec, ParamInfo, plan_chunks, search_chunk_elems, set_module_order
from .optimizer import GeminiOptimizer
from .storage import NvmeTierError

__all__ = [
    "OFFLOAD_TIERS",
    "ChunkSpec",
    "GeminiConfig",
    "GeminiOptimizer",
    "NvmeTierError",
    "ParamInfo",
    "collective_reads",
    "parse_bytes",
    "plan_chunks",
    "search_chunk_elems",
    "set_module_order",
    "setup_gemini",
]
