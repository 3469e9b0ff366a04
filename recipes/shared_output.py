"""Multi-node runs need their output folder on a filesystem every node sees at the same path: checkpoints are
written by every rank into one folder, and resume reads them all back. A folder that is only local to each node
otherwise fails at the first checkpoint (a rank's shard write: "No such file or directory"), after all the work
before it. `check_shared_output` finds it up front: every rank writes a probe file into the folder, and after a
collective rank 0 checks that it sees them all; otherwise every rank raises the same `InputError` line naming the
ranks (and their hosts) whose files rank 0 cannot see. `SharedOutputCheck` runs it when a Trainer starts (its
`setup` hook runs once the process group exists, before the strategy sets up the model).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ..utils.errors import InputError

__all__ = ["SharedOutputCheck", "check_shared_output"]

logger = logging.getLogger(__name__)

_PREFIX = ".lowmem-probe-"
_SETTLE_S = 2.0
"""How long rank 0 keeps looking for a probe it does not see yet (a network filesystem's attribute cache)."""


def _write_probe(path: Path, host: str) -> str | None:
    """Write this rank's probe; the error text when it cannot."""
    try:
        with open(path, "w") as f:
            f.write(host)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _missing(folder: Path, name: str, world: int) -> list[int]:
    deadline = time.monotonic() + _SETTLE_S
    while True:
        missing = [r for r in range(world) if not (folder / f"{name}{r}").is_file()]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.1)


def _message(folder: Path, flag: str, missing: list[int], hosts: list[tuple[str, str | None]]) -> str:
    unwritable = [f"rank {r} ({hosts[r][0]}): {hosts[r][1]}" for r in missing if hosts[r][1]]
    unseen = [f"rank {r} ({hosts[r][0]})" for r in missing if not hosts[r][1]]
    parts = []
    if unwritable:
        parts.append(f"cannot be written by {', '.join(unwritable)}")
    if unseen:
        parts.append(f"is not the same folder on every node: rank 0 ({hosts[0][0]}) does not see the files "
                     f"{', '.join(unseen)} wrote there")
    return (f"{flag} {folder}: {'; '.join(parts)}. A run on several nodes needs {flag} on a filesystem every node "
            "mounts at the same path (NFS, Lustre, a cloud file share)")


def check_shared_output(folder: str | os.PathLike, *, flag: str = "--output_dir") -> None:
    """Every rank of the default process group must see `folder` as one folder: each writes a probe, rank 0
    checks it sees all of them; otherwise every rank raises the same one-line `InputError` naming the ranks and
    hosts. Collective; a no-op without a process group or on one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    folder = Path(folder).absolute()
    box: list[Any] = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    name = f"{_PREFIX}{box[0]}-rank"
    host = socket.gethostname()
    probe = folder / f"{name}{rank}"
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, (host, _write_probe(probe, host)))  # also: every probe is written
    box = [_missing(folder, name, world) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    probe.unlink(missing_ok=True)
    if box[0]:
        raise InputError(_message(folder, flag, box[0], hosts))
    logger.debug("%s %s: seen by all %d ranks", flag, folder, world)


class SharedOutputCheck(Callback):
    """`check_shared_output(folder)` when a Trainer sets up (every rank, before the model is set up)."""

    def __init__(self, folder: str | os.PathLike, flag: str = "--output_dir") -> None:
        self.folder, self.flag = folder, flag

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            check_shared_output(self.folder, flag=self.flag)
