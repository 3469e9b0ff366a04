"""`suite bench command`: the whole-command peak memory of a command, and of a baseline command beside it, as a
container limit or `/usr/bin/time -v` would see it: the process tree from start to exit, page cache included.

    suite bench command --baseline "python plain_loop.py" --offload_dir /nvme/x -- suite diffusion finetune ...

Each command runs in its own memory cgroup where the machine allows (`memory.peak`; cgroup v1:
`memory.max_usage_in_bytes`), else its tree's RSS is sampled, compared with its `ru_maxrss` and the offload
folders' resident page-cache pages are added (`suite.bench.memory`; the method is printed and written).
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", default=None, help="a second command (one shell-quoted string) to compare with")
    parser.add_argument("--offload_dir", action="append", default=[],
                        help="a folder whose files' page cache counts without a cgroup (repeatable)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per command before it is killed")
    parser.add_argument("--no_cgroup", action="store_true", help="use the RSS + mincore fallback even with cgroups")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to measure")


def _measure(argv: list[str], args: argparse.Namespace) -> dict:
    from .memory import run_command

    out = run_command(argv, offload_paths=args.offload_dir, timeout=args.timeout, use_cgroup=not args.no_cgroup)
    return {"command": " ".join(argv), "returncode": out["returncode"], "peak_MiB": out["peak_bytes"] / 2**20,
            "wall_s": out["wall_s"], "method": out["method"]}


def run(args: argparse.Namespace) -> int:
    import shlex

    from ..errors import UsageError
    from .common import print_table, write_json

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("suite bench command: give the command after --")
    rows = []
    if args.baseline:
        base = shlex.split(args.baseline)
        if not base:
            raise UsageError("--baseline: empty command")
        rows.append({"side": "baseline", **_measure(base, args)})
    rows.append({"side": "command", **_measure(cmd, args)})
    if len(rows) == 2 and rows[0]["peak_MiB"]:
        rows[1]["peak_vs_baseline"] = rows[1]["peak_MiB"] / rows[0]["peak_MiB"]
        rows[1]["time_vs_baseline"] = rows[1]["wall_s"] / rows[0]["wall_s"]
    columns = ["side", "returncode", "peak_MiB", "peak_vs_baseline", "wall_s", "time_vs_baseline", "method", "command"]
    print_table(rows, [c for c in columns if any(c in r for r in rows)],
                title="whole-command peak memory (process tree, start to exit, page cache included)")
    write_json(args.json, {"benchmark": "command", "rows": rows})
    failed = [r for r in rows if r["returncode"] != 0]
    return 1 if failed else 0
