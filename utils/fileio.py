"""Atomic file and folder writes: a crash or kill mid-write never leaves a half-written file in place.

Files and folders written here get the permissions `open()` and `mkdir()` would give them (0644 and 0755
under umask 022; a file replaced in place keeps its mode), not the private 0600/0700 of `tempfile`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from .libc import libc_function

__all__ = ["atomic_write", "atomic_dir", "drop_page_cache", "fsync_dir", "fsync_file", "replace_dir", "stale_copies",
           "umask"]

logger = logging.getLogger(__name__)


def umask() -> int:
    """The process umask, read without changing it where the OS allows (another thread may be creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file written by someone else's writer (safetensors' `save_file`) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache(path: str | os.PathLike, write_back: bool = False) -> None:
    """Drop `path`'s pages from the page cache (a memory cgroup charges the pages a job reads and writes); with
    `write_back`, its dirty pages are written first (dirty pages cannot be dropped). Best effort: a file that
    cannot be opened, or a platform without `posix_fadvise`, is left as it is."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        if write_back:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """Open a temporary file beside `path`; on success it replaces `path` in one rename.

    On an exception the temporary file is removed and `path` keeps its previous content. The file gets the
    mode `open()` would give it: that of the file it replaces, else 0666 less the umask.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        perms = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        perms = 0o666 & ~umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, perms)
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

    The folder's entries are flushed to disk before it takes the name; see `replace_dir` for the swap.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o777 & ~umask())
        yield tmp
        fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, path, clean=True)


_RENAMEAT2 = libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint],
                           ctypes.c_int)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (Linux `renameat2(RENAME_EXCHANGE)`); False if unsupported."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False  # a file system (or seccomp filter) without the exchange: fall back to two renames
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def stale_copies(path: str | os.PathLike) -> list[Path]:
    """The complete old copies `replace_dir` keeps of `path` while swapping (`.NAME.old-XXXXXXXX`), newest first.

    One outlives the swap only when a crash came between its two renames (where no atomic exchange exists);
    a reader that finds no `path` may use the newest.
    """
    path = Path(path)
    try:
        found = [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.old-") and p.is_dir()]
    except OSError:
        return []
    return sorted(found, key=lambda p: p.stat().st_mtime_ns, reverse=True)


def _clean_stale(path: Path) -> None:
    """Remove what interrupted saves to `path` left beside it: staging folders (`.NAME.*.tmp`, and their own
    `..NAME.*.tmp` stagings) and old copies. One path has one writer at a time, and it is done here."""
    prefixes = (f".{path.name}.", f"..{path.name}.")
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return
    for p in entries:
        if p.name.startswith(prefixes) and (p.name.endswith(".tmp") or p.name.startswith(f".{path.name}.old-")):
            if p.is_dir() and not p.is_symlink():
                logger.info("removing %s, left by an interrupted save", p)
                shutil.rmtree(p, ignore_errors=True)


def replace_dir(staging: str | Path, path: str | Path, *, clean: bool = False) -> None:
    """Make the complete folder `staging` the folder `path`, with a complete `path` at every moment.

    Where the file system can swap two names atomically, `staging` and the old `path` are exchanged and the
    old one removed. Elsewhere the old `path` is moved aside first (`.NAME.old-XXXXXXXX`) and removed last; a
    crash between the two renames leaves it there for readers (`stale_copies`). With `clean`, what earlier
    interrupted saves left beside `path` is then removed: only for a path with one writer at a time (several
    processes racing to create the same folder would remove each other's stagings).
    """
    staging, path = Path(staging), Path(path)
    if path.exists() and _exchange(staging, path):
        fsync_dir(path.parent)
        shutil.rmtree(staging, ignore_errors=True)
    else:
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(path, old)
        os.replace(staging, path)
        fsync_dir(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    if clean:
        _clean_stale(path)
