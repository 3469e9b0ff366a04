"""ZeRO stages 1 and 2: sharded fp32 master weights and optimizer state (stage 1) and gradients (stage 2).

Use it through `core_parallel.setup(model, optimizer, ZeroConfig(...), group)`, which returns the model
(unchanged object, cast to the compute dtype) and a `ZeroOptimizer`. See `core_parallel.zero.optimizer`
for the training loop and `core_parallel.checkpoint` for saving.
"""

from __future__ import annotations

from .config import ZeroConfig
from .optimizer import ZeroOptimizer

__all__ = ["ZeroConfig", "ZeroOptimizer"]
