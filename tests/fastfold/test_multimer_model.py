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
from lowmem.fastfold.params import multimer as PM

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


@pytest.mark.parametrize("name", ["model_1_multimer_v3", "model_1_multimer_v2"])
def test_released_layout_names_and_shapes(name: str) -> None:
    want = json.loads((ASSETS / "released_layout.json").read_text())[name]
    got = PM.expected_layout(multimer_preset(name))
    assert sorted(got) == sorted(want)
    assert {k: list(v) for k, v in got.items()} == want
    # sizes read back from shapes alone give the preset again
    views = {k: np.broadcast_to(np.zeros((), np.float32), tuple(v)) for k, v in want.items()}
    assert PM.config_from_arrays(views, multimer_preset(name)) == multimer_preset(name)


@pytest.mark.parametrize("fuse", [True, False])
def test_npz_round_trip_and_bad_file(tmp_path: Path, fuse: bool) -> None:
    torch.manual_seed(0)
    model = AlphaFoldMultimer(multimer_tiny(fuse=fuse))
    PM.save_npz(model, tmp_path / "p.npz")
    back = PM.load_model(tmp_path / "p.npz", multimer_tiny(fuse=fuse))
    assert back.config.fuse_projection_weights == fuse
    for k, v in model.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    arrays = dict(np.load(tmp_path / "p.npz"))
    key = next(k for k in arrays if k.endswith("quat_rigid/rigid//weights"))
    arrays[key] = arrays[key][:, :5]
    arrays["alphafold/alphafold_iteration/extra//w"] = np.zeros(2, np.float32)
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ParamsError, match=r"mis-shaped .*quat_rigid(.|\n)*unexpected .*extra//w"):
        PM.load_model(tmp_path / "bad.npz", multimer_tiny(fuse=fuse))


def test_chain_relative_encoding_by_hand() -> None:
    cfg = multimer_tiny()  # r = 4, c = 1: bins 0..9 offset / other chain, 10 same entity, 11..13 sym, 14 other
    emb = MultimerInputEmbedder(cfg).double()
    w = torch.randn(cfg.c_z, 15, dtype=torch.float64)
    with torch.no_grad():
        emb.linear_relpos.weight.copy_(w)
        emb.linear_relpos.bias.zero_()
    # chains: A (entity 1, sym 1) residues 0..5, A' (entity 1, sym 2) 0..1, B (entity 2) 0..1
    f = {
        "residue_index": torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 0, 1]),
        "asym_id": torch.tensor([1] * 6 + [2, 2, 3, 3]),
        "entity_id": torch.tensor([1] * 8 + [2, 2]),
        "sym_id": torch.tensor([1] * 6 + [2, 2, 1, 1]),
    }
    rel = emb.relpos(f, 0, 10, torch.float64)

    def expect(bins: list[int]) -> torch.Tensor:
        return sum(w[:, b] for b in bins)

    assert torch.allclose(rel[0, 5], expect([0, 10, 12]))  # 0 - 5 clipped to -4 -> bin 0; same entity, sym 0
    assert torch.allclose(rel[5, 0], expect([8, 10, 12]))  # +5 -> +4 -> 8
    assert torch.allclose(rel[2, 3], expect([3, 10, 12]))  # -1 -> bin 3
    assert torch.allclose(rel[0, 6], expect([9, 10, 11]))  # other chain, same entity, sym 1 - 2 = -1 -> 11
    assert torch.allclose(rel[6, 0], expect([9, 10, 13]))
    assert torch.allclose(rel[0, 8], expect([9, 14]))  # other entity: no entity bit, bin 14


def test_iptm_counts_only_interface_pairs() -> None:
    heads = HeadsConfig(pae_bins=4, pae_max_error_bin=3.0, tm=True)
    n = 20
    logits = torch.full((n, n, 4), -1e9, dtype=torch.float64)
    asym = torch.tensor([1] * 10 + [2] * 10)
    same = asym[:, None] == asym[None, :]
    logits[..., 0][same] = 0.0  # intra-chain pairs: certain of the first bin (centre 0.75 A)
    logits[..., 3][~same] = 0.0  # interface pairs: the last bin (centre 5.25 A; breaks 0, 1.5, 3)
    w = torch.ones(n, dtype=torch.float64)
    d0 = 1.24 * (n - 15) ** (1 / 3) - 1.8
    tm = lambda e: 1 / (1 + (e / d0) ** 2)  # noqa: E731
    # rel_tol: the 1e-8 in the pair-weight normaliser
    assert math.isclose(compute_tm(logits, heads, w, asym).item(), tm(5.25), rel_tol=1e-8)
    assert math.isclose(compute_tm(logits, heads, w).item(), (tm(0.75) + tm(5.25)) / 2, rel_tol=1e-8)
