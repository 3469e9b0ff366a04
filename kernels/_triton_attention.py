"""The Triton kernels of `kernels.attention` and their launchers, imported on the first Triton call only:
importing Triton costs ~90 MiB of resident memory and is not needed on the PyTorch paths."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._shapes import lead_sizes, lead_strides


@triton.jit
def _lead_offset(z, L1, L2, L3, s0, s1, s2, s3):
    # flat batch-head index -> four leading indices -> offset through (possibly zero) strides
    i3 = z % L3
    t = z // L3
    i2 = t % L2
    t = t // L2
    i1 = t % L1
    i0 = t // L1
    return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3

@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # DISCREPANCY: Triton 3.9's interpreter multiplies bf16 tiles wrongly (garbage of order 1e10), so on
    # CPU tensors the tiles are widened to fp32 first; on CUDA the half-precision tensor-core dot is used.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)

@triton.jit
def _biased_scores(
    q, k, rows, cols, b_base, m_base, NQ, NK, scale,
    sbq, sbk, smq, smk,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # [BLOCK_M, BLOCK_N] fp32 scores q k^T * scale + bias, -inf where masked or past the key length
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale
    inside = (rows < NQ)[:, None] & (cols < NK)[None, :]
    keep = inside
    if HAS_BIAS:
        s += tl.load(b_base + rows[:, None] * sbq + cols[None, :] * sbk, mask=inside, other=0.0).to(tl.float32)
    if HAS_MASK:
        keep = keep & (tl.load(m_base + rows[:, None] * smq + cols[None, :] * smk, mask=inside, other=0) != 0)
    return tl.where(keep, s, float("-inf"))

@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Bias, Mask, Out, Lse,  # q/k/v/out contiguous [Z, N*, D]; Lse fp32 [Z, NQ]
    L1, L2, L3, NQ, NK, D, scale,
    sb0, sb1, sb2, sb3, sbq, sbk,  # bias strides, zero where it broadcasts
    sm0, sm1, sm2, sm3, smq, smk,  # mask strides (uint8 view of the bool mask)
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    z = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = (dims < D)[None, :]
    # the query block stays in registers for the whole sweep over keys
    q = tl.load(Q + z * NQ * D + rows[:, None] * D + dims[None, :], mask=(rows < NQ)[:, None] & dim_ok, other=0.0)
    b_base = Bias + _lead_offset(z, L1, L2, L3, sb0, sb1, sb2, sb3)
    m_base = Mask + _lead_offset(z, L1, L2, L3, sm0, sm1, sm2, sm3)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, NK, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kv_ok = (cols < NK)[:, None] & dim_ok
        k = tl.load(K + z * NK * D + cols[:, None] * D + dims[None, :], mask=kv_ok, other=0.0)
        v = tl.load(V + z * NK * D + cols[:, None] * D + dims[None, :], mask=kv_ok, other=0.0)
        s = _biased_scores(q, k, rows, cols, b_base, m_base, NQ, NK, scale, sbq, sbk, smq, smk,
                           HAS_BIAS, HAS_MASK, PRECISION, UPCAST)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows with nothing kept so far subtract 0: exp(-inf) = 0 instead of exp(nan)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(Out + z * NQ * D + rows[:, None] * D + dims[None, :], out.to(Out.dtype.element_ty),
             mask=(rows < NQ)[:, None] & dim_ok)
    tl.store(Lse + z * NQ + rows, lse, mask=rows < NQ)

@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, Bias, Mask, DO, Lse, Delta, DK, DV,
    L1, L2, L3, NQ, NK, D, scale,
    sb0, sb1, sb2, sb3, sbq, sbk,
    sm0, sm1, sm2, sm3, smq, smk,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    z = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = (dims < D)[None, :]
    kv_ok = (cols < NK)[:, None] & dim_ok
    k = tl.load(K + z * NK * D + cols[:, None] * D + dims[None, :], mask=kv_ok, other=0.0)
    v = tl.load(V + z * NK * D + cols[:, None] * D + dims[None, :], mask=kv_ok, other=0.0)
    b_base = Bias + _lead_offset(z, L1, L2, L3, sb0, sb1, sb2, sb3)
    m_base = Mask + _lead_offset(z, L1, L2, L3, sm0, sm1, sm2, sm3)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start in range(0, NQ, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        q_ok = (rows < NQ)[:, None] & dim_ok
        q = tl.load(Q + z * NQ * D + rows[:, None] * D + dims[None, :], mask=q_ok, other=0.0)
        do = tl.load(DO + z * NQ * D + rows[:, None] * D + dims[None, :], mask=q_ok, other=0.0)
        lse = tl.load(Lse + z * NQ + rows, mask=rows < NQ, other=float("inf"))
        delta = tl.load(Delta + z * NQ + rows, mask=rows < NQ, other=0.0)
        s = _biased_scores(q, k, rows, cols, b_base, m_base, NQ, NK, scale, sbq, sbk, smq, smk,
                           HAS_BIAS, HAS_MASK, PRECISION, UPCAST)
        p = tl.exp(s - lse[:, None])  # 0 where masked (s = -inf) or the row is empty (lse = +inf)
        dv += _dot(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
        dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
    tl.store(DK + z * NK * D + cols[:, None] * D + dims[None, :], (dk * scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + z * NK * D + cols[:, None] * D + dims[None, :], dv.to(DV.dtype.element_ty), mask=kv_ok)

@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, Bias, Mask, DO, Lse, Delta, DQ, DBias,
    L1, L2, L3, NQ, NK, D, scale,
    sb0, sb1, sb2, sb3, sbq, sbk,
    sm0, sm1, sm2, sm3, smq, smk,
    sg0, sg1, sg2, sg3, sgq, sgk,  # strides of the fp32 bias-gradient buffer, zero where bias broadcasts
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BIAS_GRAD: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BIAS_Q1: tl.constexpr, BIAS_K1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    z = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = (dims < D)[None, :]
    q_ok = (rows < NQ)[:, None] & dim_ok
    q = tl.load(Q + z * NQ * D + rows[:, None] * D + dims[None, :], mask=q_ok, other=0.0)
    do = tl.load(DO + z * NQ * D + rows[:, None] * D + dims[None, :], mask=q_ok, other=0.0)
    lse = tl.load(Lse + z * NQ + rows, mask=rows < NQ, other=float("inf"))
    delta = tl.load(Delta + z * NQ + rows, mask=rows < NQ, other=0.0)
    b_base = Bias + _lead_offset(z, L1, L2, L3, sb0, sb1, sb2, sb3)
    m_base = Mask + _lead_offset(z, L1, L2, L3, sm0, sm1, sm2, sm3)
    g_base = DBias + _lead_offset(z, L1, L2, L3, sg0, sg1, sg2, sg3)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, NK, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kv_ok = (cols < NK)[:, None] & dim_ok
        k = tl.load(K + z * NK * D + cols[:, None] * D + dims[None, :], mask=kv_ok, other=0.0)
        v = tl.load(V + z * NK * D + cols[:, None] * D + dims[None, :], mask=kv_ok, other=0.0)
        s = _biased_scores(q, k, rows, cols, b_base, m_base, NQ, NK, scale, sbq, sbk, smq, smk,
                           HAS_BIAS, HAS_MASK, PRECISION, UPCAST)
        p = tl.exp(s - lse[:, None])
        dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST)
        if BIAS_GRAD:
            # reduce over the dims the bias broadcasts along inside the tile; atomics do the rest
            if BIAS_Q1 and BIAS_K1:
                tl.atomic_add(g_base, tl.sum(tl.sum(ds, axis=1), axis=0))
            elif BIAS_Q1:
                tl.atomic_add(g_base + cols * sgk, tl.sum(ds, axis=0), mask=cols < NK)
            elif BIAS_K1:
                tl.atomic_add(g_base + rows * sgq, tl.sum(ds, axis=1), mask=rows < NQ)
            else:
                inside = (rows < NQ)[:, None] & (cols < NK)[None, :]
                tl.atomic_add(g_base + rows[:, None] * sgq + cols[None, :] * sgk, ds, mask=inside)
    tl.store(DQ + z * NQ * D + rows[:, None] * D + dims[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=q_ok)


def _launch_config(q: torch.Tensor, d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps); tl.dot needs every block dim >= 16."""
    block_d = max(16, triton.next_power_of_2(d))
    if not q.is_cuda:
        return 64, 64, block_d, 4  # the interpreter: larger tiles mean fewer (slow) Python-level steps
    if block_d >= 128:
        return 64, 32, block_d, 4
    return 64, 64, block_d, 4


def _common_args(q, n_k, scale, bias, mask):
    """Leading sizes and the bias/mask strides shared by the three kernels."""
    lead = tuple(q.shape[:-2])
    n_q = q.shape[-2]
    full = lead + (n_q, n_k)
    _, l1, l2, l3 = lead_sizes(lead)
    return (l1, l2, l3, n_q, n_k, q.shape[-1], float(scale),
            *lead_strides(bias, full, len(lead)), *lead_strides(mask, full, len(lead)))


def _triton_fwd(q, k, v, bias, mask, scale):
    """(out in q's dtype, fp32 row log-sum-exp); bias and mask already have q's number of dims."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    mask_u8 = None if mask is None else mask.view(torch.uint8)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    bm, bn, bd, warps = _launch_config(q, q.shape[-1])
    z = math.prod(q.shape[:-2])
    if z > 0 and q.shape[-2] > 0:
        _attn_fwd_kernel[(z, triton.cdiv(q.shape[-2], bm))](
            q, k, v, _or(bias, q), _or(mask_u8, q), out, lse, *_common_args(q, k.shape[-2], scale, bias, mask),
            **_flags(q, bias, mask), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps,
        )
    return out, lse


def _triton_bwd(dout, q, k, v, bias, mask, out, lse, scale, want_bias):
    """(dq, dk, dv, dbias or None): the dk/dv kernel per key block, the dq (and bias) kernel per query block."""
    q, k, v, out = q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous()
    mask_u8 = None if mask is None else mask.view(torch.uint8)
    n_k = k.shape[-2]
    do = dout.contiguous()
    delta = (do.float() * out.float()).sum(-1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dbias = torch.zeros(bias.shape, device=q.device, dtype=torch.float32) if want_bias else None
    bm, bn, bd, warps = _launch_config(q, q.shape[-1])
    z = math.prod(q.shape[:-2])
    common = _common_args(q, n_k, scale, bias, mask_u8)
    flags = _flags(q, bias, mask_u8)
    tensors = (q, k, v, _or(bias, q), _or(mask_u8, q), do, lse.contiguous(), delta)
    if z > 0 and q.shape[-2] > 0 and n_k > 0:
        _attn_bwd_dkdv_kernel[(z, triton.cdiv(n_k, bn))](
            *tensors, dk, dv, *common, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps)
        full = tuple(q.shape[:-1]) + (n_k,)
        g_strides = lead_strides(dbias, full, q.dim() - 2)
        _attn_bwd_dq_kernel[(z, triton.cdiv(q.shape[-2], bm))](
            *tensors, dq, _or(dbias, lse), *common, *g_strides, **flags, BIAS_GRAD=want_bias,
            BIAS_Q1=want_bias and bias.shape[-2] == 1, BIAS_K1=want_bias and bias.shape[-1] == 1,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps)
    else:
        dq.zero_(), dk.zero_(), dv.zero_()
    return dq, dk, dv, None if dbias is None else dbias.to(bias.dtype)


def _or(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    # Triton wants a pointer even for an argument a constexpr flag switches off
    return placeholder if t is None else t


def _flags(q: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None) -> dict:
    # fp32 inputs must not silently drop to tf32 in tl.dot; half inputs ignore the setting
    return dict(HAS_BIAS=bias is not None, HAS_MASK=mask is not None,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=not q.is_cuda)
