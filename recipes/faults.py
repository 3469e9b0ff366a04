"""What the sharded strategies (`recipes.strategies`) do when a run fails from outside: a rank lost, or SIGTERM.

- A rank that dies turns into an error on the others within seconds (gloo sees its socket close, Gemini's
  shared-memory collectives see its process gone); one that stops answering, after `collective_timeout_s`.
  The error names the rank, the last complete checkpoint on disk and how to resume from it. It says the rank
  exited only when its process is gone or its connection closed; a rank alive but elsewhere (another collective,
  a rank-0-only callback) is named as alive, with where each rank is (`core_parallel.trace`; set
  `LOWMEM_TRACE_COLLECTIVES=1` to record every rank's last collective). An app that
  moves its checkpoints after `trainer.save_checkpoint` (a staging folder renamed into place) names the
  final folder and its resume advice with `strategy.note_checkpoint(path, resume="...")`.
- SIGTERM (a preempted or cancelled job) is not taken for success (`core_parallel.preemption.Preemption`, which
  plain loops use the same way): training goes on to the end of the
  current optimizer step, every rank agrees on stopping, a checkpoint is written, one line says where and
  how to resume, and the process exits with code 143 (128 + SIGTERM). Lightning's own handler would stop at
  the next batch, possibly mid-accumulation, without a checkpoint and with exit code 0. The checkpoint is
  written by the first trainer callback that has a `save_on_signal(trainer, module)` method (returning the
  path; the diffusion recipe's checkpoint-N writer does), else as `preempted-step=N.ckpt` in the
  ModelCheckpoint folder or `default_root_dir`. A rank that cannot reach the step boundary because it waits in a
  collective its peers do not join is ended within seconds (`Preemption`'s watchdog, `LOWMEM_SIGTERM_GRACE_S`):
  exit 143, one line naming where it waits and the last complete checkpoint.

The strategies hold the state (the SIGTERM flag, the last checkpoint) and run the collective that makes the ranks
agree; this module holds the parts that need no process group.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ..core_parallel.preemption import SIGTERM_EXIT_CODE, Preemption
from ..core_parallel.trace import TRACE_ENV

__all__ = ["SIGTERM_EXIT_CODE", "StopOnSigterm", "looks_like_peer_failure", "peer_failure_message", "resume_hint",
           "save_at_sigterm", "watch_sigterm"]


# Messages by which gloo, NCCL and the TCP store report a peer that died or stopped answering.
_PEER_FAILURE = re.compile(
    r"connection (closed|reset|refused)|closed by peer|broken pipe|timed? ?out|timeout|"
    r"ECONNRESET|EPIPE|socket|NCCL communicator was aborted|store.*(closed|failed)|recv|send",
    re.IGNORECASE,
)


def looks_like_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is how a collective reports a rank that died or stopped answering."""
    dist_errors = tuple(
        getattr(dist, name) for name in ("DistError", "DistBackendError", "DistNetworkError") if hasattr(dist, name)
    )
    if dist_errors and isinstance(exc, dist_errors):
        return True
    return isinstance(exc, RuntimeError | TimeoutError | ConnectionError) and bool(_PEER_FAILURE.search(str(exc)))


def _peer_error(exc: BaseException | None) -> BaseException | None:
    """The `core_parallel.peers.PeerLostError` in `exc`'s chain (it says whether its ranks exited), if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(getattr(exc, "ranks", None), list) and isinstance(getattr(exc, "dead", None), bool):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


_CONNECTION_CLOSED = re.compile(r"connection (closed|reset)|closed by peer|broken pipe|ECONNRESET|EPIPE|EOF",
                                re.IGNORECASE)


def peer_failure_message(exc: BaseException, rank: int, world: int, timeout_s: float, hint: str) -> str:
    """The one message of a peer failure seen on `rank`: what happened to whom, then where to resume (`hint`).

    A rank is said to have exited only on evidence: `PeerLostError(dead=True)` (its process is gone) or a closed
    connection; one alive but elsewhere is named as alive (with where each rank is, from `core_parallel.trace`);
    a timeout with neither is said to be a timeout, its rank's liveness unknown."""
    named = _peer_error(exc)
    ranks = [int(r) for r in named.ranks] if named is not None and named.ranks else [1 - rank] if world == 2 else []
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}" if ranks else "another rank"
    if named is not None and named.dead:
        what = f"lost contact with {who}: its process exited"
    elif named is not None:
        where = f" Where each rank is: {named.where}" if getattr(named, "where", "") else ""
        unseen = [r for r in ranks if r not in getattr(named, "alive", [])]
        liveness = ("no process died (alive but elsewhere)" if not unseen else
                    f"whether rank(s) {unseen} are alive cannot be seen from this rank")
        what = f"{who} did not answer within the collective timeout of {timeout_s:g}s; {liveness}.{where}"
    elif _CONNECTION_CLOSED.search(str(exc)):
        what = f"lost contact with {who}: its connection closed (its process exited or its host went away)"
    else:
        what = (f"{who} did not answer within the collective timeout of {timeout_s:g}s (whether it is alive cannot "
                f"be seen from this rank; {TRACE_ENV}=1 records where each rank is)")
    return f"rank {rank}: {what}; training stopped. {hint} Cause: {exc}"


def resume_hint(path: str | None, advice: str | None) -> str:
    """'Last complete checkpoint: PATH; resume with ...', naming only a checkpoint that is on disk."""
    if path is None:
        return "Last complete checkpoint: none saved in this run."
    if not os.path.exists(path):
        return (f"Last complete checkpoint: none found ({path} was saved in this run but is no longer there: "
                f"moved, removed, or on another host's disk).")
    advice = advice or f"trainer.fit(..., ckpt_path={path!r})"
    return f"Last complete checkpoint: {path}; resume with {advice}."


def watch_sigterm(trainer: Any, preemption: Preemption) -> None:
    """Install `preemption`'s SIGTERM handler (`core_parallel.preemption`, acted on at the next optimizer-step
    boundary, `StopOnSigterm`), still calling the handler that was there before Lightning's. Call after Lightning
    registered its own handler (Trainer._run), which is replaced: it runs a collective inside the handler and
    stops at the next batch without a checkpoint, exiting 0. Lightning's teardown restores the handler it found.
    A rank that waits in a collective after SIGTERM is ended by `preemption`'s watchdog (exit 143, one line naming
    the strategy's traced collective and the last checkpoint)."""
    connector = getattr(trainer, "_signal_connector", None)
    strategy = trainer.strategy
    # a rank stuck in a collective is ended by the watchdog: its line names the strategy's traced collective
    preemption.trace = getattr(getattr(strategy, "_core_optimizer", None), "collectives", None)
    preemption.context = lambda: resume_hint(getattr(strategy, "_last_checkpoint", None),
                                             getattr(strategy, "_resume_advice", None))
    preemption.install(chain=getattr(connector, "_original_handlers", {}).get(signal.SIGTERM))


def save_at_sigterm(trainer: Any, module: Any) -> None:
    """The checkpoint of a run stopped by SIGTERM: by the first callback with `save_on_signal`, else
    `preempted-step=N.ckpt` in the ModelCheckpoint folder or `default_root_dir`."""
    saver = next((cb for cb in trainer.callbacks if callable(getattr(cb, "save_on_signal", None))), None)
    if saver is not None:
        saver.save_on_signal(trainer, module)
    else:
        folder = getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir
        trainer.save_checkpoint(os.path.join(folder, f"preempted-step={trainer.global_step}.ckpt"))


class StopOnSigterm(Callback):
    """Registered by the sharded strategies: checks for a SIGTERM at each optimizer-step boundary (a step has
    completed when `global_step` moved), so a checkpoint never holds half an accumulated gradient."""

    def __init__(self) -> None:
        self._step: int | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        stop = getattr(trainer.strategy, "stop_if_terminated", None)
        if trainer.global_step == self._step or not callable(stop):
            return
        self._step = trainer.global_step
        stop(trainer, module)
