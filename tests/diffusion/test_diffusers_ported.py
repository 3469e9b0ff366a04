"""diffusers v0.40.0's own example tests of the three scripts, ported to `suite diffusion train_x` (issue 32):
examples/text_to_image/test_text_to_image.py, test_text_to_image_lora.py and examples/dreambooth/test_dreambooth.py
(their `ExamplesTestsAccelerate` / `run_command` of examples/test_examples_utils.py run
`accelerate launch train_x.py ...` in a subprocess; here the same command line runs through the in-process CLI
entry, `suite diffusion train_x ...`, as tests/diffusion/test_scripts.py does, to keep them cheap).

Every flag and every assertion is kept. What changes, and why:
- `--pretrained_model_name_or_path hf-internal-testing/tiny-stable-diffusion-torch` is the tiny SD-1.5-shaped
  pipeline folder built offline (`diffusion.tiny.save_tiny_sd_pipeline`): nothing is downloaded in tests.
- `--dataset_name hf-internal-testing/dummy_image_text_data` is a local imagefolder (`image` and `text` columns,
  as the hub data set) of 6 images, `--instance_data_dir docs/source/en/imgs` a folder of 2 images (what that
  folder of diffusers holds at v0.40.0); the counts decide which epoch a resumed run starts at, and with them
  the scripts give the checkpoint sets asserted below.
- `test_dreambooth_if` names hf-internal-testing/tiny-if-pipe, a DeepFloyd IF pipeline, which is not supported
  here (Stable Diffusion only); its flags (`--pre_compute_text_embeddings --tokenizer_max_length=77
  --text_encoder_use_attention_mask`) run on the tiny SD pipeline instead, with its assertions.
- The SDXL tests of those files (`TestTextToImageSDXL`, `TestTextToImageLoRASDXL` and
  `test_text_to_image_lora_sdxl_checkpointing_checkpoints_total_limit`) are of other scripts
  (train_text_to_image_sdxl.py, train_text_to_image_lora_sdxl.py): tests/diffusion/test_sdxl*.py.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import pytest

from lowmem.suite.cli import main
from tests.diffusion.conftest import write_image, write_image_folder

pytest.importorskip("lightning.pytorch")

PROMPT = "a prompt"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """Stands for hf-internal-testing/tiny-stable-diffusion-torch."""
    from lowmem.diffusion.tiny import save_tiny_sd_pipeline

    return save_tiny_sd_pipeline(tmp_path_factory.mktemp("tiny-sd") / "tiny-stable-diffusion-torch")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Stands for hf-internal-testing/dummy_image_text_data: an imagefolder with image and text columns."""
    return write_image_folder(tmp_path_factory.mktemp("dummy_image_text_data"), 6, name="{i}.png",
                              caption="caption {i}", sizes=[(72, 64)] * 6, seed0=100)


@pytest.fixture(scope="module")
def imgs(tmp_path_factory) -> Path:
    """Stands for diffusers' docs/source/en/imgs (2 images at v0.40.0)."""
    folder = tmp_path_factory.mktemp("imgs")
    write_image(folder / "access_request.png", size=(80, 64), seed=1)
    write_image(folder / "diffusers_library.jpg", size=(64, 64), seed=2)
    return folder


@pytest.fixture
def tmpdir_(tmp_path) -> str:
    return str(tmp_path / "out")


def run_command(line: str, model: Path, dataset: Path | None = None, imgs: Path | None = None) -> None:
    """`accelerate launch <script>.py <args>` as `suite diffusion <script> <args>`, the hub names and the
    repository's folder replaced by the local stand-ins; fails with the command's error output."""
    args = shlex.split(line)
    script = Path(args[0]).stem
    swap = {"hf-internal-testing/tiny-stable-diffusion-torch": str(model),
            "hf-internal-testing/dummy_image_text_data": str(dataset), "docs/source/en/imgs": str(imgs)}
    argv = ["diffusion", script]
    for a in args[1:]:
        flag, eq, value = a.partition("=")
        argv.append(f"{flag}={swap.get(value, value)}" if eq else swap.get(a, a))
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 0, f"`suite {' '.join(argv)}` exited {rc}"


def checkpoints(tmpdir: str) -> set[str]:
    return {x for x in os.listdir(tmpdir) if "checkpoint" in x}


def pipeline(path, **kw):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(path, **kw)


def unet(path, subfolder):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(path, subfolder=subfolder)


# -- examples/text_to_image/test_text_to_image.py: TestTextToImage -------------------------------------------------
T2I = """examples/text_to_image/train_text_to_image.py
    --pretrained_model_name_or_path hf-internal-testing/tiny-stable-diffusion-torch
    --dataset_name hf-internal-testing/dummy_image_text_data
    --resolution 64 --center_crop --random_flip --train_batch_size 1 --gradient_accumulation_steps 1
    --learning_rate 5.0e-04 --scale_lr --lr_scheduler constant --lr_warmup_steps 0 --output_dir {tmpdir}"""


def test_text_to_image(tmpdir_, model, dataset):
    run_command(T2I.format(tmpdir=tmpdir_) + " --max_train_steps 2", model, dataset)
    # save_pretrained smoke test
    assert os.path.isfile(os.path.join(tmpdir_, "unet", "diffusion_pytorch_model.safetensors"))
    assert os.path.isfile(os.path.join(tmpdir_, "scheduler", "scheduler_config.json"))


@pytest.mark.parametrize("ema", ["", " --use_ema"], ids=["plain", "use_ema"])
def test_text_to_image_checkpointing(tmpdir_, model, dataset, ema):
    """test_text_to_image_checkpointing and test_text_to_image_checkpointing_use_ema (the same with --use_ema,
    whose first check runs 2 inference steps)."""
    # max_train_steps == 4, checkpointing_steps == 2: checkpoints at steps 2, 4
    run_command(T2I.format(tmpdir=tmpdir_) + " --max_train_steps 4 --checkpointing_steps=2" + ema + " --seed=0",
                model, dataset)
    pipe = pipeline(tmpdir_, safety_checker=None)
    pipe(PROMPT, num_inference_steps=2 if ema else 1)
    assert checkpoints(tmpdir_) == {"checkpoint-2", "checkpoint-4"}
    # an intermediate checkpoint runs
    pipe = pipeline(model, unet=unet(tmpdir_, "checkpoint-2/unet"), safety_checker=None)
    pipe(PROMPT, num_inference_steps=1)
    # remove checkpoint 2 so that only later checkpoints exist after resuming
    shutil.rmtree(os.path.join(tmpdir_, "checkpoint-2"))
    # 2 total steps, resuming from checkpoint 4 (the scripts' loop still trains one step: 5)
    run_command(T2I.format(tmpdir=tmpdir_) + " --max_train_steps 2 --checkpointing_steps=1"
                " --resume_from_checkpoint=checkpoint-4" + ema + " --seed=0", model, dataset)
    pipe = pipeline(tmpdir_, safety_checker=None)
    pipe(PROMPT, num_inference_steps=1)
    assert checkpoints(tmpdir_) == {"checkpoint-4", "checkpoint-5"}


def test_text_to_image_checkpointing_checkpoints_total_limit(tmpdir_, model, dataset):
    # max_train_steps == 6, checkpointing_steps == 2, checkpoints_total_limit == 2: 2, 4, 6 with 2 removed
    run_command(T2I.format(tmpdir=tmpdir_) + " --max_train_steps 6 --checkpointing_steps=2"
                " --checkpoints_total_limit=2 --seed=0", model, dataset)
    pipe = pipeline(tmpdir_, safety_checker=None)
    pipe(PROMPT, num_inference_steps=1)
    assert checkpoints(tmpdir_) == {"checkpoint-4", "checkpoint-6"}


def test_text_to_image_checkpointing_checkpoints_total_limit_removes_multiple_checkpoints(tmpdir_, model, dataset):
    run_command(T2I.format(tmpdir=tmpdir_) + " --max_train_steps 4 --checkpointing_steps=2 --seed=0", model, dataset)
    pipe = pipeline(tmpdir_, safety_checker=None)
    pipe(PROMPT, num_inference_steps=1)
    assert checkpoints(tmpdir_) == {"checkpoint-2", "checkpoint-4"}
    # resumed, the save at 6 removes checkpoint-2, the one at 8 checkpoint-4
    run_command(T2I.format(tmpdir=tmpdir_) + " --max_train_steps 8 --checkpointing_steps=2"
                " --resume_from_checkpoint=checkpoint-4 --checkpoints_total_limit=2 --seed=0", model, dataset)
    pipe = pipeline(tmpdir_, safety_checker=None)
    pipe(PROMPT, num_inference_steps=1)
    assert checkpoints(tmpdir_) == {"checkpoint-6", "checkpoint-8"}


# -- examples/text_to_image/test_text_to_image_lora.py: TestTextToImageLoRA ----------------------------------------
LORA = T2I.replace("train_text_to_image.py", "train_text_to_image_lora.py")


def _lora_pipe(model, tmpdir):
    pipe = pipeline(model, safety_checker=None)
    pipe.load_lora_weights(tmpdir)
    pipe(PROMPT, num_inference_steps=1)


def test_text_to_image_lora_checkpointing_checkpoints_total_limit(tmpdir_, model, dataset):
    run_command(LORA.format(tmpdir=tmpdir_) + " --max_train_steps 6 --checkpointing_steps=2"
                " --checkpoints_total_limit=2 --seed=0 --num_validation_images=0", model, dataset)
    _lora_pipe(model, tmpdir_)
    assert checkpoints(tmpdir_) == {"checkpoint-4", "checkpoint-6"}


def test_text_to_image_lora_checkpointing_checkpoints_total_limit_removes_multiple_checkpoints(tmpdir_, model,
                                                                                             dataset):
    run_command(LORA.format(tmpdir=tmpdir_) + " --max_train_steps 4 --checkpointing_steps=2 --seed=0"
                " --num_validation_images=0", model, dataset)
    _lora_pipe(model, tmpdir_)
    assert checkpoints(tmpdir_) == {"checkpoint-2", "checkpoint-4"}
    run_command(LORA.format(tmpdir=tmpdir_) + " --max_train_steps 8 --checkpointing_steps=2"
                " --resume_from_checkpoint=checkpoint-4 --checkpoints_total_limit=2 --seed=0"
                " --num_validation_images=0", model, dataset)
    _lora_pipe(model, tmpdir_)
    assert checkpoints(tmpdir_) == {"checkpoint-6", "checkpoint-8"}


# -- examples/dreambooth/test_dreambooth.py: TestDreamBooth --------------------------------------------------------
DB = """examples/dreambooth/train_dreambooth.py
    --pretrained_model_name_or_path hf-internal-testing/tiny-stable-diffusion-torch
    --instance_data_dir docs/source/en/imgs --instance_prompt photo
    --resolution 64 --train_batch_size 1 --gradient_accumulation_steps 1
    --learning_rate 5.0e-04 --scale_lr --lr_scheduler constant --lr_warmup_steps 0 --output_dir {tmpdir}"""
DB_EQ = """examples/dreambooth/train_dreambooth.py
    --pretrained_model_name_or_path=hf-internal-testing/tiny-stable-diffusion-torch
    --instance_data_dir=docs/source/en/imgs --output_dir={tmpdir} --instance_prompt=prompt --resolution=64
    --train_batch_size=1 --gradient_accumulation_steps=1"""


@pytest.mark.parametrize("extra", ["", " --pre_compute_text_embeddings --tokenizer_max_length=77"
                                       " --text_encoder_use_attention_mask"], ids=["sd", "if_flags"])
def test_dreambooth(tmpdir_, model, imgs, extra):
    """test_dreambooth, and test_dreambooth_if's flags on the SD pipeline (no DeepFloyd IF here)."""
    run_command(DB.format(tmpdir=tmpdir_) + " --max_train_steps 2" + extra, model, imgs=imgs)
    # save_pretrained smoke test
    assert os.path.isfile(os.path.join(tmpdir_, "unet", "diffusion_pytorch_model.safetensors"))
    assert os.path.isfile(os.path.join(tmpdir_, "scheduler", "scheduler_config.json"))


def test_dreambooth_checkpointing(tmpdir_, model, imgs):
    instance_prompt = "photo"
    # max_train_steps == 4, checkpointing_steps == 2: checkpoints at steps 2, 4
    run_command(DB.format(tmpdir=tmpdir_) + " --max_train_steps 4 --checkpointing_steps=2 --seed=0", model,
                imgs=imgs)
    pipe = pipeline(tmpdir_, safety_checker=None)
    pipe(instance_prompt, num_inference_steps=1)
    assert os.path.isdir(os.path.join(tmpdir_, "checkpoint-2"))
    assert os.path.isdir(os.path.join(tmpdir_, "checkpoint-4"))
    pipe = pipeline(model, unet=unet(tmpdir_, "checkpoint-2/unet"), safety_checker=None)
    pipe(instance_prompt, num_inference_steps=1)
    shutil.rmtree(os.path.join(tmpdir_, "checkpoint-2"))
    # 6 total steps, resuming from checkpoint 4
    run_command(DB.format(tmpdir=tmpdir_) + " --max_train_steps 6 --checkpointing_steps=2"
                " --resume_from_checkpoint=checkpoint-4 --seed=0", model, imgs=imgs)
    pipe = pipeline(tmpdir_, safety_checker=None)
    pipe(instance_prompt, num_inference_steps=1)
    assert not os.path.isdir(os.path.join(tmpdir_, "checkpoint-2"))
    assert os.path.isdir(os.path.join(tmpdir_, "checkpoint-4"))
    assert os.path.isdir(os.path.join(tmpdir_, "checkpoint-6"))


def test_dreambooth_checkpointing_checkpoints_total_limit(tmpdir_, model, imgs):
    run_command(DB_EQ.format(tmpdir=tmpdir_) + " --max_train_steps=6 --checkpoints_total_limit=2"
                " --checkpointing_steps=2", model, imgs=imgs)
    assert checkpoints(tmpdir_) == {"checkpoint-4", "checkpoint-6"}


def test_dreambooth_checkpointing_checkpoints_total_limit_removes_multiple_checkpoints(tmpdir_, model, imgs):
    run_command(DB_EQ.format(tmpdir=tmpdir_) + " --max_train_steps=4 --checkpointing_steps=2", model, imgs=imgs)
    assert checkpoints(tmpdir_) == {"checkpoint-2", "checkpoint-4"}
    run_command(DB_EQ.format(tmpdir=tmpdir_) + " --max_train_steps=8 --checkpointing_steps=2"
                " --resume_from_checkpoint=checkpoint-4 --checkpoints_total_limit=2", model, imgs=imgs)
    assert checkpoints(tmpdir_) == {"checkpoint-6", "checkpoint-8"}
