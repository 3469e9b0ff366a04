"""One chunk at run time: the gathered buffer its parameters view, and its fp32 shards in their tiers.

The gathered buffer `full` ([size], compute dtype, on the compute device) keeps one storage object for the
whole run: releasing resizes that storage to 0 bytes and gathering resizes it back and fills it. On a CPU
device the storage is a fixed anonymous mapping instead (`HostPages`), and so is the flat gradient buffer:
releasing hands the pages to the manager's `PageRecycler`, which moves them to the next buffer filled, and the
C heap never sees chunk-sized blocks come and go. On one rank of a CPU device, a master on the device tier in
the gathered dtype (a frozen LoRA base, or fp32 training) is `full` itself (`pin`): its gathers and releases move
no byte. The parameters are views of `full` set once at setup, so tensors autograd saved in forward see the re-gathered
data in backward, and no parameter is ever re-classed. Writes go through `full.data`, which has its own
version counter, so re-gathering does not trip autograd's in-place checks.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..host_comm import HostCollectives
from ..trace import CollectiveTrace
from .host_memory import HostPages, PageRecycler
from .layout import ChunkSpec
from .peer_reads import PeerReads
from .prefetch import Reader
from .state import ChunkState, ChunkStateMachine
from .storage import TieredBuffer

__all__ = ["Chunk", "ChunkEnv", "Reduction", "stored_dtype"]


def stored_dtype(spec: ChunkSpec, compute: torch.dtype) -> torch.dtype:
    """The dtype a chunk is gathered in: the compute dtype; a frozen chunk's is also the dtype it is stored in (it is
    never stepped, so it needs no fp32 master): its parameters' own dtype where that is narrower than the compute
    dtype (a LoRA base the user cast to bf16 under mixed precision stays bf16, as diffusers' scripts cast it),
    else the compute dtype (what compute reads: a gather from an fp32 master rounded to it)."""
    if spec.trainable:
        return compute
    own = getattr(torch, spec.dtype, None)
    if isinstance(own, torch.dtype) and own.is_floating_point and own.itemsize < compute.itemsize:
        return own
    return compute


@dataclass(frozen=True, kw_only=True)
class ChunkEnv:
    """What every chunk of one manager shares: this rank, the compute device and dtype, and how chunks
    communicate and get CPU memory."""

    rank: int
    """This process's rank in `group`."""
    world: int
    """Ranks sharing each chunk (one shard each)."""
    device: torch.device
    """Where the gathered chunk lives (the parameters' device)."""
    dtype: torch.dtype
    """Compute dtype of the gathered chunk (a frozen chunk's: `stored_dtype`)."""
    group: dist.ProcessGroup | None
    """The process group the chunks are sharded over (None: the default group, or one process)."""
    map_elems: int
    """Elements of every CPU mapping (the largest chunk's size): all alike, so pages move between any two."""
    collectives: CollectiveTrace
    """Where this rank is in its collectives (`core_parallel.trace`): the failing one names every rank's."""
    recycler: PageRecycler | None = None
    """CPU devices: hands the pages of released mappings to the next filled (None elsewhere)."""
    host_comm: HostCollectives | None = None
    """CPU ranks sharing /dev/shm: gathers and reduce-scatters through shared memory (None: the process group)."""


class Chunk:
    """Runtime state of one chunk on one rank (shard = elements [lo, hi) of the chunk).

    `master` holds this rank's shard of the parameters (fp32; a frozen chunk's in the compute dtype, as compute
    reads it: it is never stepped); a trainable chunk also has a gradient shard
    `grad` and the optimizer's per-element `states` (the manager places each buffer in its tier)."""

    def __init__(
        self, spec: ChunkSpec, env: ChunkEnv, *, master: TieredBuffer, grad: TieredBuffer | None = None,
        states: dict[str, TieredBuffer] | None = None,
    ) -> None:
        self.spec, self.world, self.group = spec, env.world, env.group
        self.index, self.rank = spec.index, env.rank
        self.shard_numel = spec.size // env.world
        self.lo, self.hi = env.rank * self.shard_numel, (env.rank + 1) * self.shard_numel
        trainable = frozenset(s.param for s in spec.slots) if spec.trainable else frozenset()
        self.sm = ChunkStateMachine(spec.index, trainable)
        self.full = torch.empty(0, dtype=stored_dtype(spec, env.dtype), device=env.device)
        self.master = master
        self.grad = grad
        self.states: dict[str, TieredBuffer] = states or {}
        self.grad_full: torch.Tensor | None = None
        self.grad_sq: torch.Tensor | None = None  # the NVMe gradient shard's squared norm (the manager's, on write)
        self._grad_is_shard = False  # `grad_full` is the gradient shard itself (one rank: `materialize_grad(into)`)
        self.pending: dict[int, torch.Tensor] = {}  # offset -> a parameter's own gradient, before grad_full
        self._pending_nbytes = 0
        self._work = None
        self._src: torch.Tensor | None = None
        self._pages: HostPages | None = None
        self._grad_pages: HostPages | None = None
        self.recycler = env.recycler
        self.map_elems = env.map_elems
        self.host_comm = env.host_comm
        # CPU ranks sharing /dev/shm: gathers read the peers' master shards themselves, no peer taking part (set by
        # the manager once the shared segment exists, which needs the chunks' NVMe regions)
        self.peers: PeerReads | None = None
        # CPU device, master on NVMe, gathers one-sided (one rank, or peer reads): an async gather is a read on this
        # thread, overlapping compute (set by the manager)
        self.reader: Reader | None = None
        self.collectives = env.collectives
        self.pinned = False  # the master is `full` itself (`pin`)
        # an optimizer step deferred to this chunk's next gather (`GeminiOptimizer._defer`): called with the gathered
        # buffer to fill (or None), it updates the shards and leaves the new master there
        self.deferred: Callable[[torch.Tensor | None], None] | None = None
        self.free_grad_when_stepped = False  # zero_grad came while the step was deferred: it frees the gradient
        self.stepping = False  # a gather in flight on the reader thread runs the deferred step (until `wait`)

    def bind(self, params: list[torch.nn.Parameter]) -> None:
        """Point each parameter of the chunk at its slice of `full` (then release the storage)."""
        if self.recycler is not None:  # CPU device
            self._pages = HostPages(self.map_elems * self.full.element_size())
            self.full = self._pages.tensor(self.full.dtype, self.spec.size)
        else:
            self.full = torch.empty(self.spec.size, dtype=self.full.dtype, device=self.full.device)
        for s in self.spec.slots:
            p = params[s.param]
            p.data = self.full[s.offset : s.offset + s.numel].view(p.shape)
        self.free_storage()

    @property
    def pinnable(self) -> bool:
        """Whether the master can be `full` itself: one rank of a CPU device, the master on the device tier in `full`'s
        dtype (nothing to gather: the gathered buffer would be a copy of it). A master on the CPU tier is not, though
        on a CPU device it is the same memory: the tiers keep their meaning, as on an accelerator."""
        return self.master.allocated and self.pinnable_on(self.master.tier)

    def pinnable_on(self, tier: str) -> bool:
        """Whether the master would be pinned on `tier`."""
        return self.world == 1 and self._pages is not None and tier == "device" and self.master.dtype == self.full.dtype

    def pin(self) -> None:
        """Keep the master in `full` (its own storage freed): the parameters view the master, so a gather or release
        only changes the state; the optimizer step and loads write the master, which the parameters see at once."""
        if self.pinned or not self.pinnable:
            return
        self.wait()
        self.alloc_storage()
        if self.master.view().data_ptr() != self.full.data_ptr():  # else read straight into it (`move_master`)
            self.full.data.copy_(self.master.view())
        self.master.adopt(self.full.data)
        self.pinned = True

    def unpin(self) -> None:
        """The master left `full` (moved to another tier, with storage of its own): `full` follows the gathers
        again (a no-op while the master still lives there)."""
        if not self.pinned or (self.master.tier == "device" and self.master.view().data_ptr() == self.full.data_ptr()):
            return
        self.pinned = False
        if self.sm.data is ChunkState.RELEASED:
            self.free_storage()

    def alloc_storage(self) -> None:
        """Give `full` memory (contents undefined until written; a pinned chunk's hold the master)."""
        if self.pinned:
            return
        if self._pages is not None:
            self.recycler.acquire(self._pages)
        else:
            self.full.untyped_storage().resize_(self.full_nbytes)

    def free_storage(self) -> None:
        """Take `full`'s memory away (not a pinned chunk's: it is the master); the parameters keep viewing it."""
        if self.pinned:
            return
        if self._pages is not None:
            self.recycler.release(self._pages)
        else:
            self.full.untyped_storage().resize_(0)

    def _new_grad_full(self, zero: bool = True) -> torch.Tensor:
        """A [size] fp32 buffer for the local gradients, zeroed (`zero=False`: contents undefined)."""
        if self._pages is None:
            return (torch.zeros if zero else torch.empty)(self.spec.size, dtype=torch.float32, device=self.full.device)
        if self._grad_pages is None:
            self._grad_pages = HostPages(self.map_elems * 4)
        out = self._grad_pages.tensor(torch.float32, self.spec.size)
        return out.zero_() if self.recycler.acquire(self._grad_pages) and zero else out

    def drop_local_grads(self) -> None:
        """Forget the local gradients (the flat buffer and the pending parameter gradients)."""
        if self.grad_full is not None and self._grad_pages is not None and not self._grad_is_shard:
            self.recycler.release(self._grad_pages)
        self.grad_full, self.pending, self._pending_nbytes, self._grad_is_shard = None, {}, 0, False

    @property
    def full_nbytes(self) -> int:
        return self.spec.size * self.full.element_size()

    def start_gather(self, async_op: bool) -> None:
        """Materialise `full` from every rank's master shard; `async_op`: finish with `wait` (through the process
        group, or a master on NVMe read one-sidedly on the reader thread; shared-memory gathers and in-memory
        one-sided reads stay synchronous). With peer reads no other rank takes part: a rank may gather a chunk its
        peers do not."""
        read_async = async_op and self.reads_async
        async_op = async_op and self.world > 1 and self.host_comm is None and self.peers is None
        if self.pinned:  # `full` is the master
            self.sm.to(ChunkState.GATHERED)
            return
        self.sm.to(ChunkState.GATHERING if async_op or read_async else ChunkState.GATHERED)
        self.alloc_storage()
        out = self.full.data
        step, self.deferred = self.deferred, None  # taken here, on this thread: never applied twice
        if read_async:  # the reader thread fills `out`; `wait` takes the result
            self._work = self.reader.submit(self._read_one_sided, out, step)
            self.stepping = step is not None
            return
        if self.world == 1 or self.peers is not None:
            self._read_one_sided(out, step)
            return
        if step is not None:
            raise RuntimeError(f"chunk {self.index}: a deferred step needs a one-sided gather")
        src = self._own_shard(out)
        if self.host_comm is not None:
            with self.collectives.collective("all_gather", self.index):
                self.host_comm.all_gather(out, src)
        else:
            with self.collectives.collective("all_gather", self.index):
                self._work = dist.all_gather_single(out, src, group=self.group, async_op=async_op)
            self._src = src if async_op else None
        if not async_op:
            self.master.done()  # NVMe pages read: out of resident memory again

    @property
    def reads_async(self) -> bool:
        """Whether an async gather reads on the reader thread: the master is on NVMe and the gather one-sided."""
        return self.reader is not None and self.master.tier == "nvme" and (self.world == 1 or self.peers is not None)

    def _own_shard(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's master shard in `out`'s dtype and device (on one rank, possibly `out` itself)."""
        if self.master.tier == "nvme" and out.device.type == "cpu":
            # pread, so the file's pages stay unmapped; on one rank of the master's dtype straight into the gathered
            # buffer (fp32 compute, or a frozen chunk kept in the compute dtype)
            direct = self.world == 1 and out.dtype == self.master.dtype
            staging = out if direct else torch.empty(self.shard_numel, dtype=self.master.dtype)
            return self.master.read_into(staging).to(out.dtype)
        return self.master.view().to(device=out.device, dtype=out.dtype)

    def _read_one_sided(self, out: torch.Tensor, step: Callable[[torch.Tensor | None], None] | None = None) -> None:
        """`out` <- the whole chunk with no other rank taking part (one rank, or peer reads); `step`: the deferred
        optimizer step, which reads the master into `out` as it updates it."""
        if step is not None:
            step(out)
            return
        src = self._own_shard(out)
        if self.world == 1:
            if src is not out:
                out.copy_(src)
        else:
            self._read_peers(out, src)
        self.master.done()

    def _read_peers(self, out: torch.Tensor, own: torch.Tensor) -> None:
        """`out` <- every rank's master shard, the peers' read from shared memory or their files (`PeerReads`)."""
        n = self.shard_numel
        for r in range(self.world):
            part = out[r * n : (r + 1) * n]
            if r == self.rank:
                part.copy_(own)
            else:
                self.peers.read_into(r, self.index, part)

    def wait(self) -> None:
        """Finish an async gather."""
        if self.sm.data is ChunkState.GATHERING:
            if isinstance(self._work, Future):  # the reader thread's read (its error, if any, raised here)
                work, self._work, self.stepping = self._work, None, False
                try:
                    work.result()
                except BaseException:  # nothing valid was gathered: released again (no module holds it yet)
                    self.sm.to(ChunkState.GATHERED)
                    self.sm.to(ChunkState.RELEASED)
                    self.free_storage()
                    raise
            else:
                with self.collectives.collective("all_gather (wait)", self.index):
                    self._work.wait()
                self._work = self._src = None
                self.master.done()
            self.sm.to(ChunkState.GATHERED)

    def release(self, in_use: bool = False) -> None:
        """Drop the gathered data (the storage shrinks to 0 bytes); `in_use`: modules still hold the chunk but
        backward is done with its data (see `ChunkStateMachine.drop`)."""
        self.wait()
        self.sm.drop() if in_use else self.sm.to(ChunkState.RELEASED)
        self.free_storage()

    @property
    def local_grad_nbytes(self) -> int:
        """Bytes of local gradients held: `grad_full` (unless it is the shard) and the parameter gradients waiting
        for it."""
        full = self.grad_full.numel() * 4 if self.grad_full is not None and not self._grad_is_shard else 0
        return full + self._pending_nbytes

    def add_grad(self, offset: int, grad: torch.Tensor) -> None:
        """Add one parameter's local gradient ([*shape], compute dtype, not used by autograd any more).

        Before the chunk's flat fp32 buffer exists, a gradient that owns its storage is kept as it is (no copy):
        `grad_full` is only allocated when the chunk is reduced, after its gathered data was released, so the
        two never coexist (the order FSDP keeps: reshard, then copy the gradients into the reduce buffer).
        """
        if self.grad_full is not None:
            self.grad_full[offset : offset + grad.numel()].add_(grad.reshape(-1))
        elif offset in self.pending:
            self.pending[offset].add_(grad)
        elif grad._base is None and grad.is_contiguous() and (
                grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()):
            self.pending[offset] = grad
            self._pending_nbytes += grad.numel() * grad.element_size()
        else:
            self.materialize_grad()
            self.grad_full[offset : offset + grad.numel()].add_(grad.reshape(-1))

    def materialize_grad(self, into: torch.Tensor | None = None) -> None:
        """Build `grad_full` ([size] fp32) from the pending parameter gradients and free them. `into`: the buffer
        to build it in when there is none yet (its contents undefined: one rank's gradient shard, so that the
        reduction copies nothing)."""
        if self.grad_full is None:  # a new buffer: each gradient copied into its place, only the rest zeroed
            self.grad_full, end = self._new_grad_full(zero=False) if into is None else into, 0
            self._grad_is_shard = into is not None
            for offset in sorted(self.pending):
                g = self.pending[offset]
                self.grad_full[end:offset].zero_()
                self.grad_full[offset : offset + g.numel()].copy_(g.reshape(-1))
                end = offset + g.numel()
            self.grad_full[end:].zero_()
        else:
            for offset, g in self.pending.items():
                self.grad_full[offset : offset + g.numel()].add_(g.reshape(-1))
        self.pending, self._pending_nbytes = {}, 0

    def reduce_scatter(self, out: torch.Tensor | None = None, async_op: bool = False) -> Reduction:
        """Start averaging the local gradients over ranks into `out` (this rank's part, [shard_numel] fp32 on
        the compute device). `out=None`: a new tensor on several ranks; on one rank the flat gradient buffer itself
        (no copy). `Reduction.finish()` waits and averages, `Reduction.close()` frees the local gradients; until
        then they stay untouched (async on several ranks: the collective runs in the background)."""
        if self.pending:
            self.materialize_grad()
        if self.grad_full is None:
            self.grad_full = self._new_grad_full()
        full = self.grad_full
        if self.world == 1:  # the shard is the whole buffer
            return Reduction(self, full if out is None or out is full else out.copy_(full), None)
        if out is None:
            out = torch.empty(self.shard_numel, dtype=torch.float32, device=full.device)
        work = None
        with self.collectives.collective("reduce_scatter", self.index):
            if self.host_comm is not None:
                self.host_comm.reduce_scatter(out, full)
            else:
                work = dist.reduce_scatter_single(out, full, group=self.group, async_op=async_op)
        return Reduction(self, out, work)  # work: None unless async through the process group

    def gather_fp32(self, buf: TieredBuffer) -> torch.Tensor:
        """The whole chunk of a shard buffer (master or an optimizer state) as [size] fp32 on the CPU (a frozen
        chunk's master, kept in the compute dtype, cast up)."""
        local = buf.view().to(device=self.full.device, copy=True)
        buf.done()
        if self.world == 1:
            return local.cpu().float()
        out = torch.empty(self.spec.size, dtype=buf.dtype, device=self.full.device)
        if self.peers is not None and buf is self.master:  # one-sided: a state_dict() on some ranks only
            self._read_peers(out, local)
            return out.float()
        with self.collectives.collective("all_gather (fp32)", self.index):
            dist.all_gather_single(out, local, group=self.group)
        return out.cpu().float()


class Reduction:
    """A chunk's gradient reduce-scatter, possibly still running: `finish()` waits for it, divides by the world
    size and returns the shard; `close()`, once the shard has been used, frees the chunk's local gradients (on one
    rank the shard is the chunk's flat gradient buffer)."""

    __slots__ = ("chunk", "out", "work")

    def __init__(self, chunk: Chunk, out: torch.Tensor, work) -> None:
        self.chunk, self.out, self.work = chunk, out, work

    def finish(self) -> torch.Tensor:
        c = self.chunk
        if self.work is not None:
            with c.collectives.collective("reduce_scatter (wait)", c.index):
                self.work.wait()
            self.work = None
        if c.world > 1:
            self.out.div_(c.world)
        return self.out

    def close(self) -> None:
        c = self.chunk
        c.drop_local_grads()
        c.sm.grad_reduced()
        self.out = None
