"""`suite bench fold`: per-stage time of `suite fold` (features, model, relax) for one target, and the wall
time of N targets with Ray feature jobs against one after another.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from ..errors import UsageError
from .harness import publish, timed

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n_res", type=int, default=64, help="residues per target")
    parser.add_argument("--targets", type=int, default=8, help="targets of the Ray vs sequential comparison")
    parser.add_argument("--num_workers", type=int, default=2, help="Ray CPUs for the feature jobs")
    parser.add_argument("--db_size", type=int, default=30000, help="sequences in the synthetic jackhmmer database")
    parser.add_argument("--model_name", default="model_1_ptm", help="model preset")
    parser.add_argument("--param_path", default=None, help="parameters (default: random weights)")
    parser.add_argument("--random_model_size", choices=["tiny", "full"], default="tiny",
                        help="size of the random model without --param_path")
    parser.add_argument("--relax", action=argparse.BooleanOptionalAction, default=True,
                        help="include relaxation (stage timing and the N-target runs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic targets")


def _database(path, targets, size: int, seed: int) -> None:
    """Ten mutated copies of each target (5% to 50% of residues changed) among random decoys (FASTA)."""
    import numpy as np

    from ...fastfold.data.testing import families, random_sequences, write_fasta

    rng = np.random.default_rng(seed + 1)
    homologs = families([(t.name, t.sequence) for t in targets], 10, rng)
    write_fasta(path, homologs + random_sequences(size, len(targets[0].sequence), rng))


def _stage_rows(target, cfg):
    from ...fastfold import run as fp
    from ...fastfold.relax import relax_protein

    spec = cfg.models[0]
    raw, features_s = timed(fp.target_raw_features, target, cfg.alignment, Path(cfg.output_dir) / "stage", True)
    model, fcfg = fp.load_model(spec)
    batch = fp.features_for_model(raw, fcfg, 0)
    pred, model_s = timed(fp.predict, model, batch, spec)
    rows = [{"stage": "features", "seconds": features_s, "detail": f"MSA depth {len(raw['msa'])}"},
            {"stage": "model", "seconds": model_s, "detail": f"{spec.model_name}, {len(target.sequence)} residues"}]
    if cfg.relax is not None:
        result = relax_protein(fp.prediction_to_protein(target, pred), cfg.relax)
        rows.append({"stage": "relax", "seconds": result.seconds,
                     "detail": f"violations {result.violations_before}->{result.violations_after}"})
    return rows


def run(args: argparse.Namespace) -> int:
    from ...fastfold.data.testing import random_sequences
    from ...fastfold.data.tools import ToolError, find_binary
    from ...fastfold.relax import RelaxConfig
    from ...fastfold.run import AlignmentConfig, FoldConfig, ModelSpec, Target, fold_targets
    from ...utils.ray_cluster import init_local_ray

    if args.n_res < 1 or args.targets < 1 or args.num_workers < 1:
        raise UsageError("--n_res, --targets and --num_workers must be >= 1")
    targets = [Target(n, s) for n, s in random_sequences(args.targets, args.n_res, args.seed, "t")]
    with tempfile.TemporaryDirectory(prefix="bench_fold_", ignore_cleanup_errors=True) as folder:
        tmp = Path(folder)
        try:
            jackhmmer_path = find_binary(None, "jackhmmer")
        except ToolError:
            jackhmmer_path = None
        if jackhmmer := jackhmmer_path is not None:
            _database(tmp / "db.fasta", targets, args.db_size, args.seed)
            alignment = AlignmentConfig(uniref90_database_path=str(tmp / "db.fasta"), cpus=1,
                                        jackhmmer_binary_path=jackhmmer_path)
        else:
            alignment = AlignmentConfig(single_sequence=True)
        spec = ModelSpec(model_name=args.model_name, param_path=args.param_path,
                         tiny=args.param_path is None and args.random_model_size == "tiny")
        base = FoldConfig(output_dir=str(tmp / "stage"), models=[spec], alignment=alignment,
                          relax=RelaxConfig(platform="auto") if args.relax else None)
        stages = _stage_rows(targets[0], base)

        def fold(out: str, workers: int) -> dict:
            cfg = dataclasses.replace(base, output_dir=str(tmp / out), num_workers=workers)
            results, seconds = timed(fold_targets, targets, cfg)
            return {"targets": len(targets), "seconds": seconds, "done": sum(r.status == "done" for r in results)}

        runs = [{"mode": "one after another", **fold("run0", 0)}]
        # The local Ray is started here, timed on its own, then reused by fold_targets (as it reuses a running
        # cluster): the second row is what `suite fold` costs end to end, the third what a running cluster costs.
        ray_context, ray_start = timed(init_local_ray, args.num_workers, configure_logging=False)
        with ray_context:
            on_ray = fold("run_ray", args.num_workers)
        runs.append({"mode": f"Ray, {args.num_workers} workers, with start-up", **on_ray,
                     "seconds": on_ray["seconds"] + ray_start})
        runs.append({"mode": f"Ray, {args.num_workers} workers, running cluster", **on_ray})
        for row in runs[1:]:
            row["speedup"] = runs[0]["seconds"] / row["seconds"]
        publish(args, {"benchmark": "fold", "args": vars(args), "stages": stages, "runs": runs, "jackhmmer": jackhmmer},
                [(f"suite fold stages, one target ({'jackhmmer' if jackhmmer else 'single sequence'})", stages, None),
                 (f"{len(targets)} targets of {args.n_res} residues", runs, None)])
    return 0
