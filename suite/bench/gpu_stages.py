"""The stages of `suite bench gpu`, each run in a process of its own by `suite bench gpu --_stage NAME`; every
result is recorded as soon as it is measured (`Recorder`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harness import SUITE, Side, SideRun, run_side, write_text

__all__ = ["Recorder", "StageContext", "checks", "child_env", "kernels", "parse_pytest_summary", "run_child"]

WORKERS = f"{__package__}.gpu_workers"


class Recorder:
    """Tables, notes and targets of one stage, rewritten to `path` (atomically) after every change."""

    def __init__(self, path: str | os.PathLike, deadline: float) -> None:
        self.path, self.deadline = Path(path), deadline
        self.data: dict[str, Any] = {"tables": {}, "notes": [], "targets": []}
        self.flush()

    def left(self) -> float:
        """Seconds until the stage's deadline."""
        return self.deadline - time.time()

    def table(self, key: str, title: str) -> None:
        self.data["tables"].setdefault(key, {"title": title, "rows": []})
        self.flush()

    def add(self, key: str, row: dict) -> None:
        self.data["tables"][key]["rows"].append(row)
        self.flush()

    def rows(self, key: str) -> list[dict]:
        return self.data["tables"].get(key, {}).get("rows", [])

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        print(f"[gpu] {text}", flush=True)
        self.flush()

    def take(self, key: str, child: SideRun | None, what: str, head: dict | None = None, **extra: Any) -> list[dict]:
        """Every JSON row `child` printed into table `key`, between `head` and `extra` (a row holding only a note
        becomes a note); a child that failed leaves a note naming `what`. The rows taken."""
        rows = []
        for row in child.json_lines() if child else []:
            if set(row) == {"note"}:
                self.note(f"{what}: {row['note']}")
                continue
            rows.append({**(head or {}), **row, **extra})
            self.add(key, rows[-1])
        if child is not None and child.returncode != 0:
            self.note(f"{what}: {child.outcome()}")
        return rows

    def target(self, name: str, measured: str, met: bool | None) -> None:
        self.data["targets"].append({"target": name, "measured": measured, "met": met})
        self.flush()

    def flush(self) -> None:
        write_text(self.path, json.dumps(self.data, indent=1, default=str))


def child_env(device: str) -> dict[str, str]:
    """The environment of every child: unbuffered output, the installed package first (no working directory on
    sys.path), and on CUDA compiled Triton (no interpreter left over from a CPU test run)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1"}
    if device == "cuda":
        env.pop("TRITON_INTERPRET", None)
    return env


def run_child(argv: list[str], timeout: float, *, device: str, cwd: str | None = None) -> SideRun:
    """Run `argv` as a side in its own session with a time limit; its stdout and stderr are captured, then copied
    to ours (the log). On the limit the whole process group is ended and what it printed is kept."""
    print(f"[gpu] $ {' '.join(argv)}  (limit {timeout:.0f} s)", flush=True)
    child = run_side(Side(argv[2] if len(argv) > 2 else argv[0], argv, timeout=max(1.0, timeout), cwd=cwd,
                          env=child_env(device), measure=False))
    print(child.stdout, end="", flush=True)
    print(child.stderr, end="", file=sys.stderr, flush=True)
    return child


@dataclass
class StageContext:
    """What every stage needs: where and how to run."""

    device: str
    smoke: bool
    work: Path
    out: Path
    rec: Recorder
    repo: Path | None = None
    python: str = field(default_factory=lambda: sys.executable)

    def suite(self, *argv: str) -> list[str]:
        return [self.python, "-m", SUITE, *argv]

    def worker(self, job: str, **spec: Any) -> list[str]:
        return [self.python, "-m", WORKERS, json.dumps({"job": job, "device": self.device, "smoke": self.smoke,
                                                        **spec})]

    def limit(self, want: float, reserve: float = 0.0) -> float | None:
        """Seconds a child may take: `want`, less if the stage's deadline (keeping `reserve` for what follows) is
        nearer; None when under 5 s would be left."""
        limit = min(want, self.rec.left() - reserve - 2)
        return limit if limit >= 5 else None

    def run(self, argv: list[str], want: float, reserve: float = 0.0, cwd: str | None = None,
            what: str = "") -> SideRun | None:
        """`argv` within `limit(want, reserve)`; None, with a note, when there is no time left for it."""
        limit = self.limit(want, reserve)
        if limit is None:
            self.rec.note(f"not run, the stage's time slice is spent: {what or ' '.join(argv[2:6])}")
            return None
        return run_child(argv, limit, device=self.device, cwd=cwd or str(self.work))

    def run_worker(self, job: str, want: float, reserve: float = 0.0, what: str = "",
                   **spec: Any) -> SideRun | None:
        """A `gpu_workers` job within `limit(want, reserve)`; the job learns its own deadline (`spec["deadline"]`)
        to stop trying larger sizes in time."""
        limit = self.limit(want, reserve)
        if limit is None:
            self.rec.note(f"not run, the stage's time slice is spent: {what or job}")
            return None
        return run_child(self.worker(job, deadline=time.time() + limit - 3, **spec), limit, device=self.device,
                         cwd=str(self.work))


# ---- checks ---------------------------------------------------------------------------------------------------

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")


def parse_pytest_summary(text: str) -> dict[str, int]:
    """Counts from pytest's last summary line ("3 passed, 1 skipped, 900 deselected in 9.1s")."""
    counts = {k: 0 for k in ("passed", "failed", "skipped", "deselected", "errors", "xfailed", "xpassed")}
    lines = [ln for ln in text.splitlines() if re.search(r"\b(passed|failed|skipped|deselected|error|errors|no tests "
                                                       r"ran)\b.* in [\d.]+s", ln)]
    for n, kind in _COUNT.findall(lines[-1] if lines else ""):
        counts["errors" if kind.startswith("error") else kind] += int(n)
    return counts


def _pytest(ctx: StageContext) -> None:
    rec = ctx.rec
    rec.table("pytest", "pytest -m gpu (Triton compiled on CUDA)")
    if ctx.repo is None or not (ctx.repo / "tests").is_dir():
        rec.note("pytest -m gpu: no tests folder beside the package (an installed copy): not run")
        return
    target = "tests/suite/test_bench_gpu.py" if ctx.smoke else "tests"
    argv = [ctx.python, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--continue-on-collection-errors",
            "-rfE", target]
    child = ctx.run(argv, want=90, cwd=str(ctx.repo))
    if child is None:
        return
    counts = parse_pytest_summary(child.stdout)
    failing = [ln.strip() for ln in child.stdout.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    ok = child.returncode == 0 and counts["failed"] == 0 and counts["errors"] == 0
    rec.add("pytest", {"command": f"pytest -m gpu {target}", "outcome": child.outcome(), **counts,
                       "seconds": child.wall_s, "ok": ok, "failing": "; ".join(failing[:20])})
    ran = counts["passed"] + counts["failed"]
    rec.target("pytest -m gpu passes", f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} "
               f"errors, {counts['skipped']} skipped", (ok and ran > 0) if ctx.device == "cuda" else None)


def checks(ctx: StageContext) -> None:
    """The kernels' and Gemini's parity on the device (a table of errors; on CUDA it also fills Triton's cache of
    compiled kernels), then `pytest -m gpu`."""
    rec = ctx.rec
    rec.table("parity", f"parity on {ctx.device}: kernels vs float64 (worst error / bound, <= 1 passes), Gemini vs "
                        "torch AdamW")
    child = ctx.run(ctx.worker("parity"), want=60, reserve=30 if ctx.device == "cuda" else 8)
    rows = rec.take("parity", child, "parity job")
    bad = [f"{r['check']} ({r.get('dtype', '?')})" for r in rows if not r.get("ok")]
    compiled = all("compiled" in r.get("path", "") for r in rows if r["check"].startswith("kernels"))
    cuda, ran = ctx.device == "cuda", bool(rows) and child is not None and child.returncode == 0
    rec.target("kernels and Gemini match their references on the device (fp32, bf16)",
               f"{len(rows) - len(bad)}/{len(rows)} pass" + (f"; failing: {', '.join(bad)}" if bad else ""),
               (ran and not bad) if cuda else None)
    if cuda:
        rec.target("Triton compiled (not interpreted, no fallback) in every kernel check",
                   "yes" if compiled else "no: see the path column", compiled and bool(rows))
    _pytest(ctx)


# ---- kernels --------------------------------------------------------------------------------------------------

_KERNEL_TARGETS = (  # (op, baseline, target, value of a row, passes, format of the value)
    ("layer_norm", "F.layer_norm", "Triton LayerNorm >= 1.25x F.layer_norm's speed (fwd+bwd, bf16)",
     lambda r: r["base ms"] / r["ours ms"], lambda v: v >= 1.25, "x{:.2f}"),
    ("softmax", "naive", "softmax with mask and bias >= 2x naive torch's speed",
     lambda r: r["base ms"] / r["ours ms"], lambda v: v >= 2.0, "x{:.2f}"),
    ("attention", "sdpa", "biased attention <= 1.0x SDPA with a float mask in time",
     lambda r: r["time ratio"], lambda v: v <= 1.0, "{:.2f}"),
    ("attention", "sdpa", "biased attention <= 0.25x SDPA with a float mask in extra memory",
     lambda r: r["mem ratio"], lambda v: v <= 0.25, "{:.2f}"),
)


def _kernel_runs(ctx: StageContext) -> list[tuple[str, list[str]]]:
    if ctx.smoke:
        return [("diffusion", ["--suites", "diffusion", "--ops", "layer_norm", "--seq", "16", "--repeat", "1"])]
    return [("evoformer", ["--suites", "evoformer", "--n-res", "512", "--heads", "4", "--repeat", "5"]),
            ("diffusion", ["--suites", "diffusion", "--seq", "4096", "--diffusion-heads", "8", "--repeat", "5"])]


def kernels(ctx: StageContext) -> None:
    """`suite bench kernels --floor` at Evoformer (N_res 512, 4 heads) and SD (L 4096, 8 heads) sizes, fwd+bwd,
    bf16 on CUDA: one run per size family, so a cut-off run keeps the first family's rows."""
    rec = ctx.rec
    rec.table("kernels", f"suite bench kernels --device {ctx.device} --modes fwd+bwd --floor (time ratio = ours / "
                         "baseline, below 1 is faster; mem = extra memory of one call)")
    runs = _kernel_runs(ctx)
    for i, (family, flags) in enumerate(runs):
        path = ctx.work / f"kernels-{family}.json"
        argv = ctx.suite("bench", "kernels", "--device", ctx.device, "--modes", "fwd+bwd", "--floor",
                         "--timeout", "120", "--json", str(path), *flags)
        child = ctx.run(argv, want=rec.left() / (len(runs) - i))
        if child is None:
            continue
        if not path.exists():
            rec.note(f"kernels {family}: {child.outcome()}, no results written")
            continue
        for row in json.loads(path.read_text())["rows"]:
            rec.add("kernels", row)
    _kernel_targets(ctx)


def _kernel_targets(ctx: StageContext) -> None:
    rows = [r for r in ctx.rec.rows("kernels") if "error" not in r and "ours ms" in r]
    for op, baseline, name, value, passes, fmt in _KERNEL_TARGETS:
        hits = [(r["size"], value(r)) for r in rows if r["op"] == op and r["baseline"] == baseline]
        if not hits:
            ctx.rec.target(name, "not measured", None)
            continue
        measured = ", ".join(f"{fmt.format(v)} ({size})" for size, v in hits)
        ctx.rec.target(name, measured, all(passes(v) for _, v in hits) if ctx.device == "cuda" else None)
