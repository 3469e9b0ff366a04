"""The `suite fold` flow as reusable functions: FASTA -> alignments -> features -> model -> relax -> files.

`suite fold` and the Lightning recipe (`recipes.FoldDataModule`, `recipes.AlphaFoldPredictor`,
`recipes.FoldPredictionWriter`) call these same functions:

- `read_targets(fasta)`: validated targets (`InputError` names the record and position).
- `target_raw_features(target, alignment_config, work_dir, with_templates)`: alignments (precomputed,
  tool runs, or single sequence) and templates -> raw features. This is the job Ray runs per target.
- `load_model(spec)` / `features_for_model(raw, feature_config, seed)` / `predict(model, batch, spec)`.
- `write_target_outputs(...)`: PDB, mmCIF, confidence JSON, PNG plots, relaxation, `timings.json`.
- `fold_targets(targets, config)`: the whole flow with Ray, resume and per-target failure reporting.

Complexes (AlphaFold-Multimer models, `model_N_multimer[_v2|_v3]`): `read_complex_targets(fasta)` gives one
`ComplexTarget` per complex (`fastfold.data.multimer.read_complexes`); its features are
`complex_raw_features` -> `process_multimer_features`, its outputs one PDB/mmCIF with a chain ID per chain, ipTM
and chain-pair PAE in the confidence JSON, ranking by 0.8 ipTM + 0.2 pTM.

Output layout, per target `<output_dir>/<name>/`: `<name>_<model>_unrelaxed.pdb` and
`<name>_<model>_prediction.npz` per model (the npz lets an interrupted run resume), then for the best
model (AlphaFold's ranking: mean pLDDT for monomer models, `_ptm` ones too; 0.8 ipTM + 0.2 pTM for
multimer) `<name>_unrelaxed.pdb|.cif`,
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

from ..utils.fileio import atomic_write
from .data import fingerprint as fp
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
    "ComplexTarget",
    "FoldConfig",
    "ModelSpec",
    "Prediction",
    "Target",
    "TargetResult",
    "dap_session",
    "feature_stream",
    "features_for_model",
    "fold_targets",
    "inputs_summary",
    "is_complete",
    "load_model",
    "predict",
    "prediction_to_protein",
    "target_fingerprint",
    "read_alignment_dir",
    "read_complex_targets",
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
    inplace: bool = False
    """In-place residual updates (inference only; FastFold's `--inplace`): one activation copy less."""

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

    @property
    def multimer(self) -> bool:
        """An AlphaFold-Multimer preset (`model_N_multimer[_v2|_v3]`): folds `ComplexTarget`s."""
        return "_multimer" in self.model_name


@dataclasses.dataclass(frozen=True)
class ComplexTarget(Target):
    """A complex as a folding target: `sequence` is every chain's sequence in feature order (the residues of the
    outputs), `complex` the `fastfold.data.multimer.Complex` (chains, chain IDs, entities)."""

    complex: Any = dataclasses.field(default=None, compare=False)

    @classmethod
    def of(cls, cplx: Any) -> ComplexTarget:
        chains = cplx.feature_order()
        description = "; ".join(f"{c.chain_id}: {c.description or c.name}" for c in cplx.chains)
        return cls(cplx.name, "".join(c.sequence for c in chains), description, complex=cplx)

    def chain_ranges(self) -> list[tuple[Any, int, int]]:
        """(chain, start, end) in feature order: the residues `[start, end)` of each chain in the outputs."""
        out, start = [], 0
        for chain in self.complex.feature_order():
            out.append((chain, start, start + len(chain.sequence)))
            start += len(chain.sequence)
        return out


def read_complex_targets(fasta_path: str | Path) -> list[ComplexTarget]:
    """The complexes of a FASTA file or folder (`fastfold.data.multimer.read_complexes`: ColabFold's `A:B`
    records or OpenFold's one file per complex) as targets; bad input raises `InputError` (one line)."""
    from .data.multimer import read_complexes

    return [ComplexTarget.of(c) for c in read_complexes(fasta_path)]


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
    """DAP ranks that share each model's Evoformer (1: this process alone, no process group). With more, one
    `fastfold.dap.DAPRuntime` serves the whole run: this process is rank 0, the other ranks are spawned once."""
    dap_timeout_s: float = 1800.0
    """Collective timeout of the DAP group: a rank that stops answering fails the run after this long."""
    num_workers: int = 0
    """Ray CPUs for alignment/feature jobs; 0: in this process, one target after another."""
    ray_address: str | None = None
    """Existing Ray cluster to use instead of starting a local one."""
    num_recycle: int | None = None
    """Recycling iterations; None: each model's preset (3 for the released models)."""
    num_seeds: int = 1
    """Predictions per model, MSA sampling seeds `seed`, `seed + 1`, ...; with several, labels end `_seed_<k>`."""
    subtract_plddt: bool = False
    """B-factor column holds 100 - pLDDT (OpenFold's `--subtract_plddt`) instead of pLDDT."""

    def __post_init__(self) -> None:
        if self.num_recycle is not None and self.num_recycle < 0:
            raise ValueError(f"FoldConfig.num_recycle must be >= 0, got {self.num_recycle}")
        if self.num_seeds < 1:
            raise ValueError(f"FoldConfig.num_seeds must be >= 1, got {self.num_seeds}")
        if not self.models:
            raise ValueError("FoldConfig.models must name at least one model")
        if self.devices < 1:
            raise ValueError(f"FoldConfig.devices must be >= 1, got {self.devices}")
        if not self.dap_timeout_s > 0:
            raise ValueError(f"FoldConfig.dap_timeout_s must be > 0, got {self.dap_timeout_s}")
        if self.num_workers < 0:
            raise ValueError(f"FoldConfig.num_workers must be >= 0, got {self.num_workers}")
        labels = [m.label for m in self.models]
        if len(set(labels)) != len(labels):
            raise ValueError(f"FoldConfig.models repeats a model name: {labels}")
        if len({m.multimer for m in self.models}) > 1:
            raise ValueError(f"FoldConfig.models mixes monomer and multimer models: {labels}")

    @property
    def multimer(self) -> bool:
        """The models are AlphaFold-Multimer's: targets are `ComplexTarget`s."""
        return self.models[0].multimer


@dataclasses.dataclass
class Prediction:
    """One model's prediction for one target (numpy, float32).

    `positions` `[N, 37, 3]`, `atom_mask` `[N, 37]`, `plddt` `[N]`, `pae` `[N, N]` or None, `ptm` or None;
    multimer models also `iptm` and `ranking_confidence` (0.8 ipTM + 0.2 pTM)."""

    positions: np.ndarray
    atom_mask: np.ndarray
    plddt: np.ndarray
    pae: np.ndarray | None = None
    ptm: float | None = None
    iptm: float | None = None
    ranking_confidence: float | None = None

    def ranking_score(self, metric: str) -> float:
        """AlphaFold's ranking: `metric` "iptm+ptm" (multimer: 0.8 ipTM + 0.2 pTM) or "mean_plddt" (every monomer
        model, `_ptm` ones too, as AlphaFold's `ranking_confidence`); "ptm" is kept for callers that ask for it."""
        if metric == "iptm+ptm":
            return float(self.ranking_confidence)
        return float(self.ptm) if metric == "ptm" else float(self.plddt.mean())

    def save(self, path: Path, fingerprint: str | None = None) -> None:
        """`fingerprint` (JSON of what made it) is stored beside the arrays, so a cache is reused only for the
        same inputs (`cached_fingerprint`)."""
        arrays = {"positions": self.positions, "atom_mask": self.atom_mask, "plddt": self.plddt}
        if self.pae is not None:
            arrays.update(pae=self.pae, ptm=np.array(self.ptm, np.float32))
        if self.iptm is not None:
            arrays.update(iptm=np.array(self.iptm, np.float32),
                          ranking_confidence=np.array(self.ranking_confidence, np.float32))
        if fingerprint is not None:
            arrays["fingerprint"] = np.array(fingerprint)
        with atomic_write(path, "wb") as f:
            np.savez(f, **arrays)

    @staticmethod
    def cached_fingerprint(path: Path) -> str | None:
        """The fingerprint a saved prediction was stored with (None: none, or an unreadable file)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                return str(z["fingerprint"]) if "fingerprint" in z else None
        except (OSError, ValueError, EOFError, KeyError):
            return None

    @classmethod
    def load(cls, path: Path) -> Prediction:
        with np.load(path) as z:
            pae = z["pae"] if "pae" in z else None
            ptm = float(z["ptm"]) if "ptm" in z else None
            iptm = float(z["iptm"]) if "iptm" in z else None
            rank = float(z["ranking_confidence"]) if "ranking_confidence" in z else None
            return cls(z["positions"], z["atom_mask"], z["plddt"], pae, ptm, iptm, rank)


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
    note: str = ""
    """Why a finished target was redone (its inputs changed), or other remarks for the summary."""
    inputs: str = ""
    """What the features were made of, in a few words (MSA depth per source, templates)."""
    relax_problem: str = ""
    """Why the relaxation cannot be trusted ("" when it can, or did not run): not converged, or refused
    because it broke chirality or cis/trans peptides (then no relaxed file is written)."""
    relax: str = ""
    """The relaxation in a few words ("relax 12.3 s, 2 passes"; "" when it did not run), also in `note` of a
    target done now; `timings.json` has each pass's energies, violations, iterations and seconds."""


# --------------------------------------------------------------------------------------------------- model


def load_model(spec: ModelSpec) -> tuple[Any, FeatureConfig]:
    """The model (eval mode, `spec.precision`) and the feature sizes it wants."""
    import torch

    from .model import AlphaFold
    from .model import config as model_config
    from .params import from_params

    if spec.multimer:
        return _load_multimer(spec)
    if spec.param_path is not None:
        model = from_params(spec.param_path, preset=spec.model_name)
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


def _device(spec: ModelSpec) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if spec.device == "auto" else spec.device


def _load_multimer(spec: ModelSpec) -> tuple[Any, FeatureConfig]:
    """An AlphaFold-Multimer model: from its `.npz` (`params_multimer.load_model`, sizes from the file), else
    random weights (`multimer_tiny` when `spec.tiny`, else the preset's real widths); MSA sizes of the preset."""
    import torch

    from .model.multimer import AlphaFoldMultimer, multimer_preset, multimer_tiny
    from .params_multimer import load_model as load_multimer

    if spec.param_path is not None:
        model = load_multimer(spec.param_path, preset=spec.model_name)
    else:
        cfg = multimer_preset(spec.model_name)  # also validates the name
        torch.manual_seed(spec.seed)
        model = AlphaFoldMultimer(multimer_tiny() if spec.tiny else cfg)
    cfg = model.config
    model = model.to(device=_device(spec), dtype=getattr(torch, PRECISIONS[spec.precision])).eval()
    p = cfg.pipeline
    feats = FeatureConfig(max_msa_clusters=p.max_msa_clusters, max_extra_msa=p.max_extra_msa,
                          max_templates=p.max_templates if cfg.template.enabled else 0, num_recycle=p.num_recycle)
    return model, feats


def features_for_model(raw: dict[str, np.ndarray], feature_config: FeatureConfig, seed: int) -> dict[str, np.ndarray]:
    """The processed batch for one model (see `fastfold.data.features`); a complex's raw features (with
    `asym_id`) get AlphaFold-Multimer's processing (`fastfold.data.multimer.process_multimer_features`)."""
    if "asym_id" in raw:
        from .data.multimer import process_multimer_features

        return process_multimer_features(raw, feature_config, seed=seed)
    return process_features(raw, feature_config, seed=seed)


def _inference_options(spec: ModelSpec, device: Any = None) -> Any:
    """The model's options; `chunk_size="auto"` fits the memory budget of `device` (where the model's
    parameters are: `InferenceOptions.for_device`, a share of the free CUDA memory, or the CPU budget)."""
    from .model import InferenceOptions

    residual = "in_place" if spec.inplace else "out_of_place"
    if spec.chunk_size == "auto":
        return InferenceOptions.for_device(device if device is not None else _device(spec), chunk_size="auto",
                                           residual=residual)
    return InferenceOptions(chunk_size=spec.chunk_size, residual=residual)


def _to_prediction(outputs: dict[str, Any]) -> Prediction:
    def arr(key: str) -> np.ndarray:
        return outputs[key].detach().float().cpu().numpy()

    pae = arr("predicted_aligned_error") if "predicted_aligned_error" in outputs else None
    ptm = float(arr("ptm_score")) if "ptm_score" in outputs else None
    iptm = float(arr("iptm_score")) if "iptm_score" in outputs else None
    rank = float(arr("ranking_confidence")) if "ranking_confidence" in outputs else None
    return Prediction(arr("final_atom_positions"), arr("final_atom_mask"), arr("plddt"), pae, ptm, iptm, rank)


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
        outputs = model(tensors, options=_inference_options(spec, param.device))
    return _to_prediction(outputs)


def _hold(runtime: Any, spec: ModelSpec) -> tuple[Any, FeatureConfig]:
    """`spec`'s model held by this rank of a DAP runtime: built on the rank's device, rank 0's weights, split
    across the group; the previously held model is dropped first."""
    return runtime.hold(spec, lambda: load_model(dataclasses.replace(spec, device=str(runtime.device))))


def _dap_model(runtime: Any, spec: ModelSpec, _source: Any = None) -> tuple[Any, FeatureConfig] | None:
    """On every rank of a DAP runtime: hold `spec`'s model. Rank 0 gets (model, feature sizes)."""
    held = _hold(runtime, spec)
    return held if runtime.rank == 0 else None


def _dap_predict(runtime: Any, spec: ModelSpec, batch: dict[str, np.ndarray] | None) -> Prediction | None:
    """On every rank of a DAP runtime: `predict` with `spec`'s model on rank 0's `batch` (broadcast)."""
    from .data.features import to_torch

    model, _ = _hold(runtime, spec)
    tensors = runtime.broadcast(None if batch is None else to_torch(batch))
    prediction = predict(model, tensors, spec)
    return prediction if runtime.rank == 0 else None


@contextlib.contextmanager
def dap_session(cfg: FoldConfig, work: bool = True):
    """The DAP runtime of a run (`cfg.devices` ranks, spawned once; NCCL with one GPU per rank when the models
    run on CUDA, gloo on CPU), or None with one device or no `work` to do."""
    if cfg.devices == 1 or not work:
        yield None
        return
    import torch

    from .dap import DAPRuntime

    kinds = {("cuda" if torch.cuda.is_available() else "cpu") if s.device == "auto" else s.device.split(":")[0]
             for s in cfg.models}
    if len(kinds) > 1:
        raise ValueError(f"FoldConfig.models: DAP runs every model on one kind of device, got {sorted(kinds)}")
    with DAPRuntime.launch(cfg.devices, device_type=kinds.pop(), timeout_s=cfg.dap_timeout_s) as runtime:
        yield runtime


# --------------------------------------------------------------------------------------------------- outputs


def prediction_to_protein(target: Target, prediction: Prediction, b_factors: np.ndarray | None = None) -> Protein:
    """The predicted structure as a `Protein` (1-based residue numbers, pLDDT as B-factors by default); a
    complex's chains in feature order, each with its chain ID and residues numbered from 1."""
    raw = make_sequence_features(target.sequence)
    plddt = np.repeat(prediction.plddt[:, None], 37, axis=1) if b_factors is None else b_factors
    if not isinstance(target, ComplexTarget):
        return Protein(prediction.positions.astype(np.float64), prediction.atom_mask, raw["aatype"],
                       raw["residue_index"] + 1, plddt)
    ranges = target.chain_ranges()
    numbers = np.concatenate([np.arange(1, end - start + 1) for _, start, end in ranges])
    index = np.concatenate([np.full(end - start, k) for k, (_, start, end) in enumerate(ranges)])
    return Protein(prediction.positions.astype(np.float64), prediction.atom_mask, raw["aatype"], numbers, plddt,
                   chain_index=index, chain_ids=tuple(c.chain_id for c, _, _ in ranges))


def _write_text(path: Path, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text)


def _write_structure(folder: Path, stem: str, protein: Protein, remark: str, pred: Prediction) -> list[str]:
    """PDB and ModelCIF; `pred.plddt` [N] goes to the ModelCIF QA metrics (the B-factors may hold 100 - pLDDT),
    with pTM and ipTM when the model gives them."""
    from .io.protein import to_mmcif, to_pdb

    scores = {k: v for k, v in (("pTM", pred.ptm), ("ipTM", pred.iptm)) if v is not None}
    method = "AlphaFold-Multimer" if pred.iptm is not None else "AlphaFold2 monomer"
    _write_text(folder / f"{stem}.pdb", to_pdb(protein, remark=remark))
    _write_text(folder / f"{stem}.cif", to_mmcif(protein, name=stem, plddt=pred.plddt, title=remark, scores=scores,
                                                 method=method))
    return [f"{stem}.pdb", f"{stem}.cif"]


def _chain_table(target: Target) -> list[dict[str, Any]] | None:
    if not isinstance(target, ComplexTarget):
        return None
    return [{"chain_id": c.chain_id, "name": c.name, "residues": [start, end]} for c, start, end in
            target.chain_ranges()]


def _write_confidence(folder: Path, name: str, pred: Prediction, mark: str = "", plots: bool = True,
                      chains: list[dict[str, Any]] | None = None) -> list[str]:
    """`<name>_confidence.json` (pLDDT, pTM, PAE; for a complex also ipTM, the ranking confidence, per-chain
    pLDDT and the chain-pair PAE) and, with `plots`, the pLDDT and PAE plots (chain boundaries drawn)."""
    from .io.confidence import chain_confidences, confidence_dict, plot_pae, plot_plddt, write_confidence_json

    confidence = confidence_dict(pred.plddt, pred.ptm, pred.pae)
    if pred.iptm is not None:
        confidence.update(iptm=round(float(pred.iptm), 4), ranking_confidence=round(float(pred.ranking_confidence), 4))
    if chains is not None:
        confidence.update(chain_confidences(pred.plddt, pred.pae, chains))
    write_confidence_json(folder / f"{name}_confidence.json", confidence)
    files = [f"{name}_confidence.json"]
    if not plots:
        return files
    plot_plddt(folder / f"{name}_plddt.png", pred.plddt, f"{name}: mean pLDDT {pred.plddt.mean():.1f}", mark=mark)
    files.append(f"{name}_plddt.png")
    if pred.pae is not None:
        title = f"{name}: pTM {pred.ptm:.3f}" + (f", ipTM {pred.iptm:.3f}" if pred.iptm is not None else "")
        bounds = None if chains is None else [(c["chain_id"], *c["residues"]) for c in chains]
        plot_pae(folder / f"{name}_pae.png", pred.pae, title, mark=mark, chains=bounds)
        files.append(f"{name}_pae.png")
    return files


def _plot_mark(remark: str) -> str:
    return "RANDOM WEIGHTS" if "RANDOM WEIGHTS" in remark else ""


def write_target_outputs(
    target: Target,
    predictions: dict[str, Prediction],
    folder: str | Path,
    relax_config: Any = None,
    timings: dict[str, float] | None = None,
    remark: str = "",
    features_info: dict[str, Any] | None = None,
    fingerprint: dict[str, Any] | None = None,
    subtract_plddt: bool = False,
    msa: np.ndarray | None = None,
) -> list[str]:
    """Write every output file of one target (module docstring) and return their names.

    `predictions` maps model label -> Prediction; every one gets its PDB, mmCIF and confidence JSON (and
    plots when there are several); the best ranked one is relaxed (when `relax_config` is given) and
    written under the target's name. `features_info` (what the features were made of) goes to
    `features.json`; `fingerprint` (what made the outputs) to `timings.json`, which is written last;
    `timings` (seconds per stage) gets the relaxation time added. `subtract_plddt`: B-factors are 100 - pLDDT.
    `msa` (the raw `msa` feature `[S, N]`): its coverage plot, as ColabFold draws it, to `<target>_coverage.png`.
    """

    def protein(pred: Prediction) -> Protein:
        b = None if not subtract_plddt else np.repeat(100.0 - pred.plddt[:, None], 37, axis=1)
        return prediction_to_protein(target, pred, b)

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    timings = timings if timings is not None else {}
    files = []
    mark = _plot_mark(remark)
    several = len(predictions) > 1
    chains = _chain_table(target)
    for label, pred in predictions.items():
        stem = f"{target.name}_{label}"
        files += _write_structure(folder, f"{stem}_unrelaxed", protein(pred), remark, pred)
        files += _write_confidence(folder, stem, pred, mark, plots=several, chains=chains)
    if all(p.iptm is not None for p in predictions.values()):
        metric = "iptm+ptm"  # AlphaFold-Multimer's ranking confidence, 0.8 ipTM + 0.2 pTM
    else:
        metric = "mean_plddt"  # AlphaFold ranks monomer models, `_ptm` ones too, by mean pLDDT
    ranked = sorted(predictions, key=lambda k: -predictions[k].ranking_score(metric))
    best = predictions[ranked[0]]
    unrelaxed = protein(best)
    files += _write_structure(folder, f"{target.name}_unrelaxed", unrelaxed, f"{remark} model {ranked[0]}".strip(),
                              best)
    relax_summary = None
    if relax_config is not None:
        from .relax import relax_protein

        result = relax_protein(unrelaxed, relax_config)
        relax_summary = result.summary()
        timings["relax"] = result.seconds
        if result.chirality_changed or result.cis_changed:
            # AlphaFold's relaxation keeps chirality and cis/trans peptides: a result that broke them is refused
            # (and an older relaxed file of this target removed, so none can pass for this run's)
            for suffix in (".pdb", ".cif"):
                (folder / f"{target.name}_relaxed{suffix}").unlink(missing_ok=True)
            relax_summary["refused"] = True
        else:
            tag = "relaxed" if result.converged else f"relaxed, NOT CONVERGED ({result.violations_after} violating)"
            files += _write_structure(folder, f"{target.name}_relaxed", result.protein, f"{remark} {tag}".strip(),
                                      best)
    files += _write_confidence(folder, target.name, best, mark, chains=chains)
    ranking = {"order": ranked, "scores": {k: predictions[k].ranking_score(metric) for k in ranked}, "metric": metric}
    _write_text(folder / "ranking.json", json.dumps(ranking, indent=2))
    # AlphaFold's file: mean pLDDT per model and the order the outputs were ranked in
    debug: dict[str, Any] = {"plddts": {k: float(predictions[k].plddt.mean()) for k in ranked}}
    if all(p.ptm is not None for p in predictions.values()):  # extra information; not the ranking of monomers
        debug["ptms"] = {k: float(predictions[k].ptm) for k in ranked}
    if metric == "iptm+ptm":  # AlphaFold-Multimer's ranking_debug.json: the ranking confidence under "iptm+ptm"
        debug["iptms"] = {k: float(predictions[k].iptm) for k in ranked}
        debug["iptm+ptm"] = {k: float(predictions[k].ranking_confidence) for k in ranked}
    debug["order"] = ranked
    _write_text(folder / "ranking_debug.json", json.dumps(debug, indent=4))
    files += ["ranking.json", "ranking_debug.json"]
    if features_info is not None:
        _write_text(folder / "features.json", json.dumps(features_info, indent=2))
        files.append("features.json")
    if msa is not None:
        from .io.confidence import plot_msa_coverage

        depth = f"{len(msa)} sequence{'s' if len(msa) != 1 else ''}"
        plot_msa_coverage(folder / f"{target.name}_coverage.png", msa, f"{target.name}: sequence coverage ({depth})")
        files.append(f"{target.name}_coverage.png")
    record = {"target": target.name, "description": target.description, "length": len(target.sequence),
              **({"chains": chains} if chains is not None else {}), "timings": timings,
              "mean_plddt": float(best.plddt.mean()), "relax": relax_summary,
              "inputs": features_info, "fingerprint": fingerprint, "files": files}
    _write_text(folder / "timings.json", json.dumps(record, indent=2))
    return [*files, "timings.json"]


def _record(target: Target, output_dir: str | Path) -> dict[str, Any] | None:
    """The target's `timings.json` when it and every file it lists exist, else None."""
    record_path = Path(output_dir) / target.name / "timings.json"
    if not record_path.exists():
        return None
    try:
        record = json.loads(record_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not all((record_path.parent / f).exists() for f in record.get("files", [])):
        return None
    return record


def is_complete(target: Target, output_dir: str | Path, fingerprint: dict[str, Any] | None = None) -> bool:
    """True when the target's `timings.json` exists and every file it lists exists; with `fingerprint`,
    also when the outputs were made from the same inputs (`target_fingerprint`)."""
    record = _record(target, output_dir)
    if record is None:
        return False
    return fingerprint is None or not fp.diff(record.get("fingerprint"), fingerprint)


def _param_entry(spec: ModelSpec) -> dict[str, Any]:
    if spec.param_path is None:
        return {"name": spec.model_name, "params": "random", "tiny": spec.tiny, "weight_seed": spec.seed}
    return {"name": spec.model_name, "params": fp.file_digest(spec.param_path)}


def _alignment_entry(target: Target, a: AlignmentConfig) -> dict[str, Any]:
    if a.precomputed_dir is not None:
        mode = "precomputed, single sequence" if a.single_sequence else "precomputed"
        if isinstance(target, ComplexTarget):  # every chain's folder (uniprot_hits.sto included)
            folders = dict.fromkeys(c.name for c in target.complex.chains)
            return {"mode": mode, "files": {n: fp.folder_digest(Path(a.precomputed_dir) / n) for n in folders}}
        return {"mode": mode, "files": fp.folder_digest(Path(a.precomputed_dir) / target.name)}
    if a.single_sequence or not a.runs_tools:
        return {"mode": "single_sequence"}
    dbs = {k: getattr(a, k) for k in ("uniref90_database_path", "mgnify_database_path", "bfd_database_path",
                                        "uniref30_database_path", "pdb70_database_path")}
    if isinstance(target, ComplexTarget) and a.uniprot_database_path:
        dbs["uniprot_database_path"] = a.uniprot_database_path
    return {"mode": "search", **{k: str(Path(v).resolve()) if v else None for k, v in dbs.items()}}


def target_fingerprint(target: Target, cfg: FoldConfig) -> dict[str, Any]:
    """What a target's outputs are made from (module `fastfold.data.fingerprint`): compared on a rerun."""
    a = cfg.alignment
    templates = None
    if a.template_mmcif_dir:
        templates = {"mmcif_dir": str(Path(a.template_mmcif_dir).resolve()), "max_template_date": a.max_template_date,
                     "kalign": a.kalign_binary_path}
        if a.obsolete_pdbs_path:
            templates["obsolete"] = fp.file_digest(a.obsolete_pdbs_path)
    relax = None
    if cfg.relax is not None:  # the OpenMM platform is left out: where it runs, not what it computes
        relax = dataclasses.asdict(cfg.relax) if dataclasses.is_dataclass(cfg.relax) else {"config": repr(cfg.relax)}
        relax.pop("platform", None)
    out = {
        "sequence": target.sequence,
        "models": [_param_entry(s) for s in cfg.models],
        "alignments": _alignment_entry(target, a),
        "templates": templates,
        "relax": relax,
        "seed": cfg.seed,
        "num_seeds": cfg.num_seeds,
        "precision": [s.precision for s in cfg.models],
        "num_recycle": cfg.num_recycle,
        "b_factors": "100 - pLDDT" if cfg.subtract_plddt else "pLDDT",
    }
    if isinstance(target, ComplexTarget):  # every chain: its ID, name (alignment folder) and sequence
        out["sequence"] = ":".join(c.sequence for c in target.complex.chains)
        out["chains"] = [[c.chain_id, c.name, c.sequence] for c in target.complex.chains]
    return out


def _model_fingerprint(target_fp: dict[str, Any], spec_index: int, seed: int) -> str:
    """The part of a target's fingerprint one model's prediction depends on (no relaxation), as JSON."""
    part = {k: target_fp[k] for k in ("sequence", "alignments", "templates", "num_recycle")}
    if "chains" in target_fp:
        part["chains"] = target_fp["chains"]
    part.update(model=target_fp["models"][spec_index], precision=target_fp["precision"][spec_index], seed=seed)
    return json.dumps(part, sort_keys=True)


# --------------------------------------------------------------------------------------------------- flow


FEATURE_INFO = "_feature_info"
"""Key of the raw-features dict under which `target_raw_features`' report travels (popped before use)."""


class _Models:
    """Models built on first use: in this process, each once per run and kept; or, with a DAP `runtime`, one
    at a time on every rank of the runtime (the held one is dropped before the next is built)."""

    def __init__(self, specs: list[ModelSpec], num_recycle: int | None = None, runtime: Any = None) -> None:
        self.specs = specs
        self.num_recycle = num_recycle
        self.runtime = runtime
        self._built: dict[str, tuple[Any, FeatureConfig]] = {}
        self._feats: dict[str, FeatureConfig] = {}

    def get(self, spec: ModelSpec) -> tuple[Any, FeatureConfig]:
        if self.runtime is not None:
            model, feats = self.runtime.call(_dap_model, spec)
        elif spec.label in self._built:
            return self._built[spec.label]
        else:
            model, feats = load_model(spec)
        if self.num_recycle is not None:
            feats = dataclasses.replace(feats, num_recycle=self.num_recycle)
        self._feats[spec.label] = feats
        if self.runtime is None:
            self._built[spec.label] = (model, feats)
        return model, feats

    def feature_config(self, spec: ModelSpec) -> FeatureConfig:
        return self._feats[spec.label] if spec.label in self._feats else self.get(spec)[1]

    def predict(self, spec: ModelSpec, raw: dict[str, np.ndarray], seed: int) -> Prediction:
        """`spec`'s prediction from one target's raw features (MSA sampling `seed`)."""
        if self.runtime is None:
            model, feats = self.get(spec)
            return predict(model, features_for_model(raw, feats, seed), spec)
        batch = features_for_model(raw, self.feature_config(spec), seed)
        return self.runtime.call(_dap_predict, spec, source=batch)

    def held_first(self, runs: list) -> list:
        """`runs` (from `_runs`) with the held model's first, so a DAP runtime switches models less often."""
        held = None if self.runtime is None else self.runtime.key
        return sorted(runs, key=lambda run: run[1] != held)


def _runs(cfg: FoldConfig) -> list[tuple[int, ModelSpec, str, int]]:
    """(model index, spec, output label, MSA sampling seed) of every prediction a target gets."""
    out = []
    for i, spec in enumerate(cfg.models):
        for k in range(cfg.num_seeds):
            label = spec.label if cfg.num_seeds == 1 else f"{spec.label}_seed_{cfg.seed + k}"
            out.append((i, spec, label, cfg.seed + k))
    return out


def _predict_all(target: Target, raw: dict[str, np.ndarray], cfg: FoldConfig, models: _Models,
                 timings: dict[str, float], target_fp: dict[str, Any] | None = None) -> dict[str, Prediction]:
    """Every model's prediction for one target, reusing a prediction cached by an interrupted run only when
    it was made from the same inputs (its stored fingerprint)."""
    folder = Path(cfg.output_dir) / target.name
    folder.mkdir(parents=True, exist_ok=True)
    target_fp = target_fp if target_fp is not None else target_fingerprint(target, cfg)
    predictions = {}
    for index, spec, label, seed in models.held_first(_runs(cfg)):
        cache = folder / f"{target.name}_{label}_prediction.npz"
        made_from = _model_fingerprint(target_fp, index, seed)
        if cache.exists() and not cfg.overwrite and Prediction.cached_fingerprint(cache) == made_from:
            predictions[label] = Prediction.load(cache)
            continue
        t0 = time.perf_counter()
        predictions[label] = models.predict(spec, raw, seed)
        predictions[label].save(cache, made_from)
        timings[f"model_{label}"] = time.perf_counter() - t0
    return {label: predictions[label] for _, _, label, _ in _runs(cfg)}


def _remark(cfg: FoldConfig) -> str:
    return "" if all(s.param_path for s in cfg.models) else "RANDOM WEIGHTS: structure is meaningless"


def _outputs_job(target: Target, predictions: dict[str, Prediction], folder: str, relax: Any,
                 timings: dict[str, float], remark: str, info: dict | None = None,
                 fingerprint: dict | None = None, subtract_plddt: bool = False,
                 msa: np.ndarray | None = None) -> tuple[list[str], dict[str, float]]:
    """What one Ray relax/output task runs."""
    files = write_target_outputs(target, predictions, folder, relax, timings, remark, info, fingerprint,
                                 subtract_plddt, msa)
    return files, timings


def inputs_summary(info: dict[str, Any] | None) -> str:
    """A few words on what the features were made of (the summary table's column)."""
    if not info:
        return ""
    if "chains" in info:  # a complex: paired rows, then each chain's own MSA depth
        per_chain = [f"{c['chain_id']} {c.get('msa_depth_dedup', 1)}" for c in info["chains"]]
        return f"MSA {info.get('msa_rows', 1)} rows ({info.get('paired_rows', 0)} paired; {', '.join(per_chain)})"
    depth = info.get("msa_depth_dedup", 1)
    parts = [f"MSA {depth}"]
    files = info.get("alignment_files", [])
    per_file = [f"{f['file'].split('_hits')[0].split('.')[0]} {f['rows_used']}" for f in files]
    if per_file:
        parts[0] += f" of {info.get('msa_depth_total', depth)} ({', '.join(per_file)})"
    elif "single" in info.get("msa_mode", ""):
        parts[0] = "single sequence"
    templates = info.get("templates", [])
    if templates:
        parts.append("templates " + " ".join(f"{t['pdb_id']}_{t['chain']}" for t in templates))
    else:
        parts.append("no templates")
    return "; ".join(parts)


def _relax_problem(record: dict[str, Any]) -> str:
    relax = record.get("relax") or {}
    problem = relax.get("problem", "")
    return f"relax {problem}" + ("; relaxed file refused" if relax.get("refused") else "") if problem else ""


def _relax_line(record: dict[str, Any]) -> str:
    relax = record.get("relax") or {}
    if not relax or relax.get("seconds") is None:
        return ""
    passes = relax.get("outer_iterations", 0)
    return f"relax {relax['seconds']:.1f} s, {passes} pass{'' if passes == 1 else 'es'}"


def _done(target: Target, folder: Path, files: list[str], timings: dict[str, float], note: str = "") -> TargetResult:
    record = json.loads((folder / "timings.json").read_text())
    relax = _relax_line(record)
    return TargetResult(target, "done", record["mean_plddt"], sum(timings.values()), str(folder), files=files,
                        note="; ".join(x for x in (note, relax) if x), inputs=inputs_summary(record.get("inputs")),
                        relax_problem=_relax_problem(record), relax=relax)


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
    """What one Ray task runs: the raw features (with their report under `FEATURE_INFO`) and the seconds
    they took."""
    t0 = time.perf_counter()
    info: dict[str, Any] = {}
    if isinstance(target, ComplexTarget):
        from .data.multimer import complex_raw_features

        raw = complex_raw_features(target.complex, cfg, work_dir, with_templates=with_templates, info=info)
    else:
        raw = target_raw_features(target, cfg, work_dir, with_templates, info=info)
    raw[FEATURE_INFO] = info
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


def _forget_outputs(target: Target, output_dir: str | Path, record: dict[str, Any]) -> None:
    """Remove a finished target's record and the files it lists, before redoing it with other inputs: an
    interrupted redo must not leave old outputs that look current (prediction caches carry their own
    fingerprint and stay)."""
    folder = Path(output_dir) / target.name
    (folder / "timings.json").unlink(missing_ok=True)
    for name in record.get("files", []):
        path = folder / name
        if path.parent == folder and not name.endswith("_prediction.npz"):
            path.unlink(missing_ok=True)


def fold_targets(
    targets: list[Target], cfg: FoldConfig, emit: Callable[[str, Target], None] | None = None
) -> list[TargetResult]:
    """Fold every target. A finished target is skipped only when its recorded fingerprint (what made it:
    sequence, models and parameter files, alignments, templates, relaxation, seeds, precision, recycles)
    equals this run's; otherwise it is redone and its result says why (`TargetResult.note`). `cfg.overwrite`
    redoes everything. Never raises for one target's failure: its `TargetResult.status` is "failed" with the
    error. `emit(stage, target)` reports progress (stages "skipped", "features", "model", "outputs", "failed")."""
    emit = emit or (lambda stage, target: None)
    results: dict[str, TargetResult] = {}
    fingerprints = {t.name: target_fingerprint(t, cfg) for t in targets}
    notes: dict[str, str] = {}
    todo = []
    for t in targets:
        record = _record(t, cfg.output_dir)
        changed = fp.diff(record.get("fingerprint"), fingerprints[t.name]) if record is not None else []
        if record is not None and not cfg.overwrite and not changed:
            results[t.name] = TargetResult(t, "skipped", record.get("mean_plddt"),
                                           folder=str(Path(cfg.output_dir) / t.name),
                                           note="same inputs as the finished run",
                                           inputs=inputs_summary(record.get("inputs")),
                                           relax_problem=_relax_problem(record), relax=_relax_line(record))
            emit("skipped", t)
            continue
        if record is not None:
            notes[t.name] = "redone (--overwrite)" if cfg.overwrite else f"redone: {', '.join(changed)} changed"
            logger.warning("target %s: %s since the finished run in %s", t.name, notes[t.name],
                           Path(cfg.output_dir) / t.name)
            _forget_outputs(t, cfg.output_dir, record)
        todo.append(t)
    with dap_session(cfg, bool(todo)) as runtime:
        _fold_todo(todo, cfg, _Models(cfg.models, cfg.num_recycle, runtime), fingerprints, notes, results, emit)
    return [results[t.name] for t in targets]


def _fold_todo(todo: list[Target], cfg: FoldConfig, models: _Models, fingerprints: dict[str, dict],
               notes: dict[str, str], results: dict[str, TargetResult], emit: Callable[[str, Target], None]) -> None:
    """Features, predictions and outputs of the targets to do, into `results`."""
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
            info = raw.pop(FEATURE_INFO, None)
            emit("features", target)
            folder = Path(cfg.output_dir) / target.name
            target_fp = fingerprints[target.name]
            try:
                timings = {"features": seconds}
                predictions = _predict_all(target, raw, cfg, models, timings, target_fp)
                emit("model", target)
                args = (target, predictions, str(folder), cfg.relax, timings, _remark(cfg), info, target_fp,
                        cfg.subtract_plddt, raw.get("msa"))
                if relax_remote is not None:
                    pending[relax_remote.remote(*args)] = target
                else:
                    files, _ = _outputs_job(*args)
                    results[target.name] = _done(target, folder, files, timings, notes.get(target.name, ""))
                    emit("outputs", target)
            except Exception as exc:  # noqa: BLE001 - one target's failure is reported, the others go on
                results[target.name] = _failed(target, exc, emit)
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            target = pending.pop(ref)
            try:
                files, timings = ray.get(ref)
                folder = Path(cfg.output_dir) / target.name
                results[target.name] = _done(target, folder, files, timings, notes.get(target.name, ""))
                emit("outputs", target)
            except Exception as exc:  # noqa: BLE001
                results[target.name] = _failed(target, _ray_cause(exc), emit)


def _failed(target: Target, exc: BaseException, emit: Callable[[str, Target], None]) -> TargetResult:
    logger.error("target %s failed: %s: %s", target.name, type(exc).__name__, exc)
    logger.debug("target %s failure", target.name, exc_info=exc)
    emit("failed", target)
    return TargetResult(target, "failed", error=f"{type(exc).__name__}: {exc}")
