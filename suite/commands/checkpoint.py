"""`suite checkpoint`: tools for sharded checkpoints (`core_parallel.save_checkpoint` folders).

    suite checkpoint consolidate PATH OUT.safetensors [--dtype working|float32]

writes one plain safetensors state_dict that `model.load_state_dict(safetensors.torch.load_file(OUT))`
accepts, from a checkpoint saved on any number of ranks.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(parser))
    p = sub.add_parser("consolidate", help="merge a sharded checkpoint folder into one safetensors file")
    p.add_argument("path", help="checkpoint folder (holds index.json)")
    p.add_argument("out", help="output .safetensors file")
    p.add_argument(
        "--dtype",
        choices=["working", "float32"],
        default="working",
        help="working: the model's dtype (default); float32: the fp32 master weights",
    )


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    if args.action != "consolidate":
        raise UsageError(f"unknown action {args.action!r}")
    if not str(args.out).endswith(".safetensors"):
        raise UsageError(f"{args.out}: the output file must end in .safetensors")
    from safetensors import SafetensorError

    from ...core_parallel.checkpoint import CheckpointReader, consolidate_checkpoint

    # A damaged or forged checkpoint (CheckpointError, a ValueError) or an unreadable file is bad input: one line
    try:
        reader = CheckpointReader(args.path)
        out = consolidate_checkpoint(args.path, args.out, dtype=args.dtype)
    except (ValueError, OSError, SafetensorError) as exc:
        raise UsageError(str(exc)) from None
    n_params = len(reader.param_names())
    print(f"consolidated {reader.path} (saved on {reader.index['world_size']} ranks, {n_params} sharded tensors) "
          f"into {out}")
    return 0
