"""Rigid transformations (rotation + translation) and quaternions in PyTorch.

A frame maps local coordinates to global ones: `x_global = rot @ x_local + trans` (AlphaFold2 suppl. 1.1).
Rotations are `[*, 3, 3]` matrices whose columns are the frame's axes in global coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Rigid", "quat_multiply_by_vec", "quat_to_rot", "rot_from_two_vecs"]


def quat_to_rot(quat: torch.Tensor) -> torch.Tensor:
    """Rotation matrix of a unit quaternion (w, x, y, z).

    quat: [*, 4]. Returns [*, 3, 3].
    """
    w, x, y, z = quat.unbind(-1)
    rows = [
        [w * w + x * x - y * y - z * z, 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), w * w - x * x + y * y - z * z, 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), w * w - x * x - y * y + z * z],
    ]
    return torch.stack([torch.stack(r, dim=-1) for r in rows], dim=-2)


def quat_multiply_by_vec(quat: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """Hamilton product `quat * (0, vec)`.

    quat: [*, 4] (w, x, y, z); vec: [*, 3]. Returns [*, 4].
    """
    w, x, y, z = quat.unbind(-1)
    b, c, d = vec.unbind(-1)
    return torch.stack(
        [-x * b - y * c - z * d, w * b + y * d - z * c, w * c - x * d + z * b, w * d + x * c - y * b], dim=-1
    )


def _robust_normalize(v: torch.Tensor, eps: float) -> torch.Tensor:
    return v / torch.sqrt((v * v).sum(-1, keepdim=True) + eps)


def rot_from_two_vecs(e0_unnormalized: torch.Tensor, e1_unnormalized: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt: x axis along e0, y axis in the (e0, e1) plane (AlphaFold2 suppl. Alg. 21).

    e0_unnormalized, e1_unnormalized: [*, 3]. Returns [*, 3, 3] with columns e0, e1, e2.
    """
    e0 = _robust_normalize(e0_unnormalized, eps)
    e1 = e1_unnormalized - (e1_unnormalized * e0).sum(-1, keepdim=True) * e0
    e1 = _robust_normalize(e1, eps)
    e2 = torch.linalg.cross(e0, e1, dim=-1)
    return torch.stack([e0, e1, e2], dim=-1)


@dataclass(frozen=True)
class Rigid:
    """A batch of rigid transformations.

    rot: [*, 3, 3]; trans: [*, 3].
    """

    rot: torch.Tensor
    trans: torch.Tensor

    @staticmethod
    def identity(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None) -> Rigid:
        """Identity frames of batch shape `shape`."""
        rot = torch.eye(3, dtype=dtype, device=device).expand(*shape, 3, 3).clone()
        return Rigid(rot, torch.zeros(*shape, 3, dtype=dtype, device=device))

    @staticmethod
    def from_3_points(
        point_on_neg_x_axis: torch.Tensor, origin: torch.Tensor, point_on_xy_plane: torch.Tensor
    ) -> Rigid:
        """Frame from three points (AlphaFold2 suppl. Alg. 21, rigidFrom3Points).

        All arguments: [*, 3]. The frame sits at `origin`, x axis pointing away from `point_on_neg_x_axis`.
        """
        rot = rot_from_two_vecs(origin - point_on_neg_x_axis, point_on_xy_plane - origin)
        return Rigid(rot, origin)

    @staticmethod
    def from_tensor_4x4(m: torch.Tensor) -> Rigid:
        """m: [*, 4, 4] homogeneous matrices."""
        return Rigid(m[..., :3, :3], m[..., :3, 3])

    def apply(self, points: torch.Tensor) -> torch.Tensor:
        """Local to global. points: [*, 3] broadcasting against the batch shape."""
        return torch.einsum("...ij,...j->...i", self.rot, points) + self.trans

    def invert_apply(self, points: torch.Tensor) -> torch.Tensor:
        """Global to local. points: [*, 3]."""
        return torch.einsum("...ji,...j->...i", self.rot, points - self.trans)

    def compose(self, other: Rigid) -> Rigid:
        """`self ∘ other`: apply `other` first, then `self`."""
        return Rigid(self.rot @ other.rot, self.apply(other.trans))

    def compose_rot(self, rot: torch.Tensor) -> Rigid:
        """`self ∘ (rot, 0)`. rot: [*, 3, 3]."""
        return Rigid(self.rot @ rot, self.trans)

    def invert(self) -> Rigid:
        """The inverse transformation."""
        rot_t = self.rot.transpose(-1, -2)
        return Rigid(rot_t, -torch.einsum("...ij,...j->...i", rot_t, self.trans))

    def unsqueeze(self, dim: int) -> Rigid:
        """Insert a batch dim (counted over the batch dims only, negative from the end)."""
        if dim < 0:
            return Rigid(self.rot.unsqueeze(dim - 2), self.trans.unsqueeze(dim - 1))
        return Rigid(self.rot.unsqueeze(dim), self.trans.unsqueeze(dim))

    def scale_translation(self, factor: float) -> Rigid:
        """Same rotation, translation multiplied by `factor` (unit change)."""
        return Rigid(self.rot, self.trans * factor)

    def to_tensor_4x4(self) -> torch.Tensor:
        """[*, 4, 4] homogeneous matrices."""
        out = torch.zeros(*self.trans.shape[:-1], 4, 4, dtype=self.trans.dtype, device=self.trans.device)
        out[..., :3, :3] = self.rot
        out[..., :3, 3] = self.trans
        out[..., 3, 3] = 1
        return out
