"""accelerate's checkpoint-N of diffusers' SDXL LoRA scripts with `--train_text_encoder` resumes (issue 45): the
scripts' save hook writes `pytorch_lora_weights.safetensors` with `unet.`, `text_encoder.` and `text_encoder_2.`
layers (`StableDiffusionXLPipeline.save_lora_weights` of `convert_state_dict_to_diffusers`), the text encoders'
as `...q_proj.lora_linear_layer.down.weight`. Written from our own run's state at step 2, resumed to 3: bitwise
the uninterrupted 3-step run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from lowmem.suite.cli import main
from tests.diffusion.conftest import as_accelerate


def _run(capsys, argv: list[str]) -> None:
    rc = main(["diffusion", *argv, "--resolution", "32", "--report_to", "csv"])
    err = capsys.readouterr().err
    assert rc == 0, "\n".join(err.splitlines()[-15:])


_DATA = {"train_text_to_image_lora_sdxl": lambda images: ["--train_data_dir", str(images)],
         "train_dreambooth_lora_sdxl": lambda images: ["--instance_data_dir", str(images), "--instance_prompt",
                                                       "a photo of sks dog", "--text_encoder_lr", "1e-2",
                                                       "--lora_dropout", "0.3"]}


@pytest.mark.parametrize("script", sorted(_DATA))
def test_scripts_checkpoint_with_both_text_encoders_lora_resumes_bitwise(capsys, tmp_path: Path, sdxl_folder,
                                                                         images, script):
    from safetensors.torch import load_file

    args = [script, "--pretrained_model_name_or_path", str(sdxl_folder), *_DATA[script](images),
            "--train_batch_size", "2", "--train_text_encoder", "--checkpointing_steps", "2", "--learning_rate",
            "1e-2", "--lr_warmup_steps", "0", "--seed", "1", "--max_train_steps", "3"]
    whole = tmp_path / "whole"
    _run(capsys, [*args, "--output_dir", str(whole)])
    acc = tmp_path / "acc"
    as_accelerate(whole / "checkpoint-2", acc / "checkpoint-2")
    lora = acc / "checkpoint-2" / "pytorch_lora_weights.safetensors"
    if script == "train_text_to_image_lora_sdxl":
        # the layout the scripts write on transformers 5, whose CLIPTextModel lost `text_model`: the first encoder's
        # layers without the prefix (the dreambooth case keeps ours and transformers 4's, with it)
        from safetensors.torch import save_file

        save_file({k.replace("text_encoder.text_model.", "text_encoder.", 1): v for k, v in load_file(lora).items()},
                  lora)
        assert any(k.startswith("text_encoder.encoder.layers.") for k in load_file(lora))
    layers = load_file(lora)
    assert {k.split(".")[0] for k in layers} == {"unet", "text_encoder", "text_encoder_2"}
    assert any(k.startswith("text_encoder_2.") and ".lora_linear_layer.down." in k for k in layers), sorted(layers)
    groups = torch.load(acc / "checkpoint-2" / "optimizer.bin", weights_only=True)["param_groups"]
    if script == "train_dreambooth_lora_sdxl":  # the script's groups: the UNet's, text_encoder's, text_encoder_2's
        sizes = [sum(1 for k in layers if k.split(".")[0] == part) for part in ("unet", "text_encoder",
                                                                                 "text_encoder_2")]
        assert [len(g["params"]) for g in groups] == sizes and [g["lr"] for g in groups] == [1e-2] * 3
    else:  # one group of all the LoRA parameters
        assert [len(g["params"]) for g in groups] == [len(layers)]
    _run(capsys, [*args, "--output_dir", str(acc), "--resume_from_checkpoint", "latest"])
    a, b = load_file(whole / "pytorch_lora_weights.safetensors"), load_file(acc / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # a checkpoint of another rank is refused in one line, naming the layer
    broken = tmp_path / "broken"
    shutil.copytree(acc / "checkpoint-2", broken / "checkpoint-2")
    main(["diffusion", *args, "--output_dir", str(broken), "--resume_from_checkpoint",
          "latest", "--rank", "8", "--resolution", "32", "--report_to", "csv"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("suite diffusion: error:")]
    assert len(err) == 1 and "has shape" in err[0], err
