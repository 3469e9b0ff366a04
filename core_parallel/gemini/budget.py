"""A memory budget for the whole process (`GeminiConfig.memory_budget`): what the process may hold at once (RAM on a
CPU device, allocated device memory on an accelerator), not just Gemini's model data.

Gemini controls the model data only (master shards, gradients, optimizer states, gathered chunks). The rest of the
process (the runtime, data, other models, activations, temporaries) is measured: at setup, what the process holds
beside the parameters; after each step, the step's peak (VmHWM since it was reset, or the allocator's peak) beside
the model data Gemini held at its own peak. The model-data budget the placement honours is the memory budget less
that; a step whose peak went over the memory budget lowers the model-data budget by the excess for the next one.
The first step has no measured activations yet, so it runs with every master and optimizer buffer off the device
(`ChunkManager._plan`); after each step what fits the measured room comes back, most-read first (`MemoryBudget`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["MemoryBudget", "ProcessMemory", "outside_model"]


class ProcessMemory:
    """What this process holds on `device`: `now()`, and the peak since `reset_peak()` (`peak()`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cpu_peak_resettable = device.type != "cpu" or self._reset_hwm()

    def now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._cpu_peak_resettable:
            self._reset_hwm()

    def peak(self) -> int:
        """The peak since `reset_peak()`; where the kernel's peak mark cannot be reset, the current size (the
        process's all-time peak would stay over the budget for ever)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if not self._cpu_peak_resettable:
            return self.now()
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return self.now()

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak resident set size (Linux >= 4.0)
            return True
        except OSError:
            return False


def outside_model(memory: ProcessMemory, params: list[torch.Tensor]) -> int:
    """What the process holds now beside the parameters (their storages on the device counted once)."""
    seen, held = set(), 0
    for p in params:
        if p.device.type != memory.device.type:
            continue
        storage = p.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        held += storage.nbytes()
    return max(memory.now() - held, 0)


class MemoryBudget:
    """`memory_budget` (`limit` bytes for the whole process) kept by a `ChunkManager` (`mgr` below): after each step,
    `refit` sets the model-data budget from the step's measured peak and moves buffers between the device and the
    offload tier to fit it."""

    def __init__(self, limit: int, memory: ProcessMemory) -> None:
        self.limit, self.memory = limit, memory
        self.last_process_peak: int | None = None  # the process's peak in the last step
        self.steps = 0  # steps measured; from the third on, one over the budget is warned of
        self._warned = False

    def refit(self, mgr: Any) -> None:
        """The model-data budget for the next step is the limit less what the process held beside the model data at
        this step's peak; a step over the limit lowers it by the excess too. Then buffers leave the device (least
        read first) until the resident ones fit it, or come back (most read first) while this step's model-data
        peak plus them fits it."""
        peak = self.last_process_peak = self.memory.peak()
        outside = max(peak - mgr.ledger.peak_device, 0)
        budget = self.limit - outside
        if peak > self.limit:
            budget = min(budget, mgr.budget - (peak - self.limit))
        # the working set: gathered chunks (prefetched too) and their gradients, as `_plan` reserves
        floor = 2 * (1 + mgr.config.prefetch) * max((c.full_nbytes + c.spec.size * 4 for c in mgr.chunks), default=0)
        mgr.budget = max(budget, floor)
        logger.debug("memory_budget: step peak %d, model data at its peak %d, model-data budget now %d", peak,
                     mgr.ledger.peak_device, mgr.budget)
        _evict(mgr)
        _promote(mgr)
        self.steps += 1
        if peak > self.limit and self.steps > 2 and not self._warned:
            # the first steps may go over while the budget learns the activations and the step's scratch; a later
            # one did with every evictable byte already gone: the budget cannot hold this run, say so once
            self._warned = True
            logger.warning(
                "memory_budget %.0f MiB: step %d peaked at %.0f MiB (%.0f MiB beside the model data, %.0f MiB of "
                "model data: the gathered chunks, gradients and step buffers it cannot do without); the budget cannot "
                "be held with these settings: raise it, or lower the batch, resolution or chunk size (chunk_mb)",
                self.limit / 2**20, self.steps, peak / 2**20, outside / 2**20, mgr.ledger.peak_device / 2**20)
        self.memory.reset_peak()


def _evict(mgr: Any) -> None:
    """The least-read bytes leave first: optimizer buffers (read once a step), last chunk first; then masters, the
    one used furthest ahead first."""
    for c in reversed(mgr.trainable_chunks):
        if mgr.fits(0):
            return
        _move_optim(mgr, c, mgr.off_tier)
    while not mgr.fits(0):
        victim = mgr.furthest_master()
        if victim is None:  # only the working set is left
            return
        mgr.move_master(mgr.chunks[victim], mgr.off_tier)


def _promote(mgr: Any) -> None:
    """The most-read bytes come back while this step's model-data peak plus them fits the budget: masters (read at
    every gather) in the order of use, then each chunk's optimizer buffers (read once a step), whole."""
    room = mgr.budget - mgr.ledger.peak_device
    for c in mgr.chunks:
        if c.master.tier != "device" and c.master.nbytes <= room:
            c.wait()  # a read in flight on the reader thread ends before the master moves
            mgr.move_master(c, "device")
            room -= c.master.nbytes
    for c in mgr.trainable_chunks:
        off = sum(b.nbytes for _, b in _optim_buffers(c) if b.tier != "device")
        if off and off <= room:
            _move_optim(mgr, c, "device")
            room -= off


def _optim_buffers(c: Any) -> list[tuple[str, Any]]:
    """Chunk `c`'s gradient and optimizer-state shards with their ledger kinds."""
    return [("grads", c.grad), *(("optim", b) for b in c.states.values())]


def _move_optim(mgr: Any, c: Any, tier: str) -> None:
    """Move chunk `c`'s gradient and optimizer-state shards to `tier` (accounted), after a step deferred to the
    chunk's next gather ran (its states are not valid before)."""
    mgr.settle([c])
    for kind, b in _optim_buffers(c):
        if b.tier != tier:
            if b.allocated:
                mgr.ledger.move(b.tier, tier, kind, b.nbytes)
            b.move(tier)
