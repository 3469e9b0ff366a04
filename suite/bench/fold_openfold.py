"""`suite bench fold-model --openfold DIR` (issue 18): our AlphaFold against OpenFold's, whole process, side by side."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.machinery
import json
import os
import statistics
import sys
import tempfile
import time
import types

from ...utils.memory_meter import cgroup_method, hwm_bytes
from ..errors import UsageError
from .harness import child, child_main, publish, run_side, torch_device, write_json, write_text

__all__ = ["PLDDT_TOLERANCE", "PlddtMismatch", "check_args", "compare", "run", "run_one", "standin_softmax_",
           "write_inputs"]

PLDDT_TOLERANCE = 1e-3
N_TEMPL = 2
_T_START = time.perf_counter()  # a child's clock starts when this module is first imported (`python -m`)


class PlddtMismatch(ValueError):
    """The two sides' mean pLDDTs differ: they did not compute the same thing, so no ratio means anything."""


def standin_softmax_(a, rows: int, cols: int) -> None:
    """Softmax over the last dimension of `a` (`rows` x `cols` values) in place, no full-size temporary, as
    OpenFold's CUDA `attn_core_inplace_cuda.forward_(a, rows, cols)` (an all -inf row is NaN, as in torch)."""
    if rows * cols != a.numel():
        raise ValueError(f"attn_core_inplace_cuda stand-in: {rows} x {cols} != {a.numel()} elements")
    x = a.view(rows, cols)  # the same storage (raises where `a` is not laid out as rows x cols)
    x.sub_(x.amax(dim=-1, keepdim=True)).exp_()
    x.div_(x.sum(dim=-1, keepdim=True))


def _install_softmax() -> str:
    """Make `import attn_core_inplace_cuda` work: the real extension where it imports, else the stand-in; which."""
    try:
        import attn_core_inplace_cuda  # noqa: F401
        return "attn_core_inplace_cuda (OpenFold's CUDA extension)"
    except ImportError as exc:
        reason = "not installed" if getattr(exc, "name", None) == "attn_core_inplace_cuda" else f"{exc}"
    module = types.ModuleType("attn_core_inplace_cuda")
    module.forward_ = standin_softmax_
    sys.modules["attn_core_inplace_cuda"] = module
    return f"suite's stand-in softmax (attn_core_inplace_cuda {reason})"


def _config(preset: str, tiny: bool):
    from ...fastfold.model import config

    return config.tiny() if tiny else config.preset(preset)


def write_inputs(folder: str, *, preset: str, n_res: int, n_seq: int, n_extra: int, tiny: bool = False,
                 seed: int = 0) -> dict[str, str]:
    """Random parameters (AlphaFold's `.npz` layout) and a feature batch (`torch.save`) for one n_res in `folder`,
    reused where an earlier call wrote the same settings: {"params": path, "features": path}."""
    import torch

    from ...fastfold.model import AlphaFold
    from ...fastfold.model.testing import random_batch, randomize_parameters
    from ...fastfold.params import save_params

    os.makedirs(folder, exist_ok=True)
    name = "tiny" if tiny else preset
    params = os.path.join(folder, f"params_{name}.npz")
    features = os.path.join(folder, f"features_{name}_r{n_res}_s{n_seq}_e{n_extra}_t{N_TEMPL}_seed{seed}.pt")
    meta = {"preset": preset, "tiny": tiny, "seed": seed}
    cfg = _config(preset, tiny)
    try:
        with open(params + ".json") as f:
            reuse = json.load(f) == meta and os.path.isfile(params)
    except (OSError, ValueError):
        reuse = False
    if not reuse:
        save_params(randomize_parameters(AlphaFold(cfg), seed=seed), params)
        gc.collect()
        write_text(params + ".json", json.dumps(meta))
    if not os.path.isfile(features):
        torch.save(random_batch(cfg, n_res=n_res, n_seq=n_seq, n_extra=n_extra, n_templ=N_TEMPL, n_recycle=0,
                                seed=seed), features + ".tmp")
        os.replace(features + ".tmp", features)
    return {"params": params, "features": features}


# ---- the children: `python -m lowmem.suite.bench.fold_openfold JSON` ----------------------------------------


def _forward(side: str, model, batch, device, *call_args, **extra) -> dict:
    """The side's row: one pass timed (model and batch on `device`); its own peak, VmHWM (not ru_maxrss)."""
    import torch

    t_ready = time.perf_counter()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        out = model(batch, *call_args)
        sync()
    result = {"side": side, "load_s": t_ready - _T_START, "forward_s": time.perf_counter() - t0,
              "plddt": float(out["plddt"].float().mean().item()), "device": device.type,
              "threads": torch.get_num_threads(), "child_maxrss_bytes": hwm_bytes(), **extra}
    if device.type == "cuda":
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def _child_ours(opts: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(opts.threads)
    from ...fastfold.model import InferenceOptions
    from ...fastfold.params import from_params

    device = torch_device(opts.device)
    model = from_params(opts.params, _config(opts.preset, opts.tiny)).eval().to(device)
    batch = {k: v.to(device) for k, v in torch.load(opts.features, weights_only=True).items()}
    return _forward("ours", model, batch, device, InferenceOptions(chunk_size=opts.chunk_size, residual="in_place"))


def _openfold_imports(paths: list[str]) -> tuple[str, dict]:
    sys.path[:0] = [p for p in paths if p]
    softmax = _install_softmax()
    import openfold
    from openfold.config import model_config
    from openfold.data.data_transforms import atom37_to_torsion_angles
    from openfold.model.model import AlphaFold
    from openfold.utils.import_weights import import_jax_weights_

    return softmax, {"model_config": model_config, "AlphaFold": AlphaFold, "import_jax_weights_": import_jax_weights_,
                     "atom37_to_torsion_angles": atom37_to_torsion_angles,
                     "where": os.path.dirname(os.path.abspath(openfold.__file__))}


def _openfold_features(batch: dict, atom37_to_torsion_angles) -> dict:
    """Our batch under OpenFold's names, plus the template torsion features its input pipeline would add."""
    if "template_all_atom_masks" in batch:
        batch["template_all_atom_mask"] = batch.pop("template_all_atom_masks")
    if "template_aatype" in batch:
        keys = ("template_aatype", "template_all_atom_positions", "template_all_atom_mask")
        t = atom37_to_torsion_angles("template_")({k: batch[k][..., 0] for k in keys})  # one recycling pass
        for k in ("template_torsion_angles_sin_cos", "template_alt_torsion_angles_sin_cos",
                  "template_torsion_angles_mask"):
            batch[k] = t[k][..., None]
    return batch


def _child_openfold(opts: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(opts.threads)
    softmax, of = _openfold_imports(opts.path)
    device = torch_device(opts.device)
    c = of["model_config"](opts.preset)
    c.globals.chunk_size = opts.chunk_size
    for stack in (c.model.template.template_pair_stack, c.model.extra_msa.extra_msa_stack, c.model.evoformer_stack):
        stack.tune_chunk_size = False
    model = of["AlphaFold"](c).eval()
    of["import_jax_weights_"](model, opts.params, version=opts.preset)
    batch = _openfold_features(torch.load(opts.features, weights_only=True), of["atom37_to_torsion_angles"])
    return _forward("openfold", model.to(device), {k: v.to(device) for k, v in batch.items()}, device,
                    softmax=softmax, openfold=of["where"])


def _child_probe(opts: argparse.Namespace) -> dict:
    """Import what the OpenFold child needs: {"ok": true, ...} or the module that is missing."""
    try:
        softmax, of = _openfold_imports(opts.path)
    except ImportError as exc:
        return {"ok": False, "missing": getattr(exc, "name", None), "error": str(exc)}
    return {"ok": True, "softmax": softmax, "openfold": of["where"]}


_CHILD_DEFAULTS = {"params": None, "features": None, "preset": "model_1_ptm", "chunk_size": 4, "threads": 2,
                   "device": "cpu", "path": [], "tiny": False}


def _side(spec: dict) -> dict:
    """One side ("ours", "openfold", "probe") of the comparison, its settings `spec` (`_CHILD_DEFAULTS`)."""
    opts = argparse.Namespace(**{**_CHILD_DEFAULTS, **spec})
    return {"ours": _child_ours, "openfold": _child_openfold, "probe": _child_probe}[opts.side](opts)


# ---- the parent -------------------------------------------------------------------------------------------


def run_one(side: str, *, timeout: float | None = None, use_cgroup: bool = True, **opts) -> dict:
    """One side's child run to its exit, measured as a whole process (`harness.run_side`): its JSON line plus
    `wall_s`, `peak_bytes` and `method`; a crash is a RuntimeError with the end of its stderr."""
    got = run_side(child(f"fold-model --openfold: the {side} side", __name__, {"side": side, **opts},
                         timeout=timeout, use_cgroup=use_cgroup))
    return {**got.result(), "wall_s": got.wall_s, "peak_bytes": got.peak_bytes, "method": got.method}


def compare(runs: list[dict], tolerance: float = PLDDT_TOLERANCE) -> list[dict]:
    """Per n_res: each side's medians (wall, forward, load, peak) and the ratios ours / OpenFold. `PlddtMismatch`
    when a run's mean pLDDT differs from one of the other side by `tolerance` or more, or a side has no run."""
    rows = []
    for n_res in sorted({r["n_res"] for r in runs}):
        side = {s: [r for r in runs if r["n_res"] == n_res and r["side"] == s] for s in ("ours", "openfold")}
        if not side["ours"] or not side["openfold"]:
            raise PlddtMismatch(f"n_res {n_res}: no {'ours' if not side['ours'] else 'openfold'} run to compare")
        diffs = [abs(a["plddt"] - b["plddt"]) for a in side["ours"] for b in side["openfold"]]
        diff = max(diffs) if all(d == d for d in diffs) else float("nan")  # max() would step over a NaN
        if not diff < tolerance:  # NaN fails too
            raise PlddtMismatch(
                f"n_res {n_res}: mean pLDDT ours {side['ours'][0]['plddt']:.4f} vs OpenFold "
                f"{side['openfold'][0]['plddt']:.4f} (|diff| {diff:.3g} >= {tolerance:g})")
        o, f = ({k: float(statistics.median([r[k] for r in side[s]]))
                 for k in ("wall_s", "forward_s", "load_s", "peak_bytes")} for s in ("ours", "openfold"))
        row = {"n_res": n_res, "runs": len(side["ours"])}
        for key, name in (("wall_s", "wall"), ("forward_s", "forward"), ("load_s", "load")):
            row.update({f"ours_{key}": o[key], f"openfold_{key}": f[key], f"{name}_ratio": o[key] / f[key]})
        rows.append({**row, "ours_peak_mib": o["peak_bytes"] / 2**20, "openfold_peak_mib": f["peak_bytes"] / 2**20,
                     "peak_ratio": o["peak_bytes"] / f["peak_bytes"], "plddt": side["ours"][0]["plddt"],
                     "plddt_diff": diff})
    return rows


def check_args(args: argparse.Namespace) -> None:
    """Refuse what this comparison cannot do, one line naming the flag (UsageError, exit 2)."""
    from ...fastfold.model.config import model_names

    folder = args.openfold
    if not os.path.isdir(folder):
        raise UsageError(f"--openfold {folder}: no such folder (give an OpenFold checkout or a folder holding "
                         "the openfold package)")
    if importlib.machinery.PathFinder.find_spec("openfold", [os.path.abspath(folder)]) is None:
        raise UsageError(f"--openfold {folder}: no openfold package in that folder (give the checkout's root, "
                         "the folder that holds openfold/)")
    for path in _pythonpath(args):
        if not os.path.isdir(path):
            raise UsageError(f"--openfold_pythonpath: {path}: no such folder")
    if args.chunk_size == "auto" or not str(args.chunk_size).isdigit() or int(args.chunk_size) <= 0:
        raise UsageError(f"--openfold: give --chunk_size as a positive int, got {args.chunk_size!r} (OpenFold's "
                         "chunk-size tuning is not our 'auto'; both sides run at the one size given)")
    if args.preset not in model_names():
        raise UsageError(f"--preset: {args.preset!r} is not a released monomer model ({', '.join(model_names())})")
    if args.threads <= 0:
        raise UsageError(f"--threads: must be positive, got {args.threads}")
    if args.multimer:
        raise UsageError("--openfold: compares the monomer model only; drop --multimer")
    if args.dtype != "float32":
        raise UsageError("--openfold: both models run in float32; drop --dtype")


def _pythonpath(args: argparse.Namespace) -> list[str]:
    return [p for p in (args.openfold_pythonpath or "").split(os.pathsep) if p]


def _probe(args: argparse.Namespace, paths: list[str]) -> dict:
    probe = run_side(child("fold-model --openfold: importing openfold", __name__, {"side": "probe", "path": paths},
                           measure=False)).result()
    if not probe["ok"]:
        missing = probe.get("missing") or ""
        if missing.split(".")[0] == "openfold":
            raise UsageError(f"--openfold {args.openfold}: openfold is not importable from there ({probe['error']})")
        raise UsageError(f"--openfold {args.openfold}: openfold needs {missing or probe['error']!r}, not importable; "
                         "add its folder with --openfold_pythonpath")
    return probe


def run(args: argparse.Namespace) -> int:
    check_args(args)
    chunk = int(args.chunk_size)
    paths = [os.path.abspath(args.openfold), *(os.path.abspath(p) for p in _pythonpath(args))]
    probe = _probe(args, paths)
    runs: list[dict] = []
    with contextlib.nullcontext(args.inputs_dir) if args.inputs_dir else tempfile.TemporaryDirectory(
            prefix="lowmem-fold-openfold-") as folder:
        for n_res in args.n_res:
            inputs = write_inputs(folder, preset=args.preset, n_res=n_res, n_seq=args.n_seq, n_extra=args.n_extra)
            for path in inputs.values():  # read once, so both sides find it in the page cache
                with open(path, "rb") as f:
                    while f.read(1 << 24):
                        pass
            for i in range(args.repeat):
                for side in ("ours", "openfold"):
                    got = run_one(side, **inputs, preset=args.preset, chunk_size=chunk, threads=args.threads,
                                  device=args.device, **({"path": paths} if side == "openfold" else {}))
                    runs.append({"n_res": n_res, "run": i + 1, **got})
                    print(f"  n_res {n_res} run {i + 1} {side}: wall {got['wall_s']:.1f} s, forward "
                          f"{got['forward_s']:.1f} s, peak {got['peak_bytes'] / 2**20:.0f} MiB, "
                          f"pLDDT {got['plddt']:.4f}", file=sys.stderr, flush=True)
    softmax = next((r["softmax"] for r in runs if "softmax" in r), probe["softmax"])
    method = runs[0]["method"] if runs else cgroup_method()
    payload = {"benchmark": "fold-model --openfold", "args": {k: v for k, v in vars(args).items()
                                                             if not k.startswith("_")},
               "openfold": probe["openfold"], "softmax": softmax, "method": method, "runs": runs}
    try:
        summary = compare(runs)
    except PlddtMismatch as exc:
        write_json(args.json, {**payload, "error": f"pLDDT mismatch: {exc}"})
        print(f"fold-model --openfold: MEAN pLDDT DISAGREES, the comparison is void: {exc}", file=sys.stderr)
        return 1
    cfg = _config(args.preset, False)
    blocks = f"{cfg.evoformer.num_blocks} Evoformer, {cfg.extra_msa.num_blocks} extra-MSA, " + (
        f"{cfg.template.num_blocks} template blocks, {N_TEMPL} templates" if cfg.template.enabled else "no templates")
    title = (f"whole process, ours vs OpenFold ({probe['openfold']}): {args.preset} at full size ({blocks}), "
             f"{args.n_seq} MSA rows, {args.n_extra} extra rows, chunk_size={chunk}, {args.threads} threads, "
             f"device {runs[0]['device']}; peak: {method}; OpenFold's softmax: {softmax}")
    publish(args, {**payload, "summary": summary}, [
        (title, [{**r, "peak_mib": r["peak_bytes"] / 2**20} for r in runs],
         ["n_res", "run", "side", "wall_s", "forward_s", "load_s", "peak_mib", "plddt"]),
        ("medians; ratios ours / OpenFold (wall and peak: the whole process)", summary,
         ["n_res", "runs", "ours_wall_s", "openfold_wall_s", "wall_ratio", "ours_forward_s", "openfold_forward_s",
          "forward_ratio", "ours_peak_mib", "openfold_peak_mib", "peak_ratio", "plddt_diff"])])
    return 0


if __name__ == "__main__":
    child_main(_side)
