"""`suite fold`: predict protein structures from FASTA (AlphaFold2 monomer and AlphaFold-Multimer, FastFold/OpenFold
flag names).

    suite fold targets.fasta [template_mmcif_dir] --output_dir out --use_precomputed_alignments alignments/
    suite fold complexes.fasta --model_preset multimer   # ColabFold's A:B records or one FASTA file per complex
    suite fold                      # the bundled example, single-sequence mode, tiny random model

Everything is validated before any work starts (bad input: one line, exit 2). The folding itself is
`fastfold.pipeline`; this module only turns flags into its configs and prints progress and a summary.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "fold_settings", "run"]

_DATABASES = ("uniref90", "mgnify", "bfd", "uniref30", "pdb70")
_TOOLS = ("jackhmmer", "hhblits", "hhsearch", "kalign")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The positional inputs, the flags of `fastfold.settings.FoldSettings` (generated: each field's docstring is
    its help) and the OpenFold/FastFold translations."""
    from ...fastfold.settings import FLAGLESS, FoldSettings
    from ...utils.settings import add_flags, settings

    parser.add_argument("fasta_path", nargs="?", default=None,
                        help="FASTA file (or folder of them), one target per record; multimer models: one complex "
                             "per record with chains split by ':' (ColabFold) or one complex per file, a record per "
                             "chain (OpenFold) (default: the bundled example)")
    parser.add_argument("template_mmcif_dir", nargs="?", default=None, help="folder of PDB mmCIF files (templates)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML of these settings (the recipe file, recipes/configs/fold.yaml; flat names or "
                             "sections); the command line wins")
    # no defaults in the namespace: a flag is there only when given, so it beats the file (explicit > file > default)
    flags = [n for n, s in settings(FoldSettings).items() if s.flaggable and n not in FLAGLESS]
    add_flags(parser, FoldSettings, only=flags, grouped=True)
    for action in parser._actions:  # the flag twin of the positional template_mmcif_dir keeps its own destination
        if action.option_strings == ["--template_mmcif_dir"]:
            action.dest, action.metavar = "template_mmcif_dir_flag", "TEMPLATE_MMCIF_DIR"
    _add_compat_arguments(parser)


def _add_compat_arguments(parser: argparse.ArgumentParser) -> None:
    """OpenFold's (`run_pretrained_openfold.py`) and FastFold's (`inference.py`) flags that have another name
    here, or that cannot apply: parsed so a copied command line gets their meaning or one line saying why
    (`_apply_compat`)."""
    group = parser.add_argument_group("OpenFold / FastFold flags (translated, or refused with the reason)")
    add = group.add_argument
    add("--config_preset", default=None, help="OpenFold: = --model_name")
    add("--jax_param_path", default=None, help="OpenFold: = --param_path (AlphaFold .npz)")
    add("--openfold_checkpoint_path", default=None, help="OpenFold: = --param_path (OpenFold .pt)")
    add("--skip_relaxation", action="store_true", help="OpenFold: = --no-relax")
    add("--relaxation", action="store_true", help="FastFold: = --relax (the default)")
    add("--data_random_seed", default=None, help="OpenFold/FastFold: = --seed")
    add("--use_single_seq_mode", action="store_true", help="OpenFold SoloSeq (ESM-1b): refused, see --single_sequence")
    add("--cif_output", action="store_true", help="OpenFold: mmCIF output (always written here, beside PDB)")
    add("--save_outputs", action="store_true",
        help="OpenFold: raw outputs (always saved: <target>_<model>_prediction.npz)")
    add("--save_prediction_result", nargs="?", const="True", default=None,
        help="FastFold: raw outputs (always saved: <target>_<model>_prediction.npz)")
    add("--output_postfix", default=None, help="OpenFold: refused (fixed names in one folder per target)")
    add("--long_sequence_inference", action="store_true", help="OpenFold: = --chunk_size auto")
    add("--uniclust30_database_path", default=None, help="OpenFold: = --uniref30_database_path (its old name)")
    add("--preset", choices=["full_dbs", "reduced_dbs"], default=None, help="full_dbs; reduced_dbs is refused")
    add("--gpus", type=int, default=None, help="FastFold: DAP size = --devices")
    add("--enable_workflow", action="store_true", help="FastFold: alignment jobs as Ray tasks (= --num_workers)")
    add("--pdb_seqres_database_path", default=None,
        help="multimer hmmsearch template search: refused (not implemented; templates come from .hhr hits)")
    for flag in ("hmmsearch_binary_path", "hmmbuild_binary_path"):
        add(f"--{flag}", default=None, help="multimer hmmsearch template search: unused (see "
                                             "--pdb_seqres_database_path)")
    for flag in ("release_dates_path", "multimer_ri_gap", "experiment_config_json"):
        add(f"--{flag}", default=None, help="refused or unused: see the error message")
    for flag in ("trace_model", "use_deepspeed_evoformer_attention", "use_custom_template"):
        add(f"--{flag}", action="store_true", help="refused: see the error message")


_COMPAT_SETTING = {
    "config_preset": "model_name: NAME", "jax_param_path": "param_path: FILE",
    "openfold_checkpoint_path": "param_path: FILE", "skip_relaxation": "relax: false", "relaxation": "relax: true",
    "data_random_seed": "seed: N", "long_sequence_inference": "chunk_size: auto",
    "uniclust30_database_path": "uniref30_database_path: PATH", "gpus": "devices: N", "enable_workflow":
    "num_workers: N", "cif_output": None, "save_outputs": None, "save_prediction_result": None, "preset": None,
}
"""OpenFold/FastFold flags translated on the command line, and the setting a config file writes instead."""


def _compat_keys() -> dict[str, str]:
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
    "multimer_ri_gap": "cannot apply: OpenFold's residue-index gap folds a complex with a monomer model; here "
                       "complexes run AlphaFold-Multimer (--model_preset multimer), whose chain-aware relative "
                       "positions (asym_id) separate the chains without a gap",
    "release_dates_path": "is not needed: template release dates are read from each mmCIF file "
                          "(_pdbx_audit_revision_history)",
}
"""Flags of OpenFold/FastFold that cannot apply here, and why (one line each)."""

_MULTIMER_ONLY = ("uniprot_database_path", "pdb_seqres_database_path", "hmmsearch_binary_path",
                  "hmmbuild_binary_path")
"""Multimer-only inputs: monomer runs ignore them (as OpenFold's do), with a warning; multimer runs: see
`_multimer_inputs`."""

COMPAT_FLAGS = {
    "openfold": (
        "fasta_dir", "template_mmcif_dir", "--use_precomputed_alignments", "--use_custom_template",
        "--use_single_seq_mode", "--output_dir", "--model_device", "--config_preset", "--jax_param_path",
        "--openfold_checkpoint_path", "--save_outputs", "--cpus", "--preset", "--output_postfix",
        "--data_random_seed", "--skip_relaxation", "--multimer_ri_gap", "--trace_model", "--subtract_plddt",
        "--long_sequence_inference", "--cif_output", "--experiment_config_json",
        "--use_deepspeed_evoformer_attention",
    ),
    "fastfold": (
        "fasta_path", "template_mmcif_dir", "--use_precomputed_alignments", "--output_dir", "--model_name",
        "--param_path", "--relaxation", "--cpus", "--gpus", "--preset", "--save_prediction_result",
        "--data_random_seed", "--model_preset", "--chunk_size", "--enable_workflow", "--inplace",
    ),
    "data": (
        "--uniref90_database_path", "--mgnify_database_path", "--pdb70_database_path", "--pdb_seqres_database_path",
        "--uniref30_database_path", "--uniclust30_database_path", "--uniprot_database_path",
        "--bfd_database_path", "--jackhmmer_binary_path", "--hhblits_binary_path", "--hhsearch_binary_path",
        "--hmmsearch_binary_path", "--hmmbuild_binary_path", "--kalign_binary_path", "--max_template_date",
        "--obsolete_pdbs_path", "--release_dates_path",
    ),
}
"""The two scripts' command-line arguments (run_pretrained_openfold.py with OpenFold's add_data_args;
FastFold's inference.py with its add_data_args): each is accepted here with its meaning or refused."""


def _same_or_usage(args: argparse.Namespace, dest: str, value, flag: str, default=None) -> None:
    current = getattr(args, dest)
    if current not in (default, value):
        raise _usage(f"{flag} {value} contradicts --{dest} {current}")
    setattr(args, dest, value)


def _apply_compat(args: argparse.Namespace) -> None:
    """Translate OpenFold/FastFold flags into suite fold's settings on `args` (a setting not there yet gets its
    default), or refuse one with the reason (exit 2)."""
    import logging

    from ...fastfold.settings import FoldSettings
    from ...utils.settings import settings

    log = logging.getLogger(__name__)
    for name, s in settings(FoldSettings).items():
        if not hasattr(args, name):
            setattr(args, name, s.default)
    for flag, why in _REFUSED.items():
        if getattr(args, flag, None) not in (None, False):
            raise _usage(f"--{flag} {why}")
    if args.preset == "reduced_dbs":
        raise _usage("--preset reduced_dbs: the small-BFD jackhmmer search is not implemented; give "
                     "--bfd_database_path and --uniref30_database_path (full_dbs) or precomputed alignments")
    if args.config_preset is not None:
        _same_or_usage(args, "model_name", args.config_preset, "--config_preset", "model_1_ptm")
    for flag in ("jax_param_path", "openfold_checkpoint_path"):
        if getattr(args, flag) is not None:
            _same_or_usage(args, "param_path", getattr(args, flag), f"--{flag}")
    if args.skip_relaxation:
        if args.relaxation:
            raise _usage("--skip_relaxation contradicts --relaxation")
        args.relax = False
    if args.data_random_seed is not None:
        try:
            seed = int(args.data_random_seed)
        except ValueError:
            raise _usage(f"--data_random_seed {args.data_random_seed!r}: expected an integer") from None
        _same_or_usage(args, "seed", seed, "--data_random_seed", 0)
    if args.long_sequence_inference and args.chunk_size is None:
        args.chunk_size = "auto"
    if args.uniclust30_database_path is not None:
        _same_or_usage(args, "uniref30_database_path", args.uniclust30_database_path, "--uniclust30_database_path")
    if args.gpus is not None:
        _same_or_usage(args, "devices", args.gpus, "--gpus", 1)
    if args.enable_workflow and args.num_workers is None:
        import os

        args.num_workers = max(1, min(4, os.cpu_count() or 1))
    _apply_model_preset(args)
    _multimer_inputs(args, log)


_MULTIMER_DEFAULT = "model_1_multimer_v3"
"""--model_name of --model_preset multimer when no model is named (as the monomer default names one model)."""


def _is_multimer(args: argparse.Namespace) -> bool:
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
            raise _usage(f"--model_preset multimer contradicts --model_name {other} (a monomer model); name "
                         "model_N_multimer_v3 models or leave --model_name out")
    elif multimer:
        raise _usage(f"--model_preset monomer contradicts --model_name {', '.join(multimer)} (AlphaFold-Multimer)")


def _multimer_inputs(args: argparse.Namespace, log) -> None:
    """The multimer-only inputs: unused by monomer models (a warning, as OpenFold's monomer runs ignore them);
    with multimer models, the UniProt search is run per chain, the hmmsearch template search is refused."""
    given = [f for f in _MULTIMER_ONLY if getattr(args, f, None) is not None]
    if not _is_multimer(args):
        for flag in given:
            log.warning("--%s is used by multimer models only; --model_name %s is a monomer model, so it is unused",
                        flag, args.model_name)
        return
    if args.pdb_seqres_database_path is not None and args.use_precomputed_alignments is None:
        raise _usage("--pdb_seqres_database_path: the hmmsearch template search of AlphaFold-Multimer is not "
                     "implemented; templates come from .hhr hits (--pdb70_database_path, or pdb70_hits.hhr in each "
                     "chain's folder of --use_precomputed_alignments)")
    for flag in ("hmmsearch_binary_path", "hmmbuild_binary_path", "pdb_seqres_database_path"):
        if getattr(args, flag) is not None:
            log.warning("--%s is unused: templates come from .hhr hits (the hmmsearch template search is not "
                        "implemented)", flag)
    if args.uniprot_database_path is not None and args.use_precomputed_alignments is not None:
        log.warning("--uniprot_database_path is unused with --use_precomputed_alignments: each chain's folder "
                    "gives its pairing MSA (uniprot_hits.sto)")


def fold_settings(args: argparse.Namespace):
    """The run's `fastfold.settings.FoldSettings`: a flag given on the command line > the `--config` file >
    the default (`utils.settings.merge`), then the OpenFold/FastFold translations (`_apply_compat`). `args`
    gets every setting under its flat name too (the input checks below read them there). A bad key or value is
    one line naming the file (or flag) and the key."""
    from ...fastfold.settings import FoldSettings
    from ...utils.settings import build, merge, read_yaml, settings

    table = settings(FoldSettings)
    given = {n: v for n, v in vars(args).items() if n in table and n not in ("fasta_path", "template_mmcif_dir")}
    # the positionals: given when not None; --template_mmcif_dir wins over its positional twin
    mmcif_dir = getattr(args, "template_mmcif_dir_flag", None) or getattr(args, "template_mmcif_dir", None)
    for name, value in (("fasta_path", getattr(args, "fasta_path", None)), ("template_mmcif_dir", mmcif_dir)):
        if value is not None:
            given[name] = value
    path = getattr(args, "config", None)
    file_values = read_yaml(path, FoldSettings, not_settings=_compat_keys()) if path else {}
    values, origin = merge(FoldSettings, argparse.Namespace(**given), file_values, str(path), explicit=given)
    for name, s in table.items():
        setattr(args, name, values.get(name, s.default))
    _apply_compat(args)
    if args.fasta_path is None:  # the bundled example, folded from its sequence alone
        from ...fastfold.examples import EXAMPLE_FASTA

        args.fasta_path = str(EXAMPLE_FASTA)
        args.single_sequence = True
    return build(FoldSettings, {n: getattr(args, n) for n in table}, origin)


# --------------------------------------------------------------------------------------------- validation


def _usage(message: str):
    from ..errors import UsageError

    return UsageError(message)


def _read_targets(args: argparse.Namespace):
    from ...fastfold.pipeline import read_targets
    from ...utils.errors import InputError

    try:
        if _is_multimer(args):
            from ...fastfold.pipeline import read_complex_targets

            return read_complex_targets(args.fasta_path)
        return read_targets(args.fasta_path)
    except InputError as exc:
        hint = ""
        if "':' is not an amino-acid letter" in str(exc):
            hint = "; chains split by ':' make a complex: fold it with --model_preset multimer"
        raise _usage(f"{exc}{hint}") from None


def _existing(path: str | None, flag: str, kind: str = "path") -> None:
    import os

    if path is None:
        return
    ok = os.path.isdir(path) if kind == "dir" else os.path.exists(path) or bool(_glob_prefix(path))
    if not ok:
        raise _usage(f"{flag} {path}: no such {'folder' if kind == 'dir' else 'file'}")


def _glob_prefix(prefix: str) -> list[str]:
    import glob

    return glob.glob(glob.escape(prefix) + "*")


def _param_paths(param_path: str | None, names: list[str]) -> list[str | None]:
    import os

    if param_path is None:
        return [None] * len(names)
    if os.path.isdir(param_path):
        paths = [os.path.join(param_path, f"params_{n}.npz") for n in names]
    else:
        paths = [p.strip() for p in param_path.split(",")]
        if len(paths) != len(names):
            raise _usage(f"--param_path gives {len(paths)} file(s) for {len(names)} model(s) in --model_name")
    for p, name in zip(paths, names):
        if not os.path.isfile(p):
            raise _usage(f"--param_path: {p}: no such parameter file")
        _check_param_file(p, name)
    return paths


def _check_param_file(path: str, model_name: str) -> None:
    """A parameter file must open as what its suffix says and hold the model `model_name` needs: one line
    naming the file (and the preset it looks like) before any work, not a traceback later."""
    import zipfile

    from ...fastfold import params
    from ...fastfold.model.config import preset

    suffix = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    if suffix in ("pt", "pth", "ckpt") and "_multimer" in model_name:
        raise _usage(f"--param_path: {path}: --model_name {model_name} reads AlphaFold-Multimer .npz files only "
                     "(params_model_N_multimer_v3.npz), not PyTorch checkpoints")
    if suffix in ("pt", "pth", "ckpt"):
        if not zipfile.is_zipfile(path):
            raise _usage(f"--param_path: {path}: not a PyTorch checkpoint (not a zip archive: truncated or corrupt?)")
        return
    if suffix != "npz":
        raise _usage(f"--param_path: {path}: unknown parameter file type (expected AlphaFold .npz or OpenFold .pt)")
    try:
        with zipfile.ZipFile(path) as z:
            keys = [n[:-4] for n in z.namelist() if n.endswith(".npy")]
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise _usage(f"--param_path: {path}: not a readable .npz file ({exc}: truncated or not an npz?)") from None
    af = [k for k in keys if k.startswith(params.PREFIX)]
    if not af:
        raise _usage(f"--param_path: {path}: no AlphaFold parameters in this .npz (no '{params.PREFIX}...' arrays)")
    multimer_file = any("~_relative_encoding" in k or "template_embedding_iteration" in k for k in af)
    if multimer_file != ("_multimer" in model_name):
        if multimer_file:
            raise _usage(f"--param_path: {path}: looks like an AlphaFold-Multimer file, but --model_name {model_name} "
                         "is a monomer model: name its model_N_multimer_v3 preset (or --model_preset multimer)")
        raise _usage(f"--param_path: {path}: looks like a monomer AlphaFold file, but --model_name {model_name} "
                     "needs AlphaFold-Multimer weights (params_model_N_multimer_v3.npz)")
    if multimer_file:
        _check_multimer_file(path, keys, model_name)
        return
    has_tm = params.PREFIX + "predicted_aligned_error_head/logits//weights" in keys
    has_templates = any("/template_embedding/" in k for k in af)
    cfg = preset(model_name)
    if (cfg.template.enabled, cfg.heads.tm) != (has_templates, has_tm):
        looks = ("model_1 or model_2" if has_templates else "model_3, model_4 or model_5") + ("_ptm" if has_tm else "")
        want = ("template" if cfg.template.enabled else "no template") + (" and pTM" if cfg.heads.tm else ", no pTM")
        raise _usage(f"--param_path: {path}: looks like a {looks} file, but --model_name {model_name} needs "
                     f"{want} weights")


def _check_multimer_file(path: str, keys: list[str], model_name: str) -> None:
    """v3 files fuse each triangle multiplication's projections, v1/v2 do not: the file must be the version
    `model_name` names (the preset's MSA sizes differ)."""
    from ...fastfold import params

    fused = any(k.startswith(params.PREFIX) and "triangle_multiplication" in k and k.endswith("/projection//weights")
                for k in keys)
    wants_v3 = model_name.endswith("_v3")
    if fused != wants_v3:
        looks = "a v3" if fused else "a v1/v2"
        raise _usage(f"--param_path: {path}: looks like {looks} AlphaFold-Multimer file (triangle projections "
                     f"{'fused' if fused else 'split'}), but --model_name {model_name} is "
                     f"{'v3' if wants_v3 else 'not v3'}")


def _validate_alignments(args: argparse.Namespace, targets) -> None:
    """Every input the run will read is checked before any work: the alignment folder (also with
    --single_sequence, which then takes only its template hits), one sub-folder per target holding alignment
    files (refused when empty or holding only unknown files, unless --single_sequence), text files only."""
    from pathlib import Path

    _existing(args.use_precomputed_alignments, "--use_precomputed_alignments", "dir")
    if args.use_precomputed_alignments and _is_multimer(args):
        _validate_chain_folders(args, targets)
    elif args.use_precomputed_alignments:
        for t in targets:
            _check_alignment_folder(args, Path(args.use_precomputed_alignments) / t.name, f"target {t.name!r}",
                                    "fold it alone")
    if args.single_sequence:
        return
    for db in _DATABASES:
        _existing(getattr(args, f"{db}_database_path"), f"--{db}_database_path")
    if _is_multimer(args):
        _existing(args.uniprot_database_path, "--uniprot_database_path")
    if args.use_precomputed_alignments is None:
        _check_binaries(args)


def _validate_chain_folders(args: argparse.Namespace, targets) -> None:
    """Complexes: `DIR/<chain name>/` of the first copy of every entity (copies reuse it), text files only; a
    folder without any alignment is refused unless --single_sequence (as for a monomer target)."""
    from pathlib import Path

    for t in targets:
        seen = set()
        for chain in t.complex.chains:
            if chain.entity_id in seen:
                continue
            seen.add(chain.entity_id)
            _check_alignment_folder(args, Path(args.use_precomputed_alignments) / chain.name,
                                    f"chain {chain.name!r} (chain {chain.chain_id} of complex {t.name!r})",
                                    "fold it from the sequences alone")


def _check_alignment_folder(args: argparse.Namespace, folder, what: str, alone: str) -> None:
    """One target's (or chain's) alignment folder: it exists, holds an alignment file unless --single_sequence,
    and every file it will read is text; else one line naming `what`."""
    from ...fastfold.data.targets import alignment_files, check_text_file
    from ...utils.errors import InputError

    if not folder.is_dir():
        raise _usage(f"--use_precomputed_alignments {args.use_precomputed_alignments}: no folder for {what}")
    msas, hits, ignored = alignment_files(folder)
    if not msas and not args.single_sequence:
        holds = f"only {', '.join(p.name for p in ignored)}" if ignored else "nothing"
        raise _usage(f"--use_precomputed_alignments: {folder}: no alignment file (.sto/.a3m, optionally .gz) "
                     f"for {what}, it holds {holds}; add --single_sequence to {alone}")
    for p in [*msas, *hits]:
        try:
            check_text_file(p)
        except InputError as exc:
            raise _usage(f"--use_precomputed_alignments: {exc}") from None


def _check_binaries(args: argparse.Namespace) -> None:
    """The tools the given databases need must be runnable before any work starts."""
    from ...fastfold.data.tools import ToolError, find_binary

    needs = {"jackhmmer": ("uniref90", "mgnify", "uniprot"), "hhblits": ("bfd",), "hhsearch": ("pdb70",)}
    for tool, dbs in needs.items():
        if any(getattr(args, f"{db}_database_path", None) for db in dbs):
            try:
                find_binary(getattr(args, f"{tool}_binary_path"), tool)
            except ToolError as exc:
                raise _usage(f"--{tool}_binary_path: {exc}") from None


def _model_specs(fs):
    from ...fastfold.model.config import model_names
    from ...fastfold.model.multimer import multimer_model_names
    from ...fastfold.pipeline import ModelSpec

    m = fs.model
    known = [*model_names(), *multimer_model_names()]
    names = [n.strip() for n in str(m.model_name).split(",") if n.strip()]
    if not names:
        raise _usage(f"--model_name {m.model_name!r}: names no model; expected one of {', '.join(known)}")
    for n in names:
        if n not in known:
            raise _usage(f"--model_name {n!r}: unknown model; expected one of {', '.join(known)}")
    if len(set(names)) != len(names):
        raise _usage(f"--model_name {m.model_name!r} names a model twice")
    multimer = [n for n in names if "_multimer" in n]
    if multimer and len(multimer) != len(names):
        raise _usage(f"--model_name {m.model_name!r} mixes monomer and AlphaFold-Multimer models (they fold "
                     "different targets: chains or complexes); run them separately")
    paths = _param_paths(m.param_path, names)
    tiny = m.random_model_size == "tiny"
    _check_device(m.model_device)
    return [ModelSpec(model_name=n, param_path=p, tiny=tiny and p is None, precision=m.precision,
                      chunk_size=m.chunk_size, seed=fs.run.seed, device=m.model_device, inplace=m.inplace)
            for n, p in zip(names, paths)]


def _check_device(device: str) -> None:
    import re

    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if device not in ("auto", "cpu") and m is None:
        raise _usage(f"--model_device {device!r}: expected auto, cpu, cuda or cuda:N")
    if m is None:
        return
    import torch

    if not torch.cuda.is_available():
        raise _usage(f"--model_device {device}: CUDA is not available here (use --model_device cpu or auto)")
    if m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise _usage(f"--model_device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _check_ray_address(address: str | None, timeout: float = 3.0) -> str | None:
    """The Ray cluster to join, checked to answer within `timeout` seconds; "auto" is resolved the way Ray
    resolves it (RAY_ADDRESS, then the cluster this machine started last) and the result is said."""
    import logging
    import os
    import socket

    if address is None:
        return None
    source = ""
    if address == "auto":
        if os.environ.get("RAY_ADDRESS"):
            address, source = os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
        else:
            current = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray", "ray_current_cluster")
            try:
                with open(current) as f:
                    address, source = f.read().strip(), current
            except OSError:
                raise _usage("--ray_address auto: no running Ray cluster found (RAY_ADDRESS unset, no "
                             f"{current}); start one with 'ray start --head' or give its address") from None
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise _usage(f"--ray_address {address!r}: expected host:port, ray://host:port or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise _usage(f"--ray_address {address}: no answer within {timeout:.0f} s ({exc.strerror or exc})") from None
    if not address.startswith("ray://"):
        _check_ray_auth(address)
    if source:
        logging.getLogger(__name__).warning("--ray_address auto: joining the Ray cluster at %s (from %s)",
                                            address, source)
    return address


_RAY_PROBE = """
import sys
from ray._raylet import GcsClient
GcsClient(address=sys.argv[1])
"""
"""Connects to a Ray GCS as `ray.init` does first (fetching the cluster id): a cluster with token authentication
refuses it at once when this side has no token or a wrong one."""


def _check_ray_auth(address: str, timeout: float = 15.0) -> None:
    """Refuse a GCS address whose cluster needs an authentication token this side lacks (Ray's token auth:
    RAY_AUTH_MODE=token with RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), in one line, instead of
    Ray's multi-line error after the features started. The probe runs in a child process (Ray's client logs
    and retries there); anything but an authentication refusal is left to Ray to report."""
    import os
    import subprocess
    import sys

    # Ray's client waits up to a minute for an endpoint that is not a GCS: a few seconds are enough here
    env = {**os.environ, "RAY_gcs_rpc_server_connect_timeout_s": "2", "RAY_gcs_rpc_server_reconnect_timeout_s": "3"}
    try:
        proc = subprocess.run([sys.executable, "-c", _RAY_PROBE, address], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return
    text = proc.stderr + proc.stdout
    if proc.returncode != 0 and ("AuthenticationError" in text or "InvalidAuthToken" in text):
        raise _usage(f"--ray_address {address}: the Ray cluster requires an authentication token and refused this "
                     "one (none set, or a wrong one): set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or "
                     "RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) to the cluster's token")


def _build_config(fs, args: argparse.Namespace, targets):
    """The run's `FoldConfig` from the settings `fs` (their ranges were checked when they were built), after the
    inputs they name are checked: the template folder, the models and their parameter files, the Ray cluster,
    the alignment folders, databases and tools, the obsolete-PDB list."""
    import os

    from ...fastfold.pipeline import FoldConfig

    _existing(fs.alignment.sources.template_mmcif_dir, "template_mmcif_dir", "dir")
    models = _model_specs(fs)
    ray_address = _check_ray_address(fs.run.ray_address)
    _validate_alignments(args, targets)
    alignment = fs.alignment.config(multimer=models[0].multimer,
                                    obsolete_pdbs_path=_obsolete_pdbs(fs.alignment.sources.obsolete_pdbs_path))
    run = fs.run
    workers = run.num_workers
    if workers is None:
        workers = min(4, os.cpu_count() or 1, len(targets)) if len(targets) > 1 else 0
    return FoldConfig(
        output_dir=run.output_dir, models=models, alignment=alignment,
        relax=fs.relaxation.config() if fs.relaxation.relax else None, overwrite=run.overwrite,
        seed=run.seed, devices=run.devices, num_workers=workers, ray_address=ray_address,
        num_recycle=run.num_recycle, num_seeds=run.num_seeds, subtract_plddt=run.subtract_plddt,
    )


# ------------------------------------------------------------------------------------------------ running


def _warn_mode(cfg, args: argparse.Namespace) -> None:
    import logging
    import sys

    log = logging.getLogger(__name__)
    if not any(s.param_path for s in cfg.models):
        sys.stderr.write(
            "\n" + "!" * 78 + "\n!! suite fold: no --param_path: the model has RANDOM WEIGHTS.\n"
            "!! The whole pipeline runs, but the structures and confidences are MEANINGLESS.\n" + "!" * 78 + "\n\n"
        )
    a = cfg.alignment
    if not a.single_sequence and a.precomputed_dir is None and not a.runs_tools:
        sys.stderr.write("!! suite fold: NO ALIGNMENTS given (no --use_precomputed_alignments, no databases): "
                         "SINGLE-SEQUENCE mode, expect low confidence\n")
        log.warning("no alignments given (no --use_precomputed_alignments, no databases): single-sequence mode")
        a.single_sequence = True
    if args.devices > 1:
        _check_dap_devices(args.devices, args.model_device)


def _check_dap_devices(devices: int, model_device: str) -> None:
    """--devices N > 1: one GPU per rank (cuda:0 .. cuda:N-1) when the models run on CUDA."""
    import torch

    if model_device.startswith("cuda:"):
        raise _usage(f"--model_device {model_device} with --devices {devices}: DAP rank r runs on cuda:r; "
                     "give --model_device cuda (or auto)")
    on_cuda = model_device == "cuda" or (model_device == "auto" and torch.cuda.is_available())
    if on_cuda and torch.cuda.device_count() < devices:
        raise _usage(f"--devices {devices}: this machine has {torch.cuda.device_count()} CUDA device(s), one per "
                     "rank is needed (or --model_device cpu)")


def _progress_runner(targets, cfg):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ...fastfold.pipeline import fold_targets

    columns = (TextColumn("{task.description:<9}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        bars = {stage: progress.add_task(stage, total=len(targets)) for stage in ("features", "model", "outputs")}

        def emit(stage: str, target) -> None:
            stages = {"skipped": list(bars), "failed": list(bars)}.get(stage, [stage] if stage in bars else [])
            for s in stages:
                if progress.tasks[bars[s]].completed < len(targets):
                    progress.advance(bars[s])

        return fold_targets(targets, cfg, emit)


def _summary(results, output_dir: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"suite fold: outputs in {output_dir}/")
    for col in ("target", "length", "status", "mean pLDDT", "time (s)", "inputs", "files / note"):
        table.add_column(col)
    for r in results:
        plddt = f"{r.mean_plddt:.1f}" if r.mean_plddt is not None else "-"
        files = r.error if r.status == "failed" else (f"{r.folder}/ ({len(r.files)} files)" if r.files else r.folder)
        if r.note and r.status != "failed":
            files = f"{files}; {r.note}"
        status = r.status
        if r.relax_problem:
            status, files = f"{status}, RELAX FAILED", f"{files}; {r.relax_problem}"
        table.add_row(r.target.name, _length(r.target), status, plddt, f"{r.seconds:.1f}", r.inputs,
                      files)
    Console(width=200).print(table)


def _length(target) -> str:
    """Residues of a target; a complex's per chain (A 16 + B 11)."""
    cplx = getattr(target, "complex", None)
    if cplx is None:
        return str(len(target.sequence))
    return " + ".join(f"{c.chain_id} {len(c.sequence)}" for c in cplx.chains)


def run(args: argparse.Namespace) -> int:
    fs = fold_settings(args)
    targets = _read_targets(args)
    cfg = _build_config(fs, args, targets)
    _warn_mode(cfg, args)
    results = _progress_runner(targets, cfg)
    _summary(results, cfg.output_dir)
    # exit 1 when a target failed, or its relaxation did not converge or was refused (the table says which)
    return 1 if any(r.status == "failed" or r.relax_problem for r in results) else 0


def _obsolete_pdbs(path: str | None) -> str | None:
    """--obsolete_pdbs_path read once up front, so a bad file is one line (naming it and the line), exit 2."""
    if path is None:
        return None
    import os

    from ...fastfold.data.templates import read_obsolete_pdbs
    from ...utils.errors import InputError

    if not os.path.isfile(path):
        raise _usage(f"--obsolete_pdbs_path {path}: no such file")
    try:
        read_obsolete_pdbs(path)
    except InputError as err:
        raise _usage(f"--obsolete_pdbs_path {err}") from None
    return path
