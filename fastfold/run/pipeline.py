"""The scheduling of a fold run over its targets: which targets to do (resume: a target complete from the same
inputs is skipped), their features as they become ready (`feature_stream`: in this process, as local Ray tasks or
with the workflow), the models (in this process or on a DAP runtime, `dap_session`) and each target's outputs
(`fastfold.run.target`); on a Ray cluster `fastfold.run.cluster` takes over. `fold_targets` is this module's entry;
`fastfold.run.entry.fold` wraps it with the checks up front and the output layouts.

The pieces of one target are elsewhere in this package: its stages (`stages`: features, model, prediction), its
files (`outputs`, layout in `fastfold.run`'s docstring), its record and fingerprint (`resume`), its result
(`results`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..data import fingerprint as fp
from ..data.targets import Target
from .cluster import fold_on_cluster
from .config import FoldConfig, weights_remark
from .ray_session import ray_cause, ray_session, uses_ray
from .results import TargetResult, done_result, failed_result, skipped_result
from .resume import forget_outputs, read_record, target_fingerprint
from .stages import FEATURE_INFO, Models, target_features
from .target import outputs_job, predict_all
from .workflow import workflow_stream

__all__ = ["dap_session", "feature_stream", "fold_targets"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def dap_session(cfg: FoldConfig, work: bool = True):
    """The DAP runtime of a run (`cfg.devices` ranks, spawned once; NCCL with one GPU per rank when the models
    run on CUDA, gloo on CPU), or None with one device or no `work` to do."""
    if cfg.devices == 1 or not work:
        yield None
        return
    import torch

    from ..dap import DAPRuntime

    kinds = {("cuda" if torch.cuda.is_available() else "cpu") if s.device == "auto" else s.device.split(":")[0]
             for s in cfg.models}
    if len(kinds) > 1:
        raise ValueError(f"FoldConfig.models: DAP runs every model on one kind of device, got {sorted(kinds)}")
    with DAPRuntime.launch(cfg.devices, device_type=kinds.pop(), timeout_s=cfg.dap_timeout_s) as runtime:
        yield runtime


def feature_stream(targets: list[Target], cfg: FoldConfig,
                   with_templates: bool) -> Iterator[tuple[Target, Any, float]]:
    """Yield (target, raw features or the exception it raised, seconds) as each target's features are ready:
    Ray tasks when `cfg.ray_address`, `cfg.enable_workflow` (each search its own task: `fastfold.run.workflow`) or
    `cfg.num_workers > 0` with several targets, else in this process."""
    def work_dir(t: Target) -> str:
        return str(Path(cfg.output_dir) / t.name)

    if not uses_ray(cfg, len(targets)):
        for t in targets:
            try:
                raw, seconds = target_features(t, cfg.alignment, work_dir(t), with_templates)
                yield t, raw, seconds
            except Exception as exc:  # noqa: BLE001 - one target's failure is reported, the others go on
                yield t, exc, 0.0
        return
    yield from _ray_feature_stream(targets, cfg, with_templates, work_dir)


def _ray_feature_stream(targets: list[Target], cfg: FoldConfig, with_templates: bool,
                        work_dir: Callable[[Target], str]) -> Iterator[tuple[Target, Any, float]]:
    with ray_session(cfg) as ray:
        if cfg.enable_workflow:
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
                yield target, ray_cause(exc), 0.0


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
            results[t.name] = skipped_result(t, Path(cfg.output_dir) / t.name, record)
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
    (`cfg.ray_address`, one device) features and models both across its nodes (`fastfold.run.cluster`)."""
    if todo and cfg.ray_address is not None:
        if models.runtime is None:
            fold_on_cluster(todo, cfg, fingerprints, notes, results, emit, _with_templates(cfg))
            return
        logger.warning("--devices %d with --ray_address: the model runs here on the DAP ranks; only the features "
                       "are spread over the cluster", cfg.devices)
    with_templates = any(models.feature_config(s).max_templates > 0 for s in cfg.models) if todo else False
    use_ray = uses_ray(cfg, len(todo))
    with ray_session(cfg) if use_ray else contextlib.nullcontext() as ray:
        # relaxation goes to Ray too (local Ray only: a cluster's workers may not see output_dir)
        relax_remote = None
        if use_ray and cfg.relax is not None and cfg.ray_address is None:
            relax_remote = ray.remote(num_cpus=1, max_retries=0)(outputs_job)
        pending: dict[Any, Target] = {}
        for target, raw, seconds in feature_stream(todo, cfg, with_templates):
            if isinstance(raw, BaseException):
                results[target.name] = failed_result(target, raw, emit)
                continue
            info = raw.pop(FEATURE_INFO, None)
            emit("features", target)
            folder = Path(cfg.output_dir) / target.name
            target_fp = fingerprints[target.name]
            try:
                timings = {"features": seconds}
                predictions = predict_all(target, raw, cfg, models, timings, target_fp)
                emit("model", target)
                args = (target, predictions, str(folder), cfg.relax, timings, weights_remark(cfg), info, target_fp,
                        cfg.subtract_plddt, raw.get("msa"))
                if relax_remote is not None:
                    pending[relax_remote.remote(*args)] = target
                else:
                    files, _ = outputs_job(*args)
                    results[target.name] = done_result(target, folder, files, timings, notes.get(target.name, ""))
                    emit("outputs", target)
            except Exception as exc:  # noqa: BLE001 - one target's failure is reported, the others go on
                results[target.name] = failed_result(target, exc, emit)
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            target = pending.pop(ref)
            try:
                files, timings = ray.get(ref)
                folder = Path(cfg.output_dir) / target.name
                results[target.name] = done_result(target, folder, files, timings, notes.get(target.name, ""))
                emit("outputs", target)
            except Exception as exc:  # noqa: BLE001
                results[target.name] = failed_result(target, ray_cause(exc), emit)


def _with_templates(cfg: FoldConfig) -> bool:
    """Whether any model reads templates, from the presets (without building the models here)."""
    from ..model import config as model_config

    return any(s.multimer or model_config.preset(s.model_name).template.enabled for s in cfg.models)

