"""`suite fold`: predict protein structures from FASTA (AlphaFold2 monomer, FastFold/OpenFold flag names).

    suite fold targets.fasta [template_mmcif_dir] --output_dir out --use_precomputed_alignments alignments/
    suite fold                      # the bundled example, single-sequence mode, tiny random model

Everything is validated before any work starts (bad input: one line, exit 2). The folding itself is
`fastfold.pipeline`; this module only turns flags into its configs and prints progress and a summary.
"""

from __future__ import annotations

import argparse
import datetime

__all__ = ["add_arguments", "run"]

_DATABASES = ("uniref90", "mgnify", "bfd", "uniref30", "pdb70")
_TOOLS = ("jackhmmer", "hhblits", "hhsearch", "kalign")


def _chunk_size(text: str):
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--chunk_size must be a positive int or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--chunk_size must be a positive int or 'auto', got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("fasta_path", nargs="?", default=None,
                        help="FASTA file, one target per record (default: the bundled example)")
    parser.add_argument("template_mmcif_dir", nargs="?", default=None, help="folder of PDB mmCIF files (templates)")
    parser.add_argument("--template_mmcif_dir", dest="template_mmcif_dir_flag", default=None,
                        help="same as the positional template_mmcif_dir")
    parser.add_argument("--output_dir", default="fold_outputs", help="one sub-folder per target is written here")
    parser.add_argument("--model_name", default="model_1_ptm",
                        help="model preset(s), comma-separated (model_1..model_5, _ptm); ranked as AlphaFold does")
    parser.add_argument("--param_path", default=None,
                        help="parameter file (one model), comma-separated files (one per model) or a folder of "
                             "params_<model_name>.npz; without it the weights are RANDOM")
    parser.add_argument("--random_model_size", choices=["tiny", "full"], default="tiny",
                        help="size of the randomly initialised model used without --param_path")
    parser.add_argument("--use_precomputed_alignments", default=None, metavar="DIR",
                        help="folder with one sub-folder per target (uniref90_hits.sto, bfd_uniref_hits.a3m, ...)")
    parser.add_argument("--single_sequence", action="store_true", help="no MSA: the query alone")
    for db in _DATABASES:
        parser.add_argument(f"--{db}_database_path", default=None, help=f"{db} database for the alignment tools")
    for tool in _TOOLS:
        parser.add_argument(f"--{tool}_binary_path", default=tool, help=f"{tool} executable")
    parser.add_argument("--max_template_date", default=datetime.date.today().isoformat(),
                        help="latest template release date, YYYY-MM-DD (default: today)")
    parser.add_argument("--cpus", type=int, default=2, help="threads per alignment tool")
    parser.add_argument("--devices", type=int, default=1, help="DAP ranks that share one target's Evoformer")
    parser.add_argument("--chunk_size", type=_chunk_size, default=None, help="low-memory chunk size, or 'auto'")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp64"], default="fp32", help="model precision")
    parser.add_argument("--model_device", default="auto",
                        help="auto (CUDA when available), cpu, cuda or cuda:N (DAP ranks with --devices run on CPU)")
    parser.add_argument("--relax", action=argparse.BooleanOptionalAction, default=True,
                        help="Amber-relax the best model (default: on)")
    parser.add_argument("--relax_platform", choices=["auto", "CPU", "CUDA"], default="auto", help="OpenMM platform")
    parser.add_argument("--ray_address", default=None, help="Ray cluster for the alignment/feature jobs")
    parser.add_argument("--num_workers", type=int, default=None,
                        help="local Ray CPUs for alignment/feature jobs; 0: no Ray (default: up to 4 when several "
                             "targets)")
    parser.add_argument("--overwrite", action="store_true", help="redo targets that are already complete")
    parser.add_argument("--seed", type=int, default=0, help="seed of MSA sampling and of random weights")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML of these flags (the recipe file, recipes/configs/fold.yaml); the command line wins")


_RECIPE_ONLY = {"accelerator"}
"""Keys of the recipe YAML that only the Lightning recipe uses."""


def _apply_config(args: argparse.Namespace) -> None:
    """Fill flags not given on the command line from the `--config` YAML (unknown keys are an error)."""
    import yaml

    path = args.config
    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except OSError as exc:
        raise _usage(f"--config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise _usage(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise _usage(f"--config {path}: expected a mapping of flag names to values")
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    default_values = vars(defaults.parse_args([]))
    for key, value in values.items():
        if key in _RECIPE_ONLY:
            continue
        dest = "template_mmcif_dir_flag" if key == "template_mmcif_dir" else key
        if dest not in default_values or dest == "config":
            raise _usage(f"--config {path}: key {key!r} is not a suite fold flag")
        if getattr(args, dest) == default_values[dest]:
            setattr(args, dest, value)


# --------------------------------------------------------------------------------------------- validation


def _usage(message: str):
    from ..errors import UsageError

    return UsageError(message)


def _read_targets(args: argparse.Namespace):
    from ...fastfold.data.parsers import InputError
    from ...fastfold.pipeline import read_targets

    if args.fasta_path is None:
        from ...fastfold.examples import EXAMPLE_FASTA

        args.fasta_path = str(EXAMPLE_FASTA)
        args.single_sequence = True
    try:
        return read_targets(args.fasta_path)
    except InputError as exc:
        raise _usage(str(exc)) from None


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


def _param_paths(args: argparse.Namespace, names: list[str]) -> list[str | None]:
    import os

    if args.param_path is None:
        return [None] * len(names)
    if os.path.isdir(args.param_path):
        paths = [os.path.join(args.param_path, f"params_{n}.npz") for n in names]
    else:
        paths = [p.strip() for p in args.param_path.split(",")]
        if len(paths) != len(names):
            raise _usage(f"--param_path gives {len(paths)} file(s) for {len(names)} model(s) in --model_name")
    for p in paths:
        if not os.path.isfile(p):
            raise _usage(f"--param_path: {p}: no such parameter file")
    return paths


def _validate_alignments(args: argparse.Namespace, targets) -> None:
    import os

    if args.single_sequence:
        return
    _existing(args.use_precomputed_alignments, "--use_precomputed_alignments", "dir")
    if args.use_precomputed_alignments:
        for t in targets:
            if not os.path.isdir(os.path.join(args.use_precomputed_alignments, t.name)):
                raise _usage(f"--use_precomputed_alignments {args.use_precomputed_alignments}: "
                             f"no folder for target {t.name!r}")
    for db in _DATABASES:
        _existing(getattr(args, f"{db}_database_path"), f"--{db}_database_path")
    if args.use_precomputed_alignments is None:
        _check_binaries(args)


def _check_binaries(args: argparse.Namespace) -> None:
    """The tools the given databases need must be runnable before any work starts."""
    from ...fastfold.data.tools import ToolError, find_binary

    needs = {"jackhmmer": ("uniref90", "mgnify"), "hhblits": ("bfd",), "hhsearch": ("pdb70",)}
    for tool, dbs in needs.items():
        if any(getattr(args, f"{db}_database_path") for db in dbs):
            try:
                find_binary(getattr(args, f"{tool}_binary_path"), tool)
            except ToolError as exc:
                raise _usage(f"--{tool}_binary_path: {exc}") from None


def _model_specs(args: argparse.Namespace):
    from ...fastfold.model.config import model_names
    from ...fastfold.pipeline import ModelSpec

    names = [n.strip() for n in args.model_name.split(",") if n.strip()]
    for n in names:
        if n not in model_names():
            raise _usage(f"--model_name {n!r}: unknown model; expected one of {', '.join(model_names())}")
    if len(set(names)) != len(names):
        raise _usage(f"--model_name {args.model_name!r} names a model twice")
    paths = _param_paths(args, names)
    tiny = args.random_model_size == "tiny"
    device = args.model_device
    if not (device in ("auto", "cpu", "cuda") or device.startswith("cuda:")):
        raise _usage(f"--model_device {device!r}: expected auto, cpu, cuda or cuda:N")
    return [ModelSpec(model_name=n, param_path=p, tiny=tiny and p is None, precision=args.precision,
                      chunk_size=args.chunk_size, seed=args.seed, device=device) for n, p in zip(names, paths)]


def _build_config(args: argparse.Namespace, targets):
    import datetime as dt
    import os

    from ...fastfold.pipeline import AlignmentConfig, FoldConfig
    from ...fastfold.relax import RelaxConfig

    mmcif_dir = args.template_mmcif_dir_flag or args.template_mmcif_dir
    _existing(mmcif_dir, "template_mmcif_dir", "dir")
    try:
        dt.date.fromisoformat(args.max_template_date)
    except ValueError:
        raise _usage(f"--max_template_date {args.max_template_date!r}: expected YYYY-MM-DD") from None
    for flag in ("devices", "cpus"):
        if getattr(args, flag) < 1:
            raise _usage(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.num_workers is not None and args.num_workers < 0:
        raise _usage(f"--num_workers must be >= 0, got {args.num_workers}")
    _validate_alignments(args, targets)
    alignment = AlignmentConfig(
        precomputed_dir=args.use_precomputed_alignments, single_sequence=args.single_sequence,
        template_mmcif_dir=mmcif_dir, max_template_date=args.max_template_date, cpus=args.cpus,
        **{f"{db}_database_path": getattr(args, f"{db}_database_path") for db in _DATABASES},
        **{f"{t}_binary_path": getattr(args, f"{t}_binary_path") for t in _TOOLS},
    )
    workers = args.num_workers
    if workers is None:
        workers = min(4, os.cpu_count() or 1, len(targets)) if len(targets) > 1 else 0
    return FoldConfig(
        output_dir=args.output_dir, models=_model_specs(args), alignment=alignment,
        relax=RelaxConfig(platform=args.relax_platform) if args.relax else None, overwrite=args.overwrite,
        seed=args.seed, devices=args.devices, num_workers=workers, ray_address=args.ray_address,
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
        log.warning("no alignments given (no --use_precomputed_alignments, no databases): single-sequence mode")
        a.single_sequence = True
    if args.devices > 1:
        try:
            from ...fastfold import dap  # noqa: F401
        except ImportError:
            raise _usage("--devices > 1 needs fastfold.dap, which this build does not have") from None


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
    for col in ("target", "length", "status", "mean pLDDT", "time (s)", "files"):
        table.add_column(col)
    for r in results:
        plddt = f"{r.mean_plddt:.1f}" if r.mean_plddt is not None else "-"
        files = r.error if r.status == "failed" else (f"{r.folder}/ ({len(r.files)} files)" if r.files else r.folder)
        table.add_row(r.target.name, str(len(r.target.sequence)), r.status, plddt, f"{r.seconds:.1f}", files)
    Console(width=160).print(table)


def run(args: argparse.Namespace) -> int:
    if args.config:
        _apply_config(args)
    targets = _read_targets(args)
    cfg = _build_config(args, targets)
    _warn_mode(cfg, args)
    results = _progress_runner(targets, cfg)
    _summary(results, args.output_dir)
    return 1 if any(r.status == "failed" for r in results) else 0
