"""Loading a parameter file streams it (issue 18): the process grows by about the model's own size, not by the
file's arrays + a converted copy + the model (3x before), and the weights are bit-identical to the saved ones
and to loading from arrays held in memory."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lowmem.fastfold import params
from lowmem.fastfold.model import AlphaFold, config

# Reset the process's RSS high-water mark just before loading (Linux: /proc/self/clear_refs, "5"), so the peak
# is the load's, not the imports'.
_CHILD = r"""
import json, sys
from lowmem.fastfold import params

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
model = params.from_params(sys.argv[1])
peak = status("VmHWM")
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"before": before, "peak": peak, "param_bytes": size}))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, AlphaFold]:
    """A model_1_ptm-shaped model with 12 Evoformer blocks (~96 MiB of float32 parameters), saved."""
    cfg = config.preset("model_1_ptm")
    cfg.evoformer = dataclasses.replace(cfg.evoformer, num_blocks=12)
    cfg.extra_msa = dataclasses.replace(cfg.extra_msa, num_blocks=1)
    torch.manual_seed(0)
    model = AlphaFold(cfg).eval()
    path = tmp_path_factory.mktemp("params") / "params_model_1_ptm.npz"
    params.save_params(model, path)
    return path, model


def test_loading_grows_memory_by_about_the_model_not_three_copies(saved):
    path, model = saved
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the RSS high-water mark")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    assert m["param_bytes"] == expected
    growth = (m["peak"] - m["before"]) / expected
    # the model's own parameters (1x) plus one array at a time; the old load held 3x (file + converted + model)
    assert growth < 1.4, f"loading grew the process by {growth:.2f}x the parameters' size"


def test_streamed_weights_are_bit_identical(saved):
    path, model = saved
    streamed = params.from_params(path)
    with np.load(path) as z:
        in_memory = AlphaFold(streamed.config)
        params.load_npz(in_memory, {k: z[k] for k in z.files}, source=str(path))
    assert streamed.config == model.config
    want = model.state_dict()
    for name, got in [("streamed", streamed.state_dict()), ("in memory", in_memory.state_dict())]:
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{name}: {k}"


def test_streaming_reports_every_problem_before_writing(tmp_path, saved):
    """A file with a missing and a mis-shaped array names both (one ParamsError), read from the headers."""
    path, model = saved
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    gone = params.PREFIX + "evoformer/single_activations//bias"
    wrong = params.PREFIX + "evoformer/prev_pair_norm//scale"
    del arrays[gone]
    arrays[wrong] = arrays[wrong][:-1]
    bad = tmp_path / "params_model_1_ptm.npz"
    np.savez(bad, **arrays)
    with pytest.raises(params.ParamsError, match=rf"(?s)missing {gone}.*mis-shaped {wrong}"):
        params.from_params(bad)
    (tmp_path / "broken.npz").write_bytes(path.read_bytes()[: 1 << 20])
    with pytest.raises(params.ParamsError, match="not a readable .npz file"):
        params.from_params(tmp_path / "broken.npz", preset="model_1_ptm")
