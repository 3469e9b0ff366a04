"""`suite bench diffusion-sdxl` (issue 33) without running it at size: the released UNet config's size, the rows'
commands, the plain full fine-tune (under the machine cap, or its not-started row), the plain loops on a tiny
SDXL pipeline, and the full row's checks of losses and the exported pipeline."""

from __future__ import annotations

import argparse
import shutil

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


def test_plain_full_row_runs_first_under_the_machine_cap_when_a_cgroup_holds_it():
    sides = bench._sides(_opts(rows="full", plain_full_cap=7 * 2**30, work="/w"), "/base", "/data")
    assert [(s["row"], s["side"]) for s in sides] == [("full", "plain"), ("full", "ours")]
    plain, ours = sides
    assert plain["argv"][3:6] == ["plain_full", "/base", "/w/out-full-plain"] and plain["cap"] == 7 * 2**30
    assert ours["cap"] == 8 * 2**30 and "--rank" not in plain["argv"]


def test_plain_loops_train_and_write_what_the_scripts_write(tmp_path, sdxl_folder, capsys):
    """Both plain loops, on the tiny SDXL pipeline: every step prints a finite loss, the LoRA loop writes a LoRA
    file diffusers loads, the full loop a UNet whose weights changed."""
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel

    bench.plain_lora(str(sdxl_folder), str(tmp_path / "lora"), steps=2, batch=1, resolution=32, rank=2)
    bench.plain_full(str(sdxl_folder), str(tmp_path / "full"), steps=2, batch=1, resolution=32)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("plain step")]
    assert len(lines) == 4 and all(torch.isfinite(torch.tensor(float(ln.split()[-1]))) for ln in lines)
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_folder)
    pipe.load_lora_weights(tmp_path / "lora")
    assert set(pipe.get_list_adapters()) == {"unet"}
    trained = dict(UNet2DConditionModel.from_pretrained(tmp_path / "full" / "unet").named_parameters())
    base = UNet2DConditionModel.from_pretrained(sdxl_folder, subfolder="unet")
    assert any(not torch.equal(p, trained[n]) for n, p in base.named_parameters())


def test_full_checks_read_the_losses_and_load_the_pipeline(tmp_path, sdxl_folder):
    def metrics(folder, losses):
        (folder / "logs" / "csv").mkdir(parents=True, exist_ok=True)
        rows = "".join(f"0,,1e-4,{i},{v}\n" for i, v in enumerate(losses))
        (folder / "logs" / "csv" / "metrics.csv").write_text("epoch,images_per_s,lr,step,train_loss\n" + rows)

    good = tmp_path / "good"
    shutil.copytree(sdxl_folder, good)
    metrics(good, [1.0, 0.5])
    out = bench._full_checks(str(good))
    assert out["losses"] == [1.0, 0.5] and out["loss_finite"]
    assert out["pipeline"]["loads"] and out["pipeline"]["finite"] and out["pipeline"]["unet_params"] > 0
    bad = tmp_path / "bad"
    metrics(bad, [1.0, float("nan")])
    out = bench._full_checks(str(bad))
    assert not out["loss_finite"] and not out["pipeline"]["loads"] and out["pipeline"]["error"]


def test_unknown_row_or_side_is_one_line_exit_2(tmp_path, capsys):
    from lowmem.suite.cli import main

    for flag in (["--sides", "mine"], ["--rows", "fulll"]):
        rc = main(["bench", "diffusion-sdxl", *flag, "--work", str(tmp_path / "w"), "--json", str(tmp_path / "j")])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and repr(flag[1]) in err[0], err
    assert not (tmp_path / "w").exists()
