"""Loading the Stable Diffusion components: a diffusers pipeline folder, a single checkpoint file, or the tiny
built-in pipeline; and assembling them into a `StableDiffusionPipeline`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .errors import InputError

__all__ = ["COMPONENTS", "check_pipeline_folder", "load_components", "make_pipeline"]

logger = logging.getLogger(__name__)

#: Subfolder -> the file (any of) that must be in it for the component to load.
COMPONENTS: dict[str, tuple[str, ...]] = {
    "unet": ("config.json",),
    "vae": ("config.json",),
    "text_encoder": ("config.json",),
    "tokenizer": ("tokenizer.json", "vocab.json", "tokenizer_config.json"),
    "scheduler": ("scheduler_config.json",),
}


def check_pipeline_folder(folder: Path) -> None:
    """Raise `InputError` naming the first thing missing from a diffusers pipeline folder."""
    index = folder / "model_index.json"
    if not index.is_file():
        raise InputError(f"{folder}: not a diffusers pipeline folder (model_index.json is missing)")
    try:
        json.loads(index.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{index}: not valid JSON ({exc})") from exc
    for sub, files in COMPONENTS.items():
        if not (folder / sub).is_dir():
            raise InputError(f"{folder}: the model folder is missing the '{sub}' component (no {sub}/ subfolder)")
        if not any((folder / sub / f).is_file() for f in files):
            raise InputError(f"{folder / sub}: the '{sub}' component has none of {', '.join(files)}")


def _from_folder(folder: Path) -> dict[str, Any]:
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    check_pipeline_folder(folder)
    loaders = {
        "unet": lambda: UNet2DConditionModel.from_pretrained(folder, subfolder="unet"),
        "vae": lambda: AutoencoderKL.from_pretrained(folder, subfolder="vae"),
        "text_encoder": lambda: CLIPTextModel.from_pretrained(folder, subfolder="text_encoder"),
        "tokenizer": lambda: CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer"),
        "scheduler": lambda: DDPMScheduler.from_pretrained(folder, subfolder="scheduler"),
    }
    out = {}
    for name, load in loaders.items():
        try:
            out[name] = load()
        except Exception as exc:  # noqa: BLE001 - any failure here is a bad model folder
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise InputError(f"{folder / name}: cannot load the '{name}' component ({reason})") from exc
    return out


def _from_single_file(path: Path) -> dict[str, Any]:
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    try:
        pipe = StableDiffusionPipeline.from_single_file(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - offline single-file loading fails in many ways; all are bad input
        raise InputError(
            f"{path}: cannot load as a single-file Stable Diffusion checkpoint offline ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); convert it to a diffusers folder first"
        ) from exc
    scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    return {"unet": pipe.unet, "vae": pipe.vae, "text_encoder": pipe.text_encoder, "tokenizer": pipe.tokenizer,
            "scheduler": scheduler}


def load_components(pretrained: str | None, *, tiny_resolution: int = 32) -> dict[str, Any]:
    """The five components from `pretrained` (pipeline folder or `.safetensors`/`.ckpt` file), or the tiny ones.

    The training noise scheduler is always a `DDPMScheduler` with the pipeline's scheduler config.
    """
    if pretrained is None:
        from .tiny import TinyPipelineConfig, build_tiny_components

        logger.info("no --pretrained_model_name_or_path: using the tiny built-in pipeline (random weights)")
        return build_tiny_components(TinyPipelineConfig(sample_size=tiny_resolution))
    path = Path(pretrained)
    if path.is_dir():
        return _from_folder(path)
    if path.is_file():
        if path.suffix not in (".safetensors", ".ckpt"):
            raise InputError(f"{path}: expected a diffusers pipeline folder or a .safetensors/.ckpt file")
        return _from_single_file(path)
    raise InputError(f"{path}: no such model folder or file (hub names cannot be downloaded here)")


def make_pipeline(components: dict[str, Any], scheduler: Any | None = None) -> Any:
    """A `StableDiffusionPipeline` over `components` (no safety checker)."""
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline(
        vae=components["vae"],
        text_encoder=components["text_encoder"],
        tokenizer=components["tokenizer"],
        unet=components["unet"],
        scheduler=scheduler if scheduler is not None else components["scheduler"],
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
