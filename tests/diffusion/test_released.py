"""`diffusion.released`: pipeline folders at the released sizes, written module by module. Checked on the same code
path with the configs scaled down: sharded safetensors with an index, read strictly by diffusers' and transformers'
`from_pretrained` and by our streaming loaders, values that depend on the seed only, a pipeline that generates."""

from __future__ import annotations

import json

import pytest
import torch

from lowmem.diffusion.released import RELEASED, write_released_pipeline

_CLIP = dict(vocab_size=1000, hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
             max_position_embeddings=77, hidden_act="gelu", projection_dim=32)
_T5 = dict(RELEASED["flux.1-dev"]["text_encoder_2"], vocab_size=1000, d_model=32, d_kv=8, d_ff=37, num_layers=2,
           num_heads=4, relative_attention_num_buckets=8)
_VAE = dict(RELEASED["flux.1-dev"]["vae"], block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, sample_size=32)
_UNET = dict(RELEASED["sdxl-base-1.0"]["unet"], sample_size=16, block_out_channels=(32, 64),
             down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
             up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
             attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2), cross_attention_dim=64,
             addition_time_embed_dim=8, projection_class_embeddings_input_dim=80)
SMALL = {
    "sdxl-base-1.0": dict(RELEASED["sdxl-base-1.0"], text_encoder=_CLIP, text_encoder_2=_CLIP, unet=_UNET,
                          vae=dict(_VAE, latent_channels=4, use_quant_conv=True, use_post_quant_conv=True)),
    "sd3.5-medium": dict(RELEASED["sd3.5-medium"], text_encoder=_CLIP, text_encoder_2=_CLIP, text_encoder_3=_T5,
                         vae=_VAE, transformer=dict(RELEASED["sd3.5-medium"]["transformer"], sample_size=16,
                                                    num_layers=2, attention_head_dim=8, num_attention_heads=4,
                                                    joint_attention_dim=32, caption_projection_dim=32,
                                                    pooled_projection_dim=64, pos_embed_max_size=32,
                                                    dual_attention_layers=(0,))),
    "flux.1-dev": dict(RELEASED["flux.1-dev"], text_encoder=_CLIP, text_encoder_2=_T5, vae=_VAE,
                       transformer=dict(RELEASED["flux.1-dev"]["transformer"], in_channels=64, num_layers=1,
                                        num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                                        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))),
}


def _pipeline_class(name):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline, StableDiffusionXLPipeline

    return {"sd3": StableDiffusion3Pipeline, "flu": FluxPipeline, "sdx": StableDiffusionXLPipeline}[name[:3]]


@pytest.mark.parametrize("name", list(RELEASED))
def test_written_folder_loads_strictly_and_generates(name, tmp_path):
    folder = write_released_pipeline(tmp_path / "a", name, configs=SMALL[name], shard_bytes=20_000)
    slot = "unet" if name.startswith("sdxl") else "transformer"
    index = json.loads((folder / slot / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((folder / slot / f).is_file() for f in shards)
    pipe = _pipeline_class(name).from_pretrained(folder, torch_dtype=torch.float32)
    for enc in (d for d in folder.iterdir() if d.name.startswith("text_encoder")):  # diffusers' scripts read it
        config = json.loads((enc / "config.json").read_text())
        assert config["architectures"] == [type(getattr(pipe, enc.name)).__name__]
    # every tensor the model has came from the files: its parameters equal what the files hold, none left at init
    from safetensors.torch import load_file

    files = {k: v for f in shards for k, v in load_file(folder / slot / f).items()}
    state = getattr(pipe, slot).state_dict()
    assert set(files) == set(state), set(files) ^ set(state)
    assert all(torch.equal(state[k].to(v.dtype), v) for k, v in files.items())
    dtype = getattr(torch, RELEASED[name]["dtype"])
    assert all(v.dtype == dtype for v in files.values() if v.is_floating_point())
    extra = {} if name.startswith("sdxl") else {"max_sequence_length": 16}
    image = pipe("a photo", num_inference_steps=2, height=32, width=32, output_type="pt",
                 generator=torch.Generator().manual_seed(0), **extra).images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()


def test_values_depend_on_the_seed_only(tmp_path):
    from safetensors.torch import load_file

    a = write_released_pipeline(tmp_path / "a", "flux.1-dev", configs=SMALL["flux.1-dev"], seed=3)
    b = write_released_pipeline(tmp_path / "b", "flux.1-dev", configs=SMALL["flux.1-dev"], seed=3)
    c = write_released_pipeline(tmp_path / "c", "flux.1-dev", configs=SMALL["flux.1-dev"], seed=4)
    sub, f = "text_encoder_2", "model.safetensors"
    ta, tb, tc = (load_file(x / sub / f) for x in (a, b, c))
    assert "shared.weight" in ta and "encoder.embed_tokens.weight" not in ta  # a tied weight saved once
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not all(torch.equal(ta[k], tc[k]) for k in ta if ta[k].ndim > 1)


def test_a_half_written_folder_is_written_again_a_complete_one_kept(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "stray").write_text("x")
    write_released_pipeline(folder, "flux.1-dev", configs=SMALL["flux.1-dev"])
    assert not (folder / "stray").exists() and (folder / ".complete").exists()
    stamp = (folder / "model_index.json").stat().st_mtime_ns
    write_released_pipeline(folder, "flux.1-dev", configs=SMALL["flux.1-dev"])
    assert (folder / "model_index.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="unknown pipeline"):
        write_released_pipeline(tmp_path / "g", "sd4")


def test_the_t5_streams_from_the_written_files(tmp_path):
    from transformers import T5EncoderModel

    from lowmem.diffusion.flow_stream import streamed_encoder

    folder = write_released_pipeline(tmp_path / "a", "flux.1-dev", configs=SMALL["flux.1-dev"])
    streamed = streamed_encoder(folder / "text_encoder_2", T5EncoderModel, torch.float32)
    whole = T5EncoderModel.from_pretrained(folder / "text_encoder_2", torch_dtype=torch.float32)
    ids = torch.tensor([[5, 9, 33, 1]])
    assert streamed is not None
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).last_hidden_state, whole(ids).last_hidden_state)
