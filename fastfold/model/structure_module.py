"""Structure module: invariant point attention, backbone update, angle resnet, all-atom coordinates
(AlphaFold2 suppl. Alg. 20-25), and AlphaFold-Multimer's variant of it (Evans et al. 2021, suppl. 2).

Frames carry their translations in units of 1/position_scale Angstrom inside the fold block, as AlphaFold
does; outputs are in Angstrom. AlphaFold2's rotations are tracked as quaternions (Alg. 23) and turned into
matrices; AlphaFold-Multimer composes rotation matrices.
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

__all__ = [
    "AngleResnet",
    "BackboneUpdate",
    "InvariantPointAttention",
    "InvariantPointAttentionMultimer",
    "StructureModule",
    "StructureModuleMultimer",
    "quat_rigid",
]


class _PointAttention(nn.Module):
    """What both IPA variants share: how many query residues one block takes."""

    cfg: StructureModuleConfig

    def query_chunk(self, options: InferenceOptions, n: int, c_z: int, itemsize: int) -> int | None:
        """Query residues per block: per query, the point distances ([N, H, P, 3], twice) and its pair row."""
        c = self.cfg
        per_row = n * (2 * 3 * c.ipa_heads * c.ipa_point_qk + 2 * c_z + 4 * c.ipa_heads) * itemsize
        return options.rows_per_chunk(n, per_row)


class InvariantPointAttention(_PointAttention):
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
    """AlphaFold2 suppl. Alg. 20 (inference: no auxiliary losses), with the shared-weight fold block.

    One forward for both models; `StructureModuleMultimer` overrides the hooks where AlphaFold-Multimer
    differs: its IPA, how the pair reaches the IPA, and frames kept as rotation matrices (`_identity_frames`,
    `_update_frames`, `_angstrom`) where AlphaFold2 tracks quaternions (Alg. 23)."""

    def __init__(self, cfg: StructureModuleConfig):
        super().__init__()
        self.cfg = cfg
        self.layer_norm_s = LayerNorm(cfg.c_s)
        self.layer_norm_z = LayerNorm(cfg.c_z)
        self.linear_in = Linear(cfg.c_s, cfg.c_s)
        self.ipa = self._point_attention(cfg)
        self.layer_norm_ipa = LayerNorm(cfg.c_s)
        self.transition = nn.ModuleList(Linear(cfg.c_s, cfg.c_s) for _ in range(cfg.transition_layers))
        self.layer_norm_transition = LayerNorm(cfg.c_s)
        self.bb_update = self._backbone_update(cfg)
        self.angle_resnet = AngleResnet(cfg.c_s, cfg.c_resnet, cfg.resnet_blocks)

    def forward(self, s: torch.Tensor, z: torch.Tensor, aatype: torch.Tensor, mask: torch.Tensor,
                options: InferenceOptions | None = None) -> dict[str, torch.Tensor]:
        """s: [*, N, C_s]; z: [*, N, N, C_z]; aatype: [*, N]; mask: seq_mask [*, N]; options: chunking of IPA.

        Returns `single` [*, N, C_s] (after the last block), `frames` [*, N, 4, 4] (Angstrom),
        `angles` and `unnormalized_angles` [*, N, 7, 2], `atom14_positions` [*, N, 14, 3] (Angstrom).
        """
        s_initial = self.layer_norm_s(s)
        ipa_pair = self._ipa_pair(z, options)
        s = self.linear_in(s_initial)
        frames = self._identity_frames(s)
        mask = mask.to(s.dtype)
        for _ in range(self.cfg.num_layers):
            s = self.layer_norm_ipa(s + self._attend(s, ipa_pair, frames, mask))
            s = self.layer_norm_transition(s + self._transition(s))
            frames = self._update_frames(s, frames)
        # Only the last iteration's side chains are part of the inference outputs.
        raw, angles = self.angle_resnet(s, s_initial)
        backbone = self._angstrom(frames)
        all_frames = torsion_angles_to_frames(aatype.long(), backbone, angles)
        return {
            "single": s,
            "frames": backbone.to_tensor_4x4(),
            "angles": angles,
            "unnormalized_angles": raw,
            "atom14_positions": frames_to_atom14_positions(aatype.long(), all_frames),
        }

    def _transition(self, s: torch.Tensor) -> torch.Tensor:
        """Alg. 20 line 8: Linear layers with ReLU between them. s: [*, N, C_s]. Returns the update to s."""
        a = s
        for i, linear in enumerate(self.transition):
            a = linear(a)
            if i < len(self.transition) - 1:
                a = torch.relu(a)
        return a

    # -- the hooks (AlphaFold2 here, AlphaFold-Multimer in StructureModuleMultimer) ---------------------------

    @staticmethod
    def _point_attention(cfg: StructureModuleConfig) -> nn.Module:
        return InvariantPointAttention(cfg)

    @staticmethod
    def _backbone_update(cfg: StructureModuleConfig) -> nn.Module:
        return BackboneUpdate(cfg.c_s)

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

    def _identity_frames(self, s: torch.Tensor):
        """(quaternion [*, N, 4], translation [*, N, 3]) of the identity, for s [*, N, C_s]."""
        quat = torch.zeros(*s.shape[:-1], 4, dtype=s.dtype, device=s.device)
        quat[..., 0] = 1
        return quat, torch.zeros(*s.shape[:-1], 3, dtype=s.dtype, device=s.device)

    def _attend(self, s: torch.Tensor, ipa_pair, frames, mask: torch.Tensor) -> torch.Tensor:
        """Alg. 20 line 6: the IPA update to s [*, N, C_s]."""
        quat, trans = frames
        return self.ipa.attend(s, Rigid(quat_to_rot(quat), trans), mask, *ipa_pair)

    def _update_frames(self, s: torch.Tensor, frames):
        """Alg. 20 line 10 (Alg. 23): the frames composed with the update predicted from s."""
        return self.bb_update(s, *frames)

    def _angstrom(self, frames) -> Rigid:
        """The frames as a `Rigid` with translations in Angstrom."""
        quat, trans = frames
        return Rigid(quat_to_rot(quat), trans * self.cfg.position_scale)


# ---------------------------------------------------------------------------------------------------------
# AlphaFold-Multimer.


class InvariantPointAttentionMultimer(_PointAttention):
    """AlphaFold-Multimer's IPA: scalar q/k/v without bias, per-head point projections (each head's x, y, z
    blocks of points), all logit terms scaled by sqrt(1/3) together; the output point norm clipped at 1e-8."""

    def __init__(self, cfg: StructureModuleConfig):
        super().__init__()
        h, self.cfg = cfg.ipa_heads, cfg
        self.heads = h
        """Heads, as the parameter files' per-head layout of the projections needs them."""
        self.linear_q = Linear(cfg.c_s, h * cfg.ipa_scalar_qk, bias=False)
        self.linear_k = Linear(cfg.c_s, h * cfg.ipa_scalar_qk, bias=False)
        self.linear_v = Linear(cfg.c_s, h * cfg.ipa_scalar_v, bias=False)
        self.linear_q_points = Linear(cfg.c_s, h * 3 * cfg.ipa_point_qk)
        self.linear_k_points = Linear(cfg.c_s, h * 3 * cfg.ipa_point_qk)
        self.linear_v_points = Linear(cfg.c_s, h * 3 * cfg.ipa_point_v)
        self.linear_b = Linear(cfg.c_z, h)
        self.head_weights = nn.Parameter(torch.full((h,), math.log(math.e - 1.0)))
        self.linear_out = Linear(h * (cfg.c_z + cfg.ipa_scalar_v + 4 * cfg.ipa_point_v), cfg.c_s)

    def _points(self, linear: Linear, s: torch.Tensor, frames: Rigid) -> torch.Tensor:
        """Global points [*, N, H, P, 3] from the per-head layout [H, (x: P, y: P, z: P)]."""
        local = linear(s).unflatten(-1, (self.cfg.ipa_heads, -1))  # [*, N, H, 3P]
        local = torch.stack(local.chunk(3, dim=-1), dim=-1)  # [*, N, H, P, 3]
        return frames.unsqueeze(-1).unsqueeze(-1).apply(local)

    def forward(self, s: torch.Tensor, z_ln: torch.Tensor, bias: torch.Tensor, frames: Rigid, mask: torch.Tensor,
                chunk: int | None) -> torch.Tensor:
        """s: [*, N, C_s]; z_ln: the LayerNormed pair [*, N, N, C_z]; bias: `linear_b(z_ln)` as [*, H, N, N];
        frames: batch shape [*, N]; mask: [*, N]. Returns the update to s [*, N, C_s], by blocks of `chunk`
        query residues."""
        c, h = self.cfg, self.cfg.ipa_heads
        q = self.linear_q(s).unflatten(-1, (h, -1)) * math.sqrt(1.0 / c.ipa_scalar_qk)
        k = self.linear_k(s).unflatten(-1, (h, -1))
        v = self.linear_v(s).unflatten(-1, (h, -1))
        q_pts = self._points(self.linear_q_points, s, frames)
        k_pts = self._points(self.linear_k_points, s, frames)
        v_pts = self._points(self.linear_v_points, s, frames)
        w = nn.functional.softplus(self.head_weights) * math.sqrt(1.0 / (max(c.ipa_point_qk, 1) * 9.0 / 2))
        outs = []
        for r0, r1 in row_blocks(s.shape[-2], chunk):
            d2 = ((q_pts[..., r0:r1, None, :, :, :] - k_pts[..., None, :, :, :, :]) ** 2).sum(-1)  # [*, i, j, H, P]
            logits = -0.5 * torch.einsum("...ijhp,h->...hij", d2, w)
            del d2
            logits = logits + torch.einsum("...ihc,...jhc->...hij", q[..., r0:r1, :, :], k)
            logits = logits + bias[..., r0:r1, :]
            mask_2d = mask[..., r0:r1, None] * mask[..., None, :]
            logits = (logits + 1e5 * (mask_2d[..., None, :, :] - 1)) * math.sqrt(1.0 / 3)
            attn = torch.softmax(logits, dim=-1)  # [*, H, i, j]
            del logits
            o = torch.einsum("...hij,...jhc->...ihc", attn, v).flatten(-2)
            o_pt = torch.einsum("...hij,...jhpx->...ihpx", attn, v_pts)
            rows = Rigid(frames.rot[..., r0:r1, :, :], frames.trans[..., r0:r1, :])
            o_pt = rows.unsqueeze(-1).unsqueeze(-1).invert_apply(o_pt)  # [*, i, H, P_v, 3] local
            o_pt_norm = torch.sqrt(torch.clamp((o_pt**2).sum(-1), min=1e-16))
            o_pair = torch.einsum("...hij,...ijc->...ihc", attn, z_ln[..., r0:r1, :, :]).flatten(-2)
            feats = [o, *(o_pt[..., k].flatten(-2) for k in range(3)), o_pt_norm.flatten(-2), o_pair]
            outs.append(self.linear_out(torch.cat(feats, dim=-1)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def quat_rigid(update: torch.Tensor) -> Rigid:
    """AlphaFold-Multimer's `QuatRigid`: update [*, 6] = (b, c, d, translation); the rotation of the
    quaternion (1, b, c, d) normalised (norm clipped at 1e-3)."""
    x, y, zq = update[..., 0], update[..., 1], update[..., 2]
    w = torch.ones_like(x)
    inv = torch.rsqrt(torch.clamp(w * w + x * x + y * y + zq * zq, min=1e-6))
    w, x, y, zq = w * inv, x * inv, y * inv, zq * inv
    rows = [
        [1 - 2 * (y * y + zq * zq), 2 * (x * y - w * zq), 2 * (x * zq + w * y)],
        [2 * (x * y + w * zq), 1 - 2 * (x * x + zq * zq), 2 * (y * zq - w * x)],
        [2 * (x * zq - w * y), 2 * (y * zq + w * x), 1 - 2 * (x * x + y * y)],
    ]
    rot = torch.stack([torch.stack(r, dim=-1) for r in rows], dim=-2)
    return Rigid(rot, update[..., 3:])


class StructureModuleMultimer(StructureModule):
    """AlphaFold-Multimer's structure module: the fold block of `StructureModule` with the multimer IPA, the
    LayerNormed pair held whole, and frames kept as rotation matrices composed with `quat_rigid` (translations
    times `position_scale`, 20 for AlphaFold-Multimer, give Angstrom)."""

    @staticmethod
    def _point_attention(cfg: StructureModuleConfig) -> nn.Module:
        return InvariantPointAttentionMultimer(cfg)

    @staticmethod
    def _backbone_update(cfg: StructureModuleConfig) -> nn.Module:
        return Linear(cfg.c_s, 6)  # AlphaFold-Multimer's `QuatRigid`: (b, c, d, translation)

    def _ipa_pair(self, z: torch.Tensor, options: InferenceOptions | None):
        """The LayerNormed pair [*, N, N, C_z], its bias [*, H, N, N] and the query block size."""
        z_ln = self.layer_norm_z(z)
        bias = self.ipa.linear_b(z_ln).movedim(-1, -3)
        chunk = None if options is None else self.ipa.query_chunk(options, z.shape[-2], z.shape[-1], z.element_size())
        return z_ln, bias, chunk

    def _identity_frames(self, s: torch.Tensor) -> Rigid:
        return Rigid.identity(tuple(s.shape[:-1]), s.dtype, s.device)

    def _attend(self, s: torch.Tensor, ipa_pair, frames: Rigid, mask: torch.Tensor) -> torch.Tensor:
        z_ln, bias, chunk = ipa_pair
        return self.ipa(s, z_ln, bias, frames, mask, chunk)

    def _update_frames(self, s: torch.Tensor, frames: Rigid) -> Rigid:
        return frames.compose(quat_rigid(self.bb_update(s)))

    def _angstrom(self, frames: Rigid) -> Rigid:
        return frames.scale_translation(self.cfg.position_scale)
