"""Fold on a Ray cluster (`FoldConfig.ray_address`): features and model inference both scheduled across the nodes.

- Features: each target's feature task (or, with `enable_workflow`, its searches and feature task:
  `fastfold.run.workflow`) is a Ray task spread over the nodes (`SPREAD`).
- Models: `FoldWorker` actors, one per GPU when the cluster has GPUs and the models may run on CUDA, else one per
  node (no CPU reserved, so feature tasks keep the node's CPUs); `FoldConfig.num_workers` > 0 asks for that many
  instead (CPU workers round-robin over the nodes). Each worker builds its models once.
- A target whose features are ready goes to the least-loaded worker (one target at a time each), which predicts,
  relaxes and writes the outputs on its own node into `output_dir`: a folder every node and the driver see.
  The fingerprints and resume are the run's (`fastfold.run.pipeline.fold_targets` decides what to do); a prediction
  cached in the folder by an interrupted run is reused by whichever worker gets the target.
- A worker whose node is lost fails the target it held (the line names the node); the others go on without it.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...utils.errors import InputError
from .config import FoldConfig, weights_remark
from .ray_session import ray_cause, ray_session
from .results import TargetResult, done_result, failed_result
from .stages import FEATURE_INFO, Models, target_features
from .target import outputs_job, predict_all
from .workflow import largest_node_cpus, submit_target

__all__ = ["FoldWorker", "fold_on_cluster", "start_workers"]

logger = logging.getLogger(__name__)


class FoldWorker:
    """One model worker (a Ray actor): the run's models, built once, and one target at a time."""

    def __init__(self, cfg: FoldConfig) -> None:
        import ray

        self.cfg = cfg
        self.models = Models(cfg.models, cfg.num_recycle, None)
        self.node_id = ray.get_runtime_context().get_node_id()

    def node(self) -> str:
        return self.node_id

    def fold(self, target: Any, features: tuple[dict[str, Any], float], target_fp: dict[str, Any]) -> tuple:
        """Predict, relax and write one target's outputs on this node; (files, timings, node id)."""
        raw, seconds = features
        info = raw.pop(FEATURE_INFO, None)
        cfg = self.cfg
        timings = {"features": seconds}
        predictions = predict_all(target, raw, cfg, self.models, timings, target_fp)
        folder = str(Path(cfg.output_dir) / target.name)
        files, _ = outputs_job(target, predictions, folder, cfg.relax, timings, weights_remark(cfg), info, target_fp,
                                cfg.subtract_plddt, raw.get("msa"))
        return files, timings, self.node_id


def _wants_gpu(cfg: FoldConfig) -> bool:
    return any(s.device != "cpu" for s in cfg.models)


def start_workers(ray, cfg: FoldConfig) -> list[Any]:
    """The model workers of the run (module docstring); `InputError` when the cluster cannot hold them."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])
    gpus = int(sum(n["Resources"].get("GPU", 0) for n in nodes))
    where = cfg.ray_address or "this Ray"
    if not nodes:
        raise InputError(f"--ray_address {where}: the Ray cluster has no live node")
    on_gpus = bool(gpus) and _wants_gpu(cfg)
    count = cfg.num_workers or (gpus if on_gpus else len(nodes))
    if on_gpus and count > gpus:
        raise InputError(f"--num_workers {count}: the Ray cluster at {where} has {gpus} GPU(s), one per model "
                         "worker")
    actor = ray.remote(max_restarts=0, max_concurrency=1)(FoldWorker)
    if on_gpus:
        return [actor.options(num_gpus=1, num_cpus=0).remote(cfg) for _ in range(count)]
    return [actor.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        nodes[i % len(nodes)]["NodeID"], soft=False)).remote(cfg) for i in range(count)]


def _submit_features(ray, todo: list, cfg: FoldConfig, with_templates: bool) -> dict[Any, Any]:
    work_dir = {t.name: str(Path(cfg.output_dir) / t.name) for t in todo}
    if cfg.enable_workflow:
        cpus = largest_node_cpus(ray)
        return {submit_target(ray, t, cfg.alignment, work_dir[t.name], with_templates, cpus,
                              scheduling_strategy="SPREAD"): t for t in todo}
    task = ray.remote(num_cpus=1, max_retries=0, scheduling_strategy="SPREAD")(target_features)
    return {task.remote(t, cfg.alignment, work_dir[t.name], with_templates): t for t in todo}


def fold_on_cluster(todo: list, cfg: FoldConfig, fingerprints: dict[str, dict], notes: dict[str, str],
                    results: dict[str, TargetResult], emit: Callable[[str, Any], None], with_templates: bool) -> None:
    """Features, predictions and outputs of the targets to do on the Ray cluster, into `results`."""
    with ray_session(cfg) as ray:
        workers = start_workers(ray, cfg)
        features = _submit_features(ray, todo, cfg, with_templates)
        ready: collections.deque = collections.deque()
        running: dict[Any, tuple[Any, int]] = {}
        load = dict.fromkeys(range(len(workers)), 0)
        while features or ready or running:
            while ready and load and min(load.values()) == 0:
                i = min(load, key=load.get)
                target, ref = ready.popleft()
                running[workers[i].fold.remote(target, ref, fingerprints[target.name])] = (target, i)
                load[i] += 1
            if not load:  # every worker lost: the rest cannot be folded
                for target, _ in ready:
                    results[target.name] = failed_result(target, RuntimeError("every model worker was lost"), emit)
                ready.clear()
            if not features and not running:
                break
            (ref,), _ = ray.wait([*features, *running], num_returns=1)
            if ref in features:
                target = features.pop(ref)
                emit("features", target)
                ready.append((target, ref))
                continue
            target, i = running.pop(ref)
            load[i] -= 1
            folder = Path(cfg.output_dir) / target.name
            try:
                files, timings, node = ray.get(ref)
                emit("model", target)
                results[target.name] = done_result(target, folder, files, timings, notes.get(target.name, ""))
                results[target.name].node = node
                emit("outputs", target)
            except ray.exceptions.RayActorError as exc:
                del load[i]
                logger.error("model worker %d lost (%s); the run goes on with %d", i, exc, len(load))
                results[target.name] = failed_result(target, RuntimeError(f"its model worker was lost: {exc}"), emit)
            except Exception as exc:  # noqa: BLE001 - one target's failure is reported, the others go on
                results[target.name] = failed_result(target, ray_cause(exc), emit)
