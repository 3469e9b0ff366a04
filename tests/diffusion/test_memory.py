"""diffusion.memory: attention-keeping checkpointing (same gradients, no attention recompute), module order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lowmem.diffusion.attention import set_kernels_attention
from lowmem.diffusion.memory import _attention_ops, enable_checkpointing, order_modules_by_use, unet_module_order


class _CountAttention(TorchDispatchMode):
    """Counts the fused attention ops that really run (SAC answers kept ones without dispatching further)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _attention_ops():
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _inputs(unet, seed=0):
    g = torch.Generator().manual_seed(seed)
    side = unet.config.sample_size
    x = torch.randn(2, unet.config.in_channels, side, side, generator=g)
    hidden = torch.randn(2, 7, unet.config.cross_attention_dim, generator=g)
    return x, torch.tensor([3, 700]), hidden


def _grads(unet, policy):
    if policy is None:
        unet.disable_gradient_checkpointing()
    else:
        enable_checkpointing(unet, policy)
    unet.zero_grad(set_to_none=True)
    x, t, hidden = _inputs(unet)
    loss = F.mse_loss(unet(x, t, hidden).sample, torch.zeros_like(x))
    counter = _CountAttention()
    with counter:
        loss.backward()
    return {n: p.grad.clone() for n, p in unet.named_parameters()}, counter.calls


def test_keep_attention_matches_plain_gradients_without_recomputing_attention(tiny):
    unet = tiny["unet"].train()
    set_kernels_attention(unet, "auto")  # CPU: PyTorch's fused SDPA op
    plain, _ = _grads(unet, None)
    full, full_calls = _grads(unet, "full")
    kept, kept_calls = _grads(unet, "keep_attention")
    assert full_calls > 0, "full checkpointing recomputes the attention in backward"
    assert kept_calls == 0, "keep_attention must not run the attention again in backward"
    for name, g in plain.items():
        torch.testing.assert_close(kept[name], g, msg=name)
        torch.testing.assert_close(full[name], g, msg=name)


def test_keep_attention_keeps_only_where_the_attention_outweighs_its_dispatch_cost(tiny):
    """Blocks with fewer tokens than channels recompute their attention like `full` (keeping it would save less than
    the selective policy's Python call per op costs); the gradients stay those of the unchecked model."""
    unet = tiny["unet"].train()
    set_kernels_attention(unet, "auto")
    side = unet.config.sample_size
    unet.config.sample_size = 4  # 16 tokens at 32 channels, 4 at 64: fewer tokens than channels everywhere
    try:
        plain, _ = _grads(unet, None)
        kept, kept_calls = _grads(unet, "keep_attention")
    finally:
        unet.config.sample_size = side
    assert kept_calls > 0, "a block with fewer tokens than channels recomputes its attention"
    for name, g in plain.items():
        torch.testing.assert_close(kept[name], g, msg=name)


def test_unknown_policy_is_refused(tiny):
    with pytest.raises(ValueError, match="policy"):
        enable_checkpointing(tiny["unet"], "sometimes")


def test_order_modules_by_use_keeps_names_and_outputs(tiny):
    unet = tiny["unet"].eval()
    x, t, hidden = _inputs(unet, seed=1)
    keys = set(unet.state_dict())
    with torch.no_grad():
        before = unet(x, t, hidden).sample
    order_modules_by_use(unet)
    names = list(unet._modules)
    assert names.index("mid_block") == names.index("up_blocks") - 1
    assert set(unet.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(unet(x, t, hidden).sample, before, rtol=0, atol=0)
    order_modules_by_use(unet)  # already in order: unchanged
    assert list(unet._modules) == names


def _first_use(unet, *inputs, **kwargs) -> list[str]:
    """The parameter-owning modules of `unet` in the order they first run on real inputs."""
    owners = {m: n for n, m in unet.named_modules() if next(m.parameters(recurse=False), None) is not None}
    order: list[str] = []
    hooks = [m.register_forward_pre_hook(lambda m, _: order.append(owners[m]) if owners[m] not in order else None)
             for m in owners]
    with torch.no_grad():
        unet(*inputs, **kwargs)
    for h in hooks:
        h.remove()
    return order


def test_unet_module_order_is_the_order_modules_first_run(tiny):
    """The meta-device trace gives the order a real forward runs the modules in (the mid block between the down
    and up blocks, resnets and attentions interleaved), every parameter-owning module once; also for an SDXL-style
    UNet (`text_time` conditioning)."""
    from diffusers import UNet2DConditionModel

    unet = tiny["unet"]
    x, t, hidden = _inputs(unet)
    order = unet_module_order(unet)
    assert order == _first_use(unet, x, t, hidden)
    named = [n for n, m in unet.named_modules() if next(m.parameters(recurse=False), None) is not None]
    assert sorted(order) == sorted(named) and order != named  # registration order differs from use
    top = [n.split(".")[0] for n in order]
    assert max(i for i, n in enumerate(top) if n == "down_blocks") < top.index("mid_block") < top.index("up_blocks")

    torch.manual_seed(0)
    sdxl = UNet2DConditionModel(sample_size=8, block_out_channels=(32, 64), layers_per_block=1,
                                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=(2, 4), use_linear_projection=True, addition_embed_type="text_time",
                                addition_time_embed_dim=8, projection_class_embeddings_input_dim=32 + 6 * 8)
    cond = {"text_embeds": torch.randn(1, 32), "time_ids": torch.randn(1, 6)}
    got = unet_module_order(sdxl)
    assert got == _first_use(sdxl, torch.randn(1, 4, 8, 8), torch.ones(1), torch.randn(1, 5, 32),
                             added_cond_kwargs=cond)
    assert any(n.startswith("add_embedding") for n in got)


def test_level_checkpointing_recomputes_only_the_top_levels_with_the_same_gradients(tiny):
    """`levels=1` checkpoints only the blocks at full latent size; lower blocks keep their activations. The
    gradients are those of the unchecked model, and fewer ops run again in backward than with every block."""
    from lowmem.diffusion.memory import LevelCheckpoint

    unet = tiny["unet"].train()
    set_kernels_attention(unet, "auto")
    plain, _ = _grads(unet, None)

    def recomputed(levels):
        enable_checkpointing(unet, "full", levels)
        func = unet.down_blocks[0]._gradient_checkpointing_func
        assert isinstance(func, LevelCheckpoint)
        unet.zero_grad(set_to_none=True)
        x, t, hidden = _inputs(unet)
        loss = F.mse_loss(unet(x, t, hidden).sample, torch.zeros_like(x))
        decided = dict(func._decided.items())
        counter = _CountConvs()
        with counter:
            loss.backward()
        return {n: p.grad.clone() for n, p in unet.named_parameters()}, decided, counter.calls

    top, decided_top, convs_top = recomputed(1)
    every, decided_all, convs_all = recomputed(10)
    for name, g in plain.items():
        torch.testing.assert_close(top[name], g, msg=name)
        torch.testing.assert_close(every[name], g, msg=name)
    assert all(decided_all.values())
    checkpointed = {m for m, use in decided_top.items() if use}
    assert checkpointed and len(checkpointed) < len(decided_top)
    assert all(m in checkpointed for m in unet.down_blocks[0].resnets)  # full size: recomputed
    assert not any(m in checkpointed for m in unet.down_blocks[-1].resnets)  # lowest level: kept
    assert convs_top < convs_all
    with pytest.raises(ValueError, match="levels"):
        LevelCheckpoint(lambda m, *a: m(*a), -1)


class _CountConvs(TorchDispatchMode):
    """Forward convolutions run during backward (recomputation)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))
