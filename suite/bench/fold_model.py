"""`suite bench fold-model`: one AlphaFold2 pass with the released channel sizes, chunked against unchunked.

Each (n_res, variant) runs in a fresh process, so its peak memory is its own: on CUDA the peak of
`torch.cuda.max_memory_allocated`, on CPU the growth of the peak resident set (VmHWM) over the resident
set just before the timed passes. The CPU measurement is made the same way for both variants:
- glibc's mmap threshold is fixed at 1 MiB, so every tensor above that size is its own mapping and is
  unmapped when freed: the resident set follows the live tensors instead of keeping freed heap pages
  (which would count a chunked run's reused scratch space as if it were all live at once);
- one warm-up pass on a 32-residue batch first initialises the libraries (thread pools, oneDNN), so their
  one-off buffers are not counted;
- then `malloc_trim(0)` hands freed heap pages back, the baseline is the resident set, and the high-water
  mark is reset (`/proc/self/clear_refs`) before the timed passes.
Random weights (the timing and memory do not depend on their values); MSA and extra-MSA sizes are flags.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

__all__ = ["add_arguments", "run"]


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n_res", type=_int_list, default=[256, 512], help="residue counts, e.g. 256,512")
    parser.add_argument("--blocks", type=int, default=4, help="Evoformer blocks (the released model has 48)")
    parser.add_argument("--extra_blocks", type=int, default=1, help="extra-MSA blocks (released: 4)")
    parser.add_argument("--n_seq", type=int, default=128, help="MSA rows (cluster centres)")
    parser.add_argument("--n_extra", type=int, default=256, help="extra-MSA rows")
    parser.add_argument("--chunk_size", default="auto", help='chunk size of the chunked run: an int or "auto"')
    parser.add_argument("--memory_budget_mb", type=int, default=64, help='budget per intermediate for "auto"')
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--repeat", type=int, default=2, help="timed passes (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed full-size passes before the timed ones")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)


def _options(variant: str, args: argparse.Namespace):
    from ...fastfold.model import InferenceOptions

    if variant == "unchunked":
        return InferenceOptions()
    chunk = args.chunk_size if args.chunk_size == "auto" else int(args.chunk_size)
    return InferenceOptions(chunk_size=chunk, memory_budget_bytes=args.memory_budget_mb * 2**20, residual="in_place")


def _rss_baseline() -> int:
    """Resident set after handing freed heap pages back; resets the high-water mark when Linux allows it."""
    import gc

    from .common import malloc_trim, peak_rss_bytes, reset_peak_rss, rss_bytes

    gc.collect()
    malloc_trim()
    if not reset_peak_rss():
        return peak_rss_bytes()  # no reset: growth is measured over the peak so far
    return rss_bytes()


def _child(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from ...fastfold.model import AlphaFold, config
    from ...fastfold.model.testing import random_batch
    from .common import fix_malloc, hwm_bytes, time_fn

    fix_malloc(2**20)
    n_res, variant = args._child.split(":")
    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device.replace("auto", "cpu")
    )
    dtype = getattr(torch, args.dtype)
    cfg = config.preset("model_3_ptm")
    cfg.evoformer = dataclasses.replace(cfg.evoformer, num_blocks=args.blocks)
    cfg.extra_msa = dataclasses.replace(cfg.extra_msa, num_blocks=args.extra_blocks)
    model = AlphaFold(cfg).to(device=device, dtype=dtype).eval()
    options = _options(variant, args)
    sync = torch.cuda.synchronize if device.type == "cuda" else None

    def batch_of(n: int) -> dict[str, torch.Tensor]:
        batch = random_batch(cfg, n_res=n, n_seq=args.n_seq, n_extra=args.n_extra, n_recycle=0)
        return {k: v.to(device) for k, v in batch.items()}

    with torch.no_grad():
        model(batch_of(32), options)  # warm-up: library initialisation, not counted
    batch = batch_of(int(n_res))
    if device.type == "cuda":
        sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_baseline()

    def one_pass():
        with torch.no_grad():
            model(batch, options)

    seconds = time_fn(one_pass, warmup=args.warmup, repeat=args.repeat, sync=sync)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else hwm_bytes()
    print(
        json.dumps(
            {
                "n_res": int(n_res),
                "variant": variant,
                "seconds": seconds,
                "peak_bytes": peak - base,
                "device": device.type,
            }
        )
    )
    return 0


def _run_child(args: argparse.Namespace, n_res: int, variant: str) -> dict:
    suite_module = __package__.rpartition(".")[0]
    argv = [sys.executable, "-m", suite_module, "bench", "fold-model", "--_child", f"{n_res}:{variant}"]
    for flag in (
        "blocks",
        "extra_blocks",
        "n_seq",
        "n_extra",
        "chunk_size",
        "memory_budget_mb",
        "dtype",
        "device",
        "repeat",
        "warmup",
    ):
        argv += [f"--{flag}", str(getattr(args, flag))]
    # the installed package, never a checkout's folders: no working directory first on sys.path (3.11+)
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONSAFEPATH": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"fold-model benchmark n_res={n_res} {variant} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError
    from .common import print_table, write_json

    if args._child:
        return _child(args)
    if args.blocks <= 0 or args.n_seq <= 0 or args.n_extra <= 0 or args.repeat <= 0:
        raise UsageError("fold-model: --blocks, --n_seq, --n_extra and --repeat must be positive")
    if args.warmup < 0:
        raise UsageError("fold-model: --warmup must not be negative")
    if args.chunk_size != "auto" and not (args.chunk_size.isdigit() and int(args.chunk_size) > 0):
        raise UsageError(f"fold-model: --chunk_size must be a positive int or 'auto', got {args.chunk_size!r}")
    rows = []
    for n_res in args.n_res:
        result = {v: _run_child(args, n_res, v) for v in ("unchunked", "chunked")}
        u, c = result["unchunked"], result["chunked"]
        rows.append(
            {
                "n_res": n_res,
                "device": u["device"],
                "unchunked_s": u["seconds"],
                "chunked_s": c["seconds"],
                "time_ratio": c["seconds"] / u["seconds"],
                "unchunked_peak_mib": u["peak_bytes"] / 2**20,
                "chunked_peak_mib": c["peak_bytes"] / 2**20,
                "memory_ratio": c["peak_bytes"] / max(u["peak_bytes"], 1),
            }
        )
    title = (
        f"AlphaFold2 pass, {args.blocks} Evoformer + {args.extra_blocks} extra-MSA blocks, released channels, "
        f"{args.n_seq} MSA rows, {args.n_extra} extra rows, {args.dtype}; chunk_size={args.chunk_size}"
    )
    print_table(rows, title=title)
    write_json(
        args.json,
        {
            "benchmark": "fold-model",
            "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "rows": rows,
        },
    )
    return 0
