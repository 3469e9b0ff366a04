"""What Lightning users do with ddp, under the sharded strategies, against ddp on 2 gloo ranks (issue 44).

One 2-rank launch (`_all_cases`), against Lightning's ddp:
- clipping by value (`gradient_clip_algorithm="value"` in automatic optimization, `self.clip_gradients(...,
  gradient_clip_algorithm="value")` in manual optimization) under zero1, zero2, zero2_offload, gemini and
  gemini_offload;
- the default checkpoint under zero2 and gemini: `ModelCheckpoint`'s `best_model_path` is one file that
  `load_from_checkpoint` reads here (another process) and that a fresh Trainer resumes exactly as ddp does.
The model is `test_strategies`' tiny module (a frozen layer, two param groups, AdamW, a per-step LR schedule,
accumulation 2 in automatic optimization).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from lowmem.core_parallel import run_on_ranks
from tests.recipes.test_strategies import make_module, make_trainer

CLIP_NAMES = ("zero1", "zero2", "zero2_offload", "gemini", "gemini_offload")
CKPT_NAMES = ("ddp", "zero2", "gemini")
GAN_NAMES = ("ddp", "zero2", "gemini")
CLIP_VALUE = 0.01  # below most gradient elements of the tiny model: most of them are clamped
TOL = 1e-6  # fp32 rounding (relative to the largest weight): the shards reduce in another order than ddp's buckets


def assert_close(actual: dict, expected: dict, label: str) -> None:
    """Every tensor within `TOL` of `expected`, relative to the largest value of the whole state."""
    assert set(actual) == set(expected), f"{label}: keys differ: {set(actual) ^ set(expected)}"
    scale = max(float(v.abs().max()) for v in expected.values())
    for key, ref in expected.items():
        diff = float((actual[key].float() - ref.float()).abs().max())
        assert diff <= TOL * scale, f"{label}: {key} differs by {diff:.3g} (largest value {scale:.3g})"


def _sd(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _manual_clip_module():
    module = make_module()

    class ManualClip(type(module)):
        def __init__(self) -> None:  # not called: the instance is re-classed below
            raise AssertionError

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value")
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()

    module.__class__ = ManualClip
    module.automatic_optimization = False
    return module


def _clip_value(root: Path) -> dict:
    out = {}
    for name in ("ddp", *CLIP_NAMES):
        module = make_module()
        make_trainer(name, 2, root, 2, gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value").fit(module)
        out[f"auto-{name}"] = _sd(module)
        module = _manual_clip_module()
        make_trainer(name, 2, root, 2, gradient_clip_val=None, accumulate_grad_batches=1).fit(module)
        out[f"manual-{name}"] = _sd(module)
    module = make_module()
    make_trainer("ddp", 2, root, 2, gradient_clip_val=None).fit(module)
    out["unclipped-ddp"] = _sd(module)
    return out


def _checkpoints(root: Path) -> dict:
    """Fit one epoch with ModelCheckpoint (the strategy's default checkpoint type), then resume to two epochs from
    the best checkpoint in a fresh Trainer and module."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    out = {}
    for name in CKPT_NAMES:
        module = make_module()
        ckpt = ModelCheckpoint(dirpath=root / name, monitor="train_loss", save_top_k=1)
        trainer = make_trainer(name, 2, root, 1, callbacks=[ckpt], enable_checkpointing=True)
        trainer.fit(module)
        out[name] = {"best": ckpt.best_model_path, "trained": _sd(module)}
        module = make_module()
        make_trainer(name, 2, root, 2).fit(module, ckpt_path=ckpt.best_model_path)
        out[name]["resumed"] = _sd(module)
        # validate(ckpt_path="best"): the best weights loaded into the set-up model outside fitting
        module = _validating(make_module())
        module.body.weight.data.add_(1.0)  # replaced by the checkpoint's
        metrics = trainer.validate(module, ckpt_path="best", verbose=False)[0]
        out[name]["val_loss"] = float(metrics["val_loss"])
    return out


def _validating(module):
    class Validating(type(module)):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

        def val_dataloader(self):
            return self.train_dataloader()

    module.__class__ = Validating
    return module


def make_gan():
    """A tiny GAN: generator and discriminator, one Adam each, trained with toggle_optimizer (manual optimization)."""
    import lightning.pytorch as pl

    class TinyGan(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.automatic_optimization = False
            self.generator = nn.Sequential(nn.Linear(4, 12), nn.Tanh(), nn.Linear(12, 6))
            self.discriminator = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 1))

        def training_step(self, batch, batch_idx):
            real, z = batch
            opt_g, opt_d = self.optimizers()
            self.toggle_optimizer(opt_g)
            g_loss = nn.functional.softplus(-self.discriminator(self.generator(z))).mean()
            self.manual_backward(g_loss)
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
            fake = self.generator(z).detach()
            d_loss = (nn.functional.softplus(-self.discriminator(real)).mean()
                      + nn.functional.softplus(self.discriminator(fake)).mean())
            self.manual_backward(d_loss)
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)
            self.log("g_loss", g_loss)

        def configure_optimizers(self):
            return [torch.optim.Adam(self.generator.parameters(), lr=0.02, betas=(0.5, 0.9)),
                    torch.optim.Adam(self.discriminator.parameters(), lr=0.03, betas=(0.5, 0.9))]

        def train_dataloader(self):
            from torch.utils.data import DataLoader, TensorDataset

            g = torch.Generator().manual_seed(2)
            real, z = torch.randn(16, 6, generator=g) + 1.0, torch.randn(16, 4, generator=g)
            world, rank = self.trainer.world_size, self.global_rank
            return DataLoader(TensorDataset(real[rank::world], z[rank::world]), batch_size=8 // world)

    return TinyGan()


def _gan(root: Path) -> dict:
    """Two epochs; one epoch, saved (the default checkpoint), and resumed to two in a fresh Trainer and module."""
    out = {}
    for name in GAN_NAMES:
        strategy = "ddp_find_unused_parameters_true" if name == "ddp" else name
        module = make_gan()
        make_trainer(strategy, 2, root, 2, gradient_clip_val=None, accumulate_grad_batches=1).fit(module)
        out[f"{name}-2"] = _sd(module)
        module = make_gan()
        trainer = make_trainer(strategy, 2, root, 1, gradient_clip_val=None, accumulate_grad_batches=1)
        trainer.fit(module)
        path = root / f"{name}-gan.ckpt"
        trainer.save_checkpoint(path)
        out[f"{name}-file"] = str(path)
        paths = {"resumed": path}
        if name != "ddp":
            trainer.strategy.state_dict_type = "sharded"
            paths["resumed-sharded"] = root / f"{name}-gan-sharded"
            trainer.save_checkpoint(paths["resumed-sharded"])
            out[f"{name}-folder"] = str(paths["resumed-sharded"])
        for key, ckpt_path in paths.items():
            module = make_gan()
            make_trainer(strategy, 2, root, 2, gradient_clip_val=None, accumulate_grad_batches=1).fit(
                module, ckpt_path=ckpt_path)
            out[f"{name}-{key}"] = _sd(module)
    return out


def _all_cases(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    return {"clip_value": _clip_value(root / "clip"), "checkpoints": _checkpoints(root / "ckpt"),
            "gan": _gan(root / "gan")}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning_users")
    t0 = time.perf_counter()
    results = run_on_ranks(_all_cases, 2, str(root), backend="none", timeout=300, env={"OMP_NUM_THREADS": "1"})
    print(f"2-rank Lightning-users run: {time.perf_counter() - t0:.1f}s")
    return root, results


@pytest.mark.distributed
@pytest.mark.parametrize("name", CLIP_NAMES)
@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_clip_by_value_equals_ddp(two_ranks, name, mode):
    _, results = two_ranks
    for rank, res in enumerate(r["clip_value"] for r in results):
        assert_close(res[f"{mode}-{name}"], res[f"{mode}-ddp"], f"{mode} {name} rank {rank}")
    # the clip does something: without it ddp ends elsewhere
    ddp, unclipped = results[0]["clip_value"]["auto-ddp"], results[0]["clip_value"]["unclipped-ddp"]
    assert max(float((ddp[k] - unclipped[k]).abs().max()) for k in ddp) > 1e-3


@pytest.mark.distributed
@pytest.mark.parametrize("name", CKPT_NAMES[1:])
def test_load_from_checkpoint_of_the_best_model_path(two_ranks, name):
    """The default checkpoint is the one file Lightning users load (`state_dict_type="full"`, as FSDP's default)."""
    _, results = two_ranks
    res = results[0]["checkpoints"][name]
    best = Path(res["best"])
    assert best.is_file(), f"{name}: the default checkpoint is not one file: {best}"
    torch.load(best, map_location="cpu", weights_only=True)  # a normal torch checkpoint
    module = type(make_module()).load_from_checkpoint(best, map_location="cpu")
    for key, value in res["trained"].items():
        assert torch.equal(module.state_dict()[key], value), key
    # trainer.validate(ckpt_path="best") under the strategy loads the same weights as ddp's does
    ddp = results[0]["checkpoints"]["ddp"]["val_loss"]
    assert abs(res["val_loss"] - ddp) <= 1e-6 * abs(ddp), (res["val_loss"], ddp)


@pytest.mark.distributed
@pytest.mark.parametrize("name", CKPT_NAMES[1:])
def test_resume_from_the_full_file_continues_like_ddp(two_ranks, name):
    """Weights, AdamW moments, LR schedule and loops come back: the second epoch equals ddp's, resumed likewise."""
    _, results = two_ranks
    for rank, res in enumerate(r["checkpoints"] for r in results):
        assert_close(res[name]["resumed"], res["ddp"]["resumed"], f"{name} rank {rank} resumed")
        assert_close(res[name]["trained"], res["ddp"]["trained"], f"{name} rank {rank} first epoch")


@pytest.mark.distributed
@pytest.mark.parametrize("name", GAN_NAMES[1:])
def test_two_optimizers_with_toggle_equal_ddp(two_ranks, name):
    """A GAN (generator and discriminator, an Adam each, toggle_optimizer) trains as under ddp, and its checkpoints
    (the full file and the sharded folder) hold both optimizers' states: resumed after one epoch from either, it ends
    where the uninterrupted run does."""
    from lowmem import recipes

    _, results = two_ranks
    for rank, res in enumerate(r["gan"] for r in results):
        assert_close(res[f"{name}-2"], res["ddp-2"], f"{name} rank {rank} GAN")
        assert_close(res[f"{name}-resumed"], res["ddp-2"], f"{name} rank {rank} GAN resumed")
        assert_close(res[f"{name}-resumed-sharded"], res["ddp-2"], f"{name} rank {rank} GAN resumed from the folder")
    ckpt = torch.load(results[0]["gan"][f"{name}-file"], map_location="cpu", weights_only=True)
    ddp = torch.load(results[0]["gan"]["ddp-file"], map_location="cpu", weights_only=True)
    folder = recipes.load_sharded_checkpoint(results[0]["gan"][f"{name}-folder"])
    assert len(ckpt["optimizer_states"]) == len(folder["optimizer_states"]) == 2
    for ours, theirs, sharded in zip(ckpt["optimizer_states"], ddp["optimizer_states"], folder["optimizer_states"]):
        for i, entry in ours["state"].items():
            for key, value in entry.items():
                assert torch.equal(sharded["state"][i][key], value), (i, key)
        assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
        assert sorted(ours["state"]) == sorted(theirs["state"])
        for i, entry in theirs["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(ours["state"][i][key], value, rtol=1e-5, atol=1e-7)


def test_several_optimizers_refuse_what_they_cannot_do():
    """One line each: a parameter in two optimizers; under Gemini, optimizers keeping other kinds of state."""
    from lowmem import core_parallel
    from lowmem.recipes.optimizers import check_several
    from lowmem.utils.errors import InputError

    def model_and(optimizers):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        return model, [make(model) for make in optimizers]

    def adam(layer):
        return lambda m: torch.optim.Adam(m[layer].parameters() if layer is not None else m.parameters())

    both = (adam(None), adam(1))
    for config in (core_parallel.ZeroConfig(), core_parallel.GeminiConfig()):
        model, opts = model_and(both)
        with pytest.raises(ValueError, match=r"optimizers 0 and 1 share (a )?parameter"):
            core_parallel.setup(model, opts, config)
    model, opts = model_and(both)
    with pytest.raises(InputError, match=r"^ZeroStrategy: optimizers 0 and 1 of configure_optimizers share a param"):
        check_several("ZeroStrategy", opts)
    model, opts = model_and((adam(0), lambda m: torch.optim.SGD(m[1].parameters(), lr=0.1)))
    with pytest.raises(ValueError, match=r"one kind of optimizer state.*Adam, SGD"):
        core_parallel.setup(model, opts, core_parallel.GeminiConfig())
    model, opts = model_and((adam(0), adam(1)))
    model, wrapped = core_parallel.setup(model, opts, core_parallel.ZeroConfig())
    assert len(wrapped) == 2 and wrapped.group_counts == [1, 1]
