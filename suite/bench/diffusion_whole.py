"""`suite bench diffusion --whole_command`, and the two commands it compares as a user runs them.

`python -m lowmem.suite.bench.diffusion write_pipeline DIR [--channels 160,320,640,640 ...]` writes a pipeline
folder of random weights of the benchmark's shapes; `python -m lowmem.suite.bench.diffusion plain_loop BASE OUT`
is the plain diffusers loop a user runs, as a whole process (what `suite diffusion finetune` is compared with):

    suite bench command --baseline "python -m lowmem.suite.bench.diffusion plain_loop BASE OUT1" -- \\
        suite diffusion finetune --pretrained_model_name_or_path BASE --strategy gemini_nvme ...

`--whole_command` runs each of the two in its own memory cgroup, start to exit (`suite.bench.memory.run_command`).
"""

from __future__ import annotations

import argparse
import os

from .diffusion import _MODULE, _encoders, _unet, add_arguments

__all__ = ["add_whole_arguments", "csv_metric", "csv_step_seconds", "main", "noise_loss", "plain_loop", "plain_step",
           "run_whole", "step_seconds", "whole_commands", "write_pipeline"]


def _drop_cached(folder: str) -> None:
    """Drop `folder`'s files from the page cache, so the next side reads (and is charged for) them itself."""
    from ...utils.fileio import drop_page_cache

    for top, _, names in os.walk(folder):
        for name in names:
            drop_page_cache(os.path.join(top, name), write_back=True)


def add_whole_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `--whole_command` only."""
    parser.add_argument("--tiers", default="nvme",
                        help="--whole_command: ours' runs, one per Gemini tier of the master weights and optimizer "
                             "state (nvme, cpu; comma-separated), chunks of --chunk_mb")
    parser.add_argument("--cap_mib", type=float, default=None,
                        help="--whole_command: run ours on the nvme tier under this memory cgroup limit (page cache "
                             "included; the kernel reclaims, then kills): the published cap")


def _ours_config(path: str, tier: str, nvme: str, chunk_mb: float) -> str:
    """A recipe YAML naming ours' Gemini config (what a user writes to set the chunk size)."""
    where = f", offload_dir: {nvme}" if tier == "nvme" else ""
    size = f", chunk_mb: {chunk_mb}" if chunk_mb > 0 else ""  # 0: Gemini searches it, as --strategy gemini_* does
    with open(path, "w") as f:
        f.write(f"launch:\n  parallel:\n    gemini: {{offload_tier: {tier}{where}, offload_param_frac: 1.0, "
                f"offload_optim_frac: 1.0{size}}}\n")
    return path


def step_seconds(log: str) -> list[float]:
    """Seconds of each optimizer step the plain loop's log reports (its `plain step k/N s X` lines), in order; ours'
    come from the run's CSV metrics (`csv_step_seconds`)."""
    import re

    with open(log, errors="replace") as f:
        return [float(m.group(1)) for line in f if (m := re.match(r"plain step \d+/\d+ s ([0-9.]+)", line))]


def csv_metric(folder: str, column: str) -> list[float]:
    """The values of `column` in `suite diffusion`'s CSV log in `folder` (`logs/csv/metrics.csv`), in order, rows
    without it skipped; [] without the file."""
    import csv

    path = os.path.join(folder, "logs", "csv", "metrics.csv")
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [float(r[column]) for r in csv.DictReader(f) if r.get(column)]


def csv_step_seconds(folder: str, batch: int) -> list[float]:
    """Seconds of each optimizer step from `suite diffusion`'s CSV log in `folder`: the `images_per_s` logged at
    step k is the batch over step k-1's duration; [] without the file."""
    return [batch / r for r in csv_metric(folder, "images_per_s") if r > 0]


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
    """One step of a plain loop: `loss_of()`, backward, the optimizer's step, and the `plain step k/N s X loss L`
    line `step_seconds` reads (the time covers all of it)."""
    import time

    t0 = time.perf_counter()
    loss = loss_of()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0
    print(f"plain step {step + 1}/{steps} s {seconds:.3f} loss {float(loss.detach()):.4f}", flush=True)


def whole_commands(opts: dict, work: str) -> list[dict]:
    """The plain loop and `suite diffusion finetune` (Gemini on each of `--tiers`), each as a whole process tree in
    its own memory cgroup (`suite.bench.memory.run_command`; ours under `--cap_mib` when given), on a pipeline
    folder of `opts`' shapes written in `work`. Every input file is dropped from the page cache before each side,
    so each reads (and is charged for) its own. Step time: the median of the steps after the first."""
    import statistics
    import subprocess
    import sys

    from ...diffusion.sample_data import write_sample_data
    from .memory import run_command

    base, data = os.path.join(work, "base"), os.path.join(work, "data")
    write_pipeline(base, opts)
    write_sample_data(data)
    py, steps, batch, res = sys.executable, str(opts["steps"]), str(opts["batch"]), str(opts["resolution"])
    sides = {"plain": [py, "-m", _MODULE, "plain_loop", base, os.path.join(work, "out-plain"),
                       "--steps", steps, "--batch", batch, "--resolution", res]}
    for tier in opts.get("tiers", "nvme").split(","):
        config = _ours_config(os.path.join(work, f"gemini-{tier}.yaml"), tier, os.path.join(work, "nvme"),
                              opts["chunk_mb"])
        sides[f"ours (gemini, {tier} tier)"] = [
            py, "-m", _MODULE.rsplit(".bench.", 1)[0], "diffusion", "finetune", "--config", config,
            "--pretrained_model_name_or_path", base, "--train_data_dir", data, "--resolution", res,
            "--train_batch_size", batch, "--max_train_steps", steps, "--mixed_precision", "bf16",
            "--gradient_checkpointing", "--log_every_n_steps", "1", "--output_dir", os.path.join(work, f"out-{tier}")]
    cap = int(opts["cap_mib"] * 2**20) if opts.get("cap_mib") else None
    rows = []
    for side, argv in sides.items():
        _drop_cached(work)
        # cwd: the work folder, so `-m` puts no checkout on sys.path (its `kernels/` would shadow Hugging Face's)
        log = os.path.join(work, f"{side.split()[0]}-{len(rows)}.log")
        with open(log, "w") as f:
            out = run_command(argv, offload_paths=[os.path.join(work, "nvme")], timeout=opts["timeout"], cwd=work,
                              stdout=f, stderr=subprocess.STDOUT, cap_bytes=cap if "nvme" in side else None)
        if out["returncode"] != 0 and not out.get("oom_kills"):
            with open(log, errors="replace") as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"{side}: {' '.join(argv)} exited with {out['returncode']}:\n{tail}")
        times = step_seconds(log) if side == "plain" else \
            csv_step_seconds(os.path.join(work, f"out-{side.split()[-2]}"), opts["batch"])
        steady = times[1:]  # both sides' first figure is step 1's (warm-up): skipped
        rows.append({"variant": side, "returncode": out["returncode"], "peak_mib": out["peak_bytes"] / 2**20,
                     "cap_mib": (cap / 2**20) if cap and "nvme" in side else None,
                     "oom_killed": bool(out.get("oom_kills")), "wall_s": out["wall_s"],
                     "step_s": statistics.median(steady) if steady else None, "step_times_s": times,
                     "method": out["method"], "command": " ".join(argv)})
    plain = rows[0]
    for r in rows[1:]:
        r["peak_ratio"] = r["peak_mib"] / plain["peak_mib"]
        r["wall_ratio"] = r["wall_s"] / plain["wall_s"]
        r["step_ratio"] = r["step_s"] / plain["step_s"] if r["step_s"] and plain["step_s"] else None
    return rows


def run_whole(opts: dict, args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    import torch

    from .common import print_table, write_json

    work = tempfile.mkdtemp(prefix="bench-diffusion-whole-")
    try:
        rows = whole_commands(opts, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    title = (f"whole commands: UNet {opts['channels']} x{opts['layers_per_block']}, encoders {opts['encoders']}, "
             f"{opts['resolution']}px, batch {opts['batch']}, {opts['steps']} steps, ours' chunks "
             f"{opts['chunk_mb']} MiB, torch {torch.__version__}")
    print_table(rows, ["variant", "peak_mib", "cap_mib", "peak_ratio", "oom_killed", "wall_s", "wall_ratio",
                       "step_s", "step_ratio", "method"], title=title)
    for r in rows:
        print(f"{r['variant']}: {r['command']}")
    print("peak_mib: the process tree from start to exit (page cache included with a cgroup); step_s: median of "
          "the steps after the first; cap_mib: ours ran under that cgroup limit")
    write_json(args.json, {"benchmark": "diffusion-whole-command", "config": opts, "rows": rows})
    return 1 if any(r["returncode"] for r in rows) else 0


def write_pipeline(folder: str, opts: dict) -> None:
    """A diffusers pipeline folder (UNet of `opts`' shapes, the `--encoders` VAE and text encoder with the tiny
    byte-level tokenizer, SD's PNDM scheduler), random weights from seed 0, safetensors."""
    import torch
    from diffusers import PNDMScheduler, StableDiffusionPipeline

    from ...diffusion.tiny import build_tokenizer

    torch.manual_seed(0)
    unet = _unet(opts)
    vae, text = _encoders({**opts, "encoders": "small" if opts["encoders"] == "none" else opts["encoders"]})
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

    from .common import fast_optimizer

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


def main(argv: list[str] | None = None) -> int:
    """`python -m lowmem.suite.bench.diffusion write_pipeline | plain_loop ...`."""
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}")
    sub = parser.add_subparsers(dest="what", required=True)
    w = sub.add_parser("write_pipeline", help="a pipeline folder of the benchmark's shapes, random weights")
    w.add_argument("folder")
    add_arguments(w)
    p = sub.add_parser("plain_loop", help="the plain diffusers loop as a whole process")
    p.add_argument("base")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--resolution", type=int, default=256)
    args = parser.parse_args(argv)
    if args.what == "write_pipeline":
        write_pipeline(args.folder, vars(args))
    else:
        plain_loop(args.base, args.out, steps=args.steps, batch=args.batch, resolution=args.resolution)
    return 0
