"""What a base folder brings, checked before any weights load (issue 45): every scheduler class diffusers ships
trains as diffusers' scripts train it (`DDPMScheduler.from_pretrained` of its config, the folder's own noise
schedule) or is refused in one line; a VAE with latent statistics is refused; `suite diffusion finetune` and the
SDXL commands recognise the model family of the folder (SD 1.x/2.x, SDXL, SD3, Flux) and name the command to use.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from lowmem.diffusion.config import FineTuneConfig
from lowmem.diffusion.errors import InputError
from lowmem.recipes.diffusion.launch import check_run
from lowmem.suite.cli import main


def _scheduler_classes() -> list[str]:
    import diffusers

    return sorted(n for n in dir(diffusers) if n.endswith("Scheduler") and isinstance(getattr(diffusers, n), type))


def _scheduler_config(name: str) -> dict | None:
    """The default config of scheduler class `name` as a pipeline folder holds it; None when the class needs
    arguments without defaults (not writable into a folder as is)."""
    import diffusers

    cls = getattr(diffusers, name)
    try:
        return json.loads(cls().to_json_string())
    except ImportError:  # an optional package missing (LMS: scipy): the folder names the class, its defaults apply
        return {"_class_name": name}
    except TypeError:
        return None


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory) -> Path:
    from lowmem.diffusion.tiny import save_tiny_sd_pipeline

    return save_tiny_sd_pipeline(tmp_path_factory.mktemp("sd") / "base")


def _copy(base: Path, to: Path) -> Path:
    """A copy of the pipeline folder `base` whose weight files are links (the test edits only configs)."""
    shutil.copytree(base, to, copy_function=lambda s, d: Path(d).symlink_to(s) if s.endswith(".safetensors")
                    else shutil.copy2(s, d))
    return to


def _with_scheduler(base: Path, to: Path, config: dict) -> Path:
    folder = _copy(base, to)
    _with_scheduler_in_place(folder, config)
    return folder


def _with_scheduler_in_place(folder: Path, config: dict) -> None:
    """The folder's scheduler made `config` (its class in model_index.json too, as diffusers writes it)."""
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    index = json.loads((folder / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", config["_class_name"]]
    (folder / "model_index.json").write_text(json.dumps(index))


def _one_line(exc: pytest.ExceptionInfo, *words: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


@pytest.mark.parametrize("name", _scheduler_classes())
def test_every_scheduler_class_trains_as_the_scripts_or_is_refused(tmp_path, sd_folder, name, caplog):
    import diffusers
    from diffusers import DDPMScheduler

    from lowmem.diffusion.models import load_components

    config = _scheduler_config(name)
    if config is None:
        pytest.skip(f"{name} has required arguments: no default config to write into a folder")
    folder = _with_scheduler(sd_folder, tmp_path / "base", config)
    cfg = FineTuneConfig(pretrained_model_name_or_path=str(folder), train_data_dir=str(tmp_path))
    try:
        check_run(cfg)
    except InputError as exc:
        msg = str(exc)
        assert "\n" not in msg and name in msg and ("scheduler_config.json" in msg or "model_index.json" in msg), msg
        if "EDM" in name:  # issue 45: EDM-style training is train_dreambooth_lora_sdxl's only
            assert "EDM-style training: only suite diffusion train_dreambooth_lora_sdxl" in msg, msg
        return
    # accepted: trained with the scripts' scheduler (DDPMScheduler.from_pretrained of the folder's config), whose
    # noise schedule is the folder's own class's
    with caplog.at_level(logging.ERROR):
        trained = load_components(str(folder))["scheduler"]
    script = DDPMScheduler.from_pretrained(folder, subfolder="scheduler")
    assert type(trained) is DDPMScheduler
    assert trained.config.prediction_type == script.config.prediction_type in ("epsilon", "v_prediction")
    assert trained.config.num_train_timesteps == script.config.num_train_timesteps
    torch.testing.assert_close(trained.betas, script.betas, rtol=0, atol=0)
    try:
        own = getattr(diffusers, name).from_pretrained(folder, subfolder="scheduler").alphas_cumprod
    except ImportError:
        return
    torch.testing.assert_close(own.double(), trained.alphas_cumprod.double(), rtol=1e-6, atol=0)


def test_the_walk_accepts_the_ddpm_family_and_refuses_the_rest(tmp_path, sd_folder):
    """The walk above is not vacuous: SD's own schedulers train, flow matching, EDM and VE schedulers are refused."""
    accepted, refused = set(), set()
    for name in ("DDIMScheduler", "PNDMScheduler", "EulerDiscreteScheduler", "DPMSolverMultistepScheduler",
                 "UniPCMultistepScheduler", "LCMScheduler", "EDMEulerScheduler",
                 "EDMDPMSolverMultistepScheduler", "FlowMatchEulerDiscreteScheduler", "ScoreSdeVeScheduler",
                 "CogVideoXDDIMScheduler"):
        folder = _with_scheduler(sd_folder, tmp_path / name, _scheduler_config(name))
        try:
            check_run(FineTuneConfig(pretrained_model_name_or_path=str(folder)))
            accepted.add(name)
        except InputError:
            refused.add(name)
    assert refused == {"EDMEulerScheduler", "EDMDPMSolverMultistepScheduler", "FlowMatchEulerDiscreteScheduler",
                       "ScoreSdeVeScheduler", "CogVideoXDDIMScheduler"}, (accepted, refused)


def test_prediction_type_the_loss_has_no_target_for_is_refused(tmp_path, sd_folder):
    folder = _copy(sd_folder, tmp_path / "base")
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "prediction_type": "sample"}))
    with pytest.raises(InputError) as exc:
        check_run(FineTuneConfig(pretrained_model_name_or_path=str(folder)))
    _one_line(exc, str(path), "'sample'")
    check_run(FineTuneConfig(pretrained_model_name_or_path=str(folder), prediction_type="v_prediction"))


def _playground_like(sdxl_folder: Path, to: Path, *, edm: bool = True, stats: bool = True) -> Path:
    """The tiny SDXL pipeline shaped like Playground v2.5's: an EDM scheduler and a VAE with latent statistics;
    its weight files removed (a refusal must come before anything loads)."""
    folder = _copy(sdxl_folder, to)
    for f in folder.rglob("*.safetensors"):
        f.unlink()
    if edm:
        from diffusers import EDMDPMSolverMultistepScheduler

        _with_scheduler_in_place(folder, json.loads(EDMDPMSolverMultistepScheduler(
            sigma_data=0.5, sigma_min=0.002, sigma_max=80.0).to_json_string()))
    if stats:
        vae = folder / "vae" / "config.json"
        vae.write_text(json.dumps({**json.loads(vae.read_text()), "latents_mean": [0.0] * 4,
                                   "latents_std": [0.5] * 4, "scaling_factor": 0.5}))
    return folder


def _cli_error(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    errors = [line for line in err.splitlines() if line.startswith("suite diffusion: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize("script", ["train_text_to_image_lora_sdxl", "train_text_to_image_sdxl"])
def test_playground_folder_is_refused_before_loading(capsys, tmp_path, sdxl_folder, images, script):
    """The text_to_image SDXL scripts would train a Playground folder as DDPM with default betas: refused, naming
    the command that trains it EDM-style (train_dreambooth_lora_sdxl: tests/diffusion/test_edm.py and
    test_sdxl_ported.py)."""
    folder = _playground_like(sdxl_folder, tmp_path / "playground")
    err = _cli_error(capsys, ["diffusion", script, "--pretrained_model_name_or_path", str(folder), "--resolution",
                              "32", "--max_train_steps", "1", "--output_dir", str(tmp_path / "out"),
                              "--train_data_dir", str(images)])
    assert "scheduler_config.json" in err and "EDMDPMSolverMultistepScheduler" in err, err
    assert "EDM-style training: only suite diffusion train_dreambooth_lora_sdxl" in err, err


def test_vae_latent_statistics_are_refused(capsys, tmp_path, sdxl_folder, images):
    folder = _playground_like(sdxl_folder, tmp_path / "stats", edm=False)
    err = _cli_error(capsys, ["diffusion", "train_text_to_image_lora_sdxl", "--pretrained_model_name_or_path",
                              str(folder), "--train_data_dir", str(images),
                              "--resolution", "32", "--max_train_steps", "1", "--output_dir", str(tmp_path / "o")])
    assert str(folder / "vae" / "config.json") in err and "latents_mean/latents_std" in err, err
    assert "only suite diffusion train_dreambooth_lora_sdxl" in err, err


# -- the model family -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("flags", "command"), [
    ([], "train_text_to_image_sdxl"),
    (["--rank", "4"], "train_text_to_image_lora_sdxl"),
    (["--rank", "4", "--instance_prompt", "sks"], "train_dreambooth_lora_sdxl"),
])
def test_finetune_on_an_sdxl_folder_names_the_sdxl_command(capsys, tmp_path, sdxl_folder, images, flags, command):
    data = ["--instance_data_dir", str(images)] if "--instance_prompt" in flags else ["--train_data_dir", str(images)]
    err = _cli_error(capsys, ["diffusion", "finetune", "--pretrained_model_name_or_path", str(sdxl_folder),
                              "--max_train_steps", "1", "--output_dir", str(tmp_path / "out"), *data, *flags])
    assert str(sdxl_folder) in err and "SDXL" in err and f"suite diffusion {command}" in err, err
    assert not (tmp_path / "out" / "logs").exists()


@pytest.mark.parametrize(("index", "transformer", "family"), [
    ({"_class_name": "StableDiffusion3Pipeline"}, "SD3Transformer2DModel", "Stable Diffusion 3"),
    ({"_class_name": "FluxPipeline"}, "FluxTransformer2DModel", "Flux"),
    ({}, "SD3Transformer2DModel", "Stable Diffusion 3"),  # no _class_name: the transformer's config tells
    ({}, "FluxTransformer2DModel", "Flux"),
])
@pytest.mark.parametrize("command", ["finetune", "train_text_to_image_sdxl"])
def test_sd3_and_flux_folders_name_their_commands(capsys, tmp_path, image_folder, index, transformer, family,
                                                 command):
    folder = tmp_path / "model"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({**index, "transformer": ["diffusers", transformer]}))
    (folder / "transformer" / "config.json").write_text(json.dumps({"_class_name": transformer}))
    err = _cli_error(capsys, ["diffusion", command, "--pretrained_model_name_or_path", str(folder),
                              "--train_data_dir", str(image_folder), "--output_dir", str(tmp_path / "out")])
    script = "train_dreambooth_sd3" if transformer.startswith("SD3") else "train_dreambooth_flux"
    assert str(folder) in err and family in err and f"use suite diffusion {script}" in err, err


def test_sdxl_command_on_an_sd_folder_names_the_sd_commands(capsys, tmp_path, sd_folder, image_folder):
    err = _cli_error(capsys, ["diffusion", "train_text_to_image_lora_sdxl", "--pretrained_model_name_or_path",
                              str(sd_folder), "--train_data_dir", str(image_folder), "--output_dir",
                              str(tmp_path / "out")])
    assert "Stable Diffusion 1.x/2.x" in err and "train_text_to_image_lora" in err, err


def test_an_inpainting_unet_is_refused(tmp_path, sd_folder):
    folder = _copy(sd_folder, tmp_path / "inpaint")
    path = folder / "unet" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "in_channels": 9}))
    with pytest.raises(InputError) as exc:
        check_run(FineTuneConfig(pretrained_model_name_or_path=str(folder)))
    _one_line(exc, str(path), "in_channels 9", "latent_channels is 4")
