"""Writing results: the diffusers pipeline folder, validation image grids, class images.

`save_pipeline` writes every component into a temporary folder beside the target first and then moves
each entry into place with one rename (the old entry is removed only after the new one is in), with
`model_index.json` last; a failure or kill never leaves a half-written component in `--output_dir`.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ..utils.fileio import atomic_write, drop_page_cache, fsync_dir

__all__ = ["generate_images", "image_grid", "save_grid", "save_over_base", "save_pipeline", "move_into"]

logger = logging.getLogger(__name__)


def move_into(src: Path, dest_dir: Path, names: Sequence[str]) -> None:
    """Move `src/<name>` to `dest_dir/<name>` for each name, replacing old entries one rename at a time."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        new, target = src / name, dest_dir / name
        old = None
        if target.is_dir() and not target.is_symlink():
            old = dest_dir / f".{name}.old-{os.getpid()}"
            os.replace(target, old)
        os.replace(new, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    fsync_dir(dest_dir)


def _copy_uncached(src: str, dst: str) -> str:
    """`shutil.copy2`, then the copy written back and both files' pages dropped from the page cache: a memory
    cgroup charges the pages a job reads and writes, and a copied component is not read again here."""
    shutil.copy2(src, dst)
    drop_page_cache(dst, write_back=True)
    drop_page_cache(src)
    return dst


def save_pipeline(pipeline: Any, folder: str | Path) -> Path:
    """`pipeline.save_pretrained` into `folder` without ever leaving a half-written component there."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".export-", suffix=".tmp"))
    try:
        pipeline.save_pretrained(tmp, safe_serialization=True)
        entries = sorted(p.name for p in tmp.iterdir() if p.name != "model_index.json")
        move_into(tmp, folder, [*entries, "model_index.json"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def save_over_base(base: str | Path, trained: dict[str, Any], folder: str | Path,
                   drop: Sequence[str] = ()) -> Path:
    """The base pipeline folder with the `trained` components replaced, written into `folder` atomically.

    Every component the trainer did not train (scheduler, tokenizer, VAE, safety checker, feature extractor,
    ...) is copied file for file, and `model_index.json` is the base's (so `requires_safety_checker` and the
    scheduler class stay); `drop` names components exported as absent (`[null, null]` in the index). A value of
    `trained` is a module (written with `save_pretrained`) or a folder already written (moved in as it is).
    """
    import json

    base, folder = Path(base), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    index = json.loads((base / "model_index.json").read_text())
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".export-", suffix=".tmp"))
    try:
        for name, value in index.items():
            if name.startswith("_") or not isinstance(value, list) or name in trained:
                continue
            if name in drop:
                index[name] = [None, None]
            elif value[0] is not None and (base / name).is_dir():
                shutil.copytree(base / name, tmp / name, copy_function=_copy_uncached)
        for name, module in trained.items():
            if isinstance(module, (str, os.PathLike)):
                shutil.move(os.fspath(module), tmp / name)
            else:
                module.save_pretrained(tmp / name, safe_serialization=True)
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        entries = sorted(p.name for p in tmp.iterdir() if p.name != "model_index.json")
        move_into(tmp, folder, [*entries, "model_index.json"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def image_grid(images: Sequence[Image.Image]) -> Image.Image:
    """Paste images (same size) into a near-square grid."""
    cols = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / cols)
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h), "white")
    for i, img in enumerate(images):
        grid.paste(img, ((i % cols) * w, (i // cols) * h))
    return grid


def save_grid(images: Sequence[Image.Image], path: str | Path) -> Path:
    """Write the grid of `images` as a PNG atomically."""
    path = Path(path)
    with atomic_write(path, "wb") as f:
        image_grid(images).save(f, format="PNG")
    return path


@torch.no_grad()
def generate_images(pipeline: Any, prompt: str, num_images: int, *, seed: int, steps: int,
                    resolution: int, batch_size: int = 1) -> list[Image.Image]:
    """`num_images` PIL images of `prompt`, reproducible from `seed` (one generator per image, so image `i`
    starts from the same noise whatever `batch_size`, the images per pipeline call, is)."""
    pipeline.set_progress_bar_config(disable=True)
    images = []
    for first in range(0, num_images, batch_size):
        n = min(batch_size, num_images - first)
        gens = [torch.Generator(device="cpu").manual_seed(seed + first + i) for i in range(n)]
        out = pipeline([prompt] * n, num_inference_steps=steps, generator=gens if n > 1 else gens[0],
                       height=resolution, width=resolution, output_type="pil")
        images.extend(out.images)
    return images
