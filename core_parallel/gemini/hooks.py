"""Module and tensor hooks that drive the chunk manager. No parameter is re-classed and no torch op is
intercepted: only `nn.Module` forward hooks, tensor gradient hooks and post-accumulate-grad hooks.

For each module that registers chunked parameters directly:
- forward pre-hook: gather its chunks; forward hook: release them (ZeRO-3 reshards after forward);
- a gradient hook on its outputs (fires before the module's backward): gather again;
- a gradient hook on its inputs (fires after the module's backward): release (the manager releases a chunk
  earlier, as soon as all its trainable parameters have their gradients);
- per trainable parameter, a post-accumulate-grad hook moves `param.grad` into the chunk's gradient
  buffer and frees it.
A parameter must be used inside the forward of a module that registers it (tied parameters registered by
several modules are fine); using another module's parameter directly is not supported.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from .manager import ChunkManager

__all__ = ["register_hooks"]


class _BackwardCall:
    """One forward call of a module, seen from backward: gathers once, releases once."""

    __slots__ = ("mgr", "ids", "gathered", "released")

    def __init__(self, mgr: ChunkManager, ids: tuple[int, ...]) -> None:
        self.mgr, self.ids = mgr, ids
        self.gathered = self.released = False

    def pre(self, grad: torch.Tensor) -> None:
        if not self.gathered:
            self.gathered = True
            self.mgr.begin_backward()
            self.mgr.access(self.ids)

    def post(self, grad: torch.Tensor) -> None:
        if self.gathered and not self.released and self.mgr._in_backward:
            self.released = True
            self.mgr.done(self.ids)


def _outside_modes():
    """Gathers and releases run outside any TorchDispatchMode. Under selective activation checkpointing the
    module hooks fire inside the checkpointed region, in forward and again in the recompute, and whether a
    chunk must be gathered there can differ between the two (it may still be gathered, or not); the ops of a
    gather (empty, all_gather) would then appear in one run and not the other, which selective checkpointing
    rejects ("encountered during backward but not found in storage")."""
    return _disable_current_modes() if torch._C._len_torch_dispatch_stack() else contextlib.nullcontext()


_FLAT = (torch.Tensor, int, float, bool, str, type(None))


def _grad_tensors(args, kwargs: dict | None = None) -> list[torch.Tensor]:
    """Tensors that require grad among a call's arguments, or in a module's output (`args` alone)."""
    if isinstance(args, torch.Tensor):
        values = [args]
    elif (isinstance(args, tuple) and all(isinstance(v, _FLAT) for v in args)
          and all(isinstance(v, _FLAT) for v in (kwargs or {}).values())):
        values = [*args, *(kwargs or {}).values()]  # the common case, without pytree's walk
    else:
        values, _ = tree_flatten((args, kwargs))  # nested containers, output classes
    return [t for t in values if isinstance(t, torch.Tensor) and t.requires_grad]


def _module_hooks(module: torch.nn.Module, mgr: ChunkManager, ids: tuple[int, ...]) -> list:
    calls: list[_BackwardCall] = []

    def pre(mod, args, kwargs):
        with _outside_modes():
            mgr.access(ids)
        if torch.is_grad_enabled():
            call = _BackwardCall(mgr, ids)
            calls.append(call)
            for t in _grad_tensors(args, kwargs):
                t.register_hook(call.post)

    def post(mod, args, kwargs, output):
        with _outside_modes():
            mgr.done(ids)
        if torch.is_grad_enabled() and calls:
            call = calls.pop()
            for t in _grad_tensors(output):
                t.register_hook(call.pre)

    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True),
    ]


def _state_dict_hooks(module: torch.nn.Module, mgr: ChunkManager, names: dict[str, int]) -> list:
    def save_pre(mod, prefix, keep_vars):
        mgr.io_gather(names.values())

    def save_post(mod, state_dict, prefix, local_metadata):
        for name, pidx in names.items():
            state_dict[prefix + name] = mgr.param_value(pidx)
        mgr.io_release(names.values())

    def load_pre(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        mgr.io_load(names.values(), {pidx: state_dict.get(prefix + name) for name, pidx in names.items()})

    def load_post(mod, incompatible):
        mgr.io_release(names.values())

    return [
        module.register_state_dict_pre_hook(save_pre),
        module.register_state_dict_post_hook(save_post),
        module.register_load_state_dict_pre_hook(load_pre),
        module.register_load_state_dict_post_hook(load_post),
    ]


def register_hooks(model: torch.nn.Module, mgr: ChunkManager, index_of: dict[int, int]) -> list:
    """Attach all hooks; `index_of` maps id(param) to its index. Returns the handles."""
    handles = []
    for module in model.modules():
        names = {n: index_of[id(p)] for n, p in module.named_parameters(recurse=False) if id(p) in index_of}
        if not names:
            continue
        ids = tuple(sorted({mgr.slot_of[i].chunk for i in names.values()}))
        handles += _module_hooks(module, mgr, ids)
        handles += _state_dict_hooks(module, mgr, names)
    for pidx, p in enumerate(mgr.params):
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(_grad_hook(mgr, pidx)))
    handles.append(model.register_forward_hook(lambda mod, args, out: mgr.release_idle()))
    return handles


def _grad_hook(mgr: ChunkManager, pidx: int):
    def hook(p: torch.Tensor) -> None:
        mgr.on_grad(pidx, p.grad)
        p.grad = None

    return hook
