"""Fixtures of the diffusion tests: the tiny pipeline (built once), small image folders."""

from __future__ import annotations

import copy
import json
import shutil
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


def write_image_folder(folder: Path, count: int, *, name: str = "img{i}.png", caption: str = "picture number {i}",
                       sizes: list[tuple[int, int]] | None = None, seed0: int = 0) -> Path:
    """An imagefolder of `count` random images (image i: `name`, `sizes[i]`, seed `seed0 + i`) and its
    metadata.jsonl (`caption` of each)."""
    lines = []
    for i in range(count):
        file = name.format(i=i)
        write_image(folder / file, size=sizes[i] if sizes else (40, 36), seed=seed0 + i)
        lines.append(json.dumps({"file_name": file, "text": caption.format(i=i)}))
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture
def image_folder(tmp_path) -> Path:
    """An imagefolder of 4 images with metadata.jsonl."""
    return write_image_folder(tmp_path / "data", 4)


# -- the tiny SDXL pipeline and images of the SDXL tests (one per test module) ----------------------------------
@pytest.fixture(scope="module")
def sdxl_folder(tmp_path_factory) -> Path:
    from lowmem.diffusion.sdxl import save_tiny_sdxl_pipeline

    return save_tiny_sdxl_pipeline(tmp_path_factory.mktemp("sdxl") / "base")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("data"), 4, sizes=[(40 + 4 * i, 36) for i in range(4)])


# -- the tiny SD3 and Flux pipelines and instance images of the SD3/Flux tests (one per test module) -------------
@pytest.fixture(scope="module")
def flow_folders(tmp_path_factory) -> dict[str, Path]:
    """{"sd3": tiny SD3 pipeline, "flux": tiny Flux pipeline, "inst": three instance images of different sizes}."""
    from lowmem.diffusion.flow_tiny import save_tiny_flux_pipeline, save_tiny_sd3_pipeline

    root = tmp_path_factory.mktemp("flow")
    for i in range(3):
        write_image(root / "inst" / f"{i}.png", size=(40 + 4 * i, 36), seed=i)
    return {"sd3": save_tiny_sd3_pipeline(root / "sd3"), "flux": save_tiny_flux_pipeline(root / "flux"),
            "inst": root / "inst"}


# -- accelerate's checkpoint-N of diffusers' scripts, from ours -----------------------------------------------
def as_accelerate(ours: Path, folder: Path) -> None:
    """accelerate's checkpoint-N as diffusers' scripts write it (the same files and formats), from our checkpoint
    `ours` of the same step: the save hooks' unet/ (+ unet_ema/ with EMAModel's config keys) or LoRA file, and
    `torch.save` of the optimizer's and the scheduler's state_dict() and of the RNG states."""
    import random

    import torch

    folder.mkdir(parents=True)
    state = torch.load(ours / "trainer_state.ckpt", weights_only=False)
    for name in ("unet", "unet_ema", "pytorch_lora_weights.safetensors"):
        if (ours / name).is_dir():
            shutil.copytree(ours / name, folder / name)
        elif (ours / name).is_file():
            shutil.copy(ours / name, folder / name)
    if (folder / "unet_ema").is_dir():  # EMAModel.save_pretrained adds its state to the UNet's config
        config = json.loads((folder / "unet_ema" / "config.json").read_text())
        config.update(decay=0.9999, optimization_step=state["ema"]["optimization_step"], use_ema_warmup=False)
        (folder / "unet_ema" / "config.json").write_text(json.dumps(config))
    torch.save(state["optimizer_states"][0], folder / "optimizer.bin")
    torch.save(state["lr_schedulers"][0], folder / "scheduler.bin")
    torch.save({"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                "torch_manual_seed": torch.get_rng_state()}, folder / "random_states_0.pkl")
    assert {p.name for p in folder.iterdir()} >= {"optimizer.bin", "scheduler.bin", "random_states_0.pkl"}
