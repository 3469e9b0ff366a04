"""The files of an alignment folder (`--use_precomputed_alignments DIR/<target>/`, or a target's `msas/`): which
files are alignments and template hits, how they are read (gzipped too, text checked), AlphaFold's row caps,
and where a target's folder is (`alignment_folder`: our name, else OpenFold's tag). Below `targets` and
`searches`, which both read them."""

from __future__ import annotations

import re
from pathlib import Path

from .parsers import InputError, Msa, parse_a3m, parse_stockholm

__all__ = [
    "HIT_SUFFIXES",
    "MAX_HITS",
    "MSA_SUFFIXES",
    "UNIPROT_HITS",
    "alignment_files",
    "alignment_folder",
    "base_name",
    "check_query_row",
    "check_text_file",
    "openfold_tag",
    "read_msa",
    "read_text_file",
]

UNIPROT_HITS = "uniprot_hits.sto"
"""The UniProt search's result in a chain's `msas/` folder: the pairing MSA of a complex, not an unpaired MSA."""

_MSA_FILES = ("uniref90_hits.sto", "mgnify_hits.sto", "bfd_uniref_hits.a3m", "bfd_uniclust_hits.a3m",
              "small_bfd_hits.sto", "uniclust30_hits.a3m")
"""OpenFold/AlphaFold per-target alignment file names, in the order their rows enter the MSA."""

MAX_HITS = {"uniref90_hits.sto": 10_000, "mgnify_hits.sto": 501}
"""Rows kept per search result, AlphaFold's caps (`uniref_max_hits`, `mgnify_max_hits`); query row included."""

MSA_SUFFIXES = (".sto", ".a3m", ".sto.gz", ".a3m.gz")
"""Alignment files read from a target's folder (gzip-compressed ones too)."""
HIT_SUFFIXES = (".hhr", ".hhr.gz")
"""Template-hit files read from a target's folder."""


def _kind(path: Path) -> str:
    """"msa", "hits" or "" (a file the reader does not use)."""
    name = path.name
    if name.endswith(MSA_SUFFIXES):
        return "msa"
    return "hits" if name.endswith(HIT_SUFFIXES) else ""


def base_name(path: Path) -> str:
    """A file's name without its `.gz` (the name AlphaFold's caps and the MSA order know)."""
    return path.name[:-3] if path.name.endswith(".gz") else path.name
def read_text_file(path: Path) -> str:
    """A text file (gunzipped when it ends in .gz); `InputError` naming it when it is binary."""
    import gzip

    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not a text file (byte {exc.start} is not UTF-8: binary or compressed?)") from None
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: cannot be read ({exc})") from None
    if "\0" in text[:65536]:
        raise InputError(f"{path}: not a text file (holds NUL bytes: binary?)")
    return text


def check_text_file(path: Path, size: int = 65536) -> None:
    """Cheap check before any work: the first `size` characters of `path` (gunzipped for .gz) are text;
    `InputError` naming the file otherwise."""
    import gzip

    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                head = f.read(size)
        else:
            with open(path, encoding="utf-8") as f:
                head = f.read(size)
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not a text file (byte {exc.start} is not UTF-8: binary or compressed?)") from None
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: cannot be read ({exc})") from None
    if "\0" in head:
        raise InputError(f"{path}: not a text file (holds NUL bytes: binary?)")


def read_msa(path: Path) -> Msa:
    """An alignment file (`.sto` or `.a3m`, gzipped too) parsed in full; a bad row is an `InputError` naming the
    file and line."""
    parse = parse_stockholm if base_name(path).endswith(".sto") else parse_a3m
    return parse(read_text_file(path), str(path))


def alignment_files(folder: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """(alignment files in MSA order, template-hit files, files the reader ignores) of a target's folder."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    msas = [p for p in files if _kind(p) == "msa"]
    msas.sort(key=lambda p: _MSA_FILES.index(base_name(p)) if base_name(p) in _MSA_FILES else len(_MSA_FILES))
    return msas, [p for p in files if _kind(p) == "hits"], [p for p in files if not _kind(p)]


def openfold_tag(name: str) -> str:
    """The name OpenFold gives the target of a FASTA header (`run_pretrained_openfold.py`'s `parse_fasta`): the
    header up to its first non-word character (`T1050-D1 ...` -> `T1050`, `1abc_A` stays)."""
    return re.split(r"\W", name, maxsplit=1)[0]


def alignment_folder(root: str | Path, name: str) -> Path:
    """The alignment folder of target (or chain) `name` under `root`: `root/<name>`, else, when only that exists,
    the folder OpenFold's scripts name after the same header (`root/<openfold_tag(name)>`); `root/<name>` when
    neither exists (the caller's error names it)."""
    own = Path(root) / name
    if own.is_dir():
        return own
    tag = openfold_tag(name)
    theirs = Path(root) / tag
    return theirs if tag and tag != name and theirs.is_dir() else own


def check_query_row(path: Path, msa: Msa, sequence: str) -> None:
    """The first row of an alignment file is its query: it must be `sequence` (case aside; an `X` on either side
    matches any residue), or the file is another target's (a wrong folder would fold another protein's
    evolutionary signal); `InputError` naming the file and the first differing position."""
    if not msa.sequences:
        return
    first = msa.sequences[0].upper()
    if len(first) != len(sequence):
        raise InputError(f"{path}: alignment has {len(first)} columns, the sequence has {len(sequence)} residues")
    for pos, (a, b) in enumerate(zip(first, sequence.upper()), start=1):
        if a != b and "X" not in (a, b):
            raise InputError(f"{path}: its first row (the query) is another sequence than the target's: "
                             f"position {pos} is {a!r}, the target has {b!r} (an alignment of another protein?)")
