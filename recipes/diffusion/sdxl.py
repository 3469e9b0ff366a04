"""The SDXL fine-tuning recipe: `StableDiffusionXLFineTune` (the SD recipe's LightningModule with SDXL's second
text encoder, micro-conditioning and pipeline), `SDXLData` (its data, from `sdxl_data`: both tokenizers' ids,
original sizes and crop corners), and `fit_sdxl` (one run, as `suite diffusion train_*_sdxl` runs it);
`sdxl_precompute` computes the embeddings and latents of `--precompute` for it.

Everything else is the SD recipe's, unchanged: checks, Trainer, strategies (Gemini shards, NVMe tier, a UNet
streamed into them), checkpoints and exact resume, validation images, export. The run's `SDXLSettings` travel in
`FineTuneConfig.extra["sdxl"]`.
"""

from __future__ import annotations

import functools
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from ...diffusion.config import FineTuneConfig
from ...diffusion.sdxl import encode_prompt_sdxl, time_ids
from ...diffusion.training import diffusion_loss, encode_latents
from .launch import fit_finetune
from .module import StableDiffusionFineTune, step_rng, stream_unet
from .sdxl_data import SDXLCaptionedImages, SDXLData, sdxl_settings
from .sdxl_precompute import frozen_component, precompute, release_stores

__all__ = ["SDXLCaptionedImages", "SDXLData", "StableDiffusionXLFineTune", "fit_sdxl", "sdxl_settings"]

logger = logging.getLogger(__name__)


# -- the LightningModule ----------------------------------------------------------------------------------------
def _load_sdxl(cfg: FineTuneConfig) -> dict[str, Any]:
    """The SDXL components, loaded as the scripts load them: the frozen text encoders in the training dtype, the
    VAE in fp32 unless the script casts it (a separate VAE in the text_to_image scripts), the UNet hollow for
    Gemini's shards when Gemini trains all of it."""
    from ...diffusion.sdxl import load_sdxl_components

    s = sdxl_settings(cfg)
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(cfg.mixed_precision)
    return load_sdxl_components(cfg.pretrained_model_name_or_path, vae=s.pretrained_vae_model_name_or_path,
                                revision=cfg.revision, variant=cfg.variant, cache_dir=cfg.cache_dir,
                                vae_dtype=half if s.vae_in_training_dtype else None, text_encoder_dtype=half,
                                stream_unet=stream_unet(cfg))


class StableDiffusionXLFineTune(StableDiffusionFineTune):
    """Fine-tunes an SDXL UNet (whole, or LoRA adapters; with `train_text_encoder`, LoRA on both text encoders)."""

    family = "sdxl"

    def __init__(self, config: FineTuneConfig, components: dict[str, Any] | None = None) -> None:
        comps = dict(components or _load_sdxl(config))
        second = comps.pop("text_encoder_2"), comps.pop("tokenizer_2")
        self_vae_source = comps.pop("vae_source", None)
        super().__init__(config, comps)
        self.text_encoder_2, self.tokenizer_2 = second
        self.vae_source: Path | None = self_vae_source
        self._freeze_second_encoder()
        self.set_modes()
        self.text_embeddings: Any = None
        """`diffusion.precompute.TextEmbeddings` of every prompt (`--precompute text|both`), else None."""
        self.latent_stores: Any = None
        """(records', class records') `FeatureStore` of latents (`--precompute latents|both`), else None."""
        self.precompute_dir: Path | None = None

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit" and self.text_embeddings is None and self.latent_stores is None:
            precompute(self, self.trainer.datamodule)

    def teardown(self, stage: str) -> None:
        release_stores(self)

    def _freeze_and_cast(self) -> None:
        super()._freeze_and_cast()
        if not sdxl_settings(self.config).vae_in_training_dtype:
            self.vae.to(torch.float32)  # SDXL's VAE overflows in fp16: the scripts keep it in fp32

    def _freeze_second_encoder(self) -> None:
        from ...diffusion.lora import add_lora

        cfg, te = self.config, self.text_encoder_2
        te.requires_grad_(False).to(self.weight_dtype)
        if cfg.lora and cfg.train_text_encoder:
            add_lora(te, cfg.rank, text_encoder=True, dropout=self.lora_dropout())
            if cfg.gradient_checkpointing:
                (getattr(te, "activation_checkpointing_enable", None) or te.gradient_checkpointing_enable)()

    def set_modes(self) -> None:
        """As the SD recipe's, for the models still held (`--precompute` drops the frozen encoders / the VAE)."""
        self.unet.train()
        for name in ("vae", "text_encoder", "text_encoder_2"):
            part = getattr(self, name, None)  # the base class sets the modes before the second encoder is there
            if part is not None:
                part.train(name != "vae" and self.config.train_text_encoder)

    def _both(self, batch: dict[str, torch.Tensor], key: str) -> torch.Tensor:
        """`batch[key]`, the class images' appended under prior preservation."""
        if self.loss_cfg.with_prior_preservation:
            return torch.cat([batch[key], batch[f"class_{key}"]])
        return batch[key]

    def lora_dropout(self) -> float:
        """train_dreambooth_lora_sdxl.py's --lora_dropout (peft's, on the UNet's and the text encoders' adapters)."""
        return sdxl_settings(self.config).lora_dropout

    def compute_loss(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The loss of one micro-batch: the SD recipe's, the UNet conditioned as SDXL is (`encode_prompt_sdxl`,
        `time_ids`); with LoRA dropout its masks drawn from the step alone (`module.step_rng`: exact resume)."""
        if not self.lora_dropout():
            return self._loss(batch, batch_idx)
        with step_rng(self, batch_idx):
            return self._loss(batch, batch_idx)

    def _loss(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = [self._both(batch, "input_ids"), self._both(batch, "input_ids_2")]
        if "latents" in batch:  # pre-computed
            latents = self._both(batch, "latents").float()
            noise = self.step_noise(latents, batch_idx, latents=True)
        else:
            pixels = self._both(batch, "pixel_values")
            noise = self.step_noise(pixels, batch_idx)
            with torch.no_grad():
                latents = encode_latents(self.vae, pixels, noise.latent_eps).float()
        if self.text_embeddings is not None:
            got = self.text_embeddings.lookup([i.cpu() for i in ids])
            hidden, pooled = got["hidden"].to(latents.device), got["pooled"].to(latents.device)
        else:
            hidden, pooled = encode_prompt_sdxl([self.text_encoder, self.text_encoder_2], ids)
        cond = {"text_embeds": pooled, "time_ids": time_ids(self._both(batch, "original_size"),
                                                            self._both(batch, "crop_top_left"),
                                                            self.config.resolution).to(pooled.device)}
        unet = functools.partial(_conditioned, self.unet, cond)
        return diffusion_loss(unet, self.noise_scheduler, latents, hidden, noise.noise, noise.timesteps,
                              self.loss_cfg, noise.perturbation)

    def configure_optimizers(self) -> Any:
        """AdamW as the SD recipe's; under DreamBooth LoRA's `--text_encoder_lr` / `--adam_weight_decay_text_encoder`
        three groups as train_dreambooth_lora_sdxl.py has them (the UNet's, the first text encoder's, the second's:
        its accelerate checkpoints' optimizer and scheduler states load as they are), the encoders' with their own
        learning rate (the possibly scaled `--learning_rate` when not given) and weight decay."""
        s, o = sdxl_settings(self.config), self.config.optimizer
        if s.text_encoder_lr is None and s.adam_weight_decay_text_encoder is None:
            return super().configure_optimizers()
        from diffusers.optimization import get_scheduler

        lr = o.learning_rate
        if o.scale_lr:
            train = self.config.train
            lr *= train.gradient_accumulation_steps * train.train_batch_size * self.trainer.world_size
        decay = o.adam_weight_decay if s.adam_weight_decay_text_encoder is None else s.adam_weight_decay_text_encoder
        encoders = [m for m in (self.text_encoder, self.text_encoder_2) if m is not None]
        in_encoders = {id(p) for m in encoders for p in m.parameters()}
        groups = [{"params": [p for p in self.parameters() if p.requires_grad and id(p) not in in_encoders]},
                  *({"params": [p for p in m.parameters() if p.requires_grad], "lr": s.text_encoder_lr or lr,
                     "weight_decay": decay} for m in encoders)]
        opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(o.adam_beta1, o.adam_beta2),
                                weight_decay=o.adam_weight_decay, eps=o.adam_epsilon)
        sched = get_scheduler(o.lr_scheduler, optimizer=opt, num_warmup_steps=o.lr_warmup_steps,
                              num_training_steps=max(1, self.length.max_train_steps if self.length
                                                     else self.trainer.max_steps), num_cycles=o.lr_num_cycles,
                              power=o.lr_power)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- inference and export (called by the SD recipe's callbacks and export) --------------------------------
    def pipeline(self, use_ema: bool = False) -> Any:
        """A `StableDiffusionXLPipeline` over the current modules (EMA weights in a UNet copy with `use_ema`)."""
        import copy

        from ...diffusion.sdxl import make_sdxl_pipeline
        from ...diffusion.streaming import gemini_of

        if gemini_of(self.unet) is None:
            self.fill_hollow()
        unet = self.unet
        if use_ema and self.ema is not None:
            unet = copy.deepcopy(self.unet)
            self.ema.copy_to(unet.parameters())
        comps = {"unet": unet, **{name: frozen_component(self, name) for name in ("vae", "text_encoder",
                                                                                   "text_encoder_2")},
                 "tokenizer": self.tokenizer, "tokenizer_2": self.tokenizer_2}
        return make_sdxl_pipeline(comps, scheduler=self.validation_scheduler())

    def lora_layers(self, parts: dict[str, Any]) -> dict[str, Any]:
        """The diffusers-format LoRA layers of the UNet (and both text encoders with `train_text_encoder`), from
        the modules or the trained values `export.trained_state` gathered (`parts["state"]`)."""
        from ...diffusion.lora import lora_state_dicts

        state = parts.get("state")

        def sub(prefix: str) -> dict[str, torch.Tensor] | None:
            return None if state is None else {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}

        te = self.config.train_text_encoder
        out = lora_state_dicts(self.unet, self.text_encoder if te else None, sub("unet."), sub("text_encoder."))
        out["text_encoder_2_lora_layers"] = (lora_state_dicts(self.text_encoder_2, None, sub("text_encoder_2."))
                                             ["unet_lora_layers"] if te else None)
        return out

    def extra_exports(self, stage: Path | None) -> dict[str, Path]:
        """Components exported beside the trained ones: the separate VAE's folder, copied into `stage` (the
        scripts save the pipeline with the VAE they trained with)."""
        if self.vae_source is None or stage is None:
            return {}
        shutil.copytree(self.vae_source, stage / "vae", ignore=shutil.ignore_patterns(".*"))
        return {"vae": stage / "vae"}


def _conditioned(unet: Any, cond: dict[str, torch.Tensor], sample: torch.Tensor, timesteps: torch.Tensor,
                 hidden: torch.Tensor, return_dict: bool = False) -> Any:
    """The UNet called as `diffusion_loss` calls it, with SDXL's added conditions."""
    return unet(sample, timesteps, hidden, added_cond_kwargs=cond, return_dict=return_dict)


def fit_sdxl(cfg: FineTuneConfig, callbacks: list[Any] | None = None, **trainer_overrides: Any) -> Any:
    """Run one SDXL fine-tuning as `suite diffusion train_*_sdxl` does; returns the finished module."""
    return fit_finetune(cfg, callbacks, module_cls=StableDiffusionXLFineTune, data_cls=SDXLData, **trainer_overrides)
