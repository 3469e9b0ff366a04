"""A UNet that never exists whole in memory: loaded from its safetensors tensor by tensor into Gemini's shards,
and written back the same way.

- `load_unet_hollow(folder)`: the UNet built from its config on the meta device, its parameters hollow (no
  memory) and naming their tensor in the folder's safetensors files (`core_parallel.gemini.lazy`). Gemini's
  setup reads each tensor (only the part its rank's shard needs), casts it to fp32 into the chunk and drops it.
  Without Gemini, `fill_hollow` gives the parameters their values in ordinary memory.
- `save_unet_streaming(unet, folder)`: what `unet.save_pretrained(folder, safe_serialization=True)` writes
  (`config.json`, `diffusion_pytorch_model.safetensors`, or shards and their index above diffusers' 10 GB), byte
  for byte, from a UNet whose parameters live in Gemini's chunks: one chunk is gathered at a time (a collective,
  every rank calls it) and rank 0 writes its tensors into place in the file with `pwrite`.

The safetensors layout is the format's own: an 8-byte little-endian header length, the JSON header (tensors
sorted by dtype alignment then name, `__metadata__` first, padded with spaces to 8 bytes), then the data in
header order.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..core_parallel.gemini.lazy import SafetensorsSource, hollow_parameters
from ..core_parallel.gemini.param_reads import owner_of
from ..core_parallel.gemini.storage import WriteBehind

__all__ = ["SafetensorsWriter", "gemini_of", "load_unet_hollow", "save_unet_streaming", "unet_weight_files"]

logger = logging.getLogger(__name__)

WEIGHTS = "diffusion_pytorch_model"
_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


def _variant(name: str, variant: str | None) -> str:
    """`name` with `variant` before its last extension, as diffusers names variant files."""
    if not variant:
        return name
    parts = name.split(".")
    return ".".join([*parts[:-1], variant, parts[-1]])


def unet_weight_files(folder: Path, variant: str | None = None) -> list[Path] | None:
    """The safetensors files of the UNet in `folder` (the `unet/` subfolder), shards in index order; None when it
    has none (a `.bin` UNet loads through diffusers)."""
    single = folder / _variant(f"{WEIGHTS}.safetensors", variant)
    if single.is_file():
        return [single]
    index = folder / _variant(f"{WEIGHTS}.safetensors.index.json", variant)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        return files if all(f.is_file() for f in files) else None
    return None


def load_unet_hollow(folder: str | Path, variant: str | None = None) -> Any | None:
    """The UNet of the diffusers folder `folder` (its `unet/` subfolder) with hollow parameters reading from its
    safetensors files, in eval mode as `from_pretrained` returns it; None where streaming does not apply (no
    safetensors, keys that differ from the model's, buffers): the caller loads it with `from_pretrained`."""
    from diffusers import UNet2DConditionModel

    sub = Path(folder) / "unet"
    files = unet_weight_files(sub, variant)
    if files is None:
        return None
    source = SafetensorsSource(files)
    config = UNet2DConditionModel.load_config(sub)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    params = {n for n, _ in unet.named_parameters(remove_duplicate=False)}
    if any(True for _ in unet.buffers()) or set(source.keys()) != params:
        logger.info("%s: keys or buffers differ from the model's; loading it whole with diffusers", sub)
        return None
    hollow_parameters(unet, source)
    unet.register_to_config(_name_or_path=folder)  # as from_pretrained records it
    unet.eval()
    logger.info("%s: UNet built without weights; %d tensors stream from %s", sub, len(params),
                ", ".join(f.name for f in files))
    return unet


class SafetensorsWriter:
    """One safetensors file written tensor by tensor, in any order, into its place (`pwrite`).

    `entries`: (name, dtype, shape) of every tensor; `write(name, tensor)` each exactly once, then `close()`
    (checks all were written, fsyncs, and drops the written pages from the page cache). The file's pages do not
    pile up in the page cache meanwhile: each tensor written starts its writeback and leaves the page cache
    once written back (`core_parallel.gemini.storage.WriteBehind`), so writing a UNet adds at most a few tens of
    MiB to what a memory cgroup charges, not the file's size."""

    def __init__(self, path: str | Path, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        # the format's serializer order: larger dtypes first (its dtype enum order), then by name
        ordered = sorted(entries, key=lambda e: (-_dtype_rank(e[1]), e[0]))
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        self._where: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, dtype, shape in ordered:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._where[name] = (offset, nbytes, dtype, tuple(shape))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        raw += b" " * (-len(raw) % 8)
        self._data = 8 + len(raw)
        self._left = set(self._where)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        os.ftruncate(self._fd, self._data + offset)
        _pwrite_all(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
        self._behind = WriteBehind(self._fd)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, nbytes, dtype, shape = self._where[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the header says {shape}")
        data = tensor.detach().to(device="cpu", dtype=dtype).contiguous().reshape(-1)
        if nbytes:
            _pwrite_all(self._fd, memoryview(data.view(torch.uint8).numpy()), self._data + offset)
            self._behind.written(self._data + offset, nbytes)
        self._left.discard(name)

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            if self._left:
                raise RuntimeError(f"{self.path}: {len(self._left)} tensors never written (e.g. {min(self._left)})")
            os.fsync(self._fd)
            if hasattr(os, "posix_fadvise"):  # written and synced: the page cache need not keep them
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(self._fd)
            self._fd = -1


def _dtype_rank(dtype: torch.dtype) -> int:
    # safetensors' Dtype enum order (BOOL < U8 < I8 < ... < F16 < BF16 < ... < F32 < F64 ...)
    order = ["BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"]
    return order.index(_NAMES[dtype])


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def gemini_of(module: torch.nn.Module) -> Any | None:
    """The Gemini chunk manager holding `module`'s parameters, or None (no Gemini, or plain tensors)."""
    for p in module.parameters():
        owner = owner_of(p)
        return owner[0] if owner is not None else None
    return None


def _shard_plan(entries: list[tuple[str, torch.dtype, tuple[int, ...]]], variant: str | None):
    """(file name -> tensor names, index JSON or None) as diffusers' save_pretrained splits them (10 GB)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    pattern = _variant(f"{WEIGHTS}{{suffix}}.safetensors", variant)
    metas = {name: torch.empty(shape, dtype=dtype, device="meta") for name, dtype, shape in entries}
    split = split_torch_state_dict_into_shards(metas, max_shard_size="10GB", filename_pattern=pattern)
    index = None
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": split.tensor_to_filename}
    return split.filename_to_tensors, index


def save_unet_streaming(unet: torch.nn.Module, folder: str | Path | None, variant: str | None = None) -> None:
    """Write `unet` (its parameters in Gemini's chunks) as `save_pretrained(folder, safe_serialization=True)`
    does, fp32, one gathered chunk at a time. Collective: every rank of the Gemini group calls it; rank 0 writes
    (the others pass `folder=None`)."""
    mgr = gemini_of(unet)
    if mgr is None:
        raise ValueError("save_unet_streaming: the UNet's parameters are not in Gemini chunks")
    named = list(unet.named_parameters(remove_duplicate=False))
    if len({id(p) for _, p in named}) != len(named):
        raise ValueError("save_unet_streaming: tied parameters; use save_pretrained on gathered weights")
    # persistent buffers (SD3's position embedding) are not in the chunks: written whole after the parameters
    buffers = [(f"{prefix}.{n}" if prefix else n, b) for prefix, m in unet.named_modules()
               for n, b in m.named_buffers(recurse=False) if n not in m._non_persistent_buffers_set]
    pidx_of = {owner_of(p)[1]: name for name, p in named}
    writers: dict[str, SafetensorsWriter] = {}
    file_of: dict[str, str] = {}
    if folder is not None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        unet.save_config(folder)
        entries = [(name, torch.float32, tuple(p.shape)) for name, p in named]
        entries += [(name, torch.float32 if b.is_floating_point() else b.dtype, tuple(b.shape)) for name, b in buffers]
        files, index = _shard_plan(entries, variant)
        by_name = {e[0]: e for e in entries}
        for fname, names in files.items():
            writers[fname] = SafetensorsWriter(folder / fname, [by_name[n] for n in names], {"format": "pt"})
            file_of.update(dict.fromkeys(names, fname))
        if index is not None:
            text = json.dumps(index, indent=2, sort_keys=True) + "\n"
            (folder / _variant(f"{WEIGHTS}.safetensors.index.json", variant)).write_text(text)
    try:
        for pidx, value in mgr.stream_values(pidx_of):
            if writers:
                name = pidx_of[pidx]
                writers[file_of[name]].write(name, value)
        for name, b in buffers if writers else ():
            writers[file_of[name]].write(name, b.detach().float() if b.is_floating_point() else b.detach())
    finally:
        for w in writers.values():
            w.close()
