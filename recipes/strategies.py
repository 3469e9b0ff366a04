"""Lightning strategies for ZeRO (stages 1, 2) and Gemini (chunked ZeRO-3), registered by name.

```python
from lowmem import recipes                       # registers the names below with Lightning's StrategyRegistry
trainer = Trainer(strategy="zero2", accelerator="cpu", devices=2, precision="bf16-mixed",
                  accumulate_grad_batches=4, gradient_clip_val=1.0)
trainer = Trainer(strategy=recipes.GeminiStrategy(placement="auto", device_memory_budget="20GB"))
```

| name | strategy |
|---|---|
| `zero1` | `ZeroStrategy(stage=1)`: optimizer state and fp32 master weights sharded |
| `zero2` | `ZeroStrategy(stage=2)`: gradients sharded too |
| `zero2_offload` | `ZeroStrategy(stage=2, offload="cpu")`: master weights and optimizer state in CPU memory |
| `gemini` | `GeminiStrategy()`: ZeRO-3 chunks, everything on the device |
| `gemini_offload` | `GeminiStrategy(offload="cpu")`: optimizer state and master weights in CPU memory |
| `gemini_nvme` | `GeminiStrategy(offload="nvme")`: those on NVMe, in a temporary folder (or `offload_dir`) |
| `gemini_auto` | `GeminiStrategy(placement="auto")`: placement traced in the first step, within a budget |

Each strategy holds one config object, `strategy.config` (a `core_parallel.ZeroConfig` / `GeminiConfig`,
validated by its own `__post_init__`), and hands it to `core_parallel.setup` unchanged but for the Trainer's
precision (`dataclasses.replace`). An app that holds such a config passes it: `GeminiStrategy(config=config)`, or
`strategy_from_config(config, collective_timeout_s=600)` for either kind, with no name lookup and no environment
variable; an app that takes a name (`--strategy`) turns it into that config where it reads its settings:
`core_parallel.config_for_strategy("gemini_nvme", offload_dir=...)` (None for `auto` and `ddp`). The names above
are `core_parallel.presets.PRESETS`, one table: registered here with the same keywords, they build the same config.
The keywords (`GeminiStrategy(offload="nvme", chunk_mb=64)`, the registered names) build the config once, in
`__init__` (`core_parallel.presets.gemini_config` for Gemini's).

Both are `DDPStrategy` subclasses that replace the DDP wrapper with `core_parallel.setup(model,
optimizer, config, group)`, the group being the default process group that Lightning's cluster
environment created. The optimizer wrapper then carries the training step: backward (loss scaling under
fp16), `no_sync()` while Lightning accumulates gradients, the clip for `gradient_clip_val` (global norm, or
elementwise on the shards for `gradient_clip_algorithm="value"`),
and the step. Checkpoints (`recipes.checkpoints`), as Lightning's FSDPStrategy: `state_dict_type="full"` (the
default) writes one Lightning file that `LitModule.load_from_checkpoint` and any strategy read, streamed tensor by
tensor by rank 0; `"sharded"` writes a folder: `core_parallel`'s sharded format (index JSON + safetensors shards,
loadable on any number of ranks, `suite checkpoint consolidate`) plus `lightning_state.pt` with the loop, callback
and scheduler state. Either replaces the old one in one rename once it is complete, so a crash mid-save leaves the
previous checkpoint intact.

Faults (a rank lost, SIGTERM) are turned into one message and a checkpoint: see `recipes.faults`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import uuid
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..core_parallel.gemini.config import GeminiConfig
from ..core_parallel.groups import check_backend
from ..core_parallel.preemption import Preemption
from ..core_parallel.presets import GEMINI_OFFLOADS, PRESETS, gemini_config
from ..core_parallel.zero.config import ZeroConfig
from ..utils.errors import InputError
from ..utils.fileio import atomic_write, replace_dir
from .checkpoints import LIGHTNING_STATE, check_state_dict_type, load_full_checkpoint, optimizer_param_names
from .faults import (
    SIGTERM_EXIT_CODE,
    StopOnSigterm,
    looks_like_peer_failure,
    peer_failure_message,
    resume_hint,
    save_at_sigterm,
    watch_sigterm,
)
from .optimizers import ToggleModelParameters, check_several
from .precision import ShardedPrecision
from .strategy_options import LIGHTNING_KEYWORDS, declare_keywords, keywords_given

__all__ = [
    "LIGHTNING_STATE",
    "SIGTERM_EXIT_CODE",
    "GEMINI_OFFLOADS",
    "STRATEGY_NAMES",
    "GeminiStrategy",
    "ZeroStrategy",
    "register_strategies",
    "strategy_class",
    "strategy_from_config",
    "strategy_kind",
]

logger = logging.getLogger(__name__)

FULL_CHECKPOINT_WARN_BYTES = 20 * 10**9
"""Weights from which a full checkpoint (written by rank 0 alone) logs one line suggesting state_dict_type='sharded'."""


class _ShardedStrategy(DDPStrategy):
    """What ZeRO and Gemini share: setup through `core_parallel`, the training hooks, checkpoints, faults."""

    def __init__(
        self,
        *,
        config: Any,
        collective_timeout_s: float = 1800.0,
        state_dict_type: str = "full",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        # the subclasses checked the other arguments (_check_arguments) before building the config
        if config.precision != "fp32":
            raise InputError(
                f"{type(config).__name__}.precision={config.precision!r}: the strategy takes its precision from "
                "Trainer(precision=...); leave the config's precision at 'fp32'"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timedelta(seconds=collective_timeout_s),
            **kwargs,
        )
        self.config = config
        """The `core_parallel` config, validated once where it was built, handed to `core_parallel.setup`."""
        self.collective_timeout_s = float(collective_timeout_s)
        self.state_dict_type = check_state_dict_type(state_dict_type)
        """"full": one Lightning file (`recipes.checkpoints`); "sharded": checkpoints are folders."""
        self._warned_full_size = False
        self._core_optimizer: Any = None
        self._param_names: list[list[list[str]]] | None = None
        """Per optimizer, per param group: the parameter names (torch's numbering of the optimizer state)."""
        self._toggle: ToggleModelParameters | None = None
        self._last_checkpoint: str | None = None
        self._resume_advice: str | None = None
        self._preemption = Preemption()  # the default group, resolved when asked

    def core_config(self, precision: str, loss_scaling: bool | None = None) -> Any:
        """`self.config` at this run's precision (what the Trainer decides: the parameters' dtype and, where
        it is not the dtype's default, whether the loss is scaled)."""
        config = dataclasses.replace(self.config, precision=precision)
        if loss_scaling is None:
            return config
        return dataclasses.replace(config, loss_scaler=dataclasses.replace(config.loss_scaler, enabled=loss_scaling))

    # -- precision -------------------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> ShardedPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ShardedPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # The Trainer builds a generic plugin from `precision=` and assigns it here when the strategy is
        # chosen by name; keep its precision, use ours.
        if plugin is not None and not isinstance(plugin, ShardedPrecision):
            plugin = ShardedPrecision(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    # -- setup -----------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group `core_parallel` shards over: the default group Lightning initialised, if any."""
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        if not any(isinstance(cb, StopOnSigterm) for cb in trainer.callbacks):
            trainer.callbacks.append(StopOnSigterm())
        self.accelerator.setup(trainer)
        self.precision_plugin.device_type = self.root_device.type
        self.precision_plugin.convert_module(self.model)  # as DDPStrategy: *-true converts, before the optimizer
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._setup_core(trainer)
        self.setup_precision_plugin()

    def _setup_core(self, trainer: Any) -> None:
        from .. import core_parallel

        plugin = self.precision_plugin
        config = self.core_config(plugin.core_precision, plugin.loss_scaling)
        users = list(self.optimizers)
        logger.info("%s: core_parallel.setup with %s", type(self).__name__, config)
        # ZeRO swaps in master shards: record the names (and, for toggling, the parameters) first
        self._param_names = [optimizer_param_names(self.model, o) for o in users]
        toggle = None
        if len(users) > 1:  # a GAN's optimizers: recipes.optimizers
            check_several(type(self).__name__, users)
            if isinstance(self.config, ZeroConfig):
                toggle = ToggleModelParameters(self.lightning_module, users)
        model, optimizer = core_parallel.setup(self.model, users if len(users) > 1 else users[0], config,
                                               group=self.process_group)
        self.model = model
        self._core_optimizer = optimizer
        self.optimizers = list(optimizer) if len(users) > 1 else [optimizer]
        if len(users) > 1 and any(o.loss_scaler.enabled for o in self.optimizers):
            raise InputError(f"{type(self).__name__}: fp16 loss scaling with {len(users)} optimizers is not supported "
                             "(each keeps its own scaler); use precision='bf16-mixed' or '32-true'")
        if self._toggle is not None:
            self._toggle.remove()
        self._toggle = toggle
        if toggle is not None:
            toggle.install(self.optimizers)
        plugin.bind(optimizer, self.root_device.type)
        for sched in self.lr_scheduler_configs:
            if not any(sched.scheduler.optimizer is o for o in (*users, *self.optimizers)):
                raise ValueError("an LR scheduler is attached to an optimizer that configure_optimizers did not return")

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self._core_optimizer is None:
            yield
            return
        with self._core_optimizer.no_sync():
            yield

    def collective_reads(self) -> Any:
        """A block in which callbacks read the model's parameters outside a forward (an EMA update, logging
        weights): every rank must enter it and run the same reads. Under Gemini the reads gather their chunks
        (`core_parallel.gemini.collective_reads`); under ZeRO the parameters are whole and it does nothing."""
        from ..core_parallel.gemini import collective_reads

        return collective_reads(self.model if self.model is not None else self.lightning_module)

    def teardown(self) -> None:
        # Not DDPStrategy.teardown: it would move the model and the optimizer state to the CPU, tearing
        # Gemini's parameter views off their chunks. The sharded model stays usable (save, validate) after fit.
        self.precision_plugin.bind(None, self.precision_plugin.device_type)
        if self._toggle is not None:
            self._toggle.remove()
            self._toggle = None
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- checkpoints -----------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        # The weights go to the sharded files in `save_checkpoint`; nothing is gathered here.
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write the sharded folder `filepath` on all ranks, or with state_dict_type="full" the one file (rank 0,
        streamed from a temporary sharded folder: `recipes.checkpoints`); it appears complete or not at all."""
        from .. import core_parallel

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        path = Path(self.broadcast(os.fspath(filepath)))
        staging = Path(self.broadcast(os.fspath(path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")))
        # The optimizer goes in even for weights-only saves: the master shards are the weights, and a
        # model-only save would gather Gemini's chunks on rank 0 alone.
        if self.state_dict_type == "full" and path.is_dir() and not (path / LIGHTNING_STATE).is_file():
            raise IsADirectoryError(f"the checkpoint path exists and is a folder: {path}")
        # A module whose frozen weights are rebuilt from their source before a resume (a fine-tuning base) says
        # so with `save_frozen_parameters = False`: they stay out of the folder, as its on_save_checkpoint drops
        # them under Lightning's own strategies, and Gemini does not gather them for the save.
        frozen = bool(getattr(self.lightning_module, "save_frozen_parameters", True))
        core_parallel.save_checkpoint(staging, self.model, self._core_optimizer, frozen=frozen)
        if self.state_dict_type == "full":
            self._save_full(checkpoint, staging, path)
            return
        if self.is_global_zero:
            state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            with atomic_write(staging / LIGHTNING_STATE, "wb") as f:
                torch.save(state, f)
        self.barrier("sharded_checkpoint_written")
        if self.is_global_zero:
            replace_dir(staging, path)
        self.barrier("sharded_checkpoint_renamed")
        self._last_checkpoint, self._resume_advice = os.fspath(path), None

    def _save_full(self, checkpoint: dict[str, Any], staging: Path, path: Path) -> None:
        from .checkpoints import write_full_checkpoint

        try:
            if self.is_global_zero:
                self._warn_full_size()
                state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
                groups = None if self._core_optimizer is None else [
                    [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in self.optimizers]
                if path.is_dir():  # a sharded checkpoint of the same name, as FSDPStrategy replaces it
                    shutil.rmtree(path)
                write_full_checkpoint(staging, path, state, groups)
        finally:
            self.barrier("full_checkpoint_written")
            if self.is_global_zero:
                shutil.rmtree(staging, ignore_errors=True)
        self._last_checkpoint, self._resume_advice = os.fspath(path), None

    def _warn_full_size(self) -> None:
        """One line, once, where the model is too big for rank 0 alone to write a full file in sensible time."""
        if self._warned_full_size:
            return
        self._warned_full_size = True
        nbytes = sum(p.numel() * p.element_size() for p in self.lightning_module.parameters())
        if nbytes >= FULL_CHECKPOINT_WARN_BYTES:
            logger.warning(
                "%s: state_dict_type='full' has rank 0 alone write %.1f GB of weights (and the optimizer state) into "
                "one file, streamed from the shards; pass %s(state_dict_type='sharded') for a folder every rank "
                "writes its part of in parallel", type(self).__name__, nbytes / 1e9, type(self).__name__)

    def note_checkpoint(self, path: str | os.PathLike, resume: str | None = None) -> None:
        """Name where the last checkpoint now lives (after the app moved it into place) and, optionally, how
        to resume from it (`"--resume_from_checkpoint latest"`); the fault messages quote both."""
        self._last_checkpoint, self._resume_advice = os.fspath(path), resume

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the sharded folder into the set-up model and optimizer; return Lightning's own state."""
        from .. import core_parallel

        path = Path(checkpoint_path)
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if path.is_file():  # state_dict_type="full", or any Lightning checkpoint file (ddp's)
            return load_full_checkpoint(path, self.model, self._core_optimizer if fitting else None,
                                        self._param_names, strict=self.lightning_module.strict_loading)
        if not (path / LIGHTNING_STATE).is_file():
            raise FileNotFoundError(
                f"{path} is not a checkpoint folder written by {type(self).__name__} (no {LIGHTNING_STATE})"
            )
        core_parallel.load_checkpoint(path, self.model, self._core_optimizer if fitting else None)
        state = _load_lightning_state(path / LIGHTNING_STATE)
        state["state_dict"] = {}
        state.setdefault("optimizer_states", [])
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Done by core_parallel.load_checkpoint in load_checkpoint().
        pass

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            path = Path(filepath)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    # -- faults (recipes.faults) -----------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if not looks_like_peer_failure(exception):
            return
        message = peer_failure_message(exception, self.global_rank, self.world_size, self.collective_timeout_s,
                                       resume_hint(self._last_checkpoint, self._resume_advice))
        logger.error(message)
        exception.args = (message,)

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Lightning's barrier, as a traced collective once the core is set up: a rank waiting here is named
        with where it is when another rank's collective times out, and its own timeout says where the others are."""
        collectives = getattr(self._core_optimizer, "collectives", None)
        if collectives is None:
            super().barrier(name, *args, **kwargs)
            return
        with collectives.collective(f"barrier({name})" if name else "barrier"):
            super().barrier(name, *args, **kwargs)

    def on_train_start(self) -> None:
        super().on_train_start()
        watch_sigterm(self.lightning_module.trainer, self._preemption)

    def stop_if_terminated(self, trainer: Any, module: Any) -> None:
        """At an optimizer-step boundary, on every rank: if any rank got SIGTERM, save a checkpoint and exit 143."""
        if not self._preemption.requested():
            return
        save_at_sigterm(trainer, module)
        if self.is_global_zero:
            logger.warning(
                "SIGTERM received: stopped after step %d. %s Exiting with code %d.",
                trainer.global_step, resume_hint(self._last_checkpoint, self._resume_advice), SIGTERM_EXIT_CODE,
            )
        raise SIGTERMException(SIGTERM_EXIT_CODE)


class ZeroStrategy(_ShardedStrategy):
    """ZeRO stage 1 or 2 (`core_parallel.ZeroConfig`) as a Lightning strategy.

    Give the config (`ZeroStrategy(config=ZeroConfig(stage=1))`) or its fields as keywords (`stage`, `offload`,
    `bucket_mb`, `overlap`, loss-scaler settings, ...), not both; `precision` comes from `Trainer(precision=...)`.
    Every `ZeroConfig` field is a keyword of this signature (`recipes.strategy_options`), so LightningCLI's
    `init_args` take them too.

    Args:
        config: the `ZeroConfig` to hold (precision left at "fp32").
        collective_timeout_s: seconds after which a collective waiting for a dead rank raises.
        state_dict_type: "full" (default, as Lightning's FSDPStrategy): a checkpoint is one Lightning file that
            `load_from_checkpoint`, `Trainer(ckpt_path=...)` under any strategy and `torch.load(weights_only=True)`
            read, streamed by rank 0; "sharded": a folder every rank writes its part of (see `recipes.checkpoints`).
    """

    def __init__(self, *, config: ZeroConfig | None = None, collective_timeout_s: float = 1800.0,
                 state_dict_type: str = "full", **kwargs: Any) -> None:
        check_state_dict_type(state_dict_type)
        fields, strategy_kwargs = _split_config_kwargs(keywords_given(ZeroStrategy, kwargs), ZeroConfig)
        _check_arguments(collective_timeout_s, strategy_kwargs)
        config = ZeroConfig(**fields) if config is None else _given_config(type(self), ZeroConfig, config, fields)
        super().__init__(config=config, collective_timeout_s=collective_timeout_s, state_dict_type=state_dict_type,
                         **strategy_kwargs)


declare_keywords(ZeroStrategy, ZeroConfig)


class GeminiStrategy(_ShardedStrategy):
    """Gemini, chunk-based ZeRO-3 (`core_parallel.GeminiConfig`), as a Lightning strategy.

    Give the config (`GeminiStrategy(config=GeminiConfig(...))`) or keywords, not both: `offload` below and
    `GeminiConfig`'s fields (`placement`, `device_memory_budget`, `chunk_mb`, `prefetch`, `offload_tier`,
    `offload_dir`, the static fractions, ...); `precision` comes from `Trainer(precision=...)`. Every `GeminiConfig`
    field is a keyword of this signature (`recipes.strategy_options`), so LightningCLI's `init_args` take them too.

    Args:
        config: the `GeminiConfig` to hold (precision left at "fp32").
        offload: the off-device tier in one word. "cpu" or "nvme": data placed off the device lives in CPU
            memory or in NVMe files in `offload_dir`; under static placement all chunks' master weights and
            optimizer states go there (fractions 1.0 unless given). "none": static placement keeps everything
            on the device (auto placement spills to CPU memory). None (default): "none", or the tier named by
            `offload_tier=`.
        offload_dir: folder of the NVMe tier, only with offload="nvme" (or offload_tier="nvme"); there without a
            folder: a new temporary folder. Given with offload="none"/"cpu" (the "cpu" tier) it is `GeminiConfig`'s
            error; given alone it selects the NVMe tier as before, with `GeminiConfig`'s DeprecationWarning.
        collective_timeout_s: seconds after which a collective waiting for a dead rank raises.
        state_dict_type: "full" (default, as Lightning's FSDPStrategy): a checkpoint is one Lightning file that
            `load_from_checkpoint`, `Trainer(ckpt_path=...)` under any strategy and `torch.load(weights_only=True)`
            read, streamed by rank 0; "sharded": a folder every rank writes its part of (see `recipes.checkpoints`).
    """

    def __init__(self, *, config: GeminiConfig | None = None, offload: str | None = None,
                 collective_timeout_s: float = 1800.0, state_dict_type: str = "full", **kwargs: Any) -> None:
        check_state_dict_type(state_dict_type)
        fields, strategy_kwargs = _split_config_kwargs(keywords_given(GeminiStrategy, kwargs), GeminiConfig)
        _check_arguments(collective_timeout_s, strategy_kwargs)
        if offload is not None:
            fields["offload"] = offload
        if config is None:
            config = gemini_config(**fields)
        else:
            _given_config(type(self), GeminiConfig, config, fields)
        super().__init__(config=config, collective_timeout_s=collective_timeout_s, state_dict_type=state_dict_type,
                         **strategy_kwargs)
        self.offload = offload if offload is not None else ("nvme" if config.offload_tier == "nvme" else "none")

    @property
    def offload_dir(self) -> str | None:
        """The NVMe tier's folder (None for the CPU tier)."""
        return self.config.offload_dir

    def model_to_device(self) -> None:
        """As DDP moves the model, except that hollow parameters (`core_parallel.gemini.lazy`: a pretrained model
        streamed into the chunks at setup) get no memory on the device, only its placement."""
        from ..core_parallel.gemini.lazy import is_hollow

        assert self.model is not None
        device = self.root_device
        for p in self.model.parameters():
            if is_hollow(p) and p.device != device:
                empty = torch.empty(p.shape, dtype=p.dtype, device=device)
                empty.untyped_storage().resize_(0)
                p.data = empty
        super().model_to_device()


_FRACTION_DOC = ("static only: fraction of chunks whose fp32 {what} live off the device; None: 0.0, or 1.0 with "
                 "offload='cpu'/'nvme'.")
declare_keywords(GeminiStrategy, GeminiConfig, overrides={
    "offload_param_frac": (float | None, None, _FRACTION_DOC.format(what="parameter shards")),
    "offload_optim_frac": (float | None, None, _FRACTION_DOC.format(what="gradient shards and optimizer states")),
})


def strategy_class(config: Any) -> type[ZeroStrategy] | type[GeminiStrategy]:
    """`ZeroStrategy` for a `core_parallel.ZeroConfig`, `GeminiStrategy` for a `GeminiConfig`."""

    if isinstance(config, ZeroConfig):
        return ZeroStrategy
    if isinstance(config, GeminiConfig):
        return GeminiStrategy
    raise TypeError(f"config must be a ZeroConfig or GeminiConfig, got {type(config).__name__}")


def strategy_from_config(config: Any, **kwargs: Any) -> ZeroStrategy | GeminiStrategy:
    """The Lightning strategy holding a `core_parallel.ZeroConfig` or `GeminiConfig` (the object itself).

    No registry name and no environment variable: `strategy.config is config`, and `strategy.core_config(p)` is
    `config` with precision `p`. `kwargs` are the strategy's own arguments (`collective_timeout_s`, `accelerator`,
    `process_group_backend`, ...). The precision is the Trainer's (`Trainer(precision=...)`): a config whose
    `precision` is not the default "fp32" is refused rather than silently overridden.
    """
    return strategy_class(config)(config=config, **kwargs)


def _given_config(strategy: type, config_type: type, config: Any, fields: dict[str, Any]) -> Any:
    """`config`, given to `strategy`: of its type, and no config field given beside it as a keyword."""
    if not isinstance(config, config_type):
        raise TypeError(f"{strategy.__name__}(config=...) takes a {config_type.__name__}, got {type(config).__name__}")
    if fields:
        raise TypeError(f"{strategy.__name__}: {sorted(fields)} come from config=, not from keyword arguments")
    return config


def _check_arguments(collective_timeout_s: float, strategy_kwargs: dict[str, Any]) -> None:
    """The strategy's own arguments, checked before the config is built (which may make a temporary folder)."""
    if not collective_timeout_s > 0:
        raise InputError(f"collective_timeout_s must be > 0, got {collective_timeout_s}")
    if strategy_kwargs.get("process_group_backend") is not None:
        check_backend(strategy_kwargs["process_group_backend"], what="process_group_backend")


def _split_config_kwargs(kwargs: dict[str, Any], config_cls: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate the config's fields from Lightning strategy arguments (accelerator, cluster_environment...)."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    if "precision" in kwargs:
        raise InputError("set the precision with Trainer(precision=...), not on the strategy")
    config = {k: v for k, v in kwargs.items() if k in fields}
    rest = {k: v for k, v in kwargs.items() if k not in fields}
    _check_strategy_keywords(rest, fields)
    return config, rest


def _check_strategy_keywords(rest: dict[str, Any], fields: set[str]) -> None:
    """A keyword that is neither a config field nor one of `LIGHTNING_KEYWORDS` is a TypeError naming it (DDPStrategy
    would pass it to a DistributedDataParallel wrapper these strategies never build, i.e. ignore it)."""
    import difflib

    for name in rest:
        if name not in LIGHTNING_KEYWORDS:
            known = sorted(fields | set(LIGHTNING_KEYWORDS) | {"offload", "collective_timeout_s", "state_dict_type"})
            close = ["collective_timeout_s"] if name == "timeout" else difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"unknown strategy keyword {name!r}{hint}")


def _load_lightning_state(path: Path) -> dict[str, Any]:
    from lightning.fabric.utilities.data import AttributeDict

    with torch.serialization.safe_globals([AttributeDict]):
        return torch.load(path, map_location="cpu", weights_only=True)


_KINDS: dict[str, type[_ShardedStrategy]] = {"zero": ZeroStrategy, "gemini": GeminiStrategy}
"""The strategy of each kind of `core_parallel.presets.PRESETS`."""
STRATEGY_NAMES = ("auto", "ddp", *PRESETS)
"""The strategy names the apps' `--strategy` takes (the sharded ones registered below, plus Lightning's)."""


def strategy_kind(name: str) -> str | None:
    """"zero" or "gemini" for the names of this module's strategies, None for the others (auto, ddp, ...)."""
    return PRESETS[name].kind if name in PRESETS else None


def register_strategies(registry: Any = StrategyRegistry) -> list[str]:
    """Register the names of `core_parallel.presets.PRESETS`, each as the strategy of its kind with its keywords
    (skipping names already there); returns the names registered now."""
    added = []
    for name, preset in PRESETS.items():
        if name not in registry:
            registry.register(name, _KINDS[preset.kind], description=preset.description, **preset.keywords)
            added.append(name)
    return added


register_strategies()
