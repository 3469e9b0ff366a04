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
- `unet_module_order`: the order in which a UNet's parameter-owning modules first run (the mid block between
  the down and up blocks, each block's resnets and attentions interleaved), from a forward pass on the meta
  device; declared with `core_parallel.gemini.set_module_order`, Gemini packs its chunks in that order.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["CHECKPOINT_POLICIES", "LevelCheckpoint", "attention_keeping_checkpoint", "enable_checkpointing",
           "order_modules_by_use", "unet_module_order"]

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


def _attention_pays(hidden: Any) -> bool:
    """Whether keeping the attention outputs of a block called on `hidden` ([B, C, H, W] or [B, T, C]) saves more
    than it costs. Of a transformer layer's forward FLOPs, self-attention is about T / (9 C + T) (4 T^2 C against
    36 T C^2 in the projections and the feed-forward): under a tenth where there are fewer tokens T than channels C,
    and the selective policy's dispatch mode costs a Python call per op of the block, in forward and in the
    recompute (SDXL at 256 px, 64-256 tokens at 640-1280 channels: 1.1 s of a 6.3 s step, none of it won back)."""
    shape = getattr(hidden, "shape", ())
    if len(shape) == 4:
        return shape[2] * shape[3] >= shape[1]
    return len(shape) == 3 and shape[1] >= shape[2]


def attention_keeping_checkpoint(module: torch.nn.Module, *args: Any) -> Any:
    """`module(*args)` under non-reentrant checkpointing that saves the fused attention outputs.

    Modules without attention (the ResNet blocks), and blocks whose attention is a small part of their work
    (`_attention_pays`), get plain checkpointing: the selective policy's dispatch mode costs a Python call per op,
    which only pays where there is a costly attention to keep.
    """
    if not _has_attention(module) or not _attention_pays(args[0] if args else None):
        return checkpoint(module.__call__, *args, use_reentrant=False)
    return checkpoint(module.__call__, *args, use_reentrant=False, context_fn=_contexts)


def _full_checkpoint(module: torch.nn.Module, *args: Any) -> Any:
    return checkpoint(module.__call__, *args, use_reentrant=False)


def _area(x: Any) -> int:
    """Spatial positions of a block's input: H*W of [B, C, H, W], the sequence length of [B, S, C]."""
    if isinstance(x, torch.Tensor) and x.dim() == 4:
        return x.shape[-2] * x.shape[-1]
    if isinstance(x, torch.Tensor) and x.dim() == 3:
        return x.shape[1]
    return 0


class LevelCheckpoint:
    """A `gradient_checkpointing_func` that checkpoints only the blocks of the `levels` highest resolutions.

    A UNet level's convolutions cost about the same at every resolution (H*W halves per level as the channels
    double, so H*W*C^2 stays), while its activations shrink with H*W*C, by half per level down. Recomputing
    the top level therefore buys back the most memory per second spent; each lower level kept in memory
    saves as much recompute as the top one for half its memory. Each block decides once, on its first call,
    by comparing its input's spatial size with the largest seen so far (the first block is at full size).
    `levels=None` checkpoints every block.
    """

    def __init__(self, fn: Any, levels: int | None) -> None:
        if levels is not None and levels < 0:
            raise ValueError(f"levels must be >= 0 or None, got {levels}")
        self.fn, self.levels = fn, levels
        self._max_area = 0
        self._decided: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, module: torch.nn.Module, *args: Any) -> Any:
        use = self._decided.get(module)
        if use is None:
            area = _area(args[0]) if args else 0
            self._max_area = max(self._max_area, area)
            use = self.levels is None or area * 4**self.levels > self._max_area
            self._decided[module] = use
        return self.fn(module, *args) if use else module(*args)


def enable_checkpointing(unet: Any, policy: str = "keep_attention", levels: int | None = None) -> None:
    """Turn on `unet`'s gradient checkpointing: `full` (diffusers' default) or `keep_attention`; `levels`: only
    the blocks of that many highest resolutions (None: all; see `LevelCheckpoint`)."""
    if policy not in CHECKPOINT_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(CHECKPOINT_POLICIES)}, got {policy!r}")
    if policy == "full" and levels is None:
        unet.enable_gradient_checkpointing(None)
        return
    fn = _full_checkpoint if policy == "full" else attention_keeping_checkpoint
    unet.enable_gradient_checkpointing(fn if levels is None else LevelCheckpoint(fn, levels))


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


def unet_module_order(unet: torch.nn.Module) -> list[str] | None:
    """The qualified names of `unet`'s modules that own parameters, in the order they first run in a forward pass
    (a `UNet2DConditionModel` of `unet.config` built on the meta device and run on meta inputs: no memory, no
    weights read, well under a second). None, logged, where the UNet cannot run so (a config this does not know
    how to feed): the caller then keeps `named_parameters()` order, which is slower under Gemini, not wrong."""
    from diffusers import UNet2DConditionModel

    cfg = unet.config
    try:
        with torch.device("meta"):
            model = UNet2DConditionModel.from_config(cfg)
            size = cfg.sample_size if isinstance(cfg.sample_size, int) else cfg.sample_size[0]
            width = cfg.cross_attention_dim
            hidden = torch.empty(1, 8, width if isinstance(width, int) else width[0])
            kwargs: dict[str, Any] = {}
            if cfg.addition_embed_type == "text_time":  # SDXL: pooled text and the six size/crop numbers
                text = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
                kwargs["added_cond_kwargs"] = {"text_embeds": torch.empty(1, text), "time_ids": torch.empty(1, 6)}
            order: list[str] = []
            owners = {m: name for name, m in model.named_modules() if next(m.parameters(recurse=False), None)
                      is not None}
            hooks = [m.register_forward_pre_hook(lambda m, _: order.append(owners.pop(m)) if m in owners else None)
                     for m in owners]
            with torch.no_grad():
                model(torch.empty(1, cfg.in_channels, size, size), torch.ones(1), hidden, **kwargs)
            for h in hooks:
                h.remove()
    except Exception as exc:  # noqa: BLE001 - an optimisation: any failure keeps the registration order
        logger.info("UNet module order not traced (%s: %s); Gemini packs its chunks in registration order",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    return order + list(owners.values())  # modules that never ran, last
