"""Loading the Stable Diffusion components: a diffusers pipeline folder, a hub id already in the local Hugging
Face cache, a single checkpoint file, or the tiny built-in pipeline; and assembling them into a
`StableDiffusionPipeline`.

Besides the five trained/frozen components, `load_components` returns what the export must keep unchanged:
`inference_scheduler` (the base's own scheduler class and config, e.g. `PNDMScheduler`; training uses a
`DDPMScheduler` built from that config, as diffusers' scripts do), `source` (the base folder, whose untrained
components are copied verbatim on export) and `extras` (safety checker, feature extractor and
`requires_safety_checker` of a single-file base).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from .errors import InputError
from .folders import training_scheduler

__all__ = ["COMPONENTS", "check_pipeline_folder", "drop_folder_cache", "load_components", "load_text_encoder",
           "load_unet", "make_pipeline", "resolve_pretrained"]

logger = logging.getLogger(__name__)

#: Subfolder -> the file (any of) that must be in it for the component to load.
COMPONENTS: dict[str, tuple[str, ...]] = {
    "unet": ("config.json",),
    "vae": ("config.json",),
    "text_encoder": ("config.json",),
    "tokenizer": ("tokenizer.json", "vocab.json", "tokenizer_config.json"),
    "scheduler": ("scheduler_config.json",),
}


def check_pipeline_folder(folder: Path, components: dict[str, tuple[str, ...]] = COMPONENTS) -> None:
    """Raise `InputError` naming the first thing missing from a diffusers pipeline folder (of `components`)."""
    index = folder / "model_index.json"
    if not index.is_file():
        raise InputError(f"{folder}: not a diffusers pipeline folder (model_index.json is missing)")
    try:
        json.loads(index.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{index}: not valid JSON ({exc})") from exc
    for sub, files in components.items():
        if not (folder / sub).is_dir():
            raise InputError(f"{folder}: the model folder is missing the '{sub}' component (no {sub}/ subfolder)")
        if not any((folder / sub / f).is_file() for f in files):
            raise InputError(f"{folder / sub}: the '{sub}' component has none of {', '.join(files)}")


def drop_folder_cache(folder: Path) -> None:
    """Drop the page cache of the files directly in `folder` (a component's weights, once loaded and copied: a
    memory cgroup charges the pages a job reads to it). Best effort; pages still mapped stay."""
    from ..utils.fileio import drop_page_cache

    try:
        files = [f for f in folder.iterdir() if f.is_file()]
    except OSError:
        return
    for f in files:
        drop_page_cache(f)


def _scheduler_class(folder: Path) -> Any:
    """The scheduler class the base pipeline ships (its `_class_name`), DDPMScheduler when unknown."""
    import diffusers

    try:
        name = json.loads((folder / "scheduler" / "scheduler_config.json").read_text()).get("_class_name")
    except (OSError, json.JSONDecodeError):
        name = None
    cls = getattr(diffusers, str(name), None)
    return cls if cls is not None and hasattr(cls, "from_pretrained") else diffusers.DDPMScheduler


def load_unet(folder: Path, variant: str | None, stream: bool) -> Any:
    """The UNet of the pipeline folder `folder` (its `unet/`, the weights of `variant`): hollow (streamed into
    Gemini's shards later, `diffusion.streaming`) when `stream` and the folder allows it, else whole. The SD and
    SDXL loaders share it."""
    from diffusers import UNet2DConditionModel

    if stream:
        from .streaming import load_unet_hollow

        unet = load_unet_hollow(folder, variant)
        if unet is not None:
            return unet
    return UNet2DConditionModel.from_pretrained(folder, subfolder="unet", variant=variant)


def load_text_encoder(folder: Path, variant: str | None, dtype: Any, cls: Any = None,
                      sub: str = "text_encoder") -> Any:
    """The text encoder in the subfolder `sub` of the pipeline folder `folder`, loaded as `cls` (CLIPTextModel by
    default) directly in `dtype` (None: fp32). The SD and SDXL loaders share it."""
    from transformers import CLIPTextModel

    cls = cls or CLIPTextModel  # SDXL's second encoder: CLIPTextModelWithProjection from text_encoder_2/
    if dtype is None:
        return cls.from_pretrained(folder, subfolder=sub, variant=variant)
    try:  # transformers 5 names it dtype; 4.x torch_dtype
        return cls.from_pretrained(folder, subfolder=sub, variant=variant, dtype=dtype)
    except TypeError:
        return cls.from_pretrained(folder, subfolder=sub, variant=variant, torch_dtype=dtype)


def _from_folder(folder: Path, variant: str | None = None, tokenizer_name: str | None = None,
                 vae_dtype: Any = None, text_encoder_dtype: Any = None, stream_unet: bool = False,
                 unet_folder: Path | None = None) -> dict[str, Any]:
    from diffusers import AutoencoderKL
    from transformers import CLIPTokenizer

    check_pipeline_folder(folder)
    tokenizer_source = (lambda: CLIPTokenizer.from_pretrained(resolve_pretrained(tokenizer_name))) if tokenizer_name \
        else (lambda: CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer"))
    # frozen encoders are read straight into the training dtype: no fp32 copy first
    vae_kw = {} if vae_dtype is None else {"torch_dtype": vae_dtype}
    loaders = {
        # a non-EMA revision's UNet loads without the variant, as diffusers' train_text_to_image loads it
        "unet": lambda: load_unet(folder, variant, stream_unet) if unet_folder is None else
        load_unet(unet_folder, None, stream_unet),
        "vae": lambda: AutoencoderKL.from_pretrained(folder, subfolder="vae", variant=variant, **vae_kw),
        "text_encoder": lambda: load_text_encoder(folder, variant, text_encoder_dtype),
        "tokenizer": tokenizer_source,
        "scheduler": lambda: training_scheduler(folder),
        "inference_scheduler": lambda: _scheduler_class(folder).from_pretrained(folder, subfolder="scheduler"),
    }
    out = {}
    for name, load in loaders.items():
        try:
            out[name] = load()
            if name in ("vae", "text_encoder"):  # read whole by from_pretrained, copied: out of the page cache
                drop_folder_cache(folder / name)
        except Exception as exc:  # noqa: BLE001 - any failure here is a bad model folder
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            where = folder / name if name != "tokenizer" or not tokenizer_name else Path(tokenizer_name)
            where = unet_folder / name if name == "unet" and unet_folder is not None else where
            raise InputError(f"{where}: cannot load the '{name}' component ({reason})") from exc
    out["source"] = folder
    return out


def _from_folder_unet(folder: Path, variant: str | None) -> Any:
    """The whole UNet of a pipeline folder (the EMA's start under --non_ema_revision)."""
    try:
        return load_unet(folder, variant, False)
    except Exception as exc:  # noqa: BLE001 - any failure here is a bad model folder
        raise InputError(f"{folder / 'unet'}: cannot load the 'unet' component ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc


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
    extras = {"safety_checker": pipe.safety_checker, "feature_extractor": pipe.feature_extractor,
              "requires_safety_checker": bool(pipe.config.get("requires_safety_checker", False))}
    return {"unet": pipe.unet, "vae": pipe.vae, "text_encoder": pipe.text_encoder, "tokenizer": pipe.tokenizer,
            "scheduler": scheduler, "inference_scheduler": pipe.scheduler, "extras": extras}


def resolve_pretrained(name: str, *, revision: str | None = None, cache_dir: str | None = None,
                       flag: str = "--revision") -> Path:
    """`name` as a local path: an existing file or folder, or a hub id's snapshot in the local cache (at
    `revision`, given by the command-line flag `flag`).

    Nothing is downloaded: a hub id that is not cached raises `InputError`.
    """
    path = Path(name)
    if path.exists():
        if revision:
            raise InputError(f"{path}: {flag} applies to hub ids, not to a local folder")
        return path
    if name.count("/") == 1 and not name.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name, revision=revision, cache_dir=cache_dir, local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - every failure means: not in the local cache
            at = f" at {flag} {revision}" if revision else ""
            get = f" --revision {revision}" if revision else ""
            raise InputError(f"{name}: not a local folder, and not in the Hugging Face cache{at} (nothing is "
                             f"downloaded here: run huggingface-cli download {name}{get} where there is "
                             f"network)") from exc
    raise InputError(f"{path}: no such model folder or file (hub names cannot be downloaded here)")


def load_components(pretrained: str | None, *, tiny_resolution: int = 32, revision: str | None = None,
                    variant: str | None = None, cache_dir: str | None = None,
                    tokenizer_name: str | None = None, vae_dtype: Any = None, text_encoder_dtype: Any = None,
                    stream_unet: bool = False, non_ema_revision: str | None = None,
                    ema_unet: bool = False) -> dict[str, Any]:
    """The components of `pretrained` (pipeline folder, cached hub id or `.safetensors`/`.ckpt` file), or the
    tiny ones: `unet`, `vae`, `text_encoder`, `tokenizer`, `scheduler` (a `DDPMScheduler` with the pipeline's
    scheduler config, for training), `inference_scheduler` (the base's own), and `source` or `extras`.

    From a pipeline folder: `vae_dtype` / `text_encoder_dtype` load those components directly in that dtype
    (None: the file's values as fp32, diffusers' default); `stream_unet` builds the UNet with hollow parameters
    that Gemini's setup fills tensor by tensor from the folder's safetensors (`diffusion.streaming`), where the
    folder allows it.

    `non_ema_revision` (a hub id's revision holding the non-EMA weights; diffusers' train_text_to_image flag):
    `unet` comes from that revision (without `variant`, as diffusers loads it), the other components from
    `revision`; with `ema_unet`, `ema_unet` is the UNet at `revision` (what the EMA starts from).
    """
    if pretrained is None:
        from .tiny import TinyPipelineConfig, build_tiny_components

        logger.info("no --pretrained_model_name_or_path: using the tiny built-in pipeline (random weights)")
        comps = build_tiny_components(TinyPipelineConfig(sample_size=tiny_resolution))
        if tokenizer_name:
            from transformers import CLIPTokenizer

            comps["tokenizer"] = CLIPTokenizer.from_pretrained(resolve_pretrained(tokenizer_name))
        return comps
    path = resolve_pretrained(pretrained, revision=revision, cache_dir=cache_dir)
    unet_folder = None
    if non_ema_revision and non_ema_revision != revision:
        unet_folder = resolve_pretrained(pretrained, revision=non_ema_revision, cache_dir=cache_dir,
                                         flag="--non_ema_revision")
    if path.is_dir():
        comps = _from_folder(path, variant, tokenizer_name, vae_dtype, text_encoder_dtype,
                             stream_unet and not ema_unet, unet_folder)
        if ema_unet and unet_folder is not None:
            comps["ema_unet"] = _from_folder_unet(path, variant)
        return comps
    if path.suffix not in (".safetensors", ".ckpt"):
        raise InputError(f"{path}: expected a diffusers pipeline folder or a .safetensors/.ckpt file")
    return _from_single_file(path)


def make_pipeline(components: dict[str, Any], scheduler: Any | None = None, *, keep_extras: bool = False) -> Any:
    """A `StableDiffusionPipeline` over `components`: no safety checker unless `keep_extras` (then the
    base's safety checker, feature extractor and `requires_safety_checker` from `components["extras"]`)."""
    from diffusers import StableDiffusionPipeline

    extras = (components.get("extras") or {}) if keep_extras else {}
    return StableDiffusionPipeline(
        vae=components["vae"],
        text_encoder=components["text_encoder"],
        tokenizer=components["tokenizer"],
        unet=components["unet"],
        scheduler=scheduler if scheduler is not None else components["scheduler"],
        safety_checker=extras.get("safety_checker"),
        feature_extractor=extras.get("feature_extractor"),
        requires_safety_checker=bool(extras.get("requires_safety_checker", False)),
    )
