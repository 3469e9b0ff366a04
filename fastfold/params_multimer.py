"""AlphaFold-Multimer parameter files (`params_model_N_multimer[_v2|_v3].npz`) <-> `AlphaFoldMultimer`.

The same declarative scheme as `fastfold.params` (one table of rows: AlphaFold haiku path, our module path,
layout kind, stack), with the multimer names:
- `evoformer/~_relative_encoding/position_activations`: the chain-aware relative encoding;
- the template embedder: `single_template_embedding/template_pair_embedding_{0..8}` (distogram, pseudo-beta
  mask, aatype of j, aatype of i, unit vector x, y, z, backbone mask, query pair), `query_embedding_norm`,
  `template_embedding_iteration` (stacked pair blocks), `output_layer_norm`, `template_embedding/output_linear`;
  `template_single_embedding` / `template_projection` for the template MSA rows;
- the structure module's IPA: `{q,k,v}_scalar_projection` (weights `[c_s, H, C]`, no bias) and
  `{q,k,v}_point_projection/point_projection` (weights `[c_s, H, 3P]`, bias `[H, 3P]`); `quat_rigid/rigid`;
- v3 files fuse each triangle multiplication's projections: `left_norm_input`, `projection` and `gate`
  (`[c_z, 2C]`: left half, right half), `center_norm`; v1/v2 files use the monomer names.
Every size is read from the file (`config_from_arrays`); the preset gives the rest (structure-module layers,
`max_relative_chain`, bins, pipeline sizes).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from ..utils.fileio import atomic_write
from . import params as P
from .model import config as cfgs
from .model.multimer import AlphaFoldMultimer, MultimerConfig, multimer_preset

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

PREFIX = P.PREFIX
Row, Leaf, ParamsError = P.Row, P.Leaf, P.ParamsError


# ---------------------------------------------------------------------------------------------------------
# Rows.


def _tri_mul_fused(af: str, ours: str, stack: str, incoming: bool) -> list[Row]:
    left, right = ("b", "a") if incoming else ("a", "b")  # AlphaFold's left half is the supplement's b incoming
    return [
        Row(f"{af}/left_norm_input", f"{ours}.layer_norm_in", "ln", stack),
        Row(f"{af}/projection", f"{ours}.linear_{left}_p|{ours}.linear_{right}_p", "fused", stack),
        Row(f"{af}/gate", f"{ours}.linear_{left}_g|{ours}.linear_{right}_g", "fused", stack),
        Row(f"{af}/center_norm", f"{ours}.layer_norm_out", "ln", stack),
        Row(f"{af}/output_projection", f"{ours}.linear_z", "linear", stack),
        Row(f"{af}/gating_linear", f"{ours}.linear_g", "linear", stack),
    ]


def _pair_rows(af: str, ours: str, stack: str, fused: bool) -> list[Row]:
    if not fused:
        return P._pair_rows(af, ours, stack)
    return [
        *_tri_mul_fused(f"{af}/triangle_multiplication_outgoing", f"{ours}.tri_mul_out", stack, incoming=False),
        *_tri_mul_fused(f"{af}/triangle_multiplication_incoming", f"{ours}.tri_mul_in", stack, incoming=True),
        *P._tri_att(f"{af}/triangle_attention_starting_node", f"{ours}.tri_att_start", stack),
        *P._tri_att(f"{af}/triangle_attention_ending_node", f"{ours}.tri_att_end", stack),
        *P._transition(f"{af}/pair_transition", f"{ours}.pair_transition", stack),
    ]


def _evoformer_block(af: str, ours: str, stack: str, extra: bool, fused: bool) -> list[Row]:
    pair = ("/triangle_", "/pair_transition")
    rows = [r for r in P._evoformer_block(af, ours, stack, extra) if not any(p in r.af for p in pair)]
    return rows + _pair_rows(af, f"{ours}.pair_stack", stack, fused)


def _trunk_rows(fused: bool) -> list[Row]:
    evo = "evoformer"
    return [
        Row(f"{evo}/preprocess_1d", "input_embedder.linear_tf_m", "linear"),
        Row(f"{evo}/preprocess_msa", "input_embedder.linear_msa_m", "linear"),
        Row(f"{evo}/left_single", "input_embedder.linear_tf_z_i", "linear"),
        Row(f"{evo}/right_single", "input_embedder.linear_tf_z_j", "linear"),
        Row(f"{evo}/~_relative_encoding/position_activations", "input_embedder.linear_relpos", "linear"),
        Row(f"{evo}/prev_pos_linear", "recycling_embedder.linear", "linear"),
        Row(f"{evo}/prev_msa_first_row_norm", "recycling_embedder.layer_norm_m", "ln"),
        Row(f"{evo}/prev_pair_norm", "recycling_embedder.layer_norm_z", "ln"),
        Row(f"{evo}/extra_msa_activations", "extra_msa_embedder.linear", "linear"),
        Row(f"{evo}/single_activations", "evoformer.linear", "linear"),
        *_evoformer_block(f"{evo}/extra_msa_stack", "extra_msa_stack.blocks.{i}", "extra_msa", True, fused),
        *_evoformer_block(f"{evo}/evoformer_iteration", "evoformer.blocks.{i}", "evoformer", False, fused),
    ]


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
    rows += _pair_rows(
        f"{ste}/template_embedding_iteration", f"{ours}.template_pair_stack.blocks.{{i}}", "template", fused
    )
    return rows + [
        Row(f"{ste}/output_layer_norm", f"{ours}.template_pair_stack.layer_norm", "ln"),
        Row(f"{te}/output_linear", f"{ours}.linear_t", "linear"),
        Row("evoformer/template_single_embedding", f"{ours}.template_single_embedder.linear_1", "linear"),
        Row("evoformer/template_projection", f"{ours}.template_single_embedder.linear_2", "linear"),
    ]


def _structure_rows(transition_layers: int, resnet_blocks: int) -> list[Row]:
    sm, fold = "structure_module", "structure_module/fold_iteration"
    sc, ipa = f"{fold}/rigid_sidechain", f"{fold}/invariant_point_attention"
    rows = [
        Row(f"{sm}/single_layer_norm", "structure_module.layer_norm_s", "ln"),
        Row(f"{sm}/initial_projection", "structure_module.linear_in", "linear"),
        Row(f"{sm}/pair_layer_norm", "structure_module.layer_norm_z", "ln"),
        Row(f"{ipa}/q_scalar_projection", "structure_module.ipa.linear_q", "mha_linear_nobias"),
        Row(f"{ipa}/k_scalar_projection", "structure_module.ipa.linear_k", "mha_linear_nobias"),
        Row(f"{ipa}/v_scalar_projection", "structure_module.ipa.linear_v", "mha_linear_nobias"),
        Row(f"{ipa}/q_point_projection/point_projection", "structure_module.ipa.linear_q_points", "mha_linear"),
        Row(f"{ipa}/k_point_projection/point_projection", "structure_module.ipa.linear_k_points", "mha_linear"),
        Row(f"{ipa}/v_point_projection/point_projection", "structure_module.ipa.linear_v_points", "mha_linear"),
        Row(f"{ipa}//trainable_point_weights", "structure_module.ipa.head_weights", "id"),
        Row(f"{ipa}/attention_2d", "structure_module.ipa.linear_b", "linear"),
        Row(f"{ipa}/output_projection", "structure_module.ipa.linear_out", "linear"),
        Row(f"{fold}/attention_layer_norm", "structure_module.layer_norm_ipa", "ln"),
        Row(f"{fold}/transition_layer_norm", "structure_module.layer_norm_transition", "ln"),
        Row(f"{fold}/quat_rigid/rigid", "structure_module.bb_update", "linear"),
        Row(f"{sc}/input_projection", "structure_module.angle_resnet.linear_in", "linear"),
        Row(f"{sc}/input_projection_1", "structure_module.angle_resnet.linear_initial", "linear"),
        Row(f"{sc}/unnormalized_angles", "structure_module.angle_resnet.linear_out", "linear"),
    ]
    rows += [
        Row(f"{fold}/transition{P._suffix(k)}", f"structure_module.transition.{k}", "linear")
        for k in range(transition_layers)
    ]
    for k in range(resnet_blocks):
        layer = f"structure_module.angle_resnet.layers.{k}"
        rows.append(Row(f"{sc}/resblock1{P._suffix(k)}", f"{layer}.linear_1", "linear"))
        rows.append(Row(f"{sc}/resblock2{P._suffix(k)}", f"{layer}.linear_2", "linear"))
    return rows


def rows_for(config: MultimerConfig) -> list[Row]:
    """Every table row of a multimer model of this configuration."""
    fused, sm = config.fuse_projection_weights, config.structure_module
    rows = [*_trunk_rows(fused), *_structure_rows(sm.transition_layers, sm.resnet_blocks), *P._HEAD_ROWS]
    if config.template.enabled:
        rows += _template_rows(fused)
    return rows + P._TM_ROWS


# ---------------------------------------------------------------------------------------------------------
# Leaves and transforms.

_EXTRA_NAMES = {
    "mha_linear_nobias": [("weights", "weight", "mha_in")],
    "mha_linear": [("weights", "weight", "mha_in"), ("bias", "bias", "mha_bias")],
}


def _leaves(row: Row, model: AlphaFoldMultimer) -> Iterator[Leaf]:
    if row.kind == "fused":
        left, right = row.ours.split("|")
        yield Leaf(f"{PREFIX}{row.af}//weights", f"{left}.weight", "T0", row.stack)
        yield Leaf(f"{PREFIX}{row.af}//weights", f"{right}.weight", "T1", row.stack)
        yield Leaf(f"{PREFIX}{row.af}//bias", f"{left}.bias", "h0", row.stack)
        yield Leaf(f"{PREFIX}{row.af}//bias", f"{right}.bias", "h1", row.stack)
    elif row.kind in _EXTRA_NAMES:
        for af_name, our_name, transform in _EXTRA_NAMES[row.kind]:
            yield Leaf(f"{PREFIX}{row.af}//{af_name}", f"{row.ours}.{our_name}", transform, row.stack)
    else:
        yield from P._leaves(row, model)


def leaves_for(model: AlphaFoldMultimer) -> list[Leaf]:
    """All leaves of `model`, in table order (a fused AlphaFold array gives two leaves)."""
    return [leaf for row in rows_for(model.config) for leaf in _leaves(row, model)]


def _stack_sizes(config: MultimerConfig) -> dict[str, int]:
    return {
        "evoformer": config.evoformer.num_blocks,
        "extra_msa": config.extra_msa.num_blocks,
        "template": config.template.num_blocks,
    }


def _heads_of(model: AlphaFoldMultimer, ours_key: str) -> int:
    if ours_key.startswith("structure_module.ipa."):
        return model.config.structure_module.ipa_heads
    return P._heads_of(model, ours_key)


def _to_ours(a: np.ndarray, transform: str) -> np.ndarray:
    if transform in ("T0", "T1"):
        c = a.shape[-1] // 2
        return (a[:, :c] if transform == "T0" else a[:, c:]).T
    if transform in ("h0", "h1"):
        c = a.shape[-1] // 2
        return a[:c] if transform == "h0" else a[c:]
    return P._to_ours(a, transform)


def _shape_to_ours(shape: tuple[int, ...], transform: str) -> tuple[int, ...]:
    if transform in ("T0", "T1"):
        return (shape[1] // 2, shape[0]) if len(shape) == 2 and shape[1] % 2 == 0 else (-1,)
    if transform in ("h0", "h1"):
        return (shape[0] // 2,) if len(shape) == 1 and shape[0] % 2 == 0 else (-1,)
    return P._shape_to_ours(shape, transform)


def _expand(leaf: Leaf, sizes: Mapping[str, int]) -> list[str]:
    return [leaf.ours.replace("{i}", str(i)) for i in range(sizes[leaf.stack])] if leaf.stack else [leaf.ours]


def model_to_arrays(model: AlphaFoldMultimer) -> dict[str, np.ndarray]:
    """The model's parameters as AlphaFold-Multimer-named float32 arrays (stacked blocks on a leading axis)."""
    state = {k: v.detach().cpu().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    sizes = _stack_sizes(model.config)
    halves: dict[str, dict[str, list[np.ndarray]]] = {}
    out = {}
    for leaf in leaves_for(model):
        keys = _expand(leaf, sizes)
        if leaf.transform in ("T0", "T1", "h0", "h1"):
            arrays = [state[k].T if leaf.transform[0] == "T" else state[k] for k in keys]
            halves.setdefault(leaf.af, {})[leaf.transform[1]] = arrays
            if len(halves[leaf.af]) == 2:
                pairs = zip(halves[leaf.af]["0"], halves[leaf.af]["1"])
                joined = [np.concatenate([a, b], axis=-1) for a, b in pairs]
                out[leaf.af] = np.stack(joined) if leaf.stack else joined[0]
            continue
        heads = _heads_of(model, leaf.ours) if leaf.transform in ("mha_in", "mha_bias", "mha_out") else None
        arrays = [P._to_af(state[k], leaf.transform, heads) for k in keys]
        out[leaf.af] = np.stack(arrays) if leaf.stack else arrays[0]
    return out


def save_npz(model: AlphaFoldMultimer, path: str | os.PathLike) -> None:
    """Write `model`'s parameters to `path` in AlphaFold-Multimer's `.npz` layout, atomically."""
    arrays = model_to_arrays(model)
    with atomic_write(path, "wb") as f:
        np.savez(f, **arrays)


def _check_arrays(model: AlphaFoldMultimer, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    state = model.state_dict()
    sizes = _stack_sizes(model.config)
    missing, misshaped, used, covered = [], [], set(), set()
    for leaf in leaves_for(model):
        keys = _expand(leaf, sizes)
        covered.update(keys)
        if leaf.af not in shapes:
            if leaf.af not in missing:
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
    problems = [f"missing {k}" for k in missing] + [f"mis-shaped {m}" for m in dict.fromkeys(misshaped)]
    problems += [f"unexpected {k}" for k in sorted(set(shapes) - used)]
    if problems:
        raise ParamsError(f"{source}: {len(problems)} parameter problem(s):\n  " + "\n  ".join(problems))
    uncovered = sorted(set(state) - covered)
    if uncovered:
        raise RuntimeError(f"fastfold.params_multimer: no table row for {', '.join(uncovered)}")


def load_npz(model: AlphaFoldMultimer, arrays: Mapping[str, np.ndarray], source: str = "<arrays>") -> None:
    """Copy AlphaFold-Multimer-named arrays into `model` (each array read once, copied, dropped). Missing,
    unexpected or mis-shaped keys raise one ParamsError listing all of them, before any parameter is written."""
    _check_arrays(model, P._shapes(arrays), source)
    state = model.state_dict()
    sizes = _stack_sizes(model.config)
    by_key: dict[str, list[Leaf]] = {}
    for leaf in leaves_for(model):
        by_key.setdefault(leaf.af, []).append(leaf)
    with torch.no_grad():
        for af, leaves in by_key.items():
            a = np.asarray(arrays[af])
            for leaf in leaves:
                keys = _expand(leaf, sizes)
                for key, part in zip(keys, a if leaf.stack else [a]):
                    state[key].copy_(torch.from_numpy(np.ascontiguousarray(_to_ours(part, leaf.transform))))
            del a


# ---------------------------------------------------------------------------------------------------------
# Sizes from a file.


def _shape(arrays: Mapping[str, np.ndarray], key: str) -> tuple[int, ...]:
    return tuple(np.shape(arrays[PREFIX + key]))


def _tri_mul_channels(arrays: Mapping[str, np.ndarray], af: str) -> tuple[int, bool]:
    """(hidden channels, fused?) of the stack's outgoing triangle multiplication."""
    fused_key = f"{PREFIX}{af}/triangle_multiplication_outgoing/projection//weights"
    if fused_key in arrays:
        return int(np.shape(arrays[fused_key])[-1]) // 2, True
    return _shape(arrays, f"{af}/triangle_multiplication_outgoing/left_projection//weights")[-1], False


def _stack_config(arrays: Mapping[str, np.ndarray], af: str, c_s: int, extra: bool) -> cfgs.EvoformerStackConfig:
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
        tri_mul_channels=_tri_mul_channels(arrays, af)[0],
        pair_heads=tri[2],
        pair_head_dim=tri[3],
        pair_transition_factor=_shape(arrays, f"{af}/pair_transition/transition1//weights")[2] // tri[1],
        c_s=c_s,
    )


def _template_config(arrays: Mapping[str, np.ndarray], base: cfgs.TemplateConfig) -> cfgs.TemplateConfig:
    ste = "evoformer/template_embedding/single_template_embedding"
    if not any(k.startswith(PREFIX + ste + "/") for k in arrays):
        return cfgs.TemplateConfig(**{**vars(base), "enabled": False})
    it = f"{ste}/template_embedding_iteration"
    tri = _shape(arrays, f"{it}/triangle_attention_starting_node/attention//query_w")  # [B, c_t, H, C]
    dgram = _shape(arrays, f"{ste}/template_pair_embedding_0//weights")  # [bins, c_t]
    return cfgs.TemplateConfig(
        **{
            **vars(base),
            "enabled": True,
            "c_t": dgram[1],
            "num_blocks": tri[0],
            "pair_heads": tri[2],
            "pair_head_dim": tri[3],
            "tri_mul_channels": _tri_mul_channels(arrays, it)[0],
            "pair_transition_factor": _shape(arrays, f"{it}/pair_transition/transition1//weights")[2] // dgram[1],
            "dgram_bins": dgram[0],
        }
    )


def _structure_config(arrays: Mapping[str, np.ndarray], base: cfgs.StructureModuleConfig, c_z: int):
    ipa = "structure_module/fold_iteration/invariant_point_attention"
    sc = "structure_module/fold_iteration/rigid_sidechain"
    c_s, heads, qk = _shape(arrays, f"{ipa}/q_scalar_projection//weights")
    return cfgs.StructureModuleConfig(
        c_s=c_s,
        c_z=c_z,
        num_layers=base.num_layers,
        ipa_heads=heads,
        ipa_scalar_qk=qk,
        ipa_scalar_v=_shape(arrays, f"{ipa}/v_scalar_projection//weights")[2],
        ipa_point_qk=_shape(arrays, f"{ipa}/q_point_projection/point_projection//weights")[2] // 3,
        ipa_point_v=_shape(arrays, f"{ipa}/v_point_projection/point_projection//weights")[2] // 3,
        transition_layers=P._count(arrays, "structure_module/fold_iteration/transition{}"),
        c_resnet=_shape(arrays, f"{sc}/input_projection//weights")[1],
        resnet_blocks=P._count(arrays, f"{sc}/resblock1{{}}"),
        position_scale=base.position_scale,
    )


def config_from_arrays(arrays: Mapping[str, np.ndarray], base: MultimerConfig) -> MultimerConfig:
    """Every architectural size read from AlphaFold-Multimer-named arrays; the rest from `base`
    (`max_relative_chain` too: the relative encoding's width is 2 r + 2 c + 5 and r is read given c)."""
    try:
        c_z = _shape(arrays, "evoformer/left_single//weights")[1]
        c_s = _shape(arrays, "evoformer/single_activations//weights")[1]
        evo = _stack_config(arrays, "evoformer/evoformer_iteration", c_s, extra=False)
        extra = _stack_config(arrays, "evoformer/extra_msa_stack", c_s, extra=True)
        relpos = _shape(arrays, "evoformer/~_relative_encoding/position_activations//weights")[0]
        max_rel, odd = divmod(relpos - 5 - 2 * base.max_relative_chain, 2)
        if odd or max_rel < 0:
            raise ParamsError(
                f"the relative encoding has {relpos} channels, not 2 r + 2 * {base.max_relative_chain} + 5"
            )
        heads = cfgs.HeadsConfig(
            **{
                **vars(base.heads),
                "plddt_bins": _shape(arrays, "predicted_lddt_head/logits//weights")[1],
                "plddt_channels": _shape(arrays, "predicted_lddt_head/act_0//weights")[1],
                "distogram_bins": _shape(arrays, "distogram_head/half_logits//weights")[1],
                "masked_msa_classes": _shape(arrays, "masked_msa_head/logits//weights")[1],
                "resolved_atoms": _shape(arrays, "experimentally_resolved_head/logits//weights")[1],
                "pae_bins": _shape(arrays, "predicted_aligned_error_head/logits//weights")[1],
                "tm": True,
            }
        )
        return MultimerConfig(
            **{
                **{f.name: getattr(base, f.name) for f in cfgs.dataclasses.fields(base)},
                "c_m": _shape(arrays, "evoformer/preprocess_msa//weights")[1],
                "c_z": c_z,
                "c_s": c_s,
                "c_e": extra.c_m,
                "target_feat_dim": _shape(arrays, "evoformer/preprocess_1d//weights")[0],
                "msa_feat_dim": _shape(arrays, "evoformer/preprocess_msa//weights")[0],
                "extra_msa_feat_dim": _shape(arrays, "evoformer/extra_msa_activations//weights")[0],
                "max_relative_feature": max_rel,
                "recycle_bins": _shape(arrays, "evoformer/prev_pos_linear//weights")[0],
                "fuse_projection_weights": _tri_mul_channels(arrays, "evoformer/evoformer_iteration")[1],
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


def empty_model(config: MultimerConfig) -> AlphaFoldMultimer:
    """`AlphaFoldMultimer(config)` built on the meta device, given uninitialised CPU storage."""
    with torch.device("meta"):
        model = AlphaFoldMultimer(config)
    return P.materialise_empty(model)


def load_model(path: str | os.PathLike, preset: str | MultimerConfig | None = None) -> AlphaFoldMultimer:
    """AlphaFoldMultimer from an AlphaFold-Multimer `.npz` (every size read from the file, arrays streamed one
    at a time into the parameters). float32 parameters, eval mode."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: no such parameter file")
    if path.suffix != ".npz":
        raise ParamsError(f"{path}: unknown parameter file type (expected an AlphaFold-Multimer .npz)")
    base = preset_for(path, preset)
    with P.NpzArrays(path) as arrays:
        try:
            config = config_from_arrays(P._shape_views(arrays.shapes), base)
        except ParamsError as exc:
            raise ParamsError(f"{path}: {exc}") from None
        model = empty_model(config)
        load_npz(model, arrays, source=str(path))
    return model.eval()


def expected_layout(config: MultimerConfig) -> dict[str, tuple[int, ...]]:
    """AlphaFold-Multimer key -> array shape for a model of `config` (built on the meta device, no data)."""
    with torch.device("meta"):
        model = AlphaFoldMultimer(config)
    state = model.state_dict()
    sizes = _stack_sizes(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for leaf in leaves_for(model):
        ours = tuple(state[_expand(leaf, sizes)[0]].shape)
        if leaf.transform in ("T0", "T1"):
            shape = (ours[1], 2 * ours[0])
        elif leaf.transform in ("h0", "h1"):
            shape = (2 * ours[0],)
        elif leaf.transform == "T":
            shape = tuple(reversed(ours))
        elif leaf.transform in ("mha_in", "mha_bias", "mha_out", "opm"):
            heads = _heads_of(model, leaf.ours) if leaf.transform != "opm" else None
            shape = P._to_af(np.broadcast_to(np.zeros((), np.float32), ours), leaf.transform, heads).shape
        else:
            shape = ours
        shapes[leaf.af] = ((sizes[leaf.stack],) if leaf.stack else ()) + tuple(shape)
    return shapes
