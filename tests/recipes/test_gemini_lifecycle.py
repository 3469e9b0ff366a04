"""One Trainer under "gemini" through fit -> validate -> test -> predict -> fit again, a callback calling the
model in `on_validation_epoch_end`, and `module.state_dict()` on every rank after each stage, on 2 gloo ranks
(one launch). The weights are compared with the same training in a plain PyTorch loop
(`test_strategies.reference_weights`, which `test_ddp_reference_trains_like_a_plain_loop` checks against
Lightning's ddp), the losses and predictions with the reference model's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowmem.core_parallel import run_on_ranks
from tests.recipes.test_strategies import (
    assert_close,
    make_module,
    make_trainer,
    reference_weights,
)

N_EVAL = 8


def _eval_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(N_EVAL, 8, generator=g), torch.randn(N_EVAL, 4, generator=g)


def _module():
    module = make_module()
    cls = type(module)

    class WithEval(cls):
        def _loss(self, batch):
            x, y = batch
            return nn.functional.mse_loss(self(x), y, reduction="sum")

        def validation_step(self, batch, batch_idx):
            self.log("val_sum", self._loss(batch), reduce_fx="sum", sync_dist=True)

        def test_step(self, batch, batch_idx):
            self.log("test_sum", self._loss(batch), reduce_fx="sum", sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

        def _loader(self):
            x, y = _eval_data()
            world, rank = self.trainer.world_size, self.global_rank
            return DataLoader(TensorDataset(x[rank::world], y[rank::world]), batch_size=2)

        val_dataloader = test_dataloader = predict_dataloader = _loader

    module.__class__ = WithEval
    return module


def _sample_callback(samples: list, copies: list | None = None):
    import lightning.pytorch as pl

    class Sample(pl.Callback):
        """Generates from the model at the end of each validation epoch, on every rank (as sample callbacks do),
        and copies the weights at the end of each training epoch, between steps (as EMA callbacks do), inside
        the strategy's `collective_reads()`."""

        def on_validation_epoch_end(self, trainer, pl_module):
            samples.append(pl_module(_eval_data()[0][:2]).tolist())

        def on_train_epoch_end(self, trainer, pl_module):
            if copies is not None:
                with torch.no_grad(), trainer.strategy.collective_reads():
                    copies.append({n: (p * 1.0).tolist() for n, p in pl_module.named_parameters()})

    return Sample()


def _state(module) -> dict:
    return {k: v.tolist() for k, v in module.state_dict().items()}


def _stages(rank: int, world: int, root: str) -> dict:
    samples: list = []
    copies: list = []
    module = _module()
    trainer = make_trainer("gemini", world, Path(root), 2, callbacks=[_sample_callback(samples, copies)],
                           enable_checkpointing=True)
    out: dict = {}
    trainer.fit(module)
    out["fit"] = _state(module)
    out["validate"] = trainer.validate(module, verbose=False)[0]["val_sum"]
    out["test"] = trainer.test(module, verbose=False)[0]["test_sum"]
    out["predict"] = [p.tolist() for p in trainer.predict(module)]
    out["validate_again"] = trainer.validate(module, verbose=False)[0]["val_sum"]
    out["after_eval"] = _state(module)
    out["samples"] = list(samples)  # before the second fit validates again
    out["copies"] = list(copies)
    trainer.fit_loop.max_epochs = 3
    trainer.fit(module)
    out["fit_again"] = _state(module)
    return out


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemini_lifecycle")
    t0 = time.perf_counter()
    results = run_on_ranks(_stages, 2, str(root), backend="none", timeout=120, env={"OMP_NUM_THREADS": "1"})
    print(f"2-rank Gemini lifecycle run took {time.perf_counter() - t0:.1f}s")
    return results


def _as_tensors(state: dict) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v) for k, v in state.items()}


def _reference(epochs: int) -> tuple[dict[str, torch.Tensor], nn.Module]:
    weights = reference_weights(epochs)
    model = make_module()
    model.load_state_dict(weights)
    return weights, model


@pytest.mark.distributed
def test_state_dict_after_fit_and_eval_is_the_trained_model_on_every_rank(stages):
    weights, _ = _reference(2)
    for rank, res in enumerate(stages):
        assert_close(_as_tensors(res["fit"]), weights, f"rank {rank}: state_dict after fit")
        assert_close(_as_tensors(res["after_eval"]), weights, f"rank {rank}: state_dict after validate/test/predict")
        # the weights a callback copied between steps at the end of the last epoch (collective_reads)
        assert len(res["copies"]) == 2, res["copies"]
        assert_close(_as_tensors(res["copies"][-1]), weights, f"rank {rank}: weights read in on_train_epoch_end")


@pytest.mark.distributed
def test_validate_test_predict_after_fit_use_the_trained_weights(stages):
    _, model = _reference(2)
    x, y = _eval_data()
    with torch.no_grad():
        out = model(x)
    loss = nn.functional.mse_loss(out, y, reduction="sum")
    for rank, res in enumerate(stages):
        for stage in ("validate", "test", "validate_again"):
            torch.testing.assert_close(torch.tensor(res[stage]), loss, rtol=1e-5, atol=1e-6, msg=f"{rank} {stage}")
        predicted = torch.cat([torch.tensor(p) for p in res["predict"]])
        torch.testing.assert_close(predicted, out[rank::2], rtol=1e-5, atol=1e-6)
        # the callback ran in fit (2 epochs) and in both validate calls, and saw the trained model after fit
        assert len(res["samples"]) >= 4
        torch.testing.assert_close(torch.tensor(res["samples"][-1]), out[:2], rtol=1e-5, atol=1e-6)


def _one_more_epoch(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a second `fit` does under ddp: the trained weights, a fresh optimizer and schedule, one epoch."""
    return reference_weights(1, start=weights)


@pytest.mark.distributed
def test_fit_again_on_the_same_trainer_continues_training(stages):
    weights = _one_more_epoch(reference_weights(2))
    for rank, res in enumerate(stages):
        assert_close(_as_tensors(res["fit_again"]), weights, f"rank {rank}: state_dict after a second fit")
