"""Several optimizers under `ZeroStrategy` / `GeminiStrategy` (GANs: a generator's and a discriminator's).

Lightning trains several optimizers with manual optimization (`self.automatic_optimization = False`), where a
training step toggles one optimizer at a time:

```python
opt_g, opt_d = self.optimizers()
self.toggle_optimizer(opt_g)           # only the generator's parameters require grad now
self.manual_backward(g_loss); opt_g.step(); opt_g.zero_grad()
self.untoggle_optimizer(opt_g)
```

`core_parallel.setup(model, [opt_g, opt_d], config)` wraps each over the same model (ZeRO: one gradient reducer each;
Gemini: one set of chunks, each optimizer stepping its own parameters) and returns an `OptimizerSet`, which the
backward and the checkpoints take as one. Lightning's `toggle_optimizer` switches `requires_grad` on the parameters
in each optimizer's `param_groups`; ZeRO's groups hold its fp32 master shards instead of the model's parameters, so
under ZeRO the strategy has the module toggle the model parameters each optimizer was built over
(`ToggleModelParameters`), which is what Lightning's toggle does under ddp.
"""

from __future__ import annotations

from typing import Any

import torch

from ..utils.errors import InputError
from .precision import unwrap_optimizer

__all__ = ["ToggleModelParameters", "check_several"]


def check_several(strategy: str, optimizers: list[Any]) -> None:
    """Several optimizers must hold disjoint parameters: one line naming the first shared one."""
    owner: dict[int, int] = {}
    for k, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if owner.setdefault(id(p), k) != k:
                    raise InputError(f"{strategy}: optimizers {owner[id(p)]} and {k} of configure_optimizers share a "
                                     "parameter; each optimizer must hold its own parameters")


class ToggleModelParameters:
    """`toggle_optimizer` / `untoggle_optimizer` of a LightningModule over the model parameters each optimizer was
    built with (recorded before `core_parallel.setup`), with Lightning's semantics: toggling one optimizer switches
    `requires_grad` off for every other optimizer's parameters, untoggling restores them."""

    def __init__(self, module: Any, user_optimizers: list[Any]) -> None:
        """Record each optimizer's model parameters: call before `core_parallel.setup` swaps in master shards."""
        self.module = module
        self.params = [[p for g in opt.param_groups for p in g["params"]] for opt in user_optimizers]
        self.optimizers = list(user_optimizers)
        self._state: dict[torch.Tensor, bool] = {}

    def install(self, core_optimizers: list[Any]) -> None:
        """Replace the module's two methods (unless its class defines its own); `core_optimizers` are the wrapped
        optimizers Lightning hands the training step, in the same order."""
        self.optimizers = [*self.optimizers[: len(self.params)], *core_optimizers]
        from lightning.pytorch import LightningModule

        cls = type(self.module)
        if (cls.toggle_optimizer is LightningModule.toggle_optimizer
                and cls.untoggle_optimizer is LightningModule.untoggle_optimizer):
            self.module.__dict__["toggle_optimizer"] = self.toggle
            self.module.__dict__["untoggle_optimizer"] = self.untoggle

    def remove(self) -> None:
        for name in ("toggle_optimizer", "untoggle_optimizer"):
            self.module.__dict__.pop(name, None)

    def _index(self, optimizer: Any) -> int:
        target = unwrap_optimizer(optimizer)
        for i, opt in enumerate(self.optimizers):
            if opt is target:
                return i % len(self.params)
        raise ValueError("toggle_optimizer got an optimizer that configure_optimizers did not return")

    def toggle(self, optimizer: Any) -> None:
        i = self._index(optimizer)
        state: dict[torch.Tensor, bool] = {}
        for params in self.params:
            for p in params:
                if p not in state:
                    state[p] = p.requires_grad
                    p.requires_grad = False
        for p in self.params[i]:
            p.requires_grad = state[p]
        self._state = state

    def untoggle(self, optimizer: Any) -> None:
        i = self._index(optimizer)
        for j, params in enumerate(self.params):
            if j != i:
                for p in params:
                    if p in self._state:
                        p.requires_grad = self._state[p]
        self._state = {}
