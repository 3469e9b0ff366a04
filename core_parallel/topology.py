"""The parallel topology: world = data-parallel (ZeRO) degree x DAP degree.

One frozen dataclass describes the layout; it validates the degrees, creates the process groups for each
axis and hands them out by axis name. Nothing here is global: callers keep the `Topology` and pass groups
on explicitly.

The environment is read in one place, `Topology.from_env()`: torchrun's `WORLD_SIZE` and `RANK` are the
launcher's contract with the processes it starts, and a user's script reads them there, once, at its entry.
Nothing in the library calls it (the Lightning strategies take ranks and groups from Lightning, `suite fold`
spawns its ranks and names each one's rank).

Rank layout: DAP is the fastest-varying axis, so the ranks of one DAP group are consecutive
(rank = dp_index * dap + dap_index), which keeps all-to-all traffic inside a node.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist

from ..utils.errors import InputError
from .groups import GLOO, NCCL, check_backend, world_rank

logger = logging.getLogger(__name__)

__all__ = ["Axis", "Topology", "default_backend"]


class Axis(str, Enum):
    """Mesh axis names. "axis" means a mesh axis; "dim" means a tensor dimension."""

    DATA = "data"
    """Data-parallel / ZeRO sharding axis: the ranks holding the same DAP index. Its group is the one to give
    `core_parallel.setup` when a job combines DAP with data parallelism (world = data x dap)."""
    DAP = "dap"
    """Dynamic axial parallelism axis (activations split across ranks)."""
    WORLD = "world"
    """All ranks."""


def default_backend(device: str | torch.device | None = None) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and dist.is_nccl_available():
        return NCCL
    return GLOO


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise InputError(f"environment variable {name}={value!r} is not an integer") from exc


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Degrees of each parallel axis and the rank of this process.

    Build it with `Topology.from_env()` under torchrun, or with explicit arguments. `init()` creates the
    process groups (and the default group when none exists); `destroy()` tears down what `init()` created.
    """

    world_size: int = 1
    """Total number of processes."""
    rank: int = 0
    """Global rank of this process."""
    dap: int = 1
    """DAP degree: ranks that split one model's activations."""
    backend: str = GLOO
    """torch.distributed backend, one of `groups.BACKENDS`: gloo (CPU), nccl (CUDA) or mpi."""
    timeout_s: float = 600.0
    """Collective timeout in seconds: a dead peer turns into an error after this long, not a hang."""
    _groups: dict = field(default_factory=dict, repr=False, compare=False)
    _owns_default: list = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise InputError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise InputError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.dap < 1:
            raise InputError(f"dap must be >= 1, got {self.dap}")
        if self.world_size % self.dap != 0:
            raise InputError(
                f"dap={self.dap} does not divide world_size={self.world_size} (world = data x dap)"
            )
        check_backend(self.backend)
        if self.timeout_s <= 0:
            raise InputError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def data(self) -> int:
        """Data-parallel (ZeRO) degree: world_size // dap."""
        return self.world_size // self.dap

    @property
    def dap_rank(self) -> int:
        """Index of this rank inside its DAP group."""
        return self.rank % self.dap

    @property
    def data_rank(self) -> int:
        """Index of this rank inside its data-parallel group."""
        return self.rank // self.dap

    def degree(self, axis: Axis | str) -> int:
        """Number of ranks along `axis`."""
        axis = Axis(axis)
        return {Axis.DATA: self.data, Axis.DAP: self.dap, Axis.WORLD: self.world_size}[axis]

    def ranks_of(self, axis: Axis | str, rank: int | None = None) -> list[int]:
        """Global ranks in the group along `axis` that contains `rank` (default: this rank)."""
        axis = Axis(axis)
        rank = self.rank if rank is None else rank
        if axis is Axis.WORLD:
            return list(range(self.world_size))
        if axis is Axis.DAP:
            start = (rank // self.dap) * self.dap
            return list(range(start, start + self.dap))
        return list(range(rank % self.dap, self.world_size, self.dap))

    @classmethod
    def from_env(cls, *, dap: int = 1, backend: str | None = None, timeout_s: float = 600.0,
                 environ: Mapping[str, str] | None = None) -> Topology:
        """Read WORLD_SIZE and RANK as torchrun sets them (1 process when unset) from `environ` (default: this
        process's environment). Call it at the entry of a script, once; see the module docstring."""
        environ = os.environ if environ is None else environ
        world = _env_int(environ, "WORLD_SIZE", 1)
        rank = _env_int(environ, "RANK", 0)
        if backend is None:
            backend = NCCL if torch.cuda.is_available() and dist.is_nccl_available() else GLOO
        return cls(world_size=world, rank=rank, dap=dap, backend=backend, timeout_s=timeout_s)

    def init(self, init_method: str | None = None) -> Topology:
        """Create the default group (if absent) and one group per axis. Returns self."""
        if self.world_size == 1 and not dist.is_initialized():
            return self
        if not dist.is_initialized():
            dist.init_process_group(
                backend=self.backend,
                init_method=init_method or "env://",
                world_size=self.world_size,
                rank=self.rank,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )
            self._owns_default.append(True)
        world, rank = world_rank()
        if (world, rank) != (self.world_size, self.rank):
            raise ValueError(
                f"topology says rank {self.rank} of {self.world_size}, the process group says rank {rank} of {world}"
            )
        # new_group is collective: every rank creates every group, in the same order.
        for axis in (Axis.DATA, Axis.DAP):
            n_groups = self.world_size // self.degree(axis)
            for g in range(n_groups):
                leader = g * self.dap if axis is Axis.DAP else g
                ranks = self.ranks_of(axis, leader)
                pg = dist.new_group(ranks=ranks, backend=self.backend)
                if self.rank in ranks:
                    self._groups[axis] = pg
        self._groups[Axis.WORLD] = dist.group.WORLD
        return self

    def group(self, axis: Axis | str) -> dist.ProcessGroup | None:
        """The process group along `axis` containing this rank; None when running on one process."""
        axis = Axis(axis)
        if not self._groups:
            if self.world_size == 1:
                return None
            raise RuntimeError("Topology.init() has not been called")
        return self._groups[axis]

    def destroy(self) -> None:
        """Destroy the groups created by `init()` (and the default group if `init()` made it)."""
        if not dist.is_initialized():
            self._groups.clear()
            return
        for axis, pg in list(self._groups.items()):
            if axis is not Axis.WORLD and pg is not None:
                dist.destroy_process_group(pg)
        self._groups.clear()
        if self._owns_default:
            dist.destroy_process_group()
            self._owns_default.clear()
