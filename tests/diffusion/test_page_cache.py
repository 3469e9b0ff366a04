"""What loading leaves in the page cache (issue 18): a memory cgroup charges the pages a job reads to it, so the
streamed UNet load reads only the bytes it asks for (readahead off) and leaves its file out of the page cache once
Gemini is set up, and the frozen VAE and text encoder leave theirs once loaded. Residency is checked with mincore;
filesystems whose pages are the file (tmpfs) keep them, and those checks skip there. Values are checked too: the
advice changes what stays cached, never what is read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lowmem import core_parallel
from lowmem.core_parallel.gemini.lazy import SafetensorsSource
from lowmem.utils.fileio import drop_page_cache, fsync_file
from lowmem.utils.memory_meter import file_resident_bytes

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20


def _warm(path: Path) -> None:
    """Written to disk (dirty pages cannot be dropped), then read whole into the page cache."""
    fsync_file(path)
    with open(path, "rb") as f:
        while f.read(MIB):
            pass


def _needs_dropping(folder: Path) -> None:
    probe = folder / "probe.bin"
    probe.write_bytes(b"\1" * (4 * MIB))
    fsync_file(probe)
    drop_page_cache(probe)
    try:
        if file_resident_bytes(str(probe)) > MIB:
            pytest.skip(f"{folder}: this filesystem keeps pages in the page cache (tmpfs?); residency cannot fall")
    finally:
        probe.unlink()


def _cold(path: Path) -> None:
    fsync_file(path)
    drop_page_cache(path)
    assert file_resident_bytes(str(path)) == 0


def test_a_read_brings_in_no_pages_past_what_it_asked(tmp_path):
    from safetensors.torch import save_file

    _needs_dropping(tmp_path)
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3 * MIB, generator=g), "b": torch.randn(3 * MIB, generator=g),
               "c": torch.randn(1000, generator=g)}  # 12 MiB, 12 MiB, 4 kB, in this order in the file
    path = tmp_path / "w.safetensors"
    save_file(tensors, path)
    _cold(path)
    src = SafetensorsSource([path])
    try:
        # a whole tensor read in one go looks sequential to the kernel, which would read ahead into the next one
        assert torch.equal(src.read("a"), tensors["a"])
        # small reads scattered over the rest, in no file order
        for lo in (2 * MIB + 123, MIB + 7, 5, 3 * MIB - 500, 777_777):
            assert torch.equal(src.read("b", lo, lo + 300), tensors["b"][lo:lo + 300])
        # each read leaves at most its two partial edge pages
        resident = file_resident_bytes(str(path))
        assert resident <= 12 * PAGE, f"{resident // PAGE} pages cached after reading 12 MiB (readahead on?)"
        assert torch.equal(src.read("c"), tensors["c"])
    finally:
        src.close()
    assert file_resident_bytes(str(path)) == 0  # close drops the whole file, edge pages included


def _unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8, block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8, norm_num_groups=32,
    )


def test_gemini_setup_leaves_the_streamed_unet_file_out_of_the_page_cache(tmp_path):
    from lowmem.diffusion.streaming import load_unet_hollow

    _needs_dropping(tmp_path)
    torch.manual_seed(0)
    ref = _unet()
    ref.save_pretrained(tmp_path / "base" / "unet", safe_serialization=True)
    weights = tmp_path / "base" / "unet" / "diffusion_pytorch_model.safetensors"
    _warm(weights)  # pages read by someone else (a copy, an earlier run) are dropped as well
    assert file_resident_bytes(str(weights)) > 0
    unet = load_unet_hollow(tmp_path / "base")
    cfg = core_parallel.GeminiConfig(offload_tier="cpu", offload_param_frac=1.0, offload_optim_frac=1.0,
                                     chunk_mb=0.25)
    model, _ = core_parallel.setup(unet, torch.optim.AdamW(unet.parameters(), lr=1e-4), cfg)
    try:
        resident = file_resident_bytes(str(weights))
        assert resident == 0, f"{resident // PAGE} pages of the UNet file left in the page cache after setup"
        got = model.state_dict()
        for k, v in ref.state_dict().items():
            assert torch.equal(got[k], v), k
    finally:
        model.gemini_manager.close()


def test_loaded_vae_and_text_encoder_leave_the_page_cache(tmp_path):
    from lowmem.diffusion.models import load_components
    from lowmem.diffusion.tiny import build_tiny_components, save_tiny_sd_pipeline

    _needs_dropping(tmp_path)
    base = save_tiny_sd_pipeline(tmp_path / "base")
    files = [f for sub in ("vae", "text_encoder") for f in (base / sub).iterdir() if f.suffix == ".safetensors"]
    assert len(files) == 2
    for f in files:
        _warm(f)
        assert file_resident_bytes(str(f)) > 0
    comps = load_components(str(base), vae_dtype=torch.bfloat16, text_encoder_dtype=torch.bfloat16)
    for f in files:
        assert file_resident_bytes(str(f)) == 0, f"{f}: left in the page cache after loading"
    want = build_tiny_components()
    for name in ("vae", "text_encoder"):
        got = comps[name].state_dict()
        for k, v in want[name].state_dict().items():
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.to(torch.bfloat16)), (name, k)
