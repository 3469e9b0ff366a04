"""Configuration of Gemini (chunk-based ZeRO-3 with device / CPU / NVMe placement).

Where data lives is decided by two independent settings: the placement decides *which* chunks leave the
device (`static`: the two fractions; `auto`: what does not fit the budget), and `offload_tier` decides
*where* they go (`cpu` memory or `nvme` files in `offload_dir`). `offload_dir` is required with
`offload_tier="nvme"` and refused with `"cpu"`, so a folder never silently changes the tier.
"""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Literal

from ...utils.errors import InputError
from ..loss_scaler import LossScalerConfig

__all__ = ["OFFLOAD_TIERS", "GeminiConfig", "parse_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_PLACEMENTS = ("static", "auto")
_PRECISIONS = ("fp32", "fp16", "bf16")
_PACKAGE = __name__.partition(".")[0]  # a deprecation warning points at the first frame outside it
OFFLOAD_TIERS = ("cpu", "nvme")
"""Values of `GeminiConfig.offload_tier`: where data placed off the device lives."""


def parse_bytes(value: int | float | str, field: str = "value") -> int:
    """Parse `20GB`, `512MiB`, `1.5e9` or an int into bytes; an `InputError` naming `field` otherwise."""
    if isinstance(value, bool):
        raise InputError(f"{field} must be a size like '20GB' or a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if m is None or m.group(2).upper() not in _UNITS:
            raise InputError(f"{field} must be a size like '20GB' or '512MiB', got {value!r}")
        number, unit = float(m.group(1)), m.group(2).upper()
    result = int(number * _UNITS[unit])
    if result <= 0:
        raise InputError(f"{field} must be > 0 bytes, got {value!r}")
    return result


def _caller_level() -> int:
    """`warnings.warn`'s stacklevel, from the function calling this one, of the first frame outside this package: the
    user's call, whether it built the config itself or through a strategy or a preset."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == _PACKAGE:
        frame, level = frame.f_back, level + 1
    return level


@dataclass(kw_only=True)
class GeminiConfig:
    """How Gemini packs parameters into chunks and where their fp32 shards and optimizer states live."""

    placement: str = "static"
    """`static`: the two fractions below decide once; `auto`: trace the first step, keep on the device what
    fits `device_memory_budget`, evict the chunk whose next use is furthest away."""
    offload_param_frac: float = 0.0
    """static only: fraction of chunks whose fp32 parameter shards live off the device (in `offload_tier`)."""
    offload_optim_frac: float = 0.0
    """static only: fraction of chunks whose gradient shards and optimizer states live off the device."""
    offload_tier: Literal["cpu", "nvme"] | None = None
    """Where data placed off the device lives: "cpu" (CPU memory) or "nvme" (memory-mapped files in
    `offload_dir`). None resolves to "cpu"; to "nvme" when only `offload_dir` is given (deprecated, with a
    DeprecationWarning: name the tier). The resolved value is stored."""
    offload_dir: str | None = None
    """Folder of the NVMe tier (one preallocated file per rank): required with offload_tier="nvme", refused
    with "cpu"."""
    device_memory_budget: int | str | None = None
    """Bytes of device memory Gemini may use for model data, e.g. '20GB'; None means what the device has."""
    memory_budget: int | str | None = None
    """auto only: bytes the whole process may hold at once (RAM on a CPU device, device memory on an accelerator),
    e.g. '6GiB'. What the process holds beside the model (measured at setup and at each step's peak: activations,
    temporaries, other models) is taken off, and the placement keeps the most-read model data resident in the rest
    (master shards before optimizer states), the remainder on the offload tier. Exclusive with
    `device_memory_budget`; on a CPU device it needs `offload_tier="nvme"` (the CPU tier is the same memory)."""
    chunk_mb: float | None = None
    """Chunk size in MiB of the compute dtype; None searches the size that wastes least padding."""
    precision: str = "fp32"
    """Compute dtype of the gathered parameters: fp32, fp16 or bf16 (master shards are always fp32)."""
    prefetch: int = 1
    """Number of chunks all-gathered ahead of use, following the order recorded in the first step."""
    prefetch_max: int = 4
    """Where masters are read from NVMe on a reader thread (one CPU rank, or peer reads), the depth starts at
    `prefetch` and each step sets it from what it measured, between `prefetch` and `prefetch_max`: deeper when
    compute waited for reads while the reader had time to spare, shallower when the reader was busy all the step
    (`prefetch.PrefetchDepth`). Equal to `prefetch` (or below it): a fixed depth."""
    step_in_forward: bool | None = None
    """One rank whose masters are on NVMe (read on the reader thread): `step()` defers each such chunk's update to
    the chunk's next gather (the next forward, on the reader thread beside compute; `GeminiOptimizer._defer`), so the
    master read for the update is the gather's read and the step's disk traffic overlaps compute. The numbers are
    those of the step run at once (hyperparameters, clipping and step counts are taken at `step()`); any other
    read of the chunk (a backward, a save, `state_dict()`) applies it first. None: where the trained chunks hold at
    least half the model's master bytes (a full fine-tune; a LoRA's small step gains nothing from it and its runs
    measured slower); True: wherever it applies; False: every chunk is stepped in `step()`."""
    keep_gathered: int | None = None
    """A chunk a module is done with stays gathered while it is among the next `keep_gathered` distinct chunks
    of the recorded order (it will be used again soon), chunks counted by their size over the largest one's (a
    small chunk used all through the step, such as a LoRA's adapters, takes little of the window); None:
    `prefetch + 1`. Higher values trade a few gathered chunks of memory for fewer re-gathers (all-gathers on
    several ranks, tier reads)."""
    host_collectives: bool = True
    """CPU ranks on one host all-gather and reduce-scatter through a shared-memory segment instead of the process
    group (gloo's loopback TCP); the process group is used when the ranks cannot share `/dev/shm`."""
    peer_reads: bool = True
    """CPU ranks on one host read each other's master shards themselves (`gemini/peer_reads.py`): a gather needs no
    other rank, so ranks may run different modules (experts skipped where they get no token, a forward or a
    `state_dict()` on rank 0 only). False (or ranks that cannot share `/dev/shm`): every gather is a collective
    that every rank must run in the same order, as on accelerators and across hosts."""
    max_grad_norm: float | None = None
    """Clip gradients to this global L2 norm inside `step()`; None disables clipping."""
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    """Dynamic loss scaler settings, used when precision is fp16."""

    def __post_init__(self) -> None:
        if self.placement not in _PLACEMENTS:
            raise InputError(f"placement must be one of {_PLACEMENTS}, got {self.placement!r}")
        for name in ("offload_param_frac", "offload_optim_frac"):
            frac = getattr(self, name)
            if not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
                raise InputError(f"{name} must be a number in [0, 1], got {frac!r}")
        if self.placement == "auto" and (self.offload_param_frac or self.offload_optim_frac):
            raise InputError("offload_param_frac/offload_optim_frac apply to placement='static' only")
        self._check_tier()
        if self.device_memory_budget is not None:
            parse_bytes(self.device_memory_budget, "device_memory_budget")
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget, "memory_budget")
            if self.placement != "auto":
                raise InputError("memory_budget needs placement='auto' (the placement decides what stays resident)")
            if self.device_memory_budget is not None:
                raise InputError("give memory_budget (the whole process) or device_memory_budget (model data on the "
                                 "device), not both")
        if self.chunk_mb is not None and not (isinstance(self.chunk_mb, (int, float)) and self.chunk_mb > 0):
            raise InputError(f"chunk_mb must be a positive number of MiB or None, got {self.chunk_mb!r}")
        if self.precision not in _PRECISIONS:
            raise InputError(f"precision must be one of {_PRECISIONS}, got {self.precision!r}")
        for name in ("prefetch", "prefetch_max"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise InputError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.keep_gathered is not None and (not isinstance(self.keep_gathered, int) or self.keep_gathered < 0):
            raise InputError(f"keep_gathered must be an int >= 0 or None, got {self.keep_gathered!r}")
        if not isinstance(self.host_collectives, bool):
            raise InputError(f"host_collectives must be True or False, got {self.host_collectives!r}")
        if not isinstance(self.peer_reads, bool):
            raise InputError(f"peer_reads must be True or False, got {self.peer_reads!r}")
        if self.step_in_forward is not None and not isinstance(self.step_in_forward, bool):
            raise InputError(f"step_in_forward must be True, False or None, got {self.step_in_forward!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise InputError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        if not isinstance(self.loss_scaler, LossScalerConfig):
            raise InputError(f"loss_scaler must be a LossScalerConfig, got {type(self.loss_scaler).__name__}")

    def _check_tier(self) -> None:
        if self.offload_dir is not None and not str(self.offload_dir).strip():
            raise InputError("offload_dir must be a folder path or None, got an empty string")
        if self.offload_tier is None:
            if self.offload_dir is not None:
                warnings.warn(
                    "GeminiConfig(offload_dir=...) without offload_tier: taken as offload_tier='nvme'; "
                    "name the tier (offload_tier='nvme'), a folder alone will stop selecting it",
                    DeprecationWarning, stacklevel=_caller_level(),
                )
            self.offload_tier = "nvme" if self.offload_dir is not None else "cpu"
        if self.offload_tier not in OFFLOAD_TIERS:
            raise InputError(f"offload_tier must be one of {OFFLOAD_TIERS}, got {self.offload_tier!r}")
        if self.offload_tier == "nvme" and self.offload_dir is None:
            raise InputError("offload_tier='nvme' needs offload_dir, the folder of the NVMe files")
        if self.offload_tier == "cpu" and self.offload_dir is not None:
            raise InputError(
                f"offload_dir={self.offload_dir!r} applies to offload_tier='nvme' only; offload_tier='cpu' keeps "
                "off-device data in CPU memory (drop offload_dir, or set offload_tier='nvme')"
            )

    @property
    def memory_budget_bytes(self) -> int | None:
        """`memory_budget` in bytes (None when unset)."""
        return None if self.memory_budget is None else parse_bytes(self.memory_budget, "memory_budget")

    @property
    def budget_bytes(self) -> int | None:
        """`device_memory_budget` in bytes (None when unset)."""
        if self.device_memory_budget is None:
            return None
        return parse_bytes(self.device_memory_budget, "device_memory_budget")
