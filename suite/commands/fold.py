"""`suite fold`: predict protein structures from FASTA (AlphaFold2 monomer and AlphaFold-Multimer, FastFold/OpenFold
flag names).

    suite fold targets.fasta [template_mmcif_dir] --output_dir out --use_precomputed_alignments alignments/
    suite fold complexes.fasta --model_preset multimer   # ColabFold's A:B records or one FASTA file per complex
    suite fold                      # the bundled example, single-sequence mode, tiny random model

Everything is validated before any work starts (bad input: one line, exit 2). The folding itself, the input
checks and the output layouts are `fastfold.run.fold`'s (the entry the Lightning recipe and Python users share);
this module only turns flags into its settings and config, and prints progress and a summary.
"""

from __future__ import annotations

import argparse

from .fold_compat import add_compat_arguments, apply_compat, compat_config_keys, is_multimer

__all__ = ["add_arguments", "fold_settings", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The positional inputs, the flags of `fastfold.run.settings.FoldSettings` (generated: each field's docstring is
    its help) and the OpenFold/FastFold translations (`fold_compat`)."""
    from ...fastfold.run.settings import FLAGLESS, FoldSettings
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
    """The run's `fastfold.run.settings.FoldSettings`: a flag given on the command line > the `--config` file >
    the default (`utils.settings.merge`), then the OpenFold/FastFold translations (`apply_compat`). `args`
    gets every setting under its flat name too (the input checks below read them there). A bad key or value is
    one line naming the file (or flag) and the key."""
    from ...fastfold.run.settings import FoldSettings
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
    """The run's targets (`fastfold.run.read_fold_targets`; bad input is one line) and, on `args.input_rule`, the
    rule that made them."""
    from ...fastfold.run.entry import read_fold_targets

    targets, args.input_rule = read_fold_targets(args.fasta_path, multimer=is_multimer(args),
                                                 ri_gap=getattr(args, "multimer_ri_gap", None))
    return targets


def _param_paths(param_path: str | None, names: list[str]) -> list[str | None]:
    """--param_path as one file per model: a folder's `params_<model_name>.npz`, or a comma list of as many files
    as models (each file is checked against its model with the other inputs, `fastfold.run.preflight`)."""
    import os

    if param_path is None:
        return [None] * len(names)
    if os.path.isdir(param_path):
        return [os.path.join(param_path, f"params_{n}.npz") for n in names]
    paths = [p.strip() for p in param_path.split(",")]
    if len(paths) != len(names):
        raise _usage(f"--param_path gives {len(paths)} file(s) for {len(names)} model(s) in --model_name")
    return paths


def _model_specs(fs, save_outputs: bool = False):
    from ...fastfold.model.config import model_names
    from ...fastfold.model.multimer import multimer_model_names
    from ...fastfold.run.stages import ModelSpec

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
    """--model_device names a device kind this build knows (whether it exists here is `fastfold.run.preflight`'s
    check, with the other inputs)."""
    import re

    if device not in ("auto", "cpu") and re.fullmatch(r"cuda(?::\d+)?", device) is None:
        raise _usage(f"--model_device {device!r}: expected auto, cpu, cuda or cuda:N")


def _check_ray_address(address: str | None, timeout: float = 3.0) -> str | None:
    """The Ray cluster to join, checked to answer (the one check every `--ray_address` entry point runs:
    `utils.ray_cluster.check_ray_address`)."""
    from ...utils.ray_cluster import check_ray_address

    return check_ray_address(address, timeout=timeout)


def _build_config(fs, args: argparse.Namespace, targets):
    """The run's `FoldConfig` from the settings `fs` (their ranges were checked when they were built): the models
    from their flags, the Ray cluster checked to answer; the files and devices they name are checked by the run
    itself (`fastfold.run.preflight`). With no alignment source at all the run folds from the sequence alone
    (`args.no_alignments`, said once the inputs passed)."""
    import os

    from ...fastfold.run.config import FoldConfig

    models = _model_specs(fs, bool(getattr(args, "save_outputs", False)))
    ray_address = _check_ray_address(fs.run.ray_address)
    alignment = fs.alignment.config(multimer=models[0].multimer,
                                    obsolete_pdbs_path=fs.alignment.sources.obsolete_pdbs_path)
    args.no_alignments = not alignment.single_sequence and alignment.precomputed_dir is None and \
        not alignment.runs_tools
    if args.no_alignments:
        alignment.single_sequence = True
    run = fs.run
    workers = run.num_workers
    if workers is None:
        # on a cluster 0 means one model worker per GPU or per node (fastfold.run.cluster)
        workers = min(4, os.cpu_count() or 1, len(targets)) if len(targets) > 1 and not ray_address else 0
    return FoldConfig(
        output_dir=run.output_dir, models=models, alignment=alignment,
        relax=fs.relaxation.config() if fs.relaxation.relax else None, overwrite=run.overwrite,
        seed=run.seed, devices=run.devices, num_workers=workers, ray_address=ray_address,
        enable_workflow=bool(getattr(args, "enable_workflow", False)),
        num_recycle=run.num_recycle, num_seeds=run.num_seeds, subtract_plddt=run.subtract_plddt,
        output_layout=getattr(args, "output_layout", "suite"), cif_output=bool(getattr(args, "cif_output", False)),
    )


# ------------------------------------------------------------------------------------------------ running


def _warn_mode(cfg, args: argparse.Namespace) -> None:
    """Said once the inputs passed, before any work: random weights, and no alignments at all."""
    import logging
    import sys

    log = logging.getLogger(__name__)
    if not any(s.param_path for s in cfg.models):
        sys.stderr.write(
            "\n" + "!" * 78 + "\n!! suite fold: no --param_path: the model has RANDOM WEIGHTS.\n"
            "!! The whole pipeline runs, but the structures and confidences are MEANINGLESS.\n" + "!" * 78 + "\n\n"
        )
    if getattr(args, "no_alignments", False):
        sys.stderr.write("!! suite fold: NO ALIGNMENTS given (no --use_precomputed_alignments, no databases): "
                         "SINGLE-SEQUENCE mode, expect low confidence\n")
        log.warning("no alignments given (no --use_precomputed_alignments, no databases): single-sequence mode")


def _progress_runner(targets, cfg, on_checked):
    """`fastfold.run.fold` with progress bars, shown (after `on_checked()`) once the inputs passed."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ...fastfold.run.entry import fold

    columns = (TextColumn("{task.description:<9}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    progress = Progress(*columns, transient=False)
    bars: dict[str, int] = {}

    def emit(stage: str, target) -> None:
        if stage == "checked":
            on_checked()
            progress.start()
            bars.update({s: progress.add_task(s, total=len(targets)) for s in ("features", "model", "outputs")})
            return
        stages = {"skipped": list(bars), "failed": list(bars)}.get(stage, [stage] if stage in bars else [])
        for s in stages:
            if progress.tasks[bars[s]].completed < len(targets):
                progress.advance(bars[s])

    try:
        return fold(targets, cfg, emit)
    finally:
        progress.stop()


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
    results = _progress_runner(targets, cfg, lambda: _warn_mode(cfg, args))
    _summary(results, cfg.output_dir, getattr(args, "input_rule", ""))
    # exit 1 when a target failed, or its relaxation did not converge or was refused (the table says which)
    return 1 if any(r.status == "failed" or r.relax_problem for r in results) else 0
