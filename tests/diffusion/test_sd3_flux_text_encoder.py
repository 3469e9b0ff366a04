"""The SD3 / Flux scripts' `--lora_dropout` and the full scripts' `--train_text_encoder` (issue 46), on the tiny
pipelines of `diffusion.flow_tiny`.

What diffusers v0.40.0 does, and what is checked here:
- `--lora_dropout p` goes into peft's `LoraConfig(lora_dropout=p)` of the transformer and, with
  --train_text_encoder, of the CLIP encoders (train_dreambooth_lora_sd3.py:1268-1286, _flux.py:1273-1290).
- train_dreambooth_sd3.py --train_text_encoder sets CLIP-L, CLIP-G and T5 `requires_grad_(True)` (:1144-1147),
  gives each a parameter group with --text_encoder_lr and --adam_weight_decay_text_encoder (:1254-1276) and saves
  them in the output pipeline (:1756-1771); train_dreambooth_flux.py trains its CLIP encoder only, T5 frozen
  (:1179-1181, :1282-1289, :1809-1820).
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from lowmem.diffusion.errors import InputError
from lowmem.suite.cli import build_parser, main
from lowmem.suite.commands.diffusion_flow import build_flow_config
from tests.diffusion.conftest import as_accelerate


@pytest.fixture(scope="module")
def folders(flow_folders) -> dict[str, Path]:
    return flow_folders  # conftest's tiny SD3/Flux pipelines and instance images


def _args(script: str, folders: dict[str, Path], out: Path, *extra: str) -> list[str]:
    family = "flux" if script.endswith("flux") else "sd3"
    return ["diffusion", script, "--pretrained_model_name_or_path", str(folders[family]), "--instance_data_dir",
            str(folders["inst"]), "--instance_prompt", "a sks dog", "--resolution", "32", "--train_batch_size", "2",
            "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--max_sequence_length", "8", "--seed", "3",
            "--report_to", "csv", "--output_dir", str(out), *extra]


def _run(capsys, script: str, folders: dict[str, Path], out: Path, *extra: str) -> list[float]:
    """One run; its per-step losses (the CSV log)."""
    rc = main(_args(script, folders, out, *extra))
    err = capsys.readouterr().err
    assert rc == 0, "\n".join(err.splitlines()[-15:])
    logs = sorted((out / "logs").glob("csv*/metrics.csv"), key=lambda p: p.stat().st_mtime)
    return [float(r["train_loss"]) for r in csv.DictReader(logs[-1].open()) if r.get("train_loss")]


def _weights(folder: Path, part: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    name = "model.safetensors" if part.startswith("text_encoder") else "diffusion_pytorch_model.safetensors"
    return load_file(folder / part / name)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], **tol) if tol else torch.equal(a[k], b[k])
                                        for k in a)


# -- --lora_dropout ---------------------------------------------------------------------------------------------
def _config(script: str, folders: dict[str, Path], out: Path, *extra: str):
    """The `FineTuneConfig` the command line builds (nothing loaded)."""
    argv = _args(script, folders, out, *extra)
    return build_flow_config(build_parser(argv).parse_args(argv))


def test_lora_dropout_reaches_the_config(folders, tmp_path):
    for script in ("train_dreambooth_lora_sd3", "train_dreambooth_lora_flux"):
        assert _config(script, folders, tmp_path).extra["flow"].lora_dropout == 0.0
        cfg = _config(script, folders, tmp_path, "--lora_dropout", "0.25")
        assert cfg.extra["flow"].lora_dropout == 0.25
        with pytest.raises(InputError, match="lora_dropout") as err:
            _config(script, folders, tmp_path, "--lora_dropout", "1.5")
        assert "\n" not in str(err.value)
    for script in ("train_dreambooth_sd3", "train_dreambooth_flux"):  # the full scripts' encoders and their group
        cfg = _config(script, folders, tmp_path, "--train_text_encoder", "--text_encoder_lr", "3e-4",
                      "--adam_weight_decay_text_encoder", "0.02")
        flow = cfg.extra["flow"]
        assert cfg.train_text_encoder and (flow.text_encoder_lr, flow.adam_weight_decay_text_encoder) == (3e-4, 0.02)


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_lora_layers_are_peft_dropout_layers(folders, tmp_path, family):
    """With --lora_dropout p every LoRA layer of the transformer and of the trained CLIP encoders is peft's with
    `nn.Dropout(p)` before its down projection (T5 gets none)."""
    from peft.tuners.lora import LoraLayer

    from lowmem.recipes.diffusion.flow import FluxFineTune, SD3FineTune

    cfg = _config(f"train_dreambooth_lora_{family}", folders, tmp_path, "--lora_dropout", "0.3",
                  "--train_text_encoder")
    module = (SD3FineTune if family == "sd3" else FluxFineTune)(cfg)
    for name in ("unet", *module.trained_encoders()):
        layers = [m for m in getattr(module, name).modules() if isinstance(m, LoraLayer)]
        assert layers, name
        for layer in layers:
            drop = layer.lora_dropout["default"]
            assert type(drop) is torch.nn.Dropout and drop.p == 0.3, (name, drop)
    t5 = "text_encoder_3" if family == "sd3" else "text_encoder_2"
    assert t5 not in module.trained_encoders()


def test_lora_dropout_changes_training(capsys, tmp_path, folders):
    """p > 0 against p = 0 from the same seed: the first step's loss is the same (peft's LoRA starts with B = 0,
    so its branch adds nothing whatever the mask), the second's and the weights differ. (A dropout run's exact
    resume: test_sd3_flux.py's test_resumes_exactly, Flux LoRA with --lora_dropout 0.3.)"""
    args = ("--max_train_steps", "2", "--rank", "2", "--train_text_encoder", "--text_encoder_lr", "1e-3")
    script = "train_dreambooth_lora_sd3"
    plain = _run(capsys, script, folders, tmp_path / "p0", *args)
    drop = _run(capsys, script, folders, tmp_path / "a", *args, "--lora_dropout", "0.5")
    assert drop[0] == pytest.approx(plain[0], rel=1e-6) and drop[1] != plain[1]
    from safetensors.torch import load_file

    w0, wa = (load_file(tmp_path / d / "pytorch_lora_weights.safetensors") for d in ("p0", "a"))
    assert w0.keys() == wa.keys()
    assert max((w0[k] - wa[k]).abs().max().item() for k in w0) > 1e-5  # Adam moves weights by ~1e-3 a step here


# -- the full scripts' --train_text_encoder ------------------------------------------------------------------------
def test_full_flux_trains_its_clip_encoder(capsys, tmp_path, folders):
    """train_dreambooth_flux --train_text_encoder: CLIP changes, T5 does not; the first step's loss is the one of
    the run with pre-computed embeddings (the same weights, encoded in the step); the pipeline written loads with
    `from_pretrained` holding the trained CLIP; --strategy gemini_nvme trains the same (adam_epsilon 1e-4: with the
    default 1e-8 a CLIP weight whose gradient is ~1e-8 moves by a fraction of the learning rate that fp32's
    summation order decides)."""
    from diffusers import FluxPipeline

    te = ("--max_train_steps", "2", "--train_text_encoder", "--text_encoder_lr", "1e-3", "--adam_epsilon", "1e-4")
    script = "train_dreambooth_flux"
    frozen = _run(capsys, script, folders, tmp_path / "frozen", "--max_train_steps", "1", "--adam_epsilon", "1e-4")
    plain = _run(capsys, script, folders, tmp_path / "plain", *te)
    gemini = _run(capsys, script, folders, tmp_path / "gemini", *te, "--strategy", "gemini_nvme", "--offload_dir",
                  str(tmp_path / "nvme"))
    assert plain[0] == pytest.approx(frozen[0], rel=1e-6)
    assert gemini == pytest.approx(plain, rel=1e-5, abs=1e-6)
    base = folders["flux"]
    clip, t5 = _weights(tmp_path / "plain", "text_encoder"), _weights(tmp_path / "plain", "text_encoder_2")
    assert not _same(clip, _weights(base, "text_encoder"), rtol=0, atol=1e-5)
    assert _same(t5, _weights(base, "text_encoder_2"))
    for part in ("text_encoder", "transformer"):
        assert _same(_weights(tmp_path / "plain", part), _weights(tmp_path / "gemini", part), rtol=1e-5, atol=1e-6)
    pipe = FluxPipeline.from_pretrained(tmp_path / "gemini")
    loaded = pipe.text_encoder.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in _weights(tmp_path / "gemini", "text_encoder").items())
    image = pipe("a sks dog", num_inference_steps=1, height=32, width=32, max_sequence_length=8,
                 output_type="np").images[0]
    assert image.shape == (32, 32, 3)


def test_full_sd3_trains_its_three_encoders_and_resumes_exactly(capsys, tmp_path, folders):
    """train_dreambooth_sd3 --train_text_encoder: CLIP-L, CLIP-G and T5 change (as the script sets them up); the
    first step's loss is the pre-computed run's; the pipeline loads with `from_pretrained` holding the trained
    encoders; 2 steps + resume from our checkpoint-2, and from accelerate's checkpoint-2 in the layout of the
    script's save hook (transformer/, text_encoder{,_2,_3}/, optimizer.bin with the four groups), give the
    3-step run's losses and weights exactly; --strategy zero2 trains the same."""
    from diffusers import StableDiffusion3Pipeline

    script, parts = "train_dreambooth_sd3", ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
    # T5 trains in train mode, so its dropout_rate (0.1) acts in the step: 0 here, for the first step's loss to be
    # the one of the frozen (eval-mode) encoders; the masks' resume is the LoRA dropout's (test_sd3_flux.py)
    base = shutil.copytree(folders["sd3"], tmp_path / "base")
    config = json.loads((base / "text_encoder_3" / "config.json").read_text())
    (base / "text_encoder_3" / "config.json").write_text(json.dumps({**config, "dropout_rate": 0.0}))
    folders = {**folders, "sd3": base}
    args = ("--checkpointing_steps", "2", "--max_train_steps", "3", "--train_text_encoder", "--text_encoder_lr",
            "2e-3", "--adam_epsilon", "1e-4")  # epsilon: see test_full_flux_trains_its_clip_encoder
    frozen = _run(capsys, script, folders, tmp_path / "frozen", "--max_train_steps", "1")
    whole = _run(capsys, script, folders, tmp_path / "whole", *args)
    assert whole[0] == pytest.approx(frozen[0], rel=1e-6)
    for part in parts:
        assert not _same(_weights(tmp_path / "whole", part), _weights(folders["sd3"], part), rtol=0, atol=1e-5), part
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "whole")
    for part in parts[1:]:
        loaded = getattr(pipe, part).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in _weights(tmp_path / "whole", part).items()), part

    shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "own" / "checkpoint-2")
    resumed = _run(capsys, script, folders, tmp_path / "own", *args, "--resume_from_checkpoint", "latest")
    assert resumed == whole[2:]
    ckpt = tmp_path / "acc" / "checkpoint-2"
    as_accelerate(tmp_path / "whole" / "checkpoint-2", ckpt)
    for part in parts:
        shutil.copytree(tmp_path / "whole" / "checkpoint-2" / part, ckpt / part)
    from_acc = _run(capsys, script, folders, tmp_path / "acc", *args, "--resume_from_checkpoint", "latest")
    assert from_acc == whole[2:]
    zero2 = _run(capsys, script, folders, tmp_path / "zero2", *args, "--strategy", "zero2")
    assert zero2 == pytest.approx(whole, rel=1e-5, abs=1e-6)
    for part in parts:
        ours = _weights(tmp_path / "whole", part)
        assert _same(ours, _weights(tmp_path / "own", part)) and _same(ours, _weights(tmp_path / "acc", part)), part
        assert _same(ours, _weights(tmp_path / "zero2", part), rtol=1e-5, atol=1e-6), part
