"""Output heads: pLDDT, distogram, masked MSA, experimentally resolved, predicted aligned error / pTM
(AlphaFold2 suppl. 1.9.6-1.9.10)."""

from __future__ import annotations

import torch
from torch import nn

from .config import AlphaFoldConfig, HeadsConfig
from .options import InferenceOptions
from .primitives import LayerNorm, Linear, row_blocks

__all__ = ["AuxiliaryHeads", "compute_plddt", "compute_predicted_aligned_error", "compute_ptm"]


def compute_plddt(logits: torch.Tensor) -> torch.Tensor:
    """Expected lDDT-Ca in [0, 100] from the bin logits (bin centres at (k + 1/2)/bins). logits: [*, N, B]."""
    bins = logits.shape[-1]
    centers = (torch.arange(bins, dtype=logits.dtype, device=logits.device) + 0.5) / bins
    return torch.softmax(logits, dim=-1) @ centers * 100


def _pae_bin_centers(cfg: HeadsConfig, like: torch.Tensor) -> torch.Tensor:
    breaks = torch.linspace(0, cfg.pae_max_error_bin, cfg.pae_bins - 1, dtype=like.dtype, device=like.device)
    step = breaks[1] - breaks[0]
    centers = breaks + step / 2
    return torch.cat([centers, centers[-1:] + step])


def _expected_by_rows(logits: torch.Tensor, values: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """softmax(logits) @ values by blocks of rows. logits: [*, N, N, B]; values: [*, B, K]. Returns [*, N, N, K]."""
    if chunk is None:
        return torch.softmax(logits, dim=-1) @ values[..., None, :, :]
    out = logits.new_empty(*logits.shape[:-1], values.shape[-1])
    for r0, r1 in row_blocks(logits.shape[-3], chunk):
        out[..., r0:r1, :, :] = torch.softmax(logits[..., r0:r1, :, :], dim=-1) @ values[..., None, :, :]
    return out


def compute_predicted_aligned_error(
    logits: torch.Tensor, cfg: HeadsConfig, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected aligned error [*, N, N] (Angstrom) and the largest representable error. logits: [*, N, N, B];
    chunk: rows of the softmax at a time (None: all)."""
    centers = _pae_bin_centers(cfg, logits)
    return _expected_by_rows(logits, centers[:, None], chunk)[..., 0], centers[-1]


def compute_ptm(
    logits: torch.Tensor, cfg: HeadsConfig, residue_weights: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Predicted TM-score (AlphaFold2 suppl. 1.9.7): the best over alignment residues of the expected TM term.

    logits: [*, N, N, B]; residue_weights: [*, N] (seq_mask); chunk: rows of the softmax at a time. Returns [*].
    """
    centers = _pae_bin_centers(cfg, logits)
    n = torch.clamp(residue_weights.sum(-1), min=19)
    d0 = 1.24 * (n - 15) ** (1.0 / 3) - 1.8
    tm_per_bin = 1.0 / (1 + centers**2 / d0[..., None] ** 2)  # [*, B]
    term = _expected_by_rows(logits, tm_per_bin[..., :, None], chunk)  # [*, N, N, 1]
    w2 = residue_weights[..., None, :] * residue_weights[..., :, None]
    normed = w2 / (1e-8 + w2.sum(-1, keepdim=True))
    per_alignment = (term[..., 0] * normed).sum(-1)  # [*, N]
    best = (per_alignment * residue_weights).argmax(-1, keepdim=True)
    return per_alignment.gather(-1, best)[..., 0]


def _linear_by_rows(linear: Linear, pair: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """linear(pair) by blocks of rows. pair: [*, N, N, C]. Returns [*, N, N, out]."""
    if chunk is None:
        return linear(pair)
    out = pair.new_empty(*pair.shape[:-1], linear.out_features)
    for r0, r1 in row_blocks(pair.shape[-3], chunk):
        out[..., r0:r1, :, :] = linear(pair[..., r0:r1, :, :])
    return out


def _symmetric_logits(linear: Linear, pair: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """AlphaFold2 suppl. 1.9.8: half + half^T with half = linear(pair) [*, N, N, B]. Chunked, the sum is made
    in place, one pair of blocks (I, J), (J, I) at a time, so no second [N, N, B] tensor is held."""
    half = _linear_by_rows(linear, pair, chunk)
    if chunk is None:
        return half + half.transpose(-2, -3)
    blocks = row_blocks(pair.shape[-3], chunk)
    for bi, (i0, i1) in enumerate(blocks):
        for j0, j1 in blocks[bi:]:
            total = half[..., i0:i1, j0:j1, :] + half[..., j0:j1, i0:i1, :].transpose(-2, -3)
            half[..., i0:i1, j0:j1, :] = total
            half[..., j0:j1, i0:i1, :] = total.transpose(-2, -3)
    return half


class PLDDTHead(nn.Module):
    """AlphaFold2 suppl. Alg. 29: per-residue lDDT-Ca bins from the structure module's single repr."""

    def __init__(self, c_s: int, cfg: HeadsConfig):
        super().__init__()
        self.layer_norm = LayerNorm(c_s)
        self.linear_1 = Linear(c_s, cfg.plddt_channels)
        self.linear_2 = Linear(cfg.plddt_channels, cfg.plddt_channels)
        self.linear_3 = Linear(cfg.plddt_channels, cfg.plddt_bins)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        """s: [*, N, C_s]. Returns logits [*, N, bins]."""
        a = torch.relu(self.linear_1(self.layer_norm(s)))
        return self.linear_3(torch.relu(self.linear_2(a)))


class AuxiliaryHeads(nn.Module):
    """All heads of the monomer model; the pTM head only for `_ptm` models."""

    def __init__(self, cfg: AlphaFoldConfig):
        super().__init__()
        h = cfg.heads
        self.cfg = h
        self.plddt = PLDDTHead(cfg.c_s, h)
        self.distogram = Linear(cfg.c_z, h.distogram_bins)
        self.masked_msa = Linear(cfg.c_m, h.masked_msa_classes)
        self.experimentally_resolved = Linear(cfg.c_s, h.resolved_atoms)
        self.tm = Linear(cfg.c_z, h.pae_bins) if h.tm else None

    def forward(
        self,
        single: torch.Tensor,
        sm_single: torch.Tensor,
        pair: torch.Tensor,
        msa: torch.Tensor,
        seq_mask: torch.Tensor,
        options: InferenceOptions | None = None,
    ) -> dict[str, torch.Tensor]:
        """single: Evoformer single [*, N, C_s]; sm_single: structure-module single [*, N, C_s];
        pair: [*, N, N, C_z]; msa: [*, S, N, C_m]; seq_mask: [*, N]. Returns AlphaFold-named outputs.
        With chunking `options`, the pair heads and their softmaxes go by blocks of rows."""
        n = pair.shape[-2]
        bins = max(self.distogram.out_features, self.tm.out_features if self.tm is not None else 0)
        per_row = n * (pair.shape[-1] + 3 * bins) * pair.element_size()
        chunk = None if options is None else options.rows_per_chunk(n, per_row)
        lddt_logits = self.plddt(sm_single)
        out = {
            "lddt_logits": lddt_logits,
            "plddt": compute_plddt(lddt_logits),
            "distogram_logits": _symmetric_logits(self.distogram, pair, chunk),
            "masked_msa_logits": self.masked_msa(msa),
            "experimentally_resolved_logits": self.experimentally_resolved(single),
        }
        if self.tm is not None:
            logits = _linear_by_rows(self.tm, pair, chunk)
            pae, max_pae = compute_predicted_aligned_error(logits, self.cfg, chunk)
            out.update(
                predicted_aligned_error_logits=logits,
                predicted_aligned_error=pae,
                max_predicted_aligned_error=max_pae,
                ptm_score=compute_ptm(logits, self.cfg, seq_mask.to(logits.dtype), chunk),
            )
        return out
