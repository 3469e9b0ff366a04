"""ZeroStrategy / GeminiStrategy against Lightning's ddp on 2 gloo ranks, checkpoints, resume, faults.

Process launches are few and grouped (each costs seconds of imports): one 2-rank launch trains every
strategy and the ddp reference and saves/resumes; one 1-rank launch resumes the 2-rank checkpoints (and
those the faulty runs left); three pairs of subprocesses, started together, meet a fault: a rank dies under
gloo (zero2), a rank dies under Gemini's shared-memory collectives, a rank gets SIGTERM. Ranks are started
with `run_on_ranks(backend="none")` or with the same environment (LOCAL_RANK, WORLD_SIZE, MASTER_PORT,
...), which makes Lightning treat the processes as launched externally, as under torchrun, and Lightning
itself creates the process group.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
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
from tests._paths import tests_only_path as _tests_only_path

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
        def __init__(self, lr: float = 0.05, fail_at_step: int | None = None, fail_rank: int = 1,
                     sigterm_at_step: int | None = None) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.frozen = nn.Linear(8, 8)
            self.frozen.requires_grad_(False)
            self.body = nn.Linear(8, 24)
            self.head = nn.Linear(24, 4)
            self.lr = lr
            self.fail_at_step = fail_at_step
            self.fail_rank = fail_rank
            self.sigterm_at_step = sigterm_at_step

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.body(self.frozen(x))))

        def training_step(self, batch, batch_idx):
            if self.fail_at_step is not None and self.global_step == self.fail_at_step:
                if self.global_rank == self.fail_rank:
                    os._exit(17)  # a rank dying without any goodbye, as on an OOM kill
            if self.global_step == self.sigterm_at_step and batch_idx % ACCUMULATE == 0 and self.global_rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # preempted in the first micro-batch of a step
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


def reference_weights(epochs: int, start: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The same training as a plain single-process PyTorch loop (what every strategy must reproduce), from
    `make_module()`'s weights or from `start` (with a fresh optimizer and schedule, as a second `fit` has)."""
    module = make_module()
    if start is not None:
        module.load_state_dict(start)
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
    """The weights of a checkpoint as one safetensors file: the sharded folder merged, or the full file's
    state_dict (the strategies' default type); returns its path (tensors do not cross processes)."""
    from lowmem import core_parallel

    if Path(ckpt).is_file():
        from safetensors.torch import save_file

        sd = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
        save_file({k: v.contiguous() for k, v in sd.items()}, out)
        return str(out)
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
    if name != "ddp":
        trainer.strategy.state_dict_type = "sharded"  # these folders resume on 1 rank (the full file: elsewhere)
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


def _resume_on_1(rank: int, world: int, root: str, dead_ckpt: str, sigterm_ckpt: str | None) -> dict:
    """Resume the 2-rank checkpoints on 1 rank, the last checkpoint the dead-rank run left, and the one the
    SIGTERM run wrote."""
    root = Path(root)
    results: dict = {}
    for name in RESUMED:
        resumed = _fit_and_save(name, root, world, 2, ckpt_path=root / f"{name}-e1-w2")
        results[name] = consolidated(resumed, root / f"{name}-resumed-on-1.safetensors")
    trainer = make_trainer("zero2", world, root / "after-dead", 3)
    trainer.fit(make_module(), ckpt_path=dead_ckpt)
    results["after_dead_step"] = trainer.global_step
    if sigterm_ckpt is not None:
        trainer = make_trainer("gemini", world, root / "after-sigterm", 3)
        trainer.fit(make_module(), ckpt_path=sigterm_ckpt)
        results["after_sigterm_step"] = trainer.global_step
        trainer.save_checkpoint(root / "after-sigterm" / "final")
        results["after_sigterm"] = consolidated(root / "after-sigterm" / "final", root / "after-sigterm.safetensors")
    return results


def assert_close(actual: dict, expected: dict, label: str) -> None:
    assert set(actual) == set(expected), f"{label}: keys differ: {set(actual) ^ set(expected)}"
    for key, ref in expected.items():
        torch.testing.assert_close(actual[key].float(), ref.float(), rtol=RTOL, atol=1e-7, msg=f"{label}: {key}")


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategies")
    env = {"OMP_NUM_THREADS": "1"}
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
def one_rank_run(two_rank_run, fault_runs):
    root, _ = two_rank_run
    dead_ckpt = fault_runs["zero2"]["last"]
    sigterm_ckpt = fault_runs["sigterm"]["last"]
    return run_on_ranks(_resume_on_1, 1, str(root), str(dead_ckpt), sigterm_ckpt and str(sigterm_ckpt),
                        backend="none", timeout=150)[0]


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
    assert trainer.precision_plugin.core_precision == "fp32"  # fp32 parameters, bf16 autocast
    with pytest.raises(ValueError, match="precision='64-true'.*ddp"):
        ShardedPrecision("64-true")
    with pytest.raises(ValueError, match="collective_timeout_s"):
        recipes.GeminiStrategy(collective_timeout_s=0)


_FAULT_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tests.recipes.test_strategies import make_module, make_trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lowmem.recipes import GeminiStrategy, ZeroStrategy

    root, fault = Path(sys.argv[1]), sys.argv[2]
    if fault == "sigterm":
        trainer = make_trainer(GeminiStrategy(), 2, root, 3)
        trainer.fit(make_module(sigterm_at_step=3))
    else:
        # A long collective timeout: only noticing the death, not waiting it out, ends the survivor in time.
        strategy = ZeroStrategy(stage=2, collective_timeout_s=600) if fault == "zero2" else GeminiStrategy(
            collective_timeout_s=600)
        ckpt = ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=1, save_top_k=-1)
        trainer = make_trainer(strategy, 2, root, 3, callbacks=[ckpt], enable_checkpointing=True)
        trainer.fit(make_module(fail_at_step=3))
    """
)
FAULTS = ("zero2", "gemini")  # a rank dies under gloo collectives, under the shared-memory ones
SURVIVOR_S = 15.0  # the bound on how long the survivor may outlive the dead rank (timeout: 600 s)


def _fault_env(rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
        NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONPATH=_tests_only_path(), PYTHONSAFEPATH="1",
    )
    return env


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory) -> dict:
    """Three 2-rank runs at once: rank 1 dies in step 4 (global_step 3) under zero2 and under gemini, both with
    Lightning's ModelCheckpoint every step; rank 0 of a gemini run gets SIGTERM in the first micro-batch of
    step 4. A survivor still running SURVIVOR_S after its peer died is killed (and fails its test)."""
    from lowmem.core_parallel.launch import free_port

    runs: dict = {}
    for fault in (*FAULTS, "sigterm"):
        root = tmp_path_factory.mktemp(f"fault_{fault}")
        port = free_port()
        logs = [open(root / f"rank{r}.err", "w+") for r in range(2)]  # files: no pipe to fill and block
        procs = [
            subprocess.Popen([sys.executable, "-c", _FAULT_SCRIPT, str(root), fault], env=_fault_env(r, port),
                             stdout=subprocess.DEVNULL, stderr=logs[r], text=True)
            for r in range(2)
        ]
        runs[fault] = {"root": root, "procs": procs, "logs": logs, "ended": [None, None], "survivor_s": None}
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and any(e is None for run in runs.values() for e in run["ended"]):
            now = time.monotonic()
            for fault, run in runs.items():
                for r, p in enumerate(run["procs"]):
                    if run["ended"][r] is None and p.poll() is not None:
                        run["ended"][r] = now
                died = run["ended"][1]
                if fault in FAULTS and died is not None and run["ended"][0] is None and now - died > SURVIVOR_S:
                    run["procs"][0].kill()  # hung: the test says so below
            time.sleep(0.05)
    finally:
        for run in runs.values():
            for p in run["procs"]:
                if p.poll() is None:
                    p.kill()
                p.wait()
    out = {}
    for fault, run in runs.items():
        stderr = []
        for f in run["logs"]:
            f.seek(0)
            stderr.append(f.read())
            f.close()
        ended = run["ended"]
        root = run["root"]
        last = sorted((root / "ckpts").glob("*step=3.ckpt")) if fault in FAULTS else sorted(root.glob("preempted-*"))
        out[fault] = {
            "root": root, "codes": [p.returncode for p in run["procs"]], "stderr": stderr,
            "survivor_s": ended[0] - ended[1] if None not in ended else None, "last": last[-1] if last else None,
        }
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("fault", FAULTS)
def test_dead_rank_stops_the_others_within_seconds_with_a_clear_error(fault_runs, fault):
    run = fault_runs[fault]
    codes, stderr = run["codes"], run["stderr"]
    assert codes[1] == 17, stderr[1][-3000:]
    assert codes[0] not in (0, -signal.SIGKILL), f"the survivor did not stop by itself:\n{stderr[0][-3000:]}"
    assert run["survivor_s"] < SURVIVOR_S, run["survivor_s"]
    assert "lost contact with rank 1" in stderr[0], stderr[0][-3000:]
    named = re.search(r"Last complete checkpoint: (.+?); resume with trainer\.fit\(\.\.\., ckpt_path=", stderr[0])
    assert named, stderr[0][-3000:]
    assert named.group(1).endswith("step=3.ckpt") and _complete_file(named.group(1))


def _complete_file(path: str | Path) -> bool:
    """A checkpoint of the strategies' default type: one Lightning file, whole (torch reads it, weights and all)."""
    path = Path(path)
    return path.is_file() and "state_dict" in torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.distributed
def test_last_checkpoint_before_the_death_is_intact_and_resumes(fault_runs, one_rank_run):
    ckpts = fault_runs["zero2"]["root"] / "ckpts"
    last = fault_runs["zero2"]["last"]
    assert last is not None and _complete_file(last), list(ckpts.iterdir())
    assert not list(ckpts.glob(".*")), "a half-written checkpoint was left behind"
    # 3 epochs of 2 optimizer steps; the run resumed from step 3 finishes the schedule.
    assert one_rank_run["after_dead_step"] == 6


@pytest.mark.distributed
def test_sigterm_saves_at_the_step_boundary_and_exits_nonzero(fault_runs, one_rank_run):
    from lowmem.recipes.strategies import SIGTERM_EXIT_CODE

    run = fault_runs["sigterm"]
    codes, stderr = run["codes"], run["stderr"]
    # both ranks stop (rank 1 got no signal: the ranks agree at the step boundary), neither as a success
    assert codes == [SIGTERM_EXIT_CODE, SIGTERM_EXIT_CODE], (codes, stderr[0][-3000:], stderr[1][-3000:])
    # signalled in the first micro-batch of step 4: the checkpoint holds the whole step, not half of it
    assert run["last"] is not None and run["last"].name == "preempted-step=4.ckpt", list(run["root"].iterdir())
    assert _complete_file(run["last"])
    line = [ln for ln in stderr[0].splitlines() if "SIGTERM received" in ln]
    assert line and str(run["last"]) in line[0] and "resume with trainer.fit(" in line[0], stderr[0][-3000:]
    # resumed (on 1 rank), the run ends where an uninterrupted one does
    assert one_rank_run["after_sigterm_step"] == 6
    assert_close(load(one_rank_run["after_sigterm"]), reference_weights(epochs=3), "resumed after SIGTERM")


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
    monkeypatch.setenv("SUITE_OFFLOAD_DIR", str(tmp_path))  # no environment variable is a channel any more
    nvme_dir = Path(config("gemini_nvme").offload_dir)
    assert nvme_dir.is_dir() and nvme_dir != tmp_path and nvme_dir.name.startswith("suite-offload-")
    nvme_dir.rmdir()
    assert config("gemini_auto").placement == "auto"
    with pytest.raises(ValueError, match="Trainer\\(precision"):
        recipes_strategies().ZeroStrategy(precision="bf16")
    with pytest.raises(ValueError, match="stage"):
        recipes_strategies().ZeroStrategy(stage=3)


def recipes_strategies():
    from lowmem.recipes import strategies

    return strategies


def test_peer_failure_is_recognised():
    from lowmem.recipes.faults import looks_like_peer_failure as _looks_like_peer_failure

    gloo = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:30886: Connection reset by peer"
    assert _looks_like_peer_failure(RuntimeError(gloo))
    assert _looks_like_peer_failure(RuntimeError("Timed out waiting 20000ms for recv operation to complete"))
    assert not _looks_like_peer_failure(ValueError("Connection reset by peer"))
    assert not _looks_like_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


# ---- one tier field, strategies built from configs ---------------------------------------------------------
_CPU_TIER_WITH_FOLDER = r"offload_dir='/x' applies to offload_tier='nvme' only; offload_tier='cpu' keeps"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # the folder is GeminiConfig's to judge: offload="cpu" and "none" are its "cpu" tier
        (dict(offload="cpu", offload_dir="/x"), _CPU_TIER_WITH_FOLDER),
        (dict(offload="none", offload_dir="/x"), _CPU_TIER_WITH_FOLDER),
        (dict(offload_tier="cpu", offload_dir="/x"), _CPU_TIER_WITH_FOLDER),
        (dict(offload="cpu", offload_tier="nvme"), r"offload='cpu' and offload_tier='nvme' name different tiers"),
        (dict(offload="none", offload_tier="nvme"), r"offload='none' and offload_tier='nvme' disagree"),
        (dict(offload="disk"), r"offload must be one of none, cpu, nvme, got 'disk'"),
        (dict(process_group_backend="tcp"), r"process_group_backend must be one of gloo, nccl, mpi"),
    ],
    ids=["cpu_with_folder", "none_with_folder", "cpu_tier_with_folder", "two_tiers", "none_vs_nvme", "unknown",
         "backend"],
)
def test_gemini_strategy_bad_offload_is_one_clear_input_error(kwargs, message):
    import warnings

    from lowmem.utils.errors import InputError

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(InputError, match=message):
            recipes_strategies().GeminiStrategy(**kwargs)


def test_gemini_strategy_tiers(tmp_path, monkeypatch):
    strategies = recipes_strategies()
    monkeypatch.setenv("SUITE_OFFLOAD_DIR", str(tmp_path / "env"))
    nvme = strategies.GeminiStrategy(offload="nvme", offload_dir=tmp_path / "own").core_config("fp32")
    assert (nvme.offload_tier, nvme.offload_dir, nvme.offload_param_frac) == ("nvme", str(tmp_path / "own"), 1.0)
    cpu = strategies.GeminiStrategy(offload="cpu").core_config("fp32")
    assert (cpu.offload_tier, cpu.offload_dir, cpu.offload_optim_frac) == ("cpu", None, 1.0)
    # auto placement: the shorthand names the tier only (the static fractions do not apply)
    auto = strategies.GeminiStrategy(placement="auto", offload="nvme").core_config("fp32")
    assert (auto.placement, auto.offload_tier, auto.offload_param_frac) == ("auto", "nvme", 0.0)
    assert Path(auto.offload_dir).name.startswith("suite-offload-")  # a temporary folder, not the environment's
    Path(auto.offload_dir).rmdir()
    # a folder alone: the NVMe tier as before (same fractions), with a DeprecationWarning at the caller
    with pytest.warns(DeprecationWarning, match="name the tier") as record:  # GeminiConfig's, at the caller
        old = strategies.GeminiStrategy(offload_dir=tmp_path / "old")
    assert record[0].filename == __file__
    old_cfg = old.core_config("fp32")
    assert (old.offload, old_cfg.offload_tier, old_cfg.offload_dir, old_cfg.offload_param_frac) == (
        "nvme", "nvme", str(tmp_path / "old"), 0.0)


def test_strategy_from_config_takes_every_field_and_no_environment(tmp_path, monkeypatch):
    from lowmem.core_parallel import GeminiConfig, ZeroConfig
    from lowmem.core_parallel.loss_scaler import LossScalerConfig
    from lowmem.utils.errors import InputError

    strategies = recipes_strategies()
    monkeypatch.setenv("SUITE_OFFLOAD_DIR", str(tmp_path / "env"))
    gemini = GeminiConfig(placement="static", offload_param_frac=0.5, offload_optim_frac=0.25, offload_tier="nvme",
                          offload_dir=str(tmp_path / "nvme"), chunk_mb=2.0, prefetch=2, keep_gathered=4,
                          host_collectives=False, max_grad_norm=1.5, loss_scaler=LossScalerConfig(hysteresis=2))
    zero = ZeroConfig(stage=1, offload="cpu", bucket_mb=5.0, overlap=False, max_grad_norm=2.0)
    for config, cls in ((gemini, strategies.GeminiStrategy), (zero, strategies.ZeroStrategy),
                        (GeminiConfig(placement="auto", device_memory_budget="1GB"), strategies.GeminiStrategy)):
        strategy = strategies.strategy_from_config(config, collective_timeout_s=60)
        assert type(strategy) is cls and strategy.collective_timeout_s == 60
        assert strategy.core_config("bf16") == dataclasses.replace(config, precision="bf16")
    with pytest.raises(InputError, match="Trainer\\(precision"):
        strategies.strategy_from_config(ZeroConfig(precision="bf16"))
    with pytest.raises(TypeError, match="ZeroConfig or GeminiConfig"):
        strategies.strategy_from_config({"stage": 2})


def test_every_strategy_name_maps_onto_the_config_its_registered_strategy_builds(tmp_path):
    """`--strategy NAME` (and `--offload_dir`) become the same `ZeroConfig` / `GeminiConfig` that
    `Trainer(strategy=NAME)` builds, so building the strategy from the config changes no number."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lowmem.core_parallel import config_for_strategy
    from lowmem.utils.errors import InputError

    strategies = recipes_strategies()
    assert set(strategies.STRATEGY_NAMES) - {"auto", "ddp"} == set(SHARDED)
    for name in strategies.STRATEGY_NAMES:
        for folder in ((None, str(tmp_path / "nvme")) if name in ("gemini_nvme", "gemini_auto") else (None,)):
            config = config_for_strategy(name, offload_dir=folder)
            if name in ("auto", "ddp"):
                assert config is None and strategies.strategy_kind(name) is None
                continue
            entry = StrategyRegistry[name]
            extra = {"offload": "nvme", "offload_dir": folder} if folder else {}
            if name == "gemini_nvme" and folder is None:  # the same temporary folder on both sides
                extra = {"offload_dir": config.offload_dir}
            registered = entry["strategy"](**{**entry["init_params"], **extra})
            assert registered.core_config("bf16") == dataclasses.replace(config, precision="bf16"), (name, folder)
            built = strategies.strategy_from_config(config)
            assert type(built) is type(registered) and built.core_config("fp32") == config
            assert strategies.strategy_kind(name) == name.split("_")[0].rstrip("12")
    for name in ("gemini", "zero2", "ddp", "auto"):
        with pytest.raises(InputError, match=f"^offload_dir /x: only the strategies with an NVMe tier .*{name}$"):
            config_for_strategy(name, offload_dir="/x")


def test_a_strategy_holds_the_config_it_is_given(tmp_path):
    """`config=` is kept as is (validated once, where it was built); beside it, config keywords are refused."""
    from lowmem.core_parallel import GeminiConfig, ZeroConfig

    strategies = recipes_strategies()
    gemini = GeminiConfig(offload_tier="nvme", offload_dir=str(tmp_path / "nvme"), chunk_mb=2.0)
    zero = ZeroConfig(stage=1)
    assert strategies.GeminiStrategy(config=gemini).config is gemini
    assert strategies.ZeroStrategy(config=zero).config is zero
    assert strategies.GeminiStrategy(config=gemini).offload_dir == str(tmp_path / "nvme")
    with pytest.raises(TypeError, match="come from config="):
        strategies.GeminiStrategy(config=gemini, chunk_mb=4.0)
    with pytest.raises(TypeError, match="come from config="):
        strategies.GeminiStrategy(config=gemini, offload="cpu")
    with pytest.raises(TypeError, match="takes a ZeroConfig"):
        strategies.ZeroStrategy(config=gemini)
