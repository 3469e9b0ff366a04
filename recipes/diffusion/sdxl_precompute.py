"""`--precompute` of the SDXL recipe: the text encoders' embeddings of every prompt and/or the VAE latents of every
image computed once, before the UNet trains (in the module's `setup`, before any strategy places its parameters),
then the models that made them dropped from the module, so neither their weights nor their chunks are in memory
while the UNet trains (diffusers' `train_text_to_image_sdxl.py` does the same with `dataset.map`, then deletes the
encoders and the VAE; `train_dreambooth_lora_sdxl.py` with the instance prompt's embeddings).

The values are kept in `diffusion.precompute` stores (memory-mapped files in a folder of the run's output, removed
at the end): a step reads the rows of its batch. Validation images load the dropped models again for the moment
they are needed, as the scripts load them again for their validation pipeline.
"""

from __future__ import annotations

import gc
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from ...diffusion.precompute import FeatureStore, TextEmbeddings, remove_store
from ...diffusion.sdxl import encode_prompt_sdxl
from ...diffusion.training import encode_latents, latent_shape, step_generator
from ...utils.memory_meter import malloc_trim
from .sdxl_data import SDXLCaptionedImages, sdxl_settings

__all__ = ["frozen_component", "precompute", "release_stores"]

logger = logging.getLogger(__name__)

_STREAM = {"text": -1, "class": -2}  # step_generator's `step` of the latents' draws (never a training step)


def precompute(module: Any, data: Any) -> None:
    """Compute what `sdxl_settings(cfg).precompute` names for `data`'s records (an `SDXLData`, set up), keep it in
    `module.text_embeddings` / `module.latent_stores`, and drop the text encoders / the VAE from `module`."""
    mode = sdxl_settings(module.config).precompute
    if mode not in ("text", "latents", "both"):
        return
    cfg = module.config
    root = Path(cfg.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    module.precompute_dir = Path(tempfile.mkdtemp(dir=root, prefix=f".precomputed-rank{module.global_rank}-"))
    ds = SDXLCaptionedImages(data.scan(), (module.tokenizer, module.tokenizer_2), cfg.data_config(),
                             data.class_records, sdxl_settings(cfg).proportion_empty_prompts)
    if mode in ("text", "both"):
        encoders = [module.text_encoder, module.text_encoder_2]

        def encode(ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            hidden, pooled = encode_prompt_sdxl(encoders, ids)
            return {"hidden": hidden, "pooled": pooled}

        module.text_embeddings = TextEmbeddings.build(module.precompute_dir / "text", ds.prompts(), ds.tokenize,
                                                      encode, batch=max(1, cfg.train.train_batch_size))
        logger.info("pre-computed the embeddings of %d prompt(s); text encoders dropped",
                    len(module.text_embeddings.index))
        module.text_encoder = module.text_encoder_2 = None
    if mode in ("latents", "both"):
        stores = [_latents(module, ds, ds.records, module.precompute_dir / "latents", _STREAM["text"])]
        stores.append(_latents(module, ds, ds.class_records, module.precompute_dir / "class_latents",
                               _STREAM["class"]) if ds.class_records else None)
        module.latent_stores = tuple(stores)
        logger.info("pre-computed the latents of %d image(s); VAE dropped",
                    len(ds.records) + len(ds.class_records))
        module.vae = None
    gc.collect()
    malloc_trim()  # the dropped models' freed heap back to the OS, out of the budget's way


@torch.no_grad()
def _latents(module: Any, ds: Any, records: list[Any], folder: Path, stream: int) -> FeatureStore:
    """One row per record: its latents (`encode_latents` of one crop and flip, a posterior sample), the original
    size and the crop corner, each drawn from a generator of (seed, record) only."""
    store = FeatureStore(folder, len(records))
    vae = module.vae
    for i, record in enumerate(records):
        g = step_generator(module.config.seed, stream, i)
        item = ds.sample(record, g, "")
        pixels = item["pixel_values"][None].to(module.device)
        eps = torch.randn(latent_shape(vae, pixels), generator=g)
        latents = encode_latents(vae, pixels, eps).float()[0]
        store.put(i, {"latents": latents, "original_size": item["original_size"],
                      "crop_top_left": item["crop_top_left"]})
    return store.finish()


def frozen_component(module: Any, name: str) -> Any:
    """`module.<name>` (vae, text_encoder, text_encoder_2), or, where `precompute` dropped it, the component loaded
    again from the base folder in the dtype the run holds it in (for one pipeline; not kept)."""
    from ...diffusion.sdxl import load_sdxl_frozen

    part = getattr(module, name)
    if part is not None:
        return part
    dtype = module.weight_dtype
    if name == "vae" and not sdxl_settings(module.config).vae_in_training_dtype:
        dtype = torch.float32
    logger.info("loading %s again for this pipeline (dropped after pre-computing)", name)
    return load_sdxl_frozen(module.base_source, name, vae_folder=module.vae_source, variant=module.config.variant,
                            dtype=dtype).to(module.device)


def release_stores(module: Any) -> None:
    """Delete the run's pre-computed files (at the end of fit)."""
    folder = getattr(module, "precompute_dir", None)
    if folder is not None:
        module.text_embeddings, module.latent_stores, module.precompute_dir = None, None, None
        remove_store(folder)
