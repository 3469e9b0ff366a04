"""`suite bench dap`: the Evoformer stack (AlphaFold2 model_1 channel sizes) on 1, 2, ... DAP ranks.

Per rank count: time per forward pass (slowest rank, median of repeats) and per-rank peak memory of the pass
(CUDA: peak allocated; CPU: peak resident set during the first full-size pass minus the resident set before
it, in a fresh process per count after a tiny warm-up pass, with large allocations mmapped so that freed memory
leaves the resident set). The timed passes follow.
1 rank runs the plain unsplit stack, the baseline a user would otherwise run. With `--budget_mb`, the
longest N_res whose per-rank peak fits the budget is estimated from a quadratic fit through two sizes.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=_int_list, default=[1, 2], help="DAP rank counts, e.g. 1,2,4")
    parser.add_argument("--n_res", type=int, default=384, help="residues")
    parser.add_argument("--n_seq", type=int, default=128, help="MSA rows")
    parser.add_argument("--blocks", type=int, default=2, help="Evoformer blocks")
    parser.add_argument("--chunk_size", type=int, default=None, help="chunk size inside each rank (default none)")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes after one warm-up")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, NCCL")
    parser.add_argument("--budget_mb", type=float, default=None, help="also estimate the longest N_res that fits")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per rank count")


def _bench_rank(rank: int, world: int, opts: dict) -> dict:
    """One rank: build the stack and inputs (same seed everywhere), time the forward, measure its peak."""
    import dataclasses

    import torch
    from torch import nn

    from core_parallel import Axis, Topology
    from fastfold.dap import parallelize_dap
    from fastfold.model import InferenceOptions, config
    from fastfold.model.evoformer import EvoformerStack
    from suite.bench.common import peak_rss_bytes, time_fn

    device = torch.device("cuda", rank) if opts["device"] == "cuda" else torch.device("cpu")
    dtype = getattr(torch, opts["dtype"])
    cfg = dataclasses.replace(config.preset("model_1").evoformer, num_blocks=opts["blocks"])
    torch.manual_seed(0)
    holder = nn.Module()
    holder.stack = EvoformerStack(cfg).to(device=device, dtype=dtype).eval()
    topo = None
    if world > 1:
        topo = Topology(world_size=world, rank=rank, dap=world, backend="nccl" if device.type == "cuda" else "gloo")
        parallelize_dap(holder, topo.init().group(Axis.DAP))
    options = InferenceOptions(chunk_size=opts["chunk_size"])
    sync = torch.cuda.synchronize if device.type == "cuda" else None

    def inputs(n: int, s: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator(device=device).manual_seed(1)
        m = torch.randn(s, n, cfg.c_m, device=device, dtype=dtype, generator=g)
        z = torch.randn(n, n, cfg.c_z, device=device, dtype=dtype, generator=g)
        return m, z, torch.ones(s, n, device=device), torch.ones(n, n, device=device)

    def run(args: tuple[torch.Tensor, ...]) -> None:
        with torch.no_grad():
            holder.stack(*args, options)

    run(inputs(8, 4))  # load every code path once, so one-time costs stay out of the measured peak
    args = inputs(opts["n_res"], opts["n_seq"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run(args)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        import psutil

        before = psutil.Process().memory_info().rss
        run(args)
        peak = peak_rss_bytes() - before
    seconds = time_fn(lambda: run(args), warmup=0, repeat=opts["repeat"], sync=sync)
    if topo is not None:
        topo.destroy()
    return {"seconds": seconds, "peak_mb": peak / 2**20}


def _measure(world: int, opts: dict, timeout: float) -> dict:
    import os

    from core_parallel import run_on_ranks

    # Large blocks straight from mmap go back to the system when freed, so the peak resident set follows
    # the peak of live tensors instead of the heap's high-water mark. glibc reads this when a process starts:
    # the spawned ranks inherit it from this environment.
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        per_rank = run_on_ranks(_bench_rank, world, opts, timeout=timeout, backend="none")
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    return {
        "ranks": world,
        "n_res": opts["n_res"],
        "seconds": max(r["seconds"] for r in per_rank),
        "peak_mb_per_rank": max(r["peak_mb"] for r in per_rank),
    }


def _fit_longest(small: dict, large: dict, budget_mb: float) -> int:
    """Peak(N) = a N^2 + b N through two measurements; the largest N with Peak(N) <= budget."""
    n1, p1, n2, p2 = small["n_res"], small["peak_mb_per_rank"], large["n_res"], large["peak_mb_per_rank"]
    a = (p2 / n2 - p1 / n1) / (n2 - n1)
    b = p1 / n1 - a * n1
    if a <= 0:
        return int(budget_mb / max(b, 1e-9))
    return int((-b + (b * b + 4 * a * budget_mb) ** 0.5) / (2 * a))


def run(args: argparse.Namespace) -> int:
    from suite.bench.common import print_table, write_json
    from suite.errors import UsageError

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < max(args.ranks):
            raise UsageError(f"--device cuda needs {max(args.ranks)} GPUs")
    opts = {k: getattr(args, k) for k in ("n_res", "n_seq", "blocks", "chunk_size", "repeat", "dtype", "device")}
    rows = [_measure(w, opts, args.timeout) for w in args.ranks]
    base = rows[0]
    for row in rows:
        row["time_vs_first"] = row["seconds"] / base["seconds"]
        row["memory_vs_first"] = row["peak_mb_per_rank"] / max(base["peak_mb_per_rank"], 1e-9)
    if args.budget_mb:
        half = {**opts, "n_res": max(8, args.n_res // 2)}
        for row in rows:
            small = _measure(row["ranks"], half, args.timeout)
            row["longest_n_res_in_budget"] = _fit_longest(small, row, args.budget_mb)
    title = (
        f"Evoformer x{args.blocks} (model_1 sizes), N_res {args.n_res}, MSA {args.n_seq}, {args.dtype}, "
        f"{args.device}, chunk {args.chunk_size}"
    )
    print_table(rows, title=title)
    write_json(args.json, {"benchmark": "dap", "settings": opts, "rows": rows})
    return 0
