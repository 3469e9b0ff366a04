"""Memory levers for training a diffusers UNet: checkpointing that keeps attention, and use-ordered modules.

- `attention_keeping_checkpoint`: a `gradient_checkpointing_func` for diffusers' `enable_gradient_checkpointing`.
  It is PyTorch's non-reentrant activation checkpointing (what diffusers uses by default) with a selective
  policy: the outputs of the fused attention ops (output and row log-sum-exp, `[B, H, Q, D]` and `[B, H, Q]`,
  small next to the block's other activations) are saved, everything else is recomputed. Backward then
  re-runs the convolutions, norms and projections but not the attention, which is the costliest op of the
  forward at 32x32 latents and above (about 40% of a CPU step at 256 px). Gradients are bit-identical to
  plain checkpointing: the saved values are exactly those the recompute would produce.
- `order_modules_by_use`: `UNet2DConditionModel` registers `mid_block` after `up_blocks`, so its
  `named_parameters()` order is not the order of use. Chunk-based ZeRO packs parameters in that order and
  reduces a chunk's gradients once it and every later chunk are complete; with `mid_block` last, the
  gradient buffers of every up-block chunk wait for the mid block's backward. Moving `mid_block` before
  `up_blocks` (same modules, same parameter names) lets each chunk be reduced as soon as its gradients are in.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["CHECKPOINT_POLICIES", "attention_keeping_checkpoint", "enable_checkpointing", "order_modules_by_use"]

logger = logging.getLogger(__name__)

CHECKPOINT_POLICIES = ("full", "keep_attention")


@functools.cache
def _attention_ops() -> frozenset:
    """The fused attention ops of this PyTorch build whose outputs are kept (missing names are skipped)."""
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    ops = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    return frozenset(ops)


def _keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_keep_attention)


_HAS_ATTENTION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _has_attention(module: torch.nn.Module) -> bool:
    """Whether `module` holds a diffusers `Attention` (cached per module)."""
    found = _HAS_ATTENTION.get(module)
    if found is None:
        found = _HAS_ATTENTION[module] = any(hasattr(m, "processor") and hasattr(m, "to_q") for m in module.modules())
    return found


def attention_keeping_checkpoint(module: torch.nn.Module, *args: Any) -> Any:
    """`module(*args)` under non-reentrant checkpointing that saves the fused attention outputs.

    Modules without attention (the ResNet blocks) get plain checkpointing: the selective policy's dispatch
    mode costs a Python call per op, which only pays where there is an attention to keep.
    """
    if not _has_attention(module):
        return checkpoint(module.__call__, *args, use_reentrant=False)
    return checkpoint(module.__call__, *args, use_reentrant=False, context_fn=_contexts)


def enable_checkpointing(unet: Any, policy: str = "keep_attention") -> None:
    """Turn on `unet`'s gradient checkpointing: `full` (diffusers' default) or `keep_attention`."""
    if policy not in CHECKPOINT_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(CHECKPOINT_POLICIES)}, got {policy!r}")
    unet.enable_gradient_checkpointing(None if policy == "full" else attention_keeping_checkpoint)


def order_modules_by_use(unet: torch.nn.Module) -> None:
    """Register `mid_block` right before `up_blocks` (no-op when either is missing or already in that order)."""
    modules = unet._modules
    names = list(modules)
    if "mid_block" not in names or "up_blocks" not in names or names.index("mid_block") < names.index("up_blocks"):
        return
    mid = modules.pop("mid_block")
    items = list(modules.items())
    modules.clear()
    for name, module in items:
        if name == "up_blocks":
            modules["mid_block"] = mid
        modules[name] = module
    logger.debug("mid_block registered before up_blocks")
