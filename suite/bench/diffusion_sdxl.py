"""`suite bench diffusion-sdxl`: SDXL at its released size (UNet 2.57B parameters), random weights, whole
commands from start to exit, each side its own process: rows `lora` and `full`.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import subprocess
import sys
import tempfile

from ...diffusion.released import RELEASED, write_released_pipeline
from ...utils.memory_meter import cgroup_method
from ..errors import UsageError
from .diffusion import noise_loss, plain_step, tool_main
from .frontier import script_flags
from .harness import SUITE, WHOLE_RATIOS, Side, add_ratios, csv_metric, emit, publish, run_side, whole_rows

__all__ = ["SDXL_UNET", "add_arguments", "check_pipeline", "main", "plain_full", "plain_lora", "run", "write_pipeline"]

_MODULE = __spec__.name if __spec__ is not None else __name__

SDXL_UNET = RELEASED["sdxl-base-1.0"]["unet"]  # stabilityai/stable-diffusion-xl-base-1.0, unet/config.json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache", default="/tmp/lowmem-bench-cache/sdxl",
                        help="folder of the random-weight SDXL pipeline (written once)")
    parser.add_argument("--rows", default="lora,full", help="which rows: lora, full (comma-separated)")
    parser.add_argument("--resolution", type=int, default=256, help="image side in pixels")
    parser.add_argument("--batch", type=int, default=1, help="images per step")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank")
    parser.add_argument("--sides", default="plain,ours", help="which sides of each row: plain, ours (comma-separated)")
    parser.add_argument("--lora_strategy", default="gemini_nvme", help="--strategy of ours in the LoRA row")
    parser.add_argument("--cap_gib", type=float, default=8.0, help="the published cap of the full row")
    parser.add_argument("--work", default="/tmp/lowmem-bench-sdxl", help="outputs and the NVMe folder")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per command before it is killed")


def write_pipeline(folder: str) -> str:
    """The SDXL base 1.0 pipeline at its released size with random weights (`diffusion.released`)."""
    return str(write_released_pipeline(folder, "sdxl-base-1.0"))


def _load_sdxl(base: str, dtype) -> dict:
    """The pipeline's parts as diffusers' SDXL scripts load them: everything with `from_pretrained` in fp32 and
    frozen; the text encoders then cast to `dtype` (the scripts' weight dtype)."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    parts = {"scheduler": DDPMScheduler.from_pretrained(base, subfolder="scheduler"),
             "tokenizer": CLIPTokenizer.from_pretrained(base, subfolder="tokenizer"),
             "encoders": [CLIPTextModel.from_pretrained(base, subfolder="text_encoder"),
                          CLIPTextModelWithProjection.from_pretrained(base, subfolder="text_encoder_2")],
             "vae": AutoencoderKL.from_pretrained(base, subfolder="vae"),
             "unet": UNet2DConditionModel.from_pretrained(base, subfolder="unet")}
    for m in (parts["unet"], parts["vae"], *parts["encoders"]):
        m.requires_grad_(False)
    for m in parts["encoders"]:
        m.to(dtype)
    return parts


def _prompt(parts: dict, batch: int, resolution: int) -> tuple:
    """The prompt's embeddings (computed once, as both scripts do) and the `added_cond_kwargs` of a batch."""
    import torch

    from ...diffusion.sdxl import encode_prompt_sdxl, time_ids

    ids = parts["tokenizer"](["a photo of sks dog"] * batch, padding="max_length", max_length=77, truncation=True,
                             return_tensors="pt").input_ids
    with torch.no_grad():
        hidden, pooled = encode_prompt_sdxl(parts["encoders"], [ids, ids])
    cond = {"text_embeds": pooled, "time_ids": time_ids(torch.tensor([[resolution] * 2] * batch),
                                                        torch.zeros(batch, 2, dtype=torch.long), resolution)}
    return hidden, cond


def _train(unet, latents_of, hidden, cond, optimizer, scheduler, steps: int, checkpointing: bool) -> None:
    """The scripts' steps (`diffusion.plain_step` of `noise_loss`: bf16 autocast, SDPA, MSE on the noise)
    with SDXL's added conditioning."""
    if checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    for step in range(steps):
        plain_step(step, steps, optimizer,
                   lambda s=step: noise_loss(unet, scheduler, latents_of(s), hidden, added_cond_kwargs=cond))


def plain_lora(base: str, out: str, *, steps: int = 2, batch: int = 1, resolution: int = 256, rank: int = 4,
               checkpointing: bool = True) -> None:
    """`train_dreambooth_lora_sdxl.py --mixed_precision bf16 [--gradient_checkpointing]` reduced to its loop: the
    UNet and both text encoders loaded with `from_pretrained` and cast to bf16, the VAE kept in fp32 (as the script
    does), peft LoRA (r = alpha = rank, gaussian init, to_k/q/v/out.0) in fp32, AdamW, SDPA, bf16 autocast,
    `steps` steps on random images with the script's `time_ids`, then the LoRA file written."""
    import torch
    from diffusers import StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(0)
    parts = _load_sdxl(base, torch.bfloat16)
    unet, vae = parts["unet"], parts["vae"]
    unet.to(torch.bfloat16)
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4)
    hidden, cond = _prompt(parts, batch, resolution)
    del parts["encoders"]  # the script computes the instance prompt's embeddings once and deletes the text encoders
    gc.collect()

    def latents_of(step: int) -> torch.Tensor:
        with torch.no_grad():
            pixels = torch.rand(batch, 3, resolution, resolution) * 2 - 1
            return vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor

    _train(unet, latents_of, hidden, cond, optimizer, parts["scheduler"], steps, checkpointing)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionXLPipeline.save_lora_weights(out, unet_lora_layers=layers, safe_serialization=True)


def plain_full(base: str, out: str, *, steps: int = 2, batch: int = 1, resolution: int = 256,
               checkpointing: bool = True) -> None:
    """`train_text_to_image_sdxl.py --mixed_precision bf16 [--gradient_checkpointing]` reduced to its loop: every
    part loaded with `from_pretrained`, the text encoders cast to bf16, the prompt embeddings and the images' VAE
    latents computed first and the encoders and VAE deleted (the script's `dataset.map` pre-computation), then the
    UNet trained in fp32 with AdamW (torch's default, as the script builds it) under bf16 autocast, SDPA; the UNet
    saved in the end. On a machine smaller than its 16 bytes per parameter it is killed for memory."""
    import torch

    torch.manual_seed(0)
    parts = _load_sdxl(base, torch.bfloat16)
    unet, vae = parts["unet"], parts["vae"]
    hidden, cond = _prompt(parts, batch, resolution)
    with torch.no_grad():
        latents = [vae.encode(torch.rand(batch, 3, resolution, resolution) * 2 - 1).latent_dist.sample()
                   * vae.config.scaling_factor for _ in range(steps)]
    del parts["encoders"], parts["vae"], vae
    gc.collect()
    unet.requires_grad_(True)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5, weight_decay=1e-2)
    _train(unet, latents.__getitem__, hidden, cond, optimizer, parts["scheduler"], steps, checkpointing)
    unet.save_pretrained(os.path.join(out, "unet"))


def _sides(opts: dict, base: str, data: str) -> list[dict]:
    """The rows' commands: (row, side, argv, note)."""
    py, work = sys.executable, opts["work"]
    common = ["--pretrained_model_name_or_path", base, *script_flags(opts)]
    suite = [py, "-m", SUITE, "diffusion"]
    rows = []
    if "lora" in opts["rows"]:
        rows += [
            {"row": "lora", "side": "plain", "argv": [
                py, "-m", _MODULE, "plain_lora", base, os.path.join(work, "out-lora-plain"), "--steps",
                str(opts["steps"]), "--batch", str(opts["batch"]), "--resolution", str(opts["resolution"]),
                "--rank", str(opts["rank"])]},
            {"row": "lora", "side": "ours", "argv": [
                *suite, "train_dreambooth_lora_sdxl", *common, "--instance_data_dir", data, "--instance_prompt",
                "a photo of sks dog", "--rank", str(opts["rank"]), "--strategy", opts["lora_strategy"],
                *(["--offload_dir", os.path.join(work, "nvme-lora")] if "nvme" in opts["lora_strategy"] else []),
                "--output_dir", os.path.join(work, "out-lora-ours")]},
        ]
    if "full" in opts["rows"] and opts.get("plain_full_cap"):
        rows.append({"row": "full", "side": "plain", "cap": opts["plain_full_cap"], "argv": [
            py, "-m", _MODULE, "plain_full", base, os.path.join(work, "out-full-plain"), "--steps", str(opts["steps"]),
            "--batch", str(opts["batch"]), "--resolution", str(opts["resolution"])]})
    if "full" in opts["rows"]:
        rows.append({"row": "full", "side": "ours", "cap": int(opts["cap_gib"] * 2**30), "argv": [
            *suite, "train_text_to_image_sdxl", *common, "--train_data_dir", data, "--strategy", "gemini_nvme",
            "--offload_dir", os.path.join(work, "nvme-full"), "--output_dir", os.path.join(work, "out-full-ours")]})
    return rows


def _machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _plain_full_note() -> dict:
    """The plain full fine-tune where it is not started (no memory cgroup to hold it in): what it needs."""
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        n = sum(p.numel() for p in UNet2DConditionModel(**SDXL_UNET).parameters())
    need, total = n * 16, _machine_bytes()  # fp32 weight + gradient + two AdamW moments
    fits = "" if need > total else " (it would fit: not measured by this benchmark)"
    return {"row": "full", "side": "plain", "returncode": None, "params_M": round(n / 1e6), "peak_mib": None,
            "note": f"not started{fits} (no memory cgroup to run it in safely): needs >= {need / 2**30:.1f} GiB for "
                    f"fp32 weights, gradients and AdamW states before activations; the machine has "
                    f"{total / 2**30:.1f} GiB"}


def _full_checks(out: str) -> dict:
    """What the full row must show besides its peak: the logged losses are finite and the exported pipeline
    loads in diffusers with a finite UNet of the released size (checked in a process of its own)."""
    losses = csv_metric(out, "train_loss")
    # its own empty working folder: `-m` puts the working folder first on sys.path, and a checkout's `kernels/`
    # there would shadow Hugging Face's, which diffusers imports
    with tempfile.TemporaryDirectory() as cwd:
        done = run_side(Side("check_pipeline", [sys.executable, "-m", _MODULE, "check_pipeline", os.path.abspath(out)],
                             cwd=cwd, measure=False))
    try:
        loaded = done.result()
    except RuntimeError:
        loaded = {"loads": False, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return {"losses": losses, "loss_finite": bool(losses) and all(math.isfinite(v) for v in losses),
            "pipeline": loaded}


def check_pipeline(out: str) -> None:
    """Print (JSON) whether `StableDiffusionXLPipeline.from_pretrained(out)` loads, its UNet's size and finiteness."""
    import torch
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(out)
    params = list(pipe.unet.parameters())
    emit({"loads": True, "unet_params": sum(p.numel() for p in params),
          "finite": all(bool(torch.isfinite(p).all()) for p in params)})


def run(args: argparse.Namespace) -> int:
    from ...diffusion.sample_data import write_sample_data

    opts = {k: getattr(args, k) for k in ("cache", "rows", "sides", "resolution", "batch", "steps", "rank",
                                          "lora_strategy", "cap_gib", "work", "timeout")}
    opts["rows"], opts["sides"] = opts["rows"].split(","), opts["sides"].split(",")
    if bad := sorted(set(opts["rows"]) - {"lora", "full"}) + sorted(set(opts["sides"]) - {"plain", "ours"}):
        raise UsageError(f"--rows/--sides: unknown {bad[0]!r} (rows: lora, full; sides: plain, ours)")
    # the plain full loop is started only inside a memory cgroup whose limit keeps the machine alive (1.5 GiB below
    # its memory): it needs 16 bytes per parameter, so where that is over the machine the kernel kills it there
    opts["plain_full_cap"] = _machine_bytes() - 3 * 2**29 if cgroup_method() != "rss+mincore" else None
    os.makedirs(opts["work"], exist_ok=True)
    subprocess.run([sys.executable, "-m", _MODULE, "write_pipeline", opts["cache"]], check=True, cwd=opts["work"])
    data = str(write_sample_data(os.path.join(opts["work"], "data")))
    specs = [s for s in _sides(opts, opts["cache"], data) if s["side"] in opts["sides"]]
    sides = [Side(f"{s['row']}/{s['side']}", s["argv"], cap_bytes=s.get("cap"), timeout=opts["timeout"],
                  cwd=opts["work"], log=os.path.join(opts["work"], f"{s['row']}-{s['side']}.log"),
                  offload_paths=[os.path.join(opts["work"], d) for d in ("nvme-lora", "nvme-full")]) for s in specs]
    rows = whole_rows(sides, [{"row": s["row"], "side": s["side"]} for s in specs], drop=[opts["cache"]],
                      batch=opts["batch"], compare=False)
    for r, side in zip(rows, sides):
        r["log"] = side.log
        if (r["row"], r["side"], r["returncode"]) == ("full", "ours", 0):
            r.update(_full_checks(side.argv[side.argv.index("--output_dir") + 1]))
    if "full" in opts["rows"] and "plain" in opts["sides"] and not opts["plain_full_cap"]:
        rows.append(_plain_full_note())
    plain = {r["row"]: r for r in rows if r["side"] == "plain" and r.get("peak_mib")}
    for r in rows:
        if r["side"] == "ours" and r["row"] in plain:
            add_ratios([r], plain[r["row"]], WHOLE_RATIOS)
    notes = [f"{r['row']}/{r['side']}: {r.get('command') or r.get('note')}" for r in rows]
    notes += [f"{r['row']}/{r['side']}: losses {r['losses']}, exported pipeline {r['pipeline']}"
              for r in rows if "pipeline" in r]
    title = (f"SDXL (released UNet config, random weights), {opts['resolution']}px, batch {opts['batch']}, "
             f"{opts['steps']} steps; step_s: median of the steps after the first")
    publish(args, {"benchmark": "diffusion-sdxl", "config": opts, "rows": rows},
            [(title, rows, ["row", "side", "returncode", "peak_mib", "peak_ratio", "cap_mib", "oom_killed", "wall_s",
                            "wall_ratio", "step_s", "step_ratio", "loss_finite", "method"])], notes)
    return 1 if any(r["returncode"] not in (0, None) for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m lowmem.suite.bench.diffusion_sdxl write_pipeline DIR | check_pipeline OUT | plain_lora BASE OUT
    [--steps 2 --batch 1 --resolution 256 --rank 4] | plain_full BASE OUT [--steps ...]`."""
    return tool_main({"write_pipeline": write_pipeline, "check_pipeline": check_pipeline, "plain_lora": plain_lora,
                      "plain_full": plain_full}, argv)


if __name__ == "__main__":
    raise SystemExit(main())
