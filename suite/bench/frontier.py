"""`suite bench diffusion`'s whole commands, each side a process from start to exit: `--whole_command`, the plain
loop against `suite diffusion finetune` (`whole_commands`), and `--frontier` (issue 47): what `--memory_budget` buys
and costs. The plain loop's whole-command peak P first; then ours (`--strategy gemini_auto --memory_budget B`) at
each B = f x P of `--budgets` in a memory cgroup capped at B. Rows: peak and step time against the plain loop, and
each step's traffic (disk, Gemini's tiers) from ours' CSV log; the disk's own speed is measured first, in the offload
folder."""

from __future__ import annotations

import argparse
import contextlib
import csv
import mmap
import os
import shutil
import sys
import tempfile
import time
from fractions import Fraction

from .harness import SUITE, WHOLE_RATIOS, Side, add_ratios, csv_metric, median, publish, save_figure, whole_rows

__all__ = ["add_frontier_arguments", "disk_speed", "run_frontier", "run_whole", "script_flags", "whole_commands"]

_BENCH = SUITE + ".bench."


def add_frontier_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `--frontier`."""
    parser.add_argument("--frontier", action="store_true",
                        help="ours under --memory_budget at fractions of the plain loop's peak (docs/benchmarks.md)")
    parser.add_argument("--frontier_rows", default="full",
                        help="--frontier: full (a full fine-tune of the UNet of the shape flags), sdxl-lora (SDXL's "
                             "released size; comma-separated)")
    parser.add_argument("--budgets", default="1/6,1/3,1/2,1", help="--frontier: fractions of the plain loop's peak")
    parser.add_argument("--work", default=None, help="--frontier: outputs and offload folders (default: a temporary "
                                                     "folder, removed after)")


def disk_speed(folder: str, mib: int = 256) -> dict:
    """MB/s of writing then reading `mib` MiB in `folder` with O_DIRECT (buffered with fsync and the page cache
    dropped where the file system refuses it), one 8 MiB request at a time."""
    from ...utils.fileio import drop_page_cache

    path, block = os.path.join(folder, ".disk-speed"), 8 << 20
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    buf.write(os.urandom(block))
    direct = True
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        direct, fd = False, os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(mib // 8):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
    finally:
        os.close(fd)
    drop_page_cache(path)
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0))
    try:
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        read_s = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    nbytes = (mib // 8) * block
    return {"write_mb_s": nbytes / write_s / 1e6, "read_mb_s": nbytes / read_s / 1e6, "direct_io": direct}


def _traffic(out: str) -> dict:
    """Median MiB per step after the first of each traffic column of ours' CSV log (`TierTraffic`)."""
    path = os.path.join(out, "logs", "csv", "metrics.csv")
    if not os.path.exists(path):
        return {}
    with open(path, newline="") as f:
        columns = next(csv.reader(f), [])
    values = {c.replace("tier_mib/", ""): csv_metric(out, c) for c in columns if c.startswith(("tier_mib/", "disk_"))}
    return {c: median(v[1:] or v) for c, v in values.items()}


def script_flags(opts: dict) -> list[str]:
    """Ours' flags besides model and data in the rows of `--frontier` and `suite bench diffusion-sdxl`: `opts`' size,
    bf16, gradient checkpointing, a CSV log (the step times), no checkpoint, no learning-rate warm-up."""
    return ["--resolution", str(opts["resolution"]), "--train_batch_size", str(opts["batch"]), "--max_train_steps",
            str(opts["steps"]), "--mixed_precision", "bf16", "--gradient_checkpointing", "--report_to", "csv",
            "--checkpointing_steps", "1000000", "--lr_warmup_steps", "0"]


def _commands(row: str, opts: dict, work: str) -> tuple[list[str], list[str]]:
    """(plain loop, ours without the budget flags) of a frontier row, after writing the model folder it needs (in a
    process of its own, as its bench writes it: `diffusion write_pipeline`, `diffusion_sdxl write_pipeline`)."""
    import subprocess

    from ...diffusion.sample_data import write_sample_data

    py, data = sys.executable, str(write_sample_data(os.path.join(work, "data")))
    if row == "full":
        bench, tool, base = "diffusion", "plain_loop", os.path.join(work, "base")
        shapes = [f"--{k}={opts[k]}" for k in ("channels", "layers_per_block", "cross_attention_dim",
                                                "attention_head_dim", "encoders", "resolution")]
        ours = ["train_text_to_image", "--pretrained_model_name_or_path", base, "--train_data_dir", data,
                "--learning_rate", "1e-5"]
    else:
        bench, tool, shapes = "diffusion_sdxl", "plain_lora", []
        base = os.path.join(opts["work"] or work, "sdxl-pipeline")  # kept with --work: written once
        ours = ["train_dreambooth_lora_sdxl", "--pretrained_model_name_or_path", base, "--instance_data_dir", data,
                "--instance_prompt", "a photo of sks dog"]
    subprocess.run([py, "-m", _BENCH + bench, "write_pipeline", base, *shapes], check=True, cwd=work)
    plain = [py, "-m", _BENCH + bench, tool, base, os.path.join(work, "out-plain"), "--steps", str(opts["steps"]),
             "--batch", str(opts["batch"]), "--resolution", str(opts["resolution"])]
    return plain, ["diffusion", *ours, *script_flags(opts)]


def run_frontier(opts: dict, args: argparse.Namespace) -> int:
    """Every `--frontier_rows` row at every budget of `--budgets`, published with the disk's speed."""
    from ..errors import UsageError

    rows_wanted = opts["frontier_rows"].split(",")
    if unknown := sorted(set(rows_wanted) - {"full", "sdxl-lora"}):
        raise UsageError(f"--frontier_rows: unknown {unknown[0]!r} (full, sdxl-lora)")
    try:
        fractions = [Fraction(f) for f in opts["budgets"].split(",")]
    except (ValueError, ZeroDivisionError) as exc:
        raise UsageError(f"--budgets {opts['budgets']!r}: fractions such as 1/6,1/2,1 ({exc})") from exc
    rows: list[dict] = []
    with contextlib.nullcontext(opts["work"]) if opts["work"] else tempfile.TemporaryDirectory(
            prefix="bench-frontier-", ignore_cleanup_errors=True) as work:
        os.makedirs(work, exist_ok=True)
        disk = disk_speed(work)
        for row in rows_wanted:
            folder = os.path.join(work, row)
            os.makedirs(folder, exist_ok=True)
            plain, ours = _commands(row, opts, folder)
            held = {"timeout": opts["timeout"], "cwd": folder}  # cwd: no checkout on sys.path (see diffusion.py)
            # every side reads the model folder from disk (the SDXL one lies outside the row's folder): pages cached
            # before a side are charged to nobody, and the plain loop's peak, the budgets' base, came out 12.6 GB
            # after the folder was written and 19.8 GB with it read from disk
            drop = [folder, ours[ours.index("--pretrained_model_name_or_path") + 1]]
            got = whole_rows([Side("plain", plain, log=os.path.join(folder, "plain.log"), **held)],
                             [{"row": row, "budget": "plain", "budget_mib": None}], drop=drop, batch=opts["batch"])
            rows += got
            peak = got[0]["peak_mib"]
            if got[0]["returncode"] != 0 or not peak:
                continue
            sides, labels = [], []
            for f in fractions:
                budget = int(peak * f * 2**20)
                out, nvme = os.path.join(folder, f"out-{f}".replace("/", "_")), os.path.join(folder, "nvme")
                shutil.rmtree(nvme, ignore_errors=True)
                os.makedirs(nvme)
                sides.append(Side(f"{row} {f}", [sys.executable, "-m", SUITE, *ours, "--strategy", "gemini_auto",
                                                 "--memory_budget", str(budget), "--offload_dir", nvme,
                                                 "--output_dir", out], cap_bytes=budget, offload_paths=[nvme],
                                  log=out + ".log", **held))
                labels.append({"row": row, "budget": str(f), "budget_mib": budget / 2**20})
            ours_rows = whole_rows(sides, labels, drop=drop, batch=opts["batch"], compare=False)
            add_ratios(ours_rows, got[0], WHOLE_RATIOS)
            for r, side in zip(ours_rows, sides):
                out = side.argv[side.argv.index("--output_dir") + 1]
                r.update(_traffic(out))
                for name in os.listdir(out) if os.path.isdir(out) else ():  # the weights: GBs per budget at size
                    if name != "logs":
                        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
            rows += ours_rows
    traffic = sorted({k for r in rows for k in r if k.startswith("disk_") or "->" in k})
    columns = ["row", "budget", "budget_mib", "returncode", "oom_killed", "peak_mib", "peak_ratio", "step_s",
               "step_ratio", "wall_s", *traffic]
    title = (f"--frontier: UNet {opts['channels']} x{opts['layers_per_block']} (full) / SDXL (sdxl-lora), "
             f"{opts['resolution']}px, batch {opts['batch']}, {opts['steps']} steps; disk {disk['read_mb_s']:.0f} MB/s "
             f"read, {disk['write_mb_s']:.0f} MB/s write ({'direct I/O' if disk['direct_io'] else 'buffered'})")
    notes = [f"{r['row']} {r['budget']}: {r['command']}" for r in rows]
    notes.append("budget: fraction of the plain loop's whole-command peak, given as --memory_budget and as the "
                 "cgroup cap ours ran under; ratios against the plain loop's run; traffic columns: median MiB "
                 "per step after the first (disk_*: /proc/self/io; src->dst: Gemini's ledger)")
    publish(args, {"benchmark": "diffusion-frontier", "config": opts, "disk": disk, "rows": rows},
            [(title, rows, columns)], notes, plotter=_plot)
    return 1 if any(r["returncode"] not in (0, None) and not r.get("oom_killed") for r in rows) else 0


def _plot(rows: list[dict], path: str, title: str) -> None:
    """Step time against whole-command peak, both over the plain loop's, a line per row (its budgets marked)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for row in dict.fromkeys(r["row"] for r in rows):
        pts = [(r["peak_ratio"], r["step_ratio"], r["budget"]) for r in rows
               if r["row"] == row and r.get("peak_ratio") and r.get("step_ratio") and r["returncode"] == 0]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=row)
            for x, y, b in pts:
                ax.annotate(b, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.plot([1], [1], marker="*", color="black", label="plain loop")
    ax.set_xlabel("whole-command peak / plain loop's")
    ax.set_ylabel("step time / plain loop's")
    ax.set_title(title[:90], fontsize=7)
    ax.legend(fontsize=8)
    save_figure(fig, path)


# ---- --whole_command ---------------------------------------------------------------------------------------


def _ours_config(path: str, tier: str, nvme: str, chunk_mb: float) -> str:
    """A recipe YAML naming ours' Gemini config (what a user writes to set the chunk size)."""
    where = f", offload_dir: {nvme}" if tier == "nvme" else ""
    size = f", chunk_mb: {chunk_mb}" if chunk_mb > 0 else ""  # 0: Gemini searches it, as --strategy gemini_* does
    with open(path, "w") as f:
        f.write(f"launch:\n  parallel:\n    gemini: {{offload_tier: {tier}{where}, offload_param_frac: 1.0, "
                f"offload_optim_frac: 1.0{size}}}\n")
    return path


def whole_commands(opts: dict, work: str) -> list[dict]:
    """The plain loop and `suite diffusion finetune` (Gemini on each of `--tiers`; the nvme one under `--cap_mib`)
    side by side (`whole_rows`) on a pipeline folder of `opts`' shapes written in `work` (as `--frontier`'s full row
    writes it, with its plain loop)."""
    plain, _ = _commands("full", opts, work)
    base, data = os.path.join(work, "base"), os.path.join(work, "data")
    py, steps, batch, res = sys.executable, str(opts["steps"]), str(opts["batch"]), str(opts["resolution"])
    cap = int(opts["cap_mib"] * 2**20) if opts.get("cap_mib") else None
    # cwd: the work folder, so `-m` puts no checkout on sys.path (its `kernels/` would shadow Hugging Face's)
    held = {"timeout": opts["timeout"], "cwd": work, "offload_paths": [os.path.join(work, "nvme")]}
    sides = [Side("plain", plain, log=os.path.join(work, "plain-0.log"), **held)]
    for tier in opts.get("tiers", "nvme").split(","):
        config = _ours_config(os.path.join(work, f"gemini-{tier}.yaml"), tier, os.path.join(work, "nvme"),
                              opts["chunk_mb"])
        sides.append(Side(f"ours (gemini, {tier} tier)", [
            py, "-m", SUITE, "diffusion", "finetune", "--config", config,
            "--pretrained_model_name_or_path", base, "--train_data_dir", data, "--resolution", res,
            "--train_batch_size", batch, "--max_train_steps", steps, "--mixed_precision", "bf16",
            "--gradient_checkpointing", "--log_every_n_steps", "1", "--output_dir", os.path.join(work, f"out-{tier}")],
            cap_bytes=cap if tier == "nvme" else None, log=os.path.join(work, f"ours-{len(sides)}.log"), **held))
    return whole_rows(sides, [{"variant": s.name, "cap_mib": None} for s in sides], drop=[work], batch=opts["batch"],
                      strict=True)


def run_whole(opts: dict, args: argparse.Namespace) -> int:
    import torch

    with tempfile.TemporaryDirectory(prefix="bench-diffusion-whole-", ignore_cleanup_errors=True) as work:
        rows = whole_commands(opts, work)
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
