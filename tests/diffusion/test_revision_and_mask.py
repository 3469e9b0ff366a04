"""diffusers' `--non_ema_revision` (train_text_to_image) and `--text_encoder_use_attention_mask` (train_dreambooth)
(issue 19): the trained UNet starts from the non-EMA revision and its EMA from --revision, both read from the local
Hugging Face cache; a missing revision is one line before any model is loaded; the text encoder gets the
tokenizer's attention mask in training with the flag, and only then."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lowmem.diffusion.config import FineTuneConfig
from lowmem.diffusion.errors import InputError
from tests.diffusion.conftest import write_image

pl = pytest.importorskip("lightning.pytorch")

REPO = "tester/tiny-sd"
MAIN, NON_EMA = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """A Hugging Face hub cache holding `tester/tiny-sd` at two revisions: `main` (EMA weights, seed 0) and
    `non-ema` (other UNet weights, seed 1), laid out as huggingface_hub writes it (refs/ -> snapshots/<commit>/)."""
    from lowmem.diffusion.tiny import TinyPipelineConfig, save_tiny_sd_pipeline

    cache = tmp_path_factory.mktemp("hf") / "hub"
    repo = cache / ("models--" + REPO.replace("/", "--"))
    for ref, commit, seed in (("main", MAIN, 0), ("non-ema", NON_EMA, 1)):
        save_tiny_sd_pipeline(repo / "snapshots" / commit, TinyPipelineConfig(seed=seed))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return cache


def _unet(cache: Path, commit: str):
    from diffusers import UNet2DConditionModel

    snap = cache / ("models--" + REPO.replace("/", "--")) / "snapshots" / commit
    return UNet2DConditionModel.from_pretrained(snap, subfolder="unet")


def _same(params, ref_params) -> bool:
    return all(torch.equal(a.detach().float().cpu(), b.detach().float()) for a, b in zip(params, ref_params))


def test_non_ema_revision_starts_the_unet_and_the_ema_from_two_revisions(hub_cache, tmp_path):
    from lowmem.recipes.diffusion import StableDiffusionFineTune

    main_unet, non_ema_unet = _unet(hub_cache, MAIN), _unet(hub_cache, NON_EMA)
    assert not _same(main_unet.parameters(), non_ema_unet.parameters())  # the two revisions differ
    common = dict(pretrained_model_name_or_path=REPO, cache_dir=str(hub_cache), output_dir=str(tmp_path))

    module = StableDiffusionFineTune(FineTuneConfig(use_ema=True, non_ema_revision="non-ema", **common))
    assert _same(module.unet.parameters(), non_ema_unet.parameters())
    assert _same(module.ema.shadow, main_unet.parameters())
    assert module.base_source.name == MAIN  # the untrained components (and the export's copies) from --revision

    # the EMA still tracks the trained UNet: its first update (decay 0, as diffusers' EMAModel) copies it
    module.ema.update()
    assert _same(module.ema.shadow, non_ema_unet.parameters())

    # --non_ema_revision given as a commit, --revision as a ref; without use_ema the UNet still comes from it
    module = StableDiffusionFineTune(FineTuneConfig(non_ema_revision=NON_EMA, revision="main", **common))
    assert module.ema is None and _same(module.unet.parameters(), non_ema_unet.parameters())

    # without the flag both start from --revision (diffusers: non_ema_revision defaults to revision)
    module = StableDiffusionFineTune(FineTuneConfig(use_ema=True, **common))
    assert _same(module.unet.parameters(), main_unet.parameters())
    assert _same(module.ema.shadow, main_unet.parameters())


def test_missing_non_ema_revision_is_one_line_before_any_model_loads(hub_cache, tmp_path, image_folder, capsys,
                                                                      monkeypatch):
    import lowmem.diffusion.models as models
    from lowmem.recipes.diffusion import check_run
    from lowmem.suite.cli import main

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_components", no_loading)
    out = tmp_path / "out"
    argv = ["diffusion", "train_text_to_image", f"--pretrained_model_name_or_path={REPO}",
            f"--cache_dir={hub_cache}", f"--train_data_dir={image_folder}", f"--output_dir={out}", "--use_ema",
            "--non_ema_revision=no-such-branch", "--max_train_steps=1"]
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    errors = [x for x in capsys.readouterr().err.splitlines() if ": error:" in x]
    assert rc == 2 and len(errors) == 1, errors
    assert "--non_ema_revision no-such-branch" in errors[0] and REPO in errors[0]
    assert not out.exists() or not any(out.rglob("*.safetensors"))

    # a local folder or the tiny pipeline has no revisions
    with pytest.raises(InputError, match="--non_ema_revision applies to hub ids"):
        check_run(FineTuneConfig(pretrained_model_name_or_path=str(image_folder), non_ema_revision="x"))
    with pytest.raises(InputError, match="tiny built-in pipeline"):
        check_run(FineTuneConfig(non_ema_revision="x"))


# -- --text_encoder_use_attention_mask ---------------------------------------------------------------------------
def _dataset(tiny, use_mask: bool, image: Path = Path("x.png")):
    from lowmem.diffusion.data import CaptionedImages, ImageRecord

    cfg = FineTuneConfig(text_encoder_use_attention_mask=use_mask).data_config()
    return CaptionedImages([ImageRecord(image, "a red circle", "test")], tiny["tokenizer"], cfg)


def test_attention_mask_reaches_the_text_encoder(tiny, tmp_path):
    from lowmem.recipes.diffusion import StableDiffusionFineTune

    ids, mask = _dataset(tiny, True).tokens("a red circle")
    assert 0 < int(mask.sum()) < mask.numel()  # a padded prompt
    ids, mask = ids[None], mask[None]
    te = tiny["text_encoder"]
    with torch.no_grad():
        direct = te(ids, attention_mask=mask)[0]
        plain = te(ids)[0]
        masked_module = StableDiffusionFineTune(FineTuneConfig(text_encoder_use_attention_mask=True),
                                                components=tiny)
        got = masked_module.encode_prompt(ids, mask)
        unmasked = StableDiffusionFineTune(FineTuneConfig(), components=tiny).encode_prompt(ids, mask)
    assert torch.equal(got, direct)
    assert torch.equal(unmasked, plain)  # without the flag the mask is not passed, as diffusers' encode_prompt
    assert not torch.allclose(got, plain)  # the mask changes the embeddings (at the padding)

    # the data items carry the mask only with the flag
    write_image(tmp_path / "x.png")
    for use_mask in (False, True):
        data = _dataset(tiny, use_mask, tmp_path / "x.png")
        item = data[0]
        assert ("attention_mask" in item) is use_mask
        if use_mask:
            assert torch.equal(item["attention_mask"], mask[0]) and torch.equal(item["input_ids"], ids[0])


class RecordMasks(pl.Callback):
    """Records the attention_mask every text-encoder call of training gets."""

    def __init__(self) -> None:
        self.masks: list = []

    def on_train_start(self, trainer, module):
        forward = module.text_encoder.forward

        def spy(*args, **kwargs):
            self.masks.append(kwargs.get("attention_mask"))
            return forward(*args, **kwargs)

        module.text_encoder.forward = spy


@pytest.mark.parametrize("use_mask", [True, False])
def test_training_step_consumes_the_mask(tmp_path, use_mask):
    """DreamBooth with prior preservation: instance and class prompts' masks go to the text encoder together."""
    from lowmem.recipes.diffusion import fit_finetune

    for i in range(2):
        write_image(tmp_path / "inst" / f"{i}.png", size=(40, 40), seed=i)
        write_image(tmp_path / "class" / f"{i}.png", size=(40, 40), seed=5 + i)
    cfg = FineTuneConfig(output_dir=str(tmp_path / "out"), instance_data_dir=str(tmp_path / "inst"),
                         instance_prompt="a photo of sks shape", class_data_dir=str(tmp_path / "class"),
                         class_prompt="a shape", with_prior_preservation=True, num_class_images=2,
                         max_train_steps=1, checkpointing_steps=5, resolution=32, report_to="csv",
                         text_encoder_use_attention_mask=use_mask)
    recorder = RecordMasks()
    fit_finetune(cfg, [recorder], enable_progress_bar=False)
    assert len(recorder.masks) == 1
    mask = recorder.masks[0]
    if not use_mask:
        assert mask is None
        return
    assert mask.shape == (2, 77)  # instance then class prompt
    lengths = mask.sum(dim=1).tolist()
    assert lengths[0] > lengths[1] > 0 and mask[:, -1].eq(0).all()
