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

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .checkpoint import consolidate_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["OptimizerSet", "consolidate_checkpoint", "load_checkpoint", "save_checkpoint", "setup"]


def setup(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    config: Any,
    group: Any = None,
) -> tuple[torch.nn.Module, Any]:
    """Apply the parallel strategy described by `config` to `model` and `optimizer`.

    Call it after building the optimizer over the model's parameters and before the first step.
    Returns `(model, optimizer)`: use both from then on (the model may be cast to the compute dtype).

    `optimizer` may be a list of optimizers over disjoint parameters (a GAN's generator and discriminator): the
    result is then an `OptimizerSet` of one wrapped optimizer each (`opts[0].step()`, ...), which backward and
    checkpoints take as one (`opts.backward(loss)`, `save_checkpoint(path, model, opts)`).
    """
    from .zero import ZeroConfig, ZeroOptimizer

    if isinstance(optimizer, (list, tuple)):
        if not optimizer:
            raise ValueError("setup got an empty list of optimizers")
        if isinstance(config, ZeroConfig):
            wrapped: list[Any] = []
            for opt in optimizer:
                wrapped.append(ZeroOptimizer(model, opt, config, group, siblings=wrapped))
            _check_disjoint(wrapped)
            return model, OptimizerSet(wrapped)
    if isinstance(config, ZeroConfig):
        return model, ZeroOptimizer(model, optimizer, config, group)
    if type(config).__module__.startswith(f"{__package__}.gemini"):
        from .gemini import setup_gemini

        model, wrapped = setup_gemini(model, optimizer, config, group)
        return model, OptimizerSet(wrapped) if isinstance(wrapped, list) else wrapped
    raise TypeError(f"config must be a ZeroConfig or GeminiConfig, got {type(config).__name__}")


def _check_disjoint(optimizers: list[Any]) -> None:
    seen: dict[int, int] = {}
    for k, o in enumerate(optimizers):
        for s in o._slots:
            if seen.setdefault(id(s.param), k) != k:
                raise ValueError(f"optimizers {seen[id(s.param)]} and {k} share parameter {s.name}: each optimizer "
                                 "must hold its own parameters")


class OptimizerSet(Sequence):
    """Several sharded optimizers over disjoint parameters of one model, set up together (`setup(model, [a, b])`).

    Indexing gives each wrapped optimizer (step, zero_grad, clip_grad_norm per optimizer, on its own parameters).
    The set is what the model-wide calls take: `backward(loss)` (one backward; every optimizer whose parameters
    require grad reduces its gradients), `no_sync()`, and the `core_parallel.checkpoint` protocol, so one checkpoint
    holds every optimizer's state: the param groups of all optimizers in order (`info["optimizers"]` counts each
    one's groups), each parameter's state with its own optimizer's group index offset into that list.
    """

    def __init__(self, optimizers: Sequence[Any]) -> None:
        self.optimizers = list(optimizers)
        self.process_group = self.optimizers[0].process_group

    def __getitem__(self, i: Any) -> Any:
        return self.optimizers[i]

    def __len__(self) -> int:
        return len(self.optimizers)

    @property
    def group_counts(self) -> list[int]:
        """How many param groups each optimizer has, in order."""
        return [len(o.param_groups) for o in self.optimizers]

    @property
    def param_groups(self) -> list[dict]:
        """Every optimizer's param groups, in order (the dicts themselves)."""
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def collectives(self) -> Any:
        return self.optimizers[0].collectives

    @property
    def loss_scaler(self) -> Any:
        return self.optimizers[0].loss_scaler

    def backward(self, loss: torch.Tensor) -> None:
        from .zero.optimizer import ZeroOptimizer, backward_together

        if isinstance(self.optimizers[0], ZeroOptimizer):
            backward_together(loss, self.optimizers)
            return
        if any(o.loss_scaler.enabled for o in self.optimizers):
            raise ValueError("fp16 loss scaling with several optimizers is not supported (each keeps its own "
                             "scaler); train in bf16 or fp32")
        self.optimizers[0].backward(loss)  # Gemini: one set of chunks, whose hooks reduce every gradient

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for o in self.optimizers:
                stack.enter_context(o.no_sync())
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    # -- the core_parallel.checkpoint protocol -----------------------------------------------------------------
    def sharded_state(self, *, frozen: bool = True) -> Any:
        from .checkpoint import ShardedState

        params: dict[str, Any] = {}
        groups: list[dict] = []
        states = [o.sharded_state(frozen=frozen) for o in self.optimizers]
        for state in states:
            for name, shard in state.params.items():
                if name in params:  # Gemini: a parameter of another optimizer, saved by that one
                    continue
                params[name] = dataclasses.replace(shard, group=shard.group + len(groups))
            groups.extend(state.param_groups)
        info = {**states[0].info, "optimizers": self.group_counts}
        return ShardedState(params=params, param_groups=groups, loss_scaler=states[0].loss_scaler, info=info)

    def end_sharded_state(self) -> None:
        for o in self.optimizers:
            end = getattr(o, "end_sharded_state", None)
            if end is not None:
                end()

    def load_sharded_state(self, reader: Any) -> None:
        """Each optimizer reads its own param groups (in order) and parameters."""
        start = 0
        for o, n in zip(self.optimizers, self.group_counts):
            o.load_sharded_state(_GroupsView(reader, reader.param_groups[start:start + n]))
            start += n


class _GroupsView:
    """A checkpoint reader whose `param_groups` are one optimizer's part of the saved list."""

    def __init__(self, reader: Any, param_groups: list[dict]) -> None:
        self._reader, self.param_groups = reader, param_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)
