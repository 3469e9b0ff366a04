"""Checkpoint types of `ZeroStrategy` / `GeminiStrategy`, named as Lightning's `FSDPStrategy` names them.

`state_dict_type="sharded"` writes a folder: `core_parallel`'s sharded format (index JSON + safetensors shards,
loadable on any number of ranks) plus `lightning_state.pt` (loops, callbacks, schedulers).
`state_dict_type="full"` (the default, as in Lightning's FSDPStrategy) writes ONE file in Lightning's own format,
`torch.save`'s zip, which
`LitModule.load_from_checkpoint(file)`, `Trainer(ckpt_path=file)` under any strategy (ddp, one process, these
ones) and `torch.load(file, weights_only=True)` read:
```
{"state_dict": {name: tensor},                      full tensors, the model's (working) dtype
 "optimizer_states": [{"state": {i: {...}}, "param_groups": [...]}, ...],   one per optimizer, torch's
                                                    format, numbered as the user's optimizer numbers its
                                                    parameters (as ddp saves)
 "epoch", "global_step", "loops", "callbacks", "lr_schedulers", ...}   Lightning's own state, unchanged
```
The file is written by rank 0 alone, tensor by tensor: every rank first writes its shard into a temporary
sharded folder beside the target (the same collective save as "sharded"), then rank 0 pickles the dict with
placeholders and streams each tensor's bytes from that folder into the zip (`_stream_save`); at most one tensor
is in memory beyond what training holds. The file replaces the target in one rename (`atomic_write`); the
temporary folder is removed. Optimizer states for the parameters' masters are fp32; under `*-true` precisions
the weights in `state_dict` are in the model's dtype, and a resume from a full file takes the fp32 masters
from them (the sharded type keeps the fp32 masters themselves).

`load_sharded_checkpoint(folder)` reads a sharded folder in one plain process into that same dict (full
tensors in memory); `convert_sharded_checkpoint(folder, out)` writes it as the one file, streaming.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core_parallel.checkpoint_format import dtype_from, tensor_names
from ..utils.errors import InputError
from ..utils.fileio import atomic_write

__all__ = [
    "LIGHTNING_STATE",
    "STATE_DICT_TYPES",
    "check_state_dict_type",
    "convert_sharded_checkpoint",
    "is_sharded_checkpoint",
    "load_sharded_checkpoint",
]

LIGHTNING_STATE = "lightning_state.pt"
"""File in a sharded checkpoint folder holding Lightning's own state (loops, callbacks, LR schedulers)."""
STATE_DICT_TYPES = ("sharded", "full")
"""The values of the strategies' `state_dict_type` (Lightning's `FSDPStrategy` takes the same two)."""


def check_state_dict_type(value: Any) -> str:
    """`value` if it is one of `STATE_DICT_TYPES`, else one-line `InputError`."""
    if value not in STATE_DICT_TYPES:
        raise InputError(f"state_dict_type must be 'sharded' or 'full', got {value!r}")
    return value


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True for a folder written with `state_dict_type="sharded"`."""
    return Path(path).is_dir() and (Path(path) / LIGHTNING_STATE).is_file()


def load_lightning_state(path: str | os.PathLike) -> dict[str, Any]:
    """The `lightning_state.pt` of a sharded folder (read with `weights_only=True`)."""
    from lightning.fabric.utilities.data import AttributeDict

    with torch.serialization.safe_globals([AttributeDict]):
        return torch.load(path, map_location="cpu", weights_only=True)


# ------------------------------------------------------------------------------------ the Lightning dict
class _Pending:
    """A tensor of the checkpoint not read yet: `load()` returns it (contiguous, on the CPU)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, load: Callable[[], torch.Tensor]) -> None:
        self.shape, self.dtype, self._load = tuple(shape), dtype, load

    def load(self) -> torch.Tensor:
        t = self._load().to(self.dtype).reshape(self.shape).contiguous()
        if t.untyped_storage().nbytes() != t.nbytes or t.storage_offset():
            t = t.clone()
        return t


def _optimizer_state(reader: Any, saved: list[dict[str, Any]], param_groups: list[dict[str, Any]] | None
                     ) -> dict[str, Any]:
    """torch's optimizer `state_dict()` of one optimizer of the checkpoint (its `saved` groups), numbered in the
    saved groups' order (the user's optimizer's order: ZeRO and Gemini list each group's parameters as the user's
    optimizer holds them)."""
    hyper = param_groups if param_groups is not None else [{k: v for k, v in g.items() if k != "params"}
                                                          for g in saved]
    state: dict[int, dict[str, Any]] = {}
    groups, i = [], 0
    for g, h in zip(saved, hyper):
        ids = []
        for name in g["params"]:
            if name in reader.index["params"]:
                entry: dict[str, Any] = dict(reader.scalars(name))
                shape = tuple(reader.index["params"][name]["shape"])
                for key in reader.tensor_keys(name):
                    if key != "master":
                        entry[key] = _Pending(shape, torch.float32, lambda n=name, k=key: reader.full(n, k))
                if entry:
                    state[i] = entry
            ids.append(i)
            i += 1
        groups.append({**h, "params": ids})
    return {"state": state, "param_groups": groups}


def group_counts(reader: Any) -> list[int]:
    """How many of the saved param groups belong to each optimizer (`core_parallel.api.OptimizerSet` records it)."""
    counts = (reader.index.get("info") or {}).get("optimizers")
    return [int(n) for n in counts] if counts else [len(reader.param_groups)]


def lightning_checkpoint(reader: Any, state: dict[str, Any], param_groups: list[list[dict]] | None = None
                         ) -> dict[str, Any]:
    """Lightning's checkpoint dict of a sharded folder: `state` (Lightning's own) plus "state_dict" and, unless
    the save was weights-only (no "lr_schedulers"), "optimizer_states" (one per optimizer), their tensors `_Pending`.

    `param_groups` (per optimizer, the live optimizer's hyperparameters without "params") replace the index's JSON
    copies.
    """
    ckpt = {k: v for k, v in state.items() if k not in ("state_dict", "optimizer_states")}
    sd: dict[str, Any] = {}
    for name, meta in reader.index["params"].items():
        sd[name] = _Pending(tuple(meta["shape"]), dtype_from(meta["dtype"]), lambda n=name: reader.full(n))
    for name in reader.index.get("model_keys", []):
        sd[name] = _model_tensor(reader, name)
    for alias, canonical in reader.index.get("aliases", {}).items():
        if canonical in sd:
            sd[alias] = sd[canonical]
    ckpt["state_dict"] = sd
    if "lr_schedulers" in state and reader.param_groups:
        ckpt["optimizer_states"], start = [], 0
        for k, n in enumerate(group_counts(reader)):
            hyper = None if param_groups is None else param_groups[k]
            ckpt["optimizer_states"].append(_optimizer_state(reader, reader.param_groups[start:start + n], hyper))
            start += n
    return ckpt


def _model_tensor(reader: Any, name: str) -> _Pending:
    from safetensors import safe_open

    with safe_open(str(reader.path / reader.index["model_file"]), framework="pt") as f:
        meta = f.get_slice(name)
        shape, dtype = tuple(meta.get_shape()), _SAFETENSORS_DTYPES[meta.get_dtype()]
    return _Pending(shape, dtype, lambda: reader.model_tensor(name))


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _materialize(obj: Any) -> Any:
    if isinstance(obj, _Pending):
        return obj.load()
    if isinstance(obj, dict):
        done: dict[int, torch.Tensor] = {}
        out = {}
        for k, v in obj.items():
            if isinstance(v, _Pending):  # aliases share one tensor, as in the model
                out[k] = done.setdefault(id(v), v.load())
            else:
                out[k] = _materialize(v)
        return out
    if isinstance(obj, list):
        return [_materialize(v) for v in obj]
    return obj


# ------------------------------------------------------------------------------- streaming torch.save
class _StorageRef:
    def __init__(self, pending: _Pending) -> None:
        self.pending = pending


def _rebuild_args(p: _Pending) -> tuple:
    stride, acc = [], 1
    for d in reversed(p.shape):
        stride.insert(0, acc)
        acc *= max(d, 1)
    return (_StorageRef(p), 0, torch.Size(p.shape), tuple(stride), False, OrderedDict())


def _stream_save(obj: Any, f: Any) -> None:
    """`torch.save(obj, f)` where `obj` holds `_Pending` tensors: each is pickled as torch pickles a contiguous
    CPU tensor and its bytes are read and written after the pickle, one at a time (`torch.load` cannot tell)."""
    storages: list[Any] = []  # (key, _Pending) or (key, real UntypedStorage)
    keys: dict[tuple[str, int], str] = {}  # placeholders by id (obj keeps them alive), storages by C pointer
    storage_types = torch.storage._dtype_to_storage_type_map()

    class Pickler(pickle.Pickler):
        def reducer_override(self, o: Any) -> Any:
            if isinstance(o, _Pending):
                return torch._utils._rebuild_tensor_v2, _rebuild_args(o)
            return NotImplemented

        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, _StorageRef):
                p = o.pending
                key = keys.setdefault(("pending", id(p)), str(len(keys)))
                if key == str(len(storages)):
                    storages.append((key, p))
                numel = 1
                for d in p.shape:
                    numel *= d
                return ("storage", getattr(torch, storage_types[p.dtype]), key, "cpu", numel)
            if isinstance(o, torch.storage.TypedStorage):  # a real tensor of Lightning's state (small)
                key = keys.setdefault(("storage", o._untyped_storage._cdata), str(len(keys)))
                if key == str(len(storages)):
                    storages.append((key, o._untyped_storage.cpu()))
                return ("storage", getattr(torch, o._pickle_storage_type()), key, "cpu", o._size())
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    with torch.serialization._open_zipfile_writer(f) as zf:
        zf.write_record("data.pkl", buf.getvalue(), len(buf.getvalue()))
        zf.write_record(".format_version", "1", 1)
        align = str(torch.serialization._get_storage_alignment())
        zf.write_record(".storage_alignment", align, len(align))
        zf.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, item in storages:
            storage = item.load().untyped_storage() if isinstance(item, _Pending) else item
            zf.write_record(f"data/{key}", storage, storage.nbytes())
            del storage


# ---------------------------------------------------------------------------------------- public calls
def write_full_checkpoint(folder: str | os.PathLike, out: str | os.PathLike, state: dict[str, Any] | None = None,
                          param_groups: list[list[dict]] | None = None) -> Path:
    """Write the sharded `folder` as one Lightning checkpoint file `out`, streaming, atomically.

    `state`: Lightning's own state (default: the folder's `lightning_state.pt`); `param_groups`: see
    `lightning_checkpoint`."""
    from ..core_parallel.checkpoint import CheckpointReader

    reader = CheckpointReader(folder)
    reader.verify()
    if state is None:
        state = load_lightning_state(Path(folder) / LIGHTNING_STATE)
    ckpt = lightning_checkpoint(reader, state, param_groups)
    out = Path(out)
    with atomic_write(out, "wb") as f:
        _stream_save(ckpt, f)
    return out


def convert_sharded_checkpoint(folder: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write a sharded checkpoint folder (`state_dict_type="sharded"`) as the one file `state_dict_type="full"`
    writes (Lightning's format), tensor by tensor; one plain process, no process group. Returns `out`."""
    _check_folder(folder)
    return write_full_checkpoint(folder, out)


def load_sharded_checkpoint(folder: str | os.PathLike) -> dict[str, Any]:
    """A sharded checkpoint folder, saved on any number of ranks, as Lightning's checkpoint dict in one plain
    process: full "state_dict" (the model's dtype), "optimizer_states" in torch's format, and Lightning's state.

    `module.load_state_dict(ckpt["state_dict"])`, or `torch.save(ckpt, "x.ckpt")` for a file any strategy resumes
    (`convert_sharded_checkpoint` writes that file without holding the model in memory)."""
    from ..core_parallel.checkpoint import CheckpointReader

    _check_folder(folder)
    reader = CheckpointReader(folder)
    reader.verify()
    return _materialize(lightning_checkpoint(reader, load_lightning_state(Path(folder) / LIGHTNING_STATE)))


def _check_folder(folder: str | os.PathLike) -> None:
    if not is_sharded_checkpoint(folder):
        raise InputError(f"{folder}: not a sharded checkpoint folder of ZeroStrategy/GeminiStrategy "
                         f"(no {LIGHTNING_STATE})")


# ----------------------------------------------------------------------- loading a full file (strategies)
class FullCheckpointReader:
    """The `core_parallel` reader protocol (what `load_sharded_state` calls) over a full checkpoint dict, so a
    ZeRO or Gemini optimizer takes its own ranges of the full tensors. `names`: the parameter names of each of
    the user's optimizer's param groups, in its order (how torch numbers the optimizer state)."""

    def __init__(self, path: Path, checkpoint: dict[str, Any], names: list[list[str]], index: int = 0) -> None:
        """`index`: which of the checkpoint's "optimizer_states" is this optimizer's."""
        self.path, self._sd = path, checkpoint["state_dict"]
        opt = (checkpoint.get("optimizer_states") or [None] * (index + 1))[index]
        flat = [n for group in names for n in group]
        self._state: dict[str, dict[str, Any]] = {}
        saved_groups = opt["param_groups"] if opt is not None else [{"params": []} for _ in names]
        if len(saved_groups) != len(names) or any(len(s["params"]) != len(n) for s, n in zip(saved_groups, names)):
            raise InputError(f"{path}: the checkpoint's optimizer has {[len(s['params']) for s in saved_groups]} "
                             f"parameters per group, this one {[len(n) for n in names]}")
        if opt is not None:
            for i, entry in opt["state"].items():
                self._state[flat[int(i)]] = entry
        self.param_groups = [{**{k: v for k, v in s.items() if k != "params"}, "params": list(n)}
                             for s, n in zip(saved_groups, names)] if opt is not None else []
        self.loss_scaler: dict[str, Any] = {}
        self._names = [n for n in flat if n in self._sd]

    def param_names(self) -> list[str]:
        return list(self._names)

    def check_param(self, name: str, shape: tuple[int, ...]) -> None:
        from ..core_parallel.checkpoint import CheckpointError

        if name not in self._sd:
            raise CheckpointError(f"{self.path}: checkpoint has no parameter {name!r}")
        if tuple(self._sd[name].shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: parameter {name!r} has shape {tuple(self._sd[name].shape)}, "
                                  f"model has {tuple(shape)}")

    def _tensor_state(self, name: str) -> dict[str, torch.Tensor]:
        shape = self._sd[name].shape
        return {k: v for k, v in self._state.get(name, {}).items()
                if isinstance(v, torch.Tensor) and v.shape == shape and v.dim() > 0}

    def tensor_keys(self, name: str) -> list[str]:
        return ["master", *self._tensor_state(name)]

    def scalars(self, name: str) -> dict[str, Any]:
        tensors = self._tensor_state(name)
        return {k: v for k, v in self._state.get(name, {}).items() if k not in tensors}

    def read(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        t = self._sd[name] if key == "master" else self._state[name][key]
        return t.detach().reshape(-1)[start:end].to(torch.float32)

    def model_tensor(self, name: str) -> torch.Tensor | None:
        return self._sd.get(name)


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of each param group's parameters, in the optimizer's order (record before `core_parallel.setup`,
    which may swap the groups' tensors for master shards)."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def load_full_checkpoint(path: Path, model: torch.nn.Module, optimizer: Any, names: list[list[list[str]]] | None,
                         strict: bool = True) -> dict[str, Any]:
    """Load a full checkpoint file into a set-up model (and its sharded optimizer, or each optimizer of an
    `OptimizerSet`, when fitting; `names`: per optimizer, `optimizer_param_names`); return the checkpoint without
    "state_dict" and with empty "optimizer_states" (both are in the model now)."""
    from lightning.fabric.utilities.data import AttributeDict

    with torch.serialization.safe_globals([AttributeDict]):  # save_hyperparameters' container, as Lightning loads
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    sd = checkpoint.pop("state_dict")
    if optimizer is None or names is None:
        model.load_state_dict(sd, strict=strict)
    else:
        optimizers = list(optimizer) if isinstance(optimizer, Sequence) else [optimizer]
        saved = checkpoint.get("optimizer_states") or []
        if saved and len(saved) != len(optimizers):
            raise InputError(f"{path}: the checkpoint holds the state of {len(saved)} optimizer(s), "
                             f"configure_optimizers returned {len(optimizers)}")
        managed = {n for per in names for group in per for n in group}
        expected = tensor_names(model)
        owner = {id(t): n for n, t in expected.items() if n in managed and t is not None}
        rest = {k: v for k, v in sd.items()
                if k in expected and k not in managed and id(expected[k]) not in owner}
        missing = sorted(set(expected) - set(sd))
        unexpected = sorted(set(sd) - set(expected))
        if strict and (missing or unexpected):
            raise InputError(f"{path}: state_dict does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        model.load_state_dict(rest, strict=False)
        for k, (opt, per) in enumerate(zip(optimizers, names)):
            opt.load_sharded_state(FullCheckpointReader(path, {"state_dict": sd, **checkpoint}, per, k))
    checkpoint["state_dict"] = {}
    checkpoint["optimizer_states"] = []
    return checkpoint
