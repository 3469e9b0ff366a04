"""The DAP runtime: one group per run (ranks spawned once), one model at a time, rank 0's batch broadcast, and a
failing or dying rank turned into an error on rank 0 instead of a hang. `suite fold --devices 2` on the tiny
random model writes the structures and confidences of `--devices 1` (float32, within 1e-3 as the other fold
DAP tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lowmem.core_parallel import RankError
from lowmem.fastfold.dap import DAPRuntime
from lowmem.fastfold.run import stages
from lowmem.fastfold.run.stages import Prediction
from lowmem.suite.cli import main

TIMEOUT_S = 60.0
"""Collective timeout of the test runtimes: the bound on any hang."""


def _pids(runtime: DAPRuntime, _source) -> list[int] | None:
    out: list[int | None] = [None] * runtime.world
    dist.all_gather_object(out, os.getpid(), group=runtime.group)
    return out if runtime.rank == 0 else None


def _sum_of_ranks(runtime: DAPRuntime, source) -> float | None:
    batch = runtime.broadcast(source)  # rank 0's batch on every rank
    total = batch["x"] * (runtime.rank + 1)
    dist.all_reduce(total, group=runtime.group)
    return float(total.sum()) if runtime.rank == 0 else None


def _fail_on(runtime: DAPRuntime, rank: int, how: str, _source) -> None:
    if runtime.rank == rank:
        if how == "exit":
            os._exit(3)
        raise RuntimeError(f"injected failure on rank {rank}")
    dist.all_reduce(torch.ones(1), group=runtime.group)  # waits for the failing rank


@pytest.mark.distributed
def test_one_group_serves_every_call():
    with DAPRuntime.launch(2, timeout_s=TIMEOUT_S) as runtime:
        first = runtime.call(_pids)
        # rank 0's batch reaches rank 1: (1 + 2) * sum(x)
        assert runtime.call(_sum_of_ranks, source={"x": torch.arange(4.0)}) == 18.0
        assert runtime.call(_pids) == first
    assert first[0] == os.getpid() and len(set(first)) == 2
    assert not dist.is_initialized()


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_failing_rank_stops_the_runtime(how):
    with DAPRuntime.launch(2, timeout_s=TIMEOUT_S) as runtime:
        with pytest.raises(RankError, match="injected failure" if how == "raise" else "ProcessDied") as info:
            runtime.call(_fail_on, 1, how)
        assert info.value.rank == 1
        with pytest.raises(RuntimeError, match="DAP runtime has stopped"):
            runtime.call(_pids)
    assert not dist.is_initialized()


def _fold_dir(out: Path, target: str) -> dict[str, np.ndarray]:
    folder = out / target
    conf = json.loads((folder / f"{target}_confidence.json").read_text())
    preds = {p.name: Prediction.load(p) for p in sorted(folder.glob("*_prediction.npz"))}
    return {"confidence": conf, "predictions": preds, "ranking": json.loads((folder / "ranking.json").read_text())}


@pytest.mark.distributed
def test_suite_fold_two_devices_equals_one(tmp_path, monkeypatch):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">pep\nMKTAYIAKQRQISF\n>two\nGSWLLKKAPE\n")
    launches, calls, loads = [], [], []
    launch, call, load_model = DAPRuntime.launch, DAPRuntime.call, stages.load_model
    monkeypatch.setattr(DAPRuntime, "launch", classmethod(lambda cls, *a, **k: launches.append(a) or launch(*a, **k)))

    def counted_call(self, fn, *args, **kw):
        calls.append((fn.__name__, tuple(p.pid for p, _ in self._followers)))
        return call(self, fn, *args, **kw)

    monkeypatch.setattr(DAPRuntime, "call", counted_call)
    monkeypatch.setattr(stages, "load_model", lambda spec: loads.append(spec.label) or load_model(spec))
    outs = {}
    for devices in (1, 2):
        outs[devices] = tmp_path / f"out{devices}"
        argv = ["fold", str(fasta), "--output_dir", str(outs[devices]), "--single_sequence", "--no-relax",
                "--num_workers", "0", "--model_name", "model_1_ptm,model_3_ptm", "--devices", str(devices),
                "--model_device", "cpu"]
        assert main(argv) == 0
    # one runtime for the run: the same follower served every load and prediction of both targets and models
    assert len(launches) == 1
    assert sum(name == "_dap_predict" for name, _ in calls) == 4
    assert len({pids for _, pids in calls}) == 1
    # rank 0 builds each model once in the one-device run (kept); with DAP one at a time, the held model first
    # on each target: pep with model_1 (built for its feature sizes), then model_3; two with model_3, then model_1
    assert loads == ["model_1_ptm", "model_3_ptm"] + ["model_1_ptm", "model_3_ptm", "model_1_ptm"], loads
    for target in ("pep", "two"):
        one, two = _fold_dir(outs[1], target), _fold_dir(outs[2], target)
        assert one["predictions"].keys() == two["predictions"].keys() and len(one["predictions"]) == 2
        for name, a in one["predictions"].items():
            b = two["predictions"][name]
            np.testing.assert_allclose(b.positions, a.positions, atol=1e-3)
            np.testing.assert_allclose(b.plddt, a.plddt, atol=1e-3)
            np.testing.assert_allclose(b.pae, a.pae, atol=1e-3)
            assert b.ptm == pytest.approx(a.ptm, abs=1e-4)
        assert two["ranking"]["order"] == one["ranking"]["order"]
        np.testing.assert_allclose(two["confidence"]["plddt"], one["confidence"]["plddt"], atol=0.011)  # 2 decimals
