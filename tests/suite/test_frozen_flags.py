"""Every command's flags and defaults, frozen: a change to the command line must update
`tests/assets/cli_flags.json` in the same commit (a user's scripts depend on them).

To accept a deliberate change: `SUITE_UPDATE_FROZEN_FLAGS=1 pytest tests/suite/test_frozen_flags.py`, then
review the file's diff.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

FROZEN = Path(__file__).resolve().parents[1] / "assets" / "cli_flags.json"


def _value(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_value(x) for x in v]
    return getattr(v, "__name__", None) or type(v).__name__


def _describe(parser: argparse.ArgumentParser, path: str, out: dict) -> None:
    flags = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                _describe(sub, f"{path} {name}", out)
            continue
        key = action.option_strings[-1] if action.option_strings else action.dest
        flags[key] = {
            "aliases": list(action.option_strings[:-1]),
            "default": _value(action.default),
            "type": _value(action.type),
            "choices": _value(list(action.choices)) if action.choices is not None else None,
            "nargs": _value(action.nargs),
            "required": bool(action.required),
            "action": type(action).__name__,
        }
    out[path] = flags


def current_flags() -> dict:
    from lowmem.suite.cli import COMMANDS, build_parser

    out: dict = {}
    for name in COMMANDS:
        parser = build_parser([name])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        _describe(sub.choices[name], f"suite {name}", out)
    return dict(sorted(out.items()))


def test_flags_and_defaults_match_the_frozen_file():
    now = current_flags()
    if os.environ.get("SUITE_UPDATE_FROZEN_FLAGS") == "1":
        FROZEN.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    frozen = json.loads(FROZEN.read_text())
    changes = []
    for cmd in sorted(set(now) | set(frozen)):
        if cmd not in now or cmd not in frozen:
            changes.append(f"{cmd}: {'removed' if cmd not in now else 'added'}")
            continue
        for flag in sorted(set(now[cmd]) | set(frozen[cmd])):
            a, b = frozen[cmd].get(flag), now[cmd].get(flag)
            if a != b:
                changes.append(f"{cmd} {flag}: {a} -> {b}")
    assert not changes, ("the command line changed; if deliberate, rerun with SUITE_UPDATE_FROZEN_FLAGS=1 and "
                         "commit tests/assets/cli_flags.json:\n" + "\n".join(changes[:50]))
