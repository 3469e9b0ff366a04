"""`setup_gemini`: pack a model's parameters into sharded chunks and wrap its optimizer."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...utils.errors import InputError
from ...utils.memory_meter import malloc_trim
from ..groups import world_rank
from .budget import ProcessMemory, outside_model
from .config import GeminiConfig
from .hooks import register_hooks
from .layout import MODULE_ORDER_ATTRIBUTE, ParamInfo, chunk_elems_from_mb, order_of_use, plan_chunks
from .manager import ChunkManager
from .optimizer import GeminiOptimizer, state_kinds

logger = logging.getLogger(__name__)

__all__ = ["setup_gemini"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _device_budget(config: GeminiConfig, device: torch.device) -> int:
    if config.budget_bytes is not None:
        return config.budget_bytes
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import psutil

    return psutil.virtual_memory().total


def _model_budget(config: GeminiConfig, device: torch.device, params: list) -> tuple[int, ProcessMemory]:
    """The model-data budget `memory_budget` leaves beside what the process holds already (`gemini/budget.py`)."""
    if device.type == "cpu" and config.offload_tier != "nvme":
        raise InputError("memory_budget on a CPU device needs offload_tier='nvme' (an offload_dir): the CPU tier is "
                         "the same memory, so nothing could leave it")
    if device.type == "cpu":  # what earlier work freed (dropped encoders, loading buffers) is not the process's
        gc.collect()
        malloc_trim()
    memory = ProcessMemory(device)
    outside = outside_model(memory, params)
    budget = config.memory_budget_bytes - outside
    if budget <= 0:
        raise InputError(f"memory_budget={config.memory_budget}: the process holds {outside / 2**20:.0f} MiB beside "
                         "the model already; raise the budget")
    return budget, memory


def _param_infos(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> tuple[list, list[ParamInfo]]:
    in_optim: dict[int, int] = {}
    for k, opt in enumerate(optimizers):
        for p in (p for g in opt.param_groups for p in g["params"]):
            if in_optim.setdefault(id(p), k) != k:
                raise ValueError(f"optimizers {in_optim[id(p)]} and {k} share a parameter: each optimizer must hold "
                                 "its own parameters")
    params, infos = [], []
    named = list(model.named_parameters())
    declared = {prefix: order for prefix, m in model.named_modules()
                if (order := getattr(m, MODULE_ORDER_ATTRIBUTE, None)) is not None}
    if declared:
        named = [named[i] for i in order_of_use([n for n, _ in named], declared)]
    for name, p in named:
        if not p.is_floating_point():
            raise ValueError(f"parameter {name} has dtype {p.dtype}; Gemini chunks floating-point parameters")
        if p.requires_grad and id(p) not in in_optim:
            raise ValueError(f"parameter {name} requires grad but is not in the optimizer; freeze it or add it")
        # a frozen parameter in the optimizer is accepted, as torch does: it gets no gradient, so no step
        # trainable chunks hold any floating dtype (fp32 masters); frozen ones one dtype each (`chunk.stored_dtype`)
        group = "chunk" if p.requires_grad else str(p.dtype).removeprefix("torch.")
        infos.append(ParamInfo(index=len(params), name=name, numel=p.numel(), dtype=group, trainable=p.requires_grad))
        params.append(p)
    if not params:
        raise ValueError("the model has no parameters to place in chunks")
    if not set(in_optim) <= {id(p) for p in params}:
        raise ValueError("the optimizer holds tensors that are not parameters of the model")
    return params, infos


def _state_kinds(optimizers: list[torch.optim.Optimizer]) -> tuple[str, ...]:
    """The optimizer state every trainable chunk keeps: one kind for all the optimizers (chunks may hold the
    parameters of several)."""
    kinds = {state_kinds(o) for o in optimizers}
    if len(kinds) > 1:
        raise ValueError(f"Gemini's chunks keep one kind of optimizer state; these optimizers keep {sorted(kinds)} "
                         f"({', '.join(type(o).__name__ for o in optimizers)}): use optimizers of one kind")
    return kinds.pop()


def setup_gemini(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    config: GeminiConfig,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.nn.Module, GeminiOptimizer | list[GeminiOptimizer]]:
    """Shard `model`'s parameters into chunks on `group` and return (model, Gemini optimizer).

    The model object is kept (same class, same parameter objects, same state_dict keys); its parameters
    hold data only while a module computes with them. `model.memory_report()` is added. Parameters are
    packed in `named_parameters()` order, which is their order of use for most models, or in the order a module
    declared with `set_module_order` (where registration and use differ, as in a diffusers UNet). A model set up before
    (a second `Trainer.fit`) keeps its chunks and current weights; the new optimizer starts with fresh state.

    `optimizer` may be a list of optimizers over disjoint parameters (a GAN's generator and discriminator, of one
    kind: all Adam or all SGD): one set of chunks, one `GeminiOptimizer` each, returned as a list; each steps its
    own parameters.
    """
    if not isinstance(config, GeminiConfig):
        raise TypeError(f"config must be a GeminiConfig, got {type(config).__name__}")
    many = isinstance(optimizer, (list, tuple))
    optimizers = list(optimizer) if many else [optimizer]
    world, rank = world_rank(group)
    params, infos = _param_infos(model, optimizers)
    kinds = _state_kinds(optimizers)
    if getattr(model, "gemini_manager", None) is not None:
        wrapped = _new_optimizers(model, optimizers, kinds, config, (world, rank), params, infos)
        return model, wrapped if many else wrapped[0]
    device = params[0].device
    dtype = _DTYPES[config.precision]
    elems = None if config.chunk_mb is None else chunk_elems_from_mb(config.chunk_mb, dtype.itemsize)
    specs = plan_chunks(infos, world, elems)
    budget, memory = _device_budget(config, device), None
    if config.memory_budget is not None:
        budget, memory = _model_budget(config, device, params)
    manager = ChunkManager(
        specs, params, config, group=group, rank=rank, world=world, device=device, dtype=dtype,
        state_kinds=kinds, budget=budget, names=[i.name for i in infos], memory=memory,
    )
    with torch.no_grad():
        manager.load_params()
    if memory is not None:
        memory.reset_peak()  # the first step's peak is measured from here
    index_of = {id(p): i for i, p in enumerate(params)}
    manager.handles.extend(register_hooks(model, manager, index_of))
    model.memory_report = manager.memory_report
    model.gemini_manager = manager
    padding = sum(s.size for s in specs) - sum(i.numel for i in infos)
    logger.info("gemini: %d parameters in %d chunks of at most %d elements (%d padding) on %d rank(s)",
                len(params), len(specs), max(s.size for s in specs), padding, world)
    wrapped = [GeminiOptimizer(o, manager, index_of, config) for o in optimizers]
    return model, wrapped if many else wrapped[0]


def _new_optimizers(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], kinds: tuple[str, ...],
                    config: GeminiConfig, world_rank: tuple[int, int], params: list,
                    infos: list[ParamInfo]) -> list[GeminiOptimizer]:
    """`model` is set up already (a second `fit` on one Trainer, a new optimizer in a plain loop): keep its chunks
    (they hold the current weights) and wrap the new optimizers over them, with fresh state as torch starts one."""
    mgr = model.gemini_manager
    what = None
    if [id(p) for p in params] != [id(p) for p in mgr.params]:
        what = "other parameters"
    elif any(mgr.is_trainable(i.index) != i.trainable for i in infos):
        what = "other parameters frozen"
    elif config != mgr.config:
        what = f"another config ({mgr.config})"
    elif world_rank != (mgr.world, mgr.rank):
        what = f"another process group ({mgr.world} ranks)"
    elif any(set(c.states) != set(kinds) for c in mgr.trainable_chunks):
        what = f"an optimizer keeping other state than {type(optimizers[0]).__name__}"
    if what is not None:
        raise ValueError(f"the model is set up by Gemini already (same parameters, frozen ones, config, process group "
                         f"and optimizer kind); this setup has {what}: set up a fresh copy of the model instead")
    mgr.state_io.end_checkpoint()
    mgr.settle()  # the last optimizer's step still deferred to the next gathers: in the weights before they go on
    mgr.zero_grad()
    for c in mgr.trainable_chunks:
        for buf in c.states.values():
            buf.view().zero_()
            buf.done()
    index_of = {id(p): i for i, p in enumerate(params)}
    return [GeminiOptimizer(o, mgr, index_of, config) for o in optimizers]


def collective_reads(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A block in which every rank reads `model`'s parameters outside a forward (an EMA update, sampling or
    logging between steps): under Gemini each read gathers its chunk, so every rank must enter the block and run
    the same reads; for a model Gemini did not set up, nothing to do.

    ```python
    with collective_reads(model):
        for e, p in zip(ema.parameters(), model.parameters()):
            e.lerp_(p, 1 - decay)
    ```
    """
    manager = getattr(model, "gemini_manager", None)
    return contextlib.nullcontext() if manager is None else manager.collective_reads()

