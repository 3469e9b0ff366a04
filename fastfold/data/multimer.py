"""Complexes for AlphaFold-Multimer: FASTA input, assembly ids, per-chain features and the merged raw features.

Two input forms (the ones ColabFold and OpenFold users already have):
- ColabFold's: one record per complex, its chains separated by ':' (`>dimer` / `MKTAYIAK:GSHMLE`). The chains
  are named `<complex>_A`, `<complex>_B`, ... (their alignment folders under `--use_precomputed_alignments`);
  a record without ':' is a one-chain complex whose chain has the record's name.
- OpenFold's: one FASTA file per complex, one record per chain; the complex is named after the file, each
  chain after its record (its alignment folder).
A file of one record is ColabFold's form; a file of several records is OpenFold's, and a ':' in it is an
error. Every error is one `InputError` line naming the file and
the record (exit 2 from `suite`).

Chains with identical sequences are one entity (a homomer part): `entity_id` counts distinct sequences in order
of first appearance, `sym_id` counts the copies of an entity. As AlphaFold-Multimer does, the features order the
chains by entity (all copies of entity 1, then entity 2, ...) and `asym_id` counts chains in that order;
`Complex.feature_order()` gives it, `Chain.chain_id` keeps the input order (A, B, ...) for the outputs.

Per chain folder (`<precomputed>/<chain name>`, OpenFold's multimer layout): the monomer alignments
(`uniref90_hits.sto`, `mgnify_hits.sto`, `bfd_*_hits.a3m`, ...) give the unpaired MSA as for a monomer;
`uniprot_hits.sto` gives the pairing MSA (never the unpaired one); `.hhr` hits give templates. Copies of an
entity reuse the first copy's features, so only the first needs a folder.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import string
from pathlib import Path

import numpy as np

from ..common import residue_constants as rc
from .features import empty_template_features, make_msa_features, make_sequence_features
from .msa_pairing import MultimerFeatureConfig, pair_and_merge, species_identifier
from .parsers import (
    InputError,
    Msa,
    TemplateHit,
    _fasta_records,
    parse_a3m,
    parse_hhr,
    parse_stockholm,
    target_name,
    validate_sequence,
)
from .targets import (
    FASTA_SUFFIXES,
    MAX_HITS,
    AlignmentConfig,
    Target,
    alignment_files,
    read_text_file,
    target_raw_features,
)

__all__ = [
    "CHAIN_IDS",
    "PAIRING_FILE",
    "Chain",
    "Complex",
    "MultimerFeatureConfig",
    "chain_raw_features",
    "complex_raw_features",
    "pairing_msa_features",
    "parse_complex_fasta",
    "read_complexes",
]

logger = logging.getLogger(__name__)

CHAIN_IDS = string.ascii_uppercase + string.ascii_lowercase + string.digits
"""PDB chain IDs given to the chains in input order (at most 62 chains)."""
PAIRING_FILE = "uniprot_hits.sto"
"""A chain folder's UniProt hits: the MSA rows paired across chains by species."""
HMMSEARCH_HITS = ("pdb_hits.sto", "hmm_output.sto")
"""hmmsearch template hits against PDB seqres (AlphaFold-Multimer's and OpenFold's names): not read yet."""
NOT_UNPAIRED = (PAIRING_FILE, *HMMSEARCH_HITS)
"""Alignment-like files of a chain folder that are not part of its unpaired MSA."""
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclasses.dataclass(frozen=True)
class Chain:
    """One chain of a complex."""

    name: str
    """Its alignment folder's name."""
    sequence: str
    chain_id: str
    """PDB chain ID, by input order (A, B, ...)."""
    entity_id: int
    """1, 2, ... by first appearance of its sequence in the complex."""
    sym_id: int
    """1, 2, ... over the copies of its entity."""
    description: str = dataclasses.field(default="", compare=False)


@dataclasses.dataclass(frozen=True)
class Complex:
    """A folding target of several chains (or one)."""

    name: str
    chains: tuple[Chain, ...]
    source: str = dataclasses.field(default="", compare=False)
    """The FASTA file it came from."""

    @property
    def num_entities(self) -> int:
        return max(c.entity_id for c in self.chains)

    @property
    def is_homomer(self) -> bool:
        return len(self.chains) > 1 and self.num_entities == 1

    def feature_order(self) -> list[Chain]:
        """Chains in the order of the features (by entity, then copy); `asym_id` is the position + 1."""
        return sorted(self.chains, key=lambda c: (c.entity_id, c.sym_id))


def _check_name(name: str, where: str) -> None:
    if not name:
        raise InputError(f"{where}: empty header (a target needs a name)")
    if not _NAME.match(name):
        raise InputError(f"{where}: name {name!r} may only hold letters, digits, '_', '.', '-'")


def _assemble(name: str, named_sequences: list[tuple[str, str, str]], source: str) -> Complex:
    """Entity and sym ids for `(chain name, sequence, header)` in input order."""
    if len(named_sequences) > len(CHAIN_IDS):
        raise InputError(f"{source}: complex {name!r} has {len(named_sequences)} chains, at most {len(CHAIN_IDS)}")
    entities: dict[str, int] = {}
    copies: dict[int, int] = {}
    chains = []
    for k, (chain_name, seq, header) in enumerate(named_sequences):
        entity = entities.setdefault(seq, len(entities) + 1)
        copies[entity] = copies.get(entity, 0) + 1
        chains.append(Chain(chain_name, seq, CHAIN_IDS[k], entity, copies[entity], header))
    return Complex(name, tuple(chains), source)


def _split_chains(raw: str, where: str) -> list[str]:
    """The chains of a ColabFold record; `InputError` for an empty chain or a separator other than ':'."""
    if "/" in raw:
        if ":" in raw:
            raise InputError(f"{where}: mixed chain separators ':' and '/' (separate chains with ':' only)")
        raise InputError(f"{where}: '/' is not a chain separator (separate chains with ':', as ColabFold)")
    parts = raw.split(":")
    for i, part in enumerate(parts, start=1):
        if not part.strip():
            raise InputError(f"{where}: chain {i} of {len(parts)} is empty (nothing between ':' separators)")
    return [validate_sequence(p, f"{where}: chain {i}") for i, p in enumerate(parts, start=1)]


def parse_complex_fasta(text: str, source: str = "<fasta>", file_name: str | None = None) -> Complex:
    """The complex of one FASTA file (module docstring). `file_name` names an OpenFold-form complex (default:
    the stem of `source`)."""
    text = text.removeprefix("\ufeff")
    records = _fasta_records(text, source)
    if not records:
        raise InputError(f"{source}: no FASTA records (expected lines starting with '>')")
    located = []
    for k, (desc, raw, lineno) in enumerate(records, start=1):
        name = target_name(desc)
        where = f"{source}: record {k} ({name or 'unnamed'}, line {lineno})"
        _check_name(name, where)
        located.append((name, raw, desc, where))
    if len(located) == 1:
        name, raw, desc, where = located[0]
        seqs = _split_chains(raw, where)
        if len(seqs) == 1:  # a one-chain complex: its folder is the record's, as for a monomer
            return _assemble(name, [(name, seqs[0], desc)], source)
        return _assemble(name, [(f"{name}_{CHAIN_IDS[i]}", s, desc) for i, s in enumerate(seqs)], source)
    named, seen = [], {}
    for k, (name, raw, desc, where) in enumerate(located, start=1):
        if ":" in raw or "/" in raw:
            sep = ":" if ":" in raw else "/"
            raise InputError(f"{where}: chain separator {sep!r} in a file of {len(located)} records (mixed forms: "
                             "one record with chains separated by ':', or one record per chain, not both)")
        if not raw.strip():
            raise InputError(f"{where}: empty chain (no residues)")
        if name in seen:
            raise InputError(f"{where}: duplicate chain name {name!r} (first at record {seen[name]})")
        seen[name] = k
        named.append((name, validate_sequence(raw, where), desc))
    complex_name = file_name if file_name is not None else Path(source).stem
    _check_name(complex_name, f"{source}: the complex's name (from the file name)")
    return _assemble(complex_name, named, source)


def read_complexes(fasta_path: str | Path) -> list[Complex]:
    """The complex of a FASTA file, or one per FASTA file of a folder (OpenFold's `fasta_dir`); complex names
    must be unique across the files."""
    path = Path(fasta_path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FASTA_SUFFIXES)
        if not files:
            raise InputError(f"{path}: folder holds no FASTA file ({', '.join(FASTA_SUFFIXES)})")
    elif path.is_file():
        files = [path]
    else:
        raise InputError(f"{path}: no such FASTA file")
    complexes, first = [], {}
    for f in files:
        try:
            text = f.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError:
            raise InputError(f"{f}: not a text file (not FASTA)") from None
        cplx = parse_complex_fasta(text, str(f))
        if cplx.name in first:
            raise InputError(f"{f}: complex {cplx.name!r} is also in {first[cplx.name]} (names must be unique)")
        first[cplx.name] = f
        complexes.append(cplx)
    return complexes


def pairing_msa_features(sequence: str, msa: Msa | None) -> dict[str, np.ndarray]:
    """`msa_all_seq` `[P, N]` (int64, our residue order), `deletion_matrix_all_seq` `[P, N]` (float32) and
    `msa_species_identifiers_all_seq` (P strings) from a chain's UniProt hits: the query first (no species),
    then the hits with repeated sequences dropped (first kept). `msa` None: the query alone."""
    rows, dels, species, seen = [sequence], [[0] * len(sequence)], [""], {sequence}
    if msa is not None:
        for seq, d, desc in zip(msa.sequences, msa.deletion_matrix, msa.descriptions):
            if seq in seen:
                continue
            seen.add(seq)
            rows.append(seq)
            dels.append(list(d))
            species.append(species_identifier(desc))
    to_ours = np.asarray(rc.MAP_HHBLITS_AATYPE_TO_OUR_AATYPE)
    ids = np.array([[rc.HHBLITS_AA_TO_ID.get(c, 20) for c in r] for r in rows], np.int64).reshape(len(rows), -1)
    return {
        "msa_all_seq": to_ours[ids].astype(np.int64),
        "deletion_matrix_all_seq": np.array(dels, np.float32).reshape(len(rows), -1),
        "msa_species_identifiers_all_seq": np.array(species, dtype=object),
    }


def _read_msa(path: Path, sequence: str) -> Msa:
    base = path.name[:-3] if path.name.endswith(".gz") else path.name
    parse = parse_stockholm if base.endswith(".sto") else parse_a3m
    msa = parse(read_text_file(path), str(path))
    if msa.sequences and len(msa.sequences[0]) != len(sequence):
        raise InputError(f"{path}: alignment has {len(msa.sequences[0])} columns, the chain has {len(sequence)}")
    cap = MAX_HITS.get(base)
    return msa.truncate(cap) if cap is not None else msa


def _chain_folder_features(chain: Chain, folder: Path, cfg: AlignmentConfig, mcfg: MultimerFeatureConfig,
                           with_templates: bool, info: dict) -> dict[str, np.ndarray]:
    """A chain's monomer raw features from its precomputed folder, plus its pairing MSA."""
    if not folder.is_dir():
        raise InputError(f"{folder}: no precomputed alignments for chain {chain.name} (folder missing)")
    msa_files, hit_files, _ = alignment_files(folder)
    unpaired = [p for p in msa_files if p.name.removesuffix(".gz") not in NOT_UNPAIRED]
    pairing = [p for p in msa_files if p.name.removesuffix(".gz") == PAIRING_FILE]
    msas = [] if cfg.single_sequence else [_read_msa(p, chain.sequence) for p in unpaired]
    if not unpaired and not cfg.single_sequence:
        logger.warning("%s: no unpaired alignment for chain %s: its MSA is the query alone", folder, chain.name)
    raw = {**make_sequence_features(chain.sequence), **make_msa_features(chain.sequence, msas)}
    uniprot = None
    if pairing and not cfg.single_sequence:
        uniprot = _read_msa(pairing[0], chain.sequence).truncate(mcfg.max_uniprot_hits)
    raw.update(pairing_msa_features(chain.sequence, uniprot))
    hits: list[TemplateHit] = [h for p in hit_files for h in parse_hhr(read_text_file(p), str(p))]
    hmm = [p.name for p in msa_files if p.name.removesuffix(".gz") in HMMSEARCH_HITS]
    if hmm and with_templates:
        logger.warning("%s: %s not used: templates come from .hhr hits only (hmmsearch hits are not read yet)",
                       folder, ", ".join(hmm))
    raw.update(_templates(chain.sequence, hits, cfg, mcfg, with_templates))
    info.update(alignment_files=[p.name for p in unpaired] if not cfg.single_sequence else [],
                pairing_file=pairing[0].name if uniprot is not None else None, template_hits=len(hits))
    return raw


def _templates(sequence: str, hits: list[TemplateHit], cfg: AlignmentConfig, mcfg: MultimerFeatureConfig,
               with_templates: bool) -> dict[str, np.ndarray]:
    if not (with_templates and hits and cfg.template_mmcif_dir and mcfg.max_templates):
        return empty_template_features(len(sequence))
    from .templates import TemplateConfig, TemplateFeaturizer

    tcfg = TemplateConfig(mmcif_dir=cfg.template_mmcif_dir, max_template_date=cfg.max_template_date,
                          max_hits=mcfg.max_templates, kalign_binary_path=cfg.kalign_binary_path)
    return TemplateFeaturizer(tcfg).get(sequence, hits)


def chain_raw_features(chain: Chain, cfg: AlignmentConfig, work_dir: str | Path,
                       mcfg: MultimerFeatureConfig | None = None, with_templates: bool = True,
                       info: dict | None = None) -> dict[str, np.ndarray]:
    """One chain's raw features: the monomer ones (`aatype`, `residue_index`, `msa`, `deletion_matrix`,
    `template_*`) and its pairing MSA (`*_all_seq`, see `pairing_msa_features`). From `<precomputed>/<name>`
    when `cfg.precomputed_dir` is set; otherwise as a monomer target (single sequence or the searches in
    `work_dir/<name>`), with `work_dir/<name>/msas/uniprot_hits.sto` for pairing when it exists."""
    mcfg = mcfg or MultimerFeatureConfig()
    info = {} if info is None else info
    if cfg.precomputed_dir is not None:
        return _chain_folder_features(chain, Path(cfg.precomputed_dir) / chain.name, cfg, mcfg, with_templates,
                                      info)
    chain_dir = Path(work_dir) / chain.name
    raw = target_raw_features(Target(chain.name, chain.sequence), cfg, chain_dir, with_templates, info)
    uniprot_path = chain_dir / "msas" / PAIRING_FILE
    uniprot = None
    if uniprot_path.is_file() and not cfg.single_sequence:
        uniprot = _read_msa(uniprot_path, chain.sequence).truncate(mcfg.max_uniprot_hits)
    raw.update(pairing_msa_features(chain.sequence, uniprot))
    raw.pop("template_sum_probs", None)
    return raw


def complex_raw_features(cplx: Complex, cfg: AlignmentConfig, work_dir: str | Path,
                         mcfg: MultimerFeatureConfig | None = None, with_templates: bool = True,
                         info: dict | None = None) -> dict[str, np.ndarray]:
    """The complex's raw features (`msa_pairing.pair_and_merge`): per-chain features (computed once per
    entity), assembly ids in feature order, MSA pairing across chains, merged MSAs and templates.

    `info`, when given, gets one entry per chain in feature order: name, chain ID, asym/entity/sym ids, its
    residue range in the features, files read and MSA depth."""
    mcfg = mcfg or MultimerFeatureConfig()
    info = {} if info is None else info
    per_entity: dict[int, tuple[dict, dict]] = {}
    chains, report, start = [], [], 0
    for asym_id, chain in enumerate(cplx.feature_order(), start=1):
        if chain.entity_id not in per_entity:
            chain_info: dict = {}
            raw = chain_raw_features(chain, cfg, work_dir, mcfg, with_templates, chain_info)
            per_entity[chain.entity_id] = (raw, chain_info)
        raw, chain_info = per_entity[chain.entity_id]
        n = len(chain.sequence)
        ids = {k: np.full(n, v, np.int64) for k, v in
               (("asym_id", asym_id), ("entity_id", chain.entity_id), ("sym_id", chain.sym_id))}
        chains.append({**{k: v.copy() for k, v in raw.items()}, **ids})
        report.append({"name": chain.name, "chain_id": chain.chain_id, "asym_id": asym_id,
                       "entity_id": chain.entity_id, "sym_id": chain.sym_id, "residues": [start, start + n],
                       "msa_depth": int(raw["msa"].shape[0]), "pairing_rows": int(raw["msa_all_seq"].shape[0]),
                       **chain_info})
        start += n
    feats = pair_and_merge(chains, mcfg)
    info["chains"] = report
    info["paired_rows"] = int(feats["num_paired_rows"])
    info["msa_rows"] = int(feats["num_alignments"])
    return feats
