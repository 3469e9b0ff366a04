"""Reading ahead: the reader thread (`Reader`) and the prefetch depth set from the measured step (`PrefetchDepth`).

Prefetching needs a gather that runs beside compute: gloo's, an accelerator's, or a read of an NVMe master on the
reader thread (a CPU device whose gathers are one-sided: one rank, or peer reads). Copies between CPU tiers and
shared-memory gathers are compute themselves: prefetching them would only hold the next chunk longer, so a CPU
device prefetches the chunks whose master is on NVMe only. The optimizer step reads the next NVMe piece on that
thread too, and writes each updated piece back there (in order: before the read that reuses its scratch memory).

How far ahead: `GeminiConfig.prefetch` chunks at first. Where the reads run on the reader thread, each step then
sets the depth from what it measured (`PrefetchDepth.end_step`): the seconds compute waited for reads, and the
seconds the reader was busy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["PrefetchDepth", "Reader"]


class Reader:
    """One thread that reads tier data while compute goes on (`submit` as an executor's); `busy`: the seconds it has
    spent reading since it started."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lowmem-tier-reader")
        self.busy = 0.0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        def timed() -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.busy += time.perf_counter() - t0  # only this thread writes it

        return self._pool.submit(timed)

    def shutdown(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait)


class PrefetchDepth:
    """How many chunks are read ahead, set from the measured step.

    A step in which compute waited for reads (more than `STALL` of its time) while the reader was idle for part of
    it (busy less than `BUSY`) reads one chunk further ahead next time, up to `most`: its reads can start earlier.
    A step in which the reader was busy nearly all the time reads one chunk less far ahead, down to `least`: the
    disk is the limit there, and reading further ahead would only hold more gathered chunks in memory. `least ==
    most`: a fixed depth. `steps`: per measured step (seconds, waited, busy, the depth it set)."""

    STALL = 0.02
    BUSY = 0.9

    def __init__(self, least: int, most: int, clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0 <= least <= most:
            raise ValueError(f"prefetch depth: need 0 <= least <= most, got {least}, {most}")
        self.depth, self.least, self.most = least, least, most
        self.waited = 0.0
        self.steps: list[tuple[float, float, float, int]] = []
        self._clock = clock
        self._start: float | None = None
        self._busy_start = 0.0

    def wait(self, seconds: float) -> None:
        """Compute waited `seconds` for a read (one in flight, or one made on the spot because none was ahead)."""
        self.waited += seconds

    def end_step(self, busy: float) -> int:
        """A step ended (`busy`: the reader's total busy seconds so far): the depth for the next one. The first call
        only starts the clock: the first step records the access order and prefetches nothing."""
        now = self._clock()
        if self._start is not None and self.most > self.least:
            seconds, read = now - self._start, busy - self._busy_start
            if self.waited > self.STALL * seconds and read < self.BUSY * seconds:
                self.depth = min(self.most, self.depth + 1)
            elif read >= self.BUSY * seconds:
                self.depth = max(self.least, self.depth - 1)
            self.steps.append((seconds, self.waited, read, self.depth))
        self._start, self._busy_start, self.waited = now, busy, 0.0
        return self.depth
