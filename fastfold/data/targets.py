"""Targets and their inputs: the FASTA targets, where their alignments come from (precomputed folders,
tool runs or single sequence), and the raw features of one target (`target_raw_features`, the job
`suite fold` runs as a Ray task per target)."""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import numpy as np

from .features import empty_template_features, make_msa_features, make_sequence_features
from .parsers import InputError, Msa, TemplateHit, parse_a3m, parse_fasta, parse_hhr, parse_stockholm

__all__ = [
    "AlignmentConfig",
    "Target",
    "read_alignment_dir",
    "read_targets",
    "run_alignment_tools",
    "target_raw_features",
]


@dataclasses.dataclass(frozen=True)
class Target:
    """One folding target from the FASTA file."""

    name: str
    sequence: str


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

def read_targets(fasta_path: str | Path) -> list[Target]:
    """The targets of a FASTA file (validated; `InputError` names the record and position)."""
    path = Path(fasta_path)
    if not path.is_file():
        raise InputError(f"{path}: no such FASTA file")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a text file (not FASTA)") from None
    return [Target(name, seq) for name, seq in parse_fasta(text, str(path))]


_MSA_FILES = ("uniref90_hits.sto", "mgnify_hits.sto", "bfd_uniref_hits.a3m", "bfd_uniclust_hits.a3m",
              "small_bfd_hits.sto", "uniclust30_hits.a3m")
"""OpenFold/AlphaFold per-target alignment file names, in the order their rows enter the MSA."""


def _read_msa(path: Path) -> Msa:
    parse = parse_stockholm if path.suffix == ".sto" else parse_a3m
    return parse(path.read_text(), str(path))


def read_alignment_dir(folder: Path, sequence: str) -> tuple[list[Msa], list[TemplateHit]]:
    """MSAs (`*.sto`, `*.a3m`; known names first) and template hits (`*.hhr`) of one target's folder."""
    if not folder.is_dir():
        raise InputError(f"{folder}: no precomputed alignments for this target (folder missing)")
    files = sorted(p for p in folder.iterdir() if p.suffix in (".sto", ".a3m"))
    files.sort(key=lambda p: _MSA_FILES.index(p.name) if p.name in _MSA_FILES else len(_MSA_FILES))
    msas = []
    for p in files:
        msa = _read_msa(p)
        if msa.sequences and len(msa.sequences[0]) != len(sequence):
            raise InputError(f"{p}: alignment has {len(msa.sequences[0])} columns, the target has {len(sequence)}")
        msas.append(msa)
    hits = [h for p in sorted(folder.glob("*.hhr")) for h in parse_hhr(p.read_text(), str(p))]
    return msas, hits


def run_alignment_tools(target: Target, cfg: AlignmentConfig, folder: Path) -> None:
    """Run the configured searches into `folder`, skipping result files already there (resume)."""
    from . import tools

    folder.mkdir(parents=True, exist_ok=True)
    uniref = folder / "uniref90_hits.sto"
    jobs = [(cfg.uniref90_database_path, uniref), (cfg.mgnify_database_path, folder / "mgnify_hits.sto")]
    for db, out in jobs:
        if db and not out.exists():
            tools.run_jackhmmer(tools.find_binary(cfg.jackhmmer_binary_path, "jackhmmer"), target.sequence, db, out,
                                cfg.cpus)
    bfd_out = folder / "bfd_uniref_hits.a3m"
    if cfg.bfd_database_path and not bfd_out.exists():
        dbs = [d for d in (cfg.bfd_database_path, cfg.uniref30_database_path) if d]
        tools.run_hhblits(tools.find_binary(cfg.hhblits_binary_path, "hhblits"), target.sequence, dbs, bfd_out,
                          cfg.cpus)
    hhr = folder / "pdb70_hits.hhr"
    if cfg.pdb70_database_path and uniref.exists() and not hhr.exists():
        a3m = tools.msa_to_a3m(_read_msa(uniref))
        tools.run_hhsearch(tools.find_binary(cfg.hhsearch_binary_path, "hhsearch"), a3m, cfg.pdb70_database_path, hhr)


def target_raw_features(
    target: Target, cfg: AlignmentConfig, work_dir: str | Path, with_templates: bool = True
) -> dict[str, np.ndarray]:
    """Raw features of one target: sequence, MSA (precomputed, searched or single) and templates."""
    msas: list[Msa] = []
    hits: list[TemplateHit] = []
    if not cfg.single_sequence:
        if cfg.precomputed_dir is not None:
            msas, hits = read_alignment_dir(Path(cfg.precomputed_dir) / target.name, target.sequence)
        elif cfg.runs_tools:
            folder = Path(work_dir) / "msas"
            run_alignment_tools(target, cfg, folder)
            msas, hits = read_alignment_dir(folder, target.sequence)
    raw = {**make_sequence_features(target.sequence), **make_msa_features(target.sequence, msas)}
    if with_templates and hits and cfg.template_mmcif_dir:
        from .templates import TemplateConfig, TemplateFeaturizer

        tcfg = TemplateConfig(mmcif_dir=cfg.template_mmcif_dir, max_template_date=cfg.max_template_date,
                              kalign_binary_path=cfg.kalign_binary_path)
        raw.update(TemplateFeaturizer(tcfg).get(target.sequence, hits))
    else:
        raw.update(empty_template_features(len(target.sequence)))
    return raw
