"""DAPStrategy: fit is refused; Trainer.predict on 2 ranks with a generic LightningModule whose ranks hold
different data returns rank 0's results on both (marked slow). The fast path is tests/recipes/test_fold_recipe.py:
one device without a process group, and 2 ranks where rank 1 builds no features and predicts rank 0's
broadcast batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lowmem.core_parallel import run_on_ranks
from tests.fastfold.test_dap import _model

KEYS = ("final_atom_positions", "plddt", "pair")


def _batches(seed: int) -> list[dict[str, torch.Tensor]]:
    from lowmem.fastfold.model import config
    from lowmem.fastfold.model.testing import random_batch

    cfg = config.tiny(templates=True, tm=True)
    return [random_batch(cfg, n_res=n, n_seq=5, n_extra=3, n_templ=2, n_recycle=0, seed=seed + n) for n in (11, 6)]


def _module():
    import lightning.pytorch as pl

    class Folder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _model("float64")

        def predict_step(self, batch, batch_idx):
            out = self.model(batch)
            return {k: out[k].detach().numpy() for k in KEYS} | {"pg": dist.is_initialized()}

    return Folder()


def _predict(rank: int, world: int, seed: int) -> list[dict]:
    import lightning.pytorch as pl

    from lowmem import recipes  # noqa: F401 - registers "dap"

    trainer = pl.Trainer(
        strategy="dap", accelerator="cpu", devices=world, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(_batches(seed), batch_size=None)
    return trainer.predict(_module(), loader)


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    model = _model("float64")
    with torch.no_grad():
        return [{k: model(b)[k].numpy() for k in KEYS} for b in _batches(0)]


def _compare(got: list[dict], want: list[dict], what: str) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for k in KEYS:
            err = abs(g[k] - w[k]).max() / abs(w[k]).max()
            assert err < 1e-10, f"{what}: {k} rel err {err:.2e}"


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_equal_one_process(reference):
    # rank 1's own dataloader holds other targets: it must predict rank 0's (broadcast) batches
    results = run_on_ranks(_predict_seeded, 2, backend="none", timeout=150)
    for rank, got in enumerate(results):
        assert all(p["pg"] for p in got)
        _compare(got, reference, f"2 ranks, rank {rank}")


def _predict_seeded(rank: int, world: int) -> list[dict]:
    return _predict(rank, world, seed=100 * rank)


def test_fit_is_refused():
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from lowmem.recipes.dap import DAPStrategy

    with pytest.raises(ValueError, match="not fit"):
        DAPStrategy().setup(SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING)))
