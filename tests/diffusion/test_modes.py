"""Train and eval modes (issue 45): with dropout > 0 in the UNet and the text encoder, every training forward of a
trained model runs in train mode and every frozen one in eval mode, as diffusers' scripts have them (`unet.train()`,
the text encoder's `train()` only when trained, the VAE as `from_pretrained` leaves it); Lightning's "Found N
module(s) in eval mode at the start of training" is not printed.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lowmem.diffusion.config import FineTuneConfig
from lowmem.recipes.diffusion import fit_finetune


@pytest.fixture(scope="module")
def dropout_folder(tmp_path_factory) -> Path:
    """The tiny SD pipeline with dropout 0.1 in the UNet's resnets and the text encoder's layers and attention."""
    from lowmem.diffusion.tiny import save_tiny_sd_pipeline

    folder = save_tiny_sd_pipeline(tmp_path_factory.mktemp("dropout") / "base")
    for sub, values in (("unet", {"dropout": 0.1}), ("text_encoder", {"dropout": 0.1, "attention_dropout": 0.1})):
        path = folder / sub / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return folder


class _RecordModes(pl.Callback):
    """The `training` flag of every module of the UNet, VAE and text encoder at each forward of a training batch."""

    def __init__(self) -> None:
        self.seen: dict[str, set[bool]] = {}
        self.dropout_in_train = 0
        self._on = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for part in ("unet", "vae", "text_encoder"):
            for name, m in getattr(pl_module, part).named_modules():
                key = f"{part}.{name}".rstrip(".")
                m.register_forward_pre_hook(lambda m, args, key=key: self._record(key, m))

    def _record(self, key: str, m: torch.nn.Module) -> None:
        if self._on:
            self.seen.setdefault(key, set()).add(m.training)
            if isinstance(m, torch.nn.Dropout) and m.p > 0 and m.training:
                self.dropout_in_train += 1

    def on_train_batch_start(self, *args) -> None:
        self._on = True

    def on_train_batch_end(self, *args) -> None:
        self._on = False


@pytest.mark.parametrize("flags", [{"train_text_encoder": True}, {"rank": 4}], ids=["full+text_encoder", "lora"])
def test_training_forwards_run_in_the_scripts_modes_and_lightning_does_not_warn(tmp_path, dropout_folder,
                                                                               image_folder, flags):
    cfg = FineTuneConfig(pretrained_model_name_or_path=str(dropout_folder), train_data_dir=str(image_folder),
                         output_dir=str(tmp_path / "out"), max_train_steps=2, report_to="csv", **flags)
    rec = _RecordModes()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fit_finetune(cfg, callbacks=[rec], enable_progress_bar=False)
    assert not [w for w in got if "eval mode at the start of training" in str(w.message)], [str(w.message)
                                                                                          for w in got]
    trained_te = bool(flags.get("train_text_encoder"))
    assert rec.seen, "no forward recorded"
    for key, modes in rec.seen.items():
        trained = key.startswith("unet") or (key.startswith("text_encoder") and trained_te)
        assert modes == {trained}, (key, modes)
    assert any(k.startswith("vae") for k in rec.seen) and any(k.startswith("text_encoder") for k in rec.seen)
    assert rec.dropout_in_train > 0  # the UNet's dropout (p > 0) ran in train mode


def test_modes_are_set_before_lightning_looks(tmp_path, dropout_folder):
    """At construction already: what Lightning's check sees in eval mode are the frozen models' modules only."""
    from lowmem.recipes.diffusion import StableDiffusionFineTune

    module = StableDiffusionFineTune(FineTuneConfig(pretrained_model_name_or_path=str(dropout_folder), rank=4))
    in_eval = {name.split(".")[0] for name, m in module.named_modules() if not m.training}
    assert in_eval == {"vae", "text_encoder"}, in_eval
    assert all(m.training for m in module.unet.modules())


@pytest.mark.parametrize(("train_text_encoder", "frozen"), [(True, {"vae"}),
                                                            (False, {"vae", "text_encoder", "text_encoder_2"})])
def test_sdxl_modes_are_set_at_construction(sdxl_folder, images, train_text_encoder, frozen):
    from lowmem.diffusion.sdxl_scripts import sdxl_script_config
    from lowmem.recipes.diffusion.sdxl import StableDiffusionXLFineTune

    cfg = sdxl_script_config("train_text_to_image_lora_sdxl", {
        "pretrained_model_name_or_path": str(sdxl_folder), "train_data_dir": str(images), "resolution": 32,
        "train_text_encoder": train_text_encoder})
    module = StableDiffusionXLFineTune(cfg)
    in_eval = {name.split(".")[0] for name, m in module.named_modules() if not m.training}
    assert in_eval == frozen, in_eval
