"""A predicted protein (atom37 layout) and its PDB and mmCIF text, with pLDDT in the B-factor column."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..common import residue_constants as rc

__all__ = ["Protein", "from_pdb", "to_mmcif", "to_pdb"]


@dataclasses.dataclass(frozen=True)
class Protein:
    """One chain. `atom_positions` `[N, 37, 3]` (Angstrom), `atom_mask` `[N, 37]`, `aatype` `[N]` (0..20),
    `residue_index` `[N]` (1-based as written), `b_factors` `[N, 37]` (pLDDT for predictions)."""

    atom_positions: np.ndarray
    atom_mask: np.ndarray
    aatype: np.ndarray
    residue_index: np.ndarray
    b_factors: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.aatype)
        shapes = {"atom_positions": (n, 37, 3), "atom_mask": (n, 37), "residue_index": (n,), "b_factors": (n, 37)}
        for name, shape in shapes.items():
            if tuple(np.shape(getattr(self, name))) != shape:
                raise ValueError(f"Protein.{name} has shape {np.shape(getattr(self, name))}, expected {shape}")

    @property
    def sequence(self) -> str:
        return rc.aatype_to_str_sequence(self.aatype)


def _element(atom_name: str) -> str:
    return atom_name[0]


def _atoms(prot: Protein):
    """(serial, atom name, residue name, residue number, xyz, b-factor) for every present atom."""
    serial = 1
    for i in range(len(prot.aatype)):
        resname = rc.resnames[int(prot.aatype[i])]
        for j, name in enumerate(rc.atom_types):
            if prot.atom_mask[i, j] < 0.5:
                continue
            b = float(prot.b_factors[i, j])
            yield serial, name, resname, int(prot.residue_index[i]), prot.atom_positions[i, j], b
            serial += 1


def to_pdb(prot: Protein, remark: str | None = None, chain_id: str = "A") -> str:
    """PDB text: fixed-column ATOM records (occupancy 1.00, B-factor from `b_factors`), TER and END."""
    lines = []
    if remark:
        lines.append(f"REMARK 250 {remark}"[:80])
    last = None
    for serial, name, resname, resnum, xyz, b in _atoms(prot):
        padded = name if len(name) == 4 else f" {name}"
        lines.append(
            f"ATOM  {serial:>5} {padded:<4} {resname:>3} {chain_id}{resnum:>4}    "
            f"{xyz[0]:>8.3f}{xyz[1]:>8.3f}{xyz[2]:>8.3f}{1.0:>6.2f}{b:>6.2f}          {_element(name):>2}  "
        )
        last = (serial, resname, resnum)
    if last is not None:
        lines.append(f"TER   {last[0] + 1:>5}      {last[1]:>3} {chain_id}{last[2]:>4}")
    lines.append("END")
    return "\n".join(line.ljust(80) if line.startswith("ATOM") else line for line in lines) + "\n"


def to_mmcif(prot: Protein, name: str = "model", chain_id: str = "A") -> str:
    """mmCIF text with the polymer sequence, atoms (B_iso = pLDDT) and per-residue pLDDT (ma_qa_metric)."""
    out = [f"data_{name}", "#", f"_entry.id {name}", "#", "loop_", "_entity_poly_seq.entity_id",
           "_entity_poly_seq.num", "_entity_poly_seq.mon_id", "_entity_poly_seq.hetero"]
    for i, a in enumerate(prot.aatype, start=1):
        out.append(f"1 {i} {rc.resnames[int(a)]} n")
    out += ["#", "loop_"] + [f"_atom_site.{f}" for f in (
        "group_PDB", "id", "type_symbol", "label_atom_id", "label_alt_id", "label_comp_id", "label_asym_id",
        "label_entity_id", "label_seq_id", "pdbx_PDB_ins_code", "Cartn_x", "Cartn_y", "Cartn_z", "occupancy",
        "B_iso_or_equiv", "auth_seq_id", "auth_asym_id", "pdbx_PDB_model_num")]
    seq_ids = {int(r): k for k, r in enumerate(prot.residue_index, start=1)}
    for serial, atom, resname, resnum, xyz, b in _atoms(prot):
        out.append(
            f"ATOM {serial} {_element(atom)} {atom} . {resname} {chain_id} 1 {seq_ids[resnum]} ? "
            f"{xyz[0]:.3f} {xyz[1]:.3f} {xyz[2]:.3f} 1.00 {b:.2f} {resnum} {chain_id} 1"
        )
    out += ["#", "loop_", "_ma_qa_metric_local.ordinal_id", "_ma_qa_metric_local.label_seq_id",
            "_ma_qa_metric_local.label_comp_id", "_ma_qa_metric_local.metric_value"]
    for k, a in enumerate(prot.aatype, start=1):
        ca = prot.b_factors[k - 1, rc.atom_order["CA"]]
        out.append(f"{k} {k} {rc.resnames[int(a)]} {ca:.2f}")
    out.append("#")
    return "\n".join(out) + "\n"


def from_pdb(text: str) -> Protein:
    """Read the first chain of PDB text (heavy atoms of standard residues) back into a `Protein`."""
    residues: dict[tuple[int, str], dict] = {}
    order: list[tuple[int, str]] = []
    for line in text.splitlines():
        if line.startswith("ENDMDL"):
            break
        if not line.startswith(("ATOM", "HETATM")):
            continue
        name, resname = line[12:16].strip(), line[17:20].strip()
        key = (int(line[22:26]), line[26].strip())
        if key not in residues:
            residues[key] = {"resname": resname, "atoms": {}}
            order.append(key)
        residues[key]["atoms"][name] = ([float(line[30:38]), float(line[38:46]), float(line[46:54])],
                                        float(line[60:66] or 0.0))
    n = len(order)
    pos, mask, b = np.zeros((n, 37, 3)), np.zeros((n, 37)), np.zeros((n, 37))
    aatype = np.zeros(n, np.int64)
    for i, key in enumerate(order):
        res = residues[key]
        aatype[i] = rc.resname_to_idx.get(res["resname"], rc.unk_restype_index)
        for name, (xyz, bf) in res["atoms"].items():
            if name in rc.atom_order:
                pos[i, rc.atom_order[name]], mask[i, rc.atom_order[name]], b[i, rc.atom_order[name]] = xyz, 1.0, bf
    return Protein(pos, mask, aatype, np.array([k[0] for k in order]), b)
