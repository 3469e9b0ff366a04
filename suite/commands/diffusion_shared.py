"""What the SD 1.x and SDXL script commands of `suite diffusion` share (`diffusion.py`, `diffusion_sdxl.py`): the
launcher settings a script command adds (`LAUNCH_SETTINGS`), one script's subcommand with its flags
(`add_script_parser`), and the summary a finished run prints (`run_summary`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["LAUNCH_SETTINGS", "add_script_parser", "run_summary"]

LAUNCH_SETTINGS = ("strategy", "devices", "num_nodes", "offload_dir", "memory_budget", "attention_backend")
"""The launcher's settings a script command adds to the script's own flags (what `accelerate launch` and its
config would set): FineTuneConfig settings, flags generated from the config like `finetune`'s."""


def add_script_parser(sub: argparse._SubParsersAction, script: str, one_line: str, flags: Iterable[Any],
                      help_of: Callable[[Any], str]) -> argparse._ArgumentGroup:
    """Add the subcommand `script` (`one_line` its help) with the script's `flags` (`diffusion.scripts.ScriptFlag`s,
    `help_of(flag)` the help of each) and the launcher settings; returns the launcher settings' group."""
    from ...diffusion.config import FineTuneConfig
    from ...diffusion.scripts import DIFFUSERS_VERSION
    from ...utils.settings import add_flags

    p = sub.add_parser(script, help=one_line,
                       description=f"{one_line}: the script's flags and defaults as in diffusers "
                                   f"v{DIFFUSERS_VERSION}; flags that cannot apply here are refused with the "
                                   "reason (see docs/diffusion.md).")
    for f in flags:
        kw: dict[str, Any] = {"default": f.default, "help": help_of(f)}
        if f.required:
            kw["required"] = True
        if f.action:
            kw["action"] = f.action
        else:
            kw.update(type=f.type, choices=f.choices, nargs=f.nargs)
        p.add_argument(f"--{f.name}", **kw)
    launch = p.add_argument_group("launcher settings (not flags of the diffusers script)")
    add_flags(launch, FineTuneConfig, defaults=True, only=LAUNCH_SETTINGS)
    return launch


def run_summary(cfg: Any) -> str:
    """What a finished fine-tuning wrote where (the result, checkpoints, validation images, logs)."""
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
