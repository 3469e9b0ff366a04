"""`suite bench dap`: the Evoformer stack (AlphaFold2 model_1 channel sizes) on 1, 2, ... DAP ranks."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ...utils.memory_meter import fixed_mmap_threshold, reset_peak_rss, rss_bytes
from ..errors import UsageError
from .harness import int_list, peak_over, publish, time_fn, torch_device

__all__ = ["add_arguments", "dap_group", "fit_longest", "group_peak_mb", "pin_to_core", "run", "search_longest"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int_list, default=[1, 2], help="DAP rank counts, e.g. 1,2,4")
    parser.add_argument("--n_res", type=int, default=384, help="residues")
    parser.add_argument("--n_seq", type=int, default=128, help="MSA rows")
    parser.add_argument("--blocks", type=int, default=2, help="Evoformer blocks")
    parser.add_argument("--chunk_size", type=int, default=None, help="chunk size inside each rank (default none)")
    parser.add_argument("--residual", choices=["out_of_place", "in_place"], default="out_of_place",
                        help="InferenceOptions.residual")
    parser.add_argument("--repeat", type=int, default=3, help="timed passes after the memory pass (0: no timing)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, NCCL")
    parser.add_argument("--affinity", choices=["pin", "none"], default="pin",
                        help="cpu: pin rank r to the r-th allowed core")
    parser.add_argument("--budget_mb", type=float, default=None, help="also find the longest N_res that fits")
    parser.add_argument("--budget_tol", type=int, default=8, help="residues: resolution of the budget search")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per rank count")


def pin_to_core(rank: int, world: int) -> int | None:
    """Pin this rank to its own core (the rank-th allowed one) when every rank can have one; which core (also
    `suite bench fold-model --multimer`'s DAP rows)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world:
        print(f"affinity: {world} ranks but {len(cores)} cores allowed; not pinning", file=sys.stderr)
        return None
    os.sched_setaffinity(0, {cores[rank]})
    return cores[rank]


def dap_group(rank: int, world: int, model, device):
    """Split `model` across a DAP group of `world` ranks (nothing with one rank): (topology or None, group or
    None). `topology.destroy()` ends it. Also `suite bench fold-model --multimer`'s DAP rows."""
    from ...core_parallel import Axis, Topology
    from ...fastfold.dap import parallelize_dap

    if world == 1:
        return None, None
    topo = Topology(world_size=world, rank=rank, dap=world, backend="nccl" if device.type == "cuda" else "gloo")
    group = topo.init().group(Axis.DAP)
    parallelize_dap(model, group)
    return topo, group


def group_peak_mb(run, group, device) -> float:
    """Peak memory growth of one `run()` on this rank (`peak_over`), the largest over the DAP `group` (MiB)."""
    import torch
    import torch.distributed as dist

    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_bytes()
    _, peak = peak_over(run, device)
    value = torch.tensor([(peak - before) / 2**20], dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def fit_longest(small: tuple[int, float], large: tuple[int, float], budget_mb: float) -> int:
    """Peak(N) = a N^2 + b N through two (N, peak MB) points; the largest N with Peak(N) <= budget."""
    (n1, p1), (n2, p2) = small, large
    a = (p2 / n2 - p1 / n1) / (n2 - n1)
    b = p1 / n1 - a * n1
    if a <= 0:
        return int(budget_mb / max(b, 1e-9))
    return int((-b + (b * b + 4 * a * budget_mb) ** 0.5) / (2 * a))


def search_longest(peak_mb, budget_mb: float, guess: int, tol: int, known: dict[int, float]) -> int:
    """The largest N (within `tol`) with peak_mb(N) <= budget_mb (the peak growing with N), 0 if N=8 does not fit:
    from `guess` in doubling steps until bracketed, then bisection; `known` (N -> peak MB) gains every probe."""

    def fits(n: int) -> bool:
        if n not in known:
            known[n] = peak_mb(n)
        return known[n] <= budget_mb

    n = max(8, guess)
    up = fits(n)
    step = max(tol, n // 32)
    while True:
        n = n + step if up else max(8, n - step)
        if fits(n) != up:
            break
        if n == 8:
            return 0
        step *= 2
    lo = max(k for k, p in known.items() if p <= budget_mb)
    hi = min((k for k, p in known.items() if p > budget_mb and k > lo), default=lo)
    while hi - lo > tol:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _bench_rank(rank: int, world: int, opts: dict) -> dict:
    """One rank (every rank seeded and deciding alike): one pass's peak, the passes' time, with a budget the longest
    N_res that fits."""
    import torch
    from torch import nn

    from ...fastfold.model import InferenceOptions, config
    from ...fastfold.model.evoformer import EvoformerStack

    device = torch_device(opts["device"], rank)
    core = pin_to_core(rank, world) if device.type == "cpu" and opts["affinity"] == "pin" else None
    dtype = getattr(torch, opts["dtype"])
    cfg = dataclasses.replace(config.preset("model_1").evoformer, num_blocks=opts["blocks"])
    torch.manual_seed(0)
    holder = nn.Module()
    holder.stack = EvoformerStack(cfg).to(device=device, dtype=dtype).eval()
    topo, group = dap_group(rank, world, holder, device)
    options = InferenceOptions(chunk_size=opts["chunk_size"], residual=opts["residual"])
    sync = torch.cuda.synchronize if device.type == "cuda" else None

    def inputs(n: int, s: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator(device=device).manual_seed(1)
        m = torch.randn(s, n, cfg.c_m, device=device, dtype=dtype, generator=g)
        z = torch.randn(n, n, cfg.c_z, device=device, dtype=dtype, generator=g)
        return m, z, torch.ones(s, n, device=device), torch.ones(n, n, device=device)

    def run(args: tuple[torch.Tensor, ...]) -> None:
        with torch.no_grad():
            holder.stack(*args, options)

    resettable = device.type == "cuda" or reset_peak_rss()

    def peak_mb(n: int) -> float:
        args = inputs(n, opts["n_seq"])  # made first: the inputs are not the pass's growth
        return group_peak_mb(lambda: run(args), group, device)

    run(inputs(8, 4))  # load every code path once, so one-time costs stay out of the measured peak
    known = {opts["n_res"]: peak_mb(opts["n_res"])}
    seconds = None
    if opts["repeat"] > 0:
        args = inputs(opts["n_res"], opts["n_seq"])
        seconds = time_fn(lambda: run(args), warmup=0, repeat=opts["repeat"], sync=sync)
        del args
    out = {"seconds": seconds, "peak_mb": known[opts["n_res"]], "core": core}
    if opts["budget_mb"]:
        if not resettable:
            raise RuntimeError("--budget_mb needs a resettable peak (Linux /proc/self/clear_refs or CUDA)")
        half = max(8, opts["n_res"] // 2)
        known[half] = peak_mb(half)
        guess = fit_longest((half, known[half]), (opts["n_res"], known[opts["n_res"]]), opts["budget_mb"])
        out["longest_fit"] = guess
        out["longest_measured"] = search_longest(peak_mb, opts["budget_mb"], guess, opts["budget_tol"], known)
        out["probes"] = sorted(known.items())
    if topo is not None:
        topo.destroy()
    return out


def _measure(world: int, opts: dict, timeout: float) -> dict:
    from ...core_parallel import run_on_ranks

    with fixed_mmap_threshold():
        per_rank = run_on_ranks(_bench_rank, world, opts, timeout=timeout, backend="none")
    row = {"ranks": world, "n_res": opts["n_res"],
           "seconds": None if opts["repeat"] == 0 else max(r["seconds"] for r in per_rank),
           "peak_mb_per_rank": max(r["peak_mb"] for r in per_rank), "cores": ",".join(str(r["core"]) for r in per_rank)}
    if opts["budget_mb"]:
        first = per_rank[0]
        row.update(longest_n_res_fit=first["longest_fit"], longest_n_res_measured=first["longest_measured"])
        row["probes"] = first["probes"]
    return row


def run(args: argparse.Namespace) -> int:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < max(args.ranks):
            raise UsageError(f"--device cuda needs {max(args.ranks)} GPUs")
    if args.repeat < 0 or args.budget_tol < 1:
        raise UsageError("--repeat must be >= 0 and --budget_tol >= 1")
    opts = {k: getattr(args, k) for k in ("n_res", "n_seq", "blocks", "chunk_size", "residual", "repeat", "dtype",
                                          "device", "affinity", "budget_mb", "budget_tol")}
    rows = [_measure(w, opts, args.timeout) for w in args.ranks]
    base = rows[0]
    for row in rows:
        if row["seconds"] is not None:
            row["time_vs_first"] = row["seconds"] / base["seconds"]
        row["memory_vs_first"] = row["peak_mb_per_rank"] / max(base["peak_mb_per_rank"], 1e-9)
        if args.budget_mb:
            row["longest_vs_first"] = row["longest_n_res_measured"] / max(base["longest_n_res_measured"], 1)
    title = (f"Evoformer x{args.blocks} (model_1 sizes), N_res {args.n_res}, MSA {args.n_seq}, {args.dtype}, "
             f"{args.device}, chunk {args.chunk_size}, {args.residual}, 1 thread per rank, affinity {args.affinity}"
             + (f", budget {args.budget_mb:g} MB/rank" if args.budget_mb else ""))
    columns = [c for c in rows[0] if c != "probes"] + [c for c in rows[-1] if c not in rows[0]]
    notes = [f"{r['ranks']} rank(s), peak MB per N_res probed: " + ", ".join(f"{n}: {p:.0f}" for n, p in r["probes"])
             for r in rows if args.budget_mb]
    publish(args, {"benchmark": "dap", "settings": opts, "rows": rows}, [(title, rows, columns)], notes)
    return 0
