"""What happened to each target of a run (`TargetResult`), as the schedulers (`fastfold.run.pipeline`,
`fastfold.run.cluster`) report it and the summary table shows it: done (read back from its record,
`timings.json`), skipped or failed; and the few words on its inputs and relaxation."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..data.targets import Target

__all__ = ["TargetResult", "done_result", "failed_result", "inputs_summary", "relax_line", "relax_problem",
           "skipped_result"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TargetResult:
    """What happened to one target."""

    target: Target
    status: str
    """"done", "skipped" (already complete) or "failed"."""
    mean_plddt: float | None = None
    seconds: float = 0.0
    folder: str = ""
    error: str = ""
    files: list[str] = dataclasses.field(default_factory=list)
    note: str = ""
    """Why a finished target was redone (its inputs changed), or other remarks for the summary."""
    inputs: str = ""
    """What the features were made of, in a few words (MSA depth per source, templates)."""
    relax_problem: str = ""
    """Why the relaxation cannot be trusted ("" when it can, or did not run): not converged, or refused
    because it broke chirality or cis/trans peptides (then no relaxed file is written)."""
    relax: str = ""
    """The relaxation in a few words ("relax 12.3 s, 2 passes"; "" when it did not run), also in `note` of a
    target done now; `timings.json` has each pass's energies, violations, iterations and seconds."""
    node: str = ""
    """The Ray node that predicted it and wrote its outputs (on a cluster, `fastfold.run.cluster`)."""


def inputs_summary(info: dict[str, Any] | None) -> str:
    """A few words on what the features were made of (the summary table's column)."""
    if not info:
        return ""
    if "chains" in info:  # a complex: paired rows, then each chain's own MSA depth
        per_chain = [f"{c['chain_id']} {c.get('msa_depth_dedup', 1)}" for c in info["chains"]]
        return f"MSA {info.get('msa_rows', 1)} rows ({info.get('paired_rows', 0)} paired; {', '.join(per_chain)})"
    depth = info.get("msa_depth_dedup", 1)
    parts = [f"MSA {depth}"]
    files = info.get("alignment_files", [])
    per_file = [f"{f['file'].split('_hits')[0].split('.')[0]} {f['rows_used']}" for f in files]
    if per_file:
        parts[0] += f" of {info.get('msa_depth_total', depth)} ({', '.join(per_file)})"
    elif "single" in info.get("msa_mode", ""):
        parts[0] = "single sequence"
    templates = info.get("templates", [])
    if templates:
        parts.append("templates " + " ".join(f"{t['pdb_id']}_{t['chain']}" for t in templates))
    else:
        parts.append("no templates")
    return "; ".join(parts)


def relax_problem(record: dict[str, Any]) -> str:
    """Why a target's relaxation (its record's "relax" entry) cannot be trusted, in a few words; "" when it can."""
    relax = record.get("relax") or {}
    problem = relax.get("problem", "")
    return f"relax {problem}" + ("; relaxed file refused" if relax.get("refused") else "") if problem else ""


def relax_line(record: dict[str, Any]) -> str:
    """The relaxation of a target's record in a few words ("relax 12.3 s, 2 passes"); "" when it did not run."""
    relax = record.get("relax") or {}
    if not relax or relax.get("seconds") is None:
        return ""
    passes = relax.get("outer_iterations", 0)
    return f"relax {relax['seconds']:.1f} s, {passes} pass{'' if passes == 1 else 'es'}"


def done_result(target: Target, folder: Path, files: list[str], timings: dict[str, float],
                note: str = "") -> TargetResult:
    """A target whose outputs were just written to `folder` (`files`), read back from its record."""
    record = json.loads((folder / "timings.json").read_text())
    relax = relax_line(record)
    return TargetResult(target, "done", record["mean_plddt"], sum(timings.values()), str(folder), files=files,
                        note="; ".join(x for x in (note, relax) if x), inputs=inputs_summary(record.get("inputs")),
                        relax_problem=relax_problem(record), relax=relax)


def skipped_result(target: Target, folder: Path, record: dict[str, Any]) -> TargetResult:
    """A target already complete from the same inputs (its record, `timings.json`, in `folder`)."""
    return TargetResult(target, "skipped", record.get("mean_plddt"), folder=str(folder),
                        note="same inputs as the finished run", inputs=inputs_summary(record.get("inputs")),
                        relax_problem=relax_problem(record), relax=relax_line(record))


def failed_result(target: Target, exc: BaseException, emit: Callable[[str, Target], None]) -> TargetResult:
    """A target that failed with `exc` (logged, and reported to `emit` as stage "failed")."""
    logger.error("target %s failed: %s: %s", target.name, type(exc).__name__, exc)
    logger.debug("target %s failure", target.name, exc_info=exc)
    emit("failed", target)
    return TargetResult(target, "failed", error=f"{type(exc).__name__}: {exc}")
