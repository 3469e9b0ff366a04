from __future__ import annotations

import logging

import pytest
import torch

from lowmem import kernels
from lowmem.kernels import backend


@pytest.fixture(autouse=True)
def _auto_after():
    yield
    kernels.set_default_backend(None)


def test_default_and_context_manager():
    kernels.set_default_backend("Torch ")
    assert kernels.current_backend() == "torch"
    with kernels.use_backend("triton"):
        assert kernels.current_backend() == "triton"
        with kernels.use_backend("auto"):
            assert kernels.current_backend() == "auto"
        assert kernels.current_backend() == "triton"
    assert kernels.current_backend() == "torch"
    kernels.set_default_backend(None)
    assert kernels.current_backend() == "auto"


def test_kernels_read_no_environment(monkeypatch):
    """The user override is read by the command line, once; a kernel call never reads the environment."""
    monkeypatch.setenv("SUITE_KERNEL_BACKEND", "torch")
    assert kernels.current_backend() == "auto"


def test_command_line_reads_the_override_once(monkeypatch, capsys):
    import json

    from lowmem.suite.cli import main

    monkeypatch.setenv("SUITE_KERNEL_BACKEND", "torch")
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["kernel_backends"]
    assert all(v.startswith("torch") for v in report.values())
    monkeypatch.setenv("SUITE_KERNEL_BACKEND", "triton")  # read at the start of main, not again
    assert kernels.current_backend() == "torch"


def _rank_backend(rank: int, world: int) -> str:
    return backend.current_backend()


def test_spawned_ranks_run_the_parents_backend():
    """`run_on_ranks` (and the DAP runtime's followers) hand the parent's default to every rank: a spawned rank
    reads no override of its own."""
    from lowmem.core_parallel import run_on_ranks

    before = backend.default_backend()
    try:
        kernels.set_default_backend("torch", source="test")
        assert run_on_ranks(_rank_backend, 2, backend="none", timeout=120) == ["torch", "torch"]
    finally:
        kernels.set_default_backend(before[0], source=before[1])


def test_bad_names_raise():
    with pytest.raises(ValueError, match="use_backend"):
        with kernels.use_backend("cuda"):
            pass
    kernels.set_default_backend("fast", source="SUITE_KERNEL_BACKEND")
    with pytest.raises(ValueError, match="SUITE_KERNEL_BACKEND"):
        kernels.layer_norm(torch.randn(2, 3), None, None)


def test_paths_chosen_on_cpu():
    cpu = torch.device("cpu")
    assert backend.select_path("softmax", cpu, None) == "cpu"
    with kernels.use_backend("torch"):
        assert backend.select_path("softmax", cpu, None) == "torch"
    with kernels.use_backend("triton"):
        assert backend.select_path("softmax", cpu, None) == "triton"  # tests run with TRITON_INTERPRET=1


def test_fallback_is_logged_once(caplog):
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="lowmem.kernels.backend"), kernels.use_backend("triton"):
        for _ in range(3):
            assert backend.select_path("attention", cpu, "head dim 999 is not supported (test)") == "cpu"
    hits = [r for r in caplog.records if "head dim 999" in r.getMessage()]
    assert len(hits) == 1


def test_fp64_under_triton_falls_back_and_matches():
    x = torch.randn(3, 5, dtype=torch.float64)
    with kernels.use_backend("triton"):
        y = kernels.softmax(x)
    torch.testing.assert_close(y, torch.softmax(x, -1))


def test_backend_report():
    report = kernels.backend_report("cpu")
    assert set(report) == {"layer_norm", "softmax", "attention"}
    assert report["attention"].startswith("cpu (chunked")
    with kernels.use_backend("torch"):
        assert all(v.startswith("torch") for v in kernels.backend_report("cpu").values())
    with kernels.use_backend("triton"):
        assert all(v == "triton (interpreted)" for v in kernels.backend_report("cpu").values())
    if not torch.cuda.is_available():
        assert "triton unavailable: CUDA is not available" in kernels.backend_report("cuda")["attention"]


def test_backend_report_names_a_bad_env_var(monkeypatch, capsys):
    import json

    from lowmem.suite.cli import main

    monkeypatch.setenv("SUITE_KERNEL_BACKEND", "bogus")
    assert main(["env", "--json"]) == 0
    assert all("SUITE_KERNEL_BACKEND" in v and "bogus" in v
               for v in json.loads(capsys.readouterr().out)["kernel_backends"].values())
    report = kernels.backend_report("cpu")
    assert all("SUITE_KERNEL_BACKEND" in v and "bogus" in v for v in report.values())


def test_import_and_cpu_paths_import_neither_triton_nor_dynamo():
    """Importing the model and running the kernels' PyTorch paths on CPU without gradients (no interpreter)
    must not import Triton (~90 MiB resident) or Dynamo (~160 MiB, ~1 s): every inference would pay for
    them. (A call that needs autograd goes through the custom ops, whose first call imports Dynamo.)"""
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from lowmem import kernels\n"
        "import lowmem.fastfold.model\n"
        "q = torch.randn(2, 3, 5, 4)\n"
        "kernels.attention(q, q, q, bias=torch.randn(3, 5, 5), mask=torch.rand(2, 1, 1, 5) > 0.3)\n"
        "kernels.softmax(q, bias=q, mask=q > 0)\n"
        "kernels.layer_norm(q, torch.ones(4), torch.zeros(4))\n"
        "kernels.attention(q, q, q, bias=torch.randn(3, 5, 5), block_q=2)\n"
        "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_select_path_carries_dynamos_constant_mark():
    """select_path is marked for Dynamo without importing it; the mark must be the one Dynamo's own
    decorator sets (if a torch release changes it, this fails before compiled graphs silently break)."""
    import torch._dynamo

    def probe():
        return 0

    marked = torch._dynamo.assume_constant_result(probe)
    extra = set(vars(marked)) - {"__wrapped__"}
    assert extra == {"_dynamo_marked_constant"}
    assert getattr(backend.select_path, "_dynamo_marked_constant", False) is True
