"""ZeroStrategy / GeminiStrategy against Lightning's ddp on 2 gloo ranks, checkpoints, resume, dead rank.

Process launches are few and grouped (each costs seconds of imports): one 2-rank launch trains every
strategy and the ddp reference and saves/resumes; one 1-rank launch resumes the 2-rank checkpoint; one
pair of subprocesses loses a rank. Ranks are started with `run_on_ranks(backend="none")`: its
environment (LOCAL_RANK, WORLD_SIZE, MASTER_PORT, ...) makes Lightning treat the processes as launched
externally, as under torchrun, and Lightning itself creates the process group.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowmem.core_parallel import run_on_ranks
from tests._paths import tests_only_path

logger = logging.getLogger(__name__)

GLOBAL_BATCH = 8
N_SAMPLES = 32
SHARDED = ("zero1", "zero2", "zero2_offload", "gemini", "gemini_offload", "gemini_nvme", "gemini_auto")
RESUMED = ("zero2", "gemini")
# (strategy, Trainer precision): half compute with fp32 master shards. "16-mixed" goes in as the strategy's
# own plugin, since on CPU Lightning would turn the name into bf16-mixed.
HALF = (("zero2", "bf16-mixed"), ("gemini", "bf16-true"), ("zero1", "16-mixed"))
RTOL = 1e-5
HALF_ATOL = 1e-2  # bf16 has 8 mantissa bits: weights of size ~0.5 after 4 steps; measured up to 2.6e-3


def _lightning():
    import lightning.pytorch as pl

    return pl


def make_module(**kwargs):
    """A tiny LightningModule with a frozen layer, two param groups, AdamW and a step LR schedule."""
    pl = _lightning()

    class Tiny(pl.LightningModule):
        def __init__(self, lr: float = 0.05, fail_at_step: int | None = None, fail_rank: int = 1) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.frozen = nn.Linear(8, 8)
            self.frozen.requires_grad_(False)
            self.body = nn.Linear(8, 24)
            self.head = nn.Linear(24, 4)
            self.lr = lr
            self.fail_at_step = fail_at_step
            self.fail_rank = fail_rank

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(self.frozen(x))))

        def training_step(self, batch, batch_idx):
            if self.fail_at_step is not None and self.global_step == self.fail_at_step:
                if self.global_rank == self.fail_rank:
                    os._exit(17)  # a rank dying without any goodbye, as on an OOM kill
            x, y = batch
            loss = nn.functional.mse_loss(self(x).float(), y.float())
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            groups = [
                {"params": self.body.parameters()},
                {"params": self.head.parameters(), "lr": self.lr / 2, "weight_decay": 0.0},
            ]
            opt = torch.optim.AdamW(groups, lr=self.lr, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x = torch.randn(N_SAMPLES, 8, generator=g)
            y = torch.randn(N_SAMPLES, 4, generator=g)
            # The same global batch on any number of ranks (rank r takes every world-th sample), so runs on
            # 1 and 2 ranks and the plain loop agree; Lightning's own DistributedSampler is switched off.
            world, rank = self.trainer.world_size, self.global_rank
            return DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=GLOBAL_BATCH // world)

    return Tiny(**kwargs)


ACCUMULATE = 2
CLIP = 0.05


def trainer_defaults(**kwargs) -> dict:
    """Trainer arguments shared by every run here: accumulation and clipping on, no logging."""
    return {
        "accelerator": "cpu",
        "accumulate_grad_batches": ACCUMULATE,
        "gradient_clip_val": CLIP,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "use_distributed_sampler": False,
        "default_root_dir": ".",
        **kwargs,
    }


def make_trainer(strategy, devices: int, root: Path, max_epochs: int, **kwargs):
    pl = _lightning()
    from lowmem import recipes  # noqa: F401  (registers the strategy names)

    args = trainer_defaults(max_epochs=max_epochs, default_root_dir=str(root), **kwargs)
    return pl.Trainer(strategy=strategy, devices=devices, **args)


def reference_weights(epochs: int) -> dict[str, torch.Tensor]:
    """The same training as a plain single-process PyTorch loop (what every strategy must reproduce)."""
    module = make_module()
    cfg = module.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N_SAMPLES, 8, generator=g), torch.randn(N_SAMPLES, 4, generator=g)
    params = [p for p in module.parameters() if p.requires_grad]
    for _ in range(epochs):
        for i in range(N_SAMPLES // GLOBAL_BATCH):
            sl = slice(i * GLOBAL_BATCH, (i + 1) * GLOBAL_BATCH)
            (nn.functional.mse_loss(module(x[sl]), y[sl]) / ACCUMULATE).backward()
            if (i + 1) % ACCUMULATE == 0:
                torch.nn.utils.clip_grad_norm_(params, CLIP)
                opt.step()
                sched.step()
                opt.zero_grad()
    return {k: v.detach() for k, v in module.state_dict().items()}


def consolidated(ckpt: Path, out: Path) -> str:
    """Merge the sharded folder into one safetensors file; returns its path (tensors do not cross processes)."""
    from lowmem import core_parallel

    core_parallel.consolidate_checkpoint(ckpt, out)
    return str(out)


def load(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def _fit_and_save(
    name: str, root: Path, world: int, epochs: int, ckpt_path: Path | None = None, precision: str = "32-true"
) -> Path:
    strategy: object = name
    if precision == "16-mixed":
        from lightning.pytorch.strategies import StrategyRegistry

        from lowmem.recipes.precision import ShardedPrecision

        entry = StrategyRegistry[name]
        strategy = entry["strategy"](precision_plugin=ShardedPrecision("16-mixed"), **entry["init_params"])
    trainer = make_trainer(strategy, world, root, epochs, precision=precision)
    trainer.fit(make_module(), ckpt_path=ckpt_path)
    assert precision == "32-true" or trainer.precision_plugin.precision == precision
    suffix = f"{'-resumed' if ckpt_path else ''}{'' if precision == '32-true' else '-' + precision}"
    out = root / f"{name}-e{epochs}-w{world}{suffix}"
    trainer.save_checkpoint(out)
    return out


def _train_all_on_2(rank: int, world: int, root: str) -> dict:
    """Every strategy on the same data; the sharded ones saved, resumed and consolidated."""
    root = Path(root)
    results: dict = {}
    trainer = make_trainer("ddp", world, root, 2)
    module = make_module()
    trainer.fit(module)
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, root / "ddp.safetensors")
        results["ddp"] = str(root / "ddp.safetensors")
    for name in SHARDED:
        out = _fit_and_save(name, root, world, 2)
        if rank == 0:
            results[name] = consolidated(out, root / f"{name}.safetensors")
    for name in RESUMED:
        first = _fit_and_save(name, root, world, 1)
        resumed = _fit_and_save(name, root, world, 2, ckpt_path=first)
        if rank == 0:
            results[f"{name}-resumed"] = consolidated(resumed, root / f"{name}-resumed.safetensors")
    for name, precision in HALF:
        out = _fit_and_save(name, root, world, 2, precision=precision)
        if rank == 0:
            results[f"{name}-{precision}"] = consolidated(out, root / f"{name}-{precision}.safetensors")
    return results


def _resume_on_1(rank: int, world: int, root: str, dead_ckpt: str) -> dict:
    """Resume the 2-rank checkpoints on 1 rank, and the last checkpoint the dead-rank run left."""
    root = Path(root)
    results: dict = {}
    for name in RESUMED:
        resumed = _fit_and_save(name, root, world, 2, ckpt_path=root / f"{name}-e1-w2")
        results[name] = consolidated(resumed, root / f"{name}-resumed-on-1.safetensors")
    trainer = make_trainer("zero2", world, root / "after-dead", 3)
    trainer.fit(make_module(), ckpt_path=dead_ckpt)
    results["after_dead_step"] = trainer.global_step
    return results


def assert_close(actual: dict, expected: dict, label: str) -> None:
    assert set(actual) == set(expected), f"{label}: keys differ: {set(actual) ^ set(expected)}"
    for key, ref in expected.items():
        torch.testing.assert_close(actual[key].float(), ref.float(), rtol=RTOL, atol=1e-7, msg=f"{label}: {key}")


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategies")
    env = {"SUITE_OFFLOAD_DIR": str(root / "nvme"), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    results = run_on_ranks(_train_all_on_2, 2, str(root), backend="none", timeout=150, env=env)
    logger.info("2-rank strategies run took %.1fs", time.perf_counter() - t0)
    return root, {k: load(v) for k, v in results[0].items()}


@pytest.mark.distributed
@pytest.mark.parametrize("name", SHARDED)
def test_strategy_matches_ddp(two_rank_run, name):
    _, results = two_rank_run
    assert_close(results[name], results["ddp"], name)


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "precision"), HALF)
def test_half_precision_trains_close_to_fp32(two_rank_run, name, precision):
    _, results = two_rank_run
    got, ddp = results[f"{name}-{precision}"], results["ddp"]
    initial = make_module().state_dict()
    for key, ref in ddp.items():
        torch.testing.assert_close(got[key].float(), ref, rtol=0, atol=HALF_ATOL, msg=f"{name} {precision}: {key}")
    # and it did train: closer to the fp32 result than the untrained weights are
    moved = (ddp["body.weight"] - initial["body.weight"]).abs().max()
    assert (got["body.weight"].float() - ddp["body.weight"]).abs().max() < moved / 4


@pytest.mark.distributed
def test_ddp_reference_trains_like_a_plain_loop(two_rank_run):
    _, results = two_rank_run
    initial, ddp = make_module().state_dict(), results["ddp"]
    moved = [k for k in ddp if "frozen" not in k and not torch.equal(ddp[k], initial[k])]
    assert moved, "the ddp reference did not train"
    assert_close(ddp, reference_weights(epochs=2), "ddp vs a plain PyTorch loop")


@pytest.mark.distributed
@pytest.mark.parametrize("name", RESUMED)
def test_resume_same_and_other_device_count(two_rank_run, name):
    root, results = two_rank_run
    assert (root / f"{name}-e1-w2" / "lightning_state.pt").is_file()
    assert_close(results[f"{name}-resumed"], results["ddp"], f"{name} resumed on 2 ranks")


@pytest.fixture(scope="module")
def one_rank_run(two_rank_run, dead_rank_run):
    root, _ = two_rank_run
    dead_ckpt = dead_rank_run["last"]
    return run_on_ranks(_resume_on_1, 1, str(root), str(dead_ckpt), backend="none", timeout=150)[0]


@pytest.mark.distributed
@pytest.mark.parametrize("name", RESUMED)
def test_saved_on_2_ranks_resumes_on_1(two_rank_run, one_rank_run, name):
    _, results = two_rank_run
    assert_close(load(one_rank_run[name]), results["ddp"], f"{name} saved on 2 ranks, resumed on 1")


def test_registered_names_and_precision_plugin():
    from lightning.pytorch.strategies import StrategyRegistry

    from lowmem import recipes
    from lowmem.recipes.precision import ShardedPrecision

    for name in SHARDED:
        assert name in StrategyRegistry, name
    trainer = make_trainer("zero2", 1, Path("."), 1, precision="bf16-mixed")
    assert isinstance(trainer.strategy, recipes.ZeroStrategy)
    assert isinstance(trainer.precision_plugin, ShardedPrecision)
    assert trainer.precision_plugin.core_precision == "bf16"
    with pytest.raises(ValueError, match="precision"):
        ShardedPrecision("16-true")
    with pytest.raises(ValueError, match="collective_timeout_s"):
        recipes.GeminiStrategy(collective_timeout_s=0)


_DEAD_RANK_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tests.recipes.test_strategies import make_module, make_trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lowmem.recipes import ZeroStrategy

    root = Path(sys.argv[1])
    ckpt = ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(
        ZeroStrategy(stage=2, collective_timeout_s=20), 2, root, 3, callbacks=[ckpt], enable_checkpointing=True
    )
    trainer.fit(make_module(fail_at_step=3))
    """
)


def _dead_rank_env(rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
        NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONPATH=tests_only_path(), PYTHONSAFEPATH="1",
    )
    return env


@pytest.fixture(scope="module")
def dead_rank_run(tmp_path_factory) -> dict:
    """Two ranks under Lightning's ModelCheckpoint (every step); rank 1 dies in step 4 (global_step 3)."""
    from lowmem.core_parallel.launch import free_port

    root = tmp_path_factory.mktemp("dead_rank")
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _DEAD_RANK_SCRIPT, str(root)], env=_dead_rank_env(r, port),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    last = sorted((root / "ckpts").glob("*step=3.ckpt"))
    return {"root": root, "codes": [p.returncode for p in procs], "stderr": [o[1] for o in outs],
            "last": last[0] if last else None}


@pytest.mark.distributed
def test_dead_rank_stops_the_others_with_a_clear_error(dead_rank_run):
    codes, stderr = dead_rank_run["codes"], dead_rank_run["stderr"]
    assert codes[1] == 17, stderr[1][-3000:]
    assert codes[0] != 0, "the surviving rank did not stop"
    assert "lost contact with another rank" in stderr[0], stderr[0][-3000:]
    assert "Last complete checkpoint:" in stderr[0] and "step=3.ckpt" in stderr[0]


@pytest.mark.distributed
def test_last_checkpoint_before_the_death_is_intact_and_resumes(dead_rank_run, one_rank_run):
    ckpts = dead_rank_run["root"] / "ckpts"
    last = dead_rank_run["last"]
    assert last is not None and (last / "lightning_state.pt").is_file(), list(ckpts.iterdir())
    assert not list(ckpts.glob(".*")), "a half-written checkpoint was left behind"
    # 3 epochs of 2 optimizer steps; the run resumed from step 3 finishes the schedule.
    assert one_rank_run["after_dead_step"] == 6


def test_configs_behind_the_names(monkeypatch, tmp_path):
    from lightning.pytorch.strategies import StrategyRegistry

    def config(name):
        entry = StrategyRegistry[name]
        return entry["strategy"](**entry["init_params"]).core_config("bf16")

    assert (config("zero1").stage, config("zero2").stage, config("zero2_offload").offload) == (1, 2, "cpu")
    assert config("zero2").precision == "bf16"
    assert (config("gemini").offload_param_frac, config("gemini").offload_dir) == (0.0, None)
    off = config("gemini_offload")
    assert (off.offload_param_frac, off.offload_optim_frac, off.offload_dir) == (1.0, 1.0, None)
    monkeypatch.setenv("SUITE_OFFLOAD_DIR", str(tmp_path))
    assert config("gemini_nvme").offload_dir == str(tmp_path)
    assert config("gemini_auto").placement == "auto"
    with pytest.raises(ValueError, match="Trainer\\(precision"):
        recipes_strategies().ZeroStrategy(precision="bf16")
    with pytest.raises(ValueError, match="stage"):
        recipes_strategies().ZeroStrategy(stage=3)


def recipes_strategies():
    from lowmem.recipes import strategies

    return strategies


def test_peer_failure_is_recognised():
    from lowmem.recipes.strategies import _looks_like_peer_failure

    gloo = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:30886: Connection reset by peer"
    assert _looks_like_peer_failure(RuntimeError(gloo))
    assert _looks_like_peer_failure(RuntimeError("Timed out waiting 20000ms for recv operation to complete"))
    assert not _looks_like_peer_failure(ValueError("Connection reset by peer"))
    assert not _looks_like_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
