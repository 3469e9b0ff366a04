"""A parameter file checked against the model that must read it, before any work (`fastfold.run.preflight` runs it
for every model of a run): one `InputError` line naming the file and what is wrong.

An AlphaFold `.npz` is read from its member names alone (no array is loaded): AlphaFold2 or AlphaFold-Multimer,
with or without template and pTM weights, v3 (fused triangle projections) or v1/v2, against the preset its
`--model_name` names. An OpenFold `.pt` checkpoint's tensor names and shapes are compared with the model it fills
(`check_openfold`: the count of each kind of problem and the first few names).
"""

from __future__ import annotations

import os
import zipfile

from ...utils.errors import InputError
from ..model.config import preset
from .monomer import check_openfold
from .table import PREFIX

__all__ = ["check_param_file"]

_CHECKPOINT_SUFFIXES = ("pt", "pth", "ckpt")


def check_param_file(path: str, model_name: str) -> None:
    """`path` exists, opens as what its suffix says and holds the weights `model_name`'s preset needs; else one
    `InputError` line naming the file (and the preset it looks like)."""
    if not os.path.isfile(path):
        raise InputError(f"--param_path: {path}: no such parameter file")
    suffix = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    if suffix in _CHECKPOINT_SUFFIXES:
        _check_checkpoint(path, model_name)
        return
    if suffix != "npz":
        raise InputError(f"--param_path: {path}: unknown parameter file type (expected AlphaFold .npz or OpenFold .pt)")
    try:
        with zipfile.ZipFile(path) as z:
            keys = [n[:-4] for n in z.namelist() if n.endswith(".npy")]
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise InputError(f"--param_path: {path}: not a readable .npz file ({exc}: truncated or not an npz?)") from None
    af = [k for k in keys if k.startswith(PREFIX)]
    if not af:
        raise InputError(f"--param_path: {path}: no AlphaFold parameters in this .npz (no '{PREFIX}...' arrays)")
    multimer_file = any("~_relative_encoding" in k or "template_embedding_iteration" in k for k in af)
    if multimer_file != ("_multimer" in model_name):
        if multimer_file:
            raise InputError(f"--param_path: {path}: looks like an AlphaFold-Multimer file, but --model_name "
                             f"{model_name} is a monomer model: name its model_N_multimer_v3 preset (or "
                             "--model_preset multimer)")
        raise InputError(f"--param_path: {path}: looks like a monomer AlphaFold file, but --model_name {model_name} "
                         "needs AlphaFold-Multimer weights (params_model_N_multimer_v3.npz)")
    if multimer_file:
        _check_multimer_version(path, keys, model_name)
    else:
        _check_monomer_heads(path, keys, af, model_name)


def _check_checkpoint(path: str, model_name: str) -> None:
    """An OpenFold checkpoint: a zip archive (PyTorch's format) whose tensors fit `model_name`'s model."""
    if "_multimer" in model_name:
        raise InputError(f"--param_path: {path}: --model_name {model_name} reads AlphaFold-Multimer .npz files only "
                         "(params_model_N_multimer_v3.npz), not PyTorch checkpoints")
    if not zipfile.is_zipfile(path):
        raise InputError(f"--param_path: {path}: not a PyTorch checkpoint (not a zip archive: truncated or corrupt?)")
    check_openfold(path, model_name)


def _check_monomer_heads(path: str, keys: list[str], af: list[str], model_name: str) -> None:
    """An AlphaFold2 file has template weights and a pTM head exactly when `model_name`'s preset does."""
    has_tm = PREFIX + "predicted_aligned_error_head/logits//weights" in keys
    has_templates = any("/template_embedding/" in k for k in af)
    cfg = preset(model_name)
    if (cfg.template.enabled, cfg.heads.tm) != (has_templates, has_tm):
        looks = ("model_1 or model_2" if has_templates else "model_3, model_4 or model_5") + ("_ptm" if has_tm else "")
        want = ("template" if cfg.template.enabled else "no template") + (" and pTM" if cfg.heads.tm else ", no pTM")
        raise InputError(f"--param_path: {path}: looks like a {looks} file, but --model_name {model_name} needs "
                         f"{want} weights")


def _check_multimer_version(path: str, keys: list[str], model_name: str) -> None:
    """v3 files fuse each triangle multiplication's projections, v1/v2 do not: the file must be the version
    `model_name` names (the preset's MSA sizes differ)."""
    fused = any(k.startswith(PREFIX) and "triangle_multiplication" in k and k.endswith("/projection//weights")
                for k in keys)
    wants_v3 = model_name.endswith("_v3")
    if fused != wants_v3:
        looks = "a v3" if fused else "a v1/v2"
        raise InputError(f"--param_path: {path}: looks like {looks} AlphaFold-Multimer file (triangle projections "
                         f"{'fused' if fused else 'split'}), but --model_name {model_name} is "
                         f"{'v3' if wants_v3 else 'not v3'}")
