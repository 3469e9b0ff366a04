"""The fine-tune streams the UNet with Gemini (issue 18): loaded hollow and filled by Gemini's setup, the frozen
encoders in the training dtype, `checkpoint-N/unet` and the export written chunk by chunk; the files are what
the gathered weights give with `save_pretrained`, and the base's other components are copied unchanged."""

from __future__ import annotations

import pytest
import torch

from lowmem.diffusion.config import FineTuneConfig

pl = pytest.importorskip("lightning.pytorch")

FAST = dict(resolution=32, report_to="csv", max_train_steps=2, checkpointing_steps=2, mixed_precision="bf16")


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory):
    from lowmem.diffusion.tiny import save_tiny_sd_pipeline

    return save_tiny_sd_pipeline(tmp_path_factory.mktemp("sd") / "base")


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class SeesTheLoad(pl.Callback):
    """Records, when fitting starts, whether the UNet was still hollow before setup and the encoders' dtypes."""

    def setup(self, trainer, module, stage):
        from lowmem.core_parallel.gemini.lazy import is_hollow

        self.hollow = all(is_hollow(p) for p in module.unet.parameters())
        self.dtypes = {p.dtype for m in (module.vae, module.text_encoder) for p in m.parameters()}


@pytest.mark.parametrize("strategy", ["gemini", "auto"])
def test_finetune_streams_the_unet_with_gemini_only(tmp_path, sd_folder, strategy):
    from diffusers import UNet2DConditionModel

    from lowmem.recipes.diffusion import fit_finetune, materialize

    out = tmp_path / "out"
    cfg = FineTuneConfig(pretrained_model_name_or_path=str(sd_folder), output_dir=str(out), strategy=strategy,
                         **FAST)
    seen = SeesTheLoad()
    module = fit_finetune(cfg, [seen], enable_progress_bar=False)
    assert seen.hollow is (strategy == "gemini")
    assert seen.dtypes == {torch.bfloat16}  # loaded in the training dtype
    # the streamed files equal save_pretrained of the gathered final weights, byte for byte
    want = materialize(module, ("unet",))["unet"]
    want.save_pretrained(tmp_path / "want", safe_serialization=True)
    ref = _files(tmp_path / "want")
    for folder in (out / "unet", out / "checkpoint-2" / "unet"):
        assert _files(folder) == ref, folder
    got = UNet2DConditionModel.from_pretrained(out, subfolder="unet").state_dict()
    base = UNet2DConditionModel.from_pretrained(sd_folder, subfolder="unet").state_dict()
    assert any(not torch.equal(got[k], base[k]) for k in base)  # trained
    exported, base_files = _files(out), _files(sd_folder)
    for key, data in base_files.items():
        if not key.startswith("unet/"):
            assert exported[key] == data, key
    assert not any(p.name.startswith((".trained-", ".export-")) for p in out.iterdir())
