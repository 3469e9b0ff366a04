"""The checkpoint-N/ folders of a fine-tuning run, as diffusers' scripts lay them out: `CheckpointEvery` writes
them (Lightning's state in `trainer_state.ckpt` plus the user-facing weights), `find_checkpoint` finds the one
`--resume_from_checkpoint` names.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from ...diffusion.errors import InputError
from .accelerate_checkpoint import is_accelerate_checkpoint
from .callbacks import at_step_boundary
from .export import write_weights

if TYPE_CHECKING:
    from .module import StableDiffusionFineTune

__all__ = ["CKPT_FILE", "CheckpointEvery", "checkpoint_step", "find_checkpoint"]

logger = logging.getLogger(__name__)

CKPT_FILE = "trainer_state.ckpt"
"""Lightning's state inside a checkpoint-N/ folder (a sharded strategy writes a folder of that name)."""
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def _is_checkpoint(path: Path) -> bool:
    """Ours (Lightning's state inside) or accelerate's (`save_state` of diffusers' scripts)."""
    return (path / CKPT_FILE).exists() or is_accelerate_checkpoint(path)


def find_checkpoint(output_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint folder `resume` names: `latest` (None when output_dir has none), a `checkpoint-N` name
    looked up inside output_dir (as diffusers' scripts do), or a path. Ours (`trainer_state.ckpt` inside) or
    accelerate's, written by diffusers' scripts (`optimizer.bin`, `scheduler.bin`, ...)."""
    if resume == "latest":
        found = sorted((int(m.group(1)), p) for p in Path(output_dir).glob("checkpoint-*")
                       if (m := _CKPT_RE.match(p.name)) and _is_checkpoint(p))
        return found[-1][1] if found else None
    path = Path(resume)
    inside = Path(output_dir) / path.name
    if not _is_checkpoint(path) and _CKPT_RE.match(path.name) and _is_checkpoint(inside):
        path = inside
    if not _is_checkpoint(path):
        raise InputError(f"{path}: not a checkpoint folder (no {CKPT_FILE} inside, nor accelerate's optimizer.bin "
                         f"and scheduler.bin, nor in {inside})")
    return path


def checkpoint_step(path: Path) -> int | None:
    """N of a checkpoint-N folder (None for a folder of another name)."""
    m = _CKPT_RE.match(path.name)
    return int(m.group(1)) if m else None


class CheckpointEvery(pl.Callback):
    """Writes `checkpoint-N/` every `every` steps atomically; with `limit`, first removes the oldest folders so
    that `limit - 1` remain, as diffusers' scripts do before each save."""

    def __init__(self, output_dir: str | Path, every: int, limit: int | None) -> None:
        self.output_dir, self.every, self.limit = Path(output_dir), every, limit
        self._last = -1

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step and step % self.every == 0 and step != self._last and at_step_boundary(trainer, batch_idx):
            self._last = step
            self.save(trainer, module, step)

    def save(self, trainer: pl.Trainer, module: StableDiffusionFineTune, step: int) -> Path:
        final = self.output_dir / f"checkpoint-{step}"
        tmp = self.output_dir / f".checkpoint-{step}.tmp"
        if trainer.is_global_zero:
            self._prune()
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        trainer.strategy.barrier("checkpoint-start")
        trainer.save_checkpoint(tmp / CKPT_FILE, weights_only=False)
        write_weights(module, tmp if trainer.is_global_zero else None)
        if trainer.is_global_zero:
            from ...diffusion.export import move_into

            staging = self.output_dir / f".checkpoint-{step}.stage"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            os.replace(tmp, staging / final.name)
            move_into(staging, self.output_dir, [final.name])
            staging.rmdir()
            logger.info("wrote %s", final)
            # Named before the barrier: a peer lost in it must not leave rank 0's advice on the moved .tmp path.
            self._note(trainer, final)
        trainer.strategy.barrier("checkpoint-end")
        self._note(trainer, final)
        return final

    @staticmethod
    def _note(trainer: pl.Trainer, final: Path) -> None:
        if hasattr(trainer.strategy, "note_checkpoint"):  # the sharded strategies' fault advice names it
            trainer.strategy.note_checkpoint(final, "--resume_from_checkpoint latest")

    def save_on_signal(self, trainer: pl.Trainer, module: StableDiffusionFineTune) -> Path:
        """On SIGTERM the sharded strategies save through here: this step's checkpoint-N/ (unless just written)."""
        if trainer.global_step != self._last:
            self._last = trainer.global_step
            self.save(trainer, module, trainer.global_step)
        return self.output_dir / f"checkpoint-{trainer.global_step}"

    def _prune(self) -> None:
        """The scripts' rule: before a save, with `limit` or more checkpoint folders, remove the oldest
        `len - limit + 1` of them."""
        if self.limit is None:
            return
        found = sorted((int(m.group(1)), p) for p in self.output_dir.iterdir() if (m := _CKPT_RE.match(p.name)))
        if len(found) >= self.limit:
            removing = [p for _, p in found[: len(found) - self.limit + 1]]
            logger.info("%d checkpoints already exist, removing %d checkpoints: %s", len(found), len(removing),
                        ", ".join(p.name for p in removing))
            for path in removing:
                shutil.rmtree(path, ignore_errors=True)
