"""diffusers' training scripts as commands: `train_text_to_image`, `train_text_to_image_lora`, `train_dreambooth`.

`SCRIPT_FLAGS` holds each script's argparse flags as diffusers v0.40.0 defines them (name, default, type,
action, choices, nargs, required; copied from `examples/text_to_image/train_text_to_image.py`,
`examples/text_to_image/train_text_to_image_lora.py` and `examples/dreambooth/train_dreambooth.py`; the rows
the scripts define alike are written once), so `suite diffusion train_x` takes exactly the command line
`accelerate launch train_x.py` takes, defaults included. `HANDLING` says what becomes of each flag here: a
`FineTuneConfig` field (the same name, or a conversion), accepted with a note, or refused with the reason.
`script_config(script, values)` turns the parsed values into a `FineTuneConfig`; a refused flag given with
another value than the script's default raises `InputError` (one line, exit 2) before anything is loaded.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InputError

__all__ = ["COMMON_FLAGS", "DIFFUSERS_VERSION", "HANDLING", "SCRIPTS", "SCRIPT_FLAGS", "TEXT_TO_IMAGE_FLAGS", "Accept",
           "Refuse", "ScriptFlag", "field_help", "flag_table", "script_config", "script_values"]

logger = logging.getLogger(__name__)

DIFFUSERS_VERSION = "0.40.0"


@dataclass(frozen=True)
class ScriptFlag:
    """One `add_argument` of a diffusers training script (name without the leading dashes)."""

    name: str
    default: Any
    type: type | None = None
    action: str | None = None
    choices: tuple[str, ...] | None = None
    nargs: str | None = None
    required: bool = False


_F = ScriptFlag  # the tables' short spelling: _F(name, default, type, action=..., ...)

COMMON_FLAGS: tuple[ScriptFlag, ...] = (
    _F('adam_beta1', 0.9, float),
    _F('adam_beta2', 0.999, float),
    _F('adam_epsilon', 1e-08, float),
    _F('adam_weight_decay', 0.01, float),
    _F('allow_tf32', False, action='store_true'),
    _F('center_crop', False, action='store_true'),
    _F('checkpointing_steps', 500, int),
    _F('checkpoints_total_limit', None, int),
    _F('dataloader_num_workers', 0, int),
    _F('enable_xformers_memory_efficient_attention', False, action='store_true'),
    _F('gradient_accumulation_steps', 1, int),
    _F('gradient_checkpointing', False, action='store_true'),
    _F('hub_model_id', None, str),
    _F('hub_token', None, str),
    _F('local_rank', -1, int),
    _F('logging_dir', 'logs', str),
    _F('lr_scheduler', 'constant', str),
    _F('lr_warmup_steps', 500, int),
    _F('max_grad_norm', 1.0, float),
    _F('max_train_steps', None, int),
    _F('mixed_precision', None, str, choices=('no', 'fp16', 'bf16')),
    _F('pretrained_model_name_or_path', None, str, required=True),
    _F('push_to_hub', False, action='store_true'),
    _F('report_to', 'tensorboard', str),
    _F('resolution', 512, int),
    _F('resume_from_checkpoint', None, str),
    _F('revision', None, str),
    _F('scale_lr', False, action='store_true'),
    _F('seed', None, int),
    _F('snr_gamma', None, float),
    _F('use_8bit_adam', False, action='store_true'),
    _F('variant', None, str),
)
"""The rows all three SD 1.x scripts define alike (the SDXL scripts' tables take them too, `diffusion.sdxl_scripts`)."""
TEXT_TO_IMAGE_FLAGS: tuple[ScriptFlag, ...] = (
    _F('cache_dir', None, str),
    _F('caption_column', 'text', str),
    _F('dataset_config_name', None, str),
    _F('dataset_name', None, str),
    _F('image_column', 'image', str),
    _F('image_interpolation_mode', 'lanczos', str),
    _F('learning_rate', 0.0001, float),
    _F('max_train_samples', None, int),
    _F('noise_offset', 0, float),
    _F('num_train_epochs', 100, int),
    _F('prediction_type', None, str),
    _F('random_flip', False, action='store_true'),
    _F('train_batch_size', 16, int),
    _F('train_data_dir', None, str),
)
"""The rows both text_to_image scripts add alike (SD 1.x and SDXL)."""


def flag_table(*parts: tuple[ScriptFlag, ...]) -> tuple[ScriptFlag, ...]:
    """One script's flags from its shared and own rows (`COMMON_FLAGS`, `TEXT_TO_IMAGE_FLAGS`, the script's), in
    diffusers' order (by name, as `--help` lists them); a name in two parts raises `ValueError`."""
    flags = sorted((f for part in parts for f in part), key=lambda f: f.name)
    if len({f.name for f in flags}) != len(flags):
        raise ValueError("a flag in two parts of one script's table")
    return tuple(flags)


SCRIPT_FLAGS: dict[str, tuple[ScriptFlag, ...]] = {
    # examples/text_to_image/train_text_to_image.py
    "train_text_to_image": flag_table(COMMON_FLAGS, TEXT_TO_IMAGE_FLAGS, (
        _F('dream_detail_preservation', 1.0, float),
        _F('dream_training', False, action='store_true'),
        _F('foreach_ema', False, action='store_true'),
        _F('input_perturbation', 0, float),
        _F('non_ema_revision', None, str),
        _F('offload_ema', False, action='store_true'),
        _F('output_dir', 'sd-model-finetuned', str),
        _F('tracker_project_name', 'text2image-fine-tune', str),
        _F('use_ema', False, action='store_true'),
        _F('validation_epochs', 5, int),
        _F('validation_prompts', None, str, nargs='+'),
    )),
    # examples/text_to_image/train_text_to_image_lora.py
    "train_text_to_image_lora": flag_table(COMMON_FLAGS, TEXT_TO_IMAGE_FLAGS, (
        _F('num_validation_images', 4, int),
        _F('output_dir', 'sd-model-finetuned-lora', str),
        _F('rank', 4, int),
        _F('validation_epochs', 1, int),
        _F('validation_prompt', None, str),
    )),
    "train_dreambooth": flag_table(COMMON_FLAGS, (  # examples/dreambooth/train_dreambooth.py
        _F('class_data_dir', None, str),
        _F('class_labels_conditioning', None),
        _F('class_prompt', None, str),
        _F('instance_data_dir', None, str, required=True),
        _F('instance_prompt', None, str, required=True),
        _F('learning_rate', 5e-06, float),
        _F('lr_num_cycles', 1, int),
        _F('lr_power', 1.0, float),
        _F('num_class_images', 100, int),
        _F('num_train_epochs', 1, int),
        _F('num_validation_images', 4, int),
        _F('offset_noise', False, action='store_true'),
        _F('output_dir', 'dreambooth-model', str),
        _F('pre_compute_text_embeddings', False, action='store_true'),
        _F('prior_generation_precision', None, str, choices=('no', 'fp32', 'fp16', 'bf16')),
        _F('prior_loss_weight', 1.0, float),
        _F('sample_batch_size', 4, int),
        _F('set_grads_to_none', False, action='store_true'),
        _F('skip_save_text_encoder', False, action='store_true'),
        _F('text_encoder_use_attention_mask', False, action='store_true'),
        _F('tokenizer_max_length', None, int),
        _F('tokenizer_name', None, str),
        _F('train_batch_size', 4, int),
        _F('train_text_encoder', False, action='store_true'),
        _F('validation_images', None, nargs='+'),
        _F('validation_prompt', None, str),
        _F('validation_scheduler', 'DPMSolverMultistepScheduler', str,
           choices=('DPMSolverMultistepScheduler', 'DDPMScheduler')),
        _F('validation_steps', 100, int),
        _F('with_prior_preservation', False, action='store_true'),
    )),
}
"""Each script's flags, as diffusers v0.40.0 defines them."""

SCRIPTS: dict[str, str] = {
    "train_text_to_image": "full fine-tune of the UNet (diffusers' examples/text_to_image/train_text_to_image.py)",
    "train_text_to_image_lora": "LoRA fine-tune of the UNet (diffusers' "
                                "examples/text_to_image/train_text_to_image_lora.py)",
    "train_dreambooth": "DreamBooth (diffusers' examples/dreambooth/train_dreambooth.py)",
}
"""The scripts, with one line each."""

# What each script fixes in code rather than by a flag: images per validation prompt and denoising steps of
# its validation pipeline call (text_to_image: one image per prompt, 20 steps; LoRA: 30; DreamBooth: 25).
_FIXED: dict[str, dict[str, Any]] = {
    "train_text_to_image": {"num_validation_images": 1, "num_inference_steps": 20},
    "train_text_to_image_lora": {"num_inference_steps": 30},
    "train_dreambooth": {"num_inference_steps": 25},
}


@dataclass(frozen=True)
class Accept:
    """The flag is implemented: `to(value)` gives the `FineTuneConfig` fields it sets (None: the field of the
    same name). `note` is its help text when not the field's own, and is logged when the flag is given."""

    to: Callable[[Any], dict[str, Any]] | None = None
    note: str | None = None


@dataclass(frozen=True)
class Refuse:
    """The flag cannot apply here; given with another value than the script's default, the run stops with
    `--flag: reason` (exit 2) before anything is loaded."""

    reason: str


_NO_HUB = "nothing is uploaded here (no network); the result stays in --output_dir"
_SAME_NAME = (
    "adam_beta1", "adam_beta2", "adam_epsilon", "adam_weight_decay", "allow_tf32", "cache_dir", "caption_column",
    "center_crop", "checkpointing_steps", "checkpoints_total_limit", "class_data_dir", "class_prompt",
    "dataloader_num_workers", "dataset_config_name", "dataset_name", "dream_detail_preservation", "dream_training",
    "foreach_ema", "gradient_accumulation_steps", "gradient_checkpointing", "image_column",
    "image_interpolation_mode", "input_perturbation", "instance_data_dir", "instance_prompt", "learning_rate",
    "logging_dir", "lr_num_cycles", "lr_power", "lr_scheduler", "lr_warmup_steps", "max_grad_norm",
    "max_train_samples", "max_train_steps", "noise_offset", "non_ema_revision", "num_class_images",
    "num_train_epochs", "num_validation_images", "offload_ema", "output_dir", "prediction_type",
    "pretrained_model_name_or_path", "prior_generation_precision", "prior_loss_weight", "random_flip", "rank",
    "report_to", "resolution", "resume_from_checkpoint", "revision", "sample_batch_size", "scale_lr",
    "skip_save_text_encoder", "snr_gamma", "text_encoder_use_attention_mask", "tokenizer_max_length",
    "tokenizer_name", "tracker_project_name", "train_batch_size", "train_data_dir", "train_text_encoder",
    "use_8bit_adam", "use_ema", "validation_epochs", "validation_prompt", "validation_prompts",
    "validation_scheduler", "validation_steps", "variant", "with_prior_preservation",
)

HANDLING: dict[str, Accept | Refuse] = {
    **{name: Accept() for name in _SAME_NAME},
    "seed": Accept(lambda v: {"seed": 0 if v is None else v},
                   "seed of data order, augmentation, noise and timesteps (default: 0 here, so that a run repeats "
                   "and resumes exactly; diffusers leaves it unseeded)"),
    "mixed_precision": Accept(lambda v: {"mixed_precision": v or "no"},
                              "no, fp16 or bf16 (default: no, as accelerate without a config file)"),
    "offset_noise": Accept(lambda v: {"noise_offset": 0.1} if v else {},
                           "DreamBooth's offset noise: the same as --noise_offset 0.1"),
    "enable_xformers_memory_efficient_attention": Accept(
        lambda v: {}, "memory-efficient attention is always on here (kernels.attention; see --attention_backend)"),
    "set_grads_to_none": Accept(lambda v: {}, "gradients are always set to None between steps here"),
    "pre_compute_text_embeddings": Accept(
        lambda v: {}, "the frozen text encoder runs in the training step here (same result); refused with "
                      "--train_text_encoder, as diffusers does"),
    "push_to_hub": Refuse(_NO_HUB),
    "hub_token": Refuse(_NO_HUB),
    "hub_model_id": Refuse(_NO_HUB),
    "local_rank": Refuse("set by torch.distributed launchers; here --devices and --num_nodes start the processes"),
    "class_labels_conditioning": Refuse("class-label conditioning is for UNets with a class embedding (DeepFloyd "
                                        "IF's upscaler); Stable Diffusion's UNet has none"),
    "validation_images": Refuse("image-conditioned validation is for DeepFloyd IF's upscaler; Stable Diffusion "
                                "validates from --validation_prompt"),
}
"""What becomes of every flag of the three scripts."""


@functools.cache
def field_help() -> dict[str, str]:
    """`FineTuneConfig` setting name -> its docstring (the help of a same-name flag)."""
    from ..utils.settings import settings
    from .config import FineTuneConfig

    return {name: s.help for name, s in settings(FineTuneConfig).items()}


def flag_help(flag: ScriptFlag) -> str:
    """The --help text of a script flag here."""
    how = HANDLING[flag.name]
    if isinstance(how, Refuse):
        return f"refused when given: {how.reason}"
    text = how.note or field_help().get(flag.name, "")
    if flag.default not in (None, False) and "default:" not in text:
        text = f"{text} (default: {flag.default})"
    return text


def script_values(script: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """The flag values with the scripts' meaning where it is not the setting's own, checked value by value
    (tests/diffusion/test_flag_values.py walks the table of 0, negative and empty values):

    - a negative `--checkpointing_steps`, `--validation_epochs` or `--validation_steps` k: every |k| (the
      scripts test `step % k == 0`); 0 is refused where the script divides by it, unused otherwise;
    - `--num_validation_images` <= 0: no validation images (`range(n)` is empty);
    - an empty `--train_data_dir` / `--instance_data_dir`: the current folder (`os.path.join("", "**")`,
      `Path("")`);
    - refused in one line: what the script fails on (an empty `--output_dir`, `--pretrained_model_name_or_path`,
      `--dataset_name` or `--variant`), and `--max_grad_norm 0`, with which the script clips every gradient to
      norm 0 and trains nothing but weight decay (a run that would train nothing says so).
    """
    out = dict(values)
    prompts = out.get("validation_prompt") is not None or out.get("validation_prompts") is not None
    for name in ("checkpointing_steps", "validation_epochs", "validation_steps"):
        k = out.get(name)
        if k is None or k > 0:
            continue
        if k < 0:
            out[name] = -k
            logger.info("--%s %d: every %d (diffusers' scripts test step %% %d == 0)", name, k, -k, k)
        elif name == "checkpointing_steps" or prompts:
            raise InputError(f"--{name} 0: diffusers' {script} divides by it (ZeroDivisionError); give a "
                             "positive number")
        else:
            del out[name]  # unused without validation prompts, as in the script
    if out.get("num_validation_images") is not None and out["num_validation_images"] < 0:
        out["num_validation_images"] = 0
    for name in ("train_data_dir", "instance_data_dir"):
        if out.get(name) == "":
            out[name] = "."
    for name in ("output_dir", "pretrained_model_name_or_path", "dataset_name", "variant"):
        if out.get(name) == "":
            raise InputError(f"--{name}: empty (diffusers' {script} fails on it too)")
    if out.get("max_grad_norm") == 0:
        raise InputError("--max_grad_norm 0: diffusers' scripts clip every gradient to norm 0, so nothing but "
                         "weight decay would train; give a positive norm")
    return out


def script_config(script: str, values: Mapping[str, Any], launch: Mapping[str, Any] | None = None) -> Any:
    """The `FineTuneConfig` of `suite diffusion <script>` from its parsed flag values (every flag of the
    script, at its default unless given) and the launcher's settings (`strategy`, `devices`, ...).

    Raises `InputError` (one line) for refused flags given with another value than the script's default, for
    what the script itself refuses, and for bad values.
    """
    from .config import FineTuneConfig

    flags = {f.name: f for f in SCRIPT_FLAGS[script]}
    given = {name: v for name, v in values.items() if name in flags and v != flags[name].default}
    values = script_values(script, values)
    refused = [f"--{name}: {how.reason}" for name in given if isinstance(how := HANDLING[name], Refuse)]
    if refused:
        raise InputError("; ".join(refused))
    if script != "train_dreambooth" and not values.get("dataset_name") and not values.get("train_data_dir"):
        raise InputError(f"{script} needs --dataset_name or --train_data_dir")
    if values.get("pre_compute_text_embeddings") and values.get("train_text_encoder"):
        raise InputError("--train_text_encoder and --pre_compute_text_embeddings exclude each other")
    if script == "train_dreambooth" and not values.get("with_prior_preservation"):
        for name in ("class_data_dir", "class_prompt"):
            if values.get(name):
                logger.warning("--%s is not used without --with_prior_preservation", name)
    fields: dict[str, Any] = dict(_FIXED[script])
    for name, flag in flags.items():
        how = HANDLING[name]
        if isinstance(how, Refuse):
            continue
        value = values.get(name, flag.default)
        fields.update(how.to(value) if how.to else {name: value})
        if how.note and name in given:
            logger.info("--%s: %s", name, how.note)
    fields.update(launch or {})
    try:
        return FineTuneConfig(**fields)
    except ValueError as exc:  # the refusal in the flag's name (a section's own field may be named otherwise)
        from ..utils.settings import explain

        raise InputError(explain(FineTuneConfig, exc, {})) from exc
