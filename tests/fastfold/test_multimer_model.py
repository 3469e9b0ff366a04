"""The AlphaFold-Multimer model (issue 22): float64 parity with OpenFold's multimer model on random weights in
AlphaFold-Multimer's .npz layout (tests/assets/multimer_model, how they were made in its README), the parameter
layout of the released v3 files, the chain-aware relative encoding, ipTM and the early stop by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lowmem.fastfold import params_multimer as PM
from lowmem.fastfold.model.config import EvoformerStackConfig, HeadsConfig, StructureModuleConfig, TemplateConfig
from lowmem.fastfold.model.multimer import (
    AlphaFoldMultimer,
    MultimerConfig,
    MultimerInputEmbedder,
    compute_tm,
    multimer_preset,
    multimer_tiny,
)
from lowmem.fastfold.params import ParamsError

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "multimer_model"


def parity_config(tolerance: float = -1.0) -> MultimerConfig:
    """The shrunk widths of the parity weights (every width distinct where the layout allows)."""
    c_m, c_z, c_s, c_e = 16, 12, 20, 8

    def stack(c: int, blocks: int, heads: int, head_dim: int, column: str) -> EvoformerStackConfig:
        return EvoformerStackConfig(
            num_blocks=blocks, c_m=c, c_z=c_z, msa_heads=heads, msa_head_dim=head_dim, column_head_dim=head_dim,
            column_attention=column, msa_transition_factor=2, opm_channels=4, tri_mul_channels=6, pair_heads=3,
            pair_head_dim=4, pair_transition_factor=2, c_s=c_s,
        )

    return MultimerConfig(
        c_m=c_m, c_z=c_z, c_s=c_s, c_e=c_e, max_relative_feature=5, max_relative_chain=2,
        recycle_early_stop_tolerance=tolerance,
        evoformer=stack(c_m, 2, 2, 5, "full"),
        extra_msa=stack(c_e, 1, 2, 4, "global"),
        template=TemplateConfig(c_t=6, num_blocks=2, pair_heads=2, pair_head_dim=3, tri_mul_channels=5,
                                pair_transition_factor=2),
        structure_module=StructureModuleConfig(
            c_s=c_s, c_z=c_z, num_layers=3, ipa_heads=3, ipa_scalar_qk=4, ipa_scalar_v=4, ipa_point_qk=2,
            ipa_point_v=3, c_resnet=8, position_scale=20.0,
        ),
        heads=HeadsConfig(plddt_bins=20, plddt_channels=8, distogram_bins=16, pae_bins=16, masked_msa_classes=22,
                          tm=True),
    )


CASES = json.loads((ASSETS / "cases.json").read_text()) if (ASSETS / "cases.json").exists() else {}


@pytest.fixture(scope="module")
def parity_model() -> AlphaFoldMultimer:
    model = PM.load_model(ASSETS / "params_model_1_multimer_v3.npz", parity_config())
    assert model.config == parity_config()  # every width read back from the file
    return model.double()


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_with_openfold_float64(parity_model: AlphaFoldMultimer, case: str) -> None:
    parity_model.config.recycle_early_stop_tolerance = CASES[case]["tolerance"]
    batch = {k: torch.from_numpy(v) for k, v in np.load(ASSETS / f"batch_{case}.npz").items()}
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    ref = np.load(ASSETS / f"openfold_{case}.npz")
    with torch.no_grad():
        out = parity_model(batch)
    assert int(out["num_recycles"]) + 1 == int(ref["num_passes"])
    for key in ("final_atom_positions", "plddt", "predicted_aligned_error", "ptm_score", "iptm_score",
                "ranking_confidence"):
        got, want = out[key].numpy(), ref[key]
        scale = max(np.abs(want).max(), 1e-12)
        assert np.abs(got - want).max() <= 1e-6 * scale, (key, np.abs(got - want).max() / scale)
