"""Shared pieces of the benchmarks: timing, peak memory, the printed table and the JSON file."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

__all__ = [
    "ddp_options",
    "fast_optimizer",
    "fix_malloc",
    "fixed_mmap_threshold",
    "hwm_bytes",
    "machine_info",
    "malloc_trim",
    "peak_rss_bytes",
    "reset_peak_rss",
    "rss_bytes",
    "print_table",
    "time_fn",
    "write_json",
]


def time_fn(
    fn: Callable[[], Any], *, warmup: int = 1, repeat: int = 3, sync: Callable[[], None] | None = None
) -> float:
    """Median wall time of `fn()` in seconds over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int:
    """Resident set size of this process now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_bytes() -> int:
    """Peak resident set since start or since the last `reset_peak_rss()` (Linux VmHWM); the unresettable
    `peak_rss_bytes()` where /proc has no VmHWM."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_rss_bytes()


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5" resets the peak resident set size (Linux >= 4.0)
        return True
    except OSError:
        return False


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def fix_malloc(mmap_threshold: int, trim_threshold: int | None = None) -> None:
    """Fix glibc's mmap threshold (no dynamic growth), so freed large tensors leave the resident set and RSS
    follows live data; optionally its trim threshold. Does nothing without glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return
    libc.mallopt(-3, mmap_threshold)  # M_MMAP_THRESHOLD
    if trim_threshold is not None:
        libc.mallopt(-1, trim_threshold)  # M_TRIM_THRESHOLD


MMAP_THRESHOLD = 65536
"""glibc's mmap threshold (bytes) in the processes of a memory pass."""


@contextlib.contextmanager
def fixed_mmap_threshold() -> Iterator[None]:
    """Processes started inside this block run with glibc's mmap threshold fixed at `MMAP_THRESHOLD`: large
    blocks come straight from mmap and go back to the system when freed, so the peak resident set follows the
    peak of live tensors instead of the heap's high-water mark. glibc reads `MALLOC_MMAP_THRESHOLD_` once when a
    process starts, so the setting travels in this process's environment (spawned ranks and subprocesses inherit
    it); this process's own allocator is unchanged (`fix_malloc` changes it), and the environment is restored
    on exit. Timing passes run outside it: the default allocator's block reuse is what users get."""
    name = "MALLOC_MMAP_THRESHOLD_"
    saved = os.environ.get(name)
    os.environ[name] = str(MMAP_THRESHOLD)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc); does nothing elsewhere."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def fast_optimizer(cls: type, params: Any, **kwargs: Any) -> tuple[Any, str]:
    """`cls(params, fused=True, **kwargs)` where this build and device have the fused kernel, else `foreach=True`,
    else the per-tensor loop: a baseline at its best, as its users would run it. Returns (optimizer, which ran:
    "fused", "foreach" or "for-loop")."""
    params = list(params)
    for flag in ("fused", "foreach"):
        try:
            return cls(params, **{flag: True}, **kwargs), flag
        except (RuntimeError, ValueError, TypeError):
            continue  # this optimizer, device or dtype has no such implementation here
    return cls(params, **kwargs), "for-loop"


def ddp_options() -> dict[str, Any]:
    """Keyword arguments of every DDP baseline: gradients live in the all-reduce buckets (no second copy)."""
    return {"gradient_as_bucket_view": True}


def machine_info() -> dict[str, Any]:
    """Date, host and devices, recorded with every JSON result."""
    import torch

    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }
    if torch.cuda.is_available():
        info["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.3f}"
        return f"{value:.3e}"
    return str(value)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, title: str | None = None) -> str:
    """Print rows as an aligned text table and return the text."""
    if not rows:
        text = f"{title or ''}\n(no rows)\n"
        print(text, end="")
        return text
    columns = list(columns or rows[0].keys())
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells)
    text = "\n".join(lines) + "\n"
    print(text, end="", flush=True)
    return text


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    """Write `payload` (plus machine info) to `path` atomically; nothing when `path` is None."""
    if not path:
        return
    payload = {"machine": machine_info(), **payload}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    os.replace(tmp, path)
