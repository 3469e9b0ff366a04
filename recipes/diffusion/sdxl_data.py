"""The data of the SDXL fine-tuning recipe: `SDXLCaptionedImages` (both tokenizers' ids, original sizes and crop
corners of each sample), `SDXLCachedLatents` (the same over pre-computed latents), `SDXLData` (the
LightningDataModule), and `sdxl_settings` (a run's `SDXLSettings`). The LightningModule is `sdxl`'s, the
pre-computation `sdxl_precompute`'s; both read these.
"""

from __future__ import annotations

from typing import Any

import torch

from ...diffusion.config import FineTuneConfig
from ...diffusion.data import CaptionedImages, ImageRecord, load_rgb, preprocess
from ...diffusion.errors import InputError
from ...diffusion.sdxl_scripts import SDXLSettings
from .datamodule import ImageCaptionData

__all__ = ["SDXLCachedLatents", "SDXLCaptionedImages", "SDXLData", "sdxl_settings"]


def sdxl_settings(cfg: FineTuneConfig) -> SDXLSettings:
    """The run's SDXL settings (`cfg.extra["sdxl"]`, defaults when absent)."""
    return cfg.extra.get("sdxl") or SDXLSettings()


class SDXLCaptionedImages(CaptionedImages):
    """`CaptionedImages` for SDXL: token ids of both tokenizers (`input_ids`, `input_ids_2`), the image's
    original size `[2]` (h, w) and the crop's top-left corner `[2]` (y, x) on the resized image, as the SDXL
    scripts condition on them; a share `empty_prompts` of captions is the empty prompt."""

    def __init__(self, records: list[ImageRecord], tokenizers: tuple[Any, Any], cfg: Any,
                 class_records: list[ImageRecord] | None = None, empty_prompts: float = 0.0) -> None:
        super().__init__(records, tokenizers[0], cfg, class_records)
        self.tokenizer_2, self.empty_prompts = tokenizers[1], empty_prompts

    def _crop_corner(self, size: tuple[int, int], generator: torch.Generator) -> tuple[int, int]:
        """The (top, left) corner `preprocess` crops at from an image of `size` (w, h), given the generator state
        it will start from (its draws, replayed)."""
        r, (w, h) = self.cfg.resolution, size
        scale = r / min(w, h)
        nw, nh = max(r, round(w * scale)), max(r, round(h * scale))
        if self.cfg.center_crop:
            return (nh - r) // 2, (nw - r) // 2
        draws = torch.rand(3, generator=generator).tolist()
        return int(draws[1] * (nh - r + 1)), int(draws[0] * (nw - r + 1))

    def sample(self, record: ImageRecord, generator: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
        """One sample of `record` drawn from `generator`: pixels, both tokenizers' ids, original size and crop
        corner, each key prefixed by `prefix` (`class_` for a class image)."""
        try:
            img = load_rgb(record.path)
        except Exception as exc:  # noqa: BLE001 - the file changed after the scan
            raise InputError(f"{record.path}: unreadable image ({type(exc).__name__}: {exc})") from exc
        replay = torch.Generator().set_state(generator.get_state())
        corner = self._crop_corner(img.size, replay)
        pixels = preprocess(img, self.cfg, generator)
        ids = self.caption_ids(record, generator)
        return {f"{prefix}pixel_values": pixels, f"{prefix}input_ids": ids[0], f"{prefix}input_ids_2": ids[1],
                f"{prefix}original_size": torch.tensor([img.height, img.width]),
                f"{prefix}crop_top_left": torch.tensor(corner)}

    def caption_ids(self, record: ImageRecord, generator: torch.Generator) -> list[torch.Tensor]:
        """Both tokenizers' ids `[L]` of the record's caption for this sample: one of several drawn, or (a share
        `empty_prompts` of samples) the empty prompt."""
        caption = record.caption
        if not isinstance(caption, str):  # several captions: one per sample, drawn after the crop and flip
            caption = caption[int(torch.randint(len(caption), (1,), generator=generator))]
        if self.empty_prompts and float(torch.rand(1, generator=generator)) < self.empty_prompts:
            caption = ""
        return self.tokenize(caption)

    def tokenize(self, caption: str) -> list[torch.Tensor]:
        """Both tokenizers' ids `[L]` of `caption`, padded to the model length as the scripts tokenize."""
        return [tok(caption, padding="max_length", truncation=True, max_length=tok.model_max_length,
                    return_tensors="pt").input_ids[0] for tok in (self.tokenizer, self.tokenizer_2)]

    def prompts(self) -> list[str]:
        """Every prompt a sample can carry (each record's captions, the empty prompt when drawn)."""
        out: list[str] = [""] if self.empty_prompts else []
        for r in (*self.records, *self.class_records):
            out.extend([r.caption] if isinstance(r.caption, str) else r.caption)
        return out

    def __getitem__(self, key: tuple[int, int] | int) -> dict[str, torch.Tensor]:
        index, seed = key if isinstance(key, tuple) else (key, key)
        generator = torch.Generator().manual_seed(seed)
        item = self.sample(self.records[index % len(self.records)], generator, "")
        if self.class_records:
            item.update(self.sample(self.class_records[index % len(self.class_records)], generator, "class_"))
        return item


class SDXLCachedLatents(SDXLCaptionedImages):
    """`SDXLCaptionedImages` whose images were encoded once (`precompute_latents`): an item holds the record's
    stored `latents` with the original size and crop corner they were made with (one crop and flip per image, as
    train_text_to_image_sdxl.py's `dataset.map` fixes them); the caption is still drawn per sample."""

    def __init__(self, base: SDXLCaptionedImages, stores: tuple[Any, Any | None]) -> None:
        super().__init__(base.records, (base.tokenizer, base.tokenizer_2), base.cfg, base.class_records,
                         base.empty_prompts)
        self.stores = stores

    def __getitem__(self, key: tuple[int, int] | int) -> dict[str, torch.Tensor]:
        index, seed = key if isinstance(key, tuple) else (key, key)
        generator = torch.Generator().manual_seed(seed)
        item: dict[str, torch.Tensor] = {}
        for prefix, records, store in (("", self.records, self.stores[0]), ("class_", self.class_records,
                                                                            self.stores[1])):
            if not records:
                continue
            row = index % len(records)
            ids = self.caption_ids(records[row], generator)
            item.update({f"{prefix}{k}": v for k, v in store.get(row).items()})
            item.update({f"{prefix}input_ids": ids[0], f"{prefix}input_ids_2": ids[1]})
        return item


class SDXLData(ImageCaptionData):
    """`ImageCaptionData` giving SDXL samples; DreamBooth's instance images repeated `--repeats` times."""

    def scan(self) -> list[ImageRecord]:
        if self.records is None:
            records = super().scan()
            self.records = records * sdxl_settings(self.config).repeats
        return self.records

    def dataset(self) -> CaptionedImages:
        module = self.trainer.lightning_module
        ds = SDXLCaptionedImages(self.scan(), (module.tokenizer, module.tokenizer_2), self.config.data_config(),
                                 self.class_records, sdxl_settings(self.config).proportion_empty_prompts)
        stores = getattr(module, "latent_stores", None)
        return ds if stores is None else SDXLCachedLatents(ds, stores)
