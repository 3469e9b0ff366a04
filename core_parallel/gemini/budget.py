"""A memory budget for the whole process (`GeminiConfig.memory_budget`): what the process may hold at once (RAM on a
CPU device, allocated device memory on an accelerator), not just Gemini's model data.

Gemini controls the model data only (master shards, gradients, optimizer states, gathered chunks). The rest of the
process (the runtime, data, other models, activations, temporaries) is measured: at setup, what the process holds
beside the parameters; after each step, the step's peak (VmHWM since it was reset, or the allocator's peak) beside
the model data Gemini held at its own peak. The model-data budget the placement honours is the memory budget less
that; a step whose peak went over the memory budget lowers the model-data budget by the excess for the next one.
The first step has no measured activations yet: it may exceed the budget by them; the steps after it do not.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

__all__ = ["ProcessMemory", "outside_model"]


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
