"""Input, recycling, template and extra-MSA embedders (AlphaFold2 suppl. Alg. 2-5, 16, 17, 32; 1.7.1)."""

from __future__ import annotations

import torch
from torch import nn

from ..common import residue_constants as rc
from ..common.geometry import atom37_to_torsion_angles, dgram_from_positions, pseudo_beta
from .config import AlphaFoldConfig, TemplateConfig
from .evoformer import TemplatePairStack
from .options import InferenceOptions
from .primitives import Attention, LayerNorm, Linear, chunked, mask_keep, row_blocks

__all__ = ["ExtraMSAEmbedder", "InputEmbedder", "RecyclingEmbedder", "TemplateAngleEmbedder", "TemplateEmbedder"]


class InputEmbedder(nn.Module):
    """AlphaFold2 suppl. Alg. 3 (input embedding) with Alg. 4 (relative position encoding)."""

    def __init__(self, cfg: AlphaFoldConfig):
        super().__init__()
        self.max_rel = cfg.max_relative_feature
        self.linear_tf_z_i = Linear(cfg.target_feat_dim, cfg.c_z)
        self.linear_tf_z_j = Linear(cfg.target_feat_dim, cfg.c_z)
        self.linear_tf_m = Linear(cfg.target_feat_dim, cfg.c_m)
        self.linear_msa_m = Linear(cfg.msa_feat_dim, cfg.c_m)
        self.linear_relpos = Linear(2 * cfg.max_relative_feature + 1, cfg.c_z)

    def forward(
        self,
        target_feat: torch.Tensor,
        residue_index: torch.Tensor,
        msa_feat: torch.Tensor,
        options: InferenceOptions | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """target_feat: [*, N, 22]; residue_index: [*, N]; msa_feat: [*, S, N, 49].
        Returns m: [*, S, N, C_m] and z: [*, N, N, C_z] (the relative positions added by row blocks when
        `options` chunk)."""
        m = self.linear_msa_m(msa_feat) + self.linear_tf_m(target_feat)[..., None, :, :]
        z = self.linear_tf_z_i(target_feat)[..., :, None, :] + self.linear_tf_z_j(target_feat)[..., None, :, :]
        n = z.shape[-2]
        chunk = None if options is None else options.rows_per_chunk(n, n * 2 * z.shape[-1] * z.element_size())
        for r0, r1 in row_blocks(n, chunk):
            z[..., r0:r1, :, :] += self._relpos(residue_index[..., r0:r1], residue_index, z.dtype)
        return m, z

    def _relpos(self, index_i: torch.Tensor, index_j: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Alg. 4: Linear(one_hot(clip(i - j))) as a row lookup of the weight plus the bias, which is what
        the product with a one-hot computes. index_i: [*, R]; index_j: [*, N]. Returns [*, R, N, C_z]."""
        offset = index_i[..., :, None].long() - index_j[..., None, :].long()
        rel = torch.clamp(offset + self.max_rel, 0, 2 * self.max_rel)
        weight = self.linear_relpos.weight.to(dtype)
        return nn.functional.embedding(rel, weight.T) + self.linear_relpos.bias.to(dtype)


class RecyclingEmbedder(nn.Module):
    """AlphaFold2 suppl. Alg. 32: previous first MSA row, pair and pseudo-beta distances into this pass."""

    def __init__(self, cfg: AlphaFoldConfig):
        super().__init__()
        self.bins = (cfg.recycle_bins, cfg.recycle_min_bin, cfg.recycle_max_bin)
        self.layer_norm_m = LayerNorm(cfg.c_m)
        self.layer_norm_z = LayerNorm(cfg.c_z)
        self.linear = Linear(cfg.recycle_bins, cfg.c_z)

    def forward(
        self, aatype: torch.Tensor, prev_m1: torch.Tensor, prev_z: torch.Tensor, prev_x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """aatype: [*, N]; prev_m1: [*, N, C_m]; prev_z: [*, N, N, C_z]; prev_x: atom37 positions [*, N, 37, 3].
        Returns the updates to the first MSA row [*, N, C_m] and to the pair [*, N, N, C_z]."""
        cb, _ = pseudo_beta(aatype, prev_x)
        dgram = dgram_from_positions(cb, *self.bins)
        return self.layer_norm_m(prev_m1), self.layer_norm_z(prev_z) + self.linear(dgram)

    def add_pair_(
        self,
        z: torch.Tensor,
        aatype: torch.Tensor,
        prev_z: torch.Tensor,
        prev_x: torch.Tensor,
        options: InferenceOptions,
    ) -> torch.Tensor:
        """`z += forward(...)[1]` by row blocks, in place (inference). z, prev_z: [*, N, N, C_z] (prev_z may be
        an expanded view); aatype: [*, N]; prev_x: [*, N, 37, 3]. Returns z."""
        cb, _ = pseudo_beta(aatype, prev_x)
        dgram = dgram_from_positions(cb, *self.bins)  # [*, N, N, bins]: small next to the pair
        n = z.shape[-2]
        chunk = options.rows_per_chunk(n, n * 3 * z.shape[-1] * z.element_size())
        for r0, r1 in row_blocks(n, chunk):
            update = self.layer_norm_z(prev_z[..., r0:r1, :, :]).add_(self.linear(dgram[..., r0:r1, :, :]))
            z[..., r0:r1, :, :] += update
        return z


class ExtraMSAEmbedder(nn.Module):
    """AlphaFold2 suppl. Alg. 2 line 14: extra-MSA one-hot and deletion features to c_e channels."""

    def __init__(self, cfg: AlphaFoldConfig):
        super().__init__()
        self.linear = Linear(cfg.extra_msa_feat_dim, cfg.c_e)

    def forward(
        self, extra_msa: torch.Tensor, extra_has_deletion: torch.Tensor, extra_deletion_value: torch.Tensor
    ) -> torch.Tensor:
        """extra_msa: [*, S_e, N] (0..22); extra_has_deletion, extra_deletion_value: [*, S_e, N].
        Returns [*, S_e, N, C_e]."""
        dtype = self.linear.weight.dtype
        one_hot = nn.functional.one_hot(extra_msa.long(), self.linear.in_features - 2).to(dtype)
        feat = torch.cat(
            [one_hot, extra_has_deletion[..., None].to(dtype), extra_deletion_value[..., None].to(dtype)], -1
        )
        return self.linear(feat)


def template_pair_features(batch: dict[str, torch.Tensor], cfg: TemplateConfig, dtype: torch.dtype) -> torch.Tensor:
    """AlphaFold2 suppl. Alg. 2 line 9 / 1.7.1: per-template pair features [*, T, N, N, 88].

    Channels: distogram of pseudo-beta (39), its pair mask (1), aatype one-hot of j and of i (22 + 22),
    backbone unit vector (3; zeros, as in the released monomer models) and the backbone pair mask (1).
    """
    pb_mask = batch["template_pseudo_beta_mask"].to(dtype)
    pb_mask_2d = pb_mask[..., :, None] * pb_mask[..., None, :]
    dgram = dgram_from_positions(
        batch["template_pseudo_beta"].to(dtype), cfg.dgram_bins, cfg.dgram_min_bin, cfg.dgram_max_bin
    )
    n = dgram.shape[-2]
    aatype = nn.functional.one_hot(batch["template_aatype"].long(), 22).to(dtype)
    atom_mask = batch["template_all_atom_masks"].to(dtype)
    bb = atom_mask[..., rc.atom_order["N"]] * atom_mask[..., rc.atom_order["CA"]] * atom_mask[..., rc.atom_order["C"]]
    bb_2d = bb[..., :, None] * bb[..., None, :]
    # DISCREPANCY: the unit-vector channels are always zero; every released monomer model sets
    # use_template_unit_vector = False, so they carry no information there.
    feats = [
        dgram,
        pb_mask_2d[..., None],
        aatype[..., None, :, :].expand(*aatype.shape[:-2], n, n, 22),
        aatype[..., :, None, :].expand(*aatype.shape[:-2], n, n, 22),
        torch.zeros(*bb_2d.shape, 3, dtype=dtype, device=bb_2d.device),
        bb_2d[..., None],
    ]
    return torch.cat(feats, dim=-1) * bb_2d[..., None]


class TemplatePointwiseAttention(nn.Module):
    """AlphaFold2 suppl. Alg. 17: each pair entry attends over the templates (no gating)."""

    def __init__(self, c_z: int, c_t: int, heads: int, head_dim: int):
        super().__init__()
        self.mha = Attention(c_z, c_t, heads, head_dim, c_z, gating=False)

    def forward(
        self, t: torch.Tensor, z: torch.Tensor, template_mask: torch.Tensor, options: InferenceOptions
    ) -> torch.Tensor:
        """t: [*, T, N, N, C_t]; z: [*, N, N, C_z]; template_mask: [*, T]. Returns [*, N, N, C_z]."""
        t = t.movedim(-4, -2)  # [*, N, N, T, C_t]
        mask = mask_keep(template_mask)[..., None, None, None, None, :]  # [*, 1, 1, 1, 1, T]
        q = z[..., None, :]  # [*, N, N, 1, C_z]
        chunk = options.rows_per_chunk(
            z.shape[-3], z.shape[-2] * t.shape[-2] * (t.shape[-1] + z.shape[-1]) * t.element_size()
        )

        def run(q_c: torch.Tensor, t_c: torch.Tensor) -> torch.Tensor:
            return self.mha(q_c, t_c, mask=mask)

        out = chunked(run, [q, t], q.dim() - 4, chunk)[..., 0, :]
        return out * (template_mask.sum(-1) > 0).to(out.dtype)[..., None, None, None]


class TemplateEmbedder(nn.Module):
    """AlphaFold2 suppl. Alg. 2 lines 9-13: template pair embedding, pair stack, pointwise attention."""

    def __init__(self, cfg: AlphaFoldConfig):
        super().__init__()
        t = cfg.template
        self.cfg = t
        self.template_pair_embedder = Linear(t.dgram_bins + 1 + 2 * 22 + 3 + 1, t.c_t)
        self.template_pair_stack = TemplatePairStack(t)
        self.template_pointwise_att = TemplatePointwiseAttention(
            cfg.c_z, t.c_t, t.pointwise_heads, t.pointwise_head_dim
        )

    def forward(
        self, batch: dict[str, torch.Tensor], z: torch.Tensor, pair_mask: torch.Tensor, options: InferenceOptions
    ) -> torch.Tensor:
        """batch: the `template_*` features with T templates; z: [*, N, N, C_z]; pair_mask: [*, N, N].
        Returns the update to z [*, N, N, C_z]."""
        feats = template_pair_features(batch, self.cfg, z.dtype)
        t = self.template_pair_embedder(feats)  # [*, T, N, N, C_t]
        t = self.template_pair_stack(t, pair_mask[..., None, :, :].to(z.dtype), options)
        return self.template_pointwise_att(t, z, batch["template_mask"].to(z.dtype), options)


class TemplateAngleEmbedder(nn.Module):
    """AlphaFold2 suppl. Alg. 2 lines 7-8: template torsion-angle features appended to the MSA as rows."""

    def __init__(self, cfg: AlphaFoldConfig):
        super().__init__()
        self.linear_1 = Linear(22 + 14 + 14 + 7, cfg.c_m)
        self.linear_2 = Linear(cfg.c_m, cfg.c_m)

    def forward(self, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """batch: `template_aatype` [*, T, N], `template_all_atom_positions` [*, T, N, 37, 3],
        `template_all_atom_masks` [*, T, N, 37]. Returns MSA rows [*, T, N, C_m] and their mask [*, T, N]
        (whether psi is defined)."""
        aatype = batch["template_aatype"].long()
        ang = atom37_to_torsion_angles(
            aatype, batch["template_all_atom_positions"].to(dtype), batch["template_all_atom_masks"].to(dtype)
        )
        feats = torch.cat(
            [
                nn.functional.one_hot(aatype, 22).to(dtype),
                ang["torsion_angles_sin_cos"].flatten(-2),
                ang["alt_torsion_angles_sin_cos"].flatten(-2),
                ang["torsion_angles_mask"],
            ],
            dim=-1,
        )
        return self.linear_2(torch.relu(self.linear_1(feats))), ang["torsion_angles_mask"][..., 2]
