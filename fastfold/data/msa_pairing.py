"""AlphaFold-Multimer's MSA pairing and chain merging (Evans et al. 2021, suppl. 2.1 and 7.3.2; the public
`msa_pairing.py` / `feature_processing.py` of AlphaFold v2.3, written afresh here from the algorithm).

Input: one feature dict per chain, in the complex's feature order (grouped by entity, `asym_id` 1, 2, ...),
each with the chain's monomer features (`aatype` `[N]`, `residue_index` `[N]`, `msa` `[S, N]`,
`deletion_matrix` `[S, N]`, `template_*` `[T, N, ...]`), its assembly ids (`asym_id`, `entity_id`, `sym_id`
`[N]`) and, for a heteromer, its pairing MSA from the UniProt hits: `msa_all_seq` `[P, N]`,
`deletion_matrix_all_seq` `[P, N]`, `msa_species_identifiers_all_seq` (P strings, '' for no species).

Steps (`pair_and_merge`):
1. Pairing (heteromers only). Rows of the UniProt MSAs that share a species are paired across chains: for each
   species in at least two chains (and at most `max_rows_per_species` rows in every chain), the rows of each chain
   are ranked by identity to the chain's query and the k-th of every chain form one paired row, k up to the
   smallest count; a chain without the species gets a gap row. The query rows are always the first paired
   row. Paired rows are ordered by how many chains they cover (most first), then by the product of their row
   ranks (lowest first).
2. Rows of a chain's unpaired MSA that already appear in its paired rows (the query included) are dropped.
3. Crop: at most `msa_crop_size // 2` paired rows; each chain keeps at most `msa_crop_size` minus the number of
   paired rows where it is not all gap of its unpaired rows; at most `max_templates` templates per chain.
4. Merge: copies of one entity (homomer parts) have their MSAs side by side; entities' unpaired MSAs are
   block-diagonal, gap (21) off the diagonal; the paired block comes first. `bert_mask` is 0 off the diagonal
   blocks, `cluster_bias_mask` marks the query row of each block (of the paired block when paired). Templates
   are padded to `max_templates` per chain and concatenated along residues.
5. `msa_mask` ones (zero on the rows added to reach `min_num_seq`), `seq_mask` ones.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

__all__ = [
    "MSA_GAP",
    "MultimerFeatureConfig",
    "block_diag",
    "create_paired_features",
    "crop_chains",
    "deduplicate_unpaired_sequences",
    "merge_chain_features",
    "pair_and_merge",
    "pair_sequences",
    "reorder_paired_rows",
    "species_identifier",
]

MSA_GAP = 21
"""MSA index of a gap (the same in HHblits' order and ours)."""
MSA_FEATURES = ("msa", "msa_mask", "deletion_matrix")
"""Per-row MSA features `[S, N]`: paired ones concatenate along residues, unpaired ones go block-diagonal."""
MSA_PAD = {"msa": MSA_GAP, "msa_mask": 1.0, "deletion_matrix": 0.0}
"""Fill of the off-diagonal blocks and of the gap row of a chain missing from a paired row (AlphaFold's)."""
SEQ_FEATURES = ("aatype", "residue_index", "asym_id", "entity_id", "sym_id", "entity_mask", "deletion_mean")
"""Per-residue features `[N]`: concatenated along residues."""
TEMPLATE_FEATURES = ("template_aatype", "template_all_atom_positions", "template_all_atom_mask")
"""Per-template features `[T, N, ...]`: padded to `max_templates`, then concatenated along residues."""


@dataclasses.dataclass(kw_only=True)
class MultimerFeatureConfig:
    """Caps of AlphaFold-Multimer's feature processing (its defaults)."""

    msa_crop_size: int = 2048
    """MSA rows per chain, paired and unpaired together; at most half of it paired."""
    max_templates: int = 4
    """Templates per chain; every chain's templates are padded to this many."""
    max_uniprot_hits: int = 50_000
    """Rows of `uniprot_hits.sto` used for pairing (query included)."""
    max_rows_per_species: int = 600
    """A species with more rows than this in any chain is not paired (AlphaFold's guard against huge groups)."""
    min_num_seq: int = 512
    """The merged MSA is padded with masked rows up to this many (AlphaFold's `pad_msa`); 0: no padding."""

    def __post_init__(self) -> None:
        for name in ("msa_crop_size", "max_templates", "max_uniprot_hits", "max_rows_per_species", "min_num_seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"MultimerFeatureConfig.{name} must be an int >= 0, got {value!r}")
        if self.msa_crop_size < 2:
            raise ValueError("MultimerFeatureConfig.msa_crop_size must be >= 2 (the query row, paired and unpaired)")


_UNIPROT_ID = re.compile(
    r"^(?:tr|sp)\|[A-Za-z0-9]{6,10}(?:_\d)?\|[A-Za-z0-9]+_(?P<species>[A-Za-z0-9]{1,5})(?:_\d+)?$"
)
"""A UniProt sequence name, `tr|ACCESSION|ENTRY_SPECIES` or `sp|ACCESSION|MNEMONIC_SPECIES`: the species is the
mnemonic after the last '_' (e.g. HUMAN, 9BACT); an isoform suffix `_1` on the accession and a trailing `_<n>`
(small BFD) are ignored."""


def species_identifier(description: str) -> str:
    """The UniProt species mnemonic of an alignment row's name (`tr|A0A1|A0A1_HUMAN/3-90 ...` -> 'HUMAN'), '' when
    the name is not a UniProt one (the query, UniRef or MGnify names): such rows are never paired."""
    words = description.split()
    if not words:
        return ""
    m = _UNIPROT_ID.match(words[0].partition("/")[0])
    return m.group("species") if m else ""


def _species_rows(chain: dict) -> dict[str, np.ndarray]:
    """Species -> the chain's pairing-MSA rows of that species, most identical to the query first (ties in row
    order); the query row and rows without a species are left out."""
    msa = chain["msa_all_seq"]
    identity = (msa == msa[0][None]).mean(-1) if len(msa) else np.zeros(0)
    by_species: dict[str, list[int]] = {}
    for row, species in enumerate(chain["msa_species_identifiers_all_seq"]):
        if species and row > 0:
            by_species.setdefault(str(species), []).append(row)
    # DISCREPANCY: AlphaFold sorts with pandas' default (unstable) sort; a stable sort makes ties deterministic.
    return {s: np.array(sorted(rows, key=lambda r: -identity[r]), np.int64) for s, rows in by_species.items()}


def pair_sequences(chains: Sequence[dict], max_rows_per_species: int = 600) -> dict[int, np.ndarray]:
    """Paired rows by the number of chains they cover: `{k: [R_k, C]}`, row indices into each chain's
    `msa_all_seq` (-1: a gap row). `k = C` starts with the query row (all zeros)."""
    num_chains = len(chains)
    per_chain = [_species_rows(c) for c in chains]
    paired: dict[int, list[np.ndarray]] = {k: [] for k in range(num_chains + 1)}
    paired[num_chains].append(np.zeros(num_chains, np.int64))
    for species in sorted(set().union(*per_chain)):
        groups = [rows.get(species) for rows in per_chain]
        present = [g for g in groups if g is not None]
        if len(present) < 2 or max(len(g) for g in present) > max_rows_per_species:
            continue
        take = min(len(g) for g in present)
        columns = [g[:take] if g is not None else np.full(take, -1, np.int64) for g in groups]
        paired[len(present)].extend(np.stack(columns, axis=1))
    return {k: np.array(rows, np.int64).reshape(-1, num_chains) for k, rows in paired.items()}


def reorder_paired_rows(paired: dict[int, np.ndarray]) -> np.ndarray:
    """All paired rows `[R, C]`: those covering most chains first, within them by |product of row indices|."""
    blocks = []
    for k in sorted(paired, reverse=True):
        rows = paired[k]
        if len(rows):
            key = np.abs(np.prod(rows, axis=1))
            blocks.append(rows[np.argsort(key, kind="stable")])
    return np.concatenate(blocks) if blocks else np.zeros((0, 0), np.int64)


def create_paired_features(chains: Sequence[dict], max_rows_per_species: int = 600) -> list[dict]:
    """Each chain's `*_all_seq` MSA features replaced by its column of the paired rows (a gap row for -1);
    `num_alignments_all_seq` set. Chains are copied, not changed in place."""
    rows = reorder_paired_rows(pair_sequences(chains, max_rows_per_species))
    out = []
    for c, chain in enumerate(chains):
        new = dict(chain)
        for name in MSA_FEATURES:
            key = f"{name}_all_seq"
            if key in chain:
                feat = chain[key]
                pad = np.full((1, feat.shape[1]), MSA_PAD[name], feat.dtype)
                new[key] = np.concatenate([feat, pad])[rows[:, c]]
        new.pop("msa_species_identifiers_all_seq", None)
        new["num_alignments_all_seq"] = len(rows)
        out.append(new)
    return out


def deduplicate_unpaired_sequences(chains: Sequence[dict]) -> list[dict]:
    """Drop each chain's unpaired MSA rows that equal one of its paired rows (so the query row goes too)."""
    out = []
    for chain in chains:
        seen = {row.tobytes() for row in np.ascontiguousarray(chain["msa_all_seq"])}
        keep = [i for i, row in enumerate(np.ascontiguousarray(chain["msa"])) if row.tobytes() not in seen]
        new = dict(chain)
        for name in MSA_FEATURES:
            if name in chain:
                new[name] = chain[name][keep]
        new["num_alignments"] = len(keep)
        out.append(new)
    return out


def crop_chains(chains: Sequence[dict], msa_crop_size: int, paired: bool, max_templates: int) -> list[dict]:
    """AlphaFold-Multimer's per-chain MSA and template caps (step 3 of the module docstring)."""
    out = []
    for chain in chains:
        new = dict(chain)
        if paired:
            num_paired = min(chain["num_alignments_all_seq"], msa_crop_size // 2)
            covered = int(np.any(chain["msa_all_seq"][:num_paired] != MSA_GAP, axis=1).sum())
            num_unpaired = min(len(chain["msa"]), max(msa_crop_size - covered, 0))
            for name in MSA_FEATURES:
                if f"{name}_all_seq" in chain:
                    new[f"{name}_all_seq"] = chain[f"{name}_all_seq"][:num_paired]
            new["num_alignments_all_seq"] = num_paired
        else:
            num_unpaired = min(len(chain["msa"]), msa_crop_size)
        for name in MSA_FEATURES:
            if name in chain:
                new[name] = chain[name][:num_unpaired]
        new["num_alignments"] = num_unpaired
        for name in TEMPLATE_FEATURES:
            new[name] = chain[name][:max_templates]
        out.append(new)
    return out


def block_diag(*arrays: np.ndarray, pad_value: float | int = 0) -> np.ndarray:
    """Block-diagonal `[sum S_i, sum N_i]` of `[S_i, N_i]` arrays, `pad_value` off the blocks."""
    rows = sum(a.shape[0] for a in arrays)
    cols = sum(a.shape[1] for a in arrays)
    out = np.full((rows, cols), pad_value, dtype=np.result_type(*arrays))
    r = c = 0
    for a in arrays:
        out[r : r + a.shape[0], c : c + a.shape[1]] = a
        r, c = r + a.shape[0], c + a.shape[1]
    return out


def _pad_templates(chain: dict, max_templates: int) -> dict:
    new = dict(chain)
    for name in TEMPLATE_FEATURES:
        feat = chain[name]
        widths = [(0, max_templates - feat.shape[0])] + [(0, 0)] * (feat.ndim - 1)
        new[name] = np.pad(feat, widths)
    new["template_mask"] = np.pad(np.ones(chain[TEMPLATE_FEATURES[0]].shape[0], np.float32), widths[0])
    return new


def _merge_entity(copies: list[dict]) -> dict:
    """Copies of one entity side by side: every feature concatenated along residues (MSAs row by row)."""
    if len(copies) == 1:
        return dict(copies[0])
    merged = dict(copies[0])
    for name in (*MSA_FEATURES, *(f"{n}_all_seq" for n in MSA_FEATURES)):
        if name in copies[0]:
            merged[name] = np.concatenate([c[name] for c in copies], axis=1)
    for name in SEQ_FEATURES:
        merged[name] = np.concatenate([c[name] for c in copies])
    for name in TEMPLATE_FEATURES:
        merged[name] = np.concatenate([c[name] for c in copies], axis=1)
    merged["template_mask"] = np.max([c["template_mask"] for c in copies], axis=0)
    return merged


def merge_chain_features(chains: Sequence[dict], paired: bool, max_templates: int) -> dict[str, np.ndarray]:
    """One complex's features from its chains' (step 4 of the module docstring). `chains` in feature order."""
    chains = [_pad_templates(c, max_templates) for c in chains]
    entities: dict[int, list[dict]] = {}
    for chain in chains:
        entities.setdefault(int(chain["entity_id"][0]), []).append(chain)
    blocks = [_merge_entity(copies) for copies in entities.values()]
    out: dict[str, np.ndarray] = {}
    for name in SEQ_FEATURES:
        out[name] = np.concatenate([b[name] for b in blocks])
    for name in TEMPLATE_FEATURES:
        out[name] = np.concatenate([b[name] for b in blocks], axis=1)
    out["template_mask"] = np.max([b["template_mask"] for b in blocks], axis=0)
    unpaired_bert = block_diag(*[np.ones(b["msa"].shape, np.float32) for b in blocks], pad_value=0.0)
    for name in ("msa", "deletion_matrix"):
        out[name] = block_diag(*[b[name] for b in blocks], pad_value=MSA_PAD[name])
    if paired:
        paired_msa = np.concatenate([b["msa_all_seq"] for b in blocks], axis=1)
        paired_dels = np.concatenate([b["deletion_matrix_all_seq"] for b in blocks], axis=1)
        out["msa"] = np.concatenate([paired_msa, out["msa"]])
        out["deletion_matrix"] = np.concatenate([paired_dels, out["deletion_matrix"]])
        out["bert_mask"] = np.concatenate([np.ones(paired_msa.shape, np.float32), unpaired_bert])
        out["cluster_bias_mask"] = np.zeros(len(out["msa"]), np.float32)
        out["cluster_bias_mask"][0] = 1.0
        out["num_paired_rows"] = np.asarray(len(paired_msa), np.int64)
    else:
        out["bert_mask"] = unpaired_bert
        starts = np.cumsum([0] + [len(b["msa"]) for b in blocks[:-1]])
        out["cluster_bias_mask"] = np.zeros(len(out["msa"]), np.float32)
        out["cluster_bias_mask"][starts[[len(b["msa"]) > 0 for b in blocks]]] = 1.0
        out["num_paired_rows"] = np.asarray(0, np.int64)
    return out


def _is_homomer_or_monomer(chains: Sequence[dict]) -> bool:
    return len({c["aatype"].tobytes() for c in chains}) == 1


def _unmerged(chain: dict) -> dict:
    """Per-chain features the merge needs: float deletions, `deletion_mean`, `entity_mask`."""
    new = dict(chain)
    new["deletion_matrix"] = np.asarray(chain["deletion_matrix"], np.float32)
    if "deletion_matrix_all_seq" in chain:
        new["deletion_matrix_all_seq"] = np.asarray(chain["deletion_matrix_all_seq"], np.float32)
    new["deletion_mean"] = new["deletion_matrix"].mean(0).astype(np.float32)
    new["entity_mask"] = (np.asarray(chain["entity_id"]) != 0).astype(np.int64)
    new["num_alignments"] = len(chain["msa"])
    return new


def pair_and_merge(chains: Sequence[dict], config: MultimerFeatureConfig | None = None) -> dict[str, np.ndarray]:
    """The complex's raw features from per-chain ones (module docstring), chains in feature order.

    Returns `aatype`, `residue_index`, `asym_id`, `entity_id`, `sym_id`, `entity_mask` `[N]` (int64),
    `seq_mask`, `deletion_mean` `[N]` (float32), `msa` `[S, N]` (int64), `deletion_matrix`, `msa_mask`,
    `bert_mask` `[S, N]` and `cluster_bias_mask` `[S]` (float32), `template_aatype` `[T, N]`,
    `template_all_atom_positions` `[T, N, 37, 3]`, `template_all_atom_mask` `[T, N, 37]`, `template_mask`
    `[T]` (T = `max_templates`), and the scalars `num_alignments`, `num_paired_rows`, `seq_length`,
    `assembly_num_chains`, `num_templates`."""
    config = config or MultimerFeatureConfig()
    chains = [_unmerged(c) for c in chains]
    paired = len(chains) > 1 and not _is_homomer_or_monomer(chains)
    if paired:
        missing = [i for i, c in enumerate(chains) if "msa_all_seq" not in c]
        if missing:
            raise ValueError(f"chains {missing} have no pairing MSA (msa_all_seq) in a heteromer")
        chains = create_paired_features(chains, config.max_rows_per_species)
        chains = deduplicate_unpaired_sequences(chains)
    chains = crop_chains(chains, config.msa_crop_size, paired, config.max_templates)
    num_templates = max((int(c["template_aatype"].shape[0]) for c in chains), default=0)
    out = merge_chain_features(chains, paired, config.max_templates)
    n = len(out["aatype"])
    out["seq_mask"] = (out["entity_id"] > 0).astype(np.float32)
    out["msa_mask"] = np.ones(out["msa"].shape, np.float32) * out["seq_mask"][None]
    out["msa"] = out["msa"].astype(np.int64)
    for name in ("aatype", "residue_index", "asym_id", "entity_id", "sym_id", "template_aatype"):
        out[name] = out[name].astype(np.int64)
    for name in ("template_all_atom_positions", "template_all_atom_mask", "template_mask", "deletion_matrix"):
        out[name] = out[name].astype(np.float32)
    out["num_alignments"] = np.asarray(len(out["msa"]), np.int64)
    short = config.min_num_seq - len(out["msa"])
    if short > 0:
        for name in ("msa", "deletion_matrix", "bert_mask", "msa_mask"):
            out[name] = np.pad(out[name], ((0, short), (0, 0)))
        out["cluster_bias_mask"] = np.pad(out["cluster_bias_mask"], (0, short))
    out["seq_length"] = np.asarray(n, np.int64)
    out["assembly_num_chains"] = np.asarray(len(chains), np.int64)
    out["num_templates"] = np.asarray(num_templates, np.int64)
    return out

