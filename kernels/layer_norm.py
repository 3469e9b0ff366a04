"""LayerNorm over the last dim: Triton kernels (forward and backward), a PyTorch reference and the entry point.

Design follows the Triton layer-norm tutorial (`05-layer-norm.py`) in the form flash-attention's
`ops/triton/layer_norm.py` gives it: one program per row in the forward pass; in the backward pass each
program walks a contiguous band of rows and keeps its partial weight/bias gradients in registers, so the
partials buffer is [n_programs, N] and one small torch sum finishes them. Statistics are fp32 whatever the
input dtype. Rows of up to `MAX_TRITON_N` elements fit one block; longer rows use the PyTorch path.
The Triton forward and backward are the custom ops `torch.ops.<ns>.layer_norm_fwd/layer_norm_bwd`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .backend import op_name, select_path

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - Triton missing or broken: the PyTorch paths still work
    triton = None

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


if triton is not None:

    @triton.jit
    def _ln_fwd_kernel(
        X,  # input rows, [M, N] contiguous
        Y,  # output rows, [M, N]
        W,  # weight [N] (unused without HAS_W)
        B,  # bias [N] (unused without HAS_B)
        Mean,  # fp32 [M], saved for backward
        Rstd,  # fp32 [M], 1 / sqrt(var + eps)
        N,  # row length
        eps,
        HAS_W: tl.constexpr,
        HAS_B: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        valid = cols < N
        x = tl.load(X + row * N + cols, mask=valid, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / N
        # centred values are zeroed past N so the padding does not enter the variance
        xc = tl.where(valid, x - mean, 0.0)
        var = tl.sum(xc * xc, axis=0) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        y = xc * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=valid, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=valid, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=valid)
        tl.store(Mean + row, mean)
        tl.store(Rstd + row, rstd)

    @triton.jit
    def _ln_bwd_kernel(
        X,  # input rows, [M, N]
        DY,  # output gradient, [M, N]
        DX,  # input gradient, [M, N]
        W,  # weight [N]
        Mean,  # fp32 [M]
        Rstd,  # fp32 [M]
        DW,  # fp32 partial weight gradients, [n_programs, N]
        DB,  # fp32 partial bias gradients, [n_programs, N]
        M,  # number of rows
        N,  # row length
        rows_per_program,
        HAS_W: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        valid = cols < N
        if HAS_W:
            w = tl.load(W + cols, mask=valid, other=0.0).to(tl.float32)
        else:
            w = tl.where(valid, 1.0, 0.0)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        start = pid * rows_per_program
        end = tl.minimum(start + rows_per_program, M)
        # int64 row offsets: M * N may pass 2**31; the pointers advance one row per iteration
        off = start.to(tl.int64) * N
        for row in range(start, end):
            x = tl.load(X + off + cols, mask=valid, other=0.0).to(tl.float32)
            dy = tl.load(DY + off + cols, mask=valid, other=0.0).to(tl.float32)
            rstd = tl.load(Rstd + row)
            xhat = tl.where(valid, (x - tl.load(Mean + row)) * rstd, 0.0)
            wdy = w * dy
            dw += dy * xhat
            db += dy
            # d xhat / d x projects out the mean and the xhat direction
            c1 = tl.sum(xhat * wdy, axis=0) / N
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
            tl.store(DX + off + cols, dx.to(DX.dtype.element_ty), mask=valid)
            off += N
        tl.store(DW + pid * N + cols, dw, mask=valid)
        tl.store(DB + pid * N + cols, db, mask=valid)


def _num_warps(block: int) -> int:
    # one warp per 256 elements of the row, between 1 and 8: enough loads in flight without idle lanes
    return min(max(block // 256, 1), 8)


def _num_programs(x: torch.Tensor, rows: int) -> int:
    if x.is_cuda:
        return min(rows, torch.cuda.get_device_properties(x.device).multi_processor_count * 4)
    return min(rows, 4)  # the interpreter: few programs, each a band of rows


def _triton_fwd(x, weight, bias, eps):
    """(y, mean, rstd): y in x's shape and dtype, the fp32 row statistics in x's leading shape."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    m = x2.shape[0]
    y = torch.empty_like(x2)
    mean = torch.empty(m, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    block = triton.next_power_of_2(n)
    if m > 0:
        _ln_fwd_kernel[(m,)](x2, y, weight, bias, mean, rstd, n, eps, HAS_W=weight is not None,
                             HAS_B=bias is not None, BLOCK_N=block, num_warps=_num_warps(block))
    lead = x.shape[:-1]
    return y.reshape(x.shape), mean.reshape(lead), rstd.reshape(lead)


def _triton_bwd(dy, x, weight, mean, rstd):
    """(dx, dweight, dbias): dx in x's shape and dtype, the parameter gradients fp32 [N] (summed partials)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    m = x2.shape[0]
    dy2 = dy.reshape(m, n).contiguous()
    dx = torch.empty_like(x2)
    programs = max(_num_programs(x2, m), 1)
    dw = torch.zeros(programs, n, device=x2.device, dtype=torch.float32)
    db = torch.zeros_like(dw)
    block = triton.next_power_of_2(n)
    if m > 0:
        _ln_bwd_kernel[(programs,)](x2, dy2, dx, weight, mean.contiguous(), rstd.contiguous(), dw, db, m, n,
                                    math.ceil(m / programs), HAS_W=weight is not None, BLOCK_N=block,
                                    num_warps=_num_warps(block))
    return dx.reshape(x.shape), dw.sum(0), db.sum(0)


# ----------------------------------------------------------------------------------------------------------
# Custom ops `torch.ops.<ns>.layer_norm_fwd/_bwd` around the Triton kernels: opaque to torch.compile, visible
# to selective checkpointing. The PyTorch path is `F.layer_norm` itself, which both already see.


@torch.library.custom_op(op_name("layer_norm_fwd"), mutates_args=())
def _layer_norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _triton_fwd(x, weight, bias, eps)


@_layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    lead = x.shape[:-1]
    return x.new_empty(x.shape), x.new_empty(lead, dtype=torch.float32), x.new_empty(lead, dtype=torch.float32)


@torch.library.custom_op(op_name("layer_norm_bwd"), mutates_args=())
def _layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return _triton_bwd(dy, x, weight, mean, rstd)


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
    if triton is None:
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
