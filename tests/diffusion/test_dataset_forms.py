"""Data as `datasets`' imagefolder accepts it and resume as diffusers' scripts resolve it (issue 19): metadata.csv,
list-valued captions (one drawn per sample), `.txt` captions beside the images, the EXIF orientation applied, and
`--resume_from_checkpoint checkpoint-N` looked up inside `--output_dir`."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from PIL import Image

from lowmem.diffusion.data import CaptionedImages, DataConfig, load_rgb, scan_image_folder
from lowmem.diffusion.errors import InputError
from tests.diffusion.conftest import write_image


def test_metadata_csv_and_txt_captions(tmp_path):
    csv_folder = tmp_path / "csv"
    for i in range(3):
        write_image(csv_folder / f"img{i}.png", seed=i)
    with open(csv_folder / "metadata.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file_name", "text"])
        w.writerows([[f"img{i}.png", f"caption, number {i}"] for i in range(3)])
    records = scan_image_folder(csv_folder, DataConfig())
    assert [(r.path.name, r.caption) for r in records] == [(f"img{i}.png", f"caption, number {i}") for i in range(3)]
    assert records[1].source.endswith("metadata.csv:3")  # line numbers count the header

    txt_folder = tmp_path / "txt"
    for i in range(2):
        write_image(txt_folder / f"b{i}.jpg", seed=i)
        (txt_folder / f"b{i}.txt").write_text(f"  text caption {i}\n")
    records = scan_image_folder(txt_folder, DataConfig())
    assert [(r.path.name, r.caption) for r in records] == [("b0.jpg", "text caption 0"), ("b1.jpg", "text caption 1")]

    (txt_folder / "b1.txt").unlink()
    with pytest.raises(InputError, match="b1.jpg: missing caption"):
        scan_image_folder(txt_folder, DataConfig())


def test_list_captions_one_drawn_per_sample(tmp_path, tiny):
    folder = tmp_path / "data"
    write_image(folder / "a.png")
    captions = ["a red circle", "a blue square", "a green line"]
    (folder / "metadata.jsonl").write_text(json.dumps({"file_name": "a.png", "text": captions}) + "\n")
    records = scan_image_folder(folder, DataConfig())
    assert records[0].caption == tuple(captions)
    data = CaptionedImages(records, tiny["tokenizer"], DataConfig())
    by_caption = {tuple(data.tokens(c)[0].tolist()): c for c in captions}
    drawn = [by_caption[tuple(data[(0, seed)]["input_ids"].tolist())] for seed in range(40)]
    assert set(drawn) == set(captions)  # each caption is drawn
    assert drawn == [by_caption[tuple(data[(0, seed)]["input_ids"].tolist())] for seed in range(40)]  # seeded


@pytest.mark.parametrize("orientation, size", [(1, (40, 20)), (6, (20, 40)), (8, (20, 40)), (3, (40, 20))])
def test_exif_orientation_is_applied(tmp_path, orientation, size):
    arr = np.zeros((20, 40, 3), dtype=np.uint8)
    arr[:, :20] = 255  # left half white
    img = Image.fromarray(arr, "RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / "photo.jpg"
    img.save(path, exif=exif.tobytes(), quality=95)
    out = load_rgb(path)
    assert out.size == size
    got = np.asarray(out, dtype=np.float64).mean(axis=2)
    white = {1: (slice(None), slice(0, 20)), 3: (slice(None), slice(20, 40)),  # upright; turned 180
             6: (slice(0, 20), slice(None)), 8: (slice(20, 40), slice(None))}[orientation]
    assert got[white].mean() > 200 and got.mean() < 160


def test_resume_from_checkpoint_name_looks_inside_output_dir(tmp_path, monkeypatch):
    from lowmem.recipes.diffusion import CKPT_FILE, find_checkpoint

    out = tmp_path / "out"
    for step in (2, 10):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / CKPT_FILE).write_bytes(b"")
    (out / "checkpoint-11").mkdir()  # no state file: not a checkpoint
    monkeypatch.chdir(tmp_path)  # the relative name does not exist from here
    assert find_checkpoint(out, "checkpoint-2") == out / "checkpoint-2"
    assert find_checkpoint(out, "latest") == out / "checkpoint-10"
    assert find_checkpoint(out, str(out / "checkpoint-10")) == out / "checkpoint-10"
    assert find_checkpoint(tmp_path / "empty", "latest") is None
    with pytest.raises(InputError, match="checkpoint-11: not a checkpoint folder"):
        find_checkpoint(out, "checkpoint-11")
