"""A diffusers attention processor that runs the UNet's attention through `kernels.attention`.

It does what diffusers' `AttnProcessor2_0` does around the attention itself (group/spatial norm, the
4-D -> sequence reshape, projections, output projection, residual and rescale), and calls
`kernels.attention(q, k, v, bias=..., scale=...)` with `q: [B, H, Q, D]` for the core. The kernel backend
(`auto`, `triton`, `torch`) is a constructor argument, not a global.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.attention import attention as _kernel_attention
from ..kernels.backend import BACKENDS, use_backend

__all__ = ["ATTENTION_BACKENDS", "KernelsAttnProcessor", "set_kernels_attention"]

ATTENTION_BACKENDS = BACKENDS
"""The kernel backends (`kernels.backend.BACKENDS`), the values of `--attention_backend`."""


def _core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float,
                    backend: str) -> torch.Tensor:
    """`kernels.attention` under `backend` (the project's own kernels: a relative import, never shadowed)."""
    with use_backend(backend):
        return _kernel_attention(q, k, v, bias=bias, scale=scale)


class KernelsAttnProcessor:
    """Attention processor for `diffusers.models.attention_processor.Attention` using `kernels.attention`."""

    def __init__(self, backend: str = "auto") -> None:
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
        self.backend = backend

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """`hidden_states: [B, N, C]` or `[B, C, H, W]`; `encoder_hidden_states: [B, L, D]`; same shape out."""
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        spatial = hidden_states.ndim == 4
        if spatial:
            b, c, h, w = hidden_states.shape
            hidden_states = hidden_states.view(b, c, h * w).transpose(1, 2)
        batch, seq, _ = hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        bias = None
        if attention_mask is not None:  # diffusers' additive mask [B*H, 1|Q, L] becomes a bias [B, H, 1|Q, L]
            attention_mask = attn.prepare_attention_mask(attention_mask, seq, batch)
            bias = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key, value = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        head_dim = key.shape[-1] // attn.heads
        q, k, v = (t.view(t.shape[0], -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        out = _core_attention(q, k, v, bias, attn.scale, self.backend)
        out = out.transpose(1, 2).reshape(out.shape[0], -1, attn.heads * head_dim).to(query.dtype)
        out = attn.to_out[1](attn.to_out[0](out))
        if spatial:
            out = out.transpose(-1, -2).reshape(b, c, h, w)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def set_kernels_attention(unet: Any, backend: str = "auto") -> None:
    """Route every attention layer of `unet` through `KernelsAttnProcessor(backend)`."""
    unet.set_attn_processor(KernelsAttnProcessor(backend))
