"""Resume a run begun with diffusers' own scripts: accelerate's `checkpoint-N/` folder, as `accelerator.save_state`
writes it with the scripts' save hooks (v0.40.0):

| file | written by | holds |
|---|---|---|
| `unet/` (`config.json`, `diffusion_pytorch_model.safetensors`) | the hook's `save_pretrained` (full UNet) | weights |
| `transformer/` (the same files) | the SD3 / Flux full scripts' hook | weights |
| `unet_ema/` | `EMAModel.save_pretrained` (--use_ema) | EMA weights; `optimization_step` in its config |
| `text_encoder/` (`model.safetensors`) | DreamBooth's hook (--train_text_encoder) | weights |
| `text_encoder{,_2,_3}/` | the SD3 / Flux full scripts' hook (--train_text_encoder) (2) | weights |
| `pytorch_lora_weights.safetensors` | the LoRA scripts' hook (`save_lora_weights`) | LoRA layers (1) |
| `optimizer.bin`, `scheduler.bin` | `torch.save(x.state_dict())` of the optimizer, the LR scheduler | state |
| `random_states_0.pkl` | `torch.save` of Python's, numpy's and torch's RNG states | RNG states |

(1) diffusers' names: `unet.`, and with the SDXL scripts' `--train_text_encoder` `text_encoder.` and
`text_encoder_2.` layers; the SD3 / Flux LoRA scripts' peft names under `transformer.` (and `text_encoder.`,
`text_encoder_2.`), read through the module's `lora_file_names`.
(2) each trained encoder's `save_pretrained` (T5's tied `encoder.embed_tokens.weight` left out, as transformers
writes it); the Flux full script's hook would write its CLIP encoder under `text_encoder/`. DISCREPANCY: in
v0.40.0 neither script reaches a checkpoint with --train_text_encoder (SD3's first step calls its `encode_prompt`
without `max_sequence_length`, a TypeError; Flux's hook raises "Wrong model supplied" on its `CLIPTextModel`), so
these folders are the layout the hooks are written for.

Everything is read with `torch.load(weights_only=True)` or safetensors. The pieces become a Lightning checkpoint
(`lightning_checkpoint`) that the run resumes like its own `checkpoint-N` (the loops restart at the scripts'
epoch through `module.restart_at_epoch`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...diffusion.errors import InputError
from ...diffusion.lora import lora_file_key

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from .module import StableDiffusionFineTune

__all__ = ["is_accelerate_checkpoint", "lightning_checkpoint", "required_files"]

logger = logging.getLogger(__name__)

_UNET = ("unet/config.json", "unet/diffusion_pytorch_model.safetensors")
_EMA = ("unet_ema/config.json", "unet_ema/diffusion_pytorch_model.safetensors")
_TEXT = ("text_encoder/config.json", "text_encoder/model.safetensors")
_LORA = "pytorch_lora_weights.safetensors"


def is_accelerate_checkpoint(path: Path) -> bool:
    """Whether `path` looks like accelerate's `save_state` folder (its optimizer and scheduler files)."""
    return (path / "optimizer.bin").is_file() or (path / "scheduler.bin").is_file()


def _denoiser(cfg: Any) -> tuple[str, str]:
    """The trained model's files in the checkpoint: `unet/`, or the SD3 / Flux scripts' `transformer/`."""
    if (cfg.extra or {}).get("flow") is None:
        return _UNET
    return tuple(name.replace("unet/", "transformer/") for name in _UNET)


def _text_folders(cfg: Any) -> list[str]:
    """The trained text encoders' folders of a full fine-tune: SD 1.x's `text_encoder/`, the SD3 / Flux full
    scripts' trained encoders."""
    if not cfg.train_text_encoder or cfg.lora:
        return []
    flow = (cfg.extra or {}).get("flow")
    if flow is None:
        return ["text_encoder"]
    from ...diffusion.flow_models import trained_text_encoders

    return trained_text_encoders(flow.family, False)


def required_files(cfg: Any) -> list[str]:
    """The files this run needs from an accelerate checkpoint (what the script's save hook writes for it)."""
    need = ["optimizer.bin", "scheduler.bin"]
    if cfg.lora:
        need.append(_LORA)
    else:
        need += _denoiser(cfg)
        if cfg.use_ema:
            need += _EMA
        need += [name.replace("text_encoder/", f"{part}/") for part in _text_folders(cfg) for name in _TEXT]
    return need


def check_files(path: Path, cfg: Any) -> None:
    """One line naming what is missing, before any model is loaded."""
    missing = [name for name in required_files(cfg) if not (path / name).is_file()]
    if missing:
        raise InputError(f"--resume_from_checkpoint {path}: accelerate checkpoint without {', '.join(missing)} "
                         "(needed to resume this run)")


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure is the file's: one line
        raise InputError(f"{path}: not loadable with torch.load(weights_only=True) ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"{path}: not a safetensors file ({type(exc).__name__}: {exc})") from exc


def _named(path: Path, prefix: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A component's weights file as the LightningModule's state-dict names; every key must match."""
    weights = _safetensors(path)
    own = module.state_dict()
    present = {own[k].data_ptr() for k in weights if k in own}
    # a tied weight (T5's encoder.embed_tokens.weight is its shared.weight) is written once by save_pretrained
    missing = sorted(k for k in set(own) - set(weights) if own[k].data_ptr() not in present)
    unexpected = sorted(set(weights) - set(own))
    wrong = [k for k in own if k in weights and weights[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        what = (f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}" if unexpected
                else f"{wrong[0]} has shape {tuple(weights[wrong[0]].shape)}, expected {tuple(own[wrong[0]].shape)}")
        raise InputError(f"{path}: does not fit this run's model ({what})")
    return {f"{prefix}.{k}": v.to(own[k].dtype) for k, v in weights.items()}


def _lora_names(module: StableDiffusionFineTune) -> dict[str, str]:
    """The file key of each trained LoRA parameter -> its name in the module. The scripts' save hooks write
    `convert_state_dict_to_diffusers(get_peft_model_state_dict(model))` of the UNet and of each trained text encoder
    under the component's prefix (`save_lora_weights`: `unet.`, `text_encoder.`, `text_encoder_2.`), so the keys
    are those renamings of peft's names (the adapter's name left out) of this module's own parameters, text encoders'
    in CLIP's `text_model.` layout (`lora_file_key`: a script run on transformers 5 wrote the first encoder's
    without it, one on transformers 4 with it; both resume)."""
    from diffusers.utils import convert_state_dict_to_diffusers

    if hasattr(module, "lora_file_names"):  # the SD3 / Flux scripts write peft's names under `transformer.`
        return module.lora_file_names()
    out = {}
    for part in ("unet", "text_encoder", "text_encoder_2"):
        model = getattr(module, part, None)
        if model is None:
            continue
        peft = {n.replace(".default.", "."): n for n, p in model.named_parameters() if p.requires_grad}
        if peft:
            out.update({lora_file_key(f"{part}.{key}"): f"{part}.{name}"
                        for key, name in convert_state_dict_to_diffusers(peft).items()})
    return out


def _lora(path: Path, module: StableDiffusionFineTune) -> dict[str, torch.Tensor]:
    """The LoRA file's layers (diffusers' names: `unet.<layer>.lora.down.weight`, `text_encoder.<layer>.
    lora_linear_layer.down.weight`, ...) as the module's peft parameters (`lora_A.default.weight`)."""
    names = _lora_names(module)
    own = dict(module.named_parameters())
    out = {}
    for key, value in _safetensors(path).items():
        name = names.get(lora_file_key(key))
        if name is None:
            trained = "the UNet's" + (" and the text encoders'" if module.config.train_text_encoder else "")
            raise InputError(f"{path}: {key} is not a LoRA layer of this run (rank {module.config.rank}, {trained} "
                             "attention projections)")
        if value.shape != own[name].shape:
            raise InputError(f"{path}: {key} has shape {tuple(value.shape)}, expected {tuple(own[name].shape)}")
        out[name] = value.to(own[name].dtype)
    if len(out) != len(names):
        missing = sorted(set(names) - {lora_file_key(k) for k in _safetensors(path)})
        raise InputError(f"{path}: {len(out)} LoRA tensors, this run trains {len(names)} (missing {missing[0]})")
    return out


def _optimizer(path: Path, params: list[torch.nn.Parameter]) -> dict[str, Any]:
    state = _load(path / "optimizer.bin")
    if not isinstance(state, dict) or "param_groups" not in state or "state" not in state:
        raise InputError(f"{path / 'optimizer.bin'}: not an optimizer state_dict")
    ids = [i for g in state["param_groups"] for i in g["params"]]
    if len(ids) != len(params):
        raise InputError(f"{path / 'optimizer.bin'}: holds {len(ids)} parameters, this run trains {len(params)}")
    for i, p in zip(ids, params):
        avg = state["state"].get(i, {}).get("exp_avg")
        if avg is not None and avg.shape != p.shape:
            raise InputError(f"{path / 'optimizer.bin'}: parameter {i} has shape {tuple(avg.shape)}, "
                             f"this run's has {tuple(p.shape)}")
    return state


def _scheduler(path: Path, step: int) -> dict[str, Any]:
    state = _load(path / "scheduler.bin")
    if not isinstance(state, dict) or "last_epoch" not in state:
        raise InputError(f"{path / 'scheduler.bin'}: not an LR scheduler state_dict")
    # accelerate steps the schedule once per process per optimizer step; here it steps once per optimizer step
    return {**state, "last_epoch": step, "_step_count": step + 1}


def _ema(path: Path, module: StableDiffusionFineTune, step: int) -> dict[str, Any]:
    weights = _named(path / _EMA[1], "unet", module.unet)
    config = json.loads((path / _EMA[0]).read_text())
    state = module.ema.state_dict()
    state["shadow"] = [weights[f"unet.{n}"].float() for n, _ in module.unet.named_parameters()]
    state["optimization_step"] = int(config.get("optimization_step", step))
    return state


def _random_states(path: Path) -> None:
    """The scripts' RNG states: restored when they load with weights_only=True, else skipped with one line."""
    files = sorted(path.glob("random_states_*.pkl"))
    if not files:
        return
    why = "the draws here are functions of --seed, the epoch and the step"
    try:
        states = torch.load(files[0], map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - numpy's state is an ndarray, which weights_only refuses
        logger.warning("%s: skipped (not loadable with weights_only=True: %s); the data order will differ from the "
                       "script's (%s)", files[0], type(exc).__name__, why)
        return
    if isinstance(states.get("torch_manual_seed"), torch.Tensor):
        torch.set_rng_state(states["torch_manual_seed"])
    logger.warning("%s: torch's RNG state restored; the data order still differs from the script's (%s)",
                   files[0], why)


def lightning_checkpoint(path: Path, module: StableDiffusionFineTune, trainer: pl.Trainer, step: int) -> dict:
    """The Lightning checkpoint of accelerate's `checkpoint-N` folder `path` for this run (N = `step`)."""
    import lightning.pytorch as pl

    check_files(path, module.config)
    cfg = module.config
    if cfg.lora:
        state = _lora(path / _LORA, module)
    else:
        state = _named(path / _denoiser(cfg)[1], "unet", module.unet)
        for part in _text_folders(cfg):
            state.update(_named(path / part / "model.safetensors", part, getattr(module, part)))
    params = [p for p in module.parameters() if p.requires_grad]
    ckpt: dict[str, Any] = {
        "epoch": 0, "global_step": step, "pytorch-lightning_version": pl.__version__, "state_dict": state,
        "optimizer_states": [_optimizer(path, params)], "lr_schedulers": [_scheduler(path, step)],
        "loops": {name: getattr(trainer, name).state_dict()
                  for name in ("fit_loop", "validate_loop", "test_loop", "predict_loop")},
        "callbacks": {},
    }
    if module.ema is not None:
        ckpt["ema"] = _ema(path, module, step)
    _random_states(path)
    return ckpt
