"""A model's sizes from the shapes of AlphaFold-named arrays (a file's headers are enough, no data is read).

The readers of what AlphaFold2 and AlphaFold-Multimer files name alike; each model's `config_from_arrays`
(`fastfold.params`, `fastfold.params.multimer`) adds what its files name differently. A missing key raises
KeyError, which `config_from_arrays` turns into a ParamsError naming it (`reading`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..model import config as cfgs
from .table import FOLD, PREFIX, SIDECHAIN, ParamsError, suffix

__all__ = [
    "count",
    "has_module",
    "heads",
    "msa_stack",
    "reading",
    "shape",
    "structure_module",
    "template_stack",
    "tri_mul_channels",
    "trunk",
]


@contextmanager
def reading() -> Iterator[None]:
    """Turns a KeyError (a key the sizes need, missing from the file) into a ParamsError naming it."""
    try:
        yield
    except KeyError as exc:
        raise ParamsError(f"missing {exc.args[0]} (needed to read the model sizes)") from None


def shape(arrays: Mapping[str, np.ndarray], key: str) -> tuple[int, ...]:
    """The shape of the array `PREFIX + key`."""
    return tuple(np.shape(arrays[PREFIX + key]))


def has_module(arrays: Mapping[str, np.ndarray], af: str) -> bool:
    """Whether the file holds any parameter under AlphaFold path `af`."""
    return any(k.startswith(PREFIX + af + "/") for k in arrays)


def count(arrays: Mapping[str, np.ndarray], pattern: str) -> int:
    """How many of `pattern`, `pattern_1`, `pattern_2`, ... exist (pattern has one `{}` for the suffix)."""
    k = 0
    while has_module(arrays, pattern.format(suffix(k))):
        k += 1
    return k


def tri_mul_channels(arrays: Mapping[str, np.ndarray], af: str) -> tuple[int, bool]:
    """(hidden channels, fused?) of the stack's outgoing triangle multiplication."""
    fused_key = f"{PREFIX}{af}/triangle_multiplication_outgoing/projection//weights"
    if fused_key in arrays:
        return int(np.shape(arrays[fused_key])[-1]) // 2, True
    return shape(arrays, f"{af}/triangle_multiplication_outgoing/left_projection//weights")[-1], False


def msa_stack(arrays: Mapping[str, np.ndarray], af: str, c_s: int, extra: bool) -> cfgs.EvoformerStackConfig:
    """The sizes of the Evoformer (or, `extra`, the extra-MSA) stack under AlphaFold path `af`."""
    row = shape(arrays, f"{af}/msa_row_attention_with_pair_bias/attention//query_w")  # [B, c_m, H, C]
    col_name = "msa_column_global_attention" if extra else "msa_column_attention"
    col = shape(arrays, f"{af}/{col_name}/attention//query_w")
    tri = shape(arrays, f"{af}/triangle_attention_starting_node/attention//query_w")  # [B, c_z, H, C]
    return cfgs.EvoformerStackConfig(
        num_blocks=row[0],
        c_m=row[1],
        c_z=tri[1],
        msa_heads=row[2],
        msa_head_dim=row[3],
        column_head_dim=col[3],
        column_attention="global" if extra else "full",
        msa_transition_factor=shape(arrays, f"{af}/msa_transition/transition1//weights")[2] // row[1],
        opm_channels=shape(arrays, f"{af}/outer_product_mean/left_projection//weights")[2],
        tri_mul_channels=tri_mul_channels(arrays, af)[0],
        pair_heads=tri[2],
        pair_head_dim=tri[3],
        pair_transition_factor=shape(arrays, f"{af}/pair_transition/transition1//weights")[2] // tri[1],
        c_s=c_s,
    )


def template_stack(arrays: Mapping[str, np.ndarray], af: str, c_t: int) -> dict[str, Any]:
    """The `TemplateConfig` fields of the template pair stack (stacked blocks under AlphaFold path `af`)."""
    tri = shape(arrays, f"{af}/triangle_attention_starting_node/attention//query_w")  # [B, c_t, H, C]
    return {
        "c_t": c_t,
        "num_blocks": tri[0],
        "pair_heads": tri[2],
        "pair_head_dim": tri[3],
        "tri_mul_channels": tri_mul_channels(arrays, af)[0],
        "pair_transition_factor": shape(arrays, f"{af}/pair_transition/transition1//weights")[2] // c_t,
    }


def trunk(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The `AlphaFoldConfig` fields of the embedders and both MSA stacks (their names are the same in both
    models' files)."""
    c_s = shape(arrays, "evoformer/single_activations//weights")[1]
    extra = msa_stack(arrays, "evoformer/extra_msa_stack", c_s, extra=True)
    return {
        "c_m": shape(arrays, "evoformer/preprocess_msa//weights")[1],
        "c_z": shape(arrays, "evoformer/left_single//weights")[1],
        "c_s": c_s,
        "c_e": extra.c_m,
        "target_feat_dim": shape(arrays, "evoformer/preprocess_1d//weights")[0],
        "msa_feat_dim": shape(arrays, "evoformer/preprocess_msa//weights")[0],
        "extra_msa_feat_dim": shape(arrays, "evoformer/extra_msa_activations//weights")[0],
        "recycle_bins": shape(arrays, "evoformer/prev_pos_linear//weights")[0],
        "evoformer": msa_stack(arrays, "evoformer/evoformer_iteration", c_s, extra=False),
        "extra_msa": extra,
    }


def structure_module(
    arrays: Mapping[str, np.ndarray], base: cfgs.StructureModuleConfig, c_z: int, **ipa: int
) -> cfgs.StructureModuleConfig:
    """The structure module's sizes given its IPA's (`c_s`, `ipa_*`, read by each model from its own names);
    the number of layers and the position scale from `base`."""
    return cfgs.StructureModuleConfig(
        c_z=c_z,
        num_layers=base.num_layers,
        transition_layers=count(arrays, f"{FOLD}/transition{{}}"),
        c_resnet=shape(arrays, f"{SIDECHAIN}/input_projection//weights")[1],
        resnet_blocks=count(arrays, f"{SIDECHAIN}/resblock1{{}}"),
        position_scale=base.position_scale,
        **ipa,
    )


def heads(arrays: Mapping[str, np.ndarray], base: cfgs.HeadsConfig, tm: bool | None) -> cfgs.HeadsConfig:
    """The output heads' sizes; `tm`: whether the PAE head must be there (None: if the file has it)."""
    tm = PREFIX + "predicted_aligned_error_head/logits//weights" in arrays if tm is None else tm
    sizes = {
        "plddt_bins": shape(arrays, "predicted_lddt_head/logits//weights")[1],
        "plddt_channels": shape(arrays, "predicted_lddt_head/act_0//weights")[1],
        "distogram_bins": shape(arrays, "distogram_head/half_logits//weights")[1],
        "masked_msa_classes": shape(arrays, "masked_msa_head/logits//weights")[1],
        "resolved_atoms": shape(arrays, "experimentally_resolved_head/logits//weights")[1],
        "tm": tm,
    }
    if tm:
        sizes["pae_bins"] = shape(arrays, "predicted_aligned_error_head/logits//weights")[1]
    return cfgs.HeadsConfig(**{**vars(base), **sizes})
