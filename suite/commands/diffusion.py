"""`suite diffusion finetune`: Stable Diffusion fine-tuning (full, LoRA, DreamBooth) with diffusers' flag names;
`suite diffusion train_text_to_image | train_text_to_image_lora | train_dreambooth`: diffusers' training scripts'
command lines, flag for flag and default for default (`accelerate launch train_x.py ...` becomes
`suite diffusion train_x ...`).

`finetune`'s flags override `--config FILE` (a recipe YAML: a shipped name such as `lora`, or a path), which
overrides the built-in defaults. Heavy imports (torch, diffusers, Lightning) happen inside `run`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["FLAGS", "LAUNCH_FLAGS", "add_arguments", "run"]

# (flag, type or "bool", default shown in --help, help). The flag name is the FineTuneConfig field name.
FLAGS: list[tuple[str, object, object, str]] = [
    ("pretrained_model_name_or_path", str, None, "diffusers pipeline folder or .safetensors/.ckpt file "
     "(default: a tiny pipeline built offline)"),
    ("train_data_dir", str, None, "imagefolder with metadata.jsonl, or images with .txt captions "
     "(default: a generated sample set)"),
    ("image_column", str, "image", "metadata.jsonl key of the image path when not file_name"),
    ("caption_column", str, "text", "metadata.jsonl key of the caption"),
    ("instance_data_dir", str, None, "DreamBooth: folder of instance images"),
    ("instance_prompt", str, None, "DreamBooth: prompt of the instance images"),
    ("class_data_dir", str, None, "DreamBooth: folder of class images (missing ones are generated)"),
    ("class_prompt", str, None, "DreamBooth: prompt of the class images"),
    ("with_prior_preservation", "bool", False, "DreamBooth: add the prior-preservation loss"),
    ("prior_loss_weight", float, 1.0, "weight of the prior-preservation loss"),
    ("num_class_images", int, 100, "class images wanted for prior preservation"),
    ("resolution", int, 32, "training image side in pixels, a multiple of 8"),
    ("center_crop", "bool", False, "centre crop (default: random crop)"),
    ("random_flip", "bool", False, "random horizontal flips"),
    ("skip_bad_images", "bool", False, "skip unreadable images with a warning instead of stopping"),
    ("train_batch_size", int, 1, "images per device per micro-batch"),
    ("gradient_accumulation_steps", int, 1, "micro-batches per optimizer step"),
    ("max_train_steps", int, None, "optimizer steps (overrides --num_train_epochs)"),
    ("num_train_epochs", int, 1, "passes over the data"),
    ("learning_rate", float, 1e-4, "peak learning rate"),
    ("scale_lr", "bool", False, "scale the learning rate by accumulation x batch x devices"),
    ("lr_scheduler", str, "constant", "linear, cosine, cosine_with_restarts, polynomial, constant, "
     "constant_with_warmup"),
    ("lr_warmup_steps", int, 0, "warm-up steps"),
    ("adam_beta1", float, 0.9, "AdamW beta1"),
    ("adam_beta2", float, 0.999, "AdamW beta2"),
    ("adam_weight_decay", float, 1e-2, "AdamW weight decay"),
    ("adam_epsilon", float, 1e-8, "AdamW epsilon"),
    ("max_grad_norm", float, 1.0, "gradient clipping norm (0 disables)"),
    ("rank", int, None, "LoRA rank: train LoRA adapters instead of the whole UNet"),
    ("train_text_encoder", "bool", False, "also train the text encoder (its LoRA adapter with --rank)"),
    ("use_ema", "bool", False, "keep and export an EMA of the UNet"),
    ("ema_decay", float, 0.9999, "EMA decay"),
    ("snr_gamma", float, None, "min-SNR weighting gamma (5.0 recommended)"),
    ("noise_offset", float, 0.0, "noise offset scale"),
    ("prediction_type", str, None, "epsilon or v_prediction (default: the scheduler's)"),
    ("gradient_checkpointing", "bool", False, "recompute activations in the backward pass"),
    ("mixed_precision", str, "no", "no, fp16 or bf16"),
    ("checkpointing_steps", int, 500, "write checkpoint-N/ every this many steps"),
    ("checkpoints_total_limit", int, None, "keep at most this many checkpoints"),
    ("resume_from_checkpoint", str, None, "a checkpoint-N folder or 'latest'"),
    ("validation_prompt", str, None, "prompt of the validation images"),
    ("num_validation_images", int, 4, "images per validation grid"),
    ("validation_steps", int, 100, "validate every this many steps"),
    ("num_inference_steps", int, 25, "denoising steps for validation and class images"),
    ("seed", int, 0, "seed of data order, augmentation, noise and timesteps"),
    ("output_dir", str, "sd-model-finetuned", "output folder: pipeline or LoRA weights, checkpoints, logs"),
    ("strategy", str, "auto", "Lightning strategy: auto, ddp, zero1, zero2, zero2_offload, gemini, "
     "gemini_offload, gemini_nvme, gemini_auto"),
    ("offload_dir", str, None, "NVMe offload folder of gemini_nvme or gemini_auto (given to the strategy)"),
    ("devices", int, 1, "processes (devices) per node"),
    ("num_nodes", int, 1, "nodes"),
    ("attention_backend", str, "auto", "kernels.attention backend: auto, triton, torch"),
    ("ray_address", str, None, "Ray cluster address ('auto' for local): train with Ray Train"),
    ("num_workers", int, None, "Ray workers (default: devices x num_nodes)"),
    ("dataloader_num_workers", int, 0, "data-loading worker processes"),
    ("report_to", str, "tensorboard", "tensorboard (plus CSV), csv, wandb (when installed) or all"),
    # the rest of diffusers' scripts' flags (as in `suite diffusion train_x`)
    ("revision", str, None, "hub revision of a model in the local Hugging Face cache"),
    ("variant", str, None, "weight-file variant (fp16 reads *.fp16.safetensors)"),
    ("cache_dir", str, None, "Hugging Face cache folder for hub ids"),
    ("tokenizer_name", str, None, "a tokenizer folder (or cached hub id) instead of the pipeline's"),
    ("tokenizer_max_length", int, None, "token length of captions (default: the tokenizer's)"),
    ("dataset_name", str, None, "a local imagefolder, or a dataset in the Hugging Face cache (needs datasets)"),
    ("dataset_config_name", str, None, "configuration of --dataset_name (needs datasets)"),
    ("max_train_samples", int, None, "train on a seeded random subset of this many samples"),
    ("image_interpolation_mode", str, "bilinear", "resize filter: nearest, bilinear, bicubic, box, hamming, "
     "lanczos"),
    ("lr_num_cycles", int, 1, "hard restarts of cosine_with_restarts"),
    ("lr_power", float, 1.0, "power of the polynomial schedule"),
    ("use_8bit_adam", "bool", False, "bitsandbytes' 8-bit AdamW (CUDA, when installed)"),
    ("allow_tf32", "bool", False, "allow TF32 matmuls and convolutions on CUDA"),
    ("foreach_ema", "bool", False, "update the EMA with foreach kernels"),
    ("offload_ema", "bool", False, "keep the EMA in CPU memory"),
    ("input_perturbation", float, 0.0, "extra noise in the UNet's input only (0.1 recommended)"),
    ("dream_training", "bool", False, "DREAM training (Zhou et al. 2023; epsilon prediction only)"),
    ("dream_detail_preservation", float, 1.0, "DREAM's detail-preservation exponent"),
    ("validation_prompts", "list", None, "several validation prompts (a grid each)"),
    ("validation_epochs", int, None, "validate every this many epochs instead of --validation_steps"),
    ("validation_scheduler", str, None, "DPMSolverMultistepScheduler or DDPMScheduler (default: the base's)"),
    ("sample_batch_size", int, 4, "images per pipeline call when generating class images"),
    ("prior_generation_precision", str, None, "dtype of class-image generation: no, fp32, fp16, bf16"),
    ("skip_save_text_encoder", "bool", False, "export the pipeline without its text encoder"),
    ("tracker_project_name", str, "text2image-fine-tune", "wandb project name"),
    ("logging_dir", str, "logs", "log folder inside --output_dir"),
    ("log_every_n_steps", int, 10, "a plain progress line every this many steps when stdout is not a terminal"),
]


# The launcher's settings a script command adds to the script's own flags (what `accelerate launch` and its
# config would set): (flag, type, default, help); the flag name is the FineTuneConfig field name.
LAUNCH_FLAGS: list[tuple[str, type, object, str]] = [
    ("strategy", str, "auto", "Lightning strategy: auto, ddp, zero1, zero2, zero2_offload, gemini, "
     "gemini_offload, gemini_nvme, gemini_auto"),
    ("devices", int, 1, "processes (devices) per node"),
    ("num_nodes", int, 1, "nodes"),
    ("offload_dir", str, None, "NVMe offload folder of gemini_nvme or gemini_auto (given to the strategy)"),
    ("attention_backend", str, "auto", "kernels.attention backend: auto, triton, torch"),
]


def _add_script(sub: argparse._SubParsersAction, script: str) -> None:
    from ...diffusion.scripts import DIFFUSERS_VERSION, SCRIPT_FLAGS, SCRIPTS, flag_help

    p = sub.add_parser(script, help=SCRIPTS[script],
                       description=f"{SCRIPTS[script]}: the script's flags and defaults as in diffusers "
                                   f"v{DIFFUSERS_VERSION}; flags that cannot apply here are refused with the "
                                   "reason (see docs/diffusion.md).")
    for f in SCRIPT_FLAGS[script]:
        kw: dict = {"default": f.default, "help": flag_help(f)}
        if f.required:
            kw["required"] = True
        if f.action:
            kw["action"] = f.action
        else:
            kw.update(type=f.type, choices=f.choices, nargs=f.nargs)
        p.add_argument(f"--{f.name}", **kw)
    launch = p.add_argument_group("launcher settings (not flags of the diffusers script)")
    for name, kind, default, text in LAUNCH_FLAGS:
        launch.add_argument(f"--{name}", type=kind, default=default,
                            help=f"{text} (default: {default})" if default is not None else text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `finetune` subcommand and the three script subcommands with their flags."""
    from ...diffusion.scripts import SCRIPTS

    sub = parser.add_subparsers(dest="diffusion_command", metavar="SUBCOMMAND", required=True,
                                parser_class=type(parser))
    p = sub.add_parser("finetune", help="fine-tune Stable Diffusion (full, LoRA with --rank, DreamBooth)",
                       description="Fine-tune Stable Diffusion with diffusers' training-script flags.")
    p.add_argument("--config", default=argparse.SUPPRESS,
                   help="recipe YAML: a shipped name (full, lora, dreambooth) or a path; flags override it")
    for name, kind, default, text in FLAGS:
        help_text = f"{text} (default: {default})" if default not in (None, False) else text
        if kind == "bool":
            p.add_argument(f"--{name}", action="store_true", default=argparse.SUPPRESS, help=help_text)
        elif kind == "list":
            p.add_argument(f"--{name}", type=str, nargs="+", default=argparse.SUPPRESS, help=help_text)
        else:
            p.add_argument(f"--{name}", type=kind, default=argparse.SUPPRESS, help=help_text)
    for script in SCRIPTS:
        _add_script(sub, script)


def resolve_config_path(value: str) -> Path:
    """A recipe path, or the shipped recipe of that name (`lora`, `diffusion_lora`, `diffusion_lora.yaml`)."""
    from ..errors import UsageError

    shipped = Path(__file__).resolve().parents[2] / "recipes" / "configs"
    for candidate in (Path(value), shipped / value, shipped / f"{value}.yaml", shipped / f"diffusion_{value}.yaml"):
        if candidate.is_file():
            return candidate
    names = sorted(p.stem.removeprefix("diffusion_") for p in shipped.glob("diffusion_*.yaml"))
    raise UsageError(f"{value}: no such config file or shipped recipe (shipped: {', '.join(names)})")


def build_config(args: argparse.Namespace) -> object:
    """The `FineTuneConfig` of the command: for `finetune` the YAML (if any) overridden by the given flags,
    for a script command its flags (refused ones checked); bad values raise UsageError."""
    from ...diffusion.config import FineTuneConfig, load_yaml_config
    from ..errors import UsageError

    if args.diffusion_command != "finetune":
        from ...diffusion.scripts import SCRIPT_FLAGS, script_config

        values = {f.name: getattr(args, f.name) for f in SCRIPT_FLAGS[args.diffusion_command]}
        launch = {name: getattr(args, name) for name, *_ in LAUNCH_FLAGS}
        return script_config(args.diffusion_command, values, launch)
    values: dict = {}
    if getattr(args, "config", None):
        values.update(load_yaml_config(resolve_config_path(args.config)))
    values.update({name: getattr(args, name) for name, *_ in FLAGS if hasattr(args, name)})
    try:
        return FineTuneConfig(**values)
    except ValueError as exc:
        raise UsageError(f"--{exc}") from exc
    except TypeError as exc:
        raise UsageError(f"bad setting: {exc}") from exc


def _summary(cfg: object) -> str:
    out = Path(cfg.output_dir)
    what = out / "pytorch_lora_weights.safetensors" if cfg.lora else out / "model_index.json"
    lines = [f"fine-tuning finished; result: {what}"]
    ckpts = sorted(out.glob("checkpoint-*"))
    if ckpts:
        lines.append(f"  checkpoints: {', '.join(p.name for p in ckpts)}")
    if (out / "validation").is_dir():
        lines.append(f"  validation images: {out / 'validation'}")
    lines.append(f"  logs: {out / 'logs'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run `suite diffusion finetune` or one of the script commands."""
    cfg = build_config(args)
    if cfg.ray_address:
        from ...recipes.diffusion import fit_with_ray

        fit_with_ray(cfg)
    else:
        from ...recipes.diffusion import fit_finetune

        fit_finetune(cfg)
    print(_summary(cfg), file=sys.stdout, flush=True)
    return 0
