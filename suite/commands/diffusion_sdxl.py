"""`suite diffusion train_text_to_image_sdxl | train_text_to_image_lora_sdxl | train_dreambooth_lora_sdxl`:
diffusers' SDXL training scripts' command lines, flag for flag and default for default (`accelerate launch
train_x_sdxl.py ...` becomes `suite diffusion train_x_sdxl ...`), with the launcher settings of the SD 1.x script
commands (`--strategy`, `--devices`, `--offload_dir`, ...). Heavy imports happen inside `run`.
"""

from __future__ import annotations

import argparse
import sys

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
    from ...diffusion.config import FineTuneConfig
    from ...diffusion.scripts import DIFFUSERS_VERSION
    from ...diffusion.sdxl_scripts import SDXL_SCRIPT_FLAGS, SDXL_SCRIPTS, SDXLSettings
    from ...utils.settings import add_flags
    from .diffusion import LAUNCH_SETTINGS

    for script, flags in SDXL_SCRIPT_FLAGS.items():
        p = sub.add_parser(script, help=SDXL_SCRIPTS[script],
                           description=f"{SDXL_SCRIPTS[script]}: the script's flags and defaults as in diffusers "
                                       f"v{DIFFUSERS_VERSION}; flags that cannot apply here are refused with the "
                                       "reason (see docs/diffusion.md).")
        for f in flags:
            how = {"action": f.action} if f.action else {"type": f.type, "choices": f.choices, "nargs": f.nargs}
            p.add_argument(f"--{f.name}", default=f.default, help=_help(script, f.name, f.default),
                           **how, **({"required": True} if f.required else {}))
        launch = p.add_argument_group("launcher settings (not flags of the diffusers script)")
        add_flags(launch, FineTuneConfig, defaults=True, only=LAUNCH_SETTINGS)
        add_flags(launch, SDXLSettings, defaults=True, only=("precompute",))


def build_sdxl_config(args: argparse.Namespace) -> object:
    """The `FineTuneConfig` (with `extra["sdxl"]`) of an SDXL script command; bad input is one `InputError`."""
    from ...diffusion.sdxl_scripts import SDXL_SCRIPT_FLAGS, sdxl_script_config
    from .diffusion import LAUNCH_SETTINGS

    values = {f.name: getattr(args, f.name) for f in SDXL_SCRIPT_FLAGS[args.diffusion_command]}
    launch = {name: getattr(args, name) for name in LAUNCH_SETTINGS}
    return sdxl_script_config(args.diffusion_command, values, launch, precompute=args.precompute)


def run_sdxl(args: argparse.Namespace) -> int:
    """Run one SDXL script command."""
    from .diffusion import _summary

    cfg = build_sdxl_config(args)
    from ...recipes.diffusion.sdxl import fit_sdxl

    fit_sdxl(cfg)
    print(_summary(cfg), file=sys.stdout, flush=True)
    return 0
