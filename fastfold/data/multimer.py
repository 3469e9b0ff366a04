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
from .alignment_files import MAX_HITS, alignment_files, alignment_folder, read_text_file
from .features import FeatureConfig, empty_template_features, make_msa_features, make_sequence_features
from .msa_pairing import MultimerFeatureConfig, pair_and_merge, species_identifier
from .parsers import (
    InputError,
    Msa,
    TemplateHit,
    fasta_records,
    parse_a3m,
    parse_hhr,
    parse_stockholm,
    target_name,
    validate_sequence,
)
from .targets import FASTA_SUFFIXES, AlignmentConfig, Target, target_raw_features

__all__ = [
    "CHAIN_IDS",
    "PAIRING_FILE",
    "Chain",
    "Complex",
    "MultimerFeatureConfig",
    "chain_raw_features",
    "complex_raw_features",
    "masked_msa",
    "msa_profile",
    "multimer_msa_sizes",
    "nearest_neighbor_clusters",
    "process_multimer_features",
    "sample_msa_rows",
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
    records = fasta_records(text, source)
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
                          max_hits=mcfg.max_templates, kalign_binary_path=cfg.kalign_binary_path,
                          obsolete_pdbs_path=cfg.obsolete_pdbs_path)
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
        folder = alignment_folder(cfg.precomputed_dir, chain.name)
        return _chain_folder_features(chain, folder, cfg, mcfg, with_templates, info)
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


# ----------------------------------------------------------------------------------------- the processed batch

MULTIMER_MSA_SIZES = {"v1": (252, 1152), "v2": (252, 1152), "v3": (508, 2048), "v3_4_5": (508, 1152)}
"""(MSA clusters, extra MSA rows) of the released AlphaFold-Multimer models: v1/v2 252 and 1152; v3 508 and 2048,
except models 4 and 5 of v3 with 1152 extra rows (OpenFold's presets)."""


def multimer_msa_sizes(model_name: str) -> tuple[int, int]:
    """(max_msa_clusters, max_extra_msa) for `model_<k>_multimer[_v2|_v3]`."""
    m = re.fullmatch(r"model_([1-5])_multimer(?:_(v2|v3))?", model_name)
    if m is None:
        raise InputError(f"--model_name: {model_name!r} is not model_<1-5>_multimer[_v2|_v3]")
    version = m.group(2) or "v1"
    if version == "v3" and m.group(1) in "45":
        version = "v3_4_5"
    return MULTIMER_MSA_SIZES[version]


def _gumbel(shape: tuple[int, ...], rng: np.random.Generator, eps: float = 1e-6) -> np.ndarray:
    return -np.log(-np.log(rng.random(shape, dtype=np.float32) + eps) + eps)


def msa_profile(msa: np.ndarray, msa_mask: np.ndarray) -> np.ndarray:
    """Masked mean of the one-hot MSA over rows, `[N, 22]` (`msa` `[S, N]`, 21 is a gap).

    The denominator's epsilon is AlphaFold's (1e-10); OpenFold's `masked_mean` adds 1e-4 (relative 1e-4 / rows)."""
    onehot = np.eye(22, dtype=np.float32)[np.minimum(msa, 21)] * msa_mask[..., None]
    return onehot.sum(0) / (msa_mask.sum(0)[:, None] + 1e-10)


def sample_msa_rows(msa_mask: np.ndarray, cluster_bias_mask: np.ndarray, max_seq: int, max_extra: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """AlphaFold-Multimer's MSA sampling: a random order (Gumbel argsort) in which the rows of `cluster_bias_mask`
    (each chain's query, or the paired queries) come first and fully masked rows last; the first `max_seq` rows
    are the cluster centres, the next `max_extra` the extra MSA. Returns both index arrays."""
    big = 1e6
    logits = (np.clip(msa_mask.sum(-1), 0.0, 1.0) - 1.0) * big + cluster_bias_mask * big
    order = np.argsort(-(logits + _gumbel(logits.shape, rng)), kind="stable")
    return order[:max_seq], order[max_seq:][:max_extra]


def masked_msa(msa: np.ndarray, msa_mask: np.ndarray, profile: np.ndarray, replace_fraction: float,
               rng: np.random.Generator, eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """AlphaFold-Multimer's BERT corruption of the sampled rows `[S, N]`: each unmasked position is chosen with
    probability `replace_fraction` and replaced by a draw from 0.1 uniform amino acid + 0.1 profile + 0.1 same +
    0.7 mask token (22). Returns the corrupted MSA and the chosen positions (float)."""
    uniform = np.array([0.05] * 20 + [0.0, 0.0], np.float32)
    probs = 0.1 * uniform + 0.1 * profile[None] + 0.1 * np.eye(22, dtype=np.float32)[np.minimum(msa, 21)]
    probs = np.concatenate([probs, np.full(probs.shape[:-1] + (1,), 0.7, np.float32)], axis=-1)
    chosen = (rng.random(msa.shape) < replace_fraction) * msa_mask
    draw = np.argmax(np.log(probs + eps) + _gumbel(probs.shape, rng), axis=-1)
    corrupted = np.where(chosen > 0, draw, msa) * (msa_mask > 0)
    return corrupted.astype(np.int64), chosen.astype(np.float32)


def nearest_neighbor_clusters(msa: np.ndarray, msa_mask: np.ndarray, deletion: np.ndarray, extra: np.ndarray,
                              extra_mask: np.ndarray, extra_deletion: np.ndarray,
                              gap_agreement_weight: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """AlphaFold-Multimer's soft assignment of extra rows `[E, N]` to cluster centres `[S, N]` (softmax over the
    centres of 1000 x agreement: matching non-gap residues, gaps weighted `gap_agreement_weight`, mask tokens 0).
    Returns `cluster_profile` `[S, N, 23]` and `cluster_deletion_mean` `[S, N]`.

    As AlphaFold-Multimer (and OpenFold) do, each assignment is multiplied by the number of residues unmasked in
    both rows, so an assigned extra row weighs about N times the centre itself in the profile."""
    weights = np.array([1.0] * 21 + [gap_agreement_weight, 0.0], np.float32)
    centres = np.eye(23, dtype=np.float32)[msa] * msa_mask[..., None]
    others = np.eye(23, dtype=np.float32)[extra] * extra_mask[..., None]
    agreement = (centres * weights).reshape(len(msa), -1) @ others.reshape(len(extra), -1).T  # [S, E]
    logits = 1e3 * agreement
    assign = np.exp(logits - logits.max(0, keepdims=True))
    assign = assign / assign.sum(0, keepdims=True)
    assign = assign * (msa_mask @ extra_mask.T)
    count = assign.sum(-1) + 1.0
    profile = (np.einsum("se,enc->snc", assign, others) + centres) / count[:, None, None]
    dels = (assign @ (extra_mask * extra_deletion) + deletion) / count[:, None]
    return profile.astype(np.float32), dels.astype(np.float32)


def _deletion_value(d: np.ndarray) -> np.ndarray:
    return (np.arctan(d / 3.0) * (2.0 / np.pi)).astype(np.float32)


def _multimer_pass(raw: dict[str, np.ndarray], profile: np.ndarray, cfg: FeatureConfig,
                   rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One recycling pass: sample centres and extra rows, corrupt the centres, cluster, build `msa_feat`."""
    sel, extra_idx = sample_msa_rows(raw["msa_mask"], raw["cluster_bias_mask"], cfg.max_msa_clusters,
                                     cfg.max_extra_msa, rng)
    msa, mask, dels = raw["msa"][sel], raw["msa_mask"][sel], raw["deletion_matrix"][sel]
    corrupted, chosen = masked_msa(msa, mask, profile, cfg.masked_msa_replace_fraction, rng)
    extra, extra_mask, extra_dels = raw["msa"][extra_idx], raw["msa_mask"][extra_idx], raw["deletion_matrix"][extra_idx]
    if len(extra) == 0:  # one fully masked row keeps the extra-MSA stack's shapes non-empty
        n = msa.shape[1]
        extra, extra_mask, extra_dels = np.full((1, n), 21), np.zeros((1, n), np.float32), np.zeros((1, n), np.float32)
    cluster_profile, cluster_dels = nearest_neighbor_clusters(corrupted, mask, dels, extra, extra_mask, extra_dels)
    msa_feat = np.concatenate([np.eye(23, dtype=np.float32)[corrupted], np.clip(dels, 0.0, 1.0)[..., None],
                               _deletion_value(dels)[..., None], cluster_profile,
                               _deletion_value(cluster_dels)[..., None]], axis=-1)
    return {
        "msa_feat": msa_feat, "msa_mask": mask.astype(np.float32), "true_msa": msa.astype(np.int64),
        "bert_mask": (raw["bert_mask"][sel] * chosen).astype(np.float32),
        "extra_msa": extra.astype(np.int64), "extra_msa_mask": extra_mask.astype(np.float32),
        "extra_deletion_matrix": extra_dels.astype(np.float32),
        "extra_has_deletion": np.clip(extra_dels, 0.0, 1.0).astype(np.float32),
        "extra_deletion_value": _deletion_value(extra_dels),
    }


def process_multimer_features(raw: dict[str, np.ndarray], config: FeatureConfig,
                              seed: int = 0) -> dict[str, np.ndarray]:
    """The multimer model's batch from `complex_raw_features`, `config.num_recycle + 1` passes on a trailing axis
    R (AlphaFold-Multimer's input processing, suppl. 7.3, as OpenFold's predict mode: every pass samples its own
    MSA). Use `multimer_msa_sizes` for `max_msa_clusters` / `max_extra_msa`.

    Per pass: `msa_feat` `[S, N, 49, R]`, `msa_mask`, `bert_mask` `[S, N, R]`, `true_msa` `[S, N, R]` (int),
    `extra_msa` `[E, N, R]` (int), `extra_msa_mask`, `extra_deletion_matrix`, `extra_has_deletion`,
    `extra_deletion_value` `[E, N, R]`. Fixed: `aatype`, `residue_index`, `asym_id`, `entity_id`, `sym_id`,
    `entity_mask` `[N, R]` (int), `seq_mask` `[N, R]`, `target_feat` `[N, 21, R]` (one-hot aatype),
    `template_*` (T = `config.max_templates`) with `template_mask` `[T, R]`, and the atom14/atom37 index maps.
    Deterministic for a given `seed`."""
    rng = np.random.default_rng(seed)
    aatype = raw["aatype"]
    t = min(config.max_templates, len(raw["template_aatype"]))
    fixed = {k: raw[k] for k in ("aatype", "residue_index", "asym_id", "entity_id", "sym_id", "entity_mask",
                                 "seq_mask")}
    fixed["target_feat"] = np.eye(21, dtype=np.float32)[aatype]
    for k in ("template_aatype", "template_all_atom_positions", "template_all_atom_mask", "template_mask"):
        fixed[k] = raw[k][:t]
    fixed.update(atom14_atom_exists=rc.restype_atom14_mask[aatype],
                 residx_atom14_to_atom37=rc.restype_atom14_to_atom37[aatype],
                 residx_atom37_to_atom14=rc.restype_atom37_to_atom14[aatype],
                 atom37_atom_exists=rc.restype_atom37_mask[aatype])
    profile = msa_profile(raw["msa"], raw["msa_mask"])
    passes = [_multimer_pass(raw, profile, config, rng) for _ in range(config.num_recycle + 1)]
    batch = {k: np.stack([v] * len(passes), axis=-1) for k, v in fixed.items()}
    for key in passes[0]:
        batch[key] = np.stack([p[key] for p in passes], axis=-1)
    return batch
