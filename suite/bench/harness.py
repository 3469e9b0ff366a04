"""The one bench harness: a bench is its rows and its sides; this module runs the sides and publishes the rows.

Sides as processes (`Side`, `run_side`, `whole_rows`: a memory cgroup under an optional cap, a time limit, peak,
wall time, `emit`ted rows and `log_step` times read back); sides as ranks (`step_times`, `peak_over`); baselines at
their best (`train_side`, `fast_optimizer`, `ran`); `publish`: tables, `--json`, `--markdown`, `--plot`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import importlib.metadata
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ...utils.fileio import atomic_write, drop_page_cache
from ...utils.memory_meter import hwm_bytes, reset_peak_rss, run_command

__all__ = ["DDP_OPTIONS", "SUITE", "WHOLE_RATIOS", "Side", "SideRun", "add_output_arguments", "add_ratios", "child",
           "child_main", "count", "csv_metric", "csv_step_seconds", "drop_cached", "emit", "emulate_card",
           "fast_optimizer", "int_list", "json_lines", "log_step", "machine_info", "markdown_table", "median", "mib",
           "names", "optimizer_impl", "peak_over", "plot", "publish", "ran", "ratio", "run_side", "safe_env",
           "save_figure", "smi", "step_seconds", "step_times", "text_table", "time_fn", "timed", "torch_device",
           "train_side", "train_step", "whole_rows", "write_json", "write_text"]

SUITE = __package__.rpartition(".")[0]
"""The suite's import name (`lowmem.suite`), for `python -m`."""


# ---- flags ----------------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """`256,512` -> [256, 512]: positive integers, comma-separated."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def count(text: str) -> int:
    """A parameter count: `20M`, `1.5B`, `100K` or a plain number."""
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
    t = text.strip().upper()
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(float(t))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count like 20M or 1.5B") from None


def names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """A flag type: a comma-separated, non-empty subset of `allowed`."""

    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values or set(values) - set(allowed):
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}, got {text!r}")
        return values

    return parse


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """What every bench writes besides its printed tables."""
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON to FILE")
    parser.add_argument("--markdown", metavar="FILE", default=None, help="also write the tables as Markdown to FILE")
    parser.add_argument("--plot", metavar="FILE", default=None, help="also plot the first table's ratios to FILE")


# ---- timing and baselines -------------------------------------------------------------------------------------


def step_times(step: Callable[[], Any], steps: int, *, warmup: int = 0, sync: Callable[[], None] | None = None,
               before: Callable[[], Any] | None = None) -> list[float]:
    """Seconds of `steps` calls of `step()` after `warmup` untimed ones (`sync` after each, timed; `before`: not)."""
    times = []
    for i in range(warmup + steps):
        if before:
            before()
        t0 = time.perf_counter()
        step()
        if sync:
            sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """`fn(*args, **kwargs)`'s result and its wall seconds."""
    t0 = time.perf_counter()
    return fn(*args, **kwargs), time.perf_counter() - t0


def peak_over(fn: Callable[[], Any], device) -> tuple[Any, int]:
    """`fn()`'s result and the peak memory while it ran, bytes: on CUDA `max_memory_allocated` (reset first), else
    the resident set's high-water mark (VmHWM, reset first where Linux allows; its growth is the caller's)."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    reset_peak_rss()
    out = fn()
    return out, torch.cuda.max_memory_allocated(device) if cuda else hwm_bytes()


def time_fn(fn: Callable[[], Any], *, warmup: int = 1, repeat: int = 3,
            sync: Callable[[], None] | None = None) -> float:
    """Median wall time of `fn()` in seconds over `repeat` runs after `warmup` runs."""
    times = step_times(fn, repeat, warmup=warmup, sync=sync)
    return sorted(times)[len(times) // 2]


def fast_optimizer(cls: type, params: Any, **kwargs: Any) -> tuple[Any, str]:
    """(optimizer, which): `cls(params, **kwargs)` "fused" where this build and device can, else "foreach", else the
    per-tensor "for-loop" (a baseline at its best)."""
    params = list(params)
    for flag in ("fused", "foreach"):
        try:
            return cls(params, **{flag: True}, **kwargs), flag
        except (RuntimeError, ValueError, TypeError):
            continue  # this optimizer, device or dtype has no such implementation here
    return cls(params, **kwargs), "for-loop"


def optimizer_impl(cls: type) -> str:
    """Which implementation `fast_optimizer` picks here for `cls`."""
    import torch

    return fast_optimizer(cls, [torch.nn.Parameter(torch.zeros(1))])[1]


def ran(strategy: str, optimizer: str = "Adam") -> str:
    """What a side ran: Gemini's fused Adam, else torch's `optimizer` as `fast_optimizer` picks it (and DDP's)."""
    if strategy.startswith("gemini"):
        return "gemini fused Adam"
    import torch

    ddp = ", DDP(" + ", ".join(f"{k}={v}" for k, v in DDP_OPTIONS.items()) + ")" if strategy == "ddp" else ""
    return f"torch {optimizer} {optimizer_impl(getattr(torch.optim, optimizer))}{ddp}"


DDP_OPTIONS = {"gradient_as_bucket_view": True}
"""Keyword arguments of every DDP baseline: gradients live in the all-reduce buckets (no second copy)."""


def train_side(strategy: str, model: Any, *, bucket_mb: float = 25.0, gemini: dict | None = None) -> tuple[Any, Any]:
    """(model, Adam at its best) as `strategy` trains them: torch's `ddp` (`DDP_OPTIONS`) and `fsdp2` (`fully_shard`
    each layer with parameters, then the whole) as their users run them, ZeRO `zero1` / `zero2` (buckets of
    `bucket_mb`), `gemini` (GeminiConfig fields `gemini`; `gemini_collective`: no peer reads)."""
    import torch

    from ... import core_parallel

    if strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, **DDP_OPTIONS)
    elif strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (m for m in model if any(True for _ in m.parameters())):
            fully_shard(layer)
        fully_shard(model)
    opt, _ = fast_optimizer(torch.optim.Adam, model.parameters(), lr=1e-4)
    if strategy in ("ddp", "fsdp2"):
        return model, opt
    if strategy.startswith("zero"):
        config = core_parallel.ZeroConfig(stage=int(strategy[-1]), bucket_mb=bucket_mb)
    else:
        config = core_parallel.GeminiConfig(**(gemini or {}), peer_reads=strategy == "gemini")
    return core_parallel.setup(model, opt, config)


def train_step(model: Any, opt: Any, x: Any) -> Callable[[], None]:
    """One training step on `x` (loss: the output's mean square; backward through the optimizer that owns it)."""
    backward = getattr(opt, "backward", lambda loss: loss.backward())

    def step() -> None:
        backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def torch_device(name: str = "auto", rank: int | None = None):
    """The device `name` names ("auto": CUDA where there is one); on CUDA `rank`'s card (modulo the cards; else the
    current one), made current."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cuda":
        return torch.device(name)
    device = torch.device("cuda", torch.cuda.current_device() if rank is None else rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def emulate_card(gib: float | None, device) -> str:
    """Limit this process's CUDA allocator to `gib` GiB and make `torch.cuda.mem_get_info` report that card;
    returns a note (nothing happens on CPU or when the card is smaller)."""
    import torch

    if not gib or device.type != "cuda":
        return "" if not gib else f"no {gib:g} GiB cap on {device.type}"
    cap = int(gib * 2**30)
    total = torch.cuda.get_device_properties(device).total_memory
    if cap >= total:
        return f"the card has {total / 2**30:.1f} GiB: no {gib:g} GiB cap needed"
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    real = torch.cuda.mem_get_info

    def mem_get_info(dev=None):
        free, _ = real(dev)
        return min(free, max(0, cap - torch.cuda.memory_reserved(dev))), cap

    torch.cuda.mem_get_info = mem_get_info
    return f"emulated {gib:g} GiB card (allocator fraction {cap / total:.3f} of {total / 2**30:.1f} GiB)"


# ---- sides as processes ---------------------------------------------------------------------------------------

_STEP = re.compile(r"^plain step \d+/\d+ s ([0-9.]+)", re.M)


def log_step(step: int, steps: int, seconds: float, loss: float) -> None:
    """The line a plain loop prints after each optimizer step, which `step_seconds` reads back."""
    print(f"plain step {step + 1}/{steps} s {seconds:.3f} loss {loss:.4f}", flush=True)


def step_seconds(text: str) -> list[float]:
    """Seconds of each step a plain loop's output reports (its `log_step` lines), in order."""
    return [float(m.group(1)) for m in _STEP.finditer(text)]


def csv_metric(folder: str, column: str) -> list[float]:
    """`column`'s values in `suite diffusion`'s CSV log in `folder` (`logs/csv/metrics.csv`); [] without one."""
    path = os.path.join(folder, "logs", "csv", "metrics.csv")
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [float(r[column]) for r in csv.DictReader(f) if r.get(column)]


def csv_step_seconds(folder: str, batch: int) -> list[float]:
    """Seconds of each step from `suite diffusion`'s CSV log in `folder` (its `images_per_s`: batch / seconds)."""
    return [batch / r for r in csv_metric(folder, "images_per_s") if r > 0]


def drop_cached(folder: str) -> None:
    """Drop `folder`'s files from the page cache, so the next side reads (and is charged for) them itself."""
    for top, _, files in os.walk(folder):
        for name in files:
            drop_page_cache(os.path.join(top, name), write_back=True)


def emit(row: dict) -> None:
    """A side's result: one JSON line on stdout, flushed (`json_lines` and `SideRun.result` read them)."""
    print(json.dumps(row, default=str), flush=True)


def json_lines(text: str) -> list[dict]:
    """Every line of `text` that is a JSON object, in order (a side's `emit`ted rows)."""
    rows = []
    for line in (t for t in text.splitlines() if t.strip().startswith("{")):
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def safe_env(**extra: str) -> dict[str, str]:
    """A child's environment: the installed package, never a checkout's folders first on sys.path (3.11+)."""
    return {**os.environ, "PYTHONSAFEPATH": "1", **extra}


def child(name: str, module: str, spec: dict, **side: Any) -> Side:
    """A side running `python -m module JSON` (`spec`; the module ends with `child_main`) with `safe_env`."""
    return Side(name, [sys.executable, "-m", module, json.dumps(spec)], env=safe_env(), **side)


def child_main(fn: Callable[[dict], dict]) -> None:
    """A `child`'s entry point: `fn(spec)`'s row `emit`ted."""
    emit(fn(json.loads(sys.argv[1])))


@dataclass
class Side:
    """One side of a row as a process of its own. `cap_bytes`: its memory cgroup's limit (page cache included);
    `measure` False: no memory figure (it measures itself); `log`: a file for its output (else captured, or with
    `capture` False left on ours)."""

    name: str
    argv: list[str]
    cap_bytes: int | None = None
    timeout: float | None = None
    cwd: str | None = None
    env: dict[str, str] | None = None
    log: str | None = None
    offload_paths: Sequence[str] = ()
    use_cgroup: bool = True
    measure: bool = True
    capture: bool = True


@dataclass
class SideRun:
    """What a side left: exit code (None: killed at its time limit), peak and its method, wall seconds, whether
    the kernel killed it for memory, what it printed."""

    side: Side
    returncode: int | None
    wall_s: float
    peak_bytes: int | None = None
    method: str | None = None
    oom_killed: bool = False
    stdout: str = ""
    stderr: str = ""

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def result(self) -> dict:
        """The side's last JSON line; RuntimeError naming the side, with the end of its stderr, when it failed."""
        lines = json_lines(self.stdout)
        if self.returncode != 0 or not lines:
            raise RuntimeError(f"{self.side.name} failed (exit {self.returncode}): {' '.join(self.side.argv)}\n"
                               f"{(self.stderr or self.stdout)[-2000:]}")
        return lines[-1]

    def step_times(self, csv_folder: str | None = None, batch: int = 1) -> list[float]:
        """Per-step seconds: the `suite diffusion` CSV log in `csv_folder`, else the side's `log_step` lines."""
        return csv_step_seconds(csv_folder, batch) if csv_folder else step_seconds(self.stdout)

    def outcome(self, text: str | None = None) -> str:
        """ok, killed (time limit, memory), OOM, or the exit code and the last line of `text` (default stderr)."""
        text = self.stderr if text is None else text
        if self.timed_out:
            return f"killed at its time limit of {self.side.timeout:.0f} s"
        if self.oom_killed:
            return "killed for memory"
        if self.returncode == 0:
            return "ok"
        if "OutOfMemoryError" in text or "out of memory" in text:
            return "OOM"
        last = text.strip().splitlines()[-1:] or [""]
        return f"exit code {self.returncode}: {last[0][:160]}".rstrip(": ")

    def row(self, times: Sequence[float] = ()) -> dict:
        """A whole-command side's row; `times`: its per-step seconds (the median over those after the first)."""
        out = {"returncode": self.returncode, "peak_mib": mib(self.peak_bytes), "wall_s": self.wall_s,
               "method": self.method, "oom_killed": self.oom_killed, "step_times_s": list(times),
               "step_s": median(times[1:]), "command": " ".join(self.side.argv)}
        if self.side.cap_bytes:  # held to its cap where the kernel enforced one (`method` says)
            out["cap_mib"] = self.side.cap_bytes / 2**20
            if self.peak_bytes:
                out["under_cap"] = self.peak_bytes <= self.side.cap_bytes and not self.oom_killed
        return out


def mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def run_side(side: Side) -> SideRun:
    """Run `side` to its exit or its time limit (then its process group is ended), measured in its own memory
    cgroup from its first instruction, under its cap (`utils.memory_meter.run_command`)."""
    with contextlib.ExitStack() as files:
        log = files.enter_context(open(side.log, "w")) if side.log else None
        captured = log is None and side.capture
        out, err = (files.enter_context(tempfile.TemporaryFile("w+")) if captured else log for _ in range(2))
        t0 = time.perf_counter()
        try:
            got = run_command(side.argv, timeout=side.timeout, use_cgroup=side.use_cgroup, cap_bytes=side.cap_bytes,
                              offload_paths=side.offload_paths, env=side.env, cwd=side.cwd, stdout=out,
                              stderr=subprocess.STDOUT if log else err, start_new_session=True, measure=side.measure)
        except subprocess.TimeoutExpired:
            got = {"returncode": None, "wall_s": time.perf_counter() - t0, "peak_bytes": None, "method": None}
        run = SideRun(side, got["returncode"], got["wall_s"], got["peak_bytes"], got["method"],
                      bool(got.get("oom_kills")))
        if captured:
            for f in (out, err):
                f.seek(0)
            run.stdout, run.stderr = out.read(), err.read()
        elif log:
            log.flush()
            with open(side.log, errors="replace") as f:
                run.stdout = f.read()  # its log: stdout and stderr
        return run


def whole_rows(sides: Sequence[Side], labels: Sequence[dict], *, drop: Sequence[str] = (), batch: int = 1,
               strict: bool = False, compare: bool = True) -> list[dict]:
    """Whole commands side by side, each after `drop`'s files left the page cache: its label, then `SideRun.row`
    with its step times (its `--output_dir`'s CSV log, else its `log_step` lines); with `compare`, ratios against
    the first side. `strict`: a side that fails, not killed for memory, raises."""
    rows = []
    for side, label in zip(sides, labels):
        for folder in drop:
            drop_cached(folder)
        got = run_side(side)
        if strict and got.returncode != 0 and not got.oom_killed:
            raise RuntimeError(f"{side.name}: {' '.join(side.argv)} exited with {got.returncode}:\n"
                               f"{(got.stderr or got.stdout)[-3000:]}")
        out = side.argv[side.argv.index("--output_dir") + 1] if "--output_dir" in side.argv else None
        rows.append({**label, **got.row(got.step_times(out, batch))})
    if compare and rows:
        add_ratios(rows[1:], rows[0], WHOLE_RATIOS)
    return rows


WHOLE_RATIOS = {"peak_ratio": "peak_mib", "wall_ratio": "wall_s", "step_ratio": "step_s"}
"""The ratios of a whole-command side against its baseline (`whole_rows`)."""


# ---- rows -----------------------------------------------------------------------------------------------------


def ratio(a: Any, b: Any, default: Any = None) -> Any:
    """a / b, `default` when either is missing (None, a string) or b is 0."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not b:
        return default
    return a / b


def add_ratios(rows: Iterable[dict], base: dict | None, pairs: dict[str, str], default: Any = None) -> None:
    """For every row, `row[out] = row[key] / base[key]` for each `out: key` of `pairs` (`default` without a base)."""
    for r in rows:
        for out, key in pairs.items():
            r[out] = ratio(r.get(key), base.get(key), default) if base else default


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.3f}"
        return f"{value:.3e}"
    return str(value)


def _present(rows: Sequence[dict], columns: Sequence[str] | None) -> list[str]:
    """The columns to show: those given that some row has, or every key in order of first appearance."""
    if columns is None:
        return list(dict.fromkeys(k for r in rows for k in r))
    return [c for c in columns if any(c in r for r in rows)]


def text_table(rows: Sequence[dict], columns: Sequence[str] | None = None, title: str | None = None) -> str:
    """Rows as an aligned text table (columns that no row has are left out)."""
    if not rows:
        return f"{title or ''}\n(no rows)\n"
    columns = _present(rows, columns)
    cells = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [title] if title else []
    for row in (columns, ["-" * w for w in widths], *cells):  # the header, its rule, the rows
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    return "\n".join(lines) + "\n"


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> list[str]:
    """Rows as Markdown table lines: booleans yes / **no**, numbers as in the text table, `|` escaped."""
    if not rows:
        return ["(no rows)"]
    columns = _present(rows, columns)

    def cell(value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "**no**"
        if isinstance(value, (dict, list)):
            value = json.dumps(value, default=str)
        return "" if value is None else _cell(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]


def smi(query: str) -> list[str]:
    """nvidia-smi's answer, one line per card (no CUDA context in this process: it would hold device memory)."""
    try:
        got = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return [line.strip() for line in got.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"nvidia-smi failed: {exc}"]


def machine_info() -> dict[str, Any]:
    """Date, host, versions and GPUs (through nvidia-smi), recorded with every JSON result."""
    info: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            "host": platform.node(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
                            "machine": platform.machine()}
    for name in ("torch", "triton", "diffusers", "transformers"):
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = None
    if shutil.which("nvidia-smi"):
        import torch

        info.update(cuda=torch.version.cuda, gpus=smi("name,memory.total,driver_version"))
    return info


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` atomically (`utils.fileio.atomic_write`: a reader never sees half a file)."""
    with atomic_write(path) as f:
        f.write(text)


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write `payload` (plus machine info) to `path` atomically; nothing when `path` is None."""
    if path:
        write_text(path, json.dumps({"machine": machine_info(), **payload}, indent=2, default=str))


def plot(rows: Sequence[dict], path: str, title: str = "") -> None:
    """A bar chart of the rows' ratio columns (`*ratio*`, `*_vs_*`; else every numeric one), a group per row
    labelled by its first column (and its second where the first repeats), to `path` (PNG, SVG, PDF)."""
    from matplotlib.figure import Figure

    keys = _present(rows, None)
    numeric = [c for c in keys if any(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool)
                                      for r in rows)]
    ys = [c for c in numeric if "ratio" in c or "_vs_" in c] or numeric
    labels = [str(r.get(keys[0], "")) for r in rows]
    if len(set(labels)) < len(labels) and len(keys) > 1:  # the first column does not tell the rows apart
        labels = [f"{a} {_cell(r.get(keys[1], ''))}" for a, r in zip(labels, rows)]
    fig = Figure(figsize=(max(6.0, 1.2 * len(rows) * max(1, len(ys))), 4))
    ax = fig.subplots()
    width = 0.8 / max(1, len(ys))
    for i, col in enumerate(ys):
        values = [r.get(col) if isinstance(r.get(col), (int, float)) else 0.0 for r in rows]
        ax.bar([k + i * width for k in range(len(rows))], values, width, label=col)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(rows))], labels, rotation=20, ha="right", fontsize=8)
    if any("ratio" in c or "_vs_" in c for c in ys):
        ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title(title[:120], fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def save_figure(fig: Any, path: str) -> None:
    """Lay `fig` (a `matplotlib.figure.Figure`, no pyplot: no backend to choose, nothing to close) out and write it
    to `path` (its folder made; PNG, SVG, PDF by the suffix)."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)


def publish(args: argparse.Namespace, payload: dict[str, Any],
            tables: Sequence[tuple[str | None, Sequence[dict], Sequence[str] | None]] = (),
            notes: Sequence[str] = (), plotter: Callable[[Sequence[dict], str, str], None] | None = None) -> None:
    """Print each (title, rows, columns) table and the notes; `payload` to `--json`, the tables to `--markdown`,
    the first table to `--plot` (by `plotter`(rows, path, title); default `plot`: its ratios)."""
    for title, rows, columns in tables:
        print(text_table(rows, columns, title), end="", flush=True)
    for note in notes:
        print(note, flush=True)
    write_json(getattr(args, "json", None), payload)
    if getattr(args, "markdown", None):
        lines = [f"# suite bench {payload.get('benchmark', '')}", ""]
        for title, rows, columns in tables:
            lines += ([title, ""] if title else []) + markdown_table(rows, columns) + [""]
        write_text(args.markdown, "\n".join(lines + [f"- {n}" for n in notes]) + "\n")
    if getattr(args, "plot", None) and tables and tables[0][1]:
        (plotter or plot)(tables[0][1], args.plot, tables[0][0] or "")


def median(values: Sequence[float]) -> float | None:
    """The median, None for no values."""
    return statistics.median(values) if values else None
