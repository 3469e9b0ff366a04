"""Reads of a chunked parameter outside the forward of a module that registers it.

The module hooks (`hooks.py`) are the fast path: while a module computes, the chunks of its own parameters are
gathered and its backward gathers them again. Any other read (a tied output layer `h @ self.emb.weight.t()` in
the parent's forward, a parameter of another module, a view of a parameter kept from earlier) would see a
released chunk, which reads as zeros on a CPU device and as freed memory on an accelerator.

So a parameter outside its modules' forwards is a `_Guarded` instance: its class is swapped (no new object,
no copy) to a subclass of its own class with a `__torch_function__` that, for any op reading its data,
gathers the chunk for that op, keeps views of it guarded too, and, when autograd records the op, gathers the
chunk again before the op's backward (as the module hooks do for a module) so the gradients are computed
from the real values and reach the chunk's reduction through the parameter's own gradient. Metadata (shape,
dtype, `.grad`, hooks) passes through untouched. While a module that registers it computes, the parameter is
of its plain class again, so the fast path pays no Python call per op.

Reading the data outside a training or evaluation pass (between steps, before the first forward) raises
`GeminiParamError` naming the parameter and its module: gathering there would be a collective that only the
ranks doing the read join. Moves and casts (`.to()`, `.cpu()`, `.half()`, ... as `module.to(device)` or a
Lightning stage's setup applies them) read no data when they change nothing: a move to the device and dtype the
parameter already has is the parameter itself, anywhere; one that would change them raises, naming both.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from .param_reads import BackwardCall, eager, outside_modes, owner_of, set_owner

__all__ = ["GeminiParamError", "guard", "unguard"]


class GeminiParamError(RuntimeError):
    """A chunked parameter's data was read where Gemini cannot gather it."""


# Tensor methods and functions that read metadata only (no element of the data).
_METADATA = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "element_size", "get_device",
    "is_contiguous", "is_floating_point", "is_complex", "is_signed", "is_inference", "is_shared", "is_pinned",
    "is_set_to", "_is_view", "data_ptr", "untyped_storage", "register_hook", "register_post_accumulate_grad_hook",
    "requires_grad_", "retain_grad", "__hash__", "__setstate__", "_fix_weakref", "__dlpack_device__",
    "_has_compatible_shallow_copy_type",
})
# Properties whose value is a view of the data (the others, shape, dtype, grad, ..., are metadata).
_VIEW_PROPERTIES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


def _op_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        return f"{owner}.{name}" if owner in _VIEW_PROPERTIES or owner == "data" else name
    return name


class _ChunkView(torch.Tensor):
    """A view of a chunk's data made by the fallback (`w.t()`, `w.detach()`, ...): guarded like a parameter.
    Its owner (`param_reads.owner_of`) is the (manager, parameter index) of the parameter it came from."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _intercept(func, args, kwargs or {})


_GUARDED: dict[type, type] = {}


def _guarded_class(base: type) -> type:
    cls = _GUARDED.get(base)
    if cls is None:
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return _intercept(func, args, kwargs or {})

        cls = type(base.__name__, (base,), {"__torch_function__": classmethod(__torch_function__),
                                            "_gemini_base": base, "__module__": base.__module__})
        _GUARDED[base] = cls
    return cls


def guard(params) -> None:
    """Give `params` (tensors tagged by `param_reads.set_owner`) their guarded class."""
    for p in params:
        cls = type(p)
        if "_gemini_base" not in cls.__dict__:
            p.__class__ = _guarded_class(cls)


def unguard(params) -> None:
    """Give `params` their plain class back (a module that registers them computes now)."""
    for p in params:
        base = type(p).__dict__.get("_gemini_base")
        if base is not None:
            p.__class__ = base


def _is_guarded(t) -> bool:
    return isinstance(t, torch.Tensor) and (type(t) is _ChunkView or "_gemini_base" in type(t).__dict__)


def _describe(mgr, pidx: int) -> str:
    name = mgr.names[pidx] if pidx < len(mgr.names) else f"#{pidx}"
    module = name.rpartition(".")[0]
    return f"parameter {name!r} (module {module!r})" if module else f"parameter {name!r} (the root module)"


def _plain(func, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _as_view(out, mgr, pidx: int, keys: set[int]):
    """Outputs that alias a chunk's data become `_ChunkView`s of it (they would read released memory later)."""
    def wrap(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in keys:
            return t
        v = t.as_subclass(_ChunkView)
        set_owner(v, mgr, pidx)
        return v

    return tree_map_only(torch.Tensor, wrap, out)


_CASTS = {"half": torch.float16, "float": torch.float32, "double": torch.float64, "bfloat16": torch.bfloat16}
_MOVES = frozenset({"to", "cpu", "cuda", "type", *_CASTS})


def _same_device(target, actual: torch.device) -> bool:
    if target is None:
        return True
    target = torch.device(target)
    if target.type != actual.type:
        return False
    if target.index is None and target.type == "cuda":
        return actual.index == torch.cuda.current_device()
    return target.index is None or target.index == actual.index


def _move_target(name: str, t: torch.Tensor, args, kwargs) -> tuple[object, torch.dtype | None] | None:
    """(device, dtype) that the move or cast `name(t, *args, **kwargs)` asks for; None: it is not one (a
    `type()` query, `to(copy=True)`, a memory-format change)."""
    if name in _CASTS:
        return None, _CASTS[name]
    if name == "cpu":
        return "cpu", None
    if name == "cuda":
        device = kwargs.get("device", args[0] if args else None)
        return torch.device("cuda", device) if isinstance(device, int) else (device or "cuda"), None
    if name == "type":
        dtype = kwargs.get("dtype", args[0] if args else None)
        return (None, dtype) if isinstance(dtype, torch.dtype) else None
    kwargs = dict(kwargs)
    if kwargs.pop("copy", False):
        return None
    device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if memory_format not in (None, torch.preserve_format):
        return None
    return device, dtype


def _move(name: str, mgr, pidx: int, args, kwargs):
    """A move or cast of a guarded tensor: itself when it changes nothing (no data read), else one error."""
    t = args[0]
    if name == "type" and len(args) == 1 and not kwargs:  # the type's name: metadata
        return _plain(torch.Tensor.type, args, kwargs)
    target = _move_target(name, t, args[1:], kwargs)
    if target is None:
        return None
    device, dtype = target
    if _same_device(device, t.device) and (dtype is None or dtype == t.dtype):
        return t
    raise GeminiParamError(
        f"{_describe(mgr, pidx)} cannot be moved or cast ({name} to device={device}, dtype={dtype}): Gemini keeps "
        f"it in chunks on {t.device} in {t.dtype}; choose the device and precision before setup (the Trainer's "
        "accelerator and precision), or read full values through model.state_dict()"
    )


@eager
def _intercept(func, args, kwargs):
    name = _op_name(func)
    if name in _METADATA or name in ("__get__", "__set__", "__delete__"):
        return _plain(func, args, kwargs)
    if name == "data.__set__" and len(args) == 2 and args[1] is args[0]:
        return None  # `p.data = p`: what Module._apply does after a move that changed nothing
    leaves, _ = tree_flatten((args, kwargs))
    refs = [owner_of(t) for t in leaves if _is_guarded(t)]
    if not refs:  # e.g. an arg mixing guarded and plain subclasses: nothing of ours to read
        return _plain(func, args, kwargs)
    mgr, pidx = refs[0]
    if name in _MOVES and _is_guarded(args[0]):
        moved = _move(name, mgr, pidx, args, kwargs)
        if moved is not None:
            return moved
    if name in ("detach", "data.__get__"):  # an alias, no element read: gather when it is used
        return _as_view(_plain(func, args, kwargs), mgr, pidx, mgr.storage_keys({mgr.slot_of[pidx].chunk}))
    if not mgr.reads_allowed():
        raise GeminiParamError(
            f"{_describe(mgr, pidx)} was read ({name or func}) outside a forward or backward pass, while Gemini "
            "holds only a shard of it; read it inside the model's forward, through model.state_dict(), or on every "
            "rank inside core_parallel.gemini.collective_reads(model) (a strategy's collective_reads())"
        )
    ids = tuple(sorted({m.slot_of[i].chunk for m, i in refs if m is mgr}))
    with outside_modes():
        mgr.access(ids)
    try:
        out = _plain(func, args, kwargs)
    finally:
        with outside_modes():
            mgr.done(ids)
    out = _as_view(out, mgr, pidx, mgr.storage_keys(ids))
    if torch.is_grad_enabled():
        _track_backward(mgr, ids, leaves, out)
    return out


def _track_backward(mgr, ids: tuple[int, ...], inputs: list, out) -> None:
    """Gather `ids` before this op's backward (a hook on its outputs' gradients), release after it (a hook on
    its other inputs' gradients). Views of the chunk need nothing: their backward reads no data."""
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad
            and type(t) is not _ChunkView]
    if not outs:
        return
    call = BackwardCall(mgr, ids)
    for t in outs:
        t.register_hook(call.pre)
    for t in inputs:
        # not on leaves: their hooks would stay for every later pass (the chunk is released at the end anyway)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None and not _is_guarded(t):
            t.register_hook(call.post)
