"""Every input of a fold run checked before the first model call (issues 34 and 48): a bad one is one `InputError`
line naming the file (and line) or the flag, and what is wrong; `suite fold` turns it into exit code 2 before any
work. `check_inputs(targets, cfg)` runs them all: the run's entry (`fastfold.run.entry.fold`) calls it, and the
Lightning recipe before its first batch.

- `check_params`: every model's parameter file, against the model that must read it
  (`fastfold.params.check_param_file`: its kind, preset, version; an OpenFold `.pt`'s names and shapes).
- `check_devices`: the models' CUDA device exists here (one GPU per DAP rank with `devices` > 1).
- `check_alignments`: every target's precomputed folder (each chain's of a complex, each record's of an
  AlphaFold-Gap target; named as ours or as OpenFold names targets, `data.alignment_files.alignment_folder`)
  exists and holds an alignment unless single-sequence, text files only, every file parsed in full: its columns
  are the sequence's and its first row is the sequence itself (a corrupt `.a3m` row is named by file and line,
  an alignment of another protein by file and position), every `.hhr` read.
- `check_sources`: the template folder, the databases (HH-suite prefixes too) and the tools they need, the
  obsolete-PDB list (read in full).
- `check_output_dir`: the output folder is created (its parents too) and probed by writing a file in it; a file
  where the folder (or a target's folder) should be, or a folder this user cannot write, is refused.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from pathlib import Path

from ...utils.errors import InputError
from ..data.alignment_files import (
    alignment_files,
    alignment_folder,
    base_name,
    check_query_row,
    check_text_file,
    read_msa,
    read_text_file,
)
from ..data.gap import GapTarget
from ..data.targets import AlignmentConfig, Target
from .config import FoldConfig
from .stages import ComplexTarget, ModelSpec

__all__ = ["check_alignments", "check_devices", "check_inputs", "check_output_dir", "check_params",
           "check_sources"]


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


def check_params(specs: list[ModelSpec]) -> None:
    """Every model's parameter file checked against the model that must read it (`check_param_file`)."""
    from ..params.checks import check_param_file

    for spec in specs:
        if spec.param_path is not None:
            check_param_file(spec.param_path, spec.model_name)


def check_devices(specs: list[ModelSpec], devices: int = 1) -> None:
    """The models' devices exist here: CUDA available, `cuda:N` within the device count; with `devices` > 1 DAP
    ranks on CUDA, one GPU per rank (rank r runs on cuda:r, so no `cuda:N`)."""
    names = sorted({s.device for s in specs})
    if all(n in ("auto", "cpu") for n in names) and devices == 1:
        return
    import torch

    for device in names:
        index = re.fullmatch(r"cuda(?::(\d+))?", device)
        if index is None:
            continue
        if not torch.cuda.is_available():
            raise InputError(f"--model_device {device}: CUDA is not available here (use --model_device cpu or auto)")
        if index.group(1) is not None and int(index.group(1)) >= torch.cuda.device_count():
            raise InputError(f"--model_device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if devices > 1:
        for device in names:
            if device.startswith("cuda:"):
                raise InputError(f"--model_device {device} with --devices {devices}: DAP rank r runs on cuda:r; "
                                 "give --model_device cuda (or auto)")
        on_cuda = any(n == "cuda" or (n == "auto" and torch.cuda.is_available()) for n in names)
        if on_cuda and torch.cuda.device_count() < devices:
            raise InputError(f"--devices {devices}: this machine has {torch.cuda.device_count()} CUDA device(s), one "
                             "per rank is needed (or --model_device cpu)")


def _units(target: Target) -> list[tuple[str, str, str, str]]:
    """(folder name, sequence, what it is, how to fold it without alignments) of every alignment folder a target
    reads: its own, each record's of an AlphaFold-Gap target, the first chain of each entity of a complex."""
    if isinstance(target, ComplexTarget):
        seen, out = set(), []
        for chain in target.complex.chains:
            if chain.entity_id not in seen:
                seen.add(chain.entity_id)
                out.append((chain.name, chain.sequence,
                            f"chain {chain.name!r} (chain {chain.chain_id} of complex {target.name!r})",
                            "fold it from the sequences alone"))
        return out
    if isinstance(target, GapTarget):
        return [(c.name, c.sequence, f"record {c.name!r} of target {target.name!r} (AlphaFold-Gap)", "fold it alone")
                for c in target.chains]
    return [(target.name, target.sequence, f"target {target.name!r}", "fold it alone")]


def _check_folder(root: Path, unit: tuple[str, str, str, str], single_sequence: bool,
                  skip_columns: tuple[str, ...]) -> None:
    """One target's (or chain's) alignment folder: it exists, holds an alignment file unless `single_sequence`,
    every file it will read is text, and parses in full; an alignment's columns and first row are the sequence
    (files named in `skip_columns`, hmmsearch's template hits, are parsed only)."""
    from ..data.parsers import parse_hhr

    name, sequence, what, alone = unit
    folder = alignment_folder(root, name)
    if not folder.is_dir():
        raise InputError(f"--use_precomputed_alignments {root}: no folder for {what}")
    msas, hits, ignored = alignment_files(folder)
    if not msas and not single_sequence:
        holds = f"only {', '.join(p.name for p in ignored)}" if ignored else "nothing"
        raise InputError(f"--use_precomputed_alignments: {folder}: no alignment file (.sto/.a3m, optionally .gz) "
                         f"for {what}, it holds {holds}; add --single_sequence to {alone}")
    for path in [*msas, *hits]:
        try:
            check_text_file(path)
        except InputError as exc:
            raise InputError(f"--use_precomputed_alignments: {exc}") from None
    for path in msas:
        msa = read_msa(path)
        if base_name(path) in skip_columns or not msa.sequences:
            continue
        if len(msa.sequences[0]) != len(sequence):
            raise InputError(f"{path}: alignment has {len(msa.sequences[0])} columns, the sequence has "
                             f"{len(sequence)} residues")
        check_query_row(path, msa, sequence)
    for path in hits:
        parse_hhr(read_text_file(path), str(path))


def check_alignments(targets: list[Target], cfg: AlignmentConfig) -> None:
    """Every precomputed alignment folder of every target (`cfg.precomputed_dir`; module docstring) checked and
    parsed up front; the first bad one raises its `InputError` (file, line, what is wrong)."""
    if cfg.precomputed_dir is None:
        return
    from ..data.multimer import HMMSEARCH_HITS

    root = Path(cfg.precomputed_dir)
    if not root.is_dir():
        raise InputError(f"--use_precomputed_alignments {cfg.precomputed_dir}: no such folder")
    for target in targets:
        for unit in _units(target):
            _check_folder(root, unit, cfg.single_sequence, HMMSEARCH_HITS)


_DATABASES = ("uniref90", "mgnify", "bfd", "uniref30", "pdb70", "uniprot")
"""The databases a run may search (`AlignmentConfig.<name>_database_path`); UniProt only for complexes."""
_TOOLS = {"jackhmmer": ("uniref90", "mgnify", "uniprot"), "hhblits": ("bfd",), "hhsearch": ("pdb70",)}
"""The tool each database is searched with."""


def _exists(path: str | None, flag: str, folder: bool = False) -> None:
    """A file (or an HH-suite database prefix: files starting with it) or, with `folder`, a folder."""
    if path is None:
        return
    ok = os.path.isdir(path) if folder else os.path.exists(path) or bool(glob.glob(glob.escape(path) + "*"))
    if not ok:
        raise InputError(f"{flag} {path}: no such {'folder' if folder else 'file'}")


def check_sources(cfg: AlignmentConfig) -> None:
    """The template folder exists; unless single-sequence, every database given exists and (without precomputed
    alignments) the tools that search them run; the obsolete-PDB list reads in full."""
    _exists(cfg.template_mmcif_dir, "template_mmcif_dir", folder=True)
    if not cfg.single_sequence:
        for db in _DATABASES:
            _exists(getattr(cfg, f"{db}_database_path"), f"--{db}_database_path")
        if cfg.precomputed_dir is None:
            _check_tools(cfg)
    if cfg.obsolete_pdbs_path is not None:
        from ..data.templates import read_obsolete_pdbs

        if not os.path.isfile(cfg.obsolete_pdbs_path):
            raise InputError(f"--obsolete_pdbs_path {cfg.obsolete_pdbs_path}: no such file")
        try:
            read_obsolete_pdbs(cfg.obsolete_pdbs_path)
        except InputError as err:
            raise InputError(f"--obsolete_pdbs_path {err}") from None


def _check_tools(cfg: AlignmentConfig) -> None:
    """The tools the given databases need are runnable."""
    from ..data.tools import ToolError, find_binary

    for tool, dbs in _TOOLS.items():
        if any(getattr(cfg, f"{db}_database_path", None) for db in dbs):
            try:
                find_binary(getattr(cfg, f"{tool}_binary_path"), tool)
            except ToolError as exc:
                raise InputError(f"--{tool}_binary_path: {exc}") from None


def check_inputs(targets: list[Target], cfg: FoldConfig) -> None:
    """All the checks above for a run (module docstring): nothing has been written but the output folder (created
    and probed) when this returns."""
    check_params(cfg.models)
    check_devices(cfg.models, cfg.devices)
    check_alignments(targets, cfg.alignment)
    check_sources(cfg.alignment)
    check_output_dir(cfg.output_dir, [t.name for t in targets])

