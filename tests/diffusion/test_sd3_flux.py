"""`suite diffusion train_dreambooth_{,lora_}{sd3,flux}` (issue 46): the scripts' flags against pinned copies of
diffusers v0.40.0's argparse (tests/assets/diffusers_flags/train_dreambooth_*{sd3,flux}.json), the flow-matching
loss and each weighting scheme against a hand-computed float64 reference, exact resume, and the tiny SD3 / Flux
runs under Gemini with its NVMe tier equal to the plain loop."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from lowmem.diffusion.config import FineTuneConfig
from lowmem.diffusion.errors import InputError
from lowmem.diffusion.flow import (
    WEIGHTING_SCHEMES,
    flow_loss,
    flux_forward,
    loss_weighting,
    noisy_input,
    schedule_points,
    sd3_forward,
    timestep_density,
)
from lowmem.diffusion.flow_scripts import FLOW_SCRIPT_FLAGS, FlowSettings, flow_handling, flow_script_config
from lowmem.diffusion.scripts import DIFFUSERS_VERSION, Accept, Refuse
from lowmem.diffusion.sdxl_scripts import SDXLSettings
from lowmem.suite.cli import build_parser, main

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "diffusers_flags"
SCRIPTS = tuple(FLOW_SCRIPT_FLAGS)


# -- the pinned flag tables -------------------------------------------------------------------------------------
def _subparser(script: str) -> argparse.ArgumentParser:
    parser = build_parser(["diffusion", script])
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["diffusion"]
    return next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[script]


def _table_problems(script: str, table: dict) -> list[str]:
    """What differs between a script's pinned flags and `suite diffusion <script>`, and flags neither accepted
    nor refused with a reason."""
    actions = {a.option_strings[0]: a for a in _subparser(script)._actions if a.option_strings}
    fields = {*FineTuneConfig.field_names(), *(f.name for c in (SDXLSettings, FlowSettings)
                                               for f in dataclasses.fields(c))}
    problems = []
    for row in table["flags"]:
        flag, name = row["flag"], row["flag"][2:]
        try:
            how = flow_handling(script, name)
        except KeyError:
            how = None
        if not (isinstance(how, Accept) or (isinstance(how, Refuse) and how.reason.strip())):
            problems.append(f"{flag}: neither accepted nor refused with a reason")
        if isinstance(how, Accept) and how.to is None and name not in fields:
            problems.append(f"{flag}: accepted as a field that does not exist")
        a = actions.get(flag)
        if a is None:
            problems.append(f"{flag}: not a flag of suite diffusion {script}")
            continue
        store_true = isinstance(a, argparse._StoreTrueAction)
        got = {"default": a.default, "required": a.required, "choices": list(a.choices) if a.choices else None,
               "nargs": None if store_true else a.nargs, "action": "store_true" if store_true else None,
               "type": None if store_true else getattr(a.type, "__name__", None)}
        want = {"default": row["default"], "required": row.get("required", False), "choices": row.get("choices"),
                "nargs": row.get("nargs"), "action": row.get("action"), "type": row.get("type")}
        problems += [f"{flag}: {k} {got[k]!r} here, {want[k]!r} in diffusers" for k in want
                     if got[k] != want[k] or type(got[k]) is not type(want[k])]
    return problems


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_is_offered_with_the_scripts_default(script):
    table = json.loads((ASSETS / f"{script}.json").read_text())
    assert table["diffusers_version"] == DIFFUSERS_VERSION
    assert [f.name for f in FLOW_SCRIPT_FLAGS[script]] == [r["flag"][2:] for r in table["flags"]]
    problems = _table_problems(script, table)
    assert not problems, "\n".join(problems)


def test_a_flag_neither_accepted_nor_refused_is_found():
    table = json.loads((ASSETS / "train_dreambooth_lora_flux.json").read_text())
    table["flags"].append({"flag": "--brand_new_flag", "default": None, "type": "str"})
    assert _table_problems("train_dreambooth_lora_flux", table) == [
        "--brand_new_flag: neither accepted nor refused with a reason",
        "--brand_new_flag: not a flag of suite diffusion train_dreambooth_lora_flux"]


SAMPLES = {"adam_beta1": 0.8, "adam_beta2": 0.99, "lr_scheduler": "cosine", "report_to": "csv",
           "image_interpolation_mode": "bicubic", "resolution": 64, "mixed_precision": "bf16",
           "prior_generation_precision": "bf16", "resume_from_checkpoint": "latest", "optimizer": "adamw",
           "weighting_scheme": "cosmap", "lora_layers": "attn.to_q", "lora_blocks": "0", "precondition_outputs": 0}
NEEDS = {"with_prior_preservation": {"class_data_dir": "cls", "class_prompt": "a dog"},
         "dataset_name": {"instance_data_dir": None}}
# accepted, and by design without effect on the settings (said in their --help)
NO_EFFECT = {"optimizer", "prodigy_beta3", "prodigy_decouple", "prodigy_safeguard_warmup",
             "prodigy_use_bias_correction", "upcast_before_saving"}


def _sample(flag) -> object:
    if flag.name in SAMPLES:
        return SAMPLES[flag.name]
    if flag.action == "store_true":
        return True
    if flag.type is bool:
        return not flag.default
    if flag.type is int:
        return (flag.default or 0) + 3
    if flag.type is float:
        return (flag.default or 0) + 0.25
    return f"given-{flag.name}"


def _settings(cfg) -> dict:
    return {**dataclasses.asdict(cfg), "flow": dataclasses.asdict(cfg.extra["flow"])}


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_flag_is_silently_ignored(script):
    """An accepted flag given with another value changes the run's settings (or says it needs not); a refused one
    stops with one line naming the flag, before anything loads."""
    defaults = {f.name: f.default for f in FLOW_SCRIPT_FLAGS[script]}
    required = {"pretrained_model_name_or_path": "base", "instance_data_dir": "inst", "instance_prompt": "a sks dog"}
    problems = []
    for flag in FLOW_SCRIPT_FLAGS[script]:
        if flag.required:
            continue
        needs = NEEDS.get(flag.name, {})
        if flag.name in ("text_encoder_lr", "adam_weight_decay_text_encoder"):
            needs = {"train_text_encoder": True}
        values = {**defaults, **required, **needs, flag.name: _sample(flag)}
        if isinstance(flow_handling(script, flag.name), Refuse):
            with pytest.raises(InputError) as err:
                flow_script_config(script, values)
            assert f"--{flag.name}:" in str(err.value) and "\n" not in str(err.value)
            continue
        try:  # the settings without the flag, with what it needs beside it
            reference = _settings(flow_script_config(script, {**values, flag.name: flag.default}))
        except InputError:  # what it needs is not a run without it (--dataset_name in place of --instance_data_dir)
            reference = _settings(flow_script_config(script, {**defaults, **required}))
        if _settings(flow_script_config(script, values)) == reference and flag.name not in NO_EFFECT:
            problems.append(f"--{flag.name}: accepted but changes nothing")
    assert not problems, "\n".join(problems)


def test_lora_targets_follow_the_scripts():
    sd3, flux = FlowSettings(family="sd3"), FlowSettings(family="flux")
    assert len(sd3.lora_targets()) == 8 and "ff.net.2" in flux.lora_targets() and len(flux.lora_targets()) == 12
    assert FlowSettings(lora_layers="attn.to_k, attn.to_v", lora_blocks="1,3").lora_targets() == [
        "transformer_blocks.1.attn.to_k", "transformer_blocks.1.attn.to_v", "transformer_blocks.3.attn.to_k",
        "transformer_blocks.3.attn.to_v"]


# -- the math, against diffusers' functions and a hand-computed float64 reference ---------------------------------
@pytest.mark.parametrize("scheme", WEIGHTING_SCHEMES)
def test_density_and_weighting_are_diffusers(scheme):
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

    ours = timestep_density(scheme, 64, torch.Generator().manual_seed(3), logit_mean=0.2, logit_std=0.9,
                            mode_scale=1.1)
    theirs = compute_density_for_timestep_sampling(scheme, 64, 0.2, 0.9, 1.1,
                                                   generator=torch.Generator().manual_seed(3))
    assert torch.equal(ours, theirs) and ((ours >= 0) & (ours < 1)).all()
    sigmas = torch.rand(64, 1, 1, 1, generator=torch.Generator().manual_seed(4)).clamp_min(1e-3)
    assert torch.equal(loss_weighting(scheme, sigmas), compute_loss_weighting_for_sd3(scheme, sigmas))


def _hand_sigma(u: float, shift: float) -> tuple[float, float]:
    """(timestep, sigma) of a draw u on FlowMatchEulerDiscreteScheduler(shift)'s training schedule, by hand: the
    timesteps 1000, 999, ..., 1; index int(1000 u); sigma shift * x / (1 + (shift - 1) x) of x = t / 1000."""
    x = (1000 - int(u * 1000)) / 1000
    s = shift * x / (1 + (shift - 1) * x)
    return 1000 * s, s


def _hand_weight(scheme: str, s: float) -> float:
    return {"sigma_sqrt": s ** -2.0, "cosmap": 2 / (math.pi * (1 - 2 * s + 2 * s * s))}.get(scheme, 1.0)


@pytest.mark.parametrize("precondition", [False, True])
@pytest.mark.parametrize("scheme", WEIGHTING_SCHEMES)
def test_sd3_loss_against_a_hand_computed_reference(scheme, precondition):
    """One batch of 4 (2 instance + 2 class images, prior preservation) through a tiny SD3 transformer in float64:
    the recipe's schedule, noisy input, forward and loss against the same computed element by element."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    torch.manual_seed(0)
    tr = SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
                               num_attention_heads=2, caption_projection_dim=16, joint_attention_dim=16,
                               pooled_projection_dim=8, out_channels=4).double().eval()
    g = torch.Generator().manual_seed(1)
    x0, x1 = torch.randn(4, 4, 8, 8, generator=g, dtype=torch.float64), torch.randn(4, 4, 8, 8, generator=g,
                                                                                      dtype=torch.float64)
    cond = {"hidden": torch.randn(4, 5, 16, generator=g, dtype=torch.float64),
            "pooled": torch.randn(4, 8, generator=g, dtype=torch.float64)}
    u = timestep_density(scheme, 4, torch.Generator().manual_seed(2))
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    t, s = schedule_points(sched, u)
    noisy = noisy_input(x0, x1, s.double())
    pred = sd3_forward(tr, noisy, t.double(), cond)
    got = flow_loss(pred, x0, x1, s.double(), weighting_scheme=scheme, precondition_outputs=precondition,
                    prior_preservation=True, prior_loss_weight=0.7)
    per = []
    for i in range(4):
        ti, si = _hand_sigma(float(u[i]), 3.0)
        assert float(t[i]) == pytest.approx(ti, rel=1e-6) and float(s[i]) == pytest.approx(si, rel=1e-6)
        xs = (1 - si) * x0[i] + si * x1[i]
        p = tr(hidden_states=xs[None], timestep=torch.tensor([ti], dtype=torch.float64),
               encoder_hidden_states=cond["hidden"][i:i + 1], pooled_projections=cond["pooled"][i:i + 1],
               return_dict=False)[0][0]
        p, target = (p * -si + xs, x0[i]) if precondition else (p, x1[i] - x0[i])
        per.append(_hand_weight(scheme, si) * float(((p - target) ** 2).mean()))
    want = (per[0] + per[1]) / 2 + 0.7 * (per[2] + per[3]) / 2
    assert float(got) == pytest.approx(want, rel=1e-5)  # the schedule's sigmas are float32


def test_flux_forward_packs_as_the_pipeline_does():
    """Flux's forward on packed 2x2 patches with their positions, zero text ids and the guidance embedding, against
    the patches packed by hand (float64)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    tr = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                pooled_projection_dim=8, axes_dims_rope=(2, 2, 4), guidance_embeds=True).double()
    g = torch.Generator().manual_seed(1)
    noisy = torch.randn(2, 4, 6, 4, generator=g, dtype=torch.float64)
    cond = {"hidden": torch.randn(2, 3, 16, generator=g, dtype=torch.float64),
            "pooled": torch.randn(2, 8, generator=g, dtype=torch.float64)}
    t = torch.tensor([700.0, 250.0], dtype=torch.float64)
    got = flux_forward(tr, noisy, t, cond, guidance_scale=3.5)
    # by hand: token (r, c) of the 3x2 grid holds the channels of pixels (2r + i, 2c + j), channel-major
    packed = torch.stack([noisy[:, :, 2 * r:2 * r + 2, 2 * c:2 * c + 2].reshape(2, 4, 4).flatten(1)
                          for r in range(3) for c in range(2)], 1)
    ids = torch.tensor([[0, r, c] for r in range(3) for c in range(2)], dtype=torch.float64)
    out = tr(hidden_states=packed, timestep=t / 1000, guidance=torch.full((2,), 3.5, dtype=torch.float64),
             pooled_projections=cond["pooled"], encoder_hidden_states=cond["hidden"],
             txt_ids=torch.zeros(3, 3, dtype=torch.float64), img_ids=ids, return_dict=False)[0]
    want = torch.zeros_like(noisy)
    for k, (r, c) in enumerate((r, c) for r in range(3) for c in range(2)):
        want[:, :, 2 * r:2 * r + 2, 2 * c:2 * c + 2] = out[:, k].view(2, 4, 2, 2)
    assert torch.allclose(got, want, atol=1e-12)


# -- runs on the tiny pipelines ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(flow_folders) -> dict[str, Path]:
    return flow_folders  # conftest's tiny SD3/Flux pipelines and instance images


def _run(capsys, script: str, folders: dict[str, Path], out: Path, *extra: str) -> list[float]:
    """One run; its per-step losses (the CSV log of this run)."""
    family = "flux" if script.endswith("flux") else "sd3"
    rc = main(["diffusion", script, "--pretrained_model_name_or_path", str(folders[family]), "--instance_data_dir",
               str(folders["inst"]), "--instance_prompt", "a sks dog", "--resolution", "32", "--train_batch_size",
               "2", "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--max_sequence_length", "8",
               "--report_to", "csv", "--output_dir", str(out), *extra])
    err = capsys.readouterr().err
    assert rc == 0, "\n".join(err.splitlines()[-15:])
    logs = sorted((out / "logs").glob("csv*/metrics.csv"), key=lambda p: p.stat().st_mtime)
    rows = list(csv.DictReader(logs[-1].open()))
    return [float(r["train_loss"]) for r in rows if r.get("train_loss")]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.parametrize(("script", "extra"), [
    ("train_dreambooth_lora_sd3", ("--cache_latents", "--weighting_scheme", "sigma_sqrt")),
    ("train_dreambooth_flux", ("--guidance_scale", "2.0")),
])
def test_gemini_nvme_equals_the_plain_loop(capsys, tmp_path, folders, script, extra, monkeypatch):
    """The same 2 steps under --strategy gemini_nvme (the trained weights and their optimizer state on NVMe; the
    transformer built without weights and streamed into the shards) and plain: equal losses and trained weights
    within fp32 tolerance; the result loads in diffusers and generates."""
    from diffusers import DiffusionPipeline

    import lowmem.diffusion.flow_stream as flow_stream

    built, hollow = [], flow_stream.hollow_transformer
    monkeypatch.setattr(flow_stream, "hollow_transformer", lambda *a, **k: built.append(hollow(*a, **k)) or built[-1])
    args = ["--max_train_steps", "2", *extra]
    plain = _run(capsys, script, folders, tmp_path / "plain", *args)
    assert built == []  # nothing streams without Gemini
    gemini = _run(capsys, script, folders, tmp_path / "gemini", *args, "--strategy", "gemini_nvme", "--offload_dir",
                  str(tmp_path / "nvme"))
    assert len(built) == 1 and built[0] is not None
    assert len(plain) == 2 and all(math.isfinite(v) for v in plain)
    assert gemini == pytest.approx(plain, rel=1e-5, abs=1e-6)
    lora = "lora" in script
    name = "pytorch_lora_weights.safetensors" if lora else "transformer/diffusion_pytorch_model.safetensors"
    a, b = _tensors(tmp_path / "plain" / name), _tensors(tmp_path / "gemini" / name)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
    family = "flux" if script.endswith("flux") else "sd3"
    pipe = DiffusionPipeline.from_pretrained(folders[family] if lora else tmp_path / "gemini")
    if lora:
        pipe.load_lora_weights(tmp_path / "gemini")
    image = pipe("a sks dog", num_inference_steps=1, height=32, width=32, max_sequence_length=8,
                 output_type="np").images[0]
    assert image.shape == (32, 32, 3) and torch.isfinite(torch.from_numpy(image)).all()


def test_prior_preservation_and_validation_images(capsys, tmp_path, folders, monkeypatch):
    """train_dreambooth_lora_flux --with_prior_preservation: the missing class images are generated by the Flux
    pipeline, a step trains on instance and class images (their embeddings pre-computed with the instance
    prompt's), and the validation images are written (2 denoising steps instead of the scripts' 28: time)."""
    import lowmem.diffusion.flow_scripts as flow_scripts

    monkeypatch.setattr(flow_scripts, "_FIXED", {"num_inference_steps": 2})
    losses = _run(capsys, "train_dreambooth_lora_flux", folders, tmp_path / "out", "--max_train_steps", "1",
                  "--with_prior_preservation", "--class_data_dir", str(tmp_path / "class"), "--class_prompt", "a dog",
                  "--num_class_images", "2", "--sample_batch_size", "2", "--validation_prompt", "a sks dog",
                  "--num_validation_images", "1")
    assert len(losses) == 1 and math.isfinite(losses[0])
    assert sorted(p.name for p in (tmp_path / "class").iterdir()) == ["class-00000.png", "class-00001.png"]
    assert (tmp_path / "out" / "validation" / "final.png").is_file()
    assert not list((tmp_path / "out").glob(".precomputed-*"))  # the pre-computed files are removed at the end


@pytest.mark.parametrize(("script", "extra"), [
    ("train_dreambooth_lora_flux", ("--train_text_encoder", "--text_encoder_lr", "2e-3", "--weighting_scheme", "mode",
                                    "--lora_dropout", "0.3")),
    ("train_dreambooth_sd3", ()),
])
def test_resumes_exactly(capsys, tmp_path, folders, script, extra):
    """3 steps in one go; 2 + resume from our checkpoint-2 (LoRA: the third step's loss and the weights equal);
    2 + resume from accelerate's checkpoint-2 as the scripts write it (the save hook's `transformer/` or LoRA file,
    optimizer.bin, scheduler.bin, random_states_0.pkl): the weights equal."""
    from tests.diffusion.conftest import as_accelerate

    args = ["--checkpointing_steps", "2", "--max_train_steps", "3", "--seed", "5", *extra]
    whole = _run(capsys, script, folders, tmp_path / "whole", *args)
    if "lora" in script:  # our own checkpoint
        shutil.copytree(tmp_path / "whole" / "checkpoint-2", tmp_path / "own" / "checkpoint-2")
        resumed = _run(capsys, script, folders, tmp_path / "own", *args, "--resume_from_checkpoint", "latest")
        assert len(whole) == 3 and resumed == whole[2:], (whole, resumed)
        a, b = (_tensors(d / "pytorch_lora_weights.safetensors") for d in (tmp_path / "whole", tmp_path / "own"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ckpt = tmp_path / "resumed" / "checkpoint-2"
    as_accelerate(tmp_path / "whole" / "checkpoint-2", ckpt)
    if "lora" not in script:
        shutil.copytree(tmp_path / "whole" / "checkpoint-2" / "transformer", ckpt / "transformer")
    _run(capsys, script, folders, tmp_path / "resumed", *args, "--resume_from_checkpoint", "latest")
    name = "pytorch_lora_weights.safetensors" if "lora" in script else "transformer/diffusion_pytorch_model.safetensors"
    a, b = _tensors(tmp_path / "whole" / name), _tensors(tmp_path / "resumed" / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if "lora" in script:
        assert {k.split(".")[0] for k in a} == {"transformer", "text_encoder"}


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_t5_streams_block_by_block(folders, family):
    """T5 (SD3's and Flux's 4.7B T5-XXL at real size) encodes the prompts block by block from its safetensors: the
    same outputs as the encoder loaded whole, and no weights held before, between or after its forwards."""
    from transformers import T5EncoderModel

    from lowmem.diffusion.flow_stream import streamed_encoder

    sub = folders[family] / ("text_encoder_3" if family == "sd3" else "text_encoder_2")
    whole = T5EncoderModel.from_pretrained(sub).eval().requires_grad_(False)
    streamed = streamed_encoder(sub, T5EncoderModel)
    held = []

    def count(*_) -> None:
        held.append(sum(p.untyped_storage().nbytes() for p in streamed.parameters()))

    streamed.encoder.block[1].register_forward_pre_hook(count)  # after the block's weights were read
    ids = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        assert torch.equal(streamed(ids)[0], whole(ids)[0])
        assert sum(p.untyped_storage().nbytes() for p in streamed.parameters()) == 0
    block = sum(p.numel() * p.element_size() for p in streamed.encoder.block[1].parameters())
    assert held == [block, block]  # while block 1 runs, only its own weights are in memory
