"""`suite demo`: the main jobs on built-in defaults (tiny models built from configs, bundled data).

Each step is an ordinary `suite` command line, run in this process, so the demo shows exactly what a user
would type. Outputs go under `--output_dir` (default `demo_outputs/`).
"""

from __future__ import annotations

import argparse
import time

__all__ = ["STEPS", "add_arguments", "run"]

# (name, argv template). {out} is replaced by the output folder.
STEPS: list[tuple[str, list[str]]] = [
    ("diffusion: LoRA fine-tune of a tiny Stable Diffusion", [
        "diffusion", "finetune", "--output_dir", "{out}/diffusion_lora", "--rank", "4", "--max_train_steps", "30",
        "--train_batch_size", "2", "--learning_rate", "1e-3", "--checkpointing_steps", "15",
        "--validation_prompt", "a red circle on a white background", "--validation_steps", "15",
        "--num_validation_images", "4", "--num_inference_steps", "10"]),
    ("diffusion: full fine-tune with EMA, min-SNR and gradient checkpointing (ddp on 1 process)", [
        "diffusion", "finetune", "--output_dir", "{out}/diffusion_full", "--max_train_steps", "20",
        "--train_batch_size", "2", "--use_ema", "--snr_gamma", "5.0", "--gradient_checkpointing",
        "--checkpointing_steps", "10", "--checkpoints_total_limit", "1",
        "--validation_prompt", "a blue square on a black background", "--validation_steps", "20",
        "--num_validation_images", "4", "--num_inference_steps", "10"]),
    ("fold: bundled example, single-sequence, tiny random model, Amber relax", ["fold", "--output_dir", "{out}/fold"]),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output_dir", default="demo_outputs", help="where the demo writes its outputs")
    parser.add_argument("--only", default=None, help="run only the steps whose name starts with this word")


def run(args: argparse.Namespace) -> int:
    from ..cli import main

    failures = []
    for name, template in STEPS:
        if args.only and not name.startswith(args.only):
            continue
        argv = [a.replace("{out}", args.output_dir) for a in template]
        print(f"\n=== {name}\n$ suite {' '.join(argv)}", flush=True)
        t0 = time.perf_counter()
        rc = main(argv)
        print(f"=== {name}: exit {rc} in {time.perf_counter() - t0:.1f}s", flush=True)
        if rc != 0:
            failures.append(name)
    if failures:
        print(f"demo: {len(failures)} step(s) failed: {', '.join(failures)}")
        return 1
    print(f"demo: all steps finished; outputs in {args.output_dir}/")
    return 0
