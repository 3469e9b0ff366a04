"""Bad input stops `suite diffusion finetune` before training: exit code 2, one line naming the file."""

from __future__ import annotations

import json
import shutil

import pytest

from lowmem.diffusion.config import FineTuneConfig
from lowmem.diffusion.data import DataConfig, scan_image_folder, validate_records
from lowmem.diffusion.errors import InputError
from lowmem.suite.cli import main
from tests.diffusion.conftest import write_image


def _run(capsys, tmp_path, *flags: str) -> str:
    rc = main(["diffusion", "finetune", "--output_dir", str(tmp_path / "out"), "--max_train_steps", "1", *flags])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    # Only the error line matters here (logging from earlier tests may also reach the captured stderr).
    errors = [line for line in err.splitlines() if line.startswith("suite diffusion: error:")]
    assert len(errors) == 1, err
    assert not (tmp_path / "out" / "checkpoint-1").exists()
    return errors[0]


def _metadata(folder, lines):
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")


def test_truncated_image(capsys, tmp_path, image_folder):
    data = (image_folder / "img2.png").read_bytes()
    (image_folder / "img2.png").write_bytes(data[: len(data) // 2])
    err = _run(capsys, tmp_path, "--train_data_dir", str(image_folder))
    assert "img2.png" in err and "--skip_bad_images" in err


def test_unreadable_image_skipped_with_flag(caplog, image_folder):
    (image_folder / "img1.png").write_bytes(b"not an image at all")
    cfg = DataConfig(resolution=16, skip_bad_images=True)
    good = validate_records(scan_image_folder(image_folder, cfg), cfg, "data")
    assert [r.path.name for r in good] == ["img0.png", "img2.png", "img3.png"]
    assert "skipped 1 unreadable image(s) of 4" in caplog.text


def test_bad_metadata_line_names_line(capsys, tmp_path, image_folder):
    lines = (image_folder / "metadata.jsonl").read_text().splitlines()
    lines[2] = '{"file_name": "img2.png", "text": '
    _metadata(image_folder, lines)
    err = _run(capsys, tmp_path, "--train_data_dir", str(image_folder))
    assert "metadata.jsonl:3" in err and "JSON" in err


def test_missing_caption_column_names_line(capsys, tmp_path, image_folder):
    _metadata(image_folder, [json.dumps({"file_name": f"img{i}.png", "text": "x"}) for i in range(3)]
              + [json.dumps({"file_name": "img3.png", "caption": "x"})])
    err = _run(capsys, tmp_path, "--train_data_dir", str(image_folder))
    assert "metadata.jsonl:4" in err and "'text'" in err


def test_caption_column_flag(image_folder):
    _metadata(image_folder, [json.dumps({"file_name": f"img{i}.png", "caption": f"c{i}"}) for i in range(4)])
    records = scan_image_folder(image_folder, DataConfig(caption_column="caption"))
    assert [r.caption for r in records] == ["c0", "c1", "c2", "c3"]


def test_metadata_points_to_missing_file(capsys, tmp_path, image_folder):
    (image_folder / "img3.png").unlink()
    err = _run(capsys, tmp_path, "--train_data_dir", str(image_folder))
    assert "metadata.jsonl:4" in err and "img3.png" in err


def test_missing_txt_caption(capsys, tmp_path):
    folder = tmp_path / "txt"
    write_image(folder / "a.png")
    (folder / "a.txt").write_text("a caption")
    write_image(folder / "b.png")
    err = _run(capsys, tmp_path, "--train_data_dir", str(folder))
    assert "b.png" in err and "missing caption" in err


def test_empty_folder(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    err = _run(capsys, tmp_path, "--train_data_dir", str(tmp_path / "empty"))
    assert "empty" in err and "no images" in err


def test_empty_instance_folder(capsys, tmp_path):
    (tmp_path / "inst").mkdir()
    err = _run(capsys, tmp_path, "--instance_data_dir", str(tmp_path / "inst"), "--instance_prompt", "sks")
    assert "inst" in err and "--instance_data_dir" in err


def test_resolution_not_multiple_of_8(capsys, tmp_path):
    err = _run(capsys, tmp_path, "--resolution", "30")
    assert "--resolution" in err and "multiple of 8" in err


def test_model_folder_missing_component(capsys, tmp_path, tiny, image_folder):
    from lowmem.diffusion.models import make_pipeline

    model = tmp_path / "model"
    make_pipeline(tiny).save_pretrained(model)
    shutil.rmtree(model / "vae")
    err = _run(capsys, tmp_path, "--pretrained_model_name_or_path", str(model), "--train_data_dir",
               str(image_folder))
    assert "model" in err and "'vae'" in err


def test_model_path_missing(capsys, tmp_path):
    err = _run(capsys, tmp_path, "--pretrained_model_name_or_path", str(tmp_path / "nope"))
    assert "nope" in err


def test_bad_yaml_key(capsys, tmp_path):
    (tmp_path / "r.yaml").write_text("resolution: 32\nlearning_rat: 0.1\n")
    err = _run(capsys, tmp_path, "--config", str(tmp_path / "r.yaml"))
    assert "r.yaml" in err and "learning_rat" in err


def test_odd_modes_and_small_images_train_inputs_accepted(tmp_path):
    folder = tmp_path / "odd"
    for i, mode in enumerate(["L", "RGBA", "CMYK", "P"]):
        name = f"{i}.jpg" if mode == "CMYK" else f"{i}.png"
        write_image(folder / name, size=(12, 10), mode=mode, seed=i)
        (folder / name).with_suffix(".txt").write_text(f"mode {mode}")
    cfg = DataConfig(resolution=32)
    records = validate_records(scan_image_folder(folder, cfg), cfg, "odd")
    assert len(records) == 4


@pytest.mark.parametrize("name", ["full", "lora", "dreambooth"])
def test_shipped_recipes_load(tmp_path, name):
    from lowmem.diffusion.config import load_yaml_config
    from lowmem.suite.commands.diffusion import resolve_config_path

    values = load_yaml_config(resolve_config_path(name))
    if name == "dreambooth":
        values.update(instance_data_dir=str(tmp_path), class_data_dir=str(tmp_path / "class"))
    cfg = FineTuneConfig(**values)
    assert cfg.lora == (name == "lora")
    assert cfg.with_prior_preservation == (name == "dreambooth")


def test_input_error_is_a_usage_error():
    from lowmem.suite.errors import UsageError

    assert issubclass(InputError, UsageError)
