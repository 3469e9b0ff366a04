"""The precision plugin of the sharded strategies (`ZeroStrategy`, `GeminiStrategy`).

Lightning's own plugins call `loss.backward()`, clip with `torch.nn.utils.clip_grad_norm_` over local
gradients and pass a closure to `optimizer.step`. Under ZeRO and Gemini the gradients live in shards
owned by the `core_parallel` optimizer wrapper, and fp16 loss scaling is that wrapper's. This plugin routes
each of those calls to the wrapper:

- backward: `optimizer.backward(loss)` (scales the loss under `16-mixed`);
- clipping by norm: `optimizer.clip_grad_norm(max_norm)` (the global norm over all shards); by value:
  `optimizer.clip_grad_value(clip)` (elementwise on the reduced gradient shards, no communication);
- step: the closure runs (forward and backward), then `optimizer.step()`.

The precisions mean what they mean in Lightning (and torch): `*-mixed` keeps the parameters in fp32 and runs
the forward under `torch.autocast(dtype)`, so LayerNorm, softmax and the losses get what autocast gives them;
`*-true` converts the module to the dtype (Lightning's `HalfPrecision`). The one difference: under `*-true`
`core_parallel` still keeps fp32 master shards, so the optimizer steps in fp32 and rounds into the dtype.

| Trainer precision | parameters (`core_parallel` precision) | forward runs under | loss scaling |
|---|---|---|---|
| `32-true`    | fp32 (`fp32`) | nothing special | none |
| `bf16-mixed` | fp32 (`fp32`) | `torch.autocast(bfloat16)` | none |
| `16-mixed`   | fp32 (`fp32`) | `torch.autocast(float16)` | dynamic (`DynamicLossScaler`, GradScaler's rules) |
| `bf16-true`  | bf16 (`bf16`) | default dtype bf16, inputs cast to bf16 | none |
| `16-true`    | fp16 (`fp16`) | default dtype fp16, inputs cast to fp16 | none (as in Lightning) |

`64-true` (and `transformer-engine`, ...) are refused in one line when the Trainer is built: `core_parallel`'s chunks
and master shards are fp32 at most. On CPU, Lightning turns `Trainer(precision="16-mixed")` into `bf16-mixed` (with
a warning), for these strategies as for ddp; torch's CPU autocast does run float16, so `16-mixed` trains on CPU when
the plugin is given explicitly: `plugins=[ShardedPrecision("16-mixed")]` or Lightning's
`MixedPrecision("16-mixed", "cpu")`.
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
    "16-mixed": "fp32",
    "bf16-mixed": "fp32",
    "bf16-true": "bf16",
    "16-true": "fp16",
}
"""Lightning precision name -> `core_parallel` precision (the dtype the parameters are kept in)."""

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
_REFUSED = {
    "64-true": "core_parallel keeps its chunks and master shards in fp32 at most; train fp64 with strategy='ddp'",
}


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer under Lightning's `LightningOptimizer` wrapper (or the object itself)."""
    return getattr(optimizer, "_optimizer", optimizer)


class ShardedPrecision(Precision):
    """Precision plugin that delegates backward, clipping and stepping to the `core_parallel` optimizer."""

    def __init__(self, precision: str = "32-true") -> None:
        precision = str(precision)
        if precision not in CORE_PRECISION:
            why = _REFUSED.get(precision, f"choose one of {', '.join(CORE_PRECISION)}")
            raise InputError(f"precision={precision!r} is not supported by the sharded strategies: {why}")
        self.precision = precision  # type: ignore[assignment]
        self.core_precision = CORE_PRECISION[precision]
        self.dtype = _DTYPES[self.core_precision]
        """The parameters' dtype (fp32 under `*-mixed`)."""
        self.autocast_dtype = _AUTOCAST.get(precision)
        """The dtype of `torch.autocast` around the forward (None: no autocast)."""
        self.loss_scaling = {"16-mixed": True, "16-true": False}.get(precision)
        """`core_parallel`'s `LossScalerConfig.enabled`: on for fp32 parameters under fp16 autocast, off for fp16
        parameters (Lightning scales no `*-true` loss), else the dtype's default (None)."""
        self.device_type = "cpu"
        self._optimizer: Any = None

    def bind(self, optimizer: Any, device_type: str) -> None:
        """Attach the `core_parallel` optimizer wrapper (called by the strategy after setup, which set its loss
        scaler from `loss_scaling`)."""
        self._optimizer = optimizer
        self.device_type = device_type

    # -- forward ---------------------------------------------------------------------------------------
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Under `*-true`, the module in the dtype, as Lightning's `HalfPrecision` does (the strategy calls this
        before `core_parallel.setup`, which then keeps fp32 master shards of the converted weights). A module
        already in the dtype, or with hollow parameters (streamed into Gemini's chunks at setup, which casts
        them), is left alone."""
        if self.dtype is torch.float32:
            return module
        tensors = [*module.parameters(), *module.buffers()]
        if all(t.dtype == self.dtype for t in tensors if t.is_floating_point()):
            return module
        from ..core_parallel.gemini.lazy import is_hollow

        if any(is_hollow(p) for p in module.parameters()):
            return module
        return module.to(self.dtype)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _default_dtype(self.dtype) if self.autocast_dtype is None else contextlib.nullcontext()

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

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
        if self.autocast_dtype is not None:
            # without autocast's weight cache: it keeps a half copy of every parameter used until the forward ends,
            # so chunks Gemini released (and fetched from CPU or NVMe one at a time) would stay in memory as copies
            # (1.7 GB for SD-1.5's UNet, 5.1 GB for SDXL's); the casts are the same, made again at each use
            with torch.autocast(self.device_type, dtype=self.autocast_dtype, cache_enabled=False):
                yield
        else:
            with _default_dtype(self.dtype):
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
        unwrap_optimizer(optimizer).clip_grad_value(float(clip_val))


def _to_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(default)
