"""A small mmCIF reader: the polymer chains (SEQRES and atom37 coordinates) and the release date.

Enough of the format for template features: `loop_` tables, single items, quoted values and `;` text
fields. Only the first model and the first alternate location of each atom are read.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import numpy as np

from ..common import residue_constants as rc
from .parsers import InputError

__all__ = ["MmcifChain", "MmcifFile", "parse_mmcif"]

_MODIFIED = {"MSE": "MET"}
"""Modified residues read as their parent (selenomethionine's SE becomes MET's SD)."""


@dataclasses.dataclass(frozen=True)
class MmcifChain:
    """One polymer chain: `sequence` (SEQRES one-letter), `positions` `[L, 37, 3]`, `mask` `[L, 37]`."""

    sequence: str
    positions: np.ndarray
    mask: np.ndarray


@dataclasses.dataclass(frozen=True)
class MmcifFile:
    """The chains of a file by author chain id, and the release date (ISO `YYYY-MM-DD`, '' if unknown)."""

    chains: dict[str, MmcifChain]
    release_date: str


_TOKEN = re.compile(r"'(.*?)'(?=\s|$)|\"(.*?)\"(?=\s|$)|(\S+)")


def _tokens(text: str, source: str) -> Iterator[tuple[str, bool]]:
    """(value, was quoted) for each token; quoted values are never names or keywords."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(";"):
            block = [line[1:]]
            i += 1
            while i < len(lines) and not lines[i].startswith(";"):
                block.append(lines[i])
                i += 1
            if i == len(lines):
                raise InputError(f"{source}: unterminated ';' text field")
            yield "\n".join(block).strip(), True
        elif line.strip() and not line.lstrip().startswith("#"):
            for m in _TOKEN.finditer(line):
                if m.group(3) is not None:
                    yield m.group(3), False
                else:
                    yield (m.group(1) if m.group(1) is not None else m.group(2)), True
        i += 1


def _tables(text: str, source: str) -> dict[str, dict[str, list[str]]]:
    """category -> {field -> column of values} (single items become one-row columns)."""
    tables: dict[str, dict[str, list[str]]] = {}
    pairs = list(_tokens(text, source))
    toks = [v for v, _ in pairs]
    keyword = [not quoted and (v.startswith("_") or v == "loop_" or v.startswith("data_")) for v, quoted in pairs]
    i = 0
    while i < len(toks):
        tok = toks[i]
        if keyword[i] and tok == "loop_":
            names = []
            i += 1
            while i < len(toks) and keyword[i] and toks[i].startswith("_"):
                names.append(toks[i])
                i += 1
            values = []
            while i < len(toks) and not keyword[i]:
                values.append(toks[i])
                i += 1
            if names and len(values) % len(names):
                raise InputError(f"{source}: loop of {names[0].split('.')[0]} has a ragged value count")
            for k, name in enumerate(names):
                cat, _, field = name.partition(".")
                tables.setdefault(cat, {})[field] = values[k :: len(names)]
        elif keyword[i] and tok.startswith("_") and i + 1 < len(toks):
            cat, _, field = tok.partition(".")
            tables.setdefault(cat, {})[field] = [toks[i + 1]]
            i += 2
        else:
            i += 1
    return tables


def _release_date(t: dict[str, dict[str, list[str]]]) -> str:
    dates = t.get("_pdbx_audit_revision_history", {}).get("revision_date", [])
    if dates:
        return min(dates)
    return t.get("_pdbx_database_status", {}).get("recvd_initial_deposition_date", [""])[0]


def _seqres(t: dict[str, dict[str, list[str]]]) -> dict[str, list[tuple[int, str]]]:
    """author chain -> [(label seq id, residue name)] from the polymer sequence scheme."""
    scheme = t.get("_pdbx_poly_seq_scheme", {})
    out: dict[str, list[tuple[int, str]]] = {}
    for strand, seq_id, mon in zip(scheme.get("pdb_strand_id", []), scheme.get("seq_id", []), scheme.get("mon_id", [])):
        out.setdefault(strand, []).append((int(seq_id), _MODIFIED.get(mon, mon)))
    return out


def _fill_atoms(
    t: dict[str, dict[str, list[str]]], chain: str, index: dict[int, int], pos: np.ndarray, mask: np.ndarray
) -> None:
    a = t["_atom_site"]
    models = a.get("pdbx_PDB_model_num", ["1"] * len(a["id"]))
    first_model = models[0] if models else "1"
    for k in range(len(a["id"])):
        if a["auth_asym_id"][k] != chain or models[k] != first_model or a["label_seq_id"][k] in (".", "?"):
            continue
        row = index.get(int(a["label_seq_id"][k]))
        name = a["label_atom_id"][k]
        if a["label_comp_id"][k] == "MSE" and name == "SE":
            name = "SD"
        if row is None or name not in rc.atom_order or mask[row, rc.atom_order[name]]:
            continue
        j = rc.atom_order[name]
        pos[row, j] = (float(a["Cartn_x"][k]), float(a["Cartn_y"][k]), float(a["Cartn_z"][k]))
        mask[row, j] = 1.0


def parse_mmcif(text: str, source: str = "<mmcif>") -> MmcifFile:
    """The protein chains of an mmCIF file with their SEQRES and atom37 coordinates."""
    t = _tables(text, source)
    if "_atom_site" not in t:
        raise InputError(f"{source}: not an mmCIF coordinate file (no _atom_site table)")
    chains = {}
    for chain, residues in _seqres(t).items():
        if not any(name in rc.restype_3to1 for _, name in residues):
            continue  # DNA/RNA
        seq = "".join(rc.restype_3to1.get(name, "X") for _, name in residues)
        index = {seq_id: row for row, (seq_id, _) in enumerate(residues)}
        pos = np.zeros((len(seq), rc.atom_type_num, 3), dtype=np.float32)
        mask = np.zeros((len(seq), rc.atom_type_num), dtype=np.float32)
        _fill_atoms(t, chain, index, pos, mask)
        chains[chain] = MmcifChain(seq, pos, mask)
    return MmcifFile(chains, _release_date(t))
