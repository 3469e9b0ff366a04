"""`model.state_dict()` / `load_state_dict()` through the chunks.

Saving gathers fp32 master chunks (a collective on all ranks); loading writes each rank's own shard (no
communication). Around a checkpoint save (`begin_checkpoint` .. `end_checkpoint`) the state_dict holds local
placeholders instead, so rank 0 alone can call `model.state_dict()` without a collective.

The chunk manager owns one `StateDictIO` and hands it what it reads: the chunks, the slot of each parameter,
the parameters (for their shapes) and their original dtypes. It holds its own caches and reads the chunks
only through their public interface.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .chunk import Chunk
from .layout import Slot
from .state import ChunkState

__all__ = ["StateDictIO"]


class StateDictIO:
    """State-dict reads and writes of the chunked parameters of one manager on one rank."""

    def __init__(self, chunks: Sequence[Chunk], slot_of: dict[int, Slot], params: Sequence[torch.nn.Parameter],
                 param_dtypes: Sequence[torch.dtype], *, rank: int) -> None:
        self.chunks, self.slot_of, self.params, self.param_dtypes = chunks, slot_of, params, param_dtypes
        self.rank = rank
        self.placeholders = False
        """A checkpoint save is under way: `param_value` hands out placeholders, not gathered values."""
        self._placeholders: dict[int, torch.Tensor] = {}
        self._frozen_stash: dict[int, torch.Tensor] = {}  # rank 0, during a save: frozen parameters' values
        self._io_cache: dict[int, torch.Tensor] = {}  # chunk -> [size] fp32 gathered for one module's save
        # chunk -> modules whose save holds it: a parameter registered by a module and by its child (a tied
        # `decoder.bias`), or a parent's and a child's parameters in one chunk, are read by the parent's
        # save after the child's save released the chunk; the chunk goes when the outermost save is done
        self._io_refs: dict[int, int] = {}
        self._io_storage: set[int] = set()  # released chunks given scratch storage for torch's load copy

    def gather(self, pidxs: Iterable[int]) -> None:
        """Gather the fp32 master chunks of parameters `pidxs` for `param_value` (collective)."""
        if self.placeholders:
            return
        for ci in sorted({self.slot_of[p].chunk for p in pidxs}):
            if ci not in self._io_cache:
                self._io_cache[ci] = self.chunks[ci].gather_fp32(self.chunks[ci].master)
            self._io_refs[ci] = self._io_refs.get(ci, 0) + 1

    def drop_cache(self) -> None:
        """Forget every gathered chunk (a save that raised half-way left some): the weights change next."""
        self._io_cache.clear()
        self._io_refs.clear()

    def param_value(self, pidx: int) -> torch.Tensor:
        """Full fp32 master value of a parameter in its original dtype; during a checkpoint save, one shared
        empty placeholder per parameter (tied names alias, values come from the shards)."""
        if self.placeholders:
            if pidx in self._frozen_stash:
                return self._frozen_stash[pidx]
            return self._placeholders.setdefault(pidx, torch.empty(0))
        s = self.slot_of[pidx]
        p = self.params[pidx]
        flat = self._io_cache[s.chunk][s.offset : s.offset + s.numel]
        return flat.view(p.shape).to(self.param_dtypes[pidx], copy=True)

    def stream_values(self, pidxs: Iterable[int]) -> Iterable[tuple[int, torch.Tensor]]:
        """(pidx, full fp32 master value viewed in the parameter's shape) of parameters `pidxs`, one chunk
        gathered at a time in chunk order (a collective: every rank iterates to the end with the same `pidxs`).
        A value is valid until the next item; only one gathered chunk is alive at a time."""
        wanted = set(pidxs)
        for ci in sorted({self.slot_of[p].chunk for p in wanted}):
            full = self.chunks[ci].gather_fp32(self.chunks[ci].master)
            for s in self.chunks[ci].spec.slots:
                if s.param in wanted:
                    yield s.param, full[s.offset : s.offset + s.numel].view(self.params[s.param].shape)
            del full

    def begin_checkpoint(self, *, frozen: bool = True) -> None:
        """Before `save_checkpoint` (collective): rank 0's model.state_dict() then needs no communication.

        Trained parameters come from the optimizer's shards (placeholders here); frozen ones are gathered
        now and kept on rank 0, so they land in the model file exactly as ZeRO saves them -- unless `frozen`
        is False: the save leaves them out (placeholders too, never written).
        """
        self.end_checkpoint()
        for c in self.chunks:
            if c.spec.trainable or not frozen:
                continue
            full = c.gather_fp32(c.master)
            if self.rank == 0:
                for s in c.spec.slots:
                    p = self.params[s.param]
                    self._frozen_stash[s.param] = full[s.offset : s.offset + s.numel].view(p.shape).to(
                        self.param_dtypes[s.param], copy=True)
        self.placeholders = True

    def end_checkpoint(self) -> None:
        """Back to normal state_dict behaviour (collective full values)."""
        self.placeholders = False
        self._frozen_stash = {}

    def release(self, pidxs: Iterable[int]) -> None:
        """Forget what `gather` / `load` held for parameters `pidxs` (scratch storage of released chunks)."""
        for ci in {self.slot_of[p].chunk for p in pidxs}:
            refs = self._io_refs.get(ci, 0) - 1
            if refs > 0:
                self._io_refs[ci] = refs
                continue
            self._io_refs.pop(ci, None)
            self._io_cache.pop(ci, None)
            c = self.chunks[ci]
            if ci in self._io_storage and c.sm.data is ChunkState.RELEASED:
                c.free_storage()
            self._io_storage.discard(ci)

    def load(self, pidxs: Iterable[int], values: dict[int, torch.Tensor | None]) -> None:
        """Write loaded values into the master shards; give released chunks scratch storage for torch's copy."""
        for pidx in pidxs:
            value, s = values.get(pidx), self.slot_of[pidx]
            c = self.chunks[s.chunk]
            if c.sm.data is ChunkState.RELEASED and s.chunk not in self._io_storage:
                c.alloc_storage()
                self._io_storage.add(s.chunk)
            if not isinstance(value, torch.Tensor) or value.numel() != s.numel:
                continue  # torch's own loader reports the mismatch
            lo, hi = max(s.offset, c.lo), min(s.offset + s.numel, c.hi)
            if lo < hi:
                flat = value.detach().reshape(-1)[lo - s.offset : hi - s.offset]
                c.master.view()[lo - c.lo : hi - c.lo].copy_(flat.float())  # via fp32, as `load_params`
                c.master.done()
