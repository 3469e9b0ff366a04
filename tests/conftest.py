"""Test hygiene shared by every test: default dtype restored, leftover process groups destroyed,
the `gpu` marker skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every Ray a test starts (its own, a child's, a worker's) is single-machine: node address 127.0.0.1, its servers
# bound there (Ray's laptop mode; on Linux it otherwise listens on every interface). Read when ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
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
