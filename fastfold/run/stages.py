"""One target's stages before its outputs: the raw features (`target_features`, the job Ray runs per target), the
model (`ModelSpec`, `load_model`, `Models`), the processed batch (`features_for_model`) and the prediction
(`predict` -> `Prediction`), in this process or on every rank of a DAP runtime.

Targets are `fastfold.data.targets.Target`s, or `ComplexTarget`s for AlphaFold-Multimer models
(`read_complex_targets`). `fastfold.run.pipeline` schedules these stages over the targets of a run.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ...utils.fileio import atomic_write
from ..data.features import FeatureConfig, process_features
from ..data.gap import GapTarget
from ..data.targets import AlignmentConfig, Target, target_raw_features

__all__ = [
    "FEATURE_INFO",
    "PRECISIONS",
    "ComplexTarget",
    "GapTarget",
    "ModelSpec",
    "Models",
    "Prediction",
    "features_for_model",
    "load_model",
    "predict",
    "read_complex_targets",
    "target_features",
]

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
    chunk_size: int | Literal["auto"] | None = None
    """Chunk size of the low-memory inference path; None: no chunking; "auto": fit a memory budget
    (`fastfold.model.options.check_chunk_size` judges it, as every holder of a chunk size does)."""
    seed: int = 0
    """Seed of the random initialisation."""
    device: str = "auto"
    """Where the model runs: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N"."""
    inplace: bool = False
    """In-place residual updates (inference only; FastFold's `--inplace`): one activation copy less."""
    keep_outputs: bool = False
    """Keep every model output on the `Prediction` (`Prediction.outputs`: single, pair and MSA representations,
    logits, ...), written as `<target>_<model>_output_dict.npz` (OpenFold's `--save_outputs`)."""

    def __post_init__(self) -> None:
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"ModelSpec.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"ModelSpec.precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if self.chunk_size is not None:  # None needs no check, and the check's module imports torch
            from ..model.options import check_chunk_size

            check_chunk_size(self.chunk_size)

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
    from ..data.multimer import read_complexes

    return [ComplexTarget.of(c) for c in read_complexes(fasta_path)]


@dataclasses.dataclass
class Prediction:
    """One model's prediction for one target (numpy, float32).

    `positions` `[N, 37, 3]`, `atom_mask` `[N, 37]`, `plddt` `[N]`, `pae` `[N, N]` or None, `ptm` or None;
    multimer models also `iptm` and `ranking_confidence` (0.8 ipTM + 0.2 pTM); `outputs`, with
    `ModelSpec.keep_outputs`, every output of the model's last pass by its name (numpy, floats as float32)."""

    positions: np.ndarray
    atom_mask: np.ndarray
    plddt: np.ndarray
    pae: np.ndarray | None = None
    ptm: float | None = None
    iptm: float | None = None
    ranking_confidence: float | None = None
    outputs: dict[str, np.ndarray] | None = None

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
        arrays.update({OUTPUT_PREFIX + k: v for k, v in (self.outputs or {}).items()})
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
        with np.load(path, allow_pickle=False) as z:
            pae = z["pae"] if "pae" in z else None
            ptm = float(z["ptm"]) if "ptm" in z else None
            iptm = float(z["iptm"]) if "iptm" in z else None
            rank = float(z["ranking_confidence"]) if "ranking_confidence" in z else None
            outputs = {k[len(OUTPUT_PREFIX):]: z[k] for k in z.files if k.startswith(OUTPUT_PREFIX)} or None
            return cls(z["positions"], z["atom_mask"], z["plddt"], pae, ptm, iptm, rank, outputs)


OUTPUT_PREFIX = "output/"
"""Prefix of the model's outputs (`Prediction.outputs`) among a saved prediction's arrays."""


FEATURE_INFO = "_feature_info"
"""Key of the raw-features dict under which `target_raw_features`' report travels (popped before use)."""


def target_features(target: Target, cfg: AlignmentConfig, work_dir: str,
                    with_templates: bool) -> tuple[dict[str, Any], float]:
    """One target's raw features (with their report under `FEATURE_INFO`) and the seconds they took: what one
    Ray task runs (`fastfold.run.pipeline.feature_stream`). A complex's are `complex_raw_features`."""
    t0 = time.perf_counter()
    info: dict[str, Any] = {}
    if isinstance(target, ComplexTarget):
        from ..data.multimer import complex_raw_features

        raw = complex_raw_features(target.complex, cfg, work_dir, with_templates=with_templates, info=info)
    elif isinstance(target, GapTarget):  # several records of one file, a monomer model: AlphaFold-Gap
        from ..data.gap import gap_raw_features

        raw = gap_raw_features(target, cfg, work_dir, with_templates, info=info)
    else:
        raw = target_raw_features(target, cfg, work_dir, with_templates, info=info)
    raw[FEATURE_INFO] = info
    return raw, time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------------- model


def load_model(spec: ModelSpec) -> tuple[Any, FeatureConfig]:
    """The model (eval mode, `spec.precision`, on `spec.device`) and the feature sizes its preset wants."""
    import torch

    from ..model import AlphaFold
    from ..model import config as model_config
    from ..params import from_params

    if spec.multimer:
        model = _multimer_model(spec)
    elif spec.param_path is not None:
        model = from_params(spec.param_path, preset=spec.model_name)
    else:
        cfg = model_config.preset(spec.model_name)  # also validates the name
        if spec.tiny:
            cfg = model_config.tiny(templates=cfg.template.enabled, tm=cfg.heads.tm)
        torch.manual_seed(spec.seed)
        model = AlphaFold(cfg)
    p = model.config.pipeline
    feats = FeatureConfig(max_msa_clusters=p.max_msa_clusters, max_extra_msa=p.max_extra_msa,
                          max_templates=p.max_templates if model.config.template.enabled else 0,
                          num_recycle=p.num_recycle)
    return model.to(device=_device(spec), dtype=getattr(torch, PRECISIONS[spec.precision])).eval(), feats


def _device(spec: ModelSpec) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if spec.device == "auto" else spec.device


def _multimer_model(spec: ModelSpec) -> Any:
    """An AlphaFold-Multimer model: from its `.npz` (`params_multimer.load_model`, sizes from the file), else
    random weights (`multimer_tiny` when `spec.tiny`, else the preset's real widths); MSA sizes of the preset."""
    import torch

    from ..model.multimer import AlphaFoldMultimer, multimer_preset, multimer_tiny
    from ..params.multimer import load_model as load_multimer

    if spec.param_path is not None:
        return load_multimer(spec.param_path, preset=spec.model_name)
    cfg = multimer_preset(spec.model_name)  # also validates the name
    torch.manual_seed(spec.seed)
    return AlphaFoldMultimer(multimer_tiny() if spec.tiny else cfg)


def features_for_model(raw: dict[str, np.ndarray], feature_config: FeatureConfig, seed: int) -> dict[str, np.ndarray]:
    """The processed batch for one model (see `fastfold.data.features`); a complex's raw features (with
    `asym_id`) get AlphaFold-Multimer's processing (`fastfold.data.multimer.process_multimer_features`)."""
    if "asym_id" in raw:
        from ..data.multimer import process_multimer_features

        return process_multimer_features(raw, feature_config, seed=seed)
    return process_features(raw, feature_config, seed=seed)


def _inference_options(spec: ModelSpec, device: Any = None) -> Any:
    """The model's options; `chunk_size="auto"` fits the memory budget of `device` (where the model's
    parameters are: `InferenceOptions.for_device`, a share of the free CUDA memory, or the CPU budget)."""
    from ..model import InferenceOptions

    residual = "in_place" if spec.inplace else "out_of_place"
    if spec.chunk_size == "auto":
        return InferenceOptions.for_device(device if device is not None else _device(spec), chunk_size="auto",
                                           residual=residual)
    return InferenceOptions(chunk_size=spec.chunk_size, residual=residual)


def _numpy_outputs(outputs: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor output as numpy (floating point as float32, bf16 included; integers kept)."""
    out = {}
    for key, value in outputs.items():
        if hasattr(value, "detach"):
            value = value.detach()
            out[key] = (value.float() if value.is_floating_point() else value).cpu().numpy()
    return out


def _to_prediction(outputs: dict[str, Any], keep: bool = False) -> Prediction:
    def arr(key: str) -> np.ndarray:
        return outputs[key].detach().float().cpu().numpy()

    pae = arr("predicted_aligned_error") if "predicted_aligned_error" in outputs else None
    ptm = float(arr("ptm_score")) if "ptm_score" in outputs else None
    iptm = float(arr("iptm_score")) if "iptm_score" in outputs else None
    rank = float(arr("ranking_confidence")) if "ranking_confidence" in outputs else None
    return Prediction(arr("final_atom_positions"), arr("final_atom_mask"), arr("plddt"), pae, ptm, iptm, rank,
                      _numpy_outputs(outputs) if keep else None)


def predict(model: Any, batch: dict[str, np.ndarray], spec: ModelSpec) -> Prediction:
    """Run `model` on one processed batch (no gradients) and collect the outputs."""
    import torch

    from ..data.features import to_torch

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
    return _to_prediction(outputs, keep=spec.keep_outputs)


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
    from ..data.features import to_torch

    model, _ = _hold(runtime, spec)
    tensors = runtime.broadcast(None if batch is None else to_torch(batch))
    prediction = predict(model, tensors, spec)
    return prediction if runtime.rank == 0 else None


class Models:
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
        """`runs` ((model index, spec, label, seed) rows) with the held model's first, so a DAP runtime switches
        models less often."""
        held = None if self.runtime is None else self.runtime.key
        return sorted(runs, key=lambda run: run[1] != held)
