"""One `suite fold` run of a short peptide in a fresh folder, for module fixtures that read its outputs."""

from __future__ import annotations

from pathlib import Path

from lowmem.suite.cli import main


def fold_peptide(folder: Path, sequence: str, *flags: str) -> tuple[Path, Path]:
    """`suite fold` of `>pep <sequence>` (single sequence, in this process, the flags added) into `folder/out`;
    asserts it exits 0 and returns (output folder, FASTA)."""
    fasta = folder / "in.fasta"
    fasta.write_text(f">pep\n{sequence}\n")
    out = folder / "out"
    assert main(["fold", str(fasta), "--output_dir", str(out), "--single_sequence", "--num_workers", "0",
                 *flags]) == 0
    return out, fasta
