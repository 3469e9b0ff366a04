"""`suite bench strategies`: Lightning strategies side by side on one LightningModule."""

from __future__ import annotations

import argparse
import logging
import time

from ...utils.memory_meter import SideMeter, hwm_bytes
from ..errors import UsageError
from .harness import DDP_OPTIONS, add_ratios, fast_optimizer, publish, ran

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, help="processes per strategy")
    parser.add_argument("--strategies", default="ddp,fsdp,zero2,gemini", help="comma-separated strategy names")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP width")
    parser.add_argument("--layers", type=int, default=8, help="MLP depth")
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--precision", default="32-true", help="Trainer precision")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "gpu"],
                        help="cpu (gloo) or gpu (NCCL); auto picks gpu when CUDA is there")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per strategy")


def _module(hidden: int, layers: int, batch: int, n_batches: int, cuda: bool):
    """The MLP every strategy trains; it records each training step's seconds (`times`)."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    sync = torch.cuda.synchronize if cuda else (lambda: None)  # each step's time: its kernels done

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            blocks = [nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()) for _ in range(layers)]
            self.net = nn.Sequential(*blocks, nn.Linear(hidden, hidden))
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            sync()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            sync()
            self.times.append(time.perf_counter() - self._t0)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return fast_optimizer(torch.optim.AdamW, self.parameters(), lr=1e-4)[0]

        def train_dataloader(self):
            g = torch.Generator().manual_seed(self.global_rank)
            x = torch.randn(batch * n_batches, hidden, generator=g)
            return DataLoader(TensorDataset(x, x.clone()), batch_size=batch)

    return MLP()


def _bench_rank(rank: int, world: int, name: str, args: dict) -> dict:
    """One rank of one strategy: fit for warmup + steps, return peak memory and step times."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from ... import recipes  # noqa: F401  (registers zero2, gemini, ...)

    cuda = args["accelerator"] == "gpu"
    n_steps = args["warmup"] + args["steps"]
    meter = SideMeter().start()
    trainer = pl.Trainer(
        strategy=DDPStrategy(**DDP_OPTIONS) if name == "ddp" else name, accelerator=args["accelerator"],
        devices=world, max_steps=n_steps, precision=args["precision"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )
    module = _module(args["hidden"], args["layers"], args["batch"], n_steps, cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = hwm_bytes()  # own peak (VmHWM): ru_maxrss inherits the parent's across fork and exec
    trainer.fit(module)
    peak = torch.cuda.max_memory_allocated() if cuda else hwm_bytes() - before
    charged = meter.peak()
    meter.close()
    times = sorted(module.times[args["warmup"]:])
    return {"peak_bytes": int(peak), "step_s": times[len(times) // 2] if times else float("nan"),
            "charged_bytes": charged, "memory_method": meter.method, "ran": ran(name, "AdamW")}


def _run_strategy(name: str, args: argparse.Namespace, shared: dict) -> dict:
    from ...core_parallel import RankError, run_on_ranks

    try:
        per_rank = run_on_ranks(_bench_rank, args.ranks, name, shared, backend="none", timeout=args.timeout,
                                 env={"OMP_NUM_THREADS": "1"})
    except (RankError, TimeoutError) as exc:
        reason = str(exc).splitlines()[0][:160]
        short = reason.split(": ", 1)[-1][:60]
        logger.warning("%s did not run: %s", name, reason)
        return {"strategy": name, "status": f"n/a: {short}", "error": reason}
    peaks = [r["peak_bytes"] for r in per_rank]
    return {"strategy": name, "status": "ok", "peak_mb_max": max(peaks) / 2**20,
            "peak_mb_per_rank": [round(p / 2**20, 1) for p in peaks],
            "charged_mb_max": max(r["charged_bytes"] for r in per_rank) / 2**20,
            "step_ms": 1e3 * max(r["step_s"] for r in per_rank), "ran": per_rank[0]["ran"],
            "memory_method": per_rank[0]["memory_method"]}


def run(args: argparse.Namespace) -> int:
    import torch

    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.ranks < 1 or args.steps < 1 or args.hidden < 1 or args.layers < 1 or args.batch < 1:
        raise UsageError("--ranks, --steps, --hidden, --layers and --batch must be >= 1")
    if not names:
        raise UsageError("--strategies names no strategy")
    accelerator = ("gpu" if torch.cuda.is_available() else "cpu") if args.accelerator == "auto" else args.accelerator
    shared = {**{k: getattr(args, k) for k in ("hidden", "layers", "batch", "steps", "warmup", "precision")},
              "accelerator": accelerator}
    params = args.layers * (args.hidden * args.hidden + args.hidden) + args.hidden * (args.hidden + 1)
    rows = [_run_strategy(name, args, shared) for name in names]
    base = next((r for r in rows if r["strategy"] == "ddp" and r["status"] == "ok"), None)
    add_ratios([r for r in rows if r["status"] == "ok"] if base else [], base, {"mem_vs_ddp": "peak_mb_max",
               "time_vs_ddp": "step_ms", "charged_vs_ddp": "charged_mb_max"}, float("nan"))
    columns = ["strategy", "status", "peak_mb_max", "peak_mb_per_rank", "charged_mb_max", "step_ms", "mem_vs_ddp",
               "charged_vs_ddp", "time_vs_ddp", "ran"]
    title = (f"Lightning strategies: {params / 1e6:.1f}M params, {args.ranks} ranks on {accelerator}, "
             f"batch {args.batch}/rank, {args.precision}")
    methods = sorted({r["memory_method"] for r in rows if "memory_method" in r})
    publish(args, {"benchmark": "strategies", "params": params, "settings": {**shared, "ranks": args.ranks},
                   "results": rows}, [(title, rows, columns)],
            [f"charged: {methods} from before the Trainer was built (page cache included)"])
    return 0
