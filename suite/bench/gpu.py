"""`suite bench gpu`: the GPU proof in one command (issue 35; docs/benchmarks.md, "GPU proof"). Each stage runs
existing commands (`pytest -m gpu`, `suite bench ... --json FILE`) as sides within its time slice; their rows are its
tables, the targets are judged from them, and gpu.json, gpu.md and gpu.log are rewritten after every command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .harness import SUITE, Side, json_lines, machine_info, markdown_table, names, run_side, smi, write_text

__all__ = ["STAGES", "Stage", "add_arguments", "markdown", "run"]

NOMINAL_BUDGET_S = 420.0
PARITY_TESTS = ("tests/kernels/test_gpu_parity.py", "tests/core_parallel/test_gpu_parity.py")
SD15 = ["--channels", "320,640,1280,1280", "--layers_per_block", "2", "--cross_attention_dim", "768",
        "--resolution", "512"]
"""`suite bench diffusion`'s flags for SD 1.5's UNet (859.5M; its config's other fields are diffusers' defaults)."""
SD_SMOKE = ["--channels", "32,64", "--layers_per_block", "1", "--cross_attention_dim", "32", "--attention_head_dim",
            "4", "--resolution", "64"]
_INJECT = {"crash": "raise SystemExit(3)", "hang": "import time; time.sleep(3600)",
           "ok": "print('{\"injected\": true}')"}


def _inject(text: str) -> dict[str, str]:
    """Test hook: `stage=crash|hang|ok,...`: those stages run one command that exits 3, sleeps (3 s slice) or prints."""
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
    parser.add_argument("--_inject", type=_inject, default={}, help=argparse.SUPPRESS)


# ---- a stage's commands ---------------------------------------------------------------------------------------


class _Stopped(Exception):
    """SIGTERM from outside (a device call's time limit): write what there is and stop."""


def _on_sigterm(signum, frame):
    raise _Stopped()


@dataclass
class _Stage:
    """One stage while it runs: its record in the report (tables, notes, commands), its deadline, what failed."""

    args: argparse.Namespace
    record: dict
    deadline: float
    work: Path
    log: Any
    save: Callable[[], None]
    repo: Path | None = None
    failed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.smoke, self.dev = self.args.smoke, self.args.device

    def note(self, text: str) -> None:
        self.record["notes"].append(text)
        print(f"[gpu] {self.record['name']}: {text}", flush=True)

    def run(self, argv: list[str], key: str, title: str, *, share: float = 1.0, probe: bool = False, per: int = 0,
            cwd: Path | None = None, read: Callable[[str], list[dict]] | None = None, **extra: Any) -> list | None:
        """Run `argv` (`bench ...`: `suite bench` with `--json FILE` and, for `per` runs in it, `--timeout`) in
        `share` of the stage's time left; its rows (`read(output)`, else the JSON's, None if it failed) go to table
        `key` with the `extra` columns. A failure crashes the stage unless `probe` (a search step)."""
        left = self.deadline - time.monotonic()
        limit, path = min(share * left, left - 0.5), self.work / f"{self.record['name']}-{len(self.record['commands'])}"
        if limit < 2:
            return self.note(f"not run, the stage's slice is spent: {' '.join(argv[:4])}")
        if argv[0] == "bench":
            argv = [sys.executable, "-m", SUITE, *argv, "--json", f"{path}.json"]
            argv += ["--timeout", str(max(5, int(limit / per) - 3))] if per else []
        if self.args._inject.get(self.record["name"]):
            argv = [sys.executable, "-c", _INJECT[self.args._inject[self.record["name"]]]]
        shown = " ".join(["suite", *argv[3:]] if argv[2:3] == [SUITE] else ["python", *argv[1:]])
        shown = shown.replace(f"{self.work}/", "")
        done = {"command": shown, "outcome": "stopped from outside (SIGTERM)", "seconds": 0.0, "limit_s": int(limit)}
        self.record["commands"].append(done)
        cuda = self.dev == "cuda"  # then compiled Triton, nothing left over from a CPU test run; else no CUDA at all
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" or not cuda}
        env.update(PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1", **({} if cuda else {"CUDA_VISIBLE_DEVICES": ""}))
        t0, out = time.monotonic(), Path(f"{path}.out")
        self.log.write(f"\n$ {shown}  (limit {limit:.0f} s)\n")
        self.log.flush()
        try:
            got = run_side(Side(shown, argv, timeout=limit, cwd=str(cwd or self.work), env=env, log=str(out),
                                measure=False))
        finally:
            text = out.read_text(errors="replace") if out.exists() else ""
            self.log.write(text)
            self.log.flush()
            done["seconds"] = round(time.monotonic() - t0, 1)
        code, done["outcome"] = got.returncode, got.outcome(text)
        if code != 0 and not probe:
            self.failed.append(done["outcome"])
        rows = None
        try:  # a reader of the output reads a failed command's too (pytest's failures, a child's missing line)
            rows = read(text) if read else json.loads(Path(f"{path}.json").read_text())["rows"] if code == 0 else None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.note(f"{shown}: no rows ({type(exc).__name__}: {exc})")
        if rows:
            table = self.record["tables"].setdefault(key, {"title": title, "rows": []})
            table["rows"] += [{**extra, **r} for r in rows]
        self.save()
        return rows


def _junit(path: Path) -> list[dict]:
    """pytest's counts from its JUnit XML (`--junitxml`), and the failing tests."""
    suite = next(ET.parse(path).getroot().iter("testsuite"))  # the root, or its one child (<testsuites>)
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failing = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
               if c.find("failure") is not None or c.find("error") is not None]
    return [{"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
             "errors": n["errors"], "skipped": n["skipped"], "failing": "; ".join(failing[:20])}]


# ---- the stages -----------------------------------------------------------------------------------------------


def _checks(s: _Stage) -> None:
    """The kernels against float64 (Triton compiled) and Gemini against torch AdamW on the device: `gpu` tests."""
    if s.repo is None:
        return s.note("no tests folder beside the package (an installed copy): pytest -m gpu not run")
    xml = s.work / "pytest.xml"
    s.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={xml}",
           *PARITY_TESTS], "pytest", "pytest -m gpu " + " ".join(PARITY_TESTS), probe=True, cwd=s.repo,
          read=lambda _: _junit(xml))


def _kernels(s: _Stage) -> None:
    """`suite bench kernels --floor` at Evoformer (N_res 512, 4 heads) and SD (L 4096, 8 heads) sizes, fwd+bwd:
    one command per size family, so a cut-off run keeps the first family's rows."""
    runs = [["--suites", "diffusion", "--ops", "layer_norm", "--seq", "16", "--repeat", "1"]] if s.smoke else [
        ["--suites", "evoformer", "--n-res", "512", "--heads", "4", "--repeat", "5"],
        ["--suites", "diffusion", "--seq", "4096", "--diffusion-heads", "8", "--repeat", "5"]]
    title = "time ratio = ours / baseline, below 1 is faster; mem ratio: extra memory of one call"
    for i, flags in enumerate(runs):
        s.run(["bench", "kernels", "--device", s.dev, "--modes", "fwd+bwd", "--floor", "--timeout", "120", *flags],
              "kernels", title, share=1 / (len(runs) - i))


def _sd(s: _Stage) -> None:
    """`suite bench diffusion` at SD-1.5's size, bf16, UNet alone: batch 1, then larger until one fails."""
    argv = ["bench", "diffusion", "--device", s.dev, "--encoders", "none", "--mixed_precision", "bf16",
            "--gemini_offload", "cpu", "--chunk_mb", "0", *(SD_SMOKE if s.smoke else SD15), "--warmup", "1",
            "--steps", "1" if s.smoke else "3"]
    title = ("SD-1.5's UNet (859.5M, random weights), 512 px, random latents and text states (no VAE, CLIP), bf16; "
             "train_mib / peak_mib: max_memory_allocated growth / total over the steps")
    batches = [1] if s.smoke else [1, 8, 32]
    for i, b in enumerate(batches):
        if not s.run([*argv, "--batch", str(b)], "sd", title, share=0.75 if i == 0 else 1 / (len(batches) - i),
                     probe=i > 0, per=2, batch=b):
            break


def _gemini(s: _Stage) -> None:
    """`suite bench gemini --ranks 1` at 1B; Gemini again with a memory snapshot when its peak is above FSDP2's;
    the CPU tier on a model whose states exceed 24 GiB (the smoke run: one command, Gemini alone with the tier)."""
    base = ["bench", "gemini", "--ranks", "1", "--width", "256" if s.smoke else "4096", "--batch", "4" if s.smoke
            else "16"]
    tier = ["--steps", "1", "--strategies", "gemini", "--offload_tier", "cpu", "--cap_gib", "24"]
    main = [*base, "--params", "1M", *tier] if s.smoke else [*base, "--params", "1B", "--steps", "3", "--strategies",
                                                             "gemini,fsdp2,ddp"]
    rows = s.run(main, "gemini", " ".join(["suite", *main]) + " (one device; fused Adam on every side; peak = "
                 "max_memory_allocated over the steps on CUDA)", share=0.6, per=1 if s.smoke else 3) or []
    peak = {r["strategy"]: r.get("train_peak_MiB") for r in rows}
    if all(isinstance(peak.get(k), float) for k in ("gemini", "fsdp2")) and peak["gemini"] > peak["fsdp2"]:
        detail = [*main[:-1], "gemini", "--memory_snapshot", str(Path(s.args.out).resolve() / "gemini_snapshot.pickle")]
        s.run(detail, "gemini_detail", "Gemini again, alone, torch.cuda.memory history recorded (snapshot for "
              "https://pytorch.org/memory_viz)", share=0.5, per=1)
    elif not s.smoke:
        s.note("no memory snapshot: Gemini's peak is not above FSDP2's (or one of them did not run)")
    if not s.smoke:
        s.run([*base, "--params", "2B", *tier], "gemini_tier", " ".join(["suite", *base, "--params", "2B", *tier])
              + ": master weights and Adam state in the CPU tier (16 B/parameter) on an emulated 24 GiB card", per=1)


def _one_pass(text: str) -> list[dict]:
    got = [r for r in json_lines(text) if "n_res" in r]
    return [{"seconds": r["seconds"], "peak_mib": r["peak_bytes"] / 2**20} for r in got[-1:]]


def _fold(s: _Stage) -> None:
    """`suite bench fold-model`: auto chunks (fastfold's device-aware budget, a quarter of the free memory) vs
    unchunked; then one-pass children (the bench's own): auto chunks with a 24 GiB card's budget at growing N_res
    until one does not fit in 24 GiB, and chunk 4."""
    shape = ["--blocks", "1" if s.smoke else "4", "--extra_blocks", "1", "--n_seq", "4" if s.smoke else "128",
             "--n_extra", "8" if s.smoke else "256", "--dtype", "float32", "--device", s.dev]
    free = (smi("memory.free") if s.dev == "cuda" else ["-"])[0].split()[0]  # "81079 MiB" of the first card
    budget = ["--memory_budget_mb", str(int(free) // 4)] if free.isdigit() else []
    argv = ["bench", "fold-model", "--n_res", "16" if s.smoke else "512,1024", *shape, "--chunk_size", "auto",
            *budget, "--warmup", "0" if s.smoke else "1", "--repeat", "1" if s.smoke else "2"]
    s.run(argv, "fold", " ".join(["suite", *argv]) + " (model_3_ptm's stack at released widths, no recycling; peak "
          "= max_memory_allocated growth over the passes)", share=0.45)
    passes = [] if s.smoke else [(2048, "auto", 24), (512, "4", None), (1024, "4", None), (3072, "auto", 24),
                                 (4096, "auto", 24)]  # the smoke run's time: the same child as the command's
    title = ("one pass, `suite bench fold-model --_child N:chunked`; 24 GiB: --memory_budget_mb 6144 (a quarter "
             "of a 24 GiB card, as auto chunks size themselves there), fits = its peak under 24 GiB")
    search = True
    for i, (n, chunks, card) in enumerate(passes):
        if card and not search:
            continue
        budget = ["--memory_budget_mb", str(card * 256)] if card else []
        rows = s.run(["bench", "fold-model", "--_child", f"{n}:chunked", *shape, "--chunk_size", chunks, *budget,
                      "--warmup", "0", "--repeat", "1"], "fold_passes", title, share=1 / (len(passes) - i),
                     probe=True, read=_one_pass, n_res=n, chunks=chunks, card=f"{card} GiB" if card else "whole")
        if card and not (rows and rows[0]["peak_mib"] <= card * 1024):
            search = False  # the first N_res that does not fit ends the search


# ---- targets: (stage, target, values(tables) -> [(value, text with {} for it)], passes(value) or None) ----------


def _speed(op: str, baseline: str, column: str | None = None) -> Callable[[dict], list]:
    """The kernels' rows of `op` against `baseline`: its speed-up (base / ours), or `column`."""
    return lambda t: [(r[column] if column else r["base ms"] / r["ours ms"], f"{{:.2f}} ({r['size']})")
                      for r in t.get("kernels", []) if (r["op"], r["baseline"]) == (op, baseline) and "ours ms" in r]


def _sides(t: dict) -> dict[int, dict[str, dict]]:
    """batch -> {"plain": row, "ours": row} of `suite bench diffusion`'s rows."""
    by: dict[int, dict[str, dict]] = {}
    for r in t.get("sd", []):
        by.setdefault(r["batch"], {})[r["variant"].split()[0]] = r
    return by


def _gemini_vs(other: str, column: str) -> Callable[[dict], list]:
    def values(t: dict) -> list:
        r = {x["strategy"]: x[column] for x in t.get("gemini", []) if isinstance(x.get(column), float)}
        return [(r["gemini"] / r[other], "{:.3f}")] if "gemini" in r and other in r else []
    return values


def _pytest(t: dict) -> list:
    return [(r["passed"] > 0 and r["failed"] + r["errors"] + r["skipped"] == 0,
             f"{r['passed']} passed, {r['failed']} failed, {r['errors']} errors, {r['skipped']} skipped"
             + (f"; failing: {r['failing']}" if r["failing"] else "")) for r in t.get("pytest", [])]


def _fits_24gib(t: dict) -> list:
    fit = [r["n_res"] for r in t.get("fold_passes", []) if r["card"] == "24 GiB" and r["peak_mib"] <= 24 * 1024]
    return [(max(fit), "largest that fit: {}")] if fit else []


TARGETS = (
    ("checks", "pytest -m gpu: kernels vs float64 (Triton compiled), Gemini vs torch AdamW, fp32 and bf16: all pass",
     _pytest, bool),
    ("kernels", "Triton LayerNorm >= 1.25x F.layer_norm's speed (fwd+bwd, bf16)", _speed("layer_norm", "F.layer_norm"),
     lambda v: v >= 1.25),
    ("kernels", "softmax with mask and bias >= 2x naive torch's speed", _speed("softmax", "naive"), lambda v: v >= 2),
    ("kernels", "biased attention <= 1.0x SDPA with a float mask in time", _speed("attention", "sdpa", "time ratio"),
     lambda v: v <= 1.0),
    ("kernels", "biased attention <= 0.25x SDPA with a float mask in extra memory",
     _speed("attention", "sdpa", "mem ratio"), lambda v: v <= 0.25),
    ("sd", "SD-1.5 512 px: ours' training peak <= 1/5.6 (0.179) of the plain loop's at the same batch",
     lambda t: [(v["ours"]["train_mib"] / v["plain"]["train_mib"], f"{{:.3f}} (batch {b})")
                for b, v in _sides(t).items() if len(v) == 2], lambda v: v <= 1 / 5.6),
    ("sd", "SD-1.5 512 px trains in 8 GiB (ours' device peak at batch 1)",
     lambda t: [(v["ours"]["peak_mib"], "{:.0f} MiB") for b, v in _sides(t).items() if b == 1 and "ours" in v],
     lambda v: v <= 8192),
    ("sd", "plain loop's device peak at batch 1 (reported, no target)",
     lambda t: [(v["plain"]["peak_mib"], "{:.0f} MiB") for b, v in _sides(t).items() if b == 1 and "plain" in v], None),
    ("gemini", "Gemini vs FSDP2 on one device: peak <= 1.0x", _gemini_vs("fsdp2", "train_peak_MiB"),
     lambda v: v <= 1.0),
    ("gemini", "Gemini vs FSDP2 on one device: step <= 1.1x", _gemini_vs("fsdp2", "step_s"), lambda v: v <= 1.1),
    ("gemini", "Gemini vs DDP on one device: step (reported, no target)", _gemini_vs("ddp", "step_s"), None),
    ("gemini", "Gemini's CPU tier trains a model whose states do not fit a 24 GiB card (throughput reported)",
     lambda t: [(r["states_GiB"], f"{{:.1f}} GiB of states, {r['samples_per_s']:.1f} samples/s")
                for r in t.get("gemini_tier", []) if isinstance(r.get("samples_per_s"), float)], lambda v: v > 24),
    ("fold", "fold: auto chunks within 1.3x of unchunked time where unchunked fits",
     lambda t: [(r["time_ratio"], f"{{:.2f}} (N_res {r['n_res']})") for r in t.get("fold", [])], lambda v: v <= 1.3),
    ("fold", "fold: N_res 2048 in 24 GiB with auto chunks", _fits_24gib, lambda v: v >= 2048),
)


def _judge(stage: dict, args: argparse.Namespace) -> list[dict]:
    """The stage's targets from its tables; met only on a full CUDA run (n/a on CPU and in smoke runs)."""
    tables, out = {k: t["rows"] for k, t in stage["tables"].items()}, []
    for name, target, values, passes in (t for t in TARGETS if t[0] == stage["name"]):
        try:
            got = values(tables)
            measured = ", ".join(text.format(v) for v, text in got) or "not measured"
            met = all(passes(v) for v, _ in got) if got and passes else None
        except Exception as exc:  # noqa: BLE001 - rows of an unexpected shape leave this target unjudged
            measured, met = f"not judged: {type(exc).__name__} {exc}", None
        out.append({"stage": name, "target": target, "measured": measured,
                    "met": met if args.device == "cuda" and not args.smoke else None})
    return out


# ---- the parent -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One stage: its share of a `NOMINAL_BUDGET_S` budget, the least time worth starting it with, its commands."""

    name: str
    share_s: float
    minimum_s: float
    what: str
    commands: Callable[[_Stage], None]


STAGES = (
    Stage("checks", 60, 20, "pytest -m gpu: kernels vs float64 (Triton compiled), Gemini vs torch AdamW", _checks),
    Stage("kernels", 90, 30, "suite bench kernels fwd+bwd --floor: LayerNorm, softmax, attention vs torch", _kernels),
    Stage("sd", 110, 40, "suite bench diffusion, SD-1.5 UNet 512 px bf16: plain loop vs ours, batch 1 and up", _sd),
    Stage("gemini", 90, 30, "suite bench gemini at 1B: Gemini vs FSDP2 vs DDP; snapshot; CPU tier beyond 24 GiB",
          _gemini),
    Stage("fold", 70, 25, "suite bench fold-model: auto chunks vs unchunked; largest N_res in 24 GiB; chunk 4", _fold),
)


def run(args: argparse.Namespace) -> int:
    if args.budget_s <= 0:
        raise UsageError(f"--budget-s must be positive, got {args.budget_s}")
    if args.device == "cpu" and not args.smoke:
        raise UsageError("--device cpu runs only with --smoke (the GPU sizes would take hours on a CPU)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: CUDA is not available here (check the command with --device cpu --smoke)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="suite-bench-gpu-"))
    repo = Path(__file__).resolve().parents[2]
    payload = {"benchmark": "gpu", "command": " ".join(["suite", *sys.argv[1:]]) if sys.argv else "",
               "device": args.device, "smoke": args.smoke, "budget_s": args.budget_s, "machine": machine_info(),
               "stages": [], "finished": False}
    t0, bank = time.monotonic(), 0.0

    def save() -> None:
        payload.update(elapsed_s=round(time.monotonic() - t0, 1), targets=[t for s in payload["stages"]
                                                                           for t in s["targets"]])
        for path in filter(None, (out / "gpu.json", getattr(args, "json", None))):  # machine: in the payload
            write_text(path, json.dumps(payload, indent=1, default=str) + "\n")
        write_text(out / "gpu.md", markdown(payload) + "\n")

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with open(out / "gpu.log", "a") as log:
            for stage in (s for s in STAGES if s.name in args.rows):
                left = args.budget_s - (time.monotonic() - t0)
                slice_s = min(stage.share_s * args.budget_s / NOMINAL_BUDGET_S + bank, left)
                if args._inject.get(stage.name) == "hang":
                    slice_s = min(slice_s, 3.0)
                record = {"name": stage.name, "what": stage.what, "slice_s": round(slice_s, 1), "status": "running",
                          "seconds": 0.0, "tables": {}, "notes": [], "commands": [], "targets": []}
                payload["stages"].append(record)
                minimum = max(5.0, stage.minimum_s * min(1.0, args.budget_s / NOMINAL_BUDGET_S))
                if slice_s < minimum and args._inject.get(stage.name) != "hang":
                    record.update(status="skipped", reason=f"needs at least {minimum:.0f} s, {max(0, left):.0f} s left")
                    continue
                log.write(f"\n===== stage {stage.name} (slice {slice_s:.0f} s) =====\n")
                s = _Stage(args, record, time.monotonic() + slice_s, work, log, save,
                           repo if (repo / "tests").is_dir() else None)
                _run_stage(stage, s)
                bank = max(0.0, slice_s - record["seconds"]) if record["status"] == "ok" else 0.0
                save()
                print(f"[gpu] {stage.name}: {record['status']} ({record['seconds']:.0f} s of {slice_s:.0f})",
                      flush=True)
        payload["finished"] = True
    except _Stopped:
        payload["stopped"] = "SIGTERM: the run was stopped from outside; the stages above are what it measured"
    finally:
        signal.signal(signal.SIGTERM, previous)
        save()
        shutil.rmtree(work, ignore_errors=True)  # the commands' outputs are in gpu.log, their rows in gpu.json
    print("\n".join(["", "suite bench gpu", *_overview(payload)]), flush=True)
    print(f"[gpu] wrote {out / 'gpu.json'}, {out / 'gpu.md'}, {out / 'gpu.log'}", flush=True)
    return 0


def _run_stage(stage: Stage, s: _Stage) -> None:
    """The stage's commands, then its status: crashed (a command failed, or this code), timed out (a command was
    killed at its limit), stopped (SIGTERM, raised on) or ok; then its targets."""
    t0, record = time.monotonic(), s.record
    try:
        if s.args._inject.get(stage.name):  # the test hook's one command (see `run`) instead of the stage's
            s.run(["-"], "injected", f"injected {s.args._inject[stage.name]} (test hook)", read=json_lines)
        else:
            stage.commands(s)
        killed = [c["outcome"] for c in record["commands"] if c["outcome"].startswith("killed")]
        record["status"] = "timed out" if killed else "crashed" if s.failed else "ok"
        if killed or s.failed:
            record["reason"] = (killed or s.failed)[0] + " (see gpu.log)"
    except _Stopped:
        record.update(status="stopped", reason="stopped from outside (SIGTERM)")
        raise
    except Exception as exc:  # noqa: BLE001 - the proof's own bug costs this stage, not the run
        record.update(status="crashed", reason=f"{type(exc).__name__}: {exc}")
    finally:
        record["seconds"] = round(time.monotonic() - t0, 1)
        record["targets"] = _judge(record, s.args)


# ---- the report -----------------------------------------------------------------------------------------------


def _overview(payload: dict) -> list[str]:
    """The stages (status, time) and the targets, as Markdown tables."""
    met = {True: "met", False: "**missed**", None: "n/a"}
    lines = ["## Stages", ""] + markdown_table([
        {"stage": s["name"], "status": s["status"], "seconds": s["seconds"], "slice s": s["slice_s"],
         "reason": s.get("reason", ""), "what": s["what"]} for s in payload["stages"]])
    return lines + ["", "## Targets", ""] + markdown_table([
        {"stage": t["stage"], "target": t["target"], "measured": t["measured"], "met": met[t["met"]]}
        for t in payload.get("targets", [])])


def markdown(payload: dict) -> str:
    """The report: machine, stages (status, time), targets, then each stage's tables, notes and commands."""
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
        if not s.get("commands") and not s.get("notes"):
            continue
        lines += ["", f"## {s['name']}: {s['status']}", ""]
        for table in s.get("tables", {}).values():
            lines += [table["title"], ""] + markdown_table(table["rows"]) + [""]
        lines += [f"- {note}" for note in s.get("notes", [])]
        lines += ["", "Commands:", ""] + markdown_table(s.get("commands", []))
    return "\n".join(lines)
