"""The single entry point of core_parallel: `setup(model, optimizer, config, group)`, and checkpoints.

```python
from lowmem import core_parallel
model, optimizer = core_parallel.setup(model, optimizer, core_parallel.ZeroConfig(stage=2), group=None)
optimizer.backward(loss); optimizer.step(); optimizer.zero_grad()
core_parallel.save_checkpoint("ckpt", model, optimizer)      # folder: index.json + safetensors shards
core_parallel.load_checkpoint("ckpt", model, optimizer)      # on any number of ranks
core_parallel.consolidate_checkpoint("ckpt", "model.safetensors")
```
The config's type picks the implementation: `ZeroConfig` -> ZeRO stage 1/2 (`core_parallel.zero`),
`GeminiConfig` -> Gemini chunks (`core_parallel.gemini`). Both return an optimizer with the same interface
(`backward`, `step`, `zero_grad`, `no_sync`, `clip_grad_norm`, `loss_scaler`, `param_groups`) and the
same checkpoint format. `group=None` means the default process group, or one process when there is none.
"""

from __future__ import annotations

from typing import Any

import torch

from .checkpoint import consolidate_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["consolidate_checkpoint", "load_checkpoint", "save_checkpoint", "setup"]


def setup(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Any,
    group: Any = None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Apply the parallel strategy described by `config` to `model` and `optimizer`.

    Call it after building the optimizer over the model's parameters and before the first step.
    Returns `(model, optimizer)`: use both from then on (the model may be cast to the compute dtype).
    """
    from .zero import ZeroConfig, ZeroOptimizer

    if isinstance(config, ZeroConfig):
        return model, ZeroOptimizer(model, optimizer, config, group)
    if type(config).__module__.startswith(f"{__package__}.gemini"):
        from .gemini import setup_gemini

        return setup_gemini(model, optimizer, config, group)
    raise TypeError(f"config must be a ZeroConfig or GeminiConfig, got {type(config).__name__}")
