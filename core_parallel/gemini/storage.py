"""The three tiers a flat fp32 shard can live in: device, CPU memory, NVMe (memory-mapped file).

The NVMe tier is one file per rank in `offload_dir`, sized at setup for every region that may ever move
there and reserved with `posix_fallocate`: a folder without room fails at setup with a clear error, and
later writes through the mapping can never hit a full disk (which would kill the process with SIGBUS or
leave half-written weights). Every access checks that the file is still linked into the folder, so a
folder that disappears raises `NvmeTierError` instead of silently training on orphaned data.

The folder may be shared (by the ranks of a job, by several jobs, by a stale run): each file has a name of
its own (`gemini-rank{r}-{random}.bin`), is created with `O_EXCL | O_NOFOLLOW` (never through a planted link,
never over someone else's file) and is `flock`ed for as long as it is open. It is removed on `close`, when
its `NvmeFile` is collected or the interpreter exits, and otherwise (the owner was killed) by the next run
in that folder, which removes every such file whose lock is free: a live owner always holds its lock.

Two jobs must not share a folder by accident (a copy-pasted `--offload_dir`): each rank also holds
`gemini-rank{r}.lock` there for the run. Within a job every rank number is unique, so a second live job that
opens the folder meets a held rank lock and is refused with one line naming the holder's pid. One process may
open several tiers in one folder (its own lock is shared, counted, and released with the last).

The tier writes through, not into, the page cache: under a memory cgroup (a container, a Slurm job) the page
cache a process fills is charged to it, and a tier kept there would cost the memory it exists to save. Each
region written (`write`, or through the mapping followed by `drop_pages`) starts its writeback at once
(`sync_file_range(SYNC_FILE_RANGE_WRITE)`) and is dropped from the page cache (`posix_fadvise(DONTNEED)`) once
written back, when more than `writeback_lag` bytes are waiting behind it (`flush()` drops them all); a region
read back with `read` is dropped right after, or never enters it: into page-aligned memory (a gathered chunk) it is
read with O_DIRECT where the file system allows. Readahead is off (`POSIX_FADV_RANDOM`): regions are read whole.
Where there is no `sync_file_range` (not Linux) `fdatasync` writes back; on a filesystem whose pages are the
file (tmpfs) the advice does nothing and the tier stays in memory, as it must.

The memory a CPU device's gathered chunks live in (`HostPages`, `PageRecycler`, `HostHeap`) is another matter,
in `host_memory.py`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import threading
import uuid
import weakref
from pathlib import Path

import torch

from ...utils.libc import libc_function
from .host_memory import HostHeap, HostPages, PageRecycler  # importable from here as before

logger = logging.getLogger(__name__)

__all__ = ["TIERS", "WRITEBACK_LAG", "HostHeap", "HostPages", "NvmeFile", "NvmeTierError", "PageRecycler",
           "TieredBuffer", "WriteBehind", "remove_stale_files", "write_back_and_drop"]

TIERS = ("device", "cpu", "nvme")
_PAGE = mmap.PAGESIZE
_F32 = 4
_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4
WRITEBACK_LAG = 16 << 20
"""Bytes written to the NVMe tier that may still be in the page cache (under writeback) before the oldest are
waited for and dropped: the disk writes them back while compute goes on."""


def _page_span(offset: int, nbytes: int) -> tuple[int, int]:
    """(start, length) of the whole pages covering bytes [offset, offset + nbytes): the kernel writes back and
    drops whole pages only, and a region's pages are its own (regions are page-aligned)."""
    start = offset // _PAGE * _PAGE
    return start, -(-(offset + nbytes) // _PAGE) * _PAGE - start


_SFR = libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int)
"""libc's `sync_file_range` (Linux), or None."""


def _advise(fd: int, offset: int, nbytes: int, advice: int) -> None:
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, nbytes, advice)
        except OSError:  # a filesystem that refuses advice: the pages stay cached, nothing is wrong
            pass


def write_back_and_drop(fd: int, offset: int, nbytes: int) -> None:
    """Write the file's bytes [offset, offset + nbytes) back to disk and drop them from the page cache."""
    if _SFR is None or _SFR(fd, offset, nbytes, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER) != 0:
        os.fdatasync(fd)
    _advise(fd, offset, nbytes, getattr(os, "POSIX_FADV_DONTNEED", 4))


class WriteBehind:
    """Keeps what is written to a file out of the page cache: `written(offset, nbytes)` starts writing those bytes
    back to disk (`sync_file_range(SYNC_FILE_RANGE_WRITE)`, no waiting) and, once more than `lag` bytes wait behind
    it, waits for the oldest and drops them (`posix_fadvise(DONTNEED)`); `flush()` does so for all of them."""

    def __init__(self, fd: int, lag: int = WRITEBACK_LAG) -> None:
        self.fd, self.lag = fd, lag
        self._pending: list[tuple[int, int]] = []
        self.pending_bytes = 0
        self._lock = threading.Lock()  # written from the reader thread and this one (a deferred step, a gradient)

    def written(self, offset: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        offset, nbytes = _page_span(offset, nbytes)
        if _SFR is not None:
            _SFR(self.fd, offset, nbytes, _SYNC_WRITE)
        with self._lock:
            self._pending.append((offset, nbytes))
            self.pending_bytes += nbytes
        while (oldest := self._oldest(self.lag)) is not None:
            write_back_and_drop(self.fd, *oldest)

    def _oldest(self, lag: int) -> tuple[int, int] | None:
        """The oldest range still waiting, taken off the list, while more than `lag` bytes wait (None: no more)."""
        with self._lock:
            if not self._pending or self.pending_bytes <= lag:
                return None
            offset, nbytes = self._pending.pop(0)
            self.pending_bytes -= nbytes
            return offset, nbytes

    def flush(self) -> None:
        while (oldest := self._oldest(-1)) is not None:
            write_back_and_drop(self.fd, *oldest)


class NvmeTierError(RuntimeError):
    """The NVMe offload folder is full, missing or was removed while training."""


_NVME_NAME = re.compile(r"gemini-rank\d+-[0-9a-f]{16}\.bin")


class NvmeFile:
    """One preallocated, memory-mapped file of regions (fp32, or a frozen chunk's compute dtype). Reserve all
    regions, then `open()`."""

    def __init__(self, folder: str | os.PathLike, rank: int, writeback_lag: int = WRITEBACK_LAG) -> None:
        self.folder = Path(folder)
        self.rank = rank
        self.writeback_lag = writeback_lag
        self._behind: WriteBehind | None = None  # the regions written, under writeback, still in the page cache
        self.path = self.folder / self._new_name()  # the name is final once `open()` succeeds
        self.size = 0
        self._fd: int | None = None
        self._direct: int | None = None  # a second descriptor with O_DIRECT for `read` (None: buffered reads only)
        self.direct_bytes = 0  # bytes `read` took with direct I/O
        self._mm: mmap.mmap | None = None
        self._ino: tuple[int, int] | None = None
        self._finalizer: weakref.finalize | None = None
        self._rank_lock: tuple[str, int] | None = None

    def _new_name(self) -> str:
        return f"gemini-rank{self.rank}-{uuid.uuid4().hex[:16]}.bin"

    def reserve(self, numel: int, itemsize: int = _F32) -> int:
        """Reserve a page-aligned region of `numel` elements of `itemsize` bytes (fp32 by default); returns its
        byte offset."""
        offset = self.size
        self.size += -(-numel * itemsize // _PAGE) * _PAGE
        return offset

    def open(self) -> None:
        """Remove stale files of dead runs, create this run's file, lock it, reserve its blocks and map it."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise NvmeTierError(f"offload_dir {self.folder}: cannot create the folder: {exc.strerror}") from exc
        self._rank_lock = _acquire_rank_lock(self.folder, self.rank)
        try:
            remove_stale_files(self.folder)
            fd = self._create()
        except BaseException:
            _release_rank_lock(self._rank_lock)
            self._rank_lock = None
            raise
        try:
            _reserve_blocks(fd, max(self.size, _PAGE))
        except OSError as exc:
            _unlink_if_same(self.path, fd)
            os.close(fd)
            _release_rank_lock(self._rank_lock)
            self._rank_lock = None
            raise NvmeTierError(
                f"offload_dir {self.folder}: cannot reserve {max(self.size, _PAGE) / 2**20:.1f} MiB for the NVMe "
                f"tier ({exc.strerror}); free space there or choose another folder"
            ) from exc
        self._fd = fd
        self._direct = _open_direct(fd)
        if self._direct is not None:  # closed with the file, or when it is collected (it would keep the inode alive)
            self._direct_closer = weakref.finalize(self, os.close, self._direct)
        self._behind = WriteBehind(fd, self.writeback_lag)
        _advise(fd, 0, 0, getattr(os, "POSIX_FADV_RANDOM", 1))  # regions are read whole: no readahead
        st = os.fstat(fd)
        self._ino = (st.st_dev, st.st_ino)
        self._mm = mmap.mmap(fd, max(self.size, _PAGE), flags=mmap.MAP_SHARED)
        if hasattr(mmap, "MADV_RANDOM"):  # a fault through the mapping reads its page only, not its neighbours
            self._mm.madvise(mmap.MADV_RANDOM)
        # Collected without close() (no one calls it) or at interpreter exit: the file still goes. Only a killed
        # process leaves it, and its lock dies with it, so the next run in this folder removes it.
        self._finalizer = weakref.finalize(self, _release, str(self.path), fd, self._ino, os.getpid(),
                                           self._rank_lock)

    def _create(self) -> int:
        """A new, locked, private file under a fresh name (retried if a name is taken or lost its lock race)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        for _ in range(8):
            try:
                fd = os.open(self.path, flags, 0o600)
            except FileExistsError:
                self.path = self.folder / self._new_name()
                continue
            except OSError as exc:
                raise NvmeTierError(
                    f"offload_dir {self.folder}: cannot create {self.path.name}: {exc.strerror}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # Between create and lock, another run's cleanup may have taken the free lock and unlinked it
                if _same_file(self.path, os.fstat(fd)):
                    return fd
            except BlockingIOError:  # that cleanup holds the lock now and will unlink it
                pass
            os.close(fd)
            self.path = self.folder / self._new_name()
        raise NvmeTierError(f"offload_dir {self.folder}: could not create a file of our own there after 8 tries")

    def check(self) -> None:
        """Raise `NvmeTierError` if the file was removed (its folder deleted or emptied) or replaced."""
        if self._fd is None:
            raise NvmeTierError(f"offload_dir {self.folder}: the NVMe tier is not open")
        if os.fstat(self._fd).st_nlink == 0 or not _same_file(self.path, os.fstat(self._fd)):
            raise NvmeTierError(
                f"offload_dir {self.folder}: {self.path.name} was removed while training; the parameters and "
                "optimizer states kept there are no longer safe. Restore from the last checkpoint."
            )

    def view(self, offset: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A writable tensor over the region at `offset` (after checking the file is still there)."""
        self.check()
        return torch.frombuffer(self._mm, dtype=dtype, count=numel, offset=offset)

    def read(self, offset: int, out: torch.Tensor) -> torch.Tensor:
        """Copy the region at `offset` into `out` (contiguous CPU, the region's dtype) with pread: no page faults;
        the pages read leave the page cache (those still being written back leave when `flush` waits for them).

        Into page-aligned `out` (a gathered chunk's `HostPages`) at a page-aligned offset, whole pages are read with
        O_DIRECT where the file system takes it (no page-cache copy to charge, fill and drop; the kernel writes back
        what of the range is still dirty first), the tail buffered; refused once, direct reads stop for the file."""
        self.check()
        nbytes = out.numel() * out.element_size()
        aligned = self._direct is not None and out.data_ptr() % _PAGE == 0 and offset % _PAGE == 0
        head = nbytes // _PAGE * _PAGE if aligned else 0
        if head:
            flat = out.view(-1).view(torch.uint8)
            try:
                _rw(os.preadv, self._direct, flat[:head], offset)
                self.direct_bytes += head
            except OSError as exc:  # EINVAL: this file system or device will not do it after all
                logger.info("NVMe tier: direct reads refused (%s); reading through the page cache", exc.strerror)
                self._close_direct()
                head = 0
            if head < nbytes:
                _rw(os.preadv, self._fd, flat[head:], offset + head)
        else:
            _rw(os.preadv, self._fd, out, offset)
        if head < nbytes:
            _advise(self._fd, *_page_span(offset + head, nbytes - head), getattr(os, "POSIX_FADV_DONTNEED", 4))
        return out

    def write(self, offset: int, src: torch.Tensor) -> None:
        """Copy `src` (contiguous CPU, the region's dtype) into the region at `offset` with pwrite and start writing
        it back (it leaves the page cache once written, see the module doc). Storing through the mapping costs a write
        fault per page (4 ms per 4 MiB here, against 0.8 ms for pwrite)."""
        self.check()
        _rw(os.pwritev, self._fd, src, offset)
        self._behind.written(offset, src.numel() * src.element_size())

    def _close_direct(self) -> None:
        if self._direct is not None:
            self._direct_closer()
            self._direct = None

    def drop_pages(self, offset: int, numel: int, itemsize: int = _F32) -> None:
        """Let the kernel drop this region (`numel` elements of `itemsize` bytes) from our resident memory and, once
        written back, from the page cache (the data stays in the file)."""
        if self._mm is not None and numel > 0:
            nbytes = -(-numel * itemsize // _PAGE) * _PAGE
            self._mm.madvise(mmap.MADV_DONTNEED, offset, nbytes)
            if self._behind is not None:  # what was stored through the mapping goes to disk, then out
                self._behind.written(offset, nbytes)

    def flush(self) -> None:
        """Wait for every region written to be on disk and drop it from the page cache."""
        if self._behind is not None:
            self._behind.flush()

    def close(self, remove: bool = True) -> None:
        """Unmap, unlock and close; remove the file unless `remove=False`."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._behind = None  # the file goes (or stays, written back by the kernel)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # tensors still view the mapping; the OS unmaps at exit
                logger.debug("NVMe mapping still viewed; left open")
            self._mm = None
        self._close_direct()
        if self._fd is not None:
            if remove:
                _unlink_if_same(self.path, os.fstat(self._fd))
            os.close(self._fd)  # the lock goes with the last descriptor (the mapping's own, if still viewed)
            self._fd = None
        if self._rank_lock is not None:
            _release_rank_lock(self._rank_lock)
            self._rank_lock = None


def _open_direct(fd: int) -> int | None:
    """A second, read-only O_DIRECT descriptor of the file open as `fd` (reopened through /proc, never by its name),
    or None where there is no O_DIRECT or the file system refuses it (tmpfs: EINVAL)."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except (OSError, AttributeError):  # AttributeError: no O_DIRECT on this platform
        return None


def _same_file(path: Path | str, st: os.stat_result | tuple[int, int]) -> bool:
    """Whether `path` (not followed if a link) is the file `st` describes."""
    dev_ino = (st.st_dev, st.st_ino) if isinstance(st, os.stat_result) else st
    try:
        cur = os.lstat(path)
    except OSError:
        return False
    return (cur.st_dev, cur.st_ino) == dev_ino


def _unlink_if_same(path: Path | str, st: os.stat_result | int | tuple[int, int]) -> None:
    if isinstance(st, int):
        st = os.fstat(st)
    if _same_file(path, st):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _release(path: str, fd: int, dev_ino: tuple[int, int], owner: int, rank_lock: tuple[str, int] | None) -> None:
    """Finalizer of an open NvmeFile: remove its file and close its descriptor (never someone else's file)."""
    if os.getpid() != owner:  # a forked child exiting normally: the file is still its parent's
        return
    if rank_lock is not None:
        _release_rank_lock(rank_lock)
    try:
        _unlink_if_same(path, dev_ino)
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass


# (folder, rank) -> [descriptor, users] for the rank locks this process holds
_RANK_LOCKS: dict[tuple[str, int], list[int]] = {}


def _acquire_rank_lock(folder: Path, rank: int) -> tuple[str, int]:
    """Hold `gemini-rank{rank}.lock` in `folder` for this process, or raise `NvmeTierError` naming the live
    process (another job) that holds it. Returns the key to release it with."""
    key = (os.path.realpath(folder), rank)
    if key in _RANK_LOCKS:
        _RANK_LOCKS[key][1] += 1
        return key
    path = os.path.join(key[0], f"gemini-rank{rank}.lock")
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(8):
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            raise NvmeTierError(f"offload_dir {folder}: cannot create {os.path.basename(path)}: {exc.strerror}"
                                + (" (a symbolic link is there)" if exc.errno == errno.ELOOP else "")) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise NvmeTierError(
                f"offload_dir {folder} is in use by another live job (pid {holder} holds rank {rank}'s lock); "
                "give each job its own offload_dir, or wait for that job to end") from None
        if _same_file(path, os.fstat(fd)):  # not unlinked by its previous holder between our open and lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            _RANK_LOCKS[key] = [fd, 1]
            return key
        os.close(fd)
    raise NvmeTierError(f"offload_dir {folder}: could not take rank {rank}'s lock after 8 tries")


def _release_rank_lock(key: tuple[str, int] | None) -> None:
    entry = _RANK_LOCKS.get(key) if key is not None else None
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _RANK_LOCKS[key]
    fd = entry[0]
    try:
        _unlink_if_same(os.path.join(key[0], f"gemini-rank{key[1]}.lock"), os.fstat(fd))
    except OSError:
        pass
    os.close(fd)


def remove_stale_files(folder: str | os.PathLike) -> list[str]:
    """Remove the NVMe files in `folder` whose owner is gone (their lock is free); returns their names.

    Links, other people's files and anything not named like ours are left alone.
    """
    removed = []
    try:
        names = [n for n in os.listdir(folder) if _NVME_NAME.fullmatch(n)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue  # gone, a link (ELOOP), or not ours to read
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live run holds it
            if _same_file(path, st):
                os.unlink(path)
                removed.append(name)
                logger.info("offload_dir %s: removed %s, left by a run that ended without cleaning up "
                            "(%.1f MiB)", folder, name, st.st_size / 2**20)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _rw(op, fd: int, t: torch.Tensor, offset: int) -> None:
    """os.preadv / os.pwritev of a whole contiguous CPU tensor, resuming after short transfers."""
    view = memoryview(t.detach().view(torch.uint8).numpy()).cast("B")  # bytes: numpy has no bfloat16
    done = 0
    while done < len(view):
        n = op(fd, [view[done:]], offset + done)
        if n <= 0:
            raise NvmeTierError(f"NVMe tier: {op.__name__} returned {n} at byte {offset + done}")
        done += n


def _reserve_blocks(fd: int, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        block = b"\0" * (1 << 20)  # filesystems without fallocate: write the zeros ourselves
        for start in range(0, nbytes, len(block)):
            os.pwrite(fd, block[: min(len(block), nbytes - start)], start)
        os.fsync(fd)
        _advise(fd, 0, nbytes, getattr(os, "POSIX_FADV_DONTNEED", 4))


class TieredBuffer:
    """A flat buffer of `numel` elements of `dtype` (fp32: masters, gradients and optimizer states; a frozen chunk's
    master is kept in the compute dtype) that lives in one tier and can move between tiers.

    `nvme_offset` is its reserved region in `nvme` (None: this buffer never goes to NVMe). A buffer
    may be unallocated (`allocated` False: gradient shards between `zero_grad` and the next reduce).
    """

    def __init__(
        self, numel: int, tier: str, device: torch.device, nvme: NvmeFile | None = None, nvme_offset: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        if tier == "nvme" and (nvme is None or nvme_offset is None):
            raise ValueError("a buffer on the nvme tier needs a reserved NVMe region")
        self.numel, self.tier, self.device, self.dtype = numel, tier, device, dtype
        self._nvme, self._offset = nvme, nvme_offset
        self._tensor: torch.Tensor | None = None
        self._region: torch.Tensor | None = None
        self.allocated = False
        # why the data is not valid yet (an optimizer step deferred to the chunk's next gather,
        # `GeminiOptimizer._defer`): reading it then raises instead of handing out the old values
        self.stale: str | None = None

    @property
    def nvme_offset(self) -> int | None:
        """Byte offset of this buffer's reserved region in its NVMe file (None: it never goes there)."""
        return self._offset

    def use_region(self, region: torch.Tensor) -> None:
        """Keep the data in `region` ([numel] CPU memory of this buffer's dtype, e.g. shared with the other ranks)
        whenever it is in memory on a CPU device, instead of a tensor of its own (set before `allocate`)."""
        if region.numel() != self.numel or region.dtype != self.dtype or region.device.type != "cpu":
            raise ValueError(f"a region for this buffer must be [{self.numel}] {self.dtype} on the CPU")
        self._region = region

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def allocate(self, fill: torch.Tensor | None = None, zero: bool = True) -> None:
        """Give the buffer storage in its tier, zeroed or copied from `fill` ([numel]); `zero=False` leaves the
        contents of an in-memory buffer undefined (the caller writes all of it)."""
        if self.tier == "nvme":
            data = fill if fill is not None else torch.zeros(self.numel, dtype=self.dtype)
            self._nvme.write(self._offset, data.detach().to(device="cpu", dtype=self.dtype).contiguous())
            self.done()
        else:
            device = self.device if self.tier == "device" else torch.device("cpu")
            if self._region is not None and device.type == "cpu":
                t = self._region
                if fill is not None:
                    t.copy_(fill)
                elif zero:
                    t.zero_()
            elif fill is None:
                t = (torch.zeros if zero else torch.empty)(self.numel, dtype=self.dtype, device=device)
            else:
                t = torch.empty(self.numel, dtype=self.dtype, device=device).copy_(fill)
            self._tensor = t
        self.allocated = True

    def adopt(self, t: torch.Tensor) -> None:
        """Hold the data in `t` ([numel] of this buffer's dtype in memory, already holding its values) instead of
        storage of its own (a pinned chunk's master, kept in the gathered buffer)."""
        if not self.allocated or self.tier == "nvme" or t.numel() != self.numel or t.dtype != self.dtype:
            raise ValueError(f"cannot adopt a [{t.numel()}] {t.dtype} tensor for a [{self.numel}] {self.dtype} "
                             f"buffer on {self.tier} (allocated: {self.allocated})")
        self._tensor = t

    def view(self) -> torch.Tensor:
        """The data as a [numel] tensor of its dtype in its tier (an mmap-backed CPU tensor for nvme)."""
        if not self.allocated:
            raise RuntimeError("buffer is not allocated")
        self._check_fresh()
        if self.tier == "nvme":
            return self._nvme.view(self._offset, self.numel, self.dtype)
        return self._tensor

    def read_into(self, out: torch.Tensor, lo: int = 0) -> torch.Tensor:
        """Elements [lo, lo + out.numel()) copied into `out` (CPU, contiguous, this buffer's dtype; all of them by
        default); from NVMe without mapping its pages."""
        self._check_fresh()
        if self.tier == "nvme":
            return self._nvme.read(self._offset + lo * self.dtype.itemsize, out)
        return out.copy_(self.view()[lo : lo + out.numel()])

    def _check_fresh(self) -> None:
        if self.stale is not None:
            raise RuntimeError(f"tier buffer read before its pending update: {self.stale}")

    def write_from(self, src: torch.Tensor, lo: int = 0) -> None:
        """Overwrite elements [lo, lo + src.numel()) with `src` (CPU, contiguous, this buffer's dtype; all of them by
        default)."""
        if self.tier == "nvme":
            self._nvme.write(self._offset + lo * self.dtype.itemsize, src)
        else:
            self.view()[lo : lo + src.numel()].copy_(src)

    def done(self) -> None:
        """Finished touching the data for now: NVMe pages may leave resident memory."""
        if self.tier == "nvme":
            self._nvme.drop_pages(self._offset, self.numel, self.dtype.itemsize)

    def free(self) -> None:
        """Drop the data (gradient shards after the step)."""
        self._tensor = None
        self.allocated = False

    def move(self, tier: str, into: torch.Tensor | None = None) -> int:
        """Move the data to `tier`; returns the bytes copied. From NVMe it is read with pread (direct I/O into
        page-aligned memory), not through the mapping, whose page faults took a page each; `into`: [numel] CPU memory
        of this dtype to read it into and keep it in (a pinned chunk's gathered buffer)."""
        if tier == self.tier:
            return 0
        self._check_fresh()
        if tier == "nvme" and self._offset is None:
            raise ValueError("this buffer has no NVMe region reserved")
        if not self.allocated:
            self.tier = tier
            return 0
        if self.tier == "nvme":
            cpu = tier == "cpu" or self.device.type == "cpu"
            dst = into if into is not None else self._region if self._region is not None and cpu else torch.empty(
                self.numel, dtype=self.dtype)
            self._nvme.read(self._offset, dst)
            self.done()
            self.tier = tier
            self._tensor = dst if cpu else dst.to(self.device)
            return self.nbytes
        data = self.view()
        self._tensor = None
        self.tier = tier
        self.allocate(fill=data)
        return self.nbytes
