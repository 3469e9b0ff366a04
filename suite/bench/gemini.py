"""`suite bench gemini`: Gemini against torch FSDP2, DDP and ZeRO-2 (per-rank peak memory, step time), and
`--ram-budget`: the largest model that trains within a RAM budget on the NVMe tier (method: docs/gemini.md)."""

from __future__ import annotations

import argparse
import gc
import gzip
import os
import shutil
import tempfile

from ...utils.memory_meter import SideMeter, fix_malloc, rss_bytes
from ..errors import UsageError
from .harness import count, emulate_card, names, peak_over, publish, ran, time_fn, torch_device, train_side, train_step

__all__ = ["STRATEGIES", "add_arguments", "run", "train_setup"]

STRATEGIES = ("gemini", "fsdp2", "ddp", "zero2")
ALSO = ("gemini_collective",)  # on request: Gemini with peer_reads=False, every gather a collective (as on GPUs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="processes (gloo on CPU, nccl on GPU)")
    parser.add_argument("--params", default="8M", help="model size for the comparison, e.g. 8M, 200M")
    parser.add_argument("--width", type=int, default=512, help="hidden width of the MLP stack")
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--strategies", type=names(STRATEGIES + ALSO), default=list(STRATEGIES),
                        help="comma-separated subset of " + ",".join(STRATEGIES + ALSO) + " (gemini_collective: "
                        "peer_reads=False, gathers as collectives)")
    parser.add_argument("--ram-budget", default=None, help="instead: largest model trainable within this RAM, "
                        "e.g. 4GB (Gemini auto placement + NVMe tier)")
    parser.add_argument("--sizes", default="16M,32M,64M", help="--ram-budget: model sizes to try, ascending")
    parser.add_argument("--offload-dir", default=None, help="--ram-budget: NVMe folder (default: a temp folder)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per spawned run")
    parser.add_argument("--offload_tier", choices=["none", "cpu"], default="none",
                        help="gemini: master weights and Adam state in the CPU tier (states and samples/s reported)")
    parser.add_argument("--cap_gib", type=float, default=None, help="CUDA: each rank on an emulated card this size")
    parser.add_argument("--memory_snapshot", metavar="FILE", default=None,
                        help="CUDA: record rank 0's allocations over setup and steps to FILE (gzipped over 15 MiB)")


def train_setup(strategy: str, device, params: int, width: int, batch: int, world: int, extra: dict):
    """An MLP of `params` parameters of `width` as `strategy` trains it (`extra`: GeminiConfig fields), one step
    taken: (model, step function, Gemini on CPU: RSS after setup less its device chunks, else None)."""
    import torch
    from torch import nn

    layers = max(1, round(params / (width * width + width)))
    mlp = nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())))
    model, opt = train_side(strategy, mlp.to(device), gemini=extra)
    gemini_cpu = hasattr(model, "memory_report") and device.type == "cpu"
    setup_rss = rss_bytes() - sum(model.memory_report()["bytes"]["device"].values()) if gemini_cpu else None
    step = train_step(model, opt, torch.randn(batch // world, width, device=device))
    step()
    return model, step, setup_rss


def _rank_run(rank: int, world: int, strategy: str, params: int, width: int, batch: int, steps: int,
              extra: dict, cap_gib: float | None = None, snapshot: str | None = None) -> dict:
    import torch

    fix_malloc(128 * 1024, trim_threshold=128 * 1024)
    torch.manual_seed(0)
    device = torch_device("auto", rank)
    card = emulate_card(cap_gib, device)
    snapshot = snapshot if device.type == "cuda" and rank == 0 else None
    # One step of a one-layer model on the same code path first: lazy imports (torch.optim pulls in dynamo,
    # FSDP2 its DTensor stack), gloo buffers and thread pools are then in the baseline, not in `peak`.
    warm, _, _ = train_setup(strategy, device, width * width, width, batch, world, extra)
    if hasattr(warm, "gemini_manager"):
        warm.gemini_manager.close()
    del warm
    gc.collect()
    baseline = 0 if device.type == "cuda" else rss_bytes()
    meter = SideMeter([extra["offload_dir"]] if extra.get("offload_dir") else ()).start()
    if snapshot:
        torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=50000)
    model, step, setup_rss = train_setup(strategy, device, params, width, batch, world, extra)
    # RAM-budget mode counts from after setup: what model construction left behind (a meta-device init would
    # not) is not training memory; what Gemini itself holds is.
    after_setup = baseline if setup_rss is None else setup_rss
    meter.reset()
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    step_s, peak = peak_over(lambda: time_fn(step, warmup=0, repeat=steps, sync=sync), device)
    report = model.memory_report() if hasattr(model, "memory_report") else None
    charged = meter.peak()
    meter.close()
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
        snapshot = _gzipped(snapshot)
    return {"peak": peak - baseline, "peak_since_setup": peak - after_setup, "step_s": step_s,
            "report": report, "charged": charged, "memory_method": meter.method, "baseline": ran(strategy),
            **({"card": card} if card else {}), **({"snapshot": snapshot} if snapshot else {})}


def _gzipped(path: str, max_mib: float = 15) -> str:
    """The snapshot file, gzipped when it is over `max_mib` (what comes back from a lent GPU has a size limit)."""
    if os.path.getsize(path) <= max_mib * 2**20:
        return path
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
    return path + ".gz"


def _spawn(strategy: str, ranks: int, params: int, args: argparse.Namespace, extra: dict) -> dict:
    import torch

    from ...core_parallel import run_on_ranks
    from ...core_parallel.topology import default_backend

    backend = default_backend("cuda" if torch.cuda.is_available() else "cpu")
    outs = run_on_ranks(_rank_run, ranks, strategy, params, args.width, args.batch, args.steps, extra,
                        args.cap_gib, args.memory_snapshot, timeout=args.timeout, backend=backend)
    return {**outs[0], **{k: max(o[k] for o in outs) for k in ("peak", "peak_since_setup", "step_s", "charged")}}


def _compare(args: argparse.Namespace) -> tuple[dict, list, list[str]]:
    import torch

    params = count(args.params)
    tier = {"offload_tier": "cpu", "offload_param_frac": 1.0, "offload_optim_frac": 1.0}
    results = {}
    for s in args.strategies:
        try:
            results[s] = _spawn(s, args.ranks, params, args, tier if args.offload_tier == "cpu" else {})
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run here is reported, not fatal
            results[s] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"}
    base = results.get("fsdp2", {})
    rows = []
    for s, r in results.items():
        if "error" in r:
            rows.append({"strategy": s, "train_peak_MiB": "n/a", "step_s": "n/a", "note": r["error"]})
            continue
        row = {"strategy": s, "train_peak_MiB": r["peak"] / 2**20, "charged_MiB": r["charged"] / 2**20,
               "step_s": r["step_s"]}
        if "peak" in base:
            row.update(peak_vs_fsdp2=r["peak"] / base["peak"], time_vs_fsdp2=r["step_s"] / base["step_s"],
                       charged_vs_fsdp2=r["charged"] / base["charged"] if base["charged"] else float("nan"))
        if args.offload_tier == "cpu":
            row.update(states_GiB=16 * params / 2**30, samples_per_s=args.batch / r["step_s"])
        row.update({k: r[k] for k in ("card", "snapshot") if k in r})
        rows.append({**row, "ran": r["baseline"], "memory_method": r["memory_method"]})
    columns = ["strategy", "train_peak_MiB", "charged_MiB", "step_s", "peak_vs_fsdp2", "charged_vs_fsdp2",
               "time_vs_fsdp2", "states_GiB", "samples_per_s", "ran", "card", "note"]
    methods = sorted({r["memory_method"] for r in rows if "memory_method" in r})
    peak = ("torch.cuda.max_memory_allocated over the steps (device memory)" if torch.cuda.is_available() else
            "peak RSS (VmHWM) over the steps minus RSS before the model was built")
    note = (f"train_peak: {peak}; charged: {methods} (host memory) from before the model was built, over the steps "
            "(page cache included)")
    title = f"gemini vs baselines: {params / 1e6:.1f}M params, {args.ranks} ranks, per-rank peak"
    return {"params": params, "ranks": args.ranks, "rows": rows}, [(title, rows, columns)], [note]


def _ram_budget(args: argparse.Namespace) -> tuple[dict, list, list[str]]:
    from ...core_parallel.gemini import parse_bytes

    try:
        budget = parse_bytes(args.ram_budget, "--ram-budget")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    rows, best = [], None
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as folder:
        for size in (count(s) for s in args.sizes.split(",")):
            extra = {"placement": "auto", "offload_tier": "nvme", "offload_dir": folder,
                     "device_memory_budget": budget // 2}
            try:
                r = _spawn("gemini", args.ranks, size, args, extra)
            except Exception as exc:  # noqa: BLE001 - the first failure ends the search
                rows.append({"params_M": size / 1e6, "note": f"failed: {str(exc).splitlines()[0][:80]}"})
                break
            states = 16 * size  # fp32 Adam: parameter, gradient, two moments
            ok = r["peak_since_setup"] <= budget
            rows.append({"params_M": size / 1e6, "model_states_GiB": states / 2**30,
                         "states_vs_budget": states / budget, "train_peak_GiB": r["peak_since_setup"] / 2**30,
                         "charged_GiB": r["charged"] / 2**30, "step_s": r["step_s"], "within_budget": ok,
                         "charged_within_budget": r["charged"] <= budget, "memory_method": r["memory_method"]})
            if not ok:
                break
            best = rows[-1]
    title = f"largest model within --ram-budget {args.ram_budget} (Gemini auto + NVMe), per rank"
    return {"budget_bytes": budget, "rows": rows, "largest": best}, [(title, rows, None)], []


def run(args: argparse.Namespace) -> int:
    if args.ranks < 1:
        raise UsageError(f"--ranks must be >= 1, got {args.ranks}")
    try:
        payload, tables, notes = _ram_budget(args) if args.ram_budget else _compare(args)
    except argparse.ArgumentTypeError as exc:  # `count` of --params or --sizes
        raise UsageError(f"--params/--sizes: {exc}") from None
    publish(args, {"benchmark": "gemini", **payload}, tables, notes)
    return 0
