"""`ZeroOptimizer`: wraps any per-parameter `torch.optim` optimizer with ZeRO stage 1 or 2 sharding.

Training loop (the same on 1 or N ranks; `group=None` is the default group, or one process without one)::

    model, opt = core_parallel.setup(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=2))
    for i, batch in enumerate(batches):
        ctx = opt.no_sync() if (i + 1) % accum else contextlib.nullcontext()
        with ctx:
            opt.backward(model(batch).mean() / accum)     # scales the loss under fp16
        if (i + 1) % accum == 0:
            opt.clip_grad_norm(1.0)                        # optional; global norm across shards
            opt.step()                                     # skipped on every rank after an fp16 overflow
            opt.zero_grad()

What happens:
- Each rank keeps an fp32 master shard of every optimized parameter (`core_parallel.flat` ranges) and the
  inner optimizer's state for that shard only; the inner optimizer's `param_groups` hold the shards, and
  this wrapper shares the same `param_groups` list, so LR schedulers (and Lightning) see the real groups.
- The model keeps full parameters in the compute dtype (`precision`); fp16/bf16 casts the model at setup
  and a forward pre-hook casts floating inputs.
- Gradients are averaged over the group (each rank's loss is a mean over its part of the global batch).
  Both stages reduce-scatter them in buckets into fp32 gradient shards and free `param.grad`: stage 1
  when backward ends (full gradients live until then), stage 2 while backward runs (`overlap`).
  `no_sync()` skips all communication and accumulates locally in `param.grad`. Under fp32 without
  offload a rank's master shard is a view into the parameter itself (no extra copy).
- `step()` consumes the gradients: after it, `param.grad` and the master gradients are cleared, and the
  updated shards are all-gathered into the model's parameters.
- Parameters with no gradient on any rank in a step (frozen, unused) are skipped by the inner optimizer,
  as on one process; a parameter with a gradient on some ranks only gets the average with zeros elsewhere.
- A rank that dies (killed, OOM) makes the others' next collective raise `core_parallel.peers.PeerLostError`
  naming it (`backward`, `step`, `clip_grad_norm`, `grad_norm`, `load_sharded_state`), not the transport's
  "Connection reset by peer" alone (kept as the cause); a collective that times out with every rank alive says
  so and where each rank is (`core_parallel.trace`, `self.collectives`).

Checkpoints: this class implements the protocol of `core_parallel.checkpoint` (`sharded_state`,
`load_sharded_state`); use `core_parallel.save_checkpoint` / `load_checkpoint`. `state_dict()` is this
rank's own shard (for same-layout resumes only).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .. import flat
from ..groups import world_rank
from ..loss_scaler import DynamicLossScaler
from ..trace import CollectiveTrace
from .config import ZeroConfig
from .reducer import GradReducer, Slot

if TYPE_CHECKING:
    from ..checkpoint import CheckpointReader, ShardedState

__all__ = ["ZeroOptimizer", "backward_together"]

logger = logging.getLogger(__name__)

_OWN_BUCKET_BYTES = 1 << 20  # parameters this large (or the bucket size, if smaller) may get their own bucket


def _names_lost_ranks(method: Callable) -> Callable:
    """`method` runs as a traced collective (`core_parallel.trace`): a rank that exited is named, and a timeout
    says where each rank is."""

    op = f"zero.{method.__name__}"

    @functools.wraps(method)
    def wrapper(self: ZeroOptimizer, *args: Any, **kwargs: Any) -> Any:
        with self.collectives.collective(op):
            return method(self, *args, **kwargs)

    return wrapper


def _cast_inputs_hook(dtype: torch.dtype) -> Callable:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype)
        if isinstance(x, (list, tuple)):
            return type(x)(cast(v) for v in x)
        if isinstance(x, dict):
            return {k: cast(v) for k, v in x.items()}
        return x

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast(args), cast(kwargs)

    return hook


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2 wrapper around `optimizer` for `model` over `group` (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ZeroConfig,
        group: dist.ProcessGroup | None = None,
        siblings: Sequence[ZeroOptimizer] = (),
    ) -> None:
        """`siblings`: the optimizers set up together with this one on `model` (several optimizers over disjoint
        parameters, `core_parallel.setup(model, [opt_a, opt_b], ...)`); they stay live, any earlier one retires."""
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a ZeroConfig, got {type(config).__name__}")
        if isinstance(optimizer, ZeroOptimizer):
            raise ValueError("optimizer is already a ZeroOptimizer")
        if len(optimizer.state) > 0:
            raise ValueError("optimizer already has state: call core_parallel.setup before the first step")
        self.inner = optimizer
        self.config = config
        self.process_group = group
        self.world, self.rank = world_rank(group)
        self.collectives = CollectiveTrace.create(group)  # where each rank is, and an exited rank by name, on a failure
        self.loss_scaler = DynamicLossScaler(config.loss_scaler, enabled=config.loss_scaler.on(config.precision))
        self.model = model
        self._retire_previous(model, siblings)
        self._slots = self._build_slots(model, optimizer)
        self._cast_model(model)
        self._reducer = GradReducer(
            self._slots,
            self._plan_buckets(model),
            stage=config.stage,
            group=group,
            world=self.world,
            rank=self.rank,
            overlap=config.overlap,
            collectives=self.collectives,
        )
        self._prepared: bool | None = None  # None: grads not prepared; else the overflow flag
        # small control tensors (flags, norms) live where the backend can reduce them
        nccl = self.world > 1 and dist.get_backend(group) == "nccl"
        self._comm_device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._init_optimizer_base()

    # ----------------------------------------------------------------------------------------- setup
    def _retire_previous(self, model: torch.nn.Module, siblings: Sequence[ZeroOptimizer]) -> None:
        """A model gets one live set of ZeroOptimizers (one, or several set up together over disjoint parameters):
        a new setup (a second `fit` on one Trainer, a new optimizer in a plain loop) removes the earlier ones'
        gradient hooks, which would otherwise reduce every gradient a second time into their buckets, and retires
        them: their `backward` and `step` raise from then on."""
        keep = {id(o) for o in siblings}
        for ref in model.__dict__.get("_zero_optimizers", ()):
            previous = ref()
            if previous is not None and previous is not self and id(previous) not in keep:
                previous._reducer.detach()
                previous._retired = True
        # not a submodule or parameter: no Module.__setattr__
        model.__dict__["_zero_optimizers"] = [weakref.ref(o) for o in (*siblings, self)]

    def _check_live(self) -> None:
        if self.__dict__.get("_retired", False):
            raise RuntimeError("this ZeroOptimizer was replaced by a newer one on the same model (a second "
                               "core_parallel.setup); use the optimizer that setup returned last")

    def _init_optimizer_base(self) -> None:
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        for name in ("step_pre", "step_post", "state_dict_pre", "state_dict_post"):
            setattr(self, f"_optimizer_{name}_hooks", OrderedDict())
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    def _build_slots(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Slot]:
        names = {id(p): n for n, p in model.named_parameters()}
        master_device = torch.device("cpu") if self.config.offload == "cpu" else None
        slots: list[Slot] = []
        for gi, group in enumerate(optimizer.param_groups):
            masters = []
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(f"optimizer param group {gi} holds a tensor that is not a parameter of the model")
                start, end = flat.shard_range(p.numel(), self.world, self.rank)
                device = master_device or p.device
                view = p.detach().reshape(-1)[start:end]
                alias = self.config.dtype == p.dtype == torch.float32 and device == p.device and p.is_contiguous()
                master = view if alias else view.to(device, torch.float32, copy=True)
                slots.append(Slot(names[id(p)], p, gi, master, start, end, world=self.world))
                masters.append(master)
            group["params"] = masters
        if not slots:
            raise ValueError("the optimizer has no parameters")
        return slots

    def _cast_model(self, model: torch.nn.Module) -> None:
        dtype = self.config.dtype
        if dtype == torch.float32:
            return
        model.to(dtype)
        model.register_forward_pre_hook(_cast_inputs_hook(dtype), with_kwargs=True)

    def _plan_buckets(self, model: torch.nn.Module) -> list[list[int]]:
        """Buckets in reverse registration order; a large parameter whose size divides by the world size
        gets a bucket of its own, reduced and gathered in place (see `core_parallel.zero.reducer`)."""
        order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        ranked = sorted(range(len(self._slots)), key=lambda i: -order[self._slots[i].name])
        own_min = min(self.config.bucket_bytes, _OWN_BUCKET_BYTES)
        nbytes, keys = [], []
        for i in ranked:
            p = self._slots[i].param
            nbytes.append(p.numel() * p.element_size())
            alone = p.numel() % self.world == 0 and p.is_contiguous() and nbytes[-1] >= own_min
            keys.append(("own", i) if alone else (p.dtype, p.device))
        return [[ranked[j] for j in b] for b in flat.plan_buckets(nbytes, keys, self.config.bucket_bytes)]

    # -------------------------------------------------------------------------------------- training
    @property
    def stage(self) -> int:
        """ZeRO stage (1 or 2)."""
        return self.config.stage

    @_names_lost_ranks
    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` with the loss scaled under fp16, then (outside no_sync) gradient reduction."""
        self._check_live()
        self._prepared = None
        self._reducer.in_optimizer_backward = True
        try:
            (loss * self.loss_scaler.scale if self.loss_scaler.enabled else loss).backward()
        finally:
            self._reducer.in_optimizer_backward = False
        if self._reducer.sync:
            self._reducer.flush()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication, both stages) inside this block."""
        previous = self._reducer.sync
        self._reducer.sync = False
        try:
            yield
        finally:
            self._reducer.sync = previous

    def _prepare_grads(self) -> bool:
        """Reduce pending gradients, fill master grads, unscale, agree on overflow. Returns the overflow flag."""
        if self._prepared is not None:
            return self._prepared
        if not self._reducer.flushed or self._reducer.local_pending:
            self._reducer.flush()
        flags = torch.tensor([float(s.had_grad) for s in self._slots] + [float(self._local_overflow())],
                             device=self._comm_device)
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        overflow = bool(flags[-1] > 0)
        inv_scale = 1.0 / self.loss_scaler.scale
        for s, used in zip(self._slots, flags[:-1].tolist()):
            if not used:
                s.master.grad = None
            elif s.master.grad is not None and inv_scale != 1.0 and not overflow:
                s.master.grad.mul_(inv_scale)
        self._prepared = overflow
        return overflow

    def _local_overflow(self) -> bool:
        if not self.loss_scaler.enabled:
            return False
        return any(s.master.grad is not None and not bool(torch.isfinite(s.master.grad).all()) for s in self._slots)

    @_names_lost_ranks
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most `max_norm`; returns the norm before clipping.

        Same result as `torch.nn.utils.clip_grad_norm_` on one process with the whole batch. Reduces
        pending gradients first. After an fp16 overflow returns inf and changes nothing.
        """
        if self._prepare_grads():
            return torch.tensor(float("inf"))
        total = self.grad_norm()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for s in self._slots:
            if s.master.grad is not None:
                s.master.grad.mul_(coef.to(s.master.grad.device))
        return total

    @_names_lost_ranks
    def clip_grad_value(self, clip_value: float) -> None:
        """Clamp every gradient element into [-clip_value, clip_value], as `torch.nn.utils.clip_grad_value_` on one
        process with the whole batch: elementwise on each rank's reduced, unscaled shards, so no communication beyond
        reducing pending gradients. After an fp16 overflow changes nothing (the step is skipped)."""
        if self._prepare_grads():
            return
        for s in self._slots:
            if s.master.grad is not None:
                s.master.grad.clamp_(-clip_value, clip_value)

    @_names_lost_ranks
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the (reduced, unscaled) gradients across all shards, as a float32 scalar."""
        self._prepare_grads()
        sq = torch.zeros((), dtype=torch.float64, device=self._comm_device)
        for s in self._slots:
            if s.master.grad is not None:
                # fp32 norm per shard (as torch's clip_grad_norm_), squares summed in fp64: no fp64 copy of the grads
                sq += torch.linalg.vector_norm(s.master.grad).to(self._comm_device, torch.float64) ** 2
        if self.world > 1:
            dist.all_reduce(sq, group=self.process_group)
        sq = sq.cpu()
        return sq.sqrt().float()

    @torch.no_grad()
    @_names_lost_ranks
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce, unscale, clip (`max_grad_norm`), update the shards and all-gather the parameters.

        On an fp16 overflow on any rank, the update is skipped on all ranks and the loss scale backs off.
        The gradients are consumed (cleared) either way.
        """
        self._check_live()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        overflow = self._prepare_grads()
        self.loss_scaler.update(overflow)
        if not overflow:
            if self.config.max_grad_norm is not None:
                self.clip_grad_norm(self.config.max_grad_norm)
            self.inner.step()
            self._reducer.gather_params()
        self._clear_grads()
        self.collectives.end_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (model and master). Gradients are always dropped, never zero-filled."""
        self._clear_grads()

    def _clear_grads(self) -> None:
        for s in self._slots:
            s.param.grad = None
            s.master.grad = None
        self._reducer.reset()
        self._prepared = None

    # ------------------------------------------------------------------------------- checkpoints
    def sharded_state(self, *, frozen: bool = True) -> ShardedState:
        """This rank's part of the state, in the `core_parallel.checkpoint` protocol (`frozen` changes nothing
        here: the frozen parameters outside the optimizer are whole in the model, saved or left out by the
        caller)."""
        from ..checkpoint import ParamShard, ShardedState

        params = {}
        for s in self._slots:
            tensors = {"master": s.master}
            scalars = {}
            for key, value in self.inner.state.get(s.master, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == s.master.shape:
                    tensors[key] = value
                else:
                    scalars[key] = value
            params[s.name] = ParamShard(
                shape=s.shape, dtype=s.param.dtype, start=s.start, end=s.end, tensors=tensors, scalars=scalars,
                group=s.group,
            )
        groups = []
        for gi, g in enumerate(self.param_groups):
            hyper = {k: v for k, v in g.items() if k != "params"}
            hyper["params"] = [s.name for s in self._slots if s.group == gi]
            groups.append(hyper)
        info = {
            "kind": "zero", "stage": self.stage, "precision": self.config.precision, "optimizer": _qualname(self.inner)
        }
        return ShardedState(params=params, param_groups=groups, loss_scaler=self.loss_scaler.state_dict(), info=info)

    @_names_lost_ranks
    def load_sharded_state(self, reader: CheckpointReader) -> None:
        """Read this rank's ranges from a checkpoint, then refresh the model's parameters."""
        from ..checkpoint import restore_param_groups

        names = [[s.name for s in self._slots if s.group == gi] for gi in range(len(self.param_groups))]
        restore_param_groups(self.param_groups, reader.param_groups, names)
        saved = set(reader.param_names())
        with torch.no_grad():
            for s in self._slots:
                if s.name not in saved and self._load_unmanaged(reader, s):
                    continue
                reader.check_param(s.name, s.shape)
                s.master.copy_(reader.read(s.name, "master", s.start, s.end))
                state: dict[str, Any] = {}
                for key in reader.tensor_keys(s.name):
                    if key != "master":
                        state[key] = reader.read(s.name, key, s.start, s.end).to(s.master.device)
                state.update(reader.scalars(s.name))
                if state:
                    self.inner.state[s.master] = state
                else:
                    self.inner.state.pop(s.master, None)
        self.loss_scaler.load_state_dict(reader.loss_scaler)
        self._clear_grads()
        self._reducer.gather_params()

    def _load_unmanaged(self, reader: CheckpointReader, s: Slot) -> bool:
        """A parameter of the optimizer that the checkpoint holds in its model file, not as a sharded parameter:
        Gemini saves frozen parameters there (it never steps them, so they have no optimizer state). Its master
        comes from the file's full-precision value; False when the model file lacks it too."""
        value = reader.model_tensor(s.name)
        if value is None or value.numel() != s.param.numel():
            return False
        s.master.copy_(value.reshape(-1)[s.start : s.end])
        self.inner.state.pop(s.master, None)
        return True

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state and the loss scaler (same world size to reload)."""
        return {
            "inner": self.inner.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict(),
            "world": self.world,
            "rank": self.rank,
            "masters": [s.master.clone() for s in self._slots],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Reload `state_dict()` output saved by the same rank of a group of the same size."""
        if state_dict.get("world") != self.world or state_dict.get("rank") != self.rank:
            raise ValueError(
                f"state_dict was saved on rank {state_dict.get('rank')} of {state_dict.get('world')}, this is rank "
                f"{self.rank} of {self.world}: use core_parallel.load_checkpoint to change the world size"
            )
        self.inner.load_state_dict(state_dict["inner"])
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        with torch.no_grad():
            for s, m in zip(self._slots, state_dict["masters"]):
                s.master.copy_(m)
        self._reducer.gather_params()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported after setup: build the optimizer with all its groups before `core_parallel.setup`."""
        if hasattr(self, "_slots"):
            raise NotImplementedError("add_param_group after core_parallel.setup is not supported")
        super().add_param_group(param_group)


def backward_together(loss: torch.Tensor, optimizers: Sequence[ZeroOptimizer]) -> None:
    """One `loss.backward()` for several ZeroOptimizers set up together over disjoint parameters of one model
    (a GAN's generator and discriminator): every optimizer holding a parameter that requires grad now reduces its
    gradients, the same ones on every rank (Lightning's `toggle_optimizer` switches the others' off on all ranks).
    No loss scaling: each optimizer has its own scaler, so fp16 with a scaler is refused."""
    if any(o.loss_scaler.enabled for o in optimizers):
        raise ValueError("fp16 loss scaling with several ZeRO optimizers is not supported (each keeps its own "
                         "scaler); train in bf16 or fp32")
    active = [o for o in optimizers if any(s.param.requires_grad for s in o._slots)]
    for o in optimizers:
        o._check_live()
    for o in active:
        o._prepared = None
        o._reducer.in_optimizer_backward = True
    try:
        loss.backward()
    finally:
        for o in active:
            o._reducer.in_optimizer_backward = False
    for o in active:
        if o._reducer.sync:
            o._reducer.flush()


def _qualname(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
