"""Tiny SD3- and Flux-shaped pipeline folders built offline (no download): the shapes of diffusers' own SD3 and Flux
pipeline tests (a one- or two-block MMDiT, 4- or 8-channel latents, 32-wide text encoders), random weights that
depend only on the seed, written with `save_pretrained` so `StableDiffusion3Pipeline.from_pretrained` /
`FluxPipeline.from_pretrained` read them. The CLIP tokenizers are `diffusion.tiny`'s byte-level one; the T5
tokenizer is a unigram over the printable ASCII characters (`t5_tokenizer`), built from its vocabulary alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["save_tiny_flux_pipeline", "save_tiny_sd3_pipeline", "t5_tokenizer"]

_T5_SPECIALS = ["<pad>", "</s>", "<unk>"]


def t5_tokenizer(max_length: int = 512) -> Any:
    """A T5 tokenizer over the three T5 specials and the printable ASCII characters: transformers 5's `T5Tokenizer`
    (built on `tokenizers`) from the vocabulary; where `T5Tokenizer` is the SentencePiece one (transformers 4, which
    needs the `sentencepiece` package), the same unigram built with `tokenizers` in a `T5TokenizerFast`."""
    import transformers

    vocab = [(t, 0.0) for t in _T5_SPECIALS] + [(chr(c), -1.0) for c in range(32, 127)] + [("\u2581", -1.0)]
    if int(transformers.__version__.split(".")[0]) >= 5:
        return transformers.T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.Unigram(vocab, unk_id=_T5_SPECIALS.index("<unk>")))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", _T5_SPECIALS.index("</s>"))])
    return transformers.T5TokenizerFast(tokenizer_object=tok, extra_ids=0, model_max_length=max_length,
                                        pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def _t5(tokenizer: Any) -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5EncoderModel(config)


def _clip(tokenizer: Any, projection: bool = True, hidden: int = 32) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from .tiny import BOS, EOS

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, max_position_embeddings=77, projection_dim=hidden, hidden_act="gelu",
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS), eos_token_id=tokenizer.convert_tokens_to_ids(EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(EOS))
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def _vae(latent_channels: int, sample_size: int) -> Any:
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(32, 64),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         latent_channels=latent_channels, sample_size=sample_size, norm_num_groups=32,
                         use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
                         scaling_factor=1.5035)


def _save(pipe: Any, folder: str | Path, tokenizers: tuple[str, ...]) -> Path:
    from .tiny import build_tokenizer

    folder = Path(folder)
    pipe.save_pretrained(folder, safe_serialization=True)
    for sub in tokenizers:  # transformers 4's slow CLIP tokenizer reads these two files
        build_tokenizer(77, folder / sub)
    return folder


def save_tiny_sd3_pipeline(folder: str | Path, seed: int = 0, sample_size: int = 32) -> Path:
    """A tiny Stable Diffusion 3 pipeline folder (two CLIP encoders with projection, a T5 encoder, a one-block
    `SD3Transformer2DModel`, a 4-channel VAE with shift and scale, `FlowMatchEulerDiscreteScheduler(shift=3)`)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    from .tiny import build_tokenizer

    clip_tok, t5_tok = build_tokenizer(77), t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=sample_size // 2, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64,
            out_channels=4)
        te1, te2, te3 = _clip(clip_tok), _clip(clip_tok), _t5(t5_tok)
        vae = _vae(4, sample_size)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=te1, tokenizer=clip_tok, text_encoder_2=te2, tokenizer_2=clip_tok, text_encoder_3=te3,
        tokenizer_3=t5_tok)
    return _save(pipe, folder, ("tokenizer", "tokenizer_2"))


def save_tiny_flux_pipeline(folder: str | Path, seed: int = 0, sample_size: int = 32,
                            guidance_embeds: bool = True) -> Path:
    """A tiny Flux pipeline folder (CLIP + T5, a `FluxTransformer2DModel` with one double and one single block and
    the guidance embedding of Flux.1-dev unless `guidance_embeds` is False, an 8-channel VAE, Flux's
    `FlowMatchEulerDiscreteScheduler` with dynamic shifting)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    from .tiny import build_tokenizer

    clip_tok, t5_tok = build_tokenizer(77), t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=32, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8),
            guidance_embeds=guidance_embeds)
        te1, te2 = _clip(clip_tok, projection=False), _t5(t5_tok)
        vae = _vae(8, sample_size)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=te1, tokenizer=clip_tok,
                        text_encoder_2=te2, tokenizer_2=t5_tok)
    return _save(pipe, folder, ("tokenizer",))
