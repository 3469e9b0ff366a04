"""The chunk manager: gathers and releases chunks for the hooks, reduces gradients, places shards.

Gradient reduce-scatters run in descending chunk index on every rank, a chunk being reduced as soon as it and
every higher chunk are complete, the rest at the end of the backward pass (zeros for a chunk a rank never
touched). A parameter that gets no gradient on some rank therefore delays memory release but never mismatches
or hangs a collective.

Gathers follow module execution. CPU ranks on one host read the peers' master shards themselves
(`peer_reads.PeerReads`): no peer takes part, so ranks may run different modules (experts skipped where they
get no token, a forward or a `state_dict()` on rank 0 only). Elsewhere (accelerators, ranks on several hosts)
a gather is a collective that every rank must run in the same order (as in any ZeRO-3).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

import torch
import torch.distributed as dist

from ..host_comm import HostCollectives, host_collectives_supported
from ..trace import CollectiveTrace
from .budget import MemoryBudget, ProcessMemory
from .chunk import Chunk, ChunkEnv, Reduction, stored_dtype
from .config import GeminiConfig
from .host_memory import HostHeap, PageRecycler
from .layout import ChunkSpec, Slot
from .lazy import clear_source, close_sources, is_hollow, source_of, take_value
from .peer_reads import PeerReads
from .placement import AccessTrace, MemoryLedger, budget_plan, keep_recent, pick_victim, static_plan
from .prefetch import PrefetchDepth, Reader
from .state import ChunkState
from .state_dict_io import StateDictIO
from .storage import NvmeFile, TieredBuffer

__all__ = ["ChunkManager"]

logger = logging.getLogger(__name__)

WRITES_IN_FLIGHT = 2
"""Gradient shards of one rank written to NVMe on the reader thread while backward computes the next ones: each holds
its chunk's flat gradient buffer until written."""

HOST_COMM_SLOT_BYTES = 4 << 20
"""Largest slot per rank of the host collectives' shared segment (each rank maps all `world` slots); bigger
chunk shards go through in pieces."""


class ChunkManager:
    """Owns the chunks of one model on one rank. `state_kinds`: optimizer state buffers per chunk."""

    def __init__(
        self, specs: list[ChunkSpec], params: list[torch.nn.Parameter], config: GeminiConfig, *,
        group: dist.ProcessGroup | None, rank: int, world: int, device: torch.device, dtype: torch.dtype,
        state_kinds: tuple[str, ...], budget: int | None, names: list[str] | None = None,
        memory: ProcessMemory | None = None,
    ) -> None:
        self.config, self.group, self.rank, self.world = config, group, rank, world
        self.device, self.budget = device, budget
        # `memory_budget`: the process measured, the model-data budget refitted after each step (`budget.py`)
        self.memory = MemoryBudget(config.memory_budget_bytes, memory) if memory is not None else None
        self.params = params
        self.names: list[str] = list(names or [])  # parameter names (as in named_parameters), for messages
        self.handles: list = []  # the hooks driving this manager (`hooks.register_hooks`)
        self.slot_of: dict[int, Slot] = {s.param: s for spec in specs for s in spec.slots}
        self.trace = AccessTrace()
        self.ledger = MemoryLedger()
        self.off_tier = config.offload_tier
        self.nvme = NvmeFile(config.offload_dir, rank) if config.offload_tier == "nvme" else None
        self.host = HostHeap(enabled=device.type == "cpu")
        # CPU devices: gathered chunks and gradient buffers live in anonymous mappings whose pages move from a
        # released buffer to the next one filled; two of the largest stay resident for that. One mapping size
        # for every chunk (its largest), so pages move between any two; the fp32 gradient buffer is the largest
        # mapping (the compute dtype takes at most 4 bytes)
        map_elems = max((s.size for s in specs), default=0)
        self.pages = PageRecycler(2 * map_elems * 4) if device.type == "cpu" else None
        # CPU ranks on one host all-gather and reduce-scatter through shared memory (a memcpy instead of gloo's
        # loopback TCP), synchronously; without it they go through the process group, in gloo's threads.
        self.host_comm = None
        if device.type == "cpu" and world > 1 and config.host_collectives:
            slot = min(max((s.size // world * 4 for s in specs), default=1), HOST_COMM_SLOT_BYTES)
            self.host_comm = HostCollectives.create(group, slot)
        # where this rank is in its collectives, and the error naming where every rank is when one fails
        self.collectives = CollectiveTrace.create(group)
        # ... and read each other's master shards one-sidedly (the buffers are placed in the shared segment below)
        self.peers: PeerReads | None = None
        env = ChunkEnv(rank=rank, world=world, device=device, dtype=dtype, group=group, map_elems=map_elems,
                       recycler=self.pages, host_comm=self.host_comm, collectives=self.collectives)
        self.chunks = self._build_chunks(specs, env, state_kinds)
        if device.type == "cpu" and world > 1 and config.peer_reads and host_collectives_supported():
            self.peers = PeerReads.create(group, [c.shard_numel for c in self.chunks], self.nvme,
                                          [c.master.nvme_offset for c in self.chunks],
                                          [c.master.dtype for c in self.chunks])
        if self.peers is not None:
            for c in self.chunks:
                c.master.use_region(self.peers.region(c.index))
                c.peers = self.peers
        self.trainable_chunks = [c for c in self.chunks if c.spec.trainable]
        # reading ahead: where it pays, and how far (`prefetch.py`); prefetch=0: no thread, every read synchronous
        self.reader = None
        one_sided = world == 1 or self.peers is not None
        if device.type == "cpu" and self.nvme is not None and one_sided and config.prefetch:
            self.reader = Reader()
            for c in self.chunks:
                c.reader = self.reader
        overlaps = device.type != "cpu" or (world > 1 and self.host_comm is None) or self.reader is not None
        least = config.prefetch if overlaps else 0
        self.depth = PrefetchDepth(least, max(least, config.prefetch_max) if self.reader is not None else least)
        self.sync = True
        self.had_grad: dict[int, bool] = {s.param: False for c in self.trainable_chunks for s in c.spec.slots}
        self.in_backward = False  # a backward pass is under way (from its first hook to `end_backward`)
        self.pass_open = False  # a forward (or its backward) is under way: the fallback may gather
        self._storage_keys: dict[int, int] = {}
        self._gathered: dict[int, int] = {}  # chunk -> bytes its gathered copy holds on the device (in the ledger)
        self.passes = 0
        self._reduce_ptr = len(self.trainable_chunks) - 1
        self._reduced: set[int] = set()  # chunks reduced in this backward pass
        self._reducing: list[tuple[Reduction, bool, int]] = []  # started: (reduction, in place, bytes accounted)
        self._writing: list[tuple[Future, Reduction, int]] = []  # gradient shards being written on the reader thread
        self._clock = 0
        self.last_used: dict[int, int] = {}  # chunk -> the clock at its last use (eviction before the trace exists)
        self._idle_kept: list[int] = []  # first step: the idle chunks kept gathered, last idle last (`_defer_release`)
        largest = max((c.full_nbytes for c in self.chunks), default=1) or 1
        # each chunk's gathered size over the largest one's: `keep_gathered` counts chunks by these weights
        self._weights = {c.index: c.full_nbytes / largest for c in self.chunks}
        self.param_dtypes = [p.dtype for p in params]
        self.state_io = StateDictIO(self.chunks, self.slot_of, params, self.param_dtypes, rank=rank)

    # ---- setup -------------------------------------------------------------------------------------
    def _plan(self, specs: list[ChunkSpec], env: ChunkEnv, n_states: int) -> list[tuple[str, str]]:
        """(parameter tier, optimizer tier) per chunk."""
        n = len(specs)
        if self.config.placement == "static":
            return static_plan(n, self.config.offload_param_frac, self.config.offload_optim_frac, self.off_tier)
        if self.memory is not None:
            # `memory_budget`: what lies beside the model data at a step's peak (activations, the step's scratch)
            # is unknown until a step has run, so the first step runs with every buffer off the device and
            # `MemoryBudget.refit` brings back what fits the measured room (held from the start, the masters
            # would leave no room for the rest of setup and the first step's activations)
            return [(self.off_tier, self.off_tier)] * n
        masters = [s.size // self.world * (4 if s.trainable else stored_dtype(s, env.dtype).itemsize) for s in specs]
        optims = [s.size // self.world * 4 * (1 + n_states) if s.trainable else 0 for s in specs]
        biggest = max((s.size * env.dtype.itemsize + s.size * 4 for s in specs), default=0)  # gathered + grads
        left = None if self.budget is None else self.budget - 2 * (1 + self.config.prefetch) * biggest
        return budget_plan(masters, optims, left, self.off_tier)

    def _buffer(self, numel: int, tier: str, movable: bool, dtype: torch.dtype = torch.float32) -> TieredBuffer:
        reserved = self.nvme is not None and (movable or tier == "nvme")
        offset = self.nvme.reserve(numel, dtype.itemsize) if reserved else None
        return TieredBuffer(numel, tier, self.device, self.nvme, offset, dtype)

    def _build_chunks(self, specs: list[ChunkSpec], env: ChunkEnv, state_kinds: tuple[str, ...]) -> list[Chunk]:
        """The chunks with their shard buffers placed (NVMe regions reserved, the file opened; no data yet)."""
        plan = self._plan(specs, env, len(state_kinds))
        auto = self.config.placement == "auto"
        chunks = []
        for spec, (ptier, otier) in zip(specs, plan):
            numel = spec.size // env.world
            # a frozen chunk is never stepped: its master is what compute reads, in the compute dtype (gathers
            # give the same values; half the bytes stored and moved under bf16/fp16, and no cast per gather)
            master = self._buffer(numel, ptier, movable=auto,
                                  dtype=torch.float32 if spec.trainable else stored_dtype(spec, env.dtype))
            grad, states = None, {}
            if spec.trainable:  # under a memory_budget the optimizer's buffers may leave the device later
                movable = self.memory is not None
                grad = self._buffer(numel, otier, movable=movable)
                states = {k: self._buffer(numel, otier, movable=movable) for k in state_kinds}
            chunks.append(Chunk(spec, env, master=master, grad=grad, states=states))
        if self.nvme is not None:
            self.nvme.open()
        return chunks

    def load_params(self) -> None:
        """Copy the parameters' current values into the master shards and point them into the chunks; the
        sources of hollow parameters are closed once read (a file source leaves the page cache)."""
        with self.master_writes("setup"):  # the first write: a peer reads none of it before every rank is done
            self._load_params()

    def _load_params(self) -> None:
        sources = {}
        for c in self.chunks:
            local = torch.zeros(c.shard_numel, dtype=c.master.dtype)
            for s in c.spec.slots:
                p = self.params[s.param]
                lo, hi = max(s.offset, c.lo), min(s.offset + s.numel, c.hi)
                if lo >= hi:
                    continue
                if is_hollow(p):  # read from its source, only this rank's part; dropped once copied
                    sources.setdefault(id(source_of(p)[0]), source_of(p)[0])
                    local[lo - c.lo : hi - c.lo] = take_value(p, lo - s.offset, hi - s.offset).float()
                else:  # via fp32, as a gather from an fp32 master rounds (a frozen master: the compute dtype)
                    flat = p.detach().reshape(-1)
                    local[lo - c.lo : hi - c.lo] = flat[lo - s.offset : hi - s.offset].float().cpu()
            c.master.allocate(fill=local)
            if self.peers is not None:
                self.peers.begin_move()
                self.peers.end_move(c.index, in_file=c.master.tier == "nvme")
            self.ledger.add(c.master.tier, "params", c.master.nbytes)
            for buf in c.states.values():
                buf.allocate()
                self.ledger.add(buf.tier, "optim", buf.nbytes)
            c.bind(self.params)
            self._repin(c)
            for s in c.spec.slots:
                clear_source(self.params[s.param])
            self._storage_keys[c.index] = c.full.untyped_storage()._cdata
        close_sources(sources.values())
        if self.nvme is not None:
            self.nvme.flush()  # the tier's file on disk, none of it left in the page cache

    def is_trainable(self, pidx: int) -> bool:
        """Whether parameter `pidx` sits in a trainable chunk (it had requires_grad at setup)."""
        return self.chunks[self.slot_of[pidx].chunk].spec.trainable

    def storage_keys(self, ids: Iterable[int]) -> set[int]:
        """Identities of the storages of chunks `ids` (a tensor aliasing one of them views chunk data)."""
        return {self._storage_keys[i] for i in ids}

    def begin_pass(self) -> None:
        """A module's forward starts: a pass is under way until its backward (or the forward) ends."""
        self.pass_open = True

    @contextlib.contextmanager
    def collective_reads(self) -> Iterator[None]:
        """Inside the block parameter reads outside a forward gather their chunks (and release them at its end),
        as inside a pass. Every rank must enter the block and run the same reads (each gather is a collective):
        an EMA update or sampling between steps, run by a callback on every rank."""
        if self.pass_open or self.in_backward:  # already inside a pass: reads gather there anyway
            yield
            return
        self.pass_open = True
        try:
            yield
        finally:
            self.pass_open = False
            self.release_idle()

    def reads_allowed(self) -> bool:
        """Whether a parameter read outside its modules may gather its chunk: inside a pass, where every rank
        runs the same reads (between steps a read may be one rank's alone, and where gathers are collectives it
        would hang; the same error on every transport, so a CPU test catches what would hang on GPUs)."""
        return self.pass_open or self.in_backward

    @contextlib.contextmanager
    def master_writes(self, what: str = "the optimizer step") -> Iterator[None]:
        """Inside: this rank writes its master shards (an optimizer step, a load). With peer reads every rank meets
        at the start (each must write as often: a collective), and the peers wait for the end of the block before
        they read the new values."""
        if self.peers is None:
            yield
            return
        with self.collectives.collective(f"{what} (peers' reads done)"):
            self.peers.begin_writes(what)
        try:
            yield
        finally:
            self.peers.end_writes()

    def end_forward(self) -> None:
        """The root module's forward returned: release idle chunks; a pass without autograd ends here."""
        self.release_idle()
        if not torch.is_grad_enabled():
            self.pass_open = False

    # ---- gather / release --------------------------------------------------------------------------
    def access(self, ids: Iterable[int]) -> None:
        """Modules start computing with chunks `ids`: gather them (and prefetch the next ones)."""
        if self.state_io.placeholders:
            self.state_io.end_checkpoint()
        for i in ids:
            c = self.chunks[i]
            self.trace.record(i)
            self._clock += 1
            self.last_used[i] = self._clock
            t0 = time.perf_counter() if c.reads_async else None  # compute waits for this read: `PrefetchDepth`
            if c.sm.data is ChunkState.RELEASED:
                self._gather(c, async_op=False)
            c.wait()
            if t0 is not None:
                self.depth.wait(time.perf_counter() - t0)
            if c.free_grad_when_stepped:  # its deferred step ran in this gather
                self.free_grad(c)
            c.sm.acquire()
        self._prefetch()

    def done(self, ids: Iterable[int]) -> None:
        """Modules are done with chunks `ids`; chunks nobody uses are released (unless needed again right away)."""
        soon = None  # the chunks needed again shortly, looked up once a chunk becomes idle
        for i in ids:
            c = self.chunks[i]
            if c.sm.release_use() and c.sm.data is not ChunkState.RELEASED:
                if c.pinned:  # released or gathered again, its master stays where it is: nothing to keep
                    self._release(c)
                    continue
                if not self.trace.frozen and self.config.keep_gathered != 0:
                    self._defer_release(i)
                    continue
                if soon is None:
                    keep = self.config.keep_gathered
                    soon = self.trace.upcoming(self.config.prefetch + 1 if keep is None else keep,
                                               self._weights) if self.trace.frozen else ()
                if i not in soon:
                    self._release(c)

    def _defer_release(self, i: int) -> None:
        """While the first step records the order, the chunks that went idle last stay gathered: modules sharing a
        chunk usually run one after another, and without the order each of them would gather the whole chunk again
        from its tier (from disk on the NVMe tier). Which stay: `placement.keep_recent`, with `keep_gathered - 1` as
        room. Every rank runs the same modules in the same order, so all make the same choice (gathers are
        collective)."""
        keep = self.config.prefetch + 1 if self.config.keep_gathered is None else self.config.keep_gathered
        order = [k for k in self._idle_kept if k != i] + [i]
        self._idle_kept, drop = keep_recent(order, self._weights, keep - 1, lambda k: (
            not self.chunks[k].sm.users and self.chunks[k].sm.data is not ChunkState.RELEASED))
        for k in drop:
            self._release(self.chunks[k])

    def _gather(self, c: Chunk, async_op: bool) -> None:
        cost = 0 if c.pinned else c.full_nbytes  # a pinned chunk's gathered buffer is its master, counted in its tier
        self._make_room(cost, exclude={c.index})
        self._account_gathered(c, cost)
        if not c.pinned:
            self.ledger.transfer(c.master.tier, "device", c.master.nbytes)
        c.start_gather(async_op)
        self._maybe_promote(c)

    def _release(self, c: Chunk, in_use: bool = False) -> None:
        c.release(in_use)
        self._account_gathered(c, 0)

    def _account_gathered(self, c: Chunk, nbytes: int) -> None:
        """Chunk `c`'s gathered copy now takes `nbytes` on the device (0: released, or pinned)."""
        self.ledger.add("device", "params", nbytes - self._gathered.get(c.index, 0))
        self._gathered[c.index] = nbytes

    def _repin(self, c: Chunk) -> None:
        """Chunk `c`'s master was placed or moved: pinned wherever it can be (`Chunk.pin`), else gathered as a copy."""
        c.unpin()
        c.pin()
        self._account_gathered(c, 0 if c.pinned or c.sm.data is ChunkState.RELEASED else c.full_nbytes)

    def release_idle(self) -> None:
        """Release gathered chunks no module uses (stale prefetches, the end of a pass)."""
        for c in self.chunks:
            if c.sm.data is not ChunkState.RELEASED and c.sm.users == 0:
                self._release(c)

    def _prefetch(self) -> None:
        """Start gathering the next `prefetch` chunks of the recorded order not gathered yet (those in flight count):
        a chunk many modules use in a row (a LoRA base's, between its adapters') is followed from its first use on."""
        if not self.depth.depth or not self.trace.frozen:
            return
        for c in [c for c in map(self.chunks.__getitem__, self.trace.ahead())
                  if not c.pinned and c.sm.data is not ChunkState.GATHERED][: self.depth.depth]:
            # not a copy between CPU tiers (compute itself, gathered when used; see __init__)
            if c.sm.data is ChunkState.RELEASED and (self.reader is None or c.reads_async):
                if not self.fits(c.full_nbytes):
                    return
                self._gather(c, async_op=True)

    # ---- placement under a budget ------------------------------------------------------------------
    def fits(self, nbytes: int) -> bool:
        return self.budget is None or self.ledger.tier_total("device") + nbytes <= self.budget

    def _make_room(self, nbytes: int, exclude: set[int]) -> None:
        """Evict parameter shards (furthest next use first) until `nbytes` more fit in the budget."""
        if self.config.placement != "auto":
            return
        while not self.fits(nbytes):
            victim = self.furthest_master(exclude)
            if victim is None:
                raise RuntimeError(
                    f"device_memory_budget={self.budget} bytes cannot hold the chunks in use "
                    f"({self.ledger.tier_total('device')} bytes used, {nbytes} more needed); raise the budget "
                    "or lower chunk_mb"
                )
            self.move_master(self.chunks[victim], self.off_tier)

    def furthest_master(self, exclude: Iterable[int] = ()) -> int | None:
        """The chunk whose master is on the device and used furthest ahead (None: no such chunk)."""
        exclude = set(exclude)
        movable = [c.index for c in self.chunks if c.master.tier == "device" and c.index not in exclude]
        return pick_victim(movable, self.trace, self.last_used)

    def _maybe_promote(self, c: Chunk) -> None:
        # under a memory_budget the chunks come back between steps only, leaving room for the step's working set
        # (`MemoryBudget.refit`): filled up to the budget here, the next gathers would push masters out again
        if (self.config.placement == "auto" and self.memory is None and c.master.tier != "device"
                and self.fits(c.master.nbytes)):
            c.wait()  # a read of the master in flight on the reader thread ends before the master moves
            self.move_master(c, "device")

    def move_master(self, c: Chunk, tier: str) -> None:
        """Move chunk `c`'s master shard to `tier` (accounted; peers told where it is)."""
        self.settle([c])
        src, into = c.master.tier, None
        if src == "nvme" and c.pinnable_on(tier):  # read into the pages it will be pinned in: no second copy
            c.alloc_storage()
            into = c.full.data
        if self.peers is not None:
            self.peers.begin_move()
        try:
            c.master.move(tier, into=into)  # (failing, the pages stay with the chunk: its next gather fills them)
        finally:
            if self.peers is not None:  # where it is now (also after a failed move)
                self.peers.end_move(c.index, in_file=c.master.tier == "nvme")
        self.ledger.move(src, tier, "params", c.master.nbytes)
        self._repin(c)

    # ---- gradients ---------------------------------------------------------------------------------
    def begin_backward(self, queue: bool = True) -> None:
        """First hook of a backward pass: arm the end-of-pass callback."""
        if self.in_backward:
            return
        self.settle()  # a step deferred to a forward that did not gather every chunk: before any gradient lands
        self.in_backward = True
        self.passes += 1
        self._reduce_ptr = len(self.trainable_chunks) - 1
        self._reduced = set()
        for c in self.chunks:
            c.sm.begin_backward()
        if queue:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def on_grad(self, param_index: int, grad: torch.Tensor) -> None:
        """A trainable parameter's gradient for this pass arrived ([*shape] compute dtype)."""
        self.begin_backward()
        s = self.slot_of[param_index]
        c = self.chunks[s.chunk]
        held = c.local_grad_nbytes
        c.add_grad(s.offset, grad)
        self._account_local_grads(c, held)
        self.had_grad[param_index] = True
        if c.sm.grad_arrived(param_index):
            if c.sm.data is not ChunkState.RELEASED:  # every gradient is in: backward needs no value of it
                self._release(c, in_use=True)
            if self.sync and self.world == 1:
                # no collective to keep in step with other ranks: reduce each chunk as soon as its gradients are
                # in. In parameter order, a chunk ending in the UNet's mid block completes only after every up
                # block's gradients: half the model's gradients were held at once (2 GB of SD-1.5's 3.4)
                self._reduce(c)
            elif self.sync:
                self._reduce_ready()

    def _account_local_grads(self, c: Chunk, held_before: int) -> None:
        self.ledger.add("device", "grads", c.local_grad_nbytes - held_before)

    def _reduce_ready(self) -> None:
        """Reduce the chunks whose gradients are complete, in reverse chunk order (every rank issues the
        reductions in the same order, whatever order its gradients completed in)."""
        while self._reduce_ptr >= 0:
            c = self.trainable_chunks[self._reduce_ptr]
            if not c.sm.grads_complete():
                return
            self._reduce(c)
            self._reduce_ptr -= 1

    def _reduce(self, c: Chunk) -> None:
        """Start chunk `c`'s gradient reduce-scatter. Through the process group on several ranks it runs in the
        background while backward computes the next chunk's gradients: once it is started, the one before it is
        finished, so at most two are in flight (local gradients are freed when their reduction finishes). Once per
        chunk and pass."""
        if c.index in self._reduced:
            return
        self._reduced.add(c.index)
        direct = not c.grad.allocated and c.grad.tier == "device"  # straight into the shard: no temporary
        if direct and self.world == 1 and c.pending and c.grad_full is None:
            c.grad.allocate(zero=False)  # one rank: the shard is the whole flat buffer, the gradients copied into it
        if c.pending:  # the flat buffer first, then the shard: the parameter gradients are gone by then
            held = c.local_grad_nbytes
            c.materialize_grad(into=c.grad.view() if direct and c.grad.allocated else None)
            self._account_local_grads(c, held)
        if direct:
            if not c.grad.allocated:
                c.grad.allocate(zero=False)  # the reduce-scatter writes all of it
            self.ledger.add(c.grad.tier, "grads", c.grad.nbytes)
        held = c.local_grad_nbytes  # accounted; a chunk without any gradient gets a zero buffer unaccounted
        reduction = c.reduce_scatter(out=c.grad.view() if direct else None, async_op=self.world > 1)
        self.finish_reductions(keep_writes=WRITES_IN_FLIGHT)
        self._reducing.append((reduction, direct, held))
        if reduction.work is None:  # done already (one rank, host collectives): free the local gradients now
            self.finish_reductions(keep_writes=WRITES_IN_FLIGHT)

    def finish_reductions(self, keep_writes: int = 0) -> None:
        """Wait for the reductions in flight and put their shards in place; of the NVMe gradient writes running on the
        reader thread (one rank), wait until at most `keep_writes` are left."""
        while self._reducing:
            reduction, direct, held = self._reducing.pop(0)
            c = reduction.chunk
            shard = reduction.finish()
            c.grad_sq = None  # an NVMe shard's squared norm, taken from memory as it is written (`clip_grad_norm`)
            if not direct and not c.grad.allocated:
                if c.grad.tier == "nvme":
                    c.grad_sq = torch.linalg.vector_norm(shard).cpu().double() ** 2
                self.ledger.add(c.grad.tier, "grads", c.grad.nbytes)
                if c.grad.tier == "nvme" and self.reader is not None:  # written there while backward goes on
                    self._writing.append((self.reader.submit(c.grad.allocate, shard), reduction, held))
                    continue
                c.grad.allocate(fill=shard)
            elif not direct:
                c.grad.view().add_(shard.to(c.grad.view().device))
            self._close_reduction(reduction, held)
        while len(self._writing) > keep_writes or (self._writing and self._writing[0][0].done()):
            write, reduction, held = self._writing.pop(0)
            try:
                write.result()  # a failed write raised here, in the backward pass
            finally:  # (the local gradients it wrote from are free to go only once it ended)
                self._close_reduction(reduction, held)

    def _close_reduction(self, reduction: Reduction, held: int) -> None:
        c = reduction.chunk
        reduction.close()
        self._account_local_grads(c, held)
        c.grad.done()
        self.ledger.transfer("device", c.grad.tier, c.grad.nbytes)

    def end_backward(self) -> None:
        """End of a backward pass: reduce what is left (unless under no_sync) and release every chunk."""
        if self.sync:
            while self._reduce_ptr >= 0:
                self._reduce(self.trainable_chunks[self._reduce_ptr])
                self._reduce_ptr -= 1
            self.finish_reductions()
        for c in self.chunks:
            c.sm.end_backward()
        self.release_idle()
        self.in_backward = False
        self.pass_open = False

    def zero_grad(self) -> None:
        """Drop gradient shards, pending local gradients and the used-parameter flags."""
        self.pass_open = False
        self.finish_reductions()
        for c in self.trainable_chunks:
            # its deferred step reads the gradient first (it may be running in a read in flight: not waited for)
            if c.deferred is not None or c.stepping:
                c.free_grad_when_stepped = True
            else:
                self.free_grad(c)
            held, c.grad_sq = c.local_grad_nbytes, None
            c.drop_local_grads()
            self._account_local_grads(c, held)
            c.sm.grad_reduced()
        self.host.trim()
        if self.pages is not None:
            self.pages.drop_all()  # between steps only the shards stay resident
        for k in self.had_grad:
            self.had_grad[k] = False

    def free_grad(self, c: Chunk) -> None:
        """Drop chunk `c`'s gradient shard (if it has one)."""
        c.free_grad_when_stepped = False
        if c.grad.allocated:
            self.ledger.add(c.grad.tier, "grads", -c.grad.nbytes)
            if c.grad.tier != "nvme":  # a heap block (an NVMe shard lives in the file)
                self.host.released(c.grad.nbytes)
            c.grad.free()

    def settle(self, chunks: Iterable[Chunk] | None = None) -> None:
        """Run the optimizer steps still deferred to the chunks' next gathers (`GeminiConfig.step_in_forward`), and
        wait for those running in reads in flight: before anything reads their shards otherwise. (Other reads in flight
        go on: a backward starting waits for none but its first chunk's.)"""
        chunks = self.trainable_chunks if chunks is None else list(chunks)
        if any(c.deferred is not None or c.free_grad_when_stepped or c.stepping for c in chunks):
            for c in chunks:
                if c.stepping:
                    c.wait()
                step, c.deferred = c.deferred, None
                if step is not None:
                    step(None)
                if c.free_grad_when_stepped:
                    self.free_grad(c)

    def used_params(self) -> set[int]:
        """Trainable parameters that got a gradient on any rank since the last zero_grad (collective)."""
        if self.peers is None:  # gathers were collectives: same-size gathers of different chunks pair up silently
            self.collectives.check_sequence(self.device)
        keys = sorted(self.had_grad)
        flags = torch.tensor([self.had_grad[k] for k in keys], dtype=torch.uint8, device=self.device)
        if self.world > 1 and flags.numel():
            with self.collectives.collective("all_reduce(used parameters)"):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return {k for k, f in zip(keys, flags.tolist()) if f}

    def end_step(self) -> None:
        """After the optimizer step: drop gathered copies (now stale), freeze the traced order (first step),
        start a new step's ledger."""
        self.pass_open = False
        self.release_idle()
        self.state_io.drop_cache()
        if self.nvme is not None:
            self.nvme.flush()
        self.trace.freeze()
        self.trace.new_step()
        self.depth.end_step(self.reader.busy if self.reader is not None else 0.0)
        if self.memory is not None:
            self.memory.refit(self)
        self.ledger.new_step()
        self.collectives.end_step()

    def memory_report(self) -> dict:
        """Bytes per tier and kind on this rank, the device peak and the traffic since the last step."""
        report = self.ledger.report()
        report["budget_bytes"] = self.budget
        if self.memory is not None:
            report["memory_budget_bytes"] = self.memory.limit
            report["process_peak_bytes_last_step"] = self.memory.last_process_peak
        report["chunks"], report["prefetch_depth"] = len(self.chunks), self.depth.depth
        report["chunk_elements"] = max((c.spec.size for c in self.chunks), default=0)
        return report

    # ---- state_dict through the chunks (`StateDictIO`, `state_io`; a save or load ends the pass) ------
    def io_gather(self, pidxs: Iterable[int]) -> None:
        """Gather the fp32 master chunks of parameters `pidxs` for `state_io.param_value` (collective)."""
        self.pass_open = False
        self.settle()
        self.state_io.gather(pidxs)

    def io_load(self, pidxs: Iterable[int], values: dict[int, torch.Tensor | None]) -> None:
        """Write `load_state_dict()` values into the master shards (no communication)."""
        self.settle()  # (its writes would be overwritten by an update computed from the old values)
        with self.master_writes("load_state_dict"):
            self.state_io.load(pidxs, values)

    def stream_values(self, pidxs: Iterable[int]) -> Iterable[tuple[int, torch.Tensor]]:
        """Full fp32 values of parameters `pidxs`, a gathered chunk at a time (collective; `StateDictIO`)."""
        self.pass_open = False
        self.settle()
        yield from self.state_io.stream_values(pidxs)

    def begin_checkpoint(self, *, frozen: bool = True) -> None:
        """Before `save_checkpoint` (collective): rank 0's model.state_dict() then needs no communication
        (`frozen=False`: the frozen parameters are not saved, so not gathered)."""
        self.pass_open = False
        self.settle()
        self.state_io.begin_checkpoint(frozen=frozen)

    def close(self) -> None:
        if self.reader is not None:
            self.release_idle()  # no read in flight
            self.reader.shutdown(wait=True)
        if self.nvme is not None:
            self.nvme.close()
        if self.host_comm is not None:
            self.host_comm.close()
        if self.peers is not None:
            self.peers.close()

