"""The chunk state machine. Illegal transitions raise (they are bugs), they are never ignored.

Parameter data (the gathered chunk):  RELEASED -> GATHERING (prefetch in flight) -> GATHERED -> RELEASED,
or RELEASED -> GATHERED directly. `users` counts the modules computing with the chunk right now (forward or
backward); a chunk is released only when no module uses it.

Gradients of one backward pass: EMPTY -> ACCUMULATING (a parameter's gradient arrived) -> EMPTY once the
chunk has been reduce-scattered into the gradient shard. Under `no_sync` the chunk stays ACCUMULATING
across backward passes. `ready` holds the parameters whose gradient arrived in this pass: when it covers
all trainable parameters of the chunk, the chunk can be reduced before the pass ends.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ChunkState", "GeminiStateError", "GradState", "ChunkStateMachine"]


class GeminiStateError(RuntimeError):
    """An illegal chunk state transition: a bug in the hooks, or a parameter used outside its module."""


class ChunkState(str, Enum):
    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


class GradState(str, Enum):
    EMPTY = "empty"
    ACCUMULATING = "accumulating"


_DATA = {
    ChunkState.RELEASED: {ChunkState.GATHERING, ChunkState.GATHERED},
    ChunkState.GATHERING: {ChunkState.GATHERED},
    ChunkState.GATHERED: {ChunkState.RELEASED},
}
_GRAD = {GradState.EMPTY: {GradState.ACCUMULATING}, GradState.ACCUMULATING: {GradState.EMPTY}}


class ChunkStateMachine:
    """State of one chunk: data state, users, gradient state and the parameters whose grads arrived."""

    def __init__(self, index: int, trainable_params: frozenset[int]) -> None:
        self.index = index
        self.trainable = trainable_params
        self.data = ChunkState.RELEASED
        self.grad = GradState.EMPTY
        self.users = 0
        self.ready: set[int] = set()

    def to(self, state: ChunkState) -> None:
        if state not in _DATA[self.data]:
            raise GeminiStateError(f"chunk {self.index}: data cannot go {self.data.value} -> {state.value}")
        if state is ChunkState.RELEASED and self.users:
            raise GeminiStateError(f"chunk {self.index}: released while {self.users} module(s) use it")
        self.data = state

    def drop(self) -> None:
        """Backward is done with the data while modules still count as users: every trainable parameter of the
        chunk got its gradient in this pass, so no backward node needs their values any more (a later use
        gathers again)."""
        if self.data is ChunkState.RELEASED or not self.trainable or not self.grads_complete():
            raise GeminiStateError(f"chunk {self.index}: dropped while {self.data.value} or gradients missing")
        self.data = ChunkState.RELEASED

    def acquire(self) -> None:
        """A module starts computing with the chunk (it must be gathered)."""
        if self.data is not ChunkState.GATHERED:
            raise GeminiStateError(f"chunk {self.index}: used while {self.data.value}")
        self.users += 1

    def release_use(self) -> bool:
        """A module is done with the chunk; True when nobody uses it any more."""
        if self.users <= 0:
            raise GeminiStateError(f"chunk {self.index}: more releases than uses")
        self.users -= 1
        return self.users == 0

    def grad_arrived(self, param: int) -> bool:
        """The gradient of `param` was added to the chunk; True when all trainable params have theirs."""
        if param not in self.trainable:
            raise GeminiStateError(f"chunk {self.index}: gradient for parameter {param} that it does not train")
        if self.grad is GradState.EMPTY:
            self.grad = GradState.ACCUMULATING
        self.ready.add(param)
        return self.grads_complete()

    def grad_reduced(self) -> None:
        """The accumulated gradients were reduce-scattered into the shard."""
        self.grad = GradState.EMPTY
        self.ready.clear()

    def grads_complete(self) -> bool:
        """Whether every trainable parameter of the chunk got its gradient in this pass."""
        return self.ready >= self.trainable

    def begin_backward(self) -> None:
        """A new backward pass starts: no gradient of it arrived yet (under no_sync the accumulated ones stay)."""
        self.ready.clear()

    def end_backward(self) -> None:
        """The backward pass is over: no module computes with the chunk any more (a module whose backward gathered
        the chunk but whose inputs need no gradient never reports that it is done, and still counts as a user)."""
        self.users = 0
