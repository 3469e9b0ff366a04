"""The fold recipe writes what `suite fold` writes: same inputs and parameters, same coordinates and
confidences, on one device and on 2 DAP ranks (gloo); a rerun skips; a bad FASTA fails before model work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lowmem.core_parallel import run_on_ranks

FASTA = ">alpha first target\nMKTAYIAKQRQISFVKSHFSRQLEERLG\n>beta\nGSHMLEDPVK\n"
NAMES = ("alpha", "beta")
LABEL = "model_1_ptm"


def _recipe(rank: int, world: int, fasta: str, out: str) -> int:
    """Fold with the recipe; returns how many targets reached predict_step."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    from lowmem.recipes import AlphaFoldPredictor, FoldDataModule, FoldPredictionWriter

    trainer = pl.Trainer(
        strategy="dap", accelerator="cpu", devices=world, callbacks=[FoldPredictionWriter(out, relax=False)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    predictions = trainer.predict(AlphaFoldPredictor(model_name=LABEL, seed=0), datamodule=FoldDataModule(fasta))
    assert dist.is_initialized() == (world > 1), "one device must need no process group"
    return len([p for p in predictions if p is not None])


@pytest.fixture(scope="module")
def folded(tmp_path_factory) -> dict[str, Path]:
    """suite fold and the one-device recipe on the same FASTA."""
    from lowmem.suite.cli import main

    root = tmp_path_factory.mktemp("fold")
    fasta = root / "targets.fasta"
    fasta.write_text(FASTA)
    cli = ["fold", str(fasta), "--output_dir", str(root / "cli"), "--single_sequence", "--no-relax",
           "--num_workers", "0", "--model_name", LABEL, "--seed", "0"]
    assert main(cli) == 0
    assert _recipe(0, 1, str(fasta), str(root / "recipe")) == len(NAMES)
    return {"fasta": fasta, "cli": root / "cli", "recipe": root / "recipe", "root": root}


def _same_outputs(a: Path, b: Path, rtol: float) -> None:
    for name in NAMES:
        fa, fb = a / name, b / name
        assert sorted(p.name for p in fa.iterdir()) == sorted(p.name for p in fb.iterdir())
        with np.load(fa / f"{name}_{LABEL}_prediction.npz") as pa, np.load(fb / f"{name}_{LABEL}_prediction.npz") as pb:
            for key in ("positions", "plddt", "pae", "ptm"):
                scale = max(np.abs(pa[key]).max(), 1e-6)
                np.testing.assert_allclose(pb[key], pa[key], rtol=0, atol=rtol * scale, err_msg=f"{name} {key}")
        ca = json.loads((fa / f"{name}_confidence.json").read_text())
        cb = json.loads((fb / f"{name}_confidence.json").read_text())
        np.testing.assert_allclose(cb["plddt"], ca["plddt"], rtol=0, atol=max(rtol * 100, 1e-6))
        assert set(ca) == set(cb)


def test_one_device_writes_what_suite_fold_writes(folded):
    _same_outputs(folded["cli"], folded["recipe"], rtol=1e-6)


def test_rerun_skips_finished_targets(folded):
    stamp = {n: (folded["recipe"] / n / "timings.json").stat().st_mtime_ns for n in NAMES}
    assert _recipe(0, 1, str(folded["fasta"]), str(folded["recipe"])) == 0
    assert stamp == {n: (folded["recipe"] / n / "timings.json").stat().st_mtime_ns for n in NAMES}


@pytest.mark.distributed
def test_two_dap_ranks_write_the_same(folded):
    out = folded["root"] / "dap2"
    counts = run_on_ranks(_recipe, 2, str(folded["fasta"]), str(out), backend="none", timeout=200)
    assert counts == [len(NAMES)] * 2
    _same_outputs(folded["cli"], out, rtol=1e-5)


def test_bad_fasta_fails_before_model_work(tmp_path):
    from lowmem.fastfold.data.parsers import InputError
    from lowmem.recipes import FoldDataModule

    bad = tmp_path / "bad.fasta"
    bad.write_text(">good\nMKVL\n>broken_record\nMK1VL\n")
    with pytest.raises(InputError, match="broken_record"):
        FoldDataModule(bad)


def test_shipped_recipe_loads():
    from lowmem.recipes.fold import load_recipe

    path = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "fold.yaml"
    recipe = load_recipe(path)
    assert recipe["trainer"] == {"strategy": "dap", "devices": 1, "accelerator": "cpu"}
    assert recipe["predictor"]["model_name"] == LABEL and recipe["writer"]["relax"] is True
    assert recipe["data"]["alignments_dir"] is None and recipe["data"]["single_sequence"] is False


def _predict(tmp_path: Path, writer_kwargs: dict, data_kwargs: dict) -> None:
    import lightning.pytorch as pl

    from lowmem.recipes import AlphaFoldPredictor, FoldDataModule, FoldPredictionWriter

    fasta = tmp_path / "one.fasta"
    fasta.write_text(">pep\nMKTAYIAKQR\n")
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[FoldPredictionWriter(tmp_path / "out", relax=False, **writer_kwargs)])
    trainer.predict(AlphaFoldPredictor(model_name=LABEL, seed=0), datamodule=FoldDataModule(fasta, **data_kwargs))


def test_recipe_writes_openfolds_layout(tmp_path):
    """Issue 48: the output layouts are the run's (`fastfold.run.write_layouts`), so the recipe writes them too."""
    _predict(tmp_path, {"output_layout": "openfold", "cif_output": True}, {"single_sequence": True})
    out = tmp_path / "out"
    assert sorted(p.name for p in (out / "predictions").iterdir()) == [f"pep_{LABEL}_unrelaxed.cif"]
    assert set(json.loads((out / "timings.json").read_text())["pep"]) == {"inference"}


def test_recipe_checks_alignments_before_the_first_batch(tmp_path):
    """Issue 48: the recipe runs the run's input checks (`fastfold.run.check_inputs`) before any model call."""
    from lowmem.utils.errors import InputError

    (tmp_path / "alignments" / "pep").mkdir(parents=True)
    a3m = tmp_path / "alignments" / "pep" / "bfd_uniclust_hits.a3m"
    a3m.write_text(">query\nMKTAYIAKQW\n")  # another sequence than the target's
    with pytest.raises(InputError, match="another sequence"):
        _predict(tmp_path, {}, {"alignments_dir": tmp_path / "alignments"})
    assert not (tmp_path / "out" / "pep").exists()
