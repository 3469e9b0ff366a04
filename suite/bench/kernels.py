"""`suite bench kernels`: LayerNorm, masked-bias softmax and attention, ours against what users would run."""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time

from ...utils.memory_meter import fixed_mmap_threshold, reset_peak_rss, rss_bytes
from ..errors import UsageError
from .harness import child, child_main, int_list, names, peak_over, publish, run_side, step_times

__all__ = ["add_arguments", "run"]

OPS = ("layer_norm", "softmax", "attention")
BASELINES = {"layer_norm": ("F.layer_norm",), "softmax": ("naive",), "attention": ("naive", "sdpa")}
MODES = ("fwd", "fwd+bwd")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--ops", type=names(OPS), default=list(OPS), help="comma list")
    parser.add_argument("--modes", type=names(MODES), default=list(MODES), help="fwd,fwd+bwd")
    parser.add_argument("--n-res", type=int_list, default=None,
                        help="Evoformer N_res sizes (default: 256 on cpu, 256,768 on cuda)")
    parser.add_argument("--heads", type=int_list, default=[4, 8], help="Evoformer head counts")
    parser.add_argument("--seq", type=int_list, default=[4096], help="diffusion sequence lengths L")
    parser.add_argument("--diffusion-heads", type=int, default=8, help="heads in the diffusion cases")
    parser.add_argument("--suites", type=names(("evoformer", "diffusion")), default=["evoformer", "diffusion"],
                        help="which size families to run")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per case (median)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per case before giving up")
    parser.add_argument("--floor", action="store_true",
                        help="attention: also SDPA without bias or mask (the floor: what the bias and mask cost)")


def _cases(args: argparse.Namespace) -> list[dict]:
    """One dict per (op, size, mode): the shapes the worker builds."""
    n_res = args.n_res or ([256] if args.device == "cpu" else [256, 768])
    cases = []
    for mode in args.modes:
        if "evoformer" in args.suites:
            for n in n_res:
                cases.append({"op": "layer_norm", "size": f"evo N={n} C=128", "mode": mode, "x": [n, n, 128]})
                for h in args.heads:
                    cases += _score_cases(f"evo N={n} H={h}", mode, lead=[1, n, h], n_q=n, n_k=n, d=32,
                                          bias=[1, 1, h, n, n], mask=[1, n, 1, 1, n])
        if "diffusion" in args.suites:
            h = args.diffusion_heads
            for n in args.seq:
                cases.append({"op": "layer_norm", "size": f"diff L={n} C=320", "mode": mode, "x": [2, n, 320]})
                cases += _score_cases(f"diff L={n} H={h}", mode, lead=[1, h], n_q=n, n_k=n, d=64,
                                      bias=[1, 1, n, n], mask=[1, 1, 1, n])
    return [c for c in cases if c["op"] in args.ops]


def _score_cases(size, mode, *, lead, n_q, n_k, d, bias, mask):
    base = {"size": size, "mode": mode, "bias": bias, "mask": mask}
    return [{**base, "op": "softmax", "x": lead + [n_q, n_k]},
            {**base, "op": "attention", "q": lead + [n_q, d], "k": lead + [n_k, d]}]


def _inputs(case: dict, device, dtype) -> dict:
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    grad = case["mode"] == "fwd+bwd"

    def rnd(shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)

    if case["op"] == "layer_norm":
        c = case["x"][-1]
        return {"x": rnd(case["x"]), "w": rnd([c]), "b": rnd([c])}
    mask = (torch.rand(*case["mask"], generator=g) > 0.1).to(device)
    if case["op"] == "softmax":
        return {"x": rnd(case["x"]), "bias": rnd(case["bias"]), "mask": mask}
    return {"q": rnd(case["q"]), "k": rnd(case["k"]), "v": rnd(case["k"]), "bias": rnd(case["bias"]), "mask": mask}


def _impl(op: str, impl: str):
    import torch
    import torch.nn.functional as F

    from ... import kernels

    def naive_scores(x, bias, mask, scale):
        return torch.softmax((x * scale + bias).masked_fill(~mask, float("-inf")), dim=-1)

    table = {
        ("layer_norm", "ours"): lambda x, w, b: kernels.layer_norm(x, w, b),
        ("layer_norm", "F.layer_norm"): lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
        ("softmax", "ours"): lambda x, bias, mask: kernels.softmax(x, mask=mask, bias=bias, scale=0.5),
        ("softmax", "naive"): lambda x, bias, mask: naive_scores(x, bias, mask, 0.5),
        ("attention", "ours"): lambda q, k, v, bias, mask: kernels.attention(q, k, v, bias=bias, mask=mask),
        ("attention", "naive"): lambda q, k, v, bias, mask: naive_scores(
            q @ k.transpose(-1, -2), bias, mask, q.shape[-1] ** -0.5) @ v,
        # leading dims flattened to SDPA's 4-D [B, H, L, D]: its fused kernels (flash) take nothing else
        ("attention", "sdpa-nobias"): lambda q, k, v, bias, mask: F.scaled_dot_product_attention(
            *(t.flatten(0, -4) for t in (q, k, v))).view(q.shape),
        ("attention", "sdpa"): lambda q, k, v, bias, mask: F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.masked_fill(~mask, float("-inf"))),
    }
    return table[(op, impl)]


def _worker(spec: dict) -> dict:
    import torch

    case, device = spec["case"], torch.device(spec["device"])
    inputs = _inputs(case, device, getattr(torch, spec["dtype"]))
    fn = _impl(case["op"], spec["impl"])
    leaves = [t for t in inputs.values() if t.requires_grad]

    def step():
        if not leaves:
            with torch.no_grad():
                return fn(**inputs)
        out = fn(**inputs)
        return torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)  # the floor skips bias

    cuda = device.type == "cuda"
    step()  # warm-up: lazy initialisation must count neither as the op's memory nor its time
    if spec["measure"] == "time":
        wall, cpu = _timings(step, spec["repeat"], torch.cuda.synchronize if cuda else None, 0.05 if cuda else 0.0)
        return {"ms": wall * 1e3, "cpu_ms": None if cuda else cpu * 1e3}
    gc.collect()
    if not cuda and not reset_peak_rss():
        raise RuntimeError("measuring extra memory on CPU needs Linux /proc/self/clear_refs")
    before = torch.cuda.memory_allocated(device) if cuda else rss_bytes()  # extra: the peak's growth over this
    return {"extra_mib": (peak_over(step, device)[1] - before) / 2**20}


def _timings(step, repeat: int, sync, min_sample_s: float = 0.0) -> tuple[float, float]:
    """Median wall and process CPU seconds per call. With `min_sample_s` (the GPU) each sample runs the call back
    to back for that long, then synchronises once (one synchronised call of a small op times the launch)."""
    calls = 1
    if min_sample_s > 0:
        once = max(step_times(step, 1, sync=sync)[0], 1e-6)
        calls = max(1, min(1000, int(min_sample_s / once)))
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            step()
        if sync:
            sync()
        wall.append((time.perf_counter() - t0) / calls)
        cpu.append((time.process_time() - c0) / calls)
    return statistics.median(wall), statistics.median(cpu)


def _run_case(case: dict, impl: str, args: argparse.Namespace, dtype: str) -> dict:
    """Memory (freed blocks leave RSS: `fixed_mmap_threshold`) and time of one implementation, a process each."""
    result = {}
    for measure in ("memory", "time"):
        spec = {"case": case, "impl": impl, "device": args.device, "dtype": dtype, "repeat": args.repeat,
                "measure": measure}
        with fixed_mmap_threshold() if measure == "memory" else contextlib.nullcontext():
            got = run_side(child(f"{case['op']} {impl}", __name__, spec, timeout=args.timeout, measure=False))
        if got.returncode != 0:
            return {"error": got.outcome()}
        result.update(got.result())
    return result


def _row(case: dict, baseline: str, ours: dict, base: dict) -> dict:
    row = {"op": case["op"], "size": case["size"], "mode": case["mode"], "baseline": baseline}
    if "error" in ours or "error" in base:
        row["error"] = ours.get("error") or base.get("error")
        return row
    row.update({"ours ms": ours["ms"], "base ms": base["ms"], "time ratio": ours["ms"] / base["ms"]})
    if ours.get("cpu_ms") and base.get("cpu_ms"):
        row["cpu-time ratio"] = ours["cpu_ms"] / base["cpu_ms"]
    row.update({"ours MiB": ours["extra_mib"], "base MiB": base["extra_mib"],
                "mem ratio": ours["extra_mib"] / max(base["extra_mib"], 1e-9)})
    return row


def run(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        raise UsageError(f"--repeat must be at least 1, got {args.repeat}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine")
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    rows = []
    cases = _cases(args)
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case['op']} {case['size']} {case['mode']}", file=sys.stderr, flush=True)
        ours = _run_case(case, "ours", args, dtype)
        floor = ("sdpa-nobias",) if args.floor and case["op"] == "attention" else ()
        for baseline in BASELINES[case["op"]] + floor:
            rows.append(_row(case, baseline, ours, _run_case(case, baseline, args, dtype)))
    columns = ["op", "size", "mode", "baseline", "ours ms", "base ms", "time ratio", "cpu-time ratio", "ours MiB",
               "base MiB", "mem ratio", "error"]
    method = ("peak RSS growth (VmHWM reset via clear_refs), one subprocess per case" if args.device == "cpu"
              else "torch.cuda.max_memory_allocated growth")
    title = f"kernels on {args.device} ({dtype}); extra memory = peak growth during one call ({method})"
    publish(args, {"benchmark": "kernels", "device": args.device, "dtype": dtype, "rows": rows,
                   "memory_method": method}, [(title, rows, columns)])
    return 0


if __name__ == "__main__":
    child_main(_worker)
