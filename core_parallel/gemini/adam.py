"""Vectorised optimizer updates on flat fp32 buffers (one call per contiguous run of a chunk shard).

The formulas follow `torch.optim.Adam` / `AdamW` / `SGD` (single-tensor path) operation for operation,
so a shard updated here matches the same elements updated by torch within fp32 rounding. NVMe-resident
buffers are updated in blocks (`block`) so only one block of each buffer is paged in at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["AdamHyper", "SgdHyper", "adam_update_", "sgd_update_", "blocked"]


@dataclass(frozen=True)
class AdamHyper:
    """Adam/AdamW hyperparameters of one param group at one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    """AdamW: decay the weights directly instead of adding weight_decay * param to the gradient."""


@dataclass(frozen=True)
class SgdHyper:
    """SGD hyperparameters of one param group."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool


def adam_update_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, h: AdamHyper
) -> None:
    """One Adam step in place. All tensors: [n] fp32 on one device; `step` counts this step (>= 1).

    `grad` is read only (weight decay builds a new tensor).
    """
    if h.weight_decay != 0:
        if h.decoupled:
            param.mul_(1 - h.lr * h.weight_decay)
        else:
            grad = grad.add(param, alpha=h.weight_decay)
    exp_avg.lerp_(grad, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    bias_correction1 = 1 - h.beta1**step
    bias_correction2_sqrt = math.sqrt(1 - h.beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(h.eps)
    param.addcdiv_(exp_avg, denom, value=-(h.lr / bias_correction1))


def sgd_update_(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, step: int, h: SgdHyper) -> None:
    """One SGD step in place. `buf` is the momentum buffer ([n], None without momentum); `step` >= 1."""
    if h.weight_decay != 0:
        grad = grad.add(param, alpha=h.weight_decay)
    if h.momentum != 0:
        assert buf is not None, "SGD with momentum needs a momentum buffer"
        if step == 1:
            buf.copy_(grad)
        else:
            buf.mul_(h.momentum).add_(grad, alpha=1 - h.dampening)
        grad = grad.add(buf, alpha=h.momentum) if h.nesterov else buf
    param.add_(grad, alpha=-h.lr)


def blocked(start: int, stop: int, block: int, fn: Callable[[int, int], None]) -> None:
    """Call `fn(lo, hi)` on consecutive blocks of [start, stop) of at most `block` elements."""
    for lo in range(start, stop, block):
        fn(lo, min(stop, lo + block))
