"""The one `(world, rank)` helper and its one meaning of `group=None`, the one list of backend names, and the
one `InputError` every core_parallel input error derives from (a forged or foreign checkpoint included)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowmem import core_parallel
from lowmem.core_parallel import Topology, ZeroConfig, checkpoint, run_on_ranks
from lowmem.core_parallel.dap import group_rank, group_size
from lowmem.core_parallel.gemini import GeminiConfig, parse_bytes
from lowmem.core_parallel.groups import BACKENDS, check_backend, world_rank
from lowmem.core_parallel.loss_scaler import LossScalerConfig
from lowmem.utils.errors import InputError


def test_world_rank_without_a_process_group_is_one_process():
    assert not dist.is_initialized()
    assert world_rank() == world_rank(None) == (1, 0)
    assert (group_size(None), group_rank(None)) == (1, 0)  # DAP means the same by None
    with pytest.raises(ValueError, match="not initialised"):
        world_rank(object())  # a group without torch.distributed: a programming error, never (1, 0)


def _world_rank_on(rank: int, world: int) -> dict:
    singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank creates every group
    return {
        "none": world_rank(),
        "world": world_rank(dist.group.WORLD),
        "single": world_rank(singles[rank]),
        "dap_none": (group_size(None), group_rank(None)),
        "dap_single": (group_size(singles[rank]), group_rank(singles[rank])),
        "topology": Topology(world_size=world, rank=rank).init().group("world") is dist.group.WORLD,
    }


@pytest.mark.distributed
def test_world_rank_with_a_process_group_means_the_default_group():
    results = run_on_ranks(_world_rank_on, 2, timeout=90)
    for rank, out in enumerate(results):
        assert out == {"none": (2, rank), "world": (2, rank), "single": (1, 0), "dap_none": (2, rank),
                       "dap_single": (1, 0), "topology": True}, (rank, out)


def test_one_list_of_backend_names():
    assert BACKENDS == ("gloo", "nccl", "mpi") and core_parallel.BACKENDS is BACKENDS
    assert check_backend("nccl") == "nccl"
    with pytest.raises(InputError, match="backend must be one of gloo, nccl, mpi, got 'tcp'"):
        Topology(world_size=1, backend="tcp")
    with pytest.raises(InputError, match="backend must be one of gloo, nccl, mpi, none, got 'ncll'"):
        run_on_ranks(_world_rank_on, 1, backend="ncll")  # refused before any process starts


@pytest.mark.parametrize(
    "make",
    [lambda: ZeroConfig(stage=3), lambda: GeminiConfig(prefetch=-1), lambda: GeminiConfig(offload_tier="cpu",
     offload_dir="/x"), lambda: LossScalerConfig(growth_factor=1.0), lambda: parse_bytes("12 parsecs"),
     lambda: Topology(world_size=0)],
    ids=["zero", "gemini", "gemini_tier", "loss_scaler", "bytes", "topology"],
)
def test_config_errors_are_input_errors(make):
    with pytest.raises(InputError) as info:
        make()
    assert isinstance(info.value, ValueError)  # what library users caught before


def _zero_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    model, opt = core_parallel.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig())
    opt.backward(model(torch.randn(5, 4)).square().mean())
    opt.step()
    core_parallel.save_checkpoint(tmp_path / "c", model, opt)
    return tmp_path / "c"


def test_a_forged_or_foreign_checkpoint_is_a_checkpoint_error_and_an_input_error(tmp_path):
    assert issubclass(checkpoint.CheckpointError, InputError) and issubclass(checkpoint.CheckpointError, ValueError)
    assert core_parallel.CheckpointError is checkpoint.CheckpointError
    folder = _zero_checkpoint(tmp_path)
    # another model (same names, other shapes): not this model's checkpoint
    other = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    other, other_opt = core_parallel.setup(other, torch.optim.SGD(other.parameters(), lr=0.1), ZeroConfig())
    with pytest.raises(checkpoint.CheckpointError, match="has shape"):
        core_parallel.load_checkpoint(folder, other, other_opt)
    # a forged index
    index = json.loads((folder / checkpoint.INDEX).read_text())
    index["params"]["0.weight"]["dtype"] = "not_a_dtype"
    (folder / checkpoint.INDEX).write_text(json.dumps(index))
    with pytest.raises(InputError, match="unknown dtype"):
        checkpoint.CheckpointReader(folder)
