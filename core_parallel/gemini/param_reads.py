"""What the two read paths of a chunked parameter share: the module hooks (`hooks.py`, the fast path) and the
guarded fallback (`fallback.py`, any other read). Both tag a tensor with the chunk manager and parameter index it
reads from (`set_owner`, `owner_of`), gather and release outside any dispatch mode (`outside_modes`), and gather
a forward use's chunks again around its backward (`BackwardCall`). Every hook either path registers runs outside
torch.compile's graphs (`eager`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["BackwardCall", "eager", "outside_modes", "owner_of", "set_owner"]


def eager(fn: Callable) -> Callable:
    """`fn` run eagerly, never traced by torch.compile (dynamo breaks the graph around it). Gemini's hooks gather and
    release chunks: collectives, waits and bookkeeping that differ from call to call (which chunk is gathered,
    prefetched or kept), so a trace of them diverges between dynamo's passes (`SpeculationLogDivergence`) or fails
    its guards on every chunk (a recompile per chunk until the limit). Outside them the module's own ops compile."""
    return torch.compiler.disable(fn, reason="Gemini gathers and releases chunks here (collectives, bookkeeping)")


def set_owner(t: torch.Tensor, mgr: Any, pidx: int) -> None:
    """Tag `t` (a chunked parameter, or a fallback view of one) with its chunk manager and parameter index."""
    t._gemini = (mgr, pidx)


def owner_of(t: torch.Tensor) -> tuple[Any, int] | None:
    """(chunk manager, parameter index) of a tensor tagged by `set_owner`; None for any other tensor."""
    return getattr(t, "_gemini", None)


def outside_modes() -> Any:
    """A context in which gathers and releases run outside any TorchDispatchMode. Under selective activation
    checkpointing the module hooks fire inside the checkpointed region, in forward and again in the recompute, and
    whether a chunk must be gathered there can differ between the two (it may still be gathered, or not); the ops
    of a gather (empty, all_gather) would then appear in one run and not the other, which selective checkpointing
    rejects ("encountered during backward but not found in storage")."""
    return _disable_current_modes() if torch._C._len_torch_dispatch_stack() else contextlib.nullcontext()


class BackwardCall:
    """One forward use of some chunks (a module call, or one op of the fallback), seen from backward: gathers
    once before its backward (`pre`, a hook on its outputs' gradients), releases once after (`post`, a hook on
    its inputs' gradients)."""

    __slots__ = ("mgr", "ids", "gathered", "released")

    def __init__(self, mgr: Any, ids: tuple[int, ...]) -> None:
        self.mgr, self.ids = mgr, ids
        self.gathered = self.released = False

    @eager
    def pre(self, grad: torch.Tensor) -> None:
        if not self.gathered:
            self.gathered = True
            self.mgr.begin_backward()
            with outside_modes():
                self.mgr.access(self.ids)

    @eager
    def post(self, grad: torch.Tensor) -> None:
        if self.gathered and not self.released and self.mgr.in_backward:
            self.released = True
            with outside_modes():
                self.mgr.done(self.ids)
