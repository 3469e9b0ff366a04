"""Shared pieces of the Gemini tests: a tiny model with odd sizes, tied, frozen and sometimes-unused
parameters, its data, and a training loop run either by Gemini on ranks or by plain torch on one process."""

from __future__ import annotations

import torch
import torch.nn as nn

from lowmem import core_parallel
from lowmem.core_parallel.gemini import GeminiConfig
from lowmem.core_parallel.gemini.state import ChunkState

GLOBAL_BATCH = 8
STEPS = 5


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 7)
        self.l1 = nn.Linear(7, 11)
        self.frozen = nn.Linear(11, 11)
        self.l2 = nn.Linear(11, 7)
        self.sometimes = nn.Linear(7, 7)  # used on even steps only
        self.head = nn.Linear(7, 13, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor, use_extra: bool | str) -> torch.Tensor:
        """`use_extra`: True, False, or "detached" (run `sometimes` but let no gradient reach it)."""
        h = self.emb(x)
        h = torch.tanh(self.frozen(torch.relu(self.l1(h))))
        h = self.l2(h)
        if use_extra == "detached":
            h = h + self.sometimes(h).detach()
        elif use_extra:
            h = h + self.sometimes(h)
        return self.head(h)


def build(kind: str = "adam") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny()
    trainable = [p for n, p in model.named_parameters() if p.requires_grad and n != "l2.weight"]
    groups = [{"params": trainable}, {"params": [model.l2.weight], "lr": 0.03, "weight_decay": 0.1}]
    if kind == "adam":
        opt = torch.optim.Adam(groups, lr=0.01, weight_decay=0.01)
    elif kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=0.01)
    else:
        opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True)
    return model, opt


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, 13, (GLOBAL_BATCH, 3), generator=g), torch.randn(GLOBAL_BATCH, 3, 13, generator=g)


def _loss(model, x, y, step):
    return ((model(x, step % 2 == 0) - y) ** 2).mean()


def train_reference(kind: str, steps: range, accum: int = 1, clip: float | None = None, state=None):
    """Plain torch on one process; returns (model, optimizer)."""
    model, opt = state or build(kind)
    for step in steps:
        for micro in range(accum):
            x, y = batch(step, micro)
            (_loss(model, x, y, step) / accum).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        opt.zero_grad()
    return model, opt


def train_sharded(rank: int, world: int, model, opt, steps: range, accum: int = 1, mode: str = "no_sync") -> None:
    """The same loop on rank `rank` of `world` with a core_parallel optimizer (local slice of the batch)."""
    per = GLOBAL_BATCH // world
    for step in steps:
        for micro in range(accum):
            x, y = batch(step, micro)
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
            loss = _loss(model, x, y, step) / accum
            if mode == "no_sync" and micro < accum - 1:
                with opt.no_sync():
                    opt.backward(loss)
            else:
                opt.backward(loss)
        opt.step()
        opt.zero_grad()


SCENARIOS = {
    "device": dict(kind="adam", cfg=dict(chunk_mb=40 * 4 / 2**20)),
    "optim_cpu": dict(kind="adamw", cfg=dict(chunk_mb=64 * 4 / 2**20, offload_optim_frac=1.0, prefetch=2)),
    # collectives through gloo instead of shared memory, as on accelerators: prefetched (async) gathers,
    # reduce-scatters in flight, the step's check that every rank issued the same collectives
    "gloo": dict(kind="adamw", cfg=dict(chunk_mb=40 * 4 / 2**20, prefetch=2, host_collectives=False,
                                        peer_reads=False)),
    "nvme": dict(kind="sgd", cfg=dict(chunk_mb=50 * 4 / 2**20, offload_param_frac=1.0, offload_optim_frac=1.0)),
    # gradients on NVMe clipped: the factor applied where the step stages them
    "nvme_clip": dict(kind="adamw", cfg=dict(chunk_mb=50 * 4 / 2**20, offload_param_frac=1.0, offload_optim_frac=1.0,
                                             max_grad_norm=0.5)),
    "auto": dict(kind="adam", cfg=dict(chunk_mb=40 * 4 / 2**20, placement="auto", device_memory_budget=2600)),
    "accum_no_sync": dict(kind="adam", cfg=dict(chunk_mb=40 * 4 / 2**20, max_grad_norm=0.5), accum=2),
    "accum_sync": dict(kind="adam", cfg=dict(chunk_mb=None), accum=3, mode="sync"),
}


def run_scenario(rank: int, world: int, name: str, tmp: str) -> dict:
    """Train scenario `name` with Gemini; returns the final model and optimizer state dicts (all ranks call)."""
    sc = SCENARIOS[name]
    cfg = dict(sc["cfg"])
    if name in ("nvme", "nvme_clip", "auto"):
        cfg["offload_dir"] = f"{tmp}/{name}-w{world}"
    model, opt = build(sc["kind"])
    model, opt = core_parallel.setup(model, opt, GeminiConfig(**cfg))
    train_sharded(rank, world, model, opt, range(STEPS), sc.get("accum", 1), sc.get("mode", "no_sync"))
    report = model.memory_report()
    out = {"model": model.state_dict(), "optim": opt.state_dict(), "report": report,
           "host_comm": model.gemini_manager.host_comm is not None}
    model.gemini_manager.close()
    return out


def reference(name: str):
    sc = SCENARIOS[name]
    return train_reference(sc["kind"], range(STEPS), sc.get("accum", 1), sc["cfg"].get("max_grad_norm"))


def assert_close_dicts(got: dict, want: dict, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    assert set(got) == set(want), (set(got) ^ set(want))
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def portable(tree):
    """Tensors -> numpy arrays (results cross the process boundary without shared-memory handles)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy()
    if isinstance(tree, dict):
        return {k: portable(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(portable(v) for v in tree)
    return tree


def tensors(tree):
    """Inverse of `portable`."""
    import numpy as np

    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree)
    if isinstance(tree, dict):
        return {k: tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(tensors(v) for v in tree)
    return tree


def fp16_overflow(rank: int, world: int) -> dict:
    """fp16 Gemini; at step 1 only the last rank sees an inf loss: every rank must skip that step."""
    model, opt = build("adam")
    from lowmem.core_parallel.loss_scaler import LossScalerConfig

    cfg = GeminiConfig(precision="fp16", chunk_mb=40 * 2 / 2**20, loss_scaler=LossScalerConfig(initial_scale=16.0))
    model, opt = core_parallel.setup(model, opt, cfg)
    per = GLOBAL_BATCH // world
    before = after = None
    for step in range(3):
        x, y = batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        loss = ((model(x, True).float() - y) ** 2).mean()
        if step == 1 and rank == world - 1:
            loss = loss * float("inf")
        if step == 1:
            before = model.state_dict()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if step == 1:
            after = model.state_dict()
    final = model.state_dict()
    return {
        "skipped_unchanged": all(torch.equal(before[k], after[k]) for k in before),
        "trained_after": any(not torch.equal(after[k], final[k]) for k in after),
        "scaler": opt.loss_scaler.state_dict(),
        "dtype": str(model.l1.weight.dtype),
    }



# ---- activation checkpointing: forward re-run inside backward, chunk memory returned --------------------
CKPT_CHUNK_MB = 4.0  # one trainable chunk shared by every block: each module call gathers and releases it
CKPT_STEPS = 2


class Checkpointed(nn.Module):
    """Small blocks run under `torch.utils.checkpoint`, so backward re-runs their forward (Gemini's pre-forward
    hooks fire again inside backward); a frozen layer, as a frozen text encoder would be."""

    def __init__(self, blocks: int = 24, width: int = 48) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.LayerNorm(width))
                                    for _ in range(blocks))
        self.frozen = nn.Linear(width, width).requires_grad_(False)
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for i in range(0, len(self.blocks), 3):
            h = checkpoint(self._run, h, i, use_reentrant=reentrant)
        return self.out(self.frozen(h))

    def _run(self, h: torch.Tensor, start: int) -> torch.Tensor:
        for block in self.blocks[start : start + 3]:
            h = h + block(h)
        return h


def _ckpt_build(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Checkpointed().to(dtype)
    return model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)


def _ckpt_batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL_BATCH, 5, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)
    return x.to(dtype).requires_grad_(), y.to(dtype)


def checkpointed_reference(reentrant: bool, dtype: torch.dtype) -> dict:
    """Plain torch on one process in `dtype`."""
    model, opt = _ckpt_build(dtype)
    for step in range(CKPT_STEPS):
        x, y = _ckpt_batch(step, dtype)
        ((model(x, reentrant) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _ckpt_train(rank: int, world: int, reentrant: bool, steps: int) -> tuple[nn.Module, list[int]]:
    model, opt = _ckpt_build()
    model, opt = core_parallel.setup(model, opt, GeminiConfig(chunk_mb=CKPT_CHUNK_MB))
    per = GLOBAL_BATCH // world
    growth = []
    for step in range(steps):
        x, y = _ckpt_batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        before = _rss()
        loss = ((model(x, reentrant) - y) ** 2).mean()
        after_forward = _rss()
        opt.backward(loss)
        growth.append(max(after_forward, _rss()) - before)
        opt.step()
        opt.zero_grad()
    return model, growth


def checkpointed_gemini(rank: int, world: int, reentrant: bool) -> dict:
    """Gemini on this rank: the final weights, the chunks still gathered after the last step, and per step the
    growth of resident memory over forward and backward (sampled after each) in units of one chunk.

    A throwaway model trains one step first, so first-use allocations (gloo buffers, autograd) are not counted.
    """
    _ckpt_train(rank, world, reentrant, 1)
    model, growth = _ckpt_train(rank, world, reentrant, CKPT_STEPS)
    mgr = model.gemini_manager
    chunk = max(c.full_nbytes for c in mgr.chunks)
    return {
        "model": model.state_dict(),
        "gathered": [c.index for c in mgr.chunks if c.sm.data is not ChunkState.RELEASED],
        "growth_chunks": [g / chunk for g in growth],
    }
