"""Sharded, world-size-independent checkpoints shared by ZeRO and Gemini.

On-disk format (version 2): one folder
```
PATH/
  index.json                              written last, by rank 0
  shard-00000-of-00002.safetensors        one per saving rank, written in parallel
  shard-00001-of-00002.safetensors
  model.safetensors                       rank 0: model tensors the optimizer does not manage (buffers,
                                          frozen parameters), full size; absent when there are none
```
Each shard holds, for every parameter the rank owns a non-empty piece of, 1-D tensors named
`"{key}/{param_name}"`: `key` is `master` (the fp32 master values) or an optimizer-state name (`exp_avg`,
`exp_avg_sq`, `momentum_buffer`, ...). Each is the flat range `[start, end)` of the parameter (row-major
flattening of its global shape) recorded in the index. `index.json`:
```
{"format": "core_parallel.sharded", "version": 2, "world_size": N,
 "params": {name: {"shape": [...], "dtype": "float16", "group": 0, "state_keys": ["master", "exp_avg", ...],
                   "scalars": {"step": {"tensor": 5.0, "dtype": "float32"}, "other": {"value": 1}}}},
 "shards": {"shard-00000-of-00002.safetensors": {name: [start, end], ...}, ...},
 "model_file": "model.safetensors" | null, "model_keys": [...],
 "checksums": {"shard-00000-of-00002.safetensors": "<sha256 hex>", ..., "model.safetensors": "..."},
 "aliases": {"tied.name": "canonical.name"},        tied parameters, stored once
 "param_groups": [{"lr": 0.001, ..., "params": [names]}],
 "loss_scaler": {...}, "info": {"kind": "zero", "stage": 2, ...}, "extra": {...user JSON...}}
```
The ranges of one parameter across shards are disjoint and cover `[0, numel)`. Any number of ranks can load:
each reads only the slices that overlap its own ranges (`CheckpointReader.read`).

A checkpoint is untrusted input. The reader checks the index before reading any tensor: file names are plain
names inside the folder (no separators, no `..`, regular files, not links), the ranges of every parameter
tile `[0, numel)` exactly, each shard holds every tensor the index promises with the promised size, and each
file's sha256 (version 2) matches; a bad checkpoint raises `CheckpointError`, one line naming the file and the
problem. Version 1 (no checksums) still loads, unverified, with a warning. The index itself has no checksum:
a damaged one fails these checks or JSON parsing, except in the values of hyperparameters and `extra`.

Saving is atomic: rank 0 creates a temporary folder beside PATH and broadcasts its name, every rank writes
its shard there and flushes it to disk, the ranks agree that all succeeded, rank 0 writes `index.json` and
swaps the folder into place (`utils.fileio.atomic_dir`), then all ranks pass a barrier. A crash at any
point leaves a complete checkpoint at PATH (the previous one, or, where the file system has no atomic
exchange and the crash came between two renames, a complete `.PATH.old-*` beside it, which the reader uses
when PATH is missing). All ranks must see the same file system.

Protocol a sharded optimizer implements (ZeRO here, Gemini in `core_parallel.gemini`):
- `process_group` attribute (None: the default group, or one process).
- `sharded_state() -> ShardedState`: this rank's pieces (`ParamShard` per parameter name, names as in
  `model.named_parameters()`), the param groups' hyperparameters with their parameter names, the loss
  scaler's `state_dict()`, and a small JSON `info` dict.
- `load_sharded_state(reader: CheckpointReader)`: read its own ranges, restore the hyperparameters
  (`restore_param_groups`) and loss scaler, and bring the model's parameters up to date.
Parameters not in `ShardedState.params` are saved from `model.state_dict()` by rank 0 alone, after
`sharded_state()` ran on every rank, so the model's state_dict must then return real values for them
without communicating. Without an optimizer every rank calls `model.state_dict()` (it may be a collective)
and rank 0 writes it. Loading never calls `model.state_dict()`: the expected names come from
`named_parameters(remove_duplicate=False)` and the persistent buffers.

`consolidate_checkpoint(path, out)` writes one plain safetensors file that `model.load_state_dict` accepts.
`save_checkpoint(path, model)` without an optimizer writes the same folder with the whole model in
`model.safetensors`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..utils.errors import InputError
from ..utils.fileio import atomic_dir, atomic_write, fsync_file, stale_copies
from . import flat
from .groups import world_rank

__all__ = [
    "CheckpointError",
    "FORMAT",
    "INDEX",
    "VERSION",
    "CheckpointReader",
    "ParamShard",
    "ShardedState",
    "consolidate_checkpoint",
    "load_checkpoint",
    "restore_param_groups",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

FORMAT = "core_parallel.sharded"
VERSION = 2
"""Version 2 added `checksums`; version 1 checkpoints still load (without verification)."""
READ_VERSIONS = (1, 2)
INDEX = "index.json"
MODEL_FILE = "model.safetensors"


class CheckpointError(InputError):
    """A checkpoint folder that is damaged, forged, inconsistent or made for another model; the message names the
    file and the problem. An `InputError` (so a `ValueError`): the `suite` command line exits 2 on it."""


@dataclass(kw_only=True)
class ParamShard:
    """The piece of one parameter a rank holds."""

    shape: tuple[int, ...]
    """Global shape of the parameter."""
    dtype: torch.dtype
    """Working (model) dtype; consolidation casts the master values to it."""
    start: int
    """First flat element held (row-major flattening of `shape`)."""
    end: int
    """One past the last flat element held; `start == end` for none."""
    tensors: dict[str, torch.Tensor]
    """`master` and per-element optimizer state, each 1-D with `end - start` elements."""
    scalars: dict[str, Any] = field(default_factory=dict)
    """Per-parameter scalar optimizer state (0-dim tensors or Python numbers), e.g. Adam's `step`."""
    group: int = 0
    """Index of the param group holding the parameter."""


@dataclass(kw_only=True)
class ShardedState:
    """What one rank contributes to a checkpoint."""

    params: dict[str, ParamShard]
    """Managed parameters by name (as in `model.named_parameters()`)."""
    param_groups: list[dict[str, Any]]
    """Hyperparameters of each group, with "params": the list of parameter names in the group."""
    loss_scaler: dict[str, Any]
    """The loss scaler's `state_dict()`."""
    info: dict[str, Any] = field(default_factory=dict)
    """Small JSON description: kind, stage, precision, optimizer class."""


# ------------------------------------------------------------------------------------------- helpers
def _group_of(optimizer: Any) -> dist.ProcessGroup | None:
    return getattr(optimizer, "process_group", None) if optimizer is not None else None


def _src(group: dist.ProcessGroup | None) -> int:
    return dist.get_global_rank(group, 0) if group is not None else 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint index")
    return dtype


def _encode_scalar(value: Any) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"optimizer state tensor of shape {tuple(value.shape)} is not per-element or scalar")
        return {"tensor": value.item(), "dtype": _dtype_name(value.dtype), "shape": list(value.shape)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ValueError(f"optimizer state value of type {type(value).__name__} cannot be checkpointed")


def _decode_scalar(entry: dict[str, Any]) -> Any:
    if "tensor" in entry:
        return torch.tensor(entry["tensor"], dtype=_dtype_from(entry["dtype"])).reshape(entry.get("shape", []))
    return entry["value"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _tensor_names(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The names `model.state_dict()` would hold, with their tensors, without calling it.

    Parameters (a tied one under every name) and persistent buffers; `_extra_state` entries map to None.
    Sharded wrappers (Gemini) make `state_dict()` gather full tensors, a collective: this needs none.
    """
    out: dict[str, torch.Tensor | None] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for name, p in module._parameters.items():
            if p is not None:
                out[pre + name] = p
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                out[pre + name] = b
        if type(module).get_extra_state is not torch.nn.Module.get_extra_state:
            out[pre + "_extra_state"] = None
    return out


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """Tied parameters/buffers: duplicate state_dict name -> first name of the same tensor object."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in _tensor_names(model).items():
        if t is None:
            continue
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
    return aliases


# ---------------------------------------------------------------------------------------------- save
def _write_shard(folder: Path, state: ShardedState | None, rank: int, world: int) -> dict[str, Any]:
    from safetensors.torch import save_file

    fname = f"shard-{rank:05d}-of-{world:05d}.safetensors"
    meta: dict[str, Any] = {"file": fname, "ranges": {}, "params": {}}
    if state is None:
        meta["file"] = None  # model only: no shard (version 1 listed one that was never written)
        return meta
    tensors = {}
    for name, ps in state.params.items():
        meta["params"][name] = {
            "shape": list(ps.shape),
            "dtype": _dtype_name(ps.dtype),
            "group": ps.group,
            "state_keys": sorted(ps.tensors),
            "scalars": {k: _encode_scalar(v) for k, v in ps.scalars.items()},
        }
        if ps.end <= ps.start:
            continue
        for key, t in ps.tensors.items():
            if t.numel() != ps.end - ps.start:
                raise ValueError(f"{key}/{name}: {t.numel()} elements for range [{ps.start}, {ps.end})")
            tensors[f"{key}/{name}"] = t.detach().reshape(-1).cpu().contiguous()
        meta["ranges"][name] = [ps.start, ps.end]
    if tensors:
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        meta["sha256"] = _flush_and_hash(folder / fname)
    else:
        meta["file"] = None
    return meta


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _flush_and_hash(path: Path) -> str:
    """fsync a file just written (safetensors does not) and return its sha256."""
    fsync_file(path)
    return _sha256(path)


def _write_model_file(folder: Path, state_dict: dict[str, Any], managed: set[str], aliases: dict[str, str]
                      ) -> tuple[list[str], str | None]:
    from safetensors.torch import save_file

    tensors = {
        k: v.detach().cpu().contiguous()
        for k, v in state_dict.items()
        if k not in managed and k not in aliases and isinstance(v, torch.Tensor)
    }
    if not tensors:
        return [], None
    save_file(tensors, str(folder / MODEL_FILE), metadata={"format": "pt"})
    return sorted(tensors), _flush_and_hash(folder / MODEL_FILE)


def _build_index(metas: list[dict], state: ShardedState | None, model_keys: list[str], model_sha: str | None,
                 aliases: dict[str, str], extra: dict | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    shards: dict[str, dict] = {}
    checksums: dict[str, str] = {}
    for meta in metas:
        for name, pmeta in meta["params"].items():
            params.setdefault(name, pmeta)
        if meta["file"] is not None:
            shards[meta["file"]] = meta["ranges"]
            checksums[meta["file"]] = meta["sha256"]
    if model_sha is not None:
        checksums[MODEL_FILE] = model_sha
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": len(metas),
        "params": params,
        "shards": shards,
        "model_file": MODEL_FILE if model_keys else None,
        "model_keys": model_keys,
        "checksums": checksums,
        "aliases": aliases,
        "param_groups": _jsonable(state.param_groups) if state else [],
        "loss_scaler": _jsonable(state.loss_scaler) if state else {},
        "info": _jsonable(state.info) if state else {"kind": "model"},
        "extra": _jsonable(extra or {}),
    }


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Save `model` (and a sharded `optimizer`, see the module docstring) into folder `path`, atomically.

    Collective: every rank of the optimizer's group (or of the default group) must call it. `extra` is a
    small JSON-able dict stored in the index (step counters, scheduler state, ...). Returns the path.
    """
    path = Path(path)
    group = _group_of(optimizer)
    world, rank = world_rank(group)
    state = optimizer.sharded_state() if optimizer is not None else None
    managed = set(state.params) if state else set()
    # Without a sharded optimizer the model's own state_dict() holds everything; a sharded model (Gemini)
    # gathers it collectively, so every rank takes part. With one, rank 0 alone reads what the optimizer
    # does not manage (Gemini's sharded_state() switches its state_dict to local placeholders first).
    model_sd = model.state_dict() if state is None else None
    if rank != 0:
        _save_on_other_rank(path, state, rank, world, group)
        return path
    aliases = _aliases(model)
    with atomic_dir(path) as tmp:
        if world > 1:
            dist.broadcast_object_list([str(tmp)], src=_src(group), group=group)
        ok, error, meta, model_keys, model_sha = True, "", None, [], None
        try:
            meta = _write_shard(tmp, state, rank, world)
            model_keys, model_sha = _write_model_file(
                tmp, model_sd if model_sd is not None else model.state_dict(), managed, aliases)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            ok, error = False, f"rank 0: {exc!r}"
        results = _gather((ok, error, meta), group, world)
        failures = [r[1] for r in results if not r[0]]
        if failures:
            raise RuntimeError(f"saving checkpoint {path} failed: {'; '.join(failures)}")
        index = _build_index([r[2] for r in results], state, model_keys, model_sha, aliases, extra)
        with atomic_write(tmp / INDEX) as f:
            json.dump(index, f, indent=1)
    if world > 1:
        dist.barrier(group=group)
    logger.info("saved checkpoint %s (%d shards)", path, world)
    return path


def _save_on_other_rank(path: Path, state: ShardedState | None, rank: int, world: int, group) -> None:
    holder: list[Any] = [None]
    dist.broadcast_object_list(holder, src=_src(group), group=group)
    ok, error, meta = True, "", None
    try:
        meta = _write_shard(Path(holder[0]), state, rank, world)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        ok, error = False, f"rank {rank}: {exc!r}"
    results = _gather((ok, error, meta), group, world)
    failures = [r[1] for r in results if not r[0]]
    if failures:
        raise RuntimeError(f"saving checkpoint {path} failed: {'; '.join(failures)}")
    dist.barrier(group=group)


def _gather(obj: Any, group, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


# ---------------------------------------------------------------------------------------------- load
def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _plain_name(name: Any) -> bool:
    """A file name that can only mean a file directly inside the checkpoint folder."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and not os.path.isabs(name))


def _resolve(path: Path) -> Path:
    """`path`, or when no folder is there the complete old copy an interrupted swap left beside it."""
    if path.exists():
        return path
    for old in stale_copies(path):
        if (old / INDEX).is_file():
            logger.warning("checkpoint %s is missing; a save was interrupted while replacing it: loading the "
                           "complete previous copy %s", path, old)
            return old
    return path


class CheckpointReader:
    """Reads a checkpoint folder: the index, and any flat range of any saved tensor.

    The index is checked when the reader is made and each file when first read (`verify` checks them all at
    once); see the module docstring. Any problem raises `CheckpointError`.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = _resolve(Path(path))
        index_file = self.path / INDEX
        if not index_file.is_file():
            raise FileNotFoundError(f"{self.path}: not a checkpoint folder (no {INDEX})")
        self._index_file = index_file
        try:
            self.index: dict[str, Any] = json.loads(index_file.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{index_file}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{index_file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        if not isinstance(self.index, dict):
            raise CheckpointError(f"{index_file}: expected a JSON object, got {type(self.index).__name__}")
        if self.index.get("format") != FORMAT:
            raise CheckpointError(
                f"{index_file}: field 'format' is {self.index.get('format')!r}, expected {FORMAT!r}")
        if self.index.get("version") not in READ_VERSIONS:
            raise CheckpointError(f"{index_file}: field 'version' is {self.index.get('version')!r}, expected one "
                                  f"of {list(READ_VERSIONS)}")
        self._ranges: dict[str, list[tuple[str, int, int]]] = {}
        self._check_index()
        self._checksums: dict[str, str] | None = self.index.get("checksums")
        if self._checksums is None:
            logger.warning("checkpoint %s (format version %s) has no checksums: loading it without verification",
                           self.path, self.index["version"])
        self._verified: set[str] = set()
        self._handles: dict[str, Any] = {}

    # ---- checks ---------------------------------------------------------------------------------------
    def _bad(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self._index_file}: {problem}")

    def _check_index(self) -> None:
        """Structure, file names and range tiling of the index; fills `self._ranges`."""
        ix = self.index
        for key, kind in (("params", dict), ("shards", dict), ("param_groups", list), ("loss_scaler", dict)):
            if not isinstance(ix.get(key), kind):
                raise self._bad(f"field {key!r} is missing or not a JSON {'object' if kind is dict else 'list'}")
        numels: dict[str, int] = {}
        for name, meta in ix["params"].items():
            shape = meta.get("shape") if isinstance(meta, dict) else None
            if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
                raise self._bad(f"params.{name}: 'shape' must be a list of non-negative integers")
            if not isinstance(meta.get("state_keys"), list) or not all(isinstance(k, str) for k in meta["state_keys"]):
                raise self._bad(f"params.{name}: 'state_keys' must be a list of names")
            try:
                _dtype_from(meta.get("dtype", ""))
            except ValueError:
                raise self._bad(f"params.{name}: unknown dtype {meta.get('dtype')!r}") from None
            numels[name] = _numel(shape)
        for fname, ranges in ix["shards"].items():
            if not _plain_name(fname):
                raise self._bad(f"shard name {fname!r} is not a plain file name inside the checkpoint folder")
            if not isinstance(ranges, dict):
                raise self._bad(f"shards.{fname}: expected an object of ranges")
            for name, rng in ranges.items():
                if name not in numels:
                    raise self._bad(f"shards.{fname}: range for {name!r}, which is not in 'params'")
                if not (isinstance(rng, list) and len(rng) == 2 and all(_is_int(v) for v in rng)):
                    raise self._bad(f"shards.{fname}.{name}: expected [start, end], got {rng!r}")
                self._ranges.setdefault(name, []).append((fname, rng[0], rng[1]))
        for name, numel in numels.items():
            at = 0
            for fname, start, end in sorted(self._ranges.get(name, []), key=lambda r: (r[1], r[2])):
                if not 0 <= start < end <= numel:
                    raise self._bad(f"{fname}: range [{start}, {end}) of {name!r} is empty or outside its "
                                    f"{numel} elements")
                if start != at:
                    what = "overlaps the previous range" if start < at else f"leaves [{at}, {start}) uncovered"
                    raise self._bad(f"{fname}: range [{start}, {end}) of {name!r} {what}")
                at = end
            if at != numel:
                raise self._bad(f"the ranges of {name!r} cover [0, {at}) of its {numel} elements")
        model_file = ix.get("model_file")
        if model_file is not None and not _plain_name(model_file):
            raise self._bad(f"model_file {model_file!r} is not a plain file name inside the checkpoint folder")
        checksums = ix.get("checksums")
        if ix["version"] >= 2:
            if not isinstance(checksums, dict):
                raise self._bad("field 'checksums' is missing or not a JSON object")
            for fname in [*ix["shards"], *([model_file] if model_file else [])]:
                if not isinstance(checksums.get(fname), str):
                    raise self._bad(f"no checksum for {fname}")
        aliases = ix.get("aliases", {})
        if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
            raise self._bad("field 'aliases' must map names to names")

    def _file(self, fname: str) -> Path:
        """The checked path of file `fname` of the checkpoint: a regular file, matching its checksum."""
        path = self.path / fname
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise CheckpointError(f"{path}: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file (a link or special file in a checkpoint)")
        if self._checksums is not None and fname not in self._verified:
            if _sha256(path) != self._checksums[fname]:
                raise CheckpointError(f"{path}: sha256 does not match the index (the file is damaged or altered)")
            self._verified.add(fname)
        return path

    def verify(self) -> None:
        """Check every file of the checkpoint now (checksums, tensors and sizes), not on first read."""
        for fname, ranges in self.index["shards"].items():
            if ranges or self._checksums is not None:  # version 1 listed an unwritten shard for model-only saves
                self._handle(fname)
        if self.index.get("model_file"):
            self._file(self.index["model_file"])

    def _handle(self, fname: str):
        from safetensors import SafetensorError, safe_open

        if fname not in self._handles:
            path = self._file(fname)
            try:
                handle = safe_open(str(path), framework="pt")
                keys = set(handle.keys())
                for name, (start, end) in self.index["shards"][fname].items():
                    for key in self.index["params"][name]["state_keys"]:
                        if f"{key}/{name}" not in keys:
                            raise CheckpointError(f"{path}: tensor {key}/{name} is missing")
                        shape = handle.get_slice(f"{key}/{name}").get_shape()
                        if list(shape) != [end - start]:
                            raise CheckpointError(f"{path}: tensor {key}/{name} has shape {list(shape)}, the index "
                                                  f"says [{end - start}]")
            except SafetensorError as exc:
                raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from None
            self._handles[fname] = handle
        return self._handles[fname]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Saved hyperparameters per group, with "params": names."""
        return self.index["param_groups"]

    @property
    def loss_scaler(self) -> dict[str, Any]:
        """Saved loss scaler state (empty when none)."""
        return self.index["loss_scaler"]

    @property
    def extra(self) -> dict[str, Any]:
        """The `extra` dict given to `save_checkpoint`."""
        return self.index.get("extra", {})

    def param_names(self) -> list[str]:
        """Names of the sharded (optimizer-managed) parameters."""
        return list(self.index["params"])

    def check_param(self, name: str, shape: tuple[int, ...]) -> None:
        """Raise `CheckpointError` unless the checkpoint holds parameter `name` with this shape."""
        meta = self.index["params"].get(name)
        if meta is None:
            raise CheckpointError(f"{self.path}: checkpoint has no parameter {name!r}")
        if tuple(meta["shape"]) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: parameter {name!r} has shape {tuple(meta['shape'])}, model has {shape}")

    def tensor_keys(self, name: str) -> list[str]:
        """Saved per-element keys of parameter `name` ("master", optimizer state names)."""
        return list(self.index["params"][name]["state_keys"])

    def scalars(self, name: str) -> dict[str, Any]:
        """Saved scalar optimizer state of parameter `name` (0-dim tensors restored as tensors)."""
        return {k: _decode_scalar(v) for k, v in self.index["params"][name].get("scalars", {}).items()}

    def read(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        """Flat elements `[start, end)` of `key` of parameter `name`, from the shards that overlap: [end - start]."""
        numel = 1
        for d in self.index["params"][name]["shape"]:
            numel *= d
        if not 0 <= start <= end <= numel:
            raise ValueError(f"range [{start}, {end}) outside parameter {name!r} of {numel} elements")
        out, covered = None, 0
        for fname, s, e in self._ranges.get(name, []):
            hit = flat.intersect((s, e), (start, end))
            if hit is None:
                continue
            piece = self._handle(fname).get_slice(f"{key}/{name}")[hit[0] - s : hit[1] - s]
            if out is None:
                out = torch.empty(end - start, dtype=piece.dtype)
            out[hit[0] - start : hit[1] - start] = piece
            covered += hit[1] - hit[0]
        if covered != end - start:
            raise CheckpointError(f"{self.path}: shards cover {covered} of {end - start} elements of {key}/{name}")
        return out if out is not None else torch.empty(0)

    def full(self, name: str, key: str = "master") -> torch.Tensor:
        """The whole tensor `key` of parameter `name`, in its global shape."""
        shape = tuple(self.index["params"][name]["shape"])
        numel = 1
        for d in shape:
            numel *= d
        return self.read(name, key, 0, numel).view(shape)

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """The full-size tensors rank 0 saved from `model.state_dict()` (buffers, unmanaged parameters)."""
        if not self.index.get("model_file"):
            return {}
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = self._file(self.index["model_file"])
        try:
            return load_file(str(path))
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from None

    def state_dict(self, dtype: str = "working") -> dict[str, torch.Tensor]:
        """A plain model state_dict: masters cast to the working dtype (or float32), model tensors, aliases."""
        if dtype not in ("working", "float32"):
            raise InputError(f"dtype must be 'working' or 'float32', got {dtype!r}")
        sd = self.model_tensors()
        for name, meta in self.index["params"].items():
            target = _dtype_from(meta["dtype"]) if dtype == "working" else torch.float32
            sd[name] = self.full(name).to(target)
        for alias, canonical in self.index.get("aliases", {}).items():
            if canonical in sd:
                sd[alias] = sd[canonical]
        return sd


def restore_param_groups(groups: list[dict], saved: list[dict], names: list[list[str]]) -> None:
    """Copy saved hyperparameters into `groups` (in place), after checking each group holds the same names."""
    if not saved:
        return
    if len(saved) != len(groups):
        raise CheckpointError(f"checkpoint has {len(saved)} param groups, the optimizer has {len(groups)}")
    for gi, (group, old) in enumerate(zip(groups, saved)):
        if list(old.get("params", [])) != list(names[gi]):
            raise CheckpointError(f"param group {gi} holds different parameters than in the checkpoint")
        for key, value in old.items():
            if key == "params" or key not in group:
                continue
            current = group[key]
            if isinstance(current, tuple):
                value = tuple(value)
            elif isinstance(current, torch.Tensor):
                value = torch.tensor(value, dtype=current.dtype, device=current.device)
            group[key] = value


def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint saved on any number of ranks into `model` (and a sharded `optimizer`).

    Collective when `optimizer` communicates (ZeRO all-gathers the parameters). Without an optimizer the
    full model is loaded on every rank. Returns the `extra` dict given at save time.
    """
    reader = CheckpointReader(path)
    reader.verify()  # every rank fails alike before any collective, not only those that read a bad file
    if optimizer is None:
        model.load_state_dict(reader.state_dict(), strict=strict)
        return reader.extra
    tensors = reader.model_tensors()
    expected = set(_tensor_names(model))  # not model.state_dict(): under Gemini that gathers every tensor
    unexpected = sorted(set(tensors) - expected)
    if strict and unexpected:
        raise CheckpointError(f"{path}: model has no tensors named {unexpected[:5]}")
    model.load_state_dict({k: v for k, v in tensors.items() if k in expected}, strict=False)
    covered = set(tensors) | set(reader.param_names()) | set(reader.index.get("aliases", {}))
    missing = sorted(expected - covered)
    if strict and missing:
        raise CheckpointError(f"{path}: checkpoint lacks model tensors {missing[:5]}")
    optimizer.load_sharded_state(reader)
    return reader.extra


def consolidate_checkpoint(path: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "working") -> Path:
    """Write the checkpoint in `path` as one plain safetensors state_dict file `out` (atomically).

    `dtype="working"` casts the fp32 masters to the model's dtype; `"float32"` keeps them in fp32.
    `model.load_state_dict(safetensors.torch.load_file(out))` then works without this library.
    """
    from safetensors.torch import save

    sd = CheckpointReader(path).state_dict(dtype)
    seen: dict[int, str] = {}
    for k, v in list(sd.items()):
        if v.data_ptr() in seen and v.numel():
            sd[k] = v.clone()
        seen[v.data_ptr()] = k
        sd[k] = sd[k].contiguous()
    out = Path(out)
    with atomic_write(out, "wb") as f:
        f.write(save(sd, metadata={"format": "pt"}))
    logger.info("consolidated %s into %s (%d tensors)", path, out, len(sd))
    return out
