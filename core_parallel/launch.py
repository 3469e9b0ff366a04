"""Run a function on N local ranks (gloo by default) and collect each rank's result.

This is the one spawn helper the tests and benchmarks use. It picks a free port, starts N processes with
the `spawn` start method, initialises the default process group in each, and returns the list of results
in rank order. If any rank raises, the others are terminated at once and the error is re-raised in the
caller with the failing rank's traceback. If the ranks do not finish within `timeout` seconds, all are
killed and `TimeoutError` is raised: a hang becomes a failure.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Collection
from typing import Any

from .groups import GLOO, LAUNCH_BACKENDS, check_backend

__all__ = ["RankError", "free_port", "run_on_ranks"]


class RankError(RuntimeError):
    """A rank raised; the message carries the rank and its traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str) -> None:
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n--- traceback of rank {rank} ---\n{tb}")
        self.rank = rank
        self.exc_type = exc_type
        self.original_message = message


def free_port() -> int:
    """A TCP port that is free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    collective_timeout: float,
    env: dict[str, str],
    kernel_backend: tuple[str, str],
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    from ..kernels.backend import set_default_backend

    # the parent's kernel backend: a spawned rank reads no override itself
    set_default_backend(kernel_backend[0], source=kernel_backend[1])
    torch.set_num_threads(1)
    try:
        if backend != "none":
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://127.0.0.1:{port}",
                world_size=world_size,
                rank=rank,
                timeout=datetime.timedelta(seconds=collective_timeout),
            )
        out = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensors by value. The queue's own pickler would hand over shared-memory
        # handles, which die with this process before the parent reads them.
        results.put((rank, True, pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException as exc:  # noqa: B036 - every failure must reach the parent
        results.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
    finally:
        if backend != "none" and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the group may be broken after a peer died
                pass


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = GLOO,
    env: dict[str, str] | None = None,
    may_die: Collection[int] = (),
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(rank, world_size, *args, **kwargs)` on `world_size` spawned ranks.

    `fn` must be importable by name (a module-level function). Its return value must be picklable; it is
    copied by value, so returned tensors stay valid after the ranks exit.
    `backend`: one of `groups.BACKENDS`, or "none", which skips process-group initialisation (for code that
    sets up its own).
    `may_die`: ranks that may exit without a result (a test of a dead rank); the call returns once every
    other rank finished, with None for those that did not return.
    Returns the results in rank order; raises `RankError` for the first rank that failed and
    `TimeoutError` if the ranks did not all finish within `timeout` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    check_backend(backend, LAUNCH_BACKENDS)
    from ..kernels.backend import default_backend

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    collective_timeout = max(5.0, timeout)
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, collective_timeout, dict(env or {}), default_backend(),
                  fn, args, kwargs, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    needed = set(range(world_size)) - set(may_die)
    deadline = time.monotonic() + timeout
    try:
        while not needed <= set(outs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(needed - set(outs))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s (hang or deadlock)")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r in sorted(needed - set(outs)) if procs[r].exitcode not in (None, 0)]
                if dead:
                    r = dead[0]
                    raise RankError(r, "ProcessDied", f"exit code {procs[r].exitcode}", "(no traceback)") from None
                continue
            if not ok:
                raise RankError(rank, *payload)
            outs[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=0.2 if not needed <= set(outs) else 5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    return [outs.get(r) for r in range(world_size)]
