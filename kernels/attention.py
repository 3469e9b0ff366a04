"""Attention with an additive (differentiable, broadcast) bias and a keep-mask: Triton, chunked PyTorch, reference.

`attention(q, k, v, bias, mask, scale)` = `softmax(q @ k^T * scale + bias, masked) @ v` over the last dim.

- Triton: a flash-attention forward (online softmax over key blocks, the row log-sum-exp saved) and a
  backward in two kernels, one per key block for dk/dv and one per query block for dq, recomputing the
  probabilities from the saved log-sum-exp (FlashAttention-2, Dao 2023; the Triton tutorial
  `06-fused-attention.py`). The bias gradient is accumulated by the dq kernel with fp32 atomics into a
  buffer of the bias's own (broadcast) shape, so no `[*, H, Q, K]` tensor ever exists.
- PyTorch path (any device, the default on CPU): `F.scaled_dot_product_attention` when there is neither bias
  nor mask. Without gradients: on CPU in fp32/fp64, matmul-softmax-matmul over blocks of about 4 MiB of scores
  (faster than SDPA with a float attn_mask at the small per-row problems of chunked inference); otherwise SDPA
  when bias and mask fold into one attn_mask no wider than the bias (PyTorch's fused kernel then tiles the keys
  itself). Everything else: a loop over query blocks, holding scores for `block_q` rows at a time (memory grows
  with block_q x K), that saves only the output and the row log-sum-exp and recomputes each block in the
  backward.
- `attention_reference`: the plain formula, materialising everything.

The Triton kernels and the block loop are the custom ops `torch.ops.<ns>.attention_fwd/attention_bwd`
(torch.library, `ns` = `backend.OP_NAMESPACE`) with fake implementations, so torch.compile traces through
them without graph breaks and selective activation checkpointing can name them. Eager calls that need no
gradient run the implementations directly (`backend.direct_call`), and the Triton kernels live in
`_triton_attention.py`, imported on the first Triton call: CPU inference imports neither Dynamo nor Triton.

Fully masked query rows give zeros (and zero gradients), never NaN: their log-sum-exp is stored as +inf.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._shapes import LEAD_DIMS, reduce_to
from .backend import direct_call, op_name, select_path, triton_installed
from .softmax import softmax_reference

__all__ = ["MAX_HEAD_DIM", "attention", "attention_reference"]

MAX_HEAD_DIM = 128
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# scores held per block by the chunked path; 16 MiB keeps Q = K = 4096, H = 8 at 1/32 of the full matrix
_CHUNK_BYTES = 16 * 2**20


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain PyTorch attention in the dtype of q (materialises the [*, H, Q, K] scores).

    q: [*, H, Q, D]; k, v: [*, H, K, D]; bias: float, broadcastable to [*, H, Q, K]; mask: bool, likewise,
    True = keep. Returns [*, H, Q, D].
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2))
    return torch.matmul(softmax_reference(s, mask, bias, scale), v)


# ----------------------------------------------------------------------------------------------------------
# PyTorch path: query blocks, online bookkeeping of the row log-sum-exp, recomputation in the backward.


def _align(t: torch.Tensor | None, nd: int) -> torch.Tensor | None:
    """View `t` with leading size-1 dims so it has `nd` dims (no copy)."""
    if t is None or t.dim() == nd:
        return t
    return t.reshape((1,) * (nd - t.dim()) + tuple(t.shape))


def _rows(t: torch.Tensor | None, qs: int, qe: int) -> torch.Tensor | None:
    """Query rows qs:qe of a bias/mask (unchanged when it broadcasts over the query dim)."""
    if t is None or t.shape[-2] == 1:
        return t
    return t[..., qs:qe, :]


def _block_scores(qc, kt, bias, mask, qs, qe):
    """Scores of query rows qs:qe, [*, H, qc, K]: (q * scale) @ k^T, + bias, -inf where masked, in place.

    Where the mask broadcasts into the bias block, it is folded into a -inf bias first: one pass over the
    scores fewer.
    """
    b, m = _rows(bias, qs, qe), _rows(mask, qs, qe)
    if b is not None and m is not None and torch.broadcast_shapes(b.shape, m.shape) == b.shape:
        b, m = b.masked_fill(~m, float("-inf")), None
    s = torch.matmul(qc, kt)
    if b is not None:
        s.add_(b)
    if m is not None:
        s.masked_fill_(~m, float("-inf"))
    return s


def _block_q(q: torch.Tensor, n_k: int, block_q: int | None) -> int:
    if block_q is not None:
        return max(1, block_q)
    per_row = max(1, math.prod(q.shape[:-2]) * n_k * 4)
    return int(max(1, min(q.shape[-2], max(16, _CHUNK_BYTES // per_row))))


def _chunked_fwd(q, k, v, bias, mask, scale, block):
    """(out, row log-sum-exp), both in the compute dtype (fp32, or fp64 for fp64 inputs)."""
    compute = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = q.to(compute), k.to(compute), v.to(compute)
    kt = kf.transpose(-1, -2)
    n_q = q.shape[-2]
    out = torch.empty(*torch.broadcast_shapes(q.shape[:-1], v.shape[:-2] + (1,)), v.shape[-1], dtype=compute,
                      device=q.device)
    lse = torch.empty(out.shape[:-1], dtype=compute, device=q.device)
    for qs in range(0, n_q, block):
        qe = min(qs + block, n_q)
        s = _block_scores(qf[..., qs:qe, :] * scale, kt, bias, mask, qs, qe)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = s.sub_(m).exp_()
        total = p.sum(-1, keepdim=True)
        out[..., qs:qe, :] = torch.matmul(p, vf).div_(total.clamp_min(torch.finfo(compute).tiny))
        # +inf for an empty row makes exp(s - lse) = 0 there in the backward
        lse[..., qs:qe] = torch.where(total > 0, m + total.log(), math.inf).squeeze(-1)
    return out, lse


def _chunked_bwd(dout, q, k, v, bias, mask, out, lse, scale, block, want_bias):
    """(dq, dk, dv, dbias or None) in the inputs' dtypes, recomputing each query block's probabilities."""
    compute = out.dtype
    qf, kf, vf = q.to(compute), k.to(compute), v.to(compute)
    do = dout.to(compute)
    delta = (do * out).sum(-1)
    # contiguous whatever q's layout: the op's fake promises contiguous gradients
    dq = torch.empty(qf.shape, dtype=compute, device=q.device)
    dk_full = dv_full = None
    dbias = torch.zeros(bias.shape, dtype=compute, device=q.device) if want_bias else None
    kt = kf.transpose(-1, -2)
    for qs in range(0, q.shape[-2], block):
        qe = min(qs + block, q.shape[-2])
        qc, doc = qf[..., qs:qe, :] * scale, do[..., qs:qe, :]
        p = _block_scores(qc, kt, bias, mask, qs, qe).sub_(lse[..., qs:qe, None]).exp_()
        dv_c = torch.matmul(p.transpose(-1, -2), doc)
        ds = torch.matmul(doc, vf.transpose(-1, -2)).sub_(delta[..., qs:qe, None]).mul_(p)
        del p
        dq[..., qs:qe, :] = torch.matmul(ds, kf).mul_(scale)
        dk_c = torch.matmul(ds.transpose(-1, -2), qc)
        dk_full = dk_c if dk_full is None else dk_full.add_(dk_c)
        dv_full = dv_c if dv_full is None else dv_full.add_(dv_c)
        if want_bias:
            if bias.shape[-2] == 1:
                dbias += reduce_to(ds, bias.shape)
            else:
                dbias[..., qs:qe, :] = reduce_to(ds, bias.shape[:-2] + (qe - qs, bias.shape[-1]))
    if dk_full is None:  # no query rows
        dk_full = torch.zeros(kf.shape, dtype=compute, device=q.device)
        dv_full = torch.zeros(vf.shape, dtype=compute, device=q.device)
    dk = reduce_to(dk_full, k.shape).to(k.dtype)
    dv = reduce_to(dv_full, v.shape).to(v.dtype)
    return dq.to(q.dtype), dk.contiguous(), dv.contiguous(), None if dbias is None else dbias.to(bias.dtype)


def _sdpa_mask(q, bias, mask):
    """bias and mask as one SDPA attn_mask in 4-D, or None where that would widen the bias or copy it."""
    nd = q.dim()
    bias, mask = _align(bias, nd), _align(mask, nd)
    if bias is None:
        attn = mask
    elif mask is None:
        attn = bias.to(q.dtype)
    elif torch.broadcast_shapes(bias.shape, mask.shape) == bias.shape:
        attn = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
    else:
        return None
    lead = attn.shape[:-3]
    if all(n == 1 for n in lead):
        return attn.reshape(1, *attn.shape[-3:])
    if lead == q.shape[:-3] and attn.is_contiguous():
        return attn.reshape(-1, *attn.shape[-3:])
    return None


def _sdpa_sliced(q, k, v, bias, mask, scale):
    """SDPA over slices of q's leading dims, bias and mask folded into one float attn_mask per slice.

    For a bias and a mask that broadcast against each other (a pair bias `[1, H, Q, K]` and a per-row mask
    `[B, 1, 1, K]`): each slice's combined mask `[b, H, Q, K]` is about `_CHUNK_BYTES`, the scores block
    the query-block loop would hold, so memory stays as bounded while the attention runs fused.
    """
    nd = q.dim()
    lead, (heads, n_q, n_k) = q.shape[:-3], (q.shape[-3], q.shape[-2], k.shape[-2])
    full = lead + (heads, n_q, n_k)
    bias_f = _align(bias, nd).expand(full)
    keep_f = _align(mask, nd).expand(full)
    out = q.new_empty(lead + (heads, n_q, v.shape[-1]))
    step = max(1, _CHUNK_BYTES // max(1, heads * n_q * n_k * bias.element_size()))
    for idx in itertools.product(*(range(n) for n in lead[:-1])):
        for s0 in range(0, lead[-1], step):
            sl = (*idx, slice(s0, min(s0 + step, lead[-1])))
            keep = keep_f[sl]
            attn = bias_f[sl].to(q.dtype).masked_fill(~keep, float("-inf"))
            o = F.scaled_dot_product_attention(q[sl], k[sl], v[sl], attn_mask=attn, scale=scale)
            # rows with every key masked: zeros whatever SDPA's convention
            out[sl] = o.masked_fill_(~keep.any(-1, keepdim=True), 0.0)
    return out


# scores per block of the explicit CPU inference path: a few MiB stay in cache; larger blocks slow it down
_CPU_BLOCK_BYTES = 4 * 2**20


def _cpu_inference(q, k, v, bias, mask, scale):
    """No gradients, CPU, fp32/fp64: `softmax(q @ k^T * scale + bias, masked) @ v` block by block, each
    block's scores at most about `_CPU_BLOCK_BYTES` (whole slices of q's leading dims, or query rows of one
    slice). At the small per-row problems of chunked inference (K <= ~1024, D <= 64) PyTorch's fused CPU
    SDPA with a float attn_mask is 1.2-2x slower than this, and folding bias and mask into its attn_mask
    costs a pass of its own. None if the shapes do not suit (k/v leading dims broadcast against q's)."""
    if not _same_lead(q, k, v):
        return None
    nd = q.dim()
    lead, (heads, n_q, n_k) = q.shape[:-3], (q.shape[-3], q.shape[-2], k.shape[-2])
    full = lead + (heads, n_q, n_k)
    bias_f = None if bias is None else _align(bias, nd).to(q.dtype).expand(full)
    drop_f = add_f = empty = None
    if mask is not None:
        keep = _align(mask, nd)
        if mask.numel() * q.element_size() <= _CPU_BLOCK_BYTES:  # small: a -inf bias (an add beats masked_fill_)
            add_f = q.new_zeros(keep.shape).masked_fill_(~keep, float("-inf")).expand(full)
        else:
            drop_f = (~keep).expand(full)
        # query rows with no key left: zeros (softmax over all -inf gives NaN rows, replaced at the end)
        empty = ~keep.any(-1, keepdim=True)
        if not bool(empty.any()):
            empty = None
    out = q.new_empty(lead + (heads, n_q, v.shape[-1]))
    per_slice = heads * n_q * n_k * q.element_size()
    step = _CPU_BLOCK_BYTES // per_slice
    if step >= 1:
        q_block = n_q
    else:
        step, q_block = 1, max(1, _CPU_BLOCK_BYTES // (heads * n_k * q.element_size()))
    for idx in itertools.product(*(range(n) for n in lead[:-1])):
        for s0 in range(0, lead[-1], step):
            sl = (*idx, slice(s0, min(s0 + step, lead[-1])))
            kt, vs = k[sl].transpose(-1, -2), v[sl]
            for r0 in range(0, n_q, q_block):
                rows = (*sl, slice(None), slice(r0, min(r0 + q_block, n_q)))
                s = torch.matmul(q[rows], kt).mul_(scale)
                if bias_f is not None:
                    s.add_(bias_f[rows])
                if add_f is not None:
                    s.add_(add_f[rows])
                if drop_f is not None:
                    s.masked_fill_(drop_f[rows], float("-inf"))
                out[rows] = torch.matmul(torch.softmax(s, -1), vs)
    if empty is not None:
        out.masked_fill_(empty.expand(out.shape[:-1] + (1,)), 0.0)
    return out


def _same_lead(q, k, v) -> bool:
    """q, k and v share their leading dims (no broadcasting between them) and have at least one besides H."""
    return q.dim() >= 4 and k.shape[:-2] == q.shape[:-2] and v.shape[:-2] == q.shape[:-2]


def _sdpa_inference(q, k, v, bias, mask, scale):
    """No gradients needed: PyTorch's fused SDPA (flash on CPU) with the bias as float mask; None if unsuited."""
    if not _same_lead(q, k, v):
        return None
    attn = _sdpa_mask(q, bias, mask)
    if attn is None:
        if bias is None or mask is None:
            return None
        return _sdpa_sliced(q, k, v, bias, mask, scale)
    q4, k4, v4 = (t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=attn, scale=scale)
    out = out.reshape(*q.shape[:-1], v.shape[-1])
    if mask is not None:  # rows with every key masked: zeros whatever SDPA's convention
        out = out.masked_fill(~_align(mask, q.dim()).any(-1, keepdim=True), 0.0)
    return out


def _attention_torch_path(q, k, v, bias, mask, scale, block_q):
    if bias is None and mask is None:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias))
    if not grad and block_q is None:
        out = None
        if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64):
            out = _cpu_inference(q, k, v, bias, mask, scale)
        if out is None:
            out = _sdpa_inference(q, k, v, bias, mask, scale)
        if out is not None:
            return out
    nd = q.dim()
    bias_a, mask_a = _align(bias, nd), _align(mask, nd)
    fwd = _attention_fwd_impl if direct_call(q, k, v, bias) else _attention_fwd
    out, _ = fwd(q, k, v, bias_a, mask_a, scale, _block_q(q, k.shape[-2], block_q), "cpu")
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# Triton path.

def _triton_unsupported(q, k, v, bias, mask) -> str | None:
    if not triton_installed():
        return "triton is not installed"
    if q.dtype not in _TRITON_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype} are not supported by the Triton kernel"
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]} (v: {v.shape[-1]}) is not supported by the Triton kernel (max {MAX_HEAD_DIM})"
    if k.shape[:-2] != q.shape[:-2] or v.shape[:-1] != k.shape[:-1]:
        return "q, k and v with different leading dims are not supported by the Triton kernel"
    if q.dim() - 2 > LEAD_DIMS:
        return f"more than {LEAD_DIMS} leading dims are not supported by the Triton kernel"
    return None


def _check_shapes(q, k, v, bias, mask) -> None:
    scores = tuple(q.shape[:-1]) + (k.shape[-2],)
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    for name, t in (("bias", bias), ("mask", mask)):
        if t is None:
            continue
        # broadcasts into the scores without widening them (plain Python: torch.broadcast_shapes costs ~0.1 ms
        # a call, which adds up over the thousands of small calls of chunked inference)
        fits = t.dim() <= len(scores) and all(a in (1, b) for a, b in zip(reversed(t.shape), reversed(scores)))
        if not fits:
            raise ValueError(f"attention: {name} {tuple(t.shape)} does not broadcast to the scores {scores}")
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"attention: mask must be a bool tensor (True = keep), got {mask.dtype}")


def _triton():
    """The Triton kernels (kernels/_triton_attention.py), imported on first use."""
    from . import _triton_attention

    return _triton_attention


# ----------------------------------------------------------------------------------------------------------
# Custom ops: the Triton kernels and the chunked PyTorch path as `torch.ops.<ns>.attention_fwd/_bwd`, opaque to
# torch.compile (the fakes give the outputs' metadata) and visible by name to selective checkpointing.
# `backend` is "triton" or "cpu" (the chunked path); `out` is in q's dtype for Triton and in the compute dtype
# for "cpu", where the backward needs it unrounded. The callers cast.


def _check_op_backend(backend: str) -> None:
    if backend not in ("triton", "cpu"):
        raise ValueError(f"attention op: backend must be 'triton' or 'cpu', got {backend!r}")


@torch.library.custom_op(op_name("attention_fwd"), mutates_args=())
def _attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor | None, scale: float, block_q: int,
    backend: str,
) -> tuple[Tensor, Tensor]:
    return _attention_fwd_impl(q, k, v, bias, mask, scale, block_q, backend)


def _attention_fwd_impl(q, k, v, bias, mask, scale, block_q, backend):
    _check_op_backend(backend)
    if backend == "triton":
        return _triton()._triton_fwd(q, k, v, bias, mask, scale)
    return _chunked_fwd(q, k, v, bias, mask, scale, block_q)


@_attention_fwd.register_fake
def _(q, k, v, bias, mask, scale, block_q, backend):
    _check_op_backend(backend)
    if backend == "triton":
        return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)
    compute = torch.promote_types(q.dtype, torch.float32)
    lead = torch.broadcast_shapes(q.shape[:-1], v.shape[:-2] + (1,))
    return q.new_empty((*lead, v.shape[-1]), dtype=compute), q.new_empty(lead, dtype=compute)


@torch.library.custom_op(op_name("attention_bwd"), mutates_args=())
def _attention_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor | None, out: Tensor,
    lse: Tensor, scale: float, block_q: int, bias_grad: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbias); dbias is an empty tensor unless `bias_grad` (ops cannot return None)."""
    _check_op_backend(backend)
    want_bias = bias is not None and bias_grad
    if backend == "triton":
        dq, dk, dv, dbias = _triton()._triton_bwd(dout, q, k, v, bias, mask, out, lse, scale, want_bias)
    else:
        dq, dk, dv, dbias = _chunked_bwd(dout, q, k, v, bias, mask, out, lse, scale, block_q, want_bias)
    return dq, dk, dv, q.new_empty(0) if dbias is None else dbias


@_attention_bwd.register_fake
def _(dout, q, k, v, bias, mask, out, lse, scale, block_q, bias_grad, backend):
    _check_op_backend(backend)
    dbias = bias.new_empty(bias.shape) if bias is not None and bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _attention_setup_context(ctx, inputs, output):
    q, k, v, bias, mask, scale, block_q, backend = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, bias, mask, out, lse)
    ctx.scale, ctx.block_q, ctx.backend = scale, block_q, backend


def _attention_backward(ctx, dout, _dlse):
    q, k, v, bias, mask, out, lse = ctx.saved_tensors
    want_bias = bias is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dbias = _attention_bwd(dout, q, k, v, bias, mask, out, lse, ctx.scale, ctx.block_q, want_bias,
                                       ctx.backend)
    return dq, dk, dv, dbias if want_bias else None, None, None, None, None


_attention_fwd.register_autograd(_attention_backward, setup_context=_attention_setup_context)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    block_q: int | None = None,
) -> torch.Tensor:
    """softmax(q @ k^T * scale + bias, keeping only `mask`) @ v, without holding the whole score matrix.

    q: [*, H, Q, D]; k, v: [*, H, K, D]; bias: float, broadcastable to [*, H, Q, K] (size-1 dims allowed,
    differentiable); mask: bool, broadcastable to [*, H, Q, K], True = keep. scale defaults to D ** -0.5.
    Returns [*, H, Q, D] in q's dtype; a query row with every key masked gives zeros.
    block_q: query rows per block on the PyTorch path (default: about 32 MiB of scores per block).
    """
    _check_shapes(q, k, v, bias, mask)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    path = select_path("attention", q.device, _triton_unsupported(q, k, v, bias, mask))
    if path == "torch":
        return attention_reference(q, k, v, bias, mask, scale)
    if path == "triton":
        fwd = _attention_fwd_impl if direct_call(q, k, v, bias) else _attention_fwd
        out, _ = fwd(q, k, v, _align(bias, q.dim()), _align(mask, q.dim()), scale, 0, "triton")
        return out
    return _attention_torch_path(q, k, v, bias, mask, scale, block_q)
