"""train_dreambooth_lora_sdxl's `--lora_dropout` (issue 46): diffusers v0.40.0 passes it to peft's `LoraConfig` of
the UNet's adapters and, with --train_text_encoder, of both text encoders' (train_dreambooth_lora_sdxl.py:664,
1206-1244); train_text_to_image_lora_sdxl.py has no such flag. A dropout run's exact resume (its masks drawn from
the seed and the step) is checked by tests/diffusion/test_sdxl_script_resume.py's DreamBooth case.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lowmem.suite.cli import build_parser, main


def _argv(sdxl_folder: Path, images: Path, out: Path, *extra: str) -> list[str]:
    return ["diffusion", "train_dreambooth_lora_sdxl", "--pretrained_model_name_or_path", str(sdxl_folder),
            "--instance_data_dir", str(images), "--instance_prompt", "a photo of sks dog", "--resolution", "32",
            "--train_batch_size", "2", "--learning_rate", "1e-2", "--lr_warmup_steps", "0", "--seed", "1",
            "--report_to", "csv", "--output_dir", str(out), *extra]


def test_lora_layers_carry_the_dropout(sdxl_folder, images, tmp_path):
    from peft.tuners.lora import LoraLayer

    from lowmem.recipes.diffusion.sdxl import StableDiffusionXLFineTune
    from lowmem.suite.commands.diffusion_sdxl import build_sdxl_config

    argv = _argv(sdxl_folder, images, tmp_path, "--lora_dropout", "0.2", "--train_text_encoder")
    cfg = build_sdxl_config(build_parser(argv).parse_args(argv))
    assert cfg.extra["sdxl"].lora_dropout == 0.2
    module = StableDiffusionXLFineTune(cfg)
    for name in ("unet", "text_encoder", "text_encoder_2"):
        layers = [m for m in getattr(module, name).modules() if isinstance(m, LoraLayer)]
        assert layers and all(type(m.lora_dropout["default"]) is torch.nn.Dropout
                              and m.lora_dropout["default"].p == 0.2 for m in layers), name
    bad = _argv(sdxl_folder, images, tmp_path, "--lora_dropout", "1.0")
    assert main(bad) == 2
