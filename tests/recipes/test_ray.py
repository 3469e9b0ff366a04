"""One Ray Train run on a private local Ray with 2 CPU workers (Ray start is slow: one run only)."""

from __future__ import annotations

import pytest

from lowmem.recipes.ray import FitJob, RayConfig, fit_on_ray
from tests._paths import tests_only_path as _tests_only_path
from tests.recipes.test_strategies import assert_close, load, make_module, reference_weights, trainer_defaults

pytest.importorskip("ray.train.lightning")


def _build_job() -> FitJob:
    kwargs = trainer_defaults(max_epochs=2)
    kwargs.pop("default_root_dir")
    return FitJob(module=make_module(), strategy="zero2", trainer_kwargs=kwargs)


def test_config_validation():
    with pytest.raises(ValueError, match="num_workers"):
        RayConfig(num_workers=0)
    with pytest.raises(ValueError, match="trainer_kwargs may not set"):
        FitJob(module=None, trainer_kwargs={"devices": 2})


def test_ray_strategy_passes_rays_check():
    from ray.train.lightning import RayDDPStrategy

    from lowmem.recipes import GeminiStrategy, ZeroStrategy
    from lowmem.recipes.ray import ray_strategy

    zero = ray_strategy("zero2_offload")
    assert isinstance(zero, ZeroStrategy) and isinstance(zero, RayDDPStrategy)
    assert zero.core_config("fp32").offload == "cpu"
    assert isinstance(ray_strategy("gemini_auto"), GeminiStrategy)
    with pytest.raises(ValueError, match="unknown strategy"):
        ray_strategy("zero3")


def test_ray_strategy_from_a_config_and_the_diffusion_job_keeps_offload_dir(tmp_path):
    """The Ray path builds the strategy from the run's config: every field (the NVMe folder included) arrives."""
    from ray.train.lightning import RayDDPStrategy

    from lowmem.core_parallel import GeminiConfig
    from lowmem.diffusion.config import FineTuneConfig
    from lowmem.recipes import GeminiStrategy
    from lowmem.recipes.diffusion.launch import _ray_job
    from lowmem.recipes.ray import ray_strategy

    config = GeminiConfig(placement="auto", offload_tier="nvme", offload_dir=str(tmp_path / "nvme"), prefetch=2)
    strategy = ray_strategy(config, collective_timeout_s=60)
    assert isinstance(strategy, GeminiStrategy) and isinstance(strategy, RayDDPStrategy)
    assert strategy.config is config and strategy.collective_timeout_s == 60
    cfg = FineTuneConfig(output_dir=str(tmp_path / "out"), strategy="gemini_nvme", offload_dir=str(tmp_path / "d"),
                         max_train_steps=1)
    job = _ray_job(cfg, cfg.parallel, 1, None, None)
    assert job.strategy == GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / "d"),
                                        offload_param_frac=1.0, offload_optim_frac=1.0)
    assert _ray_job(FineTuneConfig(output_dir=str(tmp_path / "o2")), None, 1, None, None).strategy == "ddp"


def test_fit_with_ray_sends_the_run_s_config_with_an_absolute_folder(tmp_path, monkeypatch):
    """Ray workers run in their own working folders: the job gets `cfg.parallel` with its NVMe folder absolute (a
    copy, every other field the same), and the config it sends pickles with its sharding config."""
    import dataclasses
    import os

    from ray import cloudpickle

    from lowmem.diffusion.config import FineTuneConfig
    from lowmem.recipes.diffusion import fit_with_ray

    monkeypatch.chdir(tmp_path)
    sent = {}
    monkeypatch.setattr("lowmem.recipes.ray.fit_on_ray", lambda build, config: sent.update(build=build))
    cfg = FineTuneConfig(output_dir="out", strategy="gemini_auto", offload_dir="nvme", ray_address="local",
                         max_train_steps=1)
    fit_with_ray(cfg)
    job_cfg, parallel = cloudpickle.loads(cloudpickle.dumps(sent["build"])).args[:2]
    assert parallel == dataclasses.replace(cfg.parallel, offload_dir=os.path.join(tmp_path, "nvme"))
    assert job_cfg.parallel == cfg.parallel and job_cfg.parallel.offload_dir == "nvme"


@pytest.mark.distributed
@pytest.mark.slow
def test_zero2_on_two_ray_workers_matches_reference(tmp_path, monkeypatch):
    from lowmem import core_parallel

    # Local Ray workers inherit the driver's environment: make `tests` importable there.
    monkeypatch.setenv("PYTHONPATH", _tests_only_path())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = RayConfig(address="local", num_workers=2, storage_path=str(tmp_path / "ray"), collective_timeout_s=120)
    result = fit_on_ray(_build_job, config)
    assert result.metrics["step"] == 4, result.metrics
    assert result.checkpoint_path is not None
    out = core_parallel.consolidate_checkpoint(result.checkpoint_path, tmp_path / "model.safetensors")
    assert_close(load(str(out)), reference_weights(epochs=2), "zero2 on Ray")
