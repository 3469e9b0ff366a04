"""Gemini on CUDA against plain torch AdamW on the same model and data: the loss of each of 5 steps, with the
chunks on the device, with master weights and Adam state in the CPU tier (fp32: within 1e-5 relative to
1 + |loss|), and computing in bf16 (against torch under bf16 autocast with fp32 weights: within 2e-2).
`suite bench gpu`'s checks stage runs these (`pytest -m gpu`); skipped without CUDA, where one case runs on CPU
instead, so that the check's own code is tested before a GPU is lent."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lowmem import core_parallel

TIER = {"offload_tier": "cpu", "offload_param_frac": 1.0, "offload_optim_frac": 1.0}
CASES = {"fp32 chunks on the device": ({}, False, 1e-5), "fp32 CPU tier": (TIER, False, 1e-5),
         "bf16 compute": ({"precision": "bf16"}, True, 2e-2)}


def losses(device: torch.device, config: core_parallel.GeminiConfig | None, autocast: bool,
           steps: int = 5) -> list[float]:
    """Loss of each of `steps` AdamW steps on fixed data: plain torch (`config` None) or through Gemini."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.LayerNorm(96), nn.Linear(96, 33), nn.GELU(),
                          nn.Linear(33, 48)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    if config is not None:
        model, opt = core_parallel.setup(model, opt, config)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 48, generator=g).to(device), torch.randn(16, 48, generator=g).to(device)
    backward = getattr(opt, "backward", None) or (lambda loss: loss.backward())
    out = []
    for _ in range(steps):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = (model(x).float() - y).pow(2).mean()
        backward(loss)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    if hasattr(model, "gemini_manager"):
        model.gemini_manager.close()
    return out


def worst_difference(case: str, device: torch.device) -> tuple[float, float]:
    """(largest relative loss difference over the steps, the case's tolerance)."""
    extra, autocast, tol = CASES[case]
    got = losses(device, core_parallel.GeminiConfig(chunk_mb=0.01, **extra), autocast)
    want = losses(device, None, autocast)
    return max(abs(a - b) / (1 + abs(b)) for a, b in zip(got, want)), tol


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_gemini_matches_torch_adamw_on_cuda(case):
    diff, tol = worst_difference(case, torch.device("cuda"))
    assert diff <= tol, f"{case}: loss differs by {diff:.2e} > {tol:.0e}"


def test_the_gpu_check_runs_here_on_cpu():
    """The same check on CPU: its code works before a GPU is lent."""
    diff, tol = worst_difference("fp32 chunks on the device", torch.device("cpu"))
    assert diff <= tol
