"""Parsers for the files an AlphaFold-style search produces: FASTA, A3M, Stockholm (.sto) and HHsearch (.hhr).

Every parser takes the file's text (and a name for messages) and raises `InputError` naming the file,
the record and the position of the first thing that is wrong (the project's one `InputError`, from
`utils.errors`: the `suite` command line prints it as one line and exits 2).
"""

from __future__ import annotations

import dataclasses
import logging
import re

from ...utils.errors import InputError

__all__ = [
    "InputError",
    "Msa",
    "TemplateHit",
    "fasta_records",
    "parse_a3m",
    "parse_fasta",
    "parse_fasta_records",
    "parse_hhr",
    "parse_stockholm",
    "target_name",
    "validate_sequence",
]

logger = logging.getLogger(__name__)

AMINO_ACIDS = set("ACDEFGHIKLMNPQRSTVWY")
"""The 20 standard one-letter codes."""
AMBIGUOUS = set("XBZUOJ")
"""Letters AlphaFold accepts but does not model as such: X unknown, B/Z/J ambiguous, U/O rare."""


@dataclasses.dataclass(frozen=True)
class Msa:
    """An alignment in A3M form after insertion removal.

    `sequences[i]` all have the query's length (upper case and '-'); `deletion_matrix[i][j]` counts the
    residues deleted (insertions relative to the query) just before column j.
    """

    sequences: list[str]
    deletion_matrix: list[list[int]]
    descriptions: list[str]

    def __len__(self) -> int:
        return len(self.sequences)

    def truncate(self, max_seqs: int) -> Msa:
        return Msa(self.sequences[:max_seqs], self.deletion_matrix[:max_seqs], self.descriptions[:max_seqs])


@dataclasses.dataclass(frozen=True)
class TemplateHit:
    """One HHsearch hit: `indices_query[k]`/`indices_hit[k]` are 0-based positions (-1 for a gap)."""

    index: int
    name: str
    aligned_cols: int
    sum_probs: float
    query: str
    hit_sequence: str
    indices_query: list[int]
    indices_hit: list[int]


def fasta_records(text: str, source: str) -> list[tuple[str, str, int]]:
    """(description, raw sequence, line number of the header) for each '>' record of FASTA `text` (`source` names
    it in errors): the one record splitter of targets (`parse_fasta_records`) and complexes
    (`fastfold.data.multimer`)."""
    records: list[tuple[str, str, int]] = []
    chunks: list[str] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith(";"):
            continue
        if line.startswith(">"):
            if records:
                records[-1] = (records[-1][0], "".join(chunks), records[-1][2])
            records.append((line[1:].strip(), "", lineno))
            chunks = []
        elif not records:
            raise InputError(f"{source}: line {lineno}: not FASTA (expected a '>' header before sequence data)")
        else:
            chunks.append(line)
    if records:
        records[-1] = (records[-1][0], "".join(chunks), records[-1][2])
    return records


def validate_sequence(sequence: str, where: str) -> str:
    """Upper-case `sequence` and check it is a protein sequence; warns about X/B/Z/U/O/J.

    `where` names the record for messages. Returns the upper-case sequence.
    """
    seq = re.sub(r"\s+", "", sequence).upper()
    if seq.endswith("*"):
        seq = seq[:-1]
    if not seq:
        raise InputError(f"{where}: empty sequence")
    for pos, letter in enumerate(seq, start=1):
        if letter not in AMINO_ACIDS and letter not in AMBIGUOUS:
            raise InputError(f"{where}: position {pos}: {letter!r} is not an amino-acid letter")
    odd = sorted({c for c in seq if c in AMBIGUOUS})
    if odd:
        logger.warning("%s: residues %s are modelled as unknown (X), as AlphaFold does", where, "".join(odd))
    return seq


_UNIPROT = re.compile(r"^(?:sp|tr)\|([A-Za-z0-9_.\-]+)\|")
"""UniProt FASTA headers (`sp|P0CG48|UBC_HUMAN ...`): the target is named from the accession."""


def target_name(description: str) -> str:
    """The name of a target from its header: the accession of a UniProt header, else the first word."""
    words = description.split()
    first = words[0] if words else ""
    m = _UNIPROT.match(first)
    return m.group(1) if m else first


def parse_fasta_records(text: str, source: str = "<fasta>") -> list[tuple[str, str, str]]:
    """Targets `(name, sequence, header)` of a FASTA file (see `parse_fasta`); a UTF-8 byte-order mark is
    ignored, and the whole header is kept for the outputs."""
    text = text.removeprefix("\ufeff")
    records = fasta_records(text, source)
    if not records:
        raise InputError(f"{source}: no FASTA records (expected lines starting with '>')")
    seen: dict[str, int] = {}
    out = []
    for k, (desc, raw, lineno) in enumerate(records, start=1):
        name = target_name(desc)
        where = f"{source}: record {k} ({name or 'unnamed'}, line {lineno})"
        if not name:
            raise InputError(f"{where}: empty header (a target needs a name)")
        if re.search(r"[^A-Za-z0-9_.\-]", name):
            raise InputError(f"{where}: name {name!r} may only hold letters, digits, '_', '.', '-'")
        if name in seen:
            raise InputError(f"{where}: duplicate name {name!r} (first at record {seen[name]})")
        seen[name] = k
        out.append((name, validate_sequence(raw, where), desc))
    return out


def parse_fasta(text: str, source: str = "<fasta>") -> list[tuple[str, str]]:
    """Targets `(name, sequence)` of a FASTA file; the name is the header's first word, or the accession of a
    UniProt header (`>sp|P0CG48|UBC_HUMAN ...` -> P0CG48).

    Raises `InputError` for a file that is not FASTA, an empty record, a non-amino-acid letter or a
    duplicate name. Lower case is accepted.
    """
    return [(name, seq) for name, seq, _ in parse_fasta_records(text, source)]


def _sequence_line(text: str, header_line: int, pos: int) -> tuple[int, int]:
    """(line number, column) of the `pos`-th (1-based) sequence character of the record whose header is on
    `header_line`, its sequence possibly wrapped over several lines."""
    seen = 0
    for lineno, raw in enumerate(text.splitlines()[header_line:], start=header_line + 1):
        line = raw.strip()
        if not line or line.startswith(";"):
            continue
        if seen + len(line) >= pos:
            return lineno, pos - seen
        seen += len(line)
    return header_line, pos


def parse_a3m(text: str, source: str = "<a3m>") -> Msa:
    """An A3M alignment: lower-case letters are insertions (removed, counted in the deletion matrix)."""
    records = fasta_records(text, source)
    if not records:
        raise InputError(f"{source}: no sequences in A3M file")
    sequences, deletions, descriptions = [], [], []
    width = None
    for k, (desc, raw, lineno) in enumerate(records, start=1):
        row, dels, count = [], [], 0
        for pos, c in enumerate(raw, start=1):
            if c.islower():
                count += 1
            elif c.isupper() or c == "-":
                row.append(c)
                dels.append(count)
                count = 0
            elif c != ".":
                line, column = _sequence_line(text, lineno, pos)
                raise InputError(f"{source}: line {line}: record {k} (header on line {lineno}), column {column}: "
                                 f"unexpected {c!r}")
        aligned = "".join(row)
        if width is None:
            width = len(aligned)
        elif len(aligned) != width:
            raise InputError(
                f"{source}: record {k} (line {lineno}): {len(aligned)} aligned columns, the query has {width}"
            )
        sequences.append(aligned)
        deletions.append(dels)
        descriptions.append(desc)
    return Msa(sequences, deletions, descriptions)


def _stockholm_rows(text: str, source: str) -> tuple[dict[str, str], str]:
    """Sequence rows by name, and the `#=GC RF` reference annotation ('' when absent)."""
    rows: dict[str, list[str]] = {}
    reference: list[str] = []
    lines = text.splitlines()
    if not lines or not lines[0].startswith("# STOCKHOLM"):
        raise InputError(f"{source}: line 1: not a Stockholm file (no '# STOCKHOLM' header)")
    for lineno, line in enumerate(lines[1:], start=2):
        s = line.strip()
        if s.startswith("#=GC RF"):
            reference.append(s.split()[-1])
            continue
        if not s or s.startswith("#"):
            continue
        if s == "//":
            break
        parts = s.split()
        if len(parts) != 2:
            raise InputError(f"{source}: line {lineno}: expected 'name sequence', got {len(parts)} fields")
        rows.setdefault(parts[0], []).append(parts[1])
    return {name: "".join(chunks) for name, chunks in rows.items()}, "".join(reference)


def parse_stockholm(text: str, source: str = "<sto>") -> Msa:
    """A Stockholm alignment (jackhmmer output). Insert columns (`.` in the `#=GC RF` line, else the gap
    columns of the first sequence) are removed and counted in the deletion matrix."""
    rows, reference = _stockholm_rows(text, source)
    if not rows:
        raise InputError(f"{source}: no sequences in Stockholm file")
    names = list(rows)
    query = rows[names[0]]
    if reference and len(reference) == len(query):
        keep = [i for i, c in enumerate(reference) if c not in "-."]
    else:
        keep = [i for i, c in enumerate(query) if c not in "-."]
    sequences, deletions = [], []
    for k, name in enumerate(names, start=1):
        seq = rows[name]
        if len(seq) != len(query):
            raise InputError(f"{source}: sequence {k} ({name}): length {len(seq)}, the query row has {len(query)}")
        dels, count, kept = [], 0, set(keep)
        for i, c in enumerate(seq):
            if i in kept:
                dels.append(count)
                count = 0
            elif c not in "-.":
                count += 1
        sequences.append("".join(seq[i] for i in keep).upper().replace(".", "-"))
        deletions.append(dels)
    return Msa(sequences, deletions, names)


_HHR_SUMMARY = re.compile(r"Probab=\S+\s+E-value=\S+\s+Score=\S+\s+Aligned_cols=(\d+).*Sum_probs=([-\d.]+)")
_HHR_ALIGN = re.compile(r"^([QT]) (\S+)\s+(\d+) (\S+)\s+(\d+) \(\d+\)$")


def _hhr_block(lines: list[str], index: int, source: str, start_line: int) -> TemplateHit:
    name = lines[1][1:].split()[0] if len(lines) > 1 and lines[1].startswith(">") else ""
    summary = _HHR_SUMMARY.search(lines[2]) if len(lines) > 2 else None
    if not name or summary is None:
        raise InputError(f"{source}: line {start_line}: hit {index}: malformed hit header")
    parts = {"Q": ["", None], "T": ["", None]}
    for line in lines[3:]:
        m = _HHR_ALIGN.match(line.rstrip())
        if not m or m.group(2) in ("Consensus", "ss_pred", "ss_dssp", "ss_conf"):
            continue
        key, start, chunk = m.group(1), int(m.group(3)), m.group(4)
        if parts[key][1] is None:
            parts[key][1] = start
        parts[key][0] += chunk
    q, qstart = parts["Q"]
    t, tstart = parts["T"]
    if qstart is None or tstart is None or len(q) != len(t):
        raise InputError(f"{source}: line {start_line}: hit {index} ({name}): query/template alignment unreadable")
    iq, it = [], []
    qi, ti = qstart - 1, tstart - 1
    for a, b in zip(q, t):
        iq.append(qi if a != "-" else -1)
        it.append(ti if b != "-" else -1)
        qi += a != "-"
        ti += b != "-"
    sum_probs = float(summary.group(2))
    return TemplateHit(index, name, int(summary.group(1)), sum_probs, q, t, iq, it)


def parse_hhr(text: str, source: str = "<hhr>") -> list[TemplateHit]:
    """The hits of an HHsearch/HHblits `.hhr` result, in file order (0-based residue indices)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if re.match(r"^No \d+\s*$", line)]
    if not starts and not any(line.startswith("Query") for line in lines[:3]):
        raise InputError(f"{source}: line 1: not an HHsearch .hhr file")
    hits = []
    for k, s in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        hits.append(_hhr_block(lines[s:end], k + 1, source, s + 1))
    return hits
