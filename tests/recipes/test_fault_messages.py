"""Issue 43: the sharded strategies' fault message says a rank exited only on evidence (its process gone, its
connection closed); a rank alive but elsewhere is named as alive, with where each rank is."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch.distributed as dist

from lowmem.core_parallel import run_on_ranks
from lowmem.core_parallel.peers import PeerLostError
from lowmem.recipes.faults import peer_failure_message

HINT = "Last complete checkpoint: none saved in this run."


def _message(exc: BaseException) -> str:
    return peer_failure_message(exc, rank=0, world=2, timeout_s=1800, hint=HINT)


def _claims_death(message: str) -> bool:
    head = message.split(" Cause: ")[0].lower().replace("no process died", "")
    return bool(re.search(r"died|dead|exited|gone|connection closed", head))


def test_an_alive_rank_is_named_with_where_it_is_not_as_dead():
    where = "rank 0 in all_gather (chunk 3, step 2) for 1800.0s; rank 1 in barrier(after_fit) (step 2) for 1799.9s"
    late = PeerLostError(f"rank 0: all_gather (chunk 3, step 2) timed out after 1800s. Where each rank is: {where}",
                         [1], dead=False, where=where, alive=[1])
    wrapped = RuntimeError("step failed")
    wrapped.__cause__ = late
    for exc in (late, wrapped):
        message = _message(exc)
        assert not _claims_death(message), message
        assert message.startswith("rank 0: rank 1 did not answer within the collective timeout of 1800s"), message
        assert "alive" in message and "rank 1 in barrier(after_fit)" in message.split(" Cause: ")[0], message


def test_a_late_rank_not_seen_alive_is_not_called_alive():
    """A timeout whose rank could not be looked up (another host) claims neither a death nor a live process."""
    late = PeerLostError("host collectives: ranks [1] did not arrive within 1800s", [1], dead=False, where="", alive=[])
    message = _message(late)
    assert not _claims_death(message), message
    assert "alive but elsewhere" not in message and "no process died" not in message, message
    assert "whether rank(s) [1] are alive cannot be seen from this rank" in message, message


def test_a_rank_whose_process_exited_is_named_as_exited():
    gone = PeerLostError("rank 0: rank 1 (pid 42) exited; ...", [1], dead=True)
    message = _message(gone)
    assert message.startswith("rank 0: lost contact with rank 1: its process exited; training stopped."), message


@pytest.mark.parametrize("text", ["Connection closed by peer [127.0.0.1]:1234", "Connection reset by peer"])
def test_a_closed_connection_is_named_as_closed(text):
    message = _message(dist.DistBackendError(text))
    assert "lost contact with rank 1: its connection closed" in message, message


def test_a_bare_timeout_does_not_claim_a_death():
    message = _message(dist.DistBackendError("Timed out waiting 1800000ms for recv operation to complete"))
    assert not _claims_death(message), message
    assert "rank 1 did not answer within the collective timeout of 1800s" in message, message
    assert "whether it is alive cannot be seen" in message and "LOWMEM_TRACE_COLLECTIVES=1" in message, message


def _rank0_only_read(rank: int, world: int, root: str) -> str | None:
    from lightning.pytorch.callbacks import Callback

    from lowmem.recipes import GeminiStrategy
    from tests.recipes.test_strategies import make_module, make_trainer

    class Rank0Reads(Callback):  # the habit: rank 0 alone reads the weights, then every rank meets
        def on_train_epoch_end(self, trainer, module) -> None:
            if trainer.is_global_zero:
                module.state_dict()  # gathers Gemini's chunks: rank 1 never joins
            trainer.strategy.barrier("after_read")

    # peer_reads=False: gathers are collectives, as on accelerators and across hosts (on CPU ranks of one host
    # the read is served: tests/recipes/test_rank0_only.py)
    strategy = GeminiStrategy(collective_timeout_s=3, peer_reads=False)
    trainer = make_trainer(strategy, world, Path(root), 1, callbacks=[Rank0Reads()])
    try:
        trainer.fit(make_module())
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return str(exc)
    return None


@pytest.mark.distributed
def test_gemini_rank0_only_read_names_both_ranks_alive_where_they_are(tmp_path):
    results = run_on_ranks(_rank0_only_read, 2, str(tmp_path), backend="none", timeout=150,
                           env={"OMP_NUM_THREADS": "1"})
    for rank, message in enumerate(results):
        assert message is not None and not _claims_death(message), message
        assert message.startswith(f"rank {rank}: rank {1 - rank} did not answer within the collective timeout of 3s"), (
            message)
    assert "rank 1 in barrier(after_read)" in results[0].split(" Cause: ")[0], results[0]
    assert re.search(r"rank 0 in all_gather[^;]* \(chunk \d+, step \d+\)", results[1].split(" Cause: ")[0]), results[1]
