"""Inference options: chunking, attention backend, in-place residual updates. Passed explicitly to every call.

`Layout` says how the activations of an Evoformer-like stack are spread over processes: the identity here
(one process holds everything); `fastfold.dap.DAPLayout` splits them across a DAP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ...kernels.backend import BACKENDS

__all__ = ["SINGLE_PROCESS", "ChunkSize", "InferenceOptions", "Layout", "check_chunk_size", "device_budget_bytes"]

ChunkSize = int | Literal["auto"] | None
"""A chunk size: None (no chunking), a positive int (rows per chunk) or "auto" (fit a memory budget)."""


def check_chunk_size(value: object) -> ChunkSize:
    """`value` when it is a `ChunkSize`, else `ValueError`: the one check of a chunk size, whichever holder it
    passes through (`suite fold --chunk_size`, a config file's `chunk_size`, `fastfold.run.settings.ModelSettings`,
    `ModelSpec`, `InferenceOptions`), so each refuses the same values with the same line. `True` is refused:
    a bool is an int to Python, not a chunk size."""
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ValueError(f"chunk_size must be a positive int or 'auto', got {value!r}")


CPU_BUDGET_BYTES = 256 * 2**20
"""The `chunk_size="auto"` budget on CPU (and the default of `InferenceOptions.memory_budget_bytes`)."""
CUDA_BUDGET_FRACTION = 0.25
"""Share of the device's free memory one chunk's intermediates may take on CUDA (the rest: the
activations, the parameters, the allocator's slack)."""


def device_budget_bytes(device: torch.device | str | None = None, fraction: float = CUDA_BUDGET_FRACTION) -> int:
    """The `chunk_size="auto"` budget for `device`: on CUDA `fraction` of the free device memory
    (`torch.cuda.mem_get_info`), never below the CPU budget; elsewhere `CPU_BUDGET_BYTES`.

    A fixed CPU-sized budget on a GPU chunks far finer than the memory needs (measured on an H200:
    4.3-6.5x the time for 0.14-0.19x the memory)."""
    dev = torch.device("cpu" if device is None else device)
    if dev.type != "cuda":
        return CPU_BUDGET_BYTES
    if not 0 < fraction <= 1:
        raise ValueError(f"device_budget_bytes: fraction must be in (0, 1], got {fraction!r}")
    free, _total = torch.cuda.mem_get_info(dev)
    return max(CPU_BUDGET_BYTES, int(free * fraction))
_RESIDUALS = ("out_of_place", "in_place")


@dataclass(frozen=True, kw_only=True)
class InferenceOptions:
    """How a forward pass trades memory for time; the numbers it computes do not depend on these options.

    Chunking splits attention, transitions, the outer product mean and the triangle updates along a batch
    axis, so the largest intermediate (e.g. the `[chunk, H, N, N]` attention logits) shrinks with the chunk.
    """

    chunk_size: ChunkSize = None
    """Rows per chunk: None (no chunking), a positive int, or "auto" (largest power of two whose biggest
    intermediate fits `memory_budget_bytes`)."""
    memory_budget_bytes: int = CPU_BUDGET_BYTES
    """Budget for the intermediates of one chunk (all of them alive at once, roughly) when
    `chunk_size="auto"`."""
    attention_backend: str = "auto"
    """Kernel backend for attention, softmax and LayerNorm: "auto", "triton" or "torch" (the reference)."""
    residual: str = "out_of_place"
    """Residual updates: "out_of_place" (`x = x + f(x)`, needed for autograd) or "in_place" (`x += f(x)`,
    saves one activation copy per update; inference only)."""

    def __post_init__(self) -> None:
        check_chunk_size(self.chunk_size)
        if not isinstance(self.memory_budget_bytes, int) or self.memory_budget_bytes <= 0:
            raise ValueError("InferenceOptions.memory_budget_bytes must be a positive int")
        if self.attention_backend not in BACKENDS:
            raise ValueError(
                f"InferenceOptions.attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}"
            )
        if self.residual not in _RESIDUALS:
            raise ValueError(f"InferenceOptions.residual must be one of {_RESIDUALS}, got {self.residual!r}")

    @classmethod
    def for_device(cls, device: torch.device | str | None, **fields) -> InferenceOptions:
        """Options whose `"auto"` budget fits `device` (`device_budget_bytes`) unless `memory_budget_bytes`
        is given; the other fields as passed."""
        fields.setdefault("memory_budget_bytes", device_budget_bytes(device))
        return cls(**fields)

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


class _Ready:
    """A move that has already happened: `wait()` returns its result."""

    def __init__(self, x: torch.Tensor) -> None:
        self._x = x

    def wait(self) -> torch.Tensor:
        return self._x


class Layout:
    """Where the activations of a stack live: one process holds every row (every method is the identity).

    The Evoformer, extra-MSA and template pair stacks run their one forward through a layout: they `split`
    m `[*, S, N, C_m]` and z `[*, N, N, C_z]` by rows (tensor dim -3) on entry, `move` the split between
    rows and columns (dims -3 and -2) where the next operation needs the other dim whole, `gather` what an
    operation needs from every row (a pair bias, a projection) and `gather` the outputs on exit. A parallel
    plan (`fastfold.dap.DAPLayout`) overrides these moves with collectives; the model code never imports
    `torch.distributed`. Sizes: `full_size` is the length of the dim when whole.
    """

    world: int = 1
    """Processes the activations are split across."""

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This process's shard of the whole `x` along tensor dim `dim` (a view)."""
        return x

    def gather(self, x: torch.Tensor, dim: int, full_size: int) -> torch.Tensor:
        """The whole tensor from every process's shard of `x` along `dim`."""
        return x

    def move(self, x: torch.Tensor, from_dim: int, to_dim: int, from_size: int) -> torch.Tensor:
        """`x` split along `from_dim` (whole length `from_size`) -> split along `to_dim`."""
        return x

    def move_async(self, x: torch.Tensor, from_dim: int, to_dim: int, from_size: int) -> _Ready:
        """`move`, started now; its `wait()` returns the result (so the move overlaps what runs between)."""
        return _Ready(x)


SINGLE_PROCESS = Layout()
"""The identity layout: the default of every stack."""
