"""Which rank exited: process identities of the ranks of a group, and the error that names a lost one.

A collective whose peer died fails on the survivors with the transport's own words (gloo: "Connection reset by
peer"), naming no rank. Every rank records who it is (pid, pid namespace, process start time); a rank whose
collective failed looks in `/proc` for the ranks that are gone and raises `PeerLostError` naming them, with the
transport's error as its cause. A zombie, or a pid now used by another process, counts as gone; ranks in
another pid namespace (another host, another container) cannot be looked up and are never named.

Used by Gemini's shared-memory collectives (`host_comm`, whose barrier checks liveness while it waits) and by
`core_parallel.trace` (ZeRO's and Gemini's collectives: `PeerWatch`, consulted when a gloo/NCCL collective raises;
a peer that is alive is never called dead there, and the error says where each rank is).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch.distributed as dist

from .groups import world_rank

__all__ = ["PeerLostError", "PeerWatch", "identity", "pid_namespace", "running", "start_time", "watchable"]

_GRACE_S = 2.0  # how long a failed collective waits for a peer whose socket closed to show up as exited


class PeerLostError(dist.DistBackendError):
    """A rank of the group exited, or did not arrive within the timeout: the collective cannot complete.

    A `torch.distributed.DistBackendError`, as gloo and NCCL raise when a peer is lost, so callers that handle
    those (the Lightning strategies' message, `recipes.faults`) handle this one too. `ranks`: the ranks that
    exited or did not arrive; `dead`: whether they are known to have exited (False: alive, or not visible from
    here, but late); `where`: where each rank was when a timeout was explained (`core_parallel.trace`), else "";
    `alive`: the ranks whose processes were seen running when it was raised (only these may be called alive)."""

    def __init__(self, message: str, ranks: list[int], dead: bool, where: str = "",
                 alive: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks, self.dead, self.where, self.alive = list(ranks), dead, where, list(alive or [])


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 when unreadable): equal for processes that see the same pids."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def start_time(pid: int) -> int | None:
    """Start time of a running process (field 22 of /proc/PID/stat); None when gone or a zombie; -1 unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return -1
    fields = stat[stat.rfind(b")") + 2 :].split()  # the command name in parentheses may hold spaces
    try:
        state, start = fields[0], int(fields[19])
    except (IndexError, ValueError):
        return -1
    return None if state in (b"Z", b"X", b"x") else start


def identity() -> tuple[int, int, int]:
    """This process as other ranks can look it up: (pid, pid namespace, start time or -1)."""
    pid = os.getpid()
    return pid, pid_namespace(), start_time(pid) or -1


def running(pid: int, start: int) -> bool:
    """Whether the process recorded as (pid, start) still runs (unreadable /proc: assume it does)."""
    now = start_time(pid)
    return now is not None and (now == -1 or now == start)


def watchable(identities: Sequence[tuple[int, int, int]], rank: int) -> list[tuple[int, int, int]]:
    """(rank, pid, start) of the peers whose liveness this rank can read: same pid namespace, and their start
    time readable as recorded (otherwise /proc here shows another process under that pid, or nothing useful)."""
    ns = pid_namespace()
    out = []
    for r, (pid, peer_ns, start) in enumerate(identities):
        if r == rank or ns == 0 or peer_ns != ns or start <= 0:
            continue
        now = start_time(pid)
        if now is None or now == start:  # None: exited already, the first check will say so
            out.append((r, pid, start))
    return out


class PeerWatch:
    """The ranks of a group this rank can check for liveness. Build with `create` (collective)."""

    def __init__(self, identities: Sequence[tuple[int, int, int]], rank: int) -> None:
        self.rank = rank
        self.watched = watchable(identities, rank)

    @classmethod
    def create(cls, group: dist.ProcessGroup | None) -> PeerWatch | None:
        """Collective over `group`: every rank's identity; None with one rank (nobody to lose)."""
        world, rank = world_rank(group)
        if world == 1:
            return None
        identities: list = [None] * world
        dist.all_gather_object(identities, identity(), group=group)
        return cls(identities, rank)

    def dead(self) -> list[tuple[int, int]]:
        """(rank, pid) of the watched ranks that have exited."""
        return [(r, pid) for r, pid, start in self.watched if not running(pid, start)]

    def lost(self, exc: BaseException, wait_s: float | None = None) -> PeerLostError | None:
        """The error naming the ranks that exited, when `exc` (a failed collective) came with some; waits up to
        `wait_s` (None: 2 s) for one to show as exited (a socket can close a moment before its process is gone)."""
        deadline = time.monotonic() + (_GRACE_S if wait_s is None else wait_s)
        while not (gone := self.dead()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not gone:
            return None
        who = ", ".join(f"rank {r} (pid {pid})" for r, pid in gone)
        return PeerLostError(f"rank {self.rank}: {who} exited; the collective this rank was in cannot complete "
                             f"(transport error: {exc})", [r for r, _ in gone], dead=True)
