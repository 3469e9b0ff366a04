"""AlphaFold parameter names <-> fastfold.model module paths: the pieces both models' tables are built from.

A table is a list of rows, one per module: AlphaFold's haiku path (under `PREFIX`), our module path, the layout
kind, and the stack the module repeats in (the Evoformer, extra-MSA and template pair stacks carry a leading
block axis in AlphaFold's files and one module per block here; `{i}` in our path is the block). A row expands
to leaves, one per parameter, each with the transform between the two layouts. `fastfold.params.monomer` holds the
AlphaFold2 table, `fastfold.params.multimer` the AlphaFold-Multimer one; `fastfold.params.arrays` moves the arrays
and `fastfold.params.sizes` reads a model's sizes from a file's names and shapes.

Layout kinds (AlphaFold -> ours):
- `linear`: `weights [in, out]` -> `weight [out, in]`, `bias` as is; `T`: one transposed array; `id`: as is;
- `ln`: `scale`, `offset` -> `weight`, `bias`;
- `attention`: `query_w/key_w/value_w/gating_w [in, H, C]` -> `[H*C, in]`, `gating_b [H, C]` -> `[H*C]`,
  `output_w [H, C, out]` -> `[out, H*C]` (Alg. 7); ungated attention has no `gating_*`;
- `global_attention`: as `attention`, with single-head `key_w/value_w [in, C]` (Alg. 19);
- `opm_out`: `output_w [c, c, out]` -> `[out, c*c]` (Alg. 10);
- AlphaFold-Multimer only: `mha_linear` / `mha_linear_nobias`, its IPA projections, `weights [in, H, C]` ->
  `[H*C, in]` and `bias [H, C]` -> `[H*C]`; `fused` (v3 files), a triangle multiplication's left and right
  projections in one `[in, 2C]` array (left half, right half) -> our two linears.
The incoming triangle multiplication's left/right projections are the supplement's b/a (Alg. 12).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ...utils.errors import InputError

__all__ = ["PREFIX", "Leaf", "ParamsError", "Row"]

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


@dataclass(frozen=True)
class Leaf:
    """One parameter: AlphaFold key, our state-dict key, transform, stack name."""

    af: str
    ours: str
    transform: str
    stack: str | None


def suffix(k: int) -> str:
    """Haiku names repeated modules `name`, `name_1`, `name_2`, ..."""
    return f"_{k}" if k else ""


# ---------------------------------------------------------------------------------------------------------
# Rows shared by both models.


def attention_rows(af: str, ours: str, stack: str | None) -> list[Row]:
    return [
        Row(f"{af}/query_norm", f"{ours}.layer_norm_m", "ln", stack),
        Row(f"{af}/attention", f"{ours}.mha", "attention", stack),
    ]


def tri_mul(af: str, ours: str, stack: str, incoming: bool, fused: bool = False) -> list[Row]:
    """A triangle multiplication; `fused`: AlphaFold-Multimer v3's names, one array for both projections
    (and one for both gates), left half first."""
    a, b = ("b", "a") if incoming else ("a", "b")  # AlphaFold's "left" is the supplement's b when incoming
    if fused:
        norms = ("left_norm_input", "center_norm")
        projections = [
            Row(f"{af}/{what}", f"{ours}.linear_{a}_{w}|{ours}.linear_{b}_{w}", "fused", stack)
            for what, w in (("projection", "p"), ("gate", "g"))
        ]
    else:
        norms = ("layer_norm_input", "center_layer_norm")
        projections = [
            Row(f"{af}/{side}_{what}", f"{ours}.linear_{x}_{w}", "linear", stack)
            for what, w in (("projection", "p"), ("gate", "g"))
            for side, x in (("left", a), ("right", b))
        ]
    return [
        Row(f"{af}/{norms[0]}", f"{ours}.layer_norm_in", "ln", stack),
        *projections,
        Row(f"{af}/{norms[1]}", f"{ours}.layer_norm_out", "ln", stack),
        Row(f"{af}/output_projection", f"{ours}.linear_z", "linear", stack),
        Row(f"{af}/gating_linear", f"{ours}.linear_g", "linear", stack),
    ]


def tri_att(af: str, ours: str, stack: str) -> list[Row]:
    return [
        Row(f"{af}/query_norm", f"{ours}.layer_norm", "ln", stack),
        Row(f"{af}//feat_2d_weights", f"{ours}.linear.weight", "T", stack),
        Row(f"{af}/attention", f"{ours}.mha", "attention", stack),
    ]


def transition(af: str, ours: str, stack: str | None) -> list[Row]:
    return [
        Row(f"{af}/input_layer_norm", f"{ours}.layer_norm", "ln", stack),
        Row(f"{af}/transition1", f"{ours}.linear_1", "linear", stack),
        Row(f"{af}/transition2", f"{ours}.linear_2", "linear", stack),
    ]


def pair_rows(af: str, ours: str, stack: str, fused: bool = False, attention_first: bool = False) -> list[Row]:
    """A `PairStack` (the Evoformer's pair half, or one template pair block), its modules in running order."""
    multiplications = [
        *tri_mul(f"{af}/triangle_multiplication_outgoing", f"{ours}.tri_mul_out", stack, False, fused),
        *tri_mul(f"{af}/triangle_multiplication_incoming", f"{ours}.tri_mul_in", stack, True, fused),
    ]
    attentions = [
        *tri_att(f"{af}/triangle_attention_starting_node", f"{ours}.tri_att_start", stack),
        *tri_att(f"{af}/triangle_attention_ending_node", f"{ours}.tri_att_end", stack),
    ]
    updates = attentions + multiplications if attention_first else multiplications + attentions
    return [*updates, *transition(f"{af}/pair_transition", f"{ours}.pair_transition", stack)]


def evoformer_block(af: str, ours: str, stack: str, extra: bool, fused: bool = False) -> list[Row]:
    row = f"{af}/msa_row_attention_with_pair_bias"
    rows = [
        *attention_rows(row, f"{ours}.msa_att_row", stack),
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
        rows += attention_rows(f"{af}/msa_column_attention", f"{ours}.msa_att_col", stack)
    opm = f"{af}/outer_product_mean"
    return rows + [
        *transition(f"{af}/msa_transition", f"{ours}.msa_transition", stack),
        Row(f"{opm}/layer_norm_input", f"{ours}.outer_product_mean.layer_norm", "ln", stack),
        Row(f"{opm}/left_projection", f"{ours}.outer_product_mean.linear_1", "linear", stack),
        Row(f"{opm}/right_projection", f"{ours}.outer_product_mean.linear_2", "linear", stack),
        Row(opm, f"{ours}.outer_product_mean.linear_out", "opm_out", stack),
        *pair_rows(af, f"{ours}.pair_stack", stack, fused),
    ]


def trunk_rows(relpos: str, fused: bool = False) -> list[Row]:
    """Embedders, extra-MSA stack and Evoformer. relpos: AlphaFold's name of the relative encoding's linear
    (AlphaFold-Multimer's chain-aware encoding has another); fused: AlphaFold-Multimer v3's projections."""
    evo = "evoformer"
    return [
        Row(f"{evo}/preprocess_1d", "input_embedder.linear_tf_m", "linear"),
        Row(f"{evo}/preprocess_msa", "input_embedder.linear_msa_m", "linear"),
        Row(f"{evo}/left_single", "input_embedder.linear_tf_z_i", "linear"),
        Row(f"{evo}/right_single", "input_embedder.linear_tf_z_j", "linear"),
        Row(f"{evo}/{relpos}", "input_embedder.linear_relpos", "linear"),
        Row(f"{evo}/prev_pos_linear", "recycling_embedder.linear", "linear"),
        Row(f"{evo}/prev_msa_first_row_norm", "recycling_embedder.layer_norm_m", "ln"),
        Row(f"{evo}/prev_pair_norm", "recycling_embedder.layer_norm_z", "ln"),
        Row(f"{evo}/extra_msa_activations", "extra_msa_embedder.linear", "linear"),
        Row(f"{evo}/single_activations", "evoformer.linear", "linear"),
        *evoformer_block(f"{evo}/extra_msa_stack", "extra_msa_stack.blocks.{i}", "extra_msa", True, fused),
        *evoformer_block(f"{evo}/evoformer_iteration", "evoformer.blocks.{i}", "evoformer", False, fused),
    ]


SM, FOLD = "structure_module", "structure_module/fold_iteration"
IPA, SIDECHAIN = f"{FOLD}/invariant_point_attention", f"{FOLD}/rigid_sidechain"


def structure_rows(projections: list[Row], update: Row, transition_layers: int, resnet_blocks: int) -> list[Row]:
    """The structure module given its IPA's q/k/v projections and its backbone update, which AlphaFold2 and
    AlphaFold-Multimer name and lay out differently."""
    rows = [
        Row(f"{SM}/single_layer_norm", "structure_module.layer_norm_s", "ln"),
        Row(f"{SM}/initial_projection", "structure_module.linear_in", "linear"),
        Row(f"{SM}/pair_layer_norm", "structure_module.layer_norm_z", "ln"),
        *projections,
        Row(f"{IPA}//trainable_point_weights", "structure_module.ipa.head_weights", "id"),
        Row(f"{IPA}/attention_2d", "structure_module.ipa.linear_b", "linear"),
        Row(f"{IPA}/output_projection", "structure_module.ipa.linear_out", "linear"),
        Row(f"{FOLD}/attention_layer_norm", "structure_module.layer_norm_ipa", "ln"),
        Row(f"{FOLD}/transition_layer_norm", "structure_module.layer_norm_transition", "ln"),
        update,
        Row(f"{SIDECHAIN}/input_projection", "structure_module.angle_resnet.linear_in", "linear"),
        Row(f"{SIDECHAIN}/input_projection_1", "structure_module.angle_resnet.linear_initial", "linear"),
        Row(f"{SIDECHAIN}/unnormalized_angles", "structure_module.angle_resnet.linear_out", "linear"),
    ]
    rows += [
        Row(f"{FOLD}/transition{suffix(k)}", f"structure_module.transition.{k}", "linear")
        for k in range(transition_layers)
    ]
    for k in range(resnet_blocks):
        layer = f"structure_module.angle_resnet.layers.{k}"
        rows.append(Row(f"{SIDECHAIN}/resblock1{suffix(k)}", f"{layer}.linear_1", "linear"))
        rows.append(Row(f"{SIDECHAIN}/resblock2{suffix(k)}", f"{layer}.linear_2", "linear"))
    return rows


HEAD_ROWS = [
    Row("predicted_lddt_head/input_layer_norm", "aux_heads.plddt.layer_norm", "ln"),
    Row("predicted_lddt_head/act_0", "aux_heads.plddt.linear_1", "linear"),
    Row("predicted_lddt_head/act_1", "aux_heads.plddt.linear_2", "linear"),
    Row("predicted_lddt_head/logits", "aux_heads.plddt.linear_3", "linear"),
    Row("distogram_head/half_logits", "aux_heads.distogram", "linear"),
    Row("masked_msa_head/logits", "aux_heads.masked_msa", "linear"),
    Row("experimentally_resolved_head/logits", "aux_heads.experimentally_resolved", "linear"),
]
TM_ROWS = [Row("predicted_aligned_error_head/logits", "aux_heads.tm", "linear")]


# ---------------------------------------------------------------------------------------------------------
# Leaves and transforms. `to_ours(a)` maps one AlphaFold array (no stack axis); `to_af(t, heads)` inverts it.

_ATTENTION_IN = [("query_w", "linear_q.weight", "mha_in")]
_ATTENTION_OUT = [
    ("gating_w", "linear_g.weight", "mha_in"),
    ("gating_b", "linear_g.bias", "mha_bias"),
    ("output_w", "linear_o.weight", "mha_out"),
    ("output_b", "linear_o.bias", "id"),
]
PARAM_NAMES = {
    "linear": [("weights", "weight", "T"), ("bias", "bias", "id")],
    "ln": [("scale", "weight", "id"), ("offset", "bias", "id")],
    "opm_out": [("output_w", "weight", "opm"), ("output_b", "bias", "id")],
    "attention": [
        *_ATTENTION_IN,
        ("key_w", "linear_k.weight", "mha_in"),
        ("value_w", "linear_v.weight", "mha_in"),
        *_ATTENTION_OUT,
    ],
    "global_attention": [  # single-head keys and values (Alg. 19)
        *_ATTENTION_IN,
        ("key_w", "linear_k.weight", "T"),
        ("value_w", "linear_v.weight", "T"),
        *_ATTENTION_OUT,
    ],
    "mha_linear_nobias": [("weights", "weight", "mha_in")],
    "mha_linear": [("weights", "weight", "mha_in"), ("bias", "bias", "mha_bias")],
}
"""Layout kind -> (AlphaFold parameter, our parameter under the row's module, transform) per leaf."""

HALVES = ("T0", "T1", "h0", "h1")
"""The transforms of a `fused` array's halves: weights (transposed) and biases, left (0) and right (1)."""
HEADED = ("mha_in", "mha_bias", "mha_out")
"""The transforms that need the module's head count to go back to AlphaFold's layout."""


def leaves(row: Row, model: torch.nn.Module) -> Iterator[Leaf]:
    """The leaves of one row (`model` says whether an attention is gated)."""
    if row.kind in ("T", "id"):
        yield Leaf(PREFIX + row.af, row.ours, row.kind, row.stack)
        return
    if row.kind == "fused":
        left, right = row.ours.split("|")
        for part, ours, half in (("weights", "weight", "T"), ("bias", "bias", "h")):
            yield Leaf(f"{PREFIX}{row.af}//{part}", f"{left}.{ours}", f"{half}0", row.stack)
            yield Leaf(f"{PREFIX}{row.af}//{part}", f"{right}.{ours}", f"{half}1", row.stack)
        return
    state_keys = _state_keys(model)
    for af_name, our_name, transform in PARAM_NAMES[row.kind]:
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


def heads_of(model: torch.nn.Module, ours_key: str) -> int:
    """The head count of the attention module holding parameter `ours_key`."""
    module = model.get_submodule(ours_key.rsplit(".", 2)[0].replace("{i}", "0"))
    return int(module.heads)


def to_ours(a: np.ndarray, transform: str) -> np.ndarray:
    if transform == "T":
        return a.T
    if transform == "mha_in":
        return a.reshape(a.shape[0], -1).T
    if transform == "mha_bias":
        return a.reshape(-1)
    if transform in ("mha_out", "opm"):
        return a.reshape(-1, a.shape[-1]).T
    if transform in HALVES:
        c = a.shape[-1] // 2
        half = a[..., :c] if transform[1] == "0" else a[..., c:]
        return half.T if transform[0] == "T" else half
    return a


def to_af(t: np.ndarray, transform: str, heads: int | None) -> np.ndarray:
    """AlphaFold's layout of one parameter (a `fused` half: that half, transposed back for weights)."""
    if transform in ("T", "T0", "T1"):
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


def shape_to_ours(shape: tuple[int, ...], transform: str) -> tuple[int, ...]:
    """The shape `to_ours` gives an array of `shape` (without touching any data); (-1,) where it cannot."""
    if transform == "T":
        return tuple(reversed(shape))
    if transform == "mha_in":
        return (int(np.prod(shape[1:], dtype=np.int64)), shape[0]) if shape else shape
    if transform == "mha_bias":
        return (int(np.prod(shape, dtype=np.int64)),)
    if transform in ("mha_out", "opm"):
        return (shape[-1], int(np.prod(shape[:-1], dtype=np.int64))) if shape else shape
    if transform in ("T0", "T1"):
        return (shape[1] // 2, shape[0]) if len(shape) == 2 and shape[1] % 2 == 0 else (-1,)
    if transform in ("h0", "h1"):
        return (shape[0] // 2,) if len(shape) == 1 and shape[0] % 2 == 0 else (-1,)
    return tuple(shape)


def shape_to_af(shape: tuple[int, ...], transform: str, heads: int | None) -> tuple[int, ...]:
    """The AlphaFold shape of a parameter of `shape` (no stack axis; a `fused` half gives the whole array)."""
    if transform in ("T0", "T1"):
        return (shape[1], 2 * shape[0])
    if transform in ("h0", "h1"):
        return (2 * shape[0],)
    return tuple(to_af(np.broadcast_to(np.zeros((), np.float32), shape), transform, heads).shape)
