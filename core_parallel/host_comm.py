"""All-gather and reduce-scatter for CPU ranks on one host through one shared-memory segment.

gloo moves a rank's bytes to another through loopback TCP: a 4 MiB all-gather between two local ranks takes
about 5 ms of CPU time, most of it in the kernel's network stack, on the same cores the ranks compute on.
Ranks that share a `/dev/shm` copy instead: each writes its part into its own slot of a segment mapped by all,
meets the others at a barrier, and reads what it needs (well under a millisecond for the same 4 MiB).

- Setup is collective over `group`: rank 0 creates the segment, broadcasts its name, every rank maps it, the
  group agrees that all could (else `HostCollectives.create` returns None and the caller keeps using the
  process group), and rank 0 unlinks the name at once: the memory lives as long as a rank maps it, and a
  crash leaves nothing behind in `/dev/shm`.
- The barrier: each rank bumps its own counter (one writer per cache line), then waits until every counter
  has reached its own. Waiting spins with `sched_yield` for a short while, then sleeps in short naps, so
  more ranks than cores still make progress; a rank that does not arrive within the process group's timeout
  (as its own collectives would wait) raises `PeerLostError`, naming the rank.
- A dead peer ends the wait within a fraction of a second, not after that timeout (`core_parallel.peers`, which
  ZeRO uses too): every rank records its pid,
  pid namespace and process start time in its cache line, and a waiting rank checks in `/proc` that the ranks
  it waits for still run (a zombie, or a pid reused by another process, counts as dead). gloo notices a dead
  peer through its closed socket; shared memory has no such signal. A rank that is alive but busy (validation,
  a slow step, stopped by a debugger) is waited for as long as the timeout allows. Ranks in another pid
  namespace cannot be checked and are waited for up to the timeout.
- x86-64 Linux only (its stores become visible in program order, which the counters rely on).
- Collectives are synchronous and run in the caller's thread, in program order, independently of the
  process group's own collectives.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from .groups import group_timeout, world_rank
from .peers import PeerLostError, identity, running, watchable

__all__ = ["HostCollectives", "PeerLostError", "host_collectives_supported", "map_segment", "wait_until"]

_LINE = 64  # bytes per rank: one cache line each (counter, pid, pid namespace, start time), never shared
_ALIGN = 4096
_SPINS = 2000  # sched_yield rounds before napping
_LIVENESS_S = 0.25  # seconds between checks that the ranks a barrier waits for still run


def host_collectives_supported() -> bool:
    """Whether this machine can run `HostCollectives` (x86-64 Linux with a /dev/shm)."""
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def map_segment(group: dist.ProcessGroup | None, size: int, prefix: str,
                init: Callable[[mmap.mmap], None] | None = None) -> mmap.mmap | None:
    """Collective over `group`: rank 0 creates a `/dev/shm` segment of `size` bytes, every rank maps it and calls
    `init` on it, the group agrees that all could, and rank 0 unlinks the name (the memory lives as long as a rank
    maps it: a crash leaves nothing behind). None on every rank when some rank cannot (another host, another
    /dev/shm, no room, an unsupported platform)."""
    world, rank = world_rank(group)
    supported = host_collectives_supported()
    name: list = [None]
    fd = -1
    if rank == 0 and supported:
        try:
            fd, path = tempfile.mkstemp(prefix=f"{prefix}-{uuid.uuid4().hex[:8]}-", dir="/dev/shm")
            name[0] = path
            os.ftruncate(fd, size)
        except OSError:  # no room in /dev/shm: rank 0 maps nothing below, so every rank falls back
            pass
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    buf = None
    try:
        if name[0] is not None and supported:
            if rank != 0:
                fd = os.open(name[0], os.O_RDWR)
            if os.fstat(fd).st_size == size:
                buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                if init is not None:
                    init(buf)
    except OSError:
        buf = None
    finally:
        if fd >= 0:
            os.close(fd)
    ok = torch.tensor([1 if buf is not None else 0], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if rank == 0 and name[0] is not None:
        os.unlink(name[0])  # every rank has it mapped (or gave up): the name is no longer needed
    if not ok.item():
        if buf is not None:
            buf.close()
        return None
    return buf


def wait_until(ready: Callable[[], bool], timeout: float, check: Callable[[], None],
               expired: Callable[[], BaseException]) -> None:
    """Spin (`sched_yield`), then nap, until `ready()`: `check()` every `_LIVENESS_S` (it raises for an exited
    peer), `expired()`'s error after `timeout` seconds of napping."""
    spins = 0
    deadline = next_check = None
    while not ready():
        spins += 1
        if spins < _SPINS:
            os.sched_yield()
            continue
        now = time.monotonic()
        if deadline is None:
            deadline, next_check = now + timeout, now + _LIVENESS_S
        elif now > deadline:
            raise expired()
        elif now > next_check:
            next_check = now + _LIVENESS_S
            check()
        time.sleep(0.0002)


class HostCollectives:
    """Shared-memory all-gather and reduce-scatter among the ranks of `group` (all on this host). Each rank has
    one slot of `slot_bytes` (rounded up to a page); larger tensors go through it in pieces, so the segment's
    size, which every rank maps and touches, does not grow with the tensors. Build with `create` (collective)."""

    def __init__(self, buf: mmap.mmap, rank: int, world: int, slot_bytes: int, timeout: float) -> None:
        self._buf, self.rank, self.world = buf, rank, world
        self.slot_bytes, self.timeout = slot_bytes, timeout
        self._header = _round_up(world * _LINE, _ALIGN)
        self._counters = np.frombuffer(buf, dtype=np.int64, count=world * _LINE // 8)
        self._arrived = self._counters[:: _LINE // 8]  # each rank's counter (one per cache line)
        # the peers whose process this rank can look up in /proc: (rank, pid, start time)
        self._watched = _watchable_peers(self._counters, rank, world)
        self._seq = 0
        self._fence = threading.Lock()
        self._slots = [torch.frombuffer(buf, dtype=torch.uint8, count=slot_bytes,
                                        offset=self._header + r * slot_bytes) for r in range(world)]

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, slot_bytes: int,
               timeout: float | None = None) -> HostCollectives | None:
        """Collective over `group`: a segment for `world` slots of `slot_bytes`, or None on every rank when
        some rank cannot map it (another host, another /dev/shm, an unsupported platform). `timeout`: seconds a
        barrier waits for the other ranks (None: the process group's own timeout, as its collectives wait)."""
        world, rank = world_rank(group)
        if timeout is None:
            timeout = group_timeout(group)
        slot_bytes = _round_up(max(slot_bytes, 1), _ALIGN)
        size = _round_up(world * _LINE, _ALIGN) + world * slot_bytes
        # identities written before the agreement, so every rank sees every identity once setup is over
        buf = map_segment(group, size, "lowmem-host-comm", init=lambda b: _write_identity(b, rank))
        if buf is None:
            return None
        return cls(buf, rank, world, slot_bytes, timeout)

    # ---- collectives -------------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, src: torch.Tensor) -> None:
        """`out` ([world * n], contiguous CPU) <- every rank's `src` ([n], same dtype) in rank order; in pieces
        of at most a slot."""
        n = src.numel()
        if out.numel() != n * self.world or out.dtype != src.dtype:
            raise ValueError(f"all_gather: out must hold {self.world} x {n} {src.dtype}, got {out.numel()} {out.dtype}")
        src = src.reshape(-1)
        for lo, hi in self._pieces(n, src.dtype):
            self._slot(self.rank, hi - lo, src.dtype).copy_(src[lo:hi])
            self._barrier()
            for r in range(self.world):
                part = out[r * n + lo : r * n + hi]
                part.copy_(src[lo:hi] if r == self.rank else self._slot(r, hi - lo, src.dtype))
            self._barrier()  # every rank has read every slot: they may be written again

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """`out` ([n]) <- the sum over ranks of their `full[rank * n : (rank + 1) * n]` (`full`: [world * n]).

        Per piece of at most a slot, `world - 1` rounds as in a ring: in round j each rank puts the piece rank
        `(rank + j) % world` needs into its slot, and adds the piece rank `(rank - j) % world` put there for it.
        Each rank sums its own part in a fixed order (its own values first)."""
        n = out.numel()
        if full.numel() != n * self.world or out.dtype != full.dtype:
            raise ValueError(f"reduce_scatter: full must hold {self.world} x {n} {out.dtype}, "
                             f"got {full.numel()} {full.dtype}")
        flat = full.reshape(-1)
        out.copy_(flat[self.rank * n : (self.rank + 1) * n])
        for lo, hi in self._pieces(n, full.dtype):
            for j in range(1, self.world):
                dest = (self.rank + j) % self.world
                self._slot(self.rank, hi - lo, full.dtype).copy_(flat[dest * n + lo : dest * n + hi])
                self._barrier()
                out[lo:hi].add_(self._slot((self.rank - j) % self.world, hi - lo, full.dtype))
                self._barrier()

    def barrier(self) -> None:
        """All ranks meet (shared-memory counters; no process-group traffic)."""
        self._barrier()

    def close(self) -> None:
        """Unmap the segment (the memory goes once every rank has closed it or exited)."""
        self._slots = []
        self._counters = self._arrived = None
        if self._buf is not None:
            try:
                self._buf.close()
            except BufferError:  # a view of a slot is still alive somewhere: the mapping goes with it
                pass
            self._buf = None

    # ---- internals ---------------------------------------------------------------------------------
    def _pieces(self, n: int, dtype: torch.dtype) -> list[tuple[int, int]]:
        per = self.slot_bytes // dtype.itemsize
        return [(lo, min(n, lo + per)) for lo in range(0, n, per)]

    def _slot(self, r: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._slots[r][: numel * dtype.itemsize].view(dtype)

    def _barrier(self) -> None:
        self._seq += 1
        with self._fence:  # a locked instruction: the slot's data is visible before the counter
            pass
        self._arrived[self.rank] = self._seq
        every = self._arrived
        wait_until(lambda: not (every < self._seq).any(), self.timeout, self._check_alive, self._late)

    def _late(self) -> PeerLostError:
        missing = [r for r in range(self.world) if self._arrived[r] < self._seq]
        alive = self._alive(missing)
        return PeerLostError(f"host collectives: ranks {missing} did not arrive within {self.timeout:.0f}s "
                             f"({_liveness(missing, alive)})", missing, dead=False, alive=alive)

    def _alive(self, ranks: list[int]) -> list[int]:
        """Those of `ranks` whose processes run (checked in /proc just now)."""
        watched = {r: (pid, start) for r, pid, start in self._watched}
        return [r for r in ranks if r in watched and running(*watched[r])]

    def _check_alive(self) -> None:
        """Raise `PeerLostError` if a rank this one is waiting for has exited."""
        for r, pid, start in self._watched:
            if self._arrived[r] < self._seq and not running(pid, start):
                raise PeerLostError(f"host collectives: rank {r} (pid {pid}) exited; rank {self.rank} cannot "
                                    f"complete the collective it waits in", [r], dead=True)


def _liveness(ranks: list[int], alive: list[int]) -> str:
    """What this rank can tell of `ranks`' processes, given those seen running (`alive`)."""
    if alive == ranks:
        return "alive but not answering"
    return f"alive but not answering: {alive}; not visible from this host: {[r for r in ranks if r not in alive]}"


# ---- process identity (core_parallel.peers) -----------------------------------------------------------
# Each rank's line: [counter, pid, pid namespace inode, process start time (clock ticks after boot)].
def _write_identity(buf: mmap.mmap, rank: int) -> None:
    np.frombuffer(buf, dtype=np.int64, count=4, offset=rank * _LINE)[1:4] = identity()


def _watchable_peers(counters: np.ndarray, rank: int, world: int) -> list[tuple[int, int, int]]:
    """(rank, pid, start) of the peers whose liveness this rank can read (`peers.watchable`)."""
    line = _LINE // 8
    return watchable([tuple(int(v) for v in counters[r * line + 1 : r * line + 4]) for r in range(world)], rank)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k
