from __future__ import annotations

import pytest
import torch

from lowmem import kernels
from tests.kernels._tolerance import check_op

LOW = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(rows: tuple[int, ...], n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, n, generator=g, dtype=torch.float64) * 3 + 1
    w = torch.randn(n, generator=g, dtype=torch.float64)
    b = torch.randn(n, generator=g, dtype=torch.float64)
    return x, w, b


@pytest.mark.parametrize("n", [1, 7, 33, 130, 1031])
@pytest.mark.parametrize("dtype", LOW)
def test_triton_layer_norm(n, dtype):
    rows = (3, 5) if n < 1000 else (2,)
    x, w, b = _inputs(rows, n, seed=n)
    check_op(kernels.layer_norm, kernels.layer_norm_reference, (x, w, b), {}, dtype, kernels.use_backend("triton"))


@pytest.mark.parametrize("n", [1, 7, 130, 3000])
@pytest.mark.parametrize("dtype", [torch.float64, *LOW])
def test_cpu_layer_norm(n, dtype):
    x, w, b = _inputs((4, 9), n, seed=100 + n)
    check_op(kernels.layer_norm, kernels.layer_norm_reference, (x, w, b), {}, dtype, kernels.use_backend("auto"))


@pytest.mark.parametrize("backend", ["triton", "auto", "torch"])
def test_without_weight_and_bias(backend):
    x, _, _ = _inputs((5,), 19, seed=7)
    ref = lambda x, **_: kernels.layer_norm_reference(x, None, None)  # noqa: E731
    check_op(lambda x: kernels.layer_norm(x, None, None), ref, (x,), {}, torch.float32, kernels.use_backend(backend))


def test_bad_weight_shape():
    with pytest.raises(ValueError, match="weight"):
        kernels.layer_norm(torch.randn(2, 4), torch.ones(5), None)


@pytest.mark.parametrize("kwargs", [{}, {"elementwise_affine": False}, {"bias": False}])
def test_module_is_drop_in(kwargs):
    ours = kernels.LayerNorm(12, eps=1e-6, **kwargs)
    theirs = torch.nn.LayerNorm(12, eps=1e-6, **kwargs)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 4, 12)
    torch.testing.assert_close(ours(x), theirs(x))


def test_module_multi_dim_shape():
    ours, theirs = kernels.LayerNorm((4, 6)), torch.nn.LayerNorm((4, 6))
    with torch.no_grad():
        ours.weight.normal_()
        ours.bias.normal_()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 4, 6, requires_grad=True)
    for backend in ("triton", "auto"):
        with kernels.use_backend(backend):
            y = ours(x)
        torch.testing.assert_close(y, theirs(x), atol=1e-5, rtol=1e-5)
        (gx,) = torch.autograd.grad((y * y).sum(), x)
        (rx,) = torch.autograd.grad((theirs(x) ** 2).sum(), x)
        torch.testing.assert_close(gx, rx, atol=1e-4, rtol=1e-4)
