"""Targets and their inputs: the FASTA targets, where their alignments come from (precomputed folders,
tool runs or single sequence), and the raw features of one target (`target_raw_features`, the job
`suite fold` runs as a Ray task per target)."""

from __future__ import annotations

import dataclasses
import datetime
import logging
from pathlib import Path

import numpy as np

from .alignment_files import (
    MAX_HITS,
    UNIPROT_HITS,
    alignment_files,
    alignment_folder,
    base_name,
    read_msa,
    read_text_file,
)
from .features import empty_template_features, make_msa_features, make_sequence_features
from .parsers import InputError, Msa, TemplateHit, parse_fasta_records, parse_hhr

__all__ = [
    "AlignmentConfig",
    "Target",
    "read_alignment_dir",
    "read_targets",
    "run_alignment_tools",
    "target_raw_features",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Target:
    """One folding target from the FASTA file."""

    name: str
    sequence: str
    description: str = dataclasses.field(default="", compare=False)
    """The FASTA header (without '>'), kept for the outputs."""


@dataclasses.dataclass(kw_only=True)
class AlignmentConfig:
    """Where a target's MSAs and templates come from."""

    precomputed_dir: str | None = None
    """Folder with one sub-folder per target (`uniref90_hits.sto`, `bfd_uniref_hits.a3m`, `pdb70_hits.hhr`...)."""
    single_sequence: bool = False
    """No alignments at all: the MSA is the query alone."""
    uniref90_database_path: str | None = None
    """jackhmmer database (UniRef90 FASTA)."""
    mgnify_database_path: str | None = None
    """jackhmmer database (MGnify FASTA)."""
    bfd_database_path: str | None = None
    """hhblits database prefix (BFD)."""
    uniref30_database_path: str | None = None
    """hhblits database prefix (UniRef30, searched with BFD)."""
    pdb70_database_path: str | None = None
    """hhsearch database prefix (PDB70) for template hits."""
    uniprot_database_path: str | None = None
    """jackhmmer database (UniProt FASTA) of the pairing MSA of a complex's chains (`uniprot_hits.sto`, read by
    `fastfold.data.multimer` only; never part of a chain's unpaired MSA)."""
    jackhmmer_binary_path: str = "jackhmmer"
    """jackhmmer executable."""
    hhblits_binary_path: str = "hhblits"
    """hhblits executable."""
    hhsearch_binary_path: str = "hhsearch"
    """hhsearch executable."""
    kalign_binary_path: str = "kalign"
    """kalign executable: realigns template hits whose residues differ from the chain's SEQRES."""
    template_mmcif_dir: str | None = None
    """Folder of PDB mmCIF files for templates; None: no templates."""
    max_template_date: str = dataclasses.field(default_factory=lambda: datetime.date.today().isoformat())
    """Latest template release date, YYYY-MM-DD."""
    cpus: int = 2
    """Threads per alignment tool."""
    obsolete_pdbs_path: str | None = None
    """The PDB's `obsolete.dat`: template hits on obsolete entries use their successor (`templates.TemplateConfig`)."""

    def __post_init__(self) -> None:
        try:
            datetime.date.fromisoformat(self.max_template_date)
        except ValueError:
            msg = f"AlignmentConfig.max_template_date is not YYYY-MM-DD: {self.max_template_date!r}"
            raise ValueError(msg) from None
        if self.cpus < 1:
            raise ValueError(f"AlignmentConfig.cpus must be >= 1, got {self.cpus}")

    @property
    def runs_tools(self) -> bool:
        dbs = (self.uniref90_database_path, self.mgnify_database_path, self.bfd_database_path)
        return not self.single_sequence and self.precomputed_dir is None and any(dbs)

FASTA_SUFFIXES = (".fasta", ".fa", ".faa", ".fas", ".fsa")
"""Files read from a folder of FASTA files (OpenFold's first argument)."""


def read_targets(fasta_path: str | Path) -> list[Target]:
    """The targets of a FASTA file, or of every FASTA file in a folder (OpenFold's `fasta_dir`), validated:
    `InputError` names the file, record and position; names must be unique across the files."""
    path = Path(fasta_path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FASTA_SUFFIXES)
        if not files:
            raise InputError(f"{path}: folder holds no FASTA file ({', '.join(FASTA_SUFFIXES)})")
    elif path.is_file():
        files = [path]
    else:
        raise InputError(f"{path}: no such FASTA file")
    targets: list[Target] = []
    first: dict[str, Path] = {}
    for f in files:
        try:
            text = f.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError:
            raise InputError(f"{f}: not a text file (not FASTA)") from None
        for name, seq, header in parse_fasta_records(text, str(f)):
            if name in first:
                raise InputError(f"{f}: target {name!r} is also in {first[name]} (names must be unique)")
            first[name] = f
            targets.append(Target(name, seq, header))
    return targets


def read_alignment_dir(
    folder: Path, sequence: str, info: dict | None = None, require_msa: bool = False, skip: tuple[str, ...] = ()
) -> tuple[list[Msa], list[TemplateHit]]:
    """MSAs (`*.sto`, `*.a3m`, also gzipped; known names first, AlphaFold's row caps applied) and template
    hits (`*.hhr`) of one target's folder. `info`, when given, gets what was read (files, rows per file
    before/after the cap, ignored files). `require_msa`: an `InputError` when the folder holds no
    alignment file (empty, or only files the reader does not know). `skip`: file names not read as MSAs."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: no precomputed alignments for this target (folder missing)")
    msa_files, hit_files, ignored = alignment_files(folder)
    msa_files = [p for p in msa_files if p.name not in skip]
    if ignored:
        names = ", ".join(p.name for p in ignored)
        logger.warning("%s: ignoring %s (not .sto/.a3m/.hhr, optionally .gz)", folder, names)
    if not msa_files:
        what = f"only {', '.join(p.name for p in ignored)}" if ignored else "nothing"
        if require_msa:
            raise InputError(f"{folder}: no alignment file (.sto/.a3m) for this target, it holds {what}; "
                             "add --single_sequence to fold it from the sequence alone")
        logger.warning("%s: NO ALIGNMENT FILE (holds %s): this target's MSA is the query alone", folder, what)
    msas, read = [], []
    for p in msa_files:
        msa = read_msa(p)
        if msa.sequences and len(msa.sequences[0]) != len(sequence):
            raise InputError(f"{p}: alignment has {len(msa.sequences[0])} columns, the target has {len(sequence)}")
        cap = MAX_HITS.get(base_name(p))
        kept = msa.truncate(cap) if cap is not None and len(msa) > cap else msa
        msas.append(kept)
        read.append({"file": p.name, "rows": len(msa), "rows_used": len(kept), **({"cap": cap} if cap else {})})
    hits = [h for p in hit_files for h in parse_hhr(read_text_file(p), str(p))]
    if info is not None:
        info.update(alignment_dir=str(folder), alignment_files=read, ignored_files=[p.name for p in ignored],
                    template_hit_files=[p.name for p in hit_files], template_hits=len(hits))
    return msas, hits


def run_alignment_tools(target: Target, cfg: AlignmentConfig, folder: Path) -> None:
    """Run the configured searches into `folder` one after another (`searches.search_jobs`: the same jobs the
    feature workflow runs in parallel), skipping result files already there (resume)."""
    from .searches import search_jobs

    folder.mkdir(parents=True, exist_ok=True)
    for job in search_jobs(target.sequence, cfg, folder):
        job.run(cfg.cpus)


def target_raw_features(
    target: Target, cfg: AlignmentConfig, work_dir: str | Path, with_templates: bool = True,
    info: dict | None = None,
) -> dict[str, np.ndarray]:
    """Raw features of one target: sequence, MSA (precomputed, searched or single) and templates.

    `info`, when given, gets what the features were made of: the MSA mode, the alignment files read with
    their rows, the MSA depth before and after removing duplicates, and every template hit considered
    (used: PDB id, chain, aligned columns, release date; else why not). With `cfg.single_sequence` and a
    `cfg.precomputed_dir`, the MSA is the query alone and the folder's `.hhr` hits still give templates."""
    info = {} if info is None else info
    msas: list[Msa] = []
    hits: list[TemplateHit] = []
    if cfg.precomputed_dir is not None:
        info["msa_mode"] = "single_sequence (templates from the alignment folder)" if cfg.single_sequence \
            else "precomputed"
        msas, hits = read_alignment_dir(alignment_folder(cfg.precomputed_dir, target.name), target.sequence, info,
                                        require_msa=not cfg.single_sequence)
        if cfg.single_sequence:
            msas = []
    elif cfg.single_sequence:
        info["msa_mode"] = "single_sequence"
    elif cfg.runs_tools:
        info["msa_mode"] = "search"
        folder = Path(work_dir) / "msas"
        run_alignment_tools(target, cfg, folder)
        msas, hits = read_alignment_dir(folder, target.sequence, info, skip=(UNIPROT_HITS,))
    else:
        info["msa_mode"] = "single_sequence (no alignments given)"
    raw = {**make_sequence_features(target.sequence), **make_msa_features(target.sequence, msas)}
    info["msa_depth"] = {"query": 1, **{f["file"]: f["rows_used"] for f in info.get("alignment_files", [])}}
    info["msa_depth_total"] = 1 + sum(len(m) for m in msas)
    info["msa_depth_dedup"] = int(raw["msa"].shape[0])
    info["templates"] = []
    if with_templates and hits and cfg.template_mmcif_dir:
        from .templates import TemplateConfig, TemplateFeaturizer

        tcfg = TemplateConfig(mmcif_dir=cfg.template_mmcif_dir, max_template_date=cfg.max_template_date,
                              kalign_binary_path=cfg.kalign_binary_path, obsolete_pdbs_path=cfg.obsolete_pdbs_path)
        featurizer = TemplateFeaturizer(tcfg)
        raw.update(featurizer.get(target.sequence, hits))
        info["templates"] = [r for r in featurizer.report if r["used"]]
        info["templates_skipped"] = [r for r in featurizer.report if not r["used"]]
    else:
        raw.update(empty_template_features(len(target.sequence)))
        if hits:
            info["templates_note"] = ("models without templates" if not with_templates
                                      else "no template_mmcif_dir given: hits not used")
    return raw
