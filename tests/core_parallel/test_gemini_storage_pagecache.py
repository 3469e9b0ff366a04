"""The NVMe tier writes through the page cache, not into it: data round-trips exactly, and once regions are
written back and read, the tier's file has (almost) no pages left in the page cache, which a memory cgroup
would charge to the job. Residency is checked with mincore; filesystems whose pages are the file (tmpfs) keep
them, and those checks skip there."""

from __future__ import annotations

import os

import pytest
import torch

from lowmem.core_parallel.gemini import GeminiConfig, setup_gemini
from lowmem.core_parallel.gemini.storage import NvmeFile, TieredBuffer, write_back_and_drop
from lowmem.utils.memory_meter import file_resident_bytes

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def _drops_pages(folder) -> bool:
    """Whether the filesystem of `folder` lets written-back pages leave the page cache (not tmpfs)."""
    probe = os.path.join(folder, "probe.bin")
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.pwrite(fd, b"\1" * (4 * MIB), 0)
        write_back_and_drop(fd, 0, 4 * MIB)
        return file_resident_bytes(probe) < MIB
    finally:
        os.close(fd)
        os.unlink(probe)


@pytest.fixture
def folder(tmp_path):
    return tmp_path / "nvme"


def _needs_dropping(folder) -> None:
    os.makedirs(folder, exist_ok=True)
    if not _drops_pages(folder):
        pytest.skip(f"{folder}: this filesystem keeps written-back pages in the page cache (tmpfs?); "
                    "residency cannot fall there")


def test_regions_round_trip_exactly_and_leave_the_page_cache(folder):
    sizes = [1, 1023, 257 * 1024, 1 << 20, 3 * (1 << 20) + 5]  # odd sizes, several MiB in all
    f = NvmeFile(folder, rank=0, writeback_lag=4 * MIB)
    offsets = [f.reserve(n) for n in sizes]
    f.open()
    try:
        g = torch.Generator().manual_seed(0)
        values = [torch.randn(n, generator=g) for n in sizes]
        for off, v in zip(offsets, values):
            f.write(off, v)
        for off, v in zip(offsets, values):  # read back while some are still being written back
            assert torch.equal(f.read(off, torch.empty_like(v)), v)
        # through the mapping, then handed back with drop_pages
        f.view(offsets[3], sizes[3]).mul_(2)
        f.drop_pages(offsets[3], sizes[3])
        values[3] = values[3] * 2
        f.flush()
        for off, v in zip(offsets, values):
            assert torch.equal(f.read(off, torch.empty_like(v)), v)
        _needs_dropping(folder)
        assert f.size > 16 * MIB
        assert file_resident_bytes(str(f.path)) <= 4 * PAGE, "the tier's pages stayed in the page cache"
    finally:
        f.close()


def test_pages_written_and_not_yet_flushed_stay_below_the_lag(folder):
    _needs_dropping(folder)
    lag = 2 * MIB
    f = NvmeFile(folder, rank=0, writeback_lag=lag)
    n = MIB // 4  # 1 MiB of fp32
    offsets = [f.reserve(n) for _ in range(24)]
    f.open()
    try:
        for i, off in enumerate(offsets):
            f.write(off, torch.full((n,), float(i)))
            assert file_resident_bytes(str(f.path)) <= lag + MIB + 4 * PAGE
        f.flush()
        assert file_resident_bytes(str(f.path)) <= 4 * PAGE
        assert [f.read(off, torch.empty(n))[::4096].unique().item() for off in offsets] == list(range(24))
    finally:
        f.close()


def test_the_default_lag_keeps_at_most_16_mib_of_the_tier_cached(folder):
    """The default write-behind lag (issue 18: 16 MiB, half the first one) bounds what a step leaves cached."""
    from lowmem.core_parallel.gemini.storage import WRITEBACK_LAG

    _needs_dropping(folder)
    f = NvmeFile(folder, rank=0)
    n = MIB  # 4 MiB of fp32
    offsets = [f.reserve(n) for _ in range(10)]
    f.open()
    try:
        assert f.writeback_lag == WRITEBACK_LAG <= 16 * MIB
        most = 0
        for i, off in enumerate(offsets):
            f.write(off, torch.full((n,), float(i)))
            most = max(most, file_resident_bytes(str(f.path)))
        assert most <= 16 * MIB + 4 * MIB + 4 * PAGE, f"{most / MIB:.1f} MiB of the tier cached at once"
    finally:
        f.close()


def test_tiered_buffer_moves_keep_values_and_leave_no_pages(folder):
    _needs_dropping(folder)
    f = NvmeFile(folder, rank=0)
    n = 3 * MIB // 4 + 7
    buf = TieredBuffer(n, "cpu", torch.device("cpu"), f, f.reserve(n))
    f.open()
    try:
        value = torch.randn(n, generator=torch.Generator().manual_seed(1))
        buf.allocate(fill=value)
        buf.move("nvme")
        f.flush()
        assert file_resident_bytes(str(f.path)) <= 4 * PAGE
        assert torch.equal(buf.read_into(torch.empty(n)), value)
        buf.move("cpu")
        assert torch.equal(buf.view(), value)
    finally:
        f.close()


def _train(tier: str, folder) -> tuple[dict, int | None]:
    """Three AdamW steps of a 1M-parameter MLP under Gemini with everything on `tier`: (state, most bytes of the
    tier's file in the page cache after setup and after each step; None without a file)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = GeminiConfig(chunk_mb=1, offload_param_frac=1.0, offload_optim_frac=1.0, offload_tier=tier,
                       offload_dir=str(folder) if tier == "nvme" else None)
    model, opt = setup_gemini(model, opt, cfg)
    nvme = model.gemini_manager.nvme
    resident = file_resident_bytes(str(nvme.path)) if nvme else None
    try:
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(8, 512, generator=g)
            opt.backward((model(x) - x).pow(2).mean())
            opt.step()
            opt.zero_grad()
            if nvme:
                resident = max(resident, file_resident_bytes(str(nvme.path)))
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, resident
    finally:
        model.gemini_manager.close()


def test_gemini_steps_on_the_nvme_tier_leave_its_file_out_of_the_page_cache(folder):
    on_cpu, _ = _train("cpu", None)
    on_nvme, resident = _train("nvme", folder)
    for name, want in on_cpu.items():
        assert torch.equal(on_nvme[name], want), name  # the tier moves data, not numbers
    _needs_dropping(folder)
    assert resident <= 4 * PAGE, f"{resident / MIB:.1f} MiB of the 16 MiB tier stayed in the page cache"


def test_the_step_stages_nvme_shards_piece_by_piece_with_the_same_numbers(folder, monkeypatch):
    from lowmem.core_parallel.gemini import optimizer

    on_cpu, _ = _train("cpu", None)
    monkeypatch.setattr(optimizer, "STEP_PIECE", 4096)  # 64 pieces per 1 MiB chunk
    on_nvme, _ = _train("nvme", folder)
    for name, want in on_cpu.items():
        assert torch.equal(on_nvme[name], want), name


def test_pieces_cover_the_runs_and_cut_them_from_their_own_start():
    from lowmem.core_parallel.gemini.optimizer import _pieces

    runs = [(0, 10, 0, 1), (10, 13, 1, 1), (20, 45, 0, 2), (45, 46, 0, 1)]
    spans = _pieces(runs, 8)
    covered = [(a, b, *k) for _, _, rs in spans for a, b, *k in rs]
    assert [r[:2] for r in covered] == [(0, 8), (8, 10), (10, 13), (20, 28), (28, 36), (36, 44), (44, 45), (45, 46)]
    assert [r[2:] for r in covered] == [(0, 1), (0, 1), (1, 1)] + [(0, 2)] * 4 + [(0, 1)]
    for lo, hi, rs in spans:
        assert hi - lo <= 8 and lo == rs[0][0] and hi == rs[-1][1]


def test_a_peers_read_of_an_nvme_region_leaves_the_page_cache(folder):
    """Peer reads (`gemini.peer_reads`) pread a peer's NVMe file: its pages must not stay cached afterwards."""
    from lowmem.core_parallel.gemini.peer_reads import _pread

    _needs_dropping(folder)
    path = os.path.join(folder, "peer.bin")
    data = torch.randn(MIB)  # 4 MiB of fp32
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.pwrite(fd, data.numpy().tobytes(), 0)
        write_back_and_drop(fd, 0, 4 * MIB)
        reader = os.open(path, os.O_RDONLY)
        try:
            out = torch.empty(MIB)
            _pread(reader, out, 0)
        finally:
            os.close(reader)
        assert torch.equal(out, data)
        assert file_resident_bytes(path) < MIB, file_resident_bytes(path)
    finally:
        os.close(fd)


def test_page_aligned_reads_go_direct_with_the_same_bytes_and_leave_no_pages(folder):
    """Into page-aligned memory (a gathered chunk's `HostPages`) the whole pages of a region are read with O_DIRECT and
    its tail buffered; elsewhere (unaligned memory, an offset inside a region) buffered: the same bytes either way,
    written through pwrite or the mapping and not yet written back."""
    from lowmem.core_parallel.gemini.host_memory import HostPages

    _needs_dropping(folder)
    sizes = [PAGE // 4 * 3 + 5, 257 * 1024, PAGE // 2]  # fp32: pages and a tail; whole pages; one bf16 page below
    f = NvmeFile(folder, rank=0)
    offsets = [f.reserve(n) for n in sizes]
    f.open()
    if f._direct is None:
        f.close()
        pytest.skip(f"{folder}: no O_DIRECT here")
    try:
        g = torch.Generator().manual_seed(0)
        values = [torch.randn(n, generator=g) for n in sizes]
        values[2] = values[2].to(torch.bfloat16).view(torch.float32)[: sizes[2] // 2].contiguous()
        for off, v in zip(offsets[:2], values[:2]):
            f.write(off, v)
        f.view(offsets[2], values[2].numel()).copy_(values[2])  # through the mapping, still dirty
        pages = HostPages(max(sizes) * 4)
        before = f.direct_bytes
        for off, v in zip(offsets, values):
            out = pages.tensor(torch.float32, v.numel())
            out.fill_(float("nan"))
            assert torch.equal(f.read(off, out), v)
            unaligned = torch.empty(v.numel() + 1)[1:]  # 4 bytes past torch's 64-byte alignment: buffered
            assert torch.equal(f.read(off, unaligned), v)
        whole = sum(v.numel() * 4 // PAGE * PAGE for v in values)
        assert f.direct_bytes - before == whole > 0
        inside = torch.empty(values[1].numel() - PAGE // 4 + 1)[1:]
        f.read(offsets[1] + PAGE, pages.tensor(torch.float32, inside.numel()))  # page-aligned offset inside: direct
        assert f.direct_bytes - before > whole
        f.read(offsets[1] + 4, inside[:-1])  # an offset off a page: buffered
        assert torch.equal(inside[:-1], values[1][1 : inside.numel()])
        f.flush()
        assert file_resident_bytes(f.path) < 2 * MIB
    finally:
        f.close()


def test_a_collected_tier_closes_its_direct_descriptor(folder):
    """An NVMe file collected without `close` (an error path) is removed; its O_DIRECT descriptor is closed too, or
    the removed file would keep its disk space until the process exits."""
    import gc

    f = NvmeFile(folder, rank=0)
    f.reserve(1 << 20)
    f.open()
    fd = f._direct
    if fd is None:
        f.close()
        pytest.skip(f"{folder}: no O_DIRECT here")
    del f
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
