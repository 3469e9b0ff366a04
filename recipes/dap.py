"""`DAPStrategy`: Lightning prediction with each model's Evoformer split across the devices (DAP).

`Trainer(strategy="dap", accelerator="cpu" | "gpu", devices=N).predict(module, datamodule)`: N processes
(launched as Lightning's ddp does: gloo on CPU, NCCL on GPU) hold the same weights and see the same batches.
The ranks run through the same `fastfold.dap.DAPRuntime` as `suite fold --devices N`: it broadcasts rank 0's
weights and splits the Evoformer, extra-MSA and template pair stacks of every AlphaFold inside the
LightningModule across the group (`parallelize_dap`), and broadcasts rank 0's batch, so the ranks agree even
when feature building is random. `devices=1` creates no process group at all.

Importing this module registers the name "dap" with Lightning's StrategyRegistry.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from ..core_parallel import Axis, Topology
from ..core_parallel.groups import check_backend
from ..utils.errors import InputError

logger = logging.getLogger(__name__)

__all__ = ["DAPStrategy"]


class DAPStrategy(DDPStrategy):
    """Prediction (and validation/test) with dynamic axial parallelism across the devices of one node.

    Every rank runs the same LightningModule on the same batch; only the activations of the Evoformer-like
    stacks are split. Training is not supported (the replicated weights would need their partial gradients
    summed, see `core_parallel.dap.all_reduce_grads`).
    """

    strategy_name = "dap"

    def __init__(self, *, collective_timeout_s: float = 1800.0, **kwargs: Any) -> None:
        if collective_timeout_s <= 0:
            raise InputError(f"DAPStrategy.collective_timeout_s must be > 0, got {collective_timeout_s}")
        if kwargs.get("process_group_backend") is not None:
            check_backend(kwargs["process_group_backend"], what="process_group_backend")
        super().__init__(timeout=timedelta(seconds=collective_timeout_s), **kwargs)
        self._topology: Topology | None = None
        self._runtime: Any = None

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    @property
    def dap_group(self) -> dist.ProcessGroup | None:
        """The DAP process group (None with one device)."""
        return None if self._topology is None else self._topology.group(Axis.DAP)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # DAP ranks share every batch: no rank gets a different slice of the data.
        return {"num_replicas": 1, "rank": 0}

    def setup_distributed(self) -> None:
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        if self.world_size == 1:
            logger.info("DAPStrategy: one device, no process group")
            return
        super().setup_distributed()
        self._topology = Topology(
            world_size=self.world_size,
            rank=self.global_rank,
            dap=self.world_size,
            backend=self._process_group_backend,
            timeout_s=self._timeout.total_seconds() if self._timeout else 1800.0,
        ).init()

    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            raise InputError("DAPStrategy supports Trainer.predict, validate and test, not fit")
        from ..fastfold.dap import DAPRuntime

        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        group = self.dap_group
        if group is not None:
            self._runtime = DAPRuntime(group, self.root_device)
            self._runtime.prepare(self.model)  # rank 0's weights everywhere, the stacks split
        self.setup_precision_plugin()

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Rank 0's batch on every rank (a mapping of tensors is broadcast tensor by tensor)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self._runtime is None:
            return batch
        if isinstance(batch, Mapping):
            return self._runtime.broadcast(batch)
        return super().batch_to_device(self.broadcast(batch, src=0), device, dataloader_idx)

    def teardown(self) -> None:
        super().teardown()
        self._runtime = None
        if self._topology is not None:
            self._topology.destroy()
            self._topology = None


def register_dap_strategy(registry: Any = StrategyRegistry) -> None:
    """Register "dap" (idempotent)."""
    if DAPStrategy.strategy_name not in registry:
        registry.register(
            DAPStrategy.strategy_name, DAPStrategy, description="DAP: the Evoformer split across devices (predict)"
        )


register_dap_strategy()
