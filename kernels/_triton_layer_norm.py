"""The Triton kernels of `kernels.layer_norm` and their launchers, imported on the first Triton call only:
importing Triton costs ~90 MiB of resident memory and is not needed on the PyTorch paths."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


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
