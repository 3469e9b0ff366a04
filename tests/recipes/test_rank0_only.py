"""Rank 0 alone reads the model under every strategy name (issue 43): a forward in a callback in the middle of
training (sampling, a rank-0 evaluation) and `state_dict()` after `fit` (`if trainer.is_global_zero:
torch.save(model.state_dict(), f)`, the usual way to save weights). Under Gemini on CPU ranks of one host the
gathers read the peers' shards themselves, so the other rank goes on; both answers equal ddp's. One 2-rank
launch runs every name; its timeout makes a hang fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lowmem.core_parallel import run_on_ranks
from tests.recipes.test_strategies import SHARDED, make_module, make_trainer

PROBE = torch.linspace(-1, 1, 24).reshape(3, 8)


def _callback():
    import lightning.pytorch as pl

    class Rank0Sample(pl.Callback):
        def __init__(self) -> None:
            self.sample = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1 and trainer.is_global_zero:  # after the first optimizer step, rank 0 only
                with torch.no_grad():
                    self.sample = pl_module(PROBE).clone()

    return Rank0Sample()


def _every_name(rank: int, world: int, root: str) -> dict:
    out = {}
    for name in ("ddp", *SHARDED):
        sampler = _callback()
        trainer = make_trainer(name, world, Path(root) / name, 1, callbacks=[sampler])
        module = make_module()
        trainer.fit(module)
        if trainer.is_global_zero:  # the other rank goes straight on (to the next name's setup)
            out[name] = {"sample": sampler.sample.numpy(),
                         "state": {k: v.detach().clone().numpy() for k, v in module.state_dict().items()}}
    return out


@pytest.mark.distributed
def test_rank0_only_forward_and_state_dict_under_every_strategy_name(tmp_path):
    results = run_on_ranks(_every_name, 2, str(tmp_path), backend="none", timeout=240, env={"OMP_NUM_THREADS": "1"})
    got = results[0]
    assert set(got) == {"ddp", *SHARDED}
    want = got.pop("ddp")
    for name, res in got.items():
        torch.testing.assert_close(torch.as_tensor(res["sample"]), torch.as_tensor(want["sample"]), rtol=1e-5,
                                   atol=1e-6, msg=lambda m, n=name: f"{n} sample: {m}")
        assert set(res["state"]) == set(want["state"]), name
        for k, v in want["state"].items():
            torch.testing.assert_close(torch.as_tensor(res["state"][k]), torch.as_tensor(v), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, k=k: f"{n} {k}: {m}")
