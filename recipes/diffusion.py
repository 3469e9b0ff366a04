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
import os
import re
import shutil
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

__all__ = ["ImageCaptionData", "StableDiffusionFineTune", "find_checkpoint", "fit_finetune", "fit_with_ray"]

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
        comps = components or load_components(cfg.pretrained_model_name_or_path, tiny_resolution=cfg.resolution)
        self.unet, self.vae, self.text_encoder = comps["unet"], comps["vae"], comps["text_encoder"]
        self.tokenizer, self.noise_scheduler = comps["tokenizer"], comps["scheduler"]
        self.loss_cfg = cfg.loss_config(self.noise_scheduler.config.prediction_type)
        if cfg.prediction_type:
            self.noise_scheduler.register_to_config(prediction_type=cfg.prediction_type)
        set_kernels_attention(self.unet, cfg.attention_backend)
        self._freeze_and_cast()
        self.ema = EMA(self.unet.parameters(), cfg.ema_decay) if cfg.use_ema and not cfg.lora else None
        self.strict_loading = False
        self._t_last = None

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the frozen models."""
        return {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.config.mixed_precision]

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

            # recompute every block but not the attention (same gradients, no second attention pass)
            enable_checkpointing(self.unet, "keep_attention")
            if cfg.train_text_encoder:
                self.text_encoder.gradient_checkpointing_enable()

    def trainable_names(self) -> set[str]:
        """State-dict names of the trained parameters (what a checkpoint keeps)."""
        return {n for n, p in self.named_parameters() if p.requires_grad}

    # -- training -------------------------------------------------------------------------------------------
    def _batch_tensors(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        pixels, ids = batch["pixel_values"], batch["input_ids"]
        if self.loss_cfg.with_prior_preservation:
            pixels = torch.cat([pixels, batch["class_pixel_values"]])
            ids = torch.cat([ids, batch["class_input_ids"]])
        return pixels, ids

    def step_noise(self, pixels: torch.Tensor, batch_idx: int) -> Any:
        """The noise of this rank's slice of the global micro-batch (independent of the world size)."""
        parts = 2 if self.loss_cfg.with_prior_preservation else 1
        b, world, rank = pixels.shape[0] // parts, self.trainer.world_size, self.global_rank
        shape = latent_shape(self.vae, pixels)
        g = step_generator(self.config.seed, self.global_step, batch_idx % self.trainer.accumulate_grad_batches)
        full = draw_step_noise((parts * b * world, *shape[1:]), self.noise_scheduler.config.num_train_timesteps,
                               g, self.loss_cfg.noise_offset)

        def mine(t: torch.Tensor) -> torch.Tensor:
            t = t.view(parts, b * world, *t.shape[1:])[:, rank * b:(rank + 1) * b]
            return t.reshape(parts * b, *t.shape[2:]).to(pixels.device)

        full.latent_eps, full.noise, full.timesteps = mine(full.latent_eps), mine(full.noise), mine(full.timesteps)
        return full

    def compute_loss(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The loss of one micro-batch at the current global step."""
        pixels, ids = self._batch_tensors(batch)
        noise = self.step_noise(pixels, batch_idx)
        with torch.no_grad():
            latents = encode_latents(self.vae, pixels, noise.latent_eps).float()
        hidden = self.text_encoder(ids, return_dict=False)[0]
        return diffusion_loss(self.unet, self.noise_scheduler, latents, hidden, noise.noise, noise.timesteps,
                              self.loss_cfg)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch, batch_idx)
        now = time.perf_counter()
        self.log("train_loss", loss.detach(), prog_bar=True, on_step=True)
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

        cfg = self.config
        lr = cfg.learning_rate
        if cfg.scale_lr:
            lr *= cfg.gradient_accumulation_steps * cfg.train_batch_size * self.trainer.world_size
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                weight_decay=cfg.adam_weight_decay, eps=cfg.adam_epsilon)
        sched = get_scheduler(cfg.lr_scheduler, optimizer=opt, num_warmup_steps=cfg.lr_warmup_steps,
                              num_training_steps=max(1, self.trainer.max_steps))
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
    def pipeline(self, use_ema: bool = False) -> Any:
        """A `StableDiffusionPipeline` over the current modules (EMA weights copied into a UNet copy)."""
        import copy

        from ..diffusion.models import make_pipeline

        unet = self.unet
        if use_ema and self.ema is not None:
            unet = copy.deepcopy(self.unet)
            self.ema.copy_to(unet.parameters())
        comps = {"unet": unet, "vae": self.vae, "text_encoder": self.text_encoder, "tokenizer": self.tokenizer,
                 "scheduler": self.noise_scheduler}
        return make_pipeline(comps)

    @torch.no_grad()
    def generate(self, prompt: str, num_images: int, seed: int) -> list[Any]:
        """Images of `prompt` from the current weights (eval mode, fp32 UNet calls under autocast off)."""
        from ..diffusion.export import generate_images

        was_training = self.training
        self.eval()
        try:
            return generate_images(self.pipeline(), prompt, num_images, seed=seed,
                                   steps=self.config.num_inference_steps, resolution=self.config.resolution)
        finally:
            self.train(was_training)


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
            self.records = validate_records(found, dcfg, cfg.instance_data_dir)
        else:
            folder = self._train_dir()
            self.records = validate_records(scan_image_folder(folder, dcfg), dcfg, str(folder))
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
        images = self.trainer.lightning_module.generate(cfg.class_prompt, cfg.num_class_images - have, cfg.seed)
        for i, img in enumerate(images):
            from ..core_parallel.fileio import atomic_write

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
    """The checkpoint folder `resume` names: a path, or `latest` (None when output_dir has none)."""
    if resume == "latest":
        found = sorted((int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*")
                       if (m := _CKPT_RE.match(p.name)) and (p / CKPT_FILE).exists())
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / CKPT_FILE).exists():
        raise InputError(f"{path}: not a checkpoint folder (no {CKPT_FILE} inside)")
    return path


def _sub(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def materialize(module: StableDiffusionFineTune) -> dict[str, Any]:
    """`unet`, `vae`, `text_encoder` holding the full current weights on rank 0; call on every rank.

    `module.state_dict()` is taken on every rank: under a sharding strategy (Gemini) it gathers the weights
    (a collective), and the module's own parameters hold no data between forward passes (their chunks are
    released), so fresh modules are loaded from it. Otherwise the module's own submodules are returned.
    """
    parts = {"unet": module.unet, "vae": module.vae, "text_encoder": module.text_encoder}
    # Called at optimizer-step boundaries only, so clearing gradients loses nothing; it also ends Gemini's
    # checkpoint mode (in which state_dict() returns placeholders) right after trainer.save_checkpoint.
    for optimizer in module.trainer.optimizers if module._trainer is not None else ():
        optimizer.zero_grad()
    state = module.state_dict()
    if module.global_rank != 0 or not any(getattr(m, "gemini_manager", None) is not None for m in module.modules()):
        return parts
    state = {k: v.detach().cpu() for k, v in state.items()}
    out = {}
    for name, part in parts.items():
        config = part.config
        fresh = type(part).from_config(config) if hasattr(type(part), "from_config") else type(part)(config)
        fresh.load_state_dict(_sub(state, f"{name}."), strict=False)
        out[name] = fresh
    out["state"] = state
    return out


def _lora_layers(module: StableDiffusionFineTune, parts: dict[str, Any]) -> dict[str, dict]:
    from ..diffusion.lora import lora_state_dicts

    state = parts.get("state")
    te = module.text_encoder if module.config.train_text_encoder else None
    if state is None:
        return lora_state_dicts(module.unet, te)
    return lora_state_dicts(module.unet, te, unet_state=_sub(state, "unet."), text_state=_sub(state, "text_encoder."))


def _write_weights(module: StableDiffusionFineTune, folder: Path, parts: dict[str, Any]) -> None:
    """The user-facing weights of a checkpoint: LoRA file, or unet/ (+ text_encoder/, unet_ema/); rank 0."""
    from ..diffusion.lora import save_lora_weights

    cfg = module.config
    if cfg.lora:
        save_lora_weights(folder, _lora_layers(module, parts))
        return
    parts["unet"].save_pretrained(folder / "unet", safe_serialization=True)
    if cfg.train_text_encoder:
        parts["text_encoder"].save_pretrained(folder / "text_encoder", safe_serialization=True)
    if module.ema is not None:
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
        parts = materialize(module)
        if trainer.is_global_zero:
            _write_weights(module, tmp, parts)
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
        return final

    def _prune(self) -> None:
        if self.limit is None:
            return
        found = sorted((int(m.group(1)), p) for p in self.output_dir.iterdir() if (m := _CKPT_RE.match(p.name)))
        for _, path in found[: max(0, len(found) - self.limit)]:
            shutil.rmtree(path, ignore_errors=True)


class ValidateEvery(pl.Callback):
    """Generates `num_validation_images` of the validation prompt every `every` steps; rank 0 writes a PNG grid."""

    def __init__(self, output_dir: str | Path, every: int) -> None:
        self.folder, self.every = Path(output_dir) / "validation", every
        self._last = -1

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step and step % self.every == 0 and step != self._last and _step_boundary(trainer, batch_idx):
            self._last = step
            self.validate(trainer, module, f"step-{step:06d}")

    def validate(self, trainer: pl.Trainer, module: StableDiffusionFineTune, name: str) -> None:
        from ..diffusion.export import save_grid

        cfg = module.config
        images = module.generate(cfg.validation_prompt, cfg.num_validation_images, cfg.seed)
        if trainer.is_global_zero:
            path = save_grid(images, self.folder / f"{name}.png")
            logger.info("validation images: %s", path)
            _log_images(trainer, name, images)


def _log_images(trainer: pl.Trainer, name: str, images: list[Any]) -> None:
    import numpy as np

    for lg in trainer.loggers:
        experiment = getattr(lg, "experiment", None)
        if hasattr(experiment, "add_images"):
            arr = np.stack([np.asarray(img) for img in images])
            experiment.add_images(f"validation/{name}", arr, trainer.global_step, dataformats="NHWC")


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
    loggers: list[Any] = [CSVLogger(cfg.output_dir, name="logs", version=version)]
    if cfg.report_to == "tensorboard":
        try:
            loggers.append(TensorBoardLogger(cfg.output_dir, name="logs", version="tensorboard"))
        except ModuleNotFoundError as exc:
            logger.warning("TensorBoard logging unavailable (%s); CSV only", exc)
    return loggers


class FinishRun(pl.Callback):
    """At the end of a completed run (every rank): final validation grid, EMA weights in, export."""

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        cfg = module.config
        if cfg.validation_prompt:
            ValidateEvery(cfg.output_dir, cfg.validation_steps).validate(trainer, module, "final")
        if module.ema is not None:  # diffusers' scripts export the EMA weights
            module.ema.copy_to(module.unet.parameters())
            module.ema = None
        export(trainer, module)


def trainer_kwargs(cfg: FineTuneConfig, max_steps: int, callbacks: list[pl.Callback] | None = None,
                   resumed_step: int | None = None, progress_bar: bool = True) -> dict[str, Any]:
    """`pl.Trainer` arguments of a run, except the placement (strategy, devices, nodes)."""
    cbs: list[pl.Callback] = [CheckpointEvery(cfg.output_dir, cfg.checkpointing_steps, cfg.checkpoints_total_limit)]
    if progress_bar:
        cbs.append(_progress_bar())
    if cfg.validation_prompt:
        cbs.append(ValidateEvery(cfg.output_dir, cfg.validation_steps))
    cbs += [*(callbacks or []), FinishRun()]
    return dict(
        precision=MIXED_PRECISION[cfg.mixed_precision], max_steps=max_steps, max_epochs=1,
        accumulate_grad_batches=cfg.gradient_accumulation_steps,
        gradient_clip_val=cfg.max_grad_norm or None, logger=_loggers(cfg, resumed_step), callbacks=cbs,
        enable_checkpointing=False, use_distributed_sampler=False, log_every_n_steps=1,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=cfg.output_dir,
        enable_progress_bar=progress_bar,
    )


def build_trainer(cfg: FineTuneConfig, max_steps: int, callbacks: list[pl.Callback] | None = None,
                  resumed_step: int | None = None, **overrides: Any) -> pl.Trainer:
    """The Lightning Trainer of a run (`overrides` go to `pl.Trainer`)."""
    from .. import recipes  # noqa: F401 - registers the strategy names

    if cfg.offload_dir:
        os.environ["SUITE_OFFLOAD_DIR"] = str(cfg.offload_dir)
    kwargs = trainer_kwargs(cfg, max_steps, callbacks, resumed_step, overrides.pop("enable_progress_bar", True))
    kwargs.update(accelerator="auto", devices=cfg.devices, num_nodes=cfg.num_nodes, strategy=cfg.strategy)
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def export(trainer: pl.Trainer, module: StableDiffusionFineTune) -> Path:
    """Write the final result into output_dir: LoRA weights, or the whole pipeline (EMA weights under use_ema).

    Call on every rank (gathering sharded weights is collective); rank 0 writes.
    """
    from ..diffusion.export import save_pipeline
    from ..diffusion.lora import save_lora_weights
    from ..diffusion.models import make_pipeline

    cfg, out = module.config, Path(module.config.output_dir)
    parts = materialize(module)
    if not trainer.is_global_zero:
        return out
    if cfg.lora:
        path = save_lora_weights(out, _lora_layers(module, parts))
    else:
        for name in ("unet", "vae", "text_encoder"):
            parts[name].to(torch.float32)
        pipe = make_pipeline({**parts, "tokenizer": module.tokenizer, "scheduler": module.noise_scheduler})
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
    return data, max_steps, ckpt, resumed_step


def fit_finetune(cfg: FineTuneConfig, callbacks: list[pl.Callback] | None = None, **trainer_overrides: Any) -> Any:
    """Run one fine-tuning as `suite diffusion finetune` does; returns the finished `StableDiffusionFineTune`."""
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
    strategy = "ddp" if cfg.strategy == "auto" else cfg.strategy
    return FitJob(module=module, datamodule=data, strategy=strategy, ckpt_path=ckpt,
                  trainer_kwargs=trainer_kwargs(cfg, max_steps, None, resumed_step, progress_bar=False))


def fit_with_ray(cfg: FineTuneConfig) -> Any:
    """`suite diffusion finetune --ray_address ...`: the same run on `num_workers` Ray Train workers."""
    import dataclasses
    import functools

    from .ray import RayConfig, fit_on_ray

    # Ray workers run in their own working folders: every path must be absolute.
    paths = ("output_dir", "train_data_dir", "instance_data_dir", "class_data_dir", "pretrained_model_name_or_path",
             "offload_dir")
    cfg = dataclasses.replace(cfg, **{k: os.path.abspath(getattr(cfg, k)) for k in paths
                                      if getattr(cfg, k) and os.path.exists(getattr(cfg, k))})
    if cfg.resume_from_checkpoint and cfg.resume_from_checkpoint != "latest":
        cfg = dataclasses.replace(cfg, resume_from_checkpoint=os.path.abspath(cfg.resume_from_checkpoint))
    workers = cfg.num_workers or cfg.devices * cfg.num_nodes
    _, max_steps, ckpt, resumed_step = _prepare(cfg, workers)
    build = functools.partial(_ray_job, cfg, max_steps, str(ckpt / CKPT_FILE) if ckpt else None, resumed_step)
    storage = os.path.join(cfg.output_dir, "ray")
    return fit_on_ray(build, RayConfig(address=cfg.ray_address, num_workers=workers, storage_path=storage,
                                       name="diffusion-finetune"))
