"""`suite bench diffusion`: a plain diffusers-style training loop against ours on the same UNet, batch, resolution
(docs/diffusion.md, "Benchmark"), as in-process ranks or (`--whole_command`, `--frontier`: `frontier`) whole commands:
this module's `write_pipeline` and `plain_loop` tools (`main`) against `suite diffusion finetune`."""

from __future__ import annotations

import argparse
import gc
import inspect
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...utils.memory_meter import SideMeter, fixed_mmap_threshold, hwm_bytes, reset_peak_rss, rss_bytes
from ..errors import UsageError
from .frontier import add_frontier_arguments, run_frontier, run_whole
from .harness import DDP_OPTIONS, add_ratios, fast_optimizer, log_step, optimizer_impl, publish, time_fn, torch_device

__all__ = ["add_arguments", "add_shape_arguments", "encoder_models", "main", "make_step", "noise_loss",
           "plain_loop", "plain_step", "run", "setup_variant", "tool_main", "unet_model", "write_pipeline"]

_MODULE = __spec__.name if __spec__ is not None else __name__


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that size the models and the run."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the models train")
    add_shape_arguments(parser)
    parser.add_argument("--batch", type=int, default=2, help="images per rank per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--world", type=int, default=1, help="processes (plain: DDP; ours: Gemini shards)")
    parser.add_argument("--gemini_offload", choices=["none", "cpu", "nvme"], default=None,
                        help="where Gemini keeps master weights and Adam states (default: nvme on cpu, cpu on cuda)")
    parser.add_argument("--chunk_mb", type=float, default=4.0, help="Gemini chunk size in MiB (0: Gemini picks)")
    parser.add_argument("--mixed_precision", choices=["no", "bf16"], default="no",
                        help="bf16: both sides' UNet under bf16 autocast, ours' Gemini computing in bf16")
    parser.add_argument("--checkpointing", choices=["keep_attention", "full"], default="keep_attention",
                        help="ours: recompute all but the attention outputs, or everything")
    parser.add_argument("--prefetch", type=int, default=1, help="Gemini: chunks all-gathered ahead of use")
    parser.add_argument("--keep_gathered", type=int, default=None,
                        help="Gemini: keep a chunk gathered while among the next N of the traced order")
    parser.add_argument("--checkpoint_levels", type=int, default=None,
                        help="ours: checkpoint only the blocks of this many highest resolutions (default: all)")
    parser.add_argument("--no_gemini", action="store_true", help="ours without Gemini (attention + checkpointing)")
    parser.add_argument("--attention_backend", choices=["auto", "triton", "torch"], default="auto")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant before it is killed")
    parser.add_argument("--whole_command", action="store_true",
                        help="compare whole commands instead, start to exit, on a pipeline folder of these shapes: "
                             "the plain diffusers loop against `suite diffusion finetune` (docs/benchmarks.md)")
    parser.add_argument("--tiers", default="nvme",
                        help="--whole_command: ours' runs, one per Gemini tier of the master weights and optimizer "
                             "state (nvme, cpu; comma-separated), chunks of --chunk_mb")
    parser.add_argument("--cap_mib", type=float, default=None,
                        help="--whole_command: run ours on the nvme tier under this memory cgroup limit (page cache "
                             "included; the kernel reclaims, then kills): the published cap")
    add_frontier_arguments(parser)


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that shape the UNet and the frozen encoders."""
    parser.add_argument("--channels", default="64,128,256", help="UNet block channels (SD 1.5: 320,640,1280,1280)")
    parser.add_argument("--layers_per_block", type=int, default=1, help="ResNet layers per block (SD 1.5: 2)")
    parser.add_argument("--cross_attention_dim", type=int, default=256, help="text state width (SD 1.5: 768)")
    parser.add_argument("--attention_head_dim", type=int, default=8, help="heads per attention (SD 1.5: 8)")
    parser.add_argument("--encoders", choices=["small", "sd", "none"], default="small",
                        help="frozen VAE and text encoder: small (scaled down), sd (SD 1.5 shapes) or none")
    parser.add_argument("--resolution", type=int, default=256, help="image side in pixels (latents: /8)")


# ---- models and in-process sides ------------------------------------------------------------------------


def unet_model(opts: dict):
    """The benchmark's UNet (random weights) of `opts`' channels, layers per block and widths."""
    from diffusers import UNet2DConditionModel

    channels = tuple(int(c) for c in opts["channels"].split(","))
    n = len(channels)
    return UNet2DConditionModel(
        sample_size=opts["resolution"] // 8, block_out_channels=channels, layers_per_block=opts["layers_per_block"],
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        cross_attention_dim=opts["cross_attention_dim"], attention_head_dim=opts["attention_head_dim"],
    )


def encoder_models(opts: dict):
    """(vae, text_encoder) of random weights in SD 1.5's shapes (`sd`) or scaled down (`small`), or (None, None)."""
    if opts["encoders"] == "none":
        return None, None
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel

    sd = opts["encoders"] == "sd"
    channels = (128, 256, 512, 512) if sd else (32, 64, 128, 128)
    vae = AutoencoderKL(block_out_channels=channels, layers_per_block=2 if sd else 1,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        latent_channels=4, sample_size=opts["resolution"])
    width = opts["cross_attention_dim"]
    text = CLIPTextModel(CLIPTextConfig(
        vocab_size=49408 if sd else 4096, hidden_size=width, intermediate_size=4 * width,
        num_attention_heads=12 if sd else 4, num_hidden_layers=12 if sd else 2, max_position_embeddings=77,
        projection_dim=width, hidden_act="quick_gelu", bos_token_id=0, eos_token_id=2, pad_token_id=1))
    return vae, text


def setup_variant(variant: str, opts: dict, rank: int, world: int, device):
    """(unet, optimizer, gemini optimizer or None, vae, text encoder, offload folder or None) of a variant."""
    import torch

    torch.manual_seed(0)
    model = unet_model(opts)
    vae, text = encoder_models(opts)
    frozen_dtype = torch.float32 if variant == "plain" else torch.bfloat16
    for m in (vae, text):
        if m is not None:
            m.requires_grad_(False).eval().to(device, frozen_dtype)
    model.to(device)
    if variant == "plain":
        from diffusers.models.attention_processor import AttnProcessor2_0

        model.set_attn_processor(AttnProcessor2_0())
        optimizer, _ = fast_optimizer(torch.optim.AdamW, model.parameters(), lr=1e-5)
        if world > 1:
            ids = [device.index] if device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, **DDP_OPTIONS)
        return model, optimizer, None, vae, text, None
    from ...diffusion.attention import set_kernels_attention
    from ...diffusion.memory import enable_checkpointing, order_modules_by_use

    set_kernels_attention(model, opts["attention_backend"])
    enable_checkpointing(model, opts["checkpointing"], opts.get("checkpoint_levels"))
    order_modules_by_use(model)
    optimizer, _ = fast_optimizer(torch.optim.AdamW, model.parameters(), lr=1e-5)
    if opts["no_gemini"]:
        return model, optimizer, None, vae, text, None
    from ... import core_parallel

    offload = opts["gemini_offload"]
    folder = tempfile.mkdtemp(prefix="bench-gemini-") if offload == "nvme" else None
    frac = 0.0 if offload == "none" else 1.0
    config = core_parallel.GeminiConfig(offload_param_frac=frac, offload_optim_frac=frac, offload_dir=folder,
                                        offload_tier="nvme" if offload == "nvme" else "cpu",
                                        chunk_mb=opts["chunk_mb"] or None, prefetch=opts.get("prefetch", 1),
                                        precision="bf16" if opts.get("mixed_precision") == "bf16" else "fp32",
                                        keep_gathered=opts.get("keep_gathered"))
    model, optimizer = core_parallel.setup(model, optimizer, config)
    return model, optimizer, optimizer, vae, text, folder


def make_step(parts, opts: dict, rank: int, device):
    """The training step of a variant: encode (no grad), noise, predict, loss, backward, update."""
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler

    model, optimizer, core, vae, text_encoder, _ = parts
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                              beta_end=0.012)
    side, b = opts["resolution"] // 8, opts["batch"]
    g = torch.Generator().manual_seed(rank)
    pixels = torch.rand(b, 3, opts["resolution"], opts["resolution"], generator=g).mul_(2).sub_(1).to(device)
    ids = torch.randint(0, 4096, (b, 77), generator=g).to(device)
    fixed_latents = torch.randn(b, 4, side, side, generator=g).to(device)
    fixed_text = torch.randn(b, 77, opts["cross_attention_dim"], generator=g).to(device)
    timesteps = torch.randint(0, 1000, (b,), generator=g).to(device)
    backward = torch.Tensor.backward if core is None else core.backward  # Gemini's: loss scaling, reductions

    def step() -> None:
        with torch.no_grad():
            if vae is None:
                latents, states = fixed_latents, fixed_text
            else:
                latents = vae.encode(pixels.to(vae.dtype)).latent_dist.sample().float() * vae.config.scaling_factor
                states = text_encoder(ids, return_dict=False)[0].float()
        noise = torch.randn_like(latents)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=opts.get("mixed_precision") == "bf16"):
            pred = model(scheduler.add_noise(latents, noise, timesteps), timesteps, states).sample
        backward(F.mse_loss(pred.float(), noise))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# ---- measurement -------------------------------------------------------------------------------------------


def _taking_turns(step, turns, plain: bool, warmup: int, repeat: int) -> list[float]:
    """Seconds of each of `repeat` steps after `warmup`, taking turns with the other variant's processes at the
    barrier `turns`: plain steps first in even rounds, ours in odd ones."""
    times = []
    try:
        for i in range(warmup + repeat):
            first = plain == (i % 2 == 0)
            turns.wait()
            if not first:
                turns.wait()
            t0 = time.perf_counter()
            step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            if first:
                turns.wait()
        turns.wait()  # the last step ends before the other variant's processes wind down
    except BaseException:
        turns.abort()  # the other variant's processes stop waiting
        raise
    return times


def _variant(rank: int, world: int, variant: str, opts: dict, mode: str, turns=None) -> dict:
    """One variant on this rank. mode `memory`: peak training memory; `time`: step seconds (each, taking turns,
    with `turns`); `both`."""
    import torch
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # the "modules that should be kept in float32" note on .to(bf16)
    device = torch_device(opts["device"], rank)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    small = {**opts, "channels": "32,64", "layers_per_block": 1, "resolution": 32, "batch": 1,
             "encoders": "none" if opts["encoders"] == "none" else "small"}
    parts = setup_variant(variant, small, rank, world, device)
    make_step(parts, small, rank, device)()
    _cleanup(parts)
    del parts
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device) if cuda else rss_bytes()
    meter = SideMeter().start() if mode != "time" else None
    parts = setup_variant(variant, opts, rank, world, device)
    if meter is not None and parts[-1]:
        meter.offload_paths.append(parts[-1])
    out: dict = {}
    try:
        step = make_step(parts, opts, rank, device)
        gc.collect()
        out["state_mib"] = ((torch.cuda.memory_allocated(device) if cuda else rss_bytes()) - base) / 2**20
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        else:
            out["peak_reset"] = reset_peak_rss()
        if mode == "memory":
            for _ in range(max(1, opts["warmup"]) + 1):
                step()
        elif turns is not None:
            out["step_times"] = _taking_turns(step, turns, variant == "plain", opts["warmup"], opts["steps"])
        else:
            out["step_s"] = time_fn(step, warmup=opts["warmup"], repeat=opts["steps"], sync=sync)
        if mode != "time":
            peak = torch.cuda.max_memory_allocated(device) if cuda else hwm_bytes()
            out.update(train_mib=(peak - base) / 2**20, peak_mib=peak / 2**20, charged_mib=meter.peak() / 2**20,
                       memory_method=meter.method)
        if parts[2] is not None:
            out["nvme_mib"] = sum(parts[0].memory_report()["bytes"]["nvme"].values()) / 2**20
    finally:
        if meter is not None:
            meter.close()
        _cleanup(parts)
    return out


def _cleanup(parts) -> None:
    if parts[-1]:
        shutil.rmtree(parts[-1], ignore_errors=True)


def _ranks(variant: str, opts: dict, mode: str, turns=None) -> list[dict]:
    from ...core_parallel import run_on_ranks

    return run_on_ranks(_variant, opts["world"], variant, opts, mode, turns, timeout=opts["timeout"],
                        backend="nccl" if opts["device"] == "cuda" and opts["world"] > 1 else "gloo")


def _whole_side(variant: str, opts: dict, mode: str) -> tuple[list[dict], float | None]:
    """(per-rank results, their memory cgroup's peak MiB or None): this process in it while the ranks run."""
    meter = SideMeter()
    if meter.group is None:
        return _ranks(variant, opts, mode), None
    try:
        meter.start()
        return _ranks(variant, opts, mode), meter.peak() / 2**20  # the ranks first, then the group's peak
    finally:
        meter.close()


def _measure_all(opts: dict) -> tuple[dict, dict, list[float]]:
    """(plain row, ours row, per-step time ratios). CUDA: one run of each measures both. CPU: a memory pass
    each, then both at once taking turns."""
    import multiprocessing as mp

    whole: dict = {}
    if opts["device"] == "cuda":
        per = {v: _ranks(v, opts, "both") for v in ("plain", "ours")}
        timed = {v: [max(r["step_s"] for r in per[v])] for v in per}
    else:
        per = {}
        import diffusers  # noqa: F401  (their files in the page cache before either side: neither pays for it)
        import transformers  # noqa: F401

        with fixed_mmap_threshold():
            for v in ("plain", "ours"):
                per[v], whole[v] = _whole_side(v, opts, "memory")
        turns = mp.get_context("spawn").Barrier(2 * opts["world"], timeout=opts["timeout"])
        with ThreadPoolExecutor(2) as pool:
            futures = {v: pool.submit(_ranks, v, opts, "time", turns) for v in ("plain", "ours")}
            runs = {v: f.result() for v, f in futures.items()}
        timed = {v: [max(steps) for steps in zip(*(r["step_times"] for r in runs[v]))] for v in runs}
    ratios = [o / p for p, o in zip(timed["plain"], timed["ours"])]
    rows = {v: _row(per[v], statistics.median(timed[v]), whole.get(v), opts) for v in per}
    rows["ours"]["time_ratio"] = statistics.median(ratios)
    for v in rows:
        rows[v]["step_times"] = timed[v]
    return rows["plain"], rows["ours"], ratios


def _row(per_rank: list[dict], step_s: float, whole_mib: float | None, opts: dict) -> dict:
    """Worst rank's memory; `step_s`: the slowest rank's step time; `whole_mib`: the side's cgroup peak, if any."""
    worst = max(per_rank, key=lambda r: r["train_mib"])
    row = {"world": opts["world"], "step_s": step_s, **{k: worst[k] for k in ("train_mib", "state_mib", "peak_mib")},
           "charged_mib": max(r["charged_mib"] for r in per_rank), "memory_method": worst["memory_method"],
           **({"nvme_mib": worst["nvme_mib"]} if "nvme_mib" in worst else {})}
    if worst.get("peak_reset") is False:
        row["note"] = "peak RSS since process start (clear_refs unavailable)"
    return row if whole_mib is None else {**row, "whole_mib": whole_mib}


def _defaults(args: argparse.Namespace) -> dict:
    if args.resolution % 8 or args.resolution < 16:
        raise UsageError(f"--resolution must be a multiple of 8 and >= 16, got {args.resolution}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available")
        if args.world > torch.cuda.device_count():
            raise UsageError(f"--world {args.world}: only {torch.cuda.device_count()} CUDA device(s)")
    skip = ("json", "markdown", "plot", "bench", "command")
    opts = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in skip}
    if opts["gemini_offload"] is None:
        opts["gemini_offload"] = "nvme" if args.device == "cpu" else "cpu"
    return opts


# ---- whole commands ----------------------------------------------------------------------------------------


def noise_loss(unet, scheduler, latents, hidden, **unet_kwargs):
    """The scripts' loss under bf16 autocast: noise and timesteps drawn, the UNet's prediction, MSE on the noise."""
    import torch
    import torch.nn.functional as F

    with torch.autocast("cpu", dtype=torch.bfloat16):
        noise = torch.randn_like(latents)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],))
        pred = unet(scheduler.add_noise(latents, noise, t), t, hidden, **unet_kwargs).sample
        return F.mse_loss(pred.float(), noise.float())


def plain_step(step: int, steps: int, optimizer, loss_of) -> None:
    """One timed step of a plain loop: `loss_of()`, backward, gradients clipped to norm 1.0 (the scripts'
    `--max_grad_norm` default), the optimizer's step, then its `harness.log_step` line."""
    import torch

    t0 = time.perf_counter()
    loss = loss_of()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    log_step(step, steps, time.perf_counter() - t0, float(loss.detach()))


def write_pipeline(folder: str, opts: dict) -> None:
    """A diffusers pipeline folder (UNet of `opts`' shapes, the `--encoders` VAE and text encoder with the tiny
    byte-level tokenizer, SD's PNDM scheduler), random weights from seed 0, safetensors."""
    import torch
    from diffusers import PNDMScheduler, StableDiffusionPipeline

    from ...diffusion.tiny import build_tokenizer

    torch.manual_seed(0)
    unet = unet_model(opts)
    vae, text = encoder_models({**opts, "encoders": "small" if opts["encoders"] == "none" else opts["encoders"]})
    scheduler = PNDMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                              beta_schedule="scaled_linear", skip_prk_steps=True, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=build_tokenizer(77), unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.save_pretrained(folder, safe_serialization=True)


def plain_loop(base: str, out: str, *, steps: int = 3, batch: int = 2, resolution: int = 256) -> None:
    """`train_text_to_image.py --mixed_precision bf16 --gradient_checkpointing` reduced to its loop: the fp32 UNet
    and bf16 frozen VAE and text encoder loaded with `from_pretrained`, diffusers' default (SDPA) attention, fused
    AdamW, bf16 autocast, `steps` steps on random images, then the pipeline saved with the trained UNet as the
    script saves it."""
    import torch
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    scheduler = DDPMScheduler.from_pretrained(base, subfolder="scheduler")
    tokenizer = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer")
    text = CLIPTextModel.from_pretrained(base, subfolder="text_encoder")
    vae = AutoencoderKL.from_pretrained(base, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet")
    for m in (vae, text):  # as the script does: loaded in fp32, then cast
        m.requires_grad_(False).to(torch.bfloat16)
    unet.enable_gradient_checkpointing()
    unet.train()
    optimizer, _ = fast_optimizer(torch.optim.AdamW, unet.parameters(), lr=1e-5)
    ids = tokenizer(["a photo"] * batch, padding="max_length", max_length=tokenizer.model_max_length,
                    truncation=True, return_tensors="pt").input_ids

    def loss_of() -> torch.Tensor:
        pixels = torch.rand(batch, 3, resolution, resolution) * 2 - 1
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            latents = vae.encode(pixels.to(torch.bfloat16)).latent_dist.sample() * vae.config.scaling_factor
            states = text(ids, return_dict=False)[0]
        return noise_loss(unet, scheduler, latents, states)

    for step in range(steps):
        plain_step(step, steps, optimizer, loss_of)
    pipe = StableDiffusionPipeline.from_pretrained(base, text_encoder=text, vae=vae, unet=unet)
    pipe.save_pretrained(out)


def tool_main(tools: dict[str, Callable[..., Any]], argv: Sequence[str] | None = None) -> int:
    """The SD benches' whole-process tools (`main` here and in `diffusion_sdxl`): `python -m MODULE NAME ARG...
    [--key value ...]` is `tools[NAME](*ARGS, key=value, ...)`, each value of its default's type."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in tools:
        raise SystemExit(f"usage: python -m MODULE {{{','.join(tools)}}} ARG... [--key value ...]")
    fn, positional, keywords = tools[args.pop(0)], [], {}
    defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()}
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            positional.append(arg)
            continue
        key, value = arg[2:], args.pop(0)
        default = defaults[key]
        keywords[key] = value.lower() in ("1", "true", "yes") if isinstance(default, bool) else value if default in (
            None, inspect.Parameter.empty) else type(default)(value)
    fn(*positional, **keywords)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m lowmem.suite.bench.diffusion write_pipeline DIR [--channels ...] | plain_loop BASE OUT [...]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["write_pipeline"]:
        return tool_main({"plain_loop": plain_loop}, argv)
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE} write_pipeline")
    parser.add_argument("folder")
    add_shape_arguments(parser)
    args = parser.parse_args(argv[1:])
    write_pipeline(args.folder, vars(args))
    return 0


def run(args: argparse.Namespace) -> int:
    import torch

    opts = _defaults(args)
    if opts.get("frontier"):
        return run_frontier(opts, args)
    if opts.get("whole_command"):
        return run_whole(opts, args)
    levels = "" if opts["checkpoint_levels"] is None else f" top {opts['checkpoint_levels']} levels"
    impl = optimizer_impl(torch.optim.AdamW)
    bf16 = ", UNet under bf16 autocast" if opts["mixed_precision"] == "bf16" else ""
    ours = (f"ours (kernels attention + checkpointing/{opts['checkpointing']}{levels} + bf16 encoders"
            + (f", AdamW {impl}" if opts["no_gemini"] else f" + gemini/{opts['gemini_offload']}") + f"{bf16})")
    plain = (f"plain diffusers loop (fp32, SDPA attention, AdamW {impl}"
             + (", DDP(gradient_as_bucket_view=True)" if opts["world"] > 1 else "") + f"{bf16})")
    plain_row, ours_row, ratios = _measure_all(opts)
    rows = [{"variant": plain, **plain_row}, {"variant": ours, **ours_row}]
    whole = {"whole_ratio": "whole_mib"} if "whole_mib" in rows[0] and "whole_mib" in rows[1] else {}
    add_ratios(rows[1:], rows[0], {"rss_ratio": "train_mib", "mem_ratio": "charged_mib", **whole})
    counts = {k: sum(p.numel() for p in m.parameters()) for k, m in
              (("unet", unet_model(opts)), *zip(("vae", "text_encoder"), encoder_models(opts))) if m is not None}
    sizes = ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in counts.items())
    title = (f"{opts['device']}: UNet {opts['channels']} x{opts['layers_per_block']}, {sizes} params, "
             f"{opts['resolution']}px, batch {opts['batch']}/rank, world {opts['world']}, torch {torch.__version__}")
    columns = ["variant", "step_s", "charged_mib", "mem_ratio", "whole_mib", "whole_ratio", "time_ratio",
               "train_mib", "rss_ratio", "state_mib", "peak_mib", "nvme_mib"]
    measure = "max_memory_allocated" if opts["device"] == "cuda" else "peak RSS (VmHWM, fixed mmap threshold)"
    notes = [f"charged_mib: {rows[0]['memory_method']}, from before the models were built (worst rank, page cache "
             "included); whole_mib: each side's processes start to exit in one cgroup; "
             f"train_mib: {measure} over the steps minus the same before the models were built (worst rank); "
             "state_mib: held after setup (RSS); targets: mem_ratio <= 0.33, time_ratio <= 1.2"]
    if len(ratios) > 1:
        notes.append("time_ratio per step (plain and ours taking turns): " + ", ".join(f"{r:.3f}" for r in ratios))
    publish(args, {"benchmark": "diffusion", "config": opts, "params": counts, "rows": rows,
                   "step_time_ratios": ratios}, [(title, rows, columns)], notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
