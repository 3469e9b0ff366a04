"""diffusers v0.40.0's example tests of its SDXL scripts, ported to `suite diffusion train_*_sdxl` (issue 45): the 13
SDXL cases of examples/text_to_image/test_text_to_image.py (`TestTextToImageSDXL`), test_text_to_image_lora.py
(`test_text_to_image_lora_sdxl_checkpointing_checkpoints_total_limit`, `TestTextToImageLoRASDXL`),
examples/dreambooth/test_dreambooth_lora.py (`TestDreamBoothLoRASDXL`) and test_dreambooth_lora_edm.py. There
`run_command` launches `accelerate launch <script>.py ...` in a subprocess; here the same command line runs through
the in-process CLI entry, as tests/diffusion/test_diffusers_ported.py does for the SD 1.x scripts.

Every flag and every assertion is kept, with more checks where a user would look beyond file names (the LoRA
file's text-encoder layers applied by diffusers as trained; the captions a custom-caption run trains on). What
changes, and why:
- `hf-internal-testing/tiny-stable-diffusion-xl-pipe` is the tiny SDXL pipeline folder built offline
  (`diffusion.sdxl.save_tiny_sdxl_pipeline`), `hf-internal-testing/dummy_image_text_data` a local imagefolder
  (`image` and `text` columns), `docs/source/en/imgs` a folder of 2 images: nothing is downloaded in tests.
- To keep the file's time small: `--resolution 64` runs at 32 (the tiny pipeline's size; the cases assert files,
  keys and checkpoint sets, which the resolution does not change), and a case whose command line differs from a
  checkpointing case's only by fewer steps and no checkpointing flags (`test_text_to_image_lora_sdxl`,
  `..._with_text_encoder`, `test_dreambooth_lora_sdxl`, `..._with_text_encoder`) asserts its checks on that case's
  run (module-scoped `runs`): what they assert of the LoRA file holds at any step.
- `hf-internal-testing/tiny-playground-v2-5-pipe` is the tiny SDXL folder with Playground v2.5's scheduler
  (EDMDPMSolverMultistepScheduler) and VAE latent statistics; the EDM objective these two cases train is checked
  against a hand-computed loss in tests/diffusion/test_edm.py.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from lowmem.suite.cli import main
from tests.diffusion.conftest import write_image, write_image_folder

pytest.importorskip("lightning.pytorch")

SDXL = "hf-internal-testing/tiny-stable-diffusion-xl-pipe"
PLAYGROUND = "hf-internal-testing/tiny-playground-v2-5-pipe"


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, str]:
    """The hub names and the repository's image folder -> local stand-ins."""
    from lowmem.diffusion.sdxl import save_tiny_sdxl_pipeline

    root = tmp_path_factory.mktemp("sdxl-ported")
    model = save_tiny_sdxl_pipeline(root / "tiny-stable-diffusion-xl-pipe")
    playground = root / "tiny-playground-v2-5-pipe"  # Playground v2.5's scheduler and VAE latent statistics
    shutil.copytree(model, playground)
    sched = playground / "scheduler" / "scheduler_config.json"
    sched.write_text(json.dumps({"_class_name": "EDMDPMSolverMultistepScheduler", "sigma_data": 0.5,
                                 "sigma_min": 0.002, "sigma_max": 80.0, "prediction_type": "epsilon"}))
    index = json.loads((playground / "model_index.json").read_text())
    index["scheduler"] = ["diffusers", "EDMDPMSolverMultistepScheduler"]
    (playground / "model_index.json").write_text(json.dumps(index))
    vae = playground / "vae" / "config.json"
    vae.write_text(json.dumps({**json.loads(vae.read_text()), "latents_mean": [0.1] * 4, "latents_std": [0.9] * 4}))
    data = write_image_folder(root / "dummy_image_text_data", 6, name="{i}.png", caption="caption {i}",
                              sizes=[(72, 64)] * 6, seed0=100)
    imgs = root / "imgs"
    write_image(imgs / "access_request.png", size=(80, 64), seed=1)
    write_image(imgs / "diffusers_library.jpg", size=(64, 64), seed=2)
    return {SDXL: str(model), PLAYGROUND: str(playground), "hf-internal-testing/dummy_image_text_data": str(data),
            "docs/source/en/imgs": str(imgs), "64": "32"}


@pytest.fixture
def tmpdir(tmp_path) -> str:
    return str(tmp_path / "out")


class Runs:
    """Each command line run once per module (the cases sharing one read its output)."""

    def __init__(self, root: Path, stand_ins: dict[str, str]) -> None:
        self.root, self.stand_ins, self.done = root, stand_ins, {}

    def __call__(self, line: str) -> str:
        if line not in self.done:
            out = str(self.root / f"run{len(self.done)}")
            ok(line.format(tmpdir=out), self.stand_ins)
            self.done[line] = out
        return self.done[line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stand_ins) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"), stand_ins)


def run_command(line: str, stand_ins: dict[str, str]) -> tuple[int, list[str]]:
    """`accelerate launch <script>.py <args>` as `suite diffusion <script> <args>`, the stand-ins swapped in; the
    exit code and the error lines."""
    import io
    from contextlib import redirect_stderr

    args = shlex.split(line)
    argv = ["diffusion", Path(args[0]).stem]
    for a in args[1:]:
        flag, eq, value = a.partition("=")
        argv.append(f"{flag}={stand_ins.get(value, value)}" if eq else stand_ins.get(a, a))
    err = io.StringIO()
    with redirect_stderr(err):
        try:
            rc = main([*argv, "--report_to", "csv"])
        except SystemExit as exc:
            rc = exc.code
    return rc, [ln for ln in err.getvalue().splitlines() if ln.startswith("suite diffusion: error:")]


def ok(line: str, stand_ins: dict[str, str]) -> None:
    rc, errors = run_command(line, stand_ins)
    assert rc == 0, errors


def checkpoints(tmpdir: str) -> set[str]:
    return {x for x in os.listdir(tmpdir) if "checkpoint" in x}


def lora_keys(tmpdir: str) -> list[str]:
    from safetensors.torch import load_file

    path = os.path.join(tmpdir, "pytorch_lora_weights.safetensors")
    assert os.path.isfile(path)  # save_pretrained smoke test
    return list(load_file(path))


def load_and_sample(model: str, tmpdir: str, steps: int) -> None:
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.load_lora_weights(tmpdir)
    pipe("a prompt", num_inference_steps=steps, height=32, width=32)


COMMON = """--resolution 64 --train_batch_size 1 --gradient_accumulation_steps 1 --learning_rate 5.0e-04 --scale_lr
    --lr_scheduler constant --lr_warmup_steps 0 --output_dir {tmpdir}"""
T2I_LORA = f"""examples/text_to_image/train_text_to_image_lora_sdxl.py --pretrained_model_name_or_path {SDXL}
    --dataset_name hf-internal-testing/dummy_image_text_data {COMMON}"""
DB_LORA = f"""examples/dreambooth/train_dreambooth_lora_sdxl.py --pretrained_model_name_or_path {SDXL}
    --instance_data_dir docs/source/en/imgs --instance_prompt photo {COMMON}"""
DB_CAPTIONS = f"""examples/dreambooth/train_dreambooth_lora_sdxl.py --pretrained_model_name_or_path {SDXL}
    --dataset_name hf-internal-testing/dummy_image_text_data --caption_column text --instance_prompt photo
    {COMMON} --max_train_steps 2"""


# -- examples/text_to_image/test_text_to_image.py: TestTextToImageSDXL -------------------------------------------
def test_text_to_image_sdxl(tmpdir, stand_ins):
    ok(f"""examples/text_to_image/train_text_to_image_sdxl.py --pretrained_model_name_or_path {SDXL}
        --dataset_name hf-internal-testing/dummy_image_text_data --center_crop --random_flip --max_train_steps 2
        {COMMON.format(tmpdir=tmpdir)}""", stand_ins)
    assert os.path.isfile(os.path.join(tmpdir, "unet", "diffusion_pytorch_model.safetensors"))
    assert os.path.isfile(os.path.join(tmpdir, "scheduler", "scheduler_config.json"))


# -- examples/text_to_image/test_text_to_image_lora.py -----------------------------------------------------------
T2I_LORA_CKPT = T2I_LORA + " --max_train_steps 6 --checkpointing_steps=2 --checkpoints_total_limit=2"
T2I_LORA_TE_CKPT = T2I_LORA + " --max_train_steps 6 --train_text_encoder --checkpointing_steps=2 " \
    "--checkpoints_total_limit=2"


def test_text_to_image_lora_sdxl_checkpointing_checkpoints_total_limit(runs, stand_ins):
    # 6 steps, a checkpoint every 2, at most 2 kept: checkpoint-2 is removed when checkpoint-6 is written
    tmpdir = runs(T2I_LORA_CKPT)
    load_and_sample(stand_ins[SDXL], tmpdir, 1)
    assert checkpoints(tmpdir) == {"checkpoint-4", "checkpoint-6"}


def test_text_to_image_lora_sdxl(runs):
    tmpdir = runs(T2I_LORA_CKPT)  # --max_train_steps 2 in diffusers
    assert all("lora" in k for k in lora_keys(tmpdir))


def test_text_to_image_lora_sdxl_with_text_encoder(runs):
    tmpdir = runs(T2I_LORA_TE_CKPT)  # --max_train_steps 2 --train_text_encoder in diffusers
    keys = lora_keys(tmpdir)
    assert all("lora" in k for k in keys)
    assert all(k.startswith(("unet", "text_encoder", "text_encoder_2")) for k in keys)


def _text_encoder_outputs(encoder, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = encoder(ids, output_hidden_states=True)
    return out.hidden_states[-2], out[0]


def test_text_to_image_lora_sdxl_text_encoder_checkpointing_checkpoints_total_limit(runs, stand_ins):
    """Also (issue 45): the text encoders' layers are in CLIP's `text_model.` layout, and the pipeline that loaded
    the file encodes prompts as the run's own text encoders did at its last step (their LoRA weights read from the
    run's checkpoint-6, not from the file), through diffusers' `load_lora_weights` and through the plain
    `load_adapter` of transformers that diffusers v0.40.0 calls without removing the `text_model.` prefix."""
    from diffusers import StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_peft
    from peft import LoraConfig

    from lowmem.diffusion.lora import TEXT_TARGETS, add_lora

    tmpdir = runs(T2I_LORA_TE_CKPT)
    load_and_sample(stand_ins[SDXL], tmpdir, 1)
    assert checkpoints(tmpdir) == {"checkpoint-4", "checkpoint-6"}

    from safetensors.torch import load_file

    layers = load_file(os.path.join(tmpdir, "pytorch_lora_weights.safetensors"))
    for part in ("text_encoder", "text_encoder_2"):
        mine = [k for k in layers if k.split(".")[0] == part]
        assert mine and all(k.startswith(f"{part}.text_model.encoder.layers.") for k in mine), mine[:2]
    trained = torch.load(os.path.join(tmpdir, "checkpoint-6", "trainer_state.ckpt"), weights_only=True)["state_dict"]
    base = StableDiffusionXLPipeline.from_pretrained(stand_ins[SDXL])
    loaded = StableDiffusionXLPipeline.from_pretrained(stand_ins[SDXL])
    loaded.load_lora_weights(tmpdir)
    ids = base.tokenizer(["a prompt", "caption 3"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    for part in ("text_encoder", "text_encoder_2"):
        ours = type(getattr(base, part)).from_pretrained(stand_ins[SDXL], subfolder=part)
        add_lora(ours, 4, text_encoder=True)
        state = {k[len(part) + 1:]: v for k, v in trained.items() if k.startswith(f"{part}.")}
        assert state and not ours.load_state_dict(state, strict=False).unexpected_keys
        want = _text_encoder_outputs(ours, ids)
        before = _text_encoder_outputs(getattr(base, part), ids)
        assert (want[0] - before[0]).abs().max() > 1e-4  # the LoRA changed the encoder
        # v0.40.0's path: the part's layers in peft's names, straight into transformers' load_adapter
        plain = type(getattr(base, part)).from_pretrained(stand_ins[SDXL], subfolder=part)
        peft_state = convert_state_dict_to_peft({k[len(part) + 1:]: v for k, v in layers.items()
                                                 if k.startswith(f"{part}.")})
        plain.load_adapter(adapter_state_dict=peft_state, adapter_name="default",
                           peft_config=LoraConfig(r=4, lora_alpha=4, target_modules=TEXT_TARGETS))
        for encoder in (getattr(loaded, part), plain):
            got = _text_encoder_outputs(encoder, ids)
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w)  # fp32's tolerance


# -- examples/dreambooth/test_dreambooth_lora.py: TestDreamBoothLoRASDXL ------------------------------------------
DB_LORA_CKPT = DB_LORA + " --max_train_steps 6 --checkpointing_steps=2 --checkpoints_total_limit=2"
DB_LORA_TE_CKPT = DB_LORA + " --max_train_steps 7 --checkpointing_steps=2 --checkpoints_total_limit=2 " \
    "--train_text_encoder"


def test_dreambooth_lora_sdxl(runs):
    keys = lora_keys(runs(DB_LORA_CKPT))  # --max_train_steps 2 in diffusers
    assert all("lora" in k for k in keys)
    assert all(k.startswith("unet") for k in keys)


def test_dreambooth_lora_sdxl_with_text_encoder(runs):
    keys = lora_keys(runs(DB_LORA_TE_CKPT))  # --max_train_steps 2 --train_text_encoder in diffusers
    assert all("lora" in k for k in keys)
    assert all(k.startswith(("unet", "text_encoder", "text_encoder_2")) for k in keys)


def _captions(tmp_path: Path, stand_ins: dict[str, str], **values) -> list:
    """The captions the DreamBooth LoRA SDXL run with `values` trains on, as its data module scans them."""
    from lowmem.diffusion.sdxl_scripts import SDXL_SCRIPT_FLAGS, sdxl_script_config
    from lowmem.recipes.diffusion.sdxl_data import SDXLData

    flags = {f.name: f.default for f in SDXL_SCRIPT_FLAGS["train_dreambooth_lora_sdxl"]}
    cfg = sdxl_script_config("train_dreambooth_lora_sdxl", {
        **flags, "pretrained_model_name_or_path": stand_ins[SDXL], "instance_prompt": "photo", "resolution": 32,
        "output_dir": str(tmp_path / "out"), **values})
    return [r.caption for r in SDXLData(cfg, None).scan()]


def test_custom_captions_are_the_column_else_the_instance_prompt(tmp_path, stand_ins):
    """train_dreambooth_lora_sdxl.py's DreamBoothDataset: with --caption_column each image's caption, the instance
    prompt where it is empty or null; without it the instance prompt for all; --repeats repeats both."""
    data = write_image_folder(tmp_path / "data", 3, caption="caption {i}")
    rows = [json.loads(line) for line in (data / "metadata.jsonl").read_text().splitlines()]
    rows[1]["text"], rows[2]["text"] = "", None
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _captions(tmp_path, stand_ins, dataset_name=str(data), caption_column="text") == \
        ["caption 0", "photo", "photo"]
    assert _captions(tmp_path, stand_ins, dataset_name=str(data), repeats=2) == ["photo"] * 6
    plain = tmp_path / "plain"  # images alone (no metadata): the instance prompt for each
    for i in range(2):
        write_image(plain / f"{i}.png", seed=i)
    assert _captions(tmp_path, stand_ins, dataset_name=str(plain)) == ["photo"] * 2
    from lowmem.diffusion.errors import InputError

    with pytest.raises(InputError, match="no column 'caption'|missing caption column 'caption'"):
        _captions(tmp_path, stand_ins, dataset_name=str(stand_ins["hf-internal-testing/dummy_image_text_data"]),
                  caption_column="caption")
    for values, message in (({}, "needs --dataset_name or --instance_data_dir"),
                            ({"dataset_name": str(data), "instance_data_dir": str(plain)}, "exclude each other")):
        with pytest.raises(InputError, match=message):
            _captions(tmp_path, stand_ins, **values)


def test_dreambooth_lora_sdxl_custom_captions(tmpdir, stand_ins):
    ok(DB_CAPTIONS.format(tmpdir=tmpdir), stand_ins)
    assert all(k.startswith("unet") for k in lora_keys(tmpdir))


def test_dreambooth_lora_sdxl_text_encoder_custom_captions(tmpdir, stand_ins):
    ok(DB_CAPTIONS.format(tmpdir=tmpdir) + " --train_text_encoder", stand_ins)
    assert {k.split(".")[0] for k in lora_keys(tmpdir)} == {"unet", "text_encoder", "text_encoder_2"}


def test_dreambooth_lora_sdxl_checkpointing_checkpoints_total_limit(runs, stand_ins):
    tmpdir = runs(DB_LORA_CKPT)
    load_and_sample(stand_ins[SDXL], tmpdir, 1)
    assert checkpoints(tmpdir) == {"checkpoint-4", "checkpoint-6"}


def test_dreambooth_lora_sdxl_text_encoder_checkpointing_checkpoints_total_limit(runs, stand_ins):
    tmpdir = runs(DB_LORA_TE_CKPT)
    load_and_sample(stand_ins[SDXL], tmpdir, 2)
    assert checkpoints(tmpdir) == {"checkpoint-4", "checkpoint-6"}


# -- examples/dreambooth/test_dreambooth_lora_edm.py: TestDreamBoothLoRASDXLWithEDM --------------------------------
EDM_CASES = {  # the objective itself is checked against a hand-computed EDM loss in tests/diffusion/test_edm.py
    "test_dreambooth_lora_sdxl_with_edm": f"--pretrained_model_name_or_path {SDXL} --do_edm_style_training",
    "test_dreambooth_lora_playground": f"--pretrained_model_name_or_path {PLAYGROUND}",
}


@pytest.mark.parametrize("case", sorted(EDM_CASES))
def test_dreambooth_lora_sdxl_edm(tmpdir, stand_ins, case, monkeypatch):
    from lowmem.diffusion import training

    real, calls = training.edm_loss, []

    def spy(*args, **kwargs):  # every step's loss is the EDM one, with the scheduler the script would use
        calls.append(type(args[1]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "edm_loss", spy)
    ok(f"""examples/dreambooth/train_dreambooth_lora_sdxl.py {EDM_CASES[case]} --instance_data_dir docs/source/en/imgs
        --instance_prompt photo {COMMON.format(tmpdir=tmpdir)} --max_train_steps 2""", stand_ins)
    keys = lora_keys(tmpdir)
    assert all("lora" in k for k in keys)
    assert all(k.startswith("unet") for k in keys)
    assert calls == ["EDMEulerScheduler" if "playground" in case else "DDPMScheduler"] * 2, calls
