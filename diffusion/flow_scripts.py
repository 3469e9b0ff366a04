"""diffusers' SD3 and Flux DreamBooth scripts as commands: `train_dreambooth_sd3`, `train_dreambooth_lora_sd3`,
`train_dreambooth_flux`, `train_dreambooth_lora_flux` (diffusers v0.40.0's `examples/dreambooth/train_dreambooth_
{,lora_}{sd3,flux}.py`).

As for the SD 1.x and SDXL scripts (`diffusion.scripts`, `diffusion.sdxl_scripts`), `FLOW_SCRIPT_FLAGS` holds each
script's argparse flags (the rows all four define alike written once) and `FLOW_HANDLING` what becomes of each flag
the other tables do not already handle: a `FineTuneConfig` field, a `FlowSettings` field, or a refusal with the
reason. `flow_script_config` turns the parsed values into a `FineTuneConfig` whose `extra["flow"]` is the run's
`FlowSettings`; a refused flag given with another value than the script's default is one `InputError` before
anything loads.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InputError
from .flow import WEIGHTING_SCHEMES
from .scripts import HANDLING, Accept, Refuse, ScriptFlag, flag_table, script_values
from .sdxl_scripts import SDXL_HANDLING

__all__ = ["FLOW_HANDLING", "FLOW_SCRIPTS", "FLOW_SCRIPT_FLAGS", "FlowSettings", "flow_handling", "flow_script_config",
           "script_family"]

logger = logging.getLogger(__name__)

_F = ScriptFlag


@dataclass(kw_only=True)
class FlowSettings:
    """What the SD3 and Flux scripts set beyond a `FineTuneConfig` (kept in its `extra["flow"]`)."""

    family: str = "sd3"
    """The model family trained: `sd3` or `flux`."""
    weighting_scheme: str = "logit_normal"
    """Timestep density and loss weight: sigma_sqrt, logit_normal, mode, cosmap or none (`diffusion.flow`)."""
    logit_mean: float = 0.0
    """Mean of the logit-normal timestep density."""
    logit_std: float = 1.0
    """Standard deviation of the logit-normal timestep density."""
    mode_scale: float = 1.29
    """Scale of the mode timestep density."""
    precondition_outputs: bool = False
    """SD3: the loss compares `x_s - s * pred` with the clean latents (EDM-style preconditioning of the output)."""
    max_sequence_length: int = 77
    """T5's token length of every prompt."""
    guidance_scale: float = 3.5
    """Flux: the guidance the transformer is conditioned on in training, where it embeds guidance (Flux.1-dev);
    validation images use the pipeline's default, as the script's."""
    lora_layers: str | None = None
    """Comma-separated module names the transformer's LoRA adapts (default: the script's attention layers)."""
    lora_blocks: str | None = None
    """SD3: comma-separated `transformer_blocks` indices the LoRA is restricted to."""
    lora_alpha: int | None = None
    """Flux: LoRA alpha (None: the rank, as SD3's script)."""
    lora_dropout: float = 0.0
    """Dropout probability of the LoRA layers' input (peft's `LoraConfig(lora_dropout=...)`: the transformer's and,
    with --train_text_encoder, the CLIP encoders')."""
    repeats: int = 1
    """How many times the instance images are repeated per epoch."""
    cache_latents: bool = False
    """VAE posteriors computed once per image (one crop and flip), sampled every step; the VAE dropped."""
    text_encoder_lr: float | None = None
    """Learning rate of the trained text encoders (their LoRA, or the full scripts' whole encoders, with
    --train_text_encoder; default: learning_rate)."""
    adam_weight_decay_text_encoder: float | None = None
    """AdamW weight decay of the trained text encoders (default: adam_weight_decay)."""

    def __post_init__(self) -> None:
        if self.family not in ("sd3", "flux"):
            raise ValueError(f"family must be sd3 or flux, got {self.family!r}")
        if self.weighting_scheme not in WEIGHTING_SCHEMES:
            raise ValueError(f"weighting_scheme must be one of {', '.join(WEIGHTING_SCHEMES)}, got "
                             f"{self.weighting_scheme!r}")
        if self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {self.max_sequence_length}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_blocks is not None:
            try:
                [int(b) for b in self.lora_blocks.split(",")]
            except ValueError:
                raise ValueError(f"lora_blocks must be comma-separated block numbers, got {self.lora_blocks!r}"
                                 ) from None

    def lora_targets(self) -> list[str]:
        """The transformer's module names LoRA adapts, as the scripts build `target_modules`."""
        if self.lora_layers is not None:
            targets = [t.strip() for t in self.lora_layers.split(",")]
        else:
            targets = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                       "attn.to_out.0", "attn.to_q", "attn.to_v"]
            if self.family == "flux":
                targets += ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
        if self.lora_blocks is not None:
            blocks = [int(b.strip()) for b in self.lora_blocks.split(",")]
            targets = [f"transformer_blocks.{b}.{t}" for b in blocks for t in targets]
        return targets


_COMMON = (  # the rows all four scripts define alike
    _F('adam_beta1', 0.9, float), _F('adam_beta2', 0.999, float), _F('adam_epsilon', 1e-08, float),
    _F('adam_weight_decay', 0.0001, float), _F('adam_weight_decay_text_encoder', 0.001, float),
    _F('allow_tf32', False, action='store_true'), _F('cache_dir', None, str), _F('caption_column', None, str),
    _F('center_crop', False, action='store_true'), _F('checkpointing_steps', 500, int),
    _F('checkpoints_total_limit', None, int), _F('class_data_dir', None, str), _F('class_prompt', None, str),
    _F('dataloader_num_workers', 0, int), _F('dataset_config_name', None, str), _F('dataset_name', None, str),
    _F('gradient_accumulation_steps', 1, int), _F('gradient_checkpointing', False, action='store_true'),
    _F('hub_model_id', None, str), _F('hub_token', None, str), _F('image_column', 'image', str),
    _F('instance_data_dir', None, str), _F('instance_prompt', None, str, required=True),
    _F('learning_rate', 0.0001, float), _F('local_rank', -1, int), _F('logging_dir', 'logs', str),
    _F('logit_mean', 0.0, float), _F('logit_std', 1.0, float), _F('lr_num_cycles', 1, int),
    _F('lr_power', 1.0, float), _F('lr_scheduler', 'constant', str), _F('lr_warmup_steps', 500, int),
    _F('max_grad_norm', 1.0, float), _F('max_train_steps', None, int),
    _F('mixed_precision', None, str, choices=('no', 'fp16', 'bf16')), _F('mode_scale', 1.29, float),
    _F('num_class_images', 100, int), _F('num_train_epochs', 1, int), _F('num_validation_images', 4, int),
    _F('optimizer', 'AdamW', str), _F('pretrained_model_name_or_path', None, str, required=True),
    _F('prior_generation_precision', None, str, choices=('no', 'fp32', 'fp16', 'bf16')),
    _F('prior_loss_weight', 1.0, float), _F('prodigy_beta3', None, float), _F('prodigy_decouple', True, bool),
    _F('prodigy_safeguard_warmup', True, bool), _F('prodigy_use_bias_correction', True, bool),
    _F('push_to_hub', False, action='store_true'), _F('random_flip', False, action='store_true'),
    _F('repeats', 1, int), _F('report_to', 'tensorboard', str), _F('resolution', 512, int),
    _F('resume_from_checkpoint', None, str), _F('revision', None, str), _F('sample_batch_size', 4, int),
    _F('scale_lr', False, action='store_true'), _F('seed', None, int), _F('text_encoder_lr', 5e-06, float),
    _F('train_batch_size', 4, int), _F('train_text_encoder', False, action='store_true'),
    _F('use_8bit_adam', False, action='store_true'), _F('validation_epochs', 50, int),
    _F('validation_prompt', None, str), _F('variant', None, str),
    _F('with_prior_preservation', False, action='store_true'),
)
_SD3 = (
    _F('max_sequence_length', 77, int), _F('precondition_outputs', 1, int),
    _F('weighting_scheme', 'logit_normal', str, choices=('sigma_sqrt', 'logit_normal', 'mode', 'cosmap')),
)
_FLUX = (
    _F('enable_npu_flash_attention', False, action='store_true'), _F('guidance_scale', 3.5, float),
    _F('weighting_scheme', 'none', str, choices=WEIGHTING_SCHEMES),
)
_LORA = (
    _F('cache_latents', False, action='store_true'), _F('lora_dropout', 0.0, float), _F('lora_layers', None, str),
    _F('rank', 4, int), _F('upcast_before_saving', False, action='store_true'),
)
_INTERPOLATION = ('bicubic', 'bilinear', 'box', 'hamming', 'lanczos', 'nearest', 'nearest_exact')

FLOW_SCRIPT_FLAGS: dict[str, tuple[ScriptFlag, ...]] = {
    "train_dreambooth_sd3": flag_table(_COMMON, _SD3, (_F('output_dir', 'sd3-dreambooth', str),)),
    "train_dreambooth_lora_sd3": flag_table(_COMMON, _SD3, _LORA, (
        _F('lora_blocks', None, str), _F('output_dir', 'sd3-dreambooth', str))),
    "train_dreambooth_flux": flag_table(_COMMON, _FLUX, (
        _F('image_interpolation_mode', 'lanczos', str, choices=_INTERPOLATION),
        _F('max_sequence_length', 77, int), _F('output_dir', 'flux-dreambooth', str))),
    "train_dreambooth_lora_flux": flag_table(_COMMON, _FLUX, _LORA, (
        _F('lora_alpha', 4, int), _F('max_sequence_length', 512, int), _F('output_dir', 'flux-dreambooth-lora', str))),
}
"""Each SD3 / Flux script's flags, as diffusers v0.40.0 defines them."""

FLOW_SCRIPTS: dict[str, str] = {
    "train_dreambooth_sd3": "DreamBooth full fine-tune of the SD3 transformer (diffusers' "
                            "examples/dreambooth/train_dreambooth_sd3.py)",
    "train_dreambooth_lora_sd3": "DreamBooth LoRA of SD3 (diffusers' "
                                 "examples/dreambooth/train_dreambooth_lora_sd3.py)",
    "train_dreambooth_flux": "DreamBooth full fine-tune of the Flux transformer (diffusers' "
                             "examples/dreambooth/train_dreambooth_flux.py)",
    "train_dreambooth_lora_flux": "DreamBooth LoRA of Flux (diffusers' "
                                  "examples/dreambooth/train_dreambooth_lora_flux.py)",
}
"""The SD3 and Flux scripts, with one line each."""

_FIXED: dict[str, Any] = {"num_inference_steps": 28}  # the validation pipelines' default steps (SD3's and Flux's)
_FLOW_FIELD = ("weighting_scheme", "logit_mean", "logit_std", "mode_scale", "max_sequence_length", "guidance_scale",
               "lora_layers", "lora_blocks", "lora_alpha", "lora_dropout", "repeats", "cache_latents",
               "text_encoder_lr", "adam_weight_decay_text_encoder")
_LORA_TE = Accept(None, "LoRA on the CLIP text encoders too (T5 stays frozen), their prompts encoded every step")
_FULL_TE = {
    "sd3": Accept(None, "CLIP-L, CLIP-G and T5 trained whole with the transformer (as train_dreambooth_sd3.py sets "
                        "them up), their prompts encoded every step"),
    "flux": Accept(None, "the CLIP encoder trained whole with the transformer (T5 stays frozen), the prompts encoded "
                         "every step"),
}

FLOW_HANDLING: dict[str, Accept | Refuse] = {
    **{name: Accept(lambda v, name=name: {name: v}) for name in _FLOW_FIELD},
    "precondition_outputs": Accept(lambda v: {"precondition_outputs": bool(v)},
                                   "1: the loss compares x_s - s * pred with the clean latents; 0: the velocity"),
    "upcast_before_saving": Accept(lambda v: {}, "the LoRA weights train and are written in fp32 here"),
}
"""What becomes of the SD3/Flux scripts' flags beyond the SD 1.x and SDXL tables."""


def flow_handling(script: str, name: str) -> Accept | Refuse:
    """What becomes of flag `name` of `script`."""
    if name == "train_text_encoder":
        return _LORA_TE if "lora" in script else _FULL_TE[script_family(script)]
    return FLOW_HANDLING.get(name) or SDXL_HANDLING.get(name) or HANDLING[name]


def script_family(script: str) -> str:
    """`sd3` or `flux`: the family a script trains."""
    return "flux" if script.endswith("flux") else "sd3"


def _checks(script: str, values: Mapping[str, Any]) -> None:
    """What the scripts themselves refuse, before anything loads."""
    if not values.get("instance_data_dir") and not values.get("dataset_name"):
        raise InputError(f"{script} needs --dataset_name or --instance_data_dir")
    if values.get("instance_data_dir") and values.get("dataset_name"):
        raise InputError("--dataset_name and --instance_data_dir exclude each other (the script: specify only one "
                         "of them)")
    if not values.get("with_prior_preservation"):
        for name in ("class_data_dir", "class_prompt"):
            if values.get(name):
                logger.warning("--%s is not used without --with_prior_preservation", name)
    if values.get("resolution", 1) % 16 and script_family(script) == "flux":
        raise InputError(f"--resolution {values['resolution']}: Flux packs 2x2 latent patches, so the side must be "
                         "a multiple of 16")


def flow_script_config(script: str, values: Mapping[str, Any], launch: Mapping[str, Any] | None = None) -> Any:
    """The `FineTuneConfig` of `suite diffusion <script>` (an SD3 or Flux script), its `extra["flow"]` the run's
    `FlowSettings`, from the parsed flag values and the launcher's settings. Raises `InputError` (one line) for
    refused flags given with another value than the default, for what the script refuses, and for bad values."""
    from .config import FineTuneConfig

    flags = {f.name: f for f in FLOW_SCRIPT_FLAGS[script]}
    given = {name: v for name, v in values.items() if name in flags and v != flags[name].default}
    values = script_values(script, values)
    refused = [f"--{name}: {how.reason}" for name in given if isinstance(how := flow_handling(script, name), Refuse)]
    if refused:
        raise InputError("; ".join(refused))
    _checks(script, values)
    fields: dict[str, Any] = dict(_FIXED)
    flow: dict[str, Any] = {"family": script_family(script)}
    for name, flag in flags.items():
        how = flow_handling(script, name)
        if isinstance(how, Refuse):
            continue
        value = values.get(name, flag.default)
        for key, v in (how.to(value) if how.to else {name: value}).items():
            (flow if key in {*_FLOW_FIELD, "precondition_outputs"} else fields)[key] = v
        if how.note and name in given:
            logger.info("--%s: %s", name, how.note)
    if "lora" not in script:
        fields["rank"] = None
    if not values.get("train_text_encoder"):
        flow.pop("text_encoder_lr", None)  # only the text encoders' LoRA has its own
        flow.pop("adam_weight_decay_text_encoder", None)
    fields.update(launch or {})
    try:
        fields["extra"] = {"flow": FlowSettings(**flow)}
        return FineTuneConfig(**fields)
    except ValueError as exc:
        raise InputError(f"--{exc}") from exc
