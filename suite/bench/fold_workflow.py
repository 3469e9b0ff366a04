"""`suite bench fold-workflow`: the feature workflow (`--enable_workflow`) against the serial searches, and fold on
a Ray cluster of 1 vs 2 raylets.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from ..errors import UsageError
from .harness import publish, timed

__all__ = ["add_arguments", "run"]

ASSETS = Path(__file__).resolve().parents[2] / "tests" / "assets" / "fold"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--targets", type=int, default=8, help="targets of the many-target feature rows")
    parser.add_argument("--num_workers", type=int, default=2, help="Ray CPUs of the many-target rows")
    parser.add_argument("--cpus", type=int, default=2, help="threads of one target's searches (suite fold --cpus)")
    parser.add_argument("--per_family", type=int, default=40, help="homologs of each query per database")
    parser.add_argument("--decoys", type=int, default=2000, help="random sequences per database (BFD too; a "
                                                                  "quarter for UniRef30 and PDB70)")
    parser.add_argument("--fold_targets", type=int, default=8, help="targets of the 1 vs 2 raylets rows (0: skip)")
    parser.add_argument("--fold_n_res", type=int, default=48, help="residues of each fold target")
    parser.add_argument("--raylet_cpus", type=int, default=1, help="CPUs of each raylet of the fold rows")
    parser.add_argument("--cache_dir", default="/tmp/lowmem-bench-fold-workflow", help="where the databases go")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic sequences")


def _queries(args: argparse.Namespace) -> list[tuple[str, str]]:
    from ...fastfold.data.testing import random_sequences
    from ...fastfold.run import read_targets

    first = read_targets(ASSETS / "query.fasta")[0]
    return [(first.name, first.sequence), *random_sequences(args.targets - 1, len(first.sequence), args.seed, "t", 1)]


def _databases(args: argparse.Namespace, queries) -> dict[str, str]:
    """The cached databases for these queries and sizes (built on the first run)."""
    from ...fastfold.data.testing import build_databases, hhsuite_missing, repository_hits

    hits = sorted(p for p in (ASSETS / "alignments" / "query").glob("*_hits.*") if p.suffix in (".sto", ".a3m"))
    key = json.dumps([queries, args.per_family, args.decoys, args.seed, [p.name for p in hits]])
    folder = Path(args.cache_dir) / hashlib.sha256(key.encode()).hexdigest()[:12]
    done = folder / "databases.json"
    if done.is_file():
        return json.loads(done.read_text())
    if missing := hhsuite_missing():
        print(f"HHblits/HHsearch rows left out: an HH-suite database cannot be built here ({missing})")
    shutil.rmtree(folder, ignore_errors=True)
    dbs = build_databases(folder, queries, per_family=args.per_family, decoy_count=args.decoys,
                          extra=repository_hits(hits), seed=args.seed, hhsuite=not missing)
    done.write_text(json.dumps(dbs))
    return dbs


def _features(targets, cfg) -> float:
    """Seconds of every target's features through `feature_stream` (raising a failure)."""
    from ...fastfold.run import feature_stream

    t0 = time.perf_counter()
    for target, raw, _ in feature_stream(targets, cfg, with_templates=False):
        if isinstance(raw, BaseException):
            raise RuntimeError(f"target {target.name}: {raw}")
    return time.perf_counter() - t0


def _feature_rows(args, targets, dbs, tmp: Path) -> list[dict]:
    from ...fastfold.run import AlignmentConfig, FoldConfig, ModelSpec
    from ...utils.ray_cluster import init_local_ray

    base = FoldConfig(output_dir="", models=[ModelSpec(tiny=True)], alignment=AlignmentConfig(**dbs, cpus=args.cpus))
    rows = []

    def row(what, n, seconds, serial=None):
        rows.append({"features of": what, "targets": n, "seconds": seconds,
                     "speedup": None if serial is None else serial / seconds})

    one = targets[:1]
    serial_one = _features(one, dataclasses.replace(base, output_dir=str(tmp / "s1")))
    row(f"1 target, serial ({args.cpus} threads per tool)", 1, serial_one)
    with init_local_ray(args.cpus, configure_logging=False):  # the first run starts Ray's workers, the second not
        for k, when in enumerate(("first run, workers starting", "workers running")):
            cfg = dataclasses.replace(base, output_dir=str(tmp / f"w1_{k}"), enable_workflow=True)
            row(f"1 target, workflow (Ray, {args.cpus} CPUs; {when})", 1, _features(one, cfg), serial_one)
    serial_all = _features(targets, dataclasses.replace(base, output_dir=str(tmp / "sN")))
    row("targets one after another", len(targets), serial_all)
    with init_local_ray(args.num_workers, configure_logging=False):
        per_target = dataclasses.replace(base, output_dir=str(tmp / "rN"), num_workers=args.num_workers)
        row(f"per-target Ray tasks, {args.num_workers} workers", len(targets), _features(targets, per_target),
            serial_all)
        workflow = dataclasses.replace(per_target, output_dir=str(tmp / "wN"), enable_workflow=True)
        row(f"workflow, {args.num_workers} workers", len(targets), _features(targets, workflow), serial_all)
    return rows


def _fold_rows(args, tmp: Path) -> list[dict]:
    import numpy as np
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from ...fastfold.data.testing import random_sequences
    from ...fastfold.run import AlignmentConfig, FoldConfig, ModelSpec, Target, fold_targets
    from ...utils.ray_cluster import join_ray

    targets = [Target(n, s) for n, s in random_sequences(args.fold_targets, args.fold_n_res, args.seed + 7, "f")]

    def config(out: str, **kw) -> FoldConfig:
        return FoldConfig(output_dir=str(tmp / out), models=[ModelSpec(tiny=True, device="cpu")],
                          alignment=AlignmentConfig(single_sequence=True), **kw)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each Ray worker (OMP_NUM_THREADS=1): the same sums, so outputs can be compared
    try:
        local, seconds = timed(fold_targets, targets, config("local"))
    finally:
        torch.set_num_threads(threads)
    rows = [{"fold": "in this process, 1 thread", "raylets": 0, "seconds": seconds, "start_s": 0.0,
             "done": sum(r.status == "done" for r in local)}]
    for raylets in (1, 2):
        t0 = time.perf_counter()
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.raylet_cpus, "include_dashboard":
                                                                False, "node_ip_address": "127.0.0.1"})
        for _ in range(raylets - 1):
            cluster.add_node(num_cpus=args.raylet_cpus, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        join_ray(cluster.address, log_to_driver=False, configure_logging=False)  # as a 127.0.0.1 node
        start = time.perf_counter() - t0
        try:
            got, seconds = timed(fold_targets, targets, config(f"cluster{raylets}", ray_address=cluster.address))
        finally:
            ray.shutdown()
            cluster.shutdown()
        same = all(np.array_equal(_positions(tmp / "local", t), _positions(tmp / f"cluster{raylets}", t))
                   for t in targets)
        rows.append({"fold": f"Ray cluster, {raylets} raylet(s)", "raylets": raylets, "seconds": seconds,
                     "start_s": start, "done": sum(r.status == "done" for r in got),
                     "nodes used": len({r.node for r in got}), "equal to local": same})
    for r in rows[2:]:
        r["speedup vs 1 raylet"] = rows[1]["seconds"] / r["seconds"]
    return rows


def _positions(folder: Path, target):
    from ...fastfold.run import Prediction

    return Prediction.load(folder / target.name / f"{target.name}_model_1_ptm_prediction.npz").positions


def run(args: argparse.Namespace) -> int:
    from ...fastfold.data import tools as fold_tools
    from ...fastfold.data.tools import ToolError, find_binary
    from ...fastfold.run import Target

    if min(args.targets, args.num_workers, args.cpus, args.per_family, args.raylet_cpus) < 1 or args.decoys < 0:
        raise UsageError("--targets, --num_workers, --cpus, --per_family, --raylet_cpus must be >= 1, --decoys >= 0")
    try:
        find_binary(None, "jackhmmer")
    except ToolError as exc:
        raise UsageError(f"suite bench fold-workflow needs jackhmmer: {exc}") from None

    fold_tools.logger.setLevel(logging.WARNING)  # one line per tool run otherwise
    queries = _queries(args)
    dbs = _databases(args, queries)
    targets = [Target(n, s) for n, s in queries]
    with tempfile.TemporaryDirectory(prefix="bench_fold_workflow_", ignore_cleanup_errors=True) as folder:
        tmp = Path(folder)
        features = _feature_rows(args, targets, dbs, tmp)
        fold = _fold_rows(args, tmp) if args.fold_targets else []
        tables = [(f"feature generation ({', '.join(k.split('_')[0] for k in dbs)}), {len(queries[0][1])} residues "
                   "per target", features, None)]
        if fold:
            tables.append((f"fold of {args.fold_targets} targets of {args.fold_n_res} residues, tiny model", fold,
                           None))
        publish(args, {"benchmark": "fold-workflow", "databases": dbs, "args": vars(args), "features": features,
                       "fold": fold}, tables)
    ok = all(r["done"] == args.fold_targets and r.get("equal to local", True) for r in fold)
    return 0 if ok else 1
