"""The `suite fold` flow as reusable functions: FASTA -> alignments -> features -> model -> relax -> files.

`suite fold` and the Lightning recipe (`recipes.FoldDataModule`, `recipes.AlphaFoldPredictor`,
`recipes.FoldPredictionWriter`) call these same functions, all importable from here. This module holds the run
(`FoldConfig`, `TargetResult`) and its scheduling (Ray tasks, the DAP runtime, resume); the stages of one target
live in `fastfold.stages` (features, model, prediction), its files in `fastfold.outputs`, its record and the
fingerprint a rerun compares in `fastfold.resume`:

- `read_targets(fasta)`: validated targets (`InputError` names the record and position).
- `target_raw_features(target, alignment_config, work_dir, with_templates)`: alignments (precomputed,
  tool runs, or single sequence) and templates -> raw features (`stages.target_features`, the job Ray runs per
  target, adds a complex's and the seconds; `feature_stream` yields them as they finish).
- `load_model(spec)` / `features_for_model(raw, feature_config, seed)` / `predict(model, batch, spec)`.
- `write_target_outputs(...)`: PDB, mmCIF, confidence JSON, PNG plots, relaxation, `timings.json`.
- `fold_targets(targets, config)`: the whole flow with Ray, resume and per-target failure reporting.

Complexes (AlphaFold-Multimer models, `model_N_multimer[_v2|_v3]`): `read_complex_targets(fasta)` gives one
`ComplexTarget` per complex (`fastfold.data.multimer.read_complexes`); its features are
`complex_raw_features` -> `process_multimer_features`, its outputs one PDB/mmCIF with a chain ID per chain, ipTM
and chain-pair PAE in the confidence JSON, ranking by 0.8 ipTM + 0.2 pTM.

Output layout, per target `<output_dir>/<name>/`: `<name>_<model>_unrelaxed.pdb` and
`<name>_<model>_prediction.npz` per model (the npz lets an interrupted run resume), then for the best
model (AlphaFold's ranking: mean pLDDT for monomer models, `_ptm` ones too; 0.8 ipTM + 0.2 pTM for
multimer) `<name>_unrelaxed.pdb|.cif`,
`<name>_relaxed.pdb|.cif`, `<name>_confidence.json`, `<name>_plddt.png`, `<name>_pae.png` (pTM models),
`ranking.json` and, written last, `timings.json`: a target is complete when `timings.json` lists files
that all exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..utils import ray_cluster
from .data import fingerprint as fp
from .data.targets import (
    AlignmentConfig,
    Target,
    read_alignment_dir,
    read_targets,
    run_alignment_tools,
    target_raw_features,
)
from .outputs import prediction_to_protein, write_target_outputs
from .resume import forget_outputs, is_complete, model_fingerprint, read_record, target_fingerprint
from .stages import (
    FEATURE_INFO,
    ComplexTarget,
    Models,
    ModelSpec,
    Prediction,
    features_for_model,
    load_model,
    predict,
    read_complex_targets,
    target_features,
)

__all__ = [
    "AlignmentConfig",
    "ComplexTarget",
    "FoldConfig",
    "ModelSpec",
    "Prediction",
    "Target",
    "TargetResult",
    "dap_session",
    "feature_stream",
    "features_for_model",
    "fold_targets",
    "inputs_summary",
    "is_complete",
    "load_model",
    "predict",
    "prediction_to_protein",
    "target_fingerprint",
    "read_alignment_dir",
    "read_complex_targets",
    "read_targets",
    "run_alignment_tools",
    "target_raw_features",
    "write_target_outputs",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class FoldConfig:
    """The whole run."""

    output_dir: str
    """Where the per-target folders go."""
    models: list[ModelSpec]
    """Models to run on every target (best ranked is relaxed and written under the target's name)."""
    alignment: AlignmentConfig = dataclasses.field(default_factory=AlignmentConfig)
    """MSA and template sources."""
    relax: Any = None
    """A `fastfold.relax.RelaxConfig`, or None for no relaxation."""
    overwrite: bool = False
    """Redo targets that are complete, and ignore cached predictions."""
    seed: int = 0
    """Seed of MSA sampling."""
    devices: int = 1
    """DAP ranks that share each model's Evoformer (1: this process alone, no process group). With more, one
    `fastfold.dap.DAPRuntime` serves the whole run: this process is rank 0, the other ranks are spawned once."""
    dap_timeout_s: float = 1800.0
    """Collective timeout of the DAP group: a rank that stops answering fails the run after this long."""
    num_workers: int = 0
    """Local Ray: its CPUs for alignment/feature jobs (0: in this process, one target after another). On a cluster
    (`ray_address`): the model workers (0: one per GPU, or one per node without GPUs; `fastfold.ray_fold`)."""
    ray_address: str | None = None
    """Existing Ray cluster to use instead of starting a local one: features and models both run across its nodes,
    and `output_dir` must be a folder every node sees."""
    enable_workflow: bool = False
    """Each target's database searches as parallel Ray tasks (`fastfold.workflow`, FastFold's `--enable_workflow`),
    `alignment.cpus` divided among the concurrent tools; Ray runs even for one target."""
    num_recycle: int | None = None
    """Recycling iterations; None: each model's preset (3 for the released models)."""
    num_seeds: int = 1
    """Predictions per model, MSA sampling seeds `seed`, `seed + 1`, ...; with several, labels end `_seed_<k>`."""
    subtract_plddt: bool = False
    """B-factor column holds 100 - pLDDT (OpenFold's `--subtract_plddt`) instead of pLDDT."""

    def __post_init__(self) -> None:
        if self.num_recycle is not None and self.num_recycle < 0:
            raise ValueError(f"FoldConfig.num_recycle must be >= 0, got {self.num_recycle}")
        if self.num_seeds < 1:
            raise ValueError(f"FoldConfig.num_seeds must be >= 1, got {self.num_seeds}")
        if not self.models:
            raise ValueError("FoldConfig.models must name at least one model")
        if self.devices < 1:
            raise ValueError(f"FoldConfig.devices must be >= 1, got {self.devices}")
        if not self.dap_timeout_s > 0:
            raise ValueError(f"FoldConfig.dap_timeout_s must be > 0, got {self.dap_timeout_s}")
        if self.num_workers < 0:
            raise ValueError(f"FoldConfig.num_workers must be >= 0, got {self.num_workers}")
        labels = [m.label for m in self.models]
        if len(set(labels)) != len(labels):
            raise ValueError(f"FoldConfig.models repeats a model name: {labels}")
        if len({m.multimer for m in self.models}) > 1:
            raise ValueError(f"FoldConfig.models mixes monomer and multimer models: {labels}")

    @property
    def multimer(self) -> bool:
        """The models are AlphaFold-Multimer's: targets are `ComplexTarget`s."""
        return self.models[0].multimer


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
    """The Ray node that predicted it and wrote its outputs (on a cluster, `fastfold.ray_fold`)."""


@contextlib.contextmanager
def dap_session(cfg: FoldConfig, work: bool = True):
    """The DAP runtime of a run (`cfg.devices` ranks, spawned once; NCCL with one GPU per rank when the models
    run on CUDA, gloo on CPU), or None with one device or no `work` to do."""
    if cfg.devices == 1 or not work:
        yield None
        return
    import torch

    from .dap import DAPRuntime

    kinds = {("cuda" if torch.cuda.is_available() else "cpu") if s.device == "auto" else s.device.split(":")[0]
             for s in cfg.models}
    if len(kinds) > 1:
        raise ValueError(f"FoldConfig.models: DAP runs every model on one kind of device, got {sorted(kinds)}")
    with DAPRuntime.launch(cfg.devices, device_type=kinds.pop(), timeout_s=cfg.dap_timeout_s) as runtime:
        yield runtime


# ---------------------------------------------------------------------------------------------------- flow


def _runs(cfg: FoldConfig) -> list[tuple[int, ModelSpec, str, int]]:
    """(model index, spec, output label, MSA sampling seed) of every prediction a target gets."""
    out = []
    for i, spec in enumerate(cfg.models):
        for k in range(cfg.num_seeds):
            label = spec.label if cfg.num_seeds == 1 else f"{spec.label}_seed_{cfg.seed + k}"
            out.append((i, spec, label, cfg.seed + k))
    return out


def _predict_all(target: Target, raw: dict[str, np.ndarray], cfg: FoldConfig, models: Models,
                 timings: dict[str, float], target_fp: dict[str, Any] | None = None) -> dict[str, Prediction]:
    """Every model's prediction for one target, reusing a prediction cached by an interrupted run only when
    it was made from the same inputs (its stored fingerprint)."""
    folder = Path(cfg.output_dir) / target.name
    folder.mkdir(parents=True, exist_ok=True)
    target_fp = target_fp if target_fp is not None else target_fingerprint(target, cfg)
    predictions = {}
    for index, spec, label, seed in models.held_first(_runs(cfg)):
        cache = folder / f"{target.name}_{label}_prediction.npz"
        made_from = model_fingerprint(target_fp, index, seed)
        if cache.exists() and not cfg.overwrite and Prediction.cached_fingerprint(cache) == made_from:
            predictions[label] = Prediction.load(cache)
            continue
        t0 = time.perf_counter()
        predictions[label] = models.predict(spec, raw, seed)
        predictions[label].save(cache, made_from)
        timings[f"model_{label}"] = time.perf_counter() - t0
    return {label: predictions[label] for _, _, label, _ in _runs(cfg)}


def _remark(cfg: FoldConfig) -> str:
    return "" if all(s.param_path for s in cfg.models) else "RANDOM WEIGHTS: structure is meaningless"


def _outputs_job(target: Target, predictions: dict[str, Prediction], folder: str, relax: Any,
                 timings: dict[str, float], remark: str, info: dict | None = None,
                 fingerprint: dict | None = None, subtract_plddt: bool = False,
                 msa: np.ndarray | None = None) -> tuple[list[str], dict[str, float]]:
    """What one Ray relax/output task runs."""
    files = write_target_outputs(target, predictions, folder, relax, timings, remark, info, fingerprint,
                                 subtract_plddt, msa)
    return files, timings



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


def _relax_problem(record: dict[str, Any]) -> str:
    relax = record.get("relax") or {}
    problem = relax.get("problem", "")
    return f"relax {problem}" + ("; relaxed file refused" if relax.get("refused") else "") if problem else ""


def _relax_line(record: dict[str, Any]) -> str:
    relax = record.get("relax") or {}
    if not relax or relax.get("seconds") is None:
        return ""
    passes = relax.get("outer_iterations", 0)
    return f"relax {relax['seconds']:.1f} s, {passes} pass{'' if passes == 1 else 'es'}"


def _done(target: Target, folder: Path, files: list[str], timings: dict[str, float], note: str = "") -> TargetResult:
    record = json.loads((folder / "timings.json").read_text())
    relax = _relax_line(record)
    return TargetResult(target, "done", record["mean_plddt"], sum(timings.values()), str(folder), files=files,
                        note="; ".join(x for x in (note, relax) if x), inputs=inputs_summary(record.get("inputs")),
                        relax_problem=_relax_problem(record), relax=relax)


def _uses_ray(cfg: FoldConfig, num_targets: int) -> bool:
    return num_targets > 0 and (cfg.ray_address is not None or cfg.enable_workflow
                                or (cfg.num_workers > 0 and num_targets > 1))


def _local_cpus(cfg: FoldConfig) -> int:
    """CPUs of a local Ray: `num_workers`, else (the workflow) one target's `alignment.cpus`, else 1."""
    return cfg.num_workers or (cfg.alignment.cpus if cfg.enable_workflow else 1)


@contextlib.contextmanager
def _ray_session(cfg: FoldConfig):
    """Ray for this run: the cluster at `cfg.ray_address`, else a local one with `cfg.num_workers` CPUs;
    left running when the caller had already started one."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        if cfg.ray_address:
            ray_cluster.join_ray(cfg.ray_address, log_to_driver=False)
        else:
            ray_cluster.init_local_ray(_local_cpus(cfg), configure_logging=False)  # 127.0.0.1 only
    try:
        yield ray
    finally:
        if started_here:
            ray.shutdown()



def feature_stream(targets: list[Target], cfg: FoldConfig, with_templates: bool):
    """Yield (target, raw features or the exception it raised, seconds) as each target's features are ready:
    Ray tasks when `cfg.ray_address`, `cfg.enable_workflow` (each search its own task: `fastfold.workflow`) or
    `cfg.num_workers > 0` with several targets, else in this process."""
    def work_dir(t: Target) -> str:
        return str(Path(cfg.output_dir) / t.name)

    if not _uses_ray(cfg, len(targets)):
        for t in targets:
            try:
                raw, seconds = target_features(t, cfg.alignment, work_dir(t), with_templates)
                yield t, raw, seconds
            except Exception as exc:  # noqa: BLE001 - one target's failure is reported, the others go on
                yield t, exc, 0.0
        return
    yield from _ray_feature_stream(targets, cfg, with_templates, work_dir)


_feature_stream = feature_stream  # the name recipes.fold first used


def _ray_feature_stream(targets, cfg: FoldConfig, with_templates: bool, work_dir):
    with _ray_session(cfg) as ray:
        if cfg.enable_workflow:
            from .workflow import workflow_stream

            dirs = {t.name: work_dir(t) for t in targets}
            yield from workflow_stream(ray, targets, cfg.alignment, dirs, with_templates)
            return
        remote = ray.remote(num_cpus=1, max_retries=0)(target_features)
        pending = {remote.remote(t, cfg.alignment, work_dir(t), with_templates): t for t in targets}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            target = pending.pop(done[0])
            try:
                raw, seconds = ray.get(done[0])
                yield target, raw, seconds
            except Exception as exc:  # noqa: BLE001
                yield target, _ray_cause(exc), 0.0


def _ray_cause(exc: BaseException) -> BaseException:
    return getattr(exc, "cause", None) or exc


def fold_targets(
    targets: list[Target], cfg: FoldConfig, emit: Callable[[str, Target], None] | None = None
) -> list[TargetResult]:
    """Fold every target. A finished target is skipped only when its recorded fingerprint (what made it:
    sequence, models and parameter files, alignments, templates, relaxation, seeds, precision, recycles)
    equals this run's; otherwise it is redone and its result says why (`TargetResult.note`). `cfg.overwrite`
    redoes everything. Never raises for one target's failure: its `TargetResult.status` is "failed" with the
    error. `emit(stage, target)` reports progress (stages "skipped", "features", "model", "outputs", "failed")."""
    emit = emit or (lambda stage, target: None)
    results: dict[str, TargetResult] = {}
    fingerprints = {t.name: target_fingerprint(t, cfg) for t in targets}
    notes: dict[str, str] = {}
    todo = []
    for t in targets:
        record = read_record(t, cfg.output_dir)
        changed = fp.diff(record.get("fingerprint"), fingerprints[t.name]) if record is not None else []
        if record is not None and not cfg.overwrite and not changed:
            results[t.name] = TargetResult(t, "skipped", record.get("mean_plddt"),
                                           folder=str(Path(cfg.output_dir) / t.name),
                                           note="same inputs as the finished run",
                                           inputs=inputs_summary(record.get("inputs")),
                                           relax_problem=_relax_problem(record), relax=_relax_line(record))
            emit("skipped", t)
            continue
        if record is not None:
            notes[t.name] = "redone (--overwrite)" if cfg.overwrite else f"redone: {', '.join(changed)} changed"
            logger.warning("target %s: %s since the finished run in %s", t.name, notes[t.name],
                           Path(cfg.output_dir) / t.name)
            forget_outputs(t, cfg.output_dir, record)
        todo.append(t)
    with dap_session(cfg, bool(todo)) as runtime:
        _fold_todo(todo, cfg, Models(cfg.models, cfg.num_recycle, runtime), fingerprints, notes, results, emit)
    return [results[t.name] for t in targets]


def _fold_todo(todo: list[Target], cfg: FoldConfig, models: Models, fingerprints: dict[str, dict],
               notes: dict[str, str], results: dict[str, TargetResult], emit: Callable[[str, Target], None]) -> None:
    """Features, predictions and outputs of the targets to do, into `results`: on a Ray cluster
    (`cfg.ray_address`, one device) features and models both across its nodes (`fastfold.ray_fold`)."""
    if todo and cfg.ray_address is not None:
        if models.runtime is None:
            from .ray_fold import fold_on_cluster

            fold_on_cluster(todo, cfg, fingerprints, notes, results, emit, _with_templates(cfg))
            return
        logger.warning("--devices %d with --ray_address: the model runs here on the DAP ranks; only the features "
                       "are spread over the cluster", cfg.devices)
    with_templates = any(models.feature_config(s).max_templates > 0 for s in cfg.models) if todo else False
    use_ray = _uses_ray(cfg, len(todo))
    with _ray_session(cfg) if use_ray else contextlib.nullcontext() as ray:
        # relaxation goes to Ray too (local Ray only: a cluster's workers may not see output_dir)
        relax_remote = None
        if use_ray and cfg.relax is not None and cfg.ray_address is None:
            relax_remote = ray.remote(num_cpus=1, max_retries=0)(_outputs_job)
        pending: dict[Any, Target] = {}
        for target, raw, seconds in feature_stream(todo, cfg, with_templates):
            if isinstance(raw, BaseException):
                results[target.name] = _failed(target, raw, emit)
                continue
            info = raw.pop(FEATURE_INFO, None)
            emit("features", target)
            folder = Path(cfg.output_dir) / target.name
            target_fp = fingerprints[target.name]
            try:
                timings = {"features": seconds}
                predictions = _predict_all(target, raw, cfg, models, timings, target_fp)
                emit("model", target)
                args = (target, predictions, str(folder), cfg.relax, timings, _remark(cfg), info, target_fp,
                        cfg.subtract_plddt, raw.get("msa"))
                if relax_remote is not None:
                    pending[relax_remote.remote(*args)] = target
                else:
                    files, _ = _outputs_job(*args)
                    results[target.name] = _done(target, folder, files, timings, notes.get(target.name, ""))
                    emit("outputs", target)
            except Exception as exc:  # noqa: BLE001 - one target's failure is reported, the others go on
                results[target.name] = _failed(target, exc, emit)
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            target = pending.pop(ref)
            try:
                files, timings = ray.get(ref)
                folder = Path(cfg.output_dir) / target.name
                results[target.name] = _done(target, folder, files, timings, notes.get(target.name, ""))
                emit("outputs", target)
            except Exception as exc:  # noqa: BLE001
                results[target.name] = _failed(target, _ray_cause(exc), emit)


def _with_templates(cfg: FoldConfig) -> bool:
    """Whether any model reads templates, from the presets (without building the models here)."""
    from .model import config as model_config

    return any(s.multimer or model_config.preset(s.model_name).template.enabled for s in cfg.models)


def _failed(target: Target, exc: BaseException, emit: Callable[[str, Target], None]) -> TargetResult:
    logger.error("target %s failed: %s: %s", target.name, type(exc).__name__, exc)
    logger.debug("target %s failure", target.name, exc_info=exc)
    emit("failed", target)
    return TargetResult(target, "failed", error=f"{type(exc).__name__}: {exc}")
