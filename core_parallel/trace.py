"""Where each rank is: the collective it is in or last finished (operation, chunk, step), and the error that says
so when a collective cannot complete.

ZeRO and Gemini run their collectives inside `CollectiveTrace.collective(op, chunk)`, which notes this rank's
record (a few attribute writes). When a collective fails:
- a peer whose process is gone (`/proc`, `core_parallel.peers`) is named as exited: `PeerLostError(dead=True)`;
- otherwise, when the failure is the transport's timeout (or a shared-memory barrier's), every rank that timed
  out publishes its record in the process group's store and reads the others' for a few seconds (a peer stuck
  in another collective times out too, within about the gap between the two entries); the error,
  `PeerLostError(dead=False)`, says that no watched process died and lists where each rank is. A rank alive but
  outside every traced collective (busy, sleeping, in a call of its own) is named as alive, with no record;
- a failure that is neither passes unchanged.

`LOWMEM_TRACE_COLLECTIVES=1` (the debug switch, `TRACE_ENV`) also publishes each record as the collective
starts, so a timeout names every rank's last collective, also of a rank that is nowhere in a collective now
(a store write per collective: for debugging, not for speed).

Ranks stuck in different collectives (a deadlock, not a slow peer) stop within seconds, not after the timeout:
a watchdog thread per trace publishes this rank's record once its collective has waited `STUCK_S` seconds
(and its end, then: one store write per long wait, none otherwise) and reads the others'. When every rank has
waited `STUCK_S` in a traced collective and two of them wait in different ones (another operation, chunk or
step: rank 0 in a `state_dict()` gather that rank 1, in `barrier()`, never joins), none can ever complete:
the watchdog prints one line naming where each rank is and what to do instead, and ends the process (exit
code 1), on every rank that sees it. The blocked thread cannot be interrupted from Python, and waiting for the
transport's timeout (30 minutes by default) is what a user would see as a hang. A rank that is busy (computing,
in a call of its own) has no record there, and is waited for up to the timeout as before. Groups whose timeout
is under 20 s are left to it (its error comes as soon).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
import zlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .groups import group_timeout, world_rank
from .peers import PeerLostError, PeerWatch, running

__all__ = ["STUCK_S", "TRACE_ENV", "CollectiveMismatchError", "CollectiveTrace", "Record", "is_transport_timeout",
           "is_mismatch", "mismatch", "tracing_requested"]

STUCK_S = 3.0
"""Seconds a rank waits in a collective before the watchdog publishes where it is and compares with the others."""
_POLL_S = 0.5
_WATCH_FROM_TIMEOUT_S = 20.0  # groups with a shorter timeout are left to it

TRACE_ENV = "LOWMEM_TRACE_COLLECTIVES"
"""Environment variable: "1" publishes every rank's record at each collective (read when a trace is created)."""
_MAX_WAIT_S = 10.0  # longest a timed-out rank waits for the others' records


def tracing_requested() -> bool:
    """Whether `LOWMEM_TRACE_COLLECTIVES` asks for every collective to be published."""
    return os.environ.get(TRACE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def is_transport_timeout(exc: BaseException) -> bool:
    """Whether `exc` is a collective's timeout (gloo: "Timed out waiting ...", NCCL: "Watchdog caught collective
    operation timeout", a shared-memory barrier's `PeerLostError(dead=False)`)."""
    if isinstance(exc, PeerLostError):
        return not exc.dead
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


class CollectiveMismatchError(RuntimeError):
    """The ranks issued different collectives in a step (`CollectiveTrace.check_sequence`)."""


def is_mismatch(exc: BaseException) -> bool:
    """Whether `exc` is the transport noticing that the ranks are in different collectives (gloo: "Received data
    size doesn't match expected size", NCCL: "collective mismatch")."""
    text = str(exc).lower()
    return "doesn't match expected size" in text or "collective mismatch" in text


@dataclasses.dataclass(frozen=True)
class Record:
    """One rank's collective: `step` is the number of optimizer steps finished before it; `state` "in" (entered,
    not finished) or "done"; `since`: when (epoch seconds)."""

    rank: int
    op: str
    chunk: int | None
    step: int
    state: str
    since: float

    def what(self) -> str:
        """'all_gather (chunk 3, step 2)'."""
        chunk = f"chunk {self.chunk}, " if self.chunk is not None else ""
        return f"{self.op} ({chunk}step {self.step})"

    def key(self) -> tuple:
        """What two ranks must share to be in the same collective: the operation (its issue and its wait alike),
        the chunk and the step."""
        return self.op.replace(" (wait)", ""), self.chunk, self.step

    def describe(self, now: float) -> str:
        """Where the rank is, as of `now`."""
        if self.state == "in":
            return f"rank {self.rank} in {self.what()} for {now - self.since:.1f}s"
        return (f"rank {self.rank} in no traced collective; its last, {self.what()}, finished "
                f"{now - self.since:.1f}s ago")


class CollectiveTrace:
    """This rank's record of its collectives over `group`, and the error naming where every rank is when one
    fails. Build with `create` (collective over `group`)."""

    def __init__(self, group: dist.ProcessGroup | None, watch: PeerWatch | None, publish: bool | None = None) -> None:
        self.group = group
        self.world, self.rank = world_rank(group)
        self.watch = watch
        self.publish_all = tracing_requested() if publish is None else publish
        """Publish every record as its collective starts (`LOWMEM_TRACE_COLLECTIVES`)."""
        self.step = 0
        """The optimizer steps finished (the owner calls `end_step`)."""
        self.last: Record | None = None
        self._sequence, self._count = 0, 0  # digest and number of the collectives issued since the last step
        self._prefix = _key_prefix(group) if self.world > 1 else None
        self._lock = threading.Lock()  # `last` and its copy in the store change together
        self._exposed = False  # the store holds an "in" record of this rank, published by the watchdog
        self._watchdog: threading.Thread | None = None
        # a short timeout explains itself sooner (and as an exception the caller can catch): no watchdog then
        self._watched = self._prefix is not None and group_timeout(group) > _WATCH_FROM_TIMEOUT_S
        self.on_mismatch = _stop_process
        """Called with the message when ranks wait in different collectives (a test replaces it)."""

    @classmethod
    def create(cls, group: dist.ProcessGroup | None, publish: bool | None = None) -> CollectiveTrace:
        """Collective over `group` (the ranks' identities, `PeerWatch.create`)."""
        return cls(group, PeerWatch.create(group), publish)

    def end_step(self) -> None:
        """An optimizer step finished: later records carry the next step number."""
        self.step += 1
        self._sequence, self._count = 0, 0

    def check_sequence(self, device) -> None:
        """Collective: raise `CollectiveMismatchError` on every rank when the ranks issued different collectives
        since the last step (operation and chunk, in order; waits not counted). Collectives of the same size pair
        up whatever they carry: ranks gathering different chunks of one size (experts skipped on some ranks) get
        each other's data silently. One small all-gather; `device`: where the group's tensors live."""
        if self.world == 1:
            return
        mine = torch.tensor([self._sequence, self._count], dtype=torch.int64, device=device)
        every = torch.empty(self.world * 2, dtype=torch.int64, device=device)
        with self.collective("all_gather(collective sequence)"):
            dist.all_gather_single(every, mine, group=self.group)
        pairs = every.view(self.world, 2).tolist()
        if all(p == pairs[0] for p in pairs):
            return
        counts = ", ".join(f"rank {r}: {n} collectives (digest {h:08x})" for r, (h, n) in enumerate(pairs))
        raise CollectiveMismatchError(
            f"rank {self.rank}: in step {self.step} the ranks issued different collectives over the sharded "
            f"parameters ({counts}): some gathered chunks the others did not, and collectives of one size pair up "
            "whatever they carry, so this step's values and gradients are wrong; it is not applied. Gathers are "
            "collectives here (accelerators, ranks on several hosts, or peer_reads=False): every rank must run the "
            "same modules in the same order (run every expert of a mixture on every rank, with an empty batch where "
            "it got no token).")

    @contextlib.contextmanager
    def collective(self, op: str, chunk: int | None = None) -> Iterator[None]:
        """Inside: this rank is in collective `op` (of `chunk`); a failure of it raises `PeerLostError` naming an
        exited rank, or, on a timeout with every watched rank alive, where each rank is (other errors pass)."""
        outer = self.last if self.last is not None and self.last.state == "in" else None
        if outer is not None:  # nested in a traced method: 'zero.backward / reduce_scatter of bucket 2'
            op, chunk = f"{outer.op} / {op}", outer.chunk if chunk is None else chunk
        entry = self._note(Record(self.rank, op, chunk, self.step, "in", time.time()))
        if "(wait)" not in op:
            self._sequence = zlib.crc32(f"{op}:{chunk};".encode(), self._sequence)
            self._count += 1
        try:
            yield
        except (RuntimeError, ConnectionError, TimeoutError) as exc:
            named = self.explain(exc)
            if named is None:
                raise
            raise named from exc
        # a collective nested in another (a gather inside a traced method) hands the outer one its record back
        if outer is not None:
            self._note(outer)
        else:  # the step it ran in, also when it ended the step
            self._note(dataclasses.replace(entry, state="done", since=time.time()))

    def explain(self, exc: BaseException) -> PeerLostError | None:
        """The error for a failed collective: an exited peer by name, or where each rank is after a timeout;
        None for other failures (and for an error that already says so)."""
        if getattr(exc, "where", None) or getattr(exc, "_lowmem_examined", False) or self.world == 1:
            return None  # explained already, or looked at by a nested collective (no second grace wait)
        with contextlib.suppress(AttributeError, TypeError):
            exc._lowmem_examined = True
        if isinstance(exc, PeerLostError) and exc.dead:
            return None
        waits = is_transport_timeout(exc) or is_mismatch(exc)
        lost = self.watch.lost(exc, wait_s=0.5 if waits else None) if self.watch else None
        if lost is not None or not waits:
            return lost
        return self._alive_error(exc)

    # ---- internals ---------------------------------------------------------------------------------
    def _note(self, record: Record) -> Record:
        with self._lock:
            self.last = record
            if self.publish_all or self._exposed:  # the watchdog published the wait: publish its end too
                self._publish()
                self._exposed = record.state == "in" and not self.publish_all
        if record.state == "in" and self._watchdog is None and self._watched:
            self._watchdog = threading.Thread(target=self._watch, name="lowmem-collective-watchdog", daemon=True)
            self._watchdog.start()
        return record

    def _watch(self) -> None:
        """Watchdog thread: publish a long wait, and stop the process when the ranks wait in different collectives
        (seen twice in a row, half a second apart)."""
        seen = None
        while True:
            time.sleep(_POLL_S)
            rec = self.last
            if rec is None or rec.state != "in" or time.time() - rec.since < STUCK_S:
                seen = None
                continue
            with self._lock:
                if self.last is not rec:
                    continue
                if not self._exposed and not self.publish_all:
                    self._publish()
                    self._exposed = True
            others = self._records(0.0)
            text = mismatch(rec, others, self.world, time.time())
            if text is None or text[0] != seen:
                seen = None if text is None else text[0]
                continue
            if self.last is rec:
                self.on_mismatch(text[1])
                return

    def _publish(self) -> None:
        store = _default_store() if self._prefix is not None else None
        if store is None or self.last is None:
            return
        with contextlib.suppress(RuntimeError, ValueError, OSError):  # a store gone with its host: nothing to tell
            store.set(f"{self._prefix}{self.rank}", json.dumps(dataclasses.asdict(self.last)))

    def _records(self, wait_s: float) -> dict[int, Record]:
        """The other ranks' published records, waiting up to `wait_s` for those not published yet."""
        found: dict[int, Record] = {}
        store = _default_store() if self._prefix is not None else None
        if store is None:
            return found
        deadline = time.monotonic() + wait_s
        others = [r for r in range(self.world) if r != self.rank]
        try:
            while True:
                for r in others:
                    key = f"{self._prefix}{r}"
                    if r not in found and store.check([key]):
                        found[r] = Record(**json.loads(store.get(key)))
                if len(found) == len(others) or time.monotonic() > deadline:
                    return found
                time.sleep(0.05)
        except (RuntimeError, ValueError, OSError, TypeError):
            return found

    def _alive_error(self, exc: BaseException) -> PeerLostError:
        timeout = group_timeout(self.group)
        self._publish()
        records = self._records(min(_MAX_WAIT_S, timeout))
        now = time.time()
        watched = {r: (pid, start) for r, pid, start in (self.watch.watched if self.watch else [])}
        lines, alive, alive_ranks = [], [], []
        for r in range(self.world):
            if r == self.rank:
                lines.append(self.last.describe(now) if self.last else f"rank {r}: no record")
                continue
            if r not in watched:
                seen = "liveness not visible from this host"
            elif running(*watched[r]):
                seen = "alive"
                alive.append(f"rank {r} (pid {watched[r][0]})")
                alive_ranks.append(r)
            else:  # exited since the check for exited ranks: its process is gone now
                seen = "exited"
            lines.append(records[r].describe(now) + f" ({seen})" if r in records else
                         f"rank {r} ({seen}) in no traced collective that timed out with this one; "
                         f"{TRACE_ENV}=1 records its last")
        ranks = [r for r in range(self.world) if r != self.rank]
        late = getattr(exc, "ranks", None) or ranks
        what = self.last.what() if self.last else "a collective"
        seen = (f"no process died ({', '.join(alive)} alive)" if len(alive) == len(ranks) else
                "each rank's process as far as this host sees it below")
        head = (f"rank {self.rank}: {what} met another collective on a peer (the transport saw a size "
                f"mismatch: the ranks are in different collectives); {seen}" if is_mismatch(exc) else
                f"rank {self.rank}: {what} timed out after {timeout:g}s; {seen}")
        where = "; ".join(lines)
        return PeerLostError(f"{head}. Where each rank is: {where}", late, dead=False, where=where, alive=alive_ranks)


def mismatch(mine: Record, others: dict[int, Record], world: int, now: float) -> tuple[tuple, str] | None:
    """(what is compared, the message) when every rank has waited `STUCK_S` in a traced collective and two of
    them wait in different ones; None otherwise (a rank without a record, or not waiting long, may still come)."""
    records = {mine.rank: mine, **others}
    if len(records) < world or any(r.state != "in" or now - r.since < STUCK_S for r in records.values()):
        return None
    keys = {r.key() for r in records.values()}
    if len(keys) < 2:
        return None
    where = "; ".join(records[r].describe(now) for r in sorted(records))
    text = (f"rank {mine.rank}: the ranks wait in different collectives, none of which can complete (a deadlock, "
            f"not a slow rank). Where each rank is: {where}. Gathers of sharded parameters are collectives "
            "here (accelerators, ranks on several hosts, or peer_reads=False): every rank must run the same modules "
            "in the same order. Call state_dict() and forward passes outside training on every rank (or "
            "core_parallel.save_checkpoint, which rank 0 writes alone), and run every expert of a mixture on every "
            "rank (an empty batch where it got no token).")
    return tuple(sorted(keys, key=repr)), text


def _stop_process(message: str) -> None:
    """End this process: its main thread is blocked in the transport and cannot be interrupted from Python."""
    with contextlib.suppress(Exception):  # stderr, not the logging setup: a job's log must show it
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    os._exit(1)


def _key_prefix(group: dist.ProcessGroup | None) -> str:
    """The store keys of `group`'s records: 'lowmem-trace/GROUP_NAME/' + rank."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return f"lowmem-trace/{getattr(pg, 'group_name', '') or 'default'}/"
    except (AttributeError, RuntimeError, ValueError):
        return "lowmem-trace/default/"


def _default_store() -> dist.Store | None:
    """The default group's store, looked up when needed: a trace never keeps it (or its server's threads) alive
    after `destroy_process_group`, which must close it in order (`groups.end_process_groups`)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
