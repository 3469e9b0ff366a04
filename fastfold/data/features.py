"""AlphaFold2 input features: raw features from a sequence and its alignments, then the processed batch.

Raw features (one target, numpy): `aatype` `[N]`, `residue_index` `[N]`, `msa` `[S, N]` (0..19 amino
acids in `residue_constants.restypes` order, 20 unknown, 21 gap), `deletion_matrix` `[S, N]`, and the
template features of `fastfold.data.templates`.

The processed batch is what `fastfold.AlphaFold` takes (AlphaFold2 suppl. 1.2, OpenFold's predict mode):
every feature gets a trailing recycling axis `R` (one independently sampled MSA per pass, as AlphaFold's
ensembling of inputs per recycle):

- `aatype` `[N, R]`, `residue_index` `[N, R]`, `seq_mask` `[N, R]`
- `target_feat` `[N, 22, R]`: between-segment flag (0) and one-hot amino acid over 21 classes
- `msa_feat` `[S, N, 49, R]`: one-hot cluster MSA (23), has-deletion, deletion value, cluster profile
  (23), cluster deletion mean; `msa_mask` `[S, N, R]`
- `extra_msa` `[E, N, R]` (int), `extra_msa_mask`, `extra_has_deletion`, `extra_deletion_value` `[E, N, R]`
- `template_aatype` `[T, N, R]`, `template_all_atom_positions` `[T, N, 37, 3, R]`,
  `template_all_atom_mask` `[T, N, 37, R]`, `template_mask` `[T, R]`, `template_pseudo_beta` `[T, N, 3, R]`,
  `template_pseudo_beta_mask` `[T, N, R]`, `template_sum_probs` `[T, 1, R]`
- `atom14_atom_exists` `[N, 14, R]`, `residx_atom14_to_atom37` `[N, 14, R]`,
  `residx_atom37_to_atom14` `[N, 37, R]`, `atom37_atom_exists` `[N, 37, R]`
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..common import residue_constants as rc
from .parsers import Msa

__all__ = [
    "FeatureConfig",
    "make_msa_features",
    "make_sequence_features",
    "empty_template_features",
    "process_features",
    "to_torch",
]

GAP = 21
"""MSA index of a gap."""
MASK_TOKEN = 22
"""MSA index of a masked position (masked-MSA objective)."""
MSA_CLASSES = 23
"""20 amino acids, unknown, gap, mask."""


@dataclasses.dataclass(kw_only=True)
class FeatureConfig:
    """Sizes and sampling of the processed batch (AlphaFold's eval settings by default)."""

    max_msa_clusters: int = 512
    """Cluster centres kept in `msa_feat` (the query is always the first)."""
    max_extra_msa: int = 1024
    """Rows of the extra MSA (the sequences not chosen as centres)."""
    max_templates: int = 4
    """Templates kept; 0 turns templates off (the models without templates)."""
    num_recycle: int = 3
    """Recycling iterations; the trailing axis has `num_recycle + 1` entries."""
    masked_msa_replace_fraction: float = 0.15
    """Fraction of MSA positions replaced as in AlphaFold's masked-MSA input (also at inference)."""

    def __post_init__(self) -> None:
        for name in ("max_msa_clusters", "max_extra_msa", "max_templates", "num_recycle"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"FeatureConfig.{name} must be an int >= 0, got {value!r}")
        if self.max_msa_clusters < 1:
            raise ValueError("FeatureConfig.max_msa_clusters must be >= 1 (the query row)")
        if not 0.0 <= self.masked_msa_replace_fraction <= 1.0:
            raise ValueError("FeatureConfig.masked_msa_replace_fraction must lie in [0, 1]")


def _aatype(sequence: str) -> np.ndarray:
    return np.array([rc.restype_order.get(c, rc.unk_restype_index) for c in sequence], dtype=np.int64)


def make_sequence_features(sequence: str) -> dict[str, np.ndarray]:
    """`aatype` `[N]` (X, B, Z, U, O, J -> unknown 20, as AlphaFold) and `residue_index` `[N]`."""
    return {"aatype": _aatype(sequence), "residue_index": np.arange(len(sequence), dtype=np.int64)}


def _msa_row(sequence: str) -> list[int]:
    return [rc.MAP_HHBLITS_AATYPE_TO_OUR_AATYPE[rc.HHBLITS_AA_TO_ID.get(c, 20)] for c in sequence]


def make_msa_features(query: str, msas: Sequence[Msa]) -> dict[str, np.ndarray]:
    """`msa` `[S, N]` and `deletion_matrix` `[S, N]`: the query first, then every alignment's rows with
    duplicates (same aligned sequence) removed. With no alignments this is single-sequence mode."""
    rows, dels, seen = [_msa_row(query)], [[0] * len(query)], {query}
    for msa in msas:
        for seq, d in zip(msa.sequences, msa.deletion_matrix):
            if len(seq) != len(query):
                raise ValueError(f"alignment row of length {len(seq)} for a query of length {len(query)}")
            if seq in seen:
                continue
            seen.add(seq)
            rows.append(_msa_row(seq))
            dels.append(list(d))
    return {"msa": np.array(rows, dtype=np.int64), "deletion_matrix": np.array(dels, dtype=np.float32)}


def empty_template_features(num_res: int) -> dict[str, np.ndarray]:
    """Template features with no templates (T = 0)."""
    return {
        "template_aatype": np.zeros((0, num_res), np.int64),
        "template_all_atom_positions": np.zeros((0, num_res, rc.atom_type_num, 3), np.float32),
        "template_all_atom_mask": np.zeros((0, num_res, rc.atom_type_num), np.float32),
        "template_sum_probs": np.zeros((0, 1), np.float32),
    }


def _deletion_value(d: np.ndarray) -> np.ndarray:
    return (np.arctan(d / 3.0) * (2.0 / np.pi)).astype(np.float32)


def _masked_msa(msa: np.ndarray, profile: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """AlphaFold's masked-MSA replacement: of the chosen positions 10% uniform, 10% profile, 10% kept,
    70% the mask token. `msa` `[S, N]`, `profile` `[N, 23]`."""
    if fraction == 0.0 or msa.size == 0:
        return msa
    uniform = np.full(MSA_CLASSES, 0.0)
    uniform[:20] = 0.1 / 20
    probs = uniform + 0.1 * profile[None] + 0.1 * np.eye(MSA_CLASSES)[msa]
    probs[..., MASK_TOKEN] += 1.0 - 0.3
    probs = probs / probs.sum(-1, keepdims=True)
    cum = probs.cumsum(-1)
    draw = (rng.random(msa.shape)[..., None] > cum).sum(-1).clip(0, MSA_CLASSES - 1)
    replace = rng.random(msa.shape) < fraction
    return np.where(replace, draw, msa)


def _cluster(msa: np.ndarray, dels: np.ndarray, extra: np.ndarray, extra_dels: np.ndarray):
    """Nearest-centre assignment of the extra rows and the per-cluster profile and mean deletion
    (AlphaFold2 suppl. 1.2.7). Returns `cluster_profile` `[S, N, 23]`, `cluster_deletion_mean` `[S, N]`."""
    onehot = np.eye(MSA_CLASSES, dtype=np.float32)
    centres, others = onehot[msa], onehot[extra]
    weights = np.ones(MSA_CLASSES, np.float32)
    weights[GAP:] = 0.0  # gaps and masks never count as agreement
    if len(extra):
        agreement = np.einsum("snc,enc->es", centres * weights, others)
        assign = agreement.argmax(-1)
        counts = np.bincount(assign, minlength=len(msa)).astype(np.float32)
        profile_sum = centres.copy()
        np.add.at(profile_sum, assign, others)
        del_sum = dels.copy()
        np.add.at(del_sum, assign, extra_dels)
    else:
        counts = np.zeros(len(msa), np.float32)
        profile_sum, del_sum = centres, dels
    denom = (1.0 + counts)[:, None]
    return profile_sum / denom[..., None], del_sum / denom


def _sample_msa(raw: dict[str, np.ndarray], cfg: FeatureConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One pass's MSA features: sample centres, mask, cluster, build `msa_feat` and the extra MSA."""
    msa, dels = raw["msa"], raw["deletion_matrix"]
    order = np.concatenate([[0], 1 + rng.permutation(len(msa) - 1)])
    num_clusters = min(cfg.max_msa_clusters, len(msa))
    centre_idx, extra_idx = order[:num_clusters], order[num_clusters:][: cfg.max_extra_msa]
    centres, centre_dels = msa[centre_idx], dels[centre_idx]
    profile = np.eye(MSA_CLASSES, dtype=np.float32)[msa].mean(0)
    masked = _masked_msa(centres, profile, cfg.masked_msa_replace_fraction, rng)
    extra, extra_dels = msa[extra_idx], dels[extra_idx]
    cluster_profile, cluster_dels = _cluster(masked, centre_dels, extra, extra_dels)
    msa_feat = np.concatenate(
        [
            np.eye(MSA_CLASSES, dtype=np.float32)[masked],
            np.clip(centre_dels, 0.0, 1.0)[..., None],
            _deletion_value(centre_dels)[..., None],
            cluster_profile,
            _deletion_value(cluster_dels)[..., None],
        ],
        axis=-1,
    )
    if len(extra) == 0:  # one fully masked row keeps the extra-MSA stack's shapes non-empty
        extra, extra_dels = np.full((1, msa.shape[1]), GAP), np.zeros((1, msa.shape[1]), np.float32)
        extra_mask = np.zeros((1, msa.shape[1]), np.float32)
    else:
        extra_mask = np.ones(extra.shape, np.float32)
    return {
        "msa_feat": msa_feat.astype(np.float32),
        "msa_mask": np.ones(centres.shape, np.float32),
        "extra_msa": extra.astype(np.int64),
        "extra_msa_mask": extra_mask,
        "extra_has_deletion": np.clip(extra_dels, 0.0, 1.0).astype(np.float32),
        "extra_deletion_value": _deletion_value(extra_dels),
    }


def _pseudo_beta(aatype: np.ndarray, pos: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CB (CA for glycine) positions `[..., N, 3]` and mask `[..., N]`."""
    is_gly = aatype == rc.restype_order["G"]
    ca, cb = rc.atom_order["CA"], rc.atom_order["CB"]
    pb = np.where(is_gly[..., None], pos[..., ca, :], pos[..., cb, :])
    pb_mask = np.where(is_gly, mask[..., ca], mask[..., cb])
    return pb.astype(np.float32), pb_mask.astype(np.float32)


def _fixed_features(raw: dict[str, np.ndarray], cfg: FeatureConfig) -> dict[str, np.ndarray]:
    """The features that are the same in every recycling pass."""
    aatype = raw["aatype"]
    n = len(aatype)
    target = np.zeros((n, 22), np.float32)
    target[np.arange(n), 1 + aatype] = 1.0
    t = min(cfg.max_templates, len(raw["template_aatype"]))
    t_aatype = raw["template_aatype"][:t]
    t_pos, t_mask = raw["template_all_atom_positions"][:t], raw["template_all_atom_mask"][:t]
    pb, pb_mask = _pseudo_beta(t_aatype, t_pos, t_mask)
    return {
        "aatype": aatype,
        "residue_index": raw["residue_index"],
        "seq_mask": np.ones(n, np.float32),
        "target_feat": target,
        "template_aatype": t_aatype,
        "template_all_atom_positions": t_pos,
        "template_all_atom_mask": t_mask,
        "template_mask": np.ones(t, np.float32),
        "template_pseudo_beta": pb,
        "template_pseudo_beta_mask": pb_mask,
        "template_sum_probs": raw["template_sum_probs"][:t],
        "atom14_atom_exists": rc.restype_atom14_mask[aatype],
        "residx_atom14_to_atom37": rc.restype_atom14_to_atom37[aatype],
        "residx_atom37_to_atom14": rc.restype_atom37_to_atom14[aatype],
        "atom37_atom_exists": rc.restype_atom37_mask[aatype],
    }


def process_features(raw: dict[str, np.ndarray], config: FeatureConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """The processed batch (module docstring) with `config.num_recycle + 1` passes on the trailing axis.

    Deterministic for a given `seed`.
    """
    rng = np.random.default_rng(seed)
    fixed = _fixed_features(raw, config)
    passes = [_sample_msa(raw, config, rng) for _ in range(config.num_recycle + 1)]
    num_passes = len(passes)
    batch = {k: np.stack([v] * num_passes, axis=-1) for k, v in fixed.items()}
    for key in passes[0]:
        batch[key] = np.stack([p[key] for p in passes], axis=-1)
    return batch


def to_torch(batch: dict[str, np.ndarray], device: str = "cpu", dtype=None) -> dict:
    """numpy batch -> torch tensors (floating features cast to `dtype` when given)."""
    import torch

    out = {}
    for key, value in batch.items():
        t = torch.from_numpy(np.ascontiguousarray(value)).to(device)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[key] = t
    return out
