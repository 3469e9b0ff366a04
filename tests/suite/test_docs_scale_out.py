"""Issue 37: the documented multi-node and Ray command lines run as written. Every `torchrun`, `ray start` and
`suite ... --ray_address` line of README.md and docs/*.md (a fenced line or an inline code span) is parsed:
torchrun's own parser reads the launcher part, the module or program it names runs its subcommand with `--help`,
and every flag the line gives must be one that subcommand has. The documented two-"node" line on 127.0.0.1 runs
for real: two torchrun launches (c10d rendezvous), one process each, the tiny pipeline, 2 steps."""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lowmem.core_parallel.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
_STARTS = ("torchrun ", "ray start", "suite ")


def _documented() -> list[tuple[str, str]]:
    """(where, command line) of every torchrun / ray start / suite-with---ray_address line in the docs."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fenced = False
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            candidates = [line.strip()] if fenced else re.findall(r"`([^`]+)`", line)
            for text in candidates:
                text = text.strip()
                if not text.startswith(_STARTS) or (text.startswith("suite ") and "--ray_address" not in text):
                    continue
                found.append((f"{doc.name}:{n}", text))
    return sorted(set(found))


DOCUMENTED = _documented()


@functools.cache
def _help(argv: tuple[str, ...]) -> str:
    proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"{' '.join(argv)} --help: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    return proc.stdout


def _flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--") and t != "--help"]


def _check_flags(where: str, tokens: list[str], help_text: str, what: str) -> None:
    for flag in _flags(tokens):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), f"{where}: {what} has no {flag}"


def _suite_argv(tokens: list[str], module: str | None) -> tuple[tuple[str, ...], list[str]]:
    """The command that runs the suite part (`python -m MODULE` or the `suite` program) up to its first flag,
    and the rest."""
    words = [t for t in tokens[:next((i for i, t in enumerate(tokens) if t.startswith("-")), len(tokens))]
             if t != "..."]
    launcher = (sys.executable, "-m", module) if module else (str(BIN / "suite"),)
    return (*launcher, *words), tokens[len(words):]


def test_the_docs_have_the_scale_out_lines():
    text = "\n".join(line for _, line in DOCUMENTED)
    assert "-m lowmem.suite" in text and "--no-python suite" in text and "ray start --head" in text, DOCUMENTED
    assert not re.search(r"-m suite\b", text), "`-m suite` is no module: the module is lowmem.suite"


@pytest.mark.parametrize(("where", "line"), DOCUMENTED, ids=[w for w, _ in DOCUMENTED])
def test_documented_line_parses_and_its_flags_exist(where, line):
    tokens = [t for t in shlex.split(line) if t != "..."]
    if tokens[0] == "ray":
        _check_flags(where, tokens[2:], _help((str(BIN / "ray"), "start")), "ray start")
        return
    if tokens[0] == "suite":
        argv, rest = _suite_argv(tokens[1:], None)
        _check_flags(where, rest, _help(argv), " ".join(argv[1:]))
        return
    from torch.distributed.run import get_args_parser

    try:
        args = get_args_parser().parse_args(tokens[1:])
    except SystemExit:
        pytest.fail(f"{where}: torchrun does not accept {line!r}")
    if args.module:
        assert args.training_script == "lowmem.suite", f"{where}: -m {args.training_script}: the module is lowmem.suite"
        argv, rest = _suite_argv(args.training_script_args, "lowmem.suite")
    else:
        assert args.no_python and args.training_script == "suite", f"{where}: runs {args.training_script!r}"
        argv, rest = _suite_argv(args.training_script_args, None)
    _check_flags(where, rest, _help(argv), " ".join(argv[-2:]))


@pytest.mark.distributed
def test_the_documented_two_node_line_trains_on_127_0_0_1(tmp_path):
    """The docs' try-it-on-one-machine line, run twice as two nodes (a free port, the output under tmp_path)."""
    line = next(text for _, text in DOCUMENTED if text.startswith("torchrun ") and "127.0.0.1" in text)
    tokens = shlex.split(line)
    port = free_port()
    tokens = [re.sub(r"^127\.0\.0\.1:\d+$", f"127.0.0.1:{port}", t) for t in tokens]
    tokens[tokens.index("--output_dir") + 1] = str(tmp_path / "out")
    tokens[tokens.index("--rdzv-id") + 1] = f"test{port}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([str(BIN / "torchrun"), *tokens[1:]], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for _ in range(2)]
    try:
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    assert (tmp_path / "out" / "model_index.json").is_file() and (tmp_path / "out" / "unet").is_dir()
    assert sum("GLOBAL_RANK: 1, MEMBER: 2/2" in log for log in logs) == 1, "not one run of two ranks"
    assert not list((tmp_path / "out").glob(".lowmem-probe-*")), "the shared-output probes were left behind"
