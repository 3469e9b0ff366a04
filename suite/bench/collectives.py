"""`suite bench collectives`: all-gather and reduce-scatter between local CPU ranks, gloo against the
shared-memory host collectives Gemini uses (`core_parallel.host_comm`).
"""

from __future__ import annotations

import argparse
import statistics

from ..errors import UsageError
from .harness import publish, step_times

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="local processes")
    parser.add_argument("--mb", default="1,4,16", help="MiB of fp32 per collective (the whole gathered tensor)")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first")


def _rank(rank: int, world: int, sizes: list[float], repeat: int, warmup: int) -> dict:
    import torch
    import torch.distributed as dist

    from ...core_parallel.host_comm import HostCollectives

    parts = {mb: int(mb * 2**20) // 4 // world for mb in sizes}  # fp32 values of one rank's shard
    host = HostCollectives.create(None, slot_bytes=max(parts.values()) * 4)
    if host is None:
        raise RuntimeError("host collectives are not available here (x86-64 Linux with a shared /dev/shm)")
    out = {}
    for mb, part in parts.items():
        full, shard = torch.randn(part * world), torch.randn(part)
        calls = {
            ("all_gather", "gloo"): (dist.all_gather_single, (full, shard)),
            ("all_gather", "host"): (host.all_gather, (full, shard)),
            ("reduce_scatter", "gloo"): (dist.reduce_scatter_single, (shard, full)),
            ("reduce_scatter", "host"): (host.reduce_scatter, (shard, full)),
        }
        for (op, path), (call, call_args) in calls.items():
            times = step_times(lambda c=call, a=call_args: c(*a), repeat, warmup=warmup, before=dist.barrier)
            out[f"{op}/{mb}/{path}"] = statistics.median(times) * 1e3
    host.close()
    return out


def run(args: argparse.Namespace) -> int:
    from ...core_parallel import run_on_ranks
    from ...core_parallel.host_comm import host_collectives_supported

    try:
        sizes = [float(x) for x in args.mb.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--mb must be comma-separated MiB, got {args.mb!r}") from None
    if not sizes or min(sizes) <= 0 or args.ranks < 2 or args.repeat < 1:
        raise UsageError("--mb sizes must be > 0, --ranks >= 2 and --repeat >= 1")
    if not host_collectives_supported():
        raise UsageError("host collectives need x86-64 Linux with /dev/shm")
    per_rank = run_on_ranks(_rank, args.ranks, sizes, args.repeat, args.warmup, timeout=600)
    rows = []
    for op in ("all_gather", "reduce_scatter"):
        for mb in sizes:
            gloo, host = (max(r[f"{op}/{mb}/{p}"] for r in per_rank) for p in ("gloo", "host"))
            rows.append({"op": op, "MiB": mb, "gloo_ms": gloo, "host_ms": host, "host_vs_gloo": host / gloo})
    title = f"collectives between {args.ranks} local CPU ranks (fp32, slowest rank, median of {args.repeat})"
    publish(args, {"benchmark": "collectives", "ranks": args.ranks, "rows": rows}, [(title, rows, None)])
    return 0
