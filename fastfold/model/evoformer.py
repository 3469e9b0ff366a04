"""Evoformer, extra-MSA and template pair stacks (AlphaFold2 suppl. 1.6, Alg. 6-19).

Every block takes its activations and masks explicitly and returns the updated activations. Each stack
runs its one forward through its `layout` (`options.Layout`): the identity on one process; a parallel plan
(`fastfold.parallelize_dap`) installs a layout that splits the activations across processes, and the same
forward then moves the split between rows and columns where the next operation needs the other dim whole.
Under a layout, a block's m `[*, S, N, C_m]` and z `[*, N, N, C_z]` arrive and leave split by rows (dim -3);
its masks arrive whole and are split where used. Masks are float 0/1 tensors: msa_mask `[*, N_seq, N_res]`,
pair_mask `[*, N_res, N_res]`.

Per Evoformer block (FastFold's dynamic axial parallelism, Cheng et al. arXiv 2203.00854): the row attention
on m by rows (the pair bias gathered), m moved to columns for the column attention, the transition and the
outer product mean (which writes z's local rows), m moved back to rows while the pair stack runs; in the pair
stack z by rows for the outgoing multiplication and starting-node attention, by columns for the incoming
multiplication and ending-node attention; the projection every row needs is gathered.

DISCREPANCY: a query row whose keys are all masked attends to nothing (zeros) here, where AlphaFold
averages over all keys. Such rows only exist at padding positions, which never reach unpadded outputs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ... import kernels
from .config import EvoformerStackConfig, TemplateConfig
from .options import SINGLE_PROCESS, InferenceOptions, Layout
from .primitives import Attention, LayerNorm, Linear, attention_chunk, chunked, mask_keep, row_blocks, row_chunk

__all__ = [
    "EvoformerBlock",
    "EvoformerStack",
    "ExtraMSABlock",
    "ExtraMSAStack",
    "MSAColumnAttention",
    "MSAColumnGlobalAttention",
    "MSARowAttentionWithPairBias",
    "OuterProductMean",
    "PairStack",
    "TemplatePairStack",
    "Transition",
    "TriangleAttention",
    "TriangleMultiplication",
]


def _pair_bias(
    layer_norm: nn.Module, linear: Linear, z: torch.Tensor, options: InferenceOptions, layout: Layout
) -> torch.Tensor:
    """`linear(layer_norm(z))` moved to `[*, 1, H, N, N]`; computed by row blocks when chunking, so the
    LayerNorm of the whole pair is never held. z: [*, N_local, N, C_z], the local rows (may be a transposed
    view); the bias of every row is gathered."""
    full = z.shape[-2]
    if options.chunk_size is None:
        return layout.gather(linear(layer_norm(z)).movedim(-1, -3), -2, full).unsqueeze(-4)
    heads, n = linear.out_features, z.shape[-3]
    if layout.world > 1:  # rows outermost in memory: the gather sends the buffer as it is, no transposed copy
        bias = z.new_empty(n, *z.shape[:-3], heads, z.shape[-2]).movedim(0, -2)
    else:
        bias = z.new_empty(*z.shape[:-3], heads, n, z.shape[-2])
    chunk = row_chunk(options, z, z.shape[-2] * (2 * z.shape[-1] + 2 * heads))
    for r0, r1 in row_blocks(n, chunk):
        bias[..., r0:r1, :] = linear(layer_norm(z[..., r0:r1, :, :])).movedim(-1, -3)
    return layout.gather(bias, -2, full).unsqueeze(-4)


def _row_attention(
    layer_norm: nn.Module, mha: Attention, x: torch.Tensor, mask: torch.Tensor, bias: torch.Tensor | None,
    options: InferenceOptions, into: torch.Tensor | None,
) -> torch.Tensor:
    """`mha` self-attention of LayerNormed x [*, R, L, C] along L, each of the R rows on its own, computed by
    blocks of rows (`into`: added into it block by block). mask: keep-mask [*, R, 1, 1, L]; bias: [*, 1, H, L, L]
    or None. Returns the update [*, R, L, C] (or `into`)."""
    chunk = attention_chunk(options, x.shape[-3], mha.heads, x.shape[-2], x.shape[-1], x.element_size())

    def run(x_c: torch.Tensor, mask_c: torch.Tensor) -> torch.Tensor:
        x_c = layer_norm(x_c)
        return mha(x_c, x_c, mask=mask_c, bias=bias)

    return chunked(run, [x, mask], x.dim() - 3, chunk, into=into)


class MSARowAttentionWithPairBias(nn.Module):
    """AlphaFold2 suppl. Alg. 7: row-wise gated self-attention over the MSA with a bias from the pair."""

    def __init__(self, c_m: int, c_z: int, heads: int, head_dim: int):
        super().__init__()
        self.layer_norm_m = LayerNorm(c_m)
        self.layer_norm_z = LayerNorm(c_z)
        self.linear_z = Linear(c_z, heads, bias=False)
        self.mha = Attention(c_m, c_m, heads, head_dim, c_m)

    def forward(
        self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor, options: InferenceOptions,
        layout: Layout = SINGLE_PROCESS,
    ) -> torch.Tensor:
        """m: [*, S, N, C_m]; z: [*, N, N, C_z]; msa_mask: [*, S, N]. Returns the update to m.
        Under `layout`, m and msa_mask hold the local MSA rows, z the local pair rows."""
        return self._run(m, z, msa_mask, options, None, layout)

    def residual_(
        self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor, options: InferenceOptions,
        layout: Layout = SINGLE_PROCESS,
    ) -> torch.Tensor:
        """m + forward(...), added chunk by chunk into m when `options.fused_residual`."""
        if not options.fused_residual:
            return options.add_(m, self(m, z, msa_mask, options, layout))
        return self._run(m, z, msa_mask, options, m, layout)

    def _run(self, m, z, msa_mask, options, into, layout):
        bias = _pair_bias(self.layer_norm_z, self.linear_z, z, options, layout)  # [*, 1, H, N, N]
        mask = mask_keep(msa_mask)[..., :, None, None, :]  # [*, S, 1, 1, N]
        return _row_attention(self.layer_norm_m, self.mha, m, mask, bias, options, into)


class _MSAColumnOp(nn.Module):
    """An update to m computed column by column; `_run(m, msa_mask, options, into)` writes into `into`
    (m's transposed view, [*, N, S, C_m]) chunk by chunk when given, else returns the update."""

    def forward(self, m: torch.Tensor, msa_mask: torch.Tensor, options: InferenceOptions) -> torch.Tensor:
        """m: [*, S, N, C_m]; msa_mask: [*, S, N]. Returns the update to m."""
        return self._run(m, msa_mask, options, None)

    def residual_(self, m: torch.Tensor, msa_mask: torch.Tensor, options: InferenceOptions) -> torch.Tensor:
        """m + forward(...), added chunk by chunk into m when `options.fused_residual`."""
        if not options.fused_residual:
            return options.add_(m, self(m, msa_mask, options))
        self._run(m, msa_mask, options, m.transpose(-2, -3))
        return m

    def _run(self, m, msa_mask, options, into):
        raise NotImplementedError


class MSAColumnAttention(_MSAColumnOp):
    """AlphaFold2 suppl. Alg. 8: column-wise gated self-attention over the MSA."""

    def __init__(self, c_m: int, heads: int, head_dim: int):
        super().__init__()
        self.layer_norm_m = LayerNorm(c_m)
        self.mha = Attention(c_m, c_m, heads, head_dim, c_m)

    def _run(self, m, msa_mask, options, into):
        m_t = m.transpose(-2, -3)  # [*, N, S, C]
        mask = mask_keep(msa_mask).transpose(-1, -2)[..., :, None, None, :]  # [*, N, 1, 1, S]
        return _row_attention(self.layer_norm_m, self.mha, m_t, mask, None, options, into).transpose(-2, -3)


class GlobalAttention(nn.Module):
    """AlphaFold2 suppl. Alg. 19 lines 2-7: one averaged query per head, shared single-head keys/values."""

    def __init__(self, c_in: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.linear_q = Linear(c_in, heads * head_dim, bias=False)
        self.linear_k = Linear(c_in, head_dim, bias=False)
        self.linear_v = Linear(c_in, head_dim, bias=False)
        self.linear_g = Linear(c_in, heads * head_dim)
        self.linear_o = Linear(heads * head_dim, c_in)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: [*, L, C] (one column of the MSA per batch entry); mask: [*, L] float. Returns [*, L, C]."""
        q_avg = (x * mask[..., None]).sum(-2) / (mask.sum(-1)[..., None] + 1e-10)  # [*, C]
        q = self.linear_q(q_avg).unflatten(-1, (self.heads, self.head_dim))[..., :, None, :]  # [*, H, 1, c]
        k = self.linear_k(x)[..., None, :, :]  # [*, 1, L, c]
        v = self.linear_v(x)[..., None, :, :]
        keep = mask_keep(mask)[..., None, None, :]  # [*, 1, 1, L]
        o = kernels.attention(q, k.expand(*q.shape[:-2], -1, -1), v.expand(*q.shape[:-2], -1, -1), mask=keep)
        o = o[..., 0, :]  # [*, H, c]
        g = torch.sigmoid(self.linear_g(x)).unflatten(-1, (self.heads, self.head_dim))  # [*, L, H, c]
        return self.linear_o((o[..., None, :, :] * g).flatten(-2))


class MSAColumnGlobalAttention(_MSAColumnOp):
    """AlphaFold2 suppl. Alg. 19: column-wise global attention (extra-MSA stack)."""

    def __init__(self, c_m: int, heads: int, head_dim: int):
        super().__init__()
        self.layer_norm_m = LayerNorm(c_m)
        self.global_attention = GlobalAttention(c_m, heads, head_dim)

    def _run(self, m, msa_mask, options, into):
        m_t = m.transpose(-2, -3)
        mask_t = msa_mask.transpose(-1, -2).to(m.dtype)
        gh = self.global_attention.heads * self.global_attention.head_dim
        chunk = row_chunk(options, m_t, m_t.shape[-2] * (3 * m_t.shape[-1] + 3 * gh))

        def run(m_c: torch.Tensor, mask_c: torch.Tensor) -> torch.Tensor:
            return self.global_attention(self.layer_norm_m(m_c), mask_c)

        return chunked(run, [m_t, mask_t], m_t.dim() - 3, chunk, into=into).transpose(-2, -3)


class Transition(nn.Module):
    """AlphaFold2 suppl. Alg. 9 / 15: LayerNorm, Linear(n*c), ReLU, Linear(c)."""

    def __init__(self, c: int, factor: int):
        super().__init__()
        self.layer_norm = LayerNorm(c)
        self.linear_1 = Linear(c, factor * c)
        self.linear_2 = Linear(factor * c, c)

    def forward(self, x: torch.Tensor, options: InferenceOptions) -> torch.Tensor:
        """x: [*, R, L, C]. Returns the update to x (chunked over R)."""
        return self._run(x, options, None)

    def residual_(self, x: torch.Tensor, options: InferenceOptions) -> torch.Tensor:
        """x + forward(...), added chunk by chunk into x when `options.fused_residual`."""
        if not options.fused_residual:
            return options.add_(x, self(x, options))
        return self._run(x, options, x)

    def _run(self, x, options, into):
        chunk = row_chunk(options, x, x.shape[-2] * (self.linear_1.out_features + 3 * x.shape[-1]))

        def run(x_c: torch.Tensor) -> torch.Tensor:
            return self.linear_2(torch.relu_(self.linear_1(self.layer_norm(x_c))))

        return chunked(run, [x], x.dim() - 3, chunk, into=into)


class OuterProductMean(nn.Module):
    """AlphaFold2 suppl. Alg. 10: mean over sequences of the outer product of two projections of the MSA."""

    def __init__(self, c_m: int, c_z: int, c_hidden: int, eps: float = 1e-3):
        super().__init__()
        self.eps = eps
        self.layer_norm = LayerNorm(c_m)
        self.linear_1 = Linear(c_m, c_hidden)
        self.linear_2 = Linear(c_m, c_hidden)
        self.linear_out = Linear(c_hidden * c_hidden, c_z)

    def forward(
        self, m: torch.Tensor, msa_mask: torch.Tensor, options: InferenceOptions, layout: Layout = SINGLE_PROCESS
    ) -> torch.Tensor:
        """m: [*, S, N, C_m]; msa_mask: [*, S, N]. Returns the pair update [*, N, N, C_z]:
        `out[i, j] = W(sum_s a[s, i] (x) b[s, j]) / (eps + sum_s mask[s, i] mask[s, j])`.
        Under `layout`, m holds the local MSA columns and the update the local pair rows; msa_mask is whole."""
        return self._run(m, msa_mask, options, None, layout)

    def residual_(
        self, z: torch.Tensor, m: torch.Tensor, msa_mask: torch.Tensor, options: InferenceOptions,
        layout: Layout = SINGLE_PROCESS,
    ) -> torch.Tensor:
        """z + forward(m, ...), added row block by row block into z when `options.fused_residual`.
        z: [*, N, N, C_z]."""
        if not options.fused_residual:
            return options.add_(z, self(m, msa_mask, options, layout))
        return self._run(m, msa_mask, options, z, layout)

    def _projections(self, m, mask, options):
        """a, b: [*, N, S, c] (masked), the MSA's LayerNorm taken by blocks of sequences when chunking."""
        if options.chunk_size is None:
            ln = self.layer_norm(m)
            return (self.linear_1(ln) * mask).movedim(-3, -2), (self.linear_2(ln) * mask).movedim(-3, -2)
        c = self.linear_1.out_features
        a = m.new_empty(*m.shape[:-1], c)
        b = m.new_empty(*m.shape[:-1], c)
        chunk = row_chunk(options, m, m.shape[-2] * (2 * m.shape[-1] + 2 * c))
        for s0, s1 in row_blocks(m.shape[-3], chunk):
            ln = self.layer_norm(m[..., s0:s1, :, :])
            a[..., s0:s1, :, :] = self.linear_1(ln) * mask[..., s0:s1, :, :]
            b[..., s0:s1, :, :] = self.linear_2(ln) * mask[..., s0:s1, :, :]
        return a.movedim(-3, -2), b.movedim(-3, -2)

    def _run(self, m, msa_mask, options, into, layout):
        whole = msa_mask.to(m.dtype)
        local = layout.split(whole, -1)  # the columns of m
        a, b = self._projections(m, local[..., None], options)  # [*, N_local, S, c]
        b = layout.gather(b, -3, whole.shape[-1])  # [*, N, S, c]
        norm = torch.einsum("...si,...sj->...ij", local, whole)[..., None]
        c, n = a.shape[-1], b.shape[-3]
        per_row = n * (2 * c * c + 2 * self.linear_out.out_features) * m.element_size()
        chunk = options.rows_per_chunk(a.shape[-3], per_row)

        def run(a_c: torch.Tensor, norm_c: torch.Tensor) -> torch.Tensor:
            outer = torch.einsum("...isc,...jse->...ijce", a_c, b)
            return self.linear_out(outer.flatten(-2)).div_(norm_c + self.eps)

        return chunked(run, [a, norm], a.dim() - 3, chunk, into=into)


class TriangleMultiplication(nn.Module):
    """AlphaFold2 suppl. Alg. 11 (outgoing, `z_ij = sum_k a_ik * b_jk`) and Alg. 12 (incoming,
    `z_ij = sum_k a_ki * b_kj`), with a, b the gated projections named as in the supplement.

    AlphaFold's parameter files name the projections left/right; for the incoming update its "left" is the
    supplement's b (fastfold.params maps them).

    Chunked, the update is built by blocks of output rows (outgoing) or columns (incoming): the projection
    that every block needs (b outgoing, a incoming) is computed once by blocks into a `[*, C, N, N]`
    buffer, the other one block by block. Fused with an in-place residual, each finished block is added
    straight into z: a block only reads its own rows (columns) of z, which no earlier block has touched.
    """

    def __init__(self, c_z: int, c_hidden: int, direction: str):
        super().__init__()
        if direction not in ("outgoing", "incoming"):
            raise ValueError(f"TriangleMultiplication: direction must be 'outgoing' or 'incoming', got {direction!r}")
        self.direction = direction
        self.layer_norm_in = LayerNorm(c_z)
        self.linear_a_p = Linear(c_z, c_hidden)
        self.linear_a_g = Linear(c_z, c_hidden)
        self.linear_b_p = Linear(c_z, c_hidden)
        self.linear_b_g = Linear(c_z, c_hidden)
        self.layer_norm_out = LayerNorm(c_hidden)
        self.linear_z = Linear(c_hidden, c_z)
        self.linear_g = Linear(c_z, c_z)

    def forward(
        self, z: torch.Tensor, pair_mask: torch.Tensor, options: InferenceOptions, layout: Layout = SINGLE_PROCESS
    ) -> torch.Tensor:
        """z: [*, N, N, C_z]; pair_mask: [*, N, N]. Returns the update to z. Under `layout`, z and pair_mask
        hold the local rows (outgoing) or columns (incoming); the other projection is gathered."""
        if options.chunk_size is not None:
            return self._chunked(z, pair_mask, options, None, layout)
        x = self.layer_norm_in(z)
        mask = pair_mask.to(z.dtype)[..., None]
        a = mask * self.linear_a_p(x) * torch.sigmoid(self.linear_a_g(x))
        b = mask * self.linear_b_p(x) * torch.sigmoid(self.linear_b_g(x))
        if self.direction == "incoming":  # z_ij = sum_k a_ki b_kj: the outgoing form on transposes
            a = layout.gather(a, -2, z.shape[-3])
            a, b = a.transpose(-2, -3), b.transpose(-2, -3)
        else:
            b = layout.gather(b, -3, z.shape[-2])
        a, b = a.movedim(-1, -3), b.movedim(-1, -3)  # [*, C, N, N]
        del mask
        p = torch.matmul(a, b.transpose(-1, -2)).movedim(-3, -1)  # [*, N, N, C]
        return self.linear_z(self.layer_norm_out(p)) * torch.sigmoid(self.linear_g(x))

    def residual_(
        self, z: torch.Tensor, pair_mask: torch.Tensor, options: InferenceOptions, layout: Layout = SINGLE_PROCESS
    ) -> torch.Tensor:
        """z + forward(...), added block by block into z when `options.fused_residual`."""
        if not options.fused_residual:
            return options.add_(z, self(z, pair_mask, options, layout))
        self._chunked(z, pair_mask, options, z, layout)
        return z

    def _gated_t(self, x: torch.Tensor, mask: torch.Tensor, which: str) -> torch.Tensor:
        """`mask * linear_p(x) * sigmoid(linear_g(x))` for projection `which` ("a" or "b"), channels first,
        [*, C, R, K], computed in that layout (W @ x^T): contiguous for the batched matmul without a transposing
        copy (a strided batch makes matmul copy every channel's matrix). x: [*, R, K, C_z]; mask: [*, R, K, 1]."""
        proj, gate = (self.linear_a_p, self.linear_a_g) if which == "a" else (self.linear_b_p, self.linear_b_g)
        r, k = x.shape[-3], x.shape[-2]
        xt = x.reshape(*x.shape[:-3], r * k, x.shape[-1]).transpose(-1, -2)  # [*, C_z, R*K]
        if xt.dim() == 2:  # the bias added by the GEMM itself
            p, g = (torch.addmm(lin.bias[:, None], lin.weight, xt) for lin in (proj, gate))
        else:
            p, g = (torch.matmul(lin.weight, xt).add_(lin.bias[:, None]) for lin in (proj, gate))
        p.mul_(torch.sigmoid_(g)).mul_(mask.reshape(*mask.shape[:-3], 1, r * k))
        return p.unflatten(-1, (r, k))

    def _chunked(self, z, pair_mask, options, into, layout):
        # Work on the layout in which the output blocks are rows: the transposed pair for "incoming",
        # where out^T[j, i] = gate(z^T[j, i]) * F(sum_k b(z^T[j, k]) a(z^T[i, k])).
        outgoing = self.direction == "outgoing"
        zz = z if outgoing else z.transpose(-2, -3)
        mm = (pair_mask if outgoing else pair_mask.transpose(-1, -2)).to(z.dtype)[..., None]
        row_proj, all_proj = ("a", "b") if outgoing else ("b", "a")
        n, c_h, c_z = zz.shape[-3], self.linear_a_p.out_features, zz.shape[-1]
        chunk = options.rows_per_chunk(n, zz.shape[-2] * (4 * c_h + 5 * c_z) * z.element_size())
        if chunk is not None:  # blocks as large as the shared buffer below: no higher peak, fewer small GEMMs
            chunk = max(chunk, 1 << max(0, (c_h * zz.shape[-2] // (4 * c_h + 5 * c_z)).bit_length() - 1))
        if layout.world > 1:  # rows outermost in memory: the gather sends the buffer as it is, no transposed copy
            shared = zz.new_empty(n, *zz.shape[:-3], c_h, zz.shape[-2]).movedim(0, -2)  # [*, C, J, K] view
        else:
            shared = zz.new_empty(*zz.shape[:-3], c_h, n, zz.shape[-2])  # [*, C, J, K]
        for r0, r1 in row_blocks(n, chunk):
            x = self.layer_norm_in(zz[..., r0:r1, :, :])
            shared[..., r0:r1, :] = self._gated_t(x, mm[..., r0:r1, :, :], all_proj)
        shared = layout.gather(shared, -2, zz.shape[-2])  # every row's projection
        target = z.new_empty(z.shape) if into is None else into
        out = target if outgoing else target.transpose(-2, -3)
        for r0, r1 in row_blocks(n, chunk):
            x = self.layer_norm_in(zz[..., r0:r1, :, :])
            rows = self._gated_t(x, mm[..., r0:r1, :, :], row_proj)  # [*, C, R, K], contiguous
            p = torch.matmul(rows, shared.transpose(-1, -2)).movedim(-3, -1)  # [*, R, J, C]
            del rows
            piece = self.linear_z(self.layer_norm_out(p)).mul_(torch.sigmoid_(self.linear_g(x)))
            if into is None:
                out[..., r0:r1, :, :] = piece
            else:
                out[..., r0:r1, :, :] += piece
        return target


class TriangleAttention(nn.Module):
    """AlphaFold2 suppl. Alg. 13 (starting node: attention along rows) and Alg. 14 (ending node: along
    columns, computed on the transposed pair)."""

    def __init__(self, c_z: int, heads: int, head_dim: int, node: str):
        super().__init__()
        if node not in ("starting", "ending"):
            raise ValueError(f"TriangleAttention: node must be 'starting' or 'ending', got {node!r}")
        self.node = node
        self.layer_norm = LayerNorm(c_z)
        self.linear = Linear(c_z, heads, bias=False)
        self.mha = Attention(c_z, c_z, heads, head_dim, c_z)

    def forward(
        self, z: torch.Tensor, pair_mask: torch.Tensor, options: InferenceOptions, layout: Layout = SINGLE_PROCESS
    ) -> torch.Tensor:
        """z: [*, N, N, C_z]; pair_mask: [*, N, N]. Returns the update to z. Under `layout`, z and pair_mask
        hold the local rows (starting node) or columns (ending node); the bias is gathered."""
        return self._run(z, pair_mask, options, None, layout)

    def residual_(
        self, z: torch.Tensor, pair_mask: torch.Tensor, options: InferenceOptions, layout: Layout = SINGLE_PROCESS
    ) -> torch.Tensor:
        """z + forward(...), added row block by row block into z when `options.fused_residual` (the bias
        is taken from the whole z first, so the blocks see the z before this update)."""
        if not options.fused_residual:
            return options.add_(z, self(z, pair_mask, options, layout))
        self._run(z, pair_mask, options, z, layout)
        return z

    def _run(self, z, pair_mask, options, into, layout):
        if self.node == "ending":
            z, pair_mask = z.transpose(-2, -3), pair_mask.transpose(-1, -2)
            into = None if into is None else into.transpose(-2, -3)
        bias = _pair_bias(self.layer_norm, self.linear, z, options, layout)  # [*, 1, H, N, N]
        mask = mask_keep(pair_mask)[..., :, None, None, :]  # [*, N, 1, 1, N]
        out = _row_attention(self.layer_norm, self.mha, z, mask, bias, options, into)
        return out.transpose(-2, -3) if self.node == "ending" else out


class PairStack(nn.Module):
    """The pair half of an Evoformer block (AlphaFold2 suppl. Alg. 6 lines 11-15): the triangle multiplications
    (outgoing, incoming), the triangle attentions (starting, ending node), the transition. `attention_first`:
    the template pair block (Alg. 16), the attentions before the multiplications; AlphaFold-Multimer's template
    blocks keep the Evoformer order (`TemplatePairStackMultimer`)."""

    def __init__(
        self, c_z: int, tri_mul_channels: int, heads: int, head_dim: int, transition_factor: int,
        attention_first: bool = False,
    ):
        super().__init__()

        def multiplications() -> None:
            self.tri_mul_out = TriangleMultiplication(c_z, tri_mul_channels, "outgoing")
            self.tri_mul_in = TriangleMultiplication(c_z, tri_mul_channels, "incoming")

        def attentions() -> None:
            self.tri_att_start = TriangleAttention(c_z, heads, head_dim, "starting")
            self.tri_att_end = TriangleAttention(c_z, heads, head_dim, "ending")

        self.attention_first = attention_first
        for register in (attentions, multiplications) if attention_first else (multiplications, attentions):
            register()  # in running order, the order of the parameters too
        self.pair_transition = Transition(c_z, transition_factor)

    def forward(
        self, z: torch.Tensor, pair_mask: torch.Tensor, options: InferenceOptions, layout: Layout = SINGLE_PROCESS
    ) -> torch.Tensor:
        """z: [*, N, N, C_z] (the local rows under `layout`); pair_mask: [*, N, N] (whole). A template block
        takes t [*, N_templ, N, N, C_t] and pair_mask [*, 1, N, N]. Returns the new z."""
        n = z.shape[-2]
        rows, cols = layout.split(pair_mask, -2), layout.split(pair_mask, -1)
        updates = [(self.tri_mul_out, self.tri_mul_in), (self.tri_att_start, self.tri_att_end)]
        for k, (by_rows, by_cols) in enumerate(updates[::-1] if self.attention_first else updates):
            if k:
                z = layout.move(z, -2, -3, n)
            z = by_rows.residual_(z, rows, options, layout)
            z = layout.move(z, -3, -2, n)  # the second update of each pair needs whole columns
            z = by_cols.residual_(z, cols, options, layout)
        z = self.pair_transition.residual_(z, options)
        return layout.move(z, -2, -3, n)


class EvoformerBlock(nn.Module):
    """AlphaFold2 suppl. Alg. 6 (one Evoformer block; with global column attention, Alg. 18's block).

    `opm_first`: AlphaFold-Multimer's order, the outer product mean at the start of the block (before the row
    attention) instead of after the MSA transition; off for the monomer models."""

    def __init__(self, cfg: EvoformerStackConfig, opm_first: bool = False):
        super().__init__()
        self.opm_first = opm_first
        self.msa_att_row = MSARowAttentionWithPairBias(cfg.c_m, cfg.c_z, cfg.msa_heads, cfg.msa_head_dim)
        if cfg.column_attention == "global":
            self.msa_att_col: nn.Module = MSAColumnGlobalAttention(cfg.c_m, cfg.msa_heads, cfg.column_head_dim)
        else:
            self.msa_att_col = MSAColumnAttention(cfg.c_m, cfg.msa_heads, cfg.column_head_dim)
        self.msa_transition = Transition(cfg.c_m, cfg.msa_transition_factor)
        self.outer_product_mean = OuterProductMean(cfg.c_m, cfg.c_z, cfg.opm_channels)
        self.pair_stack = PairStack(
            cfg.c_z, cfg.tri_mul_channels, cfg.pair_heads, cfg.pair_head_dim, cfg.pair_transition_factor
        )

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        options: InferenceOptions,
        layout: Layout = SINGLE_PROCESS,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """m: [*, S, N, C_m]; z: [*, N, N, C_z] (both the local rows under `layout`); msa_mask: [*, S, N];
        pair_mask: [*, N, N] (whole). Returns (m, z)."""
        s, n = msa_mask.shape[-2], msa_mask.shape[-1]
        if self.opm_first:  # the outer product mean reads m by columns
            m = layout.move(m, -3, -2, s)
            z = self.outer_product_mean.residual_(z, m, msa_mask, options, layout)
            m = layout.move(m, -2, -3, n)
        m = self.msa_att_row.residual_(m, z, layout.split(msa_mask, -2), options, layout)
        m = layout.move(m, -3, -2, s)  # the column updates need whole columns
        m = self.msa_att_col.residual_(m, layout.split(msa_mask, -1), options)
        m = self.msa_transition.residual_(m, options)
        if not self.opm_first:
            z = self.outer_product_mean.residual_(z, m, msa_mask, options, layout)
        m_rows = layout.move_async(m, -2, -3, n)  # overlaps the pair stack
        del m
        z = self.pair_stack(z, pair_mask, options, layout)
        return m_rows.wait(), z


ExtraMSABlock = EvoformerBlock
"""The extra-MSA block is the Evoformer block with global column attention (AlphaFold2 suppl. Alg. 18)."""


class _Stack(nn.Module):
    """Blocks run in turn on activations split across processes by `layout`."""

    def __init__(self, blocks: Iterable[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.layout: Layout = SINGLE_PROCESS
        """How the activations are spread over processes (`fastfold.parallelize_dap` installs a split one)."""

    def _msa_blocks(self, m, z, msa_mask, pair_mask, options):
        """Every (Evoformer-like) block on m [*, S, N, C] and z [*, N, N, C_z]; both returned as the local rows."""
        m, z = self.layout.split(m, -3), self.layout.split(z, -3)
        for block in self.blocks:
            m, z = block(m, z, msa_mask, pair_mask, options, self.layout)
        return m, z


class EvoformerStack(_Stack):
    """AlphaFold2 suppl. Alg. 6 stack plus the single-representation projection (Alg. 2 line 17); `opm_first`
    for AlphaFold-Multimer (see `EvoformerBlock`)."""

    def __init__(self, cfg: EvoformerStackConfig, opm_first: bool = False):
        super().__init__(EvoformerBlock(cfg, opm_first) for _ in range(cfg.num_blocks))
        self.linear = Linear(cfg.c_m, cfg.c_s)

    def forward(
        self, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor, pair_mask: torch.Tensor,
        options: InferenceOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """m: [*, S, N, C_m]; z: [*, N, N, C_z]. Returns (m, z, s) with s: [*, N, C_s] from the first MSA row."""
        s, n = m.shape[-3], z.shape[-2]
        m, z = self._msa_blocks(m, z, msa_mask, pair_mask, options)
        m = self.layout.gather(m, -3, s)
        return m, self.layout.gather(z, -3, n), self.linear(m[..., 0, :, :])


class ExtraMSAStack(_Stack):
    """AlphaFold2 suppl. Alg. 18: the extra-MSA stack; only its pair output is used."""

    def __init__(self, cfg: EvoformerStackConfig, opm_first: bool = False):
        super().__init__(EvoformerBlock(cfg, opm_first) for _ in range(cfg.num_blocks))

    def forward(
        self, a: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor, pair_mask: torch.Tensor,
        options: InferenceOptions,
    ) -> torch.Tensor:
        """a: [*, S_extra, N, C_e]; z: [*, N, N, C_z]. Returns the new z."""
        n = z.shape[-2]
        _, z = self._msa_blocks(a, z, msa_mask, pair_mask, options)
        return self.layout.gather(z, -3, n)


class TemplatePairStack(_Stack):
    """AlphaFold2 suppl. Alg. 16: template pair blocks (`PairStack`, attentions first) and a final LayerNorm."""

    def __init__(self, cfg: TemplateConfig, attention_first: bool = True):
        super().__init__(
            PairStack(cfg.c_t, cfg.tri_mul_channels, cfg.pair_heads, cfg.pair_head_dim, cfg.pair_transition_factor,
                      attention_first)
            for _ in range(cfg.num_blocks)
        )
        self.layer_norm = LayerNorm(cfg.c_t)

    def forward(self, t: torch.Tensor, pair_mask: torch.Tensor, options: InferenceOptions) -> torch.Tensor:
        """t: [*, N_templ, N, N, C_t]; pair_mask: [*, 1, N, N]. Returns [*, N_templ, N, N, C_t]."""
        layout, n = self.layout, t.shape[-2]
        t = layout.split(t, -3)
        for block in self.blocks:
            t = block(t, pair_mask, options, layout)
        return layout.gather(self.layer_norm(t), -3, n)
