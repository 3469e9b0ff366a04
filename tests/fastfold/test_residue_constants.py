"""Residue constants: layouts consistent with each other and with AlphaFold's published tables."""

from __future__ import annotations

import numpy as np

from lowmem.fastfold.common import residue_constants as rc


def test_orders_and_sizes():
    assert "".join(rc.restypes) == "ARNDCQEGHILKMFPSTWYV"
    assert rc.restypes_with_x[20] == "X" and rc.unk_restype_index == 20
    assert rc.atom_type_num == 37 and rc.atom_types[:5] == ["N", "CA", "C", "CB", "O"] and rc.atom_types[-1] == "OXT"
    assert len(rc.restype_name_to_atom14_names) == 21
    assert rc.restype_atom14_to_atom37.shape == (21, 14) and rc.restype_atom37_to_atom14.shape == (21, 37)


def test_hhblits_mapping():
    # B->D, Z->E, U->C, J/O -> X, gap last; everything else to the same letter in our order.
    ours = rc.MAP_HHBLITS_AATYPE_TO_OUR_AATYPE
    for letter, hh in rc.HHBLITS_AA_TO_ID.items():
        expected = {"B": "D", "Z": "E", "U": "C", "J": "X", "O": "X"}.get(letter, letter)
        assert rc.restypes_with_x_and_gap[ours[hh]] == expected


def test_atom14_atom37_maps_are_inverse():
    for r in range(20):
        names = rc.restype_name_to_atom14_names[rc.restype_1to3[rc.restypes[r]]]
        for j, name in enumerate(names):
            if name:
                a37 = rc.restype_atom14_to_atom37[r, j]
                assert rc.atom_types[a37] == name and rc.restype_atom37_to_atom14[r, a37] == j
        assert (
            rc.restype_atom14_mask[r].sum() == rc.restype_atom37_mask[r].sum() == len(rc.residue_atoms[rc.resnames[r]])
        )
    assert rc.restype_atom14_mask[20].sum() == 0


def test_chi_tables():
    assert rc.chi_angles_atom_indices.shape == (21, 4, 4)
    for r in range(20):
        chis = rc.chi_angles_atoms[rc.resnames[r]]
        assert list(rc.chi_angles_mask[r]) == [1.0] * len(chis) + [0.0] * (4 - len(chis))
        for c, atoms in enumerate(chis):
            assert [rc.atom_types[i] for i in rc.chi_angles_atom_indices[r, c]] == atoms
    # Chi angles with a pi symmetry: ASP chi2, GLU chi3, PHE chi2, TYR chi2.
    periodic = {(rc.resnames[r], c) for r in range(20) for c in range(4) if rc.chi_pi_periodic[r][c]}
    assert periodic == {("ASP", 1), ("GLU", 2), ("PHE", 1), ("TYR", 1)}


def test_rigid_group_tables():
    frames = rc.restype_rigid_group_default_frame
    assert frames.dtype == np.float32 and frames.shape == (21, 8, 4, 4)
    for r in range(20):
        for g in range(8):
            if rc.restype_rigidgroup_mask[r, g] or g < 3:
                rot = frames[r, g, :3, :3].astype(np.float64)
                np.testing.assert_allclose(rot @ rot.T, np.eye(3), atol=1e-6)
    # psi frame: origin at C, x axis along CA->C.
    ala = rc.restype_order["A"]
    np.testing.assert_allclose(frames[ala, 3, :3, 3], [1.526, 0.0, 0.0], atol=1e-6)
    # every atom of a residue has a position in its group
    assert np.all(
        (rc.restype_atom14_rigid_group_positions[:20] != 0).any(-1)
        | (rc.restype_atom14_mask[:20] == 0)
        | (np.arange(14) == 1)
    )


def test_stereo_chemical_props():
    bonds, virtual, angles = rc.load_stereo_chemical_props()
    assert set(bonds) == set(rc.resnames) and bonds["UNK"] == []
    ca_cb = {b.atom1_name + "-" + b.atom2_name: b for b in bonds["ALA"]}["CA-CB"]
    assert (ca_cb.length, ca_cb.stddev) == (1.520, 0.021)
    # law of cosines on N-CA-C of ALA: 1.459, 1.525 at 111.0 degrees
    ncac = [v for v in virtual["ALA"] if {v.atom1_name, v.atom2_name} == {"N", "C"}][0]
    expected = np.sqrt(1.459**2 + 1.525**2 - 2 * 1.459 * 1.525 * np.cos(np.radians(111.0)))
    assert abs(ncac.length - expected) < 1e-12
    assert len(angles["TRP"]) == 20 and len(bonds["TRP"]) == 15
