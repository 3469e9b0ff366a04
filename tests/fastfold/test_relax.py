"""Amber relaxation: lowers the energy, removes the clashes and broken peptide bonds of a perturbed
peptide the test builds from ideal backbone geometry, keeps atoms and B-factors; OpenMM 8 units."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lowmem.fastfold.common import residue_constants as rc
from lowmem.fastfold.io.protein import Protein
from lowmem.fastfold.relax import RelaxConfig, amber, relax_protein
from lowmem.fastfold.relax.violations import _clash_violations, find_violations

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


def test_pass_log_and_pass_budget(monkeypatch):
    """Each pass logs its energies, violations, iterations and seconds; a structure that never stops violating
    ends at `max_outer_iterations` and is reported unconverged (a check that always finds residue 3 violating
    stands in for a hopeless prediction)."""
    def always_residue_3(p):
        bad = np.zeros(len(p.aatype), bool)
        bad[3] = True
        return bad

    monkeypatch.setattr(amber, "_violations", always_residue_3)
    result = relax_protein(ideal_backbone(SEQUENCE), RelaxConfig(platform="CPU", max_outer_iterations=2))
    summary = json.loads(json.dumps(result.summary()))  # JSON-ready as timings.json stores it
    assert [p["pass"] for p in summary["passes"]] == [1, 2] and summary["outer_iterations"] == 2
    for p in summary["passes"]:
        assert p["energy_after"] <= p["energy_before"] and p["violating_residues"] == 1
        assert p["iterations"] > 0 and p["seconds"] >= 0 and p["cut_short"] is False
    assert summary["stopped"] == "pass limit" and summary["converged"] is False
    assert summary["problem"] == "not converged: 1 violating residue(s) after 2 pass(es) (pass limit)"
    assert set(summary["stage_seconds"]) == {"clean", "untangle"}


def test_time_budget_stops_the_minimiser_and_reports_it():
    """A budget already spent when the first pass starts: the minimiser stops at once (each of OpenMM's rounds
    of constraint stiffening runs one iteration), and the result says so even where no residue violates."""
    full = relax_protein(_perturbed(), RelaxConfig(platform="CPU"))
    result = relax_protein(_perturbed(), RelaxConfig(platform="CPU", max_seconds=1e-6))
    assert result.outer_iterations == 1 and result.passes[0]["cut_short"] and not full.passes[0]["cut_short"]
    assert result.passes[0]["iterations"] < 20 < full.passes[0]["iterations"]
    assert result.stopped == "time budget" and not result.converged
    assert result.problem.endswith("(time budget, its last minimisation cut short)")


def _bond_violations_loop(pos, mask, aatype, residue_index):
    """The per-residue reference of `violations._bond_violations`."""
    c, n = rc.atom_order["C"], rc.atom_order["N"]
    bad = np.zeros(len(aatype), bool)
    for i in range(len(aatype) - 1):
        if residue_index[i + 1] - residue_index[i] != 1 or not (mask[i, c] and mask[i + 1, n]):
            continue
        is_pro = int(aatype[i + 1] == rc.restype_order["P"])
        mean, std = rc.between_res_bond_length_c_n[is_pro], rc.between_res_bond_length_stddev_c_n[is_pro]
        if abs(np.linalg.norm(pos[i, c] - pos[i + 1, n]) - mean) > 12.0 * std:
            bad[i] = bad[i + 1] = True
    return bad


def _cis_loop(p):
    """The per-residue reference of `amber.cis_peptides`."""
    ca, c, n = (rc.atom_order[a] for a in ("CA", "C", "N"))
    x, m = p.atom_positions, p.atom_mask > 0.5
    out = np.zeros(len(p.aatype), np.int64)
    for i in range(len(p.aatype) - 1):
        if p.residue_index[i + 1] - p.residue_index[i] != 1 or not (m[i, ca] and m[i, c] and m[i + 1, n]
                                                                    and m[i + 1, ca]):
            continue
        b0, b1, b2 = x[i, c] - x[i, ca], x[i + 1, n] - x[i, c], x[i + 1, ca] - x[i + 1, n]
        if not 0.5 < np.linalg.norm(b1) < 2.0:
            continue
        n0, n1 = np.cross(b0, b1), np.cross(b1, b2)
        omega = np.degrees(np.arctan2(np.dot(np.cross(n0, n1), b1 / np.linalg.norm(b1)), np.dot(n0, n1)))
        out[i] = 1 if abs(omega) < 30.0 else (-1 if abs(omega) > 150.0 else 0)
    return out


def test_vectorised_checks_equal_the_per_residue_loops():
    """Peptide-bond violations and cis/trans, computed for all residues at once, equal the loops they replace on
    structures with broken bonds, cis bonds, prolines, a numbering gap and missing atoms."""
    rng = np.random.default_rng(0)
    seq = "MKPTAYPIAGSPLKV" * 4
    found = {"bond": 0, "cis": 0, "trans": 0}
    for trial in range(6):
        prot = ideal_backbone(seq, phi=-70.0, psi=-40.0 + 30 * trial)
        pos = prot.atom_positions + rng.normal(scale=0.05 * trial, size=prot.atom_positions.shape)
        mask = prot.atom_mask.copy()
        mask[rng.integers(0, len(seq), 3), rc.atom_order["N"]] = 0.0
        index = prot.residue_index.copy()
        index[30:] += 1  # a gap: no peptide bond between residues 29 and 30
        pos[11, rc.atom_order["C"]] += 0.15 * trial  # stretched bonds, some past 12 sigma
        # a cis bond 20 -> 21: the chain after C(20) turned by 180 degrees about the C(20)-N(21) bond
        origin = pos[20, rc.atom_order["C"]]
        axis = pos[21, rc.atom_order["N"]] - origin
        axis /= np.linalg.norm(axis)
        rest = pos[21:] - origin
        pos[21:] = origin + 2 * (rest @ axis)[..., None] * axis - rest
        p = Protein(pos * (mask[..., None] > 0), mask, prot.aatype, index, prot.b_factors)
        got = find_violations(p.atom_positions, p.atom_mask, p.aatype, p.residue_index)
        expected = _bond_violations_loop(p.atom_positions, mask, p.aatype, index) | _clash_violations(
            p.atom_positions, mask, p.aatype)
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(amber.cis_peptides(p), _cis_loop(p))
        found["bond"] += int(_bond_violations_loop(p.atom_positions, mask, p.aatype, index).sum())
        found["trans"] += int((_cis_loop(p) == -1).sum())
        found["cis"] += int((_cis_loop(p) == 1).sum())
    assert found["bond"] > 0 and found["trans"] > 0 and found["cis"] > 0, found


def test_relax_line_for_the_summary_table():
    from lowmem.fastfold.run.results import relax_line

    assert relax_line({"relax": {"seconds": 12.34, "outer_iterations": 2}}) == "relax 12.3 s, 2 passes"
    assert relax_line({"relax": {"seconds": 1.0, "outer_iterations": 1}}) == "relax 1.0 s, 1 pass"
    assert relax_line({"relax": None}) == ""


def test_a_pass_that_changes_nothing_ends_the_loop(monkeypatch):
    """A pass that frees no new residue and leaves every position as it was would be repeated identically up to
    the pass limit: the loop stops there, reported unconverged ("stalled")."""
    calls = []

    def unchanged(topology, positions, excluded, cfg, signs=None, deadline=None):
        calls.append(set(excluded))
        return 1.0, 1.0, positions, 3, False, False

    monkeypatch.setattr(amber, "_minimize", unchanged)
    monkeypatch.setattr(amber, "_violations", lambda p: np.arange(len(p.aatype)) == 3)
    result = relax_protein(ideal_backbone(SEQUENCE), RelaxConfig(platform="CPU", max_outer_iterations=20))
    assert calls == [set(), {3}] and result.outer_iterations == 2  # the second pass freed nothing new
    assert result.stopped == "stalled" and not result.converged and "(stalled)" in result.problem


def test_iteration_cap_per_pass_is_logged_and_reported():
    """`max_iterations` caps each pass's minimisation (OpenMM applies it to each round of constraint stiffening):
    every pass that reached it says so, and a capped last pass makes the result unconverged, with the cap named;
    a cap the minimiser never reaches changes nothing."""
    full = relax_protein(_perturbed(), RelaxConfig(platform="CPU"))
    assert full.converged and not full.passes[0]["iteration_capped"]
    roomy = relax_protein(_perturbed(), RelaxConfig(platform="CPU", max_iterations=100_000))
    assert roomy.converged and not roomy.passes[0]["iteration_capped"]
    np.testing.assert_array_equal(roomy.protein.atom_positions, full.protein.atom_positions)

    capped = relax_protein(_perturbed(), RelaxConfig(platform="CPU", max_iterations=5, max_outer_iterations=2))
    assert [p["iteration_capped"] for p in capped.passes] == [True] * capped.outer_iterations
    assert all(p["iterations"] % 5 == 0 for p in capped.passes)  # whole rounds of 5
    assert capped.passes[0]["iterations"] < full.passes[0]["iterations"]
    assert not capped.converged
    assert capped.problem.endswith("its last minimisation stopped at the iteration cap)"), capped.problem
    assert json.loads(json.dumps(capped.summary()))["passes"][0]["iteration_capped"] is True


def test_a_violation_free_pass_stopped_at_the_iteration_cap_is_not_converged(monkeypatch):
    """No residue violates, but the minimiser stopped at the cap before its tolerance: "iteration cap", not
    converged (as a minimisation the time budget cut short)."""
    monkeypatch.setattr(amber, "_violations", lambda p: np.zeros(len(p.aatype), bool))
    result = relax_protein(_perturbed(), RelaxConfig(platform="CPU", max_iterations=3))
    assert result.outer_iterations == 1 and result.passes[0]["iteration_capped"]
    assert result.stopped == "iteration cap" and result.violations_after == 0 and not result.converged
    assert result.problem == ("not converged: 0 violating residue(s) after 1 pass(es) (iteration cap, its last "
                              "minimisation stopped at the iteration cap)")
    free = relax_protein(_perturbed(), RelaxConfig(platform="CPU"))
    assert free.stopped == "converged" and free.converged and free.problem == ""
