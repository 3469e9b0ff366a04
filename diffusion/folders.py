"""What a diffusers pipeline folder is, read from its configs before any weights load: its model family
(`model_family`), and whether the noise schedule and the VAE latents it brings are what diffusers' SD/SDXL training
scripts (v0.40.0) train (`check_model_folder`). Whatever they are not is one `InputError` naming the folder, the
file and field, and what is not supported; nothing is replaced silently.

The scripts build their training scheduler with `DDPMScheduler.from_pretrained(folder, subfolder="scheduler")`,
which takes a config of any class and keeps the fields DDPMScheduler knows (betas, timesteps, prediction type),
defaulting the rest. That is the folder's own forward process when the folder's scheduler class has the same
`alphas_cumprod` (DDIM, PNDM, Euler, DPM-Solver, UniPC, LCM, ...): such folders train as the scripts train them
(`training_scheduler`). Otherwise DDPM's defaults would replace the schedule (flow matching, EDM sigmas, VE SDEs,
CogVideoX's SNR shift): refused. EDM schedulers (a class name with `EDM`, as train_dreambooth_lora_sdxl.py tests
the folder's `model_index.json`) mean EDM-style training: train_dreambooth_lora_sdxl.py switches to it (an
`EDMEulerScheduler` of the folder's config, `training.edm_loss`) and normalises the latents with the VAE's
`latents_mean`/`latents_std`; the other scripts would train DDPM's defaults, so there both are refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .errors import InputError

__all__ = ["FAMILY_NAMES", "check_model_folder", "check_scheduler", "check_vae", "model_family",
           "training_scheduler"]

logger = logging.getLogger(__name__)

FAMILY_NAMES = {"sd": "Stable Diffusion 1.x/2.x", "sdxl": "SDXL", "sd3": "Stable Diffusion 3", "flux": "Flux",
                "other": "another kind of"}
"""Family -> the words an error uses."""

_PREDICTION_TYPES = ("epsilon", "v_prediction")  # what every SD/SDXL script's loss computes a target for


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


# -- the family -------------------------------------------------------------------------------------------------
def model_family(folder: Path) -> tuple[str, str]:
    """(family, the file and field that tell it) of the pipeline folder `folder`: `sd`, `sdxl`, `sd3`, `flux` or
    `other`, from `model_index.json`'s `_class_name`, else from the components (a `transformer/` and its class,
    the UNet's `addition_embed_type="text_time"` or a second text encoder for SDXL)."""
    name = str(_json(folder / "model_index.json").get("_class_name") or "")
    told = f"model_index.json _class_name {name}"
    for key, family in (("StableDiffusionXL", "sdxl"), ("StableDiffusion3", "sd3"), ("Flux", "flux")):
        if key in name:
            return family, told
    if name.startswith("StableDiffusion"):
        return "sd", told
    transformer = folder / "transformer" / "config.json"
    if transformer.is_file():
        cls = str(_json(transformer).get("_class_name") or "")
        family = "sd3" if cls.startswith("SD3") else "flux" if cls.startswith("Flux") else "other"
        return family, f"transformer/config.json _class_name {cls or '(none)'}"
    if _json(folder / "unet" / "config.json").get("addition_embed_type") == "text_time":
        return "sdxl", "unet/config.json addition_embed_type text_time"
    if (folder / "text_encoder_2").is_dir():
        return "sdxl", "a text_encoder_2/ component"
    return "sd", told if name else "a UNet pipeline folder"


def _sdxl_command(lora: bool, dreambooth: bool) -> str:
    if dreambooth:
        return "train_dreambooth_lora_sdxl"
    return "train_text_to_image_lora_sdxl" if lora else "train_text_to_image_sdxl"


def _check_family(folder: Path, family: str, *, lora: bool, dreambooth: bool) -> None:
    found, told = model_family(folder)
    if found == family:
        return
    what = f"{folder}: {FAMILY_NAMES[found]} pipeline ({told})"
    if found in ("sd3", "flux"):
        lora = "lora_" if lora else ""
        raise InputError(f"{what}: this command trains {FAMILY_NAMES[family]}; use suite diffusion "
                         f"train_dreambooth_{lora}{found}")
    if family in ("sd3", "flux"):
        raise InputError(f"{what}: this command trains {FAMILY_NAMES[family]} pipelines")
    if found == "sdxl":
        raise InputError(f"{what}: this command trains SD 1.x/2.x; use suite diffusion "
                         f"{_sdxl_command(lora, dreambooth)}")
    if found == "sd":
        sd = "train_dreambooth" if dreambooth else "train_text_to_image_lora" if lora else "train_text_to_image"
        raise InputError(f"{what}: this command trains SDXL; use suite diffusion finetune or {sd}")
    raise InputError(f"{what}: not supported yet (suite diffusion trains SD 1.x/2.x and SDXL UNet pipelines)")


def _check_latent_channels(folder: Path) -> None:
    """The UNet denoises the VAE's latents alone: an inpainting (9 channels: latents, mask, masked image) or an
    upscaling UNet (latents and the low-resolution image) is refused; the scripts would fail in the first step."""
    unet = _json(folder / "unet" / "config.json").get("in_channels")
    latents = _json(folder / "vae" / "config.json").get("latent_channels")
    if isinstance(unet, int) and isinstance(latents, int) and unet != latents:
        raise InputError(f"{folder / 'unet' / 'config.json'}: in_channels {unet} while the VAE's latent_channels is "
                         f"{latents} (an inpainting or upscaling UNet): not supported")


# -- the noise schedule -----------------------------------------------------------------------------------------
def _edm_class(folder: Path) -> str | None:
    """The EDM scheduler class the folder names (its scheduler config's, else `model_index.json`'s), or None."""
    name = str(_json(folder / "scheduler" / "scheduler_config.json").get("_class_name") or "")
    indexed = _json(folder / "model_index.json").get("scheduler")
    indexed = str(indexed[1]) if isinstance(indexed, list) and len(indexed) == 2 else ""
    return name if "EDM" in name else indexed if "EDM" in indexed else None


def training_scheduler(folder: Path) -> Any:
    """The training scheduler of the pipeline folder `folder`, as diffusers' scripts build it: an `EDMEulerScheduler`
    of the folder's config when it names an EDM scheduler (train_dreambooth_lora_sdxl.py; the only command that
    takes such a folder), else a `DDPMScheduler`, which keeps the folder's config as `folder_config` (the
    `EulerDiscreteScheduler` of `--do_edm_style_training` is built from it, `training.euler_of`)."""
    from diffusers import DDPMScheduler, EDMEulerScheduler

    if _edm_class(folder):
        return EDMEulerScheduler.from_pretrained(folder, subfolder="scheduler")
    ddpm = DDPMScheduler.from_pretrained(folder, subfolder="scheduler")
    ddpm.folder_config = _json(folder / "scheduler" / "scheduler_config.json") or None
    return ddpm


def _own_alphas_cumprod(cls: Any, folder: Path, path: Path) -> Any:
    """The scheduler class's own `alphas_cumprod` for the folder's config; None when it has none."""
    try:
        own = cls.from_pretrained(folder, subfolder="scheduler")
    except ImportError as exc:  # an optional package missing (LMS needs scipy): its pipeline cannot load here either
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{path}: {cls.__name__} cannot be built here ({reason})") from exc
    values = getattr(own, "alphas_cumprod", None)
    return values if hasattr(values, "shape") else None


def check_scheduler(folder: Path, prediction_type: str | None = None, *, edm_ok: bool = False) -> None:
    """Refuse (one `InputError`) a scheduler that diffusers' scripts would replace by DDPM's defaults, an EDM
    scheduler unless `edm_ok` (the command trains EDM-style, as train_dreambooth_lora_sdxl.py), or a prediction
    type their loss has no target for (`prediction_type`: the `--prediction_type` override)."""
    import diffusers
    import torch

    path = folder / "scheduler" / "scheduler_config.json"
    config = _json(path)
    name = str(config.get("_class_name") or "")
    edm = _edm_class(folder)
    if edm:
        where = path if edm == name else folder / "model_index.json"
        if not edm_ok:
            raise InputError(f"{where}: {edm} is an EDM scheduler, which means EDM-style training: only "
                             "suite diffusion train_dreambooth_lora_sdxl does it, as diffusers' scripts; the others "
                             "would train DDPM's default schedule")
        pred = prediction_type or config.get("prediction_type") or "epsilon"
        if pred not in _PREDICTION_TYPES:
            raise InputError(f"{path}: prediction_type {pred!r}: not supported (EDM-style training preconditions "
                             "epsilon or v_prediction)")
        return
    cls = getattr(diffusers, name, None)
    if cls is None or not name.endswith("Scheduler"):
        raise InputError(f"{path}: _class_name {name or '(none)'} is not a scheduler class of diffusers")
    own = _own_alphas_cumprod(cls, folder, path)
    ddpm = training_scheduler(folder)
    if own is None or own.shape != ddpm.alphas_cumprod.shape or not torch.allclose(
            own.double(), ddpm.alphas_cumprod.double(), rtol=1e-6, atol=0):
        why = "has no DDPM noise schedule (betas)" if own is None else "has another noise schedule than DDPM's"
        raise InputError(f"{path}: {name} {why}; diffusers' scripts would train it as a DDPMScheduler with "
                         "default betas, a different objective: not supported")
    pred = prediction_type or ddpm.config.prediction_type
    if pred not in _PREDICTION_TYPES:
        from .training import SAMPLE_REFUSAL

        given = "--prediction_type" if prediction_type else f"{path}: prediction_type"
        why = SAMPLE_REFUSAL if pred == "sample" else "not supported (the loss trains epsilon or v_prediction)"
        raise InputError(f"{given} {pred!r}: {why}")


# -- the VAE ----------------------------------------------------------------------------------------------------
def check_vae(config_path: Path, *, stats_ok: bool = False) -> None:
    """Refuse a VAE config with latent statistics (`latents_mean`/`latents_std`, Playground v2.5's) unless
    `stats_ok`: the SDXL DreamBooth LoRA script normalises latents with them (`training.encode_latents` does), the
    others ignore them while SDXL's pipeline applies them at inference (a mismatch not reproduced here)."""
    config = _json(config_path)
    stats = [k for k in ("latents_mean", "latents_std") if config.get(k) is not None]
    if stats and not stats_ok:
        raise InputError(f"{config_path}: {'/'.join(stats)} (a VAE with latent statistics, e.g. Playground v2.5's): "
                         "only suite diffusion train_dreambooth_lora_sdxl normalises the latents with them, as "
                         "diffusers' scripts")


def check_model_folder(folder: Path, family: str, *, vae_folder: Path | None = None,
                       prediction_type: str | None = None, lora: bool = False, dreambooth: bool = False) -> None:
    """Everything above for the pipeline folder `folder` trained as `family` (`sd` or `sdxl`), before any weights
    load: the family (the command to use when it is another one), the scheduler, the VAE (`vae_folder`: a separate
    VAE folder). `lora` / `dreambooth` choose the command an error names."""
    _check_family(folder, family, lora=lora, dreambooth=dreambooth)
    if family in ("sd3", "flux"):  # flow matching: the scripts build FlowMatchEulerDiscreteScheduler from it
        name = str(_json(folder / "scheduler" / "scheduler_config.json").get("_class_name") or "")
        if name and name != "FlowMatchEulerDiscreteScheduler":
            raise InputError(f"{folder / 'scheduler' / 'scheduler_config.json'}: _class_name {name}: the SD3 / Flux "
                             "scripts train with FlowMatchEulerDiscreteScheduler's sigmas; not supported")
        return
    _check_latent_channels(folder)
    dreambooth_sdxl = family == "sdxl" and dreambooth  # train_dreambooth_lora_sdxl.py: EDM and latent statistics
    if (folder / "scheduler").is_dir():  # a folder missing it is refused by the loaders, naming the component
        check_scheduler(folder, prediction_type, edm_ok=dreambooth_sdxl)
    check_vae(vae_folder / "config.json" if vae_folder is not None else folder / "vae" / "config.json",
              stats_ok=dreambooth_sdxl)
