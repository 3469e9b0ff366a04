"""AlphaFold parameter files <-> fastfold.model modules, through one declarative table.

`TABLE` lists, module by module, AlphaFold's released parameter name (`params_model_{1..5}[_ptm].npz`,
keys `alphafold/alphafold_iteration/<module path>//<param>`) beside our module path and how the arrays
differ in layout (the kinds and the row builders are in `fastfold.params.table`). The same table loads
(`load_npz`) and writes (`save_npz`) the `.npz` layout, so a round trip is exact; the checking, streaming and
writing are `fastfold.params.arrays`'s, shared with `fastfold.params.multimer`. `from_params(path, preset)`
builds a model from a file and `save_params(model, path)` writes one; this module imports the model, never
the other way round.

OpenFold `.pt` checkpoints are read with `torch.load(weights_only=True)`; their module names differ from
ours in a few places, renamed by `OPENFOLD_RENAMES`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..model import config as cfgs
from ..model.alphafold import AlphaFold
from . import sizes
from .arrays import NpzArrays, ParamLayout, materialise_empty, problems_error
from .table import (
    FOLD,
    HEAD_ROWS,
    IPA,
    PREFIX,
    TM_ROWS,
    Leaf,
    ParamsError,
    Row,
    pair_rows,
    structure_rows,
    trunk_rows,
)

__all__ = [
    "OPENFOLD_RENAMES",
    "PREFIX",
    "TABLE",
    "Leaf",
    "NpzArrays",
    "ParamsError",
    "Row",
    "check_openfold",
    "config_from_arrays",
    "empty_model",
    "from_params",
    "leaves_for",
    "load_model",
    "load_npz",
    "materialise_empty",
    "model_to_arrays",
    "preset_for",
    "rows_for",
    "save_npz",
    "save_params",
]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------
# The AlphaFold2 table.


def _template_rows() -> list[Row]:
    te = "evoformer/template_embedding"
    ste = f"{te}/single_template_embedding"
    block = f"{ste}/template_pair_stack/__layer_stack_no_state"
    return [
        Row(f"{ste}/embedding2d", "template_embedder.template_pair_embedder", "linear"),
        *pair_rows(block, "template_embedder.template_pair_stack.blocks.{i}", "template", attention_first=True),
        Row(f"{ste}/output_layer_norm", "template_embedder.template_pair_stack.layer_norm", "ln"),
        Row(f"{te}/attention", "template_embedder.template_pointwise_att.mha", "attention"),
    ]


def _structure_rows(transition_layers: int, resnet_blocks: int) -> list[Row]:
    ipa = "structure_module.ipa"
    projections = [
        Row(f"{IPA}/q_scalar", f"{ipa}.linear_q", "linear"),
        Row(f"{IPA}/kv_scalar", f"{ipa}.linear_kv", "linear"),
        Row(f"{IPA}/q_point_local", f"{ipa}.linear_q_points", "linear"),
        Row(f"{IPA}/kv_point_local", f"{ipa}.linear_kv_points", "linear"),
    ]
    update = Row(f"{FOLD}/affine_update", "structure_module.bb_update.linear", "linear")
    return structure_rows(projections, update, transition_layers, resnet_blocks)


_ANGLE_ROWS = [
    Row("evoformer/template_single_embedding", "template_angle_embedder.linear_1", "linear"),
    Row("evoformer/template_projection", "template_angle_embedder.linear_2", "linear"),
]
_RELPOS = "pair_activiations"  # sic: AlphaFold's spelling

TABLE: dict[str, list[Row]] = {
    "trunk": trunk_rows(_RELPOS),
    "templates": _template_rows(),
    "template_angles": _ANGLE_ROWS,
    "structure_module": _structure_rows(3, 2),
    "heads": HEAD_ROWS,
    "tm_head": TM_ROWS,
}
"""The rows for the released architecture (3 transition layers, 2 resnet blocks in the structure module);
`rows_for(config)` gives the rows of any configuration."""


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


LAYOUT = ParamLayout(AlphaFold, rows_for, "fastfold.params.monomer")
"""AlphaFold2's parameters <-> AlphaFold-named arrays (`fastfold.params.arrays`)."""
leaves_for, model_to_arrays, save_npz, load_npz, empty_model = (
    LAYOUT.leaves_for, LAYOUT.model_to_arrays, LAYOUT.save_npz, LAYOUT.load_npz, LAYOUT.empty_model
)


# ---------------------------------------------------------------------------------------------------------
# Sizes from a file.


def _template_config(arrays: Mapping[str, np.ndarray], base: cfgs.TemplateConfig) -> cfgs.TemplateConfig:
    te = "evoformer/template_embedding"
    if not sizes.has_module(arrays, te):
        return replace(base, enabled=False)
    emb = sizes.shape(arrays, f"{te}/single_template_embedding/embedding2d//weights")  # [features, c_t]
    point = sizes.shape(arrays, f"{te}/attention//query_w")  # [c_z, H, C]
    block = f"{te}/single_template_embedding/template_pair_stack/__layer_stack_no_state"
    return replace(
        base,
        enabled=True,
        **sizes.template_stack(arrays, block, emb[1]),
        pointwise_heads=point[1],
        pointwise_head_dim=point[2],
        dgram_bins=emb[0] - (1 + 2 * 22 + 3 + 1),
        embed_torsion_angles=PREFIX + "evoformer/template_single_embedding//weights" in arrays,
    )


def _ipa_sizes(arrays: Mapping[str, np.ndarray]) -> dict[str, int]:
    """AlphaFold2's IPA: q and kv projections, all heads' points coordinate-major."""
    heads = sizes.shape(arrays, f"{IPA}//trainable_point_weights")[0]
    c_s, hq = sizes.shape(arrays, f"{IPA}/q_scalar//weights")
    qk = hq // heads
    p_qk = sizes.shape(arrays, f"{IPA}/q_point_local//weights")[1] // (3 * heads)
    return {
        "c_s": c_s,
        "ipa_heads": heads,
        "ipa_scalar_qk": qk,
        "ipa_scalar_v": sizes.shape(arrays, f"{IPA}/kv_scalar//weights")[1] // heads - qk,
        "ipa_point_qk": p_qk,
        "ipa_point_v": sizes.shape(arrays, f"{IPA}/kv_point_local//weights")[1] // (3 * heads) - p_qk,
    }


def config_from_arrays(arrays: Mapping[str, np.ndarray], base: cfgs.AlphaFoldConfig) -> cfgs.AlphaFoldConfig:
    """Every architectural size read from AlphaFold-named arrays; the rest (structure-module layers, bin
    edges, pipeline sizes) from `base`. Raises ParamsError naming a key the sizes need but the file lacks."""
    with sizes.reading():
        trunk = sizes.trunk(arrays)
        return replace(
            base,
            **trunk,
            max_relative_feature=(sizes.shape(arrays, f"evoformer/{_RELPOS}//weights")[0] - 1) // 2,
            template=_template_config(arrays, base.template),
            structure_module=sizes.structure_module(arrays, base.structure_module, trunk["c_z"], **_ipa_sizes(arrays)),
            heads=sizes.heads(arrays, base.heads, tm=None),
        )


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


def _openfold_problems(ours: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> list[str]:
    missing = sorted(set(state) - set(ours))
    unexpected = sorted(set(ours) - set(state))
    bad = [k for k in set(ours) & set(state) if tuple(ours[k].shape) != tuple(state[k].shape)]
    problems = [f"missing {k}" for k in missing] + [f"unexpected {k}" for k in unexpected]
    return problems + [f"mis-shaped {k} {tuple(ours[k].shape)}" for k in sorted(bad)]


def check_openfold(path: str | os.PathLike, preset: str | cfgs.AlphaFoldConfig | None = None) -> None:
    """An OpenFold `.pt` checkpoint's tensor names and shapes against the model it fills (built on the meta
    device: nothing is loaded or allocated); the same `ParamsError` as `load_model`, before any work."""
    path = Path(path)
    try:
        ours = _read_openfold(path)
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        if isinstance(exc, ParamsError):
            raise
        raise ParamsError(f"{path}: not a readable PyTorch checkpoint ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    with torch.device("meta"):
        model = AlphaFold(_config_from_state(ours, preset_for(path, preset)))
    problems = _openfold_problems(ours, model.state_dict())
    if problems:
        raise problems_error(str(path), problems)


def _load_openfold(ours: Mapping[str, torch.Tensor], base: cfgs.AlphaFoldConfig, path: Path) -> AlphaFold:
    """The model from our-named tensors (head counts from the preset), copied tensor by tensor."""
    model = empty_model(_config_from_state(ours, base))
    state = model.state_dict()
    problems = _openfold_problems(ours, state)
    if problems:
        raise problems_error(str(path), problems)
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
    return LAYOUT.load_file(path, base, config_from_arrays)


def from_params(path: str | os.PathLike, preset: str | cfgs.AlphaFoldConfig | None = None) -> AlphaFold:
    """Load AlphaFold's released `.npz` parameters or an OpenFold `.pt` checkpoint.

    Sizes come from the file; `preset` (a name such as "model_1_ptm" or a config; by default taken from a file
    name like `params_model_1_ptm.npz`) supplies the rest: structure-module layers, bin edges, pipeline sizes.
    Missing, unexpected or mis-shaped keys raise one `ParamsError`. Same as `load_model`."""
    return load_model(path, preset)


def save_params(model: AlphaFold, path: str | os.PathLike) -> None:
    """Write `model`'s parameters in AlphaFold's `.npz` layout (atomically). Same as `save_npz`."""
    save_npz(model, path)
