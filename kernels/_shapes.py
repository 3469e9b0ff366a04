"""Broadcast bookkeeping shared by the kernels: leading dims padded to four, strides of broadcast views.

A Triton program gets a flat row (or batch-head) index and turns it back into four leading indices, so a
bias or mask that broadcasts (stride 0 along a dim) is read in place and never copied.
"""

from __future__ import annotations

import torch

__all__ = ["LEAD_DIMS", "lead_sizes", "lead_strides", "reduce_to"]

LEAD_DIMS = 4


def lead_sizes(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """`shape` (at most four dims) left-padded with ones to four dims."""
    if len(shape) > LEAD_DIMS:
        raise ValueError(f"at most {LEAD_DIMS} leading dims are supported, got {len(shape)}")
    return (1,) * (LEAD_DIMS - len(shape)) + tuple(shape)  # type: ignore[return-value]


def lead_strides(t: torch.Tensor | None, full: tuple[int, ...], n_lead: int) -> tuple[int, ...]:
    """Strides of `t` viewed as broadcast to `full`: four for the padded leading dims, then the rest.

    Broadcast dims get stride 0, so kernels index the original storage. `None` gives all zeros.
    """
    n_rest = len(full) - n_lead
    if t is None:
        return (0,) * (LEAD_DIMS + n_rest)
    strides = t.expand(full).stride()
    lead = strides[:n_lead]
    return (0,) * (LEAD_DIMS - n_lead) + tuple(lead) + tuple(strides[n_lead:])


def reduce_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum `grad` over the dims along which a tensor of `shape` was broadcast; returns `shape`."""
    extra = grad.dim() - len(shape)
    if extra:
        grad = grad.sum(dim=tuple(range(extra)))
    dims = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1)
    if dims:
        grad = grad.sum(dim=dims, keepdim=True)
    return grad.reshape(shape)
