"""Atomic file and folder writes: a crash or kill mid-write never leaves a half-written file in place."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_write", "atomic_dir", "fsync_dir", "replace_dir"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry to disk (so a rename survives a power cut); a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """Open a temporary file beside `path`; on success it replaces `path` in one rename.

    On an exception the temporary file is removed and `path` keeps its previous content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; on success it becomes `path` (replacing an old one).

    The old folder is moved aside first and removed only after the new one is in place, so at every
    moment either the old or the new complete folder exists under a known name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, path)


def replace_dir(staging: str | Path, path: str | Path) -> None:
    """Move the complete folder `staging` to `path`: the old `path` is moved aside first and removed last,
    so at every moment one complete folder exists (under `path` or its `.old-` name)."""
    staging, path = Path(staging), Path(path)
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(path, old)
    os.replace(staging, path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
