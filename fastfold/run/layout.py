"""OpenFold's output layout (`suite fold --output_layout openfold`), so OpenFold users' downstream scripts read a
run unchanged: `<output_dir>/predictions/` (`predictions/<model>/` with several models, as OpenFold's
`make_output_directory`, named by the parameter file's stem or, without one, the model name) holding, per
target `<tag>`:

- `<tag>_<model>_unrelaxed.pdb` (and `.cif`) for every model;
- `<tag>_<model>_relaxed.pdb` (and `.cif`) for the best ranked model, the one relaxed here (OpenFold relaxes
  every model);
- `<tag>_<model>_output_dict.npz` with `--save_outputs`: every model output, OpenFold's `_output_dict.pkl` in a
  format that needs no pickle;
- `timings.json`, OpenFold's: `{"<tag>": {"inference": s, "relaxation": s}, ...}`, merged over targets.

The files are hard links to (or, across file systems, copies of) the per-target folder's, which stay the
record a rerun reads (`fastfold.run.resume`); a target that did not finish gets none.
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
                  order: list[str]) -> list[tuple[Path, Path]]:
    """(source, OpenFold destination) of one complete target's files; `order`: its labels, best first."""
    pairs = []
    for label in order:
        dest = dirs[_model_of(label, list(dirs))]
        for suffix in ("_unrelaxed.pdb", "_unrelaxed.cif", "_output_dict.npz"):
            pairs.append((folder / f"{name}_{label}{suffix}", dest / f"{name}_{label}{suffix}"))
    best = dirs[_model_of(order[0], list(dirs))]
    for ext in (".pdb", ".cif"):
        pairs.append((folder / f"{name}_relaxed{ext}", best / f"{name}_{order[0]}_relaxed{ext}"))
    listed = set(record.get("files", []))
    return [(s, d) for s, d in pairs if s.name in listed and s.is_file()]


def _update_timings(path: Path, tag: str, entry: dict[str, float]) -> None:
    try:
        timings = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        timings = {}
    timings = timings if isinstance(timings, dict) else {}
    timings[tag] = entry
    with atomic_write(path) as f:
        f.write(json.dumps(timings, indent=2))


def write_openfold_layout(output_dir: str | Path, targets: list[Any], models: list[Any]) -> list[Path]:
    """OpenFold's files (module docstring) of every complete target among `targets` (its `timings.json`
    there); returns the files placed."""
    dirs = model_folders(output_dir, models)
    placed = []
    for target in targets:
        folder = Path(output_dir) / target.name
        try:
            record = json.loads((folder / "timings.json").read_text())
            order = json.loads((folder / "ranking.json").read_text())["order"]
        except (OSError, ValueError, KeyError):
            continue  # not complete: nothing of it goes to predictions/
        pairs = _target_files(folder, target.name, record, dirs, order)
        for source, dest in pairs:
            dest.parent.mkdir(parents=True, exist_ok=True)
            _place(source, dest)
            placed.append(dest)
        stage = record.get("timings", {})
        for model, dest in dirs.items():
            seconds = [v for k, v in stage.items() if k.startswith("model_") and _model_of(k[6:], list(dirs)) == model]
            entry = {"inference": round(sum(seconds), 3)}
            if "relax" in stage and model == _model_of(order[0], list(dirs)):
                entry["relaxation"] = round(stage["relax"], 3)
            dest.mkdir(parents=True, exist_ok=True)
            _update_timings(dest / "timings.json", target.name, entry)
    return placed
