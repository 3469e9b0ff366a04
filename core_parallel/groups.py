"""Process groups: the one `(world, rank)` helper and the one list of backend names.

`group=None` means the same thing everywhere in `core_parallel` and `recipes` (ZeRO, Gemini, checkpoints,
DAP, the strategies): the default process group when `torch.distributed` is initialised, else one process
(`world_rank(None) == (1, 0)`). A code path that must run unsplit inside a multi-process job passes a
one-rank group, not None.

Importing this module stays free of torch (the launch helper and parsers import it cheaply).
"""

from __future__ import annotations

import logging
from typing import Any

from ..utils.errors import InputError

__all__ = ["BACKENDS", "GLOO", "LAUNCH_BACKENDS", "NCCL", "abandon_process_groups", "check_backend",
           "end_process_groups", "group_timeout", "world_rank"]

logger = logging.getLogger(__name__)

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


def group_timeout(group: Any = None) -> float:
    """The collective timeout of `group` (None: the default group) in seconds; torch's default, 30 minutes, when
    unreadable."""
    import torch
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return default_pg_timeout.total_seconds()


def abandon_process_groups() -> bool:
    """After a failure this rank reports by itself (no barrier: another rank may be gone): destroy its process groups
    now, so the interpreter's exit does not tear gloo's and the store's threads down in no particular order (a rank
    that refused bad input with exit 2 aborted there now and then: "terminate called without an active exception",
    exit -6). Returns whether there was a group to destroy."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the rank is exiting with its own error already
        logger.debug("destroying the process group after a failure: %s", exc)
    return True


def end_process_groups() -> bool:
    """End a finished job's process groups on every rank, in order: a barrier (no rank tears down its groups and
    its store connection while another still talks to them), then `destroy_process_group`, which destroys every
    group and drops the default store. Left to interpreter exit, the gloo and store threads are torn down in no
    particular order: a rank aborted there ("terminate called without an active exception") and the other
    node's torchrun agent lost its rendezvous store. Call it on success only: after a failure the barrier would
    wait for a rank that is gone. Returns whether there was a group to end."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - this rank's work is done; another rank's failure is its own exit code
        logger.warning("ending the process group: the closing barrier failed (another rank stopped or is gone: %s); "
                       "this rank's work had finished", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    dist.destroy_process_group()
    return True
