"""Parameters that are loaded straight into Gemini's shards: a model built without its weights, each parameter
reading its value from a tensor source when its chunk is filled.

Colossal-AI's lazy init builds the model's tensors lazily and materialises them one shard at a time; here the
parameters are *hollow* (right shape and dtype, no memory) and name where their value comes from, so a
pretrained model never exists whole in memory:

```python
with torch.device("meta"):
    model = Model(config)
hollow_parameters(model, SafetensorsSource(["model.safetensors"]))   # no weights in memory yet
model, optimizer = setup_gemini(model, torch.optim.AdamW(model.parameters()), config)   # read tensor by tensor
```

`setup_gemini` fills each chunk's master shard from the source (on several ranks each rank reads only the rows
its shard covers), then drops what it read. A hollow parameter must not be used before that; `fill_hollow`
gives the parameters their values in ordinary memory instead, for code paths without Gemini.

`SafetensorsSource` reads the safetensors format with `pread` (no mapping of the file, so its pages never
count towards the process's resident set) with readahead off (`POSIX_FADV_RANDOM`: the load reads tensors in the
model's order, not the file's, and pages read ahead past a tensor would stay), asks the kernel to drop the file's
pages it read from the page cache once copied, and drops the whole file when closed (the pages a tensor shares
with its neighbours): a container's memory limit charges page cache to the reader. `setup_gemini` closes the
sources it filled from.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import torch

__all__ = ["SAFETENSORS_DTYPES", "SafetensorsSource", "TensorSource", "cast_parameters", "clear_source",
           "close_sources", "fill_hollow", "hollow_parameters", "is_hollow", "read_safetensors_header", "source_of",
           "take_value"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ATTR = "gemini_source"


class TensorSource(Protocol):
    """Where hollow parameters read their values: one tensor (or a flat range of it) at a time."""

    def keys(self) -> Iterable[str]:
        """The names of the tensors it holds."""
        ...

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor `key`."""
        ...

    def read(self, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) of tensor `key` flattened (all of it by default), as a new [hi - lo] CPU tensor in
        the file's dtype."""
        ...


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(header, byte offset of the data) of a safetensors file; `ValueError` naming the file when malformed.

    Read with readahead off: a buffered read would leave readahead marks on the pages after the header, and the
    first whole-tensor read that meets them would read ahead into the tensors after it."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        _advise(fd, getattr(os, "POSIX_FADV_RANDOM", 1))
        raw = _pread_all(fd, 8, 0)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20 or n > os.fstat(fd).st_size - 8:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(_pread_all(fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a safetensors file (header is not JSON: {exc})") from exc
    finally:
        os.close(fd)
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not an object)")
    return header, 8 + n


class SafetensorsSource:
    """The tensors of one or more safetensors files (a sharded checkpoint's shards), read with `pread`.

    `drop_cache` (default True): readahead off for the file (`POSIX_FADV_RANDOM`: only the bytes asked for are
    read), after each read advise the kernel to drop the file's pages just read from the page cache (they were
    copied; a memory cgroup would otherwise charge them to this process), and on `close()` drop the whole file
    (pages shared by two tensors, or read by someone else). A read after `close()` opens the file again.
    """

    def __init__(self, files: Sequence[str | os.PathLike], *, drop_cache: bool = True) -> None:
        self.files = [Path(f) for f in files]
        self.drop_cache = drop_cache
        self._where: dict[str, tuple[int, str, tuple[int, ...], int]] = {}  # key -> (file, dtype, shape, start)
        self._fds: dict[int, int] = {}
        for i, path in enumerate(self.files):
            header, data = read_safetensors_header(path)
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                dtype = info.get("dtype")
                if dtype not in SAFETENSORS_DTYPES:
                    raise ValueError(f"{path}: tensor {key} has dtype {dtype!r}, not one this loader reads")
                start, end = info["data_offsets"]
                shape = tuple(int(d) for d in info["shape"])
                if end - start != math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize:
                    raise ValueError(f"{path}: tensor {key}: data_offsets do not match its shape and dtype")
                if key in self._where:
                    raise ValueError(f"{path}: tensor {key} is also in {self.files[self._where[key][0]]}")
                self._where[key] = (i, dtype, shape, data + start)

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._where[key][2]

    def dtype(self, key: str) -> torch.dtype:
        return SAFETENSORS_DTYPES[self._where[key][1]]

    def _fd(self, i: int) -> int:
        if i not in self._fds:
            fd = os.open(self.files[i], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            if self.drop_cache:
                _advise(fd, getattr(os, "POSIX_FADV_RANDOM", 1))
            self._fds[i] = fd
        return self._fds[i]

    def read(self, key: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        i, dtype_name, shape, start = self._where[key]
        dtype = SAFETENSORS_DTYPES[dtype_name]
        numel = math.prod(shape)
        hi = numel if hi is None else hi
        if not 0 <= lo <= hi <= numel:
            raise ValueError(f"{key}: range [{lo}, {hi}) outside its {numel} elements")
        out = torch.empty(hi - lo, dtype=dtype)
        nbytes, offset = (hi - lo) * dtype.itemsize, start + lo * dtype.itemsize
        view = memoryview(out.view(torch.uint8).numpy()) if nbytes else memoryview(b"")
        fd, done = self._fd(i), 0
        while done < nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise ValueError(f"{self.files[i]}: tensor {key} is cut short (file truncated?)")
            done += got
        if self.drop_cache and nbytes and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        return out

    def close(self) -> None:
        """Close the files; with `drop_cache`, first drop all their pages from the page cache."""
        for fd in self._fds.values():
            try:
                if self.drop_cache:
                    _advise(fd, getattr(os, "POSIX_FADV_DONTNEED", 4))
            finally:
                os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _pread_all(fd: int, n: int, offset: int) -> bytes:
    """Up to `n` bytes at `offset` (fewer only at the end of the file)."""
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _advise(fd: int, advice: int) -> None:
    """`posix_fadvise` over the whole file, where the platform and filesystem take it (advice only)."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        except OSError:
            pass


def _hollow_like(p: torch.Tensor, device: torch.device) -> torch.nn.Parameter:
    """A parameter of `p`'s shape and dtype on `device` with no memory (its storage has 0 bytes)."""
    t = torch.empty(p.shape, dtype=p.dtype, device=device)  # not touched: no page is ever resident
    t.untyped_storage().resize_(0)
    return torch.nn.Parameter(t, requires_grad=p.requires_grad)


def hollow_parameters(module: torch.nn.Module, source: TensorSource, *, prefix: str = "",
                      device: torch.device | str = "cpu") -> list[str]:
    """Replace every parameter of `module` (on the meta device or not) by a hollow one that reads its value from
    `source[prefix + name]` when Gemini fills its chunk. Buffers are left alone (they are not sharded: give them
    values before calling). Every parameter must be in `source` with its shape; returns the names."""
    device = torch.device(device)
    keys = set(source.keys())
    names = []
    for mod_name, mod in module.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            full = f"{mod_name}.{name}" if mod_name else name
            key = prefix + full
            if key not in keys:
                raise KeyError(f"{key}: not in the tensor source")
            if tuple(source.shape(key)) != tuple(p.shape):
                raise ValueError(f"{key}: shape {tuple(source.shape(key))} in the source, {tuple(p.shape)} in the "
                                 "model")
            new = _hollow_like(p, device)
            setattr(new, _ATTR, (source, key))
            mod._parameters[name] = new
            names.append(full)
    return names


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """`module.to(dtype)` for the parameters, hollow ones included: a hollow parameter becomes a hollow one of
    `dtype` reading from the same source (its value is converted when its chunk is filled), nothing is read now.
    Buffers are cast as `Module.to` casts them."""
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if is_hollow(p):
                new = _hollow_like(torch.empty(p.shape, dtype=dtype, device="meta"), p.device)
                new.requires_grad_(p.requires_grad)
                setattr(new, _ATTR, source_of(p))
                mod._parameters[name] = new
            else:
                p.data = p.data.to(dtype)
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point():
                mod._buffers[name] = b.to(dtype)


def is_hollow(p: torch.Tensor) -> bool:
    """Whether `p` is a hollow parameter whose value is still in its source."""
    return getattr(p, _ATTR, None) is not None


def source_of(p: torch.Tensor) -> tuple[TensorSource, str]:
    """(source, key) of a hollow parameter."""
    return getattr(p, _ATTR)


def take_value(p: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Elements [lo, hi) of hollow parameter `p`'s flattened value, read from its source, in `p`'s dtype."""
    source, key = source_of(p)
    return source.read(key, lo, hi).to(p.dtype)


def fill_hollow(module: torch.nn.Module) -> int:
    """Give every hollow parameter of `module` its value in ordinary memory (where no Gemini setup follows);
    returns how many were filled."""
    n, sources = 0, {}
    for p in module.parameters():
        if not is_hollow(p):
            continue
        sources[id(source_of(p)[0])] = source_of(p)[0]
        storage = p.data.untyped_storage()
        storage.resize_(p.numel() * p.element_size())
        with torch.no_grad():
            p.data.view(-1).copy_(take_value(p))
        delattr(p, _ATTR)
        n += 1
    close_sources(sources.values())
    return n


def close_sources(sources: Iterable[TensorSource]) -> None:
    """Close the sources that have a `close()` (a `SafetensorsSource` drops its files from the page cache)."""
    for source in sources:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def clear_source(p: torch.Tensor) -> None:
    """Forget where a (now filled) parameter came from."""
    if hasattr(p, _ATTR):
        delattr(p, _ATTR)
