"""Check a Ray address before joining it: one line within seconds instead of Ray's minutes of retries.

Every entry point that joins a Ray cluster (`suite fold --ray_address`, `suite diffusion finetune --ray_address`,
`recipes.ray.fit_on_ray`) calls `check_ray_address` first. It is at the bottom of the project (ray is imported
only inside the probe's child process), so `fastfold`, `recipes` and `suite` can all use it.

What is refused, each as one `InputError` line naming the flag:
- an address that is not `host:port`, `ray://host:port` or `auto` (and `auto` when no cluster is found);
- a port nobody answers on within `timeout` seconds;
- a `ray://` (Ray Client) address when grpcio (`ray[client]`, in the `ray` extra) is missing;
- a GCS address whose cluster uses Ray's token authentication while this side has no token or a wrong one
  (Ray >= 2.52 reads RAY_AUTH_MODE=token with RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token);
- a port that answers but is no Ray GCS (a dashboard, a Ray Client port given without `ray://`, ...).

Two more things every entry point shares:
- `init_local_ray`: the private Ray a command starts itself (no `--ray_address`) is local-only: its node address is
  127.0.0.1 and every server it starts (GCS, raylet, object manager, workers, agents) listens on loopback only.
  Ray's default on Linux registers the machine's network address and listens on every interface. A networked
  cluster is one the user starts with `ray start` and passes as `--ray_address`.
- `check_ray_resources`: a run that asks for more workers x CPUs/GPUs than the cluster has free is one line
  (what it asks, what is free, on how many nodes) instead of Ray Train waiting silently for resources.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import subprocess
import sys
import time
from typing import Any

from .errors import InputError, MissingExtraError

__all__ = ["AUTH_HINT", "LOOPBACK", "check_ray_address", "check_ray_auth", "check_ray_resources", "init_local_ray",
           "is_auth_failure", "is_loopback", "join_ray", "resolve_auto_address"]

logger = logging.getLogger(__name__)

AUTH_HINT = ("if the cluster was started with token authentication, set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN "
             "(or RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) to the cluster's token")
"""What a driver needs to join a cluster with Ray's token authentication."""

_PROBE = """
import sys
from ray._raylet import GcsClient
GcsClient(address=sys.argv[1])
"""
"""Connects to a Ray GCS as `ray.init` does first (fetching the cluster id): a cluster with token authentication
refuses it at once when this side has no token or a wrong one; a port that is no GCS fails within seconds."""


def is_auth_failure(text: str) -> bool:
    """Whether Ray's error text (an exception or a child's stderr) is a token-authentication refusal."""
    return any(s in text for s in ("AuthenticationError", "InvalidAuthToken", "UNAUTHENTICATED"))


def resolve_auto_address() -> tuple[str, str] | None:
    """The cluster `auto` means, as Ray resolves it (RAY_ADDRESS, then the cluster this machine started last),
    with where it was found; None when there is none."""
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    current = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray", "ray_current_cluster")
    try:
        with open(current) as f:
            address = f.read().strip()
    except OSError:
        return None
    return (address, current) if address else None


def check_ray_address(address: str | None, *, flag: str = "--ray_address", timeout: float = 3.0) -> str | None:
    """The Ray cluster to join, checked to answer within `timeout` seconds (and the GCS probe's own bound);
    "auto" is resolved the way Ray resolves it and the result is logged. None stays None."""
    if address is None:
        return None
    source = ""
    if address == "auto":
        found = resolve_auto_address()
        if found is None:
            raise InputError(f"{flag} auto: no running Ray cluster found (RAY_ADDRESS unset, no "
                             f"{os.path.join(os.environ.get('RAY_TMPDIR', '/tmp'), 'ray', 'ray_current_cluster')}); "
                             "start one with 'ray start --head' or give its address")
        address, source = found
    hostport = address.split("://", 1)[-1]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit() or ("://" in address and not address.startswith("ray://")):
        raise InputError(f"{flag} {address!r}: expected host:port, ray://host:port or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise InputError(f"{flag} {address}: no answer within {timeout:.0f} s ({exc.strerror or exc}); "
                         "is the Ray head running, and is this its GCS port (6379 by default)?") from None
    if address.startswith("ray://"):
        _check_client_extra(address, flag)
    else:
        check_ray_auth(address, flag=flag)
    if source:
        logger.warning("%s auto: joining the Ray cluster at %s (from %s)", flag, address, source)
    return address


def _check_client_extra(address: str, flag: str) -> None:
    try:
        import grpc  # noqa: F401  (what `ray[client]` adds to ray)
    except ImportError:
        err = MissingExtraError(f"{flag} {address}: a ray:// (Ray Client) address needs grpcio, which is not "
                                "installed: pip install 'lowmem-suite[ray]' (or 'ray[client]')")
        err.name = "grpc"
        raise err from None


def check_ray_auth(address: str, *, flag: str = "--ray_address", timeout: float = 15.0) -> None:
    """Refuse a GCS address that is no Ray GCS, or whose cluster needs a token this side lacks, in one line
    instead of Ray's retries and multi-line error. The probe runs in a child process (Ray's client logs and
    retries there)."""
    # Ray's client waits up to a minute for an endpoint that is not a GCS: a few seconds are enough here
    env = {**os.environ, "RAY_gcs_rpc_server_connect_timeout_s": "2", "RAY_gcs_rpc_server_reconnect_timeout_s": "3"}
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, address], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise InputError(f"{flag} {address}: no Ray cluster answered there within {timeout:.0f} s "
                         f"(a Ray GCS address, host:6379 by default, is expected; {AUTH_HINT})") from None
    if proc.returncode == 0:
        return
    text = proc.stderr + proc.stdout
    if is_auth_failure(text):
        raise InputError(f"{flag} {address}: the Ray cluster requires an authentication token and refused this "
                         "one (none set, or a wrong one): set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or "
                         "RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token) to the cluster's token")
    if "ModuleNotFoundError" in text and "ray" in text:
        raise MissingExtraError(f"{flag} {address}: this needs the optional package 'ray', which is not installed: "
                                "pip install 'lowmem-suite[ray]'")
    if "GCS" in text:
        raise InputError(f"{flag} {address}: this port answers, but not as a Ray cluster's GCS (host:6379 by "
                         "default; a Ray Client port takes ray://host:10001)")
    last = next((line for line in reversed(text.strip().splitlines()) if line.strip()), "no message")
    raise InputError(f"{flag} {address}: could not join the Ray cluster there ({last.strip()[:200]})")


LOOPBACK = "127.0.0.1"
"""The address of every Ray node the suite starts itself."""

# Ray's switch between "a node of a cluster" (the machine's network address, servers on every interface) and
# "a single machine" (127.0.0.1, servers on loopback only; its default on macOS and Windows). `ray.init` turns a
# node address of 127.0.0.1 into the network address unless it is off; Ray reads it from the environment when
# imported (the driver's `ray_constants`), and the processes `ray.init` spawns inherit it.
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _single_machine():
    from ray._private import ray_constants

    saved_env, saved = os.environ.get(_SINGLE_MACHINE_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_SINGLE_MACHINE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(_SINGLE_MACHINE_ENV, None)
        else:
            os.environ[_SINGLE_MACHINE_ENV] = saved_env


def init_local_ray(num_cpus: int | None = None, **kwargs: Any) -> Any:
    """Start a private Ray on this machine that only this machine can reach (node address 127.0.0.1, every server
    on loopback, no dashboard unless asked) and connect to it; returns `ray.init`'s context. `kwargs` go to
    `ray.init` (`num_gpus`, `log_to_driver`, `configure_logging`, ...). Raises RuntimeError (after shutting it
    down) if Ray registered another address anyway."""
    import ray

    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("log_to_driver", False)
    with _single_machine():
        ctx = ray.init(num_cpus=num_cpus, _node_ip_address=LOOPBACK, **kwargs)
    node = ctx.address_info.get("node_ip_address")
    if node != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"the local Ray registered node address {node}, not {LOOPBACK}: this Ray version does not "
                           f"honour {_SINGLE_MACHINE_ENV}=0; start a cluster with 'ray start --head "
                           f"--node-ip-address {LOOPBACK}' and pass --ray_address")
    return ctx


def is_loopback(address: str) -> bool:
    """Whether a Ray address (host:port, ray://host:port) is on this machine's loopback."""
    host = address.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def join_ray(address: str, **kwargs: Any) -> Any:
    """`ray.init(address=address, **kwargs)`; a cluster on 127.0.0.1 (one `init_local_ray` or `ray start
    --node-ip-address 127.0.0.1` started) is joined as a local-only node too: Ray would otherwise turn 127.0.0.1
    into this machine's network address, where such a cluster does not listen. Check the address first
    (`check_ray_address`)."""
    import ray

    if not is_loopback(address):
        return ray.init(address=address, **kwargs)
    with _single_machine():
        return ray.init(address=address, **kwargs)


def _fits(nodes: list[dict[str, float]], workers: int, need: dict[str, float]) -> int:
    """How many of `workers` bundles of `need` fit on the nodes' free resources (a bundle stays on one node)."""
    placed = 0
    for free in nodes:
        placed += min(math.floor(free.get(k, 0.0) / v + 1e-9) for k, v in need.items() if v > 0)
    return min(placed, workers)


def _free_per_node() -> list[dict[str, float]]:
    """Free CPUs/GPUs of each alive node (Ray's GCS, no dashboard needed)."""
    from ray._private.state import available_resources_per_node

    return [{k: float(v) for k, v in res.items() if k in ("CPU", "GPU")}
            for res in available_resources_per_node().values()]


def _describe(nodes: list[dict[str, float]]) -> str:
    cpu = sum(n.get("CPU", 0.0) for n in nodes)
    gpu = sum(n.get("GPU", 0.0) for n in nodes)
    per = ", ".join(f"{n.get('CPU', 0.0):g}" for n in nodes)
    return (f"{cpu:g} CPU{'s' if cpu != 1 else ''}{f' and {gpu:g} GPUs' if gpu else ''} free on "
            f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} (CPUs per node: {per or 'none'})")


def check_ray_resources(workers: int, *, cpus: float = 1.0, gpus: float = 0.0, what: str = "this run",
                        flag: str = "--num_workers", wait_s: float = 0.0, poll_s: float = 1.0) -> None:
    """Refuse, in one `InputError` line, a run whose `workers` x (`cpus`, `gpus`) do not fit on the connected Ray
    cluster's free resources (each worker's share on one node, as Ray places it); Ray itself would wait for
    them silently. With `wait_s` > 0, waits up to that long (a warning says for what) for them to free up or
    for nodes to join, then refuses. Call after `ray.init`."""
    need = {"CPU": float(cpus), "GPU": float(gpus)}
    if workers < 1 or not any(v > 0 for v in need.values()):
        return
    deadline = time.monotonic() + max(wait_s, 0.0)
    warned = False
    while True:
        nodes = _free_per_node()
        if _fits(nodes, workers, need) >= workers:
            return
        asks = f"{workers} worker{'s' if workers != 1 else ''} x {cpus:g} CPU" + (f" + {gpus:g} GPU" if gpus else "")
        if time.monotonic() >= deadline:
            raise InputError(f"{flag} {workers}: {what} asks for {asks}, the Ray cluster has {_describe(nodes)}; "
                             f"lower {flag}, add nodes, or free the cluster")
        if not warned:
            logger.warning("%s %d: waiting up to %.0f s for the Ray cluster to free %s (now: %s)", flag, workers,
                           wait_s, asks, _describe(nodes))
            warned = True
        time.sleep(poll_s)
