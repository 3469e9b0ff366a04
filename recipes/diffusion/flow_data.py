"""The data of the SD3 / Flux DreamBooth recipe and what is computed once before the transformer trains.

`FlowCaptionedImages`: each sample's pixels and the token ids of every text encoder's tokenizer (CLIP's at 77, T5's
at `--max_sequence_length`); `FlowCachedLatents`: the same over pre-computed VAE posteriors (`--cache_latents`);
`FlowData`: the LightningDataModule (instance images repeated `--repeats` times). `precompute` computes, in the
module's `setup` before any strategy places its parameters, the text encoders' outputs for every prompt of the run
(`diffusion.precompute.TextEmbeddings`) and, with `--cache_latents`, each image's posterior mean and std, then
drops the encoders (and the VAE) from the module: the scripts encode the instance prompt once and delete the
encoders, here every prompt is (custom captions, class prompt), so the text encoders never train beside the
transformer. `frozen_component` loads a dropped one again for the moment a pipeline needs it (validation).
"""

from __future__ import annotations

import gc
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from ...diffusion.config import FineTuneConfig
from ...diffusion.data import CaptionedImages, ImageRecord, load_rgb, preprocess
from ...diffusion.errors import InputError
from ...diffusion.flow_scripts import FlowSettings
from ...diffusion.precompute import FeatureStore, TextEmbeddings, remove_store
from ...diffusion.training import step_generator
from ...utils.memory_meter import malloc_trim
from .datamodule import ImageCaptionData

__all__ = ["FlowCachedLatents", "FlowCaptionedImages", "FlowData", "flow_settings", "frozen_component", "id_keys",
           "precompute", "release_stores"]

logger = logging.getLogger(__name__)


def flow_settings(cfg: FineTuneConfig) -> FlowSettings:
    """The run's SD3 / Flux settings (`cfg.extra["flow"]`, defaults when absent)."""
    return cfg.extra.get("flow") or FlowSettings()


def id_keys(n: int) -> list[str]:
    """The batch keys of `n` tokenizers' ids: input_ids, input_ids_2, ..."""
    return ["input_ids"] + [f"input_ids_{i}" for i in range(2, n + 1)]


class FlowCaptionedImages(CaptionedImages):
    """Pixels and every tokenizer's ids of each sample (`tokenizers`: (tokenizer, max_length) pairs)."""

    def __init__(self, records: list[ImageRecord], tokenizers: list[tuple[Any, int]], cfg: Any,
                 class_records: list[ImageRecord] | None = None) -> None:
        super().__init__(records, tokenizers[0][0], cfg, class_records)
        self.tokenizers = tokenizers

    def tokenize(self, caption: str) -> list[torch.Tensor]:
        """Every tokenizer's ids `[L]` of `caption`, padded to its length as the scripts tokenize."""
        return [tok(caption, padding="max_length", truncation=True, max_length=n, return_tensors="pt").input_ids[0]
                for tok, n in self.tokenizers]

    def caption_ids(self, record: ImageRecord, generator: torch.Generator) -> dict[str, torch.Tensor]:
        caption = record.caption
        if not isinstance(caption, str):  # several captions: one per sample, drawn after the crop and flip
            caption = caption[int(torch.randint(len(caption), (1,), generator=generator))]
        return dict(zip(id_keys(len(self.tokenizers)), self.tokenize(caption), strict=True))

    def sample(self, record: ImageRecord, generator: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
        try:
            img = load_rgb(record.path)
        except Exception as exc:  # noqa: BLE001 - the file changed after the scan
            raise InputError(f"{record.path}: unreadable image ({type(exc).__name__}: {exc})") from exc
        item = {"pixel_values": preprocess(img, self.cfg, generator), **self.caption_ids(record, generator)}
        return {f"{prefix}{k}": v for k, v in item.items()}

    def prompts(self) -> list[str]:
        """Every prompt a sample can carry."""
        out: list[str] = []
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


class FlowCachedLatents(FlowCaptionedImages):
    """`FlowCaptionedImages` whose images were encoded once: an item holds the record's stored posterior
    (`latent_mean`, `latent_std`), sampled in the step; the caption is still drawn per sample."""

    def __init__(self, base: FlowCaptionedImages, stores: tuple[Any, Any | None]) -> None:
        super().__init__(base.records, base.tokenizers, base.cfg, base.class_records)
        self.stores = stores

    def __getitem__(self, key: tuple[int, int] | int) -> dict[str, torch.Tensor]:
        index, seed = key if isinstance(key, tuple) else (key, key)
        generator = torch.Generator().manual_seed(seed)
        item: dict[str, torch.Tensor] = {}
        for prefix, records, store in (("", self.records, self.stores[0]),
                                       ("class_", self.class_records, self.stores[1])):
            if records:
                row = index % len(records)
                item.update({f"{prefix}{k}": v for k, v in store.get(row).items()})
                item.update({f"{prefix}{k}": v for k, v in self.caption_ids(records[row], generator).items()})
        return item


class FlowData(ImageCaptionData):
    """`ImageCaptionData` giving SD3 / Flux samples; the instance images repeated `--repeats` times."""

    def scan(self) -> list[ImageRecord]:
        if self.records is None:
            self.records = super().scan() * flow_settings(self.config).repeats
        return self.records

    def dataset(self) -> CaptionedImages:
        module = self.trainer.lightning_module
        ds = FlowCaptionedImages(self.scan(), module.tokenizers(), self.config.data_config(), self.class_records)
        stores = getattr(module, "latent_stores", None)
        return ds if stores is None else FlowCachedLatents(ds, stores)


# -- computed once ------------------------------------------------------------------------------------------------
def precompute(module: Any, data: Any) -> None:
    """Every prompt's text conditioning into `module.text_embeddings` (the encoders dropped), and with
    `--cache_latents` every image's posterior into `module.latent_stores` (the VAE dropped)."""
    cfg = module.config
    if module.trained_encoders() and not flow_settings(cfg).cache_latents:
        return  # --train_text_encoder: every step encodes its prompts
    root = Path(cfg.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    module.precompute_dir = Path(tempfile.mkdtemp(dir=root, prefix=f".precomputed-rank{module.global_rank}-"))
    ds = FlowCaptionedImages(data.scan(), module.tokenizers(), cfg.data_config(), data.class_records)
    if not module.trained_encoders():
        _text(module, ds)
    if flow_settings(cfg).cache_latents:
        module.latent_stores = (_posteriors(module, ds, ds.records, module.precompute_dir / "latents", -1),
                                _posteriors(module, ds, ds.class_records, module.precompute_dir / "class_latents", -2)
                                if ds.class_records else None)
        logger.info("pre-computed the latents of %d image(s); VAE dropped", len(ds.records) + len(ds.class_records))
        module.vae = None
    gc.collect()
    malloc_trim()  # the dropped models' freed heap back to the OS, out of the budget's way


def _text(module: Any, ds: FlowCaptionedImages) -> None:
    """Every prompt's conditioning into `module.text_embeddings`; the text encoders dropped from `module`."""
    cfg = module.config
    encoders = [frozen_component(module, name) for name in module.encoder_names()]  # T5 streamed

    def encode(ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.float() for k, v in module.encode_prompt_ids(encoders, ids).items()}

    module.text_embeddings = TextEmbeddings.build(module.precompute_dir / "text", ds.prompts(), ds.tokenize, encode,
                                                  batch=max(1, cfg.train_batch_size))
    logger.info("pre-computed the embeddings of %d prompt(s); text encoders dropped", len(module.text_embeddings.index))
    for name in module.encoder_names():
        setattr(module, name, None)
    encoders.clear()  # the last references: the encoders are freed here


@torch.no_grad()
def _posteriors(module: Any, ds: FlowCaptionedImages, records: list[ImageRecord], folder: Path,
                stream: int) -> FeatureStore:
    """One row per record: the VAE posterior's mean and std of one crop and flip (drawn from (seed, record))."""
    store = FeatureStore(folder, len(records))
    vae = module.vae
    for i, record in enumerate(records):
        item = ds.sample(record, step_generator(module.config.seed, stream, i), "")
        dist = vae.encode(item["pixel_values"][None].to(module.device, vae.dtype)).latent_dist
        store.put(i, {"latent_mean": dist.mean[0].float(), "latent_std": dist.std[0].float()})
    return store.finish()


def frozen_component(module: Any, name: str) -> Any:
    """`module.<name>`, or where `precompute` dropped it (or T5 was never loaded), the component loaded again from
    the base folder in the dtype the run holds it in (for one use; not kept); T5 streamed block by block."""
    from ...diffusion.flow_models import load_flow_component, load_streamed_t5, t5_name

    part = getattr(module, name)
    if part is not None:
        return part
    dtype = torch.float32 if name == "vae" else module.weight_dtype
    if name == t5_name(module.family):
        return load_streamed_t5(module.base_source, module.family, variant=module.config.variant, dtype=dtype,
                                device=module.device)
    logger.info("loading %s again for this pipeline (dropped after pre-computing)", name)
    loaded = load_flow_component(module.base_source, module.family, name, variant=module.config.variant,
                                 dtype=dtype)
    return loaded.to(module.device, dtype).requires_grad_(False).eval()


def release_stores(module: Any) -> None:
    """Delete the run's pre-computed files (at the end of fit)."""
    folder = getattr(module, "precompute_dir", None)
    if folder is not None:
        module.text_embeddings, module.latent_stores, module.precompute_dir = None, None, None
        remove_store(folder)
