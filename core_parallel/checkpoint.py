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
 "frozen_omitted": [names],                        saved with frozen=False: frozen parameters left out
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
- `sharded_state(*, frozen=True) -> ShardedState`: this rank's pieces (`ParamShard` per parameter name, names as in
  `model.named_parameters()`), the param groups' hyperparameters with their parameter names, the loss
  scaler's `state_dict()`, and a small JSON `info` dict.
- `load_sharded_state(reader: CheckpointReader)`: read its own ranges, restore the hyperparameters
  (`restore_param_groups`) and loss scaler, and bring the model's parameters up to date.
Parameters not in `ShardedState.params` are saved from `model.state_dict()` by rank 0 alone, after
`sharded_state()` ran on every rank, so the model's state_dict must then return real values for them
without communicating (with `frozen=False`, called only when the save leaves frozen parameters out, it need
not ready those: they are not read); an optional `end_sharded_state()`, called on every rank once the save is done (or
failed), ends that mode. Without an optimizer every rank calls `model.state_dict()` (it may be a collective)
and rank 0 writes it. Loading never calls `model.state_dict()`: the expected names come from
`named_parameters(remove_duplicate=False)` and the persistent buffers.

`save_checkpoint(..., frozen=False)` leaves out the parameters with `requires_grad=False` that the optimizer does
not hold (a fine-tuning run's frozen base, rebuilt from its source before a resume, as Lightning's own
strategies drop them through `on_save_checkpoint`): the index lists their names, and a load keeps the values
the model holds for them, after checking each is frozen in the model too.

`consolidate_checkpoint(path, out)` writes one plain safetensors file that `model.load_state_dict` accepts.
`save_checkpoint(path, model)` without an optimizer writes the same folder with the whole model in
`model.safetensors`.

This module saves, loads and consolidates; the format's names and records are in `checkpoint_format.py`, the
reader and its checks in `checkpoint_reader.py` (both importable from here).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..utils.fileio import atomic_dir, atomic_write, fsync_file
from .checkpoint_format import (
    FORMAT,
    INDEX,
    MODEL_FILE,
    VERSION,
    CheckpointError,
    ParamShard,
    ShardedState,
    dtype_name,
    encode_scalar,
    jsonable,
    sha256_of,
    tensor_names,
)
from .checkpoint_reader import CheckpointReader, restore_param_groups
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


# ------------------------------------------------------------------------------------------- helpers
def _group_of(optimizer: Any) -> dist.ProcessGroup | None:
    return getattr(optimizer, "process_group", None) if optimizer is not None else None


def _src(group: dist.ProcessGroup | None) -> int:
    return dist.get_global_rank(group, 0) if group is not None else 0


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """Tied parameters/buffers: duplicate state_dict name -> first name of the same tensor object."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in tensor_names(model).items():
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
            "dtype": dtype_name(ps.dtype),
            "group": ps.group,
            "state_keys": sorted(ps.tensors),
            "scalars": {k: encode_scalar(v) for k, v in ps.scalars.items()},
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


def _flush_and_hash(path: Path) -> str:
    """fsync a file just written (safetensors does not) and return its sha256."""
    fsync_file(path)
    return sha256_of(path)


def _frozen_names(model: torch.nn.Module) -> set[str]:
    """State-dict names of the parameters with requires_grad=False (a tied one under every name)."""
    return {n for n, t in tensor_names(model).items() if isinstance(t, torch.nn.Parameter) and not t.requires_grad}


def _write_model_file(folder: Path, state_dict: dict[str, Any], skip: set[str], aliases: dict[str, str]
                      ) -> tuple[list[str], str | None]:
    from safetensors.torch import save_file

    tensors = {
        k: v.detach().cpu().contiguous()
        for k, v in state_dict.items()
        if k not in skip and k not in aliases and isinstance(v, torch.Tensor)
    }
    if not tensors:
        return [], None
    save_file(tensors, str(folder / MODEL_FILE), metadata={"format": "pt"})
    return sorted(tensors), _flush_and_hash(folder / MODEL_FILE)


def _build_index(metas: list[dict], state: ShardedState | None, model_keys: list[str], model_sha: str | None,
                 aliases: dict[str, str], extra: dict | None, omitted: set[str]) -> dict[str, Any]:
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
        **({"frozen_omitted": sorted(omitted)} if omitted else {}),
        "param_groups": jsonable(state.param_groups) if state else [],
        "loss_scaler": jsonable(state.loss_scaler) if state else {},
        "info": jsonable(state.info) if state else {"kind": "model"},
        "extra": jsonable(extra or {}),
    }


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any | None = None,
    *,
    extra: dict[str, Any] | None = None,
    frozen: bool = True,
) -> Path:
    """Save `model` (and a sharded `optimizer`, see the module docstring) into folder `path`, atomically.

    Collective: every rank of the optimizer's group (or of the default group) must call it. `extra` is a
    small JSON-able dict stored in the index (step counters, scheduler state, ...). `frozen=False` leaves out
    the frozen parameters the optimizer does not hold (listed in the index; see the module docstring).
    Returns the path.
    """
    path = Path(path)
    try:
        return _save(path, model, optimizer, extra, frozen)
    finally:
        # Gemini: model.state_dict() gathers full values again (sharded_state() switched it to placeholders)
        end = getattr(optimizer, "end_sharded_state", None)
        if end is not None:
            end()


def _save(path: Path, model: torch.nn.Module, optimizer: Any | None, extra: dict[str, Any] | None,
          frozen: bool) -> Path:
    group = _group_of(optimizer)
    world, rank = world_rank(group)
    state = None
    if optimizer is not None:
        state = optimizer.sharded_state() if frozen else optimizer.sharded_state(frozen=False)
    managed = set(state.params) if state else set()
    aliases = _aliases(model)
    omitted = set() if frozen else _frozen_names(model) - managed - set(aliases)
    # Without a sharded optimizer the model's own state_dict() holds everything; a sharded model (Gemini)
    # gathers it collectively, so every rank takes part. With one, rank 0 alone reads what the optimizer
    # does not manage (Gemini's sharded_state() switches its state_dict to local placeholders first).
    model_sd = model.state_dict() if state is None else None
    if rank != 0:
        _save_on_other_rank(path, state, rank, world, group)
        return path
    with atomic_dir(path) as tmp:
        if world > 1:
            dist.broadcast_object_list([str(tmp)], src=_src(group), group=group)

        def write() -> tuple[dict[str, Any], tuple[list[str], str | None]]:
            meta = _write_shard(tmp, state, rank, world)
            sd = model_sd if model_sd is not None else model.state_dict()
            return meta, _write_model_file(tmp, sd, managed | omitted, aliases)

        metas, (model_keys, model_sha) = _write_and_agree(path, write, rank, group, world)
        index = _build_index(metas, state, model_keys, model_sha, aliases, extra, omitted)
        with atomic_write(tmp / INDEX) as f:
            json.dump(index, f, indent=1)
    if world > 1:
        dist.barrier(group=group)
    logger.info("saved checkpoint %s (%d shards%s)", path, world,
                f"; {len(omitted)} frozen parameters left out" if omitted else "")
    return path


def _save_on_other_rank(path: Path, state: ShardedState | None, rank: int, world: int, group) -> None:
    holder: list[Any] = [None]
    dist.broadcast_object_list(holder, src=_src(group), group=group)
    _write_and_agree(path, lambda: (_write_shard(Path(holder[0]), state, rank, world), None), rank, group, world)
    dist.barrier(group=group)


def _write_and_agree(path: Path, write: Callable[[], tuple[dict[str, Any], Any]], rank: int, group, world: int
                     ) -> tuple[list[dict[str, Any]], Any]:
    """Run this rank's part of a save, `write() -> (its shard metadata, anything kept locally)`, and learn how
    every rank fared: when any failed, every rank raises the same error (none is left waiting in a collective
    the failed one never reaches). Returns every rank's shard metadata and this rank's local part."""
    ok, error, meta, local = True, "", None, None
    try:
        meta, local = write()
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        ok, error = False, f"rank {rank}: {exc!r}"
    results = _gather((ok, error, meta), group, world)
    failures = [r[1] for r in results if not r[0]]
    if failures:
        raise RuntimeError(f"saving checkpoint {path} failed: {'; '.join(failures)}")
    return [r[2] for r in results], local


def _gather(obj: Any, group, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


# ---------------------------------------------------------------------------------------------- load
def load_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint saved on any number of ranks into `model` (and a sharded `optimizer`).

    Collective when `optimizer` communicates (ZeRO all-gathers the parameters). Without an optimizer the
    full model is loaded on every rank. Frozen parameters the save left out (`frozen=False`) keep the values
    the model holds; each must be a frozen parameter of `model`. Returns the `extra` dict given at save time.
    """
    reader = CheckpointReader(path)
    reader.verify()  # every rank fails alike before any collective, not only those that read a bad file
    omitted = _check_omitted(reader, model)
    if optimizer is None:
        tensors, covered = reader.state_dict(), set()
    else:
        tensors = reader.model_tensors()
        covered = set(reader.param_names()) | set(reader.index.get("aliases", {}))
    expected = set(tensor_names(model))  # not model.state_dict(): under Gemini that gathers every tensor
    unexpected = sorted(set(tensors) - expected)
    if strict and unexpected:
        raise CheckpointError(f"{path}: model has no tensors named {unexpected[:5]}")
    missing = sorted(expected - set(tensors) - covered - omitted)
    if strict and missing:
        raise CheckpointError(f"{path}: checkpoint lacks model tensors {missing[:5]}")
    model.load_state_dict({k: v for k, v in tensors.items() if k in expected}, strict=False)
    if optimizer is not None:
        optimizer.load_sharded_state(reader)
    return reader.extra


def _check_omitted(reader: CheckpointReader, model: torch.nn.Module) -> set[str]:
    """The frozen parameters `reader`'s save left out, after checking none is trained by `model`."""
    omitted = set(reader.frozen_omitted)
    if not omitted:
        return omitted
    tensors = tensor_names(model)
    trained = sorted(n for n in omitted if isinstance(tensors.get(n), torch.nn.Parameter) and tensors[n].requires_grad)
    if trained:
        raise CheckpointError(f"{reader.path}: the checkpoint left out frozen parameter {trained[0]!r} (saved with "
                              f"frozen=False), which this model trains: its saved value does not exist")
    logger.info("%s: %d frozen parameters were not saved; they keep the values the model holds", reader.path,
                len(omitted))
    return omitted


def consolidate_checkpoint(path: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "working") -> Path:
    """Write the checkpoint in `path` as one plain safetensors state_dict file `out` (atomically).

    `dtype="working"` casts the fp32 masters to the model's dtype; `"float32"` keeps them in fp32.
    `model.load_state_dict(safetensors.torch.load_file(out))` then works without this library.
    """
    from safetensors.torch import save

    reader = CheckpointReader(path)
    if reader.frozen_omitted:
        raise CheckpointError(f"{reader.path}: the checkpoint left out {len(reader.frozen_omitted)} frozen parameters "
                              f"(saved with frozen=False, e.g. {reader.frozen_omitted[0]!r}); a consolidated file "
                              f"would lack them: load it into the model (load_checkpoint) and save that instead")
    sd = reader.state_dict(dtype)
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
