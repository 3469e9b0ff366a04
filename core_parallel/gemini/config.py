"""Configuration of Gemini (chunk-based ZeRO-3 with device / CPU / NVMe placement)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..loss_scaler import LossScalerConfig

__all__ = ["GeminiConfig", "parse_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_PLACEMENTS = ("static", "auto")
_PRECISIONS = ("fp32", "fp16", "bf16")


def parse_bytes(value: int | float | str, field: str = "value") -> int:
    """Parse `20GB`, `512MiB`, `1.5e9` or an int into bytes; ValueError naming `field` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a size like '20GB' or a number of bytes, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(f"{field} must be a size like '20GB' or '512MiB', got {value!r}")
        number, unit = float(m.group(1)), m.group(2).upper()
    result = int(number * _UNITS[unit])
    if result <= 0:
        raise ValueError(f"{field} must be > 0 bytes, got {value!r}")
    return result


@dataclass(kw_only=True)
class GeminiConfig:
    """How Gemini packs parameters into chunks and where their fp32 shards and optimizer states live."""

    placement: str = "static"
    """`static`: the two fractions below decide once; `auto`: trace the first step, keep on the device what
    fits `device_memory_budget`, evict the chunk whose next use is furthest away."""
    offload_param_frac: float = 0.0
    """static only: fraction of chunks whose fp32 parameter shards live off the device (CPU, or NVMe when
    `offload_dir` is set)."""
    offload_optim_frac: float = 0.0
    """static only: fraction of chunks whose gradient shards and optimizer states live off the device."""
    offload_dir: str | None = None
    """Folder for the NVMe tier (memory-mapped files, one per rank); None keeps off-device data in CPU memory."""
    device_memory_budget: int | str | None = None
    """Bytes of device memory Gemini may use for model data, e.g. '20GB'; None means what the device has."""
    chunk_mb: float | None = None
    """Chunk size in MiB of the compute dtype; None searches the size that wastes least padding."""
    precision: str = "fp32"
    """Compute dtype of the gathered parameters: fp32, fp16 or bf16 (master shards are always fp32)."""
    prefetch: int = 1
    """Number of chunks all-gathered ahead of use, following the order recorded in the first step."""
    keep_gathered: int | None = None
    """A chunk a module is done with stays gathered while it is among the next `keep_gathered` distinct chunks
    of the recorded order (it will be used again soon); None: `prefetch + 1`. Higher values trade a few
    gathered chunks of memory for fewer re-gathers (all-gathers on several ranks)."""
    host_collectives: bool = True
    """CPU ranks on one host all-gather and reduce-scatter through a shared-memory segment instead of the process
    group (gloo's loopback TCP); the process group is used when the ranks cannot share `/dev/shm`."""
    max_grad_norm: float | None = None
    """Clip gradients to this global L2 norm inside `step()`; None disables clipping."""
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    """Dynamic loss scaler settings, used when precision is fp16."""

    def __post_init__(self) -> None:
        if self.placement not in _PLACEMENTS:
            raise ValueError(f"placement must be one of {_PLACEMENTS}, got {self.placement!r}")
        for name in ("offload_param_frac", "offload_optim_frac"):
            frac = getattr(self, name)
            if not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1], got {frac!r}")
        if self.placement == "auto" and (self.offload_param_frac or self.offload_optim_frac):
            raise ValueError("offload_param_frac/offload_optim_frac apply to placement='static' only")
        if self.offload_dir is not None and not str(self.offload_dir).strip():
            raise ValueError("offload_dir must be a folder path or None, got an empty string")
        if self.device_memory_budget is not None:
            parse_bytes(self.device_memory_budget, "device_memory_budget")
        if self.chunk_mb is not None and not (isinstance(self.chunk_mb, (int, float)) and self.chunk_mb > 0):
            raise ValueError(f"chunk_mb must be a positive number of MiB or None, got {self.chunk_mb!r}")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {_PRECISIONS}, got {self.precision!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.keep_gathered is not None and (not isinstance(self.keep_gathered, int) or self.keep_gathered < 0):
            raise ValueError(f"keep_gathered must be an int >= 0 or None, got {self.keep_gathered!r}")
        if not isinstance(self.host_collectives, bool):
            raise ValueError(f"host_collectives must be True or False, got {self.host_collectives!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        if not isinstance(self.loss_scaler, LossScalerConfig):
            raise ValueError(f"loss_scaler must be a LossScalerConfig, got {type(self.loss_scaler).__name__}")

    @property
    def budget_bytes(self) -> int | None:
        """`device_memory_budget` in bytes (None when unset)."""
        if self.device_memory_budget is None:
            return None
        return parse_bytes(self.device_memory_budget, "device_memory_budget")
