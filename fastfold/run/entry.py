"""The one entry of a fold run, shared by `suite fold`, the Lightning recipe and Python users:

    targets, rule = read_fold_targets("targets.fasta", multimer=False)
    results = fold(targets, FoldConfig(output_dir="out", models=[ModelSpec(param_path="params_model_1_ptm.npz")]))

`fold` checks every input up front (`check_inputs`: one `InputError` line naming the file or flag, before any work),
folds the targets (`fastfold.run.pipeline.fold_targets`: resume, Ray, DAP, per-target failures) and writes every
output layout the config asks for (`write_layouts`). The Lightning recipe, whose loop Lightning owns, calls the two
ends itself: `check_inputs` before its first batch and `write_layouts` after its last.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ...utils.errors import InputError
from ..data.targets import Target
from .config import FoldConfig
from .layout import write_openfold_layout
from .pipeline import fold_targets
from .preflight import check_inputs
from .results import TargetResult
from .stages import ModelSpec

__all__ = ["fold", "read_fold_targets", "write_layouts"]


def read_fold_targets(fasta_path: str | Path, *, multimer: bool = False,
                      ri_gap: int | None = None) -> tuple[list[Target], str]:
    """The targets of a FASTA file or folder and the rule that made them (for the summary): complexes for
    AlphaFold-Multimer models (ColabFold's `A:B` records, or OpenFold's one file per complex); else one target per
    record, or per file of a folder, a file of several records being one AlphaFold-Gap target whose records are
    `ri_gap` residues apart (OpenFold's `--multimer_ri_gap`; None: its default, `data.gap.RI_GAP`). Bad input is one
    `InputError` line."""
    from ..data.gap import RI_GAP, read_fold_inputs
    from .stages import read_complex_targets

    try:
        if multimer:
            targets = read_complex_targets(fasta_path)
            rule = ("one complex per file, a record per chain (OpenFold's rule)" if os.path.isdir(fasta_path)
                    else "one complex per record, chains split by ':' (ColabFold's rule)")
            return targets, rule
        return read_fold_inputs(fasta_path, gap=RI_GAP if ri_gap is None else ri_gap)
    except InputError as exc:
        hint = ""
        if "':' is not an amino-acid letter" in str(exc):
            hint = "; chains split by ':' make a complex: fold it with --model_preset multimer"
        raise InputError(f"{exc}{hint}") from None


def write_layouts(output_dir: str | Path, targets: list[Target], models: list[ModelSpec],
                  output_layout: str = "suite", cif_output: bool = False) -> list[Path]:
    """The output layouts besides the per-target folders (always written, the record a rerun reads): OpenFold's
    `predictions/` and timings files for `output_layout="openfold"` (`fastfold.run.layout`; `cif_output`: ModelCIF
    there instead of PDB). Returns the files placed."""
    if output_layout == "openfold":
        return write_openfold_layout(output_dir, targets, models, cif_output=cif_output)
    return []


def fold(targets: list[Target], config: FoldConfig,
         emit: Callable[[str, Target], None] | None = None) -> list[TargetResult]:
    """Check every input (`check_inputs`), fold every target (`fold_targets`) and write the output layouts of
    `config` (`write_layouts`); one `TargetResult` per target, in order. Bad input raises `InputError` before any
    work; one target's failure is its result, the others go on. `emit(stage, target)` reports progress: "checked"
    (target None) once the inputs passed, then `fold_targets`' stages."""
    check_inputs(targets, config)
    if emit is not None:
        emit("checked", None)
    results = fold_targets(targets, config, emit)
    write_layouts(config.output_dir, targets, config.models, config.output_layout, config.cif_output)
    return results

