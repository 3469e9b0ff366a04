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
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

from .errors import InputError, MissingExtraError

__all__ = ["AUTH_HINT", "check_ray_address", "check_ray_auth", "is_auth_failure", "resolve_auto_address"]

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
