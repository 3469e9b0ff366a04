"""The `suite` command line.

One dispatch table maps each subcommand to a module in `suite.commands` (or `suite.bench` for benchmarks).
Each module defines `add_arguments(parser)` and `run(args) -> int`; modules are imported only when their
subcommand runs, so `suite --help` stays fast. Bad input raises `UsageError`: one line on stderr, exit 2; so
does a missing optional package (the line names the extra that installs it).
A traceback is shown only with `--debug`. A command that succeeds inside a distributed job (torchrun) ends its
process groups on every rank before returning (`core_parallel.groups.end_process_groups`: a barrier, then
`destroy_process_group`). A command with a config file merges its flags and the file with
`utils.settings.merge`, the one precedence rule (explicit flag > file > default).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence

from ..core_parallel.groups import abandon_process_groups, end_process_groups
from .errors import EXIT_USAGE, UsageError, missing_extra

__all__ = ["COMMANDS", "build_parser", "main"]

# subcommand -> (module, one-line help). Nested groups ("diffusion finetune") are modules with SUBCOMMANDS.
COMMANDS: dict[str, tuple[str, str]] = {
    "env": (".commands.env", "print versions, devices, distributed backends and kernel backends"),
    "demo": (".commands.demo", "run the main jobs on built-in defaults (tiny models, bundled data)"),
    "bench": (".bench", "run a benchmark against the baseline a user would otherwise use"),
    "diffusion": (".commands.diffusion", "Stable Diffusion fine-tuning (full, LoRA, DreamBooth)"),
    "fold": (".commands.fold", "predict protein structures from FASTA (AlphaFold2, FastFold flavour)"),
    "checkpoint": (".commands.checkpoint", "sharded checkpoint tools (consolidate)"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag or subcommand in one line with exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        sys.exit(EXIT_USAGE)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only the subcommand named in `argv` (if any) gets its flags added."""
    parser = _Parser(prog="suite", description="Train and run large models on limited hardware.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    wanted = _requested_command(argv)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            try:
                importlib.import_module(module, __package__).add_arguments(p)
            except ModuleNotFoundError as exc:
                if exc.name != importlib.util.resolve_name(module, __package__):
                    raise
                parser.error(f"'{name}' is not available in this build ({module} is missing)")
    return parser


def _requested_command(argv: Sequence[str] | None) -> str | None:
    for token in argv or ():
        if token in COMMANDS:
            return token
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `suite` console script. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if "SUITE_KERNEL_BACKEND" in os.environ:  # kernels.ENV_VAR, the documented user override: read here, once
        from ..kernels import ENV_VAR, set_default_backend

        set_default_backend(os.environ[ENV_VAR], source=ENV_VAR)
    module = importlib.import_module(COMMANDS[args.command][0], __package__)
    try:
        code = int(module.run(args) or 0)
    except UsageError as exc:
        if args.debug:
            raise
        sys.stderr.write(f"suite {args.command}: error: {exc}\n")
        abandon_process_groups()  # a torchrun job's rank exits 2 cleanly, not aborted by the interpreter's teardown
        return EXIT_USAGE
    except ImportError as exc:  # an optional package (openmm, ray, ...) the command needs: name its extra
        err = missing_extra(exc)
        if err is None or args.debug:
            raise
        sys.stderr.write(f"suite {args.command}: error: {err}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write(f"suite {args.command}: interrupted\n")
        return 130
    if code == 0:  # a torchrun job's ranks end together, before the interpreter's exit tears anything down
        end_process_groups()
    return code


if __name__ == "__main__":
    sys.exit(main())
