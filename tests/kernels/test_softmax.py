from __future__ import annotations

import pytest
import torch

from lowmem import kernels
from tests.kernels._tolerance import check_op

LOW = [torch.float32, torch.float16, torch.bfloat16]

# (x, mask, bias) shapes: Evoformer-style broadcasting, a bias wider than x along no dim, K of 1 and over 1000
SHAPES = [
    ((2, 2, 2, 3, 33), (2, 2, 1, 1, 33), (2, 1, 2, 3, 33)),
    ((1, 1, 1, 1, 1), (1, 1, 1, 1, 1), (1, 1, 1, 1, 1)),
    ((3, 130), None, (130,)),
    ((2, 1030), (2, 1030), None),
    ((5, 7), (5, 1), (1, 7)),
]


def _inputs(x_shape, mask_shape, bias_shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*x_shape, generator=g, dtype=torch.float64) * 2
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=g, dtype=torch.float64)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(*mask_shape, generator=g) > 0.3
        mask.view(-1, mask_shape[-1])[0] = False  # one fully masked row: zeros, not NaN
    return x, mask, bias


def _fn(x, bias, *, mask, scale):
    return kernels.softmax(x, mask=mask, bias=bias, scale=scale)


def _ref(x, bias, *, mask, scale):
    return kernels.softmax_reference(x, mask=mask, bias=bias, scale=scale)


@pytest.mark.parametrize("backend", ["triton", "auto"])
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("shapes", SHAPES, ids=[str(s[0]) for s in SHAPES])
def test_softmax(shapes, dtype, backend):
    x, mask, bias = _inputs(*shapes, seed=len(shapes[0]) + shapes[0][-1])
    check_op(_fn, _ref, (x, bias), {"mask": mask, "scale": 0.7}, dtype, kernels.use_backend(backend))


def test_softmax_fp64_cpu_path():
    x, mask, bias = _inputs(*SHAPES[0], seed=3)
    check_op(_fn, _ref, (x, bias), {"mask": mask, "scale": 1.3}, torch.float64, kernels.use_backend("auto"))


@pytest.mark.parametrize("backend", ["triton", "auto", "torch"])
def test_fully_masked_rows_are_zero(backend):
    x = torch.randn(2, 4, 9, requires_grad=True)
    mask = torch.ones(2, 1, 9, dtype=torch.bool)
    mask[1] = False
    with kernels.use_backend(backend):
        p = kernels.softmax(x, mask=mask)
    assert torch.equal(p[1], torch.zeros(4, 9))
    torch.testing.assert_close(p[0].sum(-1), torch.ones(4))
    (g,) = torch.autograd.grad(p.square().sum(), x)
    assert torch.isfinite(g).all() and torch.equal(g[1], torch.zeros(4, 9))


def test_mask_must_be_bool():
    with pytest.raises(ValueError, match="mask"):
        kernels.softmax(torch.randn(2, 3), mask=torch.ones(2, 3))
