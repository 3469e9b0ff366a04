"""Process groups: the one `(world, rank)` helper and the one list of backend names.

`group=None` means the same thing everywhere in `core_parallel` and `recipes` (ZeRO, Gemini, checkpoints,
DAP, the strategies): the default process group when `torch.distributed` is initialised, else one process
(`world_rank(None) == (1, 0)`). A code path that must run unsplit inside a multi-process job passes a
one-rank group, not None.

Importing this module stays free of torch (the launch helper and parsers import it cheaply).
"""

from __future__ import annotations

from typing import Any

from ..utils.errors import InputError

__all__ = ["BACKENDS", "GLOO", "LAUNCH_BACKENDS", "NCCL", "check_backend", "world_rank"]

GLOO = "gloo"
"""CPU tensors (and the fallback where NCCL is missing)."""
NCCL = "nccl"
"""CUDA tensors."""
BACKENDS: tuple[str, ...] = (GLOO, NCCL, "mpi")
"""The `torch.distributed` backend names accepted wherever a backend is named (topology, launch, strategies)."""
LAUNCH_BACKENDS: tuple[str, ...] = (*BACKENDS, "none")
"""`run_on_ranks` also takes "none": spawn the ranks without initialising a process group."""


def check_backend(backend: str, allowed: tuple[str, ...] = BACKENDS, what: str = "backend") -> str:
    """`backend` when it is one of `allowed`; an `InputError` naming `what` and the choices otherwise."""
    if backend not in allowed:
        raise InputError(f"{what} must be one of {', '.join(allowed)}, got {backend!r}")
    return backend


def world_rank(group: Any = None) -> tuple[int, int]:
    """(world size, rank) of `group`; None: the default group when initialised, else (1, 0) for one process.

    A group given while `torch.distributed` is not initialised is a programming error (ValueError).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)
