"""Run any Lightning recipe on a Ray cluster through Ray Train's `TorchTrainer`.

This is what the app commands call for `--ray_address ADDRESS --num_workers N`:

```python
from lowmem.recipes.ray import FitJob, RayConfig, add_ray_arguments, fit_on_ray

add_ray_arguments(parser)                          # --ray_address, --num_workers, --ray_storage_path
...
def build_job() -> FitJob:                         # runs on every worker; must be picklable by cloudpickle
    return FitJob(
        module=StableDiffusionFineTune(...),       # any LightningModule
        datamodule=ImageCaptionData(...),          # optional
        strategy="zero2",                          # a registered name (ddp, zero1, ..., gemini_auto)
        trainer_kwargs={"max_steps": 100, "precision": "bf16-mixed", "accumulate_grad_batches": 4},
        ckpt_path=None,                            # resume from a checkpoint folder
    )

config = RayConfig.from_args(args)                 # or RayConfig(address="auto", num_workers=4, use_gpu=True)
if config is not None:                             # None when --ray_address was not given
    result = fit_on_ray(build_job, config)
    result.metrics                                 # trainer.callback_metrics of rank 0, plus epoch and step
    result.checkpoint_path                         # the final checkpoint: one Lightning file (or None)
```

How it works: `fit_on_ray` connects to the cluster (`connect_ray`: `address="local"` starts a private local Ray
with `num_workers * cpus_per_worker` CPUs, no dashboard; `"auto"` joins the running cluster and, when there
is none, starts that local Ray with a logged warning; any other address is checked first, and a closed port, a
port that is no Ray GCS or a token refusal is one `InputError` line within seconds), then a `TorchTrainer` starts
`num_workers` workers, Ray creates the torch process group (gloo on CPU, NCCL on GPU, with
`collective_timeout_s`), and each worker builds the job and a `Trainer` with the Ray cluster environment and a
Ray-compatible subclass of the named strategy (it also derives from Ray's `RayDDPStrategy`, so
`ray.train.lightning.prepare_trainer` accepts it; "ddp" is `RayDDPStrategy` itself). At the end of training
the final checkpoint is written (Lightning's one file; every rank writes its part of a folder under
`strategy_kwargs={"state_dict_type": "sharded"}`) into
`checkpoint_dir` (default: `<storage_path or a temporary folder>/<name>/final.ckpt`), and rank 0
reports it with the metrics. For more than one node `checkpoint_dir` and `storage_path` must be on a
filesystem all nodes share.

`trainer_kwargs` may not set `strategy`, `devices`, `num_nodes` or `plugins`: Ray decides those.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core_parallel.groups import GLOO, NCCL
from ..utils.errors import InputError
from ..utils.fileio import atomic_write
from ..utils.ray_cluster import (
    AUTH_HINT,
    check_ray_address,
    check_ray_resources,
    init_local_ray,
    is_auth_failure,
    join_ray,
    resolve_auto_address,
)

__all__ = ["FitJob", "RayConfig", "RayFitResult", "add_ray_arguments", "connect_ray", "fit_on_ray", "ray_strategy"]

logger = logging.getLogger(__name__)

_RESERVED = ("strategy", "devices", "num_nodes", "plugins")


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """Where and how wide to run a recipe on Ray."""

    address: str = "local"
    """Ray address: "auto" (the running cluster, else a local Ray, logged), "ray://host:10001", or "local"."""
    num_workers: int = 2
    """Number of training processes (ranks)."""
    use_gpu: bool = False
    """One GPU per worker (NCCL) instead of CPU workers (gloo)."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each worker."""
    storage_path: str | None = None
    """Ray Train's storage folder (shared across nodes for multi-node runs); None: a temporary folder."""
    name: str = "suite"
    """Name of the run under `storage_path`."""
    checkpoint_dir: str | None = None
    """Where the final checkpoint goes (a file, or a folder under state_dict_type="sharded"); None:
    `<storage_path>/<name>/final.ckpt`."""
    collective_timeout_s: float = 1800.0
    """Seconds before a collective waiting for a dead worker raises instead of hanging."""
    resource_wait_s: float = 0.0
    """Seconds to wait (with a warning) for the cluster to have `num_workers` x CPUs/GPUs free before refusing
    in one line (`utils.ray_cluster.check_ray_resources`); 0: refuse at once."""

    def __post_init__(self) -> None:
        if not self.address or not str(self.address).strip():
            raise ValueError("address must be 'local', 'auto' or a Ray address, got an empty string")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not self.cpus_per_worker > 0:
            raise ValueError(f"cpus_per_worker must be > 0, got {self.cpus_per_worker}")
        if not self.name:
            raise ValueError("name must not be empty")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.resource_wait_s < 0:
            raise ValueError(f"resource_wait_s must be >= 0, got {self.resource_wait_s}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RayConfig | None:
        """The config from `add_ray_arguments` flags; None when `--ray_address` was not given."""
        if not getattr(args, "ray_address", None):
            return None
        return cls(
            address=args.ray_address,
            num_workers=args.num_workers,
            use_gpu=bool(getattr(args, "ray_use_gpu", False)),
            storage_path=getattr(args, "ray_storage_path", None),
        )


@dataclass(kw_only=True)
class FitJob:
    """What one worker trains: built on the worker by the `build` function given to `fit_on_ray`."""

    module: Any
    """The LightningModule."""
    datamodule: Any = None
    """An optional LightningDataModule."""
    strategy: Any = "ddp"
    """A registered strategy name (ddp, zero1, zero2, zero2_offload, gemini, gemini_offload, ...), or a
    `core_parallel.ZeroConfig` / `GeminiConfig` the strategy holds (`strategy_from_config`)."""
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra constructor arguments of the strategy (e.g. {"bucket_mb": 50})."""
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `lightning.pytorch.Trainer` (max_steps, precision, callbacks, ...)."""
    ckpt_path: str | None = None
    """Checkpoint folder to resume from."""
    ignore_warnings: tuple[str, ...] = ()
    """Regular expressions of warning messages the fit silences on every worker, as a local fit of the same job
    does (`warnings.filterwarnings("ignore", message=...)`; e.g. the diffusion recipe's Lightning eval-mode
    warning about its frozen modules)."""

    def __post_init__(self) -> None:
        reserved = sorted(set(self.trainer_kwargs) & set(_RESERVED))
        if reserved:
            raise ValueError(f"trainer_kwargs may not set {reserved}: Ray decides them (use FitJob.strategy)")

    def fit(self, trainer: Any) -> None:
        """`trainer.fit` of this job's module, data and checkpoint, with `ignore_warnings` silenced."""
        with warnings.catch_warnings():
            for message in self.ignore_warnings:
                warnings.filterwarnings("ignore", message=message)
            trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=self.ckpt_path)


@dataclass(frozen=True)
class RayFitResult:
    """Outcome of `fit_on_ray`."""

    metrics: dict[str, float]
    """Rank 0's final `trainer.callback_metrics`, plus `epoch` and `step`."""
    checkpoint_path: str | None
    """The final checkpoint: Lightning's one file (the sharded strategies' folder under state_dict_type="sharded");
    None when none was written."""


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--ray_address`, `--num_workers`, `--ray_use_gpu` and `--ray_storage_path` to an app command."""
    group = parser.add_argument_group("Ray")
    group.add_argument("--ray_address", default=None, metavar="ADDRESS",
                       help="run on Ray: 'auto', 'ray://host:10001', or 'local' for a private local Ray")
    group.add_argument("--num_workers", type=int, default=2, help="number of Ray training workers (ranks)")
    group.add_argument("--ray_use_gpu", action="store_true", help="one GPU per Ray worker")
    group.add_argument("--ray_storage_path", default=None, metavar="DIR",
                       help="Ray Train storage folder (shared by all nodes for multi-node runs)")


@functools.cache
def _ray_class(base: type) -> type:
    from ray.train.lightning import RayDDPStrategy

    if issubclass(base, RayDDPStrategy):
        return base
    if issubclass(RayDDPStrategy, base):  # "ddp" (DDPStrategy): Ray's own class is the Ray-compatible one
        return RayDDPStrategy
    return type(f"Ray{base.__name__}", (base, RayDDPStrategy), {"__module__": __name__})


def ray_strategy(name: Any, **kwargs: Any) -> Any:
    """A Ray-compatible instance of the registered strategy `name` (device and sampler from Ray), or of the
    strategy holding a `ZeroConfig` / `GeminiConfig` (the object itself, as `strategy_from_config`)."""
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    from .. import recipes  # noqa: F401  (registers zero*/gemini*)
    from .strategies import strategy_class

    if not isinstance(name, str):
        return _ray_class(strategy_class(name))(config=name, **kwargs)

    if name not in StrategyRegistry:
        raise ValueError(f"unknown strategy {name!r}; registered: {', '.join(sorted(StrategyRegistry))}")
    entry = StrategyRegistry[name]
    cls = entry["strategy"]
    if not issubclass(cls, DDPStrategy):
        raise ValueError(f"strategy {name!r} ({cls.__name__}) does not run under Ray: it is not DDP-based")
    init = {**entry["init_params"], **kwargs}
    init.pop("start_method", None)  # Ray starts the processes
    return _ray_class(cls)(**init)


def _report_callback(checkpoint_dir: str, finished_file: str) -> Any:
    import lightning.pytorch as pl
    import ray.train
    from ray.train import Checkpoint

    class _ReportAtEnd(pl.Callback):
        """Write the final checkpoint on all ranks; rank 0 reports it with the metrics, then writes
        `finished_file` (every rank has reported by then: the run is complete, whatever Ray says later)."""

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            metrics.update(epoch=trainer.current_epoch, step=trainer.global_step)
            trainer.save_checkpoint(checkpoint_dir)
            if not trainer.is_global_zero:
                ray.train.report(metrics, checkpoint=None)
            elif os.path.isdir(checkpoint_dir):  # our strategies' folder (state_dict_type="sharded")
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(checkpoint_dir))
            else:  # Lightning's one file: Ray reports folders, and copies this one (SYNC upload) at once
                with tempfile.TemporaryDirectory(prefix="suite-ray-report-") as folder:
                    linked = os.path.join(folder, os.path.basename(checkpoint_dir))
                    try:
                        os.link(checkpoint_dir, linked)
                    except OSError:
                        shutil.copyfile(checkpoint_dir, linked)
                    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
            if trainer.is_global_zero:
                os.makedirs(os.path.dirname(finished_file), exist_ok=True)
                with atomic_write(finished_file) as f:
                    json.dump(metrics, f)

    return _ReportAtEnd()


def _train_worker(config: dict[str, Any]) -> None:
    """The function every Ray worker runs."""
    import lightning.pytorch as pl
    from ray.train.lightning import RayLightningEnvironment, prepare_trainer

    job: FitJob = config["build"]()
    kwargs = dict(job.trainer_kwargs)
    callbacks = [*kwargs.pop("callbacks", []), _report_callback(config["checkpoint_dir"], config["finished_file"])]
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("accelerator", "gpu" if config["use_gpu"] else "cpu")
    trainer = pl.Trainer(
        strategy=ray_strategy(job.strategy, **job.strategy_kwargs),
        devices="auto",
        plugins=[RayLightningEnvironment()],
        callbacks=callbacks,
        **kwargs,
    )
    job.fit(prepare_trainer(trainer))


def connect_ray(address: str, num_cpus: int = 1, *, flag: str = "--ray_address") -> bool:
    """Join the Ray cluster at `address` (checked first: a wrong, unreachable or token-refusing address is one
    `InputError` line within seconds, `utils.ray_cluster.check_ray_address`), or start a private local Ray with
    `num_cpus` CPUs for "local" (and for "auto" when no cluster is found, logged; both on 127.0.0.1 only,
    `utils.ray_cluster.init_local_ray`). True when this call started
    or joined Ray (the caller shuts it down); False when Ray was already initialised in this process."""
    import ray

    if ray.is_initialized():
        return False
    if address == "auto" and resolve_auto_address() is None:
        logger.warning("%s auto: no running Ray cluster found; starting a local Ray with %d CPUs", flag, num_cpus)
        address = "local"
    if address == "local":
        init_local_ray(num_cpus)
        return True
    address = check_ray_address(address, flag=flag)
    try:
        join_ray(address, log_to_driver=False)
    except Exception as exc:  # Ray's errors here are many types; the user needs the one line
        if is_auth_failure(f"{type(exc).__name__}: {exc}"):
            raise InputError(f"{flag} {address}: the Ray cluster refused this driver ({AUTH_HINT})") from None
        raise InputError(f"{flag} {address}: could not join the Ray cluster ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}; {AUTH_HINT})") from exc
    return True


def fit_on_ray(build: Callable[[], FitJob], config: RayConfig) -> RayFitResult:
    """Train the job `build()` returns on `config.num_workers` Ray workers; see the module docstring."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    started = connect_ray(config.address, max(1, int(round(config.num_workers * config.cpus_per_worker))))
    try:
        check_ray_resources(config.num_workers, cpus=config.cpus_per_worker, gpus=1.0 if config.use_gpu else 0.0,
                            wait_s=config.resource_wait_s)
        storage = os.path.abspath(config.storage_path or tempfile.mkdtemp(prefix="suite-ray-"))
        checkpoint_dir = config.checkpoint_dir or os.path.join(storage, config.name, "final.ckpt")
        finished_file = os.path.join(storage, config.name, _FINISHED)
        with contextlib.suppress(FileNotFoundError):
            os.remove(finished_file)  # a previous run's
        trainer = TorchTrainer(
            _train_worker,
            train_loop_config={"build": build, "use_gpu": config.use_gpu, "checkpoint_dir": checkpoint_dir,
                               "finished_file": finished_file},
            torch_config=TorchConfig(backend=NCCL if config.use_gpu else GLOO,
                                     timeout_s=int(config.collective_timeout_s)),
            scaling_config=ScalingConfig(num_workers=config.num_workers, use_gpu=config.use_gpu,
                                         resources_per_worker={"CPU": config.cpus_per_worker}),
            run_config=RunConfig(name=config.name, storage_path=storage),
        )
        metrics = _fit(trainer, finished_file)
    finally:
        if started:
            ray.shutdown()
    written = os.path.exists(checkpoint_dir)
    logger.info("Ray run %s finished: checkpoint %s", config.name, checkpoint_dir if written else "none")
    return RayFitResult(metrics=metrics, checkpoint_path=checkpoint_dir if written else None)


_FINISHED = "finished.json"
"""Written by rank 0 after every rank reported the end of training (under the run's storage folder)."""


def _fit(trainer: Any, finished_file: str) -> dict[str, float]:
    """Run `trainer.fit()`; a failure Ray reports after the run had finished (a worker's node lost after the final
    checkpoint and report, `finished_file` written) is logged, not raised: the run's results are complete."""
    try:
        result = trainer.fit()
    except Exception as exc:
        if not os.path.exists(finished_file):
            raise
        logger.warning("Ray reported a failure after training had finished (every rank reported its final "
                       "checkpoint); the run is complete. Ray's error: %s", str(exc).strip().splitlines()[0][:300])
        with open(finished_file) as f:
            return {k: v for k, v in json.load(f).items() if isinstance(v, int | float)}
    if result.error is not None:
        raise RuntimeError(f"Ray training failed: {result.error}") from result.error
    return {k: v for k, v in (result.metrics or {}).items() if isinstance(v, int | float)}
