"""SIGTERM for plain training loops: finish the step, every rank checkpoints at the same step, exit 143.

A cluster that preempts or cancels a job sends SIGTERM and, some seconds later, SIGKILL. Stopping inside a
step (mid-accumulation, mid-collective) loses the step or hangs the others; `Preemption` notes the signal and
lets the loop act on it at its next step boundary, where every rank asks the group together (one small
all-reduce), so all ranks stop after the same step, even when only one got the signal::

    from lowmem import core_parallel
    from lowmem.core_parallel.preemption import Preemption

    with Preemption(trace=optimizer.collectives) as preemption:   # SIGTERM handler and watchdog; undone at exit
        for step in range(start, steps):
            ...                                # forward, optimizer.backward, optimizer.step, zero_grad
            if preemption.requested():         # collective: every rank calls it at the same step boundary
                core_parallel.save_checkpoint(f"ckpt/step-{step}", model, optimizer, extra={"step": step})
                preemption.exit()              # SystemExit(143): a shell's code for a SIGTERM'd process

Exit code 143 (128 + SIGTERM) tells job scripts and schedulers the run did not finish, where 0 would read as
success. The Lightning strategies (`recipes.strategies`) use the same class at each optimizer-step boundary.

A rank that waits in a collective its peers never join (a peer elsewhere, stuck or slow) never reaches the boundary,
and Python runs no signal handler while the main thread is inside the C++ call. So `install` also starts a watchdog:
the signal reaches a daemon thread through `signal.set_wakeup_fd`; when the main thread then stays at one place (a
collective, a wait: its Python stack unchanged) for `grace_s` seconds without reaching the boundary, the watchdog
logs one line naming where this rank is (the trace's collective when `trace` is set, and the main thread's Python
frame) and ends the process with exit code 143 (`os._exit`, after flushing the logs). No checkpoint is possible
there (saving is collective); the peers' next collective then fails with the usual error naming this rank. A main
thread that keeps moving (computing its step) is left to reach the boundary and checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from .groups import world_rank

__all__ = ["GRACE_ENV", "SIGTERM_EXIT_CODE", "Preemption"]

logger = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
"""Exit code after a SIGTERM: what a shell reports for a process the signal ended, so job scripts see a failure."""

GRACE_ENV = "LOWMEM_SIGTERM_GRACE_S"
"""Environment variable: the default `grace_s` of `Preemption` (seconds; "inf" turns the watchdog off)."""
DEFAULT_GRACE_S = 10.0
_POLL_S = 0.25  # how often the watchdog looks at the main thread after a SIGTERM

_PREVIOUS = object()


def _grace_from_env() -> float:
    text = os.environ.get(GRACE_ENV, "").strip()
    if not text:
        return DEFAULT_GRACE_S
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{GRACE_ENV}={text!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{GRACE_ENV} must be > 0 seconds (inf: no watchdog), got {text!r}")
    return value


class Preemption:
    """SIGTERM noted by a handler, acted on at a step boundary agreed by every rank of `group`.

    `group`: the ranks that stop together (None: the default group, or one process without one). Use as a
    context manager (or `install` / `uninstall`) in the main thread; elsewhere signals cannot be handled and
    only `request()` sets the flag.
    `grace_s`: after a SIGTERM, how long the main thread may stay at one place (waiting in a collective) before the
    watchdog ends the process with exit code 143 (None: `LOWMEM_SIGTERM_GRACE_S`, else 10 s; `math.inf`: never).
    `trace`: the `core_parallel.trace.CollectiveTrace` whose collective the watchdog's line names (e.g. a
    ZeRO/Gemini optimizer's `collectives`); settable later. `context`: called for more text on that line (a resume
    hint).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, grace_s: float | None = None,
                 trace: Any = None, context: Callable[[], str] | None = None) -> None:
        self.group = group
        self.grace_s = _grace_from_env() if grace_s is None else float(grace_s)
        if not self.grace_s > 0:
            raise ValueError(f"grace_s must be > 0 seconds (math.inf: no watchdog), got {grace_s}")
        self.trace = trace
        self.context = context
        self._flag = threading.Event()
        self._previous: Any = None
        self._installed = False
        self._handler: Callable[[int, Any], None] | None = None
        self._watchdog: _Watchdog | None = None

    # ---- the handler ---------------------------------------------------------------------------------
    def install(self, chain: Callable[[int, Any], Any] | None | object = _PREVIOUS) -> Preemption:
        """Handle SIGTERM from now on (clears an earlier request). `chain`: a handler also called on the
        signal; by default the one installed before (unless it is the default action or ignore)."""
        self._flag.clear()
        self._stop_watchdog()
        if threading.current_thread() is not threading.main_thread():
            logger.warning("Preemption.install outside the main thread: SIGTERM is not handled here")
            return self
        self._previous = signal.getsignal(signal.SIGTERM)
        chained = self._previous if chain is _PREVIOUS else chain
        if not callable(chained) or chained in (signal.SIG_DFL, signal.SIG_IGN):
            chained = None

        def on_sigterm(signum: int, frame: Any) -> None:
            self._flag.set()
            if self._watchdog is not None:  # also here: the wakeup fd may have been taken over by other code
                self._watchdog.arm()
            if chained is not None:
                chained(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)
        self._handler = on_sigterm
        self._installed = True
        if math.isfinite(self.grace_s):
            self._watchdog = _Watchdog(self)
        return self

    def uninstall(self) -> None:
        """Put back the handler found by `install` (and stop the watchdog)."""
        self._stop_watchdog()
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None

    def _handling(self) -> bool:
        """Whether SIGTERM still goes to this object's handler (Lightning's teardown puts its own back)."""
        return self._installed and signal.getsignal(signal.SIGTERM) is self._handler

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
            stop = self.signalled
        else:
            nccl = dist.get_backend(self.group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
            flag = torch.tensor([1 if self.signalled else 0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            stop = bool(flag.item())
        if stop and self._watchdog is not None:
            self._watchdog.boundary_reached()  # the caller checkpoints now, on every rank: no deadline for that
        return stop

    def exit(self, message: str = "") -> NoReturn:
        """Stop the process with exit code 143 (raises `SystemExit`, so `finally` blocks and atexit run)."""
        if self._watchdog is not None:
            self._watchdog.boundary_reached()
        logger.warning("SIGTERM received: stopping%s. Exiting with code %d.", f" ({message})" if message else "",
                       SIGTERM_EXIT_CODE)
        raise SystemExit(SIGTERM_EXIT_CODE)


class _Watchdog:
    """A daemon thread that hears SIGTERM through the wakeup fd, also while the main thread is inside a C++ call,
    and ends the process when the main thread then stays at one place for `grace_s` without reaching a step
    boundary. Bytes for other signals are passed on to the wakeup fd that was set before."""

    def __init__(self, owner: Preemption) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._signalled_at: float | None = None
        self._done = threading.Event()  # boundary reached, or closed
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        try:
            self._old_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread of the main interpreter: the handler alone arms it
            self._old_fd = None
        threading.Thread(target=self._listen, name="lowmem-sigterm-wakeup", daemon=True).start()

    def close(self) -> None:
        self._done.set()
        restored = self._old_fd is None
        if not restored and threading.current_thread() is threading.main_thread():
            previous = signal.set_wakeup_fd(self._old_fd)
            if previous not in (self._writer.fileno(), -1):  # another component set its own since: leave that one
                signal.set_wakeup_fd(previous)
            restored = True
        self._old_fd = None
        with contextlib.suppress(OSError):
            self._reader.shutdown(socket.SHUT_RDWR)  # wakes the listener
        self._reader.close()
        if restored:  # else the wakeup fd may still be ours: a closed number could be reused by any file
            self._writer.close()

    def boundary_reached(self) -> None:
        self._done.set()

    def arm(self) -> None:
        """A SIGTERM arrived: start watching the main thread (once)."""
        with self._lock:
            if self._signalled_at is not None or self._done.is_set():
                return
            self._signalled_at = time.monotonic()
        threading.Thread(target=self._watch, name="lowmem-sigterm-watchdog", daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            old = self._old_fd
            if old is not None and old >= 0:
                with contextlib.suppress(OSError):
                    os.write(old, data)
            if signal.SIGTERM in data and self.owner._handling():
                self.owner._flag.set()
                self.arm()

    def _watch(self) -> None:
        grace = self.owner.grace_s
        place, still_since = _main_thread_place(), time.monotonic()
        while not self._done.wait(_POLL_S):
            now, current = time.monotonic(), _main_thread_place()
            if current != place:
                place, still_since = current, now
            elif now - still_since >= grace:
                self._expire(now - self._signalled_at)

    def _expire(self, waited: float) -> NoReturn:
        owner = self.owner
        try:
            _, rank = world_rank(owner.group)
        except (RuntimeError, ValueError):
            rank = 0
        where = []
        last = getattr(owner.trace, "last", None)
        if last is not None:
            where.append(last.describe(time.time()))
        where.append(_main_thread_where())
        extra = ""
        if owner.context is not None:
            try:
                extra = f" {owner.context()}"
            except Exception as exc:  # noqa: BLE001 - the line must still be written and the process end
                extra = f" ({type(exc).__name__} while describing the run: {exc})"
        logger.error(
            "rank %d: SIGTERM received %.1fs ago and this rank did not reach a step boundary; it is waiting: %s. "
            "No checkpoint written here (saving needs every rank at a step boundary).%s Exiting with code %d.",
            rank, waited, "; ".join(where), extra, SIGTERM_EXIT_CODE,
        )
        _flush_logs()
        os._exit(SIGTERM_EXIT_CODE)


def _main_frame() -> FrameType | None:
    return sys._current_frames().get(threading.main_thread().ident)


def _main_thread_place() -> tuple:
    """The main thread's Python stack as (code, instruction) pairs: unchanged while it waits in one call."""
    frame, place = _main_frame(), []
    while frame is not None and len(place) < 200:
        place.append((frame.f_code, frame.f_lasti))
        frame = frame.f_back
    return tuple(place)


def _main_thread_where() -> str:
    """'main thread in all_reduce (torch/distributed/distributed_c10d.py:2950), called from train (train.py:40)':
    the innermost frame and the innermost one outside torch."""
    frame = _main_frame()
    if frame is None:
        return "main thread not found"

    def at(f: FrameType) -> str:
        return f"{f.f_code.co_name} ({_short(f.f_code.co_filename)}:{f.f_lineno})"

    text = f"main thread in {at(frame)}"
    torch_dir = os.path.dirname(torch.__file__)
    outer = frame
    while outer is not None and outer.f_code.co_filename.startswith(torch_dir):
        outer = outer.f_back
    if outer is not None and outer is not frame:
        text += f", called from {at(outer)}"
    return text


def _short(path: str) -> str:
    """A file's path from its package root (site-packages or the working directory), else as is."""
    for root in sorted({os.path.dirname(os.path.dirname(torch.__file__)), os.getcwd()}, key=len, reverse=True):
        if path.startswith(root + os.sep):
            return path[len(root) + 1:]
    return path


def _flush_logs() -> None:
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for handler in {h for log in loggers for h in log.handlers} | {logging.lastResort}:
        with contextlib.suppress(Exception):  # a broken handler must not keep the process alive
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
