"""Structure module: invariant point attention, backbone update, angle resnet, all-atom coordinates
(AlphaFold2 suppl. Alg. 20-25).

Frames carry their translations in units of 1/position_scale Angstrom inside the fold block, as AlphaFold
does; outputs are in Angstrom. Rotations are tracked as quaternions (Alg. 23) and turned into matrices.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fastfold.common.geometry import frames_to_atom14_positions, torsion_angles_to_frames
from fastfold.common.rigid import Rigid, quat_multiply_by_vec, quat_to_rot
from fastfold.model.config import StructureModuleConfig
from fastfold.model.primitives import LayerNorm, Linear

__all__ = ["AngleResnet", "BackboneUpdate", "InvariantPointAttention", "StructureModule"]


class InvariantPointAttention(nn.Module):
    """AlphaFold2 suppl. Alg. 22. Point projections are laid out coordinate-major (x, y, z blocks of
    heads x points), as in AlphaFold's parameters."""

    def __init__(self, cfg: StructureModuleConfig):
        super().__init__()
        h, self.cfg = cfg.ipa_heads, cfg
        self.linear_q = Linear(cfg.c_s, h * cfg.ipa_scalar_qk)
        self.linear_kv = Linear(cfg.c_s, h * (cfg.ipa_scalar_qk + cfg.ipa_scalar_v))
        self.linear_q_points = Linear(cfg.c_s, h * 3 * cfg.ipa_point_qk)
        self.linear_kv_points = Linear(cfg.c_s, h * 3 * (cfg.ipa_point_qk + cfg.ipa_point_v))
        self.linear_b = Linear(cfg.c_z, h)
        self.head_weights = nn.Parameter(torch.full((h,), math.log(math.e - 1.0)))
        self.linear_out = Linear(h * (cfg.c_z + cfg.ipa_scalar_v + 4 * cfg.ipa_point_v), cfg.c_s)

    def _points(self, linear: Linear, s: torch.Tensor, frames: Rigid, n_points: int) -> torch.Tensor:
        """Project points in each residue's frame, move them to global: [*, N, H, P, 3]."""
        local = torch.stack(linear(s).chunk(3, dim=-1), dim=-1)  # [*, N, H*P, 3]
        glob = frames.unsqueeze(-1).apply(local)
        return glob.unflatten(-2, (self.cfg.ipa_heads, n_points))

    def forward(self, s: torch.Tensor, z: torch.Tensor, frames: Rigid, mask: torch.Tensor) -> torch.Tensor:
        """s: [*, N, C_s]; z: [*, N, N, C_z]; frames: batch shape [*, N]; mask: [*, N]. Returns [*, N, C_s]."""
        c, h = self.cfg, self.cfg.ipa_heads
        q = self.linear_q(s).unflatten(-1, (h, c.ipa_scalar_qk))
        k, v = self.linear_kv(s).unflatten(-1, (h, -1)).split([c.ipa_scalar_qk, c.ipa_scalar_v], dim=-1)
        q_pts = self._points(self.linear_q_points, s, frames, c.ipa_point_qk)
        k_pts, v_pts = self._points(self.linear_kv_points, s, frames, c.ipa_point_qk + c.ipa_point_v).split(
            [c.ipa_point_qk, c.ipa_point_v], dim=-2
        )
        scalar_w = math.sqrt(1.0 / (3 * max(c.ipa_scalar_qk, 1)))
        point_w = math.sqrt(1.0 / (3 * max(c.ipa_point_qk, 1) * 9.0 / 2))
        logits = torch.einsum("...ihc,...jhc->...hij", q * scalar_w, k)
        d2 = ((q_pts[..., :, None, :, :, :] - k_pts[..., None, :, :, :, :]) ** 2).sum(-1)  # [*, i, j, H, P]
        gamma = nn.functional.softplus(self.head_weights) * point_w
        logits = logits - 0.5 * torch.einsum("...ijhp,h->...hij", d2, gamma)
        logits = logits + math.sqrt(1.0 / 3) * self.linear_b(z).movedim(-1, -3)
        mask_2d = mask[..., :, None] * mask[..., None, :]
        attn = torch.softmax(logits - 1e5 * (1.0 - mask_2d[..., None, :, :]), dim=-1)  # [*, H, i, j]

        o = torch.einsum("...hij,...jhc->...ihc", attn, v).flatten(-2)
        o_pt = torch.einsum("...hij,...jhpx->...ihpx", attn, v_pts)  # global frame
        o_pt = frames.unsqueeze(-1).unsqueeze(-1).invert_apply(o_pt)  # [*, N, H, P_v, 3] local
        o_pt_norm = torch.sqrt(1e-8 + (o_pt**2).sum(-1))
        o_pair = torch.einsum("...hij,...ijc->...ihc", attn, z).flatten(-2)
        feats = [o, *(o_pt[..., k].flatten(-2) for k in range(3)), o_pt_norm.flatten(-2), o_pair]
        return self.linear_out(torch.cat(feats, dim=-1))


class BackboneUpdate(nn.Module):
    """AlphaFold2 suppl. Alg. 23: a quaternion (1, b, c, d) and a translation from the single repr."""

    def __init__(self, c_s: int):
        super().__init__()
        self.linear = Linear(c_s, 6)

    def forward(self, s: torch.Tensor, quat: torch.Tensor, trans: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """s: [*, N, C_s]; quat: [*, N, 4] unit; trans: [*, N, 3]. Returns the composed (quat, trans)."""
        update = self.linear(s)
        new_quat = quat + quat_multiply_by_vec(quat, update[..., :3])
        new_quat = new_quat / torch.linalg.vector_norm(new_quat, dim=-1, keepdim=True)
        new_trans = trans + torch.einsum("...ij,...j->...i", quat_to_rot(quat), update[..., 3:])
        return new_quat, new_trans


class _ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.linear_1 = Linear(c, c)
        self.linear_2 = Linear(c, c)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a + self.linear_2(torch.relu(self.linear_1(torch.relu(a))))


class AngleResnet(nn.Module):
    """AlphaFold2 suppl. Alg. 20 lines 11-14: torsion angles (sin, cos) from the single representation."""

    def __init__(self, c_s: int, c_hidden: int, num_blocks: int):
        super().__init__()
        self.linear_in = Linear(c_s, c_hidden)
        self.linear_initial = Linear(c_s, c_hidden)
        self.layers = nn.ModuleList(_ResBlock(c_hidden) for _ in range(num_blocks))
        self.linear_out = Linear(c_hidden, 14)

    def forward(self, s: torch.Tensor, s_initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """s, s_initial: [*, N, C_s]. Returns unnormalized and normalized angles, both [*, N, 7, 2]."""
        a = self.linear_in(torch.relu(s)) + self.linear_initial(torch.relu(s_initial))
        for layer in self.layers:
            a = layer(a)
        raw = self.linear_out(torch.relu(a)).unflatten(-1, (7, 2))
        norm = torch.sqrt(torch.clamp((raw**2).sum(-1, keepdim=True), min=1e-12))
        return raw, raw / norm


class StructureModule(nn.Module):
    """AlphaFold2 suppl. Alg. 20 (inference: no auxiliary losses), with the shared-weight fold block."""

    def __init__(self, cfg: StructureModuleConfig):
        super().__init__()
        self.cfg = cfg
        self.layer_norm_s = LayerNorm(cfg.c_s)
        self.layer_norm_z = LayerNorm(cfg.c_z)
        self.linear_in = Linear(cfg.c_s, cfg.c_s)
        self.ipa = InvariantPointAttention(cfg)
        self.layer_norm_ipa = LayerNorm(cfg.c_s)
        self.transition = nn.ModuleList(Linear(cfg.c_s, cfg.c_s) for _ in range(cfg.transition_layers))
        self.layer_norm_transition = LayerNorm(cfg.c_s)
        self.bb_update = BackboneUpdate(cfg.c_s)
        self.angle_resnet = AngleResnet(cfg.c_s, cfg.c_resnet, cfg.resnet_blocks)

    def _fold_block(self, s, s_initial, z, quat, trans, mask):
        frames = Rigid(quat_to_rot(quat), trans)
        s = self.layer_norm_ipa(s + self.ipa(s, z, frames, mask))
        a = s
        for i, linear in enumerate(self.transition):
            a = linear(a)
            if i < len(self.transition) - 1:
                a = torch.relu(a)
        s = self.layer_norm_transition(s + a)
        quat, trans = self.bb_update(s, quat, trans)
        return s, quat, trans

    def forward(
        self, s: torch.Tensor, z: torch.Tensor, aatype: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """s: [*, N, C_s]; z: [*, N, N, C_z]; aatype: [*, N]; mask: seq_mask [*, N].

        Returns `single` [*, N, C_s] (after the last block), `frames` [*, N, 4, 4] (Angstrom),
        `angles` and `unnormalized_angles` [*, N, 7, 2], `atom14_positions` [*, N, 14, 3] (Angstrom).
        """
        s_initial = self.layer_norm_s(s)
        z = self.layer_norm_z(z)
        s = self.linear_in(s_initial)
        quat = torch.zeros(*s.shape[:-1], 4, dtype=s.dtype, device=s.device)
        quat[..., 0] = 1
        trans = torch.zeros(*s.shape[:-1], 3, dtype=s.dtype, device=s.device)
        mask = mask.to(s.dtype)
        for _ in range(self.cfg.num_layers):
            s, quat, trans = self._fold_block(s, s_initial, z, quat, trans, mask)
        # Only the last iteration's side chains are part of the inference outputs.
        raw, angles = self.angle_resnet(s, s_initial)
        backbone = Rigid(quat_to_rot(quat), trans * self.cfg.position_scale)
        all_frames = torsion_angles_to_frames(aatype.long(), backbone, angles)
        return {
            "single": s,
            "frames": backbone.to_tensor_4x4(),
            "angles": angles,
            "unnormalized_angles": raw,
            "atom14_positions": frames_to_atom14_positions(aatype.long(), all_frames),
        }
