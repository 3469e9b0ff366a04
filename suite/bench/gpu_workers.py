"""The jobs `suite bench gpu` runs each in a process of its own: `python -m lowmem.suite.bench.gpu_workers JSON`.

A job prints one JSON object per line as soon as it has measured it, so a job cut off by its time limit (or
killed by an out-of-memory error) still leaves what it measured. Jobs (the JSON's `job`; docs/benchmarks.md, "GPU
proof"): `parity` (the kernels against float64 and Gemini against torch AdamW on the device), `sd` (`suite bench
diffusion`'s sides at SD-1.5's size and growing batches), `suite` (the `suite` command line in this process, on
an emulated card, `harness.emulate_card`, with fastfold's device-aware budget for `chunk_size="auto"`).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from .harness import emit, emulate_card, peak_over, step_times, torch_device
from .memory import rss_bytes

__all__ = ["SD15", "gemini_parity", "kernel_parity", "main"]

ATOL = {"float32": 1e-4, "bfloat16": 5e-2}
"""Dtype margins of the kernels' parity rule (as tests/kernels/_tolerance.py)."""


# ---- parity ---------------------------------------------------------------------------------------------------


class _Fallbacks(logging.Handler):
    """Collects the kernels' fallback warnings ("... using the PyTorch path")."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _kernel_cases(g) -> list[tuple]:
    """(name, op, reference, float64 tensors that get gradients, other keyword arguments)."""
    import torch

    from ... import kernels

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    evo_mask = torch.rand(1, 3, 1, 1, 70, generator=g) > 0.2
    evo_mask[0, 0] = False  # fully masked rows
    pad_mask = torch.rand(2, 1, 1, 77, generator=g) > 0.3
    return [
        ("layer_norm [3,37,129]", kernels.layer_norm, kernels.layer_norm_reference,
         [t(3, 37, 129), t(129), t(129)], {}),
        ("softmax evo [1,3,4,37,70] mask+bias", lambda x, b, mask: kernels.softmax(x, mask=mask, bias=b, scale=0.3),
         lambda x, b, mask: kernels.softmax_reference(x, mask, b, 0.3), [t(1, 3, 4, 37, 70), t(1, 1, 4, 37, 70)],
         {"mask": evo_mask}),
        ("attention evo D=32 mask+bias", lambda q, k, v, b, mask: kernels.attention(q, k, v, bias=b, mask=mask),
         lambda q, k, v, b, mask: kernels.attention_reference(q, k, v, b, mask),
         [t(1, 3, 4, 37, 32), t(1, 3, 4, 70, 32), t(1, 3, 4, 70, 32), t(1, 1, 4, 37, 70)], {"mask": evo_mask}),
        ("attention sd D=40 no bias", kernels.attention, kernels.attention_reference,
         [t(2, 8, 77, 40), t(2, 8, 77, 40), t(2, 8, 77, 40)], {}),
        ("attention D=64 key padding", lambda q, k, v, mask: kernels.attention(q, k, v, mask=mask),
         lambda q, k, v, mask: kernels.attention_reference(q, k, v, mask=mask),
         [t(2, 8, 100, 64), t(2, 8, 77, 64), t(2, 8, 77, 64)], {"mask": pad_mask}),
    ]


def _errors(fn, ref, tensors64, kwargs, dtype, device, backend) -> list[tuple[float, float]]:
    """(ours' error, PyTorch's own error in `dtype`) against float64, for the output and every gradient."""
    import torch

    from ... import kernels

    x64 = [x.to(device).requires_grad_() for x in tensors64]
    xl = [x.detach().to(dtype).requires_grad_() for x in x64]
    xo = [x.detach().to(dtype).requires_grad_() for x in x64]
    kwargs = {k: v.to(device) for k, v in kwargs.items()}
    r64, rl = ref(*x64, **kwargs), ref(*xl, **kwargs)
    with kernels.use_backend(backend):
        out = fn(*xo, **kwargs)
        g = torch.randn(r64.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
        grads = [torch.autograd.grad(o, xs, g.to(o.dtype)) for o, xs in ((out, xo), (rl, xl), (r64, x64))]

    def err(a, b):
        return (a.double() - b).abs().max().item() if a.numel() else 0.0

    pairs = [(err(out, r64), err(rl, r64))]
    pairs += [(err(a, c), err(b, c)) for a, b, c in zip(*grads)]
    return pairs


def kernel_parity(device_name: str, dtype_name: str) -> Iterator[dict]:
    """One row per case, as each is done: worst error over output and gradients as a fraction of the rule's bound
    (<= 1 passes), and which implementation ran (a Triton fallback is named)."""
    import torch

    from ... import kernels

    device, dtype = torch_device(device_name), getattr(torch, dtype_name)
    backend = "triton" if device.type == "cuda" else "auto"
    handler = _Fallbacks()
    logging.getLogger(kernels.__name__).addHandler(handler)
    for name, fn, ref, tensors, kwargs in _kernel_cases(torch.Generator().manual_seed(0)):
        before = len(handler.messages)
        try:
            pairs = _errors(fn, ref, tensors, kwargs, dtype, device, backend)
        except Exception as exc:  # noqa: BLE001 - a failing case is a row, the next case still runs
            yield {"check": f"kernels {name}", "dtype": dtype_name, "ok": False,
                   "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            continue
        worst = max(ours / (2 * base + ATOL[dtype_name]) for ours, base in pairs)
        fallback = handler.messages[before:]
        if device.type == "cuda":
            path = "fallback: " + fallback[0] if fallback else (
                "triton interpreted" if os.environ.get("TRITON_INTERPRET") == "1" else "triton compiled")
        else:
            path = "cpu path"
        yield {"check": f"kernels {name}", "dtype": dtype_name, "path": path, "out_err": pairs[0][0],
               "torch_err": pairs[0][1], "worst_vs_bound": worst, "ok": worst <= 1.0}


def _gemini_net(device):
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 33), nn.GELU(),
                        nn.Linear(33, 48)).to(device)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)


def _losses(device, config, autocast: bool, steps: int = 5) -> list[float]:
    """Loss of each of `steps` AdamW steps on fixed data: plain torch (`config` None) or through Gemini."""
    import torch

    from ... import core_parallel

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 48, generator=g).to(device), torch.randn(16, 48, generator=g).to(device)
    model, opt = _gemini_net(device)
    if config is not None:
        model, opt = core_parallel.setup(model, opt, config)
    backward = getattr(opt, "backward", None) or (lambda loss: loss.backward())
    losses = []
    for _ in range(steps):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = (model(x).float() - y).pow(2).mean()
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if hasattr(model, "gemini_manager"):
        model.gemini_manager.close()
    return losses


def gemini_parity(device_name: str) -> list[dict]:
    """Gemini's loss trajectory against plain torch AdamW on the same model and data: fp32 within 1e-5, bf16
    compute (against torch under bf16 autocast with fp32 weights) within 2e-2, relative to 1 + |loss|."""
    from ... import core_parallel

    device = torch_device(device_name)
    tier = {"offload_tier": "cpu", "offload_param_frac": 1.0, "offload_optim_frac": 1.0}
    cases = [("fp32, chunks on the device", {}, False, 1e-5), ("fp32, master + Adam state in the CPU tier", tier,
             False, 1e-5), ("bf16 compute, chunks on the device", {"precision": "bf16"}, True, 2e-2)]
    refs = {False: _losses(device, None, False), True: _losses(device, None, True)}
    rows = []
    for name, extra, autocast, tol in cases:
        try:
            got = _losses(device, core_parallel.GeminiConfig(chunk_mb=0.01, **extra), autocast)
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            rows.append({"check": f"gemini {name}", "ok": False,
                         "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"})
            continue
        diff = max(abs(a - b) / (1 + abs(b)) for a, b in zip(got, refs[autocast]))
        rows.append({"check": f"gemini {name}", "dtype": "bfloat16" if autocast else "float32",
                     "path": device.type, "max_rel_loss_diff": diff, "tolerance": tol, "ok": diff <= tol})
    return rows


def _parity(spec: dict) -> None:
    for dtype in ("float32", "bfloat16"):
        for row in kernel_parity(spec["device"], dtype):
            emit(row)
    for row in gemini_parity(spec["device"]):
        emit(row)


# ---- SD-1.5 UNet: `suite bench diffusion`'s sides -----------------------------------------------------------

SD15 = ["--channels", "320,640,1280,1280", "--layers_per_block", "2", "--cross_attention_dim", "768",
        "--resolution", "512"]
"""`suite bench diffusion`'s flags for SD 1.5's UNet (859.5M; its config's other fields are diffusers' defaults)."""
SD_SMOKE = ["--channels", "32,64", "--layers_per_block", "1", "--cross_attention_dim", "32", "--attention_head_dim",
            "4", "--resolution", "64"]


def _allocated(device) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_bytes()


def _oom(exc: BaseException) -> bool:
    """An out-of-memory error, also as cuBLAS or the caching allocator word it inside a RuntimeError."""
    import torch

    text = str(exc)
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


def _sd_variant(variant: str, spec: dict, opts: dict, device) -> None:
    import torch

    from .diffusion import make_step, setup_variant

    base, t0 = _allocated(device), time.perf_counter()
    head = {"variant": variant, "cap_gib": spec.get("cap_gib")}
    try:
        parts = setup_variant(variant, opts, 0, 1, device)
    except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one
        if not _oom(exc):
            raise
        emit({**head, "outcome": "OOM building the model"})
        return
    head.update(setup_s=time.perf_counter() - t0, state_mib=(_allocated(device) - base) / 2**20)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    last, step = None, None
    for batch in spec["batches"]:
        if last is not None:
            need = last["step_s"] * batch / last["batch"] * (spec["warmup"] + spec["steps"]) + 2
            if time.time() + need > spec["deadline"]:
                emit({**head, "batch": batch, "outcome": f"not tried: ~{need:.0f} s, time slice too short"})
                return
        try:
            step = make_step(parts, {**opts, "batch": batch}, 0, device)
            times, peak = peak_over(lambda s=step: step_times(s, spec["steps"], warmup=spec["warmup"], sync=sync),
                                    device)
        except RuntimeError as exc:
            if not _oom(exc):
                raise
            emit({**head, "batch": batch, "outcome": "OOM"})
            return
        finally:
            step = None
            gc.collect()
        median = statistics.median(times)
        last = {**head, "batch": batch, "outcome": "ok", "step_s": median, "images_per_s": batch / median,
                "peak_mib": (peak - base) / 2**20, "steps": len(times)}
        emit(last)


def _sd(spec: dict) -> None:
    from diffusers import UNet2DConditionModel  # noqa: F401  (imported before any setup_s is timed)
    from diffusers.models.attention_processor import AttnProcessor2_0  # noqa: F401

    from .diffusion import options

    device = torch_device(spec["device"])
    note = emulate_card(spec.get("cap_gib"), device)
    if note:
        emit({"note": note})
    opts = options(["--device", device.type, "--encoders", "none", "--mixed_precision", "bf16", "--gemini_offload",
                    "cpu", "--chunk_mb", "0", *(SD_SMOKE if spec.get("smoke") else SD15)])
    for variant in spec["variants"]:
        _sd_variant(variant, spec, opts, device)


# ---- the suite command line on an emulated card -------------------------------------------------------------


def _suite(spec: dict) -> int:
    """Each of `spec["runs"]` (else the spec itself) after a line {"run": i}: smoke runs start one interpreter."""
    from ..cli import main as suite_main

    device = torch_device(spec["device"])
    for i, run in enumerate(spec.get("runs") or [spec]):
        emit({"run": i})
        note = emulate_card(run.get("cap_gib"), device)
        if note:
            print(f"gpu_workers: {note}", file=sys.stderr, flush=True)
        argv = list(run["argv"])
        if run.get("auto_budget") and device.type == "cuda":
            from ...fastfold.model.options import device_budget_bytes

            budget_mb = max(1, device_budget_bytes(device) // 2**20)
            emit({"memory_budget_mb": budget_mb})
            argv += ["--memory_budget_mb", str(budget_mb)]
        code = suite_main(argv)
        if code:
            return code
    return 0


JOBS: dict[str, Callable[[dict], Any]] = {"parity": _parity, "sd": _sd, "suite": _suite}


def main(argv: list[str] | None = None) -> int:
    """Run the job of the JSON spec."""
    spec = json.loads((argv or sys.argv[1:])[0])
    return int(JOBS[spec["job"]](spec) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
