"""One target's work after its features, the same in this process, in a Ray task and on a cluster's model worker:
every model's prediction (`predict_all`, reusing a prediction an interrupted run cached from the same inputs) and
its files (`outputs_job`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from ..data.targets import Target
from .config import FoldConfig, prediction_runs
from .outputs import write_target_outputs
from .resume import model_fingerprint, target_fingerprint
from .stages import Models, Prediction

__all__ = ["outputs_job", "predict_all"]


def predict_all(target: Target, raw: dict[str, np.ndarray], cfg: FoldConfig, models: Models,
                timings: dict[str, float], target_fp: dict[str, Any] | None = None) -> dict[str, Prediction]:
    """Every model's prediction for one target, reusing a prediction cached by an interrupted run only when
    it was made from the same inputs (its stored fingerprint)."""
    folder = Path(cfg.output_dir) / target.name
    folder.mkdir(parents=True, exist_ok=True)
    target_fp = target_fp if target_fp is not None else target_fingerprint(target, cfg)
    predictions = {}
    for index, spec, label, seed in models.held_first(prediction_runs(cfg)):
        cache = folder / f"{target.name}_{label}_prediction.npz"
        made_from = model_fingerprint(target_fp, index, seed)
        if cache.exists() and not cfg.overwrite and Prediction.cached_fingerprint(cache) == made_from:
            predictions[label] = Prediction.load(cache)
            continue
        t0 = time.perf_counter()
        predictions[label] = models.predict(spec, raw, seed)
        predictions[label].save(cache, made_from)
        timings[f"model_{label}"] = time.perf_counter() - t0
    return {label: predictions[label] for _, _, label, _ in prediction_runs(cfg)}


def outputs_job(target: Target, predictions: dict[str, Prediction], folder: str, relax: Any,
                timings: dict[str, float], remark: str, info: dict | None = None,
                fingerprint: dict | None = None, subtract_plddt: bool = False,
                msa: np.ndarray | None = None) -> tuple[list[str], dict[str, float]]:
    """Write one target's outputs (`write_target_outputs`, relaxation included) and return (files, `timings`
    with the relaxation's seconds): what runs in this process, in a local Ray relax task or on a cluster's worker."""
    files = write_target_outputs(target, predictions, folder, relax, timings, remark, info, fingerprint,
                                 subtract_plddt, msa)
    return files, timings

