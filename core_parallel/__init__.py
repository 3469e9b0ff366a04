"""core_parallel: topology and process groups, ZeRO, Gemini chunks, DAP communication, checkpoints.

Heavy parts are imported on first use (`core_parallel.setup`, `core_parallel.ZeroConfig`, ...).
"""

from __future__ import annotations

from core_parallel._lazy import lazy_getattr
from core_parallel.launch import RankError, run_on_ranks
from core_parallel.topology import Axis, Topology, default_backend

_LAZY = {
    "setup": "core_parallel.api",
    "save_checkpoint": "core_parallel.api",
    "load_checkpoint": "core_parallel.api",
    "consolidate_checkpoint": "core_parallel.api",
    "ZeroConfig": "core_parallel.zero",
    "GeminiConfig": "core_parallel.gemini",
}
__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = ["Axis", "RankError", "Topology", "default_backend", "run_on_ranks", *_LAZY]
