"""Structure module: invariant point attention, backbone update, angle resnet, all-atom coordinates
(AlphaFold2 suppl. Alg. 20-25).

Frames carry their translations in units of 1/position_scale Angstrom inside the fold block, as AlphaFold
does; outputs are in Angstrom. Rotations are tracked as quaternions (Alg. 23) and turned into matrices.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ..common.geometry import frames_to_atom14_positions, torsion_angles_to_frames
from ..common.rigid import Rigid, quat_multiply_by_vec, quat_to_rot
from .config import StructureModuleConfig
from .options import InferenceOptions
from .primitives import LayerNorm, Linear, row_blocks

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

    def forward(
        self,
        s: torch.Tensor,
        z: torch.Tensor,
        frames: Rigid,
        mask: torch.Tensor,
        options: InferenceOptions | None = None,
    ) -> torch.Tensor:
        """s: [*, N, C_s]; z: [*, N, N, C_z]; frames: batch shape [*, N]; mask: [*, N]. Returns [*, N, C_s]
        (by blocks of query residues when `options` chunk)."""
        chunk = None if options is None else self.query_chunk(options, s.shape[-2], z.shape[-1], z.element_size())
        bias = self.linear_b(z).movedim(-1, -3)
        return self.attend(s, frames, mask, bias, lambda r0, r1: z[..., r0:r1, :, :], chunk)

    def query_chunk(self, options: InferenceOptions, n: int, c_z: int, itemsize: int) -> int | None:
        """Query residues per block: per query, the point distances ([N, H, P, 3], twice) and its pair row."""
        c = self.cfg
        per_row = n * (2 * 3 * c.ipa_heads * c.ipa_point_qk + 2 * c_z + 4 * c.ipa_heads) * itemsize
        return options.rows_per_chunk(n, per_row)

    def attend(
        self,
        s: torch.Tensor,
        frames: Rigid,
        mask: torch.Tensor,
        bias: torch.Tensor,
        pair_rows: Callable[[int, int], torch.Tensor],
        chunk: int | None,
    ) -> torch.Tensor:
        """Alg. 22 given the pair bias `linear_b(z)` [*, H, N, N] and `pair_rows(r0, r1)` = z[..., r0:r1, :, :]
        (the pair rows of those query residues), computed by blocks of `chunk` query residues."""
        c, h = self.cfg, self.cfg.ipa_heads
        q = self.linear_q(s).unflatten(-1, (h, c.ipa_scalar_qk))
        k, v = self.linear_kv(s).unflatten(-1, (h, -1)).split([c.ipa_scalar_qk, c.ipa_scalar_v], dim=-1)
        q_pts = self._points(self.linear_q_points, s, frames, c.ipa_point_qk)
        k_pts, v_pts = self._points(self.linear_kv_points, s, frames, c.ipa_point_qk + c.ipa_point_v).split(
            [c.ipa_point_qk, c.ipa_point_v], dim=-2
        )
        scalar_w = math.sqrt(1.0 / (3 * max(c.ipa_scalar_qk, 1)))
        point_w = math.sqrt(1.0 / (3 * max(c.ipa_point_qk, 1) * 9.0 / 2))
        gamma = nn.functional.softplus(self.head_weights) * point_w
        outs = []
        for r0, r1 in row_blocks(s.shape[-2], chunk):
            logits = torch.einsum("...ihc,...jhc->...hij", q[..., r0:r1, :, :] * scalar_w, k)
            d2 = ((q_pts[..., r0:r1, None, :, :, :] - k_pts[..., None, :, :, :, :]) ** 2).sum(-1)  # [*, i, j, H, P]
            logits = logits - 0.5 * torch.einsum("...ijhp,h->...hij", d2, gamma)
            del d2
            logits = logits + math.sqrt(1.0 / 3) * bias[..., r0:r1, :]
            mask_2d = mask[..., r0:r1, None] * mask[..., None, :]
            attn = torch.softmax(logits - 1e5 * (1.0 - mask_2d[..., None, :, :]), dim=-1)  # [*, H, i, j]
            del logits
            o = torch.einsum("...hij,...jhc->...ihc", attn, v).flatten(-2)
            o_pt = torch.einsum("...hij,...jhpx->...ihpx", attn, v_pts)  # global frame
            rows = frames if chunk is None else Rigid(frames.rot[..., r0:r1, :, :], frames.trans[..., r0:r1, :])
            o_pt = rows.unsqueeze(-1).unsqueeze(-1).invert_apply(o_pt)  # [*, i, H, P_v, 3] local
            o_pt_norm = torch.sqrt(1e-8 + (o_pt**2).sum(-1))
            o_pair = torch.einsum("...hij,...ijc->...ihc", attn, pair_rows(r0, r1)).flatten(-2)
            feats = [o, *(o_pt[..., k].flatten(-2) for k in range(3)), o_pt_norm.flatten(-2), o_pair]
            outs.append(self.linear_out(torch.cat(feats, dim=-1)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


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

    def _fold_block(self, s, s_initial, ipa_pair, quat, trans, mask):
        frames = Rigid(quat_to_rot(quat), trans)
        s = self.layer_norm_ipa(s + self.ipa.attend(s, frames, mask, *ipa_pair))
        a = s
        for i, linear in enumerate(self.transition):
            a = linear(a)
            if i < len(self.transition) - 1:
                a = torch.relu(a)
        s = self.layer_norm_transition(s + a)
        quat, trans = self.bb_update(s, quat, trans)
        return s, quat, trans

    def _ipa_pair(self, z: torch.Tensor, options: InferenceOptions | None):
        """What every IPA layer needs from the (fixed) pair: its bias [*, H, N, N], a function giving the
        LayerNormed pair rows of a block of query residues, and that block size. Chunked, the LayerNorm of
        the whole pair is never held: the bias is built by row blocks and the rows recomputed per layer."""
        n = z.shape[-2]
        chunk = None if options is None else self.ipa.query_chunk(options, n, z.shape[-1], z.element_size())
        if chunk is None:
            z_ln = self.layer_norm_z(z)
            return self.ipa.linear_b(z_ln).movedim(-1, -3), lambda r0, r1: z_ln[..., r0:r1, :, :], None
        bias = z.new_empty(*z.shape[:-3], self.ipa.linear_b.out_features, n, n)
        for r0, r1 in row_blocks(n, chunk):
            bias[..., r0:r1, :] = self.ipa.linear_b(self.layer_norm_z(z[..., r0:r1, :, :])).movedim(-1, -3)
        return bias, lambda r0, r1: self.layer_norm_z(z[..., r0:r1, :, :]), chunk

    def forward(
        self,
        s: torch.Tensor,
        z: torch.Tensor,
        aatype: torch.Tensor,
        mask: torch.Tensor,
        options: InferenceOptions | None = None,
    ) -> dict[str, torch.Tensor]:
        """s: [*, N, C_s]; z: [*, N, N, C_z]; aatype: [*, N]; mask: seq_mask [*, N]; options: chunking of IPA.

        Returns `single` [*, N, C_s] (after the last block), `frames` [*, N, 4, 4] (Angstrom),
        `angles` and `unnormalized_angles` [*, N, 7, 2], `atom14_positions` [*, N, 14, 3] (Angstrom).
        """
        s_initial = self.layer_norm_s(s)
        ipa_pair = self._ipa_pair(z, options)
        s = self.linear_in(s_initial)
        quat = torch.zeros(*s.shape[:-1], 4, dtype=s.dtype, device=s.device)
        quat[..., 0] = 1
        trans = torch.zeros(*s.shape[:-1], 3, dtype=s.dtype, device=s.device)
        mask = mask.to(s.dtype)
        for _ in range(self.cfg.num_layers):
            s, quat, trans = self._fold_block(s, s_initial, ipa_pair, quat, trans, mask)
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
