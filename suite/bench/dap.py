"""`suite bench dap`: the Evoformer stack (AlphaFold2 model_1 channel sizes) on 1, 2, ... DAP ranks.

Per rank count: time per forward pass (slowest rank, median of repeats) and per-rank peak memory of the pass
(CUDA: peak allocated; CPU: growth of the peak resident set during the pass, a fresh process per count).
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
    n, s = opts["n_res"], opts["n_seq"]
    m = torch.randn(s, n, cfg.c_m, device=device, dtype=dtype)
    z = torch.randn(n, n, cfg.c_z, device=device, dtype=dtype)
    msa_mask, pair_mask = torch.ones(s, n, device=device), torch.ones(n, n, device=device)
    options = InferenceOptions(chunk_size=opts["chunk_size"])
    sync = torch.cuda.synchronize if device.type == "cuda" else None

    def run() -> None:
        with torch.no_grad():
            holder.stack(m, z, msa_mask, pair_mask, options)

    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    seconds = time_fn(run, warmup=1, repeat=opts["repeat"], sync=sync)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = peak_rss_bytes() - before
    if topo is not None:
        topo.destroy()
    return {"seconds": seconds, "peak_mb": peak / 2**20}


def _measure(world: int, opts: dict, timeout: float) -> dict:
    from core_parallel import run_on_ranks

    per_rank = run_on_ranks(_bench_rank, world, opts, timeout=timeout, backend="none")
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
