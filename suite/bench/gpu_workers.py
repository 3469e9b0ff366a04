"""The jobs `suite bench gpu` runs each in a process of its own: `python -m lowmem.suite.bench.gpu_workers JSON`.

A job prints one JSON object per line as soon as it has measured it, so a job cut off by its time limit (or
killed by an out-of-memory error) still leaves what it measured. Jobs (the JSON's `job`):

- `parity`: the kernels (Triton, compiled on CUDA) against a float64 reference, outputs and gradients, fp32 and
  bf16, with the tests' rule (error <= 2x PyTorch's own error in that dtype + a dtype margin); Gemini's training
  against plain torch AdamW (fp32 and bf16 compute, chunks on the device and master/optimizer state in the CPU
  tier).
- `sd`: SD-1.5's UNet (the released config, random weights): the plain diffusers-style loop (fp32 weights, SDPA,
  fused AdamW, bf16 autocast) or ours as `suite diffusion finetune --strategy gemini_offload --mixed_precision
  bf16 --gradient_checkpointing` builds it (kernels attention, attention-keeping checkpointing, Gemini bf16 with
  fp32 master weights and AdamW state in CPU memory), at increasing batch sizes until one does not fit.
- `gemini_snapshot`: `suite bench gemini`'s Gemini run on one device with `torch.cuda.memory` history recorded,
  the snapshot written where the spec says.
- `gemini_tier`: Gemini with master weights and optimizer state in the CPU tier on a model whose states do not
  fit the (emulated) card.
- `suite`: the `suite` command line in this process (`argv`), on an emulated smaller card and/or with
  fastfold's device-aware `chunk_size="auto"` budget (`fastfold.model.options.device_budget_bytes`, what
  `InferenceOptions.for_device` uses) passed to `suite bench fold-model` as `--memory_budget_mb`.

An emulated card (`cap_gib`) is `torch.cuda.set_per_process_memory_fraction` plus `torch.cuda.mem_get_info`
reporting the emulated total and what is left of it, so code that sizes itself from the free memory sees the
smaller card.
"""

from __future__ import annotations

import gc
import gzip
import json
import logging
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from .harness import count, emit, fast_optimizer, peak_over, step_times, timed, torch_device
from .memory import hwm_bytes, rss_bytes

__all__ = ["SD15_UNET", "emulate_card", "gemini_parity", "kernel_parity", "main"]

ATOL = {"float32": 1e-4, "bfloat16": 5e-2}
"""Dtype margins of the kernels' parity rule (as tests/kernels/_tolerance.py)."""

SD15_UNET: dict[str, Any] = {
    "sample_size": 64, "in_channels": 4, "out_channels": 4, "center_input_sample": False, "flip_sin_to_cos": True,
    "freq_shift": 0, "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2, "downsample_padding": 1, "mid_block_scale_factor": 1, "act_fn": "silu",
    "norm_num_groups": 32, "norm_eps": 1e-5, "cross_attention_dim": 768, "attention_head_dim": 8,
}
"""`unet/config.json` of Stable Diffusion 1.5 (859.5M parameters), the fields that shape the model."""

_SD_SMOKE = {**SD15_UNET, "sample_size": 8, "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
             "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"], "block_out_channels": [32, 64],
             "layers_per_block": 1, "cross_attention_dim": 32, "attention_head_dim": 4}


def emulate_card(gib: float | None, device) -> str:
    """Limit this process's CUDA allocator to `gib` GiB and make `torch.cuda.mem_get_info` report that card;
    returns a note (nothing happens on CPU or when the card is smaller)."""
    import torch

    if not gib or device.type != "cuda":
        return "" if not gib else f"no {gib:g} GiB cap on {device.type}"
    cap = int(gib * 2**30)
    total = torch.cuda.get_device_properties(device).total_memory
    if cap >= total:
        return f"the card has {total / 2**30:.1f} GiB: no {gib:g} GiB cap needed"
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    real = torch.cuda.mem_get_info

    def mem_get_info(dev=None):
        free, _ = real(dev)
        return min(free, max(0, cap - torch.cuda.memory_reserved(dev))), cap

    torch.cuda.mem_get_info = mem_get_info
    return f"emulated {gib:g} GiB card (allocator fraction {cap / total:.3f} of {total / 2**30:.1f} GiB)"


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


# ---- SD-1.5 UNet ----------------------------------------------------------------------------------------------


def _sd_model(variant: str, cfg: dict, device) -> tuple[Any, Callable]:
    """The UNet and its training step `step(inputs)` for `variant` ("plain" or "ours")."""
    import torch
    import torch.nn.functional as F
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor2_0

    torch.manual_seed(0)
    with torch.device(device):
        unet = UNet2DConditionModel(**cfg)
    unet.train()
    optimizer, _ = fast_optimizer(torch.optim.AdamW, unet.parameters(), lr=1e-5)
    backward: Callable = lambda loss: loss.backward()  # noqa: E731
    if variant == "plain":
        unet.set_attn_processor(AttnProcessor2_0())
    else:
        from ... import core_parallel
        from ...diffusion.attention import set_kernels_attention
        from ...diffusion.memory import enable_checkpointing, order_modules_by_use

        set_kernels_attention(unet, "auto")
        enable_checkpointing(unet, "keep_attention")
        order_modules_by_use(unet)
        config = core_parallel.GeminiConfig(precision="bf16", offload_tier="cpu", offload_param_frac=1.0,
                                            offload_optim_frac=1.0)
        unet, optimizer = core_parallel.setup(unet, optimizer, config)
        backward = optimizer.backward

    def step(inputs: dict) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = unet(inputs["noisy"], inputs["t"], inputs["states"]).sample
        loss = F.mse_loss(pred.float(), inputs["noise"])
        backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return unet, step


def _sd_inputs(batch: int, cfg: dict, device) -> dict:
    import torch

    g = torch.Generator().manual_seed(batch)
    side = cfg["sample_size"]
    latents, noise = (torch.randn(batch, 4, side, side, generator=g) for _ in range(2))
    t = torch.randint(0, 1000, (batch,), generator=g)
    alpha = torch.linspace(0.9991, 0.0047, 1000)[t].view(-1, 1, 1, 1)  # SD's scaled-linear alphas_cumprod ends
    inputs = {"noisy": alpha.sqrt() * latents + (1 - alpha).sqrt() * noise, "noise": noise, "t": t,
              "states": torch.randn(batch, 77, cfg["cross_attention_dim"], generator=g)}
    return {k: v.to(device) for k, v in inputs.items()}


def _timed_steps(step: Callable, inputs: dict, warmup: int, steps: int, device) -> tuple[list[float], int]:
    """Seconds of each timed step (CUDA events around each, back to back, one synchronisation at the end) and
    the peak memory in bytes over warm-up and steps (CUDA: max_memory_allocated; CPU: VmHWM)."""
    import torch

    if device.type != "cuda":
        return peak_over(lambda: step_times(lambda: step(inputs), steps, warmup=warmup), device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        step(inputs)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        step(inputs)
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in events], torch.cuda.max_memory_allocated(device)


def _allocated(device) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_bytes()


def _oom(exc: BaseException) -> bool:
    """An out-of-memory error, also as cuBLAS or the caching allocator word it inside a RuntimeError."""
    import torch

    text = str(exc)
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


def _sd_variant(variant: str, spec: dict, cfg: dict, device) -> None:
    base, t0 = _allocated(device), time.perf_counter()
    head = {"variant": variant, "cap_gib": spec.get("cap_gib")}
    try:
        _, step = _sd_model(variant, cfg, device)
    except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one
        if not _oom(exc):
            raise
        emit({**head, "outcome": "OOM building the model"})
        return
    head.update(setup_s=time.perf_counter() - t0, state_mib=(_allocated(device) - base) / 2**20)
    last = None
    for batch in spec["batches"]:
        if last is not None:
            need = last["step_s"] * batch / last["batch"] * (spec["warmup"] + spec["steps"]) + 2
            if time.time() + need > spec["deadline"]:
                emit({**head, "batch": batch, "outcome": f"not tried: ~{need:.0f} s, time slice too short"})
                return
        inputs = _sd_inputs(batch, cfg, device)
        try:
            times, peak = _timed_steps(step, inputs, spec["warmup"], spec["steps"], device)
        except RuntimeError as exc:
            if not _oom(exc):
                raise
            emit({**head, "batch": batch, "outcome": "OOM"})
            return
        finally:
            del inputs
            gc.collect()
        median = statistics.median(times)
        last = {**head, "batch": batch, "outcome": "ok", "step_s": median, "images_per_s": batch / median,
                "peak_mib": (peak - base) / 2**20, "steps": len(times)}
        emit(last)


def _sd(spec: dict) -> None:
    from diffusers import UNet2DConditionModel  # noqa: F401  (imported before any setup_s is timed)
    from diffusers.models.attention_processor import AttnProcessor2_0  # noqa: F401

    device = torch_device(spec["device"])
    note = emulate_card(spec.get("cap_gib"), device)
    if note:
        emit({"note": note})
    cfg = _SD_SMOKE if spec.get("smoke") else SD15_UNET
    for variant in spec["variants"]:
        _sd_variant(variant, spec, cfg, device)


# ---- Gemini ---------------------------------------------------------------------------------------------------


def _gemini_run(spec: dict, extra: dict, record: str | None = None) -> dict:
    """`suite bench gemini`'s model and step (`gemini.train_setup`) on one device: peak and median step over `steps`."""
    import torch

    from .gemini import train_setup

    device = torch_device(spec["device"])
    cuda = device.type == "cuda"
    if record and cuda:
        torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=spec["max_entries"])
    (model, step, _), setup_s = timed(train_setup, "gemini", device, count(spec["params"]), spec["width"],
                                      spec["batch"], 1, extra)
    times, peak = peak_over(lambda: step_times(step, spec["steps"], sync=torch.cuda.synchronize if cuda else None),
                            device)
    row = {"params": sum(p.numel() for p in model.parameters()), "setup_s": setup_s,
           "step_s": statistics.median(times), "peak_mib": peak / 2**20, "host_peak_mib": hwm_bytes() / 2**20}
    report = model.memory_report()
    row["chunks"] = report.get("chunks")
    row["device_bytes"] = report["bytes"].get("device")
    if record and cuda:
        torch.cuda.memory._dump_snapshot(record)
        torch.cuda.memory._record_memory_history(enabled=None)
        row["snapshot"] = _shrink(record, spec.get("max_file_mib", 15))
    model.gemini_manager.close()
    return row


def _shrink(path: str, max_mib: float) -> str:
    """The snapshot file, gzipped when it is over `max_mib` (what comes back from the device has a size limit)."""
    if os.path.getsize(path) <= max_mib * 2**20:
        return path
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
    return path + ".gz"


def _gemini_snapshot(spec: dict) -> None:
    emit({"job": "gemini_snapshot", **_gemini_run(spec, {}, record=spec["path"])})


def _gemini_tier(spec: dict) -> None:
    device = torch_device(spec["device"])
    note = emulate_card(spec.get("cap_gib"), device)
    extra = {"offload_tier": "cpu", "offload_param_frac": 1.0, "offload_optim_frac": 1.0}
    row = _gemini_run(spec, extra)
    row.update(states_gib=16 * row["params"] / 2**30, samples_per_s=spec["batch"] / row["step_s"],
               cap_gib=spec.get("cap_gib"), note=note)
    emit({"job": "gemini_tier", **row})


# ---- the suite command line on an emulated card -------------------------------------------------------------


def _suite(spec: dict) -> int:
    from ..cli import main as suite_main

    device = torch_device(spec["device"])
    note = emulate_card(spec.get("cap_gib"), device)
    if note:
        print(f"gpu_workers: {note}", file=sys.stderr, flush=True)
    argv = list(spec["argv"])
    if spec.get("auto_budget") and device.type == "cuda":
        from ...fastfold.model.options import device_budget_bytes

        budget_mb = max(1, device_budget_bytes(device) // 2**20)
        emit({"memory_budget_mb": budget_mb})
        argv += ["--memory_budget_mb", str(budget_mb)]
    return suite_main(argv)


JOBS: dict[str, Callable[[dict], Any]] = {"parity": _parity, "sd": _sd, "gemini_snapshot": _gemini_snapshot,
                                          "gemini_tier": _gemini_tier, "suite": _suite}


def main(argv: list[str] | None = None) -> int:
    """Run the job of the JSON spec; a JSON list runs its jobs one after another in this process, each after a
    line `{"job_index": i}` (a smoke run's way to start one interpreter instead of several)."""
    spec = json.loads((argv or sys.argv[1:])[0])
    if isinstance(spec, dict):
        return int(JOBS[spec["job"]](spec) or 0)
    for i, one in enumerate(spec):
        emit({"job_index": i})
        code = int(JOBS[one["job"]](one) or 0)
        if code:
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
