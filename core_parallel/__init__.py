"""core_parallel: topology and process groups, ZeRO, Gemini chunks, DAP communication, checkpoints."""

from __future__ import annotations

from core_parallel.launch import RankError, run_on_ranks
from core_parallel.topology import Axis, Topology, default_backend

__all__ = ["Axis", "RankError", "Topology", "default_backend", "run_on_ranks"]
