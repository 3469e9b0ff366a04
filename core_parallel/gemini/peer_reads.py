"""One-sided reads of the peers' master shards, for CPU ranks on one host: a gather no peer takes part in.

A gather through the process group (or `host_comm`'s barrier) is a collective: every rank of the group must run
it, in the same order. Ranks that run different modules in a step (a mixture of experts whose experts get no
token on some rank, a forward or a `state_dict()` on rank 0 only) would wait for each other forever. Ranks that
share a host need no such meeting: each rank's fp32 master shards live in one shared-memory segment every rank
maps (those on the NVMe tier in the owner's file, which the peers open read-only at setup), and a gather copies
the peers' shards itself.

What keeps a read from seeing a shard half-written or of another step is a line per rank in the segment:
- `epoch`: how many times the rank has written its masters (an optimizer step, a `load_state_dict`); a reader
  waits until the peer's epoch equals its own (the peer may still be finishing that step), and a peer whose
  epoch is ahead means the ranks wrote different things (a load or a step on some ranks only): that raises;
- `writing`: set while the owner writes (readers wait); before it writes, every rank meets (`begin_writes`: a
  counter per rank in the same line), so no rank still reads the values being replaced (a rank that loads a
  state dict while another still reads the old weights waits for it, as the collective gathers made it);
- `moving`: odd while the owner moves a master between memory and its file (auto placement); a read taken
  across a move is taken again;
- a byte per chunk: where the owner's master is now (memory or its file).
The gradients still go through the reduce-scatters, in a fixed chunk order on every rank (`manager`), zeros
for the chunks a rank never touched.

Waiting follows the process group's timeout, checking in `/proc` that the peer still runs (`core_parallel.peers`):
an exited peer is named at once.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from ..groups import group_timeout, world_rank
from ..host_comm import map_segment, wait_until
from ..peers import PeerLostError, identity, running, watchable
from .storage import NvmeFile

__all__ = ["PeerReads", "PeerReadError"]

_LINE = 64  # bytes of a rank's line: epoch, writing, moving, pid, pid namespace, start time, writes begun
_ALIGN = 4096
_MEMORY, _FILE = 0, 1


class PeerReadError(RuntimeError):
    """The ranks' master shards went out of step: a write (an optimizer step, a load) ran on some ranks only."""


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _layout(world: int, shard_numel: list[int]) -> tuple[int, list[int], int, int]:
    """The segment's layout: (header bytes, each chunk's element offset in a rank's part (64-byte aligned), bytes
    per rank's part, total bytes)."""
    starts, total = [], 0
    for numel in shard_numel:
        starts.append(total)
        total += _round_up(numel, 16)
    header = _round_up(world * _LINE + world * len(shard_numel), _ALIGN)
    per_rank = _round_up(max(total, 1) * 4, _ALIGN)
    return header, starts, per_rank, header + world * per_rank


class PeerReads:
    """Every rank's master shards, readable by every rank of `group` on this host. Build with `create`
    (collective); `region(chunk)` is this rank's memory for chunk `chunk`'s master shard."""

    def __init__(self, buf: mmap.mmap, rank: int, world: int, shard_numel: list[int], timeout: float,
                 peer_files: list[int | None], offsets: list[int | None], dtypes: list[torch.dtype]) -> None:
        self._buf, self.rank, self.world, self.timeout = buf, rank, world, timeout
        self.shard_numel = shard_numel
        n = len(shard_numel)
        header, self._starts, per_rank, _ = _layout(world, shard_numel)
        self._lines = np.frombuffer(buf, dtype=np.int64, count=world * _LINE // 8).reshape(world, _LINE // 8)
        self._tiers = np.frombuffer(buf, dtype=np.int8, count=world * n, offset=world * _LINE).reshape(world, n)
        # each rank's part as bytes: a chunk's region holds its master in its own dtype (fp32, or a frozen chunk's
        # compute dtype), in room laid out for fp32
        self._regions = [torch.frombuffer(buf, dtype=torch.uint8, count=per_rank, offset=header + r * per_rank)
                         for r in range(world)]
        self.dtypes = dtypes
        self._files = peer_files  # per rank: a read-only descriptor of its NVMe file (None: this rank, or none)
        self._offsets = offsets  # per chunk: byte offset of the master in each rank's file (the same plan)
        self._fence = threading.Lock()
        self._watched = watchable([tuple(int(v) for v in self._lines[r, 3:6]) for r in range(world)], rank)

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, shard_numel: list[int], nvme: NvmeFile | None,
               offsets: list[int | None], dtypes: list[torch.dtype] | None = None,
               timeout: float | None = None) -> PeerReads | None:
        """Collective over `group`: the segment (`host_comm.map_segment`), the peers' NVMe files opened
        read-only; None on every rank when some rank cannot (another host, no /dev/shm, the plans differ)."""
        world, rank = world_rank(group)
        timeout = group_timeout(group) if timeout is None else timeout

        def write_identity(b: mmap.mmap) -> None:
            np.frombuffer(b, dtype=np.int64, count=_LINE // 8, offset=rank * _LINE)[3:6] = identity()

        buf = map_segment(group, _layout(world, shard_numel)[3], "lowmem-peer-reads", init=write_identity)
        if buf is None:
            return None
        # every rank's NVMe file and the plan's offsets: a peer's master is read at the same offset in its file
        mine = {"path": str(nvme.path) if nvme is not None else None, "offsets": offsets}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        files: list[int | None] = [None] * world
        ok = all(e["offsets"] == offsets for e in everyone)
        if ok:
            try:
                for r, e in enumerate(everyone):
                    if r != rank and e["path"] is not None:
                        files[r] = os.open(e["path"], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                ok = False
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        if not flag.item():
            for f in files:
                if f is not None:
                    os.close(f)
            buf.close()
            return None
        dtypes = list(dtypes) if dtypes is not None else [torch.float32] * len(shard_numel)
        return cls(buf, rank, world, list(shard_numel), timeout, files, offsets, dtypes)

    # ---- the owner's side ----------------------------------------------------------------------------
    def region(self, chunk: int) -> torch.Tensor:
        """This rank's shared memory for chunk `chunk`'s master shard ([shard_numel] of the master's dtype)."""
        return self._region(self.rank, chunk)

    def _region(self, r: int, chunk: int) -> torch.Tensor:
        dtype, lo = self.dtypes[chunk], self._starts[chunk] * 4
        return self._regions[r][lo : lo + self.shard_numel[chunk] * dtype.itemsize].view(dtype)

    def begin_writes(self, what: str) -> None:
        """The masters are about to change (`what`: an optimizer step, a load): first every rank meets here (so
        none still reads this epoch's values), then peers wait until `end_writes`. Every rank writes as often."""
        self._lines[self.rank, 6] += 1
        self._publish()
        turn = int(self._lines[self.rank, 6])
        for r in range(self.world):
            if r != self.rank:
                self._wait_until(r, lambda r=r: self._lines[r, 6] >= turn,
                                 f"{what} waits for rank {r} to write its master shards too (every rank steps and "
                                 "loads its own shard)")
        self._lines[self.rank, 1] = 1
        self._publish()

    def end_writes(self) -> None:
        """The masters are written: one more epoch."""
        self._publish()
        self._lines[self.rank, 0] += 1
        self._lines[self.rank, 1] = 0

    def begin_move(self) -> None:
        """A master is about to move between this rank's shared region and its NVMe file: reads taken from now
        until `end_move` are taken again."""
        self._lines[self.rank, 2] += 1  # odd while moving
        self._publish()

    def end_move(self, chunk: int, in_file: bool) -> None:
        """Chunk `chunk`'s master now lives in this rank's NVMe file (`in_file`) or in its shared region."""
        self._tiers[self.rank, chunk] = _FILE if in_file else _MEMORY
        self._publish()
        self._lines[self.rank, 2] += 1

    # ---- the reader's side ---------------------------------------------------------------------------
    def read_into(self, r: int, chunk: int, out: torch.Tensor) -> None:
        """`out` ([shard_numel] of any dtype) <- rank `r`'s master shard of chunk `chunk`, without rank `r`."""
        n = self.shard_numel[chunk]
        self._wait_for(r, chunk)
        while True:
            seq = int(self._lines[r, 2])
            if seq % 2:
                time.sleep(0.0002)
                continue
            if self._tiers[r, chunk] == _MEMORY:
                out.copy_(self._region(r, chunk))
            else:
                same = out.dtype == self.dtypes[chunk] and out.is_contiguous()
                staging = out if same else torch.empty(n, dtype=self.dtypes[chunk])
                _pread(self._files[r], staging, self._offsets[chunk])
                if staging is not out:
                    out.copy_(staging)
            if int(self._lines[r, 2]) == seq:
                return

    def _wait_for(self, r: int, chunk: int) -> None:
        """Until rank `r`'s masters are of this rank's epoch and not being written."""
        mine = int(self._lines[self.rank, 0])
        self._wait_until(r, lambda: self._lines[r, 0] > mine or (self._lines[r, 0] == mine and self._lines[r, 1] == 0),
                         f"reading rank {r}'s shard of chunk {chunk}: rank {r} has not finished writing its master "
                         f"shards (this rank's epoch {mine})")
        theirs = int(self._lines[r, 0])
        if theirs > mine:  # the writes meet first (`begin_writes`): only a rank that skipped that could be ahead
            raise PeerReadError(
                f"rank {self.rank}: rank {r}'s master shards were written {theirs} times, this rank's {mine}: an "
                "optimizer step or a load_state_dict ran on some ranks only. Under Gemini every rank steps and loads "
                "(its own shard); a module, a forward or a state_dict() may run on some ranks only.")

    def _wait_until(self, r: int, ready, what: str) -> None:
        """Until `ready()`; rank `r` exiting meanwhile, or the timeout, raises `PeerLostError`."""
        def check() -> None:
            for p, pid, start in self._watched:
                if p == r and not running(pid, start):
                    raise PeerLostError(f"rank {self.rank}: {what}; rank {r} (pid {pid}) exited", [r], dead=True)

        def expired() -> PeerLostError:
            alive = self._alive(r)
            return PeerLostError(f"rank {self.rank}: {what}; not within {self.timeout:.0f}s "
                                 f"({'alive' if alive else 'liveness not visible from this host'})", [r],
                                 dead=False, alive=[r] if alive else [])

        wait_until(ready, self.timeout, check, expired)

    def _alive(self, r: int) -> bool:
        return any(p == r and running(pid, start) for p, pid, start in self._watched)

    def _publish(self) -> None:
        with self._fence:  # a locked instruction: the data is visible before the counter
            pass

    def close(self) -> None:
        """Close the peers' files and unmap the segment (the memory goes with the last rank's mapping)."""
        for i, f in enumerate(self._files):
            if f is not None:
                os.close(f)
                self._files[i] = None
        self._regions, self._lines, self._tiers = [], None, None
        if self._buf is not None:
            try:
                self._buf.close()
            except BufferError:  # a master still views its region: the mapping goes with it
                pass
            self._buf = None


def _pread(fd: int, out: torch.Tensor, offset: int) -> None:
    """Read a peer's region into `out`, then let its pages leave the page cache (as the owner's own reads do:
    the tier must not cost the memory it saves; pages still being written back stay until they are clean)."""
    view = memoryview(out.view(torch.uint8).numpy()).cast("B")  # bytes: numpy has no bfloat16
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"peer reads: pread returned {n} at byte {offset + done}")
        done += n
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)
