"""`suite bench fold-model --openfold DIR` (issue 18) without OpenFold: bad flags are one line and exit 2; the
comparison (medians, ratios, the pLDDT-agreement check) on given child results; the orchestration (interleaved
sides, exit 1 on a pLDDT mismatch) with the children replaced; our child on the tiny model as a measured whole
process; the stand-in for OpenFold's CUDA softmax against torch.softmax in float64. Timings are not checked."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from lowmem.suite.bench import fold_openfold as fo
from lowmem.suite.cli import build_parser
from lowmem.suite.errors import UsageError


def _cli(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "lowmem.suite", "bench", "fold-model", *argv], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONSAFEPATH": "1"})


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def _args(*argv):
    return build_parser(["bench"]).parse_args(["bench", "fold-model", *argv])


@pytest.fixture
def fake_openfold(tmp_path):
    """A folder holding an `openfold` package (enough for the flag checks; importing it is another matter)."""
    (tmp_path / "openfold").mkdir()
    (tmp_path / "openfold" / "__init__.py").write_text("")
    return tmp_path


# ---- flags ------------------------------------------------------------------------------------------------


def test_cli_missing_openfold_dir_exit_2():
    out = _cli("--openfold", "/nonexistent")
    assert out.returncode == 2
    assert "--openfold /nonexistent" in _one_line(out.stderr)


def test_cli_chunk_auto_refused_exit_2(fake_openfold):
    out = _cli("--openfold", str(fake_openfold))  # --chunk_size defaults to "auto"
    assert out.returncode == 2
    line = _one_line(out.stderr)
    assert "--chunk_size" in line and "'auto'" in line


@pytest.mark.parametrize("extra, words", [
    (["--chunk_size", "auto"], "--chunk_size"),
    (["--chunk_size", "0"], "--chunk_size"),
    (["--chunk_size", "4", "--preset", "model_9"], "--preset"),
    (["--chunk_size", "4", "--threads", "0"], "--threads"),
    (["--chunk_size", "4", "--multimer"], "--multimer"),
    (["--chunk_size", "4", "--dtype", "bfloat16"], "--dtype"),
    (["--chunk_size", "4", "--openfold_pythonpath", "/nonexistent/deps"], "--openfold_pythonpath"),
])
def test_bad_flags_refused(fake_openfold, extra, words):
    with pytest.raises(UsageError, match=words):
        fo.check_args(_args("--openfold", str(fake_openfold), *extra))


def test_folder_without_openfold_package_refused(tmp_path):
    with pytest.raises(UsageError, match="--openfold .*no openfold package"):
        fo.check_args(_args("--openfold", str(tmp_path), "--chunk_size", "4"))
    (tmp_path / "openfold").mkdir()
    (tmp_path / "openfold" / "__init__.py").write_text("")
    fo.check_args(_args("--openfold", str(tmp_path), "--chunk_size", "4", "--preset", "model_3"))  # now accepted


def test_cli_openfold_dependency_missing_names_pythonpath(fake_openfold):
    (fake_openfold / "openfold" / "config.py").write_text("import lowmem_test_no_such_dependency\n")
    out = _cli("--openfold", str(fake_openfold), "--chunk_size", "4", "--n_res", "8")
    assert out.returncode == 2
    line = _one_line(out.stderr)
    assert "lowmem_test_no_such_dependency" in line and "--openfold_pythonpath" in line


# ---- the comparison ---------------------------------------------------------------------------------------


def _run(side, n_res=128, plddt=51.8583, wall=10.0, forward=8.0, load=1.0, peak=100 * 2**20):
    return {"n_res": n_res, "side": side, "wall_s": wall, "forward_s": forward, "load_s": load, "peak_bytes": peak,
            "plddt": plddt}


def test_compare_medians_and_ratios():
    runs = [
        _run("ours", wall=10, forward=8, load=1, peak=100 * 2**20),
        _run("openfold", wall=20, forward=10, load=4, peak=400 * 2**20, plddt=51.8585),
        _run("ours", wall=12, forward=6, load=3, peak=300 * 2**20),
        _run("openfold", wall=30, forward=30, load=2, peak=200 * 2**20, plddt=51.8584),
        _run("ours", wall=14, forward=7, load=2, peak=200 * 2**20),
        _run("openfold", wall=25, forward=20, load=3, peak=300 * 2**20, plddt=51.8583),
        _run("ours", n_res=64, wall=2, forward=1, load=1, peak=10 * 2**20, plddt=40.0),
        _run("openfold", n_res=64, wall=4, forward=4, load=1, peak=40 * 2**20, plddt=40.0),
    ]
    rows = {r["n_res"]: r for r in fo.compare(runs)}
    assert list(rows) == [64, 128]
    r = rows[128]
    assert r["runs"] == 3
    assert (r["ours_wall_s"], r["openfold_wall_s"]) == (12, 25)
    assert r["wall_ratio"] == pytest.approx(12 / 25)
    assert (r["ours_forward_s"], r["openfold_forward_s"]) == (7, 20)
    assert r["forward_ratio"] == pytest.approx(7 / 20)
    assert r["load_ratio"] == pytest.approx(2 / 3)
    assert (r["ours_peak_mib"], r["openfold_peak_mib"]) == (200, 300)
    assert r["peak_ratio"] == pytest.approx(200 / 300)
    assert r["plddt_diff"] == pytest.approx(2e-4, abs=1e-9)
    assert rows[64]["peak_ratio"] == pytest.approx(0.25) and rows[64]["forward_ratio"] == pytest.approx(0.25)


@pytest.mark.parametrize("other", [51.8583 + 1.01e-3, 51.8583 - 0.5, float("nan")])
def test_compare_refuses_disagreeing_plddt(other):
    runs = [_run("ours"), _run("openfold"), _run("ours"), _run("openfold", plddt=other)]
    with pytest.raises(fo.PlddtMismatch, match="n_res 128: mean pLDDT"):
        fo.compare(runs)


def test_compare_needs_both_sides():
    with pytest.raises(fo.PlddtMismatch, match="no openfold run"):
        fo.compare([_run("ours")])


# ---- the orchestration with the children replaced ----------------------------------------------------------


@pytest.fixture
def fake_children(monkeypatch, tmp_path):
    """`run` with no probe subprocess, tiny input files and children answering from a list."""
    calls = []
    answers = {"plddt": {"ours": 51.8583, "openfold": 51.8583}}

    def write_inputs(folder, **kw):
        paths = {"params": os.path.join(folder, "p.npz"), "features": os.path.join(folder, "f.pt")}
        for p in paths.values():
            with open(p, "wb") as f:
                f.write(b"x")
        return paths

    def run_one(side, **opts):
        calls.append((side, opts))
        return {"side": side, "load_s": 1.0, "forward_s": 2.0 if side == "ours" else 4.0, "wall_s": 3.0,
                "peak_bytes": 2**20 * (50 if side == "ours" else 100), "plddt": answers["plddt"][side],
                "device": "cpu", "method": "fake", **({"softmax": "stand-in"} if side == "openfold" else {})}

    monkeypatch.setattr(fo, "_probe", lambda args, paths: {"ok": True, "softmax": "stand-in", "openfold": "x"})
    monkeypatch.setattr(fo, "write_inputs", write_inputs)
    monkeypatch.setattr(fo, "run_one", run_one)
    return calls, answers


def test_run_interleaves_sides_and_writes_ratios(fake_openfold, fake_children, tmp_path, capsys):
    calls, _ = fake_children
    path = tmp_path / "r.json"
    args = _args("--openfold", str(fake_openfold), "--chunk_size", "4", "--n_res", "16", "--repeat", "3",
                 "--threads", "3", "--json", str(path))
    assert fo.run(args) == 0
    assert [side for side, _ in calls] == ["ours", "openfold"] * 3
    for side, opts in calls:
        assert opts["chunk_size"] == 4 and opts["threads"] == 3 and opts["preset"] == "model_1_ptm"
        assert ("path" in opts) == (side == "openfold")
    assert len({(o["params"], o["features"]) for _, o in calls}) == 1  # the same files for both sides
    result = json.loads(path.read_text())
    assert result["benchmark"] == "fold-model --openfold"
    assert len(result["runs"]) == 6
    (row,) = result["summary"]
    assert row["forward_ratio"] == pytest.approx(0.5) and row["peak_ratio"] == pytest.approx(0.5)
    assert "stand-in" in capsys.readouterr().out


def test_run_plddt_mismatch_exit_1_one_line(fake_openfold, fake_children, tmp_path, capsys):
    _, answers = fake_children
    answers["plddt"]["openfold"] = 60.0
    path = tmp_path / "r.json"
    args = _args("--openfold", str(fake_openfold), "--chunk_size", "4", "--n_res", "16", "--repeat", "1",
                 "--json", str(path))
    assert fo.run(args) == 1
    out = capsys.readouterr()
    loud = [line for line in out.err.splitlines() if not line.startswith("  n_res")]  # per-run progress lines
    assert len(loud) == 1 and "DISAGREES" in loud[0] and "60.0000" in loud[0], out.err
    assert "ratio" not in out.out
    result = json.loads(path.read_text())
    assert "pLDDT mismatch" in result["error"] and "summary" not in result


# ---- our child, a measured whole process -------------------------------------------------------------------


def test_our_child_on_the_tiny_model(tmp_path):
    from lowmem.fastfold.model import InferenceOptions
    from lowmem.fastfold.model.config import tiny
    from lowmem.fastfold.params import from_params

    inputs = fo.write_inputs(str(tmp_path), preset="model_1_ptm", n_res=10, n_seq=3, n_extra=4, tiny=True)
    got = fo.run_one("ours", **inputs, chunk_size=4, threads=1, device="cpu", tiny=True)
    assert got["side"] == "ours" and got["device"] == "cpu" and got["threads"] == 1
    assert got["peak_bytes"] > 0 and got["wall_s"] > 0 and got["forward_s"] > 0 and got["load_s"] > 0
    assert got["method"].startswith(("cgroup", "rss+mincore"))
    with torch.no_grad():
        model = from_params(inputs["params"], tiny()).eval()
        batch = torch.load(inputs["features"], weights_only=True)
        want = model(batch, InferenceOptions(chunk_size=4, residual="in_place"))["plddt"].mean().item()
    assert got["plddt"] == pytest.approx(want, abs=1e-4)
    assert 0 < got["plddt"] < 100
    # written once: a second call with the same settings reuses the files
    again = fo.write_inputs(str(tmp_path), preset="model_1_ptm", n_res=10, n_seq=3, n_extra=4, tiny=True)
    assert again == inputs


def test_child_crash_is_runtime_error_with_stderr(tmp_path):
    with pytest.raises(RuntimeError, match="the ours side failed(.|\n)*no such parameter file"):
        fo.run_one("ours", params=str(tmp_path / "missing.npz"), features=str(tmp_path / "f.pt"), chunk_size=4,
                    threads=1, device="cpu", tiny=True)


# ---- OpenFold's features from ours -------------------------------------------------------------------------


def test_openfold_features_renames_and_adds_torsions():
    seen = {}

    def atom37_to_torsion_angles(prefix):
        assert prefix == "template_"

        def f(t):
            seen.update({k: tuple(v.shape) for k, v in t.items()})
            n = t["template_aatype"].shape
            return {**t, "template_torsion_angles_sin_cos": torch.zeros(*n, 7, 2),
                    "template_alt_torsion_angles_sin_cos": torch.ones(*n, 7, 2),
                    "template_torsion_angles_mask": torch.ones(*n, 7)}
        return f

    batch = {"template_aatype": torch.zeros(2, 5, 1, dtype=torch.long),
             "template_all_atom_positions": torch.zeros(2, 5, 37, 3, 1),
             "template_all_atom_masks": torch.ones(2, 5, 37, 1), "aatype": torch.zeros(5, 1, dtype=torch.long)}
    out = fo._openfold_features(batch, atom37_to_torsion_angles)
    assert "template_all_atom_masks" not in out and out["template_all_atom_mask"].shape == (2, 5, 37, 1)
    assert seen["template_all_atom_positions"] == (2, 5, 37, 3)  # one recycling pass given to the transform
    assert out["template_torsion_angles_sin_cos"].shape == (2, 5, 7, 2, 1)
    assert out["template_torsion_angles_mask"].shape == (2, 5, 7, 1)
    # a preset without templates: nothing to add
    assert set(fo._openfold_features({"aatype": torch.zeros(5, 1)}, atom37_to_torsion_angles)) == {"aatype"}


# ---- the stand-in softmax ---------------------------------------------------------------------------------


def test_standin_softmax_matches_torch_float64_with_minus_inf():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64) * 30
    x[torch.rand(x.shape, generator=g) < 0.3] = -math.inf
    x[0, 0, 0, 0] = -math.inf
    x[0, 0, 0, 1] = 50.0  # each row below keeps a finite maximum ...
    x[1, 2, 4] = -math.inf  # ... but this one, all -inf: NaN, as torch.softmax and OpenFold's kernel (0/0)
    want = torch.softmax(x, dim=-1)
    a = x.clone()
    ptr = a.data_ptr()
    assert fo.standin_softmax_(a, 2 * 3 * 5, 7) is None
    assert a.data_ptr() == ptr
    finite = ~torch.isnan(want)
    assert torch.equal(torch.isnan(a), ~finite)
    assert torch.isnan(a[1, 2, 4]).all()
    torch.testing.assert_close(a[finite], want[finite], rtol=0, atol=1e-15)
    assert (a[x == -math.inf][~torch.isnan(a[x == -math.inf])] == 0).all()
    torch.testing.assert_close(a[finite.all(-1)].sum(-1), torch.ones(29, dtype=torch.float64))


def test_standin_softmax_checks_rows_cols():
    with pytest.raises(ValueError, match="3 x 5"):
        fo.standin_softmax_(torch.zeros(4, 4), 3, 5)


def test_install_softmax_registers_standin_when_extension_missing(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("attn_core_inplace_cuda") is not None:
        pytest.skip("OpenFold's CUDA extension is installed here")
    monkeypatch.delitem(sys.modules, "attn_core_inplace_cuda", raising=False)
    which = fo._install_softmax()
    try:
        assert "stand-in" in which
        import attn_core_inplace_cuda

        assert attn_core_inplace_cuda.forward_ is fo.standin_softmax_
    finally:
        sys.modules.pop("attn_core_inplace_cuda", None)


def test_child_peak_is_its_own_not_the_parents():
    """ru_maxrss survives fork and exec on Linux: a child started by a large parent would report the parent's
    peak. The children report VmHWM, their own."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("needs Linux /proc")
    ballast = bytearray(400 << 20)  # the parent's resident set grows by 400 MiB
    ballast[:: 4096] = b"x" * len(range(0, len(ballast), 4096))
    code = ("import json, resource; from lowmem.utils.memory_meter import hwm_bytes; "
            "print(json.dumps([hwm_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    own, inherited = json.loads(done.stdout.strip().splitlines()[-1])
    del ballast
    assert inherited >= 400 << 20  # what getrusage would have reported
    assert 0 < own < 200 << 20
