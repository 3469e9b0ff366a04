"""The AlphaFold2 monomer model with recycling (AlphaFold2 suppl. Alg. 2, inference)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch import nn

from ... import kernels
from ..common.geometry import atom14_to_atom37
from .config import AlphaFoldConfig
from .embedders import (
    ExtraMSAEmbedder,
    InputEmbedder,
    RecyclingEmbedder,
    TemplateAngleEmbedder,
    TemplateEmbedder,
)
from .evoformer import EvoformerStack, ExtraMSAStack
from .heads import AuxiliaryHeads
from .options import DEFAULT_OPTIONS, InferenceOptions
from .structure_module import StructureModule

__all__ = ["AlphaFold", "FEATURE_NAMES", "RecyclingModel"]

FEATURE_NAMES = (
    "aatype",
    "residue_index",
    "seq_mask",
    "target_feat",
    "msa_feat",
    "msa_mask",
    "extra_msa",
    "extra_msa_mask",
    "extra_has_deletion",
    "extra_deletion_value",
    "template_aatype",
    "template_all_atom_positions",
    "template_all_atom_masks",
    "template_mask",
    "template_pseudo_beta",
    "template_pseudo_beta_mask",
    "residx_atom37_to_atom14",
    "atom37_atom_exists",
)
"""Features the model reads (each with the recycling iterations on its trailing axis)."""


class RecyclingModel(nn.Module):
    """The recycling loop and one pass (AlphaFold2 suppl. Alg. 2), shared by `AlphaFold` and
    `AlphaFoldMultimer`. A subclass builds the submodules and embeds the inputs (`_embed`); its hooks say where
    AlphaFold-Multimer differs: the early stop of the recycling (`_settled`), the passes reported
    (`_last_pass`), the confidences added to the heads (`_confidences`)."""

    FEATURE_NAMES: tuple[str, ...] = ()
    """Features the model reads (each with the recycling iterations on its trailing axis)."""
    FEATURE_ALIASES: Mapping[str, str] = {}
    """Other spellings accepted for a feature name."""
    RECYCLE_IN_PLACE = False
    """Add the recycled pair in place even without fused residuals (the multimer model, inference only)."""

    def forward(
        self, batch: Mapping[str, torch.Tensor], options: InferenceOptions | None = None
    ) -> dict[str, torch.Tensor]:
        """batch: processed features, each `[*, ..., R]` with R recycling iterations on the trailing axis
        (`aatype` [*, N, R], `msa_feat` [*, S, N, 49, R], ...; see FEATURE_NAMES); unknown keys are ignored.

        Returns the last pass's outputs: `final_atom_positions` [*, N, 37, 3], `final_atom_mask` [*, N, 37],
        `plddt` [*, N], `distogram_logits` [*, N, N, B], `masked_msa_logits` [*, S, N, C],
        `experimentally_resolved_logits` [*, N, 37], `single` [*, N, C_s], `pair` [*, N, N, C_z],
        `msa` [*, S, N, C_m], and with the PAE head `predicted_aligned_error` [*, N, N] and `ptm_score` [*].
        """
        options = options or DEFAULT_OPTIONS
        feats = self._select_features(batch)
        cycles = feats["aatype"].shape[-1]
        backend = kernels.use_backend(options.attention_backend)
        with backend if options.attention_backend != "auto" else contextlib.nullcontext():
            prev, settled = None, False
            for i in range(cycles):
                last = i == cycles - 1 or settled
                f = {k: v[..., i] for k, v in feats.items()}
                with torch.set_grad_enabled(torch.is_grad_enabled() and last):
                    out = self.iteration(f, prev, options)
                if last:
                    return self._last_pass(out, i)
                settled = self._settled(prev, out, f)
                # Keep only what the next pass reads: the first MSA row is copied out of the MSA, so the
                # previous pass's whole MSA, logits and heads are freed before the next pass.
                prev = {
                    "msa_first_row": out["msa_first_row"].detach().clone(),
                    "pair": out["pair"].detach(),
                    "final_atom_positions": out["final_atom_positions"].detach(),
                }
                del out
        raise ValueError(
            f"{type(self).__name__}: the feature batch has no recycling iterations (trailing axis of size 0)"
        )

    def _select_features(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        needed = [k for k in self.FEATURE_NAMES if not k.startswith("template_") or self.template_embedder is not None]
        feats, missing = {}, []
        for key in needed:
            value = batch.get(key, batch.get(self.FEATURE_ALIASES.get(key, "")))
            if value is None:
                missing.append(key)
            else:
                feats[key] = torch.as_tensor(value)
        if missing:
            raise KeyError(f"{type(self).__name__}: the feature batch lacks {', '.join(missing)}")
        return feats

    def _recycle(
        self, f: dict[str, torch.Tensor], m: torch.Tensor, z: torch.Tensor, prev: dict[str, torch.Tensor] | None,
        options: InferenceOptions,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Alg. 2 lines 6 and 11 (Alg. 32): the previous pass (zeros before the first) added to the first MSA
        row of m [*, S, N, C_m] and to z [*, N, N, C_z]. Returns (m, z)."""
        n = z.shape[-2]
        if prev is None:  # zeros as broadcast views: the first pass holds no zero-filled pair
            prev = {
                "msa_first_row": m.new_zeros(()).expand(*m.shape[:-3], n, m.shape[-1]),
                "pair": z.new_zeros(()).expand(z.shape),
                "final_atom_positions": z.new_zeros(*z.shape[:-3], n, 37, 3),
            }
        if options.fused_residual or self.RECYCLE_IN_PLACE:
            self.recycling_embedder.add_pair_(z, f["aatype"], prev["pair"], prev["final_atom_positions"], options)
            m[..., 0, :, :] += self.recycling_embedder.layer_norm_m(prev["msa_first_row"])
            return m, z
        m1, z_rec = self.recycling_embedder(
            f["aatype"], prev["msa_first_row"], prev["pair"], prev["final_atom_positions"]
        )
        m = torch.cat([m[..., :1, :, :] + m1[..., None, :, :], m[..., 1:, :, :]], dim=-3)
        return m, z + z_rec

    def _extra_msa(
        self, f: dict[str, torch.Tensor], z: torch.Tensor, pair_mask: torch.Tensor, dtype: torch.dtype,
        options: InferenceOptions,
    ) -> torch.Tensor:
        """Alg. 2 lines 14-15: the extra MSA embedded and run through its stack. z: [*, N, N, C_z]; pair_mask:
        [*, N, N]; dtype: the model's. Returns the new z."""
        a = self.extra_msa_embedder(f["extra_msa"], *self._extra_deletion_features(f, dtype))
        z = self.extra_msa_stack(a, z, f["extra_msa_mask"].to(dtype), pair_mask, options)
        del a
        return z

    @staticmethod
    def _add_rows(m: torch.Tensor, msa_mask: torch.Tensor, rows: torch.Tensor, row_mask: torch.Tensor):
        """The template rows [*, T, N, C_m] and their mask [*, T, N] appended to the MSA and its mask."""
        return torch.cat([m, rows], dim=-3), torch.cat([msa_mask, row_mask], dim=-2)

    def iteration(
        self, f: dict[str, torch.Tensor], prev: dict[str, torch.Tensor] | None, options: InferenceOptions
    ) -> dict[str, torch.Tensor]:
        """One pass (Alg. 2 lines 5-20) on features without the recycling axis; `prev` holds the previous
        pass's `msa_first_row` [*, N, C_m], `pair` [*, N, N, C_z], `final_atom_positions` [*, N, 37, 3]."""
        n_seq = f["msa_feat"].shape[-3]
        m, z, msa_mask, pair_mask = self._embed(f, prev, options)
        m, z, s = self.evoformer(m, z, msa_mask, pair_mask, options)
        seq_mask = f["seq_mask"].to(s.dtype)
        sm = self.structure_module(s, z, f["aatype"], seq_mask, options)
        atom37_exists = f["atom37_atom_exists"].to(s.dtype)
        positions = atom14_to_atom37(sm["atom14_positions"], f["residx_atom37_to_atom14"], atom37_exists)
        msa = m[..., :n_seq, :, :]
        out = self.aux_heads(s, sm["single"], z, msa, seq_mask, options)
        self._confidences(out, f, seq_mask)
        out.update(
            final_atom_positions=positions,
            final_atom_mask=atom37_exists,
            final_atom14_positions=sm["atom14_positions"],
            final_affine_tensor=sm["frames"],
            sidechain_angles=sm["angles"],
            single=s,
            pair=z,
            msa=msa,
            msa_first_row=m[..., 0, :, :],
            structure_module=sm["single"],
        )
        return out

    # -- hooks: AlphaFold2 here, AlphaFold-Multimer in AlphaFoldMultimer ------------------------------------

    def _embed(
        self, f: dict[str, torch.Tensor], prev: dict[str, torch.Tensor] | None, options: InferenceOptions
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Alg. 2 lines 5-15: returns m, z, msa_mask, pair_mask ready for the Evoformer."""
        raise NotImplementedError

    def _extra_deletion_features(self, f: dict[str, torch.Tensor], dtype: torch.dtype):
        """The extra MSA's `has_deletion` and `deletion_value` [*, S_e, N] (AlphaFold2: features of the batch)."""
        return f["extra_has_deletion"].to(dtype), f["extra_deletion_value"].to(dtype)

    def _settled(self, prev: dict[str, torch.Tensor] | None, out: dict[str, torch.Tensor], f) -> bool:
        """Whether the pass after `out` is the last one (AlphaFold2 runs every recycling iteration)."""
        return False

    def _last_pass(self, out: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
        """The outputs of the last pass (number `index`, from 0)."""
        return out

    def _confidences(self, out: dict[str, torch.Tensor], f: dict[str, torch.Tensor], seq_mask: torch.Tensor) -> None:
        """Confidences added to the heads' outputs `out` (AlphaFold2: those of the heads)."""


class AlphaFold(RecyclingModel):
    """AlphaFold2 monomer: embedders, extra-MSA stack, Evoformer, structure module and heads.

    `model(batch, options)` runs one pass per entry of the batch's trailing (recycling) axis and returns
    AlphaFold-named outputs of the last pass. Submodules: `input_embedder`, `recycling_embedder`,
    `template_embedder`, `template_angle_embedder`, `extra_msa_embedder`, `extra_msa_stack`, `evoformer`,
    `structure_module`, `aux_heads`. Parameter files are read and written by `fastfold.params`
    (`from_params(path)`, `save_params(model, path)`); this module does not import it.
    """

    FEATURE_NAMES = FEATURE_NAMES
    FEATURE_ALIASES = {"template_all_atom_masks": "template_all_atom_mask"}  # OpenFold's spelling

    def __init__(self, config: AlphaFoldConfig):
        super().__init__()
        self.config = config
        self.input_embedder = InputEmbedder(config)
        self.recycling_embedder = RecyclingEmbedder(config)
        templ = config.template
        self.template_embedder = TemplateEmbedder(config) if templ.enabled else None
        embed_angles = templ.enabled and templ.embed_torsion_angles
        self.template_angle_embedder = TemplateAngleEmbedder(config) if embed_angles else None
        self.extra_msa_embedder = ExtraMSAEmbedder(config)
        self.extra_msa_stack = ExtraMSAStack(config.extra_msa)
        self.evoformer = EvoformerStack(config.evoformer)
        self.structure_module = StructureModule(config.structure_module)
        self.aux_heads = AuxiliaryHeads(config)

    def _embed(
        self, f: dict[str, torch.Tensor], prev: dict[str, torch.Tensor] | None, options: InferenceOptions
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Alg. 2 lines 5-15: returns m, z, msa_mask, pair_mask ready for the Evoformer."""
        dtype = self.input_embedder.linear_tf_m.weight.dtype
        seq_mask = f["seq_mask"].to(dtype)
        pair_mask = seq_mask[..., :, None] * seq_mask[..., None, :]
        m, z = self.input_embedder(f["target_feat"].to(dtype), f["residue_index"], f["msa_feat"].to(dtype), options)
        m, z = self._recycle(f, m, z, prev, options)
        templ = {k: v for k, v in f.items() if k.startswith("template_")}
        has_templates = self.template_embedder is not None and templ["template_mask"].shape[-1] > 0
        if has_templates:
            z = options.add_(z, self.template_embedder(templ, z, pair_mask, options))
        z = self._extra_msa(f, z, pair_mask, dtype, options)
        msa_mask = f["msa_mask"].to(dtype)
        if has_templates and self.template_angle_embedder is not None:
            m, msa_mask = self._add_rows(m, msa_mask, *self.template_angle_embedder(templ, dtype))
        return m, z, msa_mask, pair_mask
