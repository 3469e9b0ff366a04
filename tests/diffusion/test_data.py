"""Image loading and conversion, preprocessing, the resumable sampler, the tokenizer, the attention processor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from lowmem.diffusion.data import (
    CaptionedImages,
    DataConfig,
    StepBatchSampler,
    load_rgb,
    preprocess,
    scan_dataset,
    scan_image_folder,
)
from lowmem.diffusion.errors import InputError
from tests.diffusion.conftest import write_image


@pytest.mark.parametrize("mode", ["L", "RGBA", "CMYK", "P", "LA"])
def test_modes_become_rgb(tmp_path, mode):
    suffix = ".jpg" if mode == "CMYK" else ".png"
    path = write_image(tmp_path / f"x{suffix}", mode=mode)
    img = load_rgb(path)
    assert img.mode == "RGB" and img.size == (40, 36)


def test_16bit_grayscale_scaled_to_8bit(tmp_path):
    arr = np.array([[0, 257 * 100, 65535]], dtype=np.uint16)
    path = tmp_path / "deep.png"
    Image.fromarray(arr).save(path)
    assert Image.open(path).mode.startswith("I")
    out = np.asarray(load_rgb(path))
    assert out[0, :, 0].tolist() == [0, 100, 255]


def test_transparency_composited_over_white(tmp_path):
    path = tmp_path / "clear.png"
    Image.new("RGBA", (8, 8), (10, 20, 30, 0)).save(path)
    assert np.asarray(load_rgb(path)).min() == 255


def test_preprocess_shape_range_and_upscale():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (12, 20, 3), dtype=np.uint8))
    out = preprocess(img, DataConfig(resolution=32), torch.Generator().manual_seed(0))
    assert out.shape == (3, 32, 32) and out.min() >= -1 and out.max() <= 1


def test_center_crop_and_flip_are_reproducible():
    rng = np.random.default_rng(1)
    img = Image.fromarray(rng.integers(0, 256, (40, 64, 3), dtype=np.uint8))
    cfg = DataConfig(resolution=32, random_flip=True)
    a = preprocess(img, cfg, torch.Generator().manual_seed(5))
    b = preprocess(img, cfg, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    centre = preprocess(img, DataConfig(resolution=40, center_crop=True), torch.Generator())
    ref = np.asarray(img, dtype=np.float32)[:, 12:52] / 127.5 - 1
    torch.testing.assert_close(centre, torch.from_numpy(ref).permute(2, 0, 1))


def test_sampler_is_world_size_invariant_and_resumes():
    one = StepBatchSampler(5, 2, 7, seed=3)
    two = [StepBatchSampler(5, 1, 7, seed=3, rank=r, world_size=2) for r in range(2)]
    batches = list(one)
    assert len(batches) == 7
    for b, keys in enumerate(batches):
        assert keys == two[0].batch(b) + two[1].batch(b)
    # each epoch is a permutation of the data
    stream = [k[0] for keys in batches for k in keys]
    assert sorted(stream[:5]) == list(range(5)) and sorted(stream[5:10]) == list(range(5))
    resumed = StepBatchSampler(5, 2, 7, seed=3)
    resumed.start = 4
    assert list(resumed) == batches[4:] and len(resumed) == 7


def test_dataset_name_leaves_the_environment_alone(tmp_path, monkeypatch):
    """A Hub name is read offline by the call itself (datasets' cache builder), not by setting HF_DATASETS_OFFLINE
    for the whole process; without `datasets` the error names the package."""
    import os
    import sys

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(InputError, match="needs the datasets package"):
        scan_dataset("someone/captions", DataConfig(), export_dir=tmp_path)
    assert "HF_DATASETS_OFFLINE" not in os.environ


def test_dataset_items(image_folder):
    from lowmem.diffusion.tiny import build_tokenizer

    cfg = DataConfig(resolution=16, random_flip=True)
    records = scan_image_folder(image_folder, cfg)
    assert [r.caption for r in records] == [f"picture number {i}" for i in range(4)]
    ds = CaptionedImages(records, build_tokenizer(), cfg, class_records=records[:1])
    item = ds[(2, 11)]
    assert item["pixel_values"].shape == (3, 16, 16) and item["input_ids"].shape == (77,)
    assert torch.equal(item["class_pixel_values"], ds[(0, 11)]["pixel_values"])
    assert len(ds) == 4


def test_tokenizer_roundtrip(tmp_path):
    from transformers import CLIPTokenizer

    from lowmem.diffusion.tiny import build_tokenizer

    tok = build_tokenizer(folder=tmp_path / "tok")
    ids = tok("a red circle", padding="max_length", max_length=77, truncation=True).input_ids
    again = CLIPTokenizer.from_pretrained(tmp_path / "tok")
    short = again("a red circle").input_ids
    assert len(ids) == 77 and ids[0] == 512 and short[-1] == 513 and ids[: len(short)] == short
    assert set(ids[len(short):]) == {513}  # padded with the end token
    assert tok.decode(short[1:-1]).strip() == "a red circle"


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_kernels_attention_processor_matches_default(tiny, backend):
    from diffusers.models.attention_processor import AttnProcessor2_0

    from lowmem.diffusion.attention import set_kernels_attention

    unet = tiny["unet"].double()  # float64, so the comparison is not blurred by fp32 summation order
    torch.manual_seed(0)
    x, t, h = torch.randn(2, 4, 16, 16).double(), torch.tensor([10, 900]), torch.randn(2, 77, 32).double()
    unet.set_attn_processor(AttnProcessor2_0())
    ref = unet(x, t, h).sample
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in unet.parameters()]
    unet.zero_grad()
    set_kernels_attention(unet, backend)
    out = unet(x, t, h).sample
    out.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for g, r in zip((p.grad for p in unet.parameters()), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10)


def test_sample_data_written_by_two_processes_at_once_is_never_replaced(tmp_path, monkeypatch):
    """Every rank writes the built-in set: the first complete folder stays in place (a rank may be reading it)."""
    from lowmem.diffusion import sample_data

    folder = tmp_path / "sample_data"
    draw = sample_data._draw
    calls = []

    def racing_draw(*args):
        if not calls:  # another process completes the folder while this one is still drawing
            calls.append(1)
            monkeypatch.setattr(sample_data, "_draw", draw)
            sample_data.write_sample_data(folder)
            (folder / "marker").write_text("first")
            monkeypatch.setattr(sample_data, "_draw", racing_draw)
        return draw(*args)

    monkeypatch.setattr(sample_data, "_draw", racing_draw)
    assert sample_data.write_sample_data(folder) == folder
    assert (folder / "marker").read_text() == "first"  # not replaced by the later writer
    assert len(scan_image_folder(folder, DataConfig())) == 16
    assert [p.name for p in tmp_path.iterdir()] == ["sample_data"]  # no staging folder left behind
    (folder / "metadata.jsonl").unlink()  # a leftover without the set is replaced
    sample_data.write_sample_data(folder)
    assert not (folder / "marker").exists() and len(scan_image_folder(folder, DataConfig())) == 16
