"""`suite diffusion train_text_to_image_sdxl | train_text_to_image_lora_sdxl | train_dreambooth_lora_sdxl`
(issue 33): the SDXL scripts' flags against pinned copies of diffusers v0.40.0's argparse
(tests/assets/diffusers_flags/*_sdxl.json), and runs on a tiny SDXL-shaped pipeline whose outputs diffusers reads."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from lowmem.diffusion.config import FineTuneConfig
from lowmem.diffusion.errors import InputError
from lowmem.diffusion.scripts import DIFFUSERS_VERSION, Accept, Refuse
from lowmem.diffusion.sdxl_scripts import SDXL_SCRIPT_FLAGS, SDXLSettings, handling, sdxl_script_config
from lowmem.suite.cli import build_parser, main
from tests.diffusion.conftest import write_image

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "diffusers_flags"
SCRIPTS = tuple(SDXL_SCRIPT_FLAGS)


def _subparser(script: str) -> argparse.ArgumentParser:
    parser = build_parser(["diffusion", script])
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["diffusion"]
    return next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[script]


def _table_problems(script: str, table: dict) -> list[str]:
    """What differs between a script's pinned flags and `suite diffusion <script>`, and flags neither accepted
    nor refused with a reason."""
    actions = {a.option_strings[0]: a for a in _subparser(script)._actions if a.option_strings}
    sdxl_fields = {f.name for f in dataclasses.fields(SDXLSettings)}
    problems = []
    for row in table["flags"]:
        flag, name = row["flag"], row["flag"][2:]
        try:
            how = handling(script, name)
        except KeyError:
            how = None
        if not (isinstance(how, Accept) or (isinstance(how, Refuse) and how.reason.strip())):
            problems.append(f"{flag}: neither accepted nor refused with a reason")
        if isinstance(how, Accept) and how.to is None and name not in {*FineTuneConfig.field_names(), *sdxl_fields}:
            problems.append(f"{flag}: accepted as a field that does not exist")
        a = actions.get(flag)
        if a is None:
            problems.append(f"{flag}: not a flag of suite diffusion {script}")
            continue
        store_true = isinstance(a, argparse._StoreTrueAction)
        got = {"default": a.default, "required": a.required, "choices": list(a.choices) if a.choices else None,
               "nargs": None if store_true else a.nargs, "action": "store_true" if store_true else None,
               "type": None if store_true else getattr(a.type, "__name__", None)}
        want = {"default": row["default"], "required": row.get("required", False), "choices": row.get("choices"),
                "nargs": row.get("nargs"), "action": row.get("action"), "type": row.get("type")}
        problems += [f"{flag}: {k} {got[k]!r} here, {want[k]!r} in diffusers" for k in want
                     if got[k] != want[k] or type(got[k]) is not type(want[k])]
    return problems


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_is_offered_with_the_scripts_default(script):
    table = json.loads((ASSETS / f"{script}.json").read_text())
    assert table["diffusers_version"] == DIFFUSERS_VERSION
    assert [f.name for f in SDXL_SCRIPT_FLAGS[script]] == [r["flag"][2:] for r in table["flags"]]
    problems = _table_problems(script, table)
    assert not problems, "\n".join(problems)


def test_a_flag_neither_accepted_nor_refused_is_found():
    """The check above fails for a flag of the script that this project neither accepts nor refuses."""
    table = json.loads((ASSETS / "train_text_to_image_lora_sdxl.json").read_text())
    table["flags"].append({"flag": "--brand_new_flag", "default": None, "type": "str"})
    problems = _table_problems("train_text_to_image_lora_sdxl", table)
    assert problems == ["--brand_new_flag: neither accepted nor refused with a reason",
                        "--brand_new_flag: not a flag of suite diffusion train_text_to_image_lora_sdxl"]


def _required(script: str) -> dict:
    base = {"pretrained_model_name_or_path": "base"}
    if script == "train_dreambooth_lora_sdxl":
        return {**base, "instance_data_dir": "inst", "instance_prompt": "a sks dog"}
    return {**base, "train_data_dir": "data"}


SAMPLES = {"adam_beta1": 0.8, "adam_beta2": 0.99, "prediction_type": "v_prediction", "lr_scheduler": "cosine",
           "report_to": "csv",
           "image_interpolation_mode": "bicubic", "resolution": 64, "mixed_precision": "bf16",
           "prior_generation_precision": "bf16", "resume_from_checkpoint": "latest", "optimizer": "adamw",
           "timestep_bias_strategy": "later"}
NEEDS = {"with_prior_preservation": {"class_data_dir": "cls", "class_prompt": "a dog"},
         "dataset_name": {"train_data_dir": None, "instance_data_dir": None},
         "text_encoder_lr": {"train_text_encoder": True},
         "adam_weight_decay_text_encoder": {"train_text_encoder": True}}
# accepted, and by design without effect on the settings (said in their --help)
NO_EFFECT = {"enable_xformers_memory_efficient_attention", "optimizer", "prodigy_beta3", "prodigy_decouple",
             "prodigy_safeguard_warmup", "prodigy_use_bias_correction"}


def _sample(flag) -> object:
    if flag.name in SAMPLES:
        return SAMPLES[flag.name]
    if flag.action == "store_true":
        return True
    if flag.type is bool:
        return not flag.default
    if flag.type is int:
        return (flag.default or 0) + 3
    if flag.type is float:
        return (flag.default or 0) + 0.25
    return f"given-{flag.name}"


def _settings(cfg) -> dict:
    return {**dataclasses.asdict(cfg), "sdxl": dataclasses.asdict(cfg.extra["sdxl"])}


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_flag_is_silently_ignored(script):
    """An accepted flag given with another value changes the run's settings (or is one that says it needs
    not); a refused one stops with one line naming the flag, before anything loads."""
    defaults = {f.name: f.default for f in SDXL_SCRIPT_FLAGS[script]}
    problems = []
    for flag in SDXL_SCRIPT_FLAGS[script]:
        if flag.required:
            continue
        values = {**defaults, **_required(script), **NEEDS.get(flag.name, {}), flag.name: _sample(flag)}
        if isinstance(handling(script, flag.name), Refuse):
            with pytest.raises(InputError) as err:
                sdxl_script_config(script, values)
            assert f"--{flag.name}:" in str(err.value) and "\n" not in str(err.value)
            continue
        try:  # the settings without the flag, with what it needs beside it
            reference = _settings(sdxl_script_config(script, {**values, flag.name: flag.default}))
        except InputError:  # what it needs is not a run without it (--dataset_name in place of --train_data_dir)
            reference = _settings(sdxl_script_config(script, {**defaults, **_required(script)}))
        if _settings(sdxl_script_config(script, values)) == reference and flag.name not in NO_EFFECT:
            problems.append(f"--{flag.name}: accepted but changes nothing")
    assert not problems, "\n".join(problems)


def test_script_checks():
    defaults = {f.name: f.default for f in SDXL_SCRIPT_FLAGS["train_dreambooth_lora_sdxl"]}
    with pytest.raises(InputError, match="--optimizer prodigy: only AdamW"):
        sdxl_script_config("train_dreambooth_lora_sdxl",
                           {**defaults, **_required("train_dreambooth_lora_sdxl"), "optimizer": "prodigy"})
    with pytest.raises(InputError, match="needs --dataset_name or --instance_data_dir"):
        sdxl_script_config("train_dreambooth_lora_sdxl", {**defaults, "instance_prompt": "x"})
    t2i = {f.name: f.default for f in SDXL_SCRIPT_FLAGS["train_text_to_image_sdxl"]}
    with pytest.raises(InputError, match="needs --dataset_name or --train_data_dir"):
        sdxl_script_config("train_text_to_image_sdxl", {**t2i, "pretrained_model_name_or_path": "b"})
    with pytest.raises(InputError, match="proportion_empty_prompts must be in"):
        sdxl_script_config("train_text_to_image_sdxl", {**t2i, **_required("x"), "proportion_empty_prompts": 2.0})


def test_micro_conditioning_matches_the_crop(tmp_path):
    """The crop corner the data set reports is where `preprocess` cut: the pixels equal a crop taken there."""
    import numpy as np
    from PIL import Image

    from lowmem.diffusion.data import DataConfig, ImageRecord, load_rgb
    from lowmem.diffusion.sdxl import time_ids
    from lowmem.diffusion.tiny import build_tokenizer
    from lowmem.recipes.diffusion.sdxl import SDXLCaptionedImages

    path = write_image(tmp_path / "a.png", size=(50, 37), seed=3)
    tok = build_tokenizer(77)
    for center in (False, True):
        ds = SDXLCaptionedImages([ImageRecord(path, "a cat", "test")], (tok, tok),
                                 DataConfig(resolution=16, center_crop=center, max_length=77, interpolation="lanczos"))
        for seed in range(4):
            item = ds[(0, seed)]
            assert item["original_size"].tolist() == [37, 50]
            top, left = item["crop_top_left"].tolist()
            img = load_rgb(path)
            scale = 16 / min(img.size)
            img = img.resize((max(16, round(50 * scale)), max(16, round(37 * scale))), Image.Resampling.LANCZOS)
            want = np.asarray(img.crop((left, top, left + 16, top + 16)), dtype=np.float32) / 127.5 - 1.0
            assert torch.equal(item["pixel_values"], torch.from_numpy(want.copy()).permute(2, 0, 1))
            assert item["input_ids"].shape == item["input_ids_2"].shape == (77,)
    ids = time_ids(torch.tensor([[37, 50]]), torch.tensor([[1, 2]]), 16)
    assert ids.tolist() == [[37, 50, 1, 2, 16, 16]]


@pytest.mark.parametrize("script", SCRIPTS)
def test_prediction_type_sample_is_refused_with_the_reason(capsys, tmp_path, script):
    """Issue 45: `--prediction_type sample` (train_text_to_image_sdxl.py trains the UNet's output minus the noise
    against the clean latents, which no 'sample' scheduler inverts; the other scripts stop on it) is one line naming
    the flag and why, exit 2, before anything loads."""
    if not any(f.name == "prediction_type" for f in SDXL_SCRIPT_FLAGS[script]):
        pytest.skip(f"{script} has no --prediction_type")
    rc = main(["diffusion", script, "--pretrained_model_name_or_path", str(tmp_path / "absent"),
               "--train_data_dir", str(tmp_path), "--prediction_type", "sample", "--output_dir", str(tmp_path / "o")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("suite diffusion: error: --prediction_type 'sample': not supported") and \
        "minus the noise against the clean latents" in err[0], err


# -- runs on the tiny SDXL pipeline -----------------------------------------------------------------------------
def _run(capsys, argv: list[str]) -> None:
    rc = main(["diffusion", *argv, "--resolution", "32", "--report_to", "csv"])
    err = capsys.readouterr().err
    assert rc == 0, "\n".join(err.splitlines()[-15:])


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def test_lora_with_text_encoders_resumes_exactly_and_loads(capsys, tmp_path, sdxl_folder, images):
    """train_text_to_image_lora_sdxl --train_text_encoder: 3 steps in one go, and 2 + resume from checkpoint-2;
    the same LoRA file; diffusers loads it onto the UNet and both text encoders, and the images change."""
    from diffusers import StableDiffusionXLPipeline

    args = ["train_text_to_image_lora_sdxl", "--pretrained_model_name_or_path", str(sdxl_folder),
            "--train_data_dir", str(images), "--train_batch_size", "2", "--train_text_encoder",
            "--checkpointing_steps", "2", "--learning_rate", "1e-2", "--lr_warmup_steps", "0", "--seed", "1"]
    whole = tmp_path / "whole"
    _run(capsys, [*args, "--max_train_steps", "3", "--output_dir", str(whole), "--validation_prompt", "a cat",
                  "--num_validation_images", "1"])
    assert (whole / "validation" / "final.png").is_file()
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    _run(capsys, [*args, "--max_train_steps", "3", "--output_dir", str(resumed), "--resume_from_checkpoint",
                  "latest"])
    a, b = _tensors(whole / "pytorch_lora_weights.safetensors"), _tensors(resumed / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and {k.split(".")[0] for k in a} == {"unet", "text_encoder", "text_encoder_2"}
    assert all(torch.equal(a[k], b[k]) for k in a)

    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_folder)
    gen = dict(prompt="a cat", num_inference_steps=2, height=32, width=32, output_type="np")
    before = pipe(**gen, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(whole)
    assert set(pipe.get_list_adapters()) == {"unet", "text_encoder", "text_encoder_2"}
    after = pipe(**gen, generator=torch.Generator().manual_seed(0)).images
    assert not torch.allclose(torch.from_numpy(before), torch.from_numpy(after))


def test_full_finetune_streamed_into_gemini_with_a_separate_vae(capsys, tmp_path, sdxl_folder, images):
    """train_text_to_image_sdxl under Gemini (the UNet streamed into its shards), with
    --pretrained_vae_model_name_or_path: the exported pipeline loads in diffusers, holds the trained UNet and the
    given VAE, and the other components are the base's."""
    from diffusers import StableDiffusionXLPipeline

    vae = tmp_path / "my-vae"
    shutil.copytree(sdxl_folder / "vae", vae)
    out = tmp_path / "full"
    _run(capsys, ["train_text_to_image_sdxl", "--pretrained_model_name_or_path", str(sdxl_folder),
                  "--train_data_dir", str(images), "--train_batch_size", "2", "--max_train_steps", "2",
                  "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--strategy", "gemini",
                  "--pretrained_vae_model_name_or_path", str(vae), "--proportion_empty_prompts", "0.5",
                  "--mixed_precision", "bf16", "--output_dir", str(out)])
    pipe = StableDiffusionXLPipeline.from_pretrained(out)
    base = StableDiffusionXLPipeline.from_pretrained(sdxl_folder)
    trained = dict(pipe.unet.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in base.unet.named_parameters())
    assert all(torch.isfinite(p).all() for p in trained.values())
    assert _tensors(out / "vae" / "diffusion_pytorch_model.safetensors").keys() == \
        _tensors(vae / "diffusion_pytorch_model.safetensors").keys()
    for name in ("text_encoder", "text_encoder_2"):
        assert (out / name / "model.safetensors").read_bytes() == \
            (sdxl_folder / name / "model.safetensors").read_bytes()
    pipe(prompt="a cat", num_inference_steps=2, height=32, width=32, output_type="np")


def test_dreambooth_lora_with_prior_preservation(capsys, tmp_path, sdxl_folder):
    """train_dreambooth_lora_sdxl --with_prior_preservation: the missing class images are generated, one step
    trains on instance and class images, and diffusers loads the LoRA file."""
    from diffusers import StableDiffusionXLPipeline

    inst = tmp_path / "dog"
    for i in range(2):
        write_image(inst / f"{i}.png", size=(36, 36), seed=10 + i)
    out, classes = tmp_path / "db", tmp_path / "class"
    _run(capsys, ["train_dreambooth_lora_sdxl", "--pretrained_model_name_or_path", str(sdxl_folder),
                  "--instance_data_dir", str(inst), "--instance_prompt", "a sks dog", "--with_prior_preservation",
                  "--class_data_dir", str(classes), "--class_prompt", "a dog", "--num_class_images", "2",
                  "--sample_batch_size", "2", "--train_batch_size", "1", "--max_train_steps", "1",
                  "--lr_warmup_steps", "0", "--output_dir", str(out)])
    assert len(list(classes.glob("*.png"))) == 2
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_folder)
    pipe.load_lora_weights(out)
    assert set(pipe.get_list_adapters()) == {"unet"}
