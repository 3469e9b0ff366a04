"""`torch.compile` before and after `core_parallel.setup` (issue 43): Gemini's hooks and its guarded-parameter fallback
stay out of dynamo's graphs (they run eagerly at graph breaks), nothing recompiles per chunk, and training equals
plain eager torch within fp32 rounding, on 1 and 2 gloo ranks, for Gemini's device tier, its CPU offload tier and
ZeRO-2.

The backend is `aot_eager` (dynamo's graph capture and AOTAutograd's joint forward/backward graph, run by eager
kernels): what decides whether Gemini's hooks are traced is dynamo, the same for every backend, and inductor's C++
code generation would take minutes on the shared 2-core machine. Before the fix the first forward under Gemini
raised `SpeculationLogDivergence` in `manager.access` (dynamo traced into the chunk gathers).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch._dynamo.testing import CompileCounterWithBackend

from lowmem import core_parallel
from lowmem.core_parallel import GeminiConfig, ZeroConfig, run_on_ranks

STEPS = 3
BLOCKS = 5
BATCH = 6  # global; split evenly across ranks
CONFIGS = {
    "gemini": GeminiConfig(chunk_mb=0.0008, host_collectives=False, peer_reads=False),  # a layer per chunk; gloo
    "gemini_offload": GeminiConfig(chunk_mb=0.0008, offload_param_frac=1.0, offload_optim_frac=1.0),
    "zero2": ZeroConfig(stage=2),
}


class Block(nn.Module):
    """Two layers and a read of a sibling's weight in the block's own forward (Gemini's fallback path, inside a
    compiled frame)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = torch.tanh(self.a(h))
        return h + self.b(u) + 0.1 * torch.tanh(u @ self.a.weight.t())


class Net(nn.Module):
    def __init__(self, blocks: int = BLOCKS, width: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _data(step: int) -> torch.Tensor:
    return torch.randn(BATCH, 5, generator=torch.Generator().manual_seed(100 + step))


def _train(name: str | None, when: str | None, rank: int = 0, world: int = 1) -> dict:
    """STEPS of SGD; `name`: a key of CONFIGS or None (plain torch); `when`: compile "before" or "after" setup, or
    None (eager). Returns the losses, the final weights and the compile counter's frames after each step."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    if when == "before":
        model = torch.compile(model, backend=counter)
    if name is not None:
        model, opt = core_parallel.setup(model, opt, CONFIGS[name])
    if when == "after":
        model = torch.compile(model, backend=counter)
    losses, frames = [], []
    for step in range(STEPS):
        x = _data(step).chunk(world)[rank]
        out = model(x)
        loss = out.pow(2).mean()
        if name is None:
            loss.backward()
        else:
            opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        frames.append(counter.frame_count)
    weights = {k.removeprefix("_orig_mod."): v.detach().clone() for k, v in model.state_dict().items()}
    chunks = len(opt.manager.chunks) if hasattr(opt, "manager") else None
    return {"losses": torch.stack(losses), "weights": weights, "frames": frames, "chunks": chunks}


def _reference(world: int) -> dict:
    """Plain eager torch on one process, the global batch's loss per rank averaged (what the ranks' mean gradient
    is)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    losses = []
    for step in range(STEPS):
        parts = [model(x).pow(2).mean() for x in _data(step).chunk(world)]
        loss = torch.stack(parts).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(parts).detach())
    return {"losses": torch.stack(losses), "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _assert_matches(got: dict, want: dict, rank: int, what: str) -> None:
    torch.testing.assert_close(got["losses"], want["losses"][:, rank], rtol=1e-5, atol=1e-6, msg=what)
    assert got["weights"].keys() == want["weights"].keys(), what
    for k, v in want["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


def _assert_compiled_once(got: dict, what: str) -> None:
    frames = got["frames"]
    assert frames[0] > 0, f"{what}: nothing was compiled"
    assert frames[-1] == frames[0], f"{what}: recompiled after the first step: {frames}"
    if got["chunks"] is not None:  # a recompile per chunk would take at least as many frames as chunks
        assert got["chunks"] > BLOCKS and frames[-1] < got["chunks"], (what, frames, got["chunks"])


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_compile_on_one_rank_equals_eager(name, when):
    got = _train(name, when)
    _assert_matches(got, _reference(1), 0, f"{name}, compiled {when} setup")
    _assert_compiled_once(got, f"{name}, compiled {when} setup")


# On 2 ranks one case per config (the 1-rank matrix covers the rest): each compile costs seconds on 2 shared cores.
TWO_RANKS = (("gemini", "before"), ("gemini_offload", "after"), ("zero2", "before"))


def _all_on_ranks(rank: int, world: int) -> dict:
    return {(name, when): _train(name, when, rank, world) for name, when in TWO_RANKS}


@pytest.mark.distributed
def test_compile_on_two_ranks_equals_eager():
    want = _reference(2)
    for rank, results in enumerate(run_on_ranks(_all_on_ranks, 2, timeout=180)):
        for (name, when), got in results.items():
            what = f"rank {rank}, {name}, compiled {when} setup"
            _assert_matches(got, want, rank, what)
            _assert_compiled_once(got, what)
