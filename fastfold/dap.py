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

from core_parallel import dap as comm
from fastfold.model.evoformer import (
    EvoformerStack,
    ExtraMSAStack,
    MSARowAttentionWithPairBias,
    OuterProductMean,
    TemplatePairStack,
    TriangleAttention,
    TriangleMultiplication,
)
from fastfold.model.options import InferenceOptions
from fastfold.model.primitives import chunked

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
            self.value = comm.all_to_all(self._release(), self.split, dim, self.group, from_size=self.n)
            self.split = dim
        return self.value

    def _release(self) -> torch.Tensor:
        """Hand the shard over (so the exchange can free it early) and forget it."""
        value, self.value = self.value, None
        return value

    def update(self, dim: int | None, fn, options: InferenceOptions) -> None:
        """value += fn(shard, mask) with the shard split along `dim` (None: the current split)."""
        shard = self.along(self.split if dim is None else dim)
        self.value = options.add_(shard, fn(shard, self.masks[self.split]))

    def gather(self) -> torch.Tensor:
        return comm.gather(self.along(ROWS), ROWS, self.group, full_size=self.n)


def _triangle_multiplication(
    mod: TriangleMultiplication, z: torch.Tensor, pair_mask: torch.Tensor, options: InferenceOptions, group: Any
) -> torch.Tensor:
    """AlphaFold2 suppl. Alg. 11/12 on a shard: outgoing on rows `[*, N_r, N, C]`, incoming on columns
    `[*, N, N_r, C]` (pair_mask in the same layout). Returns the update in the shard's layout."""
    x = mod.layer_norm_in(z)
    mask = pair_mask.to(z.dtype)[..., None]
    a = mask * mod.linear_a_p(x) * torch.sigmoid(mod.linear_a_g(x))
    b = mask * mod.linear_b_p(x) * torch.sigmoid(mod.linear_b_g(x))
    del mask
    if mod.direction == "outgoing":  # z_ij = sum_k a_ik b_jk: local rows i, every row j of b
        left, right = a, comm.gather(b, ROWS, group, full_size=z.shape[-2])
    else:  # z_ij = sum_k a_ki b_kj: local columns j, every column i of a
        left = comm.gather(a, COLS, group, full_size=z.shape[-3]).transpose(-2, -3)
        right = b.transpose(-2, -3)
    del a, b
    left, right = left.movedim(-1, -3), right.movedim(-1, -3)  # [*, c, I, K], [*, c, J, K]
    rows, cols = left.shape[-2], right.shape[-2]
    chunk = options.rows_per_chunk(rows, cols * (left.shape[-3] + 2 * z.shape[-1]) * z.element_size()) or max(rows, 1)
    out = z.new_empty(z.shape)
    for i in range(0, rows, chunk):
        p = torch.matmul(left[..., i : i + chunk, :], right.transpose(-1, -2)).movedim(-3, -1)  # [*, n_i, J, c]
        gate = torch.sigmoid(mod.linear_g(x[..., i : i + chunk, :, :]))
        out[..., i : i + chunk, :, :] = mod.linear_z(mod.layer_norm_out(p)) * gate
    return out


def _outer_product_mean(
    mod: OuterProductMean, m: torch.Tensor, msa_mask: torch.Tensor, options: InferenceOptions, group: Any
) -> torch.Tensor:
    """AlphaFold2 suppl. Alg. 10 for the local residues. m: `[*, S, N_r, C_m]` split by columns;
    msa_mask: `[*, S, N]` whole. Returns the pair rows of the local residues `[*, N_r, N, C_z]`."""
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
    chunk = options.rows_per_chunk(a.shape[-3], n * c * c * m.element_size())

    def run(a_c: torch.Tensor, norm_c: torch.Tensor) -> torch.Tensor:
        outer = torch.einsum("...isc,...jse->...ijce", a_c, b)
        return mod.linear_out(outer.flatten(-2)) / (mod.eps + norm_c)

    return chunked(run, [a, norm], a.dim() - 3, chunk)


def _pair_ops(owner: nn.Module, order: tuple[str, ...], z: _Pair, options: InferenceOptions, group: Any) -> None:
    """Run the pair updates of `owner` (a PairStack or TemplatePairBlock) in `order` on the split z."""
    for name in order:
        mod = getattr(owner, name)
        if isinstance(mod, TriangleMultiplication):
            dim = ROWS if mod.direction == "outgoing" else COLS
            z.update(dim, functools.partial(_triangle_multiplication, mod, options=options, group=group), options)
        elif isinstance(mod, TriangleAttention):
            dim = ROWS if mod.node == "starting" else COLS  # the bias hook gathers the rows of (z or z^T)
            z.update(dim, functools.partial(mod, options=options), options)
        else:  # the pair transition: pointwise, either split
            z.update(None, lambda shard, _mask, mod=mod: mod(shard, options), options)


def _evoformer_block(
    block: nn.Module, m: torch.Tensor, z: _Pair, msa_mask: torch.Tensor, options: InferenceOptions, group: Any
) -> torch.Tensor:
    """One Evoformer / extra-MSA block (Alg. 6) on m split by rows `[*, S_r, N, C_m]` and z. Returns m by rows."""
    s, n = msa_mask.shape[-2], msa_mask.shape[-1]
    rows_mask, cols_mask = comm.scatter(msa_mask, -2, group), comm.scatter(msa_mask, -1, group)
    m = options.add_(m, block.msa_att_row(m, z.along(ROWS), rows_mask, options))
    m = comm.all_to_all(m, ROWS, COLS, group, from_size=s)  # [*, S, N_r, C_m]
    m = options.add_(m, block.msa_att_col(m, cols_mask, options))
    m = options.add_(m, block.msa_transition(m, options))
    z_rows = z.along(ROWS)
    z.value = options.add_(z_rows, _outer_product_mean(block.outer_product_mean, m, msa_mask, options, group))
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


def _gather_bias_rows(group: Any, _module: nn.Module, _inputs: Any, bias: torch.Tensor) -> torch.Tensor:
    """Forward hook of a pair-bias projection: its rows `[*, N_r, N, H]` -> the whole bias `[*, N, N, H]`."""
    return comm.gather(bias, ROWS, group, full_size=bias.shape[-2])


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
        if isinstance(module, MSARowAttentionWithPairBias):
            module.linear_z.register_forward_hook(functools.partial(_gather_bias_rows, group))
        elif isinstance(module, TriangleAttention):
            module.linear.register_forward_hook(functools.partial(_gather_bias_rows, group))
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
