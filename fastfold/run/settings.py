"""`suite fold`'s settings as one typed config: its flags, its `--config FILE` keys and the Lightning recipe's YAML
keys (`recipes/configs/fold.yaml`) all come from `FoldSettings` (`utils.settings`: one merge rule, explicit
flag > file > default; one-line errors naming the key and the file).

`FoldSettings` is what the user types; `fastfold.run.pipeline.FoldConfig` (with its `ModelSpec`s, `AlignmentConfig` and
`fastfold.relax.RelaxConfig`) is what the run needs: `suite fold` builds one from the other after checking the
inputs the settings name (files, devices, the Ray cluster). The alignment section is `AlignmentConfig` itself; the
model, relax and run sections are small CLI-facing ones, since their values differ in form from the owners' fields
(a comma list of model names for a list of `ModelSpec`s, minutes for `RelaxConfig.max_seconds`, `num_workers`
left out for "as many as useful").

Two settings have no flag: `fasta_path` (the positional argument gives it) and `accelerator` (only the recipe's
`Trainer` reads it). Imports neither torch nor the CLI.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Literal

from ...utils.settings import checked, section
from ..data.targets import AlignmentConfig

__all__ = ["FLAGLESS", "AlignmentSettings", "FoldSettings", "ModelSettings", "RelaxSettings", "RunSettings"]

FLAGLESS = ("fasta_path", "accelerator")
"""Settings with a YAML key but no generated flag: the positional `fasta_path`, the recipe's `accelerator`."""


@dataclass(kw_only=True)
class ModelSettings:
    """Which models, their weights and how they run."""

    model_name: str = "model_1_ptm"
    """model preset(s), comma-separated (model_1..model_5, _ptm; AlphaFold-Multimer
    model_1_multimer_v3..model_5_multimer_v3, also _v2 and v1 names); ranked as AlphaFold does (multimer: 0.8 ipTM
    + 0.2 pTM)"""
    model_preset: Literal["monomer", "multimer"] | None = None
    """FastFold/OpenFold: multimer = AlphaFold-Multimer (default --model_name model_1_multimer_v3); monomer: the
    monomer models"""
    param_path: str | None = None
    """parameter file (one model), comma-separated files (one per model) or a folder of params_<model_name>.npz;
    without it the weights are RANDOM"""
    random_model_size: Literal["tiny", "full"] = "tiny"
    """size of the randomly initialised model used without --param_path"""
    precision: Literal["fp32", "bf16", "fp64"] = "fp32"
    """model precision"""
    chunk_size: int | Literal["auto"] | None = checked(None)
    """low-memory chunk size, or 'auto'"""
    model_device: str = "auto"
    """auto (CUDA when available), cpu, cuda or cuda:N (with --devices N > 1: auto, cpu or cuda; rank r runs on
    cuda:r)"""
    inplace: bool = False
    """in-place residual updates in the model (FastFold's flag): one activation copy less"""

    def __post_init__(self) -> None:
        if self.chunk_size is not None:  # None needs no check, and the check's module imports torch
            from ..model.options import check_chunk_size

            check_chunk_size(self.chunk_size)


@dataclass(kw_only=True)
class AlignmentSettings:
    """MSA and template sources."""

    sources: AlignmentConfig = section(AlignmentConfig, rename={"precomputed_dir": "use_precomputed_alignments"},
                                       hide=("max_template_date",))
    """Where MSAs and templates come from: `fastfold.data.targets.AlignmentConfig`'s fields."""
    max_template_date: str | None = None
    """latest template release date, YYYY-MM-DD (default: today)"""

    def __post_init__(self) -> None:
        if self.max_template_date is not None:
            try:
                datetime.date.fromisoformat(self.max_template_date)
            except ValueError:
                raise ValueError(f"max_template_date {self.max_template_date!r}: expected YYYY-MM-DD") from None

    def config(self, *, multimer: bool, obsolete_pdbs_path: str | None = None) -> AlignmentConfig:
        """The run's `AlignmentConfig`: the template date resolved (today when not given, at run time, so the flag
        table does not change with the date), the UniProt search only for multimer models."""
        return dataclasses.replace(
            self.sources, max_template_date=self.max_template_date or datetime.date.today().isoformat(),
            uniprot_database_path=self.sources.uniprot_database_path if multimer else None,
            obsolete_pdbs_path=obsolete_pdbs_path)


@dataclass(kw_only=True)
class RelaxSettings:
    """Amber relaxation of the best model and its budget."""

    relax: bool = True
    """Amber-relax the best model (default: on)"""
    relax_platform: Literal["auto", "CPU", "CUDA"] = "auto"
    """OpenMM platform"""
    relax_max_passes: int = 20
    """relax budget: minimise-and-check passes (AlphaFold's 20); unconverged is reported"""
    relax_max_iterations: int = 0
    """relax budget: iteration cap of each minimisation (0: none, as AlphaFold); a capped last pass is reported
    unconverged ('iteration cap')"""
    relax_max_minutes: float | None = 10.0
    """relax budget per structure: no new pass after this many minutes, a running minimisation is stopped; the
    relaxation is then reported unconverged ('time budget', RELAX FAILED, exit 1)"""

    def __post_init__(self) -> None:
        if self.relax_max_passes < 1:
            raise ValueError(f"relax_max_passes must be >= 1, got {self.relax_max_passes}")
        if self.relax_max_iterations < 0:
            raise ValueError(f"relax_max_iterations must be >= 0, got {self.relax_max_iterations}")
        if self.relax_max_minutes is not None and not self.relax_max_minutes > 0:
            raise ValueError(f"relax_max_minutes must be > 0, got {self.relax_max_minutes}")

    def config(self):
        """`fastfold.relax.RelaxConfig` of these settings (with relaxation off too: the recipe's writer takes both)."""
        from ..relax import RelaxConfig

        minutes = self.relax_max_minutes
        return RelaxConfig(platform=self.relax_platform, max_outer_iterations=self.relax_max_passes,
                           max_iterations=self.relax_max_iterations,
                           max_seconds=None if minutes is None else 60.0 * minutes)


@dataclass(kw_only=True)
class RunSettings:
    """Inputs, outputs, seeds and workers of the whole run."""

    fasta_path: str | None = None
    """FASTA file (or folder of them), one target per record (the positional argument; default: the bundled
    example)"""
    output_dir: str = "fold_outputs"
    """one sub-folder per target is written here"""
    devices: int = 1
    """DAP ranks that share each model's Evoformer: started once for the run (one GPU each with CUDA, NCCL; CPU
    processes with gloo)"""
    accelerator: Literal["cpu", "gpu"] = "cpu"
    """the Lightning recipe's Trainer accelerator: cpu (gloo) or gpu (NCCL); suite fold uses --model_device"""
    num_workers: int | None = None
    """workers in the Ray cluster: a local Ray's CPUs for alignment/feature jobs, 0: no Ray (default: up to 4 when
    several targets); with --ray_address the model workers (default: one per GPU, or per node without GPUs)"""
    ray_address: str | None = None
    """Ray cluster to fold on: features and models across its nodes; --output_dir must be seen by every node"""
    overwrite: bool = False
    """redo targets that are already complete"""
    seed: int = 0
    """seed of MSA sampling and of random weights"""
    num_recycle: int | None = None
    """recycling iterations (default: the model's, 3 for the released models)"""
    num_seeds: int = 1
    """predictions per model, MSA sampling seeds --seed, --seed+1, ... (all ranked)"""
    subtract_plddt: bool = False
    """write 100 - pLDDT in the B-factor column (OpenFold's flag)"""

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if self.num_workers is not None and self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.num_recycle is not None and self.num_recycle < 0:
            raise ValueError(f"num_recycle must be >= 0, got {self.num_recycle}")
        if self.num_seeds < 1:
            raise ValueError(f"num_seeds must be >= 1, got {self.num_seeds}")


@dataclass(kw_only=True)
class FoldSettings:
    """Everything `suite fold` (and the fold recipe's YAML) can set; flat names are the flags and the YAML keys."""

    model: ModelSettings = section(ModelSettings)
    """Which models, their weights and how they run."""
    alignment: AlignmentSettings = section(AlignmentSettings)
    """MSA and template sources (`fastfold.data.targets.AlignmentConfig`)."""
    relaxation: RelaxSettings = section(RelaxSettings)
    """Amber relaxation of the best model and its budget."""
    run: RunSettings = section(RunSettings)
    """Outputs, seeds, DAP ranks and Ray workers of the whole run."""
