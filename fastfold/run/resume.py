"""Whether a target is done, and from what: its record (`timings.json`, written last, listing every output file)
and the fingerprint of what made its outputs (`fastfold.data.fingerprint`: sequence, models and parameter files,
alignments, templates, relaxation, seeds, precision, recycles). A rerun skips a target whose recorded fingerprint
equals its own, reuses a model's cached prediction made from the same inputs, and forgets the outputs of one it
redoes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..data import fingerprint as fp
from ..data.alignment_files import alignment_folder
from ..data.targets import AlignmentConfig, Target
from .config import FoldConfig
from .stages import ComplexTarget, GapTarget, ModelSpec

__all__ = ["forget_outputs", "is_complete", "model_fingerprint", "read_record", "target_fingerprint"]


def read_record(target: Target, output_dir: str | Path) -> dict[str, Any] | None:
    """The target's `timings.json` when it and every file it lists exist, else None."""
    record_path = Path(output_dir) / target.name / "timings.json"
    if not record_path.exists():
        return None
    try:
        record = json.loads(record_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not all((record_path.parent / f).exists() for f in record.get("files", [])):
        return None
    return record


def is_complete(target: Target, output_dir: str | Path, fingerprint: dict[str, Any] | None = None) -> bool:
    """True when the target's `timings.json` exists and every file it lists exists; with `fingerprint`,
    also when the outputs were made from the same inputs (`target_fingerprint`)."""
    record = read_record(target, output_dir)
    if record is None:
        return False
    return fingerprint is None or not fp.diff(record.get("fingerprint"), fingerprint)


def _param_entry(spec: ModelSpec) -> dict[str, Any]:
    kept = {"save_outputs": True} if spec.keep_outputs else {}  # a cached prediction without them is redone
    if spec.param_path is None:
        return {"name": spec.model_name, "params": "random", "tiny": spec.tiny, "weight_seed": spec.seed, **kept}
    return {"name": spec.model_name, "params": fp.file_digest(spec.param_path), **kept}


def _alignment_entry(target: Target, a: AlignmentConfig) -> dict[str, Any]:
    if a.precomputed_dir is not None:
        mode = "precomputed, single sequence" if a.single_sequence else "precomputed"
        if isinstance(target, ComplexTarget):  # every chain's folder (uniprot_hits.sto included)
            folders = dict.fromkeys(c.name for c in target.complex.chains)
            return {"mode": mode, "files": {n: fp.folder_digest(alignment_folder(a.precomputed_dir, n))
                                            for n in folders}}
        if isinstance(target, GapTarget):  # every record's folder
            return {"mode": mode, "files": {c.name: fp.folder_digest(alignment_folder(a.precomputed_dir, c.name))
                                            for c in target.chains}}
        return {"mode": mode, "files": fp.folder_digest(alignment_folder(a.precomputed_dir, target.name))}
    if a.single_sequence or not a.runs_tools:
        return {"mode": "single_sequence"}
    dbs = {k: getattr(a, k) for k in ("uniref90_database_path", "mgnify_database_path", "bfd_database_path",
                                        "uniref30_database_path", "pdb70_database_path")}
    if isinstance(target, ComplexTarget) and a.uniprot_database_path:
        dbs["uniprot_database_path"] = a.uniprot_database_path
    return {"mode": "search", **{k: str(Path(v).resolve()) if v else None for k, v in dbs.items()}}


def target_fingerprint(target: Target, cfg: FoldConfig) -> dict[str, Any]:
    """What a target's outputs are made from (module `fastfold.data.fingerprint`): compared on a rerun."""
    a = cfg.alignment
    templates = None
    if a.template_mmcif_dir:
        templates = {"mmcif_dir": str(Path(a.template_mmcif_dir).resolve()), "max_template_date": a.max_template_date,
                     "kalign": a.kalign_binary_path}
        if a.obsolete_pdbs_path:
            templates["obsolete"] = fp.file_digest(a.obsolete_pdbs_path)
    relax = None
    if cfg.relax is not None:  # the OpenMM platform is left out: where it runs, not what it computes
        relax = dataclasses.asdict(cfg.relax) if dataclasses.is_dataclass(cfg.relax) else {"config": repr(cfg.relax)}
        relax.pop("platform", None)
    out = {
        "sequence": target.sequence,
        "models": [_param_entry(s) for s in cfg.models],
        "alignments": _alignment_entry(target, a),
        "templates": templates,
        "relax": relax,
        "seed": cfg.seed,
        "num_seeds": cfg.num_seeds,
        "precision": [s.precision for s in cfg.models],
        "num_recycle": cfg.num_recycle,
        "b_factors": "100 - pLDDT" if cfg.subtract_plddt else "pLDDT",
    }
    if isinstance(target, ComplexTarget):  # every chain: its ID, name (alignment folder) and sequence
        out["sequence"] = ":".join(c.sequence for c in target.complex.chains)
        out["chains"] = [[c.chain_id, c.name, c.sequence] for c in target.complex.chains]
    if isinstance(target, GapTarget):  # AlphaFold-Gap: the records and the residue-index gap
        out["chains"] = [[i, c.name, c.sequence] for i, c in zip(target.chain_ids, target.chains)]
        out["residue_index_gap"] = target.gap
    return out


def model_fingerprint(target_fp: dict[str, Any], spec_index: int, seed: int) -> str:
    """The part of a target's fingerprint one model's prediction depends on (no relaxation), as JSON."""
    part = {k: target_fp[k] for k in ("sequence", "alignments", "templates", "num_recycle")}
    if "chains" in target_fp:
        part["chains"] = target_fp["chains"]
    part.update(model=target_fp["models"][spec_index], precision=target_fp["precision"][spec_index], seed=seed)
    return json.dumps(part, sort_keys=True)



def forget_outputs(target: Target, output_dir: str | Path, record: dict[str, Any]) -> None:
    """Remove a finished target's record and the files it lists, before redoing it with other inputs: an
    interrupted redo must not leave old outputs that look current (prediction caches carry their own
    fingerprint and stay)."""
    folder = Path(output_dir) / target.name
    (folder / "timings.json").unlink(missing_ok=True)
    for name in record.get("files", []):
        path = folder / name
        if path.parent == folder and not name.endswith("_prediction.npz"):
            path.unlink(missing_ok=True)
