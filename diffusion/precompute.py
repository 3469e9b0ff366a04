"""Pre-computed conditioning: text embeddings and VAE latents computed once, before the UNet trains, so the frozen
text encoders and the VAE can leave memory (what diffusers' `train_text_to_image_sdxl.py` does with `dataset.map`,
and `train_dreambooth_lora_sdxl.py` with the instance prompt's embeddings).

The values live in `FeatureStore`s: one memory-mapped `.npy` file per field in a folder, one row per item, so a
large data set costs page cache (reclaimable, read back on use), not resident memory. Rows keep the dtype the
encoders produced (bf16 values are stored exactly, as float32 with a note of the dtype), so a step reading them
gets the very tensors it would have computed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..utils.fileio import fsync_dir

__all__ = ["PRECOMPUTE_CHOICES", "FeatureStore", "TextEmbeddings", "check_precompute", "remove_store",
           "script_precompute"]

PRECOMPUTE_CHOICES = ("auto", "none", "text", "latents", "both")
"""`--precompute` values: auto (what the script does), none, text (embeddings), latents (VAE), both."""

_DTYPES = {"torch.float32": torch.float32, "torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16,
           "torch.int64": torch.int64}


def check_precompute(mode: str, train_text_encoder: bool) -> None:
    """One `ValueError` for a value that is not a choice, or text embeddings computed once while the text encoders
    train (their outputs change every step)."""
    if mode not in PRECOMPUTE_CHOICES:
        raise ValueError(f"precompute must be one of {', '.join(PRECOMPUTE_CHOICES)}, got {mode!r}")
    if mode in ("text", "both") and train_text_encoder:
        raise ValueError(f"precompute {mode!r}: the text encoders train (--train_text_encoder), so their "
                         "embeddings cannot be computed once; use 'latents' or 'none'")


def script_precompute(script: str, train_text_encoder: bool) -> str:
    """What diffusers' SDXL script `script` computes once before training: train_text_to_image_sdxl both the
    embeddings and the latents (`dataset.map`), train_dreambooth_lora_sdxl the instance prompt's embeddings unless
    the text encoders train, train_text_to_image_lora_sdxl nothing."""
    if script == "train_text_to_image_sdxl":
        return "both"
    if script == "train_dreambooth_lora_sdxl" and not train_text_encoder:
        return "text"
    return "none"


class FeatureStore:
    """Rows of fixed-shape tensors, one memory-mapped `.npy` per field in `folder` (float32 or int64 on disk; the
    tensors' own dtype restored on read). Written by one process (`put` every row, then `finish`), then read by
    any number (DataLoader workers reopen the files: a pickled store carries only its folder)."""

    def __init__(self, folder: str | Path, rows: int) -> None:
        self.folder, self.rows = Path(folder), rows
        self.folder.mkdir(parents=True, exist_ok=True)
        self._arrays: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, str] = {}
        self._written: set[int] = set()
        self._done = False

    def put(self, row: int, values: dict[str, torch.Tensor]) -> None:
        """Write `values` (field -> tensor, same shapes for every row) as row `row`."""
        if self._done:
            raise RuntimeError(f"{self.folder}: the store is finished; it is read-only")
        for name, t in values.items():
            t = t.detach().cpu()
            host = torch.int64 if not t.is_floating_point() else torch.float32
            if name not in self._arrays:
                self._dtypes[name] = str(t.dtype)
                self._arrays[name] = np.lib.format.open_memmap(
                    self.folder / f"{name}.npy", mode="w+", dtype=np.int64 if host == torch.int64 else np.float32,
                    shape=(self.rows, *t.shape))
            elif str(t.dtype) != self._dtypes[name] or tuple(t.shape) != self._arrays[name].shape[1:]:
                raise ValueError(f"{name}: row {row} is {t.dtype} {tuple(t.shape)}, the store holds "
                                 f"{self._dtypes[name]} {self._arrays[name].shape[1:]}")
            self._arrays[name][row] = t.to(host).numpy()
        self._written.add(row)

    def finish(self) -> FeatureStore:
        """Flush every file and reopen them read-only; every row must have been written."""
        missing = self.rows - len(self._written)
        if missing:
            raise RuntimeError(f"{self.folder}: {missing} of {self.rows} rows were never written")
        for a in self._arrays.values():
            a.flush()
        (self.folder / "dtypes.json").write_text(json.dumps(self._dtypes))
        fsync_dir(self.folder)
        self._done = True
        self._arrays = {}
        return self

    def _open(self) -> dict[str, np.ndarray]:
        if not self._arrays:
            self._dtypes = json.loads((self.folder / "dtypes.json").read_text())
            self._arrays = {name: np.load(self.folder / f"{name}.npy", mmap_mode="r") for name in self._dtypes}
        return self._arrays

    def get(self, row: int) -> dict[str, torch.Tensor]:
        """Row `row` of every field, in the dtype it was written with."""
        if not self._done:
            raise RuntimeError(f"{self.folder}: read before finish()")
        return {name: torch.from_numpy(np.array(a[row])).to(_DTYPES[self._dtypes[name]])
                for name, a in self._open().items()}

    def stack(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Rows `rows` of every field stacked on a new first dim."""
        got = [self.get(r) for r in rows]
        return {name: torch.stack([g[name] for g in got]) for name in got[0]}

    def __getstate__(self) -> dict[str, Any]:
        if not self._done:
            raise RuntimeError(f"{self.folder}: only a finished store can be sent to another process")
        return {"folder": self.folder, "rows": self.rows, "_done": True}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.folder, self.rows, self._done = state["folder"], state["rows"], state["_done"]
        self._arrays, self._dtypes, self._written = {}, {}, set()


class TextEmbeddings:
    """The encoders' outputs for every distinct prompt of a run, looked up by token ids (so each step keeps its own
    caption draw: a random caption of several, the empty prompt): `lookup([ids_1, ids_2, ...])` gives the stacked
    rows. Built by `build`; the prompts' outputs are computed `batch` at a time."""

    def __init__(self, store: FeatureStore, index: dict[tuple[tuple[int, ...], ...], int]) -> None:
        self.store, self.index = store, index

    @classmethod
    def build(cls, folder: str | Path, prompts: Iterable[str], tokenize: Callable[[str], list[torch.Tensor]],
              encode: Callable[[list[torch.Tensor]], dict[str, torch.Tensor]], batch: int = 4) -> TextEmbeddings:
        """`tokenize(prompt)`: one `[L]` id tensor per encoder; `encode(ids)`: the fields of a batch of prompts
        (`ids`: one `[B, L]` tensor per encoder)."""
        keyed: dict[tuple[tuple[int, ...], ...], list[torch.Tensor]] = {}
        for p in prompts:
            ids = tokenize(p)
            keyed.setdefault(tuple(tuple(int(v) for v in t.tolist()) for t in ids), ids)
        if not keyed:
            raise ValueError("no prompts to pre-compute")
        store, keys = FeatureStore(folder, len(keyed)), list(keyed)
        with torch.no_grad():
            for lo in range(0, len(keys), batch):
                chunk = keys[lo:lo + batch]
                per_encoder = [torch.stack([keyed[k][e] for k in chunk]) for e in range(len(keyed[chunk[0]]))]
                out = encode(per_encoder)
                for j in range(len(chunk)):
                    store.put(lo + j, {name: t[j] for name, t in out.items()})
        return cls(store.finish(), {k: i for i, k in enumerate(keys)})

    def lookup(self, ids: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stored fields of a batch whose prompts have token ids `ids` (one `[B, L]` tensor per encoder)."""
        rows = []
        for b in range(ids[0].shape[0]):
            key = tuple(tuple(int(v) for v in t[b].tolist()) for t in ids)
            if key not in self.index:
                raise KeyError(f"a prompt of this batch was not pre-computed ({len(self.index)} prompts were); "
                               "the data changed after the embeddings were computed")
            rows.append(self.index[key])
        return self.store.stack(rows)


def remove_store(folder: str | Path) -> None:
    """Delete a store folder (its files are only a cache of the run)."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
