"""Two CPU processes with the `zero2` and `gemini` strategies train the same weights as one process.

The data order and the noise depend on the global batch only (not on the world size), so 2 ranks x batch 1
see what 1 rank x batch 2 sees; averaged gradients make the updates agree up to summation order.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lowmem.core_parallel import run_on_ranks

pytestmark = pytest.mark.distributed

STRATEGIES_MISSING = importlib.util.find_spec("lowmem.recipes.strategies") is None


def _config(out: str, strategy: str, world: int):
    from lowmem.diffusion.config import FineTuneConfig

    return FineTuneConfig(output_dir=out, strategy=strategy, devices=world, train_batch_size=2 // world,
                          max_train_steps=2, checkpointing_steps=2, learning_rate=1e-3, resolution=32,
                          report_to="csv", max_grad_norm=0.0, adam_epsilon=1e-3)


def _train(rank: int, world: int, out: str, strategy: str) -> list[float]:
    from lowmem.recipes.diffusion import fit_finetune
    from tests.diffusion.test_finetune import RecordLosses

    recorder = RecordLosses()
    fit_finetune(_config(out, strategy, world), [recorder], enable_progress_bar=False, accelerator="cpu")
    return [loss for _, _, loss in recorder.losses]


def _unet(folder):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(folder, subfolder="unet").state_dict()


def _train_each(rank: int, world: int, root: str, strategies: list[str]) -> dict[str, list[float]]:
    """Both strategies in the same two processes (one spawn: the imports dominate the test's time)."""
    return {s: _train(rank, world, f"{root}/{s}", s) for s in strategies}


@pytest.mark.skipif(STRATEGIES_MISSING, reason="recipes/strategies.py (zero2, gemini) is not in this build yet")
def test_zero2_and_gemini_on_two_ranks_match_one_process(tmp_path):
    from lowmem.diffusion.tiny import build_tiny_components

    single = _train(0, 1, str(tmp_path / "one"), "auto")
    ref, init = _unet(tmp_path / "one"), build_tiny_components()["unet"].state_dict()
    strategies = ["zero2", "gemini"]
    per_rank = run_on_ranks(_train_each, 2, str(tmp_path), strategies, timeout=400, backend="none")
    for strategy in strategies:
        out = tmp_path / strategy
        losses = [per_rank[r][strategy] for r in range(2)]
        # each micro-batch loss of one process is the mean of the two ranks' halves
        torch.testing.assert_close(torch.tensor(losses).mean(0), torch.tensor(single), rtol=1e-5, atol=1e-6)
        assert (out / "checkpoint-2").is_dir() and (out / "model_index.json").is_file(), strategy
        ours = _unet(out)
        # Adam turns the summation-order noise of zero gradients (conv biases before GroupNorm) into full
        # lr-sized steps; adam_epsilon=1e-3 keeps such noise out, so the weights must agree closely.
        for key, expected in ref.items():
            torch.testing.assert_close(ours[key], expected, rtol=0, atol=2e-5, msg=f"{strategy}: {key}")
        moved = sum(float((ours[k] - init[k]).abs().max()) > 1e-5 for k in ref)
        assert moved > 0.9 * len(ref), f"{strategy}: only {moved} of {len(ref)} tensors were updated"
