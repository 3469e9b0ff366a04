"""Gradient buckets: reduce-scatter gradients during backward (stage 2) or when it ends (stage 1).

Buckets are fixed at setup (reverse registration order, one dtype and device each) and always launched in
that order, so every rank issues the same collectives in the same sequence even when some parameters get
no gradient on some ranks: a bucket is launched during backward only once all its parameters are ready and
all earlier buckets are launched; whatever is left is launched by `flush()`, with zeros standing in for
missing gradients. Under `no_sync` the hooks do nothing and gradients accumulate locally in `param.grad`.

Both stages use the same reduce-scatter on the same buckets (so they give identical results): each rank
adds its shard into the fp32 master gradient and `param.grad` is freed. Stage 2 with `overlap` packs each
gradient into the next bucket's buffer as soon as backward produces it (freeing `param.grad` at once) and
reduces a full bucket asynchronously while backward goes on; stage 1 keeps the full gradients until
backward ends.

Memory and time: one communication buffer per dtype/device, as large as the largest bucket, is allocated
once and reused by every bucket (a fresh buffer per bucket costs page faults every step on CPU). A bucket's
reduction runs while backward computes the next gradient; the next bucket starts filling the buffer once
that reduction is done. One buffer instead of two (fill one while the other reduces) keeps ZeRO-2's fixed
overhead at about one bucket plus one gradient.

A bucket of one contiguous parameter whose size divides by the world size is "direct": its flat layout
already is the `[world, S]` grid, so the gradient is reduced in place in `param.grad` and the parameter is
all-gathered in place, with no packing copies and no buffer. The optimizer gives large such parameters
buckets of their own. On gloo the reduce-scatter is one in-place `reduce` per rank and
the all-gather one in-place `broadcast` per rank: gloo's own reduce_scatter/all_gather are 1.5-2.5x slower
on CPU for large buckets (measured with torch 2.13). Buckets under `_SMALL_BYTES` are latency-bound and use
the single native collective instead. NCCL always uses its reduce_scatter/all_gather.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import flat
from ..trace import CollectiveTrace

__all__ = ["GradReducer", "Slot"]

logger = logging.getLogger(__name__)

_SMALL_BYTES = 1 << 18  # gloo: below this a bucket uses one native collective instead of one op per rank
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class Slot:
    """One managed parameter: the model's working tensor and this rank's fp32 master shard."""

    name: str
    param: torch.nn.Parameter
    group: int
    master: torch.Tensor
    """[end - start] fp32 values this rank owns (a view into the parameter under fp32 without offload)."""
    start: int
    end: int
    world: int = 1
    """Size of the group the parameter is sharded over."""
    bucket: int = -1
    had_grad: bool = False
    """This rank saw a gradient for the parameter since the last step."""
    shape: tuple[int, ...] = field(init=False)
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.shape = tuple(self.param.shape)
        self.numel = self.param.numel()

    @property
    def shard(self) -> int:
        """Padded shard length (elements), the same on every rank."""
        return flat.shard_size(self.numel, self.world)


class _Comm:
    """Reduce-scatter and all-gather of a `[world, S]` grid over one group (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, world: int, rank: int) -> None:
        self.group = group
        self.world = world
        self.rank = rank
        self.gloo = world > 1 and dist.get_backend(group) == "gloo"
        self.peers = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]

    def reduce_scatter(self, grid: torch.Tensor) -> tuple[list, torch.Tensor]:
        """Start summing `grid` over the group; returns (works to wait for, [S] view of this rank's sums)."""
        if self.world == 1:
            return [], grid[0]
        if self.gloo and grid.numel() * grid.element_size() >= _SMALL_BYTES:
            g = self.group
            works = [dist.reduce(grid[r], dst=peer, group=g, async_op=True) for r, peer in enumerate(self.peers)]
            return works, grid[self.rank]
        out = grid.new_empty(grid.shape[1])
        return [_reduce_scatter(out, grid.reshape(-1), group=self.group, async_op=True)], out

    def all_gather(self, grid: torch.Tensor) -> list:
        """Start filling every row of `grid` from the rank that owns it (row `rank` is this rank's input)."""
        if self.world == 1:
            return []
        if self.gloo and grid.numel() * grid.element_size() >= _SMALL_BYTES:
            g = self.group
            return [dist.broadcast(grid[r], src=peer, group=g, async_op=True) for r, peer in enumerate(self.peers)]
        local = grid[self.rank].clone()
        return [_all_gather(grid.reshape(-1), local, group=self.group, async_op=True)]


def _wait(works: list) -> None:
    for w in works:
        w.wait()


@dataclass(eq=False)
class _Pending:
    works: list
    bucket: int
    out: torch.Tensor
    keep: torch.Tensor | None = None
    """A direct bucket's gradient, alive until its reduction is done."""


class GradReducer:
    """Owns the gradient hooks, bucket buffers and bucketed collectives of one ZeRO optimizer."""

    def __init__(
        self,
        slots: Sequence[Slot],
        buckets: list[list[int]],
        *,
        stage: int,
        group: dist.ProcessGroup | None,
        world: int,
        rank: int,
        overlap: bool,
        collectives: CollectiveTrace,
    ) -> None:
        self.slots = list(slots)
        self.collectives = collectives
        """Where this rank is (`core_parallel.trace`): each bucket's wait is a traced collective, also when
        backward runs as `loss.backward()` outside `ZeroOptimizer.backward`."""
        self.buckets = buckets
        self.stage = stage
        self.group = group
        self.world = world
        self.rank = rank
        self.overlap = overlap
        self.sync = True
        """False under `no_sync`: gradients accumulate locally."""
        self.in_optimizer_backward = False
        self.flushed = False
        """A flush ran since the last `reset()` (the optimizer's step or zero_grad)."""
        self.local_pending = False
        """Gradients were accumulated under no_sync since the last flush."""
        self._comm = _Comm(group, world, rank)
        for b, idx in enumerate(buckets):
            for i in idx:
                self.slots[i].bucket = b
        self._width = [sum(self.slots[i].shard for i in idx) for idx in buckets]
        self._key = [(self.slots[idx[0]].param.dtype, self.slots[idx[0]].param.device) for idx in buckets]
        self._direct = [len(idx) == 1 and self.slots[idx[0]].numel % world == 0 and self.slots[idx[0]].numel > 0
                        and self.slots[idx[0]].param.is_contiguous() for idx in buckets]
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._ready: list[set[int]] = [set() for _ in buckets]
        self._packed: set[int] = set()
        self._next = 0
        self._pending: list[_Pending] = []
        self._callback_queued = False
        self._handles = [
            s.param.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, s in enumerate(self.slots)
            if s.param.requires_grad
        ]

    def detach(self) -> None:
        """Remove the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _grid(self, b: int) -> torch.Tensor:
        """Bucket `b`'s [world, S] view of the buffer of its dtype/device (no reduction may be using it)."""
        key = self._key[b]
        if key not in self._buffers:
            size = self.world * max(w for w, k, d in zip(self._width, self._key, self._direct) if k == key and not d)
            self._buffers[key] = torch.empty(size, dtype=key[0], device=key[1])
        buf = self._buffers[key]
        return buf[: self.world * self._width[b]].view(self.world, self._width[b])

    def _make_hook(self, index: int):
        def hook(_param: torch.Tensor) -> None:
            self.slots[index].had_grad = True
            if not self.sync:
                self.local_pending = True
                return
            if not self.in_optimizer_backward and not self._callback_queued:
                # loss.backward() called directly: flush when this backward pass ends.
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._callback_queued = True
            if not (self.overlap and self.stage == 2):
                return
            bucket = self.slots[index].bucket
            self._ready[bucket].add(index)
            if bucket == self._next and not self._direct[bucket]:
                self._drain()
                self._pack(index)
            while self._next < len(self.buckets) and len(self._ready[self._next]) == len(self.buckets[self._next]):
                self._launch(self._next)
                self._next += 1

        return hook

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.flush()

    def _pack(self, index: int) -> None:
        """Copy slot `index`'s gradient (zeros when it has none) into its bucket's buffer and free `param.grad`."""
        s = self.slots[index]
        offset = sum(self.slots[i].shard for i in self.buckets[s.bucket][: self.buckets[s.bucket].index(index)])
        g = s.param.grad
        s.had_grad = s.had_grad or g is not None
        flat.pack_into(self._grid(s.bucket), offset, s.numel, None if g is None else g.reshape(-1), self.world)
        s.param.grad = None
        self._packed.add(index)

    def flush(self) -> None:
        """Launch every bucket not launched yet (in order) and wait for all; ends the round."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        self._drain()
        self._ready = [set() for _ in self.buckets]
        self._packed.clear()
        self._next = 0
        self.flushed = True
        self.local_pending = False

    def reset(self) -> None:
        """Forget per-step bookkeeping (after step or zero_grad)."""
        self.flushed = False
        self.local_pending = False
        for s in self.slots:
            s.had_grad = False

    def _drain(self) -> None:
        while self._pending:
            self._finish(self._pending.pop(0))

    def _launch(self, b: int) -> None:
        self._drain()
        if self._direct[b]:
            self._launch_direct(b)
            return
        for i in self.buckets[b]:
            if i not in self._packed:
                self._pack(i)
        works, out = self._comm.reduce_scatter(self._grid(b))
        self._pending.append(_Pending(works, b, out))

    def _launch_direct(self, b: int) -> None:
        s = self.slots[self.buckets[b][0]]
        g = s.param.grad
        s.had_grad = s.had_grad or g is not None
        s.param.grad = None
        g = s.param.new_zeros(s.numel) if g is None else g.reshape(-1)
        if self.world > 1:
            g.div_(self.world)
        works, out = self._comm.reduce_scatter(g.view(self.world, -1))
        self._pending.append(_Pending(works, b, out, keep=g))

    def _finish(self, p: _Pending) -> None:
        with self.collectives.collective(f"reduce_scatter of bucket {p.bucket}"):
            _wait(p.works)
        offset = 0
        for i in self.buckets[p.bucket]:
            s = self.slots[i]
            piece = p.out[offset : offset + s.end - s.start]
            if s.master.grad is None:
                s.master.grad = piece.to(s.master.device, torch.float32, copy=True)
            else:
                s.master.grad.add_(piece.to(s.master.device))
            offset += s.shard

    def gather_params(self) -> None:
        """Copy the updated master shards back into the full working parameters (all-gather per bucket).

        Direct buckets gather in place into the parameter, all in flight together; the others go one at a
        time through the shared buffer.
        """
        in_flight: list = []
        with torch.no_grad():
            for b, idx in enumerate(self.buckets):
                if self._direct[b]:
                    s = self.slots[idx[0]]
                    grid = s.param.detach().view(self.world, -1)
                    if s.master.data_ptr() != grid[self.rank].data_ptr():
                        grid[self.rank].copy_(s.master)
                    in_flight += self._comm.all_gather(grid)
                    continue
                grid = self._grid(b)
                offset = 0
                for i in idx:
                    s = self.slots[i]
                    grid[self.rank, offset : offset + s.end - s.start].copy_(s.master)
                    offset += s.shard
                self._unpack(b, grid, self._comm.all_gather(grid))
            with self.collectives.collective("all_gather of the single-parameter buckets"):
                _wait(in_flight)

    def _unpack(self, b: int, grid: torch.Tensor, works: list) -> None:
        with self.collectives.collective(f"all_gather of bucket {b}"):
            _wait(works)
        offset = 0
        for i in self.buckets[b]:
            s = self.slots[i]
            if s.param.is_contiguous():
                flat.unpack_into(grid, offset, s.param.view(-1))
            else:
                full = grid.new_empty(s.numel)
                flat.unpack_into(grid, offset, full)
                s.param.copy_(full.view(s.shape))
            offset += s.shard
