"""`--precompute` of the SDXL commands (issue 33): text embeddings and VAE latents computed once before the UNet
trains, the models that made them out of the module while it trains, and the same training otherwise."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lowmem.diffusion.precompute import FeatureStore, TextEmbeddings, script_precompute
from lowmem.suite.cli import build_parser, main
from tests.diffusion.conftest import write_image


# -- the stores -------------------------------------------------------------------------------------------------
def test_feature_store_keeps_values_and_dtypes(tmp_path):
    g = torch.Generator().manual_seed(0)
    rows = [{"h": torch.randn(3, 5, generator=g).to(torch.bfloat16), "p": torch.randn(4, generator=g),
             "size": torch.randint(0, 2000, (2,), generator=g)} for _ in range(3)]
    store = FeatureStore(tmp_path / "s", 3)
    for i in (2, 0, 1):
        store.put(i, rows[i])
    with pytest.raises(RuntimeError, match="read before finish"):
        store.get(0)
    store.finish()
    for i, row in enumerate(rows):
        got = store.get(i)
        assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in row.items()}
        assert all(torch.equal(got[k], row[k]) for k in row)
    again = pickle.loads(pickle.dumps(store))  # what a DataLoader worker receives: the folder, reopened
    assert torch.equal(again.stack([2, 0])["h"], torch.stack([rows[2]["h"], rows[0]["h"]]))
    with pytest.raises(RuntimeError, match="read-only"):
        store.put(0, rows[0])


def test_feature_store_refuses_missing_rows_and_other_shapes(tmp_path):
    store = FeatureStore(tmp_path / "s", 2)
    store.put(0, {"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="x: row 1"):
        store.put(1, {"x": torch.zeros(4)})
    with pytest.raises(RuntimeError, match="1 of 2 rows were never written"):
        store.finish()


def test_text_embeddings_are_looked_up_by_token_ids(tmp_path):
    """Every distinct prompt once; a batch's rows by its ids, in batch order; an unknown prompt is loud."""
    def tokenize(p: str) -> list[torch.Tensor]:
        ids = torch.tensor([ord(c) for c in p[:6]] + [0] * (6 - len(p[:6])))
        return [ids, ids * 2]

    calls = []

    def encode(ids: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(ids[0].shape[0])
        return {"hidden": torch.stack([ids[0], ids[1]], dim=1).float(), "pooled": ids[0].float().sum(1, True)}

    emb = TextEmbeddings.build(tmp_path / "t", ["a dog", "", "a cat", "a dog"], tokenize, encode, batch=2)
    assert len(emb.index) == 3 and calls == [2, 1]
    batch = [torch.stack([tokenize(p)[e] for p in ("a cat", "a dog", "")]) for e in (0, 1)]
    got = emb.lookup(batch)
    assert torch.equal(got["hidden"], encode(batch)["hidden"]) and torch.equal(got["pooled"], encode(batch)["pooled"])
    with pytest.raises(KeyError, match="not pre-computed"):
        emb.lookup([torch.stack([tokenize("a bird")[e]]) for e in (0, 1)])


def test_auto_is_what_each_script_does():
    assert script_precompute("train_text_to_image_sdxl", False) == "both"
    assert script_precompute("train_dreambooth_lora_sdxl", False) == "text"
    assert script_precompute("train_dreambooth_lora_sdxl", True) == "none"
    assert script_precompute("train_text_to_image_lora_sdxl", False) == "none"


# -- runs on the tiny SDXL pipeline -----------------------------------------------------------------------------
class _Held(pl.Callback):
    """What the module holds while the UNet trains."""

    def __init__(self) -> None:
        self.seen: dict[str, bool] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.seen = {name: getattr(module, name) is not None for name in ("vae", "text_encoder", "text_encoder_2")}
        self.seen["latents_in_batch"] = "latents" in batch
        self.seen["store_files"] = module.precompute_dir is not None and any(module.precompute_dir.rglob("*.npy"))


def _fit(argv: list[str]) -> tuple[object, _Held]:
    from lowmem.recipes.diffusion.sdxl import fit_sdxl
    from lowmem.suite.commands.diffusion_sdxl import build_sdxl_config

    args = build_parser(["diffusion", argv[0]]).parse_args(["diffusion", *argv, "--resolution", "32",
                                                            "--report_to", "csv"])
    held = _Held()
    return fit_sdxl(build_sdxl_config(args), [held]), held


def _lora(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "pytorch_lora_weights.safetensors")


def test_precomputed_prompt_trains_as_the_text_encoders_do(tmp_path, sdxl_folder):
    """DreamBooth LoRA (auto: the instance prompt's embeddings once, as the script): the encoders are out of the
    module while the UNet trains, and the LoRA weights equal those of a run that encodes every step."""
    inst = tmp_path / "dog"
    for i in range(2):
        write_image(inst / f"{i}.png", size=(36, 36), seed=20 + i)
    args = ["train_dreambooth_lora_sdxl", "--pretrained_model_name_or_path", str(sdxl_folder), "--instance_data_dir",
            str(inst), "--instance_prompt", "a sks dog", "--train_batch_size", "2", "--max_train_steps", "2",
            "--learning_rate", "1e-2", "--lr_warmup_steps", "0", "--seed", "3",
            "--adam_epsilon", "1"]  # ~SGD: Adam's first step would turn last-bit differences into +-lr
    _, held = _fit([*args, "--output_dir", str(tmp_path / "cached")])
    assert held.seen == {"vae": True, "text_encoder": False, "text_encoder_2": False, "latents_in_batch": False,
                         "store_files": True}
    assert not list((tmp_path / "cached").glob(".precomputed*"))  # the cache is gone with the run
    _, held = _fit([*args, "--precompute", "none", "--output_dir", str(tmp_path / "encoded")])
    assert held.seen["text_encoder"] and held.seen["text_encoder_2"]
    a, b = _lora(tmp_path / "cached"), _lora(tmp_path / "encoded")
    assert a.keys() == b.keys()
    for k in a:  # fp32: the stored embeddings are the encoders' outputs for a batch of another size (last bits)
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-7)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in a.items() if "lora_B" in k or "lora.up" in k)


def test_precomputed_latents_resume_exactly_and_export(capsys, tmp_path, sdxl_folder, images):
    """train_text_to_image_sdxl (auto: embeddings and latents once, as the script): no VAE or text encoder in the
    module while the UNet trains, batches carry latents; 3 steps in one go equal 2 + resume from checkpoint-2
    bitwise; the final validation loads the dropped models again; the exported pipeline loads in diffusers."""
    from diffusers import StableDiffusionXLPipeline
    from safetensors.torch import load_file

    args = ["train_text_to_image_sdxl", "--pretrained_model_name_or_path", str(sdxl_folder), "--train_data_dir",
            str(images), "--train_batch_size", "2", "--max_train_steps", "3", "--checkpointing_steps", "2",
            "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--seed", "5", "--proportion_empty_prompts", "0.5"]
    whole = tmp_path / "whole"
    _, held = _fit([*args, "--output_dir", str(whole), "--validation_prompt", "a cat", "--num_validation_images",
                    "1"])
    assert held.seen == {"vae": False, "text_encoder": False, "text_encoder_2": False, "latents_in_batch": True,
                         "store_files": True}
    assert (whole / "validation" / "final.png").is_file()
    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    _fit([*args, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
    name = "unet/diffusion_pytorch_model.safetensors"
    a, b, base = load_file(whole / name), load_file(resumed / name), load_file(sdxl_folder / name)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], base[k]) for k in a)
    pipe = StableDiffusionXLPipeline.from_pretrained(whole)
    pipe(prompt="a cat", num_inference_steps=2, height=32, width=32, output_type="np")


@pytest.mark.parametrize(("extra", "needle"), [
    (["--precompute", "text", "--train_text_encoder"], "--precompute 'text': the text encoders train"),
    (["--precompute", "sometimes"], "--precompute must be one of auto, none, text, latents, both"),
])
def test_bad_precompute_is_one_line_exit_2(capsys, tmp_path, sdxl_folder, images, extra, needle):
    rc = main(["diffusion", "train_text_to_image_lora_sdxl", "--pretrained_model_name_or_path", str(sdxl_folder),
               "--train_data_dir", str(images), "--output_dir", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "o").exists()


def test_lora_base_streamed_into_gemini_trains_as_loaded_whole(tmp_path, sdxl_folder, caplog):
    """LoRA under a Gemini strategy: the UNet is built without weights and its frozen base streamed into Gemini's
    chunks on the NVMe tier (never whole in memory), the embeddings pre-computed; the LoRA file equals that of a
    run with the UNet loaded whole and no strategy, and diffusers loads it. Its checkpoint holds the adapters and
    their optimizer state but not the frozen base (nor the encoders): a resume from it reloads the base from the
    pipeline and ends with the same LoRA file (one step per epoch: the resume restarts no epoch half-way)."""
    import json
    import logging

    from diffusers import StableDiffusionXLPipeline

    from lowmem.diffusion.streaming import gemini_of

    inst = tmp_path / "dog"
    for i in range(2):
        write_image(inst / f"{i}.png", size=(36, 36), seed=30 + i)
    args = ["train_dreambooth_lora_sdxl", "--pretrained_model_name_or_path", str(sdxl_folder), "--instance_data_dir",
            str(inst), "--instance_prompt", "a sks dog", "--train_batch_size", "2", "--max_train_steps", "2",
            "--learning_rate", "1e-2", "--lr_warmup_steps", "0", "--seed", "4", "--adam_epsilon", "1"]
    gemini = ["--strategy", "gemini_nvme", "--offload_dir", str(tmp_path / "nvme")]
    with caplog.at_level(logging.INFO, logger="lowmem.diffusion.streaming"):
        module, held = _fit([*args, *gemini, "--checkpointing_steps", "1", "--output_dir", str(tmp_path / "streamed")])
    assert "UNet built without weights" in caplog.text
    assert gemini_of(module.unet) is not None and not held.seen["text_encoder"]
    index = json.loads((tmp_path / "streamed" / "checkpoint-1" / "trainer_state.ckpt" / "index.json").read_text())
    base = {f"unet.{n}" for n, p in module.unet.named_parameters() if not p.requires_grad}
    assert base and base <= set(index["frozen_omitted"]) and not base & set(index["model_keys"])
    assert index["params"] and all("lora" in n for n in index["params"])
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "streamed" / "checkpoint-1", resumed / "checkpoint-1")
    _fit([*args, *gemini, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])
    _fit([*args, "--output_dir", str(tmp_path / "whole")])
    a, b, c = _lora(tmp_path / "streamed"), _lora(tmp_path / "whole"), _lora(resumed)
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-7)
        assert torch.equal(a[k], c[k]), k
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_folder)
    pipe.load_lora_weights(tmp_path / "streamed")
    assert set(pipe.get_list_adapters()) == {"unet"}
