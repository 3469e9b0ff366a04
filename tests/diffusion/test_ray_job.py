"""The fine-tuning job Ray's workers run (`recipes.diffusion.launch._ray_job`) fits as a local `suite diffusion
finetune` does (issue 45): Lightning's "Found N module(s) in eval mode at the start of training" about the frozen
VAE and text encoder is silenced there too (`FitJob.ignore_warnings`, applied by `FitJob.fit`, which every Ray
worker calls). Run in process with a plain one-device Trainer: the warning filters are the job's, not Ray's."""

from __future__ import annotations

import re
import warnings

import pytest

pytest.importorskip("lightning.pytorch")
pytest.importorskip("ray")


def _eval_mode_warnings(job, *, through_job: bool) -> list[str]:
    import lightning.pytorch as pl

    from lowmem.recipes.diffusion.module import EVAL_MODE_WARNING

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="auto", **job.trainer_kwargs)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if through_job:
            job.fit(trainer)
        else:  # what a Ray worker did before: trainer.fit with no filter
            trainer.fit(job.module, datamodule=job.datamodule, ckpt_path=job.ckpt_path)
    return [str(w.message) for w in seen if re.search(EVAL_MODE_WARNING, str(w.message))]


def test_the_ray_job_silences_lightnings_eval_mode_warning(tmp_path):
    from lowmem.diffusion.config import FineTuneConfig
    from lowmem.recipes.diffusion.launch import FIT_WARNINGS, _prepare, _ray_job
    from lowmem.recipes.diffusion.module import EVAL_MODE_WARNING

    cfg = FineTuneConfig(output_dir=str(tmp_path / "out"), max_train_steps=1, report_to="csv")
    _, length, _ = _prepare(cfg, 1)
    job = _ray_job(cfg, None, length, None)
    assert EVAL_MODE_WARNING in job.ignore_warnings and job.ignore_warnings == FIT_WARNINGS
    assert _eval_mode_warnings(_ray_job(cfg, None, length, None), through_job=False)  # Lightning does warn here
    assert _eval_mode_warnings(job, through_job=True) == []
