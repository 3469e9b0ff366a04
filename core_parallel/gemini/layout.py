"""Chunk layout: parameters packed in order of use into chunks of at most a given capacity, one chunk group
per (dtype, trainable) pair. Pure and deterministic: no torch.distributed, no tensors.

A parameter never straddles two chunks, so a chunk rarely fills its capacity exactly; each chunk is sized to
what it holds, rounded up to a multiple of the world size (so it shards evenly). Padding is then at most
`world - 1` elements per chunk, instead of the unfilled rest of a fixed-size chunk (28% of a diffusers UNet's
elements with 4.5 MiB chunks), which every gather, reduction and NVMe transfer would move. With
`chunk_elems=None` the capacity is searched: the candidate whose fixed-size packing wastes the fewest elements
over all groups wins (its chunks come out evenly filled), ties going to the smaller chunk (finer-grained
memory).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["MODULE_ORDER_ATTRIBUTE", "ChunkSpec", "ParamInfo", "Slot", "order_of_use", "plan_chunks",
           "search_chunk_elems", "padding_waste", "set_module_order"]

MODULE_ORDER_ATTRIBUTE = "gemini_module_order"
"""The attribute `set_module_order` sets on a module: its parameter-owning submodules in the order they first run."""


def set_module_order(module: object, names: Sequence[str]) -> None:
    """Declare the order in which `module`'s submodules that own parameters first run in a step (qualified names
    relative to `module`, "" for itself). Gemini then packs their parameters into chunks in that order instead of
    `named_parameters()` order (`order_of_use`): where the two differ (a diffusers UNet registers its mid block
    after the up blocks, and each block's attentions before its resnets) a chunk holding parameters used far apart
    is gathered (read from its tier) once per use instead of once per pass."""
    setattr(module, MODULE_ORDER_ATTRIBUTE, tuple(names))


def order_of_use(names: Sequence[str], declared: dict[str, Sequence[str]]) -> list[int]:
    """The positions of `names` (parameters' qualified names in `named_parameters()` order) in packing order.
    Under a module with a declared order (`declared[prefix]`, see `set_module_order`), its parameters are sorted
    by the first run of their owning module or of its nearest declared ancestor (peft's `base_layer` and LoRA
    factors under the layer they wrap); one whose module never ran follows the parameter before it; ties and
    parameters outside every declared module keep their `named_parameters()` order."""
    rank: dict[str, tuple[str, int]] = {}
    for prefix, modules in declared.items():
        for r, m in enumerate(modules):
            rank.setdefault(".".join(x for x in (prefix, m) if x), (prefix, r))
    prefixes = sorted(declared, key=len, reverse=True)  # the innermost declared module decides
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        owner = next((p for p in prefixes if p == "" or name.startswith(p + ".")), None)
        if owner is not None:
            groups.setdefault(owner, []).append(i)
    out = list(range(len(names)))
    for prefix, positions in groups.items():
        keys, prev = [], -1
        for i in positions:
            module, r = names[i].rpartition(".")[0], None
            while r is None:
                got = rank.get(module)
                if got is not None and got[0] == prefix:
                    r = got[1]
                elif module in (prefix, ""):
                    break
                module = module.rpartition(".")[0]
            prev = prev if r is None else r
            keys.append((prev, i))
        for slot, (_, i) in zip(positions, sorted(keys)):
            out[slot] = i
    return out


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as the layout sees it."""

    index: int
    """Position of the parameter in packing order (`named_parameters()` order, or `order_of_use`'s)."""
    name: str
    """Its first qualified name."""
    numel: int
    """Number of elements."""
    dtype: str
    """Dtype name of the chunk group, e.g. 'float32'."""
    trainable: bool
    """Whether it receives gradients and optimizer updates."""


@dataclass(frozen=True)
class Slot:
    """Where a parameter lives: elements [offset, offset + numel) of chunk `chunk`."""

    param: int
    chunk: int
    offset: int
    numel: int


@dataclass(frozen=True)
class ChunkSpec:
    """A chunk: `size` elements (its slots' total rounded up to a multiple of the world size) holding `slots`
    back to back."""

    index: int
    dtype: str
    trainable: bool
    size: int
    slots: tuple[Slot, ...]

    @property
    def used(self) -> int:
        """Elements holding parameters (the rest is padding)."""
        return sum(s.numel for s in self.slots)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _groups(params: Sequence[ParamInfo]) -> dict[tuple[str, bool], list[ParamInfo]]:
    groups: dict[tuple[str, bool], list[ParamInfo]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.trainable), []).append(p)
    return groups


def _pack(numels: Sequence[int], size: int) -> list[list[int]]:
    """Positions of `numels` packed in order into chunks of `size` (a new chunk when the next does not fit)."""
    chunks: list[list[int]] = [[]]
    free = size
    for i, n in enumerate(numels):
        if n > free and chunks[-1]:
            chunks.append([])
            free = size
        chunks[-1].append(i)
        free -= n
    return chunks


def padding_waste(numels: Sequence[int], size: int) -> int:
    """Padding elements when `numels` are packed in order into chunks of `size` (every chunk full size)."""
    if not numels:
        return 0
    return len(_pack(numels, size)) * size - sum(numels)


def _exact_fits(groups: Sequence[Sequence[int]], world: int, lo: int, hi: int) -> set[int]:
    """Sizes in [lo, hi] that hold a group's first parameters exactly (up to rounding to `world`)."""
    fits = set()
    for g in groups:
        total = 0
        for n in g:
            total += n
            if total > hi:
                break
            if total >= lo:
                fits.add(_round_up(total, world))
    return fits


def search_chunk_elems(groups: Sequence[Sequence[int]], world: int, n_candidates: int = 256) -> int:
    """The chunk size (elements, multiple of `world`) wasting least padding over all `groups` of numels.

    Candidates run from the largest parameter up to 4x that (or the largest group's total), in
    `n_candidates` even steps, plus the sizes that hold a group's first parameters exactly (so a stack of
    equal layers gets chunks of exactly one or a few layers, not the nearest grid point).
    """
    numels = [n for g in groups for n in g]
    if not numels:
        return world
    lo = _round_up(max(numels), world)
    hi = max(lo, min(4 * lo, _round_up(max(sum(g) for g in groups), world)))
    step = max(world, _round_up(max(1, (hi - lo) // n_candidates), world))
    candidates = sorted(set(range(lo, hi + 1, step)) | _exact_fits(groups, world, lo, hi))
    best, best_waste = lo, None
    for size in candidates:
        waste = sum(padding_waste(g, size) for g in groups)
        if best_waste is None or waste < best_waste:
            best, best_waste = size, waste
    logger.info("chunk size search: %d elements, %d padding elements of %d", best, best_waste, sum(numels))
    return best


def plan_chunks(params: Sequence[ParamInfo], world: int, chunk_elems: int | None = None) -> list[ChunkSpec]:
    """Pack `params` (in the given order) into chunks of at most `chunk_elems` elements, each sized to its
    contents; `chunk_elems=None` searches the capacity.

    A capacity smaller than the largest parameter is raised to fit it (and logged).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    groups = _groups(params)
    if chunk_elems is None:
        size = search_chunk_elems([[p.numel for p in g] for g in groups.values()], world)
    else:
        size = _round_up(max(chunk_elems, 1), world)
        biggest = max((p.numel for p in params), default=0)
        if biggest > size:
            logger.info("chunk of %d elements raised to fit a parameter of %d elements", size, biggest)
            size = _round_up(biggest, world)
    specs: list[ChunkSpec] = []
    for (dtype, trainable), members in groups.items():
        for positions in _pack([p.numel for p in members], size):
            offset, slots = 0, []
            for i in positions:
                slots.append(Slot(param=members[i].index, chunk=len(specs), offset=offset, numel=members[i].numel))
                offset += members[i].numel
            specs.append(ChunkSpec(index=len(specs), dtype=dtype, trainable=trainable,
                                   size=_round_up(max(offset, 1), world), slots=tuple(slots)))
    return specs


def chunk_elems_from_mb(chunk_mb: float, element_size: int) -> int:
    """Elements in `chunk_mb` MiB of a dtype whose elements take `element_size` bytes."""
    return max(1, math.floor(chunk_mb * 2**20 / element_size))
