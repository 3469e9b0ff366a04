"""AlphaFold-named arrays <-> a model's parameters, through its table (`fastfold.params.table`).

`ParamLayout` pairs a model class with its table and does, the same way for AlphaFold2 (`fastfold.params`) and
AlphaFold-Multimer (`fastfold.params.multimer`): the one parameter check (every missing, mis-shaped and
unexpected array in one `ParamsError`, from shapes alone, before any parameter is written), streamed loading
(each array read once, copied into its parameters, dropped), writing the `.npz` layout, the expected layout
of a configuration, and models built without initialisation. `NpzArrays` reads an `.npz` member by member.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from ...utils.fileio import atomic_write
from .table import (
    HALVES,
    HEADED,
    Leaf,
    ParamsError,
    Row,
    heads_of,
    leaves,
    shape_to_af,
    shape_to_ours,
    to_af,
    to_ours,
)

__all__ = ["NpzArrays", "ParamLayout", "materialise_empty", "problems_error", "shape_views", "shapes_of"]

M = TypeVar("M", bound=nn.Module)


def problems_error(source: str, problems: list[str], show: int = 3) -> ParamsError:
    """The one error for a file's parameter problems ("missing K", "unexpected K", "mis-shaped K ..."), in a few
    lines whatever their number: the count of each kind and its first `show` names (a checkpoint of another
    model has hundreds)."""
    kinds: dict[str, list[str]] = {}
    for problem in problems:
        kind, _, rest = problem.partition(" ")
        kinds.setdefault(kind, []).append(rest)
    lines = []
    for kind, names in kinds.items():
        more = f" and {len(names) - show} more" if len(names) > show else ""
        lines.append(f"{kind} {', '.join(names[:show])}{more}")
    head = f"{source}: {len(problems)} parameter problem(s) (not this model's file?):"
    return ParamsError(head + "\n  " + "\n  ".join(lines))


def stack_sizes(config: Any) -> dict[str, int]:
    """Blocks per stack name of a model configuration."""
    return {
        "evoformer": config.evoformer.num_blocks,
        "extra_msa": config.extra_msa.num_blocks,
        "template": config.template.num_blocks,
    }


def expand(leaf: Leaf, sizes: Mapping[str, int]) -> list[str]:
    """The state-dict keys of a leaf: one, or one per block of its stack."""
    return [leaf.ours.replace("{i}", str(i)) for i in range(sizes[leaf.stack])] if leaf.stack else [leaf.ours]


class ParamLayout:
    """A model class and its table (`rows_for(config)`, the rows that apply to a configuration)."""

    def __init__(self, model_cls: type[nn.Module], rows_for: Callable[[Any], list[Row]], name: str) -> None:
        self.model_cls, self.rows_for, self.name = model_cls, rows_for, name

    def leaves_for(self, model: nn.Module) -> list[Leaf]:
        """All leaves of `model`, in table order (an AlphaFold-Multimer `fused` array gives two leaves)."""
        return [leaf for row in self.rows_for(model.config) for leaf in leaves(row, model)]

    def model_to_arrays(self, model: nn.Module) -> dict[str, np.ndarray]:
        """The model's parameters as AlphaFold-named float32 arrays (stacked blocks on a leading axis)."""
        state = {k: v.detach().cpu().to(torch.float32).numpy() for k, v in model.state_dict().items()}
        sizes = stack_sizes(model.config)
        halves: dict[str, dict[str, list[np.ndarray]]] = {}
        out = {}
        for leaf in self.leaves_for(model):
            heads = heads_of(model, leaf.ours) if leaf.transform in HEADED else None
            arrays = [to_af(state[k], leaf.transform, heads) for k in expand(leaf, sizes)]
            if leaf.transform in HALVES:  # one array from the left (0) and right (1) halves
                got = halves.setdefault(leaf.af, {})
                got[leaf.transform[1]] = arrays
                if len(got) < 2:
                    continue
                arrays = [np.concatenate([a, b], axis=-1) for a, b in zip(got["0"], got["1"])]
            out[leaf.af] = np.stack(arrays) if leaf.stack else arrays[0]
        return out

    def save_npz(self, model: nn.Module, path: str | os.PathLike) -> None:
        """Write `model`'s parameters to `path` in AlphaFold's `.npz` layout, atomically."""
        arrays = self.model_to_arrays(model)
        with atomic_write(path, "wb") as f:
            np.savez(f, **arrays)

    def check(self, model: nn.Module, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
        """Raise one ParamsError listing every missing, mis-shaped and unexpected array (shapes only), each once
        (the two leaves of a `fused` array share its key)."""
        state = model.state_dict()
        sizes = stack_sizes(model.config)
        missing, misshaped, used, covered = {}, {}, set(), set()
        for leaf in self.leaves_for(model):
            keys = expand(leaf, sizes)
            covered.update(keys)
            if leaf.af not in shapes:
                missing[leaf.af] = None
                continue
            used.add(leaf.af)
            shape = tuple(shapes[leaf.af])
            if leaf.stack and not (len(shape) > 0 and shape[0] == len(keys)):
                misshaped[f"{leaf.af}: {shape} has no leading axis of {len(keys)} blocks"] = None
                continue
            part = shape[1:] if leaf.stack else shape
            for key in keys:
                if shape_to_ours(part, leaf.transform) != tuple(state[key].shape):
                    misshaped[f"{leaf.af}: {shape} does not fit {key} {tuple(state[key].shape)}"] = None
        problems = [f"missing {k}" for k in missing] + [f"mis-shaped {m}" for m in misshaped]
        problems += [f"unexpected {k}" for k in sorted(set(shapes) - used)]
        if problems:
            raise problems_error(source, problems)
        uncovered = sorted(set(state) - covered)
        if uncovered:  # a model module the table does not know: a bug here, not in the file
            raise RuntimeError(f"{self.name}: no table row for {', '.join(uncovered)}")

    def load_npz(self, model: nn.Module, arrays: Mapping[str, np.ndarray], source: str = "<arrays>") -> None:
        """Copy AlphaFold-named arrays into `model`. Missing, unexpected or mis-shaped keys raise one
        ParamsError listing all of them, before any parameter is written.

        The arrays are read one at a time (`arrays` may be an `NpzArrays`, which reads each from the file when
        asked), each once, and copied straight into the parameters (converted to their dtype), so loading holds
        the model plus one array, never a second copy of the whole model."""
        self.check(model, shapes_of(arrays), source)
        state = model.state_dict()  # tensors sharing the parameters' storage
        sizes = stack_sizes(model.config)
        by_key: dict[str, list[Leaf]] = {}
        for leaf in self.leaves_for(model):
            by_key.setdefault(leaf.af, []).append(leaf)
        with torch.no_grad():
            for af, group in by_key.items():
                a = np.asarray(arrays[af])
                for leaf in group:
                    for key, part in zip(expand(leaf, sizes), a if leaf.stack else [a]):
                        state[key].copy_(torch.from_numpy(np.ascontiguousarray(to_ours(part, leaf.transform))))
                del a

    def expected_layout(self, config: Any) -> dict[str, tuple[int, ...]]:
        """AlphaFold key -> array shape for a model of `config` (built on the meta device, no data)."""
        with torch.device("meta"):
            model = self.model_cls(config)
        state = model.state_dict()
        sizes = stack_sizes(config)
        shapes: dict[str, tuple[int, ...]] = {}
        for leaf in self.leaves_for(model):
            heads = heads_of(model, leaf.ours) if leaf.transform in HEADED else None
            shape = shape_to_af(tuple(state[expand(leaf, sizes)[0]].shape), leaf.transform, heads)
            shapes[leaf.af] = ((sizes[leaf.stack],) if leaf.stack else ()) + shape
        return shapes

    def empty_model(self, config: Any) -> nn.Module:
        """The model built on the meta device and given uninitialised CPU storage: no random initialisation to
        pay for when every parameter is about to be loaded (the models hold no buffers)."""
        with torch.device("meta"):
            model = self.model_cls(config)
        return materialise_empty(model)

    def load_file(self, path: Path, base: Any, config_from_arrays: Callable[[Mapping[str, np.ndarray], Any], Any]):
        """The model of an `.npz` file, every size read from it (`config_from_arrays(arrays, base)`), the arrays
        streamed one at a time into the parameters; eval mode."""
        with NpzArrays(path) as arrays:
            try:
                config = config_from_arrays(shape_views(arrays.shapes), base)
            except ParamsError as exc:
                raise ParamsError(f"{path}: {exc}") from None
            model = self.empty_model(config)
            self.load_npz(model, arrays, source=str(path))
        return model.eval()


def materialise_empty(model: M) -> M:
    """Give a meta-device model uninitialised CPU storage, parameter by parameter, with plain `torch.empty`.
    (`Module.to_empty` goes through `torch.empty_like`'s reference implementation, whose first call imports
    sympy and the symbolic-shape machinery: ~50 MiB more resident for the whole process.)"""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    return model


# ---------------------------------------------------------------------------------------------------------
# Files.


def shapes_of(arrays: Mapping[str, np.ndarray]) -> Mapping[str, tuple[int, ...]]:
    """Every array's shape, without reading the data of a file-backed mapping (`NpzArrays`)."""
    shapes = getattr(arrays, "shapes", None)
    return shapes if shapes is not None else {k: tuple(np.shape(v)) for k, v in arrays.items()}


def shape_views(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Stand-ins with each shape that hold no data (a broadcast scalar), for reading sizes from shapes."""
    zero = np.zeros((), np.float32)
    return {k: np.broadcast_to(zero, s) for k, s in shapes.items()}


class NpzArrays(Mapping):
    """The arrays of an `.npz` file, read one at a time when asked (`arrays[key]`), never all at once.

    `shapes` (key -> shape) comes from the members' headers, so sizes and problems are known before any data
    is read. Use as a context manager (closes the file). Unreadable files and members raise ParamsError."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._zip = zipfile.ZipFile(self.path)
            self._members = {n[: -len(".npy")]: n for n in self._zip.namelist() if n.endswith(".npy")}
            self.shapes = {k: self._header(n)[0] for k, n in self._members.items()}
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise ParamsError(f"{self.path}: not a readable .npz file ({exc})") from None

    def _header(self, member: str) -> tuple[tuple[int, ...], np.dtype]:
        with self._zip.open(member) as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
        if dtype.hasobject:
            raise ValueError(f"{member}: object arrays are not parameters")
        return tuple(shape), dtype

    def __getitem__(self, key: str) -> np.ndarray:
        try:
            with self._zip.open(self._members[key]) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
            raise ParamsError(f"{self.path}: {key}: unreadable ({exc})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> NpzArrays:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
