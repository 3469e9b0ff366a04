"""Amber relaxation: lowers the energy, removes the clashes and broken peptide bonds of a perturbed
peptide the test builds from ideal backbone geometry, keeps atoms and B-factors; OpenMM 8 units."""

from __future__ import annotations

import numpy as np
import pytest

from lowmem.fastfold.common import residue_constants as rc
from lowmem.fastfold.io.protein import Protein
from lowmem.fastfold.relax import RelaxConfig, amber, relax_protein
from lowmem.fastfold.relax.violations import find_violations

SEQUENCE = "MKTAYIAG"


def _place(a: np.ndarray, b: np.ndarray, c: np.ndarray, bond: float, angle: float, torsion: float) -> np.ndarray:
    """NeRF: the atom d bonded to c with |cd| = bond, angle bcd and torsion abcd (degrees)."""
    angle, torsion = np.radians(angle), np.radians(torsion)
    bc = (c - b) / np.linalg.norm(c - b)
    n = np.cross(b - a, bc)
    n /= np.linalg.norm(n)
    m = np.stack([bc, np.cross(n, bc), n], axis=1)
    sin = bond * np.sin(angle)
    d = np.array([-bond * np.cos(angle), sin * np.cos(torsion), sin * np.sin(torsion)])
    return c + m @ d


def ideal_backbone(sequence: str, phi: float = -120.0, psi: float = 130.0) -> Protein:
    """N, CA, C, O (and CB) of a peptide with ideal bond lengths and angles (extended strand by default)."""
    n_res = len(sequence)
    pos = np.zeros((n_res, 37, 3))
    mask = np.zeros((n_res, 37))
    N, CA, C, OX, CB = (rc.atom_order[a] for a in ("N", "CA", "C", "O", "CB"))
    n, ca = np.array([0.0, 1.458, 0.0]), np.zeros(3)
    c = _place(np.array([1.0, 2.0, 0.0]), n, ca, 1.525, 111.0, -60.0)
    for i, aa in enumerate(sequence):
        pos[i, N], pos[i, CA], pos[i, C] = n, ca, c
        next_n = _place(n, ca, c, 1.329, 116.2, psi)
        pos[i, OX] = _place(next_n, ca, c, 1.231, 120.5, 180.0)
        mask[i, [N, CA, C, OX]] = 1.0
        if aa != "G":
            pos[i, CB] = _place(c, n, ca, 1.530, 110.5, -122.6)
            mask[i, CB] = 1.0
        next_ca = _place(ca, c, next_n, 1.458, 121.7, 180.0)
        next_c = _place(c, next_n, next_ca, 1.525, 111.0, phi)
        n, ca, c = next_n, next_ca, next_c
    aatype = np.array([rc.restype_order[a] for a in sequence])
    return Protein(pos, mask, aatype, np.arange(1, n_res + 1), np.full((n_res, 37), 70.0))


def test_ideal_backbone_has_no_violations():
    prot = ideal_backbone(SEQUENCE)
    assert not find_violations(prot.atom_positions, prot.atom_mask, prot.aatype, prot.residue_index).any()


def test_violation_check_finds_a_clash_and_a_broken_bond():
    prot = ideal_backbone(SEQUENCE)
    pos = prot.atom_positions.copy()
    pos[5, rc.atom_order["CB"]] = pos[2, rc.atom_order["CA"]] + np.array([0.0, 0.0, 1.0])
    pos[6:, :, :] += np.array([0.6, 0.0, 0.0])  # stretches the 5-6 peptide bond
    bad = find_violations(pos, prot.atom_mask, prot.aatype, prot.residue_index)
    assert bad[2] and bad[5] and bad[6]
    assert not bad[0]


@pytest.mark.slow
@pytest.mark.parametrize("untangle", [False, True], ids=["amber", "untangle-first"])
def test_relax_removes_clashes_and_lowers_energy(untangle, monkeypatch):
    # hydrogen placement varies run to run, and so does whether the start energy crosses the untangle
    # threshold; both paths are tested, the second by lowering the threshold
    if untangle:
        monkeypatch.setattr(amber, "UNTANGLE_ENERGY", 1e3)
    prot = ideal_backbone(SEQUENCE)
    rng = np.random.default_rng(0)
    pos = prot.atom_positions + rng.normal(scale=0.25, size=prot.atom_positions.shape) * prot.atom_mask[..., None]
    pos[5, rc.atom_order["CB"]] = pos[3, rc.atom_order["CA"]] + np.array([0.0, 0.0, 1.2])
    b = np.repeat(np.linspace(40, 90, len(SEQUENCE))[:, None], 37, axis=1)
    perturbed = Protein(pos, prot.atom_mask, prot.aatype, prot.residue_index, b)
    result = relax_protein(perturbed, RelaxConfig(platform="CPU"))
    assert result.violations_before > 0
    assert result.violations_after == 0
    assert result.final_energy < result.initial_energy
    assert 0.0 < result.rmsd < 2.0
    relaxed = result.protein
    # every residue gets its full heavy-atom set (side chains added), plus OXT at the C-terminus
    expected = rc.restype_atom37_mask[prot.aatype].copy()
    expected[-1, rc.atom_order["OXT"]] = 1.0
    np.testing.assert_array_equal(relaxed.atom_mask, expected)
    np.testing.assert_allclose(relaxed.b_factors[:, 0], b[:, 0])


def test_relax_config_validates():
    with pytest.raises(ValueError, match="tolerance"):
        RelaxConfig(tolerance=0)
    with pytest.raises(ValueError, match="platform"):
        RelaxConfig(platform="OpenCL2")


def _perturbed() -> Protein:
    prot = ideal_backbone(SEQUENCE)
    rng = np.random.default_rng(0)
    pos = prot.atom_positions + rng.normal(scale=0.25, size=prot.atom_positions.shape) * prot.atom_mask[..., None]
    pos[5, rc.atom_order["CB"]] = pos[3, rc.atom_order["CA"]] + np.array([0.0, 0.0, 1.2])
    return Protein(pos, prot.atom_mask, prot.aatype, prot.residue_index, prot.b_factors)


def test_same_input_same_relaxed_structure():
    """pdbfixer's hydrogens and side chains (seeded), one CPU thread, deterministic forces: identical twice
    (issue 21: up to 1.6 A apart before)."""
    a, b = (relax_protein(_perturbed(), RelaxConfig(platform="CPU")) for _ in range(2))
    np.testing.assert_array_equal(a.protein.atom_positions, b.protein.atom_positions)
    summary = a.summary()
    assert summary["converged"] and summary["problem"] == "" and summary["stopped"] == "converged"
    assert [p["pass"] for p in summary["passes"]] == list(range(1, a.outer_iterations + 1))
    assert summary["passes"][-1]["violating_residues"] == 0


def test_chirality_and_cis_trans_of_a_structure():
    prot = ideal_backbone(SEQUENCE)
    signs = amber.chirality(prot)
    assert signs.tolist() == [1] * 7 + [0]  # L everywhere; glycine has none
    mirror = Protein(prot.atom_positions * np.array([-1.0, 1.0, 1.0]), prot.atom_mask, prot.aatype,
                     prot.residue_index, prot.b_factors)
    assert amber.chirality(mirror).tolist() == [-1] * 7 + [0]
    assert amber.cis_peptides(prot).tolist() == [-1] * 7 + [0]  # trans; the last residue has no next
    pos = prot.atom_positions.copy()
    pos[4:] += np.array([3.0, 0.0, 0.0])  # a broken bond has no cis/trans
    broken = Protein(pos, prot.atom_mask, prot.aatype, prot.residue_index, prot.b_factors)
    assert amber.cis_peptides(broken)[3] == 0


def test_a_collapsed_start_keeps_its_chirality():
    """Coincident atoms (an untrained model's prediction) used to come apart with D residues."""
    prot = ideal_backbone(SEQUENCE)
    squeezed = Protein(prot.atom_positions * 0.15, prot.atom_mask, prot.aatype, prot.residue_index, prot.b_factors)
    result = relax_protein(squeezed, RelaxConfig(platform="CPU"))
    assert amber.chirality(result.protein)[:-1].tolist() == [1] * 7
    assert result.chirality_changed == [] and "chirality" not in result.problem


def test_problem_names_what_is_wrong():
    prot = ideal_backbone(SEQUENCE)
    base = dict(protein=prot, initial_energy=1.0, final_energy=0.5, violations_before=3, rmsd=0.1, seconds=1.0)
    unconverged = amber.RelaxResult(**base, violations_after=4, outer_iterations=20, stopped="pass limit")
    assert unconverged.problem == "not converged: 4 violating residue(s) after 20 pass(es) (pass limit)"
    flipped = amber.RelaxResult(**base, violations_after=0, outer_iterations=1, chirality_changed=[3, 5])
    assert flipped.problem == "broke the structure: chirality changed at residue(s) 3, 5"
    assert flipped.summary()["converged"] is True  # converged, but broken
