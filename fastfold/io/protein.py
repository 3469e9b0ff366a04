"""A predicted protein (atom37 layout) and its PDB and ModelCIF text, with pLDDT in the B-factor column."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..common import residue_constants as rc

__all__ = ["Protein", "from_pdb", "to_mmcif", "to_pdb"]


@dataclasses.dataclass(frozen=True)
class Protein:
    """One chain, or several. `atom_positions` `[N, 37, 3]` (Angstrom), `atom_mask` `[N, 37]`, `aatype` `[N]`
    (0..20), `residue_index` `[N]` (1-based as written, per chain), `b_factors` `[N, 37]` (pLDDT for predictions).

    Several chains (a complex): `chain_index` `[N]` (0, 1, ... in the order the chains are written, each chain's
    residues contiguous) and `chain_ids` (the PDB chain ID of each index, e.g. ("A", "B")). None: one chain, whose
    ID the writers take as an argument ("A")."""

    atom_positions: np.ndarray
    atom_mask: np.ndarray
    aatype: np.ndarray
    residue_index: np.ndarray
    b_factors: np.ndarray
    chain_index: np.ndarray | None = None
    chain_ids: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.aatype)
        shapes = {"atom_positions": (n, 37, 3), "atom_mask": (n, 37), "residue_index": (n,), "b_factors": (n, 37)}
        if self.chain_index is not None:
            shapes["chain_index"] = (n,)
        for name, shape in shapes.items():
            if tuple(np.shape(getattr(self, name))) != shape:
                raise ValueError(f"Protein.{name} has shape {np.shape(getattr(self, name))}, expected {shape}")
        if self.chain_index is not None:
            index = np.asarray(self.chain_index)
            ids = self.chain_ids or ()
            if n and (index.min() < 0 or index.max() >= len(ids)):
                raise ValueError(f"Protein.chain_index holds {index.min()}..{index.max()}, chain_ids has {len(ids)}")
            if n and np.any(np.diff(index) < 0):
                raise ValueError("Protein.chain_index must not decrease (each chain's residues contiguous)")
            if len(set(ids)) != len(ids) or not all(len(c) == 1 for c in ids):
                raise ValueError(f"Protein.chain_ids must be distinct one-character IDs, got {ids!r}")

    def chain_of(self, default: str = "A") -> list[str]:
        """The chain ID of every residue."""
        if self.chain_index is None:
            return [default] * len(self.aatype)
        return [self.chain_ids[int(i)] for i in self.chain_index]

    def peptide_numbers(self) -> np.ndarray:
        """Residue numbers made unique across chains (chain k's numbers shifted past chain k-1's by at least 2),
        so a test for a peptide bond, consecutive numbers, never links the last residue of one chain to the first
        of the next (a chain break is not a broken bond)."""
        numbers = np.asarray(self.residue_index, dtype=np.int64)
        if self.chain_index is None or len(numbers) == 0:
            return numbers
        span = int(numbers.max() - numbers.min()) + 2
        return numbers + np.asarray(self.chain_index, dtype=np.int64) * span

    @property
    def sequence(self) -> str:
        return rc.aatype_to_str_sequence(self.aatype)


def _element(atom_name: str) -> str:
    return atom_name[0]


def _atoms(prot: Protein, chain_id: str = "A"):
    """(serial, atom name, residue name, residue number, xyz, b-factor, chain ID, residue position) for every
    present atom; serials leave one number free after each chain (its TER record)."""
    serial = 1
    chains = prot.chain_of(chain_id)
    for i in range(len(prot.aatype)):
        if i > 0 and chains[i] != chains[i - 1]:
            serial += 1  # the previous chain's TER
        resname = rc.resnames[int(prot.aatype[i])]
        for j, name in enumerate(rc.atom_types):
            if prot.atom_mask[i, j] < 0.5:
                continue
            b = float(prot.b_factors[i, j])
            yield serial, name, resname, int(prot.residue_index[i]), prot.atom_positions[i, j], b, chains[i], i
            serial += 1


def to_pdb(prot: Protein, remark: str | None = None, chain_id: str = "A") -> str:
    """PDB text: fixed-column ATOM records (occupancy 1.00, B-factor from `b_factors`), a TER after each chain
    (the chain IDs of `prot.chain_ids`, else `chain_id`) and END."""
    lines = []
    if remark:
        lines.append(f"REMARK 250 {remark}"[:80])
    last = None
    for serial, name, resname, resnum, xyz, b, chain, _ in _atoms(prot, chain_id):
        if last is not None and chain != last[3]:
            lines.append(f"TER   {last[0] + 1:>5}      {last[1]:>3} {last[3]}{last[2]:>4}")
        padded = name if len(name) == 4 else f" {name}"
        lines.append(
            f"ATOM  {serial:>5} {padded:<4} {resname:>3} {chain}{resnum:>4}    "
            f"{xyz[0]:>8.3f}{xyz[1]:>8.3f}{xyz[2]:>8.3f}{1.0:>6.2f}{b:>6.2f}          {_element(name):>2}  "
        )
        last = (serial, resname, resnum, chain)
    if last is not None:
        lines.append(f"TER   {last[0] + 1:>5}      {last[1]:>3} {last[3]}{last[2]:>4}")
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
             title: str = "", scores: dict[str, float] | None = None, method: str = "AlphaFold2 monomer") -> str:
    """ModelCIF text (mmCIF with the ModelCIF categories, read back by python-modelcif): the polymer entities
    and their sequences, the software and protocol that made the model, the atoms (B_iso from `b_factors`), and
    pLDDT per residue (`_ma_qa_metric_local`, with every parent category) and its mean (`_ma_qa_metric_global`).

    Several chains (`prot.chain_index`): one `_struct_asym` per chain, one entity per distinct sequence (its
    chains in `pdbx_strand_id`), residues numbered from 1 in each chain (`label_seq_id`).

    `plddt` `[N]`: the per-residue pLDDT (default: the CA B-factors, which hold pLDDT unless the B-factor
    column was given something else, such as 100 - pLDDT). `title`: free text added to the title (e.g. that the
    weights were random). `scores`: further global QA metrics, "pTM" and "ipTM" (ModelCIF types of those names).
    `method`: what made the model, in the title, software and protocol ("AlphaFold2 monomer" or
    "AlphaFold-Multimer")."""
    n = len(prot.aatype)
    resnames = [rc.resnames[int(a)] for a in prot.aatype]
    if plddt is None:
        plddt = prot.b_factors[:, rc.atom_order["CA"]]
    plddt = np.asarray(plddt, dtype=np.float64).reshape(n)
    chains = _Chains.of(prot, chain_id, resnames)
    out = _cif_header(name, method, title)
    out += _polymer_loops(prot, name, resnames, chains)
    out += _modeling_loops(name, method, chains)
    out += _atom_site(prot, chain_id, chains)
    out += _qa_loops(plddt, scores, resnames, chains)
    return "\n".join(out) + "\n"


@dataclasses.dataclass(frozen=True)
class _Chains:
    """The chains of a `Protein` as mmCIF names them: `ids` the chain ID of every residue, `order` the IDs in
    the order written, `residues` each chain's residue indices, `seq_id` `[N]` each residue's number in its
    chain (from 1), `entity_of` each chain's entity (one per distinct sequence, by first appearance),
    `strands` each entity's chains, `sequences` each chain's one-letter sequence."""

    ids: list[str]
    order: list[str]
    residues: dict[str, list[int]]
    seq_id: np.ndarray
    sequences: dict[str, str]
    entity_of: dict[str, int]
    strands: dict[int, list[str]]

    @classmethod
    def of(cls, prot: Protein, chain_id: str, resnames: list[str]) -> _Chains:
        n = len(prot.aatype)
        ids = prot.chain_of(chain_id)
        order = list(dict.fromkeys(ids))
        residues = {c: [i for i in range(n) if ids[i] == c] for c in order}
        seq_id = np.zeros(n, np.int64)
        for c in order:
            seq_id[residues[c]] = np.arange(1, len(residues[c]) + 1)
        sequences = {c: "".join(rc.restype_3to1.get(resnames[i], "X") for i in residues[c]) for c in order}
        entities: dict[str, int] = {}  # sequence -> entity id, by first appearance
        entity_of = {c: entities.setdefault(sequences[c], len(entities) + 1) for c in order}
        strands = {e: [c for c in order if entity_of[c] == e] for e in entities.values()}
        return cls(ids, order, residues, seq_id, sequences, entity_of, strands)

    def first(self, entity: int) -> str:
        """The entity's first chain (whose residues stand for the entity's sequence)."""
        return self.strands[entity][0]


def _cif_header(name: str, method: str, title: str) -> list[str]:
    """The data block's entry, title, dictionary and software."""
    dict_name, dict_version, dict_location = MODELCIF_DICT
    full_title = f"{name}: predicted structure ({method})" + (f"; {title}" if title else "")
    out = [f"data_{_cif(name)}", f"_entry.id {_cif(name)}", f"_struct.entry_id {_cif(name)}",
           f"_struct.title {_cif(full_title)}",
           "_struct.pdbx_structure_determination_methodology computational",
           f"_audit_conform.dict_name {dict_name}", f"_audit_conform.dict_version {dict_version}",
           f"_audit_conform.dict_location {dict_location}", "#"]
    out += _loop("software", ["pdbx_ordinal", "name", "classification", "description", "version", "type",
                              "location"],
                 [(1, "lowmem-suite fold", "model building", f"{method} inference (fastfold)",
                   _software_version(), "program", "?")])
    return out + _loop("ma_software_group", ["ordinal_id", "group_id", "software_id"], [(1, 1, 1)])


def _polymer_loops(prot: Protein, name: str, resnames: list[str], ch: _Chains) -> list[str]:
    """The residue types, the polymer entities with their sequences, the chains and their residue numbering."""
    strands, several = ch.strands, len(ch.order) > 1
    out = _loop("chem_comp", ["id", "type", "name", "ma_provenance"],
                [(r, "peptide linking" if r == "GLY" else "L-peptide linking", _CHEM_COMP_NAMES.get(r, r),
                  "CCD Core") for r in sorted(set(resnames))])

    def entity_name(e: int) -> str:
        return f"{name} chain{'s' if len(strands[e]) > 1 else ''} {','.join(strands[e])}" if several else name

    out += _loop("entity", ["id", "type", "src_method", "pdbx_description", "pdbx_number_of_molecules"],
                 [(e, "polymer", "man", entity_name(e), len(strands[e])) for e in strands])
    out += _loop("entity_poly", ["entity_id", "type", "nstd_linkage", "nstd_monomer", "pdbx_strand_id",
                                 "pdbx_seq_one_letter_code", "pdbx_seq_one_letter_code_can"],
                 [(e, "polypeptide(L)", "no", "no", ",".join(strands[e]), ch.sequences[ch.first(e)],
                   ch.sequences[ch.first(e)]) for e in strands])
    out += _loop("entity_poly_seq", ["entity_id", "num", "mon_id", "hetero"],
                 [(e, k, resnames[i], "n") for e in strands for k, i in enumerate(ch.residues[ch.first(e)], start=1)])
    out += _loop("struct_asym", ["id", "entity_id", "details"],
                 [(c, ch.entity_of[c], f"{name} chain {c}") for c in ch.order])
    return out + _loop("pdbx_poly_seq_scheme", ["asym_id", "entity_id", "seq_id", "mon_id", "pdb_seq_num",
                                                "auth_seq_num", "pdb_mon_id", "auth_mon_id", "pdb_strand_id",
                                                "pdb_ins_code"],
                       [(c, ch.entity_of[c], int(ch.seq_id[i]), resnames[i], int(prot.residue_index[i]),
                         int(prot.residue_index[i]), resnames[i], resnames[i], c, ".")
                        for c in ch.order for i in ch.residues[c]])


def _modeling_loops(name: str, method: str, ch: _Chains) -> list[str]:
    """ModelCIF's account of the modelling: the target sequences and the model as data, the protocol, the model."""
    strands = ch.strands
    targets = [(e, f"{name} sequence" + (f" {e}" if len(strands) > 1 else ""), "target") for e in strands]
    model_data = len(targets) + 1
    out = _loop("ma_data", ["id", "name", "content_type"], [*targets, (model_data, "Model", "model coordinates")])
    out += _loop("ma_data_group", ["ordinal_id", "group_id", "data_id"],
                 [*((e, 1, e) for e in strands), (model_data, 2, model_data)])
    out += _loop("ma_target_entity", ["entity_id", "data_id", "origin"], [(e, e, "designed") for e in strands])
    out += _loop("ma_target_entity_instance", ["asym_id", "entity_id", "details"],
                 [(c, ch.entity_of[c], f"{name} chain {c}") for c in ch.order])
    out += _loop("ma_protocol_step", ["ordinal_id", "protocol_id", "step_id", "method_type", "step_name", "details",
                                      "software_group_id", "input_data_group_id", "output_data_group_id"],
                 [(1, 1, 1, "modeling", "prediction", f"{method} inference", 1, 1, 2)])
    out += _loop("ma_model_list", ["ordinal_id", "model_name", "data_id", "model_type"],
                 [(1, "Model", model_data, "Ab initio model")])
    out += _loop("ma_model_group", ["id", "name"], [(1, "All models")])
    return out + _loop("ma_model_group_link", ["group_id", "model_id"], [(1, 1)])


def _atom_site(prot: Protein, chain_id: str, ch: _Chains) -> list[str]:
    """The atoms (B_iso from the B-factors) and their elements."""
    out = ["loop_"] + [f"_atom_site.{f}" for f in (
        "group_PDB", "id", "type_symbol", "label_atom_id", "label_alt_id", "label_comp_id", "label_asym_id",
        "label_entity_id", "label_seq_id", "pdbx_PDB_ins_code", "Cartn_x", "Cartn_y", "Cartn_z", "occupancy",
        "B_iso_or_equiv", "auth_seq_id", "auth_comp_id", "auth_asym_id", "pdbx_PDB_model_num")]
    elements = set()
    for serial, (_, atom, resname, resnum, xyz, b, chain, i) in enumerate(_atoms(prot, chain_id), start=1):
        elements.add(_element(atom))
        out.append(
            f"ATOM {serial} {_element(atom)} {atom} . {resname} {chain} {ch.entity_of[chain]} {ch.seq_id[i]} ? "
            f"{xyz[0]:.3f} {xyz[1]:.3f} {xyz[2]:.3f} 1.00 {b:.2f} {resnum} {resname} {chain} 1"
        )
    out.append("#")
    return out + _loop("atom_type", ["symbol"], [(e,) for e in sorted(elements)])


def _qa_loops(plddt: np.ndarray, scores: dict[str, float] | None, resnames: list[str], ch: _Chains) -> list[str]:
    """pLDDT `[N]` per residue and its mean, and the further global scores (pTM, ipTM)."""
    description = "Predicted accuracy according to the CA-only lDDT in [0,100]"
    metrics = [(1, "pLDDT", description, "pLDDT", "global", 1), (2, "pLDDT", description, "pLDDT", "local", 1)]
    values = [(1, f"{plddt.mean():.2f}")]
    about = {"pTM": "Predicted accuracy according to the TM-score score in [0,1]",
             "ipTM": "Predicted protein-protein interface score based on TM-score in [0,1]"}
    for key, value in (scores or {}).items():
        if key not in about:
            raise ValueError(f"to_mmcif: unknown score {key!r}; expected one of {', '.join(about)}")
        metrics.append((len(metrics) + 1, key, about[key], key, "global", 1))
        values.append((len(metrics), f"{float(value):.4f}"))
    out = _loop("ma_qa_metric", ["id", "name", "description", "type", "mode", "software_group_id"], metrics)
    out += _loop("ma_qa_metric_global", ["ordinal_id", "model_id", "metric_id", "metric_value"],
                 [(k, 1, m, v) for k, (m, v) in enumerate(values, start=1)])
    return out + _loop("ma_qa_metric_local", ["ordinal_id", "model_id", "label_asym_id", "label_seq_id",
                                              "label_comp_id", "metric_id", "metric_value"],
                       [(k, 1, ch.ids[i], int(ch.seq_id[i]), resnames[i], 2, f"{plddt[i]:.2f}")
                        for k, i in enumerate(range(len(plddt)), start=1)])


def from_pdb(text: str) -> Protein:
    """Read PDB text (heavy atoms of standard residues, first model) back into a `Protein`; several chains give
    `chain_index` and `chain_ids` in the order they appear."""
    residues: dict[tuple[str, int, str], dict] = {}
    order: list[tuple[str, int, str]] = []
    for line in text.splitlines():
        if line.startswith("ENDMDL"):
            break
        if not line.startswith(("ATOM", "HETATM")):
            continue
        name, resname = line[12:16].strip(), line[17:20].strip()
        key = (line[21], int(line[22:26]), line[26].strip())
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
    ids = tuple(dict.fromkeys(k[0] for k in order))
    numbers = np.array([k[1] for k in order], np.int64)
    if len(ids) < 2:
        return Protein(pos, mask, aatype, numbers, b)
    index = np.array([ids.index(k[0]) for k in order], np.int64)
    return Protein(pos, mask, aatype, numbers, b, chain_index=index, chain_ids=ids)
