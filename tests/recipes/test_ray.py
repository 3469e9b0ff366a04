"""Ray Train runs on one private local Ray (127.0.0.1, 2 CPUs, started once for the module: Ray start is slow):
"ddp" and a sharded name on 2 workers against the plain loop; a wrong address is one line within seconds."""

from __future__ import annotations

import functools
import socket
import time

import pytest
import torch

from lowmem.recipes.ray import FitJob, RayConfig, fit_on_ray
from lowmem.utils.errors import InputError
from lowmem.utils.ray_cluster import init_local_ray
from tests._paths import tests_only_path as _tests_only_path
from tests.recipes.test_strategies import assert_close, make_module, reference_weights, trainer_defaults

pytest.importorskip("ray.train.lightning")


def _build_job(strategy: str = "zero2") -> FitJob:
    kwargs = trainer_defaults(max_epochs=2)
    kwargs.pop("default_root_dir")
    return FitJob(module=make_module(), strategy=strategy, trainer_kwargs=kwargs)


@pytest.fixture(scope="module")
def local_ray():
    """One 2-CPU Ray for this module's runs (`fit_on_ray` joins it and leaves it running), on 127.0.0.1."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        # Local Ray workers inherit the driver's environment: make `tests` importable there.
        mp.setenv("PYTHONPATH", _tests_only_path())
        mp.setenv("OMP_NUM_THREADS", "1")
        init_local_ray(2, configure_logging=False)
        try:
            yield ray
        finally:
            ray.shutdown()


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
    job = _ray_job(cfg, cfg.parallel, 1, None)
    assert job.strategy == GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / "d"),
                                        offload_param_frac=1.0, offload_optim_frac=1.0)
    assert _ray_job(FineTuneConfig(output_dir=str(tmp_path / "o2")), None, 1, None).strategy == "ddp"


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


def test_every_cluster_here_is_on_the_loopback(local_ray):
    """Issue 31: a Ray a test starts listens on 127.0.0.1 only (tests/conftest.py puts Ray in single-machine mode)."""
    import shutil
    import subprocess

    assert local_ray.util.get_node_ip_address() == "127.0.0.1"
    gcs = local_ray.get_runtime_context().gcs_address
    assert gcs.startswith("127.0.0.1:"), gcs
    listening = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout if shutil.which("ss") else ""
    port = gcs.rpartition(":")[2]
    for line in listening.splitlines():
        if f":{port} " in line:
            assert "127.0.0.1" in line, line


@pytest.mark.distributed
@pytest.mark.slow
def test_zero2_on_two_ray_workers_matches_reference(tmp_path, local_ray):
    config = RayConfig(address="local", num_workers=2, storage_path=str(tmp_path / "ray"), collective_timeout_s=120)
    result = fit_on_ray(_build_job, config)
    assert result.metrics["step"] == 4, result.metrics
    assert result.checkpoint_path is not None
    # issue 37: rank 0 wrote that every rank finished (a failure Ray reports after it does not fail the run)
    assert (tmp_path / "ray" / "suite" / "finished.json").is_file()
    # the strategies' default checkpoint: one Lightning file
    weights = torch.load(result.checkpoint_path, map_location="cpu", weights_only=True)["state_dict"]
    assert_close(weights, reference_weights(epochs=2), "zero2 on Ray")


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_the_default_on_two_ray_workers_matches_reference(tmp_path, local_ray):
    """Issue 31: FitJob's default "ddp" ran into an MRO error when the workers built its strategy."""
    assert FitJob(module=None).strategy == "ddp"
    config = RayConfig(address="local", num_workers=2, storage_path=str(tmp_path / "ray"), collective_timeout_s=120)
    result = fit_on_ray(functools.partial(_build_job, "ddp"), config)
    assert result.metrics["step"] == 4, result.metrics
    assert result.checkpoint_path is not None  # Lightning's one file
    state = torch.load(result.checkpoint_path, map_location="cpu", weights_only=True)["state_dict"]
    assert_close(state, reference_weights(epochs=2), "ddp on Ray")


def test_every_strategy_name_of_ours_builds_for_ray():
    from lightning.pytorch.strategies import DDPStrategy
    from ray.train.lightning import RayDDPStrategy

    from lowmem.core_parallel.presets import PRESETS
    from lowmem.recipes.ray import ray_strategy

    for name in ("ddp", *PRESETS):
        strategy = ray_strategy(name)
        assert isinstance(strategy, RayDDPStrategy) and isinstance(strategy, DDPStrategy), name


def _one_line_within(seconds: float, fn, *args) -> str:
    start = time.monotonic()
    with pytest.raises(InputError) as info:
        fn(*args)
    assert time.monotonic() - start < seconds
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_a_closed_port_fails_fit_on_ray_at_once(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh driver, whatever ran before here
    config = RayConfig(address="127.0.0.1:1", num_workers=2)
    message = _one_line_within(30, fit_on_ray, _build_job, config)
    assert message.startswith("--ray_address 127.0.0.1:1: no answer within 3 s"), message


def test_a_port_that_is_no_ray_cluster_fails_within_seconds(monkeypatch):
    """A port that answers but is no GCS: Ray itself retries for minutes; the probe says so in one line."""
    import ray

    from lowmem.recipes.ray import connect_ray

    # the module's shared cluster may be up in this process: connect_ray would then join nothing and return
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        message = _one_line_within(30, connect_ray, address)
    assert f"--ray_address {address}: this port answers, but not as a Ray cluster's GCS" in message, message


def test_join_failures_are_one_line_with_the_token_hint(monkeypatch):
    """What `ray.init` raises after the address checked out (e.g. a token refusal the probe could not see)."""
    import ray

    from lowmem.recipes import ray as recipes_ray
    from lowmem.utils.ray_cluster import AUTH_HINT

    monkeypatch.setattr(recipes_ray, "check_ray_address", lambda address, flag: address)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def refuse(**kwargs):
        raise ray.exceptions.AuthenticationError("InvalidAuthToken: the token does not match")

    monkeypatch.setattr(ray, "init", refuse)
    message = _one_line_within(5, recipes_ray.connect_ray, "10.0.0.1:6379")
    assert message == f"--ray_address 10.0.0.1:6379: the Ray cluster refused this driver ({AUTH_HINT})"
    assert "RAY_AUTH_MODE=token" in message and "RAY_AUTH_TOKEN" in message


def test_ray_client_address_needs_grpcio(monkeypatch):
    import sys

    from lowmem.utils.errors import MissingExtraError
    from lowmem.utils.ray_cluster import check_ray_address

    monkeypatch.setitem(sys.modules, "grpc", None)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"ray://127.0.0.1:{server.getsockname()[1]}"
        with pytest.raises(MissingExtraError, match=r"a ray:// \(Ray Client\) address needs grpcio"):
            check_ray_address(address)
        with pytest.raises(InputError, match="expected host:port, ray://host:port or auto"):
            check_ray_address(address.replace("ray://", "http://"))


def test_suite_diffusion_finetune_wrong_address_is_exit_2_at_once(tmp_path, capsys):
    from lowmem.suite.cli import main

    out = tmp_path / "out"
    start = time.monotonic()
    assert main(["diffusion", "finetune", "--output_dir", str(out), "--ray_address", "127.0.0.1:1",
                 "--max_train_steps", "1"]) == 2
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err
    assert "--ray_address 127.0.0.1:1: no answer within 3 s" in err, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1 and "Traceback" not in err, err
