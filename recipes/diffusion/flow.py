"""The SD3 and Flux DreamBooth recipe: `SD3FineTune` / `FluxFineTune` (the SD recipe's LightningModule with a
flow-matching transformer in place of the UNet, `diffusion.flow`'s loss) and `fit_flow` (one run, as `suite
diffusion train_dreambooth_{,lora_}{sd3,flux}` runs it). The data and what is computed once are `flow_data`'s.

Everything else is the SD recipe's, unchanged: checks, Trainer, strategies (ZeRO, Gemini with its NVMe tier),
checkpoints and exact resume, validation images, export. The transformer is held under the recipe's name for the
trained model, `unet` (checkpoints, strategies and export address it so); it is written as `transformer/`. The
run's `FlowSettings` travel in `FineTuneConfig.extra["flow"]`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from ...diffusion.config import FineTuneConfig
from ...diffusion.flow import (
    encode_prompt_flux,
    encode_prompt_sd3,
    flow_latents,
    flow_loss,
    flux_forward,
    noisy_input,
    schedule_points,
    sd3_forward,
    timestep_density,
)
from ...diffusion.flow_models import ENCODERS, t5_name, trained_text_encoders
from ...diffusion.training import step_generator
from .flow_data import FlowData, flow_settings, frozen_component, id_keys, precompute, release_stores
from .launch import fit_finetune
from .module import StableDiffusionFineTune, step_rng, stream_unet

__all__ = ["FluxFineTune", "SD3FineTune", "fit_flow"]

logger = logging.getLogger(__name__)


class _FlowFineTune(StableDiffusionFineTune):
    """Fine-tunes a flow-matching transformer (whole, or LoRA adapters); the text encoders are frozen, their
    outputs computed once (`flow_data.precompute`), unless --train_text_encoder trains some (`trained_encoders`):
    then every step encodes its prompts."""

    denoiser_folder = "transformer"
    """The subfolder the trained model is written to (export, checkpoints)."""

    def __init__(self, config: FineTuneConfig, components: dict[str, Any] | None = None) -> None:
        pl.LightningModule.__init__(self)
        from ...diffusion.flow_models import load_flow_components

        self.config = cfg = config
        half = None if self.weight_dtype == torch.float32 or self.full_text_encoders() else self.weight_dtype
        # T5 (SD3's and Flux's 4.7B T5-XXL) is not loaded here unless it runs in every step (--train_text_encoder):
        # it encodes the prompts once, streamed block by block (`frozen_component`, `diffusion.flow_stream`)
        skip = () if self.trained_encoders() else (t5_name(self.family),)
        comps = dict(components or load_flow_components(cfg.pretrained_model_name_or_path, self.family,
                                                        revision=cfg.revision, variant=cfg.variant,
                                                        cache_dir=cfg.cache_dir, text_encoder_dtype=half, skip=skip,
                                                        stream_transformer=stream_unet(cfg)))
        self.unet, self.vae, self.noise_scheduler = comps["transformer"], comps["vae"], comps["scheduler"]
        for enc, _, tok in ENCODERS[self.family]:
            setattr(self, enc, comps[enc])
            object.__setattr__(self, tok, comps[tok])  # tokenizers are not modules
        self.inference_scheduler = comps.get("inference_scheduler", self.noise_scheduler)
        self.base_source: Path | None = comps.get("source")
        self.base_extras: dict[str, Any] = {}
        self.loss_cfg = cfg.loss
        self.ema = None
        self.strict_loading = False
        self.save_frozen_parameters = False
        self._t_last = None
        self.length: Any = None
        self.text_embeddings: Any = None
        self.latent_stores: Any = None
        self.precompute_dir: Path | None = None
        self._freeze_and_cast()
        self.set_modes()

    # -- what differs between SD3 and Flux -------------------------------------------------------------------
    def encoder_names(self) -> list[str]:
        return [enc for enc, _, _ in ENCODERS[self.family]]

    def trained_encoders(self) -> list[str]:
        """The text encoders trained with --train_text_encoder: the LoRA scripts' adapters on the CLIP encoders;
        the full scripts' whole encoders, SD3's three (T5 too: train_dreambooth_sd3.py sets all three
        `requires_grad_(True)` and gives each a parameter group), Flux's CLIP (its T5 stays frozen)."""
        if not self.config.train_text_encoder:
            return []
        return trained_text_encoders(self.family, self.config.lora)

    def full_text_encoders(self) -> list[str]:
        """The text encoders trained whole (the full scripts' --train_text_encoder), in the scripts' order."""
        return [] if self.config.lora else self.trained_encoders()

    def trained_text_encoders(self) -> list[str]:
        """The components `export` writes beside the transformer of a full fine-tune."""
        return self.full_text_encoders()

    def tokenizers(self) -> list[tuple[Any, int]]:
        """(tokenizer, token length) of every text encoder: CLIP's 77, T5's --max_sequence_length."""
        n = flow_settings(self.config).max_sequence_length
        return [(getattr(self, tok), n if cls.startswith("T5") else 77) for _, cls, tok in ENCODERS[self.family]]

    def encode_prompt_ids(self, encoders: list[Any], ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    # -- set-up --------------------------------------------------------------------------------------------
    def _freeze_and_cast(self) -> None:
        cfg, s = self.config, flow_settings(self.config)
        self.vae.requires_grad_(False).to(torch.float32)  # the scripts keep the VAE in fp32
        for name in self.encoder_names():
            if getattr(self, name) is not None and name not in self.full_text_encoders():
                getattr(self, name).requires_grad_(False).to(self.weight_dtype)
        for name in self.full_text_encoders():  # trained whole in fp32, as the scripts leave them
            self._checkpointing(getattr(self, name).requires_grad_(True).to(torch.float32))
        if cfg.lora:
            from peft import LoraConfig

            from ...core_parallel.gemini.lazy import cast_parameters

            self.unet.requires_grad_(False)
            cast_parameters(self.unet, self.weight_dtype)  # a hollow transformer's frozen base too, read nothing yet
            self.unet.add_adapter(LoraConfig(r=cfg.rank, lora_alpha=s.lora_alpha or cfg.rank,
                                             lora_dropout=s.lora_dropout, init_lora_weights="gaussian",
                                             target_modules=s.lora_targets()))
            for p in self.unet.parameters():
                if p.requires_grad:
                    p.data = p.data.float()  # the scripts' cast_training_params: LoRA trains in fp32
            for name in self.trained_encoders():
                self._text_lora(getattr(self, name))
        else:
            self.unet.requires_grad_(True)
        if cfg.gradient_checkpointing:
            self.unet.enable_gradient_checkpointing()

    def _text_lora(self, encoder: Any) -> None:
        """The scripts' text-encoder LoRA: rank r, alpha (Flux's --lora_alpha, else r), gaussian, on the attention
        projections; trained in fp32."""
        from peft import LoraConfig, inject_adapter_in_model

        from ...diffusion.lora import TEXT_TARGETS

        rank, s = self.config.rank, flow_settings(self.config)
        config = LoraConfig(r=rank, lora_alpha=s.lora_alpha or rank, lora_dropout=s.lora_dropout,
                            init_lora_weights="gaussian", target_modules=TEXT_TARGETS)
        inject_adapter_in_model(config, encoder)
        self.text_lora_config = config
        for p in encoder.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        self._checkpointing(encoder)

    def _checkpointing(self, encoder: Any) -> None:
        """A trained text encoder's gradient checkpointing (--gradient_checkpointing)."""
        if self.config.gradient_checkpointing:
            (getattr(encoder, "activation_checkpointing_enable", None) or encoder.gradient_checkpointing_enable)()

    def set_modes(self) -> None:
        self.unet.train()
        for name in ("vae", *self.encoder_names()):
            part = getattr(self, name, None)
            if part is not None:
                part.train(name in self.trained_encoders())

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit" and self.text_embeddings is None:
            precompute(self, self.trainer.datamodule)

    def teardown(self, stage: str) -> None:
        release_stores(self)

    # -- training -------------------------------------------------------------------------------------------
    def _both(self, batch: dict[str, torch.Tensor], key: str) -> torch.Tensor:
        if self.loss_cfg.with_prior_preservation:
            return torch.cat([batch[key], batch[f"class_{key}"]])
        return batch[key]

    def _draws(self, shape: tuple[int, ...], batch_idx: int) -> dict[str, torch.Tensor]:
        """The step's VAE sample noise, flow noise and density draws of this rank's slice of the global batch
        (independent of the world size), from a generator of (seed, step, micro-batch) only."""
        s = flow_settings(self.config)
        parts = 2 if self.loss_cfg.with_prior_preservation else 1
        b, world, rank = shape[0] // parts, self.trainer.world_size, self.global_rank
        g = step_generator(self.config.seed, self.global_step, batch_idx % self.trainer.accumulate_grad_batches)
        n = parts * b * world
        full = {"latent_eps": torch.randn((n, *shape[1:]), generator=g),
                "noise": torch.randn((n, *shape[1:]), generator=g),
                "u": timestep_density(s.weighting_scheme, n, g, logit_mean=s.logit_mean, logit_std=s.logit_std,
                                      mode_scale=s.mode_scale)}

        def mine(t: torch.Tensor) -> torch.Tensor:
            t = t.view(parts, b * world, *t.shape[1:])[:, rank * b:(rank + 1) * b]
            return t.reshape(parts * b, *t.shape[2:]).to(self.device)

        return {k: mine(v) for k, v in full.items()}

    def _latents(self, batch: dict[str, torch.Tensor], batch_idx: int) -> tuple[torch.Tensor, dict[str, Any]]:
        if "latent_mean" in batch:  # pre-computed posteriors (--cache_latents)
            mean, std = self._both(batch, "latent_mean").float(), self._both(batch, "latent_std").float()
            draws = self._draws(tuple(mean.shape), batch_idx)
            shift, scale = self.config_vae()
            return (mean + std * draws["latent_eps"] - shift) * scale, draws
        pixels = self._both(batch, "pixel_values")
        factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        b, _, h, w = pixels.shape
        draws = self._draws((b, self.vae.config.latent_channels, h // factor, w // factor), batch_idx)
        with torch.no_grad():
            return flow_latents(self.vae, pixels, draws["latent_eps"]).float(), draws

    def config_vae(self) -> tuple[float, float]:
        """(shift_factor, scaling_factor) of the VAE (read from the folder when it was dropped)."""
        import json

        config = (self.vae.config if self.vae is not None else
                  json.loads((Path(self.base_source) / "vae" / "config.json").read_text()))
        return float(config.get("shift_factor") or 0.0), float(config["scaling_factor"])

    def compute_loss(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The loss of one micro-batch (`diffusion.flow`), as the SD3 / Flux scripts compute it. Dropout in the
        forward (--lora_dropout; a text encoder trained in train mode, SD3's T5 with its dropout_rate) draws from
        torch's generator seeded by (seed, step, micro-batch, rank) only, so a resumed run draws the same masks."""
        with step_rng(self, batch_idx):
            return self._loss(batch, batch_idx)

    def _loss(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        s = flow_settings(self.config)
        latents, draws = self._latents(batch, batch_idx)
        ids = [self._both(batch, k).cpu() for k in id_keys(len(self.encoder_names()))]
        if self.text_embeddings is not None:
            cond = {k: v.to(self.device) for k, v in self.text_embeddings.lookup(ids).items()}
        else:  # --train_text_encoder: some encoders train (LoRA, or whole), every step encodes
            cond = self.encode_prompt_ids([getattr(self, n) for n in self.encoder_names()], ids)
        timesteps, sigmas = schedule_points(self.noise_scheduler, draws["u"].cpu())
        timesteps, sigmas = timesteps.to(self.device), sigmas.to(self.device)
        dtype = self.weight_dtype
        noisy = noisy_input(latents.to(dtype), draws["noise"].to(dtype), sigmas)
        cond = {k: v.to(dtype) for k, v in cond.items()}
        pred = self.predict(noisy, timesteps, cond)
        return flow_loss(pred, latents.to(dtype), draws["noise"].to(dtype), sigmas, weighting_scheme=s.weighting_scheme,
                         precondition_outputs=s.precondition_outputs,
                         prior_preservation=self.loss_cfg.with_prior_preservation,
                         prior_loss_weight=self.loss_cfg.prior_loss_weight)

    def configure_optimizers(self) -> Any:
        """AdamW as the SD recipe's; with --train_text_encoder the scripts' groups: the transformer's, then one per
        trained encoder with `--text_encoder_lr` (else the possibly scaled learning rate) and
        `--adam_weight_decay_text_encoder`."""
        if not self.trained_encoders():
            return super().configure_optimizers()
        from diffusers.optimization import get_scheduler

        s, o, train = flow_settings(self.config), self.config.optimizer, self.config.train
        lr = o.learning_rate
        if o.scale_lr:
            lr *= train.gradient_accumulation_steps * train.train_batch_size * self.trainer.world_size
        decay = o.adam_weight_decay if s.adam_weight_decay_text_encoder is None else s.adam_weight_decay_text_encoder
        groups = [{"params": [p for p in self.unet.parameters() if p.requires_grad]}]
        groups += [{"params": [p for p in getattr(self, n).parameters() if p.requires_grad],
                    "lr": s.text_encoder_lr or lr, "weight_decay": decay} for n in self.trained_encoders()]
        opt = torch.optim.AdamW(groups, lr=lr, betas=(o.adam_beta1, o.adam_beta2), weight_decay=o.adam_weight_decay,
                                eps=o.adam_epsilon)
        steps = max(1, self.length.max_train_steps if self.length else self.trainer.max_steps)
        sched = get_scheduler(o.lr_scheduler, optimizer=opt, num_warmup_steps=o.lr_warmup_steps,
                              num_training_steps=steps, num_cycles=o.lr_num_cycles, power=o.lr_power)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- inference and export ---------------------------------------------------------------------------------
    def pipeline(self, use_ema: bool = False) -> Any:
        """The family's pipeline over the current transformer (the dropped encoders / VAE loaded again)."""
        from ...diffusion.flow_models import make_flow_pipeline
        from ...diffusion.streaming import gemini_of

        if gemini_of(self.unet) is None:
            self.fill_hollow()  # used before training (class images): no Gemini fills it yet
        comps = {"transformer": self.unet, "scheduler": self.inference_scheduler,
                 **{name: frozen_component(self, name) for name in ("vae", *self.encoder_names())},
                 **{tok: getattr(self, tok) for _, _, tok in ENCODERS[self.family]}}
        return make_flow_pipeline(self.family, comps)

    def lora_layers(self, parts: dict[str, Any]) -> dict[str, Any]:
        """The transformer's LoRA layers (peft's names), from the module or the values `export.trained_state`
        gathered (`parts["state"]`)."""
        from peft.utils import get_peft_model_state_dict

        state = parts.get("state")

        def sub(prefix: str) -> dict[str, torch.Tensor] | None:
            return None if state is None else {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}

        out: dict[str, Any] = {"transformer_lora_layers": get_peft_model_state_dict(self.unet, sub("unet."))}
        for name in self.trained_encoders():
            out[f"{name}_lora_layers"] = get_peft_model_state_dict(getattr(self, name), sub(f"{name}."))
        if self.family == "flux":  # train_dreambooth_lora_flux.py writes the adapters' configs (rank, alpha) beside
            out["transformer_lora_adapter_metadata"] = self.unet.peft_config["default"].to_dict()
            if self.trained_encoders():
                out["text_encoder_lora_adapter_metadata"] = self.text_lora_config.to_dict()
        return out

    def lora_file_names(self) -> dict[str, str]:
        """The LoRA file's key of each trained parameter -> its name here (resuming the scripts' accelerate
        checkpoints): `save_lora_weights` of `get_peft_model_state_dict`, peft's names without the adapter's under
        `transformer.` / `text_encoder.` / `text_encoder_2.`, text encoders' in CLIP's `text_model.` layout."""
        from ...diffusion.lora import lora_file_key

        out = {}
        for part, attr in (("transformer", "unet"), *((n, n) for n in self.trained_encoders())):
            for name, p in getattr(self, attr).named_parameters():
                if p.requires_grad:
                    out[lora_file_key(f"{part}.{name.replace('.default.', '.')}")] = f"{attr}.{name}"
        return out

    def save_lora(self, folder: Path, layers: dict[str, Any]) -> Path:
        from ...diffusion.flow_models import save_flow_lora_weights

        return save_flow_lora_weights(folder, self.family, layers)


class SD3FineTune(_FlowFineTune):
    """Stable Diffusion 3 / 3.5: `SD3Transformer2DModel`, CLIP-L + CLIP-G + T5."""

    family = "sd3"

    def encode_prompt_ids(self, encoders: list[Any], ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return encode_prompt_sd3(encoders, ids)

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        return sd3_forward(self.unet, noisy, timesteps, cond)


class FluxFineTune(_FlowFineTune):
    """Flux.1: `FluxTransformer2DModel`, CLIP-L + T5, packed latents and the guidance embedding."""

    family = "flux"

    def encode_prompt_ids(self, encoders: list[Any], ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return encode_prompt_flux(encoders, ids)

    def predict(self, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        return flux_forward(self.unet, noisy, timesteps, cond, flow_settings(self.config).guidance_scale)


def fit_flow(cfg: FineTuneConfig, callbacks: list[Any] | None = None, **trainer_overrides: Any) -> Any:
    """Run one SD3 or Flux fine-tuning as `suite diffusion train_dreambooth_*_{sd3,flux}` does; returns the module."""
    module_cls = FluxFineTune if flow_settings(cfg).family == "flux" else SD3FineTune
    return fit_finetune(cfg, callbacks, module_cls=module_cls, data_cls=FlowData, **trainer_overrides)
