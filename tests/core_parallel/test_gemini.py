"""Gemini's pure parts (config, chunk layout and search, state machine, access trace and eviction, memory
ledger, flat Adam/SGD against float64 torch, tiers) and its error paths (NVMe folder full or removed,
budget too small, unsupported optimizers), all on one process."""

from __future__ import annotations

import copy
import resource
import shutil
import signal

import pytest
import torch

from lowmem.core_parallel.gemini import GeminiConfig, NvmeTierError, parse_bytes, setup_gemini
from lowmem.core_parallel.gemini.adam import AdamHyper, SgdHyper, adam_update_, sgd_update_
from lowmem.core_parallel.gemini.layout import ParamInfo, padding_waste, plan_chunks, search_chunk_elems
from lowmem.core_parallel.gemini.placement import AccessTrace, MemoryLedger, pick_victim, static_plan
from lowmem.core_parallel.gemini.state import ChunkState, ChunkStateMachine, GeminiStateError
from lowmem.core_parallel.gemini.storage import HostPages, NvmeFile, PageRecycler, TieredBuffer
from tests.core_parallel.gemini_helpers import batch, build, fp16_overflow


# ---- config ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [("placement", "cuda"), ("offload_param_frac", 1.5), ("offload_optim_frac", -0.1), ("chunk_mb", 0),
     ("precision", "fp8"), ("prefetch", -1), ("device_memory_budget", "12 parsecs"), ("max_grad_norm", 0),
     ("offload_dir", " "), ("keep_gathered", -1)],
)
def test_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        GeminiConfig(**{field: value})


def test_config_auto_rejects_static_fractions_and_parses_sizes():
    with pytest.raises(ValueError, match="offload_param_frac"):
        GeminiConfig(placement="auto", offload_param_frac=0.5)
    assert GeminiConfig(device_memory_budget="1.5GiB").budget_bytes == 3 * 2**29
    assert parse_bytes("20GB") == 20 * 10**9 and parse_bytes(4096) == 4096 and parse_bytes("512 MiB") == 2**29


# ---- layout ------------------------------------------------------------------------------------------
def _infos(numels, trainable=None):
    trainable = trainable or [True] * len(numels)
    return [ParamInfo(index=i, name=f"p{i}", numel=n, dtype="f", trainable=t)
            for i, (n, t) in enumerate(zip(numels, trainable))]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_plan_packs_in_order_without_straddling(world):
    numels = [7, 13, 1, 50, 3, 3, 29, 11]
    trainable = [True, True, False, True, False, True, True, True]
    specs = plan_chunks(_infos(numels, trainable), world, chunk_elems=30)
    seen = []
    for spec in specs:
        # sized to its contents (padding only to shard evenly); capacity 30 raised to fit the 50-element parameter
        assert spec.size % world == 0 and 0 <= spec.size - spec.used < world and spec.used <= 50
        assert len({trainable[s.param] for s in spec.slots}) == 1 and spec.trainable == trainable[spec.slots[0].param]
        offset = 0
        for s in spec.slots:
            assert s.offset == offset and s.numel == numels[s.param] and s.offset + s.numel <= spec.size
            offset += s.numel
        seen += [s.param for s in spec.slots]
    assert sorted(seen) == list(range(len(numels)))
    assert [s.used for s in specs] == [20, 50, 43, 4]  # capacity 50: 7+13 | 50 | 3+29+11 | frozen 1+3
    for group in (True, False):  # order of use kept within each group
        order = [p for p in seen if trainable[p] is group]
        assert order == sorted(order)


def test_search_picks_the_least_padding():
    groups = [[30, 30, 30, 31, 29, 10, 50], [17, 17]]
    best = search_chunk_elems(groups, world=2)
    brute = min(range(50, 201, 2), key=lambda n: (sum(padding_waste(g, n) for g in groups), n))
    assert sum(padding_waste(g, best) for g in groups) == sum(padding_waste(g, brute) for g in groups)
    assert padding_waste([3, 3, 3], 6) == 3 and padding_waste([4, 2, 6], 6) == 0


# ---- state machine -----------------------------------------------------------------------------------
def test_state_machine_allows_the_cycle_and_rejects_the_rest():
    sm = ChunkStateMachine(0, frozenset({1, 2}))
    with pytest.raises(GeminiStateError, match="used while released"):
        sm.acquire()
    sm.to(ChunkState.GATHERING)
    with pytest.raises(GeminiStateError, match="gathering -> released"):
        sm.to(ChunkState.RELEASED)
    sm.to(ChunkState.GATHERED)
    sm.acquire()
    with pytest.raises(GeminiStateError, match="while 1 module"):
        sm.to(ChunkState.RELEASED)
    assert sm.release_use()
    sm.to(ChunkState.RELEASED)
    with pytest.raises(GeminiStateError, match="more releases"):
        sm.release_use()
    assert not sm.grad_arrived(1) and sm.grad_arrived(2)
    with pytest.raises(GeminiStateError, match="does not train"):
        sm.grad_arrived(7)


# ---- placement ---------------------------------------------------------------------------------------
def test_access_trace_and_furthest_next_use_eviction():
    trace = AccessTrace()
    for c in [0, 1, 2, 3, 2, 1, 0]:
        trace.record(c)
    assert pick_victim([0, 1, 2], trace, {0: 5, 1: 3, 2: 9}) == 1  # before the trace: least recently used
    trace.freeze()
    for c in [0, 1, 2]:
        trace.record(c)
    assert trace.cursor == 3 and trace.upcoming(2) == [3, 2]
    assert trace.next_use(3) == 0 and trace.next_use(2) == 1 and trace.next_use(0) == 3
    assert pick_victim([0, 1, 2], trace, {}) == 0 and trace.next_use(9) == float("inf")
    assert static_plan(4, 0.5, 0.25, "nvme") == [("nvme", "nvme"), ("nvme", "device"), ("device", "device")] + [
        ("device", "device")]


def test_ledger_accounts_bytes_peak_and_traffic():
    led = MemoryLedger()
    led.add("device", "params", 100)
    led.add("device", "grads", 50)
    led.move("device", "nvme", "params", 60)
    led.transfer("cpu", "device", 7)
    assert led.tier_total("device") == 90 and led.peak_device == 150
    led.new_step()
    rep = led.report()
    assert rep["bytes"]["nvme"]["params"] == 60 and rep["traffic_last_step"] == {"cpu->device": 7, "device->nvme": 60}
    assert rep["peak_device_bytes_last_step"] == 150
    with pytest.raises(RuntimeError, match="negative"):
        led.add("cpu", "optim", -1)


# ---- flat optimizer updates against torch in float64 -------------------------------------------------
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("decoupled", [False, True])
def test_flat_adam_matches_torch_float64(decoupled, fused):
    n = 1031
    p64 = torch.randn(n, dtype=torch.float64, requires_grad=True)
    ref = (torch.optim.AdamW if decoupled else torch.optim.Adam)([p64], lr=3e-3, betas=(0.8, 0.95), eps=1e-7,
                                                                   weight_decay=0.05)
    p, m, v = p64.detach().float().clone(), torch.zeros(n), torch.zeros(n)
    h = AdamHyper(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-7, weight_decay=0.05, decoupled=decoupled)
    for step in range(1, 7):
        g = torch.randn(n, dtype=torch.float64)
        p64.grad = g.clone()
        ref.step()
        adam_update_(p, g.float(), m, v, step, h, fused=fused)
    torch.testing.assert_close(p.double(), p64.detach(), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(v.double(), ref.state[p64]["exp_avg_sq"], rtol=2e-5, atol=1e-7)


def test_flat_adam_runs_torchs_fused_kernel_on_cpu(monkeypatch):
    calls = []
    for name in ("_fused_adam_", "_fused_adamw_"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    p, g, m, v = torch.randn(64), torch.randn(64), torch.zeros(64), torch.zeros(64)
    for decoupled in (False, True):
        adam_update_(p, g, m, v, 1, AdamHyper(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1,
                                              decoupled=decoupled))
    adam_update_(p, g, m, v, 2, AdamHyper(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0,
                                          decoupled=True), fused=False)
    assert calls == ["_fused_adam_", "_fused_adamw_"]


def test_flat_sgd_matches_torch_float64():
    n = 257
    p64 = torch.randn(n, dtype=torch.float64, requires_grad=True)
    ref = torch.optim.SGD([p64], lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    p, buf = p64.detach().float().clone(), torch.zeros(n)
    h = SgdHyper(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False)
    for step in range(1, 6):
        g = torch.randn(n, dtype=torch.float64)
        p64.grad = g.clone()
        ref.step()
        sgd_update_(p, g.float(), buf, step, h)
    torch.testing.assert_close(p.double(), p64.detach(), rtol=1e-5, atol=1e-6)


# ---- tiers -------------------------------------------------------------------------------------------
def test_buffers_move_between_tiers_unchanged(tmp_path):
    nvme = NvmeFile(tmp_path, rank=0)
    buf = TieredBuffer(1000, "device", torch.device("cpu"), nvme, nvme.reserve(1000))
    nvme.open()
    data = torch.randn(1000)
    buf.allocate(fill=data)
    for tier in ("nvme", "cpu", "nvme", "device"):
        assert buf.move(tier) == 4000 and buf.tier == tier
        torch.testing.assert_close(buf.view(), data, rtol=0, atol=0)
    nvme.close()
    assert not nvme.path.exists()


def _nvme_setup(tmp_path, **kw):
    model, opt = build("adam")
    keep = copy.deepcopy(model.state_dict())
    cfg = GeminiConfig(chunk_mb=40 * 4 / 2**20, offload_dir=str(tmp_path / "nvme"), **kw)
    return model, opt, cfg, keep


def _resident_pages(pages: HostPages) -> int:
    """Pages of the mapping in memory (mincore)."""
    import ctypes
    import mmap

    n = pages.nbytes // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(pages.addr), ctypes.c_size_t(pages.nbytes), vec) == 0
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("mremap", [True, False], ids=["recycled", "dropped"])
def test_page_recycler_moves_pages_to_the_next_buffer_and_bounds_idle_memory(mremap):
    nbytes = 64 << 10
    recycler = PageRecycler(max_bytes=2 * nbytes)
    if not mremap:
        recycler._mremap = None  # kernels without MREMAP_DONTUNMAP: released pages are dropped at once
    a, b, c, d = (HostPages(nbytes) for _ in range(4))
    ta, tb, tc, td = (p.tensor(torch.float32, nbytes // 4) for p in (a, b, c, d))
    assert recycler.acquire(a) is False  # fresh: reads zeros
    assert torch.count_nonzero(ta) == 0
    ta.fill_(7.0)
    recycler.release(a)
    # b takes a's pages (a keeps its address, with no pages: it would read zeros), or gets fresh zero pages
    assert recycler.acquire(b) is mremap
    assert _resident_pages(a) == 0
    expect_b = 7.0 if mremap else 0.0
    assert torch.equal(tb, torch.full_like(tb, expect_b))
    assert recycler.moves == int(mremap)
    # re-acquiring a buffer released but not yet handed on keeps its data
    tb.fill_(3.0)
    recycler.release(b)
    if mremap:
        assert recycler.acquire(b) is True and torch.equal(tb, torch.full_like(tb, 3.0))
        recycler.release(b)
    # at most max_bytes stay idle: the oldest is dropped
    for p, t in ((c, tc), (d, td)):
        recycler.acquire(p)
        t.fill_(1.0)
    recycler.release(c)
    recycler.release(d)
    assert recycler.idle_bytes <= 2 * nbytes
    if mremap:
        assert _resident_pages(b) == 0 and _resident_pages(c) > 0 and _resident_pages(d) > 0
    recycler.drop_all()
    assert recycler.idle_bytes == 0
    assert all(_resident_pages(p) == 0 for p in (a, b, c, d))


def test_chunks_are_sized_to_their_contents_in_every_tier(tmp_path):
    model, opt, cfg, _ = _nvme_setup(tmp_path, offload_param_frac=1.0, offload_optim_frac=1.0)
    numels = {id(p): p.numel() for p in model.parameters()}
    trained = sum(p.numel() for g in opt.param_groups for p in g["params"])
    model, opt = setup_gemini(model, opt, cfg)
    mgr = model.gemini_manager
    sizes = [c.spec.size for c in mgr.chunks]
    assert sum(sizes) == sum(numels.values())  # one rank: not one element of padding
    capacity = max(40, *numels.values())  # 40 elements, raised to fit the largest parameter
    assert len(set(sizes)) > 1 and max(sizes) <= capacity  # the capacity did not size every chunk
    nvme = model.memory_report()["bytes"]["nvme"]
    assert nvme["params"] == 4 * sum(numels.values()) and nvme["optim"] == 2 * 4 * trained  # fp32 master; Adam x2
    x, y = batch(0)
    ((model(x, True) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()
    mgr.close()


def test_nvme_folder_too_small_fails_at_setup_and_leaves_the_model(tmp_path):
    model, opt, cfg, keep = _nvme_setup(tmp_path, offload_param_frac=1.0, offload_optim_frac=1.0)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # a "disk" with room for one page
    try:
        with pytest.raises(NvmeTierError, match="cannot reserve .* free space there"):
            setup_gemini(model, opt, cfg)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, keep[k], rtol=0, atol=0)


def test_nvme_folder_removed_while_training_is_a_clear_error(tmp_path):
    model, opt, cfg, _ = _nvme_setup(tmp_path, offload_param_frac=1.0, offload_optim_frac=1.0)
    model, opt = setup_gemini(model, opt, cfg)
    x, y = batch(0)
    opt.backward(((model(x, True) - y) ** 2).mean())
    opt.step()
    shutil.rmtree(tmp_path / "nvme")
    with pytest.raises(NvmeTierError, match="was removed while training"):
        model(x, True)


def test_budget_too_small_for_the_chunks_in_use(tmp_path):
    model, opt = build("adam")
    model, opt = setup_gemini(model, opt, GeminiConfig(placement="auto", chunk_mb=40 * 4 / 2**20,
                                                       device_memory_budget=200))
    x, y = batch(0)
    with pytest.raises(RuntimeError, match="device_memory_budget=200 bytes cannot hold"):
        model(x, True)


def test_fp16_overflow_skips_the_step_on_one_process():
    out = fp16_overflow(0, 1)
    assert out["skipped_unchanged"] and out["trained_after"] and out["scaler"]["overflows"] == 1


def test_unsupported_optimizers_and_parameters_are_refused():
    model, _ = build("adam")
    trainable = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(TypeError, match="RMSprop"):
        setup_gemini(model, torch.optim.RMSprop(trainable), GeminiConfig())
    with pytest.raises(ValueError, match="amsgrad"):
        setup_gemini(model, torch.optim.Adam(trainable, amsgrad=True), GeminiConfig())
    with pytest.raises(ValueError, match="not parameters of the model"):
        setup_gemini(model, torch.optim.Adam([*model.parameters(), torch.zeros(2, requires_grad=True)]), GeminiConfig())
    with pytest.raises(ValueError, match="emb.weight requires grad but is not in the optimizer"):
        setup_gemini(model, torch.optim.Adam([model.l2.weight]), GeminiConfig())


def test_lr_scheduler_closure_and_no_grad_forward_match_torch():
    ref_model, ref_opt = build("adamw")
    model, opt = build("adamw")
    model, opt = setup_gemini(model, opt, GeminiConfig(chunk_mb=64 * 4 / 2**20, prefetch=2))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    for step in range(4):
        x, y = batch(step)
        for m, o in ((model, opt), (ref_model, ref_opt)):
            def closure(m=m, o=o, x=x, y=y):
                loss = ((m(x, True) - y) ** 2).mean()
                loss.backward()
                return loss
            o.step(closure)
            o.zero_grad()
        for s in scheds:
            s.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.01 * 0.5**4
    x, _ = batch(9)
    with torch.no_grad():
        torch.testing.assert_close(model(x, True), ref_model(x, True), rtol=1e-6, atol=1e-6)
    assert all(c.sm.data.value == "released" for c in model.gemini_manager.chunks)


def _count_gathers(monkeypatch) -> list[int]:
    """The indices of the chunks gathered from now on, in order (`Chunk.start_gather` recorded, then run)."""
    from lowmem.core_parallel.gemini import chunk as chunk_mod

    gathers: list[int] = []
    real = chunk_mod.Chunk.start_gather
    monkeypatch.setattr(chunk_mod.Chunk, "start_gather", lambda self, *a, **k: gathers.append(self.index) or real(
        self, *a, **k))
    return gathers


def _step_both(pairs, x: torch.Tensor) -> None:
    """One step of each (model, optimizer): Gemini's (its `backward`) and plain torch's, on the loss |m(x)|^2."""
    for m, o in pairs:
        loss = m(x).pow(2).mean()
        (o.backward(loss) if hasattr(o, "backward") else loss.backward())
        o.step()
        o.zero_grad()


@pytest.mark.parametrize("keep", [None, 0])
def test_first_step_gathers_a_shared_chunk_once_per_run_of_modules(tmp_path, monkeypatch, keep):
    """While the first step records the order, modules that share a chunk and run one after another gather it
    once, not once per module (each gather reads the whole chunk from its tier: from disk on NVMe);
    `keep_gathered=0` keeps nothing gathered. The numbers match plain torch either way."""

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(4)]
    ref = torch.nn.Sequential(*copy.deepcopy(layers))
    model = torch.nn.Sequential(*layers)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / "nvme"), offload_param_frac=1.0,
                       offload_optim_frac=1.0, chunk_mb=4 * 16 * 17 * 4 / 2**20, keep_gathered=keep)
    model, opt = setup_gemini(model, opt, cfg)
    assert len(model.gemini_manager.chunks) == 1  # the four layers share one chunk
    gathers = _count_gathers(monkeypatch)
    x = torch.randn(8, 16)
    for step in range(2):
        gathers.clear()
        _step_both(((model, opt), (ref, ref_opt)), x)
        if step == 0:
            # forward: once (kept between the layers) or once per layer; backward: once (a chunk stays
            # gathered until all its parameters have their gradients)
            assert len(gathers) == (2 if keep is None else 5), gathers
    got, want = model.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6)
    model.gemini_manager.close()


class _Interleaved(torch.nn.Module):
    """A frozen base in two chunks ({x1, x2} and {y1, y2}, registered in that order) run as x1, adapter, y1, y2,
    x2, with a small trainable adapter (LoRA-like, rank 1, a chunk of its own) between: chunk X is used again
    after the adapter's chunk and chunk Y."""

    def __init__(self) -> None:
        super().__init__()
        self.x1, self.x2, self.y1, self.y2 = (torch.nn.Linear(16, 16) for _ in range(4))
        self.down, self.up = torch.nn.Linear(16, 1, bias=False), torch.nn.Linear(1, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.x1(x)
        h = h + self.up(self.down(h))
        return self.x2(self.y2(self.y1(h)))


def test_a_small_chunk_between_uses_does_not_push_a_large_one_out_of_the_keep_window(tmp_path, monkeypatch):
    """`keep_gathered` counts chunks by size: the adapter's small chunk between two uses of chunk X leaves X
    gathered (with a count of chunks, the adapter's and Y's filled the window of 2 and X was read from disk again
    at each use); the values match plain torch."""

    torch.manual_seed(0)
    model = _Interleaved()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("down", "up")))
    ref = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ref_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    cfg = GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / "nvme"), offload_param_frac=1.0,
                       offload_optim_frac=1.0, chunk_mb=2 * 16 * 17 * 4 / 2**20)
    model, opt = setup_gemini(model, torch.optim.Adam(trainable, lr=1e-2), cfg)
    chunks = model.gemini_manager.chunks
    assert len(chunks) == 3 and sorted(c.full_nbytes for c in chunks)[0] < chunks[0].full_nbytes / 10
    gathers = _count_gathers(monkeypatch)
    for _step in range(3):
        gathers.clear()
        x = torch.randn(8, 16)
        _step_both(((model, opt), (ref, ref_opt)), x)
    # the last step follows the recorded order: the large chunks once in the forward and once in the backward
    large = [c.index for c in chunks if c.full_nbytes == max(c.full_nbytes for c in chunks)]
    assert [gathers.count(i) for i in large] == [2, 2], gathers
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-6, atol=1e-6)
    model.gemini_manager.close()


class _Alternating(torch.nn.Module):
    """LoRA's pattern: frozen layers x1, x2, x3 (one chunk) each followed by its small trainable adapter (another
    chunk), so the first step, which has no recorded order yet, meets the chunks as X A X A X A."""

    def __init__(self) -> None:
        super().__init__()
        self.xs = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(16, 1, bias=False) for _ in range(3))
        self.ups = torch.nn.ModuleList(torch.nn.Linear(1, 16, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, down, up in zip(self.xs, self.downs, self.ups, strict=True):
            x = lin(x)
            x = x + up(down(x))
        return x


def test_first_step_keeps_a_frozen_chunk_gathered_across_the_adapters_between_its_layers(tmp_path, monkeypatch):
    """Before the order is recorded, the adapter's small chunk going idle between the frozen chunk's layers does not
    release the frozen chunk (with one idle chunk kept, the frozen chunk was read from disk again at every layer:
    3 times in the forward); the first step gathers it as often as the recorded steps do. Values match torch."""
    torch.manual_seed(0)
    model = _Alternating()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("downs", "ups")))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    cfg = GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / "nvme"), offload_param_frac=1.0,
                       offload_optim_frac=1.0, chunk_mb=3 * 16 * 17 * 4 / 2**20)
    model, opt = setup_gemini(model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2),
                              cfg)
    chunks = model.gemini_manager.chunks
    frozen = [c.index for c in chunks if not c.spec.trainable]
    assert len(frozen) == 1 and len(chunks) == 2
    gathers = _count_gathers(monkeypatch)
    counts = []
    for _step in range(3):
        gathers.clear()
        _step_both(((model, opt), (ref, ref_opt)), torch.randn(8, 16))
        counts.append(gathers.count(frozen[0]))
    assert counts[0] <= counts[2] <= 2, counts
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-6, atol=1e-6)
    model.gemini_manager.close()


def _device_and_nvme_runs(tmp_path, steps: int, train, **cfg) -> None:
    """The same small model trained for `steps` steps, each `train(opt, nvme_grads)` after the backward, with every
    buffer in memory and with every buffer on NVMe (`nvme_grads`: the ids of the NVMe gradient shards); the weights
    must be equal bitwise."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    runs = {}
    for name, tier in (("device", {}), ("nvme", dict(offload_tier="nvme", offload_dir=str(tmp_path / "n"),
                                                      offload_param_frac=1.0, offload_optim_frac=1.0))):
        model = copy.deepcopy(base)
        model, opt = setup_gemini(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  GeminiConfig(chunk_mb=300 * 4 / 2**20, **cfg, **tier))
        grads = {id(c.grad) for c in model.gemini_manager.trainable_chunks if c.grad.tier == "nvme"}
        assert bool(grads) == (name == "nvme")
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            opt.backward(model(torch.randn(4, 16, generator=g)).pow(2).sum())
            train(opt, grads)
            opt.zero_grad()
        runs[name] = {k: v.clone() for k, v in model.state_dict().items()}
        model.gemini_manager.close()
    assert all(torch.equal(runs["device"][k], runs["nvme"][k]) for k in runs["device"])


def test_clipping_gradients_on_nvme_never_touches_their_file_mapping_and_equals_the_device_tier(tmp_path,
                                                                                               monkeypatch):
    """Clipped gradient shards on NVMe are read with pread for the norm and scaled where the step stages them (in
    place through the file mapping, every page faulted: 94% of an SD3.5 full fine-tune's step); the weights equal
    the all-in-memory run's bitwise."""
    from lowmem.core_parallel.gemini import storage

    real = storage.TieredBuffer.view

    def step(opt, grads):
        def view(self):
            assert id(self) not in grads, "an NVMe gradient shard read through its file mapping"
            return real(self)

        monkeypatch.setattr(storage.TieredBuffer, "view", view)
        opt.step()
        monkeypatch.setattr(storage.TieredBuffer, "view", real)
        assert opt.last_grad_norm > 0.05  # clipped every step

    _device_and_nvme_runs(tmp_path, 3, step, max_grad_norm=0.05)


def test_the_norm_of_nvme_gradients_is_taken_as_they_are_written(tmp_path, monkeypatch):
    """Clipping by norm reads no NVMe gradient shard back from disk (a whole extra read of the gradients each step):
    each shard's norm is taken from memory as it is written, and the weights still equal the all-in-memory run's
    bitwise."""
    from lowmem.core_parallel.gemini.optimizer import GeminiOptimizer

    real = GeminiOptimizer._grad_values

    def step(opt, grads):
        def read_back(self, c):
            assert id(c.grad) not in grads, "an NVMe gradient shard read back for the norm"
            return real(self, c)

        monkeypatch.setattr(GeminiOptimizer, "_grad_values", read_back)
        opt.step()
        monkeypatch.setattr(GeminiOptimizer, "_grad_values", real)
        assert opt.last_grad_norm > 0.05  # clipped every step

    _device_and_nvme_runs(tmp_path, 3, step, max_grad_norm=0.05)


def test_clip_by_norm_then_by_value_on_nvme_gradients_equals_the_device_tier(tmp_path):
    """A user clipping by norm, then by value, before `step()`: the norm's factor pending on NVMe gradient shards is
    applied before the clamp reads them (clamping unscaled values gave other weights)."""
    def step(opt, grads):
        assert opt.clip_grad_norm(0.05) > 0.05
        opt.clip_grad_value(0.002)
        opt.step()

    _device_and_nvme_runs(tmp_path, 2, step)


def test_order_of_use_sorts_declared_modules_and_keeps_the_rest():
    from lowmem.core_parallel.gemini.layout import order_of_use

    names = ["emb.weight", "net.up.w", "net.up.lora_A.default.weight", "net.mid.w", "net.down.base_layer.w",
             "net.unused.w", "net.down2.w", "head.w"]
    # `net` declared: down (peft wraps it: base_layer is under it), mid, up, down2; `unused` never ran
    got = order_of_use(names, {"net": ["down", "mid", "up", "down2"]})
    assert [names[i] for i in got] == ["emb.weight", "net.down.base_layer.w", "net.unused.w", "net.mid.w",
                                       "net.up.w", "net.up.lora_A.default.weight", "net.down2.w", "head.w"]
    assert order_of_use(names, {}) == list(range(len(names)))
    whole = order_of_use(["b.w", "a.w", "w"], {"": ["a", "", "b"]})  # the root declared, owning a parameter
    assert whole == [1, 2, 0]


class _Registered(torch.nn.Module):
    """Six frozen layers registered a1 b1 c1 a2 b2 c2 (chunks of two: {a1, b1}, {c1, a2}, {b2, c2}) and run a1 a2 b1
    b2 c1 c2, after a trainable input layer (so the backward runs through all of them)."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("a1", "b1", "c1", "a2", "b2", "c2"):
            setattr(self, name, torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(x)
        for name in ("a1", "a2", "b1", "b2", "c1", "c2"):
            x = torch.tanh(getattr(self, name)(x))
        return x


@pytest.mark.parametrize("declared", [False, True])
def test_chunks_packed_in_the_declared_order_of_use_are_gathered_once_per_pass(tmp_path, monkeypatch, declared):
    """`set_module_order`: chunks follow the order the modules run, so with a chunk kept gathered only while it is
    the next one used (`keep_gathered=1`) each is read from its tier once in the forward and once in the backward;
    packed in registration order, a chunk whose layers run apart is read once per run. Values equal plain torch."""
    from lowmem.core_parallel.gemini import set_module_order

    torch.manual_seed(0)
    model = _Registered()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head"))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.head.parameters(), lr=1e-2)
    if declared:
        set_module_order(model, ["head", "a1", "a2", "b1", "b2", "c1", "c2"])
    cfg = GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / "nvme"), offload_param_frac=1.0,
                       offload_optim_frac=1.0, chunk_mb=2 * 16 * 17 * 4 / 2**20, keep_gathered=1, prefetch=0)
    model, opt = setup_gemini(model, torch.optim.Adam(model.head.parameters(), lr=1e-2), cfg)
    manager = model.gemini_manager
    frozen = [c for c in manager.chunks if not c.spec.trainable]
    packed = [[manager.names[s.param] for s in c.spec.slots] for c in frozen]
    assert packed == ([["a1.weight", "a1.bias", "a2.weight", "a2.bias"], ["b1.weight", "b1.bias", "b2.weight",
                       "b2.bias"], ["c1.weight", "c1.bias", "c2.weight", "c2.bias"]] if declared else
                      [["a1.weight", "a1.bias", "b1.weight", "b1.bias"], ["c1.weight", "c1.bias", "a2.weight",
                       "a2.bias"], ["b2.weight", "b2.bias", "c2.weight", "c2.bias"]])
    gathers = _count_gathers(monkeypatch)
    for _step in range(2):
        gathers.clear()
        x = torch.randn(4, 16)
        _step_both(((model, opt), (ref, ref_opt)), x)
    per_chunk = [gathers.count(c.index) for c in frozen]
    assert per_chunk == ([2, 2, 2] if declared else [4, 4, 4]), gathers
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-6, atol=1e-6)
    manager.close()


def test_lr_scheduler_on_the_users_optimizer_follows_gemini_steps_without_a_false_order_warning():
    """A torch LR scheduler built on the user's optimizer (as Lightning and the scripts build it) drives Gemini's
    steps (shared param_groups) and sees the step as done, so it does not warn that it ran before the step."""
    import warnings

    model, opt = build("adam")
    ref_model, ref_opt = build("adam")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    model, gopt = setup_gemini(model, opt, GeminiConfig(chunk_mb=40 * 4 / 2**20))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the false "lr_scheduler.step() before optimizer.step()" fails here
        for step in range(3):
            x, y = batch(step)
            gopt.backward(((model(x, step % 2 == 0) - y) ** 2).mean())
            gopt.step()
            gopt.zero_grad()
            sched.step()
            ((ref_model(x, step % 2 == 0) - y) ** 2).mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step()
    assert [g["lr"] for g in gopt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    got = model.state_dict()
    for name, p in ref_model.state_dict().items():
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-6)


class _MidLast(torch.nn.Module):
    """A UNet's shape in miniature: registered down, up, mid; run down, mid, up. In parameter order the last chunk
    (mid) gets its gradients only after every up layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.down = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
        self.up = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(3))
        self.mid = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in (*self.down, self.mid, *self.up):
            x = torch.tanh(m(x))
        return x


def test_one_rank_reduces_each_chunk_when_its_gradients_are_in():
    """One rank (no collective order to keep): a chunk's local gradients are reduced into its shard as soon as they
    are complete, so backward holds about one chunk's local gradients, not every up layer's waiting for mid's;
    the weights equal torch's AdamW."""
    torch.manual_seed(0)
    ref = _MidLast()
    model = copy.deepcopy(ref)
    model, opt = setup_gemini(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                              GeminiConfig(chunk_mb=64 * 65 * 4 / 2**20))  # one layer (weight + bias) per chunk
    mgr = model.gemini_manager
    held, most = 0, 0
    account = mgr._account_local_grads

    def spy(c, before):
        nonlocal held, most
        held += c.local_grad_nbytes - before
        most = max(most, held)
        account(c, before)

    mgr._account_local_grads = spy
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    x = torch.randn(8, 64)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert len(mgr.trainable_chunks) == 7
    assert most <= 2 * 64 * 65 * 4, most  # at most two chunks' local gradients at once (7 were held before)
    state = model.state_dict()
    for name, q in ref.named_parameters():
        torch.testing.assert_close(state[name], q.detach(), rtol=1e-5, atol=1e-6)
