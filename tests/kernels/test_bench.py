"""The kernels benchmark compares like with like: each baseline computes what ours computes."""

from __future__ import annotations

import argparse

import pytest
import torch

from lowmem.suite.bench import kernels as bench


def _args(**over) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in over.items()])


@pytest.mark.parametrize("op", bench.OPS)
def test_baselines_match_ours(op):
    args = _args(n_res="8", heads="2", seq="16", modes="fwd")
    cases = [c for c in bench._cases(args) if c["op"] == op]
    assert {c["size"].split()[0] for c in cases} == {"evo", "diff"}
    for case in cases:
        inputs = bench._inputs(case, torch.device("cpu"), torch.float64)
        ours = bench._impl(op, "ours")(**inputs)
        for baseline in bench.BASELINES[op]:
            torch.testing.assert_close(bench._impl(op, baseline)(**inputs), ours)


def test_worker_reports_time_and_memory():
    case = bench._cases(_args(n_res="8", heads="2", ops="attention", suites="evoformer", modes="fwd+bwd"))[0]
    spec = {"case": case, "impl": "ours", "device": "cpu", "dtype": "float32", "repeat": 1}
    result = {**bench._worker({**spec, "measure": "memory"}), **bench._worker({**spec, "measure": "time"})}
    assert result["ms"] > 0 and result["extra_mib"] >= 0


def test_bad_flags_exit_2():
    with pytest.raises(SystemExit) as exc:
        _args(ops="matmul")
    assert exc.value.code == 2
