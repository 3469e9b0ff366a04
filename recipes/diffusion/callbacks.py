"""The callbacks of a fine-tuning run besides the checkpoints (`checkpoints.CheckpointEvery`): validation images
(`ValidateEvery`), plain progress lines for log files (`PlainProgress`) or a progress bar
(`progress_bar_callback`), what each step moved between memory tiers and the disk (`TierTraffic`), and the end of
a completed run (`FinishRun`: export, then the final validation).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from .export import export

if TYPE_CHECKING:
    from .module import StableDiffusionFineTune

__all__ = ["FinishRun", "PlainProgress", "TierTraffic", "ValidateEvery", "at_step_boundary", "disk_io_bytes",
           "progress_bar_callback"]

logger = logging.getLogger(__name__)


def at_step_boundary(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether batch `batch_idx` ended an optimizer step (the last micro-batch of its accumulation, or of the
    epoch, where the scripts' accelerate steps too)."""
    if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
        return True
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


class ValidateEvery(pl.Callback):
    """Generates `num_validation_images` of each validation prompt every `every` steps; rank 0 writes a PNG
    grid per prompt. The images come from the weights that would be exported (the EMA weights under
    --use_ema) under the training dtype's autocast; a failure is logged and never stops the run."""

    def __init__(self, output_dir: str | Path, every: int) -> None:
        self.folder, self.every = Path(output_dir) / "validation", every
        self.epochs: int | None = None
        self._last = -1

    def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
        self.epochs = module.config.validation_epochs or None

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self.epochs is None and step and step % self.every == 0 and step != self._last \
                and at_step_boundary(trainer, batch_idx):
            self._last = step
            self.validate(trainer, module, f"step-{step:06d}")

    def on_train_epoch_end(self, trainer: pl.Trainer, module: Any) -> None:
        # diffusers' text-to-image scripts: after epoch e's loop (0-based; a loop cut short by max_train_steps
        # included) when e % validation_epochs == 0, so the first epoch is always validated.
        epoch = trainer.current_epoch
        if self.epochs is not None and epoch % self.epochs == 0 and trainer.global_step != self._last:
            self._last = trainer.global_step
            self.validate(trainer, module, f"epoch-{epoch:04d}")

    def validate(self, trainer: pl.Trainer, module: StableDiffusionFineTune, name: str) -> None:
        from ...diffusion.export import save_grid

        cfg = module.config
        if cfg.num_validation_images < 1:  # diffusers' scripts: range(0) images, nothing logged
            return
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
        if not trainer.is_global_zero or step == self._last or not at_step_boundary(trainer, batch_idx):
            return
        if step % self.every and step != trainer.max_steps:
            return
        self._last = step
        t0, s0 = self._start or (time.perf_counter(), 0)
        elapsed, done = time.perf_counter() - t0, max(step - s0, 1)
        eta = int(elapsed / done * max(trainer.max_steps - step, 0))
        m = trainer.callback_metrics
        loss, ips, lr = (float(m[k]) if k in m else float("nan") for k in ("train_loss", "images_per_s", "lr"))
        print(f"step {step}/{trainer.max_steps} loss {loss:.4f} images/s {ips:.3g} lr {lr:.3g} "
              f"ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}", file=self.stream or sys.stdout, flush=True)


def disk_io_bytes() -> tuple[int, int] | None:
    """(read, written) bytes this process (all its threads) made the storage layer move (`/proc/self/io`'s
    read_bytes and write_bytes: page cache hits excluded, writes counted when dirtied); None where not readable."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


class TierTraffic(pl.Callback):
    """Per optimizer step, logged beside the loss (so in the CSV log): the MiB this process read from and wrote to
    the disk (`disk_read_mib`, `disk_write_mib`, from `disk_io_bytes`), and under Gemini the MiB its ledger moved
    between tiers in the step (`tier_mib/<src>-><dst>`, `memory_report()["traffic_last_step"]`) and the depth its
    reads ahead go to next (`prefetch_depth`)."""

    def __init__(self) -> None:
        self._io: tuple[int, int] | None = None
        self._routes: set[str] = set()  # every route seen: a step that moved nothing on one logs 0, not the last value

    def on_train_start(self, trainer: pl.Trainer, module: Any) -> None:
        self._io = disk_io_bytes()

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not at_step_boundary(trainer, batch_idx):
            return
        io, metrics = disk_io_bytes(), {}
        if io is not None and self._io is not None:
            metrics["disk_read_mib"] = (io[0] - self._io[0]) / 2**20
            metrics["disk_write_mib"] = (io[1] - self._io[1]) / 2**20
        self._io = io
        report = getattr(trainer.strategy.model, "memory_report", None)
        if callable(report):
            got = report()
            moved = got.get("traffic_last_step", {})
            self._routes.update(moved)
            for route in self._routes:
                metrics[f"tier_mib/{route}"] = moved.get(route, 0) / 2**20
            if "prefetch_depth" in got:
                metrics["prefetch_depth"] = got["prefetch_depth"]
        for name, value in metrics.items():
            module.log(name, float(value), on_step=True, on_epoch=False)


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


def progress_bar_callback() -> pl.Callback:
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
