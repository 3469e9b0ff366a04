"""A tiny Stable Diffusion pipeline built offline from configs (no download, no hub).

The shapes follow the tiny test pipelines diffusers itself uses: a two-level UNet with one cross-attention
block per level, a two-level VAE (scale factor 2) and a two-layer CLIP text encoder. The tokenizer is a
byte-level CLIP BPE with an empty merge list: 256 byte symbols, the same 256 with the end-of-word marker,
and the two CLIP specials, 514 tokens in all. It tokenizes any text (one token per byte) and is written in
both the `tokenizer.json` (transformers 5) and `vocab.json` + `merges.txt` (transformers 4) layouts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TinyPipelineConfig", "build_tiny_components", "build_tokenizer", "byte_vocab"]

logger = logging.getLogger(__name__)

BOS = "<|startoftext|>"
EOS = "<|endoftext|>"


@dataclass(kw_only=True)
class TinyPipelineConfig:
    """Sizes of the built-in tiny pipeline."""

    sample_size: int = 32
    """Image side in pixels the pipeline is configured for (latents are half of it)."""
    unet_channels: tuple[int, ...] = (32, 64)
    """UNet block output channels, one entry per resolution level."""
    layers_per_block: int = 1
    """ResNet layers per UNet block."""
    attention_head_dim: int = 8
    """Channels per attention head in the UNet."""
    text_hidden_size: int = 32
    """CLIP text encoder width; also the UNet's cross-attention dim."""
    text_layers: int = 2
    """CLIP text encoder layers."""
    max_length: int = 77
    """Tokenizer and text encoder context length."""
    seed: int = 0
    """Seed of the random initial weights."""

    def __post_init__(self) -> None:
        if self.sample_size < 8 or self.sample_size % 8:
            raise ValueError(f"sample_size must be a positive multiple of 8, got {self.sample_size}")
        if not self.unet_channels or any(c % 32 for c in self.unet_channels):
            raise ValueError(f"unet_channels must be non-empty multiples of 32 (GroupNorm), got {self.unet_channels}")
        for name in ("layers_per_block", "attention_head_dim", "text_hidden_size", "text_layers", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.text_hidden_size % 4:
            raise ValueError(f"text_hidden_size must be a multiple of 4 (4 heads), got {self.text_hidden_size}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from bytes to printable unicode symbols."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


def byte_vocab() -> dict[str, int]:
    """The 514-token byte-level CLIP vocabulary (symbols, symbols + `</w>`, BOS, EOS)."""
    symbols = list(_bytes_to_unicode().values())
    tokens = [*symbols, *(s + "</w>" for s in symbols), BOS, EOS]
    return {t: i for i, t in enumerate(tokens)}


def build_tokenizer(max_length: int = 77, folder: str | Path | None = None) -> Any:
    """A CLIPTokenizer over `byte_vocab()`; with `folder`, also write its files there (both layouts)."""
    import tempfile

    from transformers import CLIPTokenizer

    vocab = byte_vocab()
    # Built from its two files, which every transformers version reads (4.x takes file names, 5.x also dicts).
    with tempfile.TemporaryDirectory() as tmp:
        files = Path(tmp)
        _write_vocab_files(files, vocab)
        tokenizer = CLIPTokenizer(str(files / "vocab.json"), str(files / "merges.txt"), pad_token=EOS,
                                  model_max_length=max_length)
    if folder is not None:
        folder = Path(folder)
        tokenizer.save_pretrained(folder)
        _write_vocab_files(folder, vocab)
    return tokenizer


def _write_vocab_files(folder: Path, vocab: dict[str, int]) -> None:
    (folder / "vocab.json").write_text(json.dumps(vocab))
    # The tokenizers BPE loader rejects a merges file ending in a blank line: no trailing newline.
    (folder / "merges.txt").write_text("#version: 0.2")


def _unet(cfg: TinyPipelineConfig) -> Any:
    from diffusers import UNet2DConditionModel

    levels = len(cfg.unet_channels)
    down = ("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (levels - 1) if levels > 1 else ("CrossAttnDownBlock2D",)
    up = ("CrossAttnUpBlock2D",) * (levels - 1) + ("UpBlock2D",) if levels > 1 else ("CrossAttnUpBlock2D",)
    return UNet2DConditionModel(
        sample_size=cfg.sample_size // 2,
        in_channels=4,
        out_channels=4,
        layers_per_block=cfg.layers_per_block,
        block_out_channels=tuple(cfg.unet_channels),
        down_block_types=down,
        up_block_types=up,
        cross_attention_dim=cfg.text_hidden_size,
        attention_head_dim=cfg.attention_head_dim,
        norm_num_groups=32,
    )


def _vae(cfg: TinyPipelineConfig) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        sample_size=cfg.sample_size,
        norm_num_groups=32,
    )


def _text_encoder(cfg: TinyPipelineConfig, tokenizer: Any) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.text_hidden_size,
        intermediate_size=cfg.text_hidden_size + cfg.text_hidden_size // 8 + 1,
        num_attention_heads=4,
        num_hidden_layers=cfg.text_layers,
        max_position_embeddings=cfg.max_length,
        projection_dim=cfg.text_hidden_size,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS),
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(EOS),
    )
    return CLIPTextModel(config)


def build_tiny_components(cfg: TinyPipelineConfig | None = None) -> dict[str, Any]:
    """The five pipeline components (`unet`, `vae`, `text_encoder`, `tokenizer`, `scheduler`), random weights.

    The weights depend only on `cfg.seed`; the global RNG state is left untouched.
    """
    import torch
    from diffusers import DDPMScheduler

    cfg = cfg or TinyPipelineConfig()
    tokenizer = build_tokenizer(cfg.max_length)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        unet, vae, text_encoder = _unet(cfg), _vae(cfg), _text_encoder(cfg, tokenizer)
    scheduler = DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        clip_sample=False,
        steps_offset=1,
    )
    return {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": scheduler}


def save_tiny_sd_pipeline(folder: str | Path, cfg: TinyPipelineConfig | None = None) -> Path:
    """Write a tiny pipeline folder shaped like Stable Diffusion 1.5's: the tiny components with a
    `PNDMScheduler` (SD's inference scheduler), a tiny `StableDiffusionSafetyChecker`, a `CLIPImageProcessor`
    feature extractor and `requires_safety_checker: true`. Offline; the weights depend only on `cfg.seed`."""
    import torch
    from diffusers import PNDMScheduler, StableDiffusionPipeline
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    cfg = cfg or TinyPipelineConfig()
    comps = build_tiny_components(cfg)
    width = cfg.text_hidden_size
    clip = CLIPConfig(
        text_config=dict(hidden_size=width, intermediate_size=2 * width, num_attention_heads=4, num_hidden_layers=1,
                         vocab_size=514, max_position_embeddings=cfg.max_length, bos_token_id=512,
                         eos_token_id=513, pad_token_id=513),
        vision_config=dict(hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
                           num_hidden_layers=1, image_size=32, patch_size=8),
        projection_dim=width,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + 1)
        safety_checker = StableDiffusionSafetyChecker(clip)
    pipe = StableDiffusionPipeline(
        vae=comps["vae"], text_encoder=comps["text_encoder"], tokenizer=comps["tokenizer"], unet=comps["unet"],
        scheduler=PNDMScheduler.from_config(comps["scheduler"].config, skip_prk_steps=True),
        safety_checker=safety_checker,
        feature_extractor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        requires_safety_checker=True,
    )
    folder = Path(folder)
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder
