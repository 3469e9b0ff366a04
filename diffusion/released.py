"""Pipeline folders at the released models' sizes with random weights, for measuring at real size offline (no
weights can be downloaded here): SDXL base 1.0 (a 2.6B UNet, CLIP-L, CLIP-G), Stable Diffusion 3.5 medium (a 2.5B
MMDiT, CLIP-L, CLIP-G, T5-XXL) and Flux.1-dev (a 12B transformer, CLIP-L, T5-XXL), in diffusers' folder format,
weight files as sharded safetensors with their index, in the released folders' dtype (`from_pretrained` and our
streaming loaders read them).

A model is built with its parameters on the meta device (its buffers real) and written module by module: each
module's parameters get memory, their initial values (the module's own `reset_parameters`, norms at one and zero, other
tensors N(0, 0.02)) and the folder's dtype, go into the current shard, and leave memory again. Flux's transformer (24
GB in bf16) is never whole in memory. Values depend on the seed only. The tokenizers are the offline ones of the tiny
folders (`diffusion.tiny`, `diffusion.flow_tiny`): their ids index the released vocabularies' first rows.

    python -m lowmem.diffusion.released flux.1-dev FOLDER      # or sd3.5-medium, sdxl-base-1.0
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["RELEASED", "write_released_pipeline"]

_CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
               max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
_CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_attention_heads=20,
               num_hidden_layers=32, max_position_embeddings=77, hidden_act="gelu", projection_dim=1280)
_T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
               layer_norm_epsilon=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
               decoder_start_token_id=0)
_VAE = dict(in_channels=3, out_channels=3, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, latent_channels=16,
            norm_num_groups=32, sample_size=1024, use_quant_conv=False, use_post_quant_conv=False, force_upcast=True)

RELEASED: dict[str, dict[str, Any]] = {
    "sdxl-base-1.0": {
        "unet": dict(sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
                     block_out_channels=(320, 640, 1280),
                     down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                     up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
                     attention_head_dim=(5, 10, 20), transformer_layers_per_block=(1, 2, 10), cross_attention_dim=2048,
                     use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
                     projection_class_embeddings_input_dim=2816),
        "vae": dict(_VAE, latent_channels=4, use_quant_conv=True, use_post_quant_conv=True, scaling_factor=0.13025),
        "text_encoder": _CLIP_L, "text_encoder_2": _CLIP_G,
        "scheduler": dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                          steps_offset=1, timestep_spacing="leading"),
        "dtype": "float32",
    },
    "sd3.5-medium": {
        "transformer": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                            dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
        "vae": dict(_VAE, scaling_factor=1.5305, shift_factor=0.0609),
        "text_encoder": _CLIP_L, "text_encoder_2": _CLIP_G, "text_encoder_3": _T5_XXL,
        "scheduler": dict(num_train_timesteps=1000, shift=3.0),
        "dtype": "bfloat16",
    },
    "flux.1-dev": {
        "transformer": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                            guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        "vae": dict(_VAE, scaling_factor=0.3611, shift_factor=0.1159),
        "text_encoder": _CLIP_L, "text_encoder_2": _T5_XXL,
        "scheduler": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                          max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096),
        "dtype": "bfloat16",
    },
}
"""The released configs (the denoiser, `vae`, text encoders, `scheduler`: what the folders' config files say) and the
dtype of their weight files."""


def _init_(name: str, t: torch.Tensor) -> None:
    """A value for a parameter of a module without its own `reset_parameters`."""
    if t.ndim == 1 and name == "weight":
        t.fill_(1.0)  # a norm's scale
    elif t.ndim == 1 and name == "bias":
        t.zero_()
    else:
        t.normal_(0.0, 0.02)


class _ShardWriter:
    """Safetensors shards of at most `shard_bytes` named as `save_pretrained` names them, and their index."""

    def __init__(self, folder: Path, stem: str, shard_bytes: int) -> None:
        self.folder, self.stem, self.shard_bytes = folder, stem, shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.size = self.total = 0
        self.parts: list[list[str]] = []

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.current and self.size + nbytes > self.shard_bytes:
            self._flush()
        self.current[name] = t.contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.current, str(self.folder / f".part-{len(self.parts)}"), metadata={"format": "pt"})
        self.parts.append(list(self.current))
        self.current, self.size = {}, 0

    def close(self) -> None:
        if self.current:
            self._flush()
        n = len(self.parts)
        weight_map = {}
        for i, keys in enumerate(self.parts):
            name = f"{self.stem}.safetensors" if n == 1 else f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / f".part-{i}", self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            (self.folder / f"{self.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_model(model: torch.nn.Module, folder: Path, stem: str, dtype: torch.dtype, shard_bytes: int) -> None:
    """`model`'s weights (parameters on the meta device, buffers real) module by module into `folder`."""
    writer = _ShardWriter(folder, stem, shard_bytes)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())  # T5's embed_tokens: saved as `shared` only
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        own = {n: p for n, p in module.named_parameters(recurse=False) if f"{prefix}.{n}".lstrip(".") not in tied}
        new = {n: p for n, p in own.items() if id(p) not in seen}  # a weight shared by modules is written once
        seen.update(id(p) for p in own.values())
        if new:
            module.to_empty(device="cpu", recurse=False)
            own_init = not any(True for _ in module.children()) and hasattr(module, "reset_parameters")
            with torch.no_grad():
                if own_init:
                    module.reset_parameters()
                for n, p in module.named_parameters(recurse=False):
                    if n in new:
                        if not own_init:
                            _init_(n, p.data)
                        writer.add(f"{prefix}.{n}" if prefix else n, p.data.to(dtype))
            module.to_empty(device="meta", recurse=False)
        for n, b in module.named_buffers(recurse=False):
            if n not in module._non_persistent_buffers_set:
                writer.add(f"{prefix}.{n}" if prefix else n, b.to(dtype) if b.is_floating_point() else b)
    writer.close()


def _models(name: str, configs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The pipeline class and its components, models with their parameters on the meta device."""
    from accelerate import init_empty_weights
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from .flow_tiny import t5_tokenizer
    from .tiny import BOS, EOS, build_tokenizer

    clip_tok, t5_tok = build_tokenizer(77), t5_tokenizer()
    ids = dict(bos_token_id=clip_tok.convert_tokens_to_ids(BOS), eos_token_id=clip_tok.convert_tokens_to_ids(EOS),
               pad_token_id=clip_tok.convert_tokens_to_ids(EOS))
    sd3 = name.startswith("sd3")
    if name.startswith("sdxl"):
        from diffusers import EulerDiscreteScheduler, UNet2DConditionModel

        from .sdxl import make_sdxl_pipeline

        with init_empty_weights(include_buffers=False):
            parts = {"unet": UNet2DConditionModel(**configs["unet"]), "vae": AutoencoderKL(**configs["vae"]),
                     "text_encoder": CLIPTextModel(CLIPTextConfig(**configs["text_encoder"], **ids)),
                     "text_encoder_2": CLIPTextModelWithProjection(CLIPTextConfig(**configs["text_encoder_2"], **ids))}
        parts.update(scheduler=EulerDiscreteScheduler(**configs["scheduler"]), tokenizer=clip_tok, tokenizer_2=clip_tok)
        return lambda **kw: make_sdxl_pipeline(kw), parts
    with init_empty_weights(include_buffers=False):
        parts = {"transformer": (SD3Transformer2DModel if sd3 else FluxTransformer2DModel)(**configs["transformer"]),
                 "vae": AutoencoderKL(**configs["vae"]),
                 "text_encoder": (CLIPTextModelWithProjection if sd3 else CLIPTextModel)(
                     CLIPTextConfig(**configs["text_encoder"], **ids))}
        t5_slot = "text_encoder_3" if sd3 else "text_encoder_2"
        parts[t5_slot] = T5EncoderModel(T5Config(**configs[t5_slot]))
        if sd3:
            parts["text_encoder_2"] = CLIPTextModelWithProjection(CLIPTextConfig(**configs["text_encoder_2"], **ids))
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler(**configs["scheduler"])
    if sd3:
        parts.update(tokenizer=clip_tok, tokenizer_2=clip_tok, tokenizer_3=t5_tok)
        return StableDiffusion3Pipeline, parts
    parts.update(tokenizer=clip_tok, tokenizer_2=t5_tok)
    return FluxPipeline, parts


def write_released_pipeline(folder: str | Path, name: str, *, seed: int = 0, shard_bytes: int = 2 << 30,
                            configs: dict[str, Any] | None = None) -> Path:
    """Write the pipeline `name` (a key of `RELEASED`; `configs` replaces its configs, e.g. scaled down for a test)
    with random weights of `seed` in the released dtype to `folder`; `folder/.complete` is written last and a folder
    that has it is kept as it is (a half-written one is written again)."""
    from .tiny import build_tokenizer

    if name not in RELEASED:
        raise ValueError(f"unknown pipeline {name!r}: one of {', '.join(RELEASED)}")
    folder = Path(folder)
    if (folder / ".complete").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    configs = configs or RELEASED[name]
    dtype = getattr(torch, configs["dtype"])
    cls, parts = _models(name, configs)
    pipe = cls(**parts)
    pipe.save_config(folder)  # model_index.json
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for slot, part in parts.items():
            sub = folder / slot
            if not isinstance(part, torch.nn.Module):
                part.save_pretrained(sub)  # tokenizers, the scheduler
                continue
            sub.mkdir()
            diffusers_model = hasattr(part, "save_config")
            if not diffusers_model:
                part.config.architectures = [type(part).__name__]  # as save_pretrained writes it (scripts read it)
            part.save_config(sub) if diffusers_model else part.config.save_pretrained(sub)
            _write_model(part, sub, "diffusion_pytorch_model" if diffusers_model else "model", dtype, shard_bytes)
    for slot in ("tokenizer",) if name.startswith("flux") else ("tokenizer", "tokenizer_2"):
        build_tokenizer(77, folder / slot)  # the CLIP tokenizers' two files, which transformers 4 reads too
    (folder / ".complete").touch()
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in RELEASED:
        sys.exit(f"usage: python -m lowmem.diffusion.released {'|'.join(RELEASED)} FOLDER")
    print(write_released_pipeline(sys.argv[2], sys.argv[1]))
