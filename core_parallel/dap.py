"""Communication primitives of dynamic axial parallelism (DAP), on an explicit process group.

A DAP group holds one model replica whose activations are split along one tensor dim across the ranks of
the group (the mesh axis). Four moves cover the Evoformer:

- `scatter(x, dim, group)`: whole -> split along `dim` (keep this rank's slice);
- `gather(x, dim, group, full_size=...)`: split along `dim` -> whole (all-gather);
- `all_to_all(x, from_dim, to_dim, group, from_size=...)`: split along `from_dim` -> split along `to_dim`;
- `gather_async` / `all_to_all_async`: the same, launched now and finished by `Pending.wait()`, so the
  communication overlaps whatever the caller computes in between (in the backward pass too).

Split layout. A dim of length L is cut into chunks of c = ceil(L / W) on W ranks: rank r holds
[r*c, min(L, (r+1)*c)), so the last ranks may hold fewer rows (or none when L < W). Uneven sizes are padded
inside the primitives and the padding never leaves them; callers see exact shards.

Gradient convention (as in `torch.distributed.nn.functional`): the loss being differentiated is the sum of
every rank's loss. Gradients of replicated tensors (and of replicated weights) are therefore partial: sum
them over the group (`all_reduce_grads`) to get the full gradient. So `gather`'s backward is a
reduce-scatter and `scatter`'s backward keeps the local gradient slice in place, without communication.

`group=None` means what it means everywhere in `core_parallel` (`groups.world_rank`): the default process
group when one is initialised, else one process, where every primitive is the identity (no process group
needed). To run unsplit inside a multi-process job, pass a one-rank group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .groups import world_rank

__all__ = [
    "Pending",
    "all_reduce_grads",
    "all_to_all",
    "all_to_all_async",
    "gather",
    "gather_async",
    "group_rank",
    "group_size",
    "scatter",
    "shard_range",
    "shard_size",
]

Group = Any  # dist.ProcessGroup | None


def group_size(group: Group) -> int:
    """Number of ranks on the mesh axis `group` (`world_rank`'s meaning of None)."""
    return world_rank(group)[0]


def group_rank(group: Group) -> int:
    """This process's index on the mesh axis `group` (`world_rank`'s meaning of None)."""
    return world_rank(group)[1]


def _chunk(length: int, world: int) -> int:
    return max(1, math.ceil(length / world))


def shard_range(length: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s shard of a dim of `length` split over `world` ranks."""
    if length < 0 or world < 1 or not 0 <= rank < world:
        raise ValueError(f"bad shard request: length={length}, world={world}, rank={rank}")
    c = _chunk(length, world)
    start = min(length, rank * c)
    return start, min(length, start + c)


def shard_size(length: int, world: int, rank: int) -> int:
    """Length of rank `rank`'s shard of a dim of `length` split over `world` ranks."""
    start, stop = shard_range(length, world, rank)
    return stop - start


def _pad_dim(x: torch.Tensor, dim: int, target: int) -> torch.Tensor:
    """Zero-pad `x` at the end of `dim` up to `target` rows."""
    extra = target - x.size(dim)
    if extra < 0:
        raise ValueError(f"cannot pad dim {dim} of size {x.size(dim)} down to {target}")
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _norm_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} out of range for a {ndim}-d tensor")
    return dim % ndim


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


# --- the collective steps, each split into launch (returns work, buffer) and finish (returns result) ---


@dataclass(frozen=True)
class _GatherOp:
    """Split along `dim` (full length `full_size`) -> whole. Backward: reduce-scatter."""

    dim: int
    group: Group
    full_size: int

    @property
    def world(self) -> int:
        return group_size(self.group)

    def launch(self, x: torch.Tensor) -> tuple[Any, torch.Tensor]:
        c = _chunk(self.full_size, self.world)
        send = _pad_dim(x, self.dim, c).movedim(self.dim, 0).contiguous()
        buf = send.new_empty((self.world * c, *send.shape[1:]))
        return _all_gather_single(buf, send, self.group, True), buf

    def finish(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.narrow(0, 0, self.full_size).movedim(0, self.dim)

    def launch_backward(self, g: torch.Tensor) -> tuple[Any, torch.Tensor]:
        c = _chunk(self.full_size, self.world)
        send = _pad_dim(g, self.dim, self.world * c).movedim(self.dim, 0).contiguous()
        buf = send.new_empty((c, *send.shape[1:]))
        return _reduce_scatter_single(buf, send, self.group, True), buf

    def finish_backward(self, buf: torch.Tensor) -> torch.Tensor:
        local = shard_size(self.full_size, self.world, group_rank(self.group))
        return buf.narrow(0, 0, local).movedim(0, self.dim)


@dataclass(frozen=True)
class _AllToAllOp:
    """Split along `from_dim` (full length `from_size`) -> split along `to_dim`. Backward: the inverse."""

    from_dim: int
    to_dim: int
    group: Group
    from_size: int
    to_size: int

    def inverse(self) -> _AllToAllOp:
        return _AllToAllOp(self.to_dim, self.from_dim, self.group, self.to_size, self.from_size)

    def launch(self, x: torch.Tensor) -> tuple[Any, torch.Tensor]:
        world = group_size(self.group)
        c_to, c_from = _chunk(self.to_size, world), _chunk(self.from_size, world)
        x = _pad_dim(_pad_dim(x, self.to_dim, world * c_to), self.from_dim, c_from)
        # [W, piece]: one copy at most (none when to_dim is the leading dim of a contiguous x)
        send = x.unflatten(self.to_dim, (world, c_to)).movedim(self.to_dim, 0).contiguous()
        buf = torch.empty_like(send)
        return dist.all_to_all_single(buf, send, group=self.group, async_op=True), buf

    def finish(self, buf: torch.Tensor) -> torch.Tensor:
        local = shard_size(self.to_size, group_size(self.group), group_rank(self.group))
        # rank j's piece holds its rows of from_dim: concatenating in rank order is a reshape (a view when
        # from_dim is the leading dim of the piece)
        whole = buf.movedim(0, self.from_dim).flatten(self.from_dim, self.from_dim + 1)
        return whole.narrow(self.from_dim, 0, self.from_size).narrow(self.to_dim, 0, local)

    def launch_backward(self, g: torch.Tensor) -> tuple[Any, torch.Tensor]:
        return self.inverse().launch(g)

    def finish_backward(self, buf: torch.Tensor) -> torch.Tensor:
        return self.inverse().finish(buf)


@dataclass
class _State:
    """Work handles and buffers shared by the launch and wait halves of one async primitive."""

    work: Any = None
    backward_work: Any = None
    backward_buf: torch.Tensor | None = None
    buf_shape: tuple[int, ...] = field(default_factory=tuple)


class _Launch(torch.autograd.Function):
    """Forward: start the collective. Backward: wait for the backward collective `_Wait` started."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, op: Any, state: _State) -> torch.Tensor:
        state.work, buf = op.launch(x)
        state.buf_shape = tuple(buf.shape)
        ctx.op, ctx.state = op, state
        return buf

    @staticmethod
    def backward(ctx, _grad_buf: torch.Tensor):
        state = ctx.state
        state.backward_work.wait()
        grad = ctx.op.finish_backward(state.backward_buf)
        state.backward_work = state.backward_buf = None
        return grad, None, None


class _Wait(torch.autograd.Function):
    """Forward: wait for the collective and unpad. Backward: start the backward collective."""

    @staticmethod
    def forward(ctx, buf: torch.Tensor, op: Any, state: _State) -> torch.Tensor:
        state.work.wait()
        state.work = None
        ctx.op, ctx.state = op, state
        return op.finish(buf)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        state = ctx.state
        state.backward_work, state.backward_buf = ctx.op.launch_backward(grad.contiguous())
        # The real gradient travels through `state`; autograd only needs a tensor of the buffer's shape.
        return grad.new_zeros(()).expand(state.buf_shape), None, None


class Pending:
    """A collective in flight. `wait()` returns its result (once); autograd flows through it."""

    def __init__(self, x: torch.Tensor, op: Any | None) -> None:
        self._op = op
        if op is None:
            self._result: torch.Tensor | None = x
            return
        self._state = _State()
        self._buf = _Launch.apply(x, op, self._state)
        self._result = None

    def wait(self) -> torch.Tensor:
        """Block until the collective has finished; return the result tensor."""
        if self._result is None:
            self._result = _Wait.apply(self._buf, self._op, self._state)
            self._buf = None
        return self._result


# --- public primitives ---


def scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's shard of `x` along tensor dim `dim`, split over the ranks of mesh axis `group`.

    x: [..., L, ...] whole (the same on every rank) -> [..., shard_size(L, W, rank), ...]. No communication.
    The shard is a view of x (no copy; an in-place update of the shard updates x, as an in-place update of x
    would on one process). Backward: the local gradient slice, zero elsewhere.
    """
    if group_size(group) == 1:
        return x
    dim = _norm_dim(dim, x.dim())
    start, stop = shard_range(x.size(dim), group_size(group), group_rank(group))
    return x.narrow(dim, start, stop - start)


def gather_async(x: torch.Tensor, dim: int, group: Group, *, full_size: int) -> Pending:
    """Start gathering the shards of `x` along tensor dim `dim` over mesh axis `group`; see `gather`."""
    if group_size(group) == 1:
        return Pending(x, None)
    dim = _norm_dim(dim, x.dim())
    expected = shard_size(full_size, group_size(group), group_rank(group))
    if x.size(dim) != expected:
        raise ValueError(f"gather: dim {dim} holds {x.size(dim)} rows, the shard of {full_size} is {expected}")
    return Pending(x, _GatherOp(dim, group, full_size))


def gather(x: torch.Tensor, dim: int, group: Group, *, full_size: int) -> torch.Tensor:
    """All shards of `x` along tensor dim `dim`, concatenated in rank order over mesh axis `group`.

    x: [..., shard_size(full_size, W, rank), ...] -> [..., full_size, ...] (the same on every rank).
    Backward: reduce-scatter (the partial gradients of the replicated result are summed).
    """
    return gather_async(x, dim, group, full_size=full_size).wait()


def all_to_all_async(x: torch.Tensor, from_dim: int, to_dim: int, group: Group, *, from_size: int) -> Pending:
    """Start moving the split of `x` from `from_dim` to `to_dim` over mesh axis `group`; see `all_to_all`."""
    if group_size(group) == 1:
        return Pending(x, None)
    from_dim, to_dim = _norm_dim(from_dim, x.dim()), _norm_dim(to_dim, x.dim())
    if from_dim == to_dim:
        raise ValueError(f"all_to_all: from_dim and to_dim are both {from_dim}")
    expected = shard_size(from_size, group_size(group), group_rank(group))
    if x.size(from_dim) != expected:
        raise ValueError(f"all_to_all: dim {from_dim} holds {x.size(from_dim)} rows, the shard is {expected}")
    return Pending(x, _AllToAllOp(from_dim, to_dim, group, from_size, x.size(to_dim)))


def all_to_all(x: torch.Tensor, from_dim: int, to_dim: int, group: Group, *, from_size: int) -> torch.Tensor:
    """Move the split of `x` from tensor dim `from_dim` to tensor dim `to_dim` over mesh axis `group`.

    x: split along `from_dim` (this rank's shard of `from_size` rows), whole along `to_dim` (T rows)
    -> whole along `from_dim` (`from_size` rows), split along `to_dim` (shard_size(T, W, rank) rows).
    Backward: the inverse all-to-all.
    """
    pending = all_to_all_async(x, from_dim, to_dim, group, from_size=from_size)
    del x  # the caller's reference may be the last one: free the input while the exchange runs
    return pending.wait()


def all_reduce_grads(params: Iterable[torch.nn.Parameter], group: Group) -> None:
    """Sum the (partial) gradients of replicated parameters over mesh axis `group`, in place."""
    if group_size(group) == 1:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
