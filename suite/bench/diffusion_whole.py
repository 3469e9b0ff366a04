"""`suite bench diffusion --whole_command`, and the two commands it compares as a user runs them:
`python -m lowmem.suite.bench.diffusion write_pipeline DIR` and `... plain_loop BASE OUT`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from .harness import Side, fast_optimizer, log_step, publish, tool_main, whole_rows

__all__ = ["MODULE", "add_shape_arguments", "add_whole_arguments", "encoder_models", "main", "noise_loss",
           "plain_loop", "plain_step", "run_whole", "unet_model", "whole_commands", "write_pipeline"]

MODULE = f"{__package__}.diffusion"
"""The import name of `suite bench diffusion`, whose `python -m` runs this module's tools (`main`)."""


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that shape the UNet and the frozen encoders."""
    parser.add_argument("--channels", default="64,128,256", help="UNet block channels (SD 1.5: 320,640,1280,1280)")
    parser.add_argument("--layers_per_block", type=int, default=1, help="ResNet layers per block (SD 1.5: 2)")
    parser.add_argument("--cross_attention_dim", type=int, default=256, help="text state width (SD 1.5: 768)")
    parser.add_argument("--attention_head_dim", type=int, default=8, help="heads per attention (SD 1.5: 8)")
    parser.add_argument("--encoders", choices=["small", "sd", "none"], default="small",
                        help="frozen VAE and text encoder: small (scaled down), sd (SD 1.5 shapes) or none")
    parser.add_argument("--resolution", type=int, default=256, help="image side in pixels (latents: /8)")


def add_whole_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `--whole_command` only."""
    parser.add_argument("--tiers", default="nvme",
                        help="--whole_command: ours' runs, one per Gemini tier of the master weights and optimizer "
                             "state (nvme, cpu; comma-separated), chunks of --chunk_mb")
    parser.add_argument("--cap_mib", type=float, default=None,
                        help="--whole_command: run ours on the nvme tier under this memory cgroup limit (page cache "
                             "included; the kernel reclaims, then kills): the published cap")


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
    """(vae, text_encoder) with random weights, or (None, None). `sd`: SD 1.5's shapes; `small`: 8x VAE with
    (32, 64, 128, 128) channels and a 2-layer CLIP of the cross-attention width with a 4096-token vocabulary."""
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


def _ours_config(path: str, tier: str, nvme: str, chunk_mb: float) -> str:
    """A recipe YAML naming ours' Gemini config (what a user writes to set the chunk size)."""
    where = f", offload_dir: {nvme}" if tier == "nvme" else ""
    size = f", chunk_mb: {chunk_mb}" if chunk_mb > 0 else ""  # 0: Gemini searches it, as --strategy gemini_* does
    with open(path, "w") as f:
        f.write(f"launch:\n  parallel:\n    gemini: {{offload_tier: {tier}{where}, offload_param_frac: 1.0, "
                f"offload_optim_frac: 1.0{size}}}\n")
    return path


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
    """One step of a plain loop: `loss_of()`, backward, the optimizer's step, and the `harness.log_step` line its
    per-step time is read back from (the time covers all of it)."""
    t0 = time.perf_counter()
    loss = loss_of()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    log_step(step, steps, time.perf_counter() - t0, float(loss.detach()))


def whole_commands(opts: dict, work: str) -> list[dict]:
    """The plain loop and `suite diffusion finetune` (Gemini on each of `--tiers`; the nvme one under `--cap_mib`)
    side by side (`whole_rows`) on a pipeline folder of `opts`' shapes written in `work`."""
    from ...diffusion.sample_data import write_sample_data

    base, data = os.path.join(work, "base"), os.path.join(work, "data")
    write_pipeline(base, opts)
    write_sample_data(data)
    py, steps, batch, res = sys.executable, str(opts["steps"]), str(opts["batch"]), str(opts["resolution"])
    cap = int(opts["cap_mib"] * 2**20) if opts.get("cap_mib") else None
    # cwd: the work folder, so `-m` puts no checkout on sys.path (its `kernels/` would shadow Hugging Face's)
    held = {"timeout": opts["timeout"], "cwd": work, "offload_paths": [os.path.join(work, "nvme")]}
    sides = [Side("plain", [py, "-m", MODULE, "plain_loop", base, os.path.join(work, "out-plain"), "--steps", steps,
                            "--batch", batch, "--resolution", res], log=os.path.join(work, "plain-0.log"), **held)]
    for tier in opts.get("tiers", "nvme").split(","):
        config = _ours_config(os.path.join(work, f"gemini-{tier}.yaml"), tier, os.path.join(work, "nvme"),
                              opts["chunk_mb"])
        sides.append(Side(f"ours (gemini, {tier} tier)", [
            py, "-m", MODULE.rsplit(".bench.", 1)[0], "diffusion", "finetune", "--config", config,
            "--pretrained_model_name_or_path", base, "--train_data_dir", data, "--resolution", res,
            "--train_batch_size", batch, "--max_train_steps", steps, "--mixed_precision", "bf16",
            "--gradient_checkpointing", "--log_every_n_steps", "1", "--output_dir", os.path.join(work, f"out-{tier}")],
            cap_bytes=cap if tier == "nvme" else None, log=os.path.join(work, f"ours-{len(sides)}.log"), **held))
    return whole_rows(sides, [{"variant": s.name, "cap_mib": None} for s in sides], drop=[work], batch=opts["batch"],
                      strict=True)


def run_whole(opts: dict, args: argparse.Namespace) -> int:
    import torch

    work = tempfile.mkdtemp(prefix="bench-diffusion-whole-")
    try:
        rows = whole_commands(opts, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    title = (f"whole commands: UNet {opts['channels']} x{opts['layers_per_block']}, encoders {opts['encoders']}, "
             f"{opts['resolution']}px, batch {opts['batch']}, {opts['steps']} steps, ours' chunks "
             f"{opts['chunk_mb']} MiB, torch {torch.__version__}")
    columns = ["variant", "peak_mib", "cap_mib", "peak_ratio", "oom_killed", "wall_s", "wall_ratio", "step_s",
               "step_ratio", "method"]
    notes = [f"{r['variant']}: {r['command']}" for r in rows]
    notes.append("peak_mib: the process tree from start to exit (page cache included with a cgroup); step_s: median "
                 "of the steps after the first; cap_mib: ours ran under that cgroup limit")
    publish(args, {"benchmark": "diffusion-whole-command", "config": opts, "rows": rows}, [(title, rows, columns)],
            notes)
    return 1 if any(r["returncode"] for r in rows) else 0


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


def main(argv: list[str] | None = None) -> int:
    """`python -m lowmem.suite.bench.diffusion write_pipeline DIR [--channels ...] | plain_loop BASE OUT [--steps 3
    --batch 2 --resolution 256]`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["write_pipeline"]:
        return tool_main({"plain_loop": plain_loop}, argv)
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE} write_pipeline")
    parser.add_argument("folder")
    add_shape_arguments(parser)
    args = parser.parse_args(argv[1:])
    write_pipeline(args.folder, vars(args))
    return 0
