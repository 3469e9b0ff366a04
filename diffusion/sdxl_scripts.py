"""diffusers' SDXL training scripts as commands: `train_text_to_image_sdxl`, `train_text_to_image_lora_sdxl`,
`train_dreambooth_lora_sdxl` (diffusers v0.40.0's `examples/text_to_image/train_text_to_image_sdxl.py`,
`train_text_to_image_lora_sdxl.py` and `examples/dreambooth/train_dreambooth_lora_sdxl.py`).

As for the SD 1.x scripts (`diffusion.scripts`), `SDXL_SCRIPT_FLAGS` holds each script's argparse flags (the rows
the SD 1.x scripts define alike are taken from there, the SDXL rows written here) and `SDXL_HANDLING` what becomes
of each flag the SD 1.x table does not already handle: a `FineTuneConfig` or `SDXLSettings` field, or a refusal
with the reason. `sdxl_script_config` turns the parsed values into a `FineTuneConfig` whose `extra["sdxl"]` is
the run's `SDXLSettings`; a refused flag given with another value than the script's default is one `InputError`
before anything loads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InputError
from .scripts import (
    COMMON_FLAGS,
    HANDLING,
    TEXT_TO_IMAGE_FLAGS,
    Accept,
    Refuse,
    ScriptFlag,
    flag_table,
    script_values,
)

__all__ = ["SDXL_HANDLING", "SDXL_SCRIPTS", "SDXL_SCRIPT_FLAGS", "SDXLSettings", "handling", "sdxl_script_config"]

logger = logging.getLogger(__name__)

_F = ScriptFlag  # the tables' short spelling, as in diffusion.scripts


@dataclass(kw_only=True)
class SDXLSettings:
    """What the SDXL scripts set beyond a `FineTuneConfig` (kept in its `extra["sdxl"]`)."""

    pretrained_vae_model_name_or_path: str | None = None
    """A VAE folder (config.json + weights) used instead of the pipeline's (e.g. an fp16-safe SDXL VAE)."""
    proportion_empty_prompts: float = 0.0
    """Share of captions replaced by the empty prompt (text_to_image_sdxl)."""
    text_encoder_lr: float | None = None
    """Learning rate of the text encoders' LoRA (DreamBooth LoRA; default: learning_rate)."""
    adam_weight_decay_text_encoder: float | None = None
    """AdamW weight decay of the text encoders' LoRA (DreamBooth LoRA; default: adam_weight_decay)."""
    repeats: int = 1
    """How many times the instance images are repeated per epoch (DreamBooth LoRA)."""
    lora_dropout: float = 0.0
    """Dropout probability of the LoRA layers' input (DreamBooth LoRA: peft's `LoraConfig(lora_dropout=...)` of the
    UNet's and, with --train_text_encoder, both text encoders' adapters)."""
    do_edm_style_training: bool = False
    """EDM-style training (Karras et al. 2022 preconditioning, `training.edm_loss`) with the folder's own noise
    schedule (DreamBooth LoRA); a folder whose scheduler is EDM (Playground v2.5, CosXL) trains so without it."""
    vae_in_training_dtype: bool = False
    """The frozen VAE in the training dtype (the LoRA and full scripts with a separate VAE); else fp32, since
    SDXL's own VAE overflows in fp16."""
    precompute: str = "auto"
    """Compute once, before the UNet trains, and free the models that made them: `text` (both text encoders'
    embeddings of every prompt), `latents` (the VAE latents of every image, one crop and flip each, as
    train_text_to_image_sdxl.py), `both`, or `none`; `auto`: what the script does (text_to_image_sdxl both,
    dreambooth_lora_sdxl text unless --train_text_encoder, text_to_image_lora_sdxl none), resolved by the commands
    (`sdxl_script_config`); settings built in code without a script compute nothing for `auto`."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.proportion_empty_prompts <= 1.0:
            raise ValueError(f"proportion_empty_prompts must be in [0, 1], got {self.proportion_empty_prompts}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.text_encoder_lr is not None and self.text_encoder_lr <= 0:
            raise ValueError(f"text_encoder_lr must be > 0, got {self.text_encoder_lr}")
        from .precompute import check_precompute

        check_precompute(self.precompute, train_text_encoder=False)  # the combination: `sdxl_script_config`



def _without(part: tuple[ScriptFlag, ...], *names: str) -> tuple[ScriptFlag, ...]:
    return tuple(f for f in part if f.name not in names)


_SDXL_T2I = (  # the rows both text_to_image SDXL scripts add alike
    _F('enable_npu_flash_attention', False, action='store_true'),
    _F('num_validation_images', 4, int),
    _F('pretrained_vae_model_name_or_path', None, str),
    _F('resolution', 1024, int),
    _F('validation_epochs', 1, int),
    _F('validation_prompt', None, str),
)

SDXL_SCRIPT_FLAGS: dict[str, tuple[ScriptFlag, ...]] = {
    "train_text_to_image_sdxl": flag_table(_without(COMMON_FLAGS, "resolution"), TEXT_TO_IMAGE_FLAGS, _SDXL_T2I, (
        _F('output_dir', 'sdxl-model-finetuned', str),
        _F('proportion_empty_prompts', 0, float),
        _F('timestep_bias_begin', 0, int),
        _F('timestep_bias_end', 1000, int),
        _F('timestep_bias_multiplier', 1.0, float),
        _F('timestep_bias_portion', 0.25, float),
        _F('timestep_bias_strategy', 'none', str, choices=('earlier', 'later', 'range', 'none')),
        _F('use_ema', False, action='store_true'),
    )),
    "train_text_to_image_lora_sdxl": flag_table(_without(COMMON_FLAGS, "resolution"), TEXT_TO_IMAGE_FLAGS, _SDXL_T2I, (
        _F('debug_loss', False, action='store_true'),
        _F('output_dir', 'sd-model-finetuned-lora', str),
        _F('rank', 4, int),
        _F('train_text_encoder', False, action='store_true'),
    )),
    "train_dreambooth_lora_sdxl": flag_table(
        _without(COMMON_FLAGS, "resolution", "adam_weight_decay"),
        _without(TEXT_TO_IMAGE_FLAGS, "caption_column", "num_train_epochs", "train_batch_size", "max_train_samples",
                 "noise_offset", "prediction_type", "train_data_dir"), (
            _F('adam_weight_decay', 0.0001, float),
            _F('adam_weight_decay_text_encoder', 0.001, float),
            _F('caption_column', None, str),
            _F('class_data_dir', None, str),
            _F('class_prompt', None, str),
            _F('do_edm_style_training', False, action='store_true'),
            _F('instance_data_dir', None, str),
            _F('instance_prompt', None, str, required=True),
            _F('lora_dropout', 0.0, float),
            _F('lr_num_cycles', 1, int),
            _F('lr_power', 1.0, float),
            _F('num_class_images', 100, int),
            _F('num_train_epochs', 1, int),
            _F('num_validation_images', 4, int),
            _F('optimizer', 'AdamW', str),
            _F('output_dir', 'lora-dreambooth-model', str),
            _F('output_kohya_format', False, action='store_true'),
            _F('pretrained_vae_model_name_or_path', None, str),
            _F('prior_generation_precision', None, str, choices=('no', 'fp32', 'fp16', 'bf16')),
            _F('prior_loss_weight', 1.0, float),
            _F('prodigy_beta3', None, float),
            _F('prodigy_decouple', True, bool),
            _F('prodigy_safeguard_warmup', True, bool),
            _F('prodigy_use_bias_correction', True, bool),
            _F('rank', 4, int),
            _F('repeats', 1, int),
            _F('resolution', 1024, int),
            _F('sample_batch_size', 4, int),
            _F('text_encoder_lr', 5e-06, float),
            _F('train_batch_size', 4, int),
            _F('train_text_encoder', False, action='store_true'),
            _F('use_dora', False, action='store_true'),
            _F('validation_epochs', 50, int),
            _F('validation_prompt', None, str),
            _F('with_prior_preservation', False, action='store_true'),
        )),
}
"""Each SDXL script's flags, as diffusers v0.40.0 defines them."""

SDXL_SCRIPTS: dict[str, str] = {
    "train_text_to_image_sdxl": "full fine-tune of the SDXL UNet (diffusers' "
                                "examples/text_to_image/train_text_to_image_sdxl.py)",
    "train_text_to_image_lora_sdxl": "LoRA fine-tune of SDXL (diffusers' "
                                     "examples/text_to_image/train_text_to_image_lora_sdxl.py)",
    "train_dreambooth_lora_sdxl": "DreamBooth LoRA of SDXL (diffusers' "
                                  "examples/dreambooth/train_dreambooth_lora_sdxl.py)",
}
"""The SDXL scripts, with one line each."""

# What each script fixes in code: the denoising steps of its validation pipeline call (25 in all three).
_FIXED: dict[str, Any] = {"num_inference_steps": 25}

_SDXL_FIELD = ("pretrained_vae_model_name_or_path", "proportion_empty_prompts", "repeats",
               "adam_weight_decay_text_encoder", "do_edm_style_training", "lora_dropout")


def _text_encoder_lr(v: float | None) -> dict[str, Any]:
    return {"text_encoder_lr": v}


def _optimizer(v: str) -> dict[str, Any]:
    if v.lower() != "adamw":
        raise InputError(f"--optimizer {v}: only AdamW is available here (Prodigy needs the prodigyopt package, "
                         "which this project does not use)")
    return {}


_NOT_HERE = "not implemented here"
SDXL_HANDLING: dict[str, Accept | Refuse] = {
    **{name: Accept(lambda v, name=name: {name: v}) for name in _SDXL_FIELD},
    "text_encoder_lr": Accept(_text_encoder_lr),
    "optimizer": Accept(_optimizer, "AdamW (Prodigy is refused)"),
    **{name: Accept(lambda v: {}, "used only by --optimizer prodigy, which is refused here")
       for name in ("prodigy_beta3", "prodigy_decouple", "prodigy_safeguard_warmup", "prodigy_use_bias_correction")},
    "enable_npu_flash_attention": Refuse("Ascend NPUs are not supported here; attention is kernels.attention's"),
    "debug_loss": Refuse("per-file loss logs need the dataset's file names, which are not kept here"),
    "timestep_bias_strategy": Refuse(f"timestep bias sampling is {_NOT_HERE}; timesteps are drawn uniformly"),
    "timestep_bias_begin": Refuse("used only with --timestep_bias_strategy, which is refused here"),
    "timestep_bias_end": Refuse("used only with --timestep_bias_strategy, which is refused here"),
    "timestep_bias_multiplier": Refuse("used only with --timestep_bias_strategy, which is refused here"),
    "timestep_bias_portion": Refuse("used only with --timestep_bias_strategy, which is refused here"),
    "use_dora": Refuse(f"DoRA adapters are {_NOT_HERE}; LoRA (--rank) is"),
    "output_kohya_format": Refuse(f"the Kohya file format is {_NOT_HERE}; the diffusers LoRA file is written"),
}
"""What becomes of the SDXL scripts' flags beyond the SD 1.x scripts' table (`diffusion.scripts.HANDLING`)."""

def handling(script: str, name: str) -> Accept | Refuse:
    """What becomes of flag `name` of `script`."""
    return SDXL_HANDLING.get(name) or HANDLING[name]


def _checks(script: str, values: Mapping[str, Any]) -> None:
    """What the scripts themselves refuse, before anything loads."""
    if script == "train_dreambooth_lora_sdxl":
        # custom captions: --dataset_name's images, each with its --caption_column caption, the instance prompt
        # where it has none (or for all without --caption_column), as the script's DreamBoothDataset
        if not values.get("instance_data_dir") and not values.get("dataset_name"):
            raise InputError("train_dreambooth_lora_sdxl needs --dataset_name or --instance_data_dir")
        if values.get("do_edm_style_training") and values.get("snr_gamma") is not None:
            raise InputError("--snr_gamma: Min-SNR weighting is not supported with --do_edm_style_training (the "
                             "script refuses it too)")
        if values.get("instance_data_dir") and values.get("dataset_name"):
            raise InputError("--dataset_name and --instance_data_dir exclude each other (the script: specify only "
                             "one of them)")
    elif not values.get("dataset_name") and not values.get("train_data_dir"):
        raise InputError(f"{script} needs --dataset_name or --train_data_dir")
    if script == "train_dreambooth_lora_sdxl" and not values.get("with_prior_preservation"):
        for name in ("class_data_dir", "class_prompt"):
            if values.get(name):
                logger.warning("--%s is not used without --with_prior_preservation", name)


def sdxl_script_config(script: str, values: Mapping[str, Any], launch: Mapping[str, Any] | None = None,
                       precompute: str = "auto") -> Any:
    """The `FineTuneConfig` of `suite diffusion <script>` (an SDXL script), its `extra["sdxl"]` the run's
    `SDXLSettings`, from the parsed flag values and the launcher's settings (`precompute`: `--precompute`, auto
    resolved to what the script does). Raises `InputError` (one line) for refused flags given with another value
    than the default, for what the script refuses, and for bad values."""
    from .config import FineTuneConfig
    from .precompute import check_precompute, script_precompute

    flags = {f.name: f for f in SDXL_SCRIPT_FLAGS[script]}
    given = {name: v for name, v in values.items() if name in flags and v != flags[name].default}
    values = script_values(script, values)  # 0, negative and empty values with the scripts' meaning
    refused = [f"--{name}: {how.reason}" for name in given if isinstance(how := handling(script, name), Refuse)]
    if refused:
        raise InputError("; ".join(refused))
    _checks(script, values)
    fields: dict[str, Any] = dict(_FIXED)
    sdxl: dict[str, Any] = {"vae_in_training_dtype": script != "train_dreambooth_lora_sdxl"
                            and bool(values.get("pretrained_vae_model_name_or_path"))}
    for name, flag in flags.items():
        how = handling(script, name)
        if isinstance(how, Refuse):
            continue
        value = values.get(name, flag.default)
        out = how.to(value) if how.to else {name: value}
        for key, v in out.items():
            (sdxl if key in {*_SDXL_FIELD, "text_encoder_lr"} else fields)[key] = v
        if how.note and name in given:
            logger.info("--%s: %s", name, how.note)
    if script != "train_dreambooth_lora_sdxl" or not values.get("train_text_encoder"):
        sdxl.pop("text_encoder_lr", None)  # only DreamBooth LoRA's text encoders have their own
        sdxl.pop("adam_weight_decay_text_encoder", None)
    fields.update(launch or {})
    train_te = bool(values.get("train_text_encoder"))
    try:
        check_precompute(precompute, train_te)
    except ValueError as exc:
        raise InputError(f"--{exc}") from None
    sdxl["precompute"] = script_precompute(script, train_te) if precompute == "auto" else precompute
    try:
        fields["extra"] = {"sdxl": SDXLSettings(**sdxl)}
        return FineTuneConfig(**fields)
    except ValueError as exc:
        raise InputError(f"--{exc}") from exc
