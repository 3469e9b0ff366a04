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

An app that holds a `core_parallel.ZeroConfig` / `GeminiConfig` builds the strategy from it directly, with no
name lookup and no environment variable: `strategy_from_config(config, collective_timeout_s=600)`; an app that
takes a name (`--strategy`) turns it into that config first: `parallel_for_strategy("gemini_nvme",
offload_dir=...)` (the same config the registered name's strategy builds; None for `auto` and `ddp`).

Both are `DDPStrategy` subclasses that replace the DDP wrapper with `core_parallel.setup(model,
optimizer, config, group)`, the group being the default process group that Lightning's cluster
environment created. The optimizer wrapper then carries the training step: backward (loss scaling under
fp16), `no_sync()` while Lightning accumulates gradients, the global-norm clip for `gradient_clip_val`,
and the step. Checkpoints are folders: `core_parallel`'s sharded format (index JSON + safetensors
shards, loadable on any number of ranks, `suite checkpoint consolidate`) plus `lightning_state.pt` with
the loop, callback and scheduler state. The folder replaces the old one in one rename once every rank
has written its part, so a crash mid-save leaves the previous checkpoint intact.

Faults:
- A rank that dies turns into an error on the others within seconds (gloo sees its socket close, Gemini's
  shared-memory collectives see its process gone); one that stops answering, after `collective_timeout_s`.
  The error names the rank, the last complete checkpoint on disk and how to resume from it. An app that
  moves its checkpoints after `trainer.save_checkpoint` (a staging folder renamed into place) names the
  final folder and its resume advice with `strategy.note_checkpoint(path, resume="...")`.
- SIGTERM (a preempted or cancelled job) is not taken for success: training goes on to the end of the
  current optimizer step, every rank agrees on stopping, a checkpoint is written, one line says where and
  how to resume, and the process exits with code 143 (128 + SIGTERM). Lightning's own handler would stop at
  the next batch, possibly mid-accumulation, without a checkpoint and with exit code 0. The checkpoint is
  written by the first trainer callback that has a `save_on_signal(trainer, module)` method (returning the
  path; the diffusion recipe's checkpoint-N writer does), else as `preempted-step=N.ckpt` in the
  ModelCheckpoint folder or `default_root_dir`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import uuid
import warnings
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..core_parallel.groups import check_backend, world_rank
from ..utils.errors import InputError
from ..utils.fileio import atomic_write, replace_dir
from .precision import ShardedPrecision

__all__ = [
    "LIGHTNING_STATE",
    "SIGTERM_EXIT_CODE",
    "GEMINI_OFFLOADS",
    "STRATEGY_NAMES",
    "GeminiStrategy",
    "PeerFailureError",
    "ZeroStrategy",
    "parallel_for_strategy",
    "register_strategies",
    "strategy_from_config",
    "strategy_kind",
]

logger = logging.getLogger(__name__)

LIGHTNING_STATE = "lightning_state.pt"
"""File in a checkpoint folder holding Lightning's own state (loops, callbacks, LR schedulers)."""
GEMINI_OFFLOADS = ("none", "cpu", "nvme")
"""Values of `GeminiStrategy(offload=...)`."""
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM
"""Exit code after a SIGTERM: what a shell reports for a process the signal ended, so job scripts see a failure."""

# Messages by which gloo, NCCL and the TCP store report a peer that died or stopped answering.
_PEER_FAILURE = re.compile(
    r"connection (closed|reset|refused)|closed by peer|broken pipe|timed? ?out|timeout|"
    r"ECONNRESET|EPIPE|socket|NCCL communicator was aborted|store.*(closed|failed)|recv|send",
    re.IGNORECASE,
)


class PeerFailureError(RuntimeError):
    """Another rank died or stopped answering; training stopped on this rank."""


class _ShardedStrategy(DDPStrategy):
    """What ZeRO and Gemini share: setup through `core_parallel`, the training hooks, checkpoints, faults."""

    def __init__(
        self,
        *,
        collective_timeout_s: float = 1800.0,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not collective_timeout_s > 0:
            raise InputError(f"collective_timeout_s must be > 0, got {collective_timeout_s}")
        if process_group_backend is not None:
            check_backend(process_group_backend, what="process_group_backend")
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
        self.collective_timeout_s = float(collective_timeout_s)
        self._core_optimizer: Any = None
        self._last_checkpoint: str | None = None
        self._resume_advice: str | None = None
        self._sigterm = threading.Event()

    # -- subclasses ----------------------------------------------------------------------------------
    def core_config(self, precision: str) -> Any:
        """The `core_parallel` config (`ZeroConfig` / `GeminiConfig`) for this run's precision."""
        raise NotImplementedError

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
        if not any(isinstance(cb, _StopOnSigterm) for cb in trainer.callbacks):
            trainer.callbacks.append(_StopOnSigterm())
        self.accelerator.setup(trainer)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            _check_clipping(trainer)
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"{type(self).__name__} supports exactly one optimizer (it may hold several param groups); "
                    f"configure_optimizers returned {len(self.optimizers)}"
                )
            self._setup_core(trainer)
        else:
            self.precision_plugin.convert_module(self.model)
        self.setup_precision_plugin()

    def _setup_core(self, trainer: Any) -> None:
        from .. import core_parallel

        plugin = self.precision_plugin
        config = self.core_config(plugin.core_precision)
        user_optimizer = self.optimizers[0]
        logger.info("%s: core_parallel.setup with %s", type(self).__name__, config)
        model, optimizer = core_parallel.setup(self.model, user_optimizer, config, group=self.process_group)
        self.model = model
        self._core_optimizer = optimizer
        self.optimizers = [optimizer]
        plugin.bind(optimizer, self.root_device.type)
        for sched in self.lr_scheduler_configs:
            if sched.scheduler.optimizer is not user_optimizer and sched.scheduler.optimizer is not optimizer:
                raise ValueError("an LR scheduler is attached to an optimizer that configure_optimizers did not return")

    @property
    def core_optimizer(self) -> Any:
        """The `core_parallel` optimizer wrapper (None before `setup` while fitting)."""
        return self._core_optimizer

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self._core_optimizer is None:
            yield
            return
        with self._core_optimizer.no_sync():
            yield

    def teardown(self) -> None:
        # Not DDPStrategy.teardown: it would move the model and the optimizer state to the CPU, tearing
        # Gemini's parameter views off their chunks. The sharded model stays usable (save, validate) after fit.
        self.precision_plugin.bind(None, self.precision_plugin.device_type)
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
        """Write the sharded folder `filepath` on all ranks; it appears complete or not at all."""
        from .. import core_parallel

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        path = Path(self.broadcast(os.fspath(filepath)))
        staging = Path(self.broadcast(os.fspath(path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")))
        # The optimizer goes in even for weights-only saves: the master shards are the weights, and a
        # model-only save would gather Gemini's chunks on rank 0 alone.
        core_parallel.save_checkpoint(staging, self.model, self._core_optimizer)
        if self.is_global_zero:
            state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
            with atomic_write(staging / LIGHTNING_STATE, "wb") as f:
                torch.save(state, f)
        self.barrier("sharded_checkpoint_written")
        if self.is_global_zero:
            replace_dir(staging, path)
        self.barrier("sharded_checkpoint_renamed")
        self._last_checkpoint, self._resume_advice = os.fspath(path), None

    def note_checkpoint(self, path: str | os.PathLike, resume: str | None = None) -> None:
        """Name where the last checkpoint now lives (after the app moved it into place) and, optionally, how
        to resume from it (`"--resume_from_checkpoint latest"`); the fault messages quote both."""
        self._last_checkpoint, self._resume_advice = os.fspath(path), resume

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the sharded folder into the set-up model and optimizer; return Lightning's own state."""
        from .. import core_parallel

        path = Path(checkpoint_path)
        if not (path / LIGHTNING_STATE).is_file():
            raise FileNotFoundError(
                f"{path} is not a checkpoint folder written by {type(self).__name__} (no {LIGHTNING_STATE})"
            )
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
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

    # -- faults ----------------------------------------------------------------------------------------
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if not _looks_like_peer_failure(exception):
            return
        ranks = _lost_ranks(exception, self.world_size, self.global_rank)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}" if ranks else "another rank"
        message = (
            f"rank {self.global_rank}: lost contact with {who} (it died or did not answer within the collective "
            f"timeout of {self.collective_timeout_s:g}s); training stopped. {self._resume_hint()} Cause: {exception}"
        )
        logger.error(message)
        exception.args = (message,)

    def _resume_hint(self) -> str:
        """'Last complete checkpoint: PATH; resume with ...', naming only a checkpoint that is on disk."""
        path = self._last_checkpoint
        if path is None:
            return "Last complete checkpoint: none saved in this run."
        if not os.path.exists(path):
            return (f"Last complete checkpoint: none found ({path} was saved in this run but is no longer there: "
                    f"moved, removed, or on another host's disk).")
        advice = self._resume_advice or f"trainer.fit(..., ckpt_path={path!r})"
        return f"Last complete checkpoint: {path}; resume with {advice}."

    def on_train_start(self) -> None:
        super().on_train_start()
        # After Lightning registered its own handler (Trainer._run), which is replaced here: it runs a collective
        # inside the handler and stops at the next batch without a checkpoint, exiting 0.
        self._sigterm.clear()
        if threading.current_thread() is not threading.main_thread():
            return
        connector = getattr(self.lightning_module.trainer, "_signal_connector", None)
        chained = getattr(connector, "_original_handlers", {}).get(signal.SIGTERM)
        if not callable(chained) or chained in (signal.SIG_DFL, signal.SIG_IGN):
            chained = None

        def on_sigterm(signum: int, frame: Any) -> None:
            self._sigterm.set()  # acted on at the next optimizer-step boundary (_StopOnSigterm)
            if chained is not None:
                chained(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)  # Lightning's teardown restores the handler it found

    def stop_if_terminated(self, trainer: Any, module: Any) -> None:
        """At an optimizer-step boundary, on every rank: if any rank got SIGTERM, save a checkpoint and exit 143."""
        flag = torch.tensor([1 if self._sigterm.is_set() else 0], device=self.root_device)
        if world_rank(self.process_group)[0] > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        if not flag.item():
            return
        saver = next((cb for cb in trainer.callbacks if callable(getattr(cb, "save_on_signal", None))), None)
        if saver is not None:
            saver.save_on_signal(trainer, module)
        else:
            folder = getattr(trainer.checkpoint_callback, "dirpath", None) or trainer.default_root_dir
            trainer.save_checkpoint(os.path.join(folder, f"preempted-step={trainer.global_step}.ckpt"))
        if self.is_global_zero:
            logger.warning(
                "SIGTERM received: stopped after step %d. %s Exiting with code %d.",
                trainer.global_step, self._resume_hint(), SIGTERM_EXIT_CODE,
            )
        raise SIGTERMException(SIGTERM_EXIT_CODE)


class _StopOnSigterm(Callback):
    """Registered by the sharded strategies: checks for a SIGTERM at each optimizer-step boundary (a step has
    completed when `global_step` moved), so a checkpoint never holds half an accumulated gradient."""

    def __init__(self) -> None:
        self._step: int | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._step or not isinstance(trainer.strategy, _ShardedStrategy):
            return
        self._step = trainer.global_step
        trainer.strategy.stop_if_terminated(trainer, module)


class ZeroStrategy(_ShardedStrategy):
    """ZeRO stage 1 or 2 (`core_parallel.ZeroConfig`) as a Lightning strategy.

    Keyword arguments other than the ones below go to `ZeroConfig` unchanged (`bucket_mb`, `overlap`,
    loss-scaler settings, ...); `precision` comes from `Trainer(precision=...)`.

    Args:
        stage: 1 shards optimizer state and fp32 master weights; 2 shards gradients too.
        offload: "none", or "cpu" for master weights and optimizer state in CPU memory.
        collective_timeout_s: seconds after which a collective waiting for a dead rank raises.
    """

    def __init__(self, *, stage: int = 2, offload: str = "none", collective_timeout_s: float = 1800.0, **kwargs: Any):
        config, strategy_kwargs = _split_config_kwargs(kwargs, "ZeroConfig")
        super().__init__(collective_timeout_s=collective_timeout_s, **strategy_kwargs)
        self._config_kwargs = {"stage": stage, "offload": offload, **config}
        self.core_config("fp32")  # validate now, not after the processes started

    def core_config(self, precision: str) -> Any:
        from ..core_parallel import ZeroConfig

        return ZeroConfig(precision=precision, **self._config_kwargs)


class GeminiStrategy(_ShardedStrategy):
    """Gemini, chunk-based ZeRO-3 (`core_parallel.GeminiConfig`), as a Lightning strategy.

    Keyword arguments other than the ones below go to `GeminiConfig` unchanged (`device_memory_budget`,
    `chunk_mb`, `prefetch`, `offload_tier`, the static fractions, ...); `precision` comes from
    `Trainer(precision=...)`.

    Args:
        placement: "static" or "auto" (traced in the first step, kept within the device budget).
        offload: the off-device tier in one word. "cpu" or "nvme": data placed off the device lives in CPU
            memory or in NVMe files in `offload_dir`; under static placement all chunks' master weights and
            optimizer states go there (fractions 1.0 unless given). "none": static placement keeps everything
            on the device (auto placement spills to CPU memory). None (default): "none", or the tier named by
            `offload_tier=` (as `strategy_from_config` passes it).
        offload_dir: folder of the NVMe tier, only with offload="nvme" (or offload_tier="nvme"); there without a
            folder: a temporary folder. Given with offload="none"/"cpu" it is an error;
            given alone it selects the NVMe tier as before, with a DeprecationWarning.
        collective_timeout_s: seconds after which a collective waiting for a dead rank raises.
    """

    def __init__(
        self,
        *,
        placement: str = "static",
        offload: str | None = None,
        offload_dir: str | os.PathLike | None = None,
        collective_timeout_s: float = 1800.0,
        **kwargs: Any,
    ) -> None:
        config, strategy_kwargs = _split_config_kwargs(kwargs, "GeminiConfig")
        offload_dir = os.fspath(offload_dir) if offload_dir is not None else None
        self.offload_tier = _gemini_tier(offload, config.pop("offload_tier", None), offload_dir)
        super().__init__(collective_timeout_s=collective_timeout_s, **strategy_kwargs)
        self.offload = offload if offload is not None else ("nvme" if self.offload_tier == "nvme" else "none")
        self._offload_dir = offload_dir
        fractions = _offload_fields(offload) if placement == "static" else {}
        self._config_kwargs = {"placement": placement, **fractions, **config}
        self.core_config("fp32", check_only=True)

    @property
    def offload_dir(self) -> str | None:
        """The NVMe folder in use (resolved on first use for the NVMe tier without a folder)."""
        if self._offload_dir is None and self.offload_tier == "nvme":
            self._offload_dir = tempfile.mkdtemp(prefix="suite-offload-")
            logger.info("gemini NVMe tier in %s", self._offload_dir)
        return self._offload_dir

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

    def core_config(self, precision: str, check_only: bool = False) -> Any:
        from ..core_parallel import GeminiConfig

        offload_dir = self._offload_dir if check_only else self.offload_dir
        if check_only and offload_dir is None and self.offload_tier == "nvme":
            offload_dir = tempfile.gettempdir()
        return GeminiConfig(precision=precision, offload_tier=self.offload_tier, offload_dir=offload_dir,
                            **self._config_kwargs)


def strategy_from_config(config: Any, **kwargs: Any) -> ZeroStrategy | GeminiStrategy:
    """The Lightning strategy for a `core_parallel.ZeroConfig` or `GeminiConfig`, built directly from it.

    No registry name and no environment variable: every field of `config` reaches the strategy (the NVMe
    folder of a Gemini config included), and `strategy.core_config(p)` equals `config` with precision `p`.
    `kwargs` are the strategy's own arguments (`collective_timeout_s`, `accelerator`,
    `process_group_backend`, ...). The precision is the Trainer's (`Trainer(precision=...)`): a config whose
    `precision` is not the default "fp32" is refused rather than silently overridden.
    """
    from ..core_parallel import GeminiConfig, ZeroConfig

    if isinstance(config, ZeroConfig):
        cls: type[_ShardedStrategy] = ZeroStrategy
    elif isinstance(config, GeminiConfig):
        cls = GeminiStrategy
    else:
        raise TypeError(f"config must be a ZeroConfig or GeminiConfig, got {type(config).__name__}")
    if config.precision != "fp32":
        raise InputError(
            f"{type(config).__name__}.precision={config.precision!r}: the strategy takes its precision from "
            "Trainer(precision=...); leave the config's precision at 'fp32'"
        )
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "precision"}
    clash = sorted(set(fields) & set(kwargs))
    if clash:
        raise TypeError(f"strategy_from_config: {clash} come from the config, not from keyword arguments")
    return cls(**fields, **kwargs)


STRATEGY_NAMES = ("auto", "ddp", "zero1", "zero2", "zero2_offload", "gemini", "gemini_offload", "gemini_nvme",
                  "gemini_auto")
"""The strategy names the apps' `--strategy` takes (the sharded ones registered below, plus Lightning's)."""
_NVME_NAMES = ("gemini_nvme", "gemini_auto")


def strategy_kind(name: str) -> str | None:
    """"zero" or "gemini" for the names of this module's strategies, None for the others (auto, ddp, ...)."""
    if name.startswith("zero") and name in STRATEGY_NAMES:
        return "zero"
    if name.startswith("gemini") and name in STRATEGY_NAMES:
        return "gemini"
    return None


def parallel_for_strategy(name: str, offload_dir: str | os.PathLike | None = None) -> Any:
    """The `ZeroConfig` / `GeminiConfig` a strategy name stands for (what `StrategyRegistry[name]`'s strategy
    builds, precision fp32), with `offload_dir` as its NVMe folder; None for names that shard nothing here
    (auto, ddp, Lightning's own). gemini_nvme without a folder gets a new temporary one (made now).

    One `InputError` for `offload_dir` with a name that has no NVMe tier.
    """
    from ..core_parallel import GeminiConfig, ZeroConfig

    if offload_dir is not None and name not in _NVME_NAMES:
        raise InputError(f"--offload_dir {offload_dir}: only the strategies with an NVMe tier use it "
                         f"({', '.join(_NVME_NAMES)}), not --strategy {name}")
    folder = os.fspath(offload_dir) if offload_dir is not None else None
    if name == "gemini_nvme" and folder is None:
        folder = tempfile.mkdtemp(prefix="suite-offload-")
        logger.info("gemini NVMe tier in %s", folder)
    off = {"offload_param_frac": 1.0, "offload_optim_frac": 1.0}
    table = {
        "zero1": lambda: ZeroConfig(stage=1),
        "zero2": lambda: ZeroConfig(stage=2),
        "zero2_offload": lambda: ZeroConfig(stage=2, offload="cpu"),
        "gemini": lambda: GeminiConfig(),
        "gemini_offload": lambda: GeminiConfig(offload_tier="cpu", **off),
        "gemini_nvme": lambda: GeminiConfig(offload_tier="nvme", offload_dir=folder, **off),
        "gemini_auto": lambda: GeminiConfig(placement="auto", offload_tier="nvme" if folder else "cpu",
                                            offload_dir=folder),
    }
    return table[name]() if name in table else None


def _gemini_tier(offload: str | None, tier: str | None, offload_dir: str | None) -> str:
    """The `GeminiConfig.offload_tier` that `offload`, `offload_tier` and `offload_dir` name together; one
    `InputError` when they disagree."""
    from ..core_parallel.gemini import OFFLOAD_TIERS

    if offload is not None and offload not in GEMINI_OFFLOADS:
        raise InputError(f"offload must be one of {', '.join(GEMINI_OFFLOADS)}, got {offload!r}")
    if tier is not None and tier not in OFFLOAD_TIERS:
        raise InputError(f"offload_tier must be one of {', '.join(OFFLOAD_TIERS)}, got {tier!r}")
    if offload in OFFLOAD_TIERS and tier is not None and tier != offload:
        raise InputError(f"offload={offload!r} and offload_tier={tier!r} name different tiers; give one of them")
    if offload == "none" and tier == "nvme":
        raise InputError("offload='none' and offload_tier='nvme' disagree; use offload='nvme'")
    if offload in OFFLOAD_TIERS:
        tier = offload
    elif tier is None:
        if offload is None and offload_dir is not None:
            warnings.warn(
                "GeminiStrategy(offload_dir=...) without offload: taken as the NVMe tier; say offload='nvme' "
                "(a folder alone will stop selecting it)", DeprecationWarning, stacklevel=3,
            )
            tier = "nvme"
        else:
            tier = "cpu"
    if offload_dir is not None and tier != "nvme":
        named = f"offload={offload!r}" if offload is not None else f"offload_tier={tier!r}"
        raise InputError(
            f"offload_dir={offload_dir!r} applies to the NVMe tier only; {named} keeps off-device data in "
            "CPU memory (drop offload_dir, or use offload='nvme')"
        )
    return tier


def _offload_fields(offload: str | None) -> dict[str, Any]:
    """GeminiConfig static-placement fractions for the `offload` shorthand: "cpu" and "nvme" move every chunk's
    master weights and optimizer states off the device (the tier itself is `offload_tier`)."""
    if offload in (None, "none"):
        return {}
    return {"offload_param_frac": 1.0, "offload_optim_frac": 1.0}


def _split_config_kwargs(kwargs: dict[str, Any], config_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate the config's fields from Lightning strategy arguments (accelerator, cluster_environment...)."""
    from .. import core_parallel

    config_cls = getattr(core_parallel, config_name)
    fields = {f.name for f in dataclasses.fields(config_cls)}
    if "precision" in kwargs:
        raise InputError("set the precision with Trainer(precision=...), not on the strategy")
    config = {k: v for k, v in kwargs.items() if k in fields}
    rest = {k: v for k, v in kwargs.items() if k not in fields}
    return config, rest


def _check_clipping(trainer: Any) -> None:
    if trainer.gradient_clip_val and str(trainer.gradient_clip_algorithm) in ("value", "GradClipAlgorithmType.VALUE"):
        raise InputError(
            "gradient_clip_algorithm='value' is not supported by the sharded strategies; use 'norm' (the default)"
        )


def _looks_like_peer_failure(exc: BaseException) -> bool:
    dist_errors = tuple(
        getattr(dist, name) for name in ("DistError", "DistBackendError", "DistNetworkError") if hasattr(dist, name)
    )
    if isinstance(exc, PeerFailureError) or (dist_errors and isinstance(exc, dist_errors)):
        return True
    return isinstance(exc, RuntimeError | TimeoutError | ConnectionError) and bool(_PEER_FAILURE.search(str(exc)))


def _lost_ranks(exc: BaseException | None, world: int, me: int) -> list[int]:
    """The ranks a peer failure names (`PeerLostError.ranks` anywhere in the chain); with two ranks, the other."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        ranks = getattr(exc, "ranks", None)
        if isinstance(ranks, list) and ranks:
            return [int(r) for r in ranks]
        exc = exc.__cause__ or exc.__context__
    return [1 - me] if world == 2 else []


def _load_lightning_state(path: Path) -> dict[str, Any]:
    from lightning.fabric.utilities.data import AttributeDict

    with torch.serialization.safe_globals([AttributeDict]):
        return torch.load(path, map_location="cpu", weights_only=True)


_REGISTRY: tuple[tuple[str, type, str, dict[str, Any]], ...] = (
    ("zero1", ZeroStrategy, "ZeRO stage 1: optimizer state and master weights sharded", {"stage": 1}),
    ("zero2", ZeroStrategy, "ZeRO stage 2: gradients sharded too", {"stage": 2}),
    (
        "zero2_offload",
        ZeroStrategy,
        "ZeRO stage 2, master weights and optimizer state in CPU memory",
        {"stage": 2, "offload": "cpu"},
    ),
    ("gemini", GeminiStrategy, "Gemini (chunked ZeRO-3), all on the device", {}),
    ("gemini_offload", GeminiStrategy, "Gemini, optimizer state and master weights in CPU memory", {"offload": "cpu"}),
    (
        "gemini_nvme",
        GeminiStrategy,
        "Gemini, optimizer state and master weights on NVMe (a temporary folder)",
        {"offload": "nvme"},
    ),
    ("gemini_auto", GeminiStrategy, "Gemini with auto placement within the device budget", {"placement": "auto"}),
)


def register_strategies(registry: Any = StrategyRegistry) -> list[str]:
    """Register the names above (skipping names already there); returns the names registered now."""
    added = []
    for name, cls, description, init_kwargs in _REGISTRY:
        if name not in registry:
            registry.register(name, cls, description=description, **init_kwargs)
            added.append(name)
    return added


register_strategies()
