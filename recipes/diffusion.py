"""The Stable Diffusion fine-tuning recipe: `StableDiffusionFineTune` (LightningModule), `ImageCaptionData`
(LightningDataModule), the checkpoint/validation/export callbacks and `fit_finetune(config)`.

    from lowmem.recipes import StableDiffusionFineTune, ImageCaptionData
    cfg = FineTuneConfig(rank=4, max_train_steps=100, output_dir="out")
    model = StableDiffusionFineTune(cfg); data = ImageCaptionData(cfg, model.tokenizer)
    Trainer(max_steps=100, strategy="zero2").fit(model, data)

`fit_finetune(cfg)` does what `suite diffusion finetune` does: the Trainer with the callbacks, resume, export.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from ..diffusion.config import MIXED_PRECISION, FineTuneConfig
from ..diffusion.data import (
    CaptionedImages,
    ImageRecord,
    StepBatchSampler,
    scan_image_folder,
    scan_instance_folder,
    validate_records,
)
from ..diffusion.errors import InputError
from ..diffusion.training import EMA, diffusion_loss, draw_step_noise, encode_latents, latent_shape, step_generator
from .strategies import STRATEGY_NAMES, parallel_for_strategy, strategy_from_config, strategy_kind

__all__ = ["ImageCaptionData", "StableDiffusionFineTune", "check_run", "find_checkpoint", "fit_finetune",
           "fit_with_ray"]

logger = logging.getLogger(__name__)

CKPT_FILE = "trainer_state.ckpt"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


class StableDiffusionFineTune(pl.LightningModule):
    """Fine-tunes a Stable Diffusion UNet (whole, or LoRA adapters), optionally the text encoder too.

    The VAE (and the text encoder unless trained) are frozen and, under mixed precision, held in the
    half dtype. `components` overrides loading from `config.pretrained_model_name_or_path`.
    """

    def __init__(self, config: FineTuneConfig | None = None, components: dict[str, Any] | None = None) -> None:
        super().__init__()
        from ..diffusion.attention import set_kernels_attention
        from ..diffusion.models import load_components

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
        self._t_last = None

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
                "stream_unet": not cfg.lora and not cfg.use_ema and _is_gemini(cfg)}

    def setup(self, stage: str) -> None:
        if not isinstance(self.trainer.strategy, _gemini_strategy_class()):
            self.fill_hollow()

    def fill_hollow(self) -> None:
        """Give a streamed UNet's parameters their values in ordinary memory (no Gemini setup follows)."""
        from ..core_parallel.gemini.lazy import fill_hollow

        if fill_hollow(self.unet):
            logger.info("the UNet was built for streaming into Gemini; loaded whole instead (strategy %s)",
                        type(self.trainer.strategy).__name__ if self._trainer is not None else None)

    def _freeze_and_cast(self) -> None:
        from ..diffusion.lora import add_lora

        cfg = self.config
        self.vae.requires_grad_(False).to(self.weight_dtype)
        self.text_encoder.requires_grad_(cfg.train_text_encoder and not cfg.lora)
        if not cfg.train_text_encoder:
            self.text_encoder.to(self.weight_dtype)
        if cfg.lora:
            self.unet.to(self.weight_dtype)
            add_lora(self.unet, cfg.rank)
            if cfg.train_text_encoder:
                self.text_encoder.to(self.weight_dtype)
                add_lora(self.text_encoder, cfg.rank, text_encoder=True)
        if cfg.gradient_checkpointing:
            from ..diffusion.memory import enable_checkpointing

            # CLIP (transformers) recomputes only when the module is in train mode: see on_train_start.
            # recompute every block but not the attention (same gradients, no second attention pass)
            enable_checkpointing(self.unet, "keep_attention")
            if cfg.train_text_encoder:
                te = self.text_encoder
                # transformers 5 renamed it (the old name warns)
                (getattr(te, "activation_checkpointing_enable", None) or te.gradient_checkpointing_enable)()

    def set_modes(self) -> None:
        """Trained models in train mode, frozen ones in eval mode, as diffusers' scripts set them.

        Lightning keeps submodules in the mode they were loaded in (`from_pretrained` gives eval), and
        transformers' CLIP runs its gradient checkpointing only in train mode.
        """
        cfg = self.config
        self.unet.train()
        self.vae.eval()
        self.text_encoder.train(cfg.train_text_encoder)

    def on_train_start(self) -> None:
        self.set_modes()

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

    def step_noise(self, pixels: torch.Tensor, batch_idx: int) -> Any:
        """The noise of this rank's slice of the global micro-batch (independent of the world size)."""
        parts = 2 if self.loss_cfg.with_prior_preservation else 1
        b, world, rank = pixels.shape[0] // parts, self.trainer.world_size, self.global_rank
        shape = latent_shape(self.vae, pixels)
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
            images = batch["pixel_values"].shape[0] * self.trainer.world_size
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
        # the scheduler once per optimizer step, so optimizer steps are the unit here.
        sched = get_scheduler(o.lr_scheduler, optimizer=opt, num_warmup_steps=o.lr_warmup_steps,
                              num_training_steps=max(1, self.trainer.max_steps), num_cycles=o.lr_num_cycles,
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

        from ..diffusion.models import make_pipeline
        from ..diffusion.streaming import gemini_of

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
        from ..diffusion.export import generate_images

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


class ImageCaptionData(pl.LightningDataModule):
    """Captioned images from `train_data_dir`, DreamBooth instance (+ class) folders, or the built-in set.

    `scan()` validates every image before training (raising `InputError` for bad input); the sampler
    resumes at the first batch the checkpointed run had not consumed.
    """

    def __init__(self, config: FineTuneConfig, tokenizer: Any) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.records: list[ImageRecord] | None = None
        self.class_records: list[ImageRecord] | None = None
        self._start_batch = 0

    def _train_dir(self) -> Path:
        if self.config.train_data_dir:
            return Path(self.config.train_data_dir)
        from ..diffusion.sample_data import write_sample_data

        return write_sample_data(Path(self.config.output_dir) / "sample_data")

    def scan(self) -> list[ImageRecord]:
        """Find and validate the training records (once)."""
        if self.records is not None:
            return self.records
        cfg, dcfg = self.config, self.config.data_config()
        if cfg.instance_data_dir:
            found = scan_instance_folder(cfg.instance_data_dir, cfg.instance_prompt, "--instance_data_dir")
            records = validate_records(found, dcfg, cfg.instance_data_dir)
        elif cfg.dataset_name:
            from ..diffusion.data import scan_dataset

            folder = cfg.dataset_name
            records = validate_records(scan_dataset(cfg.dataset_name, dcfg, config_name=cfg.dataset_config_name,
                                                    cache_dir=cfg.cache_dir,
                                                    export_dir=Path(cfg.output_dir) / "dataset_images"),
                                       dcfg, folder)
        else:
            folder = self._train_dir()
            records = validate_records(scan_image_folder(folder, dcfg), dcfg, str(folder))
        if cfg.max_train_samples is not None and cfg.max_train_samples < len(records):
            # diffusers: dataset.shuffle(seed).select(range(n)); here a seeded subset in the original order
            g = torch.Generator().manual_seed(cfg.seed)
            keep = sorted(torch.randperm(len(records), generator=g)[: cfg.max_train_samples].tolist())
            records = [records[i] for i in keep]
        self.records = records
        return self.records

    def scan_class_images(self) -> list[ImageRecord]:
        """Validate the class images (prior preservation)."""
        cfg = self.config
        found = scan_instance_folder(cfg.class_data_dir, cfg.class_prompt, "--class_data_dir")
        self.class_records = validate_records(found, cfg.data_config(), cfg.class_data_dir)
        return self.class_records

    def prepare_data(self) -> None:
        cfg = self.config
        if not cfg.with_prior_preservation:
            return
        folder = Path(cfg.class_data_dir)
        folder.mkdir(parents=True, exist_ok=True)
        have = len([p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg")])
        if have >= cfg.num_class_images or self.trainer is None:
            return
        logger.info("generating %d class images of %r in %s", cfg.num_class_images - have, cfg.class_prompt, folder)
        precision = {"fp32": "no"}.get(cfg.prior_generation_precision or "", cfg.prior_generation_precision)
        images = self.trainer.lightning_module.generate(cfg.class_prompt, cfg.num_class_images - have, cfg.seed,
                                                        batch_size=cfg.sample_batch_size, precision=precision)
        for i, img in enumerate(images):
            from ..utils.fileio import atomic_write

            with atomic_write(folder / f"class-{have + i:05d}.png", "wb") as f:
                img.save(f, format="PNG")

    def setup(self, stage: str) -> None:
        self.scan()
        if self.config.with_prior_preservation:
            self.scan_class_images()

    def dataset(self) -> CaptionedImages:
        """The training data set."""
        return CaptionedImages(self.scan(), self.tokenizer, self.config.data_config(), self.class_records)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        cfg, trainer = self.config, self.trainer
        ds = self.dataset()
        sampler = StepBatchSampler(len(ds), cfg.train_batch_size, trainer.max_steps * cfg.gradient_accumulation_steps,
                                   seed=cfg.seed, rank=trainer.global_rank, world_size=trainer.world_size)
        sampler.start = self._start_batch
        return torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=cfg.dataloader_num_workers)

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        return {"batches_consumed": trainer.global_step * trainer.accumulate_grad_batches if trainer else 0}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._start_batch = int(state_dict.get("batches_consumed", 0))


# -- callbacks ----------------------------------------------------------------------------------------------
def _step_boundary(trainer: pl.Trainer, batch_idx: int) -> bool:
    return (batch_idx + 1) % trainer.accumulate_grad_batches == 0


def find_checkpoint(output_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint folder `resume` names: `latest` (None when output_dir has none), a `checkpoint-N` name
    looked up inside output_dir (as diffusers' scripts do), or a path."""
    if resume == "latest":
        found = sorted((int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*")
                       if (m := _CKPT_RE.match(p.name)) and (p / CKPT_FILE).exists())
        return found[-1][1] if found else None
    path = Path(resume)
    inside = Path(output_dir) / path.name
    if not (path / CKPT_FILE).exists() and _CKPT_RE.match(path.name) and (inside / CKPT_FILE).exists():
        path = inside
    if not (path / CKPT_FILE).exists():
        raise InputError(f"{path}: not a checkpoint folder (no {CKPT_FILE} inside, nor in {inside})")
    return path


def _sub(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _settle(module: StableDiffusionFineTune) -> None:
    """Before gathering weights: called at optimizer-step boundaries only, so clearing gradients loses nothing; it
    also ends Gemini's checkpoint mode (in which state_dict() returns placeholders) after trainer.save_checkpoint."""
    for optimizer in module.trainer.optimizers if module._trainer is not None else ():
        optimizer.zero_grad()


def _sharded(module: torch.nn.Module) -> bool:
    return any(getattr(m, "gemini_manager", None) is not None for m in module.modules())


def materialize(module: StableDiffusionFineTune, names: tuple[str, ...] = ("unet", "vae", "text_encoder")
                ) -> dict[str, Any]:
    """The components `names` holding the full current weights on rank 0; call on every rank.

    Under a sharding strategy (Gemini) each component's `state_dict()` gathers its weights (a collective), and
    its own parameters hold no data between forward passes (their chunks are released), so fresh modules are
    loaded from it, one component at a time; `state` holds the gathered values. Otherwise the module's own
    submodules are returned.
    """
    _settle(module)
    parts = {name: getattr(module, name) for name in names}
    if not _sharded(module):
        return parts
    out: dict[str, Any] = {"state": {}}
    for name, part in parts.items():
        state = part.state_dict()  # collective
        if module.global_rank != 0:
            continue
        state = {k: v.detach().cpu() for k, v in state.items()}
        config = part.config
        fresh = type(part).from_config(config) if hasattr(type(part), "from_config") else type(part)(config)
        fresh.load_state_dict(state, strict=False)
        out[name] = fresh
        out["state"].update({f"{name}.{k}": v for k, v in state.items()})
    return out if module.global_rank == 0 else parts


def _fp32(m: torch.nn.Module) -> torch.nn.Module:
    """`m`, or an fp32 copy when it is not fp32 (the run's own modules keep their dtype)."""
    import copy

    return m if all(p.dtype == torch.float32 for p in m.parameters()) else copy.deepcopy(m).to(torch.float32)


def write_component(module: StableDiffusionFineTune, name: str, folder: Path | None) -> None:
    """Write component `name` (`unet` or `text_encoder`) as `save_pretrained(folder)` writes it, fp32; call on
    every rank (rank 0 passes the folder, the others None). A UNet in Gemini's chunks is streamed one gathered
    chunk at a time (`diffusion.streaming`); anything else is gathered whole first."""
    from ..diffusion.streaming import gemini_of, save_unet_streaming

    part = getattr(module, name)
    if name == "unet" and gemini_of(part) is not None and not any(True for _ in part.buffers()):
        _settle(module)
        save_unet_streaming(part, folder if module.global_rank == 0 else None)
        return
    fresh = materialize(module, (name,)).get(name)
    if module.global_rank == 0 and folder is not None:
        _fp32(fresh).save_pretrained(folder, safe_serialization=True)


def _lora_layers(module: StableDiffusionFineTune, parts: dict[str, Any]) -> dict[str, dict]:
    from ..diffusion.lora import lora_state_dicts

    state = parts.get("state")
    te = module.text_encoder if module.config.train_text_encoder else None
    if state is None:
        return lora_state_dicts(module.unet, te)
    return lora_state_dicts(module.unet, te, unet_state=_sub(state, "unet."), text_state=_sub(state, "text_encoder."))


def _write_weights(module: StableDiffusionFineTune, folder: Path | None) -> None:
    """The user-facing weights of a checkpoint: LoRA file, or unet/ (+ text_encoder/, unet_ema/); call on every
    rank, rank 0 writes into `folder` (None on the others)."""
    from ..diffusion.lora import save_lora_weights

    cfg = module.config
    rank0 = module.global_rank == 0
    if cfg.lora:
        parts = materialize(module)
        if rank0:
            save_lora_weights(folder, _lora_layers(module, parts))
        return
    write_component(module, "unet", folder / "unet" if rank0 else None)
    if cfg.train_text_encoder:
        write_component(module, "text_encoder", folder / "text_encoder" if rank0 else None)
    if module.ema is not None and rank0:
        module.pipeline(use_ema=True).unet.save_pretrained(folder / "unet_ema", safe_serialization=True)


class CheckpointEvery(pl.Callback):
    """Writes `checkpoint-N/` every `every` steps atomically and prunes to `limit` folders."""

    def __init__(self, output_dir: str | Path, every: int, limit: int | None) -> None:
        self.output_dir, self.every, self.limit = Path(output_dir), every, limit
        self._last = -1

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step and step % self.every == 0 and step != self._last and _step_boundary(trainer, batch_idx):
            self._last = step
            self.save(trainer, module, step)

    def save(self, trainer: pl.Trainer, module: StableDiffusionFineTune, step: int) -> Path:
        final = self.output_dir / f"checkpoint-{step}"
        tmp = self.output_dir / f".checkpoint-{step}.tmp"
        if trainer.is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        trainer.strategy.barrier("checkpoint-start")
        trainer.save_checkpoint(tmp / CKPT_FILE, weights_only=False)
        _write_weights(module, tmp if trainer.is_global_zero else None)
        if trainer.is_global_zero:
            from ..diffusion.export import move_into

            staging = self.output_dir / f".checkpoint-{step}.stage"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            os.replace(tmp, staging / final.name)
            move_into(staging, self.output_dir, [final.name])
            staging.rmdir()
            self._prune()
            logger.info("wrote %s", final)
        trainer.strategy.barrier("checkpoint-end")
        if hasattr(trainer.strategy, "note_checkpoint"):  # the sharded strategies' fault advice names it
            trainer.strategy.note_checkpoint(final, "--resume_from_checkpoint latest")
        return final

    def save_on_signal(self, trainer: pl.Trainer, module: StableDiffusionFineTune) -> Path:
        """On SIGTERM the sharded strategies save through here: this step's checkpoint-N/ (unless just written)."""
        if trainer.global_step != self._last:
            self._last = trainer.global_step
            self.save(trainer, module, trainer.global_step)
        return self.output_dir / f"checkpoint-{trainer.global_step}"

    def _prune(self) -> None:
        if self.limit is None:
            return
        found = sorted((int(m.group(1)), p) for p in self.output_dir.iterdir() if (m := _CKPT_RE.match(p.name)))
        for _, path in found[: max(0, len(found) - self.limit)]:
            shutil.rmtree(path, ignore_errors=True)


class ValidateEvery(pl.Callback):
    """Generates `num_validation_images` of each validation prompt every `every` steps; rank 0 writes a PNG
    grid per prompt. The images come from the weights that would be exported (the EMA weights under
    --use_ema) under the training dtype's autocast; a failure is logged and never stops the run."""

    def __init__(self, output_dir: str | Path, every: int) -> None:
        self.folder, self.every = Path(output_dir) / "validation", every
        self._last = -1

    def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
        epochs = module.config.validation_epochs
        if epochs:  # diffusers validates at the end of every validation_epochs-th epoch
            batches = len(trainer.datamodule.dataset()) / (module.config.train_batch_size * trainer.world_size)
            per_epoch = max(1, math.ceil(math.ceil(batches) / trainer.accumulate_grad_batches))
            self.every = epochs * per_epoch

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step and step % self.every == 0 and step != self._last and _step_boundary(trainer, batch_idx):
            self._last = step
            self.validate(trainer, module, f"step-{step:06d}")

    def validate(self, trainer: pl.Trainer, module: StableDiffusionFineTune, name: str) -> None:
        from ..diffusion.export import save_grid

        cfg = module.config
        for i, prompt in enumerate(cfg.prompts):
            stem = name if i == 0 else f"{name}-prompt{i}"
            try:
                images = module.generate(prompt, cfg.num_validation_images, cfg.seed, use_ema=True)
            except Exception as exc:  # noqa: BLE001 - validation is optional: it must never lose the run
                logger.error("validation %s failed and was skipped (%s: %s)", stem, type(exc).__name__, exc)
                continue
            if trainer.is_global_zero:
                path = save_grid(images, self.folder / f"{stem}.png")
                logger.info("validation images (%r): %s", prompt, path)
                _log_images(trainer, stem, images)


def _log_images(trainer: pl.Trainer, name: str, images: list[Any]) -> None:
    import numpy as np

    for lg in trainer.loggers:
        experiment = getattr(lg, "experiment", None)
        if hasattr(experiment, "add_images"):
            arr = np.stack([np.asarray(img) for img in images])
            experiment.add_images(f"validation/{name}", arr, trainer.global_step, dataformats="NHWC")
        elif hasattr(lg, "log_image"):  # wandb
            lg.log_image(key=f"validation/{name}", images=list(images), step=trainer.global_step)


class PlainProgress(pl.Callback):
    """One plain line every `every` steps (step, loss, images/s, lr, ETA) on stdout, rank 0: what a log file
    shows of a run whose stdout is not a terminal (a progress bar writes nothing useful there)."""

    def __init__(self, every: int, stream: Any = None) -> None:
        self.every, self.stream = every, stream
        self._start: tuple[float, int] | None = None
        self._last = -1

    def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
        self._start = (time.perf_counter(), trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step == self._last or not _step_boundary(trainer, batch_idx):
            return
        if step % self.every and step != trainer.max_steps:
            return
        self._last = step
        t0, s0 = self._start or (time.perf_counter(), 0)
        elapsed, done = time.perf_counter() - t0, max(step - s0, 1)
        eta = int(elapsed / done * max(trainer.max_steps - step, 0))
        m = trainer.callback_metrics
        loss, ips, lr = (float(m[k]) if k in m else float("nan") for k in ("train_loss", "images_per_s", "lr"))
        print(f"step {step}/{trainer.max_steps} loss {loss:.4f} images/s {ips:.2f} lr {lr:.3g} "
              f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}", file=self.stream or sys.stdout, flush=True)


# -- the run ------------------------------------------------------------------------------------------------
def _progress_bar() -> pl.Callback:
    """Lightning's progress bar without the logger-version column (loss and images/s stay)."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    base = RichProgressBar if _RICH_AVAILABLE else TQDMProgressBar

    class ProgressBar(base):  # type: ignore[misc, valid-type]
        def get_metrics(self, trainer: pl.Trainer, module: Any) -> dict[str, Any]:
            items = super().get_metrics(trainer, module)
            items.pop("v_num", None)
            return items

    return ProgressBar()


def _loggers(cfg: FineTuneConfig, resumed_step: int | None = None) -> list[Any]:
    """CSV (and TensorBoard) loggers under output_dir/logs; a resumed run gets its own CSV file, since
    Lightning's CSV logger would overwrite the interrupted run's."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    version = "csv" if resumed_step is None else f"csv-resumed-at-{resumed_step}"
    loggers: list[Any] = [CSVLogger(cfg.output_dir, name=cfg.logging_dir, version=version)]
    if cfg.report_to in ("tensorboard", "all"):
        try:
            loggers.append(TensorBoardLogger(cfg.output_dir, name=cfg.logging_dir, version="tensorboard"))
        except ModuleNotFoundError as exc:
            logger.warning("TensorBoard logging unavailable (%s); CSV only", exc)
    if cfg.report_to == "wandb" or (cfg.report_to == "all" and _installed("wandb")):
        from lightning.pytorch.loggers import WandbLogger

        save_dir = str(Path(cfg.output_dir) / cfg.logging_dir)
        loggers.append(WandbLogger(project=cfg.tracker_project_name, save_dir=save_dir))
    return loggers


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def check_run(cfg: FineTuneConfig) -> None:
    """Refuse, with one line, settings that cannot run here; called before any data or model is loaded."""
    from lightning.pytorch.strategies import StrategyRegistry

    # ours by their table (no registration needed), Lightning's from its registry
    names = sorted({*STRATEGY_NAMES, *StrategyRegistry.available_strategies()})
    if cfg.strategy not in names:
        import difflib

        close = difflib.get_close_matches(cfg.strategy, names, n=1)
        hint = f"; did you mean {close[0]}?" if close else f" (known: {', '.join(names)})"
        raise InputError(f"--strategy {cfg.strategy}: no such strategy{hint}")
    if cfg.offload_dir is not None:  # --offload_dir with a strategy that has no NVMe tier: one line, before loading
        parallel_for_strategy(cfg.strategy, cfg.offload_dir)
    cuda = torch.cuda.is_available()
    if cfg.mixed_precision == "fp16" and not cuda:
        raise InputError("--mixed_precision fp16: needs a CUDA device (fp16 training on CPU is not supported); "
                         "use bf16 or no")
    if cfg.prior_generation_precision == "fp16" and not cuda:
        raise InputError("--prior_generation_precision fp16: needs a CUDA device; use bf16 or fp32")
    if cfg.use_8bit_adam and not (cuda and _installed("bitsandbytes")):
        why = "no CUDA device" if not cuda else "bitsandbytes is not installed (pip install bitsandbytes)"
        raise InputError(f"--use_8bit_adam: bitsandbytes' 8-bit AdamW cannot run here ({why})")
    if cfg.report_to == "wandb" and not _installed("wandb"):
        raise InputError("--report_to wandb: wandb is not installed (pip install wandb), use tensorboard or csv")
    if cfg.dataset_name and not Path(cfg.dataset_name).is_dir() and not _installed("datasets"):
        raise InputError(f"--dataset_name {cfg.dataset_name}: not a local folder, and reading a dataset from the "
                         "Hugging Face cache needs the datasets package (pip install datasets)")
    if cfg.dataset_config_name and not _installed("datasets"):
        raise InputError("--dataset_config_name: needs the datasets package (pip install datasets)")
    if cfg.non_ema_revision:
        _check_non_ema_revision(cfg)


def _check_non_ema_revision(cfg: FineTuneConfig) -> None:
    """--non_ema_revision names a revision of the hub id that is in the local cache (one line otherwise)."""
    from ..diffusion.models import resolve_pretrained

    if cfg.pretrained_model_name_or_path is None:
        raise InputError(f"--non_ema_revision {cfg.non_ema_revision}: applies to a hub id "
                         "(--pretrained_model_name_or_path), not to the tiny built-in pipeline")
    resolve_pretrained(cfg.pretrained_model_name_or_path, revision=cfg.non_ema_revision, cache_dir=cfg.cache_dir,
                       flag="--non_ema_revision")


class FinishRun(pl.Callback):
    """At the end of a completed run (every rank): EMA weights in, export, then the final validation grid.

    The export comes before anything optional, so a failing validation cannot lose the run; the validation
    then draws from exactly the exported weights.
    """

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        cfg = module.config
        if module.ema is not None:  # diffusers' scripts export the EMA weights
            module.ema.copy_to(module.unet.parameters())
            module.ema = None
        export(trainer, module)
        if cfg.prompts:
            ValidateEvery(cfg.output_dir, cfg.validation_steps).validate(trainer, module, "final")


def trainer_kwargs(cfg: FineTuneConfig, max_steps: int, callbacks: list[pl.Callback] | None = None,
                   resumed_step: int | None = None, progress_bar: bool = True) -> dict[str, Any]:
    """`pl.Trainer` arguments of a run, except the placement (strategy, devices, nodes)."""
    cbs: list[pl.Callback] = [CheckpointEvery(cfg.output_dir, cfg.checkpointing_steps, cfg.checkpoints_total_limit)]
    if progress_bar:
        cbs.append(_progress_bar())
    if not sys.stdout.isatty():
        cbs.append(PlainProgress(cfg.log_every_n_steps))
    if cfg.prompts:
        cbs.append(ValidateEvery(cfg.output_dir, cfg.validation_steps))
    cbs += [*(callbacks or []), FinishRun()]
    return dict(
        precision=MIXED_PRECISION[cfg.mixed_precision], max_steps=max_steps, max_epochs=1,
        accumulate_grad_batches=cfg.gradient_accumulation_steps,
        gradient_clip_val=cfg.optimizer.max_grad_norm or None, logger=_loggers(cfg, resumed_step), callbacks=cbs,
        enable_checkpointing=False, use_distributed_sampler=False, log_every_n_steps=1,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=cfg.output_dir,
        enable_progress_bar=progress_bar,
    )


def _gemini_strategy_class() -> type:
    from .strategies import GeminiStrategy

    return GeminiStrategy


def _is_gemini(cfg: FineTuneConfig) -> bool:
    """Whether the run shards with Gemini (its chunks can be filled from a file); makes no folder."""
    from ..core_parallel import GeminiConfig

    return isinstance(cfg.parallel, GeminiConfig) or (cfg.parallel is None and strategy_kind(cfg.strategy) == "gemini")


def parallel_config(cfg: FineTuneConfig) -> Any:
    """The run's sharding config: `parallel` when given, else the one `--strategy` (and `--offload_dir`) name
    (`recipes.strategies.parallel_for_strategy`); None for strategies that shard nothing here (auto, ddp, ...)."""
    return cfg.parallel if cfg.parallel is not None else parallel_for_strategy(cfg.strategy, cfg.offload_dir)


def build_strategy(cfg: FineTuneConfig) -> Any:
    """The Trainer's `strategy`, built directly from the run's config (`strategy_from_config`): no registry
    lookup, no environment variable; a strategy name that shards nothing here (auto, ddp, Lightning's own) as is."""
    parallel = parallel_config(cfg)
    return cfg.strategy if parallel is None else strategy_from_config(parallel)


def build_trainer(cfg: FineTuneConfig, max_steps: int, callbacks: list[pl.Callback] | None = None,
                  resumed_step: int | None = None, **overrides: Any) -> pl.Trainer:
    """The Lightning Trainer of a run (`overrides` go to `pl.Trainer`)."""
    if cfg.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # a progress bar only where a terminal shows it; elsewhere PlainProgress writes lines
    bar = overrides.pop("enable_progress_bar", sys.stderr.isatty())
    kwargs = trainer_kwargs(cfg, max_steps, callbacks, resumed_step, bar)
    kwargs.update(accelerator="auto", devices=cfg.devices, num_nodes=cfg.num_nodes, strategy=build_strategy(cfg))
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def export(trainer: pl.Trainer, module: StableDiffusionFineTune) -> Path:
    """Write the final result into output_dir: LoRA weights, or the whole pipeline (EMA weights under use_ema).

    Call on every rank (gathering sharded weights is collective); rank 0 writes. Over a base pipeline folder the
    trained components are written first (a UNet in Gemini's chunks streamed chunk by chunk, never whole) into a
    staging folder beside the output, then moved in with the base's other components.
    """
    from ..diffusion.export import save_over_base, save_pipeline
    from ..diffusion.lora import save_lora_weights
    from ..diffusion.models import make_pipeline

    cfg, out = module.config, Path(module.config.output_dir)
    rank0 = trainer.is_global_zero
    if cfg.lora:
        parts = materialize(module)
        if not rank0:
            return out
        path = save_lora_weights(out, _lora_layers(module, parts))
        logger.info("exported %s", path)
        return path
    drop = ["text_encoder"] if cfg.skip_save_text_encoder else []
    names = ["unet"] + (["text_encoder"] if cfg.train_text_encoder and not cfg.skip_save_text_encoder else [])
    if module.base_source is not None and cfg.tokenizer_name is None:
        # every component the trainer did not train is the base's, file for file
        import tempfile

        out.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(dir=out, prefix=".trained-", suffix=".tmp")) if rank0 else None
        try:
            for name in names:
                write_component(module, name, stage / name if rank0 else None)
            if not rank0:
                return out
            path = save_over_base(module.base_source, {name: stage / name for name in names}, out, drop=drop)
        finally:
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)
    else:
        parts = materialize(module)
        if not rank0:
            return out
        comps = {"vae": _fp32(parts["vae"]), "text_encoder": _fp32(parts["text_encoder"]),
                 **{name: _fp32(parts[name]) for name in names}, "tokenizer": module.tokenizer,
                 "extras": module.base_extras}
        pipe = make_pipeline(comps, scheduler=module.inference_scheduler, keep_extras=True)
        if drop:
            pipe.register_modules(text_encoder=None)
        path = save_pipeline(pipe, out)
    logger.info("exported %s", path)
    return path


def _prepare(cfg: FineTuneConfig, world: int) -> tuple[ImageCaptionData, int, Path | None, int | None]:
    """Validate the data (before any model is built), find the checkpoint to resume: data, steps, ckpt, step."""
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    ckpt = find_checkpoint(cfg.output_dir, cfg.resume_from_checkpoint) if cfg.resume_from_checkpoint else None
    if cfg.resume_from_checkpoint and ckpt is None:
        logger.info("no checkpoint found in %s; starting a new run", cfg.output_dir)
    data = ImageCaptionData(cfg, tokenizer=None)
    max_steps = cfg.total_steps(len(data.scan()), world)
    resumed_step = int(_CKPT_RE.match(ckpt.name).group(1)) if ckpt and _CKPT_RE.match(ckpt.name) else None
    if ckpt is not None:
        logger.info("resuming from %s (step %s of %d)", ckpt, "?" if resumed_step is None else resumed_step, max_steps)
    return data, max_steps, ckpt, resumed_step


def fit_finetune(cfg: FineTuneConfig, callbacks: list[pl.Callback] | None = None, **trainer_overrides: Any) -> Any:
    """Run one fine-tuning as `suite diffusion finetune` does; returns the finished `StableDiffusionFineTune`."""
    check_run(cfg)
    data, max_steps, ckpt, resumed_step = _prepare(cfg, cfg.devices * cfg.num_nodes)
    module = StableDiffusionFineTune(cfg)
    data.tokenizer = module.tokenizer
    trainer = build_trainer(cfg, max_steps, callbacks, resumed_step, **trainer_overrides)
    with warnings.catch_warnings():
        # ImageCaptionData restores the sampler position itself (its state_dict), which Lightning cannot see.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        trainer.fit(module, datamodule=data, ckpt_path=str(ckpt / CKPT_FILE) if ckpt else None, weights_only=True)
    return module


def _ray_job(cfg: FineTuneConfig, max_steps: int, ckpt: str | None, resumed_step: int | None) -> Any:
    """The job every Ray worker builds (module-level, so cloudpickle sends it by reference)."""
    from .ray import FitJob

    module = StableDiffusionFineTune(cfg)
    data = ImageCaptionData(cfg, module.tokenizer)
    parallel = parallel_config(cfg)
    strategy = parallel if parallel is not None else "ddp" if cfg.strategy == "auto" else cfg.strategy
    return FitJob(module=module, datamodule=data, strategy=strategy, ckpt_path=ckpt,
                  trainer_kwargs=trainer_kwargs(cfg, max_steps, None, resumed_step, progress_bar=False))


def fit_with_ray(cfg: FineTuneConfig) -> Any:
    """`suite diffusion finetune --ray_address ...`: the same run on `num_workers` Ray Train workers."""
    import dataclasses
    import functools

    from .ray import RayConfig, fit_on_ray

    # Ray workers run in their own working folders: every path must be absolute.
    paths = ("output_dir", "train_data_dir", "instance_data_dir", "class_data_dir", "pretrained_model_name_or_path",
             "offload_dir", "cache_dir", "tokenizer_name", "dataset_name")
    cfg = dataclasses.replace(cfg, **{k: os.path.abspath(getattr(cfg, k)) for k in paths
                                      if getattr(cfg, k) and os.path.exists(getattr(cfg, k))})
    if cfg.resume_from_checkpoint and cfg.resume_from_checkpoint != "latest":
        cfg = dataclasses.replace(cfg, resume_from_checkpoint=os.path.abspath(cfg.resume_from_checkpoint))
    if getattr(cfg.parallel, "offload_dir", None):  # a Gemini config's NVMe folder
        folder = os.path.abspath(cfg.parallel.offload_dir)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, offload_dir=folder))
    check_run(cfg)
    workers = cfg.num_workers or cfg.devices * cfg.num_nodes
    _, max_steps, ckpt, resumed_step = _prepare(cfg, workers)
    build = functools.partial(_ray_job, cfg, max_steps, str(ckpt / CKPT_FILE) if ckpt else None, resumed_step)
    storage = os.path.join(cfg.output_dir, "ray")
    return fit_on_ray(build, RayConfig(address=cfg.ray_address, num_workers=workers, storage_path=storage,
                                       name="diffusion-finetune"))
