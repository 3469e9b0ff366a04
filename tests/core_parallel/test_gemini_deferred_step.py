"""The optimizer step deferred to the next forward (issue 47, `GeminiConfig.step_in_forward`): on one rank whose masters
live on NVMe, `step()` leaves each chunk's update to the chunk's next gather, which runs it on the reader thread beside
compute and reads the master once for both. Checked against the same run with the step run in `step()`: bitwise equal
losses, weights and optimizer states (clipping, a scheduler changing the LR after each step, weight decay, a random
delay before each read, zero_grad before the forward, two steps in a row, a step with no gradient); the deferred shards
raise when read before their update; the master bytes the step no longer reads; where the update runs; a failing
write is raised; a checkpoint saved between the step and the next forward holds the new values."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import torch.nn as nn

from lowmem.core_parallel.gemini import GeminiConfig, setup_gemini
from lowmem.core_parallel.gemini.storage import NvmeFile, NvmeTierError

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _Deep(nn.Module):
    """Six linears, the second frozen: chunks enough for the recorded order to prefetch several ahead."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(19, 19) for _ in range(6))
        self.layers[1].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _built(folder, defer: bool, precision: str = "fp32", clip: float | None = None, **kw):
    torch.manual_seed(11)
    model = _Deep()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)
    cfg = GeminiConfig(precision=precision, offload_tier="nvme", offload_dir=str(folder), offload_param_frac=1.0,
                       offload_optim_frac=1.0, chunk_mb=19 * 20 * 4 / 2**20, prefetch=2, max_grad_norm=clip,
                       step_in_forward=defer, **kw)
    model, gopt = setup_gemini(model, opt, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(gopt, lambda s: 1.0 / (1 + s))
    return model, gopt, sched


def _spy_deferrals(monkeypatch) -> list[int]:
    """The chunks whose step `step()` defers, in order (appended as it defers them)."""
    from lowmem.core_parallel.gemini.optimizer import GeminiOptimizer

    seen: list[int] = []
    defer = GeminiOptimizer._defer

    def spied(self, c, *a):
        seen.append(c.index)
        return defer(self, c, *a)

    monkeypatch.setattr(GeminiOptimizer, "_defer", spied)
    return seen


def _deferred(mgr) -> list[int]:
    return [c.index for c in mgr.trainable_chunks if c.deferred is not None]


def _train(model, gopt, sched, precision: str, pattern: str, steps: int = 4,
           seen: list[int] | None = None) -> tuple[list[float], list[list[int]]]:
    """Train `steps` steps in one of the loop shapes users write; returns the losses and, for each step(), the
    chunks whose update it deferred (`seen`: from `_spy_deferrals`)."""
    seen = [] if seen is None else seen
    g = torch.Generator().manual_seed(5)
    losses, deferred = [], []
    for k in range(steps):
        if pattern == "zero_first":
            gopt.zero_grad()
        loss = model(torch.randn(8, 19, generator=g).to(_DTYPES[precision])).float().pow(2).mean()
        loss.backward()
        start = len(seen)
        gopt.step()
        deferred.append(seen[start:])
        if pattern == "twice" and k % 2 == 0:
            gopt.step()  # again on the same gradients (as torch would: they are still there)
        if pattern == "empty_step" and k == 1:
            gopt.zero_grad()
            gopt.step()  # no gradient: changes nothing
        sched.step()
        if pattern != "zero_first":
            gopt.zero_grad()
        losses.append(loss.item())
    return losses, deferred


def _final(model, gopt) -> tuple[dict, dict]:
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = gopt.state_dict()
    return model_state, opt_state


def _assert_same(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for i in oa["state"]:
        for key in oa["state"][i]:
            assert torch.equal(oa["state"][i][key], ob["state"][i][key]), (i, key)


@pytest.mark.parametrize("precision,clip,pattern", [
    ("fp32", None, "plain"), ("fp32", 0.05, "plain"), ("bf16", 0.05, "plain"), ("fp32", 0.05, "zero_first"),
    ("fp32", None, "twice"), ("fp32", 0.05, "empty_step"),
])  # eager: the step run in step(), with no delay; ours: deferred, with a random delay before each tier read and write
def test_the_deferred_step_gives_the_bits_of_the_step_run_at_once(precision, clip, pattern, tmp_path, monkeypatch):
    from lowmem.core_parallel.gemini import optimizer

    monkeypatch.setattr(optimizer, "STEP_PIECE", 96)  # several pieces per chunk, as a real chunk has
    seen = _spy_deferrals(monkeypatch)
    eager = _built(tmp_path / "eager", False, precision, clip)
    eager_losses, eager_deferred = _train(*eager, precision, pattern, seen=seen)
    eager_final = _final(*eager[:2])
    eager[0].gemini_manager.close()
    assert not any(eager_deferred)

    rng = random.Random(0)
    read = NvmeFile.read

    def slow(f, offset, out):  # a random delay before each read on the reader thread
        if threading.current_thread().name.startswith("lowmem-tier-reader"):
            time.sleep(rng.choice([0.0, 0.001, 0.01]))
        return read(f, offset, out)

    write = NvmeFile.write

    def slow_write(f, offset, src):  # and before each write there (gradient shards, deferred updates)
        if threading.current_thread().name.startswith("lowmem-tier-reader"):
            time.sleep(rng.choice([0.0, 0.001, 0.01]))
        return write(f, offset, src)

    monkeypatch.setattr(NvmeFile, "read", slow)
    monkeypatch.setattr(NvmeFile, "write", slow_write)
    ours = _built(tmp_path / "deferred", True, precision, clip)
    losses, deferred = _train(*ours, precision, pattern, seen=seen)
    final = _final(*ours[:2])
    ours[0].gemini_manager.close()
    trainable = [c.index for c in ours[0].gemini_manager.trainable_chunks]
    assert all(d == trainable for d in deferred), deferred  # every trained chunk's step was deferred, every step
    assert losses == eager_losses
    _assert_same(final, eager_final)


def test_a_deferred_shard_raises_when_read_before_its_update(tmp_path):
    model, gopt, _ = _built(tmp_path, True)
    model(torch.randn(4, 19)).pow(2).mean().backward()
    before = model.state_dict()
    gopt.step()
    mgr = model.gemini_manager
    waiting = [c for c in mgr.trainable_chunks if c.deferred is not None]
    assert len(waiting) == len(mgr.trainable_chunks)
    c = waiting[-1]
    for buf in (c.master, *c.states.values()):
        with pytest.raises(RuntimeError, match="deferred to its next gather"):
            buf.view()
        with pytest.raises(RuntimeError, match="deferred to its next gather"):
            buf.read_into(torch.empty(buf.numel, dtype=buf.dtype))
    after = model.state_dict()  # runs the deferred updates first: the new values
    assert not _deferred(mgr)
    changed = [k for k in after if not torch.equal(after[k], before[k])]
    assert changed and all(not k.startswith("layers.1.") for k in changed)
    mgr.close()


def _read_bytes(monkeypatch) -> list[int]:
    counted = [0]
    read = NvmeFile.read

    def counting(f, offset, out):
        counted[0] += out.numel() * out.element_size()
        return read(f, offset, out)

    monkeypatch.setattr(NvmeFile, "read", counting)
    return counted


def test_the_deferred_step_reads_each_trained_master_once_a_step_not_twice(tmp_path, monkeypatch):
    counted = _read_bytes(monkeypatch)
    per_run = {}
    for defer in (False, True):
        model, gopt, sched = _built(tmp_path / str(defer), defer, prefetch_max=2)  # the same read-ahead each step
        _train(model, gopt, sched, "fp32", "plain", steps=2)  # the order recorded, the first deferral made
        mgr = model.gemini_manager
        for c in mgr.chunks:  # the reads ahead at the step's end done before counting, and again at its end
            c.wait()
        start = counted[0]
        _train(model, gopt, sched, "fp32", "plain", steps=3)
        for c in mgr.chunks:
            c.wait()
        per_run[defer] = counted[0] - start
        masters = sum(c.master.nbytes for c in model.gemini_manager.trainable_chunks)
        model.gemini_manager.close()
    assert per_run[False] - per_run[True] == 3 * masters, (per_run, masters)


def test_the_update_runs_in_the_forward_on_the_reader_thread(tmp_path, monkeypatch):
    model, gopt, sched = _built(tmp_path, True)
    _train(model, gopt, sched, "fp32", "plain", steps=2)
    model(torch.randn(4, 19)).pow(2).mean().backward()  # (the last step's updates run in this forward)
    writes: list[tuple[str, str]] = []  # (phase, thread) of each tier write
    phase = ["step"]
    write = NvmeFile.write

    def noted(f, offset, src):
        writes.append((phase[0], threading.current_thread().name))
        return write(f, offset, src)

    monkeypatch.setattr(NvmeFile, "write", noted)
    gopt.step()
    gopt.zero_grad()
    assert writes == []  # the step wrote nothing: its updates wait for the chunks' gathers
    phase[0] = "forward"
    model(torch.randn(4, 19))
    # master and two Adam states of each of the five trained chunks, most on the reader thread (the forward's first
    # chunk is gathered on the spot: nothing was read ahead of it)
    assert len(writes) == 5 * 3, writes
    assert sum(t.startswith("lowmem-tier-reader") for _, t in writes) >= 4 * 3, writes
    model.gemini_manager.close()


def test_a_write_failing_under_the_deferred_update_is_raised_in_the_forward(tmp_path, monkeypatch):
    model, gopt, sched = _built(tmp_path, True)
    _train(model, gopt, sched, "fp32", "plain", steps=2)
    write = NvmeFile.write

    def failing(f, offset, src):
        if threading.current_thread().name.startswith("lowmem-tier-reader"):
            raise NvmeTierError("planted: a write-back failed under the reader")
        return write(f, offset, src)

    monkeypatch.setattr(NvmeFile, "write", failing)
    with pytest.raises(NvmeTierError, match="planted"):
        model(torch.randn(4, 19)).pow(2).mean().backward()
    monkeypatch.setattr(NvmeFile, "write", write)
    # the chunk whose update failed part-way holds no value that passes for a valid one
    with pytest.raises(RuntimeError, match="failed part-way"):
        model.state_dict()
    model.gemini_manager.close()


def test_a_checkpoint_saved_before_the_next_forward_holds_the_stepped_values(tmp_path):
    from lowmem.core_parallel.checkpoint import load_checkpoint, save_checkpoint

    finals = {}
    for defer in (False, True):
        model, gopt, sched = _built(tmp_path / f"n{defer}", defer)
        _train(model, gopt, sched, "fp32", "plain", steps=2)
        if defer:
            assert _deferred(model.gemini_manager)
        save_checkpoint(tmp_path / f"ck{defer}", model, gopt)
        model.gemini_manager.close()
        fresh, fresh_opt, _ = _built(tmp_path / f"m{defer}", False)
        load_checkpoint(tmp_path / f"ck{defer}", fresh, fresh_opt)
        finals[defer] = _final(fresh, fresh_opt)
        fresh.gemini_manager.close()
    _assert_same(finals[True], finals[False])


def test_gradient_shards_are_written_on_the_reader_thread_while_backward_goes_on(tmp_path, monkeypatch):
    """One rank, gradients on NVMe: each chunk's gradient shard is written on the reader thread (at most
    `WRITES_IN_FLIGHT` behind), not on the thread computing the backward; a failed write is raised in the backward."""
    model, gopt, sched = _built(tmp_path, True)
    _train(model, gopt, sched, "fp32", "plain", steps=2)
    mgr = model.gemini_manager
    assert all(c.grad.tier == "nvme" for c in mgr.trainable_chunks)
    threads: list[str] = []
    fail = [False]
    write = NvmeFile.write

    def noted(f, offset, src):
        threads.append(threading.current_thread().name)
        if fail[0]:
            raise NvmeTierError("planted: a gradient write failed")
        return write(f, offset, src)

    loss = model(torch.randn(4, 19)).pow(2).mean()  # (the deferred updates run here)
    monkeypatch.setattr(NvmeFile, "write", noted)
    loss.backward()
    assert len(threads) == len(mgr.trainable_chunks), threads
    assert all(t.startswith("lowmem-tier-reader") for t in threads), threads
    assert all(c.grad.allocated and c.grad_sq is not None for c in mgr.trainable_chunks)
    gopt.step()
    gopt.zero_grad()
    loss = model(torch.randn(4, 19)).pow(2).mean()
    fail[0] = True
    with pytest.raises(NvmeTierError, match="gradient write failed"):
        loss.backward()
    mgr.close()


def test_by_default_a_full_fine_tune_defers_its_step_and_a_mostly_frozen_model_does_not(tmp_path, monkeypatch):
    """`step_in_forward=None`: deferred where the trained chunks hold at least half the master bytes (a LoRA's small
    step gains nothing and measured slower); True and False as given; anything else refused."""
    from lowmem.core_parallel.gemini import optimizer
    from lowmem.utils.errors import InputError

    seen = _spy_deferrals(monkeypatch)
    for frozen, chosen, expect in [(1, None, True), (5, None, False), (5, True, True), (1, False, False)]:
        torch.manual_seed(0)
        model = _Deep()
        for layer in model.layers[:frozen]:
            layer.requires_grad_(False)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
        cfg = GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / f"{frozen}{chosen}"), offload_param_frac=1.0,
                           offload_optim_frac=1.0, chunk_mb=19 * 20 * 4 / 2**20, step_in_forward=chosen)
        model, gopt = setup_gemini(model, opt, cfg)
        seen.clear()
        model(torch.randn(4, 19)).pow(2).mean().backward()
        gopt.step()
        assert bool(seen) is expect, (frozen, chosen, seen)
        assert isinstance(gopt, optimizer.GeminiOptimizer)
        model.gemini_manager.close()
    with pytest.raises(InputError, match="step_in_forward"):
        GeminiConfig(step_in_forward="yes")


_OPS = ("train", "step", "zero_grad", "state_dict", "opt_state", "sched")


def _apply_ops(model, gopt, sched, ops: list[str], seed: int) -> list:
    """Run `ops` in order; returns what each one gave (losses, state dicts) to compare run against run."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for op in ops:
        if op == "train":
            loss = model(torch.randn(4, 19, generator=g)).pow(2).mean()
            loss.backward()
            out.append(loss.item())
        elif op == "step":
            gopt.step()
        elif op == "zero_grad":
            gopt.zero_grad()
        elif op == "state_dict":
            out.append({k: v.clone() for k, v in model.state_dict().items()})
        elif op == "opt_state":
            out.append(gopt.state_dict()["state"])
        else:
            sched.step()
    out.append(_final(model, gopt))
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_any_sequence_of_loop_calls_gives_the_bits_of_the_step_run_at_once(tmp_path):
    """Property: whatever the order of forward/backward, step, zero_grad, state_dict() of model and optimizer and the
    scheduler's step (random, with random frozen layers, clipping and piece size), the deferred run gives what the
    run with the step in `step()` gives, bit for bit, at every call."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from lowmem.core_parallel.gemini import optimizer

    counter = [0]

    @settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ops=st.lists(st.sampled_from(_OPS), min_size=4, max_size=14), frozen=st.sets(st.integers(0, 5), max_size=2),
           clip=st.sampled_from([None, 0.05]), piece=st.sampled_from([64, 1 << 20]))
    def check(ops, frozen, clip, piece):
        counter[0] += 1
        results = []
        previous = optimizer.STEP_PIECE
        optimizer.STEP_PIECE = piece
        try:
            for defer in (False, True):
                torch.manual_seed(11)
                model = _Deep()
                for i in frozen:
                    model.layers[i].requires_grad_(False)
                opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)
                cfg = GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / f"{counter[0]}-{defer}"),
                                   offload_param_frac=1.0, offload_optim_frac=1.0, chunk_mb=19 * 20 * 4 / 2**20,
                                   prefetch=2, max_grad_norm=clip, step_in_forward=defer)
                model, gopt = setup_gemini(model, opt, cfg)
                sched = torch.optim.lr_scheduler.LambdaLR(gopt, lambda s: 1.0 / (1 + s))
                try:
                    results.append(_apply_ops(model, gopt, sched, ["train", "step", *ops, "train", "step"], 7))
                finally:
                    model.gemini_manager.close()
        finally:
            optimizer.STEP_PIECE = previous
        assert _same(results[0], results[1]), (ops, frozen, clip, piece)

    check()


def test_a_budget_moving_optimizer_buffers_runs_the_deferred_step_first(tmp_path):
    """`memory_budget`'s refit moves a chunk's gradient and Adam states between tiers after the step: with the step
    deferred it runs first (its states were stale: moving them raised), and training goes on to the eager run's bits."""
    from lowmem.core_parallel.gemini import budget

    finals = {}
    for defer in (False, True):
        model, gopt, sched = _built(tmp_path / str(defer), defer)
        _train(model, gopt, sched, "fp32", "plain", steps=2)
        mgr = model.gemini_manager
        for c in mgr.trainable_chunks[::2]:  # as `_promote` and `_evict` do, to the device and back for some
            budget._move_optim(mgr, c, "device")
        _train(model, gopt, sched, "fp32", "plain", steps=1)
        for c in mgr.trainable_chunks[::2]:
            budget._move_optim(mgr, c, "nvme")
        _train(model, gopt, sched, "fp32", "plain", steps=2)
        finals[defer] = _final(model, gopt)
        mgr.close()
    _assert_same(finals[True], finals[False])


def test_a_new_optimizer_over_the_set_up_model_keeps_the_last_deferred_step(tmp_path):
    """A second setup over a model Gemini holds (a second `fit`, a new optimizer in a plain loop) starts fresh optimizer
    state: the last step of the old optimizer, still deferred, is in the weights first (its states were stale: zeroing
    them raised), as in the eager run."""
    finals = {}
    for defer in (False, True):
        model, gopt, sched = _built(tmp_path / str(defer), defer)
        _train(model, gopt, sched, "fp32", "plain", steps=2)
        opt2 = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05, weight_decay=0.1)
        cfg = model.gemini_manager.config
        model, gopt2 = setup_gemini(model, opt2, cfg)
        sched2 = torch.optim.lr_scheduler.LambdaLR(gopt2, lambda s: 1.0 / (1 + s))
        _train(model, gopt2, sched2, "fp32", "plain", steps=2)
        finals[defer] = _final(model, gopt2)
        model.gemini_manager.close()
    _assert_same(finals[True], finals[False])
