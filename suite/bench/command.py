"""`suite bench command`: the whole-command peak memory of a command, and of a baseline command beside it, as a
container limit or `/usr/bin/time -v` would see it: the process tree from start to exit, page cache included.
"""

from __future__ import annotations

import argparse
import shlex

from ..errors import UsageError
from .harness import Side, add_ratios, mib, publish, run_side

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", default=None, help="a second command (one shell-quoted string) to compare with")
    parser.add_argument("--offload_dir", action="append", default=[],
                        help="a folder whose files' page cache counts without a cgroup (repeatable)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per command before it is killed")
    parser.add_argument("--no_cgroup", action="store_true", help="use the RSS + mincore fallback even with cgroups")
    parser.add_argument("--cap_gib", type=float, default=None,
                        help="run each command in a memory cgroup capped at this many GiB (page cache charged)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to measure")


def run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("suite bench command: give the command after --")
    argvs = {"baseline": shlex.split(args.baseline)} if args.baseline else {}
    if argvs and not argvs["baseline"]:
        raise UsageError("--baseline: empty command")
    cap = int(args.cap_gib * 2**30) if args.cap_gib else None
    rows = []
    for name, argv in {**argvs, "command": cmd}.items():  # the baseline first
        got = run_side(Side(name, argv, cap_bytes=cap, timeout=args.timeout, offload_paths=args.offload_dir,
                            use_cgroup=not args.no_cgroup, capture=False))
        rows.append({"side": name, "command": " ".join(argv), "returncode": got.returncode,
                     "oom_killed": got.oom_killed, "peak_MiB": mib(got.peak_bytes), "wall_s": got.wall_s,
                     "method": got.method})
    if len(rows) == 2 and rows[0]["peak_MiB"]:
        add_ratios(rows[1:], rows[0], {"peak_vs_baseline": "peak_MiB", "time_vs_baseline": "wall_s"})
    columns = ["side", "returncode", "oom_killed", "peak_MiB", "peak_vs_baseline", "wall_s", "time_vs_baseline",
               "method", "command"]
    publish(args, {"benchmark": "command", "rows": rows},
            [("whole-command peak memory (process tree, start to exit, page cache included)", rows, columns)])
    return 1 if any(r["returncode"] != 0 for r in rows) else 0
