"""Geometry: rigid transforms, ideal residues built from torsion angles, torsions recovered from atoms."""

from __future__ import annotations

import numpy as np
import torch

from lowmem.fastfold.common import residue_constants as rc
from lowmem.fastfold.common.geometry import atom37_to_torsion_angles, dgram_from_positions, pseudo_beta
from lowmem.fastfold.common.rigid import Rigid, quat_multiply_by_vec, quat_to_rot
from lowmem.fastfold.model.testing import random_atom37

RING_CLOSURE = {("PRO", "CD", "N"), ("PRO", "CA", "N", "CD"), ("PRO", "CG", "CD", "N")}


def _random_rigid(shape, g):
    q = torch.randn(*shape, 4, generator=g, dtype=torch.float64)
    return Rigid(
        quat_to_rot(q / q.norm(dim=-1, keepdim=True)), torch.randn(*shape, 3, generator=g, dtype=torch.float64)
    )


def test_quaternions_give_rotations():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(50, 4, generator=g, dtype=torch.float64)
    q = q / q.norm(dim=-1, keepdim=True)
    r = quat_to_rot(q)
    torch.testing.assert_close(r @ r.transpose(-1, -2), torch.eye(3, dtype=torch.float64).expand(50, 3, 3))
    det = (torch.linalg.cross(r[..., 0], r[..., 1], dim=-1) * r[..., 2]).sum(-1)  # columns right-handed
    torch.testing.assert_close(det, torch.ones(50, dtype=torch.float64))
    # q * (0, v) for a pure rotation about z by theta: (cos t/2, 0, 0, sin t/2) * (0, 1, 0, 0)
    t = 0.7
    qz = torch.tensor([np.cos(t / 2), 0, 0, np.sin(t / 2)], dtype=torch.float64)
    expected = torch.tensor([0.0, np.cos(t / 2), np.sin(t / 2), 0.0], dtype=torch.float64)
    torch.testing.assert_close(quat_multiply_by_vec(qz, torch.tensor([1.0, 0, 0], dtype=torch.float64)), expected)


def test_rigid_against_homogeneous_matrices():
    g = torch.Generator().manual_seed(1)
    a, b = _random_rigid((7,), g), _random_rigid((7,), g)
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    ma, mb = a.to_tensor_4x4(), b.to_tensor_4x4()
    xh = torch.cat([x, torch.ones(7, 1, dtype=torch.float64)], -1)
    torch.testing.assert_close(a.compose(b).to_tensor_4x4(), ma @ mb)
    torch.testing.assert_close(a.apply(x), (ma @ xh[..., None])[..., :3, 0])
    torch.testing.assert_close(a.invert_apply(a.apply(x)), x)
    torch.testing.assert_close(a.invert().to_tensor_4x4(), torch.linalg.inv(ma))


def _bond_checks(pos, aatype):
    bonds, _, angles = rc.load_stereo_chemical_props()
    for i, a in enumerate(aatype.tolist()):
        name = rc.resnames[a]
        for b in bonds[name]:
            d = (pos[i, rc.atom_order[b.atom1_name]] - pos[i, rc.atom_order[b.atom2_name]]).norm().item()
            yield (name, b.atom1_name, b.atom2_name), abs(d - b.length) / b.stddev
        for an in angles[name]:
            p1, p2, p3 = (pos[i, rc.atom_order[x]] for x in (an.atom1_name, an.atom2_name, an.atom3name))
            v1, v2 = p1 - p2, p3 - p2
            ang = torch.arccos((v1 @ v2) / v1.norm() / v2.norm()).item()
            yield (name, an.atom1_name, an.atom2_name, an.atom3name), abs(ang - an.angle_rad) / an.stddev


def test_ideal_residues_have_literature_bond_lengths_and_angles():
    """Atoms placed from the rigid groups for random torsions: every bond and bond angle within 3 standard
    deviations of Engh & Huber, except proline's ring closure, which only holds at ring-closing chi angles."""
    g = torch.Generator().manual_seed(2)
    aatype = torch.arange(20).repeat(2)
    pos, _ = random_atom37(aatype, g)
    for key, z in _bond_checks(pos, aatype):
        if key not in RING_CLOSURE:
            assert z < 3, (key, z)


def test_torsion_angles_round_trip():
    """Torsions of atoms built from known torsions come back (chi and psi; omega/phi need a neighbour)."""
    g = torch.Generator().manual_seed(3)
    aatype = torch.randint(0, 20, (30,), generator=g)
    from lowmem.fastfold.common.geometry import atom14_to_atom37, frames_to_atom14_positions, torsion_angles_to_frames

    angles = torch.randn(30, 7, 2, generator=g, dtype=torch.float64)
    angles = angles / angles.norm(dim=-1, keepdim=True)
    bb = _random_rigid((30,), g)
    atom14 = frames_to_atom14_positions(aatype, torsion_angles_to_frames(aatype, bb, angles))
    to14 = torch.as_tensor(rc.restype_atom37_to_atom14)[aatype]
    mask = torch.as_tensor(rc.restype_atom37_mask, dtype=torch.float64)[aatype]
    atom37 = atom14_to_atom37(atom14, to14, mask)
    out = atom37_to_torsion_angles(aatype, atom37, mask)
    got, m = out["torsion_angles_sin_cos"], out["torsion_angles_mask"]
    chi_mask = torch.as_tensor(rc.chi_angles_mask_with_unk, dtype=torch.float64)[aatype]
    torch.testing.assert_close(m[:, 3:], chi_mask)
    sel = m[:, 2:] > 0
    # float32 literature tables limit the agreement to ~1e-6
    torch.testing.assert_close(got[:, 2:][sel], angles[:, 2:][sel], atol=1e-5, rtol=0)
    alt = out["alt_torsion_angles_sin_cos"]
    periodic = torch.as_tensor(np.asarray(rc.chi_pi_periodic), dtype=torch.float64)[aatype]
    torch.testing.assert_close(alt[:, 3:], got[:, 3:] * (1 - 2 * periodic)[..., None])


def test_pseudo_beta_and_dgram():
    aatype = torch.tensor([rc.restype_order["G"], rc.restype_order["A"]])
    pos = torch.zeros(2, 37, 3, dtype=torch.float64)
    pos[:, rc.atom_order["CA"]] = torch.tensor([[0.0, 0, 0], [1.0, 0, 0]])
    pos[:, rc.atom_order["CB"]] = torch.tensor([[5.0, 0, 0], [10.0, 0, 0]])
    pb, _ = pseudo_beta(aatype, pos)
    torch.testing.assert_close(pb, torch.tensor([[0.0, 0, 0], [10.0, 0, 0]], dtype=torch.float64))
    d = dgram_from_positions(pb, 15, 3.25, 20.75)
    # distance 10 falls in the bin whose squared edges bracket 100; the diagonal (0) in none
    edges = np.linspace(3.25, 20.75, 15)
    k = int(np.searchsorted(edges, 10.0) - 1)
    assert d[0, 1].argmax().item() == k and d[0, 1].sum() == 1 and d[0, 0].sum() == 0


def test_torsions_to_frames_gradients():
    """torsion_angles_to_frames and the atom placement are differentiable (gradcheck in float64)."""
    from lowmem.fastfold.common.geometry import frames_to_atom14_positions, torsion_angles_to_frames

    g = torch.Generator().manual_seed(4)
    aatype = torch.tensor([1, 13, 7])
    bb = _random_rigid((3,), g)
    ang = torch.randn(3, 7, 2, generator=g, dtype=torch.float64, requires_grad=True)

    def fn(a):
        return frames_to_atom14_positions(aatype, torsion_angles_to_frames(aatype, bb, a))

    assert torch.autograd.gradcheck(fn, (ang,))
