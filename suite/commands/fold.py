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

from .fold_compat import add_compat_arguments, apply_compat, compat_config_keys, is_multimer

__all__ = ["add_arguments", "fold_settings", "run"]

_DATABASES = ("uniref90", "mgnify", "bfd", "uniref30", "pdb70")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The positional inputs, the flags of `fastfold.settings.FoldSettings` (generated: each field's docstring is
    its help) and the OpenFold/FastFold translations (`fold_compat`)."""
    from ...fastfold.settings import FLAGLESS, FoldSettings
    from ...utils.settings import add_flags, settings

    parser.add_argument("fasta_path", nargs="?", default=None,
                        help="FASTA file, one target per record, or a folder of them, one target per file (a file "
                             "of several records: AlphaFold-Gap with a monomer model, as OpenFold); multimer models: "
                             "one complex per record with chains split by ':' (ColabFold) or one complex per file, a "
                             "record per chain (OpenFold) (default: the bundled example)")
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
    add_compat_arguments(parser)


def fold_settings(args: argparse.Namespace):
    """The run's `fastfold.settings.FoldSettings`: a flag given on the command line > the `--config` file >
    the default (`utils.settings.merge`), then the OpenFold/FastFold translations (`apply_compat`). `args`
    gets every setting under its flat name too (the input checks below read them there). A bad key or value is
    one line naming the file (or flag) and the key."""
    from ...fastfold.settings import FoldSettings
    from ...utils.settings import build, merge, read_yaml, settings

    table = settings(FoldSettings)
    if getattr(args, "template_mmcif_dir_flag", None):  # --template_mmcif_dir wins over its positional twin
        args.template_mmcif_dir = args.template_mmcif_dir_flag
    path = getattr(args, "config", None)
    file_values = read_yaml(path, FoldSettings, not_settings=compat_config_keys()) if path else {}
    values, origin = merge(FoldSettings, args, file_values, str(path))
    for name, s in table.items():
        setattr(args, name, values.get(name, s.default))
    apply_compat(args)
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
    """The run's targets (`InputError`s as one line) and, on `args.input_rule`, the rule that made them."""
    import os

    from ...utils.errors import InputError

    try:
        if is_multimer(args):
            from ...fastfold.pipeline import read_complex_targets

            targets = read_complex_targets(args.fasta_path)
            args.input_rule = ("one complex per file, a record per chain (OpenFold's rule)" if os.path.isdir(
                args.fasta_path) else "one complex per record, chains split by ':' (ColabFold's rule)")
            return targets
        from ...fastfold.data.gap import read_fold_inputs

        targets, args.input_rule = read_fold_inputs(args.fasta_path)
        return targets
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
    if args.use_precomputed_alignments and is_multimer(args):
        _validate_chain_folders(args, targets)
    elif args.use_precomputed_alignments:
        for t in targets:
            for name, what in _alignment_folders(t):
                _check_alignment_folder(args, Path(args.use_precomputed_alignments) / name, what, "fold it alone")
    if args.single_sequence:
        return
    for db in _DATABASES:
        _existing(getattr(args, f"{db}_database_path"), f"--{db}_database_path")
    if is_multimer(args):
        _existing(args.uniprot_database_path, "--uniprot_database_path")
    if args.use_precomputed_alignments is None:
        _check_binaries(args)


def _alignment_folders(target) -> list[tuple[str, str]]:
    """(alignment folder name, what it is) of a monomer target: its own, or each record's of an AlphaFold-Gap
    target."""
    chains = getattr(target, "chains", None)
    if chains is None:
        return [(target.name, f"target {target.name!r}")]
    return [(c.name, f"record {c.name!r} of target {target.name!r} (AlphaFold-Gap)") for c in chains]


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


def _model_specs(fs, save_outputs: bool = False):
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
                      chunk_size=m.chunk_size, seed=fs.run.seed, device=m.model_device, inplace=m.inplace,
                      keep_outputs=save_outputs)
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
    """The Ray cluster to join, checked to answer (the one check every `--ray_address` entry point runs:
    `utils.ray_cluster.check_ray_address`)."""
    from ...utils.ray_cluster import check_ray_address

    return check_ray_address(address, timeout=timeout)


def _build_config(fs, args: argparse.Namespace, targets):
    """The run's `FoldConfig` from the settings `fs` (their ranges were checked when they were built), after the
    inputs they name are checked: the template folder, the models and their parameter files, the Ray cluster,
    the alignment folders, databases and tools, the obsolete-PDB list."""
    import os

    from ...fastfold.pipeline import FoldConfig

    _existing(fs.alignment.sources.template_mmcif_dir, "template_mmcif_dir", "dir")
    models = _model_specs(fs, bool(getattr(args, "save_outputs", False)))
    ray_address = _check_ray_address(fs.run.ray_address)
    _validate_alignments(args, targets)
    alignment = fs.alignment.config(multimer=models[0].multimer,
                                    obsolete_pdbs_path=_obsolete_pdbs(fs.alignment.sources.obsolete_pdbs_path))
    run = fs.run
    workers = run.num_workers
    if workers is None:
        # on a cluster 0 means one model worker per GPU or per node (fastfold.ray_fold)
        workers = min(4, os.cpu_count() or 1, len(targets)) if len(targets) > 1 and not ray_address else 0
    return FoldConfig(
        output_dir=run.output_dir, models=models, alignment=alignment,
        relax=fs.relaxation.config() if fs.relaxation.relax else None, overwrite=run.overwrite,
        seed=run.seed, devices=run.devices, num_workers=workers, ray_address=ray_address,
        enable_workflow=bool(getattr(args, "enable_workflow", False)),
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


def _summary(results, output_dir: str, rule: str = "") -> None:
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
    console = Console(width=200)
    console.print(table)
    if rule:
        console.print(f"input rule: {rule}", highlight=False)


def _length(target) -> str:
    """Residues of a target; a complex's per chain (A 16 + B 11)."""
    cplx = getattr(target, "complex", None)
    chains = getattr(target, "chains", None)  # an AlphaFold-Gap target's records
    if chains:
        return " + ".join(f"{chain_id} {len(c.sequence)}" for chain_id, c in zip(target.chain_ids, chains))
    if cplx is None:
        return str(len(target.sequence))
    return " + ".join(f"{c.chain_id} {len(c.sequence)}" for c in cplx.chains)


def run(args: argparse.Namespace) -> int:
    from ...fastfold.dap import refuse_under_launcher

    refuse_under_launcher()  # issue 37: one line, exit 2, under torchrun (fold starts its own ranks)
    fs = fold_settings(args)
    targets = _read_targets(args)
    cfg = _build_config(fs, args, targets)
    _warn_mode(cfg, args)
    _preflight(targets, cfg)
    results = _progress_runner(targets, cfg)
    if getattr(args, "output_layout", "suite") == "openfold":
        from ...fastfold.layout import write_openfold_layout

        write_openfold_layout(cfg.output_dir, targets, cfg.models)
    _summary(results, cfg.output_dir, getattr(args, "input_rule", ""))
    # exit 1 when a target failed, or its relaxation did not converge or was refused (the table says which)
    return 1 if any(r.status == "failed" or r.relax_problem for r in results) else 0


def _preflight(targets, cfg) -> None:
    """Every input read in full before the first model call (`fastfold.preflight`): alignments of all targets,
    parameter files, the output folder created and probed for writing; bad input is one line, exit 2."""
    from ...fastfold.preflight import preflight

    preflight(targets, cfg)


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
