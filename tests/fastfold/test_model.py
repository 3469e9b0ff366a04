"""The whole model (tiny config, float64): options do not change results, invariances, recycling, dtypes."""

from __future__ import annotations

import pytest
import torch

from lowmem.fastfold.common import residue_constants as rc
from lowmem.fastfold.common.rigid import quat_to_rot
from lowmem.fastfold.model import AlphaFold, InferenceOptions, config
from lowmem.fastfold.model.testing import random_batch, randomize_parameters

F64 = torch.float64
KEYS = (
    "final_atom_positions",
    "plddt",
    "distogram_logits",
    "masked_msa_logits",
    "experimentally_resolved_logits",
    "single",
    "pair",
    "msa",
    "predicted_aligned_error",
    "ptm_score",
)


@pytest.fixture(scope="module")
def model():
    return randomize_parameters(AlphaFold(config.tiny()), seed=0).to(F64).eval()


@pytest.fixture(scope="module")
def batch():
    return random_batch(config.tiny(), n_res=9, n_seq=4, n_extra=5, n_templ=2, n_recycle=1, seed=1)


@pytest.fixture(scope="module")
def reference(model, batch):
    with torch.no_grad():
        return model(batch)


def test_output_names_and_shapes(reference):
    n = 9
    assert reference["final_atom_positions"].shape == (n, 37, 3)
    assert reference["final_atom_mask"].shape == (n, 37)
    assert reference["plddt"].shape == (n,) and reference["predicted_aligned_error"].shape == (n, n)
    assert reference["ptm_score"].shape == () and reference["msa"].shape == (4, n, 16)
    assert ((reference["plddt"] >= 0) & (reference["plddt"] <= 100)).all()
    # atoms a residue does not have are zero
    assert (reference["final_atom_positions"][reference["final_atom_mask"] == 0] == 0).all()


@pytest.mark.parametrize(
    "options",
    [
        InferenceOptions(chunk_size=2),
        InferenceOptions(chunk_size=3, residual="in_place"),
        InferenceOptions(chunk_size="auto", memory_budget_bytes=4096),
        InferenceOptions(chunk_size="auto", memory_budget_bytes=4096, residual="in_place"),
        InferenceOptions(chunk_size=1, residual="in_place"),
        InferenceOptions(residual="in_place"),
        InferenceOptions(attention_backend="torch"),
    ],
    ids=["chunk2", "chunk3-inplace", "auto", "auto-inplace", "chunk1-inplace", "inplace", "torch-backend"],
)
def test_options_do_not_change_results(model, batch, reference, options):
    with torch.no_grad():
        out = model(batch, options)
    for k in KEYS:
        torch.testing.assert_close(out[k], reference[k], rtol=1e-10, atol=1e-10, msg=k)


@pytest.fixture(scope="module")
def no_template_model():
    return randomize_parameters(AlphaFold(config.tiny(templates=False)), seed=2).to(F64).eval()


def _cast(model, dtype):
    out = AlphaFold(model.config).to(dtype)
    out.load_state_dict(model.state_dict())  # copies round to the target dtype
    return out.eval()


def test_float32_matches_float64(no_template_model, batch):
    """Without templates (whose distogram bins jump when a distance sits on a bin edge), float32 follows
    float64 to float32 rounding, amplified through the blocks."""
    with torch.no_grad():
        ref = no_template_model(batch)
        out = _cast(no_template_model, torch.float32)(batch)
    for k, tol in (("final_atom_positions", 1e-4), ("plddt", 1e-4), ("pair", 1e-4), ("ptm_score", 1e-5)):
        scale = ref[k].abs().max()
        assert (out[k].double() - ref[k]).abs().max() <= tol * scale, k


def test_bfloat16_runs_close_to_float64(no_template_model, batch):
    """One pass in bfloat16 (8-bit mantissa) stays within a few percent of float64. Recycling is left out:
    bf16 coordinates move recycled distances across distogram bin edges."""
    one_pass = {k: v[..., :1] for k, v in batch.items()}
    with torch.no_grad():
        ref = no_template_model(one_pass)
        out = _cast(no_template_model, torch.bfloat16)(one_pass)
    assert out["final_atom_positions"].dtype == torch.bfloat16
    assert torch.isfinite(out["final_atom_positions"].float()).all()
    for k in ("pair", "single", "plddt"):
        err = (out[k].double() - ref[k]).abs().max() / ref[k].abs().max()
        assert err < 0.05, (k, float(err))


def _move_templates(batch, rot, trans):
    moved = dict(batch)
    for key in ("template_all_atom_positions", "template_pseudo_beta"):
        x = batch[key].double().movedim(-1, 0)  # recycling axis first, xyz last
        moved[key] = (x @ rot.T + trans).movedim(0, -1)
    return moved


def _rotation(seed):
    q = torch.randn(4, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return quat_to_rot(q / q.norm())


def test_invariant_to_global_rotation_of_templates(model, batch, reference):
    """Template features enter through distances, torsion angles and masks: rotating every template atom
    leaves every output unchanged (AlphaFold2 suppl. 1.7.1). The first residue's undefined pre-omega (a frame
    built from two atoms at the origin) is ill-conditioned and changes at 1e-7 under rounding, as in AlphaFold."""
    out = model(_move_templates(batch, _rotation(5), torch.zeros(3, dtype=F64)))
    for k in KEYS:
        torch.testing.assert_close(out[k], reference[k], rtol=1e-5, atol=1e-5, msg=k)
    stretched = dict(batch)
    stretched["template_pseudo_beta"] = batch["template_pseudo_beta"] * 1.3
    assert not torch.allclose(model(stretched)["pair"], reference["pair"])  # the templates do matter


def test_invariant_to_global_translation_without_torsion_features(batch):
    """Translations: exact when the template torsion-angle rows are off. With them, AlphaFold computes the
    (masked-out) pre-omega and phi of the first residue against zero-filled atoms at the origin and still
    feeds their values to the MSA, so those entries move with a translation; we keep that behaviour."""
    cfg = config.tiny()
    cfg.template.embed_torsion_angles = False
    model = randomize_parameters(AlphaFold(cfg), seed=3).to(F64).eval()
    with torch.no_grad():
        ref = model(batch)
        out = model(_move_templates(batch, _rotation(6), 10 * torch.ones(3, dtype=F64)))
    for k in KEYS:
        torch.testing.assert_close(out[k], ref[k], rtol=1e-9, atol=1e-9, msg=k)


def test_recycling_runs_one_pass_per_trailing_entry(model, batch, reference):
    cycle = {k: v[..., 0] for k, v in batch.items()}
    with torch.no_grad():
        first = model.iteration(cycle, None, InferenceOptions())
        prev = {k: first[k] for k in ("msa_first_row", "pair", "final_atom_positions")}
        second = model.iteration({k: v[..., 1] for k, v in batch.items()}, prev, InferenceOptions())
        single = model({k: v[..., :1] for k, v in batch.items()})
    torch.testing.assert_close(second["final_atom_positions"], reference["final_atom_positions"], rtol=0, atol=0)
    torch.testing.assert_close(single["plddt"], first["plddt"], rtol=0, atol=0)
    assert not torch.allclose(first["plddt"], second["plddt"])


def test_recycled_positions_enter_through_pseudo_beta(model):
    """Alg. 32: the previous structure enters as CB distances (CA for glycine) only."""
    emb = model.recycling_embedder
    g = torch.Generator().manual_seed(6)
    aatype = torch.tensor([rc.restype_order["G"], rc.restype_order["A"], rc.restype_order["W"]])
    m1, z = torch.zeros(3, 16, dtype=F64), torch.zeros(3, 3, 8, dtype=F64)
    x = 4 * torch.randn(3, 37, 3, generator=g, dtype=F64)
    base = emb(aatype, m1, z, x)[1]

    def moved(res, atom):
        y = x.clone()
        y[res, rc.atom_order[atom]] += 5.0
        return emb(aatype, m1, z, y)[1]

    torch.testing.assert_close(moved(0, "CB"), base)  # glycine: CB ignored
    torch.testing.assert_close(moved(1, "CA"), base)  # alanine: CA ignored
    torch.testing.assert_close(moved(2, "N"), base)
    assert not torch.allclose(moved(0, "CA"), base) and not torch.allclose(moved(1, "CB"), base)


def test_gating_and_masking_of_padded_msa_rows(model, batch, reference):
    """A masked-out MSA row changes nothing but its own outputs, whatever it contains."""
    padded = dict(batch)
    msa_feat = batch["msa_feat"].clone()
    msa_mask = batch["msa_mask"].clone()
    msa_feat[3] = torch.randn(msa_feat[3].shape, generator=torch.Generator().manual_seed(9))
    msa_mask[3] = 0
    padded["msa_feat"], padded["msa_mask"] = msa_feat, msa_mask
    base = dict(batch)
    base["msa_mask"] = msa_mask
    with torch.no_grad():
        a, b = model(padded), model(base)
    for k in ("final_atom_positions", "plddt", "pair"):
        torch.testing.assert_close(a[k], b[k], rtol=1e-10, atol=1e-10)


def test_missing_feature_is_named(model, batch):
    bad = {k: v for k, v in batch.items() if k != "msa_feat"}
    bad["some_training_label"] = torch.zeros(3)
    with pytest.raises(KeyError, match="msa_feat"):
        model(bad)


def test_inference_options_validate():
    for kwargs in ({"attention_backend": "cuda"}, {"residual": "yes"}):
        with pytest.raises(ValueError, match="InferenceOptions"):
            InferenceOptions(**kwargs)
    # the chunk size has one check and one message wherever it is given (tests/fastfold/test_chunk_size.py)
    for bad in (0, "big", True):
        with pytest.raises(ValueError, match=r"chunk_size must be a positive int or 'auto', got"):
            InferenceOptions(chunk_size=bad)
    with pytest.raises(ValueError, match="column_attention"):
        config.EvoformerStackConfig(column_attention="row")
