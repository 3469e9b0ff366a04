"""`suite bench diffusion-sdxl` (issue 33) without running it: the released UNet config's size, the rows'
commands, and the plain full fine-tune's not-started row."""

from __future__ import annotations

import argparse

import torch

from lowmem.suite.bench import diffusion_sdxl as bench


def _opts(**kw) -> dict:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    opts = vars(parser.parse_args([]))
    opts.update(kw)
    opts["rows"] = opts["rows"].split(",") if isinstance(opts["rows"], str) else opts["rows"]
    return opts


def test_released_unet_config_has_sdxl_size():
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        n = sum(p.numel() for p in UNet2DConditionModel(**bench.SDXL_UNET).parameters())
    assert 2_560e6 < n < 2_570e6  # SDXL base 1.0's UNet: 2.567B parameters


def test_rows_run_the_sdxl_commands_with_the_same_settings():
    sides = bench._sides(_opts(lora_strategy="gemini_nvme", work="/w"), "/base", "/data")
    assert [(s["row"], s["side"]) for s in sides] == [("lora", "plain"), ("lora", "ours"), ("full", "ours")]
    plain, lora, full = (s["argv"] for s in sides)
    assert plain[3:5] == ["plain_lora", "/base"] and plain[plain.index("--rank") + 1] == "4"
    assert "train_dreambooth_lora_sdxl" in lora and lora[lora.index("--strategy") + 1] == "gemini_nvme"
    assert lora[lora.index("--offload_dir") + 1] == "/w/nvme-lora"
    assert "train_text_to_image_sdxl" in full and full[full.index("--strategy") + 1] == "gemini_nvme"
    for argv in (lora, full):
        assert argv[argv.index("--resolution") + 1] == "256" and argv[argv.index("--max_train_steps") + 1] == "2"
        assert argv[argv.index("--mixed_precision") + 1] == "bf16" and "--gradient_checkpointing" in argv


def test_plain_full_row_says_why_it_is_not_started():
    row = bench._plain_full_note()
    assert row["params_M"] == 2567 and row["peak_mib"] is None
    assert row["note"].startswith("not started") and "38.3 GiB" in row["note"]
