"""SIGTERM for plain training loops: finish the step, every rank checkpoints at the same step, exit 143.

A cluster that preempts or cancels a job sends SIGTERM and, some seconds later, SIGKILL. Stopping inside a
step (mid-accumulation, mid-collective) loses the step or hangs the others; `Preemption` notes the signal and
lets the loop act on it at its next step boundary, where every rank asks the group together (one small
all-reduce), so all ranks stop after the same step, even when only one got the signal::

    from lowmem import core_parallel
    from lowmem.core_parallel.preemption import Preemption

    with Preemption() as preemption:          # installs the SIGTERM handler; restores the old one at exit
        for step in range(start, steps):
            ...                                # forward, optimizer.backward, optimizer.step, zero_grad
            if preemption.requested():         # collective: every rank calls it at the same step boundary
                core_parallel.save_checkpoint(f"ckpt/step-{step}", model, optimizer, extra={"step": step})
                preemption.exit()              # SystemExit(143): a shell's code for a SIGTERM'd process

Exit code 143 (128 + SIGTERM) tells job scripts and schedulers the run did not finish, where 0 would read as
success. The Lightning strategies (`recipes.strategies`) use the same class at each optimizer-step boundary.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from .groups import world_rank

__all__ = ["SIGTERM_EXIT_CODE", "Preemption"]

logger = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
"""Exit code after a SIGTERM: what a shell reports for a process the signal ended, so job scripts see a failure."""

_PREVIOUS = object()


class Preemption:
    """SIGTERM noted by a handler, acted on at a step boundary agreed by every rank of `group`.

    `group`: the ranks that stop together (None: the default group, or one process without one). Use as a
    context manager (or `install` / `uninstall`) in the main thread; elsewhere signals cannot be handled and
    only `request()` sets the flag.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._flag = threading.Event()
        self._previous: Any = None
        self._installed = False

    # ---- the handler ---------------------------------------------------------------------------------
    def install(self, chain: Callable[[int, Any], Any] | None | object = _PREVIOUS) -> Preemption:
        """Handle SIGTERM from now on (clears an earlier request). `chain`: a handler also called on the
        signal; by default the one installed before (unless it is the default action or ignore)."""
        self._flag.clear()
        if threading.current_thread() is not threading.main_thread():
            logger.warning("Preemption.install outside the main thread: SIGTERM is not handled here")
            return self
        self._previous = signal.getsignal(signal.SIGTERM)
        chained = self._previous if chain is _PREVIOUS else chain
        if not callable(chained) or chained in (signal.SIG_DFL, signal.SIG_IGN):
            chained = None

        def on_sigterm(signum: int, frame: Any) -> None:
            self._flag.set()
            if chained is not None:
                chained(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._installed = True
        return self

    def uninstall(self) -> None:
        """Put back the handler found by `install`."""
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    # ---- the step boundary ---------------------------------------------------------------------------
    @property
    def signalled(self) -> bool:
        """Whether this rank got SIGTERM (or `request()`), without asking the others."""
        return self._flag.is_set()

    def request(self) -> None:
        """Ask to stop as a SIGTERM would (from code: a time limit, a watchdog)."""
        self._flag.set()

    def requested(self) -> bool:
        """Whether any rank of the group got SIGTERM: True on every rank or on none. Collective: every rank calls
        it at the same step boundary (an all-reduce of one number)."""
        world, _ = world_rank(self.group)
        if world == 1:
            return self.signalled
        nccl = dist.get_backend(self.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        flag = torch.tensor([1 if self.signalled else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def exit(self, message: str = "") -> NoReturn:
        """Stop the process with exit code 143 (raises `SystemExit`, so `finally` blocks and atexit run)."""
        logger.warning("SIGTERM received: stopping%s. Exiting with code %d.", f" ({message})" if message else "",
                       SIGTERM_EXIT_CODE)
        raise SystemExit(SIGTERM_EXIT_CODE)
