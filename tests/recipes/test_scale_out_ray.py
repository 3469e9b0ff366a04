"""Issue 37, Ray: a Ray the suite starts itself is local-only (node address 127.0.0.1, every server on loopback);
a run asking more workers x CPUs than the cluster has free is one line and exit 2 within 30 s instead of Ray
Train waiting silently; a failure Ray reports after the run finished does not fail it.

One 1-CPU Ray head runs in a child process for the module, started by `init_local_ray` with the test harness's
single-machine switch (tests/conftest.py) removed from its environment: what is checked is the product's doing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowmem.utils.errors import InputError

pytest.importorskip("ray")

SUITE = str(Path(sys.executable).parent / "suite")

_HEAD = r"""
import json, os, sys
os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
import psutil, ray
from lowmem.utils.ray_cluster import init_local_ray
ctx = init_local_ray(1, configure_logging=False)
me = psutil.Process()
pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
listen = sorted({c.laddr.ip for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid in pids})
print(json.dumps({"node": ctx.address_info["node_ip_address"], "gcs": ctx.address_info["gcs_address"],
                  "nodes": [n["NodeManagerAddress"] for n in ray.nodes()], "listen": listen}), flush=True)
sys.stdin.read()
ray.shutdown()
"""


def _env(home: Path) -> dict[str, str]:
    """Ray >= 2.52 enables token authentication on a local cluster: head and drivers share one token here (HOME
    in a temporary folder: no ~/.ray/auth_token of this machine is read or written)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    return {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "3c0a1e37" * 4, "HOME": str(home),
            "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def head(home):
    """A 1-CPU local Ray in a child process: what it reported about itself."""
    env = _env(home)
    proc = subprocess.Popen([sys.executable, "-c", _HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line, f"the Ray head did not start (exit code {proc.poll()})"
        yield json.loads(line)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_ray_the_suite_starts_is_on_the_loopback_only(head):
    assert head["node"] == "127.0.0.1" and head["nodes"] == ["127.0.0.1"], head
    assert head["gcs"].startswith("127.0.0.1:"), head
    assert head["listen"] and set(head["listen"]) <= {"127.0.0.1", "::ffff:127.0.0.1"}, head["listen"]


def test_too_few_cpus_for_num_workers_is_exit_2_within_30_s(head, home, tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([SUITE, "diffusion", "finetune", "--ray_address", head["gcs"], "--num_workers", "2",
                           "--output_dir", str(tmp_path / "out"), "--resolution", "32", "--max_train_steps", "1"],
                          capture_output=True, text=True, timeout=60, env=_env(home))
    seconds = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert seconds < 30, seconds
    line = [ln for ln in proc.stderr.splitlines() if "--num_workers 2" in ln]
    assert line and "asks for 2 workers x 1 CPU" in line[0] and "1 CPU free on 1 node" in line[0], proc.stderr[-3000:]
    assert not (tmp_path / "out" / "ray").exists() or not any((tmp_path / "out" / "ray").iterdir())


def test_workers_are_placed_per_node():
    from lowmem.utils.ray_cluster import _fits

    two = [{"CPU": 1.0}, {"CPU": 1.0}]
    assert _fits(two, 2, {"CPU": 1.0, "GPU": 0.0}) == 2
    assert _fits(two, 1, {"CPU": 2.0, "GPU": 0.0}) == 0  # 2 CPUs free in all, but not on one node
    assert _fits([{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0}], 2, {"CPU": 1.0, "GPU": 1.0}) == 1
    assert _fits([{"CPU": 0.5}, {"CPU": 0.5}], 2, {"CPU": 0.5, "GPU": 0.0}) == 2


def test_resources_wait_with_a_message_then_refuse(monkeypatch, caplog):
    from lowmem.utils import ray_cluster

    frees = iter([[{"CPU": 1.0}], [{"CPU": 1.0}], [{"CPU": 1.0}, {"CPU": 1.0}]])
    monkeypatch.setattr(ray_cluster, "_free_per_node", lambda: next(frees))
    ray_cluster.check_ray_resources(2, wait_s=10, poll_s=0.01)  # a node joins while waiting
    assert "waiting up to 10 s for the Ray cluster to free 2 workers x 1 CPU" in caplog.text
    monkeypatch.setattr(ray_cluster, "_free_per_node", lambda: [{"CPU": 4.0}])
    with pytest.raises(InputError, match=r"asks for 2 workers x 1 CPU \+ 1 GPU, the Ray cluster has 4 CPUs free"):
        ray_cluster.check_ray_resources(2, gpus=1, wait_s=0.05, poll_s=0.01)
    monkeypatch.setattr(ray_cluster, "_free_per_node", lambda: pytest.fail("nothing asked: nothing to look up"))
    ray_cluster.check_ray_resources(2, cpus=0)


class _Trainer:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def fit(self):
        if self.error is not None:
            raise self.error
        return type("Result", (), {"error": None, "metrics": {"step": 4, "note": "x"}})()


def test_a_failure_after_the_run_finished_does_not_fail_it(tmp_path, caplog):
    """A worker's node lost after the final report: Ray raises from `fit()`, rank 0 had written the finished file
    (the real file is checked by test_ray's runs). Lost before that: Ray's error, with its text, as today."""
    from lowmem.recipes.ray import _fit

    finished = tmp_path / "finished.json"
    lost = RuntimeError("WorkerGroupError: a worker's node died\nmore")
    with pytest.raises(RuntimeError, match="node died"):
        _fit(_Trainer(lost), str(finished))
    finished.write_text(json.dumps({"step": 4, "train_loss": 0.5}))
    assert _fit(_Trainer(lost), str(finished)) == {"step": 4, "train_loss": 0.5}
    assert "failure after training had finished" in caplog.text and "a worker's node died" in caplog.text
    assert _fit(_Trainer(None), str(finished)) == {"step": 4}
