"""The kernels on CUDA with Triton compiled (no interpreter, no fallback) against float64, fp32 and bf16, output
and every gradient, by the tests' rule (`_tolerance.check_op`: at most 2x torch's own error in that dtype plus a
dtype margin). `suite bench gpu`'s checks stage runs these (`pytest -m gpu`); skipped without CUDA, where one case
runs interpreted instead, so that the check's own code is tested before a GPU is lent."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from lowmem import kernels
from tests.kernels._tolerance import check_op


def _cases() -> dict[str, tuple]:
    """name -> (op, reference, float64 tensors that get gradients, masks): Evoformer's 5-D shapes with fully
    masked rows, SD's head size 40 without bias, key padding at head size 64; sizes not powers of two."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    evo_mask = torch.rand(1, 3, 1, 1, 70, generator=g) > 0.2
    evo_mask[0, 0] = False
    pad_mask = torch.rand(2, 1, 1, 77, generator=g) > 0.3
    return {
        "layer_norm [3,37,129]": (kernels.layer_norm, kernels.layer_norm_reference, [t(3, 37, 129), t(129), t(129)],
                                  {}),
        "softmax evo mask+bias": (lambda x, b, mask: kernels.softmax(x, mask=mask, bias=b, scale=0.3),
                                  lambda x, b, mask: kernels.softmax_reference(x, mask, b, 0.3),
                                  [t(1, 3, 4, 37, 70), t(1, 1, 4, 37, 70)], {"mask": evo_mask}),
        "attention evo D=32 mask+bias": (lambda q, k, v, b, mask: kernels.attention(q, k, v, bias=b, mask=mask),
                                         lambda q, k, v, b, mask: kernels.attention_reference(q, k, v, b, mask),
                                         [t(1, 3, 4, 37, 32), t(1, 3, 4, 70, 32), t(1, 3, 4, 70, 32),
                                          t(1, 1, 4, 37, 70)], {"mask": evo_mask}),
        "attention sd D=40 no bias": (kernels.attention, kernels.attention_reference,
                                      [t(2, 8, 77, 40), t(2, 8, 77, 40), t(2, 8, 77, 40)], {}),
        "attention D=64 key padding": (lambda q, k, v, mask: kernels.attention(q, k, v, mask=mask),
                                       lambda q, k, v, mask: kernels.attention_reference(q, k, v, mask=mask),
                                       [t(2, 8, 100, 64), t(2, 8, 77, 64), t(2, 8, 77, 64)], {"mask": pad_mask}),
    }


def check_case(name: str, dtype: torch.dtype, device: torch.device) -> list[str]:
    """Check one case on `device` with the Triton backend; the fallback warnings the kernels logged."""
    fn, ref, tensors, masks = _cases()[name]
    handler = logging.Handler(logging.WARNING)
    seen: list[str] = []
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(kernels.__name__)
    logger.addHandler(handler)
    try:
        check_op(fn, ref, [x.to(device) for x in tensors], {k: v.to(device) for k, v in masks.items()}, dtype,
                 kernels.use_backend("triton"))
    finally:
        logger.removeHandler(handler)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(_cases()))
def test_kernel_matches_float64_on_cuda_with_triton_compiled(name, dtype):
    assert os.environ.get("TRITON_INTERPRET") != "1", "Triton interpreted: the compiled kernels are not checked"
    fallbacks = check_case(name, dtype, torch.device("cuda"))
    assert not fallbacks, fallbacks


def test_the_gpu_check_runs_here_interpreted():
    """The same check on CPU (Triton interpreted, as every test here runs it): its code works before a GPU is lent."""
    assert check_case("layer_norm [3,37,129]", torch.float32, torch.device("cpu")) == []
