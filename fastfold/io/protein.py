"""A predicted protein (atom37 layout) and its PDB and ModelCIF text, with pLDDT in the B-factor column."""

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


_CHEM_COMP_NAMES = {
    "ALA": "ALANINE", "ARG": "ARGININE", "ASN": "ASPARAGINE", "ASP": "ASPARTIC ACID", "CYS": "CYSTEINE",
    "GLN": "GLUTAMINE", "GLU": "GLUTAMIC ACID", "GLY": "GLYCINE", "HIS": "HISTIDINE", "ILE": "ISOLEUCINE",
    "LEU": "LEUCINE", "LYS": "LYSINE", "MET": "METHIONINE", "PHE": "PHENYLALANINE", "PRO": "PROLINE",
    "SER": "SERINE", "THR": "THREONINE", "TRP": "TRYPTOPHAN", "TYR": "TYROSINE", "VAL": "VALINE", "UNK": "UNKNOWN",
}
"""Chemical-component names of the residues a prediction can hold (PDB Chemical Component Dictionary)."""

MODELCIF_DICT = ("mmcif_ma.dic", "1.4.9", "https://raw.githubusercontent.com/ihmwg/ModelCIF/fece26d/dist/mmcif_ma.dic")
"""The ModelCIF dictionary the files conform to (name, version, location), as python-modelcif 1.x writes it."""


def _cif(value: object) -> str:
    """One mmCIF value: bare when it can be, else quoted (a text field when it holds both quote kinds)."""
    text = str(value)
    if text and not any(c.isspace() for c in text) and text[0] not in "_#$'\"[];" and text not in (".", "?") \
            and text.lower().partition("_")[0] not in ("data", "loop", "save", "global", "stop"):
        return text
    if "\n" not in text and "'" not in text:
        return f"'{text}'"
    if "\n" not in text and '"' not in text:
        return f'"{text}"'
    return f"\n;{text}\n;\n"


def _loop(category: str, fields: list[str], rows: list[tuple]) -> list[str]:
    out = ["loop_", *(f"_{category}.{f}" for f in fields)]
    out += [" ".join(v if isinstance(v, str) and v in (".", "?") else _cif(v) for v in row) for row in rows]
    return [*out, "#"]


def _software_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("lowmem-suite")
    except metadata.PackageNotFoundError:
        return "?"


def to_mmcif(prot: Protein, name: str = "model", chain_id: str = "A", plddt: np.ndarray | None = None,
             title: str = "") -> str:
    """ModelCIF text (mmCIF with the ModelCIF categories, read back by python-modelcif): the polymer entity
    and its sequence, the software and protocol that made the model, the atoms (B_iso from `b_factors`), and
    pLDDT per residue (`_ma_qa_metric_local`, with every parent category) and its mean (`_ma_qa_metric_global`).

    `plddt` `[N]`: the per-residue pLDDT (default: the CA B-factors, which hold pLDDT unless the B-factor
    column was given something else, such as 100 - pLDDT). `title`: free text added to the title (e.g. that the
    weights were random)."""
    n = len(prot.aatype)
    resnames = [rc.resnames[int(a)] for a in prot.aatype]
    if plddt is None:
        plddt = prot.b_factors[:, rc.atom_order["CA"]]
    plddt = np.asarray(plddt, dtype=np.float64).reshape(n)
    sequence = "".join(rc.restype_3to1.get(r, "X") for r in resnames)
    dict_name, dict_version, dict_location = MODELCIF_DICT
    full_title = f"{name}: predicted structure (AlphaFold2 monomer)" + (f"; {title}" if title else "")
    out = [f"data_{_cif(name)}", f"_entry.id {_cif(name)}", f"_struct.entry_id {_cif(name)}",
           f"_struct.title {_cif(full_title)}",
           "_struct.pdbx_structure_determination_methodology computational",
           f"_audit_conform.dict_name {dict_name}", f"_audit_conform.dict_version {dict_version}",
           f"_audit_conform.dict_location {dict_location}", "#"]
    out += _loop("software", ["pdbx_ordinal", "name", "classification", "description", "version", "type",
                              "location"],
                 [(1, "lowmem-suite fold", "model building", "AlphaFold2 monomer inference (fastfold)",
                   _software_version(), "program", "?")])
    out += _loop("ma_software_group", ["ordinal_id", "group_id", "software_id"], [(1, 1, 1)])
    comps = sorted(set(resnames))
    out += _loop("chem_comp", ["id", "type", "name", "ma_provenance"],
                 [(r, "peptide linking" if r == "GLY" else "L-peptide linking", _CHEM_COMP_NAMES.get(r, r),
                   "CCD Core") for r in comps])
    out += _loop("entity", ["id", "type", "src_method", "pdbx_description", "pdbx_number_of_molecules"],
                 [(1, "polymer", "man", name, 1)])
    out += _loop("entity_poly", ["entity_id", "type", "nstd_linkage", "nstd_monomer", "pdbx_strand_id",
                                 "pdbx_seq_one_letter_code", "pdbx_seq_one_letter_code_can"],
                 [(1, "polypeptide(L)", "no", "no", chain_id, sequence, sequence)])
    out += _loop("entity_poly_seq", ["entity_id", "num", "mon_id", "hetero"],
                 [(1, i, r, "n") for i, r in enumerate(resnames, start=1)])
    out += _loop("struct_asym", ["id", "entity_id", "details"], [(chain_id, 1, f"{name} chain {chain_id}")])
    out += _loop("pdbx_poly_seq_scheme", ["asym_id", "entity_id", "seq_id", "mon_id", "pdb_seq_num", "auth_seq_num",
                                          "pdb_mon_id", "auth_mon_id", "pdb_strand_id", "pdb_ins_code"],
                 [(chain_id, 1, i, r, int(num), int(num), r, r, chain_id, ".")
                  for i, (r, num) in enumerate(zip(resnames, prot.residue_index), start=1)])
    out += _loop("ma_data", ["id", "name", "content_type"], [(1, f"{name} sequence", "target"),
                                                             (2, "Model", "model coordinates")])
    out += _loop("ma_data_group", ["ordinal_id", "group_id", "data_id"], [(1, 1, 1), (2, 2, 2)])
    out += _loop("ma_target_entity", ["entity_id", "data_id", "origin"], [(1, 1, "designed")])
    out += _loop("ma_target_entity_instance", ["asym_id", "entity_id", "details"],
                 [(chain_id, 1, f"{name} chain {chain_id}")])
    out += _loop("ma_protocol_step", ["ordinal_id", "protocol_id", "step_id", "method_type", "step_name", "details",
                                      "software_group_id", "input_data_group_id", "output_data_group_id"],
                 [(1, 1, 1, "modeling", "prediction", "AlphaFold2 monomer inference", 1, 1, 2)])
    out += _loop("ma_model_list", ["ordinal_id", "model_name", "data_id", "model_type"],
                 [(1, "Model", 2, "Ab initio model")])
    out += _loop("ma_model_group", ["id", "name"], [(1, "All models")])
    out += _loop("ma_model_group_link", ["group_id", "model_id"], [(1, 1)])
    out += ["loop_"] + [f"_atom_site.{f}" for f in (
        "group_PDB", "id", "type_symbol", "label_atom_id", "label_alt_id", "label_comp_id", "label_asym_id",
        "label_entity_id", "label_seq_id", "pdbx_PDB_ins_code", "Cartn_x", "Cartn_y", "Cartn_z", "occupancy",
        "B_iso_or_equiv", "auth_seq_id", "auth_comp_id", "auth_asym_id", "pdbx_PDB_model_num")]
    seq_ids = {int(r): k for k, r in enumerate(prot.residue_index, start=1)}
    elements = set()
    for serial, atom, resname, resnum, xyz, b in _atoms(prot):
        elements.add(_element(atom))
        out.append(
            f"ATOM {serial} {_element(atom)} {atom} . {resname} {chain_id} 1 {seq_ids[resnum]} ? "
            f"{xyz[0]:.3f} {xyz[1]:.3f} {xyz[2]:.3f} 1.00 {b:.2f} {resnum} {resname} {chain_id} 1"
        )
    out.append("#")
    out += _loop("atom_type", ["symbol"], [(e,) for e in sorted(elements)])
    description = "Predicted accuracy according to the CA-only lDDT in [0,100]"
    out += _loop("ma_qa_metric", ["id", "name", "description", "type", "mode", "software_group_id"],
                 [(1, "pLDDT", description, "pLDDT", "global", 1), (2, "pLDDT", description, "pLDDT", "local", 1)])
    out += _loop("ma_qa_metric_global", ["ordinal_id", "model_id", "metric_id", "metric_value"],
                 [(1, 1, 1, f"{plddt.mean():.2f}")])
    out += _loop("ma_qa_metric_local", ["ordinal_id", "model_id", "label_asym_id", "label_seq_id", "label_comp_id",
                                        "metric_id", "metric_value"],
                 [(k, 1, chain_id, k, r, 2, f"{v:.2f}") for k, (r, v) in enumerate(zip(resnames, plddt), start=1)])
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
