"""End-to-end fine-tuning of the tiny pipeline on CPU: full (EMA), LoRA, DreamBooth, resume, export + reload."""

from __future__ import annotations

import csv

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from lowmem.diffusion.config import FineTuneConfig
from tests.diffusion.conftest import write_image

pl = pytest.importorskip("lightning.pytorch")

FAST = dict(resolution=32, num_inference_steps=2, num_validation_images=1, report_to="csv")


class RecordLosses(pl.Callback):
    """Collects (global step, batch index, loss) of every micro-batch."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, int, float]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append((trainer.global_step, batch_idx, float(outputs["loss"])))


class StopAt(pl.Callback):
    """Simulates a kill right after the checkpoint of step `step` was written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError("killed")


def _fit(cfg: FineTuneConfig, *callbacks: pl.Callback):
    from lowmem.recipes.diffusion import fit_finetune

    return fit_finetune(cfg, list(callbacks), enable_progress_bar=False)


def _image(pipe, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = pipe("a red circle", num_inference_steps=2, generator=g, height=32, width=32, output_type="np")
    return out.images[0]


def test_full_finetune_ema_checkpoints_validation_export(tmp_path):
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    out = tmp_path / "full"
    cfg = FineTuneConfig(output_dir=str(out), max_train_steps=2, train_batch_size=2, use_ema=True, snr_gamma=5.0,
                         gradient_checkpointing=True, checkpointing_steps=1, checkpoints_total_limit=1,
                         validation_prompt="a red circle", validation_steps=2, **FAST)
    recorder = RecordLosses()
    _fit(cfg, recorder)
    assert [s for s, _, _ in recorder.losses] == [1, 2]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (out / "validation" / "step-000002.png").is_file() and (out / "validation" / "final.png").is_file()
    with open(out / "logs" / "csv" / "metrics.csv") as f:
        assert sum(1 for row in csv.DictReader(f) if row.get("train_loss")) == 2
    exported = UNet2DConditionModel.from_pretrained(out, subfolder="unet").state_dict()
    ema = UNet2DConditionModel.from_pretrained(out / "checkpoint-2", subfolder="unet_ema").state_dict()
    raw = UNet2DConditionModel.from_pretrained(out / "checkpoint-2", subfolder="unet").state_dict()
    assert all(torch.equal(exported[k], ema[k]) for k in exported)
    assert any(not torch.equal(exported[k], raw[k]) for k in exported)
    pipe = StableDiffusionPipeline.from_pretrained(out)
    image = _image(pipe)
    assert image.shape == (32, 32, 3) and np.isfinite(image).all()


def test_lora_with_text_encoder_loads_into_pipeline(tmp_path):
    from lowmem.diffusion.models import make_pipeline
    from lowmem.diffusion.tiny import build_tiny_components

    out = tmp_path / "lora"
    cfg = FineTuneConfig(output_dir=str(out), rank=4, train_text_encoder=True, learning_rate=1e-2,
                         max_train_steps=2, checkpointing_steps=2, **FAST)
    _fit(cfg)
    weights = load_file(out / "pytorch_lora_weights.safetensors")
    assert any(k.startswith("unet.") for k in weights) and any(k.startswith("text_encoder.") for k in weights)
    assert (out / "checkpoint-2" / "pytorch_lora_weights.safetensors").is_file()
    assert not (out / "model_index.json").exists()
    pipe = make_pipeline(build_tiny_components())
    base = _image(pipe)
    pipe.load_lora_weights(out)
    tuned = _image(pipe)
    assert tuned.shape == base.shape and np.abs(tuned - base).max() > 1e-4


def test_dreambooth_prior_preservation_generates_class_images(tmp_path):
    from diffusers import StableDiffusionPipeline

    for i in range(2):
        write_image(tmp_path / "inst" / f"{i}.png", size=(48, 40), seed=i)
    out = tmp_path / "db"
    cfg = FineTuneConfig(output_dir=str(out), instance_data_dir=str(tmp_path / "inst"),
                         instance_prompt="a photo of sks shape", class_data_dir=str(tmp_path / "class"),
                         class_prompt="a photo of a shape", with_prior_preservation=True, num_class_images=2,
                         train_text_encoder=True, max_train_steps=2, checkpointing_steps=5, **FAST)
    module = _fit(cfg)
    assert len(list((tmp_path / "class").glob("*.png"))) == 2
    pipe = StableDiffusionPipeline.from_pretrained(out)
    for a, b in zip(pipe.text_encoder.parameters(), module.text_encoder.parameters()):
        assert torch.equal(a, b.float())
    assert _image(pipe).shape == (32, 32, 3)


def test_resume_continues_with_the_uninterrupted_losses(tmp_path, image_folder):
    from diffusers import UNet2DConditionModel

    # 4 images, 2 per step: checkpoint-2 ends epoch 0 (mid-epoch the scripts restart the epoch: test_resume.py)
    def config(name, resume=None):
        return FineTuneConfig(output_dir=str(tmp_path / name), train_data_dir=str(image_folder), max_train_steps=4,
                              gradient_accumulation_steps=2,
                              lr_scheduler="cosine", lr_warmup_steps=1, use_ema=True, random_flip=True,
                              noise_offset=0.05, checkpointing_steps=2, resume_from_checkpoint=resume, **FAST)

    whole = RecordLosses()
    _fit(config("a"), whole)
    first, second = RecordLosses(), RecordLosses()
    with pytest.raises(RuntimeError, match="killed"):
        _fit(config("b"), first, StopAt(2))
    assert (tmp_path / "b" / "checkpoint-2").is_dir() and not (tmp_path / "b" / "model_index.json").exists()
    _fit(config("b", resume="latest"), second)
    assert len(whole.losses) == 8
    assert first.losses + second.losses == whole.losses
    a = UNet2DConditionModel.from_pretrained(tmp_path / "a", subfolder="unet").state_dict()
    b = UNet2DConditionModel.from_pretrained(tmp_path / "b", subfolder="unet").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
