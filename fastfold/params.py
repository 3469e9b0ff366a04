"""AlphaFold parameter files <-> fastfold.model modules, through one declarative table.

`TABLE` lists, module by module, AlphaFold's released parameter name (`params_model_{1..5}[_ptm].npz`,
keys `alphafold/alphafold_iteration/<module path>//<param>`) beside our module path and how the arrays
differ in layout. The same table loads (`load_npz`) and writes (`save_npz`) the `.npz` layout, so a round
trip is exact. `from_params(path, preset)` builds a model from a file and `save_params(model, path)` writes
one; this module imports the model, never the other way round. Stacked modules (the Evoformer, extra-MSA
and template pair blocks) carry a leading block axis in AlphaFold's files and one module per block here.

Layout transforms (AlphaFold -> ours):
- `linear`: `weights [in, out]` -> `weight [out, in]`, `bias` as is;
- `ln`: `scale`, `offset` -> `weight`, `bias`;
- `attention`: `query_w/key_w/value_w/gating_w [in, H, C]` -> `[H*C, in]`, `gating_b [H, C]` -> `[H*C]`,
  `output_w [H, C, out]` -> `[out, H*C]` (Alg. 7);
- `global_attention`: as `attention`, with single-head `key_w/value_w [in, C]` (Alg. 19);
- `opm_out`: `output_w [c, c, out]` -> `[out, c*c]` (Alg. 10).
The incoming triangle multiplication's left/right projections are the supplement's b/a (Alg. 12).

OpenFold `.pt` checkpoints are read with `torch.load(weights_only=True)`; their module names differ from
ours in a few places, renamed by `OPENFOLD_RENAMES`.
"""

from __future__ import annotations

import logging
import os
import re
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from torch import nn

from ..utils.errors import InputError
from ..utils.fileio import atomic_write
from .model import config as cfgs
from .model.alphafold import AlphaFold

__all__ = [
    "OPENFOLD_RENAMES",
    "TABLE",
    "ParamsError",
    "NpzArrays",
    "config_from_arrays",
    "empty_model",
    "from_params",
    "load_model",
    "load_npz",
    "save_npz",
    "save_params",
]

log = logging.getLogger(__name__)
PREFIX = "alphafold/alphafold_iteration/"


class ParamsError(InputError):
    """A parameter file that does not fit the model; the message names the file and every bad key. An
    `InputError` (so a `ValueError`): the `suite` command line prints it as one line and exits 2."""


@dataclass(frozen=True)
class Row:
    """One module: AlphaFold path (under PREFIX), our module path, layout kind, and the stack it lives in."""

    af: str
    ours: str
    kind: str
    stack: str | None = None


def _attention_rows(af: str, ours: str, stack: str | None) -> list[Row]:
    return [
        Row(f"{af}/query_norm", f"{ours}.layer_norm_m", "ln", stack),
        Row(f"{af}/attention", f"{ours}.mha", "attention", stack),
    ]


def _tri_mul(af: str, ours: str, stack: str, incoming: bool) -> list[Row]:
    a, b = ("b", "a") if incoming else ("a", "b")  # AlphaFold's "left" is the supplement's b when incoming
    return [
        Row(f"{af}/layer_norm_input", f"{ours}.layer_norm_in", "ln", stack),
        Row(f"{af}/left_projection", f"{ours}.linear_{a}_p", "linear", stack),
        Row(f"{af}/right_projection", f"{ours}.linear_{b}_p", "linear", stack),
        Row(f"{af}/left_gate", f"{ours}.linear_{a}_g", "linear", stack),
        Row(f"{af}/right_gate", f"{ours}.linear_{b}_g", "linear", stack),
        Row(f"{af}/center_layer_norm", f"{ours}.layer_norm_out", "ln", stack),
        Row(f"{af}/output_projection", f"{ours}.linear_z", "linear", stack),
        Row(f"{af}/gating_linear", f"{ours}.linear_g", "linear", stack),
    ]


def _tri_att(af: str, ours: str, stack: str) -> list[Row]:
    return [
        Row(f"{af}/query_norm", f"{ours}.layer_norm", "ln", stack),
        Row(f"{af}//feat_2d_weights", f"{ours}.linear.weight", "T", stack),
        Row(f"{af}/attention", f"{ours}.mha", "attention", stack),
    ]


def _transition(af: str, ours: str, stack: str | None) -> list[Row]:
    return [
        Row(f"{af}/input_layer_norm", f"{ours}.layer_norm", "ln", stack),
        Row(f"{af}/transition1", f"{ours}.linear_1", "linear", stack),
        Row(f"{af}/transition2", f"{ours}.linear_2", "linear", stack),
    ]


def _pair_rows(af: str, ours: str, stack: str) -> list[Row]:
    return [
        *_tri_mul(f"{af}/triangle_multiplication_outgoing", f"{ours}.tri_mul_out", stack, incoming=False),
        *_tri_mul(f"{af}/triangle_multiplication_incoming", f"{ours}.tri_mul_in", stack, incoming=True),
        *_tri_att(f"{af}/triangle_attention_starting_node", f"{ours}.tri_att_start", stack),
        *_tri_att(f"{af}/triangle_attention_ending_node", f"{ours}.tri_att_end", stack),
        *_transition(f"{af}/pair_transition", f"{ours}.pair_transition", stack),
    ]


def _evoformer_block(af: str, ours: str, stack: str, extra: bool) -> list[Row]:
    row = f"{af}/msa_row_attention_with_pair_bias"
    rows = [
        *_attention_rows(row, f"{ours}.msa_att_row", stack),
        Row(f"{row}/feat_2d_norm", f"{ours}.msa_att_row.layer_norm_z", "ln", stack),
        Row(f"{row}//feat_2d_weights", f"{ours}.msa_att_row.linear_z.weight", "T", stack),
    ]
    if extra:
        col = f"{af}/msa_column_global_attention"
        rows += [
            Row(f"{col}/query_norm", f"{ours}.msa_att_col.layer_norm_m", "ln", stack),
            Row(f"{col}/attention", f"{ours}.msa_att_col.global_attention", "global_attention", stack),
        ]
    else:
        rows += _attention_rows(f"{af}/msa_column_attention", f"{ours}.msa_att_col", stack)
    opm = f"{af}/outer_product_mean"
    rows += [
        *_transition(f"{af}/msa_transition", f"{ours}.msa_transition", stack),
        Row(f"{opm}/layer_norm_input", f"{ours}.outer_product_mean.layer_norm", "ln", stack),
        Row(f"{opm}/left_projection", f"{ours}.outer_product_mean.linear_1", "linear", stack),
        Row(f"{opm}/right_projection", f"{ours}.outer_product_mean.linear_2", "linear", stack),
        Row(opm, f"{ours}.outer_product_mean.linear_out", "opm_out", stack),
        *_pair_rows(af, f"{ours}.pair_stack", stack),
    ]
    return rows


def _template_rows() -> list[Row]:
    te = "evoformer/template_embedding"
    ste = f"{te}/single_template_embedding"
    block = f"{ste}/template_pair_stack/__layer_stack_no_state"
    ours_block = "template_embedder.template_pair_stack.blocks.{i}"
    pair = [
        *_tri_att(f"{block}/triangle_attention_starting_node", f"{ours_block}.tri_att_start", "template"),
        *_tri_att(f"{block}/triangle_attention_ending_node", f"{ours_block}.tri_att_end", "template"),
        *_tri_mul(f"{block}/triangle_multiplication_outgoing", f"{ours_block}.tri_mul_out", "template", incoming=False),
        *_tri_mul(f"{block}/triangle_multiplication_incoming", f"{ours_block}.tri_mul_in", "template", incoming=True),
        *_transition(f"{block}/pair_transition", f"{ours_block}.pair_transition", "template"),
    ]
    return [
        Row(f"{ste}/embedding2d", "template_embedder.template_pair_embedder", "linear"),
        *pair,
        Row(f"{ste}/output_layer_norm", "template_embedder.template_pair_stack.layer_norm", "ln"),
        Row(f"{te}/attention", "template_embedder.template_pointwise_att.mha", "attention"),
    ]


def _structure_rows(transition_layers: int, resnet_blocks: int) -> list[Row]:
    sm, fold, sc = (
        "structure_module",
        "structure_module/fold_iteration",
        "structure_module/fold_iteration/rigid_sidechain",
    )
    ipa = f"{fold}/invariant_point_attention"
    rows = [
        Row(f"{sm}/single_layer_norm", "structure_module.layer_norm_s", "ln"),
        Row(f"{sm}/initial_projection", "structure_module.linear_in", "linear"),
        Row(f"{sm}/pair_layer_norm", "structure_module.layer_norm_z", "ln"),
        Row(f"{ipa}/q_scalar", "structure_module.ipa.linear_q", "linear"),
        Row(f"{ipa}/kv_scalar", "structure_module.ipa.linear_kv", "linear"),
        Row(f"{ipa}/q_point_local", "structure_module.ipa.linear_q_points", "linear"),
        Row(f"{ipa}/kv_point_local", "structure_module.ipa.linear_kv_points", "linear"),
        Row(f"{ipa}//trainable_point_weights", "structure_module.ipa.head_weights", "id"),
        Row(f"{ipa}/attention_2d", "structure_module.ipa.linear_b", "linear"),
        Row(f"{ipa}/output_projection", "structure_module.ipa.linear_out", "linear"),
        Row(f"{fold}/attention_layer_norm", "structure_module.layer_norm_ipa", "ln"),
        Row(f"{fold}/transition_layer_norm", "structure_module.layer_norm_transition", "ln"),
        Row(f"{fold}/affine_update", "structure_module.bb_update.linear", "linear"),
        Row(f"{sc}/input_projection", "structure_module.angle_resnet.linear_in", "linear"),
        Row(f"{sc}/input_projection_1", "structure_module.angle_resnet.linear_initial", "linear"),
        Row(f"{sc}/unnormalized_angles", "structure_module.angle_resnet.linear_out", "linear"),
    ]
    rows += [
        Row(f"{fold}/transition{_suffix(k)}", f"structure_module.transition.{k}", "linear")
        for k in range(transition_layers)
    ]
    for k in range(resnet_blocks):
        rows.append(Row(f"{sc}/resblock1{_suffix(k)}", f"structure_module.angle_resnet.layers.{k}.linear_1", "linear"))
        rows.append(Row(f"{sc}/resblock2{_suffix(k)}", f"structure_module.angle_resnet.layers.{k}.linear_2", "linear"))
    return rows


def _suffix(k: int) -> str:
    """Haiku names repeated modules `name`, `name_1`, `name_2`, ..."""
    return f"_{k}" if k else ""


def _top_rows() -> list[Row]:
    evo = "evoformer"
    return [
        Row(f"{evo}/preprocess_1d", "input_embedder.linear_tf_m", "linear"),
        Row(f"{evo}/preprocess_msa", "input_embedder.linear_msa_m", "linear"),
        Row(f"{evo}/left_single", "input_embedder.linear_tf_z_i", "linear"),
        Row(f"{evo}/right_single", "input_embedder.linear_tf_z_j", "linear"),
        Row(f"{evo}/pair_activiations", "input_embedder.linear_relpos", "linear"),  # sic: AlphaFold's spelling
        Row(f"{evo}/prev_pos_linear", "recycling_embedder.linear", "linear"),
        Row(f"{evo}/prev_msa_first_row_norm", "recycling_embedder.layer_norm_m", "ln"),
        Row(f"{evo}/prev_pair_norm", "recycling_embedder.layer_norm_z", "ln"),
        Row(f"{evo}/extra_msa_activations", "extra_msa_embedder.linear", "linear"),
        Row(f"{evo}/single_activations", "evoformer.linear", "linear"),
        *_evoformer_block(f"{evo}/extra_msa_stack", "extra_msa_stack.blocks.{i}", "extra_msa", extra=True),
        *_evoformer_block(f"{evo}/evoformer_iteration", "evoformer.blocks.{i}", "evoformer", extra=False),
    ]


_HEAD_ROWS = [
    Row("predicted_lddt_head/input_layer_norm", "aux_heads.plddt.layer_norm", "ln"),
    Row("predicted_lddt_head/act_0", "aux_heads.plddt.linear_1", "linear"),
    Row("predicted_lddt_head/act_1", "aux_heads.plddt.linear_2", "linear"),
    Row("predicted_lddt_head/logits", "aux_heads.plddt.linear_3", "linear"),
    Row("distogram_head/half_logits", "aux_heads.distogram", "linear"),
    Row("masked_msa_head/logits", "aux_heads.masked_msa", "linear"),
    Row("experimentally_resolved_head/logits", "aux_heads.experimentally_resolved", "linear"),
]
_TM_ROWS = [Row("predicted_aligned_error_head/logits", "aux_heads.tm", "linear")]
_ANGLE_ROWS = [
    Row("evoformer/template_single_embedding", "template_angle_embedder.linear_1", "linear"),
    Row("evoformer/template_projection", "template_angle_embedder.linear_2", "linear"),
]

TABLE: dict[str, list[Row]] = {
    "trunk": _top_rows(),
    "templates": _template_rows(),
    "template_angles": _ANGLE_ROWS,
    "structure_module": _structure_rows(3, 2),
    "heads": _HEAD_ROWS,
    "tm_head": _TM_ROWS,
}
"""The rows for the released architecture (3 transition layers, 2 resnet blocks in the structure module);
`rows_for(config)` gives the rows of any configuration."""


# ---------------------------------------------------------------------------------------------------------
# Leaves: one AlphaFold array <-> one parameter tensor.


@dataclass(frozen=True)
class Leaf:
    """One parameter: AlphaFold key, our state-dict key, transform, stack name."""

    af: str
    ours: str
    transform: str
    stack: str | None


_PARAM_NAMES = {
    "linear": [("weights", "weight", "T"), ("bias", "bias", "id")],
    "ln": [("scale", "weight", "id"), ("offset", "bias", "id")],
    "opm_out": [("output_w", "weight", "opm"), ("output_b", "bias", "id")],
    "attention": [
        ("query_w", "linear_q.weight", "mha_in"),
        ("key_w", "linear_k.weight", "mha_in"),
        ("value_w", "linear_v.weight", "mha_in"),
        ("gating_w", "linear_g.weight", "mha_in"),
        ("gating_b", "linear_g.bias", "mha_bias"),
        ("output_w", "linear_o.weight", "mha_out"),
        ("output_b", "linear_o.bias", "id"),
    ],
    "global_attention": [
        ("query_w", "linear_q.weight", "mha_in"),
        ("key_w", "linear_k.weight", "T"),
        ("value_w", "linear_v.weight", "T"),
        ("gating_w", "linear_g.weight", "mha_in"),
        ("gating_b", "linear_g.bias", "mha_bias"),
        ("output_w", "linear_o.weight", "mha_out"),
        ("output_b", "linear_o.bias", "id"),
    ],
}


def rows_for(config: cfgs.AlphaFoldConfig) -> list[Row]:
    """Every table row that applies to a model of this configuration."""
    sm = config.structure_module
    rows = [*TABLE["trunk"], *_structure_rows(sm.transition_layers, sm.resnet_blocks), *TABLE["heads"]]
    if config.template.enabled:
        rows += TABLE["templates"]
        if config.template.embed_torsion_angles:
            rows += TABLE["template_angles"]
    if config.heads.tm:
        rows += TABLE["tm_head"]
    return rows


def _leaves(row: Row, model: torch.nn.Module) -> Iterator[Leaf]:
    if row.kind in ("T", "id"):
        yield Leaf(PREFIX + row.af, row.ours, row.kind, row.stack)
        return
    state_keys = _state_keys(model)
    for af_name, our_name, transform in _PARAM_NAMES[row.kind]:
        ours = f"{row.ours}.{our_name}"
        if row.kind == "attention" and our_name.startswith("linear_g") and ours.replace("{i}", "0") not in state_keys:
            continue  # ungated attention (template pointwise attention)
        yield Leaf(f"{PREFIX}{row.af}//{af_name}", ours, transform, row.stack)


def _state_keys(model: torch.nn.Module) -> set[str]:
    cache = getattr(model, "_fastfold_state_keys", None)
    if cache is None:
        cache = set(model.state_dict().keys())
        object.__setattr__(model, "_fastfold_state_keys", cache)
    return cache


def _stack_sizes(config: cfgs.AlphaFoldConfig) -> dict[str, int]:
    return {
        "evoformer": config.evoformer.num_blocks,
        "extra_msa": config.extra_msa.num_blocks,
        "template": config.template.num_blocks,
    }


def leaves_for(model: AlphaFold) -> list[Leaf]:
    """All leaves of `model`, in table order."""
    return [leaf for row in rows_for(model.config) for leaf in _leaves(row, model)]


# ---------------------------------------------------------------------------------------------------------
# Transforms. `to_ours(a)` maps one AlphaFold array (no stack axis); `to_af(t, heads)` inverts it.


def _heads_of(model: AlphaFold, ours_key: str) -> int:
    module = model.get_submodule(ours_key.rsplit(".", 2)[0].replace("{i}", "0"))
    return int(module.heads)


def _to_ours(a: np.ndarray, transform: str) -> np.ndarray:
    if transform == "T":
        return a.T
    if transform in ("mha_in",):
        return a.reshape(a.shape[0], -1).T
    if transform == "mha_bias":
        return a.reshape(-1)
    if transform in ("mha_out", "opm"):
        return a.reshape(-1, a.shape[-1]).T
    return a


def _to_af(t: np.ndarray, transform: str, heads: int | None) -> np.ndarray:
    if transform == "T":
        return t.T
    if transform == "mha_in":
        return t.T.reshape(t.shape[1], heads, -1)
    if transform == "mha_bias":
        return t.reshape(heads, -1)
    if transform == "mha_out":
        return t.T.reshape(heads, -1, t.shape[0])
    if transform == "opm":
        c = int(round(t.shape[1] ** 0.5))
        return t.T.reshape(c, c, t.shape[0])
    return t


def _needs_heads(leaf: Leaf) -> bool:
    return leaf.transform in ("mha_in", "mha_bias", "mha_out")


def _expand(leaf: Leaf, sizes: Mapping[str, int]) -> list[str]:
    return [leaf.ours.replace("{i}", str(i)) for i in range(sizes[leaf.stack])] if leaf.stack else [leaf.ours]


def model_to_arrays(model: AlphaFold) -> dict[str, np.ndarray]:
    """The model's parameters as AlphaFold-named float32 arrays (stacked blocks on a leading axis)."""
    state = {k: v.detach().cpu().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    sizes = _stack_sizes(model.config)
    out = {}
    for leaf in leaves_for(model):
        heads = _heads_of(model, leaf.ours) if _needs_heads(leaf) else None
        arrays = [_to_af(state[k], leaf.transform, heads) for k in _expand(leaf, sizes)]
        out[leaf.af] = np.stack(arrays) if leaf.stack else arrays[0]
    return out


def save_npz(model: AlphaFold, path: str | os.PathLike) -> None:
    """Write `model`'s parameters to `path` in AlphaFold's `.npz` layout, atomically."""
    arrays = model_to_arrays(model)
    with atomic_write(path, "wb") as f:
        np.savez(f, **arrays)


def _shape_to_ours(shape: tuple[int, ...], transform: str) -> tuple[int, ...]:
    """The shape `_to_ours` gives an array of `shape` (without touching any data)."""
    if transform == "T":
        return tuple(reversed(shape))
    if transform == "mha_in":
        return (int(np.prod(shape[1:], dtype=np.int64)), shape[0]) if shape else shape
    if transform == "mha_bias":
        return (int(np.prod(shape, dtype=np.int64)),)
    if transform in ("mha_out", "opm"):
        return (shape[-1], int(np.prod(shape[:-1], dtype=np.int64))) if shape else shape
    return tuple(shape)


def _shapes(arrays: Mapping[str, np.ndarray]) -> Mapping[str, tuple[int, ...]]:
    """Every array's shape, without reading the data of a file-backed mapping (`NpzArrays`)."""
    shapes = getattr(arrays, "shapes", None)
    return shapes if shapes is not None else {k: tuple(np.shape(v)) for k, v in arrays.items()}


def _check_arrays(model: AlphaFold, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Raise one ParamsError listing every missing, mis-shaped and unexpected array (shapes only)."""
    state = model.state_dict()
    sizes = _stack_sizes(model.config)
    missing, misshaped, used, covered = [], [], set(), set()
    for leaf in leaves_for(model):
        keys = _expand(leaf, sizes)
        covered.update(keys)
        if leaf.af not in shapes:
            missing.append(leaf.af)
            continue
        used.add(leaf.af)
        shape = tuple(shapes[leaf.af])
        if leaf.stack and not (len(shape) > 0 and shape[0] == len(keys)):
            misshaped.append(f"{leaf.af}: {shape} has no leading axis of {len(keys)} blocks")
            continue
        part = shape[1:] if leaf.stack else shape
        for key in keys:
            if _shape_to_ours(part, leaf.transform) != tuple(state[key].shape):
                misshaped.append(f"{leaf.af}: {shape} does not fit {key} {tuple(state[key].shape)}")
    unexpected = sorted(set(shapes) - used)
    problems = [f"missing {k}" for k in missing] + [f"mis-shaped {m}" for m in misshaped]
    problems += [f"unexpected {k}" for k in unexpected]
    if problems:
        raise ParamsError(f"{source}: {len(problems)} parameter problem(s):\n  " + "\n  ".join(problems))
    uncovered = sorted(set(state) - covered)
    if uncovered:  # a model module the table does not know: a bug here, not in the file
        raise RuntimeError(f"fastfold.params: no table row for {', '.join(uncovered)}")


def load_npz(model: AlphaFold, arrays: Mapping[str, np.ndarray], source: str = "<arrays>") -> None:
    """Copy AlphaFold-named arrays into `model`. Missing, unexpected or mis-shaped keys raise one
    ParamsError listing all of them, before any parameter is written.

    The arrays are read one at a time (`arrays` may be an `NpzArrays`, which reads each from the file when
    asked) and copied straight into the parameters (converted to their dtype), so loading holds the model
    plus one array, never a second copy of the whole model."""
    _check_arrays(model, _shapes(arrays), source)
    state = model.state_dict()  # tensors sharing the parameters' storage
    sizes = _stack_sizes(model.config)
    with torch.no_grad():
        for leaf in leaves_for(model):
            a = np.asarray(arrays[leaf.af])
            keys = _expand(leaf, sizes)
            for key, part in zip(keys, a if leaf.stack else [a]):
                state[key].copy_(torch.from_numpy(np.ascontiguousarray(_to_ours(part, leaf.transform))))
            del a


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


def _shape_views(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Stand-ins with each shape that hold no data (a broadcast scalar), for reading sizes from shapes."""
    zero = np.zeros((), np.float32)
    return {k: np.broadcast_to(zero, s) for k, s in shapes.items()}


def empty_model(config: cfgs.AlphaFoldConfig) -> AlphaFold:
    """`AlphaFold(config)` built on the meta device and given uninitialised CPU storage: no random
    initialisation to pay for when every parameter is about to be loaded (the model holds no buffers)."""
    with torch.device("meta"):
        model = AlphaFold(config)
    return materialise_empty(model)


M = TypeVar("M", bound=nn.Module)


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
# Sizes from a file.


def _shape(arrays: Mapping[str, np.ndarray], key: str) -> tuple[int, ...]:
    return tuple(np.shape(arrays[PREFIX + key]))


def _count(arrays: Mapping[str, np.ndarray], pattern: str) -> int:
    """How many of `pattern`, `pattern_1`, `pattern_2`, ... exist (pattern has one `{}` for the suffix)."""
    k = 0
    while any(key.startswith(PREFIX + pattern.format(_suffix(k)) + "/") for key in arrays):
        k += 1
    return k


def _stack_config(arrays: Mapping[str, np.ndarray], af: str, base: cfgs.EvoformerStackConfig, extra: bool):
    row = _shape(arrays, f"{af}/msa_row_attention_with_pair_bias/attention//query_w")  # [B, c_m, H, C]
    col_name = "msa_column_global_attention" if extra else "msa_column_attention"
    col = _shape(arrays, f"{af}/{col_name}/attention//query_w")
    tri = _shape(arrays, f"{af}/triangle_attention_starting_node/attention//query_w")  # [B, c_z, H, C]
    return cfgs.EvoformerStackConfig(
        num_blocks=row[0],
        c_m=row[1],
        c_z=tri[1],
        msa_heads=row[2],
        msa_head_dim=row[3],
        column_head_dim=col[3],
        column_attention="global" if extra else "full",
        msa_transition_factor=_shape(arrays, f"{af}/msa_transition/transition1//weights")[2] // row[1],
        opm_channels=_shape(arrays, f"{af}/outer_product_mean/left_projection//weights")[2],
        tri_mul_channels=_shape(arrays, f"{af}/triangle_multiplication_outgoing/left_projection//weights")[2],
        pair_heads=tri[2],
        pair_head_dim=tri[3],
        pair_transition_factor=_shape(arrays, f"{af}/pair_transition/transition1//weights")[2] // tri[1],
        c_s=base.c_s,
    )


def _template_config(arrays: Mapping[str, np.ndarray], base: cfgs.TemplateConfig) -> cfgs.TemplateConfig:
    te = "evoformer/template_embedding"
    if not any(k.startswith(PREFIX + te + "/") for k in arrays):
        return cfgs.TemplateConfig(**{**vars(base), "enabled": False})
    block = f"{te}/single_template_embedding/template_pair_stack/__layer_stack_no_state"
    tri = _shape(arrays, f"{block}/triangle_attention_starting_node/attention//query_w")
    emb = _shape(arrays, f"{te}/single_template_embedding/embedding2d//weights")
    point = _shape(arrays, f"{te}/attention//query_w")
    return cfgs.TemplateConfig(
        **{
            **vars(base),
            "enabled": True,
            "c_t": emb[1],
            "num_blocks": tri[0],
            "pair_heads": tri[2],
            "pair_head_dim": tri[3],
            "tri_mul_channels": _shape(arrays, f"{block}/triangle_multiplication_outgoing/left_projection//weights")[2],
            "pair_transition_factor": _shape(arrays, f"{block}/pair_transition/transition1//weights")[2] // emb[1],
            "pointwise_heads": point[1],
            "pointwise_head_dim": point[2],
            "dgram_bins": emb[0] - (1 + 2 * 22 + 3 + 1),
            "embed_torsion_angles": PREFIX + "evoformer/template_single_embedding//weights" in arrays,
        }
    )


def _structure_config(arrays: Mapping[str, np.ndarray], base: cfgs.StructureModuleConfig, c_z: int):
    ipa = "structure_module/fold_iteration/invariant_point_attention"
    sc = "structure_module/fold_iteration/rigid_sidechain"
    heads = _shape(arrays, f"{ipa}//trainable_point_weights")[0]
    c_s, hq = _shape(arrays, f"{ipa}/q_scalar//weights")
    qk = hq // heads
    p_qk = _shape(arrays, f"{ipa}/q_point_local//weights")[1] // (3 * heads)
    return cfgs.StructureModuleConfig(
        c_s=c_s,
        c_z=c_z,
        num_layers=base.num_layers,
        ipa_heads=heads,
        ipa_scalar_qk=qk,
        ipa_scalar_v=_shape(arrays, f"{ipa}/kv_scalar//weights")[1] // heads - qk,
        ipa_point_qk=p_qk,
        ipa_point_v=_shape(arrays, f"{ipa}/kv_point_local//weights")[1] // (3 * heads) - p_qk,
        transition_layers=_count(arrays, "structure_module/fold_iteration/transition{}"),
        c_resnet=_shape(arrays, f"{sc}/input_projection//weights")[1],
        resnet_blocks=_count(arrays, f"{sc}/resblock1{{}}"),
        position_scale=base.position_scale,
    )


def config_from_arrays(arrays: Mapping[str, np.ndarray], base: cfgs.AlphaFoldConfig) -> cfgs.AlphaFoldConfig:
    """Every architectural size read from AlphaFold-named arrays; the rest (structure-module layers, bin
    edges, pipeline sizes) from `base`. Raises ParamsError naming a key the sizes need but the file lacks."""
    try:
        c_m = _shape(arrays, "evoformer/preprocess_msa//weights")[1]
        c_z = _shape(arrays, "evoformer/left_single//weights")[1]
        evo = _stack_config(arrays, "evoformer/evoformer_iteration", base.evoformer, extra=False)
        evo.c_s = _shape(arrays, "evoformer/single_activations//weights")[1]
        extra = _stack_config(arrays, "evoformer/extra_msa_stack", base.extra_msa, extra=True)
        extra.c_s = evo.c_s
        heads = cfgs.HeadsConfig(
            **{
                **vars(base.heads),
                "plddt_bins": _shape(arrays, "predicted_lddt_head/logits//weights")[1],
                "plddt_channels": _shape(arrays, "predicted_lddt_head/act_0//weights")[1],
                "distogram_bins": _shape(arrays, "distogram_head/half_logits//weights")[1],
                "masked_msa_classes": _shape(arrays, "masked_msa_head/logits//weights")[1],
                "resolved_atoms": _shape(arrays, "experimentally_resolved_head/logits//weights")[1],
                "tm": PREFIX + "predicted_aligned_error_head/logits//weights" in arrays,
            }
        )
        if heads.tm:
            heads.pae_bins = _shape(arrays, "predicted_aligned_error_head/logits//weights")[1]
        return cfgs.AlphaFoldConfig(
            **{
                **{f.name: getattr(base, f.name) for f in cfgs.dataclasses.fields(base)},
                "c_m": c_m,
                "c_z": c_z,
                "c_s": evo.c_s,
                "c_e": extra.c_m,
                "target_feat_dim": _shape(arrays, "evoformer/preprocess_1d//weights")[0],
                "msa_feat_dim": _shape(arrays, "evoformer/preprocess_msa//weights")[0],
                "extra_msa_feat_dim": _shape(arrays, "evoformer/extra_msa_activations//weights")[0],
                "max_relative_feature": (_shape(arrays, "evoformer/pair_activiations//weights")[0] - 1) // 2,
                "recycle_bins": _shape(arrays, "evoformer/prev_pos_linear//weights")[0],
                "evoformer": evo,
                "extra_msa": extra,
                "template": _template_config(arrays, base.template),
                "structure_module": _structure_config(arrays, base.structure_module, c_z),
                "heads": heads,
            }
        )
    except KeyError as exc:
        raise ParamsError(f"missing {exc.args[0]} (needed to read the model sizes)") from None


# ---------------------------------------------------------------------------------------------------------
# Files.

_FILE_NAME = re.compile(r"(?:params_)?(model_[1-5](?:_ptm)?)")

OPENFOLD_RENAMES: list[tuple[str, str]] = [
    (r"^(module\.|model\.)+", ""),
    (r"^template_embedder\.template_single_embedder\.", "template_angle_embedder."),
    (r"^template_embedder\.template_pair_embedder\.linear\.", "template_embedder.template_pair_embedder."),
    (r"\.msa_att_col\._msa_att\.", ".msa_att_col."),
    (r"\.linear_(q|kv)_points\.linear\.", r".linear_\1_points."),
    (r"^structure_module\.transition\.layer_norm\.", "structure_module.layer_norm_transition."),
    (r"^aux_heads\.(distogram|masked_msa|experimentally_resolved|tm)\.linear\.", r"aux_heads.\1."),
]
"""OpenFold state-dict names -> ours (regex, replacement), applied in order."""


def _openfold_key(key: str) -> str:
    for pattern, repl in OPENFOLD_RENAMES:
        key = re.sub(pattern, repl, key)
    m = re.fullmatch(r"structure_module\.transition\.layers\.0\.linear_(\d+)\.(weight|bias)", key)
    if m:
        key = f"structure_module.transition.{int(m.group(1)) - 1}.{m.group(2)}"
    return key


def preset_for(path: str | os.PathLike, preset: str | cfgs.AlphaFoldConfig | None) -> cfgs.AlphaFoldConfig:
    """The preset given (a name or a config), else the one the file name says (`params_model_1_ptm.npz`),
    else the released defaults."""
    if isinstance(preset, cfgs.AlphaFoldConfig):
        return preset
    if preset is None:
        m = _FILE_NAME.fullmatch(Path(path).stem)
        if m:
            preset = m.group(1)
    if preset is None:
        log.info("%s: no preset given or in the file name; using the released model_1 defaults", path)
        return cfgs.AlphaFoldConfig()
    return cfgs.preset(preset)


def _read_openfold(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names; memory-mapped when the file allows (torch's zip format), so
    they occupy the page cache, not a second copy of the model."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
        state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]
    if isinstance(state, Mapping) and "ema" in state and isinstance(state["ema"], Mapping):
        state = state["ema"].get("params", state)
    if not isinstance(state, Mapping):
        raise ParamsError(f"{path}: not a state dict")
    return {_openfold_key(k): v for k, v in state.items() if torch.is_tensor(v)}


def _load_openfold(ours: Mapping[str, torch.Tensor], base: cfgs.AlphaFoldConfig, path: Path) -> AlphaFold:
    """The model from our-named tensors (head counts from the preset), copied tensor by tensor."""
    model = empty_model(_config_from_state(ours, base))
    state = model.state_dict()
    missing = sorted(set(state) - set(ours))
    unexpected = sorted(set(ours) - set(state))
    bad = [k for k in set(ours) & set(state) if tuple(ours[k].shape) != tuple(state[k].shape)]
    problems = [f"missing {k}" for k in missing] + [f"unexpected {k}" for k in unexpected]
    problems += [f"mis-shaped {k} {tuple(ours[k].shape)}" for k in sorted(bad)]
    if problems:
        raise ParamsError(f"{path}: {len(problems)} parameter problem(s):\n  " + "\n  ".join(problems))
    with torch.no_grad():
        for k, v in ours.items():
            state[k].copy_(v)
    return model


def _config_from_state(ours: Mapping[str, torch.Tensor], base: cfgs.AlphaFoldConfig) -> cfgs.AlphaFoldConfig:
    """Block counts and channels from an (our-named) state dict; head counts from the preset."""

    def blocks(prefix: str) -> int:
        idx = [int(m.group(1)) for k in ours if (m := re.match(prefix + r"\.(\d+)\.", k))]
        return max(idx) + 1 if idx else 0

    evo = cfgs.dataclasses.replace(base.evoformer, num_blocks=blocks(r"evoformer\.blocks"))
    extra = cfgs.dataclasses.replace(base.extra_msa, num_blocks=blocks(r"extra_msa_stack\.blocks"))
    n_templ = blocks(r"template_embedder\.template_pair_stack\.blocks")
    templ = cfgs.dataclasses.replace(
        base.template,
        enabled=n_templ > 0,
        num_blocks=n_templ or base.template.num_blocks,
        embed_torsion_angles=any(k.startswith("template_angle_embedder.") for k in ours),
    )
    heads = cfgs.dataclasses.replace(base.heads, tm=any(k.startswith("aux_heads.tm.") for k in ours))
    return cfgs.dataclasses.replace(base, evoformer=evo, extra_msa=extra, template=templ, heads=heads)


def load_model(path: str | os.PathLike, preset: str | cfgs.AlphaFoldConfig | None = None) -> AlphaFold:
    """AlphaFold from a released `.npz` (every size read from the file) or an OpenFold `.pt` checkpoint
    (block counts from the file, other sizes from the preset). float32 parameters, eval mode.

    Streaming: the model is built without initialisation, then the file is read array by array (`.npz`
    members one at a time; a `.pt` memory-mapped) and each is copied into its parameter and dropped, so the
    peak is the model plus one array, not the file's arrays + a converted copy + the model."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: no such parameter file")
    base = preset_for(path, preset)
    if path.suffix in (".pt", ".pth", ".ckpt"):
        return _load_openfold(_read_openfold(path), base, path).eval()
    if path.suffix != ".npz":
        raise ParamsError(f"{path}: unknown parameter file type (expected .npz or an OpenFold .pt)")
    with NpzArrays(path) as arrays:
        try:
            config = config_from_arrays(_shape_views(arrays.shapes), base)
        except ParamsError as exc:
            raise ParamsError(f"{path}: {exc}") from None
        model = empty_model(config)
        load_npz(model, arrays, source=str(path))
    return model.eval()


def from_params(path: str | os.PathLike, preset: str | cfgs.AlphaFoldConfig | None = None) -> AlphaFold:
    """Load AlphaFold's released `.npz` parameters or an OpenFold `.pt` checkpoint.

    Sizes come from the file; `preset` (a name such as "model_1_ptm" or a config; by default taken from a file
    name like `params_model_1_ptm.npz`) supplies the rest: structure-module layers, bin edges, pipeline sizes.
    Missing, unexpected or mis-shaped keys raise one `ParamsError`. Same as `load_model`."""
    return load_model(path, preset)


def save_params(model: AlphaFold, path: str | os.PathLike) -> None:
    """Write `model`'s parameters in AlphaFold's `.npz` layout (atomically). Same as `save_npz`."""
    save_npz(model, path)
