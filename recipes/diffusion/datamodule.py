"""`ImageCaptionData`: the LightningDataModule of the Stable Diffusion fine-tuning recipe.

Captioned images from an imagefolder, a dataset, DreamBooth's instance (+ class) folders or the built-in set, all
validated before training (`diffusion.data`); the sampler deals one epoch at a time as diffusers' scripts do (a
resumed run restarts its epoch from the first batch, `diffusion.schedule`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from ...diffusion.config import FineTuneConfig
from ...diffusion.data import (
    CaptionedImages,
    EpochBatchSampler,
    ImageRecord,
    scan_image_folder,
    scan_instance_folder,
    validate_records,
)

__all__ = ["ImageCaptionData"]

logger = logging.getLogger(__name__)


class ImageCaptionData(pl.LightningDataModule):
    """Captioned images from `train_data_dir`, DreamBooth instance (+ class) folders, or the built-in set.

    `scan()` validates every image before training (raising `InputError` for bad input). `length` (set by
    `fit_finetune`: `diffusion.schedule.run_length`) says how many batches each epoch goes through; without it
    every epoch is whole.
    """

    def __init__(self, config: FineTuneConfig, tokenizer: Any) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.records: list[ImageRecord] | None = None
        self.class_records: list[ImageRecord] | None = None
        self.length: Any = None

    def _train_dir(self) -> Path:
        if self.config.train_data_dir:
            return Path(self.config.train_data_dir)
        from ...diffusion.sample_data import write_sample_data

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
            from ...diffusion.data import scan_dataset

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
        # the scripts use min(found, --num_class_images) of them
        records = validate_records(found, cfg.data_config(), cfg.class_data_dir)
        self.class_records = records[: max(1, cfg.num_class_images)]
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
            from ...utils.fileio import atomic_write

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
        sampler = EpochBatchSampler(len(ds), cfg.train_batch_size, seed=cfg.seed, rank=trainer.global_rank,
                                    world_size=trainer.world_size,
                                    epoch_batches=self.length.epoch_batches if self.length else None)
        return torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=cfg.dataloader_num_workers)

    def state_dict(self) -> dict[str, Any]:
        # nothing to keep: a resumed run starts its epoch from the first batch (the epoch comes from the step)
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # older checkpoints hold "batches_consumed"; the scripts' resume does not use it

