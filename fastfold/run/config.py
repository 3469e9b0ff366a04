"""What a fold run is asked to do: `FoldConfig` (models, alignments, relaxation, seeds, workers, output layout),
validated on construction, and the two facts every scheduler of the run derives from it: the predictions each
target gets (`prediction_runs`) and the remark a structure carries (`weights_remark`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from ..data.targets import AlignmentConfig
from .stages import ModelSpec

__all__ = ["OUTPUT_LAYOUTS", "RANDOM_WEIGHTS", "FoldConfig", "prediction_runs", "weights_remark"]

OUTPUT_LAYOUTS = ("suite", "openfold")
"""`FoldConfig.output_layout` values: one folder per target (always written, the record a rerun reads), and
OpenFold's `predictions/` beside it (`fastfold.run.layout`)."""


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
    """Local Ray: its CPUs for alignment/feature jobs (0: in this process, one target after another). On a cluster
    (`ray_address`): the model workers (0: one per GPU, or one per node without GPUs; `fastfold.run.cluster`)."""
    ray_address: str | None = None
    """Existing Ray cluster to use instead of starting a local one: features and models both run across its nodes,
    and `output_dir` must be a folder every node sees."""
    enable_workflow: bool = False
    """Each target's database searches as parallel Ray tasks (`fastfold.run.workflow`, FastFold's `--enable_workflow`),
    `alignment.cpus` divided among the concurrent tools; Ray runs even for one target."""
    num_recycle: int | None = None
    """Recycling iterations; None: each model's preset (3 for the released models)."""
    num_seeds: int = 1
    """Predictions per model, MSA sampling seeds `seed`, `seed + 1`, ...; with several, labels end `_seed_<k>`."""
    subtract_plddt: bool = False
    """B-factor column holds 100 - pLDDT (OpenFold's `--subtract_plddt`) instead of pLDDT."""
    output_layout: Literal["suite", "openfold"] = "suite"
    """"openfold": every complete target's files also under OpenFold's names in `<output_dir>/predictions/`, and
    OpenFold's `timings.json` files (`fastfold.run.layout`); "suite": the per-target folders alone."""
    cif_output: bool = False
    """OpenFold's `--cif_output`: its layout holds ModelCIF (`.cif`) instead of PDB files (the per-target folders
    always hold both)."""

    def __post_init__(self) -> None:
        if self.num_recycle is not None and self.num_recycle < 0:
            raise ValueError(f"FoldConfig.num_recycle must be >= 0, got {self.num_recycle}")
        if self.num_seeds < 1:
            raise ValueError(f"FoldConfig.num_seeds must be >= 1, got {self.num_seeds}")
        if not self.models:
            raise ValueError("FoldConfig.models must name at least one model")
        if self.devices < 1:
            raise ValueError(f"FoldConfig.devices must be >= 1, got {self.devices}")
        if self.output_layout not in OUTPUT_LAYOUTS:
            raise ValueError(f"FoldConfig.output_layout must be one of {OUTPUT_LAYOUTS}, got {self.output_layout!r}")
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



def prediction_runs(cfg: FoldConfig) -> list[tuple[int, ModelSpec, str, int]]:
    """(model index, spec, output label, MSA sampling seed) of every prediction a target gets: each model once per
    seed, labels `<model>` or, with several seeds, `<model>_seed_<k>`."""
    out = []
    for i, spec in enumerate(cfg.models):
        for k in range(cfg.num_seeds):
            label = spec.label if cfg.num_seeds == 1 else f"{spec.label}_seed_{cfg.seed + k}"
            out.append((i, spec, label, cfg.seed + k))
    return out


RANDOM_WEIGHTS = "RANDOM WEIGHTS: structure is meaningless"
"""The remark every structure made without parameter files carries (PDB REMARK, mmCIF title, plot stamp)."""


def weights_remark(cfg: FoldConfig) -> str:
    """`RANDOM_WEIGHTS` when a model of the run has no parameter file, else ""."""
    return "" if all(s.param_path for s in cfg.models) else RANDOM_WEIGHTS
