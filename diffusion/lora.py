"""LoRA adapters through peft, saved in the diffusers layout `pipe.load_lora_weights` reads.

The adapter follows diffusers' LoRA scripts: rank r, alpha r, gaussian init, on the attention projections
(`to_q`, `to_k`, `to_v`, `to_out.0` in the UNet; `q_proj`, `k_proj`, `v_proj`, `out_proj` in CLIP).

Text-encoder layers are written in CLIP's `text_model.` layout (`text_encoder.text_model.encoder.layers.0.
self_attn.q_proj.lora_linear_layer.down.weight`) whatever transformers runs here (`lora_file_key`): transformers
5 flattened `CLIPTextModel` (no `text_model` module; `CLIPTextModelWithProjection` kept it), so peft's names of the
first SDXL encoder lost the prefix. That layout is the one every SD/SDXL LoRA file trained before had, the one a
transformers 4 `CLIPTextModel` needs, and the one transformers 5's `load_adapter` maps onto the flat model (checked
with 5.25), so `load_lora_weights` applies it in diffusers v0.40.0, which hands the keys to `load_adapter` as they
are, and in later versions, which also strip the prefix themselves.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..utils.fileio import fsync_dir

__all__ = ["LORA_WEIGHT_NAME", "TEXT_ENCODER_PARTS", "add_lora", "lora_file_key", "lora_state_dicts",
           "save_lora_weights"]

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
UNET_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
TEXT_ENCODER_PARTS = ("text_encoder", "text_encoder_2")
"""The LoRA file's prefixes of text-encoder layers."""


def lora_file_key(key: str) -> str:
    """`key` of a LoRA file (`<part>.<layer>...`) in the layout written here: a text encoder's layer under CLIP's
    `text_model.` (added when peft named it on transformers 5's flat `CLIPTextModel`), other keys unchanged."""
    part, _, rest = key.partition(".")
    if part in TEXT_ENCODER_PARTS and rest.startswith(("encoder.", "embeddings.", "final_layer_norm.")):
        return f"{part}.text_model.{rest}"
    return key


def add_lora(model: Any, rank: int, *, text_encoder: bool = False, dropout: float = 0.0) -> list[torch.nn.Parameter]:
    """Add a rank-`rank` adapter to `model` (a UNet, or a CLIP text encoder) and return its fp32 parameters;
    `dropout`: peft's `lora_dropout` on the adapter's input (the SDXL DreamBooth script's --lora_dropout)."""
    from peft import LoraConfig, inject_adapter_in_model

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    config = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=dropout, init_lora_weights="gaussian",
                        target_modules=TEXT_TARGETS if text_encoder else UNET_TARGETS)
    model.requires_grad_(False)
    if text_encoder:
        # transformers' `add_adapter` wants a newer peft than some installs have; peft's own injection is
        # what it calls underneath, and diffusers' load_lora_weights reads the result the same way.
        inject_adapter_in_model(config, model)
    else:
        model.add_adapter(config)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return params


def lora_state_dicts(unet: Any, text_encoder: Any | None = None,
                     unet_state: dict | None = None, text_state: dict | None = None) -> dict[str, dict]:
    """The diffusers-format LoRA layers of `unet` (and `text_encoder`), from the modules or given state dicts."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    out = {"unet_lora_layers": convert_state_dict_to_diffusers(get_peft_model_state_dict(unet, unet_state))}
    if text_encoder is not None:
        out["text_encoder_lora_layers"] = convert_state_dict_to_diffusers(
            get_peft_model_state_dict(text_encoder, text_state))
    return out


def _text_model_key(layers: str, key: str) -> str:
    """`key` of the `layers` argument (`text_encoder_lora_layers`, ...) in the layout `lora_file_key` gives."""
    part = layers.removesuffix("_lora_layers")
    return lora_file_key(f"{part}.{key}").removeprefix(f"{part}.")


def save_lora_weights(folder: str | Path, layers: dict[str, dict | None], *, sdxl: bool | None = None) -> Path:
    """Write `pytorch_lora_weights.safetensors` into `folder` atomically (a kill leaves the old file), as the
    pipeline's `save_lora_weights` writes it: `StableDiffusionXLPipeline`'s with `sdxl` (by default when `layers`
    holds `text_encoder_2_lora_layers`: SDXL's pipeline writes the second text encoder's layers), else
    `StableDiffusionPipeline`'s. `layers`: `unet_lora_layers` and optionally `text_encoder_lora_layers`,
    `text_encoder_2_lora_layers` (None: not written). Text-encoder keys are written in CLIP's `text_model.`
    layout (`lora_file_key`)."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    if sdxl is None:
        sdxl = "text_encoder_2_lora_layers" in layers
    pipeline = StableDiffusionXLPipeline if sdxl else StableDiffusionPipeline
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layers = {k: None if v is None else {_text_model_key(k, n): t.detach().float().cpu().contiguous()
                                         for n, t in v.items()}
              for k, v in layers.items()}
    with tempfile.TemporaryDirectory(dir=folder, prefix=".lora-") as tmp:
        pipeline.save_lora_weights(tmp, safe_serialization=True, **layers)
        os.replace(Path(tmp) / LORA_WEIGHT_NAME, folder / LORA_WEIGHT_NAME)
    fsync_dir(folder)
    return folder / LORA_WEIGHT_NAME
