"""Gradient buckets: reduce-scatter gradients during backward (stage 2) or when it ends (stage 1).

Buckets are fixed at setup (reverse registration order, one dtype and device each) and always launched in
that order, so every rank issues the same collectives in the same sequence even when some parameters get
no gradient on some ranks: a bucket is launched during backward only once all its parameters are ready and
all earlier buckets are launched; whatever is left is launched by `flush()`, with zeros standing in for
missing gradients. Under `no_sync` the hooks do nothing and gradients accumulate locally in `param.grad`.

Both stages use the same reduce-scatter on the same buckets (so they give identical results): each rank
adds its shard into the fp32 master gradient and `param.grad` is freed. Stage 2 with `overlap` launches
buckets asynchronously as backward produces them; stage 1 keeps the full gradients until backward ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from core_parallel import flat

__all__ = ["GradReducer", "Slot"]

logger = logging.getLogger(__name__)

_MAX_IN_FLIGHT = 1  # one bucket reducing while backward produces the next: bounded extra memory
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


@dataclass(eq=False)
class _Pending:
    work: object | None
    bucket: int
    buffer: torch.Tensor
    out: torch.Tensor


class GradReducer:
    """Owns the gradient hooks and bucketed collectives of one ZeRO optimizer."""

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
    ) -> None:
        self.slots = list(slots)
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
        for b, idx in enumerate(buckets):
            for i in idx:
                self.slots[i].bucket = b
        self._ready: list[set[int]] = [set() for _ in buckets]
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
            self._ready[self.slots[index].bucket].add(index)
            while self._next < len(self.buckets) and len(self._ready[self._next]) == len(self.buckets[self._next]):
                self._launch(self._next)
                self._next += 1

        return hook

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.flush()

    def flush(self) -> None:
        """Launch every bucket not launched yet (in order) and wait for all; ends the round."""
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        while self._pending:
            self._finish(self._pending.pop(0))
        self._ready = [set() for _ in self.buckets]
        self._next = 0
        self.flushed = True
        self.local_pending = False

    def reset(self) -> None:
        """Forget per-step bookkeeping (after step or zero_grad)."""
        self.flushed = False
        self.local_pending = False
        for s in self.slots:
            s.had_grad = False

    def _launch(self, b: int) -> None:
        while len(self._pending) >= _MAX_IN_FLIGHT:
            self._finish(self._pending.pop(0))
        slots = [self.slots[i] for i in self.buckets[b]]
        grads = []
        for s in slots:
            g = s.param.grad
            s.had_grad = s.had_grad or g is not None
            grads.append(g.reshape(-1) if g is not None else s.param.new_zeros(s.numel))
        buffer = flat.pack_for_reduce_scatter(grads, self.world)
        for s in slots:
            s.param.grad = None
        buffer.div_(self.world)
        work, out = None, buffer
        if self.world > 1:
            out = buffer.new_empty(buffer.numel() // self.world)
            work = _reduce_scatter(out, buffer, group=self.group, async_op=self.overlap and self.stage == 2)
        self._pending.append(_Pending(work, b, buffer, out))

    def _finish(self, p: _Pending) -> None:
        if p.work is not None and hasattr(p.work, "wait"):
            p.work.wait()
        offset = 0
        for i in self.buckets[p.bucket]:
            s = self.slots[i]
            view = p.out[offset : offset + s.end - s.start]
            piece = view.to(s.master.device, torch.float32)
            if s.master.grad is None:
                s.master.grad = piece.clone() if piece.data_ptr() == view.data_ptr() else piece
            else:
                s.master.grad.add_(piece)
            offset += s.shard

    def gather_params(self) -> None:
        """Copy the updated master shards back into the full working parameters (all-gather per bucket)."""
        with torch.no_grad():
            for idx in self.buckets:
                slots = [self.slots[i] for i in idx]
                p0 = slots[0].param
                local = torch.zeros(sum(s.shard for s in slots), dtype=p0.dtype, device=p0.device)
                offset = 0
                for s in slots:
                    local[offset : offset + s.end - s.start] = s.master
                    offset += s.shard
                if self.world > 1:
                    gathered = local.new_empty(local.numel() * self.world)
                    _all_gather(gathered, local, group=self.group)
                else:
                    gathered = local
                for s, full in zip(slots, flat.unpack_gathered(gathered, [s.numel for s in slots], self.world)):
                    s.param.copy_(full.view(s.shape))
