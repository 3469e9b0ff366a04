"""Ray for a fold run: whether it uses Ray (`uses_ray`), the session (`ray_session`: the cluster at
`FoldConfig.ray_address`, else a local Ray on 127.0.0.1), and the exception a failed task raised (`ray_cause`)."""

from __future__ import annotations

import contextlib

from ...utils import ray_cluster
from .config import FoldConfig

__all__ = ["ray_cause", "ray_session", "uses_ray"]


def uses_ray(cfg: FoldConfig, num_targets: int) -> bool:
    """Whether a run of `num_targets` targets uses Ray: on a cluster, with the workflow, or with local workers and
    several targets."""
    return num_targets > 0 and (cfg.ray_address is not None or cfg.enable_workflow
                                or (cfg.num_workers > 0 and num_targets > 1))


def _local_cpus(cfg: FoldConfig) -> int:
    """CPUs of a local Ray: `num_workers`, else (the workflow) one target's `alignment.cpus`, else 1."""
    return cfg.num_workers or (cfg.alignment.cpus if cfg.enable_workflow else 1)


@contextlib.contextmanager
def ray_session(cfg: FoldConfig):
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


def ray_cause(exc: BaseException) -> BaseException:
    """The exception a Ray task raised (Ray wraps it in a `RayTaskError` with the original as `cause`)."""
    return getattr(exc, "cause", None) or exc
