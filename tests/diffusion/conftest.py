"""Fixtures of the diffusion tests: the tiny pipeline (built once), small image folders."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


@pytest.fixture(scope="session")
def _tiny_components():
    from lowmem.diffusion.tiny import build_tiny_components

    return build_tiny_components()


@pytest.fixture
def tiny(_tiny_components):
    """A fresh deep copy of the tiny pipeline components (tests may train them)."""
    return copy.deepcopy(_tiny_components)


def write_image(path: Path, size=(40, 36), mode="RGB", seed=0) -> Path:
    """A random image of `size` in `mode` written to `path`."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    img = Image.fromarray(arr, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


@pytest.fixture
def image_folder(tmp_path) -> Path:
    """An imagefolder of 4 images with metadata.jsonl."""
    folder = tmp_path / "data"
    lines = []
    for i in range(4):
        write_image(folder / f"img{i}.png", seed=i)
        lines.append(json.dumps({"file_name": f"img{i}.png", "text": f"picture number {i}"}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder
