"""Inference options: chunking, attention backend, in-place residual updates. Passed explicitly to every call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["InferenceOptions"]

_BACKENDS = ("auto", "triton", "torch")
_RESIDUALS = ("out_of_place", "in_place")


@dataclass(frozen=True, kw_only=True)
class InferenceOptions:
    """How a forward pass trades memory for time; the numbers it computes do not depend on these options.

    Chunking splits attention, transitions, the outer product mean and the triangle updates along a batch
    axis, so the largest intermediate (e.g. the `[chunk, H, N, N]` attention logits) shrinks with the chunk.
    """

    chunk_size: int | str | None = None
    """Rows per chunk: None (no chunking), a positive int, or "auto" (largest power of two whose biggest
    intermediate fits `memory_budget_bytes`)."""
    memory_budget_bytes: int = 256 * 2**20
    """Budget for the intermediates of one chunk (all of them alive at once, roughly) when
    `chunk_size="auto"`."""
    attention_backend: str = "auto"
    """Kernel backend for attention, softmax and LayerNorm: "auto", "triton" or "torch" (the reference)."""
    residual: str = "out_of_place"
    """Residual updates: "out_of_place" (`x = x + f(x)`, needed for autograd) or "in_place" (`x += f(x)`,
    saves one activation copy per update; inference only)."""

    def __post_init__(self) -> None:
        c = self.chunk_size
        if not (c is None or c == "auto" or (isinstance(c, int) and not isinstance(c, bool) and c > 0)):
            raise ValueError(f"InferenceOptions.chunk_size must be None, 'auto' or a positive int, got {c!r}")
        if not isinstance(self.memory_budget_bytes, int) or self.memory_budget_bytes <= 0:
            raise ValueError("InferenceOptions.memory_budget_bytes must be a positive int")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(
                f"InferenceOptions.attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.residual not in _RESIDUALS:
            raise ValueError(f"InferenceOptions.residual must be one of {_RESIDUALS}, got {self.residual!r}")

    def rows_per_chunk(self, total: int, bytes_per_row: int) -> int | None:
        """Chunk length along an axis of `total` rows whose per-row intermediate takes `bytes_per_row`.

        None means "do not chunk" (the whole axis at once).
        """
        if self.chunk_size is None:
            return None
        if self.chunk_size == "auto":
            rows = max(1, self.memory_budget_bytes // max(1, bytes_per_row))
            if rows >= total:
                return None
            return 1 << (rows.bit_length() - 1)
        return None if self.chunk_size >= total else int(self.chunk_size)

    @property
    def fused_residual(self) -> bool:
        """Whether chunked modules add their update straight into the activation, chunk by chunk, instead
        of building the whole update first (in-place residuals with chunking)."""
        return self.residual == "in_place" and self.chunk_size is not None

    def add_(self, x: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """Residual update `x + update`, in place when `residual == "in_place"`. x, update: same shape."""
        if self.residual == "in_place":
            return x.add_(update)
        return x + update


DEFAULT_OPTIONS = InferenceOptions()
