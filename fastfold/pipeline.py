"""The `suite fold` flow as reusable functions: FASTA -> alignments -> features -> model -> relax -> files.

`suite fold` and the Lightning recipe (`recipes.FoldDataModule`, `recipes.AlphaFoldPredictor`,
`recipes.FoldPredictionWriter`) call these same functions:

- `read_targets(fasta)`: validated targets (`InputError` names the record and position).
- `target_raw_features(target, alignment_config, work_dir, with_templates)`: alignments (precomputed,
  tool runs, or single sequence) and templates -> raw features. This is the job Ray runs per target.
- `load_model(spec)` / `features_for_model(raw, feature_config, seed)` / `predict(model, batch, spec)`.
- `write_target_outputs(...)`: PDB, mmCIF, confidence JSON, PNG plots, relaxation, `timings.json`.
- `fold_targets(targets, config)`: the whole flow with Ray, resume and per-target failure reporting.

Output layout, per target `<output_dir>/<name>/`: `<name>_<model>_unrelaxed.pdb` and
`<name>_<model>_prediction.npz` per model (the npz lets an interrupted run resume), then for the best
model (AlphaFold's ranking: pTM for `_ptm` models, else mean pLDDT) `<name>_unrelaxed.pdb|.cif`,
`<name>_relaxed.pdb|.cif`, `<name>_confidence.json`, `<name>_plddt.png`, `<name>_pae.png` (pTM models),
`ranking.json` and, written last, `timings.json`: a target is complete when `timings.json` lists files
that all exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..core_parallel.fileio import atomic_write
from .data.features import FeatureConfig, make_sequence_features, process_features
from .data.targets import (
    AlignmentConfig,
    Target,
    read_alignment_dir,
    read_targets,
    run_alignment_tools,
    target_raw_features,
)
from .io.protein import Protein

__all__ = [
    "AlignmentConfig",
    "FoldConfig",
    "ModelSpec",
    "Prediction",
    "Target",
    "TargetResult",
    "feature_stream",
    "features_for_model",
    "fold_targets",
    "is_complete",
    "load_model",
    "predict",
    "prediction_to_protein",
    "read_alignment_dir",
    "read_targets",
    "run_alignment_tools",
    "target_raw_features",
    "write_target_outputs",
]

logger = logging.getLogger(__name__)

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp64": "float64"}
"""`--precision` values and the torch dtype each selects."""


@dataclasses.dataclass(kw_only=True)
class ModelSpec:
    """How to build one model, in any process (picklable)."""

    model_name: str = "model_1_ptm"
    """Released preset name (`model_1` .. `model_5`, `_ptm`)."""
    param_path: str | None = None
    """Parameter file; None: random initialisation (meaningless structures)."""
    tiny: bool = False
    """With no parameters: use the tiny configuration (demo and tests)."""
    precision: str = "fp32"
    """fp32, bf16 or fp64."""
    chunk_size: int | str | None = None
    """Chunk size of the low-memory inference path; None: no chunking; "auto": fit a memory budget."""
    seed: int = 0
    """Seed of the random initialisation."""
    device: str = "auto"
    """Where the model runs: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N"."""

    def __post_init__(self) -> None:
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"ModelSpec.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"ModelSpec.precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        c = self.chunk_size
        if not (c is None or c == "auto" or (isinstance(c, int) and c >= 1)):
            raise ValueError(f"ModelSpec.chunk_size must be None, 'auto' or >= 1, got {c!r}")

    @property
    def label(self) -> str:
        return self.model_name


@dataclasses.dataclass(kw_only=True)
class FoldConfig:
    """The whole run."""

    output_dir: str
    """Where the per-target folders go."""
    models: list[ModelSpec]
    """Models to run on every target (best ranked is relaxed and written under the target's name)."""
    alignment: AlignmentConfig = dataclasses.field(default_factory=AlignmentConfig)
    """MSA and template sources."""
    relax: Any = None
    """A `fastfold.relax.RelaxConfig`, or None for no relaxation."""
    overwrite: bool = False
    """Redo targets that are complete, and ignore cached predictions."""
    seed: int = 0
    """Seed of MSA sampling."""
    devices: int = 1
    """DAP ranks for the model (1: no process group)."""
    num_workers: int = 0
    """Ray CPUs for alignment/feature jobs; 0: in this process, one target after another."""
    ray_address: str | None = None
    """Existing Ray cluster to use instead of starting a local one."""

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("FoldConfig.models must name at least one model")
        if self.devices < 1:
            raise ValueError(f"FoldConfig.devices must be >= 1, got {self.devices}")
        if self.num_workers < 0:
            raise ValueError(f"FoldConfig.num_workers must be >= 0, got {self.num_workers}")
        labels = [m.label for m in self.models]
        if len(set(labels)) != len(labels):
            raise ValueError(f"FoldConfig.models repeats a model name: {labels}")


@dataclasses.dataclass
class Prediction:
    """One model's prediction for one target (numpy, float32).

    `positions` `[N, 37, 3]`, `atom_mask` `[N, 37]`, `plddt` `[N]`, `pae` `[N, N]` or None, `ptm` or None."""

    positions: np.ndarray
    atom_mask: np.ndarray
    plddt: np.ndarray
    pae: np.ndarray | None = None
    ptm: float | None = None

    def ranking_score(self, metric: str) -> float:
        """AlphaFold's ranking: `metric` "ptm" (all models are `_ptm`) or "mean_plddt"."""
        return float(self.ptm) if metric == "ptm" else float(self.plddt.mean())

    def save(self, path: Path) -> None:
        arrays = {"positions": self.positions, "atom_mask": self.atom_mask, "plddt": self.plddt}
        if self.pae is not None:
            arrays.update(pae=self.pae, ptm=np.array(self.ptm, np.float32))
        with atomic_write(path, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: Path) -> Prediction:
        with np.load(path) as z:
            pae = z["pae"] if "pae" in z else None
            ptm = float(z["ptm"]) if "ptm" in z else None
            return cls(z["positions"], z["atom_mask"], z["plddt"], pae, ptm)


@dataclasses.dataclass
class TargetResult:
    """What happened to one target."""

    target: Target
    status: str
    """"done", "skipped" (already complete) or "failed"."""
    mean_plddt: float | None = None
    seconds: float = 0.0
    folder: str = ""
    error: str = ""
    files: list[str] = dataclasses.field(default_factory=list)


# --------------------------------------------------------------------------------------------------- model


def load_model(spec: ModelSpec) -> tuple[Any, FeatureConfig]:
    """The model (eval mode, `spec.precision`) and the feature sizes it wants."""
    import torch

    from .model import AlphaFold
    from .model import config as model_config

    if spec.param_path is not None:
        model = AlphaFold.from_params(spec.param_path, preset=spec.model_name)
        cfg = model.config
    else:
        cfg = model_config.preset(spec.model_name)  # also validates the name
        if spec.tiny:
            cfg = model_config.tiny(templates=cfg.template.enabled, tm=cfg.heads.tm)
        torch.manual_seed(spec.seed)
        model = AlphaFold(cfg)
    device = spec.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device=device, dtype=getattr(torch, PRECISIONS[spec.precision])).eval()
    p = cfg.pipeline
    templates = p.max_templates if cfg.template.enabled else 0
    feats = FeatureConfig(max_msa_clusters=p.max_msa_clusters, max_extra_msa=p.max_extra_msa,
                          max_templates=templates, num_recycle=p.num_recycle)
    return model, feats


def features_for_model(raw: dict[str, np.ndarray], feature_config: FeatureConfig, seed: int) -> dict[str, np.ndarray]:
    """The processed batch for one model (see `fastfold.data.features`)."""
    return process_features(raw, feature_config, seed=seed)


def _inference_options(spec: ModelSpec) -> Any:
    from .model import InferenceOptions

    return InferenceOptions(chunk_size=spec.chunk_size)


def _to_prediction(outputs: dict[str, Any]) -> Prediction:
    def arr(key: str) -> np.ndarray:
        return outputs[key].detach().float().cpu().numpy()

    pae = arr("predicted_aligned_error") if "predicted_aligned_error" in outputs else None
    ptm = float(arr("ptm_score")) if "ptm_score" in outputs else None
    return Prediction(arr("final_atom_positions"), arr("final_atom_mask"), arr("plddt"), pae, ptm)


def predict(model: Any, batch: dict[str, np.ndarray], spec: ModelSpec) -> Prediction:
    """Run `model` on one processed batch (no gradients) and collect the outputs."""
    import torch

    from .data.features import to_torch

    param = next(model.parameters())
    # bf16 models get float32 features (coordinates and masks keep their precision; the model casts)
    dtype = torch.float32 if param.dtype in (torch.bfloat16, torch.float16) else param.dtype
    numpy_part = {k: v for k, v in batch.items() if isinstance(v, np.ndarray)}
    tensors = to_torch(numpy_part, device=str(param.device), dtype=dtype)
    for key, value in batch.items():
        if key not in tensors:
            value = value.to(param.device)
            tensors[key] = value.to(dtype) if value.is_floating_point() else value
    with torch.no_grad():
        outputs = model(tensors, options=_inference_options(spec))
    return _to_prediction(outputs)


def _dap_rank(rank: int, world_size: int, spec: ModelSpec, batch_path: str) -> Prediction | None:
    """One DAP rank: build the model, receive the batch from rank 0, run the DAP-parallel model."""
    import torch.distributed as dist

    from .dap import broadcast_batch, parallelize_dap
    from .data.features import to_torch

    model, _ = load_model(dataclasses.replace(spec, device="cpu"))  # gloo ranks: CPU tensors
    batch = to_torch(dict(np.load(batch_path))) if rank == 0 else None
    group = dist.group.WORLD
    batch = broadcast_batch(batch, group, src=0)
    model = parallelize_dap(model, group)
    prediction = predict(model, batch, spec)
    return prediction if rank == 0 else None


def predict_dap(spec: ModelSpec, batch: dict[str, np.ndarray], devices: int, scratch: Path) -> Prediction:
    """`predict` across `devices` gloo ranks with the Evoformer split by DAP; rank 0's result."""
    from ..core_parallel.launch import run_on_ranks

    path = scratch / ".dap_batch.npz"
    with atomic_write(path, "wb") as f:
        np.savez(f, **batch)
    try:
        return run_on_ranks(_dap_rank, devices, spec, str(path), timeout=3600.0)[0]
    finally:
        path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------------- outputs


def prediction_to_protein(target: Target, prediction: Prediction, b_factors: np.ndarray | None = None) -> Protein:
    """The predicted structure as a `Protein` (1-based residue numbers, pLDDT as B-factors by default)."""
    raw = make_sequence_features(target.sequence)
    plddt = np.repeat(prediction.plddt[:, None], 37, axis=1) if b_factors is None else b_factors
    return Protein(prediction.positions.astype(np.float64), prediction.atom_mask, raw["aatype"],
                   raw["residue_index"] + 1, plddt)


def _write_text(path: Path, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def _write_structure(folder: Path, stem: str, protein: Protein, remark: str) -> list[str]:
    from .io.protein import to_mmcif, to_pdb

    _write_text(folder / f"{stem}.pdb", to_pdb(protein, remark=remark))
    _write_text(folder / f"{stem}.cif", to_mmcif(protein, name=stem))
    return [f"{stem}.pdb", f"{stem}.cif"]


def _write_confidence(folder: Path, name: str, pred: Prediction) -> list[str]:
    from .io.confidence import confidence_dict, plot_pae, plot_plddt, write_confidence_json

    write_confidence_json(folder / f"{name}_confidence.json", confidence_dict(pred.plddt, pred.ptm, pred.pae))
    plot_plddt(folder / f"{name}_plddt.png", pred.plddt, f"{name}: mean pLDDT {pred.plddt.mean():.1f}")
    files = [f"{name}_confidence.json", f"{name}_plddt.png"]
    if pred.pae is not None:
        plot_pae(folder / f"{name}_pae.png", pred.pae, f"{name}: pTM {pred.ptm:.3f}")
        files.append(f"{name}_pae.png")
    return files


def write_target_outputs(
    target: Target,
    predictions: dict[str, Prediction],
    folder: str | Path,
    relax_config: Any = None,
    timings: dict[str, float] | None = None,
    remark: str = "",
) -> list[str]:
    """Write every output file of one target (module docstring) and return their names.

    `predictions` maps model label -> Prediction; the best ranked one is relaxed (when `relax_config` is
    given) and written under the target's name. `timings.json` is written last; `timings` (seconds per
    stage) gets the relaxation time added.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    timings = timings if timings is not None else {}
    files = []
    from .io.protein import to_pdb

    for label, pred in predictions.items():
        text = to_pdb(prediction_to_protein(target, pred), remark=remark)
        _write_text(folder / f"{target.name}_{label}_unrelaxed.pdb", text)
        files.append(f"{target.name}_{label}_unrelaxed.pdb")
    metric = "ptm" if all(p.ptm is not None for p in predictions.values()) else "mean_plddt"
    ranked = sorted(predictions, key=lambda k: -predictions[k].ranking_score(metric))
    best = predictions[ranked[0]]
    unrelaxed = prediction_to_protein(target, best)
    files += _write_structure(folder, f"{target.name}_unrelaxed", unrelaxed, f"{remark} model {ranked[0]}".strip())
    relax_summary = None
    if relax_config is not None:
        from .relax import relax_protein

        result = relax_protein(unrelaxed, relax_config)
        relax_summary = result.summary()
        timings["relax"] = result.seconds
        files += _write_structure(folder, f"{target.name}_relaxed", result.protein, f"{remark} relaxed".strip())
    files += _write_confidence(folder, target.name, best)
    ranking = {"order": ranked, "scores": {k: predictions[k].ranking_score(metric) for k in ranked}, "metric": metric}
    _write_text(folder / "ranking.json", json.dumps(ranking, indent=2))
    files.append("ranking.json")
    record = {"target": target.name, "length": len(target.sequence), "timings": timings,
              "mean_plddt": float(best.plddt.mean()), "relax": relax_summary, "files": files}
    _write_text(folder / "timings.json", json.dumps(record, indent=2))
    return [*files, "timings.json"]


def is_complete(target: Target, output_dir: str | Path) -> bool:
    """True when the target's `timings.json` exists and every file it lists exists."""
    record_path = Path(output_dir) / target.name / "timings.json"
    if not record_path.exists():
        return False
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError:
        return False
    return all((record_path.parent / f).exists() for f in record.get("files", []))


# --------------------------------------------------------------------------------------------------- flow


class _Models:
    """Models built once per run, on first use."""

    def __init__(self, specs: list[ModelSpec]) -> None:
        self.specs = specs
        self._built: dict[str, tuple[Any, FeatureConfig]] = {}

    def get(self, spec: ModelSpec) -> tuple[Any, FeatureConfig]:
        if spec.label not in self._built:
            self._built[spec.label] = load_model(spec)
        return self._built[spec.label]

    def feature_config(self, spec: ModelSpec) -> FeatureConfig:
        return self.get(spec)[1]


def _predict_all(target: Target, raw: dict[str, np.ndarray], cfg: FoldConfig, models: _Models,
                 timings: dict[str, float]) -> dict[str, Prediction]:
    """Every model's prediction for one target (reusing predictions cached by an interrupted run)."""
    folder = Path(cfg.output_dir) / target.name
    folder.mkdir(parents=True, exist_ok=True)
    predictions = {}
    for spec in cfg.models:
        cache = folder / f"{target.name}_{spec.label}_prediction.npz"
        if cache.exists() and not cfg.overwrite:
            predictions[spec.label] = Prediction.load(cache)
            continue
        t0 = time.perf_counter()
        model, feature_cfg = models.get(spec)
        batch = features_for_model(raw, feature_cfg, cfg.seed)
        if cfg.devices > 1:
            predictions[spec.label] = predict_dap(spec, batch, cfg.devices, folder)
        else:
            predictions[spec.label] = predict(model, batch, spec)
        predictions[spec.label].save(cache)
        timings[f"model_{spec.label}"] = time.perf_counter() - t0
    return predictions


def _remark(cfg: FoldConfig) -> str:
    return "" if all(s.param_path for s in cfg.models) else "RANDOM WEIGHTS: structure is meaningless"


def _outputs_job(target: Target, predictions: dict[str, Prediction], folder: str, relax: Any,
                 timings: dict[str, float], remark: str) -> tuple[list[str], dict[str, float]]:
    """What one Ray relax/output task runs."""
    files = write_target_outputs(target, predictions, folder, relax, timings, remark)
    return files, timings


def _done(target: Target, folder: Path, files: list[str], timings: dict[str, float]) -> TargetResult:
    record = json.loads((folder / "timings.json").read_text())
    return TargetResult(target, "done", record["mean_plddt"], sum(timings.values()), str(folder), files=files)


def _uses_ray(cfg: FoldConfig, num_targets: int) -> bool:
    return num_targets > 0 and (cfg.ray_address is not None or (cfg.num_workers > 0 and num_targets > 1))


@contextlib.contextmanager
def _ray_session(cfg: FoldConfig):
    """Ray for this run: the cluster at `cfg.ray_address`, else a local one with `cfg.num_workers` CPUs;
    left running when the caller had already started one."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        if cfg.ray_address:
            ray.init(address=cfg.ray_address, log_to_driver=False)
        else:
            ray.init(num_cpus=max(cfg.num_workers, 1), include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
    try:
        yield ray
    finally:
        if started_here:
            ray.shutdown()


def _features_job(target: Target, cfg: AlignmentConfig, work_dir: str, with_templates: bool):
    """What one Ray task runs: the raw features and the seconds they took."""
    t0 = time.perf_counter()
    raw = target_raw_features(target, cfg, work_dir, with_templates)
    return raw, time.perf_counter() - t0


def feature_stream(targets: list[Target], cfg: FoldConfig, with_templates: bool):
    """Yield (target, raw features or the exception it raised, seconds) as each target's features are ready:
    Ray tasks when `cfg.ray_address` or `cfg.num_workers > 0` with several targets, else in this process."""
    def work_dir(t: Target) -> str:
        return str(Path(cfg.output_dir) / t.name)

    if not _uses_ray(cfg, len(targets)):
        for t in targets:
            try:
                raw, seconds = _features_job(t, cfg.alignment, work_dir(t), with_templates)
                yield t, raw, seconds
            except Exception as exc:  # noqa: BLE001 - one target's failure is reported, the others go on
                yield t, exc, 0.0
        return
    yield from _ray_feature_stream(targets, cfg, with_templates, work_dir)


_feature_stream = feature_stream  # the name recipes.fold first used


def _ray_feature_stream(targets, cfg: FoldConfig, with_templates: bool, work_dir):
    with _ray_session(cfg) as ray:
        remote = ray.remote(num_cpus=1, max_retries=0)(_features_job)
        pending = {remote.remote(t, cfg.alignment, work_dir(t), with_templates): t for t in targets}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            target = pending.pop(done[0])
            try:
                raw, seconds = ray.get(done[0])
                yield target, raw, seconds
            except Exception as exc:  # noqa: BLE001
                yield target, _ray_cause(exc), 0.0


def _ray_cause(exc: BaseException) -> BaseException:
    return getattr(exc, "cause", None) or exc


def fold_targets(
    targets: list[Target], cfg: FoldConfig, emit: Callable[[str, Target], None] | None = None
) -> list[TargetResult]:
    """Fold every target; complete ones are skipped unless `cfg.overwrite`. Never raises for one target's
    failure: its `TargetResult.status` is "failed" with the error. `emit(stage, target)` reports progress
    (stages "skipped", "features", "model", "outputs", "failed")."""
    emit = emit or (lambda stage, target: None)
    results: dict[str, TargetResult] = {}
    todo = []
    for t in targets:
        if not cfg.overwrite and is_complete(t, cfg.output_dir):
            results[t.name] = TargetResult(t, "skipped", _recorded_plddt(t, cfg.output_dir),
                                           folder=str(Path(cfg.output_dir) / t.name))
            emit("skipped", t)
        else:
            todo.append(t)
    models = _Models(cfg.models)
    with_templates = any(models.feature_config(s).max_templates > 0 for s in cfg.models) if todo else False
    use_ray = _uses_ray(cfg, len(todo))
    with _ray_session(cfg) if use_ray else contextlib.nullcontext() as ray:
        # relaxation goes to Ray too (local Ray only: a cluster's workers may not see output_dir)
        relax_remote = None
        if use_ray and cfg.relax is not None and cfg.ray_address is None:
            relax_remote = ray.remote(num_cpus=1, max_retries=0)(_outputs_job)
        pending: dict[Any, Target] = {}
        for target, raw, seconds in feature_stream(todo, cfg, with_templates):
            if isinstance(raw, BaseException):
                results[target.name] = _failed(target, raw, emit)
                continue
            emit("features", target)
            folder = Path(cfg.output_dir) / target.name
            try:
                timings = {"features": seconds}
                predictions = _predict_all(target, raw, cfg, models, timings)
                emit("model", target)
                if relax_remote is not None:
                    ref = relax_remote.remote(target, predictions, str(folder), cfg.relax, timings, _remark(cfg))
                    pending[ref] = target
                else:
                    files = write_target_outputs(target, predictions, folder, cfg.relax, timings, _remark(cfg))
                    results[target.name] = _done(target, folder, files, timings)
                    emit("outputs", target)
            except Exception as exc:  # noqa: BLE001 - one target's failure is reported, the others go on
                results[target.name] = _failed(target, exc, emit)
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            target = pending.pop(ref)
            try:
                files, timings = ray.get(ref)
                results[target.name] = _done(target, Path(cfg.output_dir) / target.name, files, timings)
                emit("outputs", target)
            except Exception as exc:  # noqa: BLE001
                results[target.name] = _failed(target, _ray_cause(exc), emit)
    return [results[t.name] for t in targets]


def _failed(target: Target, exc: BaseException, emit: Callable[[str, Target], None]) -> TargetResult:
    logger.error("target %s failed: %s: %s", target.name, type(exc).__name__, exc)
    logger.debug("target %s failure", target.name, exc_info=exc)
    emit("failed", target)
    return TargetResult(target, "failed", error=f"{type(exc).__name__}: {exc}")


def _recorded_plddt(target: Target, output_dir: str | Path) -> float | None:
    record = json.loads((Path(output_dir) / target.name / "timings.json").read_text())
    return record.get("mean_plddt")
