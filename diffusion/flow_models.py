"""The components of SD3 and Flux pipeline folders as the DreamBooth scripts load them, the pipelines over them, and
their LoRA file (`StableDiffusion3Pipeline.save_lora_weights` / `FluxPipeline.save_lora_weights`).

SD3: `transformer` (`SD3Transformer2DModel`), `vae`, `text_encoder` / `text_encoder_2` (CLIP-L / CLIP-G with
projection), `text_encoder_3` (T5), their three tokenizers, and the `FlowMatchEulerDiscreteScheduler`. Flux:
`transformer` (`FluxTransformer2DModel`), `vae`, `text_encoder` (CLIP-L), `text_encoder_2` (T5), two tokenizers,
the scheduler.
"""

from __future__ import annotations

import inspect
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from ..utils.fileio import fsync_dir
from .errors import InputError
from .lora import LORA_WEIGHT_NAME, lora_file_key
from .models import check_pipeline_folder, drop_folder_cache, resolve_pretrained

__all__ = ["ENCODERS", "FLOW_COMPONENTS", "load_flow_component", "load_flow_components", "load_streamed_t5",
           "make_flow_pipeline", "save_flow_lora_weights", "t5_name", "trained_text_encoders"]

logger = logging.getLogger(__name__)

ENCODERS: dict[str, tuple[tuple[str, str, str], ...]] = {
    # family -> (encoder subfolder, its transformers class, its tokenizer subfolder), in the scripts' order
    "sd3": (("text_encoder", "CLIPTextModelWithProjection", "tokenizer"),
            ("text_encoder_2", "CLIPTextModelWithProjection", "tokenizer_2"),
            ("text_encoder_3", "T5EncoderModel", "tokenizer_3")),
    "flux": (("text_encoder", "CLIPTextModel", "tokenizer"), ("text_encoder_2", "T5EncoderModel", "tokenizer_2")),
}
"""Each family's text encoders."""

FLOW_COMPONENTS: dict[str, dict[str, tuple[str, ...]]] = {
    family: {"transformer": ("config.json",), "vae": ("config.json",), "scheduler": ("scheduler_config.json",),
             **{e: ("config.json",) for e, _, _ in enc},
             **{t: ("tokenizer.json", "vocab.json", "tokenizer_config.json", "spiece.model") for _, _, t in enc}}
    for family, enc in ENCODERS.items()
}
"""Subfolder -> the file (any of) that must be in it, per family."""


def _dtype_kw(dtype: Any) -> dict[str, Any]:
    return {} if dtype is None else {"torch_dtype": dtype}


def _loader(folder: Path, family: str, name: str, variant: str | None, dtype: Any) -> Any:
    import diffusers
    import transformers

    if name == "transformer":
        cls = diffusers.SD3Transformer2DModel if family == "sd3" else diffusers.FluxTransformer2DModel
        return lambda: cls.from_pretrained(folder, subfolder="transformer", variant=variant)
    if name == "vae":
        return lambda: diffusers.AutoencoderKL.from_pretrained(folder, subfolder="vae", variant=variant)
    if name == "scheduler":
        return lambda: diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    for enc, cls_name, tok in ENCODERS[family]:
        if name == enc:
            cls = getattr(transformers, cls_name)
            # transformers 5 names it dtype; 4.x torch_dtype
            key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
            kw = {} if dtype is None else {key: dtype}
            return lambda: cls.from_pretrained(folder, subfolder=enc, variant=variant, **kw)
        if name == tok:
            return lambda: transformers.AutoTokenizer.from_pretrained(folder, subfolder=tok)
    raise KeyError(name)


def load_flow_component(folder: Path, family: str, name: str, *, variant: str | None = None,
                        dtype: Any = None) -> Any:
    """One component `name` of the pipeline folder (a text encoder directly in `dtype`); one `InputError`
    naming the folder and the component when it cannot load."""
    try:
        part = _loader(folder, family, name, variant, dtype)()
    except Exception as exc:  # noqa: BLE001 - any failure to read a component is the folder's
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise InputError(f"{folder / name}: cannot load the '{name}' component ({reason})") from exc
    if name.startswith(("vae", "text_encoder")):
        drop_folder_cache(folder / name)  # read whole and copied: out of the page cache
    return part


def trained_text_encoders(family: str, lora: bool) -> list[str]:
    """The text encoders the scripts' --train_text_encoder trains: the LoRA scripts' adapters go on the CLIP
    encoders; train_dreambooth_sd3.py trains all three whole (T5 too), train_dreambooth_flux.py its CLIP (T5
    frozen)."""
    if lora or family == "flux":
        return [enc for enc, cls, _ in ENCODERS[family] if cls.startswith("CLIP")]
    return [enc for enc, _, _ in ENCODERS[family]]


def t5_name(family: str) -> str:
    """The subfolder of the family's T5 encoder."""
    return next(enc for enc, cls, _ in ENCODERS[family] if cls.startswith("T5"))


def load_streamed_t5(folder: Path, family: str, *, variant: str | None = None, dtype: Any = None,
                     device: Any = "cpu") -> Any:
    """The family's T5 encoder streamed block by block on `device` (`diffusion.flow_stream`), or, where streaming
    does not apply, loaded whole (frozen, eval mode)."""
    from transformers import T5EncoderModel

    from .flow_stream import streamed_encoder

    name = t5_name(family)
    model = streamed_encoder(folder / name, T5EncoderModel, dtype, variant, device=device)
    if model is None:
        model = load_flow_component(folder, family, name, variant=variant, dtype=dtype).requires_grad_(False).eval()
        model.to(device)
    return model


def load_flow_components(pretrained: str, family: str, *, revision: str | None = None, variant: str | None = None,
                         cache_dir: str | None = None, text_encoder_dtype: Any = None,
                         skip: tuple[str, ...] = (), stream_transformer: bool = False) -> dict[str, Any]:
    """Every component of the SD3 / Flux folder `pretrained` (a folder, or a hub id in the local cache), the text
    encoders in `text_encoder_dtype`, plus `source` (the folder) and `inference_scheduler` (the scheduler again,
    for validation pipelines); the components `skip` are None (loaded when needed: T5, streamed). With
    `stream_transformer` the transformer is built hollow for Gemini's shards (`flow_stream.hollow_transformer`)
    where the folder allows it."""
    folder = resolve_pretrained(pretrained, revision=revision, cache_dir=cache_dir)
    check_pipeline_folder(folder, FLOW_COMPONENTS[family])
    out: dict[str, Any] = {"source": folder}
    if stream_transformer:
        import diffusers

        from .flow_stream import hollow_transformer

        cls = diffusers.SD3Transformer2DModel if family == "sd3" else diffusers.FluxTransformer2DModel
        out["transformer"] = hollow_transformer(folder, cls, variant)
        skip = (*skip, "transformer") if out["transformer"] is not None else skip
    for name in FLOW_COMPONENTS[family]:
        if name in skip and name in out:
            continue
        dtype = text_encoder_dtype if name.startswith("text_encoder") else None
        out[name] = None if name in skip else load_flow_component(folder, family, name, variant=variant, dtype=dtype)
    out["inference_scheduler"] = load_flow_component(folder, family, "scheduler")
    return out


def make_flow_pipeline(family: str, components: dict[str, Any]) -> Any:
    """A `StableDiffusion3Pipeline` / `FluxPipeline` over `components` (the names of `FLOW_COMPONENTS`)."""
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    cls = StableDiffusion3Pipeline if family == "sd3" else FluxPipeline
    return cls(**{name: components[name] for name in FLOW_COMPONENTS[family]})


def save_flow_lora_weights(folder: str | Path, family: str, layers: dict[str, dict | None]) -> Path:
    """Write `pytorch_lora_weights.safetensors` into `folder` atomically, as the family's pipeline's
    `save_lora_weights` writes it (`layers`: `transformer_lora_layers`, optionally `text_encoder_lora_layers`,
    `text_encoder_2_lora_layers`; peft's names, fp32; `transformer_lora_adapter_metadata`: the adapter's config,
    written in the file's metadata as Flux's script does)."""
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline if family == "sd3" else FluxPipeline
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    def key(part: str, name: str) -> str:
        return lora_file_key(f"{part.removesuffix('_lora_layers')}.{name}").split(".", 1)[1]

    layers = {k: v if v is None or k.endswith("_metadata") else
              {key(k, n): t.detach().float().cpu().contiguous() for n, t in v.items()} for k, v in layers.items()}
    accepted = inspect.signature(pipeline.save_lora_weights).parameters
    # diffusers before adapter metadata in LoRA files (0.33) writes the file without it, as its scripts then did
    layers = {k: v for k, v in layers.items() if not k.endswith("_metadata") or k in accepted}
    with tempfile.TemporaryDirectory(dir=folder, prefix=".lora-") as tmp:
        pipeline.save_lora_weights(tmp, safe_serialization=True, **layers)
        os.replace(Path(tmp) / LORA_WEIGHT_NAME, folder / LORA_WEIGHT_NAME)
    fsync_dir(folder)
    return folder / LORA_WEIGHT_NAME

