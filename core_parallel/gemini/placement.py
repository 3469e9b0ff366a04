"""Placement: where each chunk's fp32 parameter shard and optimizer state live, and the device budget.

Pure bookkeeping, no communication:
- `static_plan`: fixed fractions of chunks off the device, decided once.
- `budget_plan`: what fits a device budget stays, the most-read bytes first.
- `AccessTrace`: the chunk access order recorded in the first step; `next_use` gives the distance to a
  chunk's next access from the current position (the information Belady's optimal eviction needs).
- `pick_victim`: among evictable chunks, the one whose next use is furthest away.
- `keep_recent`: before the order is recorded, which idle gathered chunks stay gathered.
- `MemoryLedger`: bytes per tier and kind (params, grads, optim), the peak on the device, and the
  traffic between tiers in the current step. On a CPU-only machine the "device" is CPU memory and the
  budget is enforced by this accounting.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

__all__ = ["KINDS", "AccessTrace", "MemoryLedger", "budget_plan", "keep_recent", "pick_victim", "static_plan"]

KINDS = ("params", "grads", "optim")


def static_plan(n_chunks: int, param_frac: float, optim_frac: float, off_tier: str) -> list[tuple[str, str]]:
    """(param tier, optim tier) per chunk: the first round(frac * n) chunks go to `off_tier`."""
    n_param, n_optim = round(param_frac * n_chunks), round(optim_frac * n_chunks)
    return [
        (off_tier if i < n_param else "device", off_tier if i < n_optim else "device") for i in range(n_chunks)
    ]


def budget_plan(masters: Sequence[int], optims: Sequence[int], left: int | None,
                off_tier: str) -> list[tuple[str, str]]:
    """(param tier, optim tier) per chunk, given each chunk's master and optimizer bytes and the device bytes `left`
    (None: no budget). The most-read bytes stay: every master is read at each gather (forward and backward), a
    chunk's gradient and optimizer states once a step; so masters first (in the order of use), then the optimizer's
    buffers. What does not fit starts on `off_tier`."""
    if left is None or sum(masters) + sum(optims) <= left:
        return [("device", "device")] * len(masters)
    plan = [[off_tier, off_tier] for _ in masters]
    for kind, sizes in ((0, masters), (1, optims)):
        for i, size in enumerate(sizes):
            if size and size <= left:
                plan[i][kind] = "device"
                left -= size
    return [(p, o) for p, o in plan]


class AccessTrace:
    """Chunk accesses in the order of one traced step; afterwards answers "when is chunk c used next?"."""

    AHEAD = 8
    """How many distinct chunks `ahead` lists at most."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.frozen = False
        self.cursor = 0
        self._positions: dict[int, list[int]] = {}
        self._ahead: list[tuple[int, ...]] = []

    def record(self, chunk: int) -> None:
        """Note an access; while recording it appends, afterwards it advances the cursor."""
        if not self.frozen:
            self.order.append(chunk)
            return
        positions = self._positions.get(chunk, [])
        i = bisect.bisect_left(positions, self.cursor)
        if i < len(positions):
            self.cursor = positions[i] + 1

    def freeze(self) -> None:
        """End of the traced step: the order is fixed from now on."""
        if self.frozen:
            return
        self.frozen = True
        for pos, c in enumerate(self.order):
            self._positions.setdefault(c, []).append(pos)
        self._ahead = [()] * (len(self.order) + 1)
        for pos in range(len(self.order) - 1, -1, -1):
            c = self.order[pos]
            self._ahead[pos] = (c, *(x for x in self._ahead[pos + 1] if x != c))[: self.AHEAD]
        self.cursor = 0

    def ahead(self) -> tuple[int, ...]:
        """The next distinct chunks from the cursor in the order of their next use, `AHEAD` at most (computed once
        at `freeze`: however many accesses of the same chunks come first, no scan)."""
        return self._ahead[self.cursor] if self.frozen else ()

    def new_step(self) -> None:
        """Rewind the cursor to the start of the recorded order."""
        if self.frozen:
            self.cursor = 0

    def next_use(self, chunk: int) -> float:
        """Accesses until `chunk` is used again (wrapping into the next step); inf when never used."""
        positions = self._positions.get(chunk)
        if not self.frozen or not positions:
            return math.inf
        i = bisect.bisect_left(positions, self.cursor)
        if i < len(positions):
            return positions[i] - self.cursor
        return len(self.order) - self.cursor + positions[0]

    def upcoming(self, n: float, weights: Mapping[int, float] | None = None) -> list[int]:
        """The next distinct chunks in the recorded order from the cursor, `n` of them; with `weights` (a chunk's
        size over the largest chunk's), as many as weigh `n` together: a small chunk used all through the step
        (a LoRA's adapters beside a frozen base) does not push a large one out of the window."""
        out: list[int] = []
        total = 0.0
        for c in self.order[self.cursor :]:
            if total >= n:
                break
            if c not in out:
                out.append(c)
                total += 1.0 if weights is None else weights.get(c, 1.0)
        return out


def pick_victim(candidates: Iterable[int], trace: AccessTrace, last_used: dict[int, int]) -> int | None:
    """The candidate used furthest in the future; before the trace exists, the least recently used."""
    candidates = list(candidates)
    if not candidates:
        return None
    if trace.frozen:
        return max(candidates, key=lambda c: (trace.next_use(c), c))
    return min(candidates, key=lambda c: (last_used.get(c, -1), c))


class MemoryLedger:
    """Bytes held per (tier, kind), the device peak, and bytes moved between tiers in this step."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.traffic: dict[tuple[str, str], int] = defaultdict(int)
        self.last_traffic: dict[tuple[str, str], int] = {}
        self.peak_device = 0
        self.last_peak_device = 0

    def add(self, tier: str, kind: str, nbytes: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.bytes[(tier, kind)] += nbytes
        if self.bytes[(tier, kind)] < 0:
            raise RuntimeError(f"memory accounting went negative for {tier}/{kind}")
        self.peak_device = max(self.peak_device, self.tier_total("device"))

    def move(self, src: str, dst: str, kind: str, nbytes: int) -> None:
        """Account `nbytes` of `kind` moving from tier `src` to `dst`."""
        if src == dst:
            return
        self.add(src, kind, -nbytes)
        self.add(dst, kind, nbytes)
        self.traffic[(src, dst)] += nbytes

    def transfer(self, src: str, dst: str, nbytes: int) -> None:
        """Account a copy between tiers that does not change who holds what (e.g. a gather source)."""
        if src != dst:
            self.traffic[(src, dst)] += nbytes

    def tier_total(self, tier: str) -> int:
        return sum(v for (t, _), v in self.bytes.items() if t == tier)

    def new_step(self) -> None:
        """Close the step: its traffic and peak become `last_*`; counting starts again."""
        self.last_traffic = dict(self.traffic)
        self.last_peak_device = self.peak_device
        self.traffic.clear()
        self.peak_device = self.tier_total("device")

    def report(self, tiers: Sequence[str] = ("device", "cpu", "nvme")) -> dict:
        """{"bytes": {tier: {kind: n}}, "traffic_last_step": {"src->dst": n}, "peak_device_bytes_last_step": n}."""
        return {
            "bytes": {t: {k: self.bytes.get((t, k), 0) for k in KINDS} for t in tiers},
            "traffic_last_step": {f"{s}->{d}": n for (s, d), n in sorted(self.last_traffic.items())},
            "peak_device_bytes_last_step": self.last_peak_device,
        }


def keep_recent(order: Sequence[int], weights: Mapping[int, float], room: float,
                idle: Callable[[int], bool]) -> tuple[list[int], list[int]]:
    """Which gathered chunks that went idle (`order`, the last idle last) stay gathered, and which to release: the
    last one stays, the ones before it (those still `idle`) while their `weights` sum to at most `room`, as the
    recorded order's window counts them (a LoRA's small adapter chunk used between the layers of a frozen chunk
    does not push it out). Returns (kept, the last idle last; to release)."""
    kept, drop = [order[-1]], []
    for k in reversed(order[:-1]):
        if not idle(k):
            continue  # in use again, or released since
        if weights[k] <= room + 1e-9:
            room -= weights[k]
            kept.append(k)
        else:
            drop.append(k)
    return kept[::-1], drop
