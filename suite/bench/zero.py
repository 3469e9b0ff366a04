"""`suite bench zero`: per-rank memory and step time of torch DDP, torch FSDP2 (`fully_shard`), ZeRO-1, ZeRO-2."""

from __future__ import annotations

import argparse

from ...utils.memory_meter import SideMeter, fix_malloc, hwm_bytes, rss_bytes
from ..errors import UsageError
from .harness import add_ratios, count, names, publish, ran, step_times, torch_device, train_side, train_step

__all__ = ["add_arguments", "run"]

VARIANTS = ("ddp", "fsdp2", "zero1", "zero2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="number of local processes (default 2)")
    parser.add_argument("--params", type=count, default=count("20M"), help="model size, e.g. 20M or 200M")
    parser.add_argument("--width", type=int, default=None, help="hidden size of the Linear stack (default: chosen)")
    parser.add_argument("--batch", type=int, default=8, help="rows per rank per step (default 8)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (default 3)")
    parser.add_argument("--variants", type=names(VARIANTS), default=list(VARIANTS),
                        help=f"comma list out of {','.join(VARIANTS)}")
    parser.add_argument("--bucket_mb", type=float, default=25.0, help="ZeRO bucket size in MiB (default 25)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant before giving up")


def _build(width: int, layers: int, device):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh()))).to(device)


def _steps(variant: str, model, width: int, n: int, bucket_mb: float, batch: int, cuda: bool) -> list[float]:
    """Seconds of `n` steps, each between two barriers (the slowest rank's step)."""
    import torch
    import torch.distributed as dist

    model, opt = train_side(variant, model, bucket_mb=bucket_mb)
    step = train_step(model, opt, torch.randn(batch, width, device=next(model.parameters()).device))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    return step_times(step, n, sync=sync, before=dist.barrier)


def _rank(rank: int, world: int, variant: str, width: int, layers: int, batch: int, steps: int,
          bucket_mb: float) -> dict:
    """One variant on one rank: peak memory and the median step time."""
    import torch

    fix_malloc(1 << 20)  # freed gradient buckets leave the resident set: RSS tracks live tensors
    device = torch_device("auto", rank)
    cuda = device.type == "cuda"
    # a tiny run first: one-off runtime allocations (thread pools, comm buffers) are not counted
    _steps(variant, _build(8, 1, device), 8, 1, bucket_mb, batch, cuda)
    base = torch.cuda.memory_allocated() if cuda else rss_bytes()
    meter = SideMeter().start()
    times = sorted(_steps(variant, _build(width, layers, device), width, steps + 1, bucket_mb, batch, cuda)[1:])
    peak = torch.cuda.max_memory_allocated() if cuda else hwm_bytes()  # own peak: ru_maxrss inherits the parent's
    charged = meter.peak()
    meter.close()
    return {"peak_bytes": peak, "states_bytes": peak - base, "step_s": times[len(times) // 2],
            "charged_bytes": charged, "memory_method": meter.method, "ran": ran(variant)}


def run(args: argparse.Namespace) -> int:
    import torch

    from ...core_parallel import run_on_ranks

    if args.ranks < 1 or args.batch < 1 or args.steps < 1:
        raise UsageError("--ranks, --batch and --steps must be >= 1")
    width = args.width or min(2048, max(64, int((args.params / 8) ** 0.5)))
    layers = max(1, round(args.params / (width * width + width)))
    n_params = layers * (width * width + width)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    rows = []
    for variant in args.variants:
        res = run_on_ranks(_rank, args.ranks, variant, width, layers, args.batch, args.steps, args.bucket_mb,
                           timeout=args.timeout, backend=backend, env={"OMP_NUM_THREADS": "1"})
        r = {**res[0], **{k: max(x[k] for x in res) for k in ("peak_bytes", "states_bytes", "charged_bytes", "step_s")}}
        rows.append({"variant": variant, "peak_MiB": r["peak_bytes"] / 2**20, "states_MiB": r["states_bytes"] / 2**20,
                     "bytes_per_param": r["states_bytes"] / n_params, "charged_MiB": r["charged_bytes"] / 2**20,
                     "step_s": r["step_s"], "ran": r["ran"], "memory_method": r["memory_method"]})
    add_ratios(rows, next((r for r in rows if r["variant"] == "ddp"), None),
               {"mem_vs_ddp": "states_MiB", "charged_vs_ddp": "charged_MiB", "time_vs_ddp": "step_s"}, float("nan"))
    title = (f"zero bench: {args.ranks} ranks ({backend}), {n_params / 1e6:.1f}M params ({layers} x Linear({width})), "
             f"batch {args.batch}/rank, Adam fp32; per-rank maxima")
    columns = ["variant", "peak_MiB", "states_MiB", "bytes_per_param", "mem_vs_ddp", "charged_MiB", "charged_vs_ddp",
               "step_s", "time_vs_ddp", "ran"]
    publish(args, {"benchmark": "zero", "ranks": args.ranks, "params": n_params, "width": width, "layers": layers,
                   "batch": args.batch, "steps": args.steps, "rows": rows}, [(title, rows, columns)],
            [f"charged: {rows[0]['memory_method']} from before the model was built (page cache included)"])
    return 0
