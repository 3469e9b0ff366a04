"""Protein geometry in PyTorch: torsion angles <-> rigid-group frames <-> atom14 / atom37 positions.

AlphaFold2 suppl. Alg. 24 (computeAllAtomCoordinates), Alg. 25 (makeRotX), section 1.8 (torsion angles and
rigid groups), and the pseudo-beta / distogram features of section 1.7.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import residue_constants as rc
from .rigid import Rigid

__all__ = [
    "atom14_to_atom37",
    "atom37_to_torsion_angles",
    "dgram_from_positions",
    "frames_to_atom14_positions",
    "pseudo_beta",
    "residue_constant_tensor",
    "torsion_angles_to_frames",
]


@functools.lru_cache(maxsize=64)
def _constant(name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    value = getattr(rc, name)
    return torch.as_tensor(np.asarray(value), device=device).to(dtype)


def residue_constant_tensor(name: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A table of `residue_constants` as a tensor on `like`'s device (cached per dtype and device)."""
    return _constant(name, dtype or like.dtype, like.device)


def _rot_x(sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
    """Rotation about the x axis (AlphaFold2 suppl. Alg. 25). sin, cos: [*]. Returns [*, 3, 3]."""
    zeros, ones = torch.zeros_like(sin), torch.ones_like(sin)
    rows = [[ones, zeros, zeros], [zeros, cos, -sin], [zeros, sin, cos]]
    return torch.stack([torch.stack(r, dim=-1) for r in rows], dim=-2)


def torsion_angles_to_frames(aatype: torch.Tensor, backbone: Rigid, angles_sin_cos: torch.Tensor) -> Rigid:
    """Frames of the 8 rigid groups in global coordinates (AlphaFold2 suppl. Alg. 24, lines 2-10).

    aatype: [*, N] (0..20); backbone: frames of batch shape [*, N]; angles_sin_cos: [*, N, 7, 2] as
    (sin, cos) of (pre-omega, phi, psi, chi1..chi4). Returns frames of batch shape [*, N, 8].
    """
    default = Rigid.from_tensor_4x4(
        residue_constant_tensor("restype_rigid_group_default_frame", angles_sin_cos)[aatype]
    )
    sin = torch.cat([torch.zeros_like(angles_sin_cos[..., :1, 0]), angles_sin_cos[..., 0]], dim=-1)
    cos = torch.cat([torch.ones_like(angles_sin_cos[..., :1, 1]), angles_sin_cos[..., 1]], dim=-1)
    frames = default.compose_rot(_rot_x(sin, cos))  # each group relative to its parent
    rot, trans = list(frames.rot.unbind(-3)), list(frames.trans.unbind(-2))
    for k in (5, 6, 7):  # chi2..chi4 hang off the previous chi group
        parent = Rigid(rot[k - 1], trans[k - 1])
        child = parent.compose(Rigid(rot[k], trans[k]))
        rot[k], trans[k] = child.rot, child.trans
    to_backbone = Rigid(torch.stack(rot, dim=-3), torch.stack(trans, dim=-2))
    return backbone.unsqueeze(-1).compose(to_backbone)


def frames_to_atom14_positions(aatype: torch.Tensor, frames: Rigid) -> torch.Tensor:
    """Literature atom positions placed in their rigid groups (AlphaFold2 suppl. Alg. 24, line 11).

    aatype: [*, N]; frames: batch shape [*, N, 8]. Returns atom14 positions [*, N, 14, 3], zero where the
    residue type has no such atom.
    """
    like = frames.trans
    group = residue_constant_tensor("restype_atom14_to_rigid_group", like, torch.long)[aatype]  # [*, N, 14]
    rot = torch.gather(frames.rot, -3, group[..., None, None].expand(*group.shape, 3, 3))
    trans = torch.gather(frames.trans, -2, group[..., None].expand(*group.shape, 3))
    local = residue_constant_tensor("restype_atom14_rigid_group_positions", like)[aatype]
    mask = residue_constant_tensor("restype_atom14_mask", like)[aatype]
    return Rigid(rot, trans).apply(local) * mask[..., None]


def atom14_to_atom37(
    atom14: torch.Tensor, residx_atom37_to_atom14: torch.Tensor, atom37_exists: torch.Tensor
) -> torch.Tensor:
    """Scatter atom14 data into the atom37 layout.

    atom14: [*, N, 14, C]; residx_atom37_to_atom14: [*, N, 37] (long); atom37_exists: [*, N, 37].
    Returns [*, N, 37, C], zero where the atom does not exist.
    """
    idx = residx_atom37_to_atom14.long()[..., None].expand(*residx_atom37_to_atom14.shape, atom14.shape[-1])
    return torch.gather(atom14, -2, idx) * atom37_exists[..., None].to(atom14.dtype)


def pseudo_beta(
    aatype: torch.Tensor, atom37: torch.Tensor, atom37_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CB position (CA for glycine), used for distance features (AlphaFold2 suppl. 1.7).

    aatype: [*, N]; atom37: [*, N, 37, 3]; atom37_mask: [*, N, 37] or None.
    Returns positions [*, N, 3] and, when a mask is given, its mask [*, N].
    """
    is_gly = (aatype == rc.restype_order["G"])[..., None]
    ca, cb = rc.atom_order["CA"], rc.atom_order["CB"]
    pos = torch.where(is_gly, atom37[..., ca, :], atom37[..., cb, :])
    if atom37_mask is None:
        return pos, None
    return pos, torch.where(is_gly[..., 0], atom37_mask[..., ca], atom37_mask[..., cb])


def dgram_from_positions(positions: torch.Tensor, num_bins: int, min_bin: float, max_bin: float) -> torch.Tensor:
    """One-hot distance histogram: bin k holds lower_k < d < upper_k with squared breaks.

    positions: [*, N, 3]. Returns [*, N, N, num_bins]; distances below `min_bin` fall in no bin.
    """
    lower = torch.linspace(min_bin, max_bin, num_bins, dtype=positions.dtype, device=positions.device) ** 2
    upper = torch.cat([lower[1:], lower.new_tensor([1e8])])
    d2 = ((positions[..., :, None, :] - positions[..., None, :, :]) ** 2).sum(-1, keepdim=True)
    return ((d2 > lower) & (d2 < upper)).to(positions.dtype)


def _torsion_atom_positions(
    aatype: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The four atoms of each of the 7 torsions: positions [*, N, 7, 4, 3] and mask [*, N, 7]."""
    prev_pos = torch.cat([torch.zeros_like(pos[..., :1, :, :]), pos[..., :-1, :, :]], dim=-3)
    prev_mask = torch.cat([torch.zeros_like(mask[..., :1, :]), mask[..., :-1, :]], dim=-2)
    n, ca, c, o = (rc.atom_order[a] for a in ("N", "CA", "C", "O"))
    pre_omega = torch.stack([prev_pos[..., ca, :], prev_pos[..., c, :], pos[..., n, :], pos[..., ca, :]], dim=-2)
    phi = torch.stack([prev_pos[..., c, :], pos[..., n, :], pos[..., ca, :], pos[..., c, :]], dim=-2)
    psi = torch.stack([pos[..., n, :], pos[..., ca, :], pos[..., c, :], pos[..., o, :]], dim=-2)
    pre_omega_mask = prev_mask[..., ca] * prev_mask[..., c] * mask[..., n] * mask[..., ca]
    phi_mask = prev_mask[..., c] * mask[..., n] * mask[..., ca] * mask[..., c]
    psi_mask = mask[..., n] * mask[..., ca] * mask[..., c] * mask[..., o]

    idx = residue_constant_tensor("chi_angles_atom_indices", pos, torch.long)[aatype]  # [*, N, 4, 4]
    flat = idx.flatten(-2)  # [*, N, 16]
    chi_pos = torch.gather(pos, -2, flat[..., None].expand(*flat.shape, 3)).unflatten(-2, (4, 4))
    chi_atom_mask = torch.gather(mask, -1, flat).unflatten(-1, (4, 4)).prod(-1)
    chi_mask = residue_constant_tensor("chi_angles_mask_with_unk", pos)[aatype] * chi_atom_mask
    positions = torch.cat([pre_omega[..., None, :, :], phi[..., None, :, :], psi[..., None, :, :], chi_pos], dim=-3)
    masks = torch.cat([pre_omega_mask[..., None], phi_mask[..., None], psi_mask[..., None], chi_mask], dim=-1)
    return positions, masks


def atom37_to_torsion_angles(
    aatype: torch.Tensor, atom37: torch.Tensor, atom37_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The 7 torsion angles of each residue from its atoms (AlphaFold2 suppl. 1.8, Table 2).

    aatype: [*, N] (values above 20 are treated as unknown); atom37: [*, N, 37, 3]; atom37_mask: [*, N, 37].
    Returns `torsion_angles_sin_cos` [*, N, 7, 2], `alt_torsion_angles_sin_cos` (chi angles with a pi
    symmetry shifted by pi) and `torsion_angles_mask` [*, N, 7]. Undefined angles are left as computed
    (zero atoms give (0, 0)), as AlphaFold does for template features.
    """
    aatype = aatype.long().clamp(max=20)
    atom37_mask = atom37_mask.to(atom37.dtype)
    positions, mask = _torsion_atom_positions(aatype, atom37, atom37_mask)
    frames = Rigid.from_3_points(positions[..., 1, :], positions[..., 2, :], positions[..., 0, :])
    fourth = frames.invert_apply(positions[..., 3, :])
    sin_cos = torch.stack([fourth[..., 2], fourth[..., 1]], dim=-1)
    sin_cos = sin_cos / torch.sqrt((sin_cos**2).sum(-1, keepdim=True) + 1e-8)
    # psi is defined with the O atom, which sits opposite the psi torsion's reference; flip its sign.
    sign = sin_cos.new_tensor([1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0])
    sin_cos = sin_cos * sign[:, None]
    periodic = residue_constant_tensor("chi_pi_periodic", atom37)[aatype]
    mirror = torch.cat([torch.ones_like(periodic[..., :3]), 1.0 - 2.0 * periodic], dim=-1)
    return {
        "torsion_angles_sin_cos": sin_cos,
        "alt_torsion_angles_sin_cos": sin_cos * mirror[..., None],
        "torsion_angles_mask": mask,
    }
