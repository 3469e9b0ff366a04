"""`suite bench fold-model`: one AlphaFold2 pass with the released channel sizes, chunked against unchunked;
`--multimer` (AlphaFold-Multimer, with DAP rows) and `--openfold DIR` (`fold_openfold`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys

from ...utils.memory_meter import fix_malloc, fixed_mmap_threshold, hwm_bytes, malloc_trim, reset_peak_rss, rss_bytes
from ..errors import UsageError
from .harness import SUITE, Side, emit, int_list, peak_over, publish, run_side, safe_env, step_times, torch_device

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n_res", type=int_list, default=[256, 512], help="residue counts, e.g. 256,512")
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
    parser.add_argument("--multimer", action="store_true",
                        help="AlphaFold-Multimer (model_1_multimer_v3 widths) on a complex of --chains; DAP rows too")
    parser.add_argument("--chains", type=int_list, default=[256, 256],
                        help="--multimer: chain lengths of the complex, e.g. 256,256")
    parser.add_argument("--n_templ", type=int, default=4, help="--multimer: templates")
    parser.add_argument("--template_blocks", type=int, default=2, help="--multimer: template pair blocks (released: 2)")
    parser.add_argument("--dap_ranks", type=int_list, default=[1, 2],
                        help="--multimer: DAP rank counts, the first the baseline (one count: no DAP rows)")
    parser.add_argument("--parts", choices=["all", "chunk", "dap"], default="all",
                        help="--multimer: which comparisons to run")
    parser.add_argument("--openfold", metavar="DIR", default=None,
                        help="compare with OpenFold's model from this checkout (whole process)")
    parser.add_argument("--openfold_pythonpath", metavar="PATHS", default="",
                        help=f"--openfold: extra folders ({os.pathsep!r}-separated) for OpenFold's dependencies")
    parser.add_argument("--preset", default="model_1_ptm", help="--openfold: the released model, full size")
    parser.add_argument("--threads", type=int, default=2, help="--openfold: torch threads in each side's process")
    parser.add_argument("--inputs_dir", metavar="DIR", default=None,
                        help="--openfold: write (or reuse) the parameters and features here")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)


def _multimer_model(args: argparse.Namespace, device, dtype):
    """AlphaFold-Multimer at model_1_multimer_v3 widths (random weights, no early stop) and chains -> its batch."""
    import torch

    from ...fastfold.model.multimer import AlphaFoldMultimer, multimer_preset
    from ...fastfold.model.testing import random_multimer_batch, randomize_parameters

    cfg = multimer_preset("model_1_multimer_v3")
    cfg.evoformer = dataclasses.replace(cfg.evoformer, num_blocks=args.blocks)
    cfg.extra_msa = dataclasses.replace(cfg.extra_msa, num_blocks=args.extra_blocks)
    cfg.template = dataclasses.replace(cfg.template, num_blocks=args.template_blocks)
    cfg.recycle_early_stop_tolerance = -1.0
    model = randomize_parameters(AlphaFoldMultimer(cfg), seed=0).to(device=device, dtype=dtype).eval()

    def batch_of(chains: list[int]) -> dict[str, torch.Tensor]:
        return {k: v.to(device) for k, v in random_multimer_batch(
            chains, n_seq=args.n_seq, n_extra=args.n_extra, n_templ=args.n_templ, n_recycle=0, seed=0).items()}

    return model, batch_of


def _child(args: argparse.Namespace) -> int:
    import torch

    from ...fastfold.model import AlphaFold, InferenceOptions, config
    from ...fastfold.model.testing import random_batch

    fix_malloc(2**20)
    n_res, variant = args._child.split(":")
    device = torch_device(args.device)
    dtype = getattr(torch, args.dtype)
    chunk = args.chunk_size if args.chunk_size == "auto" else int(args.chunk_size)
    options = InferenceOptions() if variant == "unchunked" else InferenceOptions(
        chunk_size=chunk, memory_budget_bytes=args.memory_budget_mb * 2**20, residual="in_place")
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    if args.multimer:
        model, batch_of = _multimer_model(args, device, dtype)
        warm = [16] * len(args.chains)
        n_res = sum(args.chains)
    else:
        cfg = config.preset("model_3_ptm")
        cfg.evoformer = dataclasses.replace(cfg.evoformer, num_blocks=args.blocks)
        cfg.extra_msa = dataclasses.replace(cfg.extra_msa, num_blocks=args.extra_blocks)
        model = AlphaFold(cfg).to(device=device, dtype=dtype).eval()
        warm = 32

        def batch_of(n: int) -> dict[str, torch.Tensor]:
            return {k: v.to(device) for k, v in random_batch(cfg, n_res=n, n_seq=args.n_seq, n_extra=args.n_extra,
                                                             n_recycle=0).items()}

    with torch.no_grad():
        model(batch_of(warm), options)  # warm-up: library initialisation, not counted
    batch = batch_of(args.chains if args.multimer else int(n_res))
    if device.type == "cuda":
        base = torch.cuda.memory_allocated()
    else:  # freed heap pages handed back first; without a resettable peak, growth over the peak so far (VmHWM)
        gc.collect()
        malloc_trim()
        base = rss_bytes() if reset_peak_rss() else hwm_bytes()

    def one_pass():
        with torch.no_grad():
            model(batch, options)

    times, peak = peak_over(lambda: step_times(one_pass, args.repeat, warmup=args.warmup, sync=sync), device)
    emit({"n_res": int(n_res), "variant": variant, "seconds": sorted(times)[len(times) // 2],
          "peak_bytes": peak - base, "device": device.type})
    return 0


def _run_child(args: argparse.Namespace, n_res: int, variant: str) -> dict:
    argv = [sys.executable, "-m", SUITE, "bench", "fold-model", "--_child", f"{n_res}:{variant}"]
    for flag in ("blocks", "extra_blocks", "n_seq", "n_extra", "chunk_size", "memory_budget_mb", "dtype", "device",
                 "repeat", "warmup"):
        argv += [f"--{flag}", str(getattr(args, flag))]
    if args.multimer:
        argv += ["--multimer", "--chains", ",".join(map(str, args.chains)), "--n_templ", str(args.n_templ),
                 "--template_blocks", str(args.template_blocks)]
    return run_side(Side(f"fold-model benchmark n_res={n_res} {variant}", argv, env=safe_env(), measure=False)).result()


def run(args: argparse.Namespace) -> int:
    if args._child:
        return _child(args)
    if min(args.blocks, args.n_seq, args.n_extra, args.repeat) <= 0 or args.warmup < 0:
        raise UsageError("fold-model: --blocks, --n_seq, --n_extra and --repeat must be positive, --warmup not "
                         "negative")
    from ...fastfold.model.options import check_chunk_size

    try:  # the one chunk-size check (the flag's text read as suite fold reads it)
        check_chunk_size(int(args.chunk_size) if args.chunk_size.lstrip("-").isdigit() else args.chunk_size)
    except ValueError as exc:
        raise UsageError(f"fold-model: --{exc}") from None
    if args.openfold is not None:
        from .fold_openfold import run as run_openfold

        return run_openfold(args)
    if args.multimer:
        return _run_multimer(args)
    rows = []
    for n_res in args.n_res:
        u, c = (_run_child(args, n_res, v) for v in ("unchunked", "chunked"))
        rows.append({"n_res": n_res, "device": u["device"], "unchunked_s": u["seconds"], "chunked_s": c["seconds"],
                     "time_ratio": c["seconds"] / u["seconds"], "unchunked_peak_mib": u["peak_bytes"] / 2**20,
                     "chunked_peak_mib": c["peak_bytes"] / 2**20,
                     "memory_ratio": c["peak_bytes"] / max(u["peak_bytes"], 1)})
    title = (f"AlphaFold2 pass, {args.blocks} Evoformer + {args.extra_blocks} extra-MSA blocks, released channels, "
             f"{args.n_seq} MSA rows, {args.n_extra} extra rows, {args.dtype}; chunk_size={args.chunk_size}")
    publish(args, {"benchmark": "fold-model", "args": _args(args), "rows": rows}, [(title, rows, None)])
    return 0


def _args(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


def _dap_rank(rank: int, world: int, opts: dict) -> dict:
    """One DAP rank of the multimer comparison: the model split across the group; one pass's peak, then the time."""
    import torch

    from ...fastfold.model import InferenceOptions
    from .dap import dap_group, group_peak_mb, pin_to_core

    device = torch.device("cpu")
    core = pin_to_core(rank, world)
    model, batch_of = _multimer_model(argparse.Namespace(**opts), device, getattr(torch, opts["dtype"]))
    topo, group = dap_group(rank, world, model, device)
    options = InferenceOptions()

    def run(batch) -> None:
        with torch.no_grad():
            model(batch, options)

    run(batch_of([16] * len(opts["chains"])))  # every code path once: one-time costs stay out of the peak
    batch = batch_of(opts["chains"])
    for _ in range(opts["warmup"]):
        run(batch)
    times: list[float] = []
    peak = group_peak_mb(lambda: times.extend(step_times(lambda: run(batch), 1)), group, device)
    times += step_times(lambda: run(batch), opts["repeat"] - 1)
    if topo is not None:
        topo.destroy()
    return {"seconds": sorted(times)[len(times) // 2], "peak_mib": peak, "core": core}


def _run_dap(args: argparse.Namespace, world: int) -> dict:
    from ...core_parallel import run_on_ranks

    opts = {k: getattr(args, k) for k in ("blocks", "extra_blocks", "n_seq", "n_extra", "n_templ", "template_blocks",
                                          "chains", "dtype", "repeat", "warmup")}
    with fixed_mmap_threshold():  # freed large tensors leave the resident set (as bench dap)
        per_rank = run_on_ranks(_dap_rank, world, opts, timeout=3600.0, backend="none")
    return {"seconds": max(r["seconds"] for r in per_rank), "peak_mib": max(r["peak_mib"] for r in per_rank),
            "cores": ",".join(str(r["core"]) for r in per_rank)}


def _compared(name: str, base: dict, got: dict, **extra) -> dict:
    """A multimer row: `got` against `base` (seconds and peak MiB of each)."""
    return {"comparison": name, **extra, "baseline_s": base["seconds"], "s": got["seconds"],
            "time_ratio": got["seconds"] / base["seconds"], "baseline_peak_mib": base["peak_mib"],
            "peak_mib": got["peak_mib"], "memory_ratio": got["peak_mib"] / max(base["peak_mib"], 1e-9)}


def _run_multimer(args: argparse.Namespace) -> int:
    if args.n_templ <= 0 or args.template_blocks < 0:
        raise UsageError("fold-model --multimer: --n_templ must be positive and --template_blocks not negative")
    if args.parts == "dap" and len(args.dap_ranks) < 2:
        raise UsageError("fold-model --multimer --parts dap: give two or more --dap_ranks, e.g. 1,2")
    if args.device == "cuda" and args.parts != "chunk":
        raise UsageError("fold-model --multimer: the DAP rows run on CPU (gloo); use --parts chunk with --device cuda")
    complex_ = "+".join(map(str, args.chains))
    rows = []
    if args.parts in ("all", "chunk"):
        u, c = ({**r, "peak_mib": r["peak_bytes"] / 2**20} for r in
                (_run_child(args, sum(args.chains), v) for v in ("unchunked", "chunked")))
        rows.append({**_compared("chunked vs unchunked", u, c, complex=complex_, device=u["device"]),
                     "memory_ratio": c["peak_bytes"] / max(u["peak_bytes"], 1),
                     "settings": f"chunk_size={args.chunk_size}, in_place"})
    if args.parts in ("all", "dap") and len(args.dap_ranks) > 1:
        base = _run_dap(args, args.dap_ranks[0])
        for world in args.dap_ranks[1:]:
            got = _run_dap(args, world)
            rows.append({**_compared(f"DAP {world} ranks vs {args.dap_ranks[0]}", base, got, complex=complex_,
                                     device="cpu"),
                         "settings": f"unchunked, 1 thread per rank, cores {base['cores']} / {got['cores']}"})
    title = (f"AlphaFold-Multimer pass (model_1_multimer_v3 widths), complex {complex_}, {args.blocks} Evoformer + "
             f"{args.extra_blocks} extra-MSA + {args.template_blocks} template blocks, {args.n_seq} MSA rows, "
             f"{args.n_extra} extra rows, {args.n_templ} templates, {args.dtype}")
    publish(args, {"benchmark": "fold-model --multimer", "args": _args(args), "rows": rows}, [(title, rows, None)])
    return 0
