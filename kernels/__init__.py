"""kernels: LayerNorm, masked-bias softmax and attention with Triton kernels, fast PyTorch paths and references.

    from lowmem import kernels
    y = kernels.layer_norm(x, weight, bias)                 # x [*, N]
    p = kernels.softmax(x, mask=mask, bias=bias, scale=s)   # x [B, S, H, Q, K], mask [B, S, 1, 1, K], ...
    o = kernels.attention(q, k, v, bias=bias, mask=mask)    # q [*, H, Q, D], bias [*, H, Q, K] broadcastable
    with kernels.use_backend("torch"): ...                  # default: set_default_backend (suite: SUITE_KERNEL_BACKEND)

The kernels are torch.library custom ops, `getattr(torch.ops, kernels.OP_NAMESPACE).attention_fwd` and so on.
"""

from __future__ import annotations

import torch

from .attention import attention, attention_reference
from .backend import (
    BACKENDS,
    ENV_VAR,
    OP_NAMESPACE,
    current_backend,
    set_default_backend,
    triton_unavailable_reason,
    use_backend,
)
from .layer_norm import LayerNorm, layer_norm, layer_norm_reference
from .softmax import softmax, softmax_reference

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "LayerNorm",
    "OP_NAMESPACE",
    "attention",
    "attention_reference",
    "backend_report",
    "current_backend",
    "layer_norm",
    "layer_norm_reference",
    "set_default_backend",
    "softmax",
    "softmax_reference",
    "use_backend",
]

_CPU_PATHS = {
    "layer_norm": "cpu (F.layer_norm)",
    "softmax": "cpu (fused torch.softmax, in-place masked scores, output-only backward)",
    "attention": "cpu (chunked online-softmax over query blocks, recomputing backward; SDPA when no bias/mask"
                 " or no gradients)",
}


def backend_report(device: torch.device | str | None = None) -> dict[str, str]:
    """For each op, the implementation `auto` (or the requested backend) picks on `device`, and why.

    `device` defaults to CUDA when available, else CPU. Input-dependent fallbacks (dtype, head dim) are
    not known here; they are logged once when they happen.
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        requested = current_backend()
    except ValueError as exc:  # a bad default (SUITE_KERNEL_BACKEND): report it (kernel calls raise it)
        return {op: f"error: {exc}" for op in _CPU_PATHS}
    reason = triton_unavailable_reason(device)
    report = {}
    for op, cpu_path in _CPU_PATHS.items():
        if requested == "torch":
            report[op] = "torch (reference; requested)"
        elif reason is None and (device.type == "cuda" or requested == "triton"):
            report[op] = "triton" + (" (interpreted)" if device.type == "cpu" else "")
        elif device.type == "cuda" or requested == "triton":
            report[op] = f"{cpu_path.replace('cpu ', 'torch ', 1)} (triton unavailable: {reason})"
        else:
            report[op] = cpu_path
    return report
