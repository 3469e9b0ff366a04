"""mmCIF templates through gemmi: the polymer chains (SEQRES and atom37 coordinates) and the release date.

gemmi's CIF reader handles the whole syntax (quoted values, `;` text fields, loops); this module only picks
the tables template features need. Only the first model and the first alternate location of each atom are
read. Where the sequence scheme lists two residues for one position (microheterogeneity: two residue types
modelled at one place), the first is the chain's residue and only its atoms are read, so the SEQRES keeps one
letter per position and matches the template hit's sequence. Modified residues become their parent amino acid
through gemmi's chemical-component table (MSE -> MET, SEP -> SER, TPO -> THR, MLY -> LYS, ...), keeping the
parent's atoms (selenomethionine's SE is MET's SD), as AlphaFold's template featuriser does; a residue gemmi
does not know is unknown (X).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..common import residue_constants as rc
from .parsers import InputError

__all__ = ["MmcifChain", "MmcifFile", "parent_residue", "parse_mmcif"]

_ATOM_RENAMES = {("MSE", "SE"): "SD"}
"""Atoms of a modified residue that take the name of the parent's atom in the same place."""


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


@functools.cache
def parent_residue(name: str) -> str | None:
    """The standard amino acid (three letters) a residue name stands for: itself for the 20, the parent for
    a modified amino acid in gemmi's chemical-component table (Biopython's table when gemmi lacks it),
    None for anything else (nucleotides, ligands, unknown names)."""
    if name in rc.restype_3to1:
        return name
    import gemmi

    info = gemmi.find_tabulated_residue(name)
    letter = ""
    if info is not None and info.is_amino_acid() and info.one_letter_code.strip():
        letter = info.one_letter_code.strip().upper()
    if letter not in rc.restype_1to3:
        try:
            from Bio.Data.PDBData import protein_letters_3to1_extended as table
        except ImportError:  # Biopython is optional
            table = {}
        letter = table.get(name, "")
    return rc.restype_1to3.get(letter)


def _release_date(block) -> str:
    dates = [d for d in block.find_values("_pdbx_audit_revision_history.revision_date") if d not in "?."]
    if dates:
        return min(dates)
    date = block.find_value("_pdbx_database_status.recvd_initial_deposition_date")
    return date if date and date not in "?." else ""


def _column(table, k: int) -> list[str]:
    import gemmi

    return [gemmi.cif.as_string(row[k]) for row in table]


def _seqres(block, source: str) -> dict[str, list[tuple[int, str]]]:
    """author chain -> [(label seq id, residue name)] from the polymer sequence scheme, one residue per seq id
    (the first listed where there are several: microheterogeneity)."""
    table = block.find("_pdbx_poly_seq_scheme.", ["pdb_strand_id", "seq_id", "mon_id"])
    out: dict[str, list[tuple[int, str]]] = {}
    seen: set[tuple[str, int]] = set()
    for strand, seq_id, mon in zip(_column(table, 0), _column(table, 1), _column(table, 2)):
        try:
            key = (strand, int(seq_id))
        except ValueError:
            raise InputError(f"{source}: _pdbx_poly_seq_scheme.seq_id {seq_id!r} is not a number") from None
        if key not in seen:
            seen.add(key)
            out.setdefault(strand, []).append((key[1], mon))
    return out


_ChainWork = tuple[dict[int, int], list[str], np.ndarray, np.ndarray, list[str]]
"""label seq id -> row, parent residue per row, positions, mask, residue name per row (as the scheme has it)."""


def _fill_atoms(block, chains: dict[str, _ChainWork], source: str) -> None:
    fields = ["auth_asym_id", "label_seq_id", "label_atom_id", "label_comp_id", "Cartn_x", "Cartn_y", "Cartn_z",
              "?pdbx_PDB_model_num"]
    table = block.find("_atom_site.", fields)
    first_model = None
    for row in table:
        model = row.str(7) if row.has(7) else "1"
        first_model = first_model or model
        chain = chains.get(row.str(0))
        if chain is None or model != first_model or row[1] in (".", "?"):
            continue
        index, parents, pos, mask, names = chain
        try:
            seq_row = index.get(int(row.str(1)))
        except ValueError:
            raise InputError(f"{source}: _atom_site.label_seq_id {row.str(1)!r} is not a number") from None
        if seq_row is None:
            continue
        comp, name = row.str(3), row.str(2)
        if comp != names[seq_row]:
            continue  # the other residue of a microheterogeneous position
        name = _ATOM_RENAMES.get((comp, name), name)
        parent = parents[seq_row]
        if (name != "OXT" and name not in rc.residue_atoms.get(parent, ())) or mask[seq_row, rc.atom_order[name]]:
            continue
        j = rc.atom_order[name]
        try:
            pos[seq_row, j] = (float(row.str(4)), float(row.str(5)), float(row.str(6)))
        except ValueError:
            raise InputError(f"{source}: atom {name} of residue {row.str(1)}: coordinates are not numbers") from None
        mask[seq_row, j] = 1.0


def parse_mmcif(text: str, source: str = "<mmcif>") -> MmcifFile:
    """The protein chains of an mmCIF file with their SEQRES and atom37 coordinates."""
    import gemmi

    try:
        block = gemmi.cif.read_string(text)[0]
    except (ValueError, RuntimeError, IndexError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{source}: not a readable mmCIF file ({first})") from None
    if not block.find_mmcif_category("_atom_site."):
        raise InputError(f"{source}: not an mmCIF coordinate file (no _atom_site table)")
    chains, work = {}, {}
    for chain, residues in _seqres(block, source).items():
        parents = [parent_residue(name) for _, name in residues]
        if not any(parents):
            continue  # DNA/RNA
        seq = "".join(rc.restype_3to1[p] if p else "X" for p in parents)
        index = {seq_id: row for row, (seq_id, _) in enumerate(residues)}
        pos = np.zeros((len(seq), rc.atom_type_num, 3), dtype=np.float32)
        mask = np.zeros((len(seq), rc.atom_type_num), dtype=np.float32)
        work[chain] = (index, [p or "UNK" for p in parents], pos, mask, [name for _, name in residues])
        chains[chain] = MmcifChain(seq, pos, mask)
    _fill_atoms(block, work, source)
    return MmcifFile(chains, _release_date(block))
