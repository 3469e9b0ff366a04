"""`suite fold`'s OpenFold/FastFold compatibility: the flags of OpenFold's `run_pretrained_openfold.py` and
FastFold's `inference.py` that have another name here, or cannot apply, parsed so that a copied command line gets
their meaning (`apply_compat` translates them into `suite fold`'s settings) or one line saying why (exit 2); in a
config file they are refused with the setting to write instead (`compat_config_keys`). Also
`--model_preset monomer|multimer` and the multimer-only inputs.
"""

from __future__ import annotations

import argparse
import logging
import os

from ..errors import UsageError

__all__ = ["add_compat_arguments", "apply_compat", "compat_config_keys", "is_multimer"]

log = logging.getLogger(__name__)


def add_compat_arguments(parser: argparse.ArgumentParser) -> None:
    """OpenFold's (`run_pretrained_openfold.py`) and FastFold's (`inference.py`) flags that have another name
    here, or that cannot apply: parsed so a copied command line gets their meaning or one line saying why
    (`apply_compat`)."""
    group = parser.add_argument_group("OpenFold / FastFold flags (translated, or refused with the reason)")
    add = group.add_argument
    add("--config_preset", default=None, help="OpenFold: = --model_name")
    add("--jax_param_path", default=None, help="OpenFold: = --param_path (AlphaFold .npz)")
    add("--openfold_checkpoint_path", default=None, help="OpenFold: = --param_path (OpenFold .pt)")
    add("--skip_relaxation", action="store_true", help="OpenFold: = --no-relax")
    add("--relaxation", action="store_true", help="FastFold: = --relax (the default)")
    add("--data_random_seed", default=None, help="OpenFold/FastFold: = --seed")
    add("--use_single_seq_mode", action="store_true", help="OpenFold SoloSeq (ESM-1b): refused, see --single_sequence")
    add("--cif_output", action="store_true",
        help="OpenFold: with --output_layout openfold, ModelCIF (.cif) instead of PDB in predictions/ (the per-target "
             "folders always hold both)")
    add("--save_outputs", action="store_true",
        help="OpenFold: every model output (single, pair and MSA representations, logits, ...) in "
             "<target>_<model>_output_dict.npz (numpy arrays, no pickle)")
    add("--save_prediction_result", nargs="?", const="True", default=None,
        help="FastFold: = --save_outputs (a false value: off)")
    add("--output_layout", choices=["suite", "openfold"], default="suite",
        help="openfold: also OpenFold's <output_dir>/predictions/<tag>_<model>_unrelaxed.pdb, _relaxed.pdb, "
             "_output_dict.npz, timings.json (fastfold.run.layout)")
    add("--output_postfix", default=None, help="OpenFold: refused (fixed names in one folder per target)")
    add("--long_sequence_inference", action="store_true", help="OpenFold: = --chunk_size auto")
    add("--uniclust30_database_path", default=None, help="OpenFold: = --uniref30_database_path (its old name)")
    add("--preset", choices=["full_dbs", "reduced_dbs"], default=None, help="full_dbs; reduced_dbs is refused")
    add("--gpus", type=int, default=None, help="FastFold: DAP size = --devices")
    add("--enable_workflow", action="store_true",
        help="FastFold: each target's searches as parallel Ray tasks, --cpus divided among them (docs/fold.md)")
    add("--pdb_seqres_database_path", default=None,
        help="multimer hmmsearch template search: refused (not implemented; templates come from .hhr hits)")
    for flag in ("hmmsearch_binary_path", "hmmbuild_binary_path"):
        add(f"--{flag}", default=None, help="multimer hmmsearch template search: unused (see "
                                             "--pdb_seqres_database_path)")
    add("--multimer_ri_gap", default=None, metavar="N",
        help="OpenFold: residue-index gap between the records of a FASTA file folded as one target by a monomer model "
             "(AlphaFold-Gap; default 200, OpenFold's); unused by AlphaFold-Multimer models")
    for flag in ("release_dates_path", "experiment_config_json"):
        add(f"--{flag}", default=None, help="refused or unused: see the error message")
    for flag in ("trace_model", "use_deepspeed_evoformer_attention", "use_custom_template"):
        add(f"--{flag}", action="store_true", help="refused: see the error message")


_COMPAT_SETTING = {
    "config_preset": "model_name: NAME", "jax_param_path": "param_path: FILE",
    "openfold_checkpoint_path": "param_path: FILE", "skip_relaxation": "relax: false", "relaxation": "relax: true",
    "data_random_seed": "seed: N", "long_sequence_inference": "chunk_size: auto",
    "uniclust30_database_path": "uniref30_database_path: PATH", "gpus": "devices: N", "enable_workflow":
    "num_workers: N", "cif_output": None, "save_outputs": None, "save_prediction_result": None, "preset": None,
    "output_layout": None, "multimer_ri_gap": None,
}
"""OpenFold/FastFold flags translated on the command line, and the setting a config file writes instead."""


def compat_config_keys() -> dict[str, str]:
    """The OpenFold/FastFold flags written as keys of a config file: the line that says what to write instead
    (`utils.settings.read_yaml`'s `not_settings`)."""
    out = {}
    for key in (*_COMPAT_SETTING, *_REFUSED):
        instead = _COMPAT_SETTING.get(key)
        what = f"write '{instead}' instead" if instead else "it has no setting here (see suite fold --help)"
        out[key] = ("an OpenFold/FastFold command-line flag, translated on the command line only; in a config "
                    f"file {what}")
    return out


_REFUSED = {
    "use_single_seq_mode": "is OpenFold's SoloSeq (ESM-1b embeddings with the seq_model_* presets), which this "
                           "build does not have; --single_sequence folds from the query alone with AlphaFold models",
    "output_postfix": "cannot apply: every target's files have fixed names in <output_dir>/<target>/; use another "
                      "--output_dir per run",
    "trace_model": "cannot apply: TorchScript tracing is not implemented (the model runs eagerly, on CPU or CUDA)",
    "use_deepspeed_evoformer_attention": "cannot apply: DeepSpeed's DS4Sci kernel is not used; attention kernels "
                                         "are chosen by the model itself",
    "use_custom_template": "is not supported: templates come from .hhr hits and template_mmcif_dir",
    "experiment_config_json": "cannot apply: OpenFold config overrides do not map onto this model; use "
                              "--config FILE with suite fold flags",
    "release_dates_path": "is not needed: template release dates are read from each mmCIF file "
                          "(_pdbx_audit_revision_history)",
}
"""Flags of OpenFold/FastFold that cannot apply here, and why (one line each)."""

_MULTIMER_ONLY = ("uniprot_database_path", "pdb_seqres_database_path", "hmmsearch_binary_path",
                  "hmmbuild_binary_path")
"""Multimer-only inputs: monomer runs ignore them (as OpenFold's do), with a warning; multimer runs: see
`_multimer_inputs`."""


def _same_or_usage(args: argparse.Namespace, dest: str, value, flag: str, default=None) -> None:
    current = getattr(args, dest)
    if current not in (default, value):
        raise UsageError(f"{flag} {value} contradicts --{dest} {current}")
    setattr(args, dest, value)


def apply_compat(args: argparse.Namespace) -> None:
    """Translate OpenFold/FastFold flags into suite fold's settings on `args` (a setting not there yet gets its
    default), or refuse one with the reason (exit 2)."""
    from ...fastfold.run.settings import FoldSettings
    from ...utils.settings import settings

    for name, s in settings(FoldSettings).items():
        if not hasattr(args, name):
            setattr(args, name, s.default)
    for flag, why in _REFUSED.items():
        if getattr(args, flag, None) not in (None, False):
            raise UsageError(f"--{flag} {why}")
    if args.preset == "reduced_dbs":
        raise UsageError("--preset reduced_dbs: the small-BFD jackhmmer search is not implemented; give "
                     "--bfd_database_path and --uniref30_database_path (full_dbs) or precomputed alignments")
    if args.config_preset is not None:
        _same_or_usage(args, "model_name", args.config_preset, "--config_preset", "model_1_ptm")
    for flag in ("jax_param_path", "openfold_checkpoint_path"):
        if getattr(args, flag) is not None:
            _same_or_usage(args, "param_path", getattr(args, flag), f"--{flag}")
    if args.skip_relaxation:
        if args.relaxation:
            raise UsageError("--skip_relaxation contradicts --relaxation")
        args.relax = False
    if args.data_random_seed is not None:
        try:
            seed = int(args.data_random_seed)
        except ValueError:
            raise UsageError(f"--data_random_seed {args.data_random_seed!r}: expected an integer") from None
        _same_or_usage(args, "seed", seed, "--data_random_seed", 0)
    fastfold_save = str(args.save_prediction_result).lower() not in ("none", "false", "0", "no")
    args.save_outputs = bool(args.save_outputs or fastfold_save)
    if args.long_sequence_inference and args.chunk_size is None:
        args.chunk_size = "auto"
    if args.uniclust30_database_path is not None:
        _same_or_usage(args, "uniref30_database_path", args.uniclust30_database_path, "--uniclust30_database_path")
    if args.gpus is not None:
        _same_or_usage(args, "devices", args.gpus, "--gpus", 1)
    if args.enable_workflow and args.num_workers is None and not args.ray_address:
        args.num_workers = max(1, min(4, os.cpu_count() or 1))
    _apply_model_preset(args)
    _multimer_inputs(args)
    args.multimer_ri_gap = _ri_gap(args)


def _ri_gap(args: argparse.Namespace) -> int:
    """--multimer_ri_gap N (OpenFold's, default 200): the residue-index jump between the records of a FASTA file that
    a monomer model folds as one target (AlphaFold-Gap), in the features and the written residue numbers. OpenFold
    splits its outputs' chains with it; AlphaFold-Multimer models separate chains by `asym_id`, so there it is
    unused (a warning when not the default)."""
    from ...fastfold.data.gap import RI_GAP

    if args.multimer_ri_gap is None:
        return RI_GAP
    try:
        gap = int(args.multimer_ri_gap)
    except (TypeError, ValueError):
        raise UsageError(f"--multimer_ri_gap {args.multimer_ri_gap!r}: expected an integer (residues)") from None
    if gap < 1:
        raise UsageError(f"--multimer_ri_gap {gap}: must be >= 1 (the residue-index jump between records)")
    if is_multimer(args) and gap != RI_GAP:
        log.warning("--multimer_ri_gap %d is unused by AlphaFold-Multimer models (chains are told apart by asym_id)",
                    gap)
    return gap


_MULTIMER_DEFAULT = "model_1_multimer_v3"
"""--model_name of --model_preset multimer when no model is named (as the monomer default names one model)."""


def is_multimer(args: argparse.Namespace) -> bool:
    return any("_multimer" in n for n in str(args.model_name).split(","))


def _apply_model_preset(args: argparse.Namespace) -> None:
    """--model_preset multimer|monomer (FastFold/OpenFold) agrees with --model_name, or picks its default."""
    if args.model_preset is None:
        return
    names = [n.strip() for n in str(args.model_name).split(",") if n.strip()]
    multimer = [n for n in names if "_multimer" in n]
    if args.model_preset == "multimer":
        if args.model_name == "model_1_ptm":  # the default: not named by the user
            args.model_name = _MULTIMER_DEFAULT
        elif len(multimer) != len(names):
            other = ", ".join(n for n in names if n not in multimer)
            raise UsageError(f"--model_preset multimer contradicts --model_name {other} (a monomer model); name "
                         "model_N_multimer_v3 models or leave --model_name out")
    elif multimer:
        raise UsageError(f"--model_preset monomer contradicts --model_name {', '.join(multimer)} (AlphaFold-Multimer)")


def _multimer_inputs(args: argparse.Namespace) -> None:
    """The multimer-only inputs: unused by monomer models (a warning, as OpenFold's monomer runs ignore them);
    with multimer models, the UniProt search is run per chain, the hmmsearch template search is refused."""
    given = [f for f in _MULTIMER_ONLY if getattr(args, f, None) is not None]
    if not is_multimer(args):
        for flag in given:
            log.warning("--%s is used by multimer models only; --model_name %s is a monomer model, so it is unused",
                        flag, args.model_name)
        return
    if args.pdb_seqres_database_path is not None and args.use_precomputed_alignments is None:
        raise UsageError("--pdb_seqres_database_path: the hmmsearch template search of AlphaFold-Multimer is not "
                     "implemented; templates come from .hhr hits (--pdb70_database_path, or pdb70_hits.hhr in each "
                     "chain's folder of --use_precomputed_alignments)")
    for flag in ("hmmsearch_binary_path", "hmmbuild_binary_path", "pdb_seqres_database_path"):
        if getattr(args, flag) is not None:
            log.warning("--%s is unused: templates come from .hhr hits (the hmmsearch template search is not "
                        "implemented)", flag)
    if args.uniprot_database_path is not None and args.use_precomputed_alignments is not None:
        log.warning("--uniprot_database_path is unused with --use_precomputed_alignments: each chain's folder "
                    "gives its pairing MSA (uniprot_hits.sto)")
