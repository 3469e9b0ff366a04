"""Checkpoint types (`state_dict_type="sharded" | "full"`) of ZeroStrategy / GeminiStrategy, as Lightning's FSDP.

One 2-rank launch: for zero2 and gemini, fit one epoch with `state_dict_type="full"`, save the one file and (same
state) the sharded folder, then resume to two epochs from the file under the same strategy and under Lightning's
ddp. This process then reads the files as a Lightning user would: `load_from_checkpoint`, `torch.load(...,
weights_only=True)`, `Trainer(ckpt_path=file)` on one device without any strategy, and the sharded folder with
`recipes.load_sharded_checkpoint`. Weights are compared with the plain single-process loop of
`test_strategies` (= ddp), at 32-true.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from lowmem.core_parallel import run_on_ranks
from tests.recipes.test_strategies import assert_close, make_module, make_trainer, reference_weights

NAMES = ("zero2", "gemini")


def _strategy(name: str, state_dict_type: str):
    from lowmem.recipes import GeminiStrategy, ZeroStrategy

    if name == "gemini":
        return GeminiStrategy(state_dict_type=state_dict_type)
    return ZeroStrategy(stage=2, state_dict_type=state_dict_type)


def _save_st(module, path: Path) -> str:
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}, path)
    return str(path)


def _two_ranks(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    out: dict = {}
    for name in NAMES:
        trainer = make_trainer(_strategy(name, "full"), world, root, 1)
        trainer.fit(make_module())
        full = root / f"{name}.ckpt"
        trainer.save_checkpoint(full)
        trainer.strategy.state_dict_type = "sharded"  # the same state, as a folder
        trainer.save_checkpoint(root / f"{name}-sharded")
        # resume from the one file: under the same sharded strategy, and under Lightning's ddp
        trainer = make_trainer(_strategy(name, "full"), world, root, 2)
        trainer.fit(make_module(), ckpt_path=full)
        trainer.save_checkpoint(root / f"{name}-resumed.ckpt")
        module = make_module()
        make_trainer("ddp", world, root, 2).fit(module, ckpt_path=full)
        if rank == 0:
            out[f"{name}-ddp-resumed"] = _save_st(module, root / f"{name}-ddp-resumed.safetensors")
    return out


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt_types")
    t0 = time.perf_counter()
    results = run_on_ranks(_two_ranks, 2, str(root), backend="none", timeout=150, env={"OMP_NUM_THREADS": "1"})
    print(f"2-rank checkpoint-types run: {time.perf_counter() - t0:.1f}s")
    return root, results[0]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_full_file_is_one_lightning_checkpoint(two_rank_run, name):
    from lowmem import recipes

    root, _ = two_rank_run
    full = root / f"{name}.ckpt"
    assert full.is_file()
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")], "a temporary file or folder was left"
    ckpt = torch.load(full, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 2 and "loops" in ckpt and ckpt["lr_schedulers"]
    assert_close(ckpt["state_dict"], reference_weights(1), f"{name} full")
    # the sharded folder of the same state, read in this one plain process, is the same dict
    sharded = recipes.load_sharded_checkpoint(root / f"{name}-sharded")
    assert set(sharded) == set(ckpt)
    for k, v in ckpt["state_dict"].items():
        assert torch.equal(sharded["state_dict"][k], v), k
    (opt,), (opt_sharded,) = ckpt["optimizer_states"], sharded["optimizer_states"]
    assert [g["params"] for g in opt["param_groups"]] == [[0, 1], [2, 3]]
    assert [g["lr"] for g in opt["param_groups"]] == [g["lr"] for g in opt_sharded["param_groups"]]
    assert sorted(opt["state"]) == [0, 1, 2, 3] and float(opt["state"][0]["step"]) == 2.0
    for i, entry in opt["state"].items():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in entry.items():
            assert torch.equal(value, opt_sharded["state"][i][key]), (i, key)


@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_full_file_loads_with_load_from_checkpoint(two_rank_run, name):
    root, _ = two_rank_run
    module = type(make_module()).load_from_checkpoint(root / f"{name}.ckpt", map_location="cpu")
    assert_close(module.state_dict(), reference_weights(1), f"{name} load_from_checkpoint")


@pytest.mark.distributed
@pytest.mark.parametrize("name", NAMES)
def test_full_file_resumes_under_every_strategy(two_rank_run, name):
    root, results = two_rank_run
    expected = reference_weights(2)
    assert_close(_weights(root / f"{name}-resumed.ckpt"), expected, f"{name} resumed from its full file")
    from safetensors.torch import load_file

    assert_close(load_file(results[f"{name}-ddp-resumed"]), expected, f"ddp resumed from {name}'s full file")
    # one process, no strategy named
    import lightning.pytorch as pl

    module = make_module()
    pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
               gradient_clip_val=0.05, use_distributed_sampler=False, default_root_dir=str(root / "single")
               ).fit(module, ckpt_path=root / f"{name}.ckpt")
    assert_close(module.state_dict(), expected, f"one process resumed from {name}'s full file")


@pytest.mark.distributed
def test_sharded_folder_converts_to_the_full_file(two_rank_run, tmp_path):
    from lowmem import recipes

    root, _ = two_rank_run
    out = recipes.convert_sharded_checkpoint(root / "gemini-sharded", tmp_path / "converted.ckpt")
    converted, full = (torch.load(p, weights_only=True) for p in (out, root / "gemini.ckpt"))
    for k, v in full["state_dict"].items():
        assert torch.equal(converted["state_dict"][k], v), k


def test_unknown_state_dict_type_is_one_line(tmp_path):
    from lowmem import recipes
    from lowmem.utils.errors import InputError

    for cls in (recipes.ZeroStrategy, recipes.GeminiStrategy):
        with pytest.raises(InputError, match=r"^state_dict_type must be 'sharded' or 'full', got 'ful'$"):
            cls(state_dict_type="ful")
    with pytest.raises(InputError, match="not a sharded checkpoint folder"):
        recipes.load_sharded_checkpoint(tmp_path)
    # the default is Lightning FSDPStrategy's: one full file
    assert recipes.ZeroStrategy().state_dict_type == recipes.GeminiStrategy().state_dict_type == "full"
