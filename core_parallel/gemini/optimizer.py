"""The optimizer Gemini hands back: a `torch.optim.Optimizer` sharing the user's `param_groups` (so LR
schedulers keep working) that updates the fp32 master shards where each chunk's optimizer state lives.

Supported inner optimizers: `torch.optim.Adam`, `AdamW` and `SGD` (their hyperparameters are read from
the param groups at every step). `state_dict()` / `load_state_dict()` use torch's own format, consolidated
over ranks, so a state saved here loads into a plain torch optimizer and the other way round.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import wait

import torch
import torch.distributed as dist

from ..loss_scaler import DynamicLossScaler
from ..trace import CollectiveTrace
from .adam import AdamHyper, SgdHyper, adam_update_, sgd_update_
from .chunk import Chunk
from .config import GeminiConfig
from .host_memory import HostPages
from .manager import ChunkManager
from .state import ChunkState
from .storage import TieredBuffer

__all__ = ["GeminiOptimizer", "optimizer_kind", "state_kinds"]


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """'adam' or 'sgd'; TypeError for optimizers Gemini cannot run on flat shards."""
    if isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        kind = "adam"
    elif isinstance(optimizer, torch.optim.SGD):
        kind = "sgd"
    else:
        raise TypeError(f"Gemini supports torch.optim.Adam, AdamW and SGD, got {type(optimizer).__name__}")
    for i, g in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if g.get(flag):
                raise ValueError(f"param_groups[{i}].{flag}=True is not supported by Gemini")
    return kind


def state_kinds(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """Names of the per-element state buffers the optimizer keeps."""
    if optimizer_kind(optimizer) == "adam":
        return ("exp_avg", "exp_avg_sq")
    return ("momentum_buffer",) if any(g.get("momentum", 0) for g in optimizer.param_groups) else ()


STEP_PIECE = 1 << 20
"""Elements of an NVMe shard staged at a time by `step()` (4 MiB per buffer). A run is split only at multiples of
this from its start, so torch's fused kernel sees the same element positions and the numbers do not change."""


def _pieces(runs: list[tuple[int, int, int, int]], piece: int) -> list[tuple[int, int, list]]:
    """(lo, hi, runs) spans of at most `piece` elements covering `runs` (lo, hi, group, step) in order; a run
    longer than `piece` is cut at multiples of `piece` from its own start."""
    spans: list[tuple[int, int, list]] = []
    for lo, hi, *key in runs:
        for a in range(lo, hi, piece):
            b = min(a + piece, hi)
            if spans and b - spans[-1][0] <= piece:
                spans[-1] = (spans[-1][0], b, [*spans[-1][2], (a, b, *key)])
            else:
                spans.append((a, b, [(a, b, *key)]))
    return spans


def _hyper(kind: str, group: dict, decoupled: bool) -> AdamHyper | SgdHyper:
    if kind == "adam":
        b1, b2 = group["betas"]
        return AdamHyper(lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"],
                         weight_decay=group["weight_decay"], decoupled=decoupled)
    return SgdHyper(lr=float(group["lr"]), momentum=group["momentum"], dampening=group["dampening"],
                    weight_decay=group["weight_decay"], nesterov=group["nesterov"])


class GeminiOptimizer(torch.optim.Optimizer):
    """Sharded optimizer over Gemini chunks: backward, step, zero_grad, no_sync, clip_grad_norm."""

    def __init__(self, inner: torch.optim.Optimizer, manager: ChunkManager, index_of: dict[int, int],
                 config: GeminiConfig) -> None:
        super().__init__([torch.zeros(1)], {})
        self.inner, self.manager, self.max_grad_norm = inner, manager, config.max_grad_norm
        self.kind = optimizer_kind(inner)
        self.decoupled = isinstance(inner, torch.optim.AdamW)
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups
        self.group_of: dict[int, int] = {}
        self.order: list[int] = []  # param indices in torch's state_dict numbering
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                self.group_of[index_of[id(p)]] = gi
                self.order.append(index_of[id(p)])
        # trained: the parameters stepped (a frozen parameter may sit in a group; it is never stepped, as in torch)
        self.steps: dict[int, int] = {p: 0 for p in self.group_of if manager.is_trainable(p)}
        self.last_grad_norm: torch.Tensor | None = None
        self.process_group = manager.group
        self.loss_scaler = DynamicLossScaler(config.loss_scaler, enabled=config.loss_scaler.on(config.precision))
        self._scratch: dict[str, HostPages] = {}  # NVMe shards staged during step(), dropped after it
        # clipping's factor for the gradient shards on NVMe, applied where the step stages them (`_views`): scaling
        # them in place through the file mapping costs a page fault per page (minutes for an SD3.5 full fine-tune)
        self._nvme_grad_scale = 1.0
        self._prepared: bool | None = None  # None: not yet; else whether this step overflowed

    # ---- the training-loop interface ---------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, then make sure every rank has run its gradient reductions."""
        self.manager.state_io.end_checkpoint()
        passes = self.manager.passes
        (loss * self.loss_scaler.scale if self.loss_scaler.enabled else loss).backward()
        if self.manager.passes == passes:  # no hook fired on this rank: still take part in the reductions
            self.manager.begin_backward(queue=False)
            self.manager.end_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (full-size fp32 buffers per chunk), no communication."""
        previous, self.manager.sync = self.manager.sync, False
        try:
            yield
        finally:
            self.manager.sync = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.state_io.end_checkpoint()
        self._prepared = None
        self._nvme_grad_scale = 1.0
        self.manager.zero_grad()

    def _grad_shards(self) -> Iterator[torch.Tensor]:
        """Every gradient shard as a tensor to read or change in place (NVMe ones through their file mapping, with
        clipping's pending factor applied first: rare paths, the clipped step never comes here)."""
        scale, self._nvme_grad_scale = self._nvme_grad_scale, 1.0
        for c in self.manager.trainable_chunks:
            c.grad_sq = None  # the shards may change here
            if scale != 1.0 and c.grad.allocated and c.grad.tier == "nvme":
                c.grad.view().mul_(scale)
        for c in self.manager.trainable_chunks:
            if c.grad.allocated:
                yield c.grad.view()
                c.grad.done()

    @property
    def collectives(self) -> CollectiveTrace:
        """Where this rank is in its collectives (`core_parallel.trace`), as `ZeroOptimizer.collectives`."""
        return self.manager.collectives

    def _prepare(self) -> bool:
        """Once per step under fp16: agree on overflow across ranks, unscale. Returns True on overflow."""
        if self._prepared is None:
            overflow = False
            if self.loss_scaler.enabled:
                flag = torch.tensor([0.0])
                for g in self._grad_shards():
                    if not torch.isfinite(g).all():
                        flag[0] = 1.0
                if self.manager.world > 1:
                    flag = flag.to(self.manager.device)
                    with self.collectives.collective("all_reduce(overflow)"):
                        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.manager.group)
                overflow = bool(flag.item())
                if not overflow:
                    for g in self._grad_shards():
                        g.mul_(1.0 / self.loss_scaler.scale)
            self._prepared = overflow
        return self._prepared

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradient shards so their global L2 norm is at most `max_norm`; returns the norm."""
        if norm_type != 2.0:
            raise ValueError(f"norm_type must be 2.0 (global L2 norm over shards), got {norm_type}")
        if self._prepare():
            return torch.tensor(float("inf"))
        total = self._grad_norm()
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:
            for c in self.manager.trainable_chunks:
                if c.grad.allocated and c.grad.tier != "nvme":
                    c.grad.view().mul_(coef)
            self._nvme_grad_scale *= coef
        self.last_grad_norm = total
        return total

    def clip_grad_value(self, clip_value: float) -> None:
        """Clamp every element of the gradient shards into [-clip_value, clip_value], as
        `torch.nn.utils.clip_grad_value_` on one process: elementwise, no communication. After an fp16 overflow
        changes nothing (the step is skipped)."""
        if self._prepare():
            return
        for g in self._grad_shards():
            g.clamp_(-clip_value, clip_value)

    def _grad_norm(self) -> torch.Tensor:
        # each shard's norm in fp32 (as torch.nn.utils.clip_grad_norm_ takes each gradient's), their squares summed
        # in fp64: a float64 copy of every gradient shard took a third of a CPU step of a 220M UNet. An NVMe shard's
        # was taken as it was written (the same values, so the same norm): reading it back cost a disk read a step
        sq = torch.zeros((), dtype=torch.float64)
        for c in self.manager.trainable_chunks:
            if c.grad.allocated and c.grad_sq is not None and self._nvme_grad_scale == 1.0:
                sq += c.grad_sq
            elif c.grad.allocated:
                sq += torch.linalg.vector_norm(self._grad_values(c)).cpu().double() ** 2
        if self.manager.world > 1:
            sq = sq.to(self.manager.device)
            with self.collectives.collective("all_reduce(grad norm)"):
                dist.all_reduce(sq, group=self.manager.group)
        return sq.sqrt().float().cpu()

    def _grad_values(self, c: Chunk) -> torch.Tensor:
        """Chunk `c`'s gradient shard as clipping has made it; one on NVMe read with pread into a temporary."""
        if c.grad.tier != "nvme":
            return c.grad.view()
        g = c.grad.read_into(torch.empty(c.grad.numel, dtype=c.grad.dtype))
        return g.mul_(self._nvme_grad_scale) if self._nvme_grad_scale != 1.0 else g

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.manager.state_io.end_checkpoint()
        self.manager.settle()  # the last step's deferred updates no forward applied (a step without one between)
        used = self.manager.used_params()
        overflow = self._prepare()
        self.loss_scaler.update(overflow)
        self._prepared = None
        if overflow:  # every rank agreed: skip the step, keep the states
            self.manager.end_step()
            return loss
        if self.max_grad_norm is not None:
            self.clip_grad_norm(self.max_grad_norm)
        for p in used:
            if p in self.steps:  # another optimizer's parameter (several over one model's chunks) is not ours
                self.steps[p] += 1
        hypers = [_hyper(self.kind, g, self.decoupled or g.get("decoupled_weight_decay", False))
                  for g in self.param_groups]
        eager = []
        for c in (c for c in self.manager.trainable_chunks if c.grad.allocated):
            if self._defers(c):
                self._defer(c, used, hypers)
            else:
                eager.append(c)
        try:
            with self.manager.master_writes():  # peers reading this rank's masters wait for the new values
                self._step_chunks(eager, used, hypers)
        finally:
            for pages in self._scratch.values():
                pages.drop()
            self._nvme_grad_scale = 1.0
        self.manager.end_step()
        # The user's optimizer was stepped through us, never through its own step(): mark it as torch's LR
        # schedulers do when they wrap that step, or the first scheduler.step() warns falsely of a wrong order.
        self.inner._opt_called = True  # type: ignore[attr-defined]
        return loss

    # ---- the step deferred to the next forward (`GeminiConfig.step_in_forward`) ------------------------
    # On one rank whose masters are on NVMe the step reads every master, gradient and state shard and writes master
    # and states back: seconds of disk with no compute beside them, after which the next forward reads every master
    # again. Deferred, a chunk's update runs when its next gather asks for the master (on the reader thread when the
    # gather is a prefetch): the master is read once for both, and the disk works while the forward computes. The
    # numbers do not change: hyperparameters, clipping's factor and step counts are taken here, and the update runs
    # on the same pieces with the same kernel. Until it ran, the chunk's master and states are marked stale (a read
    # raises); the manager runs what is left before a backward, a save or load, a state_dict() (`settle`).
    def _defers(self, c: Chunk) -> bool:
        mgr = self.manager
        return (self._step_in_forward and mgr.reader is not None and mgr.world == 1 and c.master.tier == "nvme"
                and c.sm.data is ChunkState.RELEASED and c.deferred is None)

    @functools.cached_property
    def _step_in_forward(self) -> bool:
        """`GeminiConfig.step_in_forward` resolved (None: whether the trained chunks hold half the master bytes)."""
        chosen = self.manager.config.step_in_forward
        if chosen is None:
            trained = sum(c.master.nbytes for c in self.manager.trainable_chunks)
            chosen = 2 * trained >= sum(c.master.nbytes for c in self.manager.chunks)
        return chosen

    def _defer(self, c: Chunk, used: set[int], hypers: list) -> None:
        spans = self._spans(c, used)
        if not spans:
            return
        scale = self._nvme_grad_scale if c.grad.tier == "nvme" else 1.0
        for b in (c.master, *c.states.values()):
            b.stale = f"chunk {c.index}'s optimizer step is deferred to its next gather"
        c.deferred = functools.partial(self._step_deferred, c, spans, hypers, scale)

    def _step_deferred(self, c: Chunk, spans: list, hypers: list, scale: float, out: torch.Tensor | None) -> None:
        """Run chunk `c`'s deferred update (`spans` from `_spans`); `out`: the gathered buffer to leave the new master
        in (None: none). Runs on whichever thread gathers the chunk: its scratch pieces are that thread's."""
        for b in (c.master, *c.states.values()):
            b.stale = None
        try:
            self._run_deferred(c, spans, hypers, scale, out)
        except BaseException as exc:  # part of the shards updated: none of them may pass for valid values again
            for b in (c.master, *c.states.values()):
                b.stale = (f"chunk {c.index}'s deferred optimizer step failed part-way ({exc!r}); restore from the "
                           "last checkpoint")
            raise

    def _run_deferred(self, c: Chunk, spans: list, hypers: list, scale: float, out: torch.Tensor | None) -> None:
        direct = out is not None and out.dtype == c.master.dtype  # one rank: `out` is the whole master shard
        if direct:
            c.master.read_into(out)  # the gather's read: the update below changes its spans in place
        thread = threading.get_ident()
        for lo, hi, runs in spans:
            views = self._views(c, lo, hi, thread, scale=scale, master=out[lo:hi] if direct else None)
            self._update(c, views, lo, runs, hypers)
            self._write_back([(b, views[name]) for name, b in (("master", c.master), *c.states.items())
                              if b.tier == "nvme"], lo, None)
        if out is not None and not direct:  # the gathered dtype differs: cast from the new master
            out.copy_(c.master.read_into(torch.empty(c.shard_numel, dtype=c.master.dtype)))
        for b in (c.master, c.grad, *c.states.values()):
            b.done()

    def _runs(self, c: Chunk, used: set[int]) -> Iterator[tuple[int, int, int, int]]:
        """(lo, hi, group, step) over this rank's shard: contiguous params sharing group and step."""
        run = None
        for s in c.spec.slots:
            lo, hi = max(s.offset, c.lo) - c.lo, min(s.offset + s.numel, c.hi) - c.lo
            if lo >= hi or s.param not in used or s.param not in self.group_of:  # not trained, or another's
                if run:
                    yield run
                run = None
                continue
            key = (self.group_of[s.param], self.steps[s.param])
            if run and run[1] == lo and run[2:] == key:
                run = (run[0], hi, *key)
            else:
                if run:
                    yield run
                run = (lo, hi, *key)
        if run:
            yield run

    def _staged(self, name: str, buf: TieredBuffer, lo: int, hi: int, parity: int) -> torch.Tensor:
        """Elements [lo, hi) of `buf` (on NVMe) read into this step's scratch buffer `name` (two of each, `parity`,
        so the next piece is read while this one is updated): updating through the file mapping would take a write
        fault per page; the result goes back with one pwrite (`_step_chunks`)."""
        pages = self._scratch.get(f"{name}{parity}")
        if pages is None:  # one piece, reused for every piece of every chunk
            pages = self._scratch[f"{name}{parity}"] = HostPages(STEP_PIECE * 4)
        return buf.read_into(pages.tensor(torch.float32, hi - lo), lo)

    def _spans(self, c: Chunk, used: set[int]) -> list[tuple[int, int, list]]:
        runs = list(self._runs(c, used))
        if any(b.tier == "nvme" for b in (c.master, c.grad, *c.states.values())):
            return _pieces(runs, STEP_PIECE)
        return [(0, c.shard_numel, runs)] if runs else []

    def _views(self, c: Chunk, lo: int, hi: int, parity: int, scale: float | None = None,
               master: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Elements [lo, hi) of the chunk's master, gradient and states: NVMe ones staged in scratch memory (set
        `parity`); `master`: the master's elements where they are already (a gathered buffer); `scale`: clipping's
        factor for an NVMe gradient (default: this step's)."""
        bufs = {"master": c.master, "grad": c.grad, **c.states}
        views = {k: master if k == "master" and master is not None else
                 self._staged(k, b, lo, hi, parity) if b.tier == "nvme" else b.view()[lo:hi] for k, b in bufs.items()}
        scale = self._nvme_grad_scale if scale is None else scale
        if c.grad.tier == "nvme" and scale != 1.0:
            views["grad"].mul_(scale)  # the staged copy: clipping's scale, as in place elsewhere
        return views

    def _step_chunks(self, chunks: list[Chunk], used: set[int], hypers: list) -> None:
        """Update each chunk's shard where its optimizer state lives. NVMe shards are staged in scratch memory a
        piece of at most `STEP_PIECE` elements at a time and written back, so the step holds eight pieces (two
        sets of four), not four shards. With the manager's reader thread (a CPU device) the next piece is read
        and the last one written back there while this one is updated: the step streams at the disk's pace."""
        work = [(c, *span) for c in chunks for span in self._spans(c, used)]
        reader = self.manager.reader
        pending, writes = None, []
        try:
            for k, (c, lo, hi, runs) in enumerate(work):
                views = pending.result() if pending is not None else self._views(c, lo, hi, k % 2)
                pending = None
                if k + 1 < len(work) and reader is not None:
                    nc, nlo, nhi, _ = work[k + 1]
                    pending = reader.submit(self._views, nc, nlo, nhi, (k + 1) % 2)
                self._update(c, views, lo, runs, hypers)
                back = ([(b, views[name]) for name, b in (("master", c.master), *c.states.items()) if b.tier == "nvme"],
                        lo, c if k + 1 == len(work) or work[k + 1][0] is not c else None)
                # with the reader, the write-back runs there too: after the read of the next piece, before the read
                # that reuses this piece's scratch memory (one thread, in order), while this thread updates the next
                if reader is not None:
                    writes.append(reader.submit(self._write_back, *back))
                else:
                    self._write_back(*back)
            for f in writes:
                f.result()  # a failed write is raised here, before the step counts as done
        finally:  # the scratch memory is not read into or written from once the step is gone
            wait([f for f in (pending, *writes) if f is not None])

    @staticmethod
    def _write_back(back: list[tuple[TieredBuffer, torch.Tensor]], lo: int, last_of: Chunk | None) -> None:
        """Write the updated staged pieces `back` ((buffer, piece) pairs from element `lo`) to their NVMe shards;
        `last_of`: the chunk whose last piece this was (its buffers' pages may leave resident memory)."""
        for b, piece in back:
            b.write_from(piece, lo)
        if last_of is not None:
            for b in (last_of.master, last_of.grad, *last_of.states.values()):
                b.done()

    def _update(self, c: Chunk, views: dict[str, torch.Tensor], span_lo: int, runs: list, hypers: list) -> None:
        """Step elements [span_lo, span_lo + len) of the chunk (`views`; staged NVMe pieces are written back by the
        caller, `_write_back`)."""
        grad, master = views["grad"], views["master"]
        states = {k: views[k] for k in c.states}
        param = master if master.device == grad.device else master.to(grad.device)
        for lo, hi, gi, step in runs:
            lo, hi = lo - span_lo, hi - span_lo
            if self.kind == "adam":
                adam_update_(param[lo:hi], grad[lo:hi], states["exp_avg"][lo:hi], states["exp_avg_sq"][lo:hi],
                             step, hypers[gi])
            else:
                buf = states["momentum_buffer"][lo:hi] if "momentum_buffer" in states else None
                sgd_update_(param[lo:hi], grad[lo:hi], buf, step, hypers[gi])
        if param is not master:
            master.copy_(param)
            self.manager.ledger.transfer(c.grad.tier, c.master.tier, master.numel() * 4)

    # ---- torch-format state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's optimizer state_dict, consolidated on every rank (collective: call on all ranks)."""
        self.manager.settle()
        state: dict[int, dict] = {}
        pos = {p: i for i, p in enumerate(self.order)}
        for c in self.manager.trainable_chunks:
            full = {k: c.gather_fp32(b) for k, b in c.states.items()}
            for s in c.spec.slots:
                if self.steps.get(s.param, 0) == 0:
                    continue
                entry = {k: v[s.offset : s.offset + s.numel].view(self.manager.params[s.param].shape).clone()
                         for k, v in full.items()}
                if self.kind == "adam":
                    entry["step"] = torch.tensor(float(self.steps[s.param]))
                state[pos[s.param]] = entry
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's optimizer format (any rank count saved it); each rank keeps its own shard."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups)
        ):
            raise ValueError("optimizer state_dict has a different number of param groups or parameters")
        self.manager.settle()
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})
        for pidx in self.steps:
            self.steps[pidx] = 0
        for i, entry in state_dict["state"].items():
            pidx = self.order[int(i)]
            if pidx not in self.steps:
                continue  # state of a parameter frozen here: never stepped
            self.steps[pidx] = int(entry["step"]) if "step" in entry else 1
            self._load_entry(pidx, entry)

    def _load_entry(self, pidx: int, entry: dict) -> None:
        s = self.manager.slot_of[pidx]
        c = self.manager.chunks[s.chunk]
        lo, hi = max(s.offset, c.lo), min(s.offset + s.numel, c.hi)
        if lo >= hi:
            return
        for k, buf in c.states.items():
            value = entry.get(k)
            if value is None:
                raise KeyError(f"optimizer state of parameter {pidx} lacks {k!r}")
            buf.view()[lo - c.lo : hi - c.lo].copy_(value.detach().reshape(-1)[lo - s.offset : hi - s.offset])
            buf.done()

    # ---- the core_parallel.checkpoint protocol ------------------------------------------------------
    def sharded_state(self, *, frozen: bool = True):
        """This rank's pieces of every trained parameter for `save_checkpoint` (collective); `frozen=False`: the
        save leaves the frozen parameters out, so their chunks are not gathered for it."""
        from ..checkpoint import ParamShard, ShardedState

        mgr = self.manager
        mgr.begin_checkpoint(frozen=frozen)  # rank 0 alone calls model.state_dict() next: no collectives
        params = {}
        for pidx, name in enumerate(mgr.names):
            if pidx not in self.steps:
                continue  # frozen: saved in the model file, as ZeRO does
            s = mgr.slot_of[pidx]
            c = mgr.chunks[s.chunk]
            lo, hi = max(s.offset, c.lo), min(s.offset + s.numel, c.hi)
            lo, hi = (lo, hi) if lo < hi else (s.offset, s.offset)
            tensors = {"master": c.master.view()[lo - c.lo : hi - c.lo].clone()}
            scalars = {}
            if self.steps.get(pidx, 0) > 0:
                tensors.update({k: b.view()[lo - c.lo : hi - c.lo].clone() for k, b in c.states.items()})
                if self.kind == "adam":
                    scalars["step"] = torch.tensor(float(self.steps[pidx]))
            for b in (c.master, *c.states.values()):
                b.done()
            params[name] = ParamShard(shape=tuple(mgr.params[pidx].shape), dtype=mgr.param_dtypes[pidx],
                                      start=lo - s.offset, end=hi - s.offset, tensors=tensors, scalars=scalars,
                                      group=self.group_of.get(pidx, 0))
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [mgr.names[self.order[j]] for j in range(len(self.order)) if self._gi(j) == gi]}
                  for gi, g in enumerate(self.param_groups)]
        info = {"kind": "gemini", "precision": mgr.config.precision, "optimizer": type(self.inner).__name__}
        return ShardedState(params=params, param_groups=groups, loss_scaler=self.loss_scaler.state_dict(), info=info)

    def end_sharded_state(self) -> None:
        """The save is done (no communication): model.state_dict() gathers full values again."""
        self.manager.state_io.end_checkpoint()

    def _gi(self, j: int) -> int:
        return self.group_of[self.order[j]]

    def load_sharded_state(self, reader) -> None:
        """Read this rank's ranges of a checkpoint saved by ZeRO or Gemini on any number of ranks."""
        from ..checkpoint import CheckpointError, restore_param_groups

        mgr = self.manager
        mgr.settle()
        names = [[mgr.names[p] for p in self.order if self.group_of[p] == gi] for gi in range(len(self.param_groups))]
        restore_param_groups(self.param_groups, reader.param_groups, names)
        saved = set(reader.param_names())
        with mgr.master_writes("load_checkpoint"):
            for pidx, name in enumerate(mgr.names):
                if name not in saved:
                    if pidx in self.steps:
                        raise CheckpointError(f"{reader.path}: checkpoint has no trained parameter {name!r}")
                    continue  # a frozen parameter ZeRO saved in model.safetensors: loaded with the model file
                reader.check_param(name, tuple(mgr.params[pidx].shape))
                self._load_param(reader, pidx, name)
        self.loss_scaler.load_state_dict(reader.loss_scaler)
        mgr.zero_grad()

    def _load_param(self, reader, pidx: int, name: str) -> None:
        s = self.manager.slot_of[pidx]
        c = self.manager.chunks[s.chunk]
        lo, hi = max(s.offset, c.lo), min(s.offset + s.numel, c.hi)
        keys = set(reader.tensor_keys(name))
        if pidx in self.steps:
            step = reader.scalars(name).get("step")
            self.steps[pidx] = int(step) if step is not None else (1 if keys - {"master"} else 0)
        if lo >= hi:
            return
        for key, buf in (("master", c.master), *c.states.items()):
            if key not in keys:
                buf.view()[lo - c.lo : hi - c.lo].zero_()
            else:
                buf.view()[lo - c.lo : hi - c.lo].copy_(reader.read(name, key, lo - s.offset, hi - s.offset))
            buf.done()

    def __repr__(self) -> str:
        return f"GeminiOptimizer({type(self.inner).__name__}, chunks={len(self.manager.chunks)})"


