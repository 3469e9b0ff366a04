"""Small sequence databases in the real formats of AlphaFold's searches (FASTA, HH-suite ffindex), for the
feature-workflow benchmark (`suite bench fold-workflow`, `suite bench fold`) and its tests (no data, no downloads).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

__all__ = ["build_databases", "cstranslate", "families", "hhsuite_missing", "random_sequences", "repository_hits",
           "write_fasta", "write_hhsuite_db"]

LETTERS = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
HHSUITE_DATA = "/usr/lib/hhsuite/data"


def cstranslate() -> str | None:
    """A `cstranslate` that runs here: on PATH, or one of the CPU variants Debian installs (its dispatch
    script is broken in some releases)."""
    found = shutil.which("cstranslate")
    candidates = ([found] if found else []) + sorted(glob.glob("/usr/libexec/hhsuite/cstranslate-*"))
    for path in candidates:
        try:
            ok = subprocess.run([path, "-h"], capture_output=True, timeout=10).returncode in (0, 1)
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return path
    return None


def hhsuite_missing() -> str:
    """What is missing to build an HH-suite database here ("" when nothing)."""
    missing = [t for t in ("ffindex_build",) if shutil.which(t) is None]
    if cstranslate() is None:
        missing.append("cstranslate")
    for lib in ("cs219.lib", "context_data.lib"):
        if not os.path.exists(os.path.join(HHSUITE_DATA, lib)):
            missing.append(f"{HHSUITE_DATA}/{lib}")
    return ", ".join(missing)


def families(queries: Sequence[tuple[str, str]], per_family: int, rng: np.random.Generator,
             max_rate: float = 0.5) -> list[tuple[str, str]]:
    """`per_family` mutated copies of each (name, sequence), changed at rates spread up to `max_rate`."""
    out = []
    for name, seq in queries:
        for k in range(per_family):
            rate = max_rate * (k + 1) / per_family
            residues = np.array(list(seq))
            flip = rng.random(len(residues)) < rate
            residues[flip] = rng.choice(LETTERS, int(flip.sum()))
            out.append((f"{name}_hom{k}", "".join(residues)))
    return out


def random_sequences(count: int, length: int, rng: np.random.Generator | int, prefix: str = "decoy",
                     start: int = 0) -> list[tuple[str, str]]:
    """`count` random (name, sequence) pairs of `length` residues, named `prefix` + index from `start`."""
    rng = np.random.default_rng(rng) if isinstance(rng, int) else rng
    return [(f"{prefix}{k}", "".join(rng.choice(LETTERS, length))) for k in range(start, start + count)]



def repository_hits(paths: Iterable[str | Path], limit: int | None = None) -> list[tuple[str, str]]:
    """The ungapped rows of alignment files (.sto, .a3m), after the first (the query), as database sequences."""
    from .parsers import parse_a3m, parse_stockholm

    out = []
    for path in paths:
        path = Path(path)
        parse = parse_stockholm if path.suffix == ".sto" else parse_a3m
        msa = parse(path.read_text(), str(path))
        for k, seq in enumerate(msa.sequences[1:], start=1):
            residues = "".join(c for c in seq.upper() if c.isalpha())
            if residues:
                out.append((f"{path.stem}_{k}", residues))
    return out[:limit]


def write_fasta(path: str | Path, records: Iterable[tuple[str, str]]) -> str:
    with open(path, "w") as f:
        for name, seq in records:
            f.write(f">{name}\n{seq}\n")
    return str(path)


def write_hhsuite_db(prefix: str | Path, records: Sequence[tuple[str, str]], cpus: int = 1) -> str:
    """An HH-suite database of one-sequence A3M entries at `prefix` (`_a3m` and `_cs219` ffindex pairs);
    returns the prefix. `RuntimeError` naming what is missing when it cannot be built here."""
    missing = hhsuite_missing()
    if missing:
        raise RuntimeError(f"cannot build an HH-suite database here: missing {missing}")
    prefix = str(prefix)
    with tempfile.TemporaryDirectory() as tmp:
        for name, seq in records:
            Path(tmp, f"{name}.a3m").write_text(f">{name}\n{seq}\n")
        subprocess.run(["ffindex_build", "-s", f"{prefix}_a3m.ffdata", f"{prefix}_a3m.ffindex", tmp],
                       check=True, capture_output=True)
    subprocess.run([cstranslate(), "-A", f"{HHSUITE_DATA}/cs219.lib", "-D", f"{HHSUITE_DATA}/context_data.lib",
                    "-x", "0.3", "-c", "4", "-f", "-i", f"{prefix}_a3m", "-o", f"{prefix}_cs219", "-I", "a3m",
                    "-b"], check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": str(cpus)})
    return prefix


def build_databases(folder: str | Path, queries: Sequence[tuple[str, str]], *, per_family: int = 20,
                    decoy_count: int = 1000, extra: Sequence[tuple[str, str]] = (), seed: int = 0,
                    hhsuite: bool = True) -> dict[str, str]:
    """UniRef90 and MGnify FASTA files, and (with `hhsuite`) BFD, UniRef30 and PDB70 HH-suite databases, in
    `folder`: `AlignmentConfig` field -> path. Each database holds its own draw of the query families among
    `decoy_count` decoys as long as the first query."""
    rng = np.random.default_rng(seed)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    length = len(queries[0][1])

    def records(tag: str, count: int) -> list[tuple[str, str]]:
        fam = [(f"{tag}_{n}", s) for n, s in families(queries, per_family, rng)]
        return fam + [(f"{tag}_{n}", s) for n, s in extra] + random_sequences(count, length, rng, f"{tag}_decoy")

    out = {"uniref90_database_path": write_fasta(folder / "uniref90.fasta", records("ur90", decoy_count)),
           "mgnify_database_path": write_fasta(folder / "mgnify.fasta", records("mgy", decoy_count))}
    if hhsuite:
        out["bfd_database_path"] = write_hhsuite_db(folder / "bfd", records("bfd", decoy_count))
        out["uniref30_database_path"] = write_hhsuite_db(folder / "uniref30", records("ur30", decoy_count // 4))
        out["pdb70_database_path"] = write_hhsuite_db(folder / "pdb70", records("pdb", decoy_count // 4))
    return out
