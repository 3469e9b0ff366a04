"""OpenFold's output layout (`FoldConfig.output_layout="openfold"`, `suite fold --output_layout openfold`), so
OpenFold users' downstream scripts read a run unchanged (`run_pretrained_openfold.py` and its `script_utils`):
`<output_dir>/predictions/` (`predictions/<model>/` with several models, as OpenFold's `make_output_directory`,
named by the parameter file's stem or, without one, the model name) holding, per target `<tag>`:

- `<tag>_<model>_unrelaxed.pdb` for every model, or with `cif_output` (OpenFold's `--cif_output`)
  `<tag>_<model>_unrelaxed.cif` instead;
- `<tag>_<model>_relaxed.pdb` (`.cif` with `cif_output`) for the best ranked model, the one relaxed here
  (OpenFold relaxes every model);
- `<tag>_<model>_output_dict.npz` with `--save_outputs`: every model output, OpenFold's `_output_dict.pkl` in a
  format that needs no pickle;
- `timings.json` of the model that was relaxed, as OpenFold's `relax_protein` writes it: `{"relaxation": s}` (the
  last target relaxed; OpenFold updates one key per prediction folder).

and `<output_dir>/timings.json`, as OpenFold's `run_model` writes it: `{"<tag>": {"inference": s}, ...}` merged
over targets; with several models a tag holds the last model's seconds (OpenFold's runs the models one after
another and each overwrites the tag).

The files are hard links to (or, across file systems, copies of) the per-target folder's, which stay the
record a rerun reads (`fastfold.run.resume`: both formats, with every stage's seconds); a target that did not
finish gets none.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ...utils.fileio import atomic_write

__all__ = ["model_folders", "write_openfold_layout"]


def model_folders(output_dir: str | Path, models: list[Any]) -> dict[str, Path]:
    """Model name -> its OpenFold prediction folder: `predictions/`, or one sub-folder per model when several."""
    root = Path(output_dir) / "predictions"
    if len(models) == 1:
        return {models[0].model_name: root}
    return {m.model_name: root / (Path(m.param_path).stem if m.param_path else m.model_name) for m in models}


def _place(source: Path, dest: Path) -> None:
    """`dest` becomes `source`'s content, atomically (a hard link, else a copy, renamed into place)."""
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copy2(source, tmp)
    os.replace(tmp, dest)


def _model_of(label: str, names: list[str]) -> str:
    """The model a prediction label (`<model>` or `<model>_seed_<k>`) belongs to."""
    return max((n for n in names if label == n or label.startswith(n + "_seed_")), key=len)


def _target_files(folder: Path, name: str, record: dict[str, Any], dirs: dict[str, Path],
                  order: list[str], ext: str) -> list[tuple[Path, Path]]:
    """(source, OpenFold destination) of one complete target's files; `order`: its labels, best first; `ext`: the
    structures' format, ".pdb" or ".cif"."""
    pairs = []
    for label in order:
        dest = dirs[_model_of(label, list(dirs))]
        for suffix in (f"_unrelaxed{ext}", "_output_dict.npz"):
            pairs.append((folder / f"{name}_{label}{suffix}", dest / f"{name}_{label}{suffix}"))
    best = dirs[_model_of(order[0], list(dirs))]
    pairs.append((folder / f"{name}_relaxed{ext}", best / f"{name}_{order[0]}_relaxed{ext}"))
    listed = set(record.get("files", []))
    return [(s, d) for s, d in pairs if s.name in listed and s.is_file()]


def _update_timings(path: Path, entries: dict[str, Any]) -> None:
    """OpenFold's `update_timings`: `path`'s JSON object updated with `entries` (a file that is not one is
    replaced)."""
    try:
        timings = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        timings = {}
    timings = timings if isinstance(timings, dict) else {}
    timings.update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        f.write(json.dumps(timings, indent=2))


def _last_inference(stage: dict[str, float], names: list[str]) -> float | None:
    """The seconds of a target's last prediction in OpenFold's order (models as given, each model's seeds in
    turn), or None when every prediction came from an interrupted run's cache."""
    labels = [k[len("model_"):] for k in stage if k.startswith("model_")]
    if not labels:
        return None
    last = max(range(len(labels)), key=lambda i: (names.index(_model_of(labels[i], names)), i))
    return stage["model_" + labels[last]]


def write_openfold_layout(output_dir: str | Path, targets: list[Any], models: list[Any],
                          cif_output: bool = False) -> list[Path]:
    """OpenFold's files (module docstring) of every complete target among `targets` (its `timings.json` there),
    structures as ModelCIF with `cif_output`; returns the files placed."""
    dirs = model_folders(output_dir, models)
    placed = []
    for target in targets:
        folder = Path(output_dir) / target.name
        try:
            record = json.loads((folder / "timings.json").read_text())
            order = json.loads((folder / "ranking.json").read_text())["order"]
        except (OSError, ValueError, KeyError):
            continue  # not complete: nothing of it goes to predictions/
        for source, dest in _target_files(folder, target.name, record, dirs, order, ".cif" if cif_output else ".pdb"):
            dest.parent.mkdir(parents=True, exist_ok=True)
            _place(source, dest)
            placed.append(dest)
        stage = record.get("timings", {})
        inference = _last_inference(stage, list(dirs))
        if inference is not None:
            _update_timings(Path(output_dir) / "timings.json", {target.name: {"inference": round(inference, 3)}})
        if "relax" in stage:
            _update_timings(dirs[_model_of(order[0], list(dirs))] / "timings.json",
                            {"relaxation": round(stage["relax"], 3)})
    return placed
