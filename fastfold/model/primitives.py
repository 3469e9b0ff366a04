"""Building blocks shared by the modules: Linear, LayerNorm, gated multi-head attention, chunked application and
its cost model (how many rows one chunk takes).

Attention and LayerNorm go through the `kernels` package (AlphaFold2 suppl. 1.11.1 for the attention form).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ... import kernels
from .options import InferenceOptions

__all__ = ["Attention", "LayerNorm", "Linear", "attention_chunk", "chunked", "mask_keep", "row_blocks", "row_chunk"]

LayerNorm = kernels.LayerNorm
"""torch.nn.LayerNorm-compatible (weight/bias, eps 1e-5) through `kernels.layer_norm`."""


class Linear(nn.Linear):
    """`torch.nn.Linear`; weight `[out, in]` (AlphaFold stores `[in, out]`; fastfold.params transposes)."""


def mask_keep(mask: torch.Tensor) -> torch.Tensor:
    """Float 0/1 mask to the boolean keep-mask the kernels take. mask: any shape."""
    return mask > 0.5 if mask.dtype != torch.bool else mask


def row_blocks(total: int, chunk: int | None) -> list[tuple[int, int]]:
    """(start, stop) pairs covering range(total) in steps of `chunk` (one block when chunk is None)."""
    step = total if chunk is None else max(1, chunk)
    return [(i, min(i + step, total)) for i in range(0, total, step)] or [(0, 0)]


def chunked(
    fn: Callable[..., torch.Tensor],
    args: Sequence[torch.Tensor | None],
    dim: int,
    chunk: int | None,
    shared: Sequence[torch.Tensor | None] = (),
    *,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fn(*args, *shared)` computed in slices of `chunk` along dim `dim` of every tensor in `args`.

    Tensors in `args` whose size along `dim` is 1 are broadcast to every slice; `shared` ones are passed
    whole. The output is concatenated along the same dim (counted from the end when negative).

    With `into`, each slice of the output is instead added in place to the same slice of `into`, which is
    returned: a fused residual update that never holds the whole update. A slice of `into` may be read by
    `fn` for its own slice only (it is updated after `fn` returns); `shared` must not alias `into`.
    """
    if chunk is None:
        return fn(*args, *shared) if into is None else into.add_(fn(*args, *shared))
    total = max(a.shape[dim] for a in args if a is not None)
    out: torch.Tensor | None = into
    for start in range(0, total, chunk):
        sl = [
            None if a is None else (a if a.shape[dim] == 1 else a.narrow(dim, start, min(chunk, total - start)))
            for a in args
        ]
        piece = fn(*sl, *shared)
        if into is not None:
            into.narrow(dim, start, piece.shape[dim]).add_(piece)
            continue
        if out is None:
            shape = list(piece.shape)
            shape[dim] = total
            out = piece.new_empty(shape)
        out.narrow(dim, start, piece.shape[dim]).copy_(piece)
    assert out is not None
    return out


# The chunk-cost model: rows per chunk from the bytes one row's intermediates take, under `options`.


def row_chunk(options: InferenceOptions, x: torch.Tensor, per_row_elems: int) -> int | None:
    """Rows per chunk along dim -3 of `x` when one row's intermediates take `per_row_elems` of x's dtype."""
    return options.rows_per_chunk(x.shape[-3], per_row_elems * x.element_size())


def attention_chunk(options: InferenceOptions, rows: int, heads: int, length: int, c: int, itemsize: int) -> int | None:
    """Rows per chunk of a row-wise attention: per row, the q/k/v/gate/output projections (5 x L x C),
    LayerNorm output and input slices, plus one block of scores (heads x L x L, blocked again inside)."""
    return options.rows_per_chunk(rows, (8 * length * c + heads * length * min(length, 256)) * itemsize)


class Attention(nn.Module):
    """Multi-head attention with optional sigmoid gating (AlphaFold2 suppl. Alg. 7 lines 2-7, 1.11.1).

    Parameters as AlphaFold names them: query/key/value without bias, gating with bias, output with bias.
    """

    def __init__(self, c_q: int, c_kv: int, heads: int, head_dim: int, c_out: int, *, gating: bool = True):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.linear_q = Linear(c_q, heads * head_dim, bias=False)
        self.linear_k = Linear(c_kv, heads * head_dim, bias=False)
        self.linear_v = Linear(c_kv, heads * head_dim, bias=False)
        self.linear_g = Linear(c_q, heads * head_dim) if gating else None
        self.linear_o = Linear(heads * head_dim, c_out)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(-2, -3)  # [*, H, L, C]

    def forward(
        self,
        q_x: torch.Tensor,
        kv_x: torch.Tensor,
        mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q_x: [*, Q, C_q]; kv_x: [*, K, C_kv]; mask: bool keep-mask broadcastable to [*, H, Q, K];
        bias: broadcastable to [*, H, Q, K]. Returns [*, Q, C_out]."""
        q = self._split(self.linear_q(q_x))
        k = self._split(self.linear_k(kv_x))
        v = self._split(self.linear_v(kv_x))
        o = kernels.attention(q, k, v, bias=bias, mask=mask).transpose(-2, -3)  # [*, Q, H, C]
        if self.linear_g is not None:
            o = o * torch.sigmoid(self.linear_g(q_x)).unflatten(-1, (self.heads, self.head_dim))
        return self.linear_o(o.flatten(-2))
