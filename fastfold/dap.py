"""Dynamic axial parallelism for the AlphaFold model, applied from outside: `parallelize_dap(model, group)`.

The plan (FastFold's, on explicit groups and any sizes). Weights are replicated; only activations are split
across the ranks of the DAP mesh axis `group`. The model's stacks have one forward each, written against a
`Layout` (`fastfold.model.options`); `parallelize_dap` installs `DAPLayout(group)` on the Evoformer, extra-MSA
and template pair stacks, which turns the layout's moves into `core_parallel.dap` collectives:

- Each stack splits its inputs by rows on entry and gathers its outputs on exit, so the embedders, the template
  pointwise attention, the structure module and the heads run unchanged on whole tensors.
- Inside a stack the MSA representation m `[*, S, N, C_m]` is split by rows (S, tensor dim -3) for the row
  attention and by columns (N, dim -2) for the column attention, the transition and the outer product
  mean; the pair representation z `[*, N, N, C_z]` is split by rows for the outgoing triangle
  multiplication and the starting-node attention, by columns for the incoming multiplication and the
  ending-node attention. `core_parallel.dap.all_to_all` moves the split between the two dims.
- What an operation needs whole is gathered: the pair bias of the MSA row attention and of the triangle
  attentions, one gated projection of each triangle multiplication, and the right projection of the outer
  product mean.
- m's move back from columns to rows is launched before the pair stack and waited for after it, so it
  overlaps the pair stack.

Uneven sizes (any N_res, any MSA depth, fewer rows than ranks) are handled by the primitives' internal
padding. Chunking works unchanged inside each rank (`InferenceOptions.chunk_size`).

`DAPRuntime` runs a whole fold on one DAP group: `suite fold --devices N` launches it once per run, the
Lightning `DAPStrategy` wraps the group it set up; both load, broadcast and predict through it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core_parallel import dap as comm
from ..core_parallel.launch import RankError
from ..utils.errors import InputError
from .model.evoformer import EvoformerStack, ExtraMSAStack, TemplatePairStack
from .model.multimer import TemplatePairStackMultimer
from .model.options import SINGLE_PROCESS, Layout

logger = logging.getLogger(__name__)

__all__ = ["CONNECT_TIMEOUT_S", "DAPLayout", "DAPRuntime", "broadcast_batch", "broadcast_module", "parallelize_dap",
           "refuse_under_launcher"]

_STACKS = (EvoformerStack, ExtraMSAStack, TemplatePairStack, TemplatePairStackMultimer)
"""The stacks that run through a `Layout` (monomer and AlphaFold-Multimer models)."""


class DAPLayout(Layout):
    """A stack's activations split across the ranks of the DAP mesh axis `group` (see `Layout`)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world = comm.group_size(group)

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return comm.scatter(x, dim, self.group)

    def gather(self, x: torch.Tensor, dim: int, full_size: int) -> torch.Tensor:
        return comm.gather(x, dim, self.group, full_size=full_size)

    def move(self, x: torch.Tensor, from_dim: int, to_dim: int, from_size: int) -> torch.Tensor:
        pending = comm.all_to_all_async(x, from_dim, to_dim, self.group, from_size=from_size)
        del x  # the caller's reference may be the last one: free the input while the exchange runs
        return pending.wait()

    def move_async(self, x: torch.Tensor, from_dim: int, to_dim: int, from_size: int) -> comm.Pending:
        return comm.all_to_all_async(x, from_dim, to_dim, self.group, from_size=from_size)


def parallelize_dap(model: nn.Module, group: Any) -> nn.Module:
    """Split the Evoformer, extra-MSA and template pair stacks of `model` across the ranks of `group`.

    Changes `model` in place (installs `DAPLayout(group)` on each stack; weights, state_dict and every
    forward untouched) and returns it. Every rank of `group` must call the model with the same batch (see
    `broadcast_batch`); each returns the same whole outputs as the unsplit model. `group=None` (one process,
    no process group) leaves the model as it is; a one-rank group runs the plan with every communication a
    no-op.
    """
    if group is None:
        return model
    stacks = [m for m in model.modules() if type(m) in _STACKS]
    if not stacks:
        raise ValueError("parallelize_dap: the model has no Evoformer, extra-MSA or template pair stack")
    if any(s.layout is not SINGLE_PROCESS for s in stacks):
        raise ValueError("parallelize_dap: this model is already split across a DAP group")
    layout = DAPLayout(group)
    for stack in stacks:
        stack.layout = layout
    logger.info("DAP: %d stacks split across %d ranks", len(stacks), layout.world)
    return model


@torch.no_grad()
def broadcast_module(module: nn.Module, group: Any, src: int = 0) -> None:
    """Rank `src`'s parameters and buffers on every rank of `group` (DAP needs identical weights)."""
    if comm.group_size(group) == 1:
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, group=group, group_src=src)


def broadcast_batch(
    batch: Mapping[str, Any] | None, group: Any, src: int = 0, device: torch.device | str | None = None
) -> dict[str, Any]:
    """The feature batch of rank `src` (its index in `group`) on every rank of `group`.

    Only rank `src` needs `batch` (a mapping of tensors; other values travel as pickled objects); the
    others pass None. Tensors arrive on `device` (default: CPU for gloo, the current CUDA device for NCCL).
    """
    if comm.group_size(group) == 1:
        if batch is None:
            raise ValueError("broadcast_batch: one rank and no batch")
        return dict(batch)
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    me = comm.group_rank(group)
    header: list[Any] = [None]
    if me == src:
        if batch is None:
            raise ValueError(f"broadcast_batch: rank {src} is the source but has no batch")
        header[0] = {
            k: (("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("object", v))
            for k, v in batch.items()
        }
    dist.broadcast_object_list(header, group=group, group_src=src)
    out: dict[str, Any] = {}
    for key, meta in header[0].items():
        if meta[0] == "object":
            out[key] = meta[1]
            continue
        t = batch[key].to(device).contiguous() if me == src else torch.empty(meta[1], dtype=meta[2], device=device)
        dist.broadcast(t, group=group, group_src=src)
        out[key] = t
    return out


class DAPRuntime:
    """One DAP group for a whole run, and the model its ranks hold (one at a time).

    Rank 0 drives: it reads the inputs, broadcasts each batch (`broadcast`) and writes the outputs; every
    rank holds the same weights (`prepare`: rank 0's weights broadcast, then `parallelize_dap`). Two ways in:

    - `DAPRuntime.launch(devices)` (`suite fold --devices N`): this process becomes rank 0 and spawns the
      N - 1 other ranks once for the whole run (NCCL on CUDA, one GPU per rank; gloo on CPU). `call(fn, ...)`
      then runs `fn(runtime, *args, source)` on every rank, `source` (a batch) on rank 0 only. A rank that
      fails stops the runtime: its error is raised on rank 0 as `RankError` and every later call fails at
      once; a hang is bounded by the collective timeout.
    - `DAPRuntime(group, device)` (`recipes.DAPStrategy`): the ranks already exist and run the same code.
    """

    def __init__(self, group: Any, device: torch.device | str, *, followers: list | None = None,
                 topology: Any = None) -> None:
        self.group, self.device = group, torch.device(device)
        self.world, self.rank = comm.group_size(group), comm.group_rank(group)
        self.model: nn.Module | None = None
        """The model this rank holds (see `hold`)."""
        self.key: Any = None
        """What `model` was built from."""
        self.extra: Any = None
        """What the builder returned beside the model (e.g. its feature sizes)."""
        self._followers = followers or []
        self._topology = topology
        self._broken = ""

    # --- what every rank does (both kinds of runtime)

    def prepare(self, model: nn.Module) -> nn.Module:
        """`model` with rank 0's weights, split across the group (in place)."""
        broadcast_module(model, self.group)
        return parallelize_dap(model, self.group)

    def broadcast(self, batch: Mapping[str, Any] | None) -> dict[str, Any]:
        """Rank 0's batch (others pass None) on every rank, on this rank's device."""
        return broadcast_batch(batch if self.rank == 0 else None, self.group, src=0, device=self.device)

    def hold(self, key: Any, build) -> tuple[nn.Module, Any]:
        """The model built by `build()` -> (model, extra), prepared; kept until another `key` is asked for, so
        one model at a time is alive (the previous one is dropped before the next is built)."""
        if self.model is None or self.key != key:
            self.model = self.key = self.extra = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            model, extra = build()
            self.model, self.key, self.extra = self.prepare(model), key, extra
        return self.model, self.extra

    # --- driving a launched runtime from rank 0

    @classmethod
    def launch(cls, devices: int, *, device_type: str = "cpu", timeout_s: float = 1800.0):
        """Context manager: a runtime of `devices` ranks, this process rank 0 (see the class docstring)."""
        return _Launched(cls, devices, device_type, timeout_s)

    def call(self, fn, *args: Any, source: Any = None) -> Any:
        """`fn(runtime, *args, source)` on every rank (`fn` importable by name, `args` picklable; `source` on
        rank 0 only, None elsewhere); returns rank 0's result."""
        if self._broken:
            raise RuntimeError(f"the DAP runtime has stopped: {self._broken}")
        try:
            for r, (proc, conn) in enumerate(self._followers, 1):
                if not proc.is_alive():
                    raise RankError(r, "ProcessDied", f"exit code {proc.exitcode}", "(no traceback)")
                conn.send((fn, args))
            result = fn(self, *args, source)
            for r, (proc, conn) in enumerate(self._followers, 1):
                _wait_ack(r, proc, conn, self._topology.timeout_s)
            return result
        except BaseException as exc:
            if not self._followers:
                raise
            err = exc if isinstance(exc, RankError) else _first_report(self._followers, wait_s=3.0)
            self._stop(f"{type(err or exc).__name__}: {err or exc}".splitlines()[0])
            if err is not None and err is not exc:
                raise err from exc
            raise

    def _stop(self, why: str) -> None:
        """Kill the other ranks and drop the group (after a failure)."""
        self._broken = why
        for proc, conn in self._followers:
            conn.close()
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10.0)
        self._destroy()

    def _destroy(self) -> None:
        self.model = None
        if self._topology is not None:
            try:
                self._topology.destroy()
                _destroy_default()
            except Exception:  # noqa: BLE001 - the group may be broken after a peer died
                logger.debug("DAP runtime: destroying the process group failed", exc_info=True)
            self._topology = None

    def close(self) -> None:
        """Stop the other ranks (they finish their loop) and destroy the group."""
        if self._broken:
            return
        self._broken = "closed"
        for _proc, conn in self._followers:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc, conn in self._followers:
            proc.join(timeout=30.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10.0)
            conn.close()
        self._destroy()


class _Launched:
    """`DAPRuntime.launch`'s context manager: spawn, init, yield the runtime, close."""

    def __init__(self, cls, devices: int, device_type: str, timeout_s: float) -> None:
        if devices < 1:
            raise ValueError(f"DAPRuntime.launch: devices must be >= 1, got {devices}")
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"DAPRuntime.launch: device_type must be cpu or cuda, got {device_type!r}")
        if device_type == "cuda" and torch.cuda.device_count() < devices:
            raise ValueError(f"DAPRuntime.launch: {devices} ranks need {devices} CUDA devices, this machine has "
                             f"{torch.cuda.device_count()}")
        self.cls, self.devices, self.device_type, self.timeout_s = cls, devices, device_type, timeout_s
        self.runtime: DAPRuntime | None = None
        self._threads = torch.get_num_threads()

    def __enter__(self) -> DAPRuntime:
        import multiprocessing as mp
        import os

        from ..core_parallel import Axis, Topology
        from ..core_parallel.launch import free_port
        from ..kernels.backend import default_backend

        if dist.is_initialized():
            raise RuntimeError("DAPRuntime.launch: this process already belongs to a process group (a launcher such "
                               "as torchrun started it); the runtime starts its own ranks")
        ctx = mp.get_context("spawn")
        port, world = free_port(), self.devices
        backend = "nccl" if self.device_type == "cuda" else "gloo"
        threads = max(1, (os.cpu_count() or 1) // world) if self.device_type == "cpu" else self._threads
        followers = []
        try:
            for r in range(1, world):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_follow, args=(r, world, port, backend, self.timeout_s, threads,
                                                         default_backend(), theirs),
                                   daemon=True, name=f"dap-rank-{r}")
                proc.start()
                theirs.close()
                followers.append((proc, mine))
            for r, (proc, conn) in enumerate(followers, 1):
                _wait_ack(r, proc, conn, 120.0)  # started: imports done, joining the group
            torch.set_num_threads(threads)
            device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            _join_group(0, world, port, backend, self.timeout_s)
            topology = Topology(world_size=world, rank=0, dap=world, backend=backend, timeout_s=self.timeout_s)
            topology.init()
            group = topology.group(Axis.DAP) if world > 1 else None
        except BaseException as exc:
            # a rank that could not join says why (its own error) rather than rank 0's "did not join"
            report = _first_report(followers, wait_s=1.0) if isinstance(exc, TimeoutError) else None
            for proc, conn in followers:
                proc.kill()
                proc.join(timeout=10.0)
                conn.close()
            _destroy_default()
            torch.set_num_threads(self._threads)
            if isinstance(report, RankError) and report.exc_type != "ProcessDied":
                raise report from exc
            raise
        self.runtime = self.cls(group, device, followers=followers, topology=topology)
        logger.info("DAP runtime: %d ranks (%s)", world, backend)
        return self.runtime

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.runtime is not None:
                self.runtime.close()
        finally:
            torch.set_num_threads(self._threads)


CONNECT_TIMEOUT_S = 60.0
"""Seconds the ranks of a launched runtime have to meet at rank 0's rendezvous before the set-up fails, naming
the ranks that did not come (the collective timeout, much longer, bounds the collectives after that)."""


def _join_group(rank: int, world: int, port: int, backend: str, timeout_s: float,
                connect_s: float = CONNECT_TIMEOUT_S) -> None:
    """Create the default process group of a launched runtime on its own TCP store at 127.0.0.1:`port` (rank 0
    hosts it). Not `init_method="tcp://..."`: under a launcher (torchrun sets TORCHELASTIC_USE_AGENT_STORE) torch
    would use the launcher's store instead, shared with every other process it started. A rank missing after
    `connect_s` seconds is a `TimeoutError` naming it (on rank 0) or naming rank 0's address (on the others)."""
    import datetime
    import time

    if world == 1:
        return
    address = f"127.0.0.1:{port}"
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=connect_s))
    except (RuntimeError, OSError) as exc:
        raise TimeoutError(f"DAP rank {rank} of {world}: could not reach rank 0's rendezvous at {address} within "
                           f"{connect_s:.0f} s ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                           ) from exc
    store.set(f"joined/{rank}", "1")
    if rank == 0:
        deadline = time.monotonic() + connect_s
        missing = list(range(1, world))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"joined/{r}"])]
            time.sleep(0.05 if missing else 0.0)
        if missing:
            who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
            raise TimeoutError(f"DAP set-up: {who} of {world} did not join the rendezvous at {address} within "
                               f"{connect_s:.0f} s")
        store.set("all-joined", "1")
    else:
        try:
            store.wait(["all-joined"], datetime.timedelta(seconds=connect_s))
        except (RuntimeError, OSError) as exc:
            raise TimeoutError(f"DAP rank {rank} of {world}: rank 0 ({address}) did not report every rank joined "
                               f"within {connect_s:.0f} s") from exc
    dist.init_process_group(backend, store=dist.PrefixStore("dap", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _destroy_default() -> None:
    """Destroy the default group `_join_group` made (if any)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def refuse_under_launcher(command: str = "suite fold", environ: Mapping[str, str] | None = None) -> None:
    """`suite fold` starts its own ranks (`DAPRuntime.launch`, on 127.0.0.1): a process that is one of several a
    launcher started (torchrun, or any launcher setting WORLD_SIZE > 1) would fold the same targets once per
    process, each with its own ranks. Refused in one line before any work, saying how to run fold instead."""
    import os

    env = os.environ if environ is None else environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    if world <= 1:
        return
    launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "a launcher"
    raise InputError(f"{command}: this process is rank {env.get('RANK', '?')} of {world} started by {launcher} "
                     f"(WORLD_SIZE={world}), and fold does not run under torchrun: it starts its own ranks. Run it "
                     "once, without a launcher: on one machine 'suite fold --devices N' (DAP over N local ranks); "
                     "across machines start a Ray cluster ('ray start' on each node) and run 'suite fold "
                     "--ray_address HEAD:6379'")


def _wait_ack(rank: int, proc: Any, conn: Any, timeout_s: float) -> None:
    """Wait for rank `rank`'s answer to the last message: ("ok", None) or ("error", report)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                kind, report = conn.recv()
            except EOFError:
                kind, report = "error", ("ProcessDied", f"exit code {proc.exitcode}", "(no traceback)")
            if kind == "error":
                raise RankError(rank, *report)
            return
        if not proc.is_alive() and not conn.poll(0.2):
            raise RankError(rank, "ProcessDied", f"exit code {proc.exitcode}", "(no traceback)")
    raise TimeoutError(f"DAP rank {rank} did not answer within {timeout_s:.0f}s")


def _first_report(followers: list, wait_s: float) -> BaseException | None:
    """The first follower error (rank order) reported within `wait_s` seconds; else a follower that died without
    a report (`ProcessDied`); else None."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        dead = None
        for r, (proc, conn) in enumerate(followers, 1):
            try:
                if conn.poll():
                    kind, report = conn.recv()
                    if kind == "error":
                        return RankError(r, *report)
            except (EOFError, OSError):
                dead = dead or RankError(r, "ProcessDied", f"exit code {proc.exitcode}", "(no traceback)")
        if dead is not None or time.monotonic() >= deadline:
            return dead
        time.sleep(0.1)


def _follow(rank: int, world: int, port: int, backend: str, timeout_s: float, threads: int,
            kernel_backend: tuple[str, str], conn: Any) -> None:
    """A launched runtime's rank > 0: run what rank 0 sends until it sends None (or goes away), with rank 0's
    kernel backend (`kernel_backend`: `kernels.backend.default_backend()` there)."""
    import os
    import traceback

    topology = None
    try:
        from ..core_parallel import Axis, Topology
        from ..kernels.backend import set_default_backend

        set_default_backend(kernel_backend[0], source=kernel_backend[1])
        torch.set_num_threads(threads)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send(("ok", None))
        _join_group(rank, world, port, backend, timeout_s)
        topology = Topology(world_size=world, rank=rank, dap=world, backend=backend, timeout_s=timeout_s)
        topology.init()
        runtime = DAPRuntime(topology.group(Axis.DAP), device)
        while True:
            try:
                message = conn.recv()
            except EOFError:  # rank 0 is gone
                os._exit(1)
            if message is None:
                break
            fn, args = message
            fn(runtime, *args, None)
            conn.send(("ok", None))
    except BaseException as exc:  # noqa: B036 - every failure must reach rank 0
        try:
            conn.send(("error", (type(exc).__name__, str(exc), traceback.format_exc())))
        finally:
            os._exit(1)  # closes this rank's connections now: rank 0's collectives fail instead of waiting
    runtime.model = None
    topology.destroy()
    _destroy_default()
