"""The precision plugin of the sharded strategies (`ZeroStrategy`, `GeminiStrategy`).

Lightning's own plugins call `loss.backward()`, clip with `torch.nn.utils.clip_grad_norm_` over local
gradients and pass a closure to `optimizer.step`. Under ZeRO and Gemini the gradients live in shards
owned by the `core_parallel` optimizer wrapper, fp16 needs that wrapper's loss scaler, and the fp32
master weights are the wrapper's business. This plugin routes each of those calls to the wrapper:

- backward: `optimizer.backward(loss)` (scales the loss under fp16);
- clipping by norm: `optimizer.clip_grad_norm(max_norm)` (the global norm over all shards);
- step: the closure runs (forward and backward), then `optimizer.step()`.

Lightning precision names map to the compute dtype that `core_parallel` keeps the parameters in (always
with fp32 master shards for the half types):

| Trainer precision | core_parallel precision | forward runs under |
|---|---|---|
| `32-true`    | `fp32` | nothing special |
| `16-mixed`   | `fp16` | `torch.autocast(float16)`, inputs cast to fp16, dynamic loss scaling |
| `bf16-mixed` | `bf16` | `torch.autocast(bfloat16)`, inputs cast to bf16 |
| `bf16-true`  | `bf16` | default dtype bf16, inputs cast to bf16 |
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection

from ..utils.errors import InputError

__all__ = ["CORE_PRECISION", "ShardedPrecision"]

logger = logging.getLogger(__name__)

CORE_PRECISION: dict[str, str] = {
    "32-true": "fp32",
    "16-mixed": "fp16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
}
"""Lightning precision name -> `core_parallel` precision (compute dtype of the parameters)."""

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer under Lightning's `LightningOptimizer` wrapper (or the object itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


class ShardedPrecision(Precision):
    """Precision plugin that delegates backward, clipping and stepping to the `core_parallel` optimizer."""

    def __init__(self, precision: str = "32-true") -> None:
        precision = str(precision)
        if precision not in CORE_PRECISION:
            raise InputError(
                f"precision={precision!r} is not supported by the sharded strategies; "
                f"choose one of {', '.join(CORE_PRECISION)}"
            )
        self.precision = precision  # type: ignore[assignment]
        self.core_precision = CORE_PRECISION[precision]
        self.dtype = _DTYPES[self.core_precision]
        self.device_type = "cpu"
        self._optimizer: Any = None

    def bind(self, optimizer: Any, device_type: str) -> None:
        """Attach the `core_parallel` optimizer wrapper (called by the strategy after setup)."""
        self._optimizer = optimizer
        self.device_type = device_type

    # -- forward ---------------------------------------------------------------------------------------
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # Used when not fitting (validate / predict without core_parallel.setup); while fitting,
        # core_parallel casts the parameters itself.
        return module.to(self.dtype) if self.precision == "bf16-true" else module

    def convert_input(self, data: Any) -> Any:
        if self.dtype is torch.float32:
            return data
        return apply_to_collection(data, torch.Tensor, _to_dtype, self.dtype)

    def convert_output(self, data: Any) -> Any:
        if self.dtype is torch.float32:
            return data
        return apply_to_collection(data, torch.Tensor, _to_dtype, torch.get_default_dtype())

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision.endswith("-mixed"):
            with torch.autocast(self.device_type, dtype=self.dtype):
                yield
        elif self.precision == "bf16-true":
            default = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        else:
            yield

    # -- backward, clipping, step ---------------------------------------------------------------------
    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        wrapper = self._optimizer
        if wrapper is None:
            raise RuntimeError("ShardedPrecision.backward called before the strategy bound its optimizer")
        if args or kwargs:
            raise TypeError("the sharded strategies take no extra backward arguments (retain_graph, ...)")
        wrapper.backward(tensor)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(f"the sharded optimizer's step takes no arguments, got {sorted(kwargs)}")
        closure_result = closure()
        self._after_closure(model, optimizer)
        automatic = getattr(model, "automatic_optimization", True)
        if closure_result is None and automatic:
            # training_step returned None: Lightning skips this batch (no backward ran, no step either).
            return None
        unwrap_optimizer(optimizer).step()
        return closure_result

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        unwrap_optimizer(optimizer).clip_grad_norm(float(clip_val))

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        raise InputError(
            "gradient_clip_algorithm='value' is not supported by the sharded strategies "
            "(gradients live in shards); use gradient_clip_algorithm='norm'"
        )


def _to_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor
