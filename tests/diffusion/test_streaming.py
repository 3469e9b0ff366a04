"""A pretrained UNet streams into Gemini's shards and back out (issue 18): built without weights, each tensor read
from the safetensors file into its chunk and dropped, never the whole fp32 model in memory; the weights equal
`from_pretrained`'s bit for bit, and the streamed export is byte for byte what `save_pretrained` writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowmem import core_parallel
from lowmem.core_parallel.gemini.lazy import SafetensorsSource, fill_hollow, is_hollow
from lowmem.diffusion.streaming import SafetensorsWriter, load_unet_hollow, save_unet_streaming


def _unet(channels=(32, 64), layers=1, cross=32):
    from diffusers import UNet2DConditionModel

    n = len(channels)
    return UNet2DConditionModel(
        sample_size=8, block_out_channels=channels, layers_per_block=layers, cross_attention_dim=cross,
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1), attention_head_dim=8, norm_num_groups=32,
    )


def _save_folder(folder: Path, unet) -> Path:
    unet.save_pretrained(folder / "unet", safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return _save_folder(tmp_path_factory.mktemp("small"), _unet())


def _gemini(unet, tier: str, folder: Path | None, chunk_mb: float = 0.25):
    cfg = core_parallel.GeminiConfig(offload_tier=tier, offload_dir=str(folder) if folder else None,
                                     offload_param_frac=1.0, offload_optim_frac=1.0, chunk_mb=chunk_mb)
    return core_parallel.setup(unet, torch.optim.AdamW(unet.parameters(), lr=1e-4), cfg)


def _ref_state(folder: Path) -> dict[str, torch.Tensor]:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(folder, subfolder="unet").state_dict()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_streamed_load_equals_from_pretrained_bit_for_bit(small, tmp_path, tier):
    unet = load_unet_hollow(small)
    assert unet is not None and all(is_hollow(p) for p in unet.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in unet.parameters())  # nothing read yet
    model, _ = _gemini(unet, tier, tmp_path / "nvme" if tier == "nvme" else None)
    assert not any(is_hollow(p) for p in model.parameters())
    got, want = model.state_dict(), _ref_state(small)
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k


def test_fill_hollow_without_gemini_equals_from_pretrained(small):
    unet = load_unet_hollow(small)
    assert fill_hollow(unet) == len(list(unet.parameters()))
    want = _ref_state(small)
    for k, v in unet.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_cast_hollow_reads_nothing_and_fills_the_cast_values(small):
    """`cast_parameters` (LoRA's frozen base in the weight dtype): hollow parameters change dtype without reading
    anything; filled, they hold the file's values cast as `Module.to` casts them."""
    from lowmem.core_parallel.gemini.lazy import cast_parameters, source_of

    unet = load_unet_hollow(small)
    sources = {n: source_of(p) for n, p in unet.named_parameters()}
    cast_parameters(unet, torch.bfloat16)
    assert all(is_hollow(p) and p.dtype == torch.bfloat16 and p.untyped_storage().nbytes() == 0
               and source_of(p) == sources[n] for n, p in unet.named_parameters())
    fill_hollow(unet)
    for k, v in _ref_state(small).items():
        assert torch.equal(unet.state_dict()[k], v.to(torch.bfloat16)), k


def _assert_streamed_is_save_pretrained(model, cls, tmp_path: Path) -> None:
    """`save_unet_streaming(model)` and `save_pretrained` of the gathered model write the same files, byte for byte."""
    save_unet_streaming(model, tmp_path / "streamed")
    old = cls.from_config(model.config)
    old.load_state_dict(model.state_dict())
    old.save_pretrained(tmp_path / "old", safe_serialization=True)
    names = sorted(p.name for p in (tmp_path / "old").iterdir())
    assert sorted(p.name for p in (tmp_path / "streamed").iterdir()) == names
    for name in names:
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "old" / name).read_bytes(), name


def test_streamed_export_is_what_save_pretrained_writes(small, tmp_path):
    """Gemini's weights (after a step) written chunk by chunk equal `save_pretrained` of the gathered model, byte
    for byte: config.json and the safetensors file."""
    from diffusers import UNet2DConditionModel

    model, opt = _gemini(load_unet_hollow(small), "cpu", None)
    x, t, ctx = torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 3, 32)
    model(x, t, ctx).sample.square().mean().backward()
    opt.step()
    opt.zero_grad()
    _assert_streamed_is_save_pretrained(model, UNet2DConditionModel, tmp_path)
    back = UNet2DConditionModel.from_pretrained(tmp_path / "streamed")
    assert not torch.equal(back.conv_in.weight, _ref_state(small)["conv_in.weight"])  # the trained weights


def test_streamed_export_writes_persistent_buffers_too(tmp_path):
    """SD3's transformer keeps its position embedding in a persistent buffer, outside Gemini's chunks: the streamed
    export writes it after the parameters, byte for byte as `save_pretrained` of the gathered model (it used to be
    gathered whole instead: 9 GB fp32 twice for SD3.5-medium, over an 8 GiB cap, at the end of the run)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    cfg = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
               joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
               pos_embed_max_size=8)
    model = SD3Transformer2DModel(**cfg)
    assert "pos_embed.pos_embed" in model.state_dict()
    model, opt = _gemini(model, "cpu", None, chunk_mb=0.05)
    out = model(torch.randn(1, 4, 8, 8), torch.randn(1, 5, 16), torch.randn(1, 16), torch.tensor([10])).sample
    out.sum().backward()
    opt.step()
    opt.zero_grad()
    _assert_streamed_is_save_pretrained(model, SD3Transformer2DModel, tmp_path)


def test_writer_matches_safetensors_for_mixed_dtypes_and_any_write_order(tmp_path):
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(1)
    tensors = {"b.w": torch.randn(3, 5, generator=g), "a.h": torch.randn(7, generator=g).half(),
               "z.bf": torch.randn(2, 2, generator=g).bfloat16(), "c.i": torch.arange(4), "e": torch.zeros(0, 3),
               "s": torch.tensor(2.5, dtype=torch.float64)}
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    w = SafetensorsWriter(tmp_path / "ours.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()],
                          {"format": "pt"})
    for k in sorted(tensors, reverse=True):
        w.write(k, tensors[k])
    w.close()
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    src = SafetensorsSource([tmp_path / "ours.safetensors"])
    assert torch.equal(src.read("b.w", 4, 11), tensors["b.w"].reshape(-1)[4:11])
    assert load_file(tmp_path / "ours.safetensors").keys() == tensors.keys()
    w = SafetensorsWriter(tmp_path / "short.safetensors", [("x", torch.float32, (2,))])
    with pytest.raises(RuntimeError, match="never written"):
        w.close()


def _rank_load(rank: int, world: int, folder: str) -> dict:
    """One rank streams the UNet into its shards; returns the gathered state and the elements it read."""
    import torch.distributed as dist

    import lowmem.core_parallel.gemini.lazy as lazy

    read = []
    orig = lazy.SafetensorsSource.read

    def counting(self, key, lo=0, hi=None):
        out = orig(self, key, lo, hi)
        read.append(out.numel())
        return out

    lazy.SafetensorsSource.read = counting
    unet = load_unet_hollow(folder)
    model, _ = _gemini(unet, "cpu", None, chunk_mb=0.25)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    dist.barrier()
    return {"read": sum(read), "state": state if rank == 0 else None}


@pytest.mark.distributed
def test_two_ranks_read_about_their_shards_only(small):
    out = core_parallel.run_on_ranks(_rank_load, 2, str(small), timeout=120)
    want = _ref_state(small)
    total = sum(v.numel() for v in want.values())
    for k, v in want.items():
        assert torch.equal(out[0]["state"][k], v), k
    for r in out:  # each rank reads its half, plus whole rows at shard edges
        assert r["read"] < 0.6 * total, (r["read"], total)


# The child resets the RSS high-water mark (Linux /proc/self/clear_refs "5") just before loading, so the peak is
# the load's, not the imports'. `stream` 0 runs the old path: from_pretrained, then Gemini setup.
_CHILD = r"""
import json, sys, torch
from lowmem import core_parallel
from lowmem.diffusion.streaming import load_unet_hollow

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

folder, nvme, stream = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
from diffusers import UNet2DConditionModel
torch.ones(1) + 1
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
unet = load_unet_hollow(folder) if stream else UNet2DConditionModel.from_pretrained(folder, subfolder="unet")
cfg = core_parallel.GeminiConfig(offload_tier="nvme", offload_dir=nvme, offload_param_frac=1.0,
                                 offload_optim_frac=1.0, chunk_mb=4)
model, opt = core_parallel.setup(unet, torch.optim.AdamW(unet.parameters(), lr=1e-4), cfg)
peak = status("VmHWM")
size = sum(p.numel() * 4 for p in model.parameters())
print(json.dumps({"before": before, "peak": peak, "fp32_bytes": size}))
"""


@pytest.fixture(scope="module")
def medium(tmp_path_factory) -> Path:
    """A UNet of ~60M parameters (~240 MB fp32) as a diffusers folder."""
    torch.manual_seed(0)
    return _save_folder(tmp_path_factory.mktemp("medium"), _unet((128, 256, 512), layers=1, cross=256))


def _growth(folder: Path, nvme: Path, stream: bool) -> float:
    env = {**__import__("os").environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed tensors leave the heap
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(folder), str(nvme), "1" if stream else "0"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=nvme)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert m["fp32_bytes"] > 200e6
    return (m["peak"] - m["before"]) / m["fp32_bytes"]


def test_loading_into_gemini_never_holds_the_whole_model(medium, tmp_path):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the RSS high-water mark")
    (tmp_path / "a").mkdir()
    growth = _growth(medium, tmp_path / "a", stream=True)
    assert growth < 0.5, f"loading the UNet into Gemini grew the process by {growth:.2f}x its fp32 size"


@pytest.mark.slow
def test_the_old_path_holds_the_whole_model(medium, tmp_path):
    """The measurement can fail: from_pretrained then Gemini setup grows by at least the model."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the RSS high-water mark")
    (tmp_path / "b").mkdir()
    assert _growth(medium, tmp_path / "b", stream=False) > 0.9
