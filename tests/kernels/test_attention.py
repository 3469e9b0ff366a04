from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lowmem import kernels
from tests.kernels._tolerance import check, check_op

LOW = [torch.float32, torch.float16, torch.bfloat16]

# (lead dims [*, H], Q, K, D, bias shape, mask shape)
CASES = {
    "evoformer": ((2, 2, 2), 7, 33, 16, (2, 1, 2, 7, 33), (2, 2, 1, 1, 33)),
    "ones": ((1, 1), 1, 1, 1, (1, 1, 1, 1), None),
    "bias-over-keys": ((1, 2), 130, 7, 33, (1, 2, 1, 7), (130, 1)),
    "long-keys": ((1, 1), 5, 1030, 128, (5, 1), None),
    "plain": ((2, 3), 33, 33, 64, None, None),
    "mask-folds-into-bias": ((1, 2), 9, 12, 8, (1, 1, 9, 12), (1, 1, 9, 12)),
}


def _inputs(case, seed):
    lead, n_q, n_k, d, bias_shape, mask_shape = CASES[case]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, n_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(*lead, n_k, d, generator=g, dtype=torch.float64)
    v = torch.randn(*lead, n_k, d, generator=g, dtype=torch.float64)
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=g, dtype=torch.float64)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(*mask_shape, generator=g) > 0.3
        mask.view(-1, mask_shape[-1])[0] = False  # at least one fully masked query row
    return (q, k, v, bias), mask


def _fn(q, k, v, bias, *, mask, block_q=None):
    return kernels.attention(q, k, v, bias=bias, mask=mask, block_q=block_q)


def _ref(q, k, v, bias, *, mask, block_q=None):
    return kernels.attention_reference(q, k, v, bias=bias, mask=mask)


# every dtype for the broadcast-heavy cases; two dtypes for the rest (the interpreter is slow)
TRITON_RUNS = [(c, d) for c in ("evoformer", "bias-over-keys") for d in LOW] + [
    ("ones", torch.float16), ("ones", torch.float32), ("long-keys", torch.bfloat16), ("long-keys", torch.float32),
    ("plain", torch.float16), ("plain", torch.float32)]


@pytest.mark.parametrize("case, dtype", TRITON_RUNS)
def test_triton_attention(case, dtype):
    tensors, mask = _inputs(case, seed=len(case))
    check_op(_fn, _ref, tensors, {"mask": mask}, dtype, kernels.use_backend("triton"))


@pytest.mark.parametrize("dtype", [torch.float64, *LOW])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_attention(case, dtype):
    tensors, mask = _inputs(case, seed=10 + len(case))
    check_op(_fn, _ref, tensors, {"mask": mask, "block_q": 3}, dtype, kernels.use_backend("auto"))


@pytest.mark.parametrize("backend", ["triton", "auto", "torch"])
def test_fully_masked_rows_are_zero(backend):
    q, k, v = (torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3))
    bias = torch.randn(3, 5, 5, requires_grad=True)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[1, :, 2] = False
    with kernels.use_backend(backend):
        out = kernels.attention(q, k, v, bias, mask)
    assert torch.equal(out[1, :, 2], torch.zeros(3, 8))
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][1, :, 2], torch.zeros(3, 8))


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op creates."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest_tensor(fn, q, k, v, bias, mask, block_q=None):
    with _LargestTensor() as mode:
        out = fn(q, k, v, bias, mask=mask, block_q=block_q)
        torch.autograd.grad(out.sum(), (q, k, v, bias))
    return mode.largest


def test_cpu_path_never_holds_the_score_matrix():
    lead, n_q, n_k, d, block = (2, 2), 64, 48, 8, 8
    q = torch.randn(*lead, n_q, d, requires_grad=True)
    k, v = torch.randn(*lead, n_k, d, requires_grad=True), torch.randn(*lead, n_k, d, requires_grad=True)
    bias = torch.randn(lead[1], n_q, n_k, requires_grad=True)  # broadcast over the batch dim
    mask = torch.rand(lead[0], 1, 1, n_k) > 0.2
    scores = 4 * n_q * n_k
    naive = _largest_tensor(_ref, q, k, v, bias, mask)
    assert naive >= scores  # the measurement sees a materialised score matrix
    ours = _largest_tensor(_fn, q, k, v, bias, mask, block_q=block)
    # the bias and its gradient are [H, Q, K]: half the score matrix; blocks are 4 * block * K
    assert ours <= max(bias.numel(), 4 * block * n_k)


def test_default_block_bounds_the_scores():
    q = torch.randn(1, 8, 4096, 32)
    block = kernels.attention.__globals__["_block_q"](q, 4096, None)
    assert 16 <= block <= 4096 // 8


@pytest.mark.parametrize(
    "shapes, match",
    [(((2, 4, 8), (2, 5, 7), (2, 5, 7), None), "do not match"), (((2, 4, 8), (2, 5, 8), (2, 5, 8), (3, 4, 5)), "bias")],
)
def test_bad_shapes(shapes, match):
    q, k, v, b = (None if s is None else torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        kernels.attention(q, k, v, bias=b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_attention_inference(case, dtype):
    """Without gradients the PyTorch path may hand the work to SDPA; same answers, masked rows zero."""
    (q, k, v, bias), mask = _inputs(case, seed=20 + len(case))
    ref64 = kernels.attention_reference(q, k, v, bias, mask)
    low = [None if t is None else t.to(dtype) for t in (q, k, v, bias)]
    with torch.no_grad():
        out = kernels.attention(*low[:3], bias=low[3], mask=mask)
    check(out, kernels.attention_reference(*low[:3], low[3], mask), ref64, "output", dtype)
    if mask is not None:
        dead = ~mask.expand(ref64.shape[:-1] + (k.shape[-2],)).any(-1)
        assert dead.any() and torch.equal(out[dead], torch.zeros_like(out[dead]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("block_bytes", [64, 4096, 1 << 22])
@pytest.mark.parametrize("case", ["evoformer", "bias-over-keys", "mask-folds-into-bias", "long-keys"])
def test_cpu_inference_blocks(case, block_bytes, dtype, monkeypatch):
    """The explicit no-grad CPU path at any block size (query rows of one slice, whole slices, everything;
    a small mask added as a -inf bias or a large one filled in): the float64 answer, dead rows zero."""
    module = kernels.attention.__globals__
    monkeypatch.setitem(module, "_CPU_BLOCK_BYTES", block_bytes)
    (q, k, v, bias), mask = _inputs(case, seed=70 + block_bytes % 7)
    ref64 = kernels.attention_reference(q, k, v, bias, mask)
    low = [None if t is None else t.to(dtype) for t in (q, k, v, bias)]
    with torch.no_grad():
        direct = module["_cpu_inference"](*low[:3], low[3], mask, q.shape[-1] ** -0.5)
        out = kernels.attention(*low[:3], bias=low[3], mask=mask)
    assert direct is not None and out.dtype == dtype
    torch.testing.assert_close(out, direct, rtol=0, atol=0)  # the public call took this path
    check(out, kernels.attention_reference(*low[:3], low[3], mask), ref64, "output", dtype)
    if mask is not None:
        dead = ~mask.expand(ref64.shape[:-1] + (k.shape[-2],)).any(-1)
        assert dead.any() and torch.equal(out[dead], torch.zeros_like(out[dead]))
