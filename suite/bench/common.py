"""Shared pieces of the benchmarks: timing, peak memory, the printed table and the JSON file."""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

__all__ = [
    "machine_info",
    "peak_rss_bytes",
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
