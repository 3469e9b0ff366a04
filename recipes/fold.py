"""Protein structure prediction as a Lightning recipe, on `suite fold`'s own functions (`fastfold.run`).

    from lowmem.recipes import AlphaFoldPredictor, FoldDataModule, FoldPredictionWriter
    trainer = Trainer(strategy="dap", accelerator="cpu", devices=2, callbacks=[FoldPredictionWriter("out")])
    trainer.predict(AlphaFoldPredictor("params_model_1_ptm.npz"), datamodule=FoldDataModule("targets.fasta"))

- `FoldDataModule` reads and validates the FASTA at construction (a bad record fails before any model work)
  and streams one processed feature batch per target, built by `fastfold.run` exactly as `suite fold`
  builds them (Ray tasks when `num_workers > 0` or `ray_address` is given). Targets the writer already
  finished are skipped. Only global rank 0 builds features; with `strategy="dap"` the other ranks receive
  rank 0's batch (`recipes.DAPStrategy`).
- `AlphaFoldPredictor` holds the model `fastfold.run.load_model` builds and runs `fastfold.run.predict`.
- `FoldPredictionWriter` writes the files `suite fold` writes (`fastfold.run.write_target_outputs`).

The run's entry (`fastfold.run.fold`) is Lightning's loop here, so the recipe calls its two ends: every input is
checked before the first batch (`fastfold.run.check_inputs`: parameter files, alignment folders, sources, the
output folder; one `InputError` line), and the writer writes the output layouts after the last one
(`fastfold.run.write_layouts`: OpenFold's `predictions/` with `output_layout="openfold"`).

Complexes: `AlphaFoldPredictor(model_name="model_1_multimer_v3")` (or a `params_model_N_multimer_v3.npz`) with
`FoldDataModule(fasta, multimer=True)` (ColabFold's `A:B` records or one FASTA file per complex; one alignment
folder per chain); the writer writes the complex's files as `suite fold --model_preset multimer` does.

`load_recipe(path)` reads a YAML recipe (`recipes/configs/fold.yaml`) through `suite fold`'s own settings class
(`fastfold.run.settings.FoldSettings`: the same keys, checks and one-line errors as `suite fold --config`) and returns
the objects' keyword arguments.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader, IterableDataset

from ..fastfold import run as fold_run

logger = logging.getLogger(__name__)

__all__ = ["AlphaFoldPredictor", "FoldDataModule", "FoldPredictionWriter", "load_recipe", "recipe_settings"]

_NAME, _SEQUENCE, _SECONDS, _ERROR = "_target_name", "_target_sequence", "_features_seconds", "_error"
_INFO, _MSA = "_features_info", "_msa"
"""Batch keys that are not model features: the target (plain strings: Lightning walks batches and refuses
frozen dataclasses), the feature-building time, a feature failure, what the features were made of (JSON), the
raw MSA (for the coverage plot)."""


def _target_keys(target: fold_run.Target) -> dict[str, str]:
    return {_NAME: target.name, _SEQUENCE: target.sequence}
_RANDOM_REMARK = "RANDOM WEIGHTS: structure is meaningless"


def _model_name_from_path(path: str | None) -> str | None:
    match = re.search(r"(model_[1-5](?:_multimer(?:_v2|_v3)?|_ptm)?)", Path(path).name) if path else None
    return match.group(1) if match else None


class AlphaFoldPredictor(pl.LightningModule):
    """`predict_step` folds one target's feature batch with the fastfold AlphaFold model.

    Without `param_path` the weights are random (seeded by `seed`; the tiny configuration unless
    `tiny=False`), as in `suite fold` without `--param_path`. `model_name` defaults to the name in the
    parameter file's name, else "model_1_ptm". `precision` is "fp32", "bf16" or "fp64" (`--precision`).
    """

    def __init__(
        self,
        param_path: str | None = None,
        model_name: str | None = None,
        *,
        precision: str = "fp32",
        chunk_size: int | str | None = None,
        seed: int = 0,
        tiny: bool | None = None,
    ) -> None:
        super().__init__()
        name = model_name or _model_name_from_path(param_path) or "model_1_ptm"
        self.spec = fold_run.ModelSpec(
            model_name=name,
            param_path=param_path,
            tiny=(param_path is None) if tiny is None else tiny,
            precision=precision,
            chunk_size=chunk_size,
            seed=seed,
        )
        self.model, self.feature_config = fold_run.load_model(self.spec)
        if param_path is None:
            logger.warning("AlphaFoldPredictor: no param_path, RANDOM weights: the structures are meaningless")

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any] | None:
        """batch: one target's processed features plus `_target_name` and `_target_sequence`. Returns the
        target's name and sequence, its `Prediction` and the timings; None when its features failed."""
        if batch.get(_ERROR) is not None:
            return None
        t0 = time.perf_counter()
        features = {k: v for k, v in batch.items() if not k.startswith("_")}
        prediction = fold_run.predict(self.model, features, self.spec)
        timings = {"features": float(batch.get(_SECONDS, 0.0)), f"model_{self.spec.label}": time.perf_counter() - t0}
        remark = "" if self.spec.param_path else _RANDOM_REMARK
        info = json.loads(batch[_INFO]) if batch.get(_INFO) else None
        msa = batch[_MSA].cpu().numpy() if batch.get(_MSA) is not None else None
        return {"name": batch[_NAME], "sequence": batch[_SEQUENCE], "label": self.spec.label,
                "prediction": prediction, "timings": timings, "remark": remark, "features_info": info, "msa": msa}


class _TargetStream(IterableDataset):
    """One item per target still to fold, in the order features become ready (rank 0) or placeholders."""

    def __init__(self, module: FoldDataModule, todo: list[fold_run.Target], feature_config: Any, rank: int) -> None:
        self.module, self.todo, self.feature_config, self.rank = module, todo, feature_config, rank

    def __iter__(self):
        if self.rank != 0:  # DAP ranks receive rank 0's batches: keep in step without building features
            yield from (_target_keys(t) for t in self.todo)
            return
        cfg = self.module.fold_config(self.feature_config)
        with_templates = self.feature_config.max_templates > 0
        for target, raw, seconds in fold_run.feature_stream(self.todo, cfg, with_templates):
            if isinstance(raw, BaseException):
                logger.error("target %s failed: %s: %s", target.name, type(raw).__name__, raw)
                self.module.failures[target.name] = f"{type(raw).__name__}: {raw}"
                yield {**_target_keys(target), _ERROR: str(raw)}
                continue
            info = raw.pop(fold_run.FEATURE_INFO, None)
            batch = fold_run.features_for_model(raw, self.feature_config, self.module.seed)
            from ..fastfold.data.features import to_torch

            yield {**_target_keys(target), _SECONDS: seconds, _INFO: json.dumps(info),
                   _MSA: torch.from_numpy(np.asarray(raw["msa"])), **to_torch(batch)}


class FoldDataModule(pl.LightningDataModule):
    """Targets of a FASTA file -> processed feature batches (one per target), as `suite fold` builds them.

    `alignments_dir` is `--use_precomputed_alignments` (one sub-folder per target); `single_sequence`
    uses the query alone. Further keywords take `suite fold`'s flag names: `template_mmcif_dir`,
    `max_template_date`, `uniref90_database_path`, ..., `jackhmmer_binary_path`, ..., `cpus`, `seed`,
    `num_workers` (Ray CPUs; 0: no Ray), `ray_address`, `enable_workflow` (each target's searches as parallel Ray
    tasks, `fastfold.run.workflow`), `uniprot_database_path` (complexes). `multimer`: the
    FASTA holds complexes (`fastfold.run.read_complex_targets`) for an AlphaFold-Multimer predictor. `failures` maps
    target name -> error afterwards.
    """

    def __init__(
        self,
        fasta: str | Path,
        alignments_dir: str | Path | None = None,
        single_sequence: bool = False,
        *,
        seed: int = 0,
        num_workers: int = 0,
        ray_address: str | None = None,
        enable_workflow: bool = False,
        output_dir: str | Path | None = None,
        multimer: bool = False,
        **alignment: Any,
    ) -> None:
        super().__init__()
        # InputError naming the record, before any model work
        self.multimer = multimer
        self.targets = fold_run.read_complex_targets(fasta) if multimer else fold_run.read_targets(fasta)
        if not single_sequence and alignments_dir is None and not any(k.endswith("_database_path") for k in alignment):
            logger.warning("FoldDataModule: no alignments and no databases: single-sequence mode")
            single_sequence = True
        self.alignment = fold_run.AlignmentConfig(
            precomputed_dir=None if alignments_dir is None else str(alignments_dir),
            single_sequence=single_sequence,
            **alignment,
        )
        if num_workers < 0:
            raise ValueError(f"FoldDataModule.num_workers must be >= 0, got {num_workers}")
        self.seed, self.num_workers, self.ray_address = seed, num_workers, ray_address
        self.enable_workflow = enable_workflow
        self.output_dir = None if output_dir is None else str(output_dir)
        self.failures: dict[str, str] = {}

    def _writer(self) -> FoldPredictionWriter | None:
        trainer = getattr(self, "trainer", None)
        callbacks = trainer.callbacks if trainer is not None else []
        return next((cb for cb in callbacks if isinstance(cb, FoldPredictionWriter)), None)

    def fold_config(self, feature_config: Any) -> fold_run.FoldConfig:
        """The `suite fold` run configuration the feature stream uses (work dirs under the output dir)."""
        writer = self._writer()
        output_dir = self.output_dir or (writer.output_dir if writer else "fold_outputs")
        spec = getattr(self.trainer.lightning_module, "spec", None) or fold_run.ModelSpec()
        return fold_run.FoldConfig(output_dir=str(output_dir), models=[spec], alignment=self.alignment,
                                   seed=self.seed, num_workers=self.num_workers, ray_address=self.ray_address,
                                   enable_workflow=self.enable_workflow)

    def predict_dataloader(self) -> DataLoader:
        writer = self._writer()
        todo = [t for t in self.targets if writer is None or not writer.is_complete(t)]
        skipped = len(self.targets) - len(todo)
        if skipped:
            logger.info("FoldDataModule: %d target(s) already complete, skipped", skipped)
        feature_config = self.trainer.lightning_module.feature_config
        spec = getattr(self.trainer.lightning_module, "spec", None)
        if spec is not None and spec.multimer != self.multimer:
            raise ValueError(f"FoldDataModule(multimer={self.multimer}) with the {spec.model_name} predictor: "
                             f"{'complexes need' if self.multimer else 'single chains need'} "
                             f"{'an AlphaFold-Multimer' if self.multimer else 'a monomer'} model")
        fold_run.check_inputs(todo, self.fold_config(feature_config))  # one InputError line, before any batch
        stream = _TargetStream(self, todo, feature_config, self.trainer.global_rank)
        return DataLoader(stream, batch_size=None, num_workers=0)


class FoldPredictionWriter(BasePredictionWriter):
    """Writes each target's `suite fold` outputs under `output_dir/<name>/` (global rank 0 only).

    `relax=True` Amber-relaxes the prediction (`relax_config`, default `fastfold.relax.RelaxConfig()`).
    Targets already complete are skipped by `FoldDataModule` unless `overwrite`. `output_layout="openfold"` also
    writes OpenFold's `predictions/` after the last batch (`cif_output`: ModelCIF there instead of PDB), as
    `suite fold --output_layout openfold` does.
    """

    def __init__(self, output_dir: str | Path, relax: bool = True, *, overwrite: bool = False,
                 relax_config: Any = None, output_layout: str = "suite", cif_output: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = str(output_dir)
        self.overwrite = overwrite
        self.output_layout, self.cif_output = output_layout, cif_output
        if relax and relax_config is None:
            from ..fastfold.relax import RelaxConfig

            relax_config = RelaxConfig()
        self.relax_config = relax_config if relax else None

    def is_complete(self, target: fold_run.Target) -> bool:
        return not self.overwrite and fold_run.is_complete(target, self.output_dir)

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        if prediction is None or trainer.global_rank != 0:
            return
        datamodule = getattr(trainer, "datamodule", None)
        known = {t.name: t for t in getattr(datamodule, "targets", [])}
        target = known.get(prediction["name"]) or fold_run.Target(prediction["name"], prediction["sequence"])
        label = prediction["label"]
        folder = Path(self.output_dir) / target.name
        folder.mkdir(parents=True, exist_ok=True)
        prediction["prediction"].save(folder / f"{target.name}_{label}_prediction.npz")
        files = fold_run.write_target_outputs(target, {label: prediction["prediction"]}, folder, self.relax_config,
                                              dict(prediction["timings"]), prediction["remark"],
                                              features_info=prediction.get("features_info"),
                                              msa=prediction.get("msa"))
        logger.info("%s: wrote %d files to %s", target.name, len(files), folder)

    def on_predict_end(self, trainer, pl_module) -> None:
        """The output layouts of every complete target (global rank 0), as `suite fold` writes them after its run."""
        if trainer.global_rank != 0:
            return
        targets = getattr(getattr(trainer, "datamodule", None), "targets", [])
        spec = getattr(pl_module, "spec", None)
        if targets and spec is not None:
            fold_run.write_layouts(self.output_dir, targets, [spec], self.output_layout, self.cif_output)


_PREDICTOR_KEYS = ("param_path", "model_name", "precision", "chunk_size", "seed")
_WRITER_KEYS = ("output_dir", "relax", "overwrite")
_TRAINER_KEYS = ("devices", "accelerator")
_RELAX_BUDGET = ("relax_platform", "relax_max_passes", "relax_max_iterations", "relax_max_minutes")
_CLI_ONLY = ("model_device", "inplace", "num_recycle", "num_seeds", "subtract_plddt")
"""`suite fold` settings the recipe's objects have no argument for: a recipe that sets one is refused (one line)
rather than silently run without it."""


def recipe_settings(path: str | Path) -> tuple[Any, set[str]]:
    """The fold recipe YAML `path` read as `suite fold --config` reads it (`fastfold.run.settings.FoldSettings`: the
    same keys, flat or in sections, the same checks and one-line errors naming the file and the key); and the
    flat names the file sets."""
    from ..fastfold.run.settings import FoldSettings
    from ..utils.settings import build, read_yaml

    values = read_yaml(path, FoldSettings)
    return build(FoldSettings, values, dict.fromkeys(values, str(path))), set(values)


def load_recipe(path: str | Path) -> dict[str, dict[str, Any]]:
    """A fold recipe YAML (`suite fold`'s settings as keys, `recipe_settings`) -> keyword arguments of
    `AlphaFoldPredictor` ("predictor"), `FoldDataModule` ("data"), `FoldPredictionWriter` ("writer") and `Trainer`
    ("trainer"). Only the keys the file sets are passed (each object's defaults otherwise)."""
    from ..fastfold.run.settings import FoldSettings
    from ..utils.errors import InputError
    from ..utils.settings import settings

    fs, given = recipe_settings(path)
    table = settings(FoldSettings)
    for key in _CLI_ONLY:
        if key in given:
            raise InputError(f"{path}: {key}: a suite fold setting the recipe does not take (its objects have no "
                             "such argument); run suite fold --config, or leave it out")
    value = {name: functools.reduce(getattr, s.path, fs) for name, s in table.items() if name in given}
    out: dict[str, dict[str, Any]] = {"predictor": {}, "writer": {}, "trainer": {"strategy": "dap"}, "data": {}}
    for key, v in value.items():
        if key in _PREDICTOR_KEYS:
            out["predictor"][key] = v
        elif key in _WRITER_KEYS:
            out["writer"][key] = v
        elif key in _TRAINER_KEYS:
            out["trainer"][key] = v
        elif key == "random_model_size":
            out["predictor"]["tiny"] = v == "tiny"
        elif key == "fasta_path":
            out["data"]["fasta"] = v
        elif key == "use_precomputed_alignments":
            out["data"]["alignments_dir"] = v
        elif key == "model_preset":
            if v == "multimer":
                out["data"]["multimer"] = True
                out["predictor"].setdefault("model_name", "model_1_multimer_v3")
        elif key in _RELAX_BUDGET:
            out["writer"]["relax_config"] = fs.relaxation.config()
        elif key == "num_workers" and v is None:
            continue  # suite fold's "as many as useful"; the data module's default: no Ray
        elif key == "max_template_date" and v is None:
            continue  # today, AlignmentConfig's default
        else:  # single_sequence, num_workers, ray_address and AlignmentConfig's fields
            out["data"][key] = v
    if "seed" in out["predictor"]:
        out["data"]["seed"] = out["predictor"]["seed"]
    if "_multimer" in str(out["predictor"].get("model_name") or "") or "_multimer" in str(
            out["predictor"].get("param_path") or ""):
        out["data"]["multimer"] = True
    return out
