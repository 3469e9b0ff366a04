"""`ZeroConfig`: the settings of the ZeRO optimizer wrapper."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...utils.errors import InputError
from ..loss_scaler import LossScalerConfig

__all__ = ["PRECISIONS", "ZeroConfig"]

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(kw_only=True)
class ZeroConfig:
    """ZeRO stage, precision, offload, bucketing, clipping and loss scaling."""

    stage: int = 2
    """1: shard master weights and optimizer state; 2: also reduce-scatter gradients during backward."""
    precision: str = "fp32"
    """Compute dtype of the model parameters: fp32, fp16 or bf16 (half types keep fp32 master shards)."""
    offload: str = "none"
    """Where master shards and optimizer state live: none (the parameters' device) or cpu."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MiB: one collective per bucket."""
    overlap: bool = True
    """Stage 2: reduce-scatter buckets while backward still runs (async), instead of after it. Stage 1 ignores it."""
    max_grad_norm: float | None = None
    """Clip the global L2 gradient norm to this in every step(); None: no automatic clipping."""
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    """Dynamic loss scaler settings, used when precision is fp16."""

    def __post_init__(self) -> None:
        if self.stage not in (1, 2):
            raise InputError(f"stage must be 1 or 2, got {self.stage!r}")
        if self.precision not in PRECISIONS:
            raise InputError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if self.offload not in ("none", "cpu"):
            raise InputError(f"offload must be 'none' or 'cpu', got {self.offload!r}")
        if not isinstance(self.overlap, bool):
            raise InputError(f"overlap must be True or False, got {self.overlap!r}")
        if not self.bucket_mb > 0:
            raise InputError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise InputError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if not isinstance(self.loss_scaler, LossScalerConfig):
            raise InputError(f"loss_scaler must be a LossScalerConfig, got {type(self.loss_scaler).__name__}")

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype named by `precision`."""
        return PRECISIONS[self.precision]

    @property
    def bucket_bytes(self) -> int:
        """`bucket_mb` in bytes."""
        return max(1, int(self.bucket_mb * 2**20))
