"""The Triton kernels of `kernels.softmax` and their launchers, imported on the first Triton call only:
importing Triton costs ~90 MiB of resident memory and is not needed on the PyTorch paths."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._shapes import lead_sizes, lead_strides


@triton.jit
def _row_offset(row, L1, L2, L3, s0, s1, s2, s3):
    # flat row index -> four leading indices -> element offset through (possibly zero) strides
    i3 = row % L3
    t = row // L3
    i2 = t % L2
    t = t // L2
    i1 = t % L1
    i0 = t // L1
    return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3

@triton.jit
def _softmax_fwd_kernel(
    X, Bias, Mask, Y,  # Y is contiguous [rows, K]; the others are read through their strides
    L1, L2, L3, K, scale,
    sx0, sx1, sx2, sx3, sxk,
    sb0, sb1, sb2, sb3, sbk,
    sm0, sm1, sm2, sm3, smk,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    keep = cols < K
    x = tl.load(X + _row_offset(row, L1, L2, L3, sx0, sx1, sx2, sx3) + cols * sxk, mask=keep, other=0.0)
    s = x.to(tl.float32) * scale
    if HAS_BIAS:
        b_ptr = Bias + _row_offset(row, L1, L2, L3, sb0, sb1, sb2, sb3) + cols * sbk
        s += tl.load(b_ptr, mask=keep, other=0.0).to(tl.float32)
    if HAS_MASK:
        m_ptr = Mask + _row_offset(row, L1, L2, L3, sm0, sm1, sm2, sm3) + cols * smk
        keep = keep & (tl.load(m_ptr, mask=keep, other=0) != 0)
    s = tl.where(keep, s, float("-inf"))
    m = tl.max(s, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # fully masked row: exp(-inf - 0) = 0 everywhere
    e = tl.exp(s - m)
    total = tl.sum(e, axis=0)
    y = e / tl.where(total == 0.0, 1.0, total)
    tl.store(Y + row * K + cols, y.to(Y.dtype.element_ty), mask=cols < K)

@triton.jit
def _softmax_bwd_kernel(P, DY, DS, K, BLOCK_K: tl.constexpr):
    # all three contiguous [rows, K]; DS is fp32
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    valid = cols < K
    p = tl.load(P + row * K + cols, mask=valid, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * K + cols, mask=valid, other=0.0).to(tl.float32)
    ds = p * (dy - tl.sum(p * dy, axis=0))
    tl.store(DS + row * K + cols, ds, mask=valid)


def _softmax_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def _triton_fwd(x, mask, bias, scale):
    shapes = [x.shape] + [t.shape for t in (mask, bias) if t is not None]
    full = tuple(torch.broadcast_shapes(*shapes))
    n_lead = len(full) - 1
    k = full[-1]
    y = torch.empty(full, device=x.device, dtype=x.dtype)
    rows = y.numel() // max(k, 1)
    mask_u8 = None if mask is None else mask.view(torch.uint8)
    block = triton.next_power_of_2(k)
    _, l1, l2, l3 = lead_sizes(full[:-1])
    if rows > 0 and k > 0:
        _softmax_fwd_kernel[(rows,)](
            x, bias if bias is not None else x, mask_u8 if mask_u8 is not None else x, y,
            l1, l2, l3, k, float(scale),
            *lead_strides(x, full, n_lead), *lead_strides(bias, full, n_lead), *lead_strides(mask, full, n_lead),
            HAS_BIAS=bias is not None, HAS_MASK=mask is not None, BLOCK_K=block, num_warps=_softmax_warps(block),
        )
    return y


def _triton_bwd(y, dy):
    y = y.contiguous()
    k = y.shape[-1]
    ds = torch.empty(y.shape, device=y.device, dtype=torch.float32)
    rows = y.numel() // max(k, 1)
    if rows > 0 and k > 0:
        block = triton.next_power_of_2(k)
        _softmax_bwd_kernel[(rows,)](y, dy.contiguous(), ds, k, BLOCK_K=block, num_warps=_softmax_warps(block))
    return ds
