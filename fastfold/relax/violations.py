"""Structural violations AlphaFold's relaxation loop checks (AlphaFold2 suppl. 1.9.11, as a numpy check).

A residue is violating when its peptide bond to the next residue is outside the literature length by more
than 12 standard deviations, or when one of its heavy atoms clashes with a heavy atom of another residue
(distance below the sum of van der Waals radii minus a 1.5 Angstrom tolerance).
"""

from __future__ import annotations

import numpy as np

from ..common import residue_constants as rc

__all__ = ["find_violations"]

TOLERANCE_FACTOR = 12.0
"""Allowed deviation of the peptide bond, in standard deviations."""
CLASH_TOLERANCE = 1.5
"""Allowed overlap of van der Waals spheres, Angstrom."""


def _bond_violations(pos: np.ndarray, mask: np.ndarray, aatype: np.ndarray, residue_index: np.ndarray) -> np.ndarray:
    c, n = rc.atom_order["C"], rc.atom_order["N"]
    bad = np.zeros(len(aatype), bool)
    if len(aatype) < 2:
        return bad
    # peptide bond i -> i+1, all at once: consecutive residue numbers, both atoms present
    linked = (np.diff(residue_index) == 1) & (mask[:-1, c] != 0) & (mask[1:, n] != 0)
    is_pro = (aatype[1:] == rc.restype_order["P"]).astype(np.int64)
    mean = np.asarray(rc.between_res_bond_length_c_n)[is_pro]
    std = np.asarray(rc.between_res_bond_length_stddev_c_n)[is_pro]
    length = np.linalg.norm(pos[:-1, c] - pos[1:, n], axis=-1)
    broken = linked & (np.abs(length - mean) > TOLERANCE_FACTOR * std)
    bad[:-1] |= broken
    bad[1:] |= broken
    return bad


def _clash_violations(pos: np.ndarray, mask: np.ndarray, aatype: np.ndarray) -> np.ndarray:
    res, atom = np.nonzero(mask > 0.5)
    xyz = pos[res, atom]
    radius = np.array([rc.van_der_waals_radius[rc.atom_types[a][0]] for a in atom])
    is_sg = np.array([rc.atom_types[a] == "SG" for a in atom])
    is_c, is_n = atom == rc.atom_order["C"], atom == rc.atom_order["N"]
    bad = np.zeros(len(aatype), bool)
    for start in range(0, len(xyz), 512):
        sl = slice(start, start + 512)
        dist = np.linalg.norm(xyz[sl, None] - xyz[None], axis=-1)
        limit = radius[sl, None] + radius[None] - CLASH_TOLERANCE
        clash = (dist < limit) & (res[sl, None] != res[None])
        clash &= ~((is_c[sl, None] & is_n[None] & (res[None] == res[sl, None] + 1))
                   | (is_n[sl, None] & is_c[None] & (res[None] == res[sl, None] - 1)))
        clash &= ~(is_sg[sl, None] & is_sg[None])
        rows, cols = np.nonzero(clash)
        bad[res[sl][rows]] = True
        bad[res[cols]] = True
    return bad


def find_violations(
    pos: np.ndarray, mask: np.ndarray, aatype: np.ndarray, residue_index: np.ndarray
) -> np.ndarray:
    """Boolean `[N]`: residues with a peptide-bond or clash violation. `pos` `[N, 37, 3]`, `mask` `[N, 37]`."""
    return _bond_violations(pos, mask, aatype, residue_index) | _clash_violations(pos, mask, aatype)
