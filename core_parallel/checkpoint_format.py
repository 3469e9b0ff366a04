"""The on-disk format of sharded checkpoints (see `core_parallel.checkpoint` for the layout): its names and
version, what a rank contributes (`ParamShard`, `ShardedState`), how dtypes, scalars and JSON values are written,
and the error a bad checkpoint raises. Shared by the writer (`checkpoint.py`) and the reader
(`checkpoint_reader.py`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..utils.errors import InputError

__all__ = ["FORMAT", "INDEX", "MODEL_FILE", "READ_VERSIONS", "VERSION", "CheckpointError", "ParamShard",
           "ShardedState", "decode_scalar", "dtype_from", "dtype_name", "encode_scalar", "jsonable", "sha256_of",
           "tensor_names"]

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


def dtype_name(dtype: torch.dtype) -> str:
    """The index's name of a dtype ("float16")."""
    return str(dtype).removeprefix("torch.")


def dtype_from(name: str) -> torch.dtype:
    """The dtype an index names; `CheckpointError` for a name torch does not know."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint index")
    return dtype


def encode_scalar(value: Any) -> dict[str, Any]:
    """A scalar optimizer state (0-dim or one-element tensor, or a JSON value) as its index entry."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"optimizer state tensor of shape {tuple(value.shape)} is not per-element or scalar")
        return {"tensor": value.item(), "dtype": dtype_name(value.dtype), "shape": list(value.shape)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise ValueError(f"optimizer state value of type {type(value).__name__} cannot be checkpointed")


def decode_scalar(entry: dict[str, Any]) -> Any:
    """The value an `encode_scalar` entry holds (tensors come back as tensors of their dtype and shape)."""
    if "tensor" in entry:
        return torch.tensor(entry["tensor"], dtype=dtype_from(entry["dtype"])).reshape(entry.get("shape", []))
    return entry["value"]


def jsonable(value: Any) -> Any:
    """`value` as JSON can hold it: tensors as numbers or lists, other objects as their repr."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def tensor_names(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
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


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()
