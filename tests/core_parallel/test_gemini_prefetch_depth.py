"""The prefetch depth set from the measured step (issue 47): `PrefetchDepth` on measured figures (a clock of our own),
then a Gemini model on the NVMe tier whose reads take longer than some modules' compute, so that compute waits for
reads the reader had time to start earlier: the depth grows, the waits shrink, and training is unchanged."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from lowmem.core_parallel.gemini import GeminiConfig, setup_gemini
from lowmem.core_parallel.gemini.prefetch import PrefetchDepth, Reader
from lowmem.core_parallel.gemini.storage import NvmeFile


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _step(depth: PrefetchDepth, clock: _Clock, seconds: float, waited: float, busy_total: float) -> int:
    clock.now += seconds
    depth.wait(waited)
    return depth.end_step(busy_total)


def test_the_depth_follows_the_measured_waits_and_the_readers_time():
    clock = _Clock()
    depth = PrefetchDepth(1, 3, clock)
    assert depth.end_step(0.0) == 1  # the first step records the order: the clock starts, nothing is judged
    # compute waited 0.3 s of 1 s, the reader was busy 0.5 s: the reads could have started earlier
    assert _step(depth, clock, 1.0, 0.3, 0.5) == 2
    assert _step(depth, clock, 1.0, 0.3, 1.0) == 3
    assert _step(depth, clock, 1.0, 0.3, 1.5) == 3  # at most `most`
    # no wait worth the name (under 2%): the depth stays
    assert _step(depth, clock, 1.0, 0.01, 2.0) == 3
    # the reader busy 95% of the step: the disk is the limit, one chunk less held ahead each step, down to `least`
    assert _step(depth, clock, 1.0, 0.3, 2.95) == 2
    assert _step(depth, clock, 1.0, 0.0, 3.9) == 1
    assert _step(depth, clock, 1.0, 0.5, 4.9) == 1
    assert [s[3] for s in depth.steps] == [2, 3, 3, 3, 2, 1, 1]
    assert depth.steps[0][:3] == (1.0, 0.3, 0.5)


def test_a_fixed_depth_never_moves():
    clock = _Clock()
    depth = PrefetchDepth(2, 2, clock)
    depth.end_step(0.0)
    for busy in (0.1, 0.2, 5.0):
        assert _step(depth, clock, 1.0, 0.9, busy) == 2
    with pytest.raises(ValueError):
        PrefetchDepth(3, 2)


def test_the_reader_counts_its_busy_seconds():
    reader = Reader()
    try:
        assert reader.submit(lambda a, b: time.sleep(0.05) or a + b, 2, 3).result() == 5
        assert reader.busy >= 0.05
    finally:
        reader.shutdown()


class _Sleep(torch.autograd.Function):
    """Compute that takes `seconds`, forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None


class _Uneven(nn.Module):
    """A chunk per layer; every fourth layer's compute is long (`slow` seconds each way), the others' nothing."""

    def __init__(self, slow: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))
        self.slow = slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i % 4 == 0:
                x = _Sleep.apply(x, self.slow)
        return x


def _train(tmp_path, prefetch_max: int, read_s: float, steps: int, monkeypatch):
    torch.manual_seed(0)
    model = _Uneven(slow=8 * read_s)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / f"nvme{prefetch_max}"), offload_param_frac=1.0,
                       offload_optim_frac=1.0, chunk_mb=16 * 17 * 4 / 2**20, prefetch=1, prefetch_max=prefetch_max)
    read = NvmeFile.read

    def slow(f, offset, out):  # a read on the reader thread takes `read_s` (a slow disk)
        if threading.current_thread().name.startswith("lowmem-tier-reader"):
            time.sleep(read_s)
        return read(f, offset, out)

    monkeypatch.setattr(NvmeFile, "read", slow)
    model, gopt = setup_gemini(model, opt, cfg)
    mgr = model.gemini_manager
    assert len(mgr.chunks) == 8 and mgr.reader is not None
    g = torch.Generator().manual_seed(1)
    losses, depths = [], []
    for _ in range(steps):
        loss = model(torch.randn(4, 16, generator=g)).pow(2).mean()
        loss.backward()
        gopt.step()
        gopt.zero_grad()
        losses.append(loss.item())
        depths.append(mgr.memory_report()["prefetch_depth"])
    waits = [s[1] for s in mgr.depth.steps]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.close()
    return losses, state, depths, waits


def test_the_depth_grows_where_compute_waits_for_reads_the_reader_could_start_earlier(tmp_path, monkeypatch):
    """Three chunks whose compute takes nothing follow one whose compute is long: one chunk ahead, the second and
    third are read only when the one before them starts, and compute waits for each. Deeper, they are read while
    the long one computes."""
    losses, state, depths, waits = _train(tmp_path, prefetch_max=4, read_s=0.02, steps=5, monkeypatch=monkeypatch)
    assert depths[0] == 1 and max(depths) >= 3, depths
    assert waits[-1] < waits[0] / 2, waits
    fixed_losses, fixed_state, fixed_depths, _ = _train(tmp_path, prefetch_max=1, read_s=0.02, steps=5,
                                                        monkeypatch=monkeypatch)
    assert set(fixed_depths) == {1}
    assert losses == fixed_losses
    for k in state:
        assert torch.equal(state[k], fixed_state[k]), k
