"""Stable Diffusion XL pieces: the components of an SDXL pipeline folder (two CLIP text encoders, the second with
a projection; a UNet with `addition_embed_type="text_time"`), its prompt encoding and micro-conditioning, the
pipeline over them, its LoRA file, and a tiny SDXL-shaped pipeline built offline for tests.

SDXL (Podell et al. 2023, "SDXL: Improving Latent Diffusion Models for High-Resolution Image Synthesis") conditions
the UNet on the concatenated penultimate hidden states of both text encoders (`encoder_hidden_states`), the
second encoder's pooled projection (`text_embeds`) and six numbers per image (`time_ids`): the original image
size, the top-left corner of the crop, and the target size (sec. 2.2, "micro-conditioning"), as diffusers'
`train_*_sdxl.py` scripts feed them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import InputError
from .folders import training_scheduler
from .lora import save_lora_weights
from .models import check_pipeline_folder, drop_folder_cache, load_text_encoder, load_unet, resolve_pretrained

__all__ = ["SDXL_COMPONENTS", "TinySDXLConfig", "encode_prompt_sdxl",
           "load_sdxl_components", "load_sdxl_frozen", "make_sdxl_pipeline", "save_sdxl_lora_weights",
           "save_tiny_sdxl_pipeline", "time_ids"]

logger = logging.getLogger(__name__)

#: Subfolder -> the file (any of) that must be in it for the component to load.
SDXL_COMPONENTS: dict[str, tuple[str, ...]] = {
    "unet": ("config.json",),
    "vae": ("config.json",),
    "text_encoder": ("config.json",),
    "text_encoder_2": ("config.json",),
    "tokenizer": ("tokenizer.json", "vocab.json", "tokenizer_config.json"),
    "tokenizer_2": ("tokenizer.json", "vocab.json", "tokenizer_config.json"),
    "scheduler": ("scheduler_config.json",),
}


# -- loading ----------------------------------------------------------------------------------------------------
def _dtype_kw(dtype: Any) -> dict[str, Any]:
    return {} if dtype is None else {"torch_dtype": dtype}


def load_sdxl_components(pretrained: str, *, vae: str | None = None, revision: str | None = None,
                         variant: str | None = None, cache_dir: str | None = None, vae_dtype: Any = None,
                         text_encoder_dtype: Any = None, stream_unet: bool = False) -> dict[str, Any]:
    """The components of the SDXL pipeline `pretrained` (a folder, or a hub id in the local cache): `unet`,
    `vae` (from the folder `vae` when given), `text_encoder`, `text_encoder_2`, `tokenizer`, `tokenizer_2`,
    `scheduler` (the training scheduler the scripts build from the pipeline's scheduler config: DDPM, or EDM Euler
    for an EDM folder, `folders.training_scheduler`),
    `inference_scheduler` (the pipeline's own) and `source` (the folder).

    The frozen models load directly in `vae_dtype` / `text_encoder_dtype` (None: fp32); `stream_unet` builds the
    UNet hollow for Gemini to fill from the safetensors (`diffusion.streaming`). Any failure is one `InputError`
    naming the component's folder.
    """
    folder = resolve_pretrained(pretrained, revision=revision, cache_dir=cache_dir)
    if not folder.is_dir():
        raise InputError(f"{folder}: the SDXL commands need a diffusers pipeline folder (single files are not read)")
    check_pipeline_folder(folder, SDXL_COMPONENTS)
    vae_folder = resolve_pretrained(vae, cache_dir=cache_dir) if vae else None
    if vae_folder is not None and not (vae_folder / "config.json").is_file():
        raise InputError(f"{vae_folder}: --pretrained_vae_model_name_or_path needs a VAE folder with config.json")
    loaders = _loaders(folder, vae_folder, variant, vae_dtype, text_encoder_dtype, stream_unet)
    out: dict[str, Any] = {"source": folder, "vae_source": vae_folder}
    for name, (where, load) in loaders.items():
        try:
            out[name] = load()
        except Exception as exc:  # noqa: BLE001 - any failure here is a bad model folder
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise InputError(f"{where}: cannot load the '{name}' component ({reason})") from exc
        if name in ("vae", "text_encoder", "text_encoder_2"):  # read whole and copied: out of the page cache
            drop_folder_cache(where)
    return out


def _loaders(folder: Path, vae_folder: Path | None, variant: str | None, vae_dtype: Any, text_encoder_dtype: Any,
             stream_unet: bool) -> dict[str, tuple[Path, Any]]:
    """Component name -> (its folder, a function loading it)."""
    import diffusers
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    sched_class = json.loads((folder / "scheduler" / "scheduler_config.json").read_text()).get("_class_name")
    sched_class = getattr(diffusers, str(sched_class), diffusers.EulerDiscreteScheduler)
    return {
        "unet": (folder / "unet", lambda: load_unet(folder, variant, stream_unet)),
        "vae": (vae_folder or folder / "vae",
                lambda: AutoencoderKL.from_pretrained(vae_folder, **_dtype_kw(vae_dtype)) if vae_folder else
                AutoencoderKL.from_pretrained(folder, subfolder="vae", variant=variant, **_dtype_kw(vae_dtype))),
        "text_encoder": (folder / "text_encoder",
                         lambda: load_text_encoder(folder, variant, text_encoder_dtype, CLIPTextModel)),
        "text_encoder_2": (folder / "text_encoder_2",
                           lambda: load_text_encoder(folder, variant, text_encoder_dtype,
                                                      CLIPTextModelWithProjection, "text_encoder_2")),
        "tokenizer": (folder / "tokenizer", lambda: CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer")),
        "tokenizer_2": (folder / "tokenizer_2",
                        lambda: CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer_2")),
        "scheduler": (folder / "scheduler", lambda: training_scheduler(folder)),
        "inference_scheduler": (folder / "scheduler",
                                lambda: sched_class.from_pretrained(folder, subfolder="scheduler")),
    }


def load_sdxl_frozen(folder: Path, name: str, *, vae_folder: Path | None = None, variant: str | None = None,
                     dtype: Any = None) -> Any:
    """One frozen component (`vae`, `text_encoder`, `text_encoder_2`) of the pipeline folder `folder` again, in
    `dtype`, gradients off, in eval mode: what a run that freed it after pre-computing needs back for validation
    images (as the scripts load them again for their validation pipeline)."""
    where, load = _loaders(folder, vae_folder, variant, dtype, dtype, False)[name]
    try:
        module = load()
    except Exception as exc:  # noqa: BLE001 - the folder changed during the run
        raise InputError(f"{where}: cannot load the '{name}' component again ({type(exc).__name__}: {exc})") from exc
    return module.requires_grad_(False).eval()


# -- the math of a step -----------------------------------------------------------------------------------------
def encode_prompt_sdxl(text_encoders: list[Any], input_ids: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """SDXL's prompt embeddings: the penultimate hidden states of every encoder concatenated on the channel dim,
    `[B, L, D1 + D2]`, and the pooled projection of the last encoder, `[B, P]` (diffusers' `encode_prompt` of the
    SDXL training scripts). `input_ids: [B, L]` per encoder."""
    hidden, pooled = [], None
    for encoder, ids in zip(text_encoders, input_ids, strict=True):
        out = encoder(ids.to(encoder.device), output_hidden_states=True, return_dict=True)
        hidden.append(out.hidden_states[-2])
        pooled = out[0]  # text_embeds of the projection model (the last encoder's is the one used)
    return torch.cat(hidden, dim=-1), pooled.view(pooled.shape[0], -1)


def time_ids(original_sizes: torch.Tensor, crops_top_left: torch.Tensor, resolution: int) -> torch.Tensor:
    """The micro-conditioning `[B, 6]`: original (h, w), crop top-left (y, x), target (h, w) = resolution.

    `original_sizes: [B, 2]`, `crops_top_left: [B, 2]` (ints)."""
    target = torch.full_like(original_sizes, resolution)
    return torch.cat([original_sizes, crops_top_left, target], dim=1)


# -- pipelines and files ----------------------------------------------------------------------------------------
def make_sdxl_pipeline(components: dict[str, Any], scheduler: Any | None = None) -> Any:
    """A `StableDiffusionXLPipeline` over `components` (no watermarker)."""
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline(
        vae=components["vae"], text_encoder=components["text_encoder"],
        text_encoder_2=components["text_encoder_2"], tokenizer=components["tokenizer"],
        tokenizer_2=components["tokenizer_2"], unet=components["unet"],
        scheduler=scheduler if scheduler is not None else components["scheduler"],
        add_watermarker=False,
    )


def save_sdxl_lora_weights(folder: str | Path, layers: dict[str, Any]) -> Path:
    """Write `pytorch_lora_weights.safetensors` as `StableDiffusionXLPipeline.save_lora_weights` does, atomically;
    `layers`: `unet_lora_layers` and optionally `text_encoder_lora_layers`, `text_encoder_2_lora_layers`."""
    return save_lora_weights(folder, layers, sdxl=True)


# -- a tiny SDXL-shaped pipeline --------------------------------------------------------------------------------
@dataclass(kw_only=True)
class TinySDXLConfig:
    """Sizes of the tiny SDXL-shaped pipeline (the shapes of diffusers' own SDXL pipeline tests)."""

    sample_size: int = 32
    """Image side in pixels (latents are half of it)."""
    unet_channels: tuple[int, ...] = (32, 64)
    """UNet block output channels, one entry per level."""
    text_hidden_size: int = 32
    """Width of each text encoder (the UNet's cross-attention dim is twice it)."""
    time_embed_dim: int = 8
    """`addition_time_embed_dim` of the UNet (six of them per image)."""
    seed: int = 0
    """Seed of the random initial weights."""


def _tiny_unet(cfg: TinySDXLConfig) -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=cfg.sample_size // 2, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=tuple(cfg.unet_channels), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4), use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=cfg.time_embed_dim,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=cfg.text_hidden_size + 6 * cfg.time_embed_dim,
        cross_attention_dim=2 * cfg.text_hidden_size, norm_num_groups=32,
    )


def _tiny_text_encoder(cfg: TinySDXLConfig, tokenizer: Any, projection: bool) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from .tiny import BOS, EOS

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.text_hidden_size, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, max_position_embeddings=77, projection_dim=cfg.text_hidden_size, hidden_act="gelu",
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS), eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(EOS),
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def save_tiny_sdxl_pipeline(folder: str | Path, cfg: TinySDXLConfig | None = None) -> Path:
    """Write a tiny SDXL pipeline folder in diffusers' layout (random weights depending only on `cfg.seed`, an
    `EulerDiscreteScheduler` as SDXL ships), offline; `StableDiffusionXLPipeline.from_pretrained` reads it."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler

    from .tiny import build_tokenizer

    cfg = cfg or TinySDXLConfig()
    tokenizer = build_tokenizer(77)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        unet = _tiny_unet(cfg)
        vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(32, 64),
                            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                            latent_channels=4, sample_size=cfg.sample_size, norm_num_groups=32)
        te1 = _tiny_text_encoder(cfg, tokenizer, projection=False)
        te2 = _tiny_text_encoder(cfg, tokenizer, projection=True)
    scheduler = EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                       beta_schedule="scaled_linear", prediction_type="epsilon", steps_offset=1,
                                       timestep_spacing="leading")
    pipe = make_sdxl_pipeline({"unet": unet, "vae": vae, "text_encoder": te1, "text_encoder_2": te2,
                               "tokenizer": tokenizer, "tokenizer_2": tokenizer, "scheduler": scheduler})
    folder = Path(folder)
    pipe.save_pretrained(folder, safe_serialization=True)
    for sub in ("tokenizer", "tokenizer_2"):  # transformers 4's slow tokenizer reads these two
        build_tokenizer(77, folder / sub)
    return folder
