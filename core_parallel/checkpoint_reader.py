"""Reading a sharded checkpoint: `CheckpointReader` checks the index and each file it reads (a checkpoint is
untrusted input, see `core_parallel.checkpoint`) and reads any flat range of any saved tensor, on any number of
ranks; `restore_param_groups` puts the saved hyperparameters back into an optimizer."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import torch

from ..utils.errors import InputError
from ..utils.fileio import stale_copies
from . import flat
from .checkpoint_format import (
    FORMAT,
    INDEX,
    READ_VERSIONS,
    CheckpointError,
    decode_scalar,
    dtype_from,
    sha256_of,
)

__all__ = ["CheckpointReader", "restore_param_groups"]

logger = logging.getLogger(__name__)


def _numel(shape: list[int] | tuple[int, ...]) -> int:
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
    once); see `core_parallel.checkpoint`. Any problem raises `CheckpointError`.
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
                dtype_from(meta.get("dtype", ""))
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
        omitted = ix.get("frozen_omitted", [])
        if not isinstance(omitted, list) or not all(isinstance(n, str) for n in omitted):
            raise self._bad("field 'frozen_omitted' must be a list of names")
        clash = sorted(set(omitted) & (set(numels) | set(ix.get("model_keys") or [])))
        if clash:
            raise self._bad(f"'frozen_omitted' names {clash[0]!r}, which the checkpoint also holds")

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
            if sha256_of(path) != self._checksums[fname]:
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
        return {k: decode_scalar(v) for k, v in self.index["params"][name].get("scalars", {}).items()}

    def read(self, name: str, key: str, start: int, end: int) -> torch.Tensor:
        """Flat elements `[start, end)` of `key` of parameter `name`, from the shards that overlap: [end - start]."""
        numel = _numel(self.index["params"][name]["shape"])
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
        return self.read(name, key, 0, _numel(shape)).view(shape)

    @property
    def frozen_omitted(self) -> list[str]:
        """Frozen parameters the save left out (`save_checkpoint(frozen=False)`): a load keeps the model's own."""
        return list(self.index.get("frozen_omitted", []))

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

    def model_tensor(self, name: str) -> torch.Tensor | None:
        """One tensor of the model file (`model_tensors` reads them all), or None when the file lacks it."""
        if name not in self.index.get("model_keys", []) or not self.index.get("model_file"):
            return None
        from safetensors import SafetensorError, safe_open

        path = self._file(self.index["model_file"])
        try:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name) if name in f.keys() else None
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: not a valid safetensors file ({exc})") from None

    def state_dict(self, dtype: str = "working") -> dict[str, torch.Tensor]:
        """A plain model state_dict: masters cast to the working dtype (or float32), model tensors, aliases."""
        if dtype not in ("working", "float32"):
            raise InputError(f"dtype must be 'working' or 'float32', got {dtype!r}")
        sd = self.model_tensors()
        for name, meta in self.index["params"].items():
            target = dtype_from(meta["dtype"]) if dtype == "working" else torch.float32
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
