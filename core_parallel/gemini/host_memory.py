"""CPU memory outside the C heap for a CPU device's gathered chunks, and the heap's freed pages handed back.

`HostPages` is a fixed anonymous mapping a gathered chunk (or its flat gradient buffer) lives in; a
`PageRecycler` moves the resident pages of a released mapping to the next one filled, so chunk-sized blocks never
come and go in glibc's heap. `HostHeap` gives back what the heap still frees (gradient shards in CPU memory) with
one `malloc_trim` per step.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch

from ...utils.libc import libc_function

logger = logging.getLogger(__name__)

__all__ = ["HostHeap", "HostPages", "PageRecycler"]

_PAGE = mmap.PAGESIZE


class HostPages:
    """A fixed private anonymous mapping whose pages come and go: CPU memory outside the C heap.

    Gathered chunks and their flat gradient buffers on a CPU device live here rather than in malloc'd
    storage, so chunk-sized blocks never come and go in glibc's heap (where the small tensors autograd saves
    split the holes they leave, and resident memory grew by about one chunk per module call). The mapping's
    address and size never change, so tensors viewing it stay valid; only its pages move (`PageRecycler`).
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(-(-nbytes // _PAGE) * _PAGE, _PAGE)
        self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))

    def tensor(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A [numel] tensor over the mapping (it keeps the mapping alive)."""
        return torch.frombuffer(self._mm, dtype=dtype, count=numel)

    def drop(self) -> None:
        """Return every page to the kernel; the next touch faults in a zero page."""
        self._mm.madvise(mmap.MADV_DONTNEED)


_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4


def _mremap():
    """libc's `mremap`, or None where there is none."""
    return libc_function("mremap", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p],
                         ctypes.c_void_p)


class PageRecycler:
    """Hands the resident pages of released `HostPages` to the next one of the same size that is filled.

    Released mappings keep their pages ("idle", at most `max_bytes`, oldest dropped first). Acquiring a mapping
    that is not resident moves an idle mapping's pages to its address with `mremap(MREMAP_DONTUNMAP)`: a page
    table update, no page faults and no zeroing (0.13 ms instead of 1.2 ms per 4 MiB here). Where `mremap` or
    `MREMAP_DONTUNMAP` (Linux 5.13 for private anonymous memory) is missing, released pages are dropped at
    once and acquiring faults fresh ones in.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._mremap = _mremap() if max_bytes > 0 else None
        self._idle: dict[int, HostPages] = {}  # id -> mapping, oldest first
        self._resident: set[int] = set()  # ids of mappings that hold pages (in use or idle)
        self.idle_bytes = 0
        self.moves = 0

    def acquire(self, pages: HostPages) -> bool:
        """`pages` is about to be written; returns True if it holds old data (False: it reads zeros)."""
        key = id(pages)
        if self._idle.pop(key, None) is not None:
            self.idle_bytes -= pages.nbytes
            return True
        if key in self._resident:
            return True
        donor = next((d for d in self._idle.values() if d.nbytes == pages.nbytes), None)
        self._resident.add(key)
        if donor is None or not self._move(donor, pages):
            return False
        return True

    def release(self, pages: HostPages) -> None:
        """`pages`' data is no longer needed; its pages stay for reuse while there is room."""
        key = id(pages)
        if key not in self._resident or key in self._idle:
            return
        if self._mremap is None:
            self._resident.discard(key)
            pages.drop()
            return
        self._idle[key] = pages
        self.idle_bytes += pages.nbytes
        while self.idle_bytes > self.max_bytes:
            self._drop(next(iter(self._idle.values())))

    def drop_all(self) -> None:
        """Give every idle page back to the kernel."""
        for pages in list(self._idle.values()):
            self._drop(pages)

    def _drop(self, pages: HostPages) -> None:
        del self._idle[id(pages)]
        self.idle_bytes -= pages.nbytes
        self._resident.discard(id(pages))
        pages.drop()

    def _move(self, donor: HostPages, pages: HostPages) -> bool:
        flags = _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP
        if self._mremap(donor.addr, donor.nbytes, pages.nbytes, flags, pages.addr) != pages.addr:
            err = ctypes.get_errno()
            logger.info("gemini: mremap(MREMAP_DONTUNMAP) unavailable (%s); released CPU chunks drop their pages",
                        os.strerror(err))
            self._mremap = None
            self.drop_all()
            return False
        del self._idle[id(donor)]
        self.idle_bytes -= donor.nbytes
        self._resident.discard(id(donor))  # its range is still mapped, empty: the next touch reads zeros
        self.moves += 1
        return True


def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    return libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int, library="libc.so.6")


class HostHeap:
    """Hands the memory of released gradient shards in CPU memory back to the operating system.

    glibc serves blocks below its mmap threshold (which grows by itself up to 32 MiB once a large block is
    freed) from the heap, and keeps freed heap blocks resident; the small tensors autograd saves split the
    holes such blocks leave, and resident memory creeps up. Gathered chunks and flat gradient buffers stay
    out of the heap (`HostPages`); the gradient shards freed by `zero_grad` are what is left, and one
    `malloc_trim` per step (when at least `min_bytes` were freed) returns their pages. Trimming costs more
    than the heap walk: every page it returns is faulted in again by the next allocations there.
    """

    def __init__(self, enabled: bool, min_bytes: int = 4 << 20) -> None:
        self.min_bytes = min_bytes
        self._trim = _malloc_trim() if enabled else None
        if enabled and self._trim is None:
            logger.info("gemini: no glibc malloc_trim; released CPU buffers go back to the allocator only")
        self.pending = 0
        self.trims = 0

    def released(self, nbytes: int) -> None:
        """`nbytes` of heap memory were freed (given back at the next `trim`)."""
        if self._trim is not None:
            self.pending += nbytes

    def trim(self) -> None:
        """Give the free pages of the heap back, if at least `min_bytes` were freed since the last trim."""
        if self._trim is not None and self.pending >= self.min_bytes:
            self._trim(0)
            self.pending = 0
            self.trims += 1
