"""Chunked inference: the device-aware `chunk_size="auto"` budget (the free-memory query mocked) and the
fused inference attention that chunked calls take (a per-row mask beside a pair bias), against float64."""

from __future__ import annotations

import importlib

import pytest
import torch

from lowmem import kernels
from lowmem.fastfold.model import options as opts
from lowmem.fastfold.model.options import InferenceOptions, device_budget_bytes


def test_cpu_budget_is_the_fixed_default():
    assert device_budget_bytes("cpu") == opts.CPU_BUDGET_BYTES == InferenceOptions().memory_budget_bytes
    assert InferenceOptions.for_device("cpu", chunk_size="auto").memory_budget_bytes == opts.CPU_BUDGET_BYTES


def test_cuda_budget_follows_free_memory(monkeypatch):
    asked = []

    def mem_get_info(device):
        asked.append(torch.device(device))
        return 80 * 2**30, 141 * 2**30  # free, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert device_budget_bytes("cuda:1") == 20 * 2**30
    assert asked == [torch.device("cuda:1")]
    assert device_budget_bytes("cuda", fraction=0.5) == 40 * 2**30
    o = InferenceOptions.for_device(torch.device("cuda"), chunk_size="auto")
    assert o.memory_budget_bytes == 20 * 2**30
    # a bigger budget means fewer, larger chunks: 256 rows of 64 MiB each fit whole on the GPU, not on CPU
    assert o.rows_per_chunk(256, 64 * 2**20) is None
    assert InferenceOptions(chunk_size="auto").rows_per_chunk(256, 64 * 2**20) == 4
    # an explicit budget wins; an almost full device never goes below the CPU budget
    assert InferenceOptions.for_device("cuda", memory_budget_bytes=2**20).memory_budget_bytes == 2**20
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**20, 141 * 2**30))
    assert device_budget_bytes("cuda") == opts.CPU_BUDGET_BYTES
    with pytest.raises(ValueError, match="fraction"):
        device_budget_bytes("cuda", fraction=0)


@pytest.mark.parametrize("lead", [(6,), (2, 3)])
def test_sliced_inference_attention_matches_float64(lead, monkeypatch):
    """bias [1.., H, Q, K] and mask [*, 1, 1, K] widen when combined: SDPA by slices of the leading dims
    (a tiny slice budget forces several), fully masked rows give zeros."""
    attention_module = importlib.import_module(kernels.__name__ + ".attention")
    monkeypatch.setattr(attention_module, "_CHUNK_BYTES", 2 * 3 * 5 * 7 * 4)  # two rows per slice
    # the SDPA path (bf16/fp16 on CPU, CUDA without Triton), not the explicit fp32 CPU one
    monkeypatch.setattr(attention_module, "_cpu_inference", lambda *a: None)
    g = torch.Generator().manual_seed(0)
    h, n_q, n_k, d = 3, 5, 7, 4
    q = torch.randn(*lead, h, n_q, d, generator=g)
    k, v = torch.randn(*lead, h, n_k, d, generator=g), torch.randn(*lead, h, n_k, d, generator=g)
    bias = torch.randn(h, n_q, n_k, generator=g)
    mask = torch.rand(*lead, 1, 1, n_k, generator=g) > 0.3
    mask.view(-1, n_k)[1] = False  # one row of the batch sees no key at all
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        attention_module.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw)
    )
    with torch.no_grad():
        out = kernels.attention(q, k, v, bias=bias, mask=mask)
    ref = kernels.attention_reference(q.double(), k.double(), v.double(), bias.double(), mask)
    ref = ref.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    assert len(calls) == (3 if lead == (6,) else 4)  # 2 rows per slice of the last leading dim
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    assert out.view(-1, h, n_q, d)[1].abs().max() == 0
