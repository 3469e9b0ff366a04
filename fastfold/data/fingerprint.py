"""What made a target's outputs: a JSON-ready record compared on a rerun, so a finished target is reused only
when every input that shaped it is the same (sequence, models and their parameter files, alignment inputs,
template settings, relaxation, seeds, precision, recycles).

Files are hashed whole (SHA-256), except zip archives (parameter `.npz`, OpenFold `.pt`) over 2 MiB: their
first and last MiB, since the last holds the central directory with every member's CRC-32, so any changed
array shows there without reading hundreds of MiB per target.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["diff", "file_digest", "folder_digest"]

_BLOCK = 1 << 20


def file_digest(path: str | os.PathLike) -> str:
    """`<size>:<sha256>` of the whole file, or of a large zip's first and last MiB (its central directory)."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size > 2 * _BLOCK and zipfile.is_zipfile(f):
            f.seek(0)
            h.update(f.read(_BLOCK))
            f.seek(size - _BLOCK)
            h.update(f.read(_BLOCK))
        else:
            f.seek(0)
            for block in iter(lambda: f.read(_BLOCK), b""):
                h.update(block)
    return f"{size}:{h.hexdigest()[:32]}"


def folder_digest(folder: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, str]:
    """`{file name: file_digest}` of the plain files in `folder` (only `names` when given); {} if absent."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    files = sorted(p for p in folder.iterdir() if p.is_file() and (names is None or p.name in names))
    return {p.name: file_digest(p) for p in files}


_LABELS = {
    "sequence": "sequence",
    "chains": "chains",
    "models": "models/parameters",
    "alignments": "alignments",
    "templates": "templates",
    "relax": "relax",
    "seed": "seed",
    "num_seeds": "seeds per model",
    "precision": "precision",
    "num_recycle": "recycles",
    "b_factors": "B-factors",
}


def diff(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[str]:
    """Human names of the parts of `new` that differ from `old` (["no record of its inputs"] when `old` is
    missing, as for outputs written before fingerprints existed)."""
    if not old:
        return ["no record of its inputs"]
    keys = list(dict.fromkeys([*new, *old]))
    return [_LABELS.get(k, k) for k in keys if old.get(k) != new.get(k)]
