"""core_parallel: topology and process groups, ZeRO, Gemini chunks, DAP communication, checkpoints.

Heavy parts are imported on first use (`core_parallel.setup`, `core_parallel.ZeroConfig`, ...).
"""

from __future__ import annotations

from ..utils.lazy import lazy_getattr
from .launch import RankError, run_on_ranks

# Importing the package stays free of torch (Ray workers and parsers import it cheaply).
_LAZY = {
    "Axis": ".topology",
    "Topology": ".topology",
    "default_backend": ".topology",
    "BACKENDS": ".groups",
    "world_rank": ".groups",
    "InputError": "..utils.errors",
    "CheckpointError": ".checkpoint",
    "PeerLostError": ".peers",
    "setup": ".api",
    "save_checkpoint": ".api",
    "load_checkpoint": ".api",
    "consolidate_checkpoint": ".api",
    "OptimizerSet": ".api",
    "ZeroConfig": ".zero",
    "GeminiConfig": ".gemini",
    "OFFLOAD_TIERS": ".gemini",
    "config_for_strategy": ".presets",
}
__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = ["RankError", "run_on_ranks", *_LAZY]
