"""Fold on a Ray cluster of two raylets (every node on 127.0.0.1): targets spread over both nodes' model
workers, outputs equal to a local run, the same fingerprints and resume."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lowmem.fastfold.run import AlignmentConfig, FoldConfig, ModelSpec, Prediction, Target, fold_targets

ray = pytest.importorskip("ray")

TARGETS = [Target(f"t{i}", seq) for i, seq in enumerate(["MKTAYIAKQR", "GSWLLKKAEE", "PEPTIDEKLV", "ACDEFGHIKL"])]


def _config(out: Path, **kw) -> FoldConfig:
    return FoldConfig(output_dir=str(out), models=[ModelSpec(model_name="model_1_ptm", tiny=True, device="cpu")],
                      alignment=AlignmentConfig(single_sequence=True), **kw)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                      "include_dashboard": False})
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    c.wait_for_nodes(timeout=60)
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    yield c
    ray.shutdown()
    c.shutdown()


def test_targets_spread_over_two_raylets_equal_a_local_run(cluster, tmp_path):
    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.1"} and len(ray.nodes()) == 2
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (Ray's OMP_NUM_THREADS=1): the same float sums, bit for bit
    try:
        local = fold_targets(TARGETS, _config(tmp_path / "local"))
    finally:
        torch.set_num_threads(threads)
    on_cluster = fold_targets(TARGETS, _config(tmp_path / "cluster", ray_address=cluster.address))
    assert [r.status for r in local + on_cluster] == ["done"] * 8, [r.error for r in local + on_cluster]
    assert len({r.node for r in on_cluster}) == 2  # both raylets' workers folded targets
    for t in TARGETS:
        a, b = (Prediction.load(tmp_path / side / t.name / f"{t.name}_model_1_ptm_prediction.npz")
                for side in ("local", "cluster"))
        for key in ("positions", "atom_mask", "plddt", "pae", "ptm"):
            assert np.array_equal(getattr(a, key), getattr(b, key)), (t.name, key)
        pdb = f"{t.name}_unrelaxed.pdb"
        assert (tmp_path / "local" / t.name / pdb).read_text() == (tmp_path / "cluster" / t.name / pdb).read_text()
        fp_local, fp_cluster = (json.loads((tmp_path / side / t.name / "timings.json").read_text())["fingerprint"]
                                for side in ("local", "cluster"))
        assert fp_local == fp_cluster

    # resume: a finished target is skipped by its fingerprint; one with its record removed is redone on the cluster
    (tmp_path / "cluster" / "t2" / "timings.json").unlink()
    again = fold_targets(TARGETS, _config(tmp_path / "cluster", ray_address=cluster.address))
    assert [r.status for r in again] == ["skipped", "skipped", "done", "skipped"], [r.error for r in again]
    assert again[2].node


def test_cpu_workers_round_robin_over_the_nodes(cluster, tmp_path):
    from lowmem.fastfold.run.cluster import start_workers

    workers = start_workers(ray, _config(tmp_path, ray_address=cluster.address, num_workers=3))
    nodes = [ray.get(w.node.remote(), timeout=60) for w in workers]
    assert nodes[0] == nodes[2] != nodes[1]
    for w in workers:
        ray.kill(w)


class _GpuCluster:
    """What `ray.nodes()` says of a cluster of two nodes with one GPU each (none here to start actors on)."""

    @staticmethod
    def nodes():
        return [{"Alive": True, "NodeID": n, "Resources": {"CPU": 8.0, "GPU": 1.0}} for n in ("a", "b")]

    @staticmethod
    def remote(**_):
        raise AssertionError("no worker may start when the cluster cannot hold them")


def test_more_model_workers_than_gpus_is_one_line_before_any_starts(tmp_path):
    from lowmem.fastfold.run.cluster import start_workers
    from lowmem.utils.errors import InputError

    cfg = FoldConfig(output_dir=str(tmp_path), models=[ModelSpec(model_name="model_1_ptm", tiny=True)],
                     ray_address="10.0.0.1:6379", num_workers=3)
    with pytest.raises(InputError, match=r"^--num_workers 3: the Ray cluster at 10.0.0.1:6379 has 2 GPU\(s\)"):
        start_workers(_GpuCluster, cfg)
