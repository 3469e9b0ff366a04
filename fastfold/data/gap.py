"""OpenFold's rule for a folder of FASTA files folded with a monomer model: a file with several records is one
target, its chains joined as AlphaFold-Gap (OpenFold's `DataPipeline.process_multiseq_fasta`): the sequences
concatenated, the residue index jumping by `RI_GAP` (200) at each chain break, each chain's MSA placed in its own
columns with gaps elsewhere, each chain's templates likewise. A single FASTA file keeps AlphaFold's and ColabFold's
rule, one target per record (`read_fold_inputs` says which rule applied).

The target is named as OpenFold names it, the records' names joined by '-'; each record's name is its
alignment folder (`<precomputed>/<record name>/`, OpenFold's `super_alignment_dir/<desc>`).

DISCREPANCY: the MSA's first row is the whole query (every chain's sequence), where OpenFold's first row is the
first chain's query with gaps over the others; AlphaFold's feature processing takes row 0 as the query.
DISCREPANCY: the outputs keep the gapped numbering (chain B starts at `len(A) + 1 + RI_GAP`) with one chain ID per
record, where OpenFold renumbers each chain from 1: the gap stays visible in the PDB.
"""

from __future__ import annotations

import dataclasses
import string
from pathlib import Path

import numpy as np

from .features import make_msa_features, make_sequence_features
from .parsers import InputError
from .targets import FASTA_SUFFIXES, AlignmentConfig, Target, read_targets, target_raw_features

__all__ = ["RI_GAP", "RULE_GAP", "RULE_RECORDS", "GapTarget", "gap_raw_features", "read_fold_inputs"]

RI_GAP = 200
"""Residue-index jump between chains (OpenFold's `--multimer_ri_gap` default)."""

RULE_RECORDS = "one target per record (a single FASTA file: AlphaFold's and ColabFold's rule)"
RULE_GAP = ("a folder of FASTA files: one target per file (OpenFold's rule); a file with several records is "
            "one target, chains joined as AlphaFold-Gap (residue-index gap {gap})")
"""The rule `read_fold_inputs` reports for a folder of FASTA files; `RULE_GAP.format(gap=...)` names the gap used."""


@dataclasses.dataclass(frozen=True)
class GapTarget(Target):
    """Several chains folded as one monomer target (AlphaFold-Gap): `sequence` is the chains' sequences joined,
    `chains` the records (each a `Target`: name = alignment folder, sequence)."""

    chains: tuple[Target, ...] = dataclasses.field(default=(), compare=False)
    gap: int = RI_GAP

    @classmethod
    def of(cls, chains: list[Target], gap: int = RI_GAP) -> GapTarget:
        description = "; ".join(f"{chain_id}: {c.description or c.name}" for chain_id, c in zip(string.ascii_uppercase,
                                                                                               chains))
        return cls("-".join(c.name for c in chains), "".join(c.sequence for c in chains), description,
                   chains=tuple(chains), gap=gap)

    @property
    def chain_ids(self) -> tuple[str, ...]:
        return tuple(string.ascii_uppercase[: len(self.chains)])

    def chain_index(self) -> np.ndarray:
        """`[N]` the chain (0, 1, ...) of every residue."""
        return np.concatenate([np.full(len(c.sequence), k, np.int64) for k, c in enumerate(self.chains)])

    def residue_index(self) -> np.ndarray:
        """`[N]` 0-based residue index with `gap` added at every chain break."""
        return np.arange(len(self.sequence), dtype=np.int64) + self.gap * self.chain_index()


def _read_file_targets(path: Path, gap: int) -> list[Target]:
    targets = []
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FASTA_SUFFIXES):
        records = read_targets(f)
        if len(records) > 26:
            raise InputError(f"{f}: {len(records)} records; an AlphaFold-Gap target takes at most 26 chains (A-Z)")
        targets.append(records[0] if len(records) == 1 else GapTarget.of(records, gap))
    return targets


def read_fold_inputs(fasta_path: str | Path, gap: int = RI_GAP) -> tuple[list[Target], str]:
    """The monomer targets of a FASTA file (one per record) or of a folder of FASTA files (one per file, a
    several-record file an AlphaFold-Gap `GapTarget`), validated, and the rule that applied (`RULE_RECORDS`,
    `RULE_GAP`; `gap`: the residue-index jump between an AlphaFold-Gap target's records, OpenFold's
    `--multimer_ri_gap`). Target names, and each chain's folder name, must be unique across the files."""
    path = Path(fasta_path)
    if not path.is_dir():
        return read_targets(path), RULE_RECORDS
    read_targets(path)  # the folder's checks: FASTA files present, records valid, record names unique
    targets = _read_file_targets(path, gap)
    names = [t.name for t in targets]
    for name in names:
        if names.count(name) > 1:
            raise InputError(f"{path}: two files make the target {name!r} (names must be unique)")
    return targets, RULE_GAP.format(gap=gap)


def _pad_rows(rows: np.ndarray, before: int, after: int, value: float) -> np.ndarray:
    pad = [(0, 0)] * rows.ndim
    pad[1] = (before, after)
    return np.pad(rows, pad, constant_values=value)


def _merge(target: GapTarget, parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One target's raw features from its chains': MSA rows and templates each in their chain's columns."""
    n = len(target.sequence)
    raw = {**make_sequence_features(target.sequence), **make_msa_features(target.sequence, [])}
    raw["residue_index"] = target.residue_index()
    gap_id = int(make_msa_features("-", [])["msa"][0, 0])
    msa, dels, templates = [raw["msa"]], [raw["deletion_matrix"]], {}
    start = 0
    for chain, part in zip(target.chains, parts):
        before, after = start, n - start - len(chain.sequence)
        msa.append(_pad_rows(part["msa"][1:], before, after, gap_id))
        dels.append(_pad_rows(part["deletion_matrix"][1:], before, after, 0))
        for key, value in part.items():
            if key.startswith("template_"):
                padded = value if key == "template_sum_probs" else _pad_rows(
                    value, before, after, 21 if key == "template_aatype" else 0)
                templates.setdefault(key, []).append(padded)
        start += len(chain.sequence)
    raw["msa"], raw["deletion_matrix"] = np.concatenate(msa), np.concatenate(dels)
    raw.update({k: np.concatenate(v) for k, v in templates.items()})
    return raw


def gap_raw_features(target: GapTarget, cfg: AlignmentConfig, work_dir: str | Path, with_templates: bool = True,
                     info: dict | None = None) -> dict[str, np.ndarray]:
    """Raw features of an AlphaFold-Gap target: each chain's (`target_raw_features`: its precomputed folder
    `<precomputed>/<chain name>`, or its searches in `work_dir/chains/<chain name>`) merged as OpenFold's
    `process_multiseq_fasta` does (module docstring). `info` gets each chain's report under `gap_chains`."""
    info = {} if info is None else info
    parts, reports = [], []
    for chain in target.chains:
        report: dict = {}
        parts.append(target_raw_features(chain, cfg, Path(work_dir) / "chains" / chain.name, with_templates,
                                         info=report))
        reports.append({"chain": chain.name, **report})
    raw = _merge(target, parts)
    files = [{**f, "file": f"{r['chain']}/{f['file']}"} for r in reports for f in r.get("alignment_files", [])]
    info.update(msa_mode=f"AlphaFold-Gap ({reports[0].get('msa_mode', '')})", residue_index_gap=target.gap,
                alignment_files=files, templates=[t for r in reports for t in r.get("templates", [])],
                msa_depth_total=1 + sum(r.get("msa_depth_total", 1) - 1 for r in reports),
                msa_depth_dedup=int(raw["msa"].shape[0]), gap_chains=reports)
    return raw
