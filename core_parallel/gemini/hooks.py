"""Module and tensor hooks that drive the chunk manager. No parameter is re-classed and no torch op is
intercepted: only `nn.Module` forward hooks, tensor gradient hooks and post-accumulate-grad hooks.

For each module that registers chunked parameters directly:
- forward pre-hook: gather its chunks; forward hook: release them (ZeRO-3 reshards after forward);
- a gradient hook on its outputs (fires before the module's backward): gather again;
- a gradient hook on its inputs (fires after the module's backward): release (the manager releases a chunk
  earlier, as soon as all its trainable parameters have their gradients);
- per trainable parameter, a post-accumulate-grad hook moves `param.grad` into the chunk's gradient
  buffer and frees it.
While a module computes, its own parameters have their plain class; outside, they are guarded (`fallback.py`):
any other read of them (another module's parameter, a tied output layer in the parent's forward) gathers their
chunk for that op and for its backward.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from .fallback import guard, unguard
from .manager import ChunkManager
from .param_reads import BackwardCall, eager, outside_modes, set_owner

__all__ = ["register_hooks"]


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


def _module_hooks(module: torch.nn.Module, mgr: ChunkManager, ids: tuple[int, ...], own: tuple) -> list:
    calls: list[BackwardCall] = []
    entered = [0]  # calls whose gather succeeded: `post` also runs when forward (or `pre`) raised

    def pre(mod, args, kwargs):
        mgr.begin_pass()
        with outside_modes():
            mgr.access(ids)
        entered[0] += 1
        unguard(own)
        if torch.is_grad_enabled():
            call = BackwardCall(mgr, ids)
            calls.append(call)
            for t in _grad_tensors(args, kwargs):
                t.register_hook(call.post)

    def post(mod, args, kwargs, output):
        guard(own)
        if not entered[0]:
            return
        entered[0] -= 1
        with outside_modes():
            mgr.done(ids)
        if torch.is_grad_enabled() and calls:
            call = calls.pop()
            for t in _grad_tensors(output):
                t.register_hook(call.pre)

    return [
        module.register_forward_pre_hook(eager(pre), with_kwargs=True),
        module.register_forward_hook(eager(post), with_kwargs=True, always_call=True),
    ]


def _state_dict_hooks(module: torch.nn.Module, mgr: ChunkManager, names: dict[str, int]) -> list:
    def save_pre(mod, prefix, keep_vars):
        mgr.io_gather(names.values())

    def save_post(mod, state_dict, prefix, local_metadata):
        for name, pidx in names.items():
            state_dict[prefix + name] = mgr.state_io.param_value(pidx)
        mgr.state_io.release(names.values())

    own = [mgr.params[pidx] for pidx in names.values()]

    def load_pre(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        mgr.io_load(names.values(), {pidx: state_dict.get(prefix + name) for name, pidx in names.items()})
        unguard(own)  # torch copies into the parameters (scratch storage; the shards were written above)

    def load_post(mod, incompatible):
        guard(own)
        mgr.state_io.release(names.values())

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
        own = tuple(mgr.params[i] for i in dict.fromkeys(names.values()))
        handles += _module_hooks(module, mgr, ids, own)
        handles += _state_dict_hooks(module, mgr, names)
    for pidx, p in enumerate(mgr.params):
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(eager(_grad_hook(mgr, pidx))))
    handles.append(model.register_forward_hook(eager(lambda mod, args, out: mgr.end_forward())))
    for pidx, p in enumerate(mgr.params):
        set_owner(p, mgr, pidx)
    guard(mgr.params)
    return handles


def _grad_hook(mgr: ChunkManager, pidx: int):
    def hook(p: torch.Tensor) -> None:
        with torch._C.DisableTorchFunctionSubclass():  # .grad is metadata: no call into the guard
            grad = p.grad
            p.grad = None
        mgr.on_grad(pidx, grad)

    return hook
