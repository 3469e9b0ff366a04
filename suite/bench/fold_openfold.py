"""`suite bench fold-model --openfold DIR` (issue 18): our AlphaFold against OpenFold's, whole process, side by side."""

from __future__ import annotations

import argparse
import gc
import importlib.machinery
import json
import os
import statistics
import sys
import tempfile
import time
import types

from ..errors import UsageError
from .harness import Side, emit, publish, run_side, safe_env, torch_device, write_json, write_text
from .memory import cgroup_method, hwm_bytes

__all__ = ["PLDDT_TOLERANCE", "PlddtMismatch", "check_args", "compare", "run", "run_one", "standin_softmax_",
           "write_inputs"]

PLDDT_TOLERANCE = 1e-3
N_TEMPL = 2
_T_START = time.perf_counter()  # a child's clock starts when this module is first imported (`python -m`)


class PlddtMismatch(ValueError):
    """The two sides' mean pLDDTs differ: they did not compute the same thing, so no ratio means anything."""


# ---- the stand-in for OpenFold's CUDA softmax ---------------------------------------------------------------


def standin_softmax_(a, rows: int, cols: int) -> None:
    """Softmax over the last dimension of `a`, in place: the signature of OpenFold's CUDA extension
    `attn_core_inplace_cuda.forward_(a, rows, cols)`, which treats `a` as `rows` x `cols` contiguous values.

    Same arithmetic as that kernel: subtract the row's maximum, exponentiate, divide by the row's sum, with no
    special case. So a -inf entry in a row with a finite maximum becomes 0 (as in `torch.softmax`), and a row
    that is all -inf becomes NaN (0/0, also as in `torch.softmax`); OpenFold's own masks are a finite -1e5 or
    -1e9, so its rows never are. No full-size temporary: only the per-row maximum and sum are allocated."""
    if rows * cols != a.numel():
        raise ValueError(f"attn_core_inplace_cuda stand-in: {rows} x {cols} != {a.numel()} elements")
    x = a.view(rows, cols)  # the same storage (raises where `a` is not laid out as rows x cols)
    x.sub_(x.amax(dim=-1, keepdim=True)).exp_()
    x.div_(x.sum(dim=-1, keepdim=True))


def _install_softmax() -> str:
    """Make `import attn_core_inplace_cuda` work: the real extension where it imports, else the stand-in.
    Returns which one."""
    try:
        import attn_core_inplace_cuda  # noqa: F401
        return "attn_core_inplace_cuda (OpenFold's CUDA extension)"
    except ImportError as exc:
        reason = "not installed" if getattr(exc, "name", None) == "attn_core_inplace_cuda" else f"{exc}"
    module = types.ModuleType("attn_core_inplace_cuda")
    module.forward_ = standin_softmax_
    module.__doc__ = "suite bench fold-model's CPU stand-in for OpenFold's in-place softmax (forward only)"
    sys.modules["attn_core_inplace_cuda"] = module
    return f"suite's stand-in softmax (attn_core_inplace_cuda {reason})"


# ---- inputs -----------------------------------------------------------------------------------------------


def _tiny_config():
    from ...fastfold.model import config

    return config.tiny()


def write_inputs(folder: str, *, preset: str, n_res: int, n_seq: int, n_extra: int, tiny: bool = False,
                 seed: int = 0) -> dict[str, str]:
    """Random parameters (AlphaFold's `.npz` layout) and a feature batch (`torch.save`) for one n_res in `folder`;
    reused when a previous call wrote the same settings there. Returns {"params": path, "features": path}."""
    import torch

    from ...fastfold.model import AlphaFold, config
    from ...fastfold.model.testing import random_batch, randomize_parameters
    from ...fastfold.params import save_params

    os.makedirs(folder, exist_ok=True)
    name = "tiny" if tiny else preset
    params = os.path.join(folder, f"params_{name}.npz")
    features = os.path.join(folder, f"features_{name}_r{n_res}_s{n_seq}_e{n_extra}_t{N_TEMPL}_seed{seed}.pt")
    meta_path = params + ".json"
    meta = {"preset": preset, "tiny": tiny, "seed": seed}
    cfg = _tiny_config() if tiny else config.preset(preset)
    try:
        with open(meta_path) as f:
            reuse = json.load(f) == meta and os.path.isfile(params)
    except (OSError, ValueError):
        reuse = False
    if not reuse:
        model = randomize_parameters(AlphaFold(cfg), seed=seed)
        save_params(model, params)
        del model
        gc.collect()
        write_text(meta_path, json.dumps(meta))
    if not os.path.isfile(features):
        batch = random_batch(cfg, n_res=n_res, n_seq=n_seq, n_extra=n_extra, n_templ=N_TEMPL, n_recycle=0, seed=seed)
        tmp = features + ".tmp"
        torch.save(batch, tmp)
        os.replace(tmp, features)
    return {"params": params, "features": features}


def _read_through(paths) -> None:
    """Read each file once, so both sides find it in the page cache (the first reader would pay otherwise)."""
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


# ---- the children -----------------------------------------------------------------------------------------


def _finish(side: str, t_ready: float, forward_s: float, plddt, device, extra: dict) -> int:
    import torch

    # VmHWM, this process's own: ru_maxrss would carry the bench's peak across fork and exec
    result = {"side": side, "load_s": t_ready - _T_START, "forward_s": forward_s,
              "plddt": float(plddt.float().mean().item()), "device": device.type, "threads": torch.get_num_threads(),
              "child_maxrss_bytes": hwm_bytes(), **extra}
    if device.type == "cuda":
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    emit(result)
    return 0


def _forward(model, batch, device, *call_args):
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        out = model(batch, *call_args)
        sync()
    return out, time.perf_counter() - t0


def _child_ours(opts: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(opts.threads)
    from ...fastfold.model import InferenceOptions
    from ...fastfold.params import from_params

    device = torch_device(opts.device)
    model = from_params(opts.params, _tiny_config() if opts.tiny else opts.preset).eval().to(device)
    batch = {k: v.to(device) for k, v in torch.load(opts.features, weights_only=True).items()}
    t_ready = time.perf_counter()
    out, seconds = _forward(model, batch, device, InferenceOptions(chunk_size=opts.chunk_size, residual="in_place"))
    return _finish("ours", t_ready, seconds, out["plddt"], device, {})


def _openfold_imports(paths: list[str]) -> tuple[str, dict]:
    sys.path[:0] = [p for p in paths if p]
    softmax = _install_softmax()
    import openfold
    from openfold.config import model_config
    from openfold.data.data_transforms import atom37_to_torsion_angles
    from openfold.model.model import AlphaFold
    from openfold.utils.import_weights import import_jax_weights_

    api = {"model_config": model_config, "AlphaFold": AlphaFold, "import_jax_weights_": import_jax_weights_,
           "atom37_to_torsion_angles": atom37_to_torsion_angles,
           "where": os.path.dirname(os.path.abspath(openfold.__file__))}
    return softmax, api


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


def _child_openfold(opts: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(opts.threads)
    softmax, of = _openfold_imports(opts.path)
    device = torch_device(opts.device)
    c = of["model_config"](opts.preset)
    c.globals.chunk_size = opts.chunk_size
    c.model.template.template_pair_stack.tune_chunk_size = False
    c.model.extra_msa.extra_msa_stack.tune_chunk_size = False
    c.model.evoformer_stack.tune_chunk_size = False
    model = of["AlphaFold"](c).eval()
    of["import_jax_weights_"](model, opts.params, version=opts.preset)
    model = model.to(device)
    batch = _openfold_features(torch.load(opts.features, weights_only=True), of["atom37_to_torsion_angles"])
    batch = {k: v.to(device) for k, v in batch.items()}
    t_ready = time.perf_counter()
    out, seconds = _forward(model, batch, device)
    return _finish("openfold", t_ready, seconds, out["plddt"], device, {"softmax": softmax, "openfold": of["where"]})


def _child_probe(opts: argparse.Namespace) -> int:
    """Import what the OpenFold child needs; one JSON line: {"ok": true, ...} or the module that is missing."""
    try:
        softmax, of = _openfold_imports(opts.path)
    except ImportError as exc:
        emit({"ok": False, "missing": getattr(exc, "name", None), "error": str(exc)})
        return 0
    emit({"ok": True, "softmax": softmax, "openfold": of["where"]})
    return 0


_CHILD_DEFAULTS = {"params": None, "features": None, "preset": "model_1_ptm", "chunk_size": 4, "threads": 2,
                   "device": "cpu", "path": [], "tiny": False}
"""A child's settings (`path`: folders put first on sys.path on OpenFold's side; `tiny`: ours on `config.tiny()`)."""


def child_main(argv: list[str] | None = None) -> int:
    """`python -m lowmem.suite.bench.fold_openfold JSON`: one side ("ours", "openfold", "probe") of the comparison."""
    spec = json.loads((argv or sys.argv[1:])[0])
    opts = argparse.Namespace(**{**_CHILD_DEFAULTS, **spec})
    return {"ours": _child_ours, "openfold": _child_openfold, "probe": _child_probe}[opts.side](opts)


# ---- the parent -------------------------------------------------------------------------------------------


def _child_argv(side: str, **opts) -> list[str]:
    return [sys.executable, "-m", __name__, json.dumps({"side": side, **opts})]


def run_one(side: str, *, timeout: float | None = None, use_cgroup: bool = True, **opts) -> dict:
    """Run one side's child to its exit, measured as a whole process (`harness.run_side`); its JSON line plus
    `wall_s`, `peak_bytes` and `method`. A crash is a RuntimeError with the end of its stderr."""
    got = run_side(Side(f"fold-model --openfold: the {side} side", _child_argv(side, **opts), timeout=timeout,
                        env=safe_env(), use_cgroup=use_cgroup))
    return {**got.result(), "wall_s": got.wall_s, "peak_bytes": got.peak_bytes, "method": got.method}


def compare(runs: list[dict], tolerance: float = PLDDT_TOLERANCE) -> list[dict]:
    """Per n_res: the medians of each side's runs and the ratios ours / OpenFold (whole-process wall time,
    forward time, load time, whole-process peak). `runs` are the children's results with `n_res`, `side`
    ("ours" / "openfold"), `wall_s`, `forward_s`, `load_s`, `peak_bytes`, `plddt`. Raises `PlddtMismatch` when
    any run's mean pLDDT differs from any run of the other side by `tolerance` or more, or a side has no run."""
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
        med = {s: {k: float(statistics.median([r[k] for r in rs])) for k in ("wall_s", "forward_s", "load_s",
                                                                           "peak_bytes")}
               for s, rs in side.items()}
        o, f = med["ours"], med["openfold"]
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
    probe = run_side(Side("fold-model --openfold: importing openfold", _child_argv("probe", path=paths),
                          env=safe_env(), measure=False)).result()
    if not probe["ok"]:
        missing = probe.get("missing") or ""
        if missing.split(".")[0] == "openfold":
            raise UsageError(f"--openfold {args.openfold}: openfold is not importable from there "
                             f"({probe['error']})")
        raise UsageError(f"--openfold {args.openfold}: openfold needs {missing or probe['error']!r}, not importable; "
                         "add its folder with --openfold_pythonpath")
    return probe


def _blocks(args: argparse.Namespace) -> str:
    from ...fastfold.model import config

    cfg = config.preset(args.preset)
    templates = "no templates"
    if cfg.template.enabled:
        templates = f"{cfg.template.num_blocks} template blocks, {N_TEMPL} templates"
    return f"{cfg.evoformer.num_blocks} Evoformer, {cfg.extra_msa.num_blocks} extra-MSA, {templates}"


def run(args: argparse.Namespace) -> int:
    check_args(args)
    chunk = int(args.chunk_size)
    paths = [os.path.abspath(args.openfold), *(os.path.abspath(p) for p in _pythonpath(args))]
    probe = _probe(args, paths)
    tmp = None if args.inputs_dir else tempfile.TemporaryDirectory(prefix="lowmem-fold-openfold-")
    folder = args.inputs_dir or tmp.name
    runs: list[dict] = []
    try:
        for n_res in args.n_res:
            inputs = write_inputs(folder, preset=args.preset, n_res=n_res, n_seq=args.n_seq, n_extra=args.n_extra)
            _read_through(inputs.values())
            common = dict(params=inputs["params"], features=inputs["features"], preset=args.preset,
                          chunk_size=chunk, threads=args.threads, device=args.device)
            for i in range(args.repeat):
                for side in ("ours", "openfold"):
                    extra = {"path": paths} if side == "openfold" else {}
                    got = run_one(side, **common, **extra)
                    runs.append({"n_res": n_res, "run": i + 1, **got})
                    print(f"  n_res {n_res} run {i + 1} {side}: wall {got['wall_s']:.1f} s, forward "
                          f"{got['forward_s']:.1f} s, peak {got['peak_bytes'] / 2**20:.0f} MiB, "
                          f"pLDDT {got['plddt']:.4f}", file=sys.stderr, flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
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
    title = (f"whole process, ours vs OpenFold ({probe['openfold']}): {args.preset} at full size ({_blocks(args)}), "
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
    sys.exit(child_main())
