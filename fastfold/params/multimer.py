"""AlphaFold-Multimer parameter files (`params_model_N_multimer[_v2|_v3].npz`) <-> `AlphaFoldMultimer`.

The same declarative scheme as `fastfold.params` (rows from `fastfold.params.table`; checking, streaming and
writing by `fastfold.params.arrays`), with the names where AlphaFold-Multimer's files differ from AlphaFold2's:
- `evoformer/~_relative_encoding/position_activations`: the chain-aware relative encoding;
- the template embedder: `single_template_embedding/template_pair_embedding_{0..8}` (distogram, pseudo-beta
  mask, aatype of j, aatype of i, unit vector x, y, z, backbone mask, query pair), `query_embedding_norm`,
  `template_embedding_iteration` (stacked pair blocks, Evoformer order), `output_layer_norm`,
  `template_embedding/output_linear`; `template_single_embedding` / `template_projection` for the template
  MSA rows; no pointwise attention;
- the structure module's IPA: `{q,k,v}_scalar_projection` (weights `[c_s, H, C]`, no bias) and
  `{q,k,v}_point_projection/point_projection` (weights `[c_s, H, 3P]`, bias `[H, 3P]`); `quat_rigid/rigid`;
- v3 files fuse each triangle multiplication's projections: `left_norm_input`, `projection` and `gate`
  (`[c_z, 2C]`: left half, right half), `center_norm`; v1/v2 files use the monomer names;
- the PAE head always.
Every size is read from the file (`config_from_arrays`); the preset gives the rest (structure-module layers,
`max_relative_chain`, bins, pipeline sizes).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..model import config as cfgs
from ..model.multimer import AlphaFoldMultimer, MultimerConfig, multimer_preset
from . import sizes
from .arrays import ParamLayout
from .table import FOLD, HEAD_ROWS, IPA, TM_ROWS, ParamsError, Row, pair_rows, structure_rows, trunk_rows

__all__ = [
    "config_from_arrays",
    "empty_model",
    "expected_layout",
    "leaves_for",
    "load_model",
    "load_npz",
    "model_to_arrays",
    "rows_for",
    "save_npz",
]

# ---------------------------------------------------------------------------------------------------------
# The AlphaFold-Multimer table.

_RELPOS = "~_relative_encoding/position_activations"

_PAIR_EMBEDDINGS = [
    "dgram_linear",
    "pseudo_beta_mask_linear",
    "aatype_linear_1",
    "aatype_linear_2",
    "x_linear",
    "y_linear",
    "z_linear",
    "backbone_mask_linear",
    "query_embedding_linear",
]
"""Our names of AlphaFold-Multimer's `template_pair_embedding_0` .. `_8`, in that order."""


def _template_rows(fused: bool) -> list[Row]:
    te = "evoformer/template_embedding"
    ste = f"{te}/single_template_embedding"
    ours = "template_embedder"
    emb = f"{ours}.template_pair_embedder"
    rows = [Row(f"{ste}/query_embedding_norm", f"{emb}.query_embedding_layer_norm", "ln")]
    rows += [
        Row(f"{ste}/template_pair_embedding_{k}", f"{emb}.{name}", "linear") for k, name in enumerate(_PAIR_EMBEDDINGS)
    ]
    blocks = f"{ours}.template_pair_stack.blocks.{{i}}"
    rows += pair_rows(f"{ste}/template_embedding_iteration", blocks, "template", fused)  # Evoformer order
    return rows + [
        Row(f"{ste}/output_layer_norm", f"{ours}.template_pair_stack.layer_norm", "ln"),
        Row(f"{te}/output_linear", f"{ours}.linear_t", "linear"),
        Row("evoformer/template_single_embedding", f"{ours}.template_single_embedder.linear_1", "linear"),
        Row("evoformer/template_projection", f"{ours}.template_single_embedder.linear_2", "linear"),
    ]


def _structure_rows(transition_layers: int, resnet_blocks: int) -> list[Row]:
    ipa = "structure_module.ipa"
    projections = [Row(f"{IPA}/{x}_scalar_projection", f"{ipa}.linear_{x}", "mha_linear_nobias") for x in "qkv"]
    projections += [
        Row(f"{IPA}/{x}_point_projection/point_projection", f"{ipa}.linear_{x}_points", "mha_linear") for x in "qkv"
    ]
    update = Row(f"{FOLD}/quat_rigid/rigid", "structure_module.bb_update", "linear")
    return structure_rows(projections, update, transition_layers, resnet_blocks)


def rows_for(config: MultimerConfig) -> list[Row]:
    """Every table row of a multimer model of this configuration."""
    fused, sm = config.fuse_projection_weights, config.structure_module
    rows = [*trunk_rows(_RELPOS, fused), *_structure_rows(sm.transition_layers, sm.resnet_blocks), *HEAD_ROWS]
    if config.template.enabled:
        rows += _template_rows(fused)
    return rows + TM_ROWS


LAYOUT = ParamLayout(AlphaFoldMultimer, rows_for, "fastfold.params.multimer")
"""AlphaFold-Multimer's parameters <-> AlphaFold-Multimer-named arrays (`fastfold.params.arrays`)."""
leaves_for, model_to_arrays, save_npz, load_npz, empty_model, expected_layout = (
    LAYOUT.leaves_for, LAYOUT.model_to_arrays, LAYOUT.save_npz, LAYOUT.load_npz, LAYOUT.empty_model,
    LAYOUT.expected_layout,
)


# ---------------------------------------------------------------------------------------------------------
# Sizes from a file.


def _template_config(arrays: Mapping[str, np.ndarray], base: cfgs.TemplateConfig) -> cfgs.TemplateConfig:
    ste = "evoformer/template_embedding/single_template_embedding"
    if not sizes.has_module(arrays, ste):
        return replace(base, enabled=False)
    dgram = sizes.shape(arrays, f"{ste}/template_pair_embedding_0//weights")  # [bins, c_t]
    stack = sizes.template_stack(arrays, f"{ste}/template_embedding_iteration", dgram[1])
    return replace(base, enabled=True, **stack, dgram_bins=dgram[0])


def _ipa_sizes(arrays: Mapping[str, np.ndarray]) -> dict[str, int]:
    """AlphaFold-Multimer's IPA: per-head q/k/v projections."""
    c_s, heads, qk = sizes.shape(arrays, f"{IPA}/q_scalar_projection//weights")
    return {
        "c_s": c_s,
        "ipa_heads": heads,
        "ipa_scalar_qk": qk,
        "ipa_scalar_v": sizes.shape(arrays, f"{IPA}/v_scalar_projection//weights")[2],
        "ipa_point_qk": sizes.shape(arrays, f"{IPA}/q_point_projection/point_projection//weights")[2] // 3,
        "ipa_point_v": sizes.shape(arrays, f"{IPA}/v_point_projection/point_projection//weights")[2] // 3,
    }


def config_from_arrays(arrays: Mapping[str, np.ndarray], base: MultimerConfig) -> MultimerConfig:
    """Every architectural size read from AlphaFold-Multimer-named arrays; the rest from `base`
    (`max_relative_chain` too: the relative encoding's width is 2 r + 2 c + 5 and r is read given c)."""
    with sizes.reading():
        trunk = sizes.trunk(arrays)
        relpos = sizes.shape(arrays, f"evoformer/{_RELPOS}//weights")[0]
        max_rel, odd = divmod(relpos - 5 - 2 * base.max_relative_chain, 2)
        if odd or max_rel < 0:
            raise ParamsError(
                f"the relative encoding has {relpos} channels, not 2 r + 2 * {base.max_relative_chain} + 5"
            )
        return replace(
            base,
            **trunk,
            max_relative_feature=max_rel,
            fuse_projection_weights=sizes.tri_mul_channels(arrays, "evoformer/evoformer_iteration")[1],
            template=_template_config(arrays, base.template),
            structure_module=sizes.structure_module(arrays, base.structure_module, trunk["c_z"], **_ipa_sizes(arrays)),
            heads=sizes.heads(arrays, base.heads, tm=True),  # the PAE head always
        )


# ---------------------------------------------------------------------------------------------------------
# Files.

_FILE_NAME = re.compile(r"(?:params_)?(model_[1-5]_multimer(?:_v2|_v3)?)")


def preset_for(path: str | os.PathLike, preset: str | MultimerConfig | None) -> MultimerConfig:
    """The preset given (a name or a config), else the one the file name says
    (`params_model_1_multimer_v3.npz`), else the released v3 defaults."""
    if isinstance(preset, MultimerConfig):
        return preset
    if preset is None:
        m = _FILE_NAME.fullmatch(Path(path).stem)
        preset = m.group(1) if m else "model_1_multimer_v3"
    return multimer_preset(preset)


def load_model(path: str | os.PathLike, preset: str | MultimerConfig | None = None) -> AlphaFoldMultimer:
    """AlphaFoldMultimer from an AlphaFold-Multimer `.npz` (every size read from the file, arrays streamed one
    at a time into the parameters). float32 parameters, eval mode."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: no such parameter file")
    if path.suffix != ".npz":
        raise ParamsError(f"{path}: unknown parameter file type (expected an AlphaFold-Multimer .npz)")
    return LAYOUT.load_file(path, preset_for(path, preset), config_from_arrays)
