"""The tolerance rule of CONVENTIONS.md: error <= 2 x PyTorch's own error in the same dtype + a dtype margin.

`check(ours, ref_lowp, ref64, name)` measures both errors against the float64 result; `ref_lowp` is the
plain PyTorch reference run in the dtype under test.
"""

from __future__ import annotations

import torch

ATOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def max_err(a: torch.Tensor, ref64: torch.Tensor) -> float:
    assert a.shape == ref64.shape, (a.shape, ref64.shape)
    assert torch.isfinite(a).all(), "non-finite values"
    return (a.double() - ref64).abs().max().item() if a.numel() else 0.0


def check(ours: torch.Tensor, ref_lowp: torch.Tensor, ref64: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    ours_err = max_err(ours, ref64)
    torch_err = max_err(ref_lowp, ref64)
    bound = 2 * torch_err + ATOL[dtype]
    assert ours_err <= bound, f"{name}: error {ours_err:.3e} > 2 x torch's {torch_err:.3e} + {ATOL[dtype]:.0e}"


def leaves(*tensors: torch.Tensor | None, dtype: torch.dtype | None = None) -> list[torch.Tensor | None]:
    """Fresh leaf copies (optionally cast) that require grad; None stays None."""
    out = []
    for t in tensors:
        out.append(None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(True))
    return out


def grads(out: torch.Tensor, inputs: list[torch.Tensor | None], g: torch.Tensor) -> list[torch.Tensor | None]:
    present = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(out, present, g.to(out.dtype)))
    return [None if t is None else next(got) for t in inputs]


def check_op(fn, ref, tensors, kwargs, dtype, backend_cm, g_seed=0):
    """Run `fn` under `backend_cm` in `dtype`, `ref` in float64 and in `dtype`; compare outputs and grads.

    `tensors` are float64 tensors (or None) that get gradients; `kwargs` are passed unchanged (masks).
    """
    x64 = leaves(*tensors)
    xl = leaves(*tensors, dtype=dtype)
    xo = leaves(*tensors, dtype=dtype)
    r64 = ref(*x64, **kwargs)
    rl = ref(*xl, **kwargs)
    with backend_cm:
        out = fn(*xo, **kwargs)
    assert out.dtype == dtype
    check(out, rl, r64.detach(), "output", dtype)
    g = torch.randn(r64.shape, generator=torch.Generator().manual_seed(g_seed), dtype=torch.float64).to(r64.device)
    for i, (a, b, c) in enumerate(zip(grads(out, xo, g), grads(rl, xl, g), grads(r64, x64, g))):
        if c is not None:
            check(a, b, c, f"grad of input {i}", dtype)
