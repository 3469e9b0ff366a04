"""`StableDiffusionFineTune`: the LightningModule of the Stable Diffusion fine-tuning recipe (full, LoRA, DreamBooth).

It loads the pipeline's components, freezes and casts what is not trained, computes the loss of a micro-batch
(diffusers' training scripts' math, `diffusion.training`), builds AdamW and its schedule, and generates images from
the current weights (validation, class images). The rest of the recipe lives beside it: `datamodule` (the data),
`checkpoints` and `callbacks` (what runs during fit), `export` (the written result), `launch` (the run).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from ...diffusion.config import FineTuneConfig
from ...diffusion.training import EMA, diffusion_loss, draw_step_noise, encode_latents, latent_shape, step_generator
from ..strategies import GeminiStrategy

__all__ = ["EVAL_MODE_WARNING", "StableDiffusionFineTune", "restart_at_epoch", "step_rng", "stream_unet",
           "warn_trained_in_eval"]

logger = logging.getLogger(__name__)


class StableDiffusionFineTune(pl.LightningModule):
    """Fine-tunes a Stable Diffusion UNet (whole, or LoRA adapters), optionally the text encoder too.

    The VAE (and the text encoder unless trained) are frozen and, under mixed precision, held in the
    half dtype. `components` overrides loading from `config.pretrained_model_name_or_path`.
    """

    family = "sd"
    """The model family it trains (`diffusion.folders.model_family`): a base folder of another is refused."""

    def __init__(self, config: FineTuneConfig | None = None, components: dict[str, Any] | None = None) -> None:
        super().__init__()
        from ...diffusion.attention import set_kernels_attention
        from ...diffusion.models import load_components

        self.config = cfg = config or FineTuneConfig()
        uses_ema = cfg.use_ema and not cfg.lora
        comps = components or load_components(cfg.pretrained_model_name_or_path, tiny_resolution=cfg.resolution,
                                               revision=cfg.revision, variant=cfg.variant, cache_dir=cfg.cache_dir,
                                               tokenizer_name=cfg.tokenizer_name,
                                               non_ema_revision=cfg.non_ema_revision, ema_unet=uses_ema,
                                               **self._load_options())
        self.unet, self.vae, self.text_encoder = comps["unet"], comps["vae"], comps["text_encoder"]
        self.tokenizer, self.noise_scheduler = comps["tokenizer"], comps["scheduler"]
        # What the export keeps as the base ships it: the inference scheduler, the base folder (its untrained
        # components are copied), a single file's safety checker and feature extractor.
        self.inference_scheduler = comps.get("inference_scheduler", self.noise_scheduler)
        self.base_source: Path | None = comps.get("source")
        self.base_extras: dict[str, Any] = comps.get("extras") or {}
        self.loss_cfg = cfg.loss_config(self.noise_scheduler.config.prediction_type)
        if cfg.prediction_type:
            self.noise_scheduler.register_to_config(prediction_type=cfg.prediction_type)
        set_kernels_attention(self.unet, cfg.attention_backend)
        self._freeze_and_cast()
        # the EMA starts from the UNet at --revision, the trained UNet from --non_ema_revision (diffusers' script)
        ema_start = comps.get("ema_unet")
        self.ema = (EMA(self.unet.parameters(), cfg.ema.ema_decay, foreach=cfg.ema.foreach_ema,
                        offload=cfg.ema.offload_ema, start=None if ema_start is None else ema_start.parameters())
                    if uses_ema else None)
        del ema_start
        self.strict_loading = False
        self.save_frozen_parameters = False
        """The sharded strategies leave the frozen weights out of checkpoints (the base and encoders reload from
        --pretrained_model_name_or_path on resume, as on_save_checkpoint drops them under Lightning's own)."""
        self._t_last = None
        self.length: Any = None
        """The run's `diffusion.schedule.RunLength` (set by `fit_finetune`): the LR schedule's length and, on
        resume, the epoch the loops restart at; None under a plain Trainer (its max_steps, its loop state)."""
        self.set_modes()

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the frozen models."""
        return {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.config.mixed_precision]

    def _load_options(self) -> dict[str, Any]:
        """How the components load: the frozen ones directly in the training dtype, and the UNet streamed into
        Gemini's shards when Gemini trains all of it (no LoRA, no EMA, which need its values before setup)."""
        cfg, dtype = self.config, self.weight_dtype
        half = None if dtype == torch.float32 else dtype
        trains_text_encoder = cfg.train_text_encoder and not cfg.lora
        return {"vae_dtype": half, "text_encoder_dtype": None if trains_text_encoder else half,
                "stream_unet": stream_unet(cfg)}

    def setup(self, stage: str) -> None:
        self.set_modes()
        if not isinstance(self.trainer.strategy, GeminiStrategy):
            self.fill_hollow()
        elif type(self.unet).__name__ == "UNet2DConditionModel":
            # chunks packed in the order the UNet's modules run (its mid block is registered last); SD3's and Flux's
            # transformers register their blocks in the order they run
            from ...core_parallel.gemini import set_module_order
            from ...diffusion.memory import unet_module_order

            order = unet_module_order(self.unet)
            if order is not None:
                set_module_order(self.unet, order)

    def fill_hollow(self) -> None:
        """Give a streamed UNet's parameters their values in ordinary memory (no Gemini setup follows)."""
        from ...core_parallel.gemini.lazy import fill_hollow

        if fill_hollow(self.unet):
            logger.info("the UNet was built for streaming into Gemini; loaded whole instead (strategy %s)",
                        type(self.trainer.strategy).__name__ if self._trainer is not None else None)

    def _freeze_and_cast(self) -> None:
        from ...diffusion.lora import add_lora

        cfg = self.config
        self.vae.requires_grad_(False).to(self.weight_dtype)
        self.text_encoder.requires_grad_(cfg.train_text_encoder and not cfg.lora)
        if not cfg.train_text_encoder:
            self.text_encoder.to(self.weight_dtype)
        if cfg.lora:
            from ...core_parallel.gemini.lazy import cast_parameters

            cast_parameters(self.unet, self.weight_dtype)  # a streamed UNet's frozen base too, read nothing yet
            add_lora(self.unet, cfg.rank, dropout=self.lora_dropout())
            if cfg.train_text_encoder:
                self.text_encoder.to(self.weight_dtype)
                add_lora(self.text_encoder, cfg.rank, text_encoder=True, dropout=self.lora_dropout())
        if cfg.gradient_checkpointing:
            from ...diffusion.memory import enable_checkpointing

            # CLIP (transformers) recomputes only when the module is in train mode: see on_train_start.
            # recompute every block but not the attention (same gradients, no second attention pass)
            enable_checkpointing(self.unet, "keep_attention")
            if cfg.train_text_encoder:
                te = self.text_encoder
                # transformers 5 renamed it (the old name warns)
                (getattr(te, "activation_checkpointing_enable", None) or te.gradient_checkpointing_enable)()

    def lora_dropout(self) -> float:
        """peft's `lora_dropout` of the adapters (the SD 1.x scripts have no --lora_dropout: 0)."""
        return 0.0

    def set_modes(self) -> None:
        """Trained models in train mode, frozen ones in eval mode, as diffusers' scripts set them (`unet.train()`,
        the text encoder's `train()` only when it is trained; the rest as `from_pretrained` leaves it, eval).

        Set at construction and again in `setup` and `on_train_start` (a pipeline built for class images or
        validation restores the modes it found); transformers' CLIP runs its gradient checkpointing only in train
        mode.
        """
        cfg = self.config
        self.unet.train()
        self.vae.eval()
        self.text_encoder.train(cfg.train_text_encoder)

    def on_train_start(self) -> None:
        self.set_modes()
        warn_trained_in_eval(self)

    def trainable_names(self) -> set[str]:
        """State-dict names of the trained parameters (what a checkpoint keeps)."""
        return {n for n, p in self.named_parameters() if p.requires_grad}

    # -- training -------------------------------------------------------------------------------------------
    def _batch_tensors(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                                         torch.Tensor | None]:
        """Pixels, token ids and (with text_encoder_use_attention_mask) the attention mask of a batch, the class
        images appended under prior preservation."""
        pixels, ids, mask = batch["pixel_values"], batch["input_ids"], batch.get("attention_mask")
        if self.loss_cfg.with_prior_preservation:
            pixels = torch.cat([pixels, batch["class_pixel_values"]])
            ids = torch.cat([ids, batch["class_input_ids"]])
            if mask is not None:
                mask = torch.cat([mask, batch["class_attention_mask"]])
        return pixels, ids, mask

    def encode_prompt(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The text encoder's hidden states of token ids; the attention mask is passed only with
        text_encoder_use_attention_mask (diffusers' DreamBooth `encode_prompt`)."""
        if self.config.text_encoder_use_attention_mask and mask is not None:
            return self.text_encoder(ids, attention_mask=mask.to(ids.device), return_dict=False)[0]
        return self.text_encoder(ids, return_dict=False)[0]

    def step_noise(self, pixels: torch.Tensor, batch_idx: int, latents: bool = False) -> Any:
        """The noise of this rank's slice of the global micro-batch (independent of the world size); `pixels` are
        the batch's latents themselves with `latents` (pre-computed)."""
        parts = 2 if self.loss_cfg.with_prior_preservation else 1
        b, world, rank = pixels.shape[0] // parts, self.trainer.world_size, self.global_rank
        shape = tuple(pixels.shape) if latents else latent_shape(self.vae, pixels)
        g = step_generator(self.config.seed, self.global_step, batch_idx % self.trainer.accumulate_grad_batches)
        full = draw_step_noise((parts * b * world, *shape[1:]), self.noise_scheduler.config.num_train_timesteps,
                               g, self.loss_cfg.noise_offset, self.loss_cfg.input_perturbation)

        def mine(t: torch.Tensor) -> torch.Tensor:
            t = t.view(parts, b * world, *t.shape[1:])[:, rank * b:(rank + 1) * b]
            return t.reshape(parts * b, *t.shape[2:]).to(pixels.device)

        full.latent_eps, full.noise, full.timesteps = mine(full.latent_eps), mine(full.noise), mine(full.timesteps)
        if full.perturbation is not None:
            full.perturbation = mine(full.perturbation)
        return full

    def compute_loss(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The loss of one micro-batch at the current global step."""
        pixels, ids, mask = self._batch_tensors(batch)
        noise = self.step_noise(pixels, batch_idx)
        with torch.no_grad():
            latents = encode_latents(self.vae, pixels, noise.latent_eps).float()
        hidden = self.encode_prompt(ids, mask)
        return diffusion_loss(self.unet, self.noise_scheduler, latents, hidden, noise.noise, noise.timesteps,
                              self.loss_cfg, noise.perturbation)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch, batch_idx)
        now = time.perf_counter()
        # the mean over ranks (each rank's loss is over its own slice of the global batch)
        self.log("train_loss", loss.detach(), prog_bar=True, on_step=True, sync_dist=True)
        schedulers = self.lr_schedulers() if self._trainer is not None else None
        if schedulers is not None:
            sched = schedulers[0] if isinstance(schedulers, list) else schedulers
            self.log("lr", float(sched.get_last_lr()[0]), prog_bar=True, on_step=True)
        if self._t_last is not None:
            images = batch["input_ids"].shape[0] * self.trainer.world_size
            self.log("images_per_s", images / max(now - self._t_last, 1e-9), prog_bar=True, on_step=True)
        self._t_last = now
        return loss

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self.ema is not None:
            self.ema.update()

    def configure_optimizers(self) -> Any:
        from diffusers.optimization import get_scheduler

        o, train = self.config.optimizer, self.config.train
        lr = o.learning_rate
        if o.scale_lr:
            lr *= train.gradient_accumulation_steps * train.train_batch_size * self.trainer.world_size
        params = [p for p in self.parameters() if p.requires_grad]
        adamw = torch.optim.AdamW
        if o.use_8bit_adam:
            import bitsandbytes as bnb  # check_run made sure it is importable and CUDA is there

            adamw = bnb.optim.AdamW8bit
        opt = adamw(params, lr=lr, betas=(o.adam_beta1, o.adam_beta2), weight_decay=o.adam_weight_decay,
                    eps=o.adam_epsilon)
        # diffusers' scripts count warm-up and total steps in optimizer steps times processes; Lightning steps
        # the scheduler once per optimizer step, so optimizer steps are the unit here. The length is
        # max_train_steps even where the run ends past it (resumed at its end, the scripts still train a step).
        sched = get_scheduler(o.lr_scheduler, optimizer=opt, num_warmup_steps=o.lr_warmup_steps,
                              num_training_steps=max(1, self.length.max_train_steps if self.length
                                                     else self.trainer.max_steps), num_cycles=o.lr_num_cycles,
                              power=o.lr_power)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- checkpoint state -----------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict")
        if isinstance(state, dict):
            keep = self.trainable_names()
            for key in [k for k in state if k not in keep]:
                del state[key]
        if self.ema is not None:
            checkpoint["ema"] = self.ema.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.ema is not None and "ema" in checkpoint:
            self.ema.load_state_dict(checkpoint["ema"])
        if self.length is not None and "loops" in checkpoint:
            restart_at_epoch(checkpoint, self.length.first_epoch, self.length.start_step)

    # -- inference and export -------------------------------------------------------------------------------
    def validation_scheduler(self) -> Any:
        """The sampler of validation and class images: the base's own scheduler, or --validation_scheduler."""
        name = self.config.validation_scheduler
        if name is None:
            return self.inference_scheduler
        import diffusers

        return getattr(diffusers, name).from_config(self.inference_scheduler.config)

    def pipeline(self, use_ema: bool = False) -> Any:
        """A `StableDiffusionPipeline` over the current modules with the base's scheduler and no safety
        checker (as diffusers' validation builds it); EMA weights go into a UNet copy with `use_ema`."""
        import copy

        from ...diffusion.models import make_pipeline
        from ...diffusion.streaming import gemini_of

        if gemini_of(self.unet) is None:
            self.fill_hollow()  # used before training: no Gemini will fill it
        unet = self.unet
        if use_ema and self.ema is not None:
            unet = copy.deepcopy(self.unet)
            self.ema.copy_to(unet.parameters())
        comps = {"unet": unet, "vae": self.vae, "text_encoder": self.text_encoder, "tokenizer": self.tokenizer,
                 "scheduler": self.validation_scheduler()}
        return make_pipeline(comps)

    def autocast(self, precision: str | None = None) -> Any:
        """The training dtype's autocast (or `precision`'s): frozen half-precision models meet fp32 weights."""
        import contextlib

        precision = precision or self.config.mixed_precision
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    @torch.no_grad()
    def generate(self, prompt: str, num_images: int, seed: int, *, use_ema: bool = False, batch_size: int = 1,
                 precision: str | None = None) -> list[Any]:
        """Images of `prompt` from the current weights (the EMA weights with `use_ema`), in eval mode and
        under the training dtype's autocast; each model's train/eval mode is restored afterwards."""
        from ...diffusion.export import generate_images

        modes = {m: m.training for m in self.modules()}
        self.eval()
        try:
            with self.autocast(precision):
                return generate_images(self.pipeline(use_ema=use_ema), prompt, num_images, seed=seed,
                                       steps=self.config.num_inference_steps, resolution=self.config.resolution,
                                       batch_size=batch_size)
        finally:
            for m, mode in modes.items():
                m.training = mode



EVAL_MODE_WARNING = r"Found \d+ module\(s\) in eval mode at the start of training"
"""Lightning's check at the start of fit, which flags every module in eval mode: the frozen VAE and encoders are,
on purpose (as in diffusers' scripts); `warn_trained_in_eval` checks what matters instead."""


def warn_trained_in_eval(module: pl.LightningModule) -> list[str]:
    """Warn (once, naming them) about the modules with trained parameters that are in eval mode; returns them."""
    bad = [name for name, m in module.named_modules()
           if not m.training and any(p.requires_grad for p in m.parameters(recurse=False))]
    if bad:
        logger.warning("%d module(s) with trained parameters are in eval mode at the start of training: %s", len(bad),
                       ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else ""))
    return bad


@contextlib.contextmanager
def step_rng(module: pl.LightningModule, batch_idx: int) -> Iterator[None]:
    """Within it torch's generators (the CPU's, and the module's CUDA device's) are seeded from (seed, step,
    micro-batch, rank) only, and restored after: the dropout masks of a step's forward (LoRA dropout, a text
    encoder trained in train mode) are then the same in a resumed run."""
    g = step_generator(module.config.seed, module.global_step, batch_idx % module.trainer.accumulate_grad_batches,
                       -1 - module.global_rank)  # a stream apart from the step's noise draws (rank 0's)
    seed = int(torch.randint(2**62, (1,), generator=g))
    with torch.random.fork_rng(devices=[module.device] if module.device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def stream_unet(cfg: FineTuneConfig) -> bool:
    """Whether the UNet is built hollow and streamed into Gemini's shards: Gemini places all of it (the trained
    UNet, or LoRA's frozen base in the weight dtype), and no EMA needs its values before setup."""
    return not cfg.use_ema and _is_gemini(cfg)


def _is_gemini(cfg: FineTuneConfig) -> bool:
    """Whether the run shards with Gemini (its chunks can be filled from a file)."""
    from ...core_parallel import GeminiConfig

    return isinstance(cfg.parallel, GeminiConfig)


def restart_at_epoch(checkpoint: dict[str, Any], epoch: int, step: int) -> None:
    """Make a Lightning checkpoint's loop state start `epoch` from its first batch at optimizer step `step` (what
    diffusers' scripts do on resume: `first_epoch = global_step // num_update_steps_per_epoch`, the epoch's
    batches from the first), whatever batch of which epoch it was written at."""
    fit = checkpoint["loops"]["fit_loop"]

    def put(progress: dict[str, Any], total: int, current: int) -> None:
        for name in progress["total"]:
            progress["total"][name] = total
        for name in progress["current"]:
            progress["current"][name] = current

    put(fit["epoch_progress"], epoch, epoch)  # `epoch` epochs done, none begun
    put(fit["epoch_loop.batch_progress"], 0, 0)
    fit["epoch_loop.batch_progress"]["is_last_batch"] = False
    put(fit["epoch_loop.scheduler_progress"], step, 0)
    optimizer = fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
    put(optimizer["step"], step, 0)  # Trainer.global_step
    put(optimizer["zero_grad"], step, 0)
    fit["epoch_loop.state_dict"]["_batches_that_stepped"] = step
