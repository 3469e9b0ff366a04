"""Frozen chunks in the compute dtype (issue 47): a frozen chunk keeps no fp32 master, gradient or optimizer state, and
the optimizer step moves none of its bytes; what compute reads of it is bitwise what a gather from an fp32 master
gave (the value rounded to the compute dtype), in every tier, on one rank and on two."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lowmem.core_parallel import run_on_ranks
from lowmem.core_parallel.gemini import GeminiConfig, setup_gemini
from lowmem.core_parallel.gemini.storage import NvmeFile, TieredBuffer

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Adapted(nn.Module):
    """A frozen base (two odd-sized linears) with a trainable low-rank adapter, as LoRA trains."""

    def __init__(self) -> None:
        super().__init__()
        self.base1, self.base2 = nn.Linear(13, 29), nn.Linear(29, 13)
        self.down, self.up = nn.Linear(13, 3, bias=False), nn.Linear(3, 13, bias=False)
        self.base1.requires_grad_(False)
        self.base2.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base2(torch.tanh(self.base1(x))) + self.up(self.down(x))


def _config(tier: str, precision: str, tmp_path, **kw) -> GeminiConfig:
    chunk = dict(chunk_mb=400 * _DTYPES[precision].itemsize / 2**20)
    if tier == "device":
        return GeminiConfig(precision=precision, **chunk, **kw)
    if tier == "cpu":
        return GeminiConfig(precision=precision, offload_tier="cpu", offload_param_frac=1.0, offload_optim_frac=1.0,
                            **chunk, **kw)
    return GeminiConfig(precision=precision, offload_tier="nvme", offload_dir=str(tmp_path / "nvme"),
                        offload_param_frac=1.0, offload_optim_frac=1.0, **chunk, **kw)


def _built(seed: int = 0):
    torch.manual_seed(seed)
    model = Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, opt


class _Touches:
    """Which buffers' data the optimizer step reads or writes, and the NVMe bytes it moves."""

    def __init__(self, monkeypatch) -> None:
        self.buffers: set[int] = set()
        self.nvme_offsets: list[int] = []
        self.on = False
        for name in ("view", "read_into", "write_from", "allocate"):
            orig = getattr(TieredBuffer, name)
            monkeypatch.setattr(TieredBuffer, name, self._wrap_buffer(orig))
        for name in ("read", "write"):
            orig = getattr(NvmeFile, name)
            monkeypatch.setattr(NvmeFile, name, self._wrap_file(orig))

    def _wrap_buffer(self, orig):
        def wrapped(buf, *a, **k):
            if self.on:
                self.buffers.add(id(buf))
            return orig(buf, *a, **k)
        return wrapped

    def _wrap_file(self, orig):
        def wrapped(f, offset, *a, **k):
            if self.on:
                self.nvme_offsets.append(offset)
            return orig(f, offset, *a, **k)
        return wrapped


@pytest.mark.parametrize("tier", ["device", "cpu", "nvme"])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_frozen_chunks_keep_the_compute_dtype_only_and_the_step_never_touches_them(tier, precision, tmp_path,
                                                                                  monkeypatch):
    model, opt = _built()
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    model, gopt = setup_gemini(model, opt, _config(tier, precision, tmp_path))
    mgr = model.gemini_manager
    dtype = _DTYPES[precision]
    frozen = [c for c in mgr.chunks if not c.spec.trainable]
    trained = [c for c in mgr.chunks if c.spec.trainable]
    assert frozen and trained
    for c in frozen:  # no fp32 copy, no gradient, no optimizer state
        assert c.master.dtype == dtype and c.master.nbytes == c.shard_numel * dtype.itemsize
        assert c.grad is None and c.states == {}
        assert c.master.tier == ("device" if tier == "device" else tier)
    for c in trained:
        assert c.master.dtype == torch.float32 and c.grad is not None and set(c.states) == {"exp_avg", "exp_avg_sq"}
    # what the ledger (memory_report, the placement's accounting) charges for the masters: frozen ones at 2 bytes
    report = mgr.memory_report()
    charged = sum(kinds["params"] for kinds in report["bytes"].values())
    assert charged == sum(c.shard_numel * (dtype.itemsize if c in frozen else 4) for c in mgr.chunks)

    touches = _Touches(monkeypatch)
    x = torch.randn(5, 13).to(dtype)
    for _ in range(2):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        touches.on = True
        gopt.step()
        mgr.settle()  # a step deferred to the next forward (one rank, masters on NVMe) runs here: counted too
        touches.on = False
        gopt.zero_grad()
        assert torch.isfinite(loss)
    frozen_bufs = {id(c.master) for c in frozen}
    assert not touches.buffers & frozen_bufs, "the optimizer step touched a frozen chunk's master"
    assert touches.buffers & {id(c.master) for c in trained}, "the counter saw no step at all"
    if tier == "nvme":
        frozen_offsets = {c.master.nvme_offset for c in frozen}
        assert touches.nvme_offsets and not frozen_offsets & set(touches.nvme_offsets)

    # what compute reads is the value rounded to the compute dtype (as a gather from an fp32 master rounded it),
    # and state_dict() gives that value back in the parameter's dtype
    sd = model.state_dict()
    for name, value in base.items():
        assert sd[name].dtype == torch.float32
        assert torch.equal(sd[name], value.to(dtype).float()), name


def _two_ranks(rank: int, world: int, folder: str) -> None:
    from pathlib import Path

    for tier in ("cpu", "nvme"):
        model, opt = _built()
        base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        model, gopt = setup_gemini(model, opt, _config(tier, "bf16", Path(folder) / f"r{rank}"))
        mgr = model.gemini_manager
        assert mgr.peers is not None  # peer reads of a bf16 master in shared memory or in a peer's file
        frozen = [c for c in mgr.chunks if not c.spec.trainable]
        assert all(c.master.dtype == torch.bfloat16 and c.master.tier == tier for c in frozen)
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            model(torch.randn(4, 13, generator=g).bfloat16()).float().pow(2).mean().backward()
            gopt.step()
            gopt.zero_grad()
        sd = model.state_dict()
        for name, value in base.items():
            assert torch.equal(sd[name], value.bfloat16().float()), (tier, name)
        mgr.close()


def test_two_ranks_read_each_others_frozen_masters_in_the_compute_dtype(tmp_path):
    run_on_ranks(_two_ranks, 2, str(tmp_path), timeout=120)


class _Deep(nn.Module):
    """Enough chunks in a row that the recorded order has something to prefetch."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(17, 17) for _ in range(6))
        self.layers[1].requires_grad_(False)
        self.layers[4].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _deep_on_nvme(folder, prefetch: int, precision: str = "fp32", **kw):
    """`_Deep` (seed 3) and Adam under Gemini, every master and optimizer buffer on NVMe in `folder` (`kw`: more
    `GeminiConfig` fields)."""
    torch.manual_seed(3)
    model = _Deep()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.02)
    cfg = GeminiConfig(precision=precision, offload_tier="nvme", offload_dir=str(folder), offload_param_frac=1.0,
                       offload_optim_frac=1.0, chunk_mb=17 * 18 * 4 / 2**20, prefetch=prefetch, **kw)
    return setup_gemini(model, opt, cfg)


def _nvme_run(tmp_path, prefetch: int, delays: list[float] | None, precision: str = "fp32", steps: int = 4):
    import random
    import time

    model, gopt = _deep_on_nvme(tmp_path / f"p{prefetch}", prefetch, precision)
    mgr = model.gemini_manager
    submitted = []
    if delays is not None:
        rng = random.Random(0)
        read = NvmeFile.read

        def slow(f, offset, out):  # the reader thread sleeps a random while before each read
            import threading

            if threading.current_thread().name.startswith("lowmem-tier-reader"):
                submitted.append(offset)
                time.sleep(rng.choice(delays))
            return read(f, offset, out)

        NvmeFile.read = slow
    try:
        losses = []
        g = torch.Generator().manual_seed(5)
        dtype = _DTYPES[precision]
        for _ in range(steps):
            loss = model(torch.randn(8, 17, generator=g).to(dtype)).float().pow(2).mean()
            loss.backward()
            gopt.step()
            gopt.zero_grad()
            losses.append(loss.item())
        state = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        if delays is not None:
            NvmeFile.read = read
        reader = mgr.reader
        mgr.close()
    return losses, state, submitted, reader


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_async_tier_reads_equal_synchronous_ones_bitwise_under_random_delays(precision, tmp_path, monkeypatch):
    from lowmem.core_parallel.gemini import optimizer

    monkeypatch.setattr(optimizer, "STEP_PIECE", 64)  # the step streams several pieces per chunk
    sync_losses, sync_state, _, _ = _nvme_run(tmp_path / "sync", prefetch=0, delays=None, precision=precision)
    losses, state, submitted, reader = _nvme_run(tmp_path / "async", prefetch=2, delays=[0.0, 0.002, 0.02],
                                                 precision=precision)
    assert reader is not None and submitted, "no read ran on the reader thread: nothing was prefetched"
    # the reader read masters for gathers (at most 12 a step) and the step's pieces (4 chunks x 5 pieces x 4 buffers)
    assert len(submitted) > 100, len(submitted)
    assert losses == sync_losses
    assert state.keys() == sync_state.keys()
    for k in state:
        assert torch.equal(state[k], sync_state[k]), k


def test_a_failed_async_read_is_raised_where_the_chunk_is_used(tmp_path, monkeypatch):
    import threading

    from lowmem.core_parallel.gemini.storage import NvmeTierError

    model, gopt = _deep_on_nvme(tmp_path, prefetch=2)
    model(torch.randn(2, 17)).sum().backward()
    gopt.step()
    gopt.zero_grad()
    read = NvmeFile.read

    def failing(f, offset, out):
        if threading.current_thread().name.startswith("lowmem-tier-reader"):
            raise NvmeTierError("planted: the disk failed under the reader thread")
        return read(f, offset, out)

    monkeypatch.setattr(NvmeFile, "read", failing)
    with pytest.raises(NvmeTierError, match="planted"):
        model(torch.randn(2, 17)).sum().backward()


def test_the_step_writes_its_nvme_pieces_back_on_the_reader_thread(tmp_path, monkeypatch):
    """With the reader thread the optimizer step's write-backs run there, in order with its reads (this thread
    only updates, the disk streams both ways), and a write that fails there fails the step. (The step run in
    `step()`; deferred to the next forward it runs on that thread whole: `test_gemini_deferred_step.py`.)"""
    import threading

    from lowmem.core_parallel.gemini import optimizer
    from lowmem.core_parallel.gemini.storage import NvmeTierError

    monkeypatch.setattr(optimizer, "STEP_PIECE", 64)  # several pieces per chunk: reads and writes interleave
    model, gopt = _deep_on_nvme(tmp_path, prefetch=1, step_in_forward=False)
    model(torch.randn(2, 17)).sum().backward()
    threads: list[str] = []
    write = NvmeFile.write

    def noted(f, offset, src):
        threads.append(threading.current_thread().name)
        if fail:
            raise NvmeTierError("planted: a write-back failed")
        return write(f, offset, src)

    fail = False
    monkeypatch.setattr(NvmeFile, "write", noted)
    gopt.step()
    # 4 trainable chunks of 17 x 18 elements, pieces of 64: 5 pieces each, master and two Adam states per piece
    assert len(threads) == 4 * 5 * 3 and all(t.startswith("lowmem-tier-reader") for t in threads), set(threads)
    gopt.zero_grad()
    model(torch.randn(2, 17)).sum().backward()
    fail = True
    with pytest.raises(NvmeTierError, match="planted"):
        gopt.step()
    model.gemini_manager.close()


def test_a_frozen_base_cast_by_the_user_stays_in_its_dtype_under_mixed_precision(tmp_path):
    """Mixed precision (fp32 parameters, bf16 autocast) with the frozen base cast to bf16 first, as diffusers' LoRA
    scripts cast it (`weight_dtype`): the base stays bf16 in every tier, with no fp32 copy; the trainable adapter keeps
    fp32 masters; the losses are those of plain torch running the same model under autocast."""
    def built():
        model, opt = _built()
        model.base1.to(torch.bfloat16)
        model.base2.to(torch.bfloat16)
        return model, opt

    ref, ref_opt = built()
    model, opt = built()
    model, gopt = setup_gemini(model, opt, _config("nvme", "fp32", tmp_path, prefetch=1))
    mgr = model.gemini_manager
    for c in mgr.chunks:
        want = torch.float32 if c.spec.trainable else torch.bfloat16
        assert c.master.dtype == want and c.full.dtype == want, (c.index, c.master.dtype, c.full.dtype)
    assert model.base1.weight.dtype == torch.bfloat16 and model.down.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(6, 13, generator=g)
        losses = []
        for m, o in ((ref, ref_opt), (model, gopt)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(x).float().pow(2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-7)
    mgr.close()


class _Shared(nn.Module):
    """Three layers per chunk, each chunk's layers run one after another: a chunk is accessed three times in a row."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_the_next_chunk_is_read_from_the_first_use_of_the_current_one(tmp_path, monkeypatch):
    """With the order recorded, a chunk used by several modules in a row has the next chunk read ahead from its first
    use on (it was from its last: the read then overlapped one module's compute instead of three)."""
    from lowmem.core_parallel.gemini.manager import ChunkManager

    torch.manual_seed(0)
    model = _Shared()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / "nvme"), offload_param_frac=1.0,
                       offload_optim_frac=1.0, chunk_mb=3 * 16 * 17 * 4 / 2**20, prefetch=1)
    model, gopt = setup_gemini(model, opt, cfg)
    mgr = model.gemini_manager
    assert mgr.reader is not None and [len(c.spec.slots) for c in mgr.chunks] == [6, 6, 6]
    events: list[tuple[str, int]] = []
    gather, record = ChunkManager._gather, mgr.trace.record
    monkeypatch.setattr(ChunkManager, "_gather", lambda self, c, async_op: (
        events.append(("prefetch" if async_op else "gather", c.index)), gather(self, c, async_op))[1])
    monkeypatch.setattr(mgr.trace, "record", lambda i: (events.append(("use", i)), record(i))[1])
    x = torch.randn(4, 16)
    for _ in range(2):  # the second step runs with the order recorded
        events.clear()
        model(x).pow(2).mean().backward()
        gopt.step()
        gopt.zero_grad()
    forward = events[: events.index(("use", 2)) + 1]
    # step 2, forward: chunk 1 is prefetched right after chunk 0's first use, chunk 2 after chunk 1's
    assert forward[:3] == [("use", 0), ("gather", 0), ("prefetch", 1)], forward
    assert forward.index(("prefetch", 2)) == forward.index(("use", 1)) + 1, forward
    mgr.close()
