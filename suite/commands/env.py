"""`suite env`: what a user needs to diagnose a set-up."""

from __future__ import annotations

import argparse
import importlib
import json
import platform

from ...core_parallel.groups import BACKENDS

__all__ = ["add_arguments", "collect", "run"]

PACKAGES = ("torch", "triton", "diffusers", "transformers", "peft", "lightning", "ray", "openmm", "pdbfixer",
            "safetensors", "numpy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - any failure means "not installed" for this report
        try:
            mod = importlib.import_module(name)
            return str(getattr(mod, "__version__", "installed"))
        except Exception:  # noqa: BLE001
            return "not installed"


def _devices() -> list[dict]:
    import torch

    out = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            out.append({"index": i, "name": props.name, "total_gib": round(total / 2**30, 2),
                        "free_gib": round(free / 2**30, 2), "capability": f"{props.major}.{props.minor}"})
    return out


def _kernel_backends() -> dict:
    try:
        from ... import kernels
    except Exception as exc:  # noqa: BLE001
        return {"error": f"kernels failed to import: {exc}"}
    report = getattr(kernels, "backend_report", None)
    if report is None:
        return {"error": "kernels.backend_report() not available"}
    return report()


def collect() -> dict:
    """The environment report as a dictionary."""
    import psutil
    import torch
    import torch.distributed as dist

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": psutil.cpu_count(logical=True),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "packages": {name: _version(name) for name in PACKAGES},
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "cuda_devices": _devices(),
        "distributed": {
            "available": dist.is_available(),
            **{name: dist.is_available() and getattr(dist, f"is_{name}_available")() for name in BACKENDS},
        },
        "kernel_backends": _kernel_backends(),
    }


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"python        {info['python']}  ({info['platform']})")
    print(f"cpus          {info['cpu_count']}   memory {info['memory_gib']} GiB")
    print("packages:")
    for name, ver in info["packages"].items():
        print(f"  {name:<13} {ver}")
    print(f"cuda          {'available' if info['cuda_available'] else 'not available'}"
          f"  (torch built with CUDA {info['cuda_version']})")
    for d in info["cuda_devices"]:
        print(f"  cuda:{d['index']} {d['name']}  {d['total_gib']} GiB total, {d['free_gib']} GiB free,"
              f" sm_{d['capability']}")
    backends = [k for k in BACKENDS if info["distributed"][k]]
    print(f"distributed   {', '.join(backends) if backends else 'none'}")
    print("kernel backends (this machine, default device):")
    for op, backend in info["kernel_backends"].items():
        print(f"  {op:<13} {backend}")
    return 0
