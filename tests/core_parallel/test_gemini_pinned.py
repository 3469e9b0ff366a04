"""Pinned chunks (issue 47): on one rank of a CPU device a master on the device tier in the gathered dtype lives in the
gathered buffer itself, so gathers and releases move no byte and the model data is held once, not twice. Checked:
which chunks are pinned, that their gathers copy nothing, that the ledger charges them once, that training equals
the unpinned run bitwise, and that a pinned master moved to NVMe and back (between steps, and while its chunk is in use)
keeps every value. Also the flat gradient buffer's fill (each gradient copied into place, only the rest zeroed),
on two ranks that use different parameters, and on one rank straight into the gradient shard."""

from __future__ import annotations

import pytest
import torch

from lowmem.core_parallel.gemini import GeminiConfig, setup_gemini
from lowmem.core_parallel.gemini.chunk import Chunk
from lowmem.core_parallel.gemini.placement import AccessTrace
from lowmem.core_parallel.gemini.state import ChunkState
from lowmem.core_parallel.gemini.storage import NvmeFile
from tests.core_parallel.gemini_helpers import assert_close_dicts, batch, build

STEPS = range(4)


def _loss(model, step: int) -> torch.Tensor:
    x, y = batch(step)
    return ((model(x, step % 2 == 0) - y) ** 2).mean()


class _Reads:
    """Counts the chunk reads that fill a gathered buffer (one rank: `Chunk._read_one_sided`)."""

    def __init__(self, monkeypatch) -> None:
        self.chunks: list[int] = []
        orig = Chunk._read_one_sided

        def counted(chunk, out, *rest):
            self.chunks.append(chunk.index)
            return orig(chunk, out, *rest)

        monkeypatch.setattr(Chunk, "_read_one_sided", counted)


def _unpinned(precision: str, monkeypatch) -> dict[str, torch.Tensor]:
    """The final state of the same run with every chunk gathered into a copy (no chunk pinned)."""
    with monkeypatch.context() as m:
        m.setattr(Chunk, "pinnable", property(lambda self: False))
        model, opt = build("adam")
        model, gopt = setup_gemini(model, opt, GeminiConfig(chunk_mb=40 * 4 / 2**20, precision=precision))
        assert not any(c.pinned for c in model.gemini_manager.chunks)
        _train(model, gopt)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        model.gemini_manager.close()
    return state


def _held(mgr, *kinds: str) -> int:
    return sum(mgr.ledger.report()["bytes"]["device"][k] for k in kinds)


def _train(model, opt, steps=STEPS, between=None) -> None:
    for step in steps:
        _loss(model, step).backward()
        opt.step()
        opt.zero_grad()
        if between is not None:
            between(step)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_device_masters_are_the_gathered_buffers_on_one_rank(precision, monkeypatch):
    model, opt = build("adam")
    model, gopt = setup_gemini(model, opt, GeminiConfig(chunk_mb=40 * 4 / 2**20, precision=precision))
    mgr = model.gemini_manager
    # fp32: every chunk; bf16: the frozen ones (kept in bf16), not the trainable ones (fp32 masters, bf16 compute)
    want = {c.index for c in mgr.chunks if precision == "fp32" or not c.spec.trainable}
    assert want and {c.index for c in mgr.chunks if c.pinned} == want
    for c in mgr.chunks:
        same = c.master.view().data_ptr() == c.full.data_ptr()
        assert same == c.pinned, c.index
    reads = _Reads(monkeypatch)
    lookups = []  # look-aheads in the recorded order (a pinned chunk needs none: keeping it gathered saves nothing)
    upcoming = AccessTrace.upcoming
    monkeypatch.setattr(AccessTrace, "upcoming", lambda self, *a, **k: lookups.append(1) or upcoming(self, *a, **k))
    # inside a forward the ledger charges a gathered pinned chunk nothing beside its master, an unpinned one its copy
    charged = []
    handle = model.l2.register_forward_hook(lambda *_: charged.append(
        (mgr.ledger.tier_total("device") - _held(mgr, "grads", "optim"),
         sum(c.full_nbytes for c in mgr.chunks if not c.pinned and c.sm.data is not ChunkState.RELEASED))))
    _train(model, gopt)
    handle.remove()
    # only the chunks that are not pinned are read (the counter works: bf16's trainable chunks are)
    assert set(reads.chunks) == {c.index for c in mgr.chunks if not c.pinned}, "a pinned chunk's gather copied"
    masters = sum(c.master.nbytes for c in mgr.chunks)
    assert bool(lookups) == (precision != "fp32"), len(lookups)
    assert charged and all(params == masters + copies for params, copies in charged), (charged, masters)
    assert mgr.memory_report()["bytes"]["device"]["params"] == masters
    got = model.state_dict()
    for k, v in _unpinned(precision, monkeypatch).items():  # the same run with gathered copies, bitwise
        assert torch.equal(got[k], v), k
    mgr.close()


def test_a_pinned_master_moved_to_nvme_and_back_keeps_every_value(tmp_path):
    cfg = dict(chunk_mb=40 * 4 / 2**20, offload_tier="nvme", offload_dir=str(tmp_path / "nvme"), placement="auto",
               device_memory_budget=1 << 30)
    model, opt = build("adam")
    model, gopt = setup_gemini(model, opt, GeminiConfig(**cfg))
    mgr = model.gemini_manager
    assert all(c.pinned for c in mgr.chunks)
    moved: list[tuple[int, bool]] = []

    def off_and_back(step: int) -> None:  # between steps: every master to NVMe, then half of them back
        for c in mgr.chunks:
            mgr.move_master(c, "nvme")
            assert not c.pinned and c.sm.data is ChunkState.RELEASED
        for c in mgr.chunks[step % 2 :: 2]:
            with pytest.MonkeyPatch.context() as m:  # read with pread into the pages it is pinned in, not faulted in
                m.setattr(NvmeFile, "view", lambda *a, **k: pytest.fail("read back through the mapping"))
                mgr.move_master(c, "device")
            assert c.pinned and c.master.view().data_ptr() == c.full.data_ptr()

    # and while a chunk is in use: a module's forward pre-hook moves its own chunk off and back
    first = next(iter(model.l1.parameters()))

    def in_use(module, args):
        c = mgr.chunks[mgr.slot_of[next(i for i, p in enumerate(mgr.params) if p is first)].chunk]
        assert c.sm.data is ChunkState.GATHERED
        was = c.pinned
        mgr.move_master(c, "nvme")
        assert not c.pinned and c.sm.data is ChunkState.GATHERED  # a gathered copy of its own now
        mgr.move_master(c, "device")
        moved.append((c.index, was))

    handle = model.l1.register_forward_pre_hook(in_use)
    _train(model, gopt, between=off_and_back)
    handle.remove()
    assert moved and any(was for _, was in moved)
    got = model.state_dict()
    for k, v in _unpinned("fp32", pytest.MonkeyPatch()).items():
        assert torch.equal(got[k], v), k
    # the ledger is back to the masters alone once every chunk is released
    assert mgr.memory_report()["bytes"]["device"]["params"] == sum(
        c.master.nbytes for c in mgr.chunks if c.master.tier == "device")
    mgr.close()


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, both: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if both else self.a(x)


def _stale_buffers_rank(rank: int, world: int) -> dict:
    """Rank 1 uses `b`, rank 0 does not; every flat gradient buffer handed out undefined is full of NaN (recycled
    pages hold old data), so rank 0 must zero `b`'s place before the reduction sums it with rank 1's."""
    new = Chunk._new_grad_full

    def stale(self, zero=True):
        out = new(self, zero)
        return out if zero else out.fill_(float("nan"))

    Chunk._new_grad_full = stale
    torch.manual_seed(0)
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, gopt = setup_gemini(model, opt, GeminiConfig(chunk_mb=64 * 4 / 2**20))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    gopt.backward(model(x, rank == 1).pow(2).mean())
    gopt.step()
    out = {k: v.clone() for k, v in model.state_dict().items()}
    model.gemini_manager.close()
    return out


def test_a_new_gradient_buffer_zeros_what_this_rank_did_not_compute():
    from lowmem.core_parallel import run_on_ranks

    got = run_on_ranks(_stale_buffers_rank, 2, timeout=120)
    torch.manual_seed(0)
    ref = _TwoHeads()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss = sum(ref(torch.randn(4, 5, generator=torch.Generator().manual_seed(r)), r == 1).pow(2).mean()
               for r in range(2)) / 2
    loss.backward()
    opt.step()
    for rank_state in got:
        assert_close_dicts(rank_state, ref.state_dict())



def test_one_rank_copies_gradients_straight_into_their_shard(monkeypatch):
    """On one rank the gradient shard is the whole flat buffer: the gradients are copied into it, with no flat buffer
    of their own (and no copy of it into the shard). Shards handed out undefined are full of NaN here, and `b` gets
    no gradient in odd steps, so its place in the shard must be zeroed, as plain torch's missing gradient is."""
    from lowmem.core_parallel.gemini.storage import TieredBuffer

    flat = []
    monkeypatch.setattr(Chunk, "_new_grad_full", lambda self, zero=True: flat.append(self.index))
    allocate = TieredBuffer.allocate

    def stale(self, fill=None, zero=True):
        allocate(self, fill, zero)
        if fill is None and not zero and self.tier != "nvme":
            self.view().fill_(float("nan"))

    monkeypatch.setattr(TieredBuffer, "allocate", stale)
    torch.manual_seed(0)
    model = _TwoHeads()
    ref = _TwoHeads()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, gopt = setup_gemini(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               GeminiConfig(chunk_mb=64 * 4 / 2**20))
    for step in range(4):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        gopt.backward(model(x, step % 2 == 0).pow(2).mean())
        gopt.step()
        gopt.zero_grad()
        ref(x, step % 2 == 0).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert flat == []
    assert_close_dicts(model.state_dict(), ref.state_dict())
    model.gemini_manager.close()
