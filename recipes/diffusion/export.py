"""The trained weights out of a run: gathered from the shards (`materialize`), written as diffusers writes them
(`write_component`, `write_weights` for a checkpoint-N/ folder) and exported as the final result (`export`).

Under Gemini every rank takes part (gathering is a collective) and rank 0 writes; a UNet in Gemini's chunks is
streamed out one gathered chunk at a time, never whole.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch

if TYPE_CHECKING:
    from .module import StableDiffusionFineTune

__all__ = ["export", "materialize", "write_component", "write_weights"]

logger = logging.getLogger(__name__)


def _sub(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def _settle(module: StableDiffusionFineTune) -> None:
    """Before gathering weights: called at optimizer-step boundaries only, so clearing gradients loses nothing; it
    also ends Gemini's checkpoint mode (in which state_dict() returns placeholders) after trainer.save_checkpoint."""
    for optimizer in module.trainer.optimizers if module._trainer is not None else ():
        optimizer.zero_grad()


def _sharded(module: torch.nn.Module) -> bool:
    return any(getattr(m, "gemini_manager", None) is not None for m in module.modules())


def materialize(module: StableDiffusionFineTune, names: tuple[str, ...] = ("unet", "vae", "text_encoder")
                ) -> dict[str, Any]:
    """The components `names` holding the full current weights on rank 0; call on every rank.

    Under a sharding strategy (Gemini) each component's `state_dict()` gathers its weights (a collective), and
    its own parameters hold no data between forward passes (their chunks are released), so fresh modules are
    loaded from it, one component at a time; `state` holds the gathered values. Otherwise the module's own
    submodules are returned.
    """
    _settle(module)
    parts = {name: getattr(module, name) for name in names}
    if not _sharded(module):
        return parts
    out: dict[str, Any] = {"state": {}}
    for name, part in parts.items():
        state = part.state_dict()  # collective
        if module.global_rank != 0:
            continue
        state = {k: v.detach().cpu() for k, v in state.items()}
        config = part.config
        fresh = type(part).from_config(config) if hasattr(type(part), "from_config") else type(part)(config)
        fresh.load_state_dict(state, strict=False)
        out[name] = fresh
        out["state"].update({f"{name}.{k}": v for k, v in state.items()})
    return out if module.global_rank == 0 else parts


def trained_state(module: StableDiffusionFineTune) -> dict[str, Any]:
    """What a LoRA export reads: under Gemini `{"state": {name: full fp32 value}}` of the trained parameters only
    (their chunks gathered one at a time; the frozen base, gigabytes for SDXL, is never gathered), else `{}` (the
    modules hold their values). Call on every rank (collective)."""
    from ...core_parallel.gemini.param_reads import owner_of
    from ...diffusion.streaming import gemini_of

    _settle(module)
    mgr = gemini_of(module.unet)
    if mgr is None:
        return {}
    owned = ((owner_of(p), n) for n, p in module.named_parameters() if p.requires_grad)
    names = {owner[1]: n for owner, n in owned if owner is not None}
    return {"state": {names[i]: v.detach().to("cpu", copy=True) for i, v in mgr.stream_values(names)}}


def _fp32(m: torch.nn.Module) -> torch.nn.Module:
    """`m`, or an fp32 copy when it is not fp32 (the run's own modules keep their dtype)."""
    import copy

    return m if all(p.dtype == torch.float32 for p in m.parameters()) else copy.deepcopy(m).to(torch.float32)


def write_component(module: StableDiffusionFineTune, name: str, folder: Path | None) -> None:
    """Write component `name` (`unet` or `text_encoder`) as `save_pretrained(folder)` writes it, fp32; call on
    every rank (rank 0 passes the folder, the others None). A UNet in Gemini's chunks is streamed one gathered
    chunk at a time (`diffusion.streaming`); anything else is gathered whole first."""
    from ...diffusion.streaming import gemini_of, save_unet_streaming

    part = getattr(module, name)
    if name == "unet" and gemini_of(part) is not None:
        _settle(module)
        save_unet_streaming(part, folder if module.global_rank == 0 else None)
        return
    fresh = materialize(module, (name,)).get(name)
    if module.global_rank == 0 and folder is not None:
        _fp32(fresh).save_pretrained(folder, safe_serialization=True)


def _lora_layers(module: StableDiffusionFineTune, parts: dict[str, Any]) -> dict[str, dict]:
    from ...diffusion.lora import lora_state_dicts

    if hasattr(module, "lora_layers"):  # a subclass with more adapted models (SDXL's second text encoder)
        return module.lora_layers(parts)
    state = parts.get("state")
    te = module.text_encoder if module.config.train_text_encoder else None
    if state is None:
        return lora_state_dicts(module.unet, te)
    return lora_state_dicts(module.unet, te, unet_state=_sub(state, "unet."), text_state=_sub(state, "text_encoder."))


def _folder_of(module: StableDiffusionFineTune, name: str) -> str:
    """The pipeline subfolder of component `name`: the trained denoiser's is the module's `denoiser_folder`
    (`transformer` for SD3 / Flux), else its own name."""
    return getattr(module, "denoiser_folder", "unet") if name == "unet" else name


def _text_encoders(module: StableDiffusionFineTune) -> list[str]:
    """The text encoders a full fine-tune trains: the module's `trained_text_encoders()` where it has one (SD3's
    --train_text_encoder trains three), else `text_encoder` with `train_text_encoder`."""
    if hasattr(module, "trained_text_encoders"):
        return module.trained_text_encoders()
    return ["text_encoder"] if module.config.train_text_encoder else []


def write_weights(module: StableDiffusionFineTune, folder: Path | None) -> None:
    """The user-facing weights of a checkpoint: LoRA file, or unet/ (+ text_encoder/, unet_ema/); call on every
    rank, rank 0 writes into `folder` (None on the others)."""
    from ...diffusion.lora import save_lora_weights

    cfg = module.config
    rank0 = module.global_rank == 0
    if cfg.lora:
        parts = trained_state(module)
        if rank0:
            getattr(module, "save_lora", save_lora_weights)(folder, _lora_layers(module, parts))
        return
    write_component(module, "unet", folder / _folder_of(module, "unet") if rank0 else None)
    for name in _text_encoders(module):
        write_component(module, name, folder / name if rank0 else None)
    if module.ema is not None and rank0:
        module.pipeline(use_ema=True).unet.save_pretrained(folder / "unet_ema", safe_serialization=True)



def export(trainer: pl.Trainer, module: StableDiffusionFineTune) -> Path:
    """Write the final result into output_dir: LoRA weights, or the whole pipeline (EMA weights under use_ema).

    Call on every rank (gathering sharded weights is collective); rank 0 writes. Over a base pipeline folder the
    trained components are written first (a UNet in Gemini's chunks streamed chunk by chunk, never whole) into a
    staging folder beside the output, then moved in with the base's other components.
    """
    from ...diffusion.export import save_over_base, save_pipeline
    from ...diffusion.lora import save_lora_weights
    from ...diffusion.models import make_pipeline

    cfg, out = module.config, Path(module.config.output_dir)
    rank0 = trainer.is_global_zero
    if cfg.lora:
        parts = trained_state(module)
        if not rank0:
            return out
        path = getattr(module, "save_lora", save_lora_weights)(out, _lora_layers(module, parts))
        logger.info("exported %s", path)
        return path
    drop = ["text_encoder"] if cfg.skip_save_text_encoder else []
    names = ["unet"] + ([] if cfg.skip_save_text_encoder else _text_encoders(module))
    if module.base_source is not None and cfg.tokenizer_name is None:
        # every component the trainer did not train is the base's, file for file
        import tempfile

        out.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(dir=out, prefix=".trained-", suffix=".tmp")) if rank0 else None
        try:
            for name in names:
                write_component(module, name, stage / _folder_of(module, name) if rank0 else None)
            if not rank0:
                return out
            trained = {_folder_of(module, name): stage / _folder_of(module, name) for name in names}
            trained.update(module.extra_exports(stage) if hasattr(module, "extra_exports") else {})  # SDXL's VAE
            path = save_over_base(module.base_source, trained, out, drop=drop)
        finally:
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)
    else:
        parts = materialize(module)
        if not rank0:
            return out
        comps = {"vae": _fp32(parts["vae"]), "text_encoder": _fp32(parts["text_encoder"]),
                 **{name: _fp32(parts[name]) for name in names}, "tokenizer": module.tokenizer,
                 "extras": module.base_extras}
        pipe = make_pipeline(comps, scheduler=module.inference_scheduler, keep_extras=True)
        if drop:
            pipe.register_modules(text_encoder=None)
        path = save_pipeline(pipe, out)
    logger.info("exported %s", path)
    return path

