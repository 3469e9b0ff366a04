"""Every input of a fold run checked before the first model call (issue 34): a bad one is one `InputError` line
naming the file (and line) and what is wrong, which `suite fold` turns into exit code 2 before any work.

- `check_output_dir`: the output folder is created (its parents too) and probed by writing a file in it; a file
  where the folder (or a target's folder) should be, or a folder this user cannot write, is refused.
- `check_alignments`: every precomputed alignment file of every target (each chain of a complex or of an
  AlphaFold-Gap target) is parsed in full and its columns compared with the sequence, every `.hhr` read; a corrupt
  `.a3m` row is named by file and line (the parsers' messages), not found later as one failed target.
- `check_params`: every parameter file is opened; an OpenFold `.pt` checkpoint's tensor names and shapes are
  compared with the model it must fill, so a mismatched `--openfold_checkpoint_path` is refused up front in a
  few lines (the count and the first few names, `params_io.problems_error`).

`preflight(targets, cfg)` runs them all (`suite fold` calls it after its own flag checks).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from ..utils.errors import InputError
from .data.targets import AlignmentConfig, Target, alignment_files, read_text_file

__all__ = ["check_alignments", "check_output_dir", "check_params", "preflight"]


def check_output_dir(output_dir: str | Path, names: list[str] = ()) -> None:
    """`output_dir` exists as a folder this process can write (created with its parents when missing), and
    no target's folder `output_dir/<name>` is a file; else one `InputError` line naming the path."""
    out = Path(output_dir)
    for path in (out, *out.parents):
        if path.exists() and not path.is_dir():
            raise InputError(f"--output_dir {out}: {path} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--output_dir {out}: cannot be created ({exc.strerror or exc})") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=out)
    except OSError as exc:
        raise InputError(f"--output_dir {out}: cannot be written ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)
    for name in names:
        folder = out / name
        if folder.exists() and not folder.is_dir():
            raise InputError(f"--output_dir {out}: {folder} is a file where target {name!r}'s folder goes")
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            raise InputError(f"--output_dir {out}: {folder} (target {name!r}'s folder) cannot be written")


def _check_folder(folder: Path, sequence: str, skip_columns: tuple[str, ...] = ()) -> None:
    """Parse every alignment and hit file of one target's (or chain's) folder in full; an alignment's column
    count must be the sequence's length (files named in `skip_columns` are parsed only)."""
    from .data.parsers import parse_a3m, parse_hhr, parse_stockholm

    if not folder.is_dir():
        return  # a missing folder is the caller's check (`suite fold` refuses it unless --single_sequence)
    msas, hits, _ = alignment_files(folder)
    for path in msas:
        base = path.name.removesuffix(".gz")
        parse = parse_stockholm if base.endswith(".sto") else parse_a3m
        msa = parse(read_text_file(path), str(path))
        if base not in skip_columns and msa.sequences and len(msa.sequences[0]) != len(sequence):
            raise InputError(f"{path}: alignment has {len(msa.sequences[0])} columns, the sequence has "
                             f"{len(sequence)} residues")
    for path in hits:
        parse_hhr(read_text_file(path), str(path))


def _folders(target: Target, root: Path) -> list[tuple[Path, str]]:
    """(alignment folder, sequence) of a target: its own, or each chain's (first copy of each entity of a
    complex; each record of an AlphaFold-Gap target)."""
    from .stages import ComplexTarget, GapTarget

    if isinstance(target, ComplexTarget):
        seen, out = set(), []
        for chain in target.complex.chains:
            if chain.entity_id not in seen:
                seen.add(chain.entity_id)
                out.append((root / chain.name, chain.sequence))
        return out
    if isinstance(target, GapTarget):
        return [(root / c.name, c.sequence) for c in target.chains]
    return [(root / target.name, target.sequence)]


def check_alignments(targets: list[Target], cfg: AlignmentConfig) -> None:
    """Every precomputed alignment of every target parsed up front (`cfg.precomputed_dir`); the first bad file
    raises its `InputError` (file, line, what is wrong)."""
    if cfg.precomputed_dir is None:
        return
    from .data.multimer import HMMSEARCH_HITS

    root = Path(cfg.precomputed_dir)
    for target in targets:
        for folder, sequence in _folders(target, root):
            _check_folder(folder, sequence, skip_columns=HMMSEARCH_HITS)


def check_params(specs: list[Any]) -> None:
    """Every model's parameter file opened: `.npz` members listed (`suite fold` checks their preset), an
    OpenFold `.pt` checkpoint's names and shapes compared with the model it fills (`params.check_openfold`)."""
    from .params import check_openfold

    for spec in specs:
        path = spec.param_path
        if path is None:
            continue
        if Path(path).suffix in (".pt", ".pth", ".ckpt"):
            check_openfold(path, spec.model_name)
            continue
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise InputError(f"--param_path {path}: cannot be read ({exc.strerror or exc})") from None


def preflight(targets: list[Target], cfg: Any) -> None:
    """All the checks above for a `fastfold.pipeline.FoldConfig` run: nothing has been written but the output
    folder (created and probed) when this returns."""
    check_params(cfg.models)
    check_alignments(targets, cfg.alignment)
    check_output_dir(cfg.output_dir, [t.name for t in targets])
