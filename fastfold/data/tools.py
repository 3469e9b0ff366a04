"""Runners for the alignment tools AlphaFold uses: jackhmmer, hhblits, hhsearch (and kalign).

Each runner takes the binary path and writes one result file atomically (a killed tool never leaves a
half-written alignment that a resumed run would trust). Flags follow AlphaFold's pipeline.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ...utils.fileio import atomic_write
from .parsers import Msa

__all__ = ["ToolError", "find_binary", "msa_to_a3m", "run_hhblits", "run_hhsearch", "run_jackhmmer", "run_kalign"]

logger = logging.getLogger(__name__)


class ToolError(RuntimeError):
    """An alignment tool is missing or failed; the message carries its stderr tail."""


def _extra_bin_dirs() -> list[str]:
    """Where pip-installed tools live when the environment is not on PATH: this interpreter's `bin/`
    and the `hmmer` wheel's own binaries."""
    dirs = [str(Path(sys.executable).parent)]
    spec = importlib.util.find_spec("hmmer")
    if spec is not None and spec.origin:
        dirs.append(str(Path(spec.origin).parent / "data" / "bin"))
    return dirs


def find_binary(path_or_name: str | None, default: str) -> str:
    """The executable to run: the given path, else `default` on PATH, else in this environment's `bin/`
    or the `hmmer` wheel. Raises `ToolError` if absent."""
    candidate = path_or_name or default
    found = shutil.which(candidate)
    if found is None and os.sep not in candidate:
        found = shutil.which(candidate, path=os.pathsep.join(_extra_bin_dirs()))
    if found is None:
        raise ToolError(f"{default}: binary {candidate!r} not found (install it or pass its path)")
    return found


def _run(cmd: Sequence[str], what: str, timeout: float | None = None) -> None:
    logger.info("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        raise ToolError(f"{what}: {exc}") from None
    if proc.returncode != 0:
        raise ToolError(f"{what} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")


def _write_query(directory: str, sequence: str, name: str = "query") -> str:
    path = Path(directory) / f"{name}.fasta"
    path.write_text(f">{name}\n{sequence}\n")
    return str(path)


def _install(tmp_result: Path, output: str | Path) -> None:
    with atomic_write(output) as f:
        f.write(tmp_result.read_text())


def run_jackhmmer(binary: str, sequence: str, database: str, output_sto: str | Path, cpus: int = 2) -> None:
    """jackhmmer (one iteration, AlphaFold's filter thresholds) of `sequence` against `database`."""
    with tempfile.TemporaryDirectory() as tmp:
        query = _write_query(tmp, sequence)
        out = Path(tmp) / "out.sto"
        cmd = [binary, "-o", "/dev/null", "-A", str(out), "--noali", "--F1", "0.0005", "--F2", "0.00005",
               "--F3", "0.0000005", "--incE", "0.0001", "-E", "0.0001", "--cpu", str(cpus), "-N", "1", query, database]
        _run(cmd, f"jackhmmer on {database}")
        if not out.exists():  # jackhmmer writes no alignment when nothing passes the thresholds
            out.write_text(f"# STOCKHOLM 1.0\n\nquery {sequence}\n//\n")
        _install(out, output_sto)


def run_hhblits(binary: str, sequence: str, databases: Sequence[str], output_a3m: str | Path, cpus: int = 2) -> None:
    """hhblits (3 iterations) of `sequence` against `databases` (BFD and UniRef30 prefixes)."""
    with tempfile.TemporaryDirectory() as tmp:
        query = _write_query(tmp, sequence)
        out = Path(tmp) / "out.a3m"
        cmd = [binary, "-i", query, "-cpu", str(cpus), "-oa3m", str(out), "-o", "/dev/null", "-n", "3",
               "-e", "0.001", "-maxseq", "1000000", "-realign_max", "100000", "-maxfilt", "100000",
               "-min_prefilter_hits", "1000"]
        for db in databases:
            cmd += ["-d", db]
        _run(cmd, "hhblits")
        _install(out, output_a3m)


def msa_to_a3m(msa: Msa) -> str:
    """An alignment as A3M text without insertions (the input hhsearch takes)."""
    lines = []
    for k, (desc, seq) in enumerate(zip(msa.descriptions, msa.sequences)):
        lines.append(f">{desc or f'seq{k}'}\n{seq}")
    return "\n".join(lines) + "\n"


def run_hhsearch(binary: str, query_a3m: str, database: str, output_hhr: str | Path) -> None:
    """hhsearch of an A3M alignment against a PDB70-style database."""
    with tempfile.TemporaryDirectory() as tmp:
        query = Path(tmp) / "query.a3m"
        query.write_text(query_a3m)
        out = Path(tmp) / "out.hhr"
        _run([binary, "-i", str(query), "-o", str(out), "-maxseq", "1000000", "-d", database], "hhsearch")
        _install(out, output_hhr)


def run_kalign(binary: str, sequences: Sequence[str]) -> list[str]:
    """Align `sequences` with kalign; returns the aligned rows in input order."""
    with tempfile.TemporaryDirectory() as tmp:
        fasta = Path(tmp) / "in.fasta"
        fasta.write_text("".join(f">s{i}\n{s}\n" for i, s in enumerate(sequences)))
        out = Path(tmp) / "out.fasta"
        _run([binary, "-i", str(fasta), "-o", str(out), "-format", "fasta"], "kalign")
        rows: dict[str, str] = {}
        name = ""
        for line in out.read_text().splitlines():
            if line.startswith(">"):
                name = line[1:].split()[0]
                rows[name] = ""
            else:
                rows[name] += line.strip()
        return [rows[f"s{i}"] for i in range(len(sequences))]
