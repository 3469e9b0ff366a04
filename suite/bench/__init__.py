"""`suite bench NAME`: benchmarks that print a table and write JSON, side by side with the baseline.

Each is a module with `add_arguments(parser)` and `run(args) -> int`: its rows and its sides; running, measuring and
publishing are `harness`'s. Modules import only light things at the top; heavy imports happen inside `run`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

from .harness import add_output_arguments

__all__ = ["BENCHMARKS", "add_arguments", "run"]

BENCHMARKS: dict[str, tuple[str, str]] = {
    "kernels": (".kernels", "LayerNorm, masked-bias softmax and attention vs torch"),
    "zero": (".zero", "ZeRO-1/2 vs torch DDP and FSDP2: per-rank memory and step time"),
    "gemini": (".gemini", "Gemini vs FSDP2, DDP and ZeRO-2; largest model within a RAM budget"),
    "collectives": (".collectives", "CPU ranks' all-gather and reduce-scatter: gloo vs shared memory"),
    "strategies": (".strategies", "Lightning strategies: ddp, fsdp, zero2, gemini"),
    "diffusion": (".diffusion", "plain diffusers-style loop vs ours on one UNet"),
    "diffusion-sdxl": (".diffusion_sdxl", "SDXL at its released size: LoRA and full fine-tune, whole commands"),
    "fold-model": (".fold_model", "AlphaFold model pass: chunked vs unchunked"),
    "dap": (".dap", "DAP: per-rank memory and time on 1, 2, ... ranks"),
    "fold": (".fold", "suite fold per-stage time; Ray vs one after another"),
    "fold-workflow": (".fold_workflow", "feature workflow vs serial searches; fold on 1 vs 2 raylets"),
    "command": (".command", "whole-command peak memory (process tree, page cache) vs a baseline command"),
    "gpu": (".gpu", "the GPU proof: every GPU row in one command, each in its own time slice (issue 35)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="NAME", required=True, parser_class=type(parser))
    for name, (module, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_output_arguments(p)
        try:
            importlib.import_module(module, __name__).add_arguments(p)
        except ModuleNotFoundError as exc:
            if exc.name != importlib.util.resolve_name(module, __name__):
                raise
            p.set_defaults(_missing=module)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    if getattr(args, "_missing", None):
        raise UsageError(f"benchmark {args.bench!r} is not available in this build ({args._missing} missing)")
    return importlib.import_module(BENCHMARKS[args.bench][0], __name__).run(args)
