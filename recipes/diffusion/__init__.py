"""The Stable Diffusion fine-tuning recipe, one room per part:

| module | holds |
|---|---|
| `module` | `StableDiffusionFineTune`, the LightningModule (loss, optimizer, image generation) |
| `datamodule` | `ImageCaptionData`, the LightningDataModule (validated images, resumable sampler) |
| `checkpoints` | the checkpoint-N/ folders: `CheckpointEvery` writes them, `find_checkpoint` finds one |
| `callbacks` | validation images, progress lines, the end of a run (`ValidateEvery`, `PlainProgress`, `FinishRun`) |
| `export` | the trained weights gathered and written (`materialize`, `write_component`, `export`) |
| `launch` | one run: checks, the Trainer holding `cfg.parallel`, local and Ray fit (`fit_finetune`, `fit_with_ray`) |
| `accelerate_checkpoint` | resuming from accelerate's checkpoint-N/ of diffusers' own scripts |
| `sdxl`, `sdxl_data`, `sdxl_precompute` | SDXL: its LightningModule and `fit_sdxl`; its data; `--precompute` |

The modules import downwards only: `module` and `datamodule` import none of the others; `export`,
`accelerate_checkpoint`, `callbacks`, `checkpoints` and `launch` build on them, in that order; the SDXL modules
on all of these.

    from lowmem.recipes import StableDiffusionFineTune, ImageCaptionData
    cfg = FineTuneConfig(rank=4, max_train_steps=100, output_dir="out")
    model = StableDiffusionFineTune(cfg); data = ImageCaptionData(cfg, model.tokenizer)
    Trainer(max_steps=100, strategy="zero2").fit(model, data)

`fit_finetune(cfg)` does what `suite diffusion finetune` does: the Trainer with the callbacks, resume, export.
"""

from __future__ import annotations

from .callbacks import FinishRun, PlainProgress, ValidateEvery
from .checkpoints import CKPT_FILE, CheckpointEvery, find_checkpoint
from .datamodule import ImageCaptionData
from .export import materialize, write_component
from .launch import (
    build_strategy,
    build_trainer,
    check_run,
    fit_finetune,
    fit_with_ray,
    trainer_kwargs,
)
from .module import StableDiffusionFineTune

# `export` (the function) stays in its module: here the name is the submodule's.
__all__ = ["CKPT_FILE", "CheckpointEvery", "FinishRun", "ImageCaptionData", "PlainProgress",
           "StableDiffusionFineTune", "ValidateEvery", "build_strategy", "build_trainer", "check_run",
           "find_checkpoint", "fit_finetune", "fit_with_ray", "materialize", "trainer_kwargs",
           "write_component"]
