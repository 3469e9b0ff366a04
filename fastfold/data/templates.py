"""Template features from HHsearch hits and a folder of PDB mmCIF files (AlphaFold2 suppl. 1.2.3).

A hit `1ABC_A` names PDB entry `1abc`, author chain `A`. A hit is skipped (with a warning) when its mmCIF
file is missing, it was released after the cut-off date, its chain is absent, or the hit's residues
cannot be placed on the chain's SEQRES. The hit's alignment maps query residues to template residues.
With the PDB's list of obsolete entries (`obsolete.dat`, OpenFold's and AlphaFold's `--obsolete_pdbs_path`), a hit
on an obsolete entry uses its successor, and a hit on an entry removed without one is skipped, as AlphaFold does.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..common import residue_constants as rc
from .features import empty_template_features
from .mmcif import MmcifFile, parse_mmcif
from .parsers import InputError, TemplateHit

__all__ = ["TemplateConfig", "TemplateFeaturizer", "read_obsolete_pdbs"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class TemplateConfig:
    """Where templates come from and which hits are allowed."""

    mmcif_dir: str
    """Folder of `<pdb id>.cif` files (lower-case ids, as the PDB mirror names them)."""
    max_template_date: str
    """Latest release date allowed, `YYYY-MM-DD`."""
    max_hits: int = 4
    """Templates kept per target, best `sum_probs` first."""
    kalign_binary_path: str | None = "kalign"
    """kalign, to realign a hit whose residues differ from the chain's SEQRES; None: skip such hits."""
    obsolete_pdbs_path: str | None = None
    """The PDB's `obsolete.dat`: hits on obsolete entries use the successor's file (see `read_obsolete_pdbs`)."""

    def __post_init__(self) -> None:
        try:
            datetime.date.fromisoformat(self.max_template_date)
        except ValueError:
            msg = f"TemplateConfig.max_template_date must be YYYY-MM-DD, got {self.max_template_date!r}"
            raise ValueError(msg) from None
        if self.max_hits < 0:
            raise ValueError(f"TemplateConfig.max_hits must be >= 0, got {self.max_hits}")


def read_obsolete_pdbs(path: str | Path) -> dict[str, str | None]:
    """Obsolete PDB id -> its successor (lower case), or None for an entry removed without one, from the PDB's
    `obsolete.dat` (`OBSLTE    31-JUL-94 116L     216L`; with several successors, the first). `InputError`
    naming the file when it cannot be read or holds no OBSLTE line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file (not the PDB's obsolete.dat)") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    out: dict[str, str | None] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0] != "OBSLTE":
            continue
        if len(fields) < 3 or len(fields[2]) != 4:
            raise InputError(f"{path}: line {lineno}: expected 'OBSLTE date id [successor ...]', got {line.strip()!r}")
        out[fields[2].lower()] = fields[3].lower() if len(fields) > 3 else None
    if not out:
        raise InputError(f"{path}: no OBSLTE lines (not the PDB's obsolete.dat)")
    return out


class TemplateFeaturizer:
    """Builds `template_*` raw features `[T, N, ...]` for a query from its hits."""

    def __init__(self, config: TemplateConfig) -> None:
        self.config = config
        self._obsolete = read_obsolete_pdbs(config.obsolete_pdbs_path) if config.obsolete_pdbs_path else {}
        self._cache: dict[str, MmcifFile | None] = {}
        self.report: list[dict] = []
        """What the last `get` did with each hit it considered (used: PDB id, chain, columns, date; else why)."""

    def _load(self, pdb_id: str) -> MmcifFile | None:
        if pdb_id not in self._cache:
            path = Path(self.config.mmcif_dir) / f"{pdb_id}.cif"
            if not path.exists():
                self._cache[pdb_id] = None
            else:
                try:
                    text = path.read_text()
                except UnicodeDecodeError:
                    raise InputError(f"{path}: not a text mmCIF file (binary or compressed)") from None
                self._cache[pdb_id] = parse_mmcif(text, str(path))
        return self._cache[pdb_id]

    def _skip(self, hit: TemplateHit, reason: str, level: int = logging.WARNING) -> None:
        logger.log(level, "template %s skipped: %s", hit.name, reason)
        self.report.append({"hit": hit.name, "used": False, "reason": reason})

    def _one(self, query: str, hit: TemplateHit) -> dict[str, np.ndarray] | None:
        pdb_id, _, chain_id = hit.name.partition("_")
        pdb_id, replaces = pdb_id.lower(), None
        if pdb_id in self._obsolete:
            successor = self._obsolete[pdb_id]
            if successor is None:
                self._skip(hit, f"{pdb_id} is obsolete, removed from the PDB without a successor", logging.INFO)
                return None
            logger.info("template %s: %s is obsolete, using its successor %s", hit.name, pdb_id, successor)
            pdb_id, replaces = successor, pdb_id
        try:
            mmcif = self._load(pdb_id)
        except InputError as exc:
            self._skip(hit, str(exc))
            return None
        if mmcif is None:
            self._skip(hit, f"no {pdb_id.lower()}.cif in {self.config.mmcif_dir}")
            return None
        if not mmcif.release_date or mmcif.release_date > self.config.max_template_date:
            self._skip(hit, f"released {mmcif.release_date or '?'}, after the cut-off", logging.INFO)
            return None
        chain = mmcif.chains.get(chain_id)
        if chain is None:
            self._skip(hit, f"chain {chain_id} not in the mmCIF file")
            return None
        feats = _features_from_hit(query, hit, chain.sequence, chain.positions, chain.mask, self._kalign())
        if feats is None:
            self.report.append({"hit": hit.name, "used": False, "reason": "hit residues not placed on the SEQRES"})
            return None
        columns = int((feats["template_all_atom_mask"].sum(-1) > 0).sum())
        self.report.append({"hit": hit.name, "used": True, "pdb_id": pdb_id, "chain": chain_id,
                            "aligned_cols": hit.aligned_cols, "query_residues_with_atoms": columns,
                            "sum_probs": hit.sum_probs, "release_date": mmcif.release_date,
                            **({"replaces": replaces} if replaces else {})})
        return feats

    def _kalign(self) -> str | None:
        from .tools import ToolError, find_binary

        path = self.config.kalign_binary_path
        if not path:
            return None
        try:
            return find_binary(path, "kalign")
        except ToolError:
            return None

    def get(self, query: str, hits: Sequence[TemplateHit]) -> dict[str, np.ndarray]:
        """Template features for `query` from `hits` (best first); T = 0 when none is usable."""
        feats = []
        self.report = []
        for hit in sorted(hits, key=lambda h: -h.sum_probs):
            if len(feats) >= self.config.max_hits:
                break
            one = self._one(query, hit)
            if one is not None:
                feats.append(one)
        if not feats:
            return empty_template_features(len(query))
        return {k: np.stack([f[k] for f in feats]) for k in feats[0]}


def _realign(hit_residues: str, seqres: str, kalign: str) -> dict[int, int]:
    """Hit residue k -> SEQRES index, from a kalign alignment of the two (matched columns only)."""
    from .tools import run_kalign

    a, b = run_kalign(kalign, [hit_residues, seqres])
    mapping, i, j = {}, 0, 0
    for x, y in zip(a, b):
        if x != "-" and y != "-":
            mapping[i] = j
        i += x != "-"
        j += y != "-"
    return mapping


def _hit_to_seqres(hit: TemplateHit, seqres: str, kalign: str | None) -> dict[int, int] | None:
    """Hit residue k (0 = first aligned template residue) -> SEQRES index; None if it cannot be placed."""
    hit_residues = hit.hit_sequence.replace("-", "")
    offset = seqres.find(hit_residues)
    if offset >= 0:
        return {k: offset + k for k in range(len(hit_residues))}
    if kalign is None:
        logger.warning("template %s skipped: hit sequence not in the chain's SEQRES (no kalign to realign)", hit.name)
        return None
    mapping = _realign(hit_residues, seqres, kalign)
    if len(mapping) < 0.5 * len(hit_residues):
        logger.warning("template %s skipped: realigned hit matches under half its residues", hit.name)
        return None
    logger.info("template %s: hit realigned to SEQRES with kalign (%d residues)", hit.name, len(mapping))
    return mapping


def _features_from_hit(
    query: str, hit: TemplateHit, seqres: str, positions: np.ndarray, mask: np.ndarray, kalign: str | None = None
) -> dict[str, np.ndarray] | None:
    """Map the hit's aligned template residues onto the query. `positions` `[L, 37, 3]`."""
    to_seqres = _hit_to_seqres(hit, seqres, kalign)
    if to_seqres is None:
        return None
    first_hit = min(i for i in hit.indices_hit if i >= 0)
    n = len(query)
    out_pos = np.zeros((n, rc.atom_type_num, 3), np.float32)
    out_mask = np.zeros((n, rc.atom_type_num), np.float32)
    aatype = np.full(n, 21, np.int64)  # gap where the template has no residue
    for qi, ti in zip(hit.indices_query, hit.indices_hit):
        if qi < 0 or ti < 0 or qi >= n or (ti - first_hit) not in to_seqres:
            continue
        row = to_seqres[ti - first_hit]
        out_pos[qi], out_mask[qi] = positions[row], mask[row]
        aatype[qi] = rc.restype_order.get(seqres[row], rc.unk_restype_index)
    return {
        "template_aatype": aatype,
        "template_all_atom_positions": out_pos,
        "template_all_atom_mask": out_mask,
        "template_sum_probs": np.array([hit.sum_probs], np.float32),
    }
