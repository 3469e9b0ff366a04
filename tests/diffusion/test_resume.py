"""Resume as diffusers' training scripts resume (issue 32): the run's length counted as they count it, a resumed run
continuing the global step, the epoch and the LR schedule to the new end, the checkpoints they write and remove."""

from __future__ import annotations

import shutil

import pytest
import torch

from lowmem.diffusion.config import FineTuneConfig
from lowmem.diffusion.errors import InputError
from lowmem.diffusion.schedule import run_length
from tests.diffusion.conftest import as_accelerate, write_image_folder

pl = pytest.importorskip("lightning.pytorch")


@pytest.mark.parametrize(("args", "want"), [
    # (samples, batch, processes, accumulation, max_train_steps, epochs, start) -> (epochs, first, end, batches)
    ((4, 1, 1, 1, 8, 100, 0), (2, 0, 8, {0: 4, 1: 4})),
    ((4, 1, 1, 1, 8, 100, 4), (2, 1, 8, {1: 4})),
    ((4, 1, 1, 1, 5, 100, 4), (2, 1, 5, {1: 1})),
    ((4, 1, 1, 1, 4, 100, 4), (1, 1, 4, {})),  # at the end: nothing
    ((6, 1, 1, 1, 2, 100, 4), (1, 0, 5, {0: 1})),  # past the end, epoch not over: one step (diffusers' test)
    ((4, 1, 1, 1, 5, 100, 2), (2, 0, 6, {0: 3, 1: 1})),  # restart of epoch 0, break, then one step in epoch 1
    ((5, 1, 1, 2, None, 3, 0), (3, 0, 9, {0: 5, 1: 5, 2: 5})),  # the epoch's last micro-batch steps too
    ((2, 1, 1, 1, 6, 100, 4), (3, 2, 6, {2: 2})),  # DreamBooth's test: 2 images, resume at 4, 6 steps
    ((7, 2, 2, 1, None, 2, 0), (2, 0, 4, {0: 2, 1: 2})),  # batches per rank: ceil(7 / (2 x 2))
])
def test_run_length_counts_as_the_scripts(args, want):
    got = run_length(*args)
    assert (got.num_train_epochs, got.first_epoch, got.end_step, got.epoch_batches) == want
    assert got.trains_nothing == (want[2] == args[-1])


def test_epoch_sampler_deals_the_same_global_batches_on_any_number_of_ranks():
    from lowmem.diffusion.data import EpochBatchSampler

    one = EpochBatchSampler(6, 2, seed=3)
    two = [EpochBatchSampler(6, 1, seed=3, rank=r, world_size=2) for r in range(2)]
    for epoch in (0, 1):
        for s in (one, *two):
            s.set_epoch(epoch)
        assert [sorted(b) for b in one] == [sorted(x + y) for x, y in zip(*two, strict=True)]
    assert sorted(i for b in one for i, _ in b) == list(range(6))  # each sample once per epoch
    short = EpochBatchSampler(5, 2, seed=3, epoch_batches={0: 2})
    assert len(short) == 3 and len(list(short)) == 2
    short.set_epoch(1)
    assert [len(b) for b in short] == [2, 2, 1]  # one process: the last batch is short


def _config(out, data, **kw) -> FineTuneConfig:
    base = dict(output_dir=str(out), train_data_dir=str(data), resolution=32, report_to="csv", seed=0,
                lr_scheduler="linear", lr_warmup_steps=2, learning_rate=1e-3, max_train_steps=8, use_ema=True)
    return FineTuneConfig(**{**base, **kw})


def _fit(cfg, *callbacks):
    from lowmem.recipes.diffusion import fit_finetune

    return fit_finetune(cfg, list(callbacks), enable_progress_bar=False)


class Steps(pl.Callback):
    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        lr = float(trainer.optimizers[0].param_groups[0]["lr"])
        self.steps.append((trainer.current_epoch, trainer.global_step, lr))


def _unet(folder):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(folder, subfolder="unet").state_dict()


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("data"), 4, caption="picture {i}")


@pytest.fixture(scope="module")
def whole(tmp_path_factory, image_folder):
    """An uninterrupted 8-step run (4 images, 4 steps an epoch, EMA, linear warm-up), checkpoints at 4 and 8."""
    out, steps = tmp_path_factory.mktemp("whole") / "out", Steps()
    _fit(_config(out, image_folder, checkpointing_steps=4), steps)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    return out, steps.steps


def test_resume_trains_to_the_new_end_bitwise_and_one_step_past_it(tmp_path, image_folder, whole):
    out, whole_steps = whole
    part = Steps()
    # a run that stopped at step 4 of 8 (its checkpoint-4), resumed with the same flags: steps 5-8 in epoch 1
    shutil.copytree(out / "checkpoint-4", tmp_path / "resumed" / "checkpoint-4")
    _fit(_config(tmp_path / "resumed", image_folder, checkpointing_steps=4, resume_from_checkpoint="checkpoint-4"),
         part)
    assert [s[:2] for s in part.steps] == [(1, 5), (1, 6), (1, 7), (1, 8)]
    assert part.steps == whole_steps[4:]  # the LR schedule continues too
    a, b = _unet(out), _unet(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in (tmp_path / "resumed").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]

    # resumed at 4 with --max_train_steps 5: one step (5), and its checkpoint
    one = Steps()
    shutil.copytree(out / "checkpoint-4", tmp_path / "five" / "checkpoint-4")
    _fit(_config(tmp_path / "five", image_folder, max_train_steps=5, checkpointing_steps=1,
                 resume_from_checkpoint="latest"), one)
    assert [s[:2] for s in one.steps] == [(1, 5)]
    assert sorted(p.name for p in (tmp_path / "five").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5"]

    # resumed at its end: one line, nothing trained, nothing written
    shutil.rmtree(tmp_path / "five" / "checkpoint-5")
    before = sorted(p.name for p in (tmp_path / "five").iterdir())
    with pytest.raises(InputError, match="no step would be trained") as err:
        _fit(_config(tmp_path / "five", image_folder, max_train_steps=4, resume_from_checkpoint="checkpoint-4"))
    assert "\n" not in str(err.value) and "checkpoint-4" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "five").iterdir()) == before


def test_accelerate_checkpoint_of_the_scripts_resumes(tmp_path, image_folder, whole, caplog):
    out, whole_steps = whole
    as_accelerate(out / "checkpoint-4", tmp_path / "acc" / "checkpoint-4")
    assert {p.name for p in (tmp_path / "acc" / "checkpoint-4").iterdir()} == {
        "unet", "unet_ema", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"}
    part = Steps()
    with caplog.at_level("WARNING"):
        _fit(_config(tmp_path / "acc", image_folder, checkpointing_steps=4, resume_from_checkpoint="latest"), part)
    assert part.steps == whole_steps[4:]
    a, b = _unet(out), _unet(tmp_path / "acc")  # UNet, EMA, optimizer and LR schedule all continued
    assert all(torch.equal(a[k], b[k]) for k in a)
    skipped = [r.getMessage() for r in caplog.records if "random_states_0.pkl" in r.getMessage()]
    assert len(skipped) == 1 and "data order will differ" in skipped[0]
    assert not list((tmp_path / "acc").glob(".resume-*"))  # the converted state is not left behind

    # what is missing is named, in one line, before any model is loaded
    (tmp_path / "acc" / "checkpoint-4" / "optimizer.bin").unlink()
    shutil.rmtree(tmp_path / "acc" / "checkpoint-4" / "unet_ema")
    with pytest.raises(InputError) as err:
        _fit(_config(tmp_path / "acc", image_folder, resume_from_checkpoint="checkpoint-4"))
    line = str(err.value)
    assert "\n" not in line and "optimizer.bin" in line and "unet_ema/diffusion_pytorch_model.safetensors" in line


def test_accelerate_lora_checkpoint_resumes(tmp_path, image_folder):
    from safetensors.torch import load_file

    def cfg(out, **kw):
        # 2 micro-batches a step: checkpoint-2 ends epoch 0 (mid-epoch, the epoch would restart)
        return _config(out, image_folder, rank=4, use_ema=False, max_train_steps=4, checkpointing_steps=2,
                       gradient_accumulation_steps=2, **kw)

    _fit(cfg(tmp_path / "whole"))
    as_accelerate(tmp_path / "whole" / "checkpoint-2", tmp_path / "acc" / "checkpoint-2")
    part = Steps()
    _fit(cfg(tmp_path / "acc", resume_from_checkpoint="checkpoint-2"), part)
    assert [s[1] for s in part.steps] == [2, 3, 3, 4]  # after each micro-batch
    a = load_file(tmp_path / "whole" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "acc" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resumed_mid_epoch_restarts_the_epoch_and_breaks_as_the_scripts(tmp_path, image_folder, whole):
    """checkpoint-2 of 4 steps an epoch, resumed with --max_train_steps 5: the scripts restart epoch 0 from its
    first batch (steps 3, 4, 5), break at 5, then run epoch 1's first batch (step 6) and stop."""
    out, _ = whole
    shutil.copytree(out / "checkpoint-4", tmp_path / "mid" / "checkpoint-2")  # its weights; the step is the name's
    part = Steps()
    _fit(_config(tmp_path / "mid", image_folder, max_train_steps=5, checkpointing_steps=3,
                 resume_from_checkpoint="latest"), part)
    assert [s[:2] for s in part.steps] == [(0, 3), (0, 4), (0, 5), (1, 6)]
    assert sorted(p.name for p in (tmp_path / "mid").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3",
                                                                               "checkpoint-6"]


def test_validation_epochs_validates_as_the_scripts_after_epochs_0_k_2k(tmp_path, image_folder):
    """The text-to-image scripts validate after epoch e's loop when e % validation_epochs == 0 (0-based), so the
    first epoch is validated and, with k = 2 and one step an epoch, 3 steps validate after epochs 0 and 2."""
    out = tmp_path / "out"
    _fit(_config(out, image_folder, train_batch_size=4, max_train_steps=3, use_ema=False,
                 validation_prompt="a red circle", validation_epochs=2, num_validation_images=1,
                 num_inference_steps=2))
    names = sorted(p.name for p in (out / "validation").glob("*.png"))
    assert names == ["epoch-0000.png", "epoch-0002.png", "final.png"], names
