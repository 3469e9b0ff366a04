"""core_parallel: topology and process groups, ZeRO, Gemini chunks, DAP communication, checkpoints.

Heavy parts are imported on first use (`core_parallel.setup`, `core_parallel.ZeroConfig`, ...).
"""

from __future__ import annotations

from core_parallel._lazy import lazy_getattr
from core_parallel.launch import RankError, run_on_ranks

# Importing the package stays free of torch (Ray workers and parsers import it cheaply).
_LAZY = {
    "Axis": "core_parallel.topology",
    "Topology": "core_parallel.topology",
    "default_backend": "core_parallel.topology",
    "setup": "core_parallel.api",
    "save_checkpoint": "core_parallel.api",
    "load_checkpoint": "core_parallel.api",
    "consolidate_checkpoint": "core_parallel.api",
    "ZeroConfig": "core_parallel.zero",
    "GeminiConfig": "core_parallel.gemini",
}
__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = ["RankError", "run_on_ranks", *_LAZY]
