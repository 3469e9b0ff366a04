"""Dynamic axial parallelism for the AlphaFold model, applied from outside: `parallelize_dap(model, group)`.

The plan (FastFold's, on explicit groups and any sizes). Weights are replicated; only activations are split
across the ranks of the DAP mesh axis `group`:

- Each Evoformer, extra-MSA and template pair stack scatters its inputs on entry and gathers its outputs on
  exit, so the embedders, the template pointwise attention, the structure module and the heads run
  unchanged on whole tensors.
- Inside a stack the MSA representation m `[*, S, N, C_m]` is split by rows (S, tensor dim -3) for the row
  attention and by columns (N, dim -2) for the column attention, the transition and the outer product
  mean; the pair representation z `[*, N, N, C_z]` is split by rows for the outgoing triangle
  multiplication and the starting-node attention, by columns for the incoming multiplication and the
  ending-node attention. `core_parallel.dap.all_to_all` moves the split between the two dims.
- What an operation needs whole is gathered: the pair bias of the MSA row attention and of the triangle
  attentions (a forward hook on their bias projection, `[*, N, N, H]`), one gated projection of each
  triangle multiplication, and the right projection of the outer product mean.
- m's move back from columns to rows is launched before the pair stack and waited for after it, so it
  overlaps the pair stack.

Uneven sizes (any N_res, any MSA depth, fewer rows than ranks) are handled by the primitives' internal
padding. Chunking works unchanged inside each rank (`InferenceOptions.chunk_size`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core_parallel import dap as comm
from .model.evoformer import (
    EvoformerStack,
    ExtraMSAStack,
    MSARowAttentionWithPairBias,
    OuterProductMean,
    TemplatePairStack,
    TriangleAttention,
    TriangleMultiplication,
)
from .model.options import InferenceOptions
from .model.primitives import mask_keep

logger = logging.getLogger(__name__)

__all__ = ["broadcast_batch", "parallelize_dap"]

ROWS, COLS = -3, -2
"""Tensor dims of m `[*, S, N, C]` and z `[*, N, N, C]` along which an activation is split."""

_PAIR_STACK_ORDER = ("tri_mul_out", "tri_mul_in", "tri_att_start", "tri_att_end", "pair_transition")
_TEMPLATE_BLOCK_ORDER = ("tri_att_start", "tri_att_end", "tri_mul_out", "tri_mul_in", "pair_transition")


class _Pair:
    """A pair activation `[*, N, N, C]` split over `group` by rows (dim -3) or columns (dim -2), with the
    pair mask `[*, N, N]` split both ways."""

    def __init__(self, z: torch.Tensor, pair_mask: torch.Tensor, group: Any) -> None:
        self.group, self.n = group, z.shape[-2]
        self.split = ROWS
        self.value = comm.scatter(z, ROWS, group)
        self.masks = {ROWS: comm.scatter(pair_mask, -2, group), COLS: comm.scatter(pair_mask, -1, group)}

    def along(self, dim: int) -> torch.Tensor:
        """The local shard split along `dim` (one all-to-all when it is split along the other dim)."""
        if self.split != dim:
            value, self.value = self.value, None  # hand the shard over, so the exchange can free it early
            self.value = comm.all_to_all(value, self.split, dim, self.group, from_size=self.n)
            self.split = dim
        return self.value

    def update(self, dim: int | None, fn) -> None:
        """value = fn(shard, mask), the residual included, with the shard split along `dim` (None: as it is)."""
        shard = self.along(self.split if dim is None else dim)
        self.value = fn(shard, self.masks[self.split])

    def gather(self) -> torch.Tensor:
        return comm.gather(self.along(ROWS), ROWS, self.group, full_size=self.n)


def _row_blocks(total: int, chunk: int | None) -> list[tuple[int, int]]:
    step = total if chunk is None else max(1, chunk)
    return [(r, min(r + step, total)) for r in range(0, total, max(step, 1))]


def _residual_rows(x: torch.Tensor, fn, chunk: int | None, options: InferenceOptions) -> torch.Tensor:
    """`x + update`, where `fn(r0, r1)` is the update of rows [r0, r1) of dim -3 and reads only those rows of x.

    Chunked, the update is added block by block and never held whole: into x itself with in-place
    residuals, else into a copy of x (the same sums as `x + update`, one activation less alive).
    """
    rows = x.shape[-3]
    if chunk is None or rows == 0:
        return options.add_(x, fn(0, rows))
    out = x if options.residual == "in_place" else x.clone()
    for r0, r1 in _row_blocks(rows, chunk):
        out[..., r0:r1, :, :] += fn(r0, r1)
    return out


def _module_residual(mod: nn.Module, x: torch.Tensor, *args: Any, options: InferenceOptions) -> torch.Tensor:
    """`x + mod(x, *args, options)` for a module that works on a local shard unchanged (column attention,
    transitions), through the module's own `residual_` (fused with chunking) where it has one."""
    fused = getattr(mod, "residual_", None)
    if fused is not None:
        return fused(x, *args, options)
    return options.add_(x, mod(x, *args, options))


def _attention_chunk(options: InferenceOptions, rows: int, heads: int, length: int, c: int, itemsize: int):
    """Rows per chunk of a row-wise attention: its projections (about 8 x L x C) and one block of scores."""
    return options.rows_per_chunk(rows, (8 * length * c + heads * length * min(length, 256)) * itemsize)


def _whole_bias(layer_norm: nn.Module, linear: nn.Module, z_rows: torch.Tensor, chunk: int | None, group: Any):
    """The pair bias `[*, 1, H, N, N]` of every row, from this rank's rows `z_rows: [*, N_r, N, C]` (any strides):
    `linear(layer_norm(z))` on the local rows (by row blocks when chunking), then gathered."""
    if chunk is None:
        local = linear(layer_norm(z_rows))
    else:
        local = z_rows.new_empty(*z_rows.shape[:-1], linear.out_features)
        for r0, r1 in _row_blocks(z_rows.shape[-3], chunk):
            local[..., r0:r1, :, :] = linear(layer_norm(z_rows[..., r0:r1, :, :]))
    return comm.gather(local, ROWS, group, full_size=z_rows.shape[-2]).movedim(-1, -3).unsqueeze(-4)


def _msa_row_attention(
    mod: MSARowAttentionWithPairBias, m: torch.Tensor, z_rows: torch.Tensor, msa_mask: torch.Tensor,
    options: InferenceOptions, group: Any,
) -> torch.Tensor:
    """AlphaFold2 suppl. Alg. 7 on m split by rows `[*, S_r, N, C_m]` (msa_mask `[*, S_r, N]`), with the bias
    from z split by rows `[*, N_r, N, C_z]`. Returns the new m."""
    chunk = _attention_chunk(options, m.shape[-3], mod.mha.heads, m.shape[-2], m.shape[-1], m.element_size())
    bias = _whole_bias(mod.layer_norm_z, mod.linear_z, z_rows, chunk, group)

    def update(r0: int, r1: int) -> torch.Tensor:
        x = mod.layer_norm_m(m[..., r0:r1, :, :])
        return mod.mha(x, x, mask=mask_keep(msa_mask[..., r0:r1, :])[..., :, None, None, :], bias=bias)

    return _residual_rows(m, update, chunk, options)


def _triangle_attention(
    mod: TriangleAttention, z: torch.Tensor, pair_mask: torch.Tensor, options: InferenceOptions, group: Any
) -> torch.Tensor:
    """AlphaFold2 suppl. Alg. 13 (starting node) on z split by rows `[*, N_r, N, C]`, Alg. 14 (ending node) on
    z split by columns `[*, N, N_r, C]`; pair_mask in the same layout. Returns the new z."""
    ending = mod.node == "ending"
    zt = z.transpose(-2, -3) if ending else z  # the attention's rows are local: [*, N_r, N, C]
    mt = pair_mask.transpose(-1, -2) if ending else pair_mask
    chunk = _attention_chunk(options, zt.shape[-3], mod.mha.heads, zt.shape[-2], zt.shape[-1], z.element_size())
    if chunk is None:  # one LayerNorm for the bias and the attention
        x = mod.layer_norm(zt)
        bias = comm.gather(mod.linear(x), ROWS, group, full_size=zt.shape[-2]).movedim(-1, -3).unsqueeze(-4)
        new = options.add_(zt, mod.mha(x, x, mask=mask_keep(mt)[..., :, None, None, :], bias=bias))
    else:
        bias = _whole_bias(mod.layer_norm, mod.linear, zt, chunk, group)

        def update(r0: int, r1: int) -> torch.Tensor:
            x = mod.layer_norm(zt[..., r0:r1, :, :])
            return mod.mha(x, x, mask=mask_keep(mt[..., r0:r1, :])[..., :, None, None, :], bias=bias)

        new = _residual_rows(zt, update, chunk, options)
    return new.transpose(-2, -3) if ending else new


def _gated(mod: TriangleMultiplication, x: torch.Tensor, mask: torch.Tensor, which: str) -> torch.Tensor:
    """mask * linear_p(x) * sigmoid(linear_g(x)) for the projection `which` ("a" or "b")."""
    proj, gate = getattr(mod, f"linear_{which}_p"), getattr(mod, f"linear_{which}_g")
    return mask * proj(x) * torch.sigmoid(gate(x))


def _triangle_multiplication(
    mod: TriangleMultiplication, z: torch.Tensor, pair_mask: torch.Tensor, options: InferenceOptions, group: Any
) -> torch.Tensor:
    """AlphaFold2 suppl. Alg. 11 (outgoing) on z split by rows `[*, N_r, N, C]`, Alg. 12 (incoming) on z split
    by columns `[*, N, N_r, C]`; pair_mask in the same layout. Returns the new z.

    Both work on the layout whose rows are local: z for outgoing, z^T for incoming, where
    `out^T[j, i] = sum_k b^T[j, k] a^T[i, k]`. The projection every local row needs (b outgoing, a incoming) is
    gathered from all ranks; the other one is computed block by block when chunking.
    """
    outgoing = mod.direction == "outgoing"
    zz = z if outgoing else z.transpose(-2, -3)  # [*, R, N, C]
    mm = (pair_mask if outgoing else pair_mask.transpose(-1, -2)).to(z.dtype)[..., None]
    row_proj, all_proj = ("a", "b") if outgoing else ("b", "a")
    c_h, n = mod.linear_a_p.out_features, zz.shape[-2]
    chunk = options.rows_per_chunk(zz.shape[-3], n * (4 * c_h + 5 * zz.shape[-1]) * z.element_size())
    x_all = mod.layer_norm_in(zz) if chunk is None else None
    if chunk is None:
        local = _gated(mod, x_all, mm, all_proj)
    else:
        local = zz.new_empty(*zz.shape[:-1], c_h)
        for r0, r1 in _row_blocks(zz.shape[-3], chunk):
            x = mod.layer_norm_in(zz[..., r0:r1, :, :])
            local[..., r0:r1, :, :] = _gated(mod, x, mm[..., r0:r1, :, :], all_proj)
    shared = comm.gather(local, ROWS, group, full_size=n).movedim(-1, -3)  # [*, c, J, K]
    del local

    def update(r0: int, r1: int) -> torch.Tensor:
        x = x_all if x_all is not None else mod.layer_norm_in(zz[..., r0:r1, :, :])
        rows = _gated(mod, x, mm[..., r0:r1, :, :], row_proj).movedim(-1, -3)  # [*, c, R, K]
        p = torch.matmul(rows, shared.transpose(-1, -2)).movedim(-3, -1)  # [*, R, J, c]
        del rows
        return mod.linear_z(mod.layer_norm_out(p)) * torch.sigmoid(mod.linear_g(x))

    new = _residual_rows(zz, update, chunk, options)
    return new if outgoing else new.transpose(-2, -3)


def _outer_product_mean(
    mod: OuterProductMean, z: torch.Tensor, m: torch.Tensor, msa_mask: torch.Tensor, options: InferenceOptions,
    group: Any,
) -> torch.Tensor:
    """AlphaFold2 suppl. Alg. 10 for the local residues, added to their pair rows z `[*, N_r, N, C_z]`.
    m: `[*, S, N_r, C_m]` split by columns; msa_mask: `[*, S, N]` whole. Returns the new z rows."""
    n = msa_mask.shape[-1]
    full_mask = msa_mask.to(m.dtype)
    local_mask = comm.scatter(full_mask, -1, group)
    ln = mod.layer_norm(m)
    a = (mod.linear_1(ln) * local_mask[..., None]).movedim(-3, -2)  # [*, N_r, S, c]
    b = mod.linear_2(ln) * local_mask[..., None]
    del ln
    b = comm.gather(b, COLS, group, full_size=n).movedim(-3, -2)  # [*, N, S, c]
    norm = torch.einsum("...si,...sj->...ij", local_mask, full_mask)[..., None]  # [*, N_r, N, 1]
    c = a.shape[-1]
    chunk = options.rows_per_chunk(a.shape[-3], n * (2 * c * c + 2 * z.shape[-1]) * m.element_size())

    def update(r0: int, r1: int) -> torch.Tensor:
        outer = torch.einsum("...isc,...jse->...ijce", a[..., r0:r1, :, :], b)
        return mod.linear_out(outer.flatten(-2)) / (mod.eps + norm[..., r0:r1, :, :])

    return _residual_rows(z, update, chunk, options)


def _pair_ops(owner: nn.Module, order: tuple[str, ...], z: _Pair, options: InferenceOptions, group: Any) -> None:
    """Run the pair updates of `owner` (a PairStack or TemplatePairBlock) in `order` on the split z."""
    for name in order:
        mod = getattr(owner, name)
        if isinstance(mod, TriangleMultiplication):
            dim = ROWS if mod.direction == "outgoing" else COLS
            z.update(dim, functools.partial(_triangle_multiplication, mod, options=options, group=group))
        elif isinstance(mod, TriangleAttention):
            dim = ROWS if mod.node == "starting" else COLS
            z.update(dim, functools.partial(_triangle_attention, mod, options=options, group=group))
        else:  # the pair transition: pointwise, either split
            z.update(None, lambda shard, _mask, mod=mod: _module_residual(mod, shard, options=options))


def _evoformer_block(
    block: nn.Module, m: torch.Tensor, z: _Pair, msa_mask: torch.Tensor, options: InferenceOptions, group: Any
) -> torch.Tensor:
    """One Evoformer / extra-MSA block (Alg. 6) on m split by rows `[*, S_r, N, C_m]` and z. Returns m by rows."""
    s, n = msa_mask.shape[-2], msa_mask.shape[-1]
    rows_mask, cols_mask = comm.scatter(msa_mask, -2, group), comm.scatter(msa_mask, -1, group)
    m = _msa_row_attention(block.msa_att_row, m, z.along(ROWS), rows_mask, options, group)
    m = comm.all_to_all(m, ROWS, COLS, group, from_size=s)  # [*, S, N_r, C_m]
    m = _module_residual(block.msa_att_col, m, cols_mask, options=options)
    m = _module_residual(block.msa_transition, m, options=options)
    z.value = _outer_product_mean(block.outer_product_mean, z.along(ROWS), m, msa_mask, options, group)
    m_back = comm.all_to_all_async(m, COLS, ROWS, group, from_size=n)  # overlaps the pair stack
    del m
    _pair_ops(block.pair_stack, _PAIR_STACK_ORDER, z, options, group)
    return m_back.wait()


def _msa_stack(stack: nn.Module, m, z, msa_mask, pair_mask, options, group) -> tuple[torch.Tensor, _Pair]:
    """Run every block of an Evoformer or extra-MSA stack on split activations; returns (m by rows, z)."""
    msa_mask = msa_mask.to(m.dtype)
    zp = _Pair(z, pair_mask, group)
    m = comm.scatter(m, ROWS, group)
    for block in stack.blocks:
        m = _evoformer_block(block, m, zp, msa_mask, options, group)
    return m, zp


def _evoformer_forward(stack: EvoformerStack, group: Any, m, z, msa_mask, pair_mask, options):
    """`EvoformerStack.forward` under DAP: same arguments and results (m, z, s), whole tensors."""
    s = m.shape[-3]
    m, zp = _msa_stack(stack, m, z, msa_mask, pair_mask, options, group)
    m = comm.gather(m, ROWS, group, full_size=s)
    return m, zp.gather(), stack.linear(m[..., 0, :, :])


def _extra_msa_forward(stack: ExtraMSAStack, group: Any, a, z, msa_mask, pair_mask, options):
    """`ExtraMSAStack.forward` under DAP: returns the whole z (the extra MSA itself is dropped split)."""
    return _msa_stack(stack, a, z, msa_mask, pair_mask, options, group)[1].gather()


def _template_forward(stack: TemplatePairStack, group: Any, t, pair_mask, options):
    """`TemplatePairStack.forward` under DAP. t: `[*, T, N, N, C_t]`; pair_mask `[*, 1, N, N]`."""
    tp = _Pair(t, pair_mask, group)
    for block in stack.blocks:
        _pair_ops(block, _TEMPLATE_BLOCK_ORDER, tp, options, group)
    tp.value = stack.layer_norm(tp.along(ROWS))
    return tp.gather()


_STACK_FORWARDS = (
    (EvoformerStack, _evoformer_forward),
    (ExtraMSAStack, _extra_msa_forward),
    (TemplatePairStack, _template_forward),
)


def parallelize_dap(model: nn.Module, group: Any) -> nn.Module:
    """Split the Evoformer, extra-MSA and template pair stacks of `model` across the ranks of `group`.

    Changes `model` in place (weights and state_dict untouched) and returns it. Every rank of `group` must
    call the model with the same batch (see `broadcast_batch`); each returns the same whole outputs as the
    unsplit model. `group=None` (one process, no process group) leaves the model as it is; a one-rank
    group runs the plan with every communication a no-op.
    """
    if group is None:
        return model
    if getattr(model, "_dap_group", None) is not None:
        raise ValueError("parallelize_dap: this model is already split across a DAP group")
    stacks = 0
    for module in model.modules():
        for cls, forward in _STACK_FORWARDS:
            if type(module) is cls:
                module.forward = functools.partial(forward, module, group)
                stacks += 1
    if stacks == 0:
        raise ValueError("parallelize_dap: the model has no Evoformer, extra-MSA or template pair stack")
    model._dap_group = group
    logger.info("DAP: %d stacks split across %d ranks", stacks, comm.group_size(group))
    return model


def broadcast_batch(
    batch: Mapping[str, Any] | None, group: Any, src: int = 0, device: torch.device | str | None = None
) -> dict[str, Any]:
    """The feature batch of rank `src` (its index in `group`) on every rank of `group`.

    Only rank `src` needs `batch` (a mapping of tensors; other values travel as pickled objects); the
    others pass None. Tensors arrive on `device` (default: CPU for gloo, the current CUDA device for NCCL).
    """
    if comm.group_size(group) == 1:
        if batch is None:
            raise ValueError("broadcast_batch: one rank and no batch")
        return dict(batch)
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    me = comm.group_rank(group)
    header: list[Any] = [None]
    if me == src:
        if batch is None:
            raise ValueError(f"broadcast_batch: rank {src} is the source but has no batch")
        header[0] = {
            k: (("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("object", v))
            for k, v in batch.items()
        }
    dist.broadcast_object_list(header, group=group, group_src=src)
    out: dict[str, Any] = {}
    for key, meta in header[0].items():
        if meta[0] == "object":
            out[key] = meta[1]
            continue
        t = batch[key].to(device).contiguous() if me == src else torch.empty(meta[1], dtype=meta[2], device=device)
        dist.broadcast(t, group=group, group_src=src)
        out[key] = t
    return out
