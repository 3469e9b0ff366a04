"""The AlphaFold-Multimer model (v2.x / v3, inference): chain-aware relative positions, the multimer template
embedder, the multimer structure module (IPA with per-head point projections, quaternion rigid update; in
`structure_module.py` beside the monomer one), the confidence heads with pTM and interface pTM (ipTM), ranked by
0.8 ipTM + 0.2 pTM. The recycling loop and the pass are the monomer's (`alphafold.RecyclingModel`); the model
overrides its hooks where AlphaFold-Multimer differs.

Following the AlphaFold-Multimer paper (Evans et al. 2021, bioRxiv 2021.10.04.463034, suppl. 2-3) and the
public AlphaFold v2.3 `modules_multimer` description; the numbers equal OpenFold's multimer model in float64
(tests/assets/multimer_model). The Evoformer and extra-MSA stacks are the monomer ones with the outer product
mean first in each block (`opm_first`); v3 parameter files fuse the triangle multiplications' left/right
projections (`fastfold.params.multimer` splits them into our two linears).

Parameter files are read and written by `fastfold.params.multimer`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..common import residue_constants as rc
from ..common.geometry import (
    pseudo_beta,
    residue_constant_tensor,
)
from ..common.rigid import Rigid
from .alphafold import RecyclingModel
from .config import (
    AlphaFoldConfig,
    EvoformerStackConfig,
    HeadsConfig,
    PipelineConfig,
    StructureModuleConfig,
    TemplateConfig,
)
from .embedders import ExtraMSAEmbedder, RecyclingEmbedder
from .evoformer import EvoformerStack, ExtraMSAStack, TemplatePairStack
from .heads import AuxiliaryHeads
from .options import DEFAULT_OPTIONS, InferenceOptions
from .primitives import LayerNorm, Linear, row_blocks
from .structure_module import StructureModuleMultimer

__all__ = [
    "FEATURE_NAMES",
    "AlphaFoldMultimer",
    "MultimerConfig",
    "compute_tm",
    "multimer_model_names",
    "multimer_preset",
    "multimer_tiny",
]

FEATURE_NAMES = (
    "aatype", "residue_index",
    "asym_id", "entity_id", "sym_id",  # the chains: relative encoding, template pairs, ipTM
    "seq_mask", "target_feat", "msa_feat", "msa_mask", "extra_msa", "extra_msa_mask",
    "extra_deletion_matrix",  # where the monomer reads extra_has_deletion and extra_deletion_value
    "template_aatype", "template_all_atom_positions", "template_all_atom_mask",  # no template_mask, pseudo-beta
    "residx_atom37_to_atom14", "atom37_atom_exists",
)
"""Features the multimer model reads (each with the recycling passes on its trailing axis), as
`fastfold.data.multimer.process_multimer_features` writes them."""


@dataclass(kw_only=True)
class MultimerConfig(AlphaFoldConfig):
    """The AlphaFold-Multimer model: the monomer fields with the multimer defaults, plus its own."""

    target_feat_dim: int = 21
    """Channels of `target_feat` (the one-hot aatype; no between-segment channel)."""
    max_relative_chain: int = 2
    """Clip of the relative chain (sym_id) encoding."""
    fuse_projection_weights: bool = True
    """Whether the parameter file fuses the triangle multiplications' projections (v3 files do; v1/v2 not)."""
    recycle_early_stop_tolerance: float = 0.5
    """Stop recycling once the Ca distance matrix moves by at most this (Angstrom, RMS); negative: never."""
    iptm_weight: float = 0.8
    """Weight of ipTM in the ranking confidence."""
    ptm_weight: float = 0.2
    """Weight of pTM in the ranking confidence."""
    structure_module: StructureModuleConfig = field(
        default_factory=lambda: StructureModuleConfig(position_scale=20.0)
    )
    """Structure module (translations in units of 1/20 Angstrom, as AlphaFold-Multimer)."""
    heads: HeadsConfig = field(default_factory=lambda: HeadsConfig(masked_msa_classes=22, tm=True))
    """Output heads (22 masked-MSA classes; the PAE head always)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_relative_chain < 0:
            raise ValueError("MultimerConfig.max_relative_chain must be >= 0")
        if not self.heads.tm:
            raise ValueError("MultimerConfig: the multimer model always has the PAE head (heads.tm)")


_MODEL_NAME = re.compile(r"model_([1-5])_multimer(?:_(v2|v3))?")


def multimer_model_names() -> list[str]:
    """The released multimer models: model_N_multimer (v1), model_N_multimer_v2, model_N_multimer_v3."""
    return [f"model_{i}_multimer{s}" for s in ("", "_v2", "_v3") for i in range(1, 6)]


def multimer_preset(name: str) -> MultimerConfig:
    """The configuration of a released multimer model, e.g. "model_1_multimer_v3": released sizes, MSA sizes
    (`fastfold.data.multimer.multimer_msa_sizes`), 20 recycles with early stop at 0.5 A (AlphaFold v2.3)."""
    match = _MODEL_NAME.fullmatch(name)
    if not match:
        raise ValueError(f"multimer_preset: unknown model name {name!r}; expected one of "
                         f"{', '.join(multimer_model_names())}")
    index, version = int(match.group(1)), match.group(2)
    v3 = version == "v3"
    clusters, extra = (508, 1152 if index in (4, 5) else 2048) if v3 else (252, 1152)
    return MultimerConfig(
        fuse_projection_weights=v3,
        pipeline=PipelineConfig(max_msa_clusters=clusters, max_extra_msa=extra, max_templates=4, num_recycle=20),
    )


def multimer_tiny(*, fuse: bool = True) -> MultimerConfig:
    """A very small multimer model with every component, for tests (seconds on one CPU core)."""
    c_m, c_z, c_s, c_e = 16, 8, 16, 8
    stack = dict(
        c_z=c_z, msa_heads=2, msa_head_dim=4, column_head_dim=4, opm_channels=4, tri_mul_channels=6,
        pair_heads=2, pair_head_dim=4, msa_transition_factor=2, pair_transition_factor=2, c_s=c_s,
    )
    return MultimerConfig(
        c_m=c_m, c_z=c_z, c_s=c_s, c_e=c_e, max_relative_feature=4, max_relative_chain=1,
        fuse_projection_weights=fuse,
        evoformer=EvoformerStackConfig(num_blocks=2, c_m=c_m, **stack),
        extra_msa=EvoformerStackConfig(num_blocks=1, c_m=c_e, column_attention="global", **stack),
        template=TemplateConfig(c_t=6, num_blocks=1, pair_heads=2, pair_head_dim=3, tri_mul_channels=5),
        structure_module=StructureModuleConfig(
            c_s=c_s, c_z=c_z, num_layers=2, ipa_heads=2, ipa_scalar_qk=4, ipa_scalar_v=3, ipa_point_qk=2,
            ipa_point_v=3, c_resnet=8, position_scale=20.0,
        ),
        heads=HeadsConfig(plddt_bins=10, plddt_channels=8, distogram_bins=12, pae_bins=9, masked_msa_classes=22,
                          tm=True),
        pipeline=PipelineConfig(max_msa_clusters=5, max_extra_msa=7, max_templates=2, num_recycle=1),
    )


# ---------------------------------------------------------------------------------------------------------
# Embedders.


class MultimerInputEmbedder(nn.Module):
    """Input embedding (AlphaFold2 suppl. Alg. 3) with AlphaFold-Multimer's chain-aware relative encoding:
    one-hot of the clipped residue offset within a chain (2r + 1 bins) or "other chain" (1 bin), whether the
    two residues' entities are equal (1), and the clipped sym_id offset within an entity (2c + 1) or "other
    entity" (1): 2r + 2c + 5 channels into `linear_relpos`."""

    def __init__(self, cfg: MultimerConfig):
        super().__init__()
        self.max_rel, self.max_chain = cfg.max_relative_feature, cfg.max_relative_chain
        self.linear_tf_z_i = Linear(cfg.target_feat_dim, cfg.c_z)
        self.linear_tf_z_j = Linear(cfg.target_feat_dim, cfg.c_z)
        self.linear_tf_m = Linear(cfg.target_feat_dim, cfg.c_m)
        self.linear_msa_m = Linear(cfg.msa_feat_dim, cfg.c_m)
        self.linear_relpos = Linear(2 * self.max_rel + 2 * self.max_chain + 5, cfg.c_z)

    def forward(self, f: Mapping[str, torch.Tensor], dtype: torch.dtype, options: InferenceOptions):
        """f: `target_feat` [*, N, 21], `msa_feat` [*, S, N, 49], `residue_index`, `asym_id`, `entity_id`,
        `sym_id` [*, N]. Returns m [*, S, N, C_m] and z [*, N, N, C_z]."""
        tf = f["target_feat"].to(dtype)
        m = self.linear_msa_m(f["msa_feat"].to(dtype)) + self.linear_tf_m(tf)[..., None, :, :]
        z = self.linear_tf_z_i(tf)[..., :, None, :] + self.linear_tf_z_j(tf)[..., None, :, :]
        n = z.shape[-2]
        chunk = options.rows_per_chunk(n, n * 2 * z.shape[-1] * z.element_size())
        for r0, r1 in row_blocks(n, chunk):
            z[..., r0:r1, :, :] += self.relpos(f, r0, r1, z.dtype)
        return m, z

    def relpos(self, f: Mapping[str, torch.Tensor], r0: int, r1: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows r0:r1 of the encoding, as `Linear(one_hot features)`: each residue pair sums the weight
        columns of its three active bins. Returns [*, r1 - r0, N, C_z]."""
        pos, asym, entity, sym = (f[k].long() for k in ("residue_index", "asym_id", "entity_id", "sym_id"))
        r, c = self.max_rel, self.max_chain
        same_chain = asym[..., r0:r1, None] == asym[..., None, :]
        same_entity = entity[..., r0:r1, None] == entity[..., None, :]
        offset = torch.clamp(pos[..., r0:r1, None] - pos[..., None, :] + r, 0, 2 * r)
        offset = torch.where(same_chain, offset, torch.full_like(offset, 2 * r + 1))
        rel_chain = torch.clamp(sym[..., r0:r1, None] - sym[..., None, :] + c, 0, 2 * c)
        rel_chain = torch.where(same_entity, rel_chain, torch.full_like(rel_chain, 2 * c + 1))
        weight = self.linear_relpos.weight.to(dtype).T  # [bins, C_z]
        out = nn.functional.embedding(offset, weight[: 2 * r + 2])
        out = out + same_entity[..., None].to(dtype) * weight[2 * r + 2]
        out = out + nn.functional.embedding(rel_chain, weight[2 * r + 3 :])
        return out + self.linear_relpos.bias.to(dtype)


def _normalized(v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """v / max(|v|, eps) (AlphaFold-Multimer's Vec3Array.normalized). v: [*, 3]."""
    return v / torch.sqrt(torch.clamp((v * v).sum(-1, keepdim=True), min=eps * eps))


def backbone_frames(positions: torch.Tensor, mask: torch.Tensor) -> tuple[Rigid, torch.Tensor]:
    """AlphaFold-Multimer's `make_backbone_affine`: frame at CA, x axis along C - CA, N in the xy plane.
    positions: [*, N, 37, 3]; mask: [*, N, 37]. Returns frames of batch shape [*, N] and their mask [*, N]."""
    n, ca, c = (positions[..., rc.atom_order[a], :] for a in ("N", "CA", "C"))
    e0 = _normalized(c - ca)
    e1 = n - ca
    e1 = _normalized(e1 - (e1 * e0).sum(-1, keepdim=True) * e0)
    e2 = torch.linalg.cross(e0, e1, dim=-1)
    frame_mask = mask[..., rc.atom_order["N"]] * mask[..., rc.atom_order["CA"]] * mask[..., rc.atom_order["C"]]
    return Rigid(torch.stack([e0, e1, e2], dim=-1), ca), frame_mask


def chi_angle_features(aatype: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
    """The four chi dihedrals as AlphaFold-Multimer computes them (atan2 of the plane normals) and their mask
    (the residue type has the angle and its four atoms are present). aatype: [*, N]; positions:
    [*, N, 37, 3]; mask: [*, N, 37]. Returns angles and mask, both [*, N, 4]."""
    aa = torch.clamp(aatype.long(), max=20)
    indices = _chi_atom_indices(positions.device)[aa]  # [*, N, 4 chis, 4 atoms]
    flat = indices.flatten(-2)  # [*, N, 16]
    atoms = torch.gather(positions, -2, flat[..., None].expand(*flat.shape, 3)).unflatten(-2, (4, 4))
    a, b, c, d = atoms.unbind(-2)
    v1, v2, v3 = a - b, b - c, d - c
    c1 = torch.linalg.cross(v1, v2, dim=-1)
    c2 = torch.linalg.cross(v3, v2, dim=-1)
    c3 = torch.linalg.cross(c2, c1, dim=-1)
    v2_norm = torch.sqrt(torch.clamp((v2 * v2).sum(-1), min=1e-12))
    angles = torch.atan2((c3 * v2).sum(-1), v2_norm * (c1 * c2).sum(-1))
    table = torch.cat([residue_constant_tensor("chi_angles_mask", positions), positions.new_zeros(1, 4)])
    atom_mask = torch.gather(mask, -1, flat).unflatten(-1, (4, 4)).prod(-1)
    return angles, table[aa] * atom_mask.to(positions.dtype)


_CHI_ATOMS: dict[torch.device, torch.Tensor] = {}


def _chi_atom_indices(device: torch.device) -> torch.Tensor:
    if device not in _CHI_ATOMS:
        table = []
        for res in rc.restypes:
            chis = [[rc.atom_order[a] for a in chi] for chi in rc.chi_angles_atoms[rc.restype_1to3[res]]]
            table.append(chis + [[0, 0, 0, 0]] * (4 - len(chis)))
        table.append([[0, 0, 0, 0]] * 4)
        _CHI_ATOMS[device] = torch.tensor(table, device=device)
    return _CHI_ATOMS[device]


class TemplatePairEmbedderMultimer(nn.Module):
    """One template's pair activations (AlphaFold-Multimer `SingleTemplateEmbedding`): distogram, pseudo-beta
    mask, aatype of j and of i, the backbone unit vector (x, y, z) and its mask, each through its own linear
    (cross-chain pairs zeroed by `multichain_mask_2d`), plus a projection of the LayerNormed pair."""

    def __init__(self, c_z: int, cfg: TemplateConfig):
        super().__init__()
        c = cfg.c_t
        self.dgram_linear = Linear(cfg.dgram_bins, c)
        self.pseudo_beta_mask_linear = Linear(1, c)
        self.aatype_linear_1 = Linear(22, c)
        self.aatype_linear_2 = Linear(22, c)
        self.x_linear = Linear(1, c)
        self.y_linear = Linear(1, c)
        self.z_linear = Linear(1, c)
        self.backbone_mask_linear = Linear(1, c)
        self.query_embedding_layer_norm = LayerNorm(c_z)
        self.query_embedding_linear = Linear(c_z, c)

    def forward(self, templ: Mapping[str, torch.Tensor], z: torch.Tensor, multichain_2d: torch.Tensor,
                cfg: TemplateConfig, options: InferenceOptions = DEFAULT_OPTIONS) -> torch.Tensor:
        """templ: one template's `template_aatype` [*, N], `template_all_atom_positions` [*, N, 37, 3],
        `template_all_atom_mask` [*, N, 37]; z: [*, N, N, C_z]; multichain_2d: [*, N, N] (same chain).
        Returns [*, N, N, C_t], built by blocks of rows when `options` chunk (the [rows, N, *] intermediates:
        distogram, unit vectors, the LayerNormed pair, one block at a time)."""
        dtype, n = z.dtype, z.shape[-2]
        aatype = templ["template_aatype"].long()
        pos = templ["template_all_atom_positions"].to(dtype)
        mask = templ["template_all_atom_mask"].to(dtype)
        cb, cb_mask = pseudo_beta(aatype, pos, mask)
        one_hot = nn.functional.one_hot(aatype, 22).to(dtype)
        frames, bb_mask = backbone_frames(pos, mask)
        c_t = self.dgram_linear.out_features
        per_row = n * (2 * cfg.dgram_bins + 3 * z.shape[-1] + 8 * c_t + 16) * z.element_size()
        chunk = options.rows_per_chunk(n, per_row)
        if chunk is None:
            return self._rows(0, n, z, cb, cb_mask, one_hot, frames, bb_mask, multichain_2d, cfg)
        out = z.new_empty(*z.shape[:-1], c_t)
        for r0, r1 in row_blocks(n, chunk):
            out[..., r0:r1, :, :] = self._rows(r0, r1, z, cb, cb_mask, one_hot, frames, bb_mask, multichain_2d, cfg)
        return out

    def _rows(self, r0: int, r1: int, z: torch.Tensor, cb: torch.Tensor, cb_mask: torch.Tensor,
              one_hot: torch.Tensor, frames: Rigid, bb_mask: torch.Tensor, multichain_2d: torch.Tensor,
              cfg: TemplateConfig) -> torch.Tensor:
        """Rows r0:r1 of the template's pair activations [*, r1 - r0, N, C_t]."""
        whole = r0 == 0 and r1 == z.shape[-2]
        multichain = multichain_2d if whole else multichain_2d[..., r0:r1, :]
        cb_2d = cb_mask[..., r0:r1, None] * cb_mask[..., None, :] * multichain
        lower = torch.linspace(cfg.dgram_min_bin, cfg.dgram_max_bin, cfg.dgram_bins, dtype=cb.dtype,
                               device=cb.device) ** 2  # as geometry.dgram_from_positions, for rows r0:r1
        upper = torch.cat([lower[1:], lower.new_tensor([1e8])])
        d2 = ((cb[..., r0:r1, None, :] - cb[..., None, :, :]) ** 2).sum(-1, keepdim=True)
        dgram = ((d2 > lower) & (d2 < upper)).to(cb.dtype) * cb_2d[..., None]
        del d2
        act = self.dgram_linear(dgram) + self.pseudo_beta_mask_linear(cb_2d[..., None])
        del dgram
        act = act + self.aatype_linear_1(one_hot[..., None, :, :]) + self.aatype_linear_2(
            one_hot[..., r0:r1, None, :])
        bb_2d = bb_mask[..., r0:r1, None] * bb_mask[..., None, :] * multichain
        rows = Rigid(frames.rot[..., r0:r1, :, :], frames.trans[..., r0:r1, :])
        local = rows.unsqueeze(-1).invert_apply(frames.trans[..., None, :, :])  # [*, R, N, 3]: j seen from i
        unit = _normalized(local) * bb_2d[..., None]
        del local
        act = act + self.x_linear(unit[..., 0:1]) + self.y_linear(unit[..., 1:2]) + self.z_linear(unit[..., 2:3])
        act = act + self.backbone_mask_linear(bb_2d[..., None])
        z_rows = z if whole else z[..., r0:r1, :, :]
        return act + self.query_embedding_linear(self.query_embedding_layer_norm(z_rows))


class TemplatePairStackMultimer(TemplatePairStack):
    """AlphaFold-Multimer's template pair stack: its blocks run in the Evoformer pair order (triangle
    multiplications first, where AlphaFold2's template blocks start with the attentions), then a LayerNorm."""

    def __init__(self, cfg: TemplateConfig):
        super().__init__(cfg, attention_first=False)


class TemplateSingleEmbedderMultimer(nn.Module):
    """Template rows appended to the MSA: one-hot aatype (22), sin, cos and mask of the four chi angles (34
    channels) -> Linear, ReLU, Linear; the row mask is the chi1 mask."""

    def __init__(self, c_m: int):
        super().__init__()
        self.linear_1 = Linear(22 + 3 * 4, c_m)
        self.linear_2 = Linear(c_m, c_m)

    def forward(self, templ: Mapping[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """templ: `template_aatype` [*, T, N], `template_all_atom_positions` [*, T, N, 37, 3],
        `template_all_atom_mask` [*, T, N, 37]. Returns rows [*, T, N, C_m] and their mask [*, T, N]."""
        aatype = templ["template_aatype"].long()
        angles, mask = chi_angle_features(
            aatype, templ["template_all_atom_positions"].to(dtype), templ["template_all_atom_mask"].to(dtype)
        )
        feats = torch.cat(
            [nn.functional.one_hot(aatype, 22).to(dtype), torch.sin(angles) * mask, torch.cos(angles) * mask, mask],
            dim=-1,
        )
        return self.linear_2(torch.relu(self.linear_1(feats))), mask[..., 0]


class TemplateEmbedderMultimer(nn.Module):
    """AlphaFold-Multimer's template embedding: each template's pair activations through the pair stack,
    averaged over all template rows (padding rows included, as AlphaFold-Multimer), ReLU, Linear to C_z."""

    def __init__(self, cfg: MultimerConfig):
        super().__init__()
        self.cfg = cfg.template
        self.template_pair_embedder = TemplatePairEmbedderMultimer(cfg.c_z, cfg.template)
        self.template_pair_stack = TemplatePairStackMultimer(cfg.template)
        self.linear_t = Linear(cfg.template.c_t, cfg.c_z)
        self.template_single_embedder = TemplateSingleEmbedderMultimer(cfg.c_m)

    def forward(self, templ: Mapping[str, torch.Tensor], z: torch.Tensor, pair_mask: torch.Tensor,
                asym_id: torch.Tensor, options: InferenceOptions) -> torch.Tensor:
        """templ: the `template_*` features with T templates on dim -3 (-4 for positions); z: [*, N, N, C_z];
        pair_mask: [*, N, N]; asym_id: [*, N]. Returns the update to z [*, N, N, C_z]."""
        multichain = (asym_id[..., :, None] == asym_id[..., None, :]).to(z.dtype)
        n_templ = templ["template_aatype"].shape[-2]
        mask = pair_mask[..., None, :, :].to(z.dtype)

        def embed(i: int) -> torch.Tensor:
            one = {
                "template_aatype": templ["template_aatype"][..., i, :],
                "template_all_atom_positions": templ["template_all_atom_positions"][..., i, :, :, :],
                "template_all_atom_mask": templ["template_all_atom_mask"][..., i, :, :],
            }
            return self.template_pair_embedder(one, z, multichain, self.cfg, options)

        if options.chunk_size is None:
            t = torch.stack([embed(i) for i in range(n_templ)], dim=-4)
            t = self.template_pair_stack(t, mask, options)
            return self.linear_t(torch.relu(t.sum(-4) / n_templ))
        # chunked: one template at a time through the stack, summed (AlphaFold-Multimer's scan over templates)
        total = None
        for i in range(n_templ):
            t = self.template_pair_stack(embed(i)[..., None, :, :, :], mask, options)[..., 0, :, :, :]
            total = t if total is None else total.add_(t)
            del t
        return self.linear_t(torch.relu_(total.div_(n_templ)))


# ---------------------------------------------------------------------------------------------------------
# Confidence.


def compute_tm(logits: torch.Tensor, cfg: HeadsConfig, residue_weights: torch.Tensor,
               asym_id: torch.Tensor | None = None) -> torch.Tensor:
    """pTM (AlphaFold2 suppl. 1.9.7), or with `asym_id` the interface pTM of AlphaFold-Multimer (suppl. 2.4):
    the expected TM term counted only over residue pairs of different chains, d0 from all residues; the
    best over alignment residues. logits: [*, N, N, B]; residue_weights, asym_id: [*, N]. Returns [*]."""
    breaks = torch.linspace(0, cfg.pae_max_error_bin, cfg.pae_bins - 1, dtype=logits.dtype, device=logits.device)
    step = breaks[1] - breaks[0]
    centers = torch.cat([breaks + step / 2, (breaks[-1:] + step / 2) + step])
    n = torch.clamp(residue_weights.sum(-1), min=19)
    d0 = 1.24 * (n - 15) ** (1.0 / 3) - 1.8
    tm_per_bin = 1.0 / (1 + centers**2 / d0[..., None] ** 2)  # [*, B]
    term = (torch.softmax(logits, dim=-1) * tm_per_bin[..., None, None, :]).sum(-1)  # [*, N, N]
    w2 = residue_weights[..., :, None] * residue_weights[..., None, :]
    if asym_id is not None:
        w2 = w2 * (asym_id[..., :, None] != asym_id[..., None, :]).to(w2.dtype)
    normed = w2 / (1e-8 + w2.sum(-1, keepdim=True))
    per_alignment = (term * normed).sum(-1)  # [*, N]
    best = (per_alignment * residue_weights).argmax(-1, keepdim=True)
    return per_alignment.gather(-1, best)[..., 0]


def ca_distance_change(prev: torch.Tensor, new: torch.Tensor, seq_mask: torch.Tensor) -> torch.Tensor:
    """RMS change of the Ca distance matrix between two passes (AlphaFold v2.3's recycling early stop).
    prev, new: atom37 positions [*, N, 37, 3]; seq_mask: [*, N]. Returns [*] (Angstrom)."""
    ca = rc.atom_order["CA"]

    def dist(x: torch.Tensor) -> torch.Tensor:
        p = x[..., ca, :]
        return torch.sqrt(((p[..., :, None, :] - p[..., None, :, :]) ** 2).sum(-1))

    sq = (dist(prev) - dist(new)) ** 2
    m2 = seq_mask[..., :, None] * seq_mask[..., None, :]
    mean = (sq * m2).sum((-1, -2)) / (m2.sum((-1, -2)) + 1e-10)
    return torch.sqrt(mean + 1e-8)


# ---------------------------------------------------------------------------------------------------------
# The model.


class AlphaFoldMultimer(RecyclingModel):
    """AlphaFold-Multimer: embedders, extra-MSA stack and Evoformer (outer product mean first), the multimer
    structure module and the heads with pTM, ipTM and the ranking confidence.

    `model(batch, options)` runs one pass per entry of the batch's trailing (recycling) axis, stopping early
    once the predicted Ca distances settle (`config.recycle_early_stop_tolerance`, as AlphaFold v2.3: the pass
    after the one that settles is the last), and returns AlphaFold-named outputs of the last pass plus
    `num_recycles` (passes run - 1), `iptm_score` and `ranking_confidence`. Submodules: `input_embedder`,
    `recycling_embedder`, `template_embedder`, `extra_msa_embedder`, `extra_msa_stack`, `evoformer`,
    `structure_module`, `aux_heads`. The recycling loop and the pass are `RecyclingModel`'s; the hooks below
    are where AlphaFold-Multimer differs.
    """

    FEATURE_NAMES = FEATURE_NAMES
    RECYCLE_IN_PLACE = True

    def __init__(self, config: MultimerConfig):
        super().__init__()
        self.config = config
        self.input_embedder = MultimerInputEmbedder(config)
        self.recycling_embedder = RecyclingEmbedder(config)
        self.template_embedder = TemplateEmbedderMultimer(config) if config.template.enabled else None
        self.extra_msa_embedder = ExtraMSAEmbedder(config)
        self.extra_msa_stack = ExtraMSAStack(config.extra_msa, opm_first=True)
        self.evoformer = EvoformerStack(config.evoformer, opm_first=True)
        self.structure_module = StructureModuleMultimer(config.structure_module)
        self.aux_heads = AuxiliaryHeads(config)

    def _embed(self, f: dict[str, torch.Tensor], prev: dict[str, torch.Tensor] | None, options: InferenceOptions):
        """Returns m, z, msa_mask, pair_mask ready for the Evoformer. AlphaFold-Multimer's embedding: the
        chain-aware relative encoding; the template embedder sees the chains (`asym_id`) and its template rows
        (from chi angles, no template mask feature) join the MSA before the extra-MSA stack."""
        dtype = self.input_embedder.linear_tf_m.weight.dtype
        seq_mask = f["seq_mask"].to(dtype)
        pair_mask = seq_mask[..., :, None] * seq_mask[..., None, :]
        m, z = self.input_embedder(f, dtype, options)
        m, z = self._recycle(f, m, z, prev, options)
        msa_mask = f["msa_mask"].to(dtype)
        if self.template_embedder is not None and f["template_aatype"].shape[-2] > 0:
            templ = {k: v for k, v in f.items() if k.startswith("template_")}
            z = options.add_(z, self.template_embedder(templ, z, pair_mask, f["asym_id"], options))
            m, msa_mask = self._add_rows(m, msa_mask, *self.template_embedder.template_single_embedder(templ, dtype))
        z = self._extra_msa(f, z, pair_mask, dtype, options)
        return m, z, msa_mask, pair_mask

    def _extra_deletion_features(self, f: dict[str, torch.Tensor], dtype: torch.dtype):
        """AlphaFold-Multimer derives them from the deletion counts `extra_deletion_matrix` [*, S_e, N]:
        min(d, 1) and 2/pi atan(d / 3)."""
        dels = f["extra_deletion_matrix"].to(dtype)
        return torch.clamp(dels, 0.0, 1.0), torch.atan(dels / 3.0) * (2.0 / math.pi)

    def _settled(self, prev: dict[str, torch.Tensor] | None, out: dict[str, torch.Tensor], f) -> bool:
        """AlphaFold v2.3's early stop: the Ca distances moved by at most the tolerance since the previous pass
        (zeros before the first); never with a negative tolerance."""
        tol = self.config.recycle_early_stop_tolerance
        if tol < 0:
            return False
        prev_x = prev["final_atom_positions"] if prev is not None else torch.zeros_like(out["final_atom_positions"])
        change = ca_distance_change(prev_x, out["final_atom_positions"], f["seq_mask"].to(prev_x.dtype))
        return bool((change <= tol).all())

    def _last_pass(self, out: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
        """The outputs with `num_recycles` (passes run - 1; fewer than the batch holds after an early stop)."""
        out["num_recycles"] = torch.tensor(index)
        return out

    def _confidences(self, out: dict[str, torch.Tensor], f: dict[str, torch.Tensor], seq_mask: torch.Tensor) -> None:
        """AlphaFold-Multimer's confidences: pTM, interface pTM over pairs of different chains, and the ranking
        confidence `iptm_weight * ipTM + ptm_weight * pTM`."""
        logits = out["predicted_aligned_error_logits"]
        out["ptm_score"] = compute_tm(logits, self.config.heads, seq_mask)
        out["iptm_score"] = compute_tm(logits, self.config.heads, seq_mask, f["asym_id"])
        out["ranking_confidence"] = (
            self.config.iptm_weight * out["iptm_score"] + self.config.ptm_weight * out["ptm_score"]
        )
