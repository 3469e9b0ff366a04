"""`suite diffusion train_text_to_image | train_text_to_image_lora | train_dreambooth`: diffusers' command lines
run unchanged (issue 19). The flag tables of diffusers v0.40.0's scripts are in tests/assets/diffusers_flags/."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from lowmem.diffusion.config import FineTuneConfig
from lowmem.diffusion.errors import InputError
from lowmem.diffusion.scripts import DIFFUSERS_VERSION, HANDLING, SCRIPT_FLAGS, Accept, Refuse, script_config
from lowmem.suite.cli import build_parser, main
from tests.diffusion.conftest import write_image

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "diffusers_flags"
SCRIPTS = ("train_text_to_image", "train_text_to_image_lora", "train_dreambooth")


def _table(script: str) -> dict:
    return json.loads((ASSETS / f"{script}.json").read_text())


def _subparser(script: str) -> argparse.ArgumentParser:
    parser = build_parser(["diffusion", script])
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["diffusion"]
    return next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[script]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_is_offered_with_the_scripts_default(script):
    table = _table(script)
    assert table["diffusers_version"] == DIFFUSERS_VERSION
    actions = {a.option_strings[0]: a for a in _subparser(script)._actions if a.option_strings}
    problems = []
    for row in table["flags"]:
        flag, name = row["flag"], row["flag"][2:]
        how = HANDLING.get(name)
        if not (isinstance(how, Accept) or (isinstance(how, Refuse) and how.reason.strip())):
            problems.append(f"{flag}: neither accepted nor refused with a reason")
        if isinstance(how, Accept) and how.to is None and name not in FineTuneConfig.field_names():
            problems.append(f"{flag}: accepted as a FineTuneConfig field that does not exist")
        a = actions.get(flag)
        if a is None:
            problems.append(f"{flag}: not a flag of suite diffusion {script}")
            continue
        got = {"default": a.default, "required": a.required,
               "choices": list(a.choices) if a.choices is not None else None,
               "nargs": a.nargs if not isinstance(a, argparse._StoreTrueAction) else None,
               "action": "store_true" if isinstance(a, argparse._StoreTrueAction) else None,
               "type": getattr(a.type, "__name__", None) if not isinstance(a, argparse._StoreTrueAction) else None}
        want = {"default": row["default"], "required": row.get("required", False), "choices": row.get("choices"),
                "nargs": row.get("nargs"), "action": row.get("action"), "type": row.get("type")}
        for key in want:
            if got[key] != want[key] or type(got[key]) is not type(want[key]):
                problems.append(f"{flag}: {key} {got[key]!r} here, {want[key]!r} in diffusers")
    # the package's table is the same as the asset (the parser is generated from the package's)
    assert [f.name for f in SCRIPT_FLAGS[script]] == [r["flag"][2:] for r in table["flags"]]
    assert not problems, "\n".join(problems)


# A value other than the script's default for each accepted flag (a sample of its type otherwise).
SAMPLES = {"adam_beta1": 0.8, "adam_beta2": 0.99,
           "prediction_type": "v_prediction", "lr_scheduler": "cosine", "report_to": "csv",
           "image_interpolation_mode": "bicubic", "resolution": 64, "logging_dir": "other-logs",
           "tracker_project_name": "other", "validation_scheduler": "DDPMScheduler", "mixed_precision": "bf16",
           "prior_generation_precision": "bf16", "resume_from_checkpoint": "latest"}
NEEDS = {"with_prior_preservation": {"class_data_dir": "cls", "class_prompt": "a dog"},
         "dataset_name": {"train_data_dir": None}}


def _required(script: str) -> dict:
    base = {"pretrained_model_name_or_path": "base"}
    if script == "train_dreambooth":
        return {**base, "instance_data_dir": "inst", "instance_prompt": "a sks dog"}
    return {**base, "train_data_dir": "data"}


def _sample(flag) -> object:
    if flag.name in SAMPLES:
        return SAMPLES[flag.name]
    if flag.action == "store_true":
        return True
    if flag.choices:
        return next(c for c in flag.choices if c != flag.default)
    if flag.nargs == "+":
        return ["a", "b"]
    if flag.type is int:
        return (flag.default or 0) + 3
    if flag.type is float:
        return (flag.default or 0) + 0.25
    return f"given-{flag.name}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_flag_is_silently_ignored(script):
    """An accepted flag given with another value changes the run's settings (or says why it needs not);
    a refused one stops with one line naming the flag and the reason."""
    defaults = {f.name: f.default for f in SCRIPT_FLAGS[script]}
    base = dataclasses.asdict(script_config(script, {**defaults, **_required(script)}))
    for flag in SCRIPT_FLAGS[script]:
        if flag.required:
            continue
        values = {**defaults, **_required(script), **NEEDS.get(flag.name, {}), flag.name: _sample(flag)}
        how = HANDLING[flag.name]
        if isinstance(how, Refuse):
            with pytest.raises(InputError) as err:
                script_config(script, values)
            line = str(err.value)
            assert line.startswith(f"--{flag.name}: ") and how.reason in line and "\n" not in line
            continue
        got = dataclasses.asdict(script_config(script, values))
        if how.to is not None and how.to(values[flag.name]) == {}:
            assert how.note, f"--{flag.name} changes nothing and says nothing"
            continue
        assert got != base, f"--{flag.name} {values[flag.name]!r} changed nothing"


def test_script_settings():
    t2i = {f.name: f.default for f in SCRIPT_FLAGS["train_text_to_image"]}
    cfg = script_config("train_text_to_image", {**t2i, **_required("train_text_to_image")})
    assert (cfg.resolution, cfg.num_train_epochs, cfg.lr_warmup_steps, cfg.train_batch_size) == (512, 100, 500, 16)
    assert (cfg.rank, cfg.seed, cfg.mixed_precision, cfg.num_validation_images) == (None, 0, "no", 1)
    lora = {f.name: f.default for f in SCRIPT_FLAGS["train_text_to_image_lora"]}
    cfg = script_config("train_text_to_image_lora", {**lora, **_required("train_text_to_image_lora")})
    assert cfg.lora and cfg.rank == 4 and cfg.output_dir == "sd-model-finetuned-lora"
    db = {f.name: f.default for f in SCRIPT_FLAGS["train_dreambooth"]}
    cfg = script_config("train_dreambooth", {**db, **_required("train_dreambooth"), "offset_noise": True})
    assert cfg.noise_offset == 0.1 and cfg.learning_rate == 5e-6 and cfg.validation_epochs is None
    with pytest.raises(InputError, match="--dataset_name or --train_data_dir"):
        script_config("train_text_to_image", {**t2i, "pretrained_model_name_or_path": "base"})


# -- the README command lines ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory):
    from lowmem.diffusion.tiny import save_tiny_sd_pipeline

    return save_tiny_sd_pipeline(tmp_path_factory.mktemp("sd") / "base")


@pytest.fixture
def dog_folder(tmp_path) -> Path:
    for i in range(2):
        write_image(tmp_path / "dog" / f"dog{i}.jpg", seed=10 + i)
    return tmp_path / "dog"


def _main(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's errors exit
        return exc.code


def _cli(capsys, line: str) -> tuple[int, str]:
    """Run a diffusers README command line with `accelerate launch train_x.py` replaced by `suite diffusion
    train_x` (its `--flag=value` and `--flag="value"` forms as a shell splits them)."""
    import shlex

    rc = _main(shlex.split(line))
    err = capsys.readouterr().err
    return rc, "\n".join(x for x in err.splitlines() if x.startswith("suite diffusion: error:"))


def _scheduler(folder: Path) -> str:
    return json.loads((folder / "scheduler" / "scheduler_config.json").read_text())["_class_name"]


def test_readme_text_to_image(capsys, tmp_path, sd_folder, image_folder):
    out = tmp_path / "sd-naruto-model"
    rc, err = _cli(capsys, f"""diffusion train_text_to_image \\
      --pretrained_model_name_or_path={sd_folder} \\
      --train_data_dir={image_folder} \\
      --use_ema \\
      --resolution=32 --center_crop --random_flip \\
      --train_batch_size=1 \\
      --gradient_accumulation_steps=4 \\
      --gradient_checkpointing \\
      --max_train_steps=1 \\
      --learning_rate=1e-05 \\
      --max_grad_norm=1 \\
      --lr_scheduler="constant" --lr_warmup_steps=0 \\
      --output_dir="{out}" """.replace("\\\n", " "))
    assert rc == 0, err
    # what the script writes: the pipeline (the EMA UNet) with the base's untrained components
    assert (out / "model_index.json").is_file() and (out / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert _scheduler(out) == _scheduler(sd_folder) == "PNDMScheduler"
    assert (out / "safety_checker").is_dir() and (out / "feature_extractor").is_dir()


def test_readme_lora(capsys, tmp_path, sd_folder, image_folder):
    from safetensors.torch import load_file

    out = tmp_path / "sd-naruto-model-lora"
    rc, err = _cli(capsys, f"""diffusion train_text_to_image_lora \\
      --pretrained_model_name_or_path={sd_folder} \\
      --train_data_dir={image_folder} --caption_column="text" \\
      --resolution=32 --random_flip \\
      --train_batch_size=1 \\
      --num_train_epochs=100 --max_train_steps=2 --checkpointing_steps=5000 \\
      --learning_rate=1e-04 --lr_scheduler="constant" --lr_warmup_steps=0 \\
      --seed=42 \\
      --output_dir="{out}" \\
      --validation_prompt="cute dragon creature" --num_validation_images=1 --report_to=tensorboard"""
                   .replace("\\\n", " "))
    assert rc == 0, err
    weights = load_file(out / "pytorch_lora_weights.safetensors")
    downs = [v for k, v in weights.items() if k.endswith("lora.down.weight")]
    assert downs and all(v.shape[0] == 4 for v in downs)  # the script's default rank, not a full fine-tune
    assert not (out / "model_index.json").exists() and not (out / "unet").exists()
    assert (out / "validation" / "final.png").is_file()


def test_readme_dreambooth(capsys, tmp_path, sd_folder, dog_folder):
    out, cls = tmp_path / "path-to-save-model", tmp_path / "path-to-class-images"
    line = f"""diffusion train_dreambooth \\
      --pretrained_model_name_or_path={sd_folder}  \\
      --instance_data_dir={dog_folder} \\
      --class_data_dir={cls} \\
      --output_dir={out} \\
      --with_prior_preservation --prior_loss_weight=1.0 \\
      --instance_prompt="a photo of sks dog" \\
      --class_prompt="a photo of dog" \\
      --resolution=32 \\
      --train_batch_size=1 \\
      --gradient_accumulation_steps=1 \\
      --learning_rate=5e-6 \\
      --lr_scheduler="constant" \\
      --lr_warmup_steps=0 \\
      --num_class_images=2 \\
      --max_train_steps=1 \\
      --push_to_hub""".replace("\\\n", " ")
    # the README's line uploads to the Hub: one line saying why not, before anything is loaded or written
    rc, err = _cli(capsys, line)
    assert rc == 2 and len(err.splitlines()) == 1 and "--push_to_hub" in err and "no network" in err
    assert not out.exists() and not cls.exists()
    rc, err = _cli(capsys, line.replace("--push_to_hub", ""))
    assert rc == 0, err
    assert len(list(cls.glob("*.png"))) == 2  # the missing class images were generated
    assert (out / "model_index.json").is_file() and _scheduler(out) == "PNDMScheduler"


def test_refused_and_unavailable_flags_are_one_line(capsys, tmp_path, sd_folder, image_folder):
    import importlib.util

    base = (f"diffusion train_text_to_image_lora --pretrained_model_name_or_path={sd_folder} "
            f"--train_data_dir={image_folder} --output_dir={tmp_path / 'out'} --max_train_steps=1")
    cases = [("--hub_token=abc --local_rank=0", "--hub_token: nothing is uploaded"),
             ("--mixed_precision=fp8", "invalid choice"),
             ("--report_to=comet_ml", "report_to")]
    if importlib.util.find_spec("wandb") is None:
        cases.append(("--report_to=wandb", "wandb is not installed"))
    if importlib.util.find_spec("bitsandbytes") is None:
        cases.append(("--use_8bit_adam", "--use_8bit_adam"))
    for extra, expected in cases:
        rc = _main([*base.split(), *extra.split()])
        err = capsys.readouterr().err.strip().splitlines()
        errors = [x for x in err if ": error:" in x]
        assert rc == 2 and len(errors) == 1 and expected in errors[0], (extra, err)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.safetensors"))
