"""`suite bench gpu`: the GPU proof in one command (issue 35), sized for a 15-minute lend of one H100 or H200.

    suite bench gpu --out DIR [--budget-s 420] [--device cuda|cpu] [--smoke] [--rows checks,kernels,...]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .harness import kill_group, markdown_table, names, write_json, write_text

__all__ = ["STAGES", "Stage", "add_arguments", "markdown", "run"]

NOMINAL_BUDGET_S = 420.0


@dataclass(frozen=True)
class Stage:
    """One stage: its share of a `NOMINAL_BUDGET_S` budget and the least time worth starting it with."""

    name: str
    share_s: float
    minimum_s: float
    what: str


STAGES = (
    Stage("checks", 80, 20, "CUDA paths: kernels' and Gemini's parity on the device, fp32 and bf16; pytest -m gpu"),
    Stage("kernels", 85, 30, "kernels fwd+bwd: LayerNorm vs F.layer_norm, softmax vs naive, attention vs SDPA"),
    Stage("sd", 100, 40, "SD-1.5 UNet 512 px: plain diffusers-style loop vs ours (Gemini), whole card and 8 GiB"),
    Stage("gemini", 85, 30, "Gemini vs FSDP2 vs DDP at 1B on one device; snapshot; CPU tier beyond 24 GiB"),
    Stage("fold", 70, 25, "AlphaFold model: auto chunks vs unchunked vs chunk 4; largest N_res in 24 GiB"),
)
_INJECT = ("crash", "hang", "ok")


def _inject(text: str) -> dict[str, str]:
    """Test hook: `stage=crash|hang|ok,...` replaces those stages' work (a hang gets a 3 s slice)."""
    pairs = dict(p.split("=", 1) for p in text.split(",") if "=" in p)
    if not pairs or any(k not in {s.name for s in STAGES} or v not in _INJECT for k, v in pairs.items()):
        raise argparse.ArgumentTypeError(f"expected stage=crash|hang|ok,..., got {text!r}")
    return pairs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="gpu-proof", help="folder for gpu.json, gpu.md, gpu.log (default: gpu-proof)")
    parser.add_argument("--budget-s", type=float, default=NOMINAL_BUDGET_S,
                        help="seconds for all stages together, split in their shares (default: 420)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="default: cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check the command end to end (any device)")
    parser.add_argument("--rows", type=names([s.name for s in STAGES]), default=[s.name for s in STAGES],
                        help="comma list of stages to run, in this order: " + ",".join(s.name for s in STAGES))
    parser.add_argument("--_stage", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_deadline", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_inject", type=_inject, default={}, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args._stage:
        return _stage_main(args)
    return _orchestrate(args)


# ---- the parent -----------------------------------------------------------------------------------------------


class _Stopped(Exception):
    """SIGTERM from outside (a device call's time limit): write what there is and stop."""


def _on_sigterm(signum, frame):
    raise _Stopped()


def _check(args: argparse.Namespace) -> None:
    if args.budget_s <= 0:
        raise UsageError(f"--budget-s must be positive, got {args.budget_s}")
    if args.device == "cpu" and not args.smoke:
        raise UsageError("--device cpu runs only with --smoke (the GPU sizes would take hours on a CPU)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available here (check the command with --device cpu --smoke)")


def _orchestrate(args: argparse.Namespace) -> int:
    _check(args)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="suite-bench-gpu-"))
    payload = {"benchmark": "gpu", "command": " ".join(["suite", *sys.argv[1:]]) if sys.argv else "",
               "device": args.device, "smoke": args.smoke, "budget_s": args.budget_s, "machine": _machine(args.device),
               "stages": [], "finished": False}
    selected = [s for s in STAGES if s.name in args.rows]
    t0, bank = time.monotonic(), 0.0
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with open(out / "gpu.log", "a") as log:
            for stage in selected:
                left = args.budget_s - (time.monotonic() - t0)
                share = stage.share_s * args.budget_s / NOMINAL_BUDGET_S
                slice_s = min(share + bank, left)
                if args._inject.get(stage.name) == "hang":
                    slice_s = min(slice_s, 3.0)
                result = _run_stage(stage, args, work, out, slice_s, log, left)
                bank = max(0.0, slice_s - result["seconds"]) if result["status"] == "ok" else 0.0
                payload["stages"].append(result)
                payload["elapsed_s"] = time.monotonic() - t0
                _write(out, payload, args)
                print(f"[gpu] {stage.name}: {result['status']} ({result['seconds']:.0f} s of {slice_s:.0f})",
                      flush=True)
        payload["finished"] = True
    except _Stopped:
        payload["stopped"] = "SIGTERM: the run was stopped from outside; the stages above are what it measured"
    finally:
        signal.signal(signal.SIGTERM, previous)
        payload["elapsed_s"] = time.monotonic() - t0
        _write(out, payload, args)
        shutil.rmtree(work, ignore_errors=True)  # the stages' records, now in the payload
    print(_summary(payload), flush=True)
    print(f"[gpu] wrote {out / 'gpu.json'}, {out / 'gpu.md'}, {out / 'gpu.log'}", flush=True)
    return 0


def _run_stage(stage: Stage, args: argparse.Namespace, work: Path, out: Path, slice_s: float, log, left: float) -> dict:
    result: dict[str, Any] = {"name": stage.name, "what": stage.what, "slice_s": round(slice_s, 1), "seconds": 0.0}
    minimum = max(5.0, stage.minimum_s * min(1.0, args.budget_s / NOMINAL_BUDGET_S))  # a process takes seconds
    if slice_s < minimum and args._inject.get(stage.name) != "hang":
        result.update(status="skipped", reason=f"needs at least {minimum:.0f} s, {max(0.0, left):.0f} s left")
        return result
    argv = [sys.executable, "-m", __package__.rpartition(".")[0], "bench", "gpu", "--_stage", stage.name,
            "--_work", str(work), "--_deadline", str(time.time() + slice_s - 2), "--device", args.device,
            "--out", str(out)] + (["--smoke"] if args.smoke else [])
    if args._inject:
        argv += ["--_inject", ",".join(f"{k}={v}" for k, v in args._inject.items())]
    from .gpu_stages import child_env

    log.write(f"\n===== stage {stage.name} (slice {slice_s:.0f} s) =====\n")
    log.flush()
    record = work / f"{stage.name}.json"
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=work, env=child_env(args.device),
                            start_new_session=True)
    try:
        code = proc.wait(timeout=max(1.0, slice_s))
        result["status"] = "ok" if code == 0 else "crashed"
        if code != 0:
            result["reason"] = f"exit code {code} (see gpu.log)"
    except subprocess.TimeoutExpired:
        kill_group(proc)
        result.update(status="timed out", reason=f"killed at its slice of {slice_s:.0f} s; rows below are what it "
                                                 "recorded before")
    except _Stopped:
        kill_group(proc)
        result.update(status="stopped", reason="stopped from outside (SIGTERM)", seconds=time.monotonic() - t0)
        result.update(_recorded(record))
        raise _Stopped() from None
    finally:
        result["seconds"] = round(time.monotonic() - t0, 1)
    result.update(_recorded(record))
    return result


def _recorded(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {"tables": {}, "notes": [], "targets": []}


def _machine(device: str) -> dict[str, Any]:
    """Versions and the card, without a CUDA context in this process (it would hold device memory for the
    whole run): the card's name, memory and driver come from nvidia-smi."""
    info: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            "host": platform.node(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    if device == "cuda":
        import torch

        info["cuda"] = torch.version.cuda
    for name in ("torch", "triton", "diffusers", "transformers"):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    if device == "cuda":
        try:
            query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
            smi = subprocess.run(query, capture_output=True, text=True, timeout=20)
            info["gpus"] = [line.strip() for line in smi.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.TimeoutExpired) as exc:
            info["gpus"] = [f"nvidia-smi failed: {exc}"]
    return info


# ---- a stage's process ----------------------------------------------------------------------------------------


def _stage_main(args: argparse.Namespace) -> int:
    from . import gpu_rows, gpu_stages

    functions = {"checks": gpu_stages.checks, "kernels": gpu_stages.kernels, "sd": gpu_rows.sd,
                 "gemini": gpu_rows.gemini, "fold": gpu_rows.fold}
    rec = gpu_stages.Recorder(Path(args._work) / f"{args._stage}.json", args._deadline or time.time() + 3600)
    injected = args._inject.get(args._stage)
    if injected == "crash":
        rec.note("injected crash (test hook)")
        return 3
    if injected == "hang":
        rec.note("injected hang (test hook)")
        time.sleep(3600)
    if injected == "ok":
        rec.table("injected", "test hook")
        rec.add("injected", {"stage": args._stage, "ok": True})
        return 0
    repo = Path(__file__).resolve().parents[2]
    ctx = gpu_stages.StageContext(device=args.device, smoke=args.smoke, work=Path(args._work), out=Path(args.out),
                                  rec=rec, repo=repo if (repo / "pyproject.toml").exists() else None)
    functions[args._stage](ctx)
    return 0


# ---- the report -----------------------------------------------------------------------------------------------


def _write(out: Path, payload: dict, args: argparse.Namespace) -> None:
    payload["targets"] = [{"stage": s["name"], **t} for s in payload["stages"] for t in s.get("targets", [])]
    write_text(out / "gpu.json", json.dumps(payload, indent=1, default=str) + "\n")
    write_text(out / "gpu.md", markdown(payload) + "\n")
    if getattr(args, "json", None):
        write_json(args.json, payload)


def _met(value: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "n/a"}[value]


def _overview(payload: dict) -> list[str]:
    """The stages (status, time) and the targets, as Markdown tables."""
    lines = ["## Stages", ""] + markdown_table([
        {"stage": s["name"], "status": s["status"], "seconds": s["seconds"], "slice s": s["slice_s"],
         "reason": s.get("reason", ""), "what": s["what"]} for s in payload["stages"]])
    return lines + ["", "## Targets", ""] + markdown_table([
        {"stage": t["stage"], "target": t["target"], "measured": t["measured"], "met": _met(t["met"])}
        for t in payload.get("targets", [])])


def markdown(payload: dict) -> str:
    """The report: machine, stages (status, time), targets, then each stage's tables and notes."""
    m = payload.get("machine", {})
    lines = [f"# suite bench gpu: {m.get('date', '')}", "",
             f"- command: `{payload.get('command', '')}`; device {payload['device']}"
             + (" (smoke: tiny sizes)" if payload.get("smoke") else ""),
             f"- machine: {', '.join(m.get('gpus', []) or ['no GPU'])}; torch {m.get('torch')} (CUDA {m.get('cuda')}), "
             f"Triton {m.get('triton')}, diffusers {m.get('diffusers')}, Python {m.get('python')}",
             f"- budget {payload['budget_s']:.0f} s, used {payload.get('elapsed_s', 0):.0f} s"
             + ("" if payload.get("finished") else " (not finished: " + payload.get("stopped", "running") + ")"), ""]
    lines += _overview(payload)
    for s in payload["stages"]:
        if not s.get("tables") and not s.get("notes"):
            continue
        lines += ["", f"## {s['name']}: {s['status']}", ""]
        for table in s.get("tables", {}).values():
            lines += [table["title"], ""] + markdown_table(table["rows"]) + [""]
        lines += [f"- {note}" for note in s.get("notes", [])]
    return "\n".join(lines)


def _summary(payload: dict) -> str:
    return "\n".join(["", "suite bench gpu"] + _overview(payload))
