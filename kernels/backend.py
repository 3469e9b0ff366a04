"""Backend choice for the kernels: `auto`, `triton` or `torch`.

The choice comes from `kernels.use_backend(name)` (a context manager, innermost wins), else from the process's
default, `kernels.set_default_backend(name)` (`auto` until set). The kernels read no environment variable for
it: the user override `SUITE_KERNEL_BACKEND=auto|triton|torch` (`ENV_VAR`) is read once, by the `suite` command
line at its start (`suite.cli.main`), and handed to `set_default_backend`. A program that calls the kernels
itself and wants the same override reads it once at its own start:

    kernels.set_default_backend(os.environ.get(kernels.ENV_VAR), source=kernels.ENV_VAR)

A spawned process starts at `auto`: a launcher whose ranks should share the default hands them
`current_backend()` and each rank's entry point sets it.

- `auto`: the Triton kernels for CUDA tensors when Triton works and the dtype/shape is supported, otherwise
  the fast PyTorch path (`"cpu"` below: chunked attention, fused torch ops; it runs on any device).
- `triton`: the Triton kernels. On CPU tensors they run only under `TRITON_INTERPRET=1` (set before
  `kernels` is imported, because Triton reads it when a kernel is defined); that is how the tests run them.
  `TRITON_INTERPRET` is Triton's own variable, which the kernels must agree with: it is read here, once, when
  this module is imported (`_INTERPRETED`), the one environment variable the kernels read.
- `torch`: the plain PyTorch reference (`*_reference` in each kernel module).

Every fallback is logged once (per op and reason), never silent.

Under `torch.compile` the choice is made when Dynamo traces the call (the kernels themselves are
`torch.library` custom ops in the namespace `OP_NAMESPACE`, opaque to the compiler); a later change of
backend needs a fresh compile (`torch.compiler.reset()`).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator

import torch

__all__ = ["BACKENDS", "ENV_VAR", "OP_NAMESPACE", "Path", "current_backend", "default_backend", "direct_call",
           "op_name", "select_path", "set_default_backend", "triton_installed", "triton_unavailable_reason",
           "use_backend"]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "SUITE_KERNEL_BACKEND"
"""The user override of the default backend, read by the command line (never by the kernels)."""
#: The implementation an op call ends up in: the Triton kernel, the fast PyTorch path, or the reference.
Path = str

#: torch.library namespace of the kernels' custom ops (`torch.ops.<OP_NAMESPACE>.attention_fwd`, ...): the
#: top-level package the kernels are installed under, so the package name is written in one place only.
OP_NAMESPACE = __name__.partition(".")[0]

# Triton decides at decoration time whether a kernel is interpreted, so the flag is read once at import.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("suite_kernel_backend", default=None)
_default: tuple[str, str] = ("auto", "set_default_backend")  # (name, where it came from, for the error)
_logged: set[str] = set()


def _check(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source}: unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


def set_default_backend(name: str | None, *, source: str = "set_default_backend") -> None:
    """Make `name` (`auto`, `triton` or `torch`; None or blank: `auto`; any case) the backend of kernel calls
    outside `use_backend`, in this process and every thread of it. `source` says where the value came from (e.g.
    `ENV_VAR`). An unknown name raises `ValueError` naming `source` when a kernel call needs the default (and
    `backend_report` shows it), not here: an override that no call reads stops nothing."""
    global _default
    _default = ((name or "").strip().lower() or "auto", source)


def default_backend() -> tuple[str, str]:
    """The default as set (`name`, `source`), unchecked: what a launcher hands its spawned ranks, which pass it
    back to `set_default_backend(name, source=source)` so that every rank runs the kernels its parent was asked for."""
    return _default


def current_backend() -> str:
    """The backend requested now: the innermost `use_backend`, else the default (`set_default_backend`)."""
    name = _override.get()
    if name is not None:
        return name
    return _check(*_default)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run the enclosed kernel calls with backend `name` (`auto`, `triton` or `torch`)."""
    token = _override.set(_check(name, "use_backend"))
    try:
        yield
    finally:
        _override.reset(token)


# found, not imported: the kernels import Triton on their first Triton call
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    """Whether a `triton` package is installed (looked up once at import, without importing it)."""
    return _TRITON_FOUND


def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no Triton"
        return f"triton failed to import: {exc}"
    return None


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton kernels cannot run on `device`, or None when they can."""
    device = torch.device(device)
    if device.type == "cuda":
        reason = None if torch.cuda.is_available() else "CUDA is not available"
    elif device.type == "cpu":
        reason = None if _INTERPRETED else "CPU tensors need TRITON_INTERPRET=1 set before kernels is imported"
    else:
        reason = f"no Triton kernels for device type {device.type!r}"
    # imported only where it would run: on CPU without the interpreter the PyTorch paths never import it
    return reason or _triton_import_error()


def log_once(message: str) -> None:
    """Log a fallback warning the first time it happens in this process."""
    if message not in _logged:
        _logged.add(message)
        logger.warning(message)


def direct_call(*tensors: torch.Tensor | None) -> bool:
    """Whether a kernel may run its implementation itself instead of through its custom op: no gradient is
    wanted and torch.compile is not tracing, so the op's dispatch would change nothing. Eager inference then
    never calls a custom op, whose first call imports Dynamo (~160 MiB resident, ~1 s) in processes that
    never compile."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def op_name(name: str) -> str:
    """The qualified custom-op name `"<OP_NAMESPACE>::<name>"` for `torch.library.custom_op`."""
    return f"{OP_NAMESPACE}::{name}"


def _assume_constant_result(fn):
    """`torch.compiler.assume_constant_result(fn)` without importing Dynamo when our package is imported: that
    import alone costs ~160 MiB of resident memory and ~1 s in every process, compiled or not. The mark is the
    attribute `torch._dynamo.assume_constant_result` sets (tests/kernels/test_backend.py checks it still is;
    tests/kernels/test_custom_ops.py that torch.compile still takes the kernels whole)."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


# Dynamo cannot read a ContextVar; it calls this once while tracing and bakes the answer into the graph.
@_assume_constant_result
def select_path(op: str, device: torch.device, unsupported: str | None) -> Path:
    """Pick `"triton"`, `"cpu"` (the fast PyTorch path) or `"torch"` (the reference) for one call of `op`.

    `unsupported` is the op's reason why the Triton kernel cannot take these inputs (dtype, size), or None.
    """
    requested = current_backend()
    if requested == "torch":
        return "torch"
    reason = triton_unavailable_reason(device) or unsupported
    if requested == "triton":
        if reason is None:
            return "triton"
        log_once(f"kernels.{op}: backend 'triton' requested but {reason}; using the PyTorch path")
        return "cpu"
    if device.type == "cuda":
        if reason is None:
            return "triton"
        log_once(f"kernels.{op}: Triton not used on CUDA ({reason}); using the PyTorch path")
    return "cpu"
