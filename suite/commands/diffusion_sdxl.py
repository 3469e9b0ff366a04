"""`suite diffusion train_text_to_image_sdxl | train_text_to_image_lora_sdxl | train_dreambooth_lora_sdxl`:
diffusers' SDXL training scripts' command lines, flag for flag and default for default (`accelerate launch
train_x_sdxl.py ...` becomes `suite diffusion train_x_sdxl ...`), with the launcher settings of the SD 1.x script
commands (`--strategy`, `--devices`, `--offload_dir`, ...). Heavy imports happen inside `run`.
"""

from __future__ import annotations

import argparse
import sys

from .diffusion_shared import LAUNCH_SETTINGS, add_script_parser, run_summary

__all__ = ["add_sdxl_scripts", "build_sdxl_config", "run_sdxl"]


def _help(script: str, name: str, default: object) -> str:
    from ...diffusion.scripts import Refuse, field_help
    from ...diffusion.sdxl_scripts import SDXLSettings, handling
    from ...utils.settings import settings

    how = handling(script, name)
    if isinstance(how, Refuse):
        return f"refused when given: {how.reason}"
    own = {n: s.help for n, s in settings(SDXLSettings).items()}
    text = how.note or field_help().get(name) or own.get(name, "")
    if default not in (None, False) and "default:" not in text:
        text = f"{text} (default: {default})"
    return text


def add_sdxl_scripts(sub: argparse._SubParsersAction) -> None:
    """Add the three SDXL script subcommands to `suite diffusion`."""
    from ...diffusion.sdxl_scripts import SDXL_SCRIPT_FLAGS, SDXL_SCRIPTS, SDXLSettings
    from ...utils.settings import add_flags

    for script, flags in SDXL_SCRIPT_FLAGS.items():
        launch = add_script_parser(sub, script, SDXL_SCRIPTS[script], flags,
                                   lambda f, script=script: _help(script, f.name, f.default))
        add_flags(launch, SDXLSettings, defaults=True, only=("precompute",))


def build_sdxl_config(args: argparse.Namespace) -> object:
    """The `FineTuneConfig` (with `extra["sdxl"]`) of an SDXL script command; bad input is one `InputError`."""
    from ...diffusion.sdxl_scripts import SDXL_SCRIPT_FLAGS, sdxl_script_config

    values = {f.name: getattr(args, f.name) for f in SDXL_SCRIPT_FLAGS[args.diffusion_command]}
    launch = {name: getattr(args, name) for name in LAUNCH_SETTINGS}
    return sdxl_script_config(args.diffusion_command, values, launch, precompute=args.precompute)


def run_sdxl(args: argparse.Namespace) -> int:
    """Run one SDXL script command."""
    cfg = build_sdxl_config(args)
    from ...recipes.diffusion.sdxl import fit_sdxl

    fit_sdxl(cfg)
    print(run_summary(cfg), file=sys.stdout, flush=True)
    return 0
