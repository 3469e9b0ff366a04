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

from .diffusion_flow import FLOW_COMMANDS, add_flow_scripts, run_flow
from .diffusion_sdxl import add_sdxl_scripts, run_sdxl
from .diffusion_shared import LAUNCH_SETTINGS, add_script_parser, run_summary

__all__ = ["LAUNCH_SETTINGS", "add_arguments", "build_config", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `finetune` subcommand (its flags generated from `FineTuneConfig`) and the three script
    subcommands with their flags."""
    from ...diffusion.config import FineTuneConfig
    from ...diffusion.scripts import SCRIPT_FLAGS, SCRIPTS, flag_help
    from ...utils.settings import add_flags

    sub = parser.add_subparsers(dest="diffusion_command", metavar="SUBCOMMAND", required=True,
                                parser_class=type(parser))
    p = sub.add_parser("finetune", help="fine-tune Stable Diffusion (full, LoRA with --rank, DreamBooth)",
                       description="Fine-tune Stable Diffusion with diffusers' training-script flags.")
    p.add_argument("--config", default=argparse.SUPPRESS,
                   help="recipe YAML: a shipped name (full, lora, dreambooth) or a path; flags override it")
    # no defaults in the namespace: a flag is there only when given, so it beats the file (explicit > file > default)
    add_flags(p, FineTuneConfig, grouped=True)
    for script in SCRIPTS:
        add_script_parser(sub, script, SCRIPTS[script], SCRIPT_FLAGS[script], flag_help)
    add_sdxl_scripts(sub)  # train_text_to_image_sdxl, train_text_to_image_lora_sdxl, train_dreambooth_lora_sdxl
    add_flow_scripts(sub)  # train_dreambooth_{,lora_}sd3, train_dreambooth_{,lora_}flux


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
    """The `FineTuneConfig` of the command: for `finetune` the flags given, over the YAML (if any), over the
    defaults; for a script command its flags (refused ones checked). Bad input raises one UsageError naming the
    flag, or the file and its key."""
    from ...diffusion.config import FineTuneConfig, load_yaml_config
    from ...utils.settings import build, merge

    if args.diffusion_command != "finetune":
        from ...diffusion.scripts import SCRIPT_FLAGS, script_config

        values = {f.name: getattr(args, f.name) for f in SCRIPT_FLAGS[args.diffusion_command]}
        launch = {name: getattr(args, name) for name in LAUNCH_SETTINGS}
        return script_config(args.diffusion_command, values, launch)
    path = resolve_config_path(args.config) if getattr(args, "config", None) else None
    file_values = load_yaml_config(path) if path else {}
    values, origin = merge(FineTuneConfig, args, file_values, str(path))
    if "parallel" in values and {origin.get("strategy"), origin.get("offload_dir")} & {"--strategy", "--offload_dir"}:
        # the file's `parallel` and an explicit --strategy name the same thing: the flag wins (flag > file)
        del values["parallel"]
    return build(FineTuneConfig, values, origin)


def run(args: argparse.Namespace) -> int:
    """Run `suite diffusion finetune` or one of the script commands."""
    if args.diffusion_command.endswith("_sdxl"):
        return run_sdxl(args)
    if args.diffusion_command in FLOW_COMMANDS:
        return run_flow(args)
    cfg = build_config(args)
    if cfg.ray_address:
        from ...recipes.diffusion import fit_with_ray

        fit_with_ray(cfg)
    else:
        from ...recipes.diffusion import fit_finetune

        fit_finetune(cfg)
    print(run_summary(cfg), file=sys.stdout, flush=True)
    return 0
