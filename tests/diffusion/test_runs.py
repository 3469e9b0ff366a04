"""Runs that must not lose work or mislead: bf16 + validation, EMA validation, what the export keeps, text-encoder
gradient checkpointing, bad flag values refused before any model is loaded, progress lines in a log file."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from lowmem.diffusion.config import FineTuneConfig
from lowmem.suite.cli import main

pl = pytest.importorskip("lightning.pytorch")

FAST = dict(resolution=32, num_inference_steps=2, num_validation_images=2, report_to="csv", max_train_steps=2,
            checkpointing_steps=2, validation_prompt="a red circle", validation_steps=100)


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory):
    """A tiny SD-1.5-shaped pipeline folder: PNDMScheduler, safety checker, feature extractor."""
    from lowmem.diffusion.tiny import save_tiny_sd_pipeline

    return save_tiny_sd_pipeline(tmp_path_factory.mktemp("sd") / "base")


def _fit(cfg, *callbacks):
    from lowmem.recipes.diffusion import fit_finetune

    return fit_finetune(cfg, list(callbacks), enable_progress_bar=False)


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class CountTextEncoderLayerCalls(pl.Callback):
    """Counts forward calls inside the first CLIP layer during the first training batch, and its train mode."""

    def __init__(self) -> None:
        self.calls, self.training, self._handle = 0, None, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 0 and self._handle is None:
            # a submodule of the layer: transformers checkpoints the layer's forward (its own hooks run once)
            layer = next(m for n, m in module.text_encoder.named_modules() if n.endswith("encoder.layers.0.mlp"))
            self.training = module.text_encoder.training

            def count(*_):
                self.calls += 1

            self._handle = layer.register_forward_pre_hook(count)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self._handle:
            self._handle.remove()
            self._handle = False


def test_bf16_validation_full_finetune_keeps_base_components(tmp_path, sd_folder):
    """bf16 + --validation_prompt on a full fine-tune (text encoder too): validation images and the export
    both written; the export is the base with the trained UNet and text encoder swapped in."""
    from diffusers import PNDMScheduler

    out = tmp_path / "out"
    cfg = FineTuneConfig(pretrained_model_name_or_path=str(sd_folder), output_dir=str(out), mixed_precision="bf16",
                         train_text_encoder=True, gradient_checkpointing=True, use_ema=True, **FAST)
    counter = CountTextEncoderLayerCalls()
    _fit(cfg, counter)
    # CLIP's checkpointing runs (forward + recompute in backward) only because the encoder is in train mode
    assert counter.training is True and counter.calls == 2
    assert (out / "validation" / "final.png").is_file()
    index, base_index = (json.loads((f / "model_index.json").read_text()) for f in (out, sd_folder))
    assert index == base_index and index["requires_safety_checker"] is True
    exported, base = _files(out), _files(sd_folder)
    for name in ("scheduler", "safety_checker", "feature_extractor", "vae", "tokenizer"):
        keys = [k for k in base if k.startswith(name + "/")]
        assert keys and all(exported[k] == base[k] for k in keys), name
    for name in ("unet", "text_encoder"):
        key = f"{name}/" + ("diffusion_pytorch_model.safetensors" if name == "unet" else "model.safetensors")
        assert exported[key] != base[key], name
    scheduler = PNDMScheduler.from_pretrained(out, subfolder="scheduler")
    assert type(scheduler) is PNDMScheduler


def test_ema_validation_draws_from_the_exported_weights(tmp_path, sd_folder):
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    from lowmem.diffusion.export import generate_images, image_grid

    out = tmp_path / "out"
    cfg = FineTuneConfig(pretrained_model_name_or_path=str(sd_folder), output_dir=str(out), use_ema=True,
                         learning_rate=1e-2, **FAST)
    _fit(cfg)
    final = np.asarray(Image.open(out / "validation" / "final.png").convert("RGB"))
    pipe = StableDiffusionPipeline.from_pretrained(out, safety_checker=None, requires_safety_checker=False)

    def grid(p):
        images = generate_images(p, "a red circle", 2, seed=cfg.seed, steps=2, resolution=32)
        return np.asarray(image_grid(images))

    assert np.array_equal(grid(pipe), final)
    pipe.unet = UNet2DConditionModel.from_pretrained(out / "checkpoint-2", subfolder="unet")  # raw weights
    assert not np.array_equal(grid(pipe), final)


def test_progress_lines_when_stdout_is_not_a_terminal(tmp_path, capsys):
    cfg = FineTuneConfig(output_dir=str(tmp_path / "out"), rank=4, log_every_n_steps=1,
                         **{**FAST, "validation_prompt": None})
    _fit(cfg)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"step 2/2 loss \d+\.\d{4} images/s [0-9.e+-]+ lr [0-9.e-]+ ETA 0:00:00", lines[-1])
    with open(tmp_path / "out" / "logs" / "csv" / "metrics.csv") as f:
        header = f.readline()
    assert "lr" in header.strip().split(",") and "train_loss" in header


@pytest.mark.parametrize("flags, expect", [
    (["--strategy", "fsdp9"], "did you mean fsdp?"),
    (["--mixed_precision", "fp16"], "needs a CUDA device"),
    (["--lr_scheduler", "cosin"], "lr_scheduler must be one of"),
    (["--report_to", "mlflow"], "report_to must be one of"),
])
def test_bad_flag_values_one_line_before_any_model(monkeypatch, capsys, tmp_path, flags, expect):
    if flags[0] == "--mixed_precision" and torch.cuda.is_available():
        pytest.skip("fp16 runs where CUDA is available")

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("lowmem.diffusion.models.load_components", no_model)
    out = tmp_path / "out"
    rc = main(["diffusion", "finetune", "--output_dir", str(out), *flags])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ln.startswith("suite diffusion: error:")]
    assert rc == 2 and len(errors) == 1 and expect in errors[0], err
    assert "Traceback" not in err and not (out / "sample_data").exists()


def test_offload_dir_reaches_the_strategy_object_not_the_environment(tmp_path, monkeypatch):
    """`--offload_dir` builds the Gemini strategy with that folder (local and Ray paths); no environment variable
    is set, and a strategy without an NVMe tier refuses the flag in one line."""
    import os

    from lowmem.diffusion.errors import InputError
    from lowmem.recipes.diffusion import build_trainer, check_run

    environ = dict(os.environ)
    folder = str(tmp_path / "nvme")
    for name in ("gemini_nvme", "gemini_auto"):
        cfg = FineTuneConfig(output_dir=str(tmp_path / name), strategy=name, offload_dir=folder)
        parallel = cfg.parallel  # the run's one sharding config, built with the config
        check_run(cfg)
        trainer = build_trainer(cfg, 2, enable_progress_bar=False)
        assert trainer.strategy.config is parallel and cfg.parallel is parallel, name  # held, not rebuilt
        assert (parallel.offload_tier, parallel.offload_dir) == ("nvme", folder), name
    assert dict(os.environ) == environ
    refused = f"offload_dir {re.escape(folder)}: only the strategies with an NVMe tier"
    for name in ("gemini", "zero2", "auto"):  # refused where the config is built, before anything loads
        with pytest.raises(InputError, match=f"{refused}.*{name}"):
            FineTuneConfig(output_dir=str(tmp_path / "x"), strategy=name, offload_dir=folder)


def test_memory_budget_reaches_gemini_auto_and_trains_as_gemini(capsys, tmp_path, sd_folder, image_folder):
    """`--memory_budget` (issue 47) builds gemini_auto's config with the budget and an NVMe tier; elsewhere one line,
    exit 2, before anything is written. A tight budget (part of the model streamed from NVMe) trains the same LoRA
    weights as everything resident."""
    from safetensors.torch import load_file

    from lowmem.core_parallel.gemini.budget import ProcessMemory

    cfg = FineTuneConfig(output_dir=str(tmp_path / "c"), strategy="gemini_auto", memory_budget="8GiB")
    assert (cfg.parallel.placement, cfg.parallel.memory_budget, cfg.parallel.offload_tier) == ("auto", "8GiB", "nvme")
    rc = main(["diffusion", "finetune", "--strategy", "gemini", "--memory_budget", "2GiB",
               "--output_dir", str(tmp_path / "refused")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("suite diffusion: error:")]
    assert rc == 2 and len(err) == 1 and "memory_budget" in err[0] and "gemini_auto" in err[0]
    assert not (tmp_path / "refused").exists()

    base = ["diffusion", "train_text_to_image_lora", f"--pretrained_model_name_or_path={sd_folder}",
            f"--train_data_dir={image_folder}", "--resolution=32", "--train_batch_size=1", "--max_train_steps=3",
            "--seed=7", "--learning_rate=1e-3", "--report_to=csv"]
    weights = {}
    for name, extra in (("gemini", ["--strategy", "gemini"]),
                        ("budget", ["--strategy", "gemini_auto", "--memory_budget", None,
                                    "--offload_dir", str(tmp_path / "nvme")]),
                        ("nvme", ["--strategy", "gemini_nvme", "--offload_dir", str(tmp_path / "nvme2")])):
        # this process (after a run of the same work, alone or not) and a little: tight
        budget = str(ProcessMemory(torch.device("cpu")).now() + (48 << 20))
        rc = main([*base, f"--output_dir={tmp_path / name}", *(budget if a is None else a for a in extra)])
        assert rc == 0, capsys.readouterr().err[-2000:]
        weights[name] = load_file(tmp_path / name / "pytorch_lora_weights.safetensors")
    assert weights["gemini"].keys() == weights["budget"].keys()
    for k, v in weights["gemini"].items():
        assert torch.equal(v, weights["budget"][k]), k
    # what each step moved (`TierTraffic`, read by `suite bench diffusion --frontier`): the NVMe tier's run read its
    # chunks from there in every step; all resident, nothing came from there
    from lowmem.suite.bench.harness import csv_metric

    streamed = csv_metric(str(tmp_path / "nvme"), "tier_mib/nvme->device")
    assert len(streamed) == 3 and all(v > 0 for v in streamed[1:]), streamed
    # and the depth its reads ahead go to (set from each measured step, `PrefetchDepth`)
    depths = csv_metric(str(tmp_path / "nvme"), "prefetch_depth")
    assert len(depths) == 3 and all(1 <= d <= 4 for d in depths), depths
    assert not csv_metric(str(tmp_path / "gemini"), "tier_mib/nvme->device")
    assert len(csv_metric(str(tmp_path / "gemini"), "disk_read_mib")) == 3


def test_tier_traffic_logs_a_step_that_moved_nothing_as_zero():
    """A route that moved bytes in one step and none in the next logs 0 for the next (Lightning keeps the last
    value of a key not logged again: a resident step showed the first step's 66 GB of NVMe reads)."""
    from types import SimpleNamespace

    from lowmem.recipes.diffusion.callbacks import TierTraffic

    reports = iter([{"nvme->device": 3 << 20}, {}, {"device->nvme": 1 << 20}])
    model = SimpleNamespace(memory_report=lambda: {"traffic_last_step": next(reports)})
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=model), accumulate_grad_batches=1)
    logged: list[dict] = []
    module = SimpleNamespace(log=lambda name, value, **kw: logged[-1].__setitem__(name, value))
    cb = TierTraffic()
    for i in range(3):
        logged.append({})
        cb.on_train_batch_end(trainer, module, None, None, i)
    tiers = [{k: v for k, v in step.items() if k.startswith("tier_mib/")} for step in logged]
    assert tiers == [{"tier_mib/nvme->device": 3.0}, {"tier_mib/nvme->device": 0.0},
                     {"tier_mib/nvme->device": 0.0, "tier_mib/device->nvme": 1.0}], tiers
