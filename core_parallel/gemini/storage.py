"""The three tiers a flat fp32 shard can live in: device, CPU memory, NVMe (memory-mapped file).

The NVMe tier is one file per rank in `offload_dir`, sized at setup for every region that may ever move
there and reserved with `posix_fallocate`: a folder without room fails at setup with a clear error, and
later writes through the mapping can never hit a full disk (which would kill the process with SIGBUS or
leave half-written weights). Every access checks that the file is still linked into the folder, so a
folder that disappears raises `NvmeTierError` instead of silently training on orphaned data.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["TIERS", "HostHeap", "NvmeFile", "NvmeTierError", "TieredBuffer"]

TIERS = ("device", "cpu", "nvme")
_PAGE = mmap.PAGESIZE
_F32 = 4


class NvmeTierError(RuntimeError):
    """The NVMe offload folder is full, missing or was removed while training."""


class NvmeFile:
    """One preallocated, memory-mapped file of fp32 regions. Reserve all regions, then `open()`."""

    def __init__(self, folder: str | os.PathLike, rank: int) -> None:
        self.folder = Path(folder)
        self.path = self.folder / f"gemini-rank{rank}.bin"
        self.size = 0
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None

    def reserve(self, numel: int) -> int:
        """Reserve a page-aligned region of `numel` fp32 elements; returns its byte offset."""
        offset = self.size
        self.size += -(-numel * _F32 // _PAGE) * _PAGE
        return offset

    def open(self) -> None:
        """Create the file, reserve its blocks on disk and map it."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise NvmeTierError(f"offload_dir {self.folder}: cannot create {self.path.name}: {exc.strerror}") from exc
        try:
            _reserve_blocks(fd, max(self.size, _PAGE))
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise NvmeTierError(
                f"offload_dir {self.folder}: cannot reserve {max(self.size, _PAGE) / 2**20:.1f} MiB for the NVMe "
                f"tier ({exc.strerror}); free space there or choose another folder"
            ) from exc
        self._fd = fd
        self._mm = mmap.mmap(fd, max(self.size, _PAGE), flags=mmap.MAP_SHARED)

    def check(self) -> None:
        """Raise `NvmeTierError` if the file was removed (its folder deleted or emptied)."""
        if self._fd is None:
            raise NvmeTierError(f"offload_dir {self.folder}: the NVMe tier is not open")
        if os.fstat(self._fd).st_nlink == 0 or not self.path.exists():
            raise NvmeTierError(
                f"offload_dir {self.folder}: {self.path.name} was removed while training; the parameters and "
                "optimizer states kept there are no longer safe. Restore from the last checkpoint."
            )

    def view(self, offset: int, numel: int) -> torch.Tensor:
        """A writable fp32 tensor over the region at `offset` (after checking the file is still there)."""
        self.check()
        return torch.frombuffer(self._mm, dtype=torch.float32, count=numel, offset=offset)

    def drop_pages(self, offset: int, numel: int) -> None:
        """Let the kernel drop this region from our resident memory (the data stays in the file)."""
        if self._mm is not None and numel > 0:
            self._mm.madvise(mmap.MADV_DONTNEED, offset, -(-numel * _F32 // _PAGE) * _PAGE)

    def close(self, remove: bool = True) -> None:
        """Unmap and close; remove the file unless `remove=False`."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # tensors still view the mapping; the OS unmaps at exit
                logger.debug("NVMe mapping still viewed; left open")
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if remove:
            self.path.unlink(missing_ok=True)


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


class TieredBuffer:
    """A flat fp32 buffer of `numel` elements that lives in one tier and can move between tiers.

    `nvme_offset` is its reserved region in `nvme` (None: this buffer never goes to NVMe). A buffer
    may be unallocated (`allocated` False: gradient shards between `zero_grad` and the next reduce).
    """

    def __init__(
        self, numel: int, tier: str, device: torch.device, nvme: NvmeFile | None = None, nvme_offset: int | None = None
    ) -> None:
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        if tier == "nvme" and (nvme is None or nvme_offset is None):
            raise ValueError("a buffer on the nvme tier needs a reserved NVMe region")
        self.numel, self.tier, self.device = numel, tier, device
        self._nvme, self._offset = nvme, nvme_offset
        self._tensor: torch.Tensor | None = None
        self.allocated = False

    @property
    def nbytes(self) -> int:
        return self.numel * _F32

    def allocate(self, fill: torch.Tensor | None = None) -> None:
        """Give the buffer storage in its tier, zeroed or copied from `fill` ([numel])."""
        if self.tier == "nvme":
            view = self._nvme.view(self._offset, self.numel)
            view.copy_(fill) if fill is not None else view.zero_()
            self._nvme.drop_pages(self._offset, self.numel)
        else:
            device = self.device if self.tier == "device" else torch.device("cpu")
            if fill is None:
                t = torch.zeros(self.numel, dtype=torch.float32, device=device)
            else:
                t = torch.empty(self.numel, dtype=torch.float32, device=device).copy_(fill)
            self._tensor = t
        self.allocated = True

    def view(self) -> torch.Tensor:
        """The data as a [numel] fp32 tensor in its tier (an mmap-backed CPU tensor for nvme)."""
        if not self.allocated:
            raise RuntimeError("buffer is not allocated")
        if self.tier == "nvme":
            return self._nvme.view(self._offset, self.numel)
        return self._tensor

    def done(self) -> None:
        """Finished touching the data for now: NVMe pages may leave resident memory."""
        if self.tier == "nvme":
            self._nvme.drop_pages(self._offset, self.numel)

    def free(self) -> None:
        """Drop the data (gradient shards after the step)."""
        self._tensor = None
        self.allocated = False

    def move(self, tier: str) -> int:
        """Move the data to `tier`; returns the bytes copied."""
        if tier == self.tier:
            return 0
        if tier == "nvme" and self._offset is None:
            raise ValueError("this buffer has no NVMe region reserved")
        if not self.allocated:
            self.tier = tier
            return 0
        data = self.view()
        src = data.clone() if self.tier == "nvme" else data
        self.done()
        self._tensor = None
        self.tier = tier
        self.allocate(fill=src)
        return self.nbytes


def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HostHeap:
    """Hands the memory of released chunk buffers in CPU memory back to the operating system.

    glibc serves blocks below its mmap threshold (which grows by itself up to 32 MiB once a large block is
    freed) from the heap, and keeps freed heap blocks resident. A released chunk leaves such a hole; the
    small tensors autograd saves during forward land in it, the chunk's next gather no longer fits, and
    resident memory grows by about one chunk per module call: 1.6 GiB instead of 0.4 GiB per rank on a
    12.8M-parameter UNet. `malloc_trim` returns the free pages of every hole; it runs once `min_bytes` have
    been released since the last trim, so small chunks do not pay a heap walk (~1 ms) each.
    """

    def __init__(self, enabled: bool, min_bytes: int = 4 << 20) -> None:
        self.min_bytes = min_bytes
        self._trim = _malloc_trim() if enabled else None
        if enabled and self._trim is None:
            logger.info("gemini: no glibc malloc_trim; released CPU chunks go back to the allocator only")
        self.pending = 0
        self.trims = 0

    def released(self, nbytes: int) -> None:
        """`nbytes` of chunk memory were freed; trim the heap once enough has been."""
        if self._trim is None:
            return
        self.pending += nbytes
        if self.pending >= self.min_bytes:
            self.trim()

    def trim(self) -> None:
        """Give the free pages of the heap back now."""
        if self._trim is not None and self.pending:
            self._trim(0)
            self.pending = 0
            self.trims += 1
