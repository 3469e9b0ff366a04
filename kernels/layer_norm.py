"""LayerNorm over the last dim: Triton kernels (forward and backward), a PyTorch reference and the entry point.

Design follows the Triton layer-norm tutorial (`05-layer-norm.py`) in the form flash-attention's
`ops/triton/layer_norm.py` gives it: one program per row in the forward pass; in the backward pass each
program walks a contiguous band of rows and keeps its partial weight/bias gradients in registers, so the
partials buffer is [n_programs, N] and one small torch sum finishes them. Statistics are fp32 whatever the
input dtype. Rows of up to `MAX_TRITON_N` elements fit one block; longer rows use the PyTorch path.
The Triton forward and backward are the custom ops `torch.ops.<ns>.layer_norm_fwd/layer_norm_bwd`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import direct_call, op_name, select_path, triton_installed

__all__ = ["LayerNorm", "MAX_TRITON_N", "layer_norm", "layer_norm_reference"]

MAX_TRITON_N = 16384
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """Plain PyTorch LayerNorm over the last dim; fp16/bf16 are computed in fp32 as `F.layer_norm` does.

    x: [*, N]; weight, bias: [N] or None. Returns [*, N] in the dtype of `x`.
    """
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    mean = xf.mean(-1, keepdim=True)
    xc = xf - mean
    var = (xc * xc).mean(-1, keepdim=True)
    y = xc * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


def _triton():
    """The Triton kernels (kernels/_triton_layer_norm.py), imported on first use."""
    from . import _triton_layer_norm

    return _triton_layer_norm


# ----------------------------------------------------------------------------------------------------------
# Custom ops `torch.ops.<ns>.layer_norm_fwd/_bwd` around the Triton kernels: opaque to torch.compile, visible
# to selective checkpointing. The PyTorch path is `F.layer_norm` itself, which both already see.


@torch.library.custom_op(op_name("layer_norm_fwd"), mutates_args=())
def _layer_norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _triton()._triton_fwd(x, weight, bias, eps)


@_layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    lead = x.shape[:-1]
    return x.new_empty(x.shape), x.new_empty(lead, dtype=torch.float32), x.new_empty(lead, dtype=torch.float32)


@torch.library.custom_op(op_name("layer_norm_bwd"), mutates_args=())
def _layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return _triton()._triton_bwd(dy, x, weight, mean, rstd)


@_layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd):
    n = x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(n, dtype=torch.float32), x.new_empty(n, dtype=torch.float32)


def _layer_norm_setup_context(ctx, inputs, output):
    x, weight, bias, _eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _layer_norm_bwd(dy, x, weight, mean, rstd)
    dweight = dw.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
    dbias = db.to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[2] else None
    return dx, dweight, dbias, None


_layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup_context)


def _triton_unsupported(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> str | None:
    if not triton_installed():
        return "triton is not installed"
    if x.dtype not in _TRITON_DTYPES:
        return f"dtype {x.dtype} is not supported by the Triton kernel"
    if x.shape[-1] > MAX_TRITON_N:
        return f"rows longer than {MAX_TRITON_N} are not supported by the Triton kernel"
    for p in (weight, bias):
        if p is not None and p.device != x.device:
            return "weight/bias on another device"
    return None


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm of `x` over its last dim, then `* weight + bias`.

    x: [*, N]; weight, bias: [N] or None. Returns [*, N] in the dtype of `x`. Differentiable in all three.
    """
    n = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (n,):
            raise ValueError(f"layer_norm: {name} must have shape ({n},), got {tuple(p.shape)}")
    path = select_path("layer_norm", x.device, _triton_unsupported(x, weight, bias))
    if path == "triton":
        if direct_call(x, weight, bias):
            return _triton()._triton_fwd(x, weight, bias, float(eps))[0]
        return _layer_norm_fwd(x, weight, bias, float(eps))[0]
    if path == "torch":
        return layer_norm_reference(x, weight, bias, eps)
    if x.device.type == "cpu" and x.dtype in (torch.float16, torch.bfloat16):
        # CPU F.layer_norm accumulates half-precision weight/bias gradients in half; fp32 keeps them exact
        up = [None if t is None else t.float() for t in (weight, bias)]
        return F.layer_norm(x.float(), (n,), up[0], up[1], eps).to(x.dtype)
    return F.layer_norm(x, (n,), weight, bias, eps)


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in for `torch.nn.LayerNorm` (same arguments and state_dict keys) that calls `kernels.layer_norm`.

    A multi-dim `normalized_shape` is handled by flattening those trailing dims into one.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nd = len(self.normalized_shape)
        if nd == 1:
            return layer_norm(x, self.weight, self.bias, self.eps)
        lead = x.shape[: x.dim() - nd]
        weight = None if self.weight is None else self.weight.reshape(-1)
        bias = None if self.bias is None else self.bias.reshape(-1)
        y = layer_norm(x.reshape(*lead, -1), weight, bias, self.eps)
        return y.reshape(x.shape)
