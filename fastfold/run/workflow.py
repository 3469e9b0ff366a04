"""The feature workflow on Ray (FastFold's `--enable_workflow`): each target's database searches run as parallel
Ray tasks, then its features are built in one more task that waits for them.

Per target (and per distinct chain of a complex, each in its own `msas/` folder), the searches of
`fastfold.data.searches.search_jobs` (jackhmmer on UniRef90 and MGnify, HHblits on BFD + UniRef30, jackhmmer on
UniProt for a complex) start together, each with its share of `AlignmentConfig.cpus` as threads and as the Ray
CPUs it reserves (`tool_cpus`: the CPUs divided among the concurrent tools, at least one each); HHsearch on PDB70
starts when the UniRef90 result it reads exists. The feature task (`fastfold.run.stages.target_features`, the one the
per-target path runs) finds every result in place, so it reads them exactly as the serial path does and the raw
features are the same arrays. A result already in the folder is not searched again (the serial path's rule). All
targets' tasks are submitted at once, so the searches of many targets interleave on the cluster's CPUs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..data.searches import SearchJob, search_jobs, tool_cpus
from ..data.targets import AlignmentConfig, Target
from .ray_session import ray_cause
from .stages import ComplexTarget, target_features

__all__ = ["largest_node_cpus", "search_folders", "submit_target", "workflow_stream"]


def search_folders(target: Target, work_dir: str | Path) -> list[tuple[str, Path]]:
    """(query sequence, folder of its results) of every search unit of a target: the target's `msas/`, or for a
    complex each entity's first chain's `<chain name>/msas/` (where `fastfold.data.multimer` reads them)."""
    if isinstance(target, ComplexTarget):
        seen, out = set(), []
        for chain in target.complex.feature_order():
            if chain.entity_id not in seen:
                seen.add(chain.entity_id)
                out.append((chain.sequence, Path(work_dir) / chain.name / "msas"))
        return out
    return [(target.sequence, Path(work_dir) / "msas")]


def _search(job: SearchJob, cpus: int, *after: Any) -> tuple[float, float]:
    """One search (a Ray task): (start, end) wall-clock times. `after`: the results this one waits for."""
    start = time.time()
    Path(job.output).parent.mkdir(parents=True, exist_ok=True)
    job.run(cpus)
    return start, time.time()


def _features(target: Target, cfg: AlignmentConfig, work_dir: str, with_templates: bool,
              *searches: tuple[float, float]) -> tuple[dict[str, Any], float]:
    """The target's raw features once its searches are done (a Ray task); the seconds count from the first
    search's start."""
    raw, seconds = target_features(target, cfg, work_dir, with_templates)
    if searches:
        seconds = time.time() - min(start for start, _ in searches)
    return raw, seconds


_REMOTE: dict[str, Any] = {}


def _remote(ray, fn) -> Any:
    if fn.__name__ not in _REMOTE:
        _REMOTE[fn.__name__] = ray.remote(max_retries=0)(fn)
    return _REMOTE[fn.__name__]


def largest_node_cpus(ray) -> int:
    """CPUs of the cluster's largest live node (a task asking for more could never be scheduled)."""
    cpus = [int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    return max([c for c in cpus if c > 0], default=1)


def submit_target(ray, target: Target, cfg: AlignmentConfig, work_dir: str, with_templates: bool,
                  max_cpus: int, **options: Any) -> Any:
    """Submit one target's searches and its feature task; returns the feature task's ref (`(raw, seconds)`).
    `options`: Ray options of the feature task (a scheduling strategy)."""
    search, refs = _remote(ray, _search), []
    if cfg.runs_tools:
        for sequence, folder in search_folders(target, work_dir):
            jobs = search_jobs(sequence, cfg, folder)
            first = [j for j in jobs if j.after is None]
            share = min(tool_cpus(cfg.cpus, len(first)), max_cpus)
            by_name = {j.name: search.options(num_cpus=share).remote(j, share) for j in first}
            for j in jobs:
                if j.after is not None:
                    waits = [by_name[j.after]] if j.after in by_name else []
                    by_name[j.name] = search.options(num_cpus=1).remote(j, 1, *waits)
            refs += by_name.values()
    return _remote(ray, _features).options(num_cpus=1, **options).remote(target, cfg, work_dir, with_templates,
                                                                          *refs)


def workflow_stream(ray, targets: list[Target], cfg: AlignmentConfig, work_dirs: dict[str, str],
                    with_templates: bool) -> Iterator[tuple[Target, Any, float]]:
    """Yield (target, raw features or the exception, seconds) as each target's features are ready; every
    target's searches are submitted first, so they interleave."""
    max_cpus = largest_node_cpus(ray)
    pending = {submit_target(ray, t, cfg, work_dirs[t.name], with_templates, max_cpus): t for t in targets}
    while pending:
        (ref,), _ = ray.wait(list(pending), num_returns=1)
        target = pending.pop(ref)
        try:
            raw, seconds = ray.get(ref)
            yield target, raw, seconds
        except Exception as exc:  # noqa: BLE001 - one target's failure is reported, the others go on
            yield target, ray_cause(exc), 0.0
