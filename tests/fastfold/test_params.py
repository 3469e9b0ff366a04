"""Parameter files: AlphaFold .npz names and shapes, exact round trips, sizes from the file, errors, OpenFold .pt."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from lowmem.fastfold import params
from lowmem.fastfold.model import AlphaFold, InferenceOptions, config
from lowmem.fastfold.model.testing import random_batch, randomize_parameters

P = params.PREFIX


@pytest.fixture(scope="module")
def tiny_model():
    return randomize_parameters(AlphaFold(config.tiny()), seed=0).eval()


def test_round_trip_is_exact(tmp_path, tiny_model):
    path = tmp_path / "tiny.npz"
    params.save_params(tiny_model, path)
    loaded = params.from_params(path, preset=config.tiny())
    assert loaded.config == tiny_model.config  # every size read back from the file
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    params.save_params(loaded, tmp_path / "again.npz")
    with np.load(path) as a, np.load(tmp_path / "again.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for k in a.files:
            assert a[k].dtype == np.float32 and np.array_equal(a[k], b[k]), k
    batch = random_batch(config.tiny(), n_res=6, n_seq=3, n_extra=3, n_templ=1, n_recycle=0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch)["final_atom_positions"], tiny_model(batch)["final_atom_positions"])


def test_sizes_are_read_from_the_file(tmp_path):
    cfg = config.tiny(templates=False, tm=False)
    cfg.evoformer = dataclasses.replace(cfg.evoformer, num_blocks=3, msa_heads=3, pair_heads=1, opm_channels=5)
    cfg.structure_module = dataclasses.replace(cfg.structure_module, ipa_heads=3, ipa_point_v=5, resnet_blocks=1)
    path = tmp_path / "odd_sizes.npz"
    params.save_params(AlphaFold(cfg), path)
    loaded = params.from_params(path, preset=config.tiny())
    assert loaded.config.evoformer == cfg.evoformer
    assert loaded.config.structure_module == dataclasses.replace(cfg.structure_module, num_layers=2)
    assert not loaded.config.template.enabled and not loaded.config.heads.tm
    assert loaded.template_embedder is None and loaded.aux_heads.tm is None


RELEASED_SHAPES = {  # from params_model_1_ptm.npz (48 Evoformer blocks, 4 extra-MSA blocks, 2 template blocks)
    "evoformer/preprocess_1d//weights": (22, 256),
    "evoformer/preprocess_msa//weights": (49, 256),
    "evoformer/pair_activiations//weights": (65, 128),
    "evoformer/prev_pos_linear//weights": (15, 128),
    "evoformer/extra_msa_activations//weights": (25, 64),
    "evoformer/evoformer_iteration/msa_row_attention_with_pair_bias/attention//query_w": (48, 256, 8, 32),
    "evoformer/evoformer_iteration/msa_row_attention_with_pair_bias//feat_2d_weights": (48, 128, 8),
    "evoformer/evoformer_iteration/msa_column_attention/attention//output_w": (48, 8, 32, 256),
    "evoformer/evoformer_iteration/outer_product_mean//output_w": (48, 32, 32, 128),
    "evoformer/evoformer_iteration/triangle_multiplication_incoming/left_projection//weights": (48, 128, 128),
    "evoformer/evoformer_iteration/triangle_attention_ending_node/attention//gating_b": (48, 4, 32),
    "evoformer/extra_msa_stack/msa_column_global_attention/attention//key_w": (4, 64, 8),
    "evoformer/extra_msa_stack/msa_column_global_attention/attention//query_w": (4, 64, 8, 8),
    "evoformer/template_embedding/single_template_embedding/embedding2d//weights": (88, 64),
    "evoformer/template_embedding/single_template_embedding/template_pair_stack/__layer_stack_no_state/"
    "triangle_attention_starting_node/attention//query_w": (2, 64, 4, 16),
    "evoformer/template_embedding/attention//query_w": (128, 4, 16),
    "evoformer/template_embedding/attention//output_w": (4, 16, 128),
    "evoformer/template_single_embedding//weights": (57, 256),
    "evoformer/single_activations//weights": (256, 384),
    "structure_module/fold_iteration/invariant_point_attention//trainable_point_weights": (12,),
    "structure_module/fold_iteration/invariant_point_attention/kv_point_local//weights": (384, 432),
    "structure_module/fold_iteration/invariant_point_attention/output_projection//weights": (2112, 384),
    "structure_module/fold_iteration/rigid_sidechain/resblock2_1//weights": (128, 128),
    "structure_module/fold_iteration/transition_2//bias": (384,),
    "predicted_lddt_head/logits//weights": (128, 50),
    "distogram_head/half_logits//weights": (128, 64),
    "predicted_aligned_error_head/logits//weights": (128, 64),
    "experimentally_resolved_head/logits//weights": (384, 37),
    "masked_msa_head/logits//weights": (256, 23),
}


def test_released_names_and_shapes():
    cfg = config.preset("model_1_ptm")
    cfg.evoformer = dataclasses.replace(cfg.evoformer, num_blocks=1)  # the full stack is 93M parameters
    arrays = params.model_to_arrays(AlphaFold(cfg))
    for key, shape in RELEASED_SHAPES.items():
        if "evoformer_iteration" in key:
            shape = (1, *shape[1:])
        assert arrays[P + key].shape == shape, key
    assert all(re.fullmatch(r"alphafold/alphafold_iteration/[a-z_0-9/]+//[a-z_0-9]+", k) for k in arrays)
    # model_3 has no template weights; _ptm adds exactly the aligned-error head
    cfg3 = dataclasses.replace(config.preset("model_3"), evoformer=cfg.evoformer)
    keys3 = set(params.model_to_arrays(AlphaFold(cfg3)))
    assert not any("template" in k for k in keys3)
    assert set(arrays) - keys3 - {k for k in arrays if "template" in k} == {
        P + "predicted_aligned_error_head/logits//weights",
        P + "predicted_aligned_error_head/logits//bias",
    }


def test_incoming_triangle_multiplication_swaps_left_and_right(tiny_model):
    """AlphaFold computes the incoming update as einsum('kjc,kic->ijc', left, right): its "left" projection
    is the supplement's b. A hand-built file with distinct left/right weights must reproduce that."""
    arrays = params.model_to_arrays(tiny_model)
    base = P + "evoformer/evoformer_iteration/triangle_multiplication_incoming/"
    g = np.random.default_rng(0)
    for name in ("left_projection", "right_projection", "left_gate", "right_gate"):
        arrays[base + name + "//weights"] = g.normal(size=arrays[base + name + "//weights"].shape).astype(np.float32)
        arrays[base + name + "//bias"] = g.normal(size=arrays[base + name + "//bias"].shape).astype(np.float32)
    model = AlphaFold(tiny_model.config)
    params.load_npz(model, arrays)
    mod = model.evoformer.blocks[0].pair_stack.tri_mul_in.double()
    z = torch.randn(5, 5, tiny_model.config.c_z, dtype=torch.float64)
    mask = torch.ones(5, 5, dtype=torch.float64)

    def af(name):
        return (
            torch.from_numpy(arrays[base + name + "//weights"][0]).double(),
            torch.from_numpy(arrays[base + name + "//bias"][0]).double(),
        )

    x = mod.layer_norm_in(z)
    left = (x @ af("left_projection")[0] + af("left_projection")[1]) * torch.sigmoid(
        x @ af("left_gate")[0] + af("left_gate")[1]
    )
    right = (x @ af("right_projection")[0] + af("right_projection")[1]) * torch.sigmoid(
        x @ af("right_gate")[0] + af("right_gate")[1]
    )
    act = torch.einsum("kjc,kic->ijc", left, right)
    expected = mod.linear_z(mod.layer_norm_out(act)) * torch.sigmoid(mod.linear_g(x))
    torch.testing.assert_close(mod(z, mask, InferenceOptions()), expected)


def test_bad_files_raise_one_error_listing_every_problem(tmp_path, tiny_model):
    arrays = params.model_to_arrays(tiny_model)
    gone = P + "evoformer/single_activations//bias"
    wrong = P + "distogram_head/half_logits//weights"
    del arrays[gone]
    arrays[wrong] = arrays[wrong][:, :-1]
    arrays[P + "evoformer/not_a_module//weights"] = np.zeros(3, np.float32)
    with pytest.raises(params.ParamsError) as err:
        params.load_npz(AlphaFold(tiny_model.config), arrays, source="bad.npz")
    text = str(err.value)
    assert "bad.npz" in text and f"missing {gone}" in text and "unexpected" in text
    assert "not_a_module" in text and re.search(r"mis-shaped .*half_logits", text)
    with pytest.raises(params.ParamsError, match="no such parameter file"):
        params.from_params(tmp_path / "absent.npz")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(params.ParamsError, match="unknown parameter file type"):
        params.from_params(tmp_path / "x.bin")


def test_preset_comes_from_the_file_name(tmp_path):
    cfg = config.preset("model_3_ptm")
    cfg.evoformer = dataclasses.replace(cfg.evoformer, num_blocks=1)
    cfg.extra_msa = dataclasses.replace(cfg.extra_msa, num_blocks=1)
    path = tmp_path / "params_model_3_ptm.npz"
    params.save_params(AlphaFold(cfg), path)
    loaded = params.from_params(path)
    assert loaded.config.pipeline == config.preset("model_3_ptm").pipeline
    assert loaded.config.structure_module.num_layers == 8 and loaded.config.heads.tm
    with pytest.raises(ValueError, match="unknown model name"):
        config.preset("model_9")


def _to_openfold_names(state):
    out = {}
    for k, v in state.items():
        k = re.sub(r"^template_angle_embedder\.", "template_embedder.template_single_embedder.", k)
        k = re.sub(
            r"^template_embedder\.template_pair_embedder\.", "template_embedder.template_pair_embedder.linear.", k
        )
        k = re.sub(r"^(evoformer\.blocks\.\d+)\.msa_att_col\.", r"\1.msa_att_col._msa_att.", k)
        k = re.sub(r"\.linear_(q|kv)_points\.", r".linear_\1_points.linear.", k)
        k = re.sub(r"^structure_module\.layer_norm_transition\.", "structure_module.transition.layer_norm.", k)
        m = re.fullmatch(r"structure_module\.transition\.(\d)\.(weight|bias)", k)
        if m:
            k = f"structure_module.transition.layers.0.linear_{int(m.group(1)) + 1}.{m.group(2)}"
        k = re.sub(r"^aux_heads\.(distogram|masked_msa|experimentally_resolved|tm)\.", r"aux_heads.\1.linear.", k)
        out["model." + k] = v
    return out


def test_openfold_checkpoint(tmp_path, tiny_model):
    path = tmp_path / "openfold.pt"
    torch.save({"state_dict": _to_openfold_names(tiny_model.state_dict())}, path)
    loaded = params.from_params(path, preset=config.tiny())
    for k, v in tiny_model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    bad = _to_openfold_names(tiny_model.state_dict())
    del bad["model.evoformer.linear.bias"]
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(params.ParamsError, match="missing evoformer.linear.bias"):
        params.from_params(tmp_path / "bad.pt", preset=config.tiny())


def test_model_module_does_not_import_params():
    """Loading and saving live in fastfold.params (which imports the model), not on the model class: importing
    the model never imports params, so there is no alphafold <-> params cycle."""
    import subprocess
    import sys

    code = (
        "import sys; from lowmem.fastfold.model import AlphaFold; "
        "assert 'lowmem.fastfold.params' not in sys.modules, 'model imported params'; "
        "assert not hasattr(AlphaFold, 'from_params') and not hasattr(AlphaFold, 'save_params')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_fastfold_errors_are_the_one_input_error():
    from lowmem.fastfold.data import parsers
    from lowmem.utils.errors import InputError

    assert issubclass(params.ParamsError, InputError)
    assert parsers.InputError is InputError
