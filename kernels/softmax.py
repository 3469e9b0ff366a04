"""Softmax over the last dim of `x * scale + bias` with a keep-mask: Triton kernels, reference, entry point.

Built like the Triton fused-softmax tutorial (`02-fused-softmax.py`): one program per row, the whole row in
one block, fp32 arithmetic. Bias and mask are read through their broadcast strides (stride 0 where they
broadcast), so an Evoformer bias `[B, 1, H, Q, K]` or mask `[B, S, 1, 1, K]` is never expanded in memory.
A fully masked row gives zeros (its maximum is -inf; the kernel subtracts 0 instead and divides by 1).

The backward kernel writes `ds = p * (dp - sum(p * dp))` once in fp32; `dx = scale * ds` and the bias
gradient is `ds` summed over the bias's broadcast dims.

The Triton kernels and the PyTorch path are the custom ops `torch.ops.<ns>.softmax_fwd/softmax_bwd`
(torch.library, `ns` = `backend.OP_NAMESPACE`), opaque to torch.compile and visible to selective checkpointing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._shapes import LEAD_DIMS, reduce_to
from .backend import direct_call, op_name, select_path, triton_installed

__all__ = ["MAX_TRITON_K", "softmax", "softmax_reference"]

MAX_TRITON_K = 16384
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _safe_softmax(s: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim where a row of all -inf gives zeros instead of NaN."""
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    return e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(s.dtype).tiny)


def softmax_reference(
    x: torch.Tensor, mask: torch.Tensor | None = None, bias: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    """Plain PyTorch masked, biased softmax over the last dim, in the dtype of `x`.

    x: [*, K]; bias: broadcastable to x (float); mask: broadcastable to x (bool, True = keep).
    Returns the broadcast shape (that of x when bias and mask broadcast to it).
    """
    s = x * scale
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return _safe_softmax(s)


def _fits(s: torch.Tensor, other: torch.Tensor) -> bool:
    return torch.broadcast_shapes(s.shape, other.shape) == s.shape


def _ds(p: torch.Tensor, dp: torch.Tensor) -> torch.Tensor:
    return p * (dp - (p * dp).sum(-1, keepdim=True))


def _cpu_dtype(x: torch.Tensor, bias: torch.Tensor | None) -> torch.dtype:
    """dtype of the PyTorch path's probabilities: fp32 (fp64 for fp64 x), promoted by a bias that widens x."""
    compute = torch.promote_types(x.dtype, torch.float32)
    if bias is not None and not _fits(x, bias):
        compute = torch.promote_types(compute, bias.dtype)
    return compute


def _cpu_fwd(x, mask, bias, scale):
    """The PyTorch path: in-place fp32 scores, fused `torch.softmax`; returns p in `_cpu_dtype`."""
    compute = torch.promote_types(x.dtype, torch.float32)
    s = torch.mul(x.to(compute), scale)
    # in place where the other operand broadcasts into the scores, out of place where it widens them
    if bias is not None:
        s = s.add_(bias) if _fits(s, bias) else s + bias
    if mask is not None:
        s = s.masked_fill_(~mask, float("-inf")) if _fits(s, mask) else s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    del s
    if mask is not None:
        p.masked_fill_(~mask.any(-1, keepdim=True), 0.0)
    return p.contiguous()  # a permuted x gives permuted scores; the op's fake promises a contiguous result


def _meta(x: torch.Tensor, bias: torch.Tensor | None, scale: float) -> tuple:
    return x.shape, x.dtype, None if bias is None else bias.shape, None if bias is None else bias.dtype, scale


def _grads(ctx, ds: torch.Tensor) -> tuple:
    """Gradients for (x, mask, bias, scale) from ds = d loss / d (x * scale + bias), fp32, full shape."""
    x_shape, x_dtype, bias_shape, bias_dtype, scale = ctx.meta
    dx = dbias = None
    if ctx.needs_input_grad[0]:
        dx = reduce_to(ds * scale, x_shape).to(x_dtype)
    if bias_shape is not None and ctx.needs_input_grad[2]:
        dbias = reduce_to(ds, bias_shape).to(bias_dtype)
    return dx, None, dbias, None


def _triton():
    """The Triton kernels (kernels/_triton_softmax.py), imported on first use."""
    from . import _triton_softmax

    return _triton_softmax


# ----------------------------------------------------------------------------------------------------------
# Custom ops `torch.ops.<ns>.softmax_fwd/_bwd`: opaque to torch.compile, visible to selective checkpointing.
# `backend` "triton": p in x's dtype, ds fp32; "cpu": both in `_cpu_dtype` (the backward needs p unrounded).


def _check_op_backend(backend: str) -> None:
    if backend not in ("triton", "cpu"):
        raise ValueError(f"softmax op: backend must be 'triton' or 'cpu', got {backend!r}")


def _softmax_fwd_impl(x: Tensor, mask: Tensor | None, bias: Tensor | None, scale: float, backend: str) -> Tensor:
    _check_op_backend(backend)
    return _triton()._triton_fwd(x, mask, bias, scale) if backend == "triton" else _cpu_fwd(x, mask, bias, scale)


@torch.library.custom_op(op_name("softmax_fwd"), mutates_args=())
def _softmax_fwd(x: Tensor, mask: Tensor | None, bias: Tensor | None, scale: float, backend: str) -> Tensor:
    return _softmax_fwd_impl(x, mask, bias, scale, backend)


@_softmax_fwd.register_fake
def _(x, mask, bias, scale, backend):
    _check_op_backend(backend)
    full = torch.broadcast_shapes(*[t.shape for t in (x, mask, bias) if t is not None])
    return x.new_empty(full, dtype=x.dtype if backend == "triton" else _cpu_dtype(x, bias))


@torch.library.custom_op(op_name("softmax_bwd"), mutates_args=())
def _softmax_bwd(p: Tensor, dp: Tensor, backend: str) -> Tensor:
    """ds = d loss / d (x * scale + bias) from the probabilities p and their gradient dp."""
    _check_op_backend(backend)
    return _triton()._triton_bwd(p, dp) if backend == "triton" else _ds(p, dp.to(p.dtype)).contiguous()


@_softmax_bwd.register_fake
def _(p, dp, backend):
    _check_op_backend(backend)
    return p.new_empty(p.shape, dtype=torch.float32 if backend == "triton" else p.dtype)


def _softmax_setup_context(ctx, inputs, output):
    x, mask, bias, scale, backend = inputs
    ctx.save_for_backward(output)
    ctx.meta = _meta(x, bias, scale)
    ctx.backend = backend


def _softmax_backward(ctx, dp):
    (p,) = ctx.saved_tensors
    return (*_grads(ctx, _softmax_bwd(p, dp, ctx.backend)), None)


_softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup_context)


def _triton_unsupported(x: torch.Tensor, mask: torch.Tensor | None, bias: torch.Tensor | None) -> str | None:
    if not triton_installed():
        return "triton is not installed"
    if x.dtype not in _TRITON_DTYPES:
        return f"dtype {x.dtype} is not supported by the Triton kernel"
    full = torch.broadcast_shapes(*[t.shape for t in (x, mask, bias) if t is not None])
    if full[-1] > MAX_TRITON_K:
        return f"rows longer than {MAX_TRITON_K} are not supported by the Triton kernel"
    if len(full) - 1 > LEAD_DIMS:
        return f"more than {LEAD_DIMS} leading dims are not supported by the Triton kernel"
    return None


def softmax(
    x: torch.Tensor, mask: torch.Tensor | None = None, bias: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    """Softmax over the last dim of `x * scale + bias`, positions where `mask` is False excluded.

    x: [*, K] (e.g. [B, S, H, Q, K]); bias: float, broadcastable to x (e.g. [B, 1, H, Q, K]);
    mask: bool, broadcastable to x (e.g. [B, S, 1, 1, K]), True = keep. Returns x's shape (the broadcast
    shape) in x's dtype; a fully masked row is all zeros. Differentiable in x and bias.
    """
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"softmax: mask must be a bool tensor (True = keep), got {mask.dtype}")
    if bias is not None:
        bias = bias.to(x.dtype) if not bias.is_floating_point() else bias
    path = select_path("softmax", x.device, _triton_unsupported(x, mask, bias))
    if path == "torch":
        return softmax_reference(x, mask, bias, scale)
    fwd = _softmax_fwd_impl if direct_call(x, bias) else _softmax_fwd
    return fwd(x, mask, bias, float(scale), path).to(x.dtype)
