"""`suite diffusion train_dreambooth_sd3 | train_dreambooth_lora_sd3 | train_dreambooth_flux |
train_dreambooth_lora_flux`: diffusers' SD3 and Flux DreamBooth scripts' command lines, flag for flag and default
for default (`accelerate launch train_x.py ...` becomes `suite diffusion train_x ...`), with the launcher settings
of the other script commands (`--strategy`, `--devices`, `--offload_dir`, ...). Heavy imports happen inside `run`.
"""

from __future__ import annotations

import argparse
import sys

from .diffusion_shared import LAUNCH_SETTINGS, add_script_parser, run_summary

__all__ = ["FLOW_COMMANDS", "add_flow_scripts", "build_flow_config", "run_flow"]

FLOW_COMMANDS = ("train_dreambooth_sd3", "train_dreambooth_lora_sd3", "train_dreambooth_flux",
                 "train_dreambooth_lora_flux")
"""The subcommands this file adds (the keys of `diffusion.flow_scripts.FLOW_SCRIPT_FLAGS`)."""


def _help(script: str, name: str, default: object) -> str:
    from ...diffusion.flow_scripts import FlowSettings, flow_handling
    from ...diffusion.scripts import Refuse, field_help
    from ...diffusion.sdxl_scripts import SDXLSettings
    from ...utils.settings import settings

    how = flow_handling(script, name)
    if isinstance(how, Refuse):
        return f"refused when given: {how.reason}"
    own = {n: s.help for cls in (SDXLSettings, FlowSettings) for n, s in settings(cls).items()}
    text = how.note or own.get(name) or field_help().get(name, "")
    if default not in (None, False) and "default:" not in text:
        text = f"{text} (default: {default})"
    return text


def add_flow_scripts(sub: argparse._SubParsersAction) -> None:
    """Add the four SD3 / Flux script subcommands to `suite diffusion`."""
    from ...diffusion.flow_scripts import FLOW_SCRIPT_FLAGS, FLOW_SCRIPTS

    for script, flags in FLOW_SCRIPT_FLAGS.items():
        add_script_parser(sub, script, FLOW_SCRIPTS[script], flags,
                          lambda f, script=script: _help(script, f.name, f.default))


def build_flow_config(args: argparse.Namespace) -> object:
    """The `FineTuneConfig` (with `extra["flow"]`) of an SD3 / Flux script command; bad input is one `InputError`."""
    from ...diffusion.flow_scripts import FLOW_SCRIPT_FLAGS, flow_script_config

    values = {f.name: getattr(args, f.name) for f in FLOW_SCRIPT_FLAGS[args.diffusion_command]}
    launch = {name: getattr(args, name) for name in LAUNCH_SETTINGS}
    return flow_script_config(args.diffusion_command, values, launch)


def run_flow(args: argparse.Namespace) -> int:
    """Run one SD3 / Flux script command."""
    cfg = build_flow_config(args)
    from ...recipes.diffusion.flow import fit_flow

    fit_flow(cfg)
    print(run_summary(cfg), file=sys.stdout, flush=True)
    return 0
