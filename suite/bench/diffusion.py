"""`suite bench diffusion`: a plain diffusers-style training loop against ours on the same UNet, batch, resolution.

- plain: diffusers' default attention (`AttnProcessor2_0`), fp32 AdamW, no gradient checkpointing
  (torch DDP when `--world` > 1), as `train_text_to_image.py` runs it.
- ours: attention through `kernels.attention` (`KernelsAttnProcessor`), gradient checkpointing, and
  Gemini (`core_parallel.setup` with `GeminiConfig`, optimizer states and fp32 shards offloaded per
  `--gemini_offload`) unless `--no_gemini`.

Each variant runs in its own process(es) (`core_parallel.run_on_ranks`), so peak RSS is its own. The VAE and
text encoder are left out (frozen, identical for both); the UNet trains on random latents of
`resolution / 8` and random text states, as Stable Diffusion's UNet sees them.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that size the UNet and the run."""
    parser.add_argument("--channels", default="64,128,256", help="UNet block channels (SD 1.5: 320,640,1280,1280)")
    parser.add_argument("--layers_per_block", type=int, default=1, help="ResNet layers per block (SD 1.5: 2)")
    parser.add_argument("--cross_attention_dim", type=int, default=256, help="text state width (SD 1.5: 768)")
    parser.add_argument("--attention_head_dim", type=int, default=8, help="heads per attention (SD 1.5: 8)")
    parser.add_argument("--resolution", type=int, default=256, help="image side in pixels (latents: /8)")
    parser.add_argument("--batch", type=int, default=2, help="images per rank per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--world", type=int, default=1, help="processes (plain: DDP; ours: Gemini shards)")
    parser.add_argument("--gemini_offload", choices=["none", "cpu", "nvme"], default="nvme",
                        help="where Gemini keeps fp32 shards and optimizer states")
    parser.add_argument("--no_gemini", action="store_true", help="ours without Gemini (attention + checkpointing)")
    parser.add_argument("--attention_backend", choices=["auto", "triton", "torch"], default="auto")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant before it is killed")


def _unet(opts: dict):
    from diffusers import UNet2DConditionModel

    channels = tuple(int(c) for c in opts["channels"].split(","))
    n = len(channels)
    return UNet2DConditionModel(
        sample_size=opts["resolution"] // 8, block_out_channels=channels, layers_per_block=opts["layers_per_block"],
        down_block_types=("CrossAttnDownBlock2D",) * (n - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (n - 1),
        cross_attention_dim=opts["cross_attention_dim"], attention_head_dim=opts["attention_head_dim"],
    )


def _setup(variant: str, opts: dict, rank: int, world: int):
    import torch

    torch.manual_seed(0)
    model = _unet(opts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    if variant == "plain":
        from diffusers.models.attention_processor import AttnProcessor2_0

        model.set_attn_processor(AttnProcessor2_0())
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        return model, optimizer, None
    from diffusion.attention import set_kernels_attention

    set_kernels_attention(model, opts["attention_backend"])
    model.enable_gradient_checkpointing()
    if opts["no_gemini"]:
        return model, optimizer, None
    import tempfile

    import core_parallel

    offload = opts["gemini_offload"]
    config = core_parallel.GeminiConfig(
        offload_param_frac=0.0 if offload == "none" else 1.0, offload_optim_frac=0.0 if offload == "none" else 1.0,
        offload_dir=tempfile.mkdtemp(prefix="bench-gemini-") if offload == "nvme" else None)
    model, optimizer = core_parallel.setup(model, optimizer, config)
    return model, optimizer, optimizer


def _variant(rank: int, world: int, variant: str, opts: dict) -> dict:
    """One variant on this rank: median step seconds, peak RSS and peak RSS over the pre-model baseline."""
    import gc

    import psutil

    from suite.bench.common import peak_rss_bytes

    # One step of a small UNet on the same code path first: lazy imports, thread pools and kernel caches are
    # then in the baseline, not in the training memory measured below.
    small = {**opts, "channels": "32,64", "layers_per_block": 1, "resolution": 32, "batch": 1}
    _steps(variant, small, rank, world, 0, 1)
    gc.collect()
    baseline = psutil.Process().memory_info().rss
    seconds = _steps(variant, opts, rank, world, opts["warmup"], opts["steps"])
    peak = peak_rss_bytes()
    return {"step_s": seconds, "peak_rss_mib": peak / 2**20, "train_mib": (peak - baseline) / 2**20}


def _steps(variant: str, opts: dict, rank: int, world: int, warmup: int, repeat: int) -> float:
    """Build the variant and time `repeat` training steps after `warmup`; returns the median seconds."""
    import torch
    import torch.nn.functional as F

    from suite.bench.common import time_fn

    model, optimizer, core = _setup(variant, opts, rank, world)
    side, b = opts["resolution"] // 8, opts["batch"]
    g = torch.Generator().manual_seed(rank)
    latents = torch.randn(b, 4, side, side, generator=g)
    text = torch.randn(b, 77, opts["cross_attention_dim"], generator=g)
    timesteps = torch.randint(0, 1000, (b,), generator=g)

    def step() -> None:
        noise = torch.randn_like(latents)
        pred = model(latents + noise, timesteps, text).sample
        loss = F.mse_loss(pred, noise)
        if core is not None:
            core.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return time_fn(step, warmup=warmup, repeat=repeat)


def run(args: argparse.Namespace) -> int:
    """Run both variants and print the table."""
    import torch

    from core_parallel import run_on_ranks
    from suite.bench.common import print_table, write_json
    from suite.errors import UsageError

    if args.resolution % 8 or args.resolution < 16:
        raise UsageError(f"--resolution must be a multiple of 8 and >= 16, got {args.resolution}")
    opts = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("json",)}
    ours_name = "ours (kernels attention + checkpointing" + ("" if args.no_gemini else
                                                                f" + gemini/{args.gemini_offload}") + ")"
    rows = []
    for variant, label in (("plain", "plain diffusers loop (SDPA, fp32 AdamW)"), ("ours", ours_name)):
        per_rank = run_on_ranks(_variant, args.world, variant, opts, timeout=args.timeout)
        worst = max(per_rank, key=lambda r: r["train_mib"])
        rows.append({"variant": label, "world": args.world, "step_s": max(r["step_s"] for r in per_rank),
                     "peak_rss_mib": worst["peak_rss_mib"], "train_mib": worst["train_mib"]})
    plain, ours = rows
    ours["mem_ratio"] = ours["train_mib"] / plain["train_mib"]
    ours["time_ratio"] = ours["step_s"] / plain["step_s"]
    n_params = sum(p.numel() for p in _unet(opts).parameters())
    title = (f"UNet {args.channels} x{args.layers_per_block} ({n_params / 1e6:.1f}M params), "
             f"{args.resolution}px, batch {args.batch}/rank, torch {torch.__version__}")
    print_table(rows, ["variant", "world", "step_s", "peak_rss_mib", "train_mib", "mem_ratio", "time_ratio"],
                title=title)
    print("train_mib: peak RSS minus RSS before the model was built (per rank, worst rank); "
          "targets: mem_ratio <= 0.33, time_ratio <= 1.2")
    write_json(args.json, {"benchmark": "diffusion", "config": opts, "params": n_params, "rows": rows})
    return 0
