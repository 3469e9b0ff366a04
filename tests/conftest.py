"""Test hygiene shared by every test: default dtype restored, leftover process groups destroyed,
the `gpu` marker skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without CUDA, Triton kernels run in the interpreter on CPU tensors. Triton reads this when a kernel is
# decorated, so it is set before any test module imports `kernels`.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture(autouse=True)
def _destroy_process_groups():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
