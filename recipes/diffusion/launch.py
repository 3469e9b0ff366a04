"""One fine-tuning run, as `suite diffusion finetune` runs it: the checks before anything loads (`check_run`), the
Trainer with its strategy, loggers and callbacks (`build_trainer`), resume, and the fit itself, locally
(`fit_finetune`) or on Ray Train workers (`fit_with_ray`).

The sharding config (`ZeroConfig | GeminiConfig | None`) is the config's own, `cfg.parallel`: built once with
the `FineTuneConfig`, from `parallel` or from `--strategy` and `--offload_dir`, and validated there. Here it is
handed unchanged to the strategy object (`strategy.config`), locally and on Ray.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from ...diffusion.config import MIXED_PRECISION, FineTuneConfig
from ...diffusion.errors import InputError
from ...diffusion.schedule import RunLength, run_length
from ..strategies import STRATEGY_NAMES, strategy_from_config
from .accelerate_checkpoint import check_files, lightning_checkpoint
from .callbacks import FinishRun, PlainProgress, TierTraffic, ValidateEvery, progress_bar_callback
from .checkpoints import CKPT_FILE, CheckpointEvery, checkpoint_step, find_checkpoint
from .datamodule import ImageCaptionData
from .module import EVAL_MODE_WARNING, StableDiffusionFineTune

__all__ = ["build_strategy", "build_trainer", "check_run", "fit_finetune", "fit_with_ray", "trainer_kwargs"]

logger = logging.getLogger(__name__)


# -- before anything loads --------------------------------------------------------------------------------------
def check_run(cfg: FineTuneConfig, family: str = "sd") -> None:
    """Refuse, with one line, settings that cannot run here; called before any data or model is loaded. `family`:
    the model family the run trains (`sd`, `sdxl`): a pipeline folder of another one is refused."""
    _check_strategy_name(cfg.strategy)
    _check_model_folder(cfg, family)
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
    if cfg.with_prior_preservation and cfg.sample_batch_size < 1 and _class_images(cfg) < cfg.num_class_images:
        raise InputError(f"--sample_batch_size {cfg.sample_batch_size}: class images are to be generated "
                         f"(--num_class_images {cfg.num_class_images}), which needs a batch size >= 1")


def _check_model_folder(cfg: FineTuneConfig, family: str) -> None:
    """The base folder's family, scheduler and VAE (`diffusion.folders`), from their configs; the tiny built-in
    pipeline and single files (diffusers' own SD configs) need no check."""
    from ...diffusion.folders import check_model_folder
    from ...diffusion.models import resolve_pretrained

    if cfg.pretrained_model_name_or_path is None:
        return
    folder = resolve_pretrained(cfg.pretrained_model_name_or_path, revision=cfg.revision, cache_dir=cfg.cache_dir)
    if not folder.is_dir():
        return
    vae = getattr((cfg.extra or {}).get("sdxl"), "pretrained_vae_model_name_or_path", None)
    check_model_folder(folder, family, vae_folder=resolve_pretrained(vae, cache_dir=cfg.cache_dir) if vae else None,
                       prediction_type=cfg.prediction_type, lora=cfg.lora, dreambooth=cfg.dreambooth)


def _class_images(cfg: FineTuneConfig) -> int:
    folder = Path(cfg.class_data_dir)
    return len([p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg")]) if folder.is_dir() else 0


def _check_strategy_name(name: str) -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    # ours by their table (no registration needed), Lightning's from its registry
    names = sorted({*STRATEGY_NAMES, *StrategyRegistry.available_strategies()})
    if name not in names:
        import difflib

        close = difflib.get_close_matches(name, names, n=1)
        hint = f"; did you mean {close[0]}?" if close else f" (known: {', '.join(names)})"
        raise InputError(f"--strategy {name}: no such strategy{hint}")


def _check_non_ema_revision(cfg: FineTuneConfig) -> None:
    """--non_ema_revision names a revision of the hub id that is in the local cache (one line otherwise)."""
    from ...diffusion.models import resolve_pretrained

    if cfg.pretrained_model_name_or_path is None:
        raise InputError(f"--non_ema_revision {cfg.non_ema_revision}: applies to a hub id "
                         "(--pretrained_model_name_or_path), not to the tiny built-in pipeline")
    resolve_pretrained(cfg.pretrained_model_name_or_path, revision=cfg.non_ema_revision, cache_dir=cfg.cache_dir,
                       flag="--non_ema_revision")


def _prepare(cfg: FineTuneConfig, world: int, data_cls: type[ImageCaptionData] = ImageCaptionData,
             ) -> tuple[ImageCaptionData, RunLength, Path | None]:
    """Validate the data (before any model is built), find the checkpoint to resume and count the run as diffusers'
    scripts do (`diffusion.schedule`); a run that would train nothing is refused in one line."""
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    ckpt = find_checkpoint(cfg.output_dir, cfg.resume_from_checkpoint) if cfg.resume_from_checkpoint else None
    if cfg.resume_from_checkpoint and ckpt is None:
        logger.info("checkpoint %r does not exist in %s; starting a new training run", cfg.resume_from_checkpoint,
                    cfg.output_dir)
    start = 0
    if ckpt is not None:
        found = checkpoint_step(ckpt)
        if found is None:
            raise InputError(f"--resume_from_checkpoint {ckpt}: the step is read from the folder's name, "
                             "checkpoint-N (as diffusers' scripts read it)")
        start = found
        if not (ckpt / CKPT_FILE).exists():  # accelerate's, from diffusers' scripts: its files, before any model
            check_files(ckpt, cfg)
    data = data_cls(cfg, tokenizer=None)
    samples = len(data.scan())
    if cfg.with_prior_preservation:  # DreamBooth's data set is as long as the longer of instance and class images
        samples = max(samples, cfg.num_class_images)
    length = run_length(samples, cfg.train_batch_size, world, cfg.gradient_accumulation_steps, cfg.max_train_steps,
                        cfg.num_train_epochs, start)
    if length.trains_nothing:
        given = f"--resume_from_checkpoint {ckpt.name}: " if ckpt is not None else ""
        raise InputError(f"{given}{length.describe_nothing()}")
    if ckpt is not None:
        logger.info("resuming from %s (step %d, epoch %d from its first batch; the run ends at step %d)", ckpt,
                    start, length.first_epoch, length.end_step)
    data.length = length
    return data, length, ckpt


# -- the Trainer ------------------------------------------------------------------------------------------------
def trainer_kwargs(cfg: FineTuneConfig, length: RunLength | int, callbacks: list[pl.Callback] | None = None,
                   resumed_step: int | None = None, progress_bar: bool = True) -> dict[str, Any]:
    """`pl.Trainer` arguments of a run, except the placement (strategy, devices, nodes). `length` is the run's
    `RunLength` (the scripts' epochs; the run ends at its end_step), or a number of steps over as many epochs as
    they take."""
    max_steps, max_epochs = ((length, -1) if isinstance(length, int)
                             else (length.end_step, length.num_train_epochs))
    from ..shared_output import SharedOutputCheck  # issue 37: every rank sees output_dir (multi-node runs)
    cbs: list[pl.Callback] = [SharedOutputCheck(cfg.output_dir),
                              CheckpointEvery(cfg.output_dir, cfg.checkpointing_steps, cfg.checkpoints_total_limit)]
    if progress_bar:
        cbs.append(progress_bar_callback())
    if not sys.stdout.isatty():
        cbs.append(PlainProgress(cfg.log_every_n_steps))
    if cfg.prompts:
        cbs.append(ValidateEvery(cfg.output_dir, cfg.validation_steps))
    cbs += [TierTraffic(), *(callbacks or []), FinishRun()]
    return dict(
        precision=MIXED_PRECISION[cfg.mixed_precision], max_steps=max_steps, max_epochs=max_epochs,
        accumulate_grad_batches=cfg.gradient_accumulation_steps,
        gradient_clip_val=cfg.optimizer.max_grad_norm or None, logger=_loggers(cfg, resumed_step), callbacks=cbs,
        enable_checkpointing=False, use_distributed_sampler=False, log_every_n_steps=1,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=cfg.output_dir,
        enable_progress_bar=progress_bar,
    )


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


def build_strategy(cfg: FineTuneConfig) -> Any:
    """The Trainer's `strategy`: the sharded strategy holding `cfg.parallel` (the run's sharding config, the object
    itself: no registry lookup, no environment variable), or `--strategy`'s name as is when it shards nothing here
    (auto, ddp, Lightning's own). The sharded ones keep their checkpoint-N/ folders sharded (every rank writes its
    part; the frozen base is left out), not the one full file that is the strategies' default."""
    return cfg.strategy if cfg.parallel is None else strategy_from_config(cfg.parallel, state_dict_type="sharded")


def build_trainer(cfg: FineTuneConfig, length: RunLength | int, callbacks: list[pl.Callback] | None = None,
                  resumed_step: int | None = None, **overrides: Any) -> pl.Trainer:
    """The Lightning Trainer of a run (`overrides` go to `pl.Trainer`)."""
    if cfg.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # a progress bar only where a terminal shows it; elsewhere PlainProgress writes lines
    bar = overrides.pop("enable_progress_bar", sys.stderr.isatty())
    kwargs = trainer_kwargs(cfg, length, callbacks, resumed_step, bar)
    kwargs.update(accelerator="auto", devices=cfg.devices, num_nodes=cfg.num_nodes,
                  strategy=build_strategy(cfg))
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


# -- the fit --------------------------------------------------------------------------------------------------
FIT_WARNINGS = (
    # a resumed run restarts its epoch from the first batch, as diffusers' scripts do (diffusion.schedule)
    "You're resuming from a checkpoint that ended before the epoch",
    # Lightning flags every module in eval mode; the frozen ones are on purpose (the module checks the trained)
    EVAL_MODE_WARNING,
)
"""Lightning's warnings a fine-tuning silences, on one process as on Ray's workers (`FitJob.ignore_warnings`)."""


def fit_finetune(cfg: FineTuneConfig, callbacks: list[pl.Callback] | None = None, *,
                 module_cls: type[StableDiffusionFineTune] = StableDiffusionFineTune,
                 data_cls: type[ImageCaptionData] = ImageCaptionData, **trainer_overrides: Any) -> Any:
    """Run one fine-tuning as `suite diffusion finetune` does; returns the finished module. `module_cls` and
    `data_cls` give another model family the same run (checks, run length, resume, Trainer): SDXL's."""
    check_run(cfg, module_cls.family)
    data, length, ckpt = _prepare(cfg, cfg.devices * cfg.num_nodes, data_cls)
    # as the scripts' set_seed(args.seed) before the models load: LoRA's random initial weights follow the seed,
    # not whatever the process drew before (a second run in one process, a library caller)
    torch.manual_seed(cfg.seed)
    module = module_cls(cfg)
    module.length = length
    data.tokenizer = module.tokenizer
    trainer = build_trainer(cfg, length, callbacks, length.start_step if ckpt else None, **trainer_overrides)
    ckpt_path, converted = (str(ckpt / CKPT_FILE), None) if ckpt and (ckpt / CKPT_FILE).exists() else (None, None)
    if ckpt is not None and ckpt_path is None:  # accelerate's, from diffusers' scripts: made a Lightning file
        converted = _from_accelerate(ckpt, module, trainer, length.start_step)
        ckpt_path = str(converted)
    try:
        with warnings.catch_warnings():
            for message in FIT_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path, weights_only=True)
    finally:
        if converted is not None:
            converted.unlink(missing_ok=True)
    return module


def _from_accelerate(ckpt: Path, module: StableDiffusionFineTune, trainer: pl.Trainer, step: int) -> Path:
    """accelerate's checkpoint-N of diffusers' scripts as a Lightning checkpoint file beside it in output_dir
    (each process writes its own, atomically, and removes it after the fit)."""
    from ...utils.fileio import atomic_write

    state = lightning_checkpoint(ckpt, module, trainer, step)
    path = Path(module.config.output_dir) / f".resume-{ckpt.name}-{os.getpid()}.ckpt"
    with atomic_write(path, "wb") as f:
        torch.save(state, f)
    logger.info("resuming accelerate's %s (diffusers' scripts): weights, optimizer and LR scheduler state", ckpt)
    return path


def _ray_job(cfg: FineTuneConfig, parallel: Any, length: RunLength, ckpt: str | None) -> Any:
    """The job every Ray worker builds (module-level, so cloudpickle sends it by reference); `parallel` is the
    driver's sharding config (`cfg.parallel`, its NVMe folder absolute), sent as is."""
    from ..ray import FitJob

    module = StableDiffusionFineTune(cfg)
    module.length = length
    data = ImageCaptionData(cfg, module.tokenizer)
    data.length = length
    strategy = parallel if parallel is not None else "ddp" if cfg.strategy == "auto" else cfg.strategy
    return FitJob(module=module, datamodule=data, strategy=strategy, ckpt_path=ckpt, ignore_warnings=FIT_WARNINGS,
                  trainer_kwargs=trainer_kwargs(cfg, length, None, length.start_step if ckpt else None,
                                                progress_bar=False))


def fit_with_ray(cfg: FineTuneConfig) -> Any:
    """`suite diffusion finetune --ray_address ...`: the same run on `num_workers` Ray Train workers."""
    from ..ray import RayConfig, fit_on_ray

    # Ray workers run in their own working folders: every path must be absolute.
    paths = ("output_dir", "train_data_dir", "instance_data_dir", "class_data_dir", "pretrained_model_name_or_path",
             "cache_dir", "tokenizer_name", "dataset_name")
    cfg = dataclasses.replace(cfg, **{k: os.path.abspath(getattr(cfg, k)) for k in paths
                                      if getattr(cfg, k) and os.path.exists(getattr(cfg, k))})
    if cfg.resume_from_checkpoint and cfg.resume_from_checkpoint != "latest":
        cfg = dataclasses.replace(cfg, resume_from_checkpoint=os.path.abspath(cfg.resume_from_checkpoint))
    check_run(cfg)
    if cfg.ray_address not in ("local", "auto"):  # before any work: a wrong address is one line within seconds
        from ...utils.ray_cluster import check_ray_address

        check_ray_address(cfg.ray_address)
    parallel = cfg.parallel
    if getattr(parallel, "offload_dir", None):  # a Gemini config's NVMe folder, as the paths above
        parallel = dataclasses.replace(parallel, offload_dir=os.path.abspath(parallel.offload_dir))
    workers = cfg.num_workers or cfg.devices * cfg.num_nodes
    _, length, ckpt = _prepare(cfg, workers)
    if ckpt is not None and not (ckpt / CKPT_FILE).exists():
        raise InputError(f"--resume_from_checkpoint {ckpt}: accelerate's checkpoints (diffusers' scripts) resume "
                         "without --ray_address; resume it locally for a step, then on Ray from its checkpoint")
    build = functools.partial(_ray_job, cfg, parallel, length, str(ckpt / CKPT_FILE) if ckpt else None)
    storage = os.path.join(cfg.output_dir, "ray")
    return fit_on_ray(build, RayConfig(address=cfg.ray_address, num_workers=workers, storage_path=storage,
                                       name="diffusion-finetune"))
