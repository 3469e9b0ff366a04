from __future__ import annotations

import logging

import pytest
import torch

import kernels
from kernels import backend


def test_env_var_and_context_manager(monkeypatch):
    monkeypatch.setenv("SUITE_KERNEL_BACKEND", "torch")
    assert kernels.current_backend() == "torch"
    with kernels.use_backend("triton"):
        assert kernels.current_backend() == "triton"
        with kernels.use_backend("auto"):
            assert kernels.current_backend() == "auto"
        assert kernels.current_backend() == "triton"
    assert kernels.current_backend() == "torch"
    monkeypatch.delenv("SUITE_KERNEL_BACKEND")
    assert kernels.current_backend() == "auto"


def test_bad_names_raise(monkeypatch):
    with pytest.raises(ValueError, match="use_backend"):
        with kernels.use_backend("cuda"):
            pass
    monkeypatch.setenv("SUITE_KERNEL_BACKEND", "fast")
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
    with caplog.at_level(logging.WARNING, logger="kernels.backend"), kernels.use_backend("triton"):
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


def test_backend_report_names_a_bad_env_var(monkeypatch):
    monkeypatch.setenv("SUITE_KERNEL_BACKEND", "bogus")
    report = kernels.backend_report("cpu")
    assert all("SUITE_KERNEL_BACKEND" in v and "bogus" in v for v in report.values())


def test_name_shared_with_hugging_face_kernels_is_explained(monkeypatch):
    """transformers >= 5.25 imports Hugging Face's `kernels` (same import name as ours): the failure names the pin."""
    from importlib import metadata

    import kernels

    with pytest.raises(AttributeError, match="no attribute 'CUDAProperties'"):
        kernels.CUDAProperties  # noqa: B018 -- the Hugging Face package is not installed here
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda dist: "0.19.1" if dist == "kernels" else real(dist))
    with pytest.raises(ImportError, match=r"Hugging Face's `kernels` 0\.19\.1.*transformers<5\.25"):
        from kernels import CUDAProperties  # noqa: F401
    with pytest.raises(AttributeError):  # private and dunder lookups stay plain AttributeErrors
        kernels._not_there  # noqa: B018
    from kernels import attention, layer_norm  # noqa: F401 -- our own names are unaffected
