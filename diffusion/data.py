"""Captioned image data: scanning and validating local folders, image preprocessing, a resumable sampler.

Folder formats (the ones diffusers' training scripts read, as `datasets`' imagefolder accepts them):
- an imagefolder with `metadata.jsonl` (one JSON object per line) or `metadata.csv` (a header row), each
  record with `file_name` and a caption column; a list-valued caption gives one caption picked at random
  per sample (seeded), as diffusers does;
- images with same-name `.txt` captions (`cat.png` + `cat.txt`);
- DreamBooth: every image of `--instance_data_dir` gets `--instance_prompt` (and the class images
  `--class_prompt`).

Every image is opened and decoded once while scanning, so a bad file stops the run before training with
one line naming it (or is skipped with a warning when `skip_bad_images` is set). Grayscale, palette, RGBA,
CMYK and 16-bit images are converted to 8-bit RGB (transparency over white), and the EXIF orientation is
applied (a phone photo stored sideways trains upright); images smaller than the resolution are upscaled,
as diffusers' resize does.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from .errors import InputError

__all__ = [
    "IMAGE_SUFFIXES",
    "CaptionedImages",
    "DataConfig",
    "ImageRecord",
    "EpochBatchSampler",
    "StepBatchSampler",
    "load_rgb",
    "preprocess",
    "scan_dataset",
    "scan_image_folder",
    "scan_instance_folder",
    "validate_records",
]

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


@dataclass(kw_only=True)
class DataConfig:
    """How images become training tensors."""

    resolution: int = 32
    """Side of the square training images in pixels (a multiple of 8)."""
    center_crop: bool = False
    """Crop the centre after resizing; otherwise a random crop."""
    random_flip: bool = False
    """Flip each image horizontally with probability 1/2."""
    image_column: str = "image"
    """metadata.jsonl key holding the image path when it is not `file_name`."""
    caption_column: str | None = "text"
    """metadata.jsonl key holding the caption; None: none, every image gets `default_caption`."""
    default_caption: str | None = None
    """The caption of an image whose caption is missing, null or empty, and of every image when `caption_column`
    is None: DreamBooth's instance prompt with `--dataset_name` (train_dreambooth_lora_sdxl.py's custom captions)."""
    skip_bad_images: bool = False
    """Skip unreadable images with a warning instead of stopping."""
    max_length: int = 77
    """Token length every caption is padded or truncated to."""
    attention_mask: bool = False
    """Also give each caption's attention mask (`attention_mask`, `class_attention_mask`: 1 for tokens, 0 for
    padding)."""
    interpolation: str = "bilinear"
    """Resampling filter of the resize (torchvision's InterpolationMode names)."""

    def __post_init__(self) -> None:
        if self.resolution < 8 or self.resolution % 8:
            raise ValueError(f"resolution must be a positive multiple of 8, got {self.resolution}")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        for name in ("image_column", "caption_column"):
            if not getattr(self, name) and (name == "image_column" or self.caption_column is not None):
                raise ValueError(f"{name} must be a non-empty string")
        if self.interpolation not in _RESAMPLING:
            raise ValueError(f"interpolation must be one of {', '.join(_RESAMPLING)}, got {self.interpolation!r}")


_RESAMPLING = {"nearest": "NEAREST", "nearest_exact": "NEAREST", "bilinear": "BILINEAR", "bicubic": "BICUBIC",
               "box": "BOX", "hamming": "HAMMING", "lanczos": "LANCZOS"}


@dataclass(frozen=True)
class ImageRecord:
    """One training image and its caption (or captions, one drawn per sample); `source` says where the pair
    was declared (for messages)."""

    path: Path
    caption: str | tuple[str, ...]
    source: str


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _check_folder(folder: Path, flag: str) -> None:
    if not folder.exists():
        raise InputError(f"{folder}: no such folder ({flag})")
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder ({flag})")


def _metadata_record(folder: Path, meta: Path, lineno: int, line: str, cfg: DataConfig) -> ImageRecord:
    where = f"{meta}:{lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return _row_record(folder, where, row, cfg)


def _caption(row: dict[str, Any], where: str, cfg: DataConfig) -> Any:
    """The caption of a metadata or dataset row: `cfg.default_caption` where the row has none (no caption column,
    the key missing, null or empty), as train_dreambooth_lora_sdxl.py gives such images the instance prompt."""
    if cfg.caption_column is None:
        return cfg.default_caption
    if cfg.caption_column not in row and cfg.default_caption is None:
        raise InputError(f"{where}: missing caption column '{cfg.caption_column}' (keys: {', '.join(row)})")
    caption = row.get(cfg.caption_column)
    return cfg.default_caption if cfg.default_caption is not None and caption in (None, "", []) else caption


def _row_record(folder: Path, where: str, row: dict[str, Any], cfg: DataConfig) -> ImageRecord:
    name = row.get("file_name", row.get(cfg.image_column))
    if not isinstance(name, str) or not name:
        raise InputError(f"{where}: missing 'file_name'")
    caption = _caption(row, where, cfg)
    if isinstance(caption, list) and caption and all(isinstance(c, str) for c in caption):
        caption = tuple(caption)
    elif not isinstance(caption, str):
        raise InputError(f"{where}: caption '{cfg.caption_column}' must be a string or a non-empty list of "
                         f"strings, got {type(caption).__name__}")
    path = folder / name
    if not path.is_file():
        raise InputError(f"{where}: image file '{name}' does not exist in {folder}")
    return ImageRecord(path=path, caption=caption, source=where)


def _require_caption_column(meta: Path, rows: list[dict[str, Any]], cfg: DataConfig) -> None:
    """With a default caption a row may lack the caption, but the column must be somewhere (the script's
    `--caption_column` check of the dataset's columns)."""
    if cfg.caption_column is not None and not any(cfg.caption_column in row for row in rows):
        raise InputError(f"{meta}: no column '{cfg.caption_column}' (--caption_column; columns: "
                         f"{', '.join(dict.fromkeys(k for row in rows for k in row))})")


def scan_image_folder(folder: str | Path, cfg: DataConfig) -> list[ImageRecord]:
    """Records of a `--train_data_dir` (metadata.jsonl, or `.txt` captions beside the images)."""
    folder = Path(folder)
    _check_folder(folder, "--train_data_dir")
    meta = folder / "metadata.jsonl"
    if meta.is_file():
        lines = meta.read_text(encoding="utf-8", errors="replace").splitlines()
        records = [_metadata_record(folder, meta, i, ln, cfg) for i, ln in enumerate(lines, 1) if ln.strip()]
        if not records:
            raise InputError(f"{meta}: no records (the file is empty)")
        _require_caption_column(meta, [json.loads(ln) for ln in lines if ln.strip()], cfg)
        return records
    meta = folder / "metadata.csv"
    if meta.is_file():
        with open(meta, newline="", encoding="utf-8", errors="replace") as f:
            try:
                rows = list(csv.DictReader(f))
            except csv.Error as exc:
                raise InputError(f"{meta}: not valid CSV ({exc})") from exc
        # line numbers count the header as line 1
        records = [_row_record(folder, f"{meta}:{i}", row, cfg) for i, row in enumerate(rows, 2)]
        if not records:
            raise InputError(f"{meta}: no records (only a header, or empty)")
        _require_caption_column(meta, rows, cfg)
        return records
    images = _images_in(folder)
    if not images:
        raise InputError(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)}) and no metadata.jsonl/metadata.csv")
    if cfg.caption_column is None:  # an imagefolder without metadata: its images, each with the default caption
        return [ImageRecord(path=p, caption=cfg.default_caption, source=str(p)) for p in images]
    records = []
    for image in images:
        txt = image.with_suffix(".txt")
        if not txt.is_file():
            raise InputError(f"{image}: missing caption (no {txt.name} and no metadata.jsonl in {folder})")
        records.append(ImageRecord(path=image, caption=txt.read_text(encoding="utf-8").strip(), source=str(txt)))
    return records


def scan_dataset(name: str, cfg: DataConfig, *, config_name: str | None = None, cache_dir: str | None = None,
                 export_dir: str | Path) -> list[ImageRecord]:
    """Records of `--dataset_name`: a local imagefolder, or a dataset already in the Hugging Face cache.

    A cached dataset is read with `datasets` from local files only (`_load_offline`: nothing is looked up or
    downloaded, and the environment is left alone); its images are written once as PNG files to `export_dir`, so
    the rest of the pipeline (validation, resumable sampling) sees a folder.
    """
    if Path(name).is_dir() and config_name is None:
        return scan_image_folder(name, cfg)
    ds = _load_offline(name, config_name, cache_dir)
    columns = list(ds.column_names)
    for column in (cfg.image_column, cfg.caption_column):
        if column is not None and column not in columns:
            raise InputError(f"--dataset_name {name}: no column '{column}' (columns: {', '.join(columns)})")
    out = Path(export_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for i, row in enumerate(ds):
        path = out / f"{i:07d}.png"
        if not path.is_file():
            from ..utils.fileio import atomic_write

            with atomic_write(path, "wb") as f:
                row[cfg.image_column].convert("RGB").save(f, format="PNG")
        caption = _caption(row, f"{name}[{i}]", cfg)
        caption = tuple(caption) if isinstance(caption, list) else str(caption)
        records.append(ImageRecord(path=path, caption=caption, source=f"{name}[{i}]"))
    if not records:
        raise InputError(f"--dataset_name {name}: the train split is empty")
    return records


def _load_offline(name: str, config_name: str | None, cache_dir: str | None) -> Any:
    """The train split of `--dataset_name` from local files only, whatever the environment says: a local folder
    through `datasets.load_dataset` (its packaged builders read the folder), a Hub name through `datasets`' `Cache`
    builder over its cache folder, the builder `load_dataset` itself falls back to offline. Offline is a property of
    the call, not of the process: `load_dataset` takes no argument that keeps a Hub name off the network
    (`DownloadConfig.local_files_only` is not read since datasets 3.0), and `HF_DATASETS_OFFLINE` is read once when
    `datasets` is imported."""
    try:
        import datasets
    except ImportError as exc:
        raise InputError(f"--dataset_name {name}: reading it needs the datasets package") from exc
    try:
        if Path(name).is_dir():
            return datasets.load_dataset(name, config_name, cache_dir=cache_dir, split="train")
        from datasets.packaged_modules.cache.cache import Cache  # datasets >= 2.16

        # the arguments load_dataset gives it offline: the Hub name, its last part, the newest cached version
        builder = Cache(cache_dir=cache_dir, dataset_name=name.split("/")[-1], repo_id=name, config_name=config_name,
                        version="auto", hash="auto")
        builder.download_and_prepare()  # nothing to download: checks the cache folder is there
        return builder.as_dataset(split="train")
    except Exception as exc:  # noqa: BLE001 - any failure: not available offline
        raise InputError(f"--dataset_name {name}: cannot load it offline ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc


def scan_instance_folder(folder: str | Path, prompt: str, flag: str) -> list[ImageRecord]:
    """Records of a DreamBooth instance or class folder: every image with the same prompt."""
    folder = Path(folder)
    _check_folder(folder, flag)
    images = _images_in(folder)
    if not images:
        raise InputError(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)}) ({flag})")
    return [ImageRecord(path=p, caption=prompt, source=str(p)) for p in images]


def _to_8bit(img: Image.Image) -> Image.Image:
    """16-bit and 32-bit single-channel images scaled to 8-bit grayscale."""
    arr = np.asarray(img, dtype=np.float64)
    arr = arr / 257.0 if img.mode.startswith("I") else arr
    return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), mode="L")


def load_rgb(path: str | Path) -> Image.Image:
    """Decode `path` fully and return an 8-bit RGB image (raises OSError/ValueError for bad files)."""
    with Image.open(path) as img:
        img.load()
        img = ImageOps.exif_transpose(img)
        if img.mode.startswith("I") or img.mode == "F":
            img = _to_8bit(img)
        if img.mode == "P" and "transparency" in img.info:
            img = img.convert("RGBA")
        if img.mode in ("RGBA", "LA", "PA"):
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return img.convert("RGB")


def validate_records(records: Sequence[ImageRecord], cfg: DataConfig, what: str) -> list[ImageRecord]:
    """Decode every image once; stop on the first bad one, or skip bad ones when `cfg.skip_bad_images`."""
    good, bad, small = [], [], 0
    for record in records:
        try:
            with Image.open(record.path) as img:
                img.load()
                size = img.size
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for broken files
            if not cfg.skip_bad_images:
                raise InputError(
                    f"{record.path}: unreadable or truncated image ({type(exc).__name__}: {exc}); "
                    "pass --skip_bad_images to skip such files"
                ) from exc
            logger.warning("skipping unreadable image %s (%s)", record.path, exc)
            bad.append(record)
            continue
        small += min(size) < cfg.resolution
        good.append(record)
    if bad:
        logger.warning("%s: skipped %d unreadable image(s) of %d", what, len(bad), len(records))
    if small:
        logger.warning("%s: %d image(s) smaller than %d px will be upscaled", what, small, cfg.resolution)
    if not good:
        raise InputError(f"{what}: no readable images left")
    return good


def preprocess(img: Image.Image, cfg: DataConfig, generator: torch.Generator) -> torch.Tensor:
    """Resize the short side to `cfg.resolution`, crop, maybe flip; returns `[3, R, R]` in [-1, 1].

    The random crop offset and the flip are drawn from `generator` (so a sample is reproducible).
    """
    r = cfg.resolution
    w, h = img.size
    scale = r / min(w, h)
    nw, nh = max(r, round(w * scale)), max(r, round(h * scale))
    img = img.resize((nw, nh), getattr(Image.Resampling, _RESAMPLING[cfg.interpolation]))
    draws = torch.rand(3, generator=generator).tolist()
    if cfg.center_crop:
        left, top = (nw - r) // 2, (nh - r) // 2
    else:
        left, top = int(draws[0] * (nw - r + 1)), int(draws[1] * (nh - r + 1))
    img = img.crop((left, top, left + r, top + r))
    if cfg.random_flip and draws[2] < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    arr = torch.from_numpy(np.asarray(img, dtype=np.float32).copy()).permute(2, 0, 1)
    return arr / 127.5 - 1.0


class CaptionedImages(torch.utils.data.Dataset):
    """Images and token ids; with class records (DreamBooth prior preservation) each item holds both.

    Items are addressed by `(index, seed)` keys from `StepBatchSampler`, the seed fixing crop and flip.
    """

    def __init__(
        self,
        records: Sequence[ImageRecord],
        tokenizer: Any,
        cfg: DataConfig,
        class_records: Sequence[ImageRecord] | None = None,
    ) -> None:
        self.records = list(records)
        self.class_records = list(class_records or [])
        self.tokenizer = tokenizer
        self.cfg = cfg

    def __len__(self) -> int:
        return max(len(self.records), len(self.class_records))

    def tokens(self, text: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and attention mask `[max_length]` of `text`, padded and truncated."""
        out = self.tokenizer(text, padding="max_length", truncation=True, max_length=self.cfg.max_length,
                             return_tensors="pt")
        return out.input_ids[0], out.attention_mask[0]

    def _one(self, record: ImageRecord, generator: torch.Generator) -> tuple[torch.Tensor, tuple[torch.Tensor,
                                                                                                  torch.Tensor]]:
        try:
            img = load_rgb(record.path)
        except Exception as exc:  # noqa: BLE001 - the file changed after the scan
            raise InputError(f"{record.path}: unreadable image ({type(exc).__name__}: {exc})") from exc
        pixels = preprocess(img, self.cfg, generator)
        caption = record.caption
        if not isinstance(caption, str):  # several captions: one per sample, drawn after the crop and flip
            caption = caption[int(torch.randint(len(caption), (1,), generator=generator))]
        return pixels, self.tokens(caption)

    def __getitem__(self, key: tuple[int, int] | int) -> dict[str, torch.Tensor]:
        index, seed = key if isinstance(key, tuple) else (key, key)
        generator = torch.Generator().manual_seed(seed)
        pixels, (ids, mask) = self._one(self.records[index % len(self.records)], generator)
        item = {"pixel_values": pixels, "input_ids": ids}
        if self.cfg.attention_mask:
            item["attention_mask"] = mask
        if self.class_records:
            cp, (cids, cmask) = self._one(self.class_records[index % len(self.class_records)], generator)
            item.update(class_pixel_values=cp, class_input_ids=cids)
            if self.cfg.attention_mask:
                item["class_attention_mask"] = cmask
        return item


class StepBatchSampler(torch.utils.data.Sampler):
    """Per-rank batches of `(index, seed)` keys for a fixed number of global batches, resumable.

    The sample stream is the concatenation of per-epoch permutations (each seeded by `seed` and the epoch).
    Global batch `b` takes stream positions `[b*B*W, (b+1)*B*W)`, rank `r` the `r`-th slice of `B`.
    Iteration starts at batch `start`, so a resumed run sees exactly the batches the interrupted one would
    have; `len()` stays `num_batches` (Lightning counts the restored batches itself).
    """

    def __init__(
        self, dataset_len: int, batch_size: int, num_batches: int, *, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        if dataset_len < 1 or batch_size < 1 or num_batches < 0:
            raise ValueError("dataset_len and batch_size must be >= 1, num_batches >= 0")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.n, self.batch_size, self.num_batches = dataset_len, batch_size, num_batches
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.start = 0
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g).tolist()}
        return self._perms[epoch]

    def batch(self, b: int) -> list[tuple[int, int]]:
        """The keys of this rank's part of global batch `b`."""
        first = (b * self.world_size + self.rank) * self.batch_size
        keys = []
        for pos in range(first, first + self.batch_size):
            epoch, i = divmod(pos, self.n)
            keys.append((self._perm(epoch)[i], (self.seed * 7_919 + pos) % (2**63 - 1)))
        return keys

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for b in range(self.start, self.num_batches):
            yield self.batch(b)

    def __len__(self) -> int:
        return self.num_batches


class EpochBatchSampler(torch.utils.data.Sampler):
    """Per-rank batches of `(index, seed)` keys, one epoch at a time, as diffusers' scripts' shuffled
    DataLoader deals them: epoch `e` is a permutation seeded by `seed` and `e`, cut into global batches of
    `batch_size x world_size` (rank `r` takes the `r`-th slice); the last global batch is short on one process
    and, on several, filled from the start of the permutation (accelerate's even batches).

    `set_epoch(e)` (Lightning calls it) selects the epoch; `epoch_batches[e]`, when given, is how many of its
    batches the run goes through (`diffusion.schedule.run_length`), all of them otherwise.
    """

    def __init__(self, dataset_len: int, batch_size: int, *, seed: int, rank: int = 0, world_size: int = 1,
                 epoch_batches: dict[int, int] | None = None) -> None:
        if dataset_len < 1 or batch_size < 1:
            raise ValueError("dataset_len and batch_size must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.n, self.batch_size, self.seed, self.rank, self.world_size = dataset_len, batch_size, seed, rank, world_size
        self.epoch_batches = dict(epoch_batches or {})
        self.epoch = 0
        self._perm: tuple[int, list[int]] = (-1, [])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batch(self, epoch: int, b: int) -> list[tuple[int, int]]:
        """The keys of this rank's part of global batch `b` of `epoch`."""
        if self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.n, generator=g).tolist())
        perm = self._perm[1]
        first = (b * self.world_size + self.rank) * self.batch_size
        last = first + self.batch_size
        if self.world_size == 1:
            last = min(last, self.n)
        keys = []
        for pos in range(first, last):
            i = pos % self.n
            keys.append((perm[i], (self.seed * 7_919 + epoch * self.n + i) % (2**63 - 1)))
        return keys

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.epoch
        for b in range(min(self.epoch_batches.get(epoch, len(self)), len(self))):
            yield self.batch(epoch, b)

    def __len__(self) -> int:
        return math.ceil(self.n / (self.batch_size * self.world_size))
