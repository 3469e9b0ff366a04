"""Gemini's `model.state_dict()` / `load_state_dict()` with a Parameter registered by a module and by its child (as
Hugging Face's `BertLMPredictionHead`: `bias is decoder.bias`) and a root parameter sharing a chunk with its
children, after a checkpoint save (full values again, not placeholders); moves that change nothing are the
parameter itself, others and reads outside a pass are one error. Two gloo ranks, one launch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from lowmem.core_parallel import run_on_ranks

STEPS = 2


class Head(nn.Module):
    """BertLMPredictionHead's registration: the head's `bias` is also `decoder.bias`."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(6, 6)
        self.decoder = nn.Linear(6, 10, bias=False)
        self.bias = nn.Parameter(torch.randn(10) * 0.1)
        self.decoder.bias = self.bias

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.dense(h)))


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(6))  # the root's own parameter, in a chunk with its children's
        self.inp = nn.Linear(5, 6)
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inp(x) * self.scale)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 10, generator=g)


def _train(model: nn.Module, opt, rank: int = 0, world: int = 1) -> None:
    for step in range(STEPS):
        x, y = _data(step)
        loss = nn.functional.mse_loss(model(x[rank::world]), y[rank::world])
        if hasattr(opt, "backward"):
            opt.backward(loss)
        else:
            loss.backward()
        opt.step()
        opt.zero_grad()


def _plain(sd: dict) -> dict:
    return {k: v.detach().clone().tolist() for k, v in sd.items()}


def _ranks(rank: int, world: int, ckpt: str) -> dict:
    from lowmem import core_parallel
    from lowmem.core_parallel.gemini import GeminiConfig
    from lowmem.core_parallel.gemini.fallback import GeminiParamError

    model = Shared()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = core_parallel.setup(model, opt, GeminiConfig(chunk_mb=1), group=None)
    out: dict = {"initial": _plain(model.state_dict())}
    _train(model, opt, rank, world)
    core_parallel.save_checkpoint(ckpt, model, opt)
    out["trained"] = _plain(model.state_dict())  # after a save: gathered values, not the save's placeholders
    # reads between steps on every rank (an EMA update) gather inside collective_reads; after it, reads are loud
    ema = {}
    with torch.no_grad(), core_parallel.gemini.collective_reads(model):
        for name, p in model.named_parameters():
            ema[name] = (0.5 * p + 0.25).tolist()
    out["ema"] = ema
    # moves and casts Lightning applies between stages: no-ops are the parameter itself, others one error
    assert model.to("cpu") is model and model.to(torch.float32).float() is model
    model.eval().train()
    errors = []
    for call in (lambda: model.to(torch.float64), lambda: model.half(), lambda: model.scale.sum(),
                 lambda: next(model.parameters()).clone()):
        try:
            call()
        except GeminiParamError as e:
            errors.append(str(e))
    out["errors"] = errors
    # load: the tied names given the same new values; both read back, and the model computes with them
    new = {k: v + 1.0 for k, v in model.state_dict().items()}
    model.load_state_dict(new)
    out["loaded"] = _plain(model.state_dict())
    with torch.no_grad():
        out["output"] = model(_data(0)[0]).tolist()
    model.gemini_manager.close()
    return out


@pytest.fixture(scope="module")
def ranks_result(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("shared") / "ckpt"
    return run_on_ranks(_ranks, 2, str(ckpt), timeout=90, env={"OMP_NUM_THREADS": "1"})


def _close(got: dict, want: dict, label: str) -> None:
    assert set(got) == set(want), f"{label}: keys differ: {set(got) ^ set(want)}"
    for k, v in want.items():
        torch.testing.assert_close(torch.tensor(got[k]), v.detach(), rtol=1e-5, atol=1e-6, msg=f"{label}: {k}")


@pytest.mark.distributed
def test_shared_registration_state_dict_on_every_rank(ranks_result):
    ref = Shared()
    assert ref.head.bias is ref.head.decoder.bias and "head.decoder.bias" in ref.state_dict()
    initial = copy.deepcopy(ref.state_dict())
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1))
    for rank, res in enumerate(ranks_result):
        _close(res["initial"], initial, f"rank {rank} initial")
        _close(res["trained"], ref.state_dict(), f"rank {rank} after training and a checkpoint save")
        assert res["trained"]["head.bias"] == res["trained"]["head.decoder.bias"]


@pytest.mark.distributed
def test_collective_reads_between_steps(ranks_result):
    ref = Shared()
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1))
    for rank, res in enumerate(ranks_result):
        want = {n: 0.5 * p.detach() + 0.25 for n, p in ref.named_parameters()}
        _close(res["ema"], want, f"rank {rank} EMA-style reads")


@pytest.mark.distributed
def test_shared_registration_load_state_dict(ranks_result):
    ref = Shared()
    _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1))
    ref.load_state_dict({k: v + 1.0 for k, v in ref.state_dict().items()})
    with torch.no_grad():
        want = ref(_data(0)[0])
    for rank, res in enumerate(ranks_result):
        _close(res["loaded"], ref.state_dict(), f"rank {rank} loaded")
        torch.testing.assert_close(torch.tensor(res["output"]), want, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_moves_that_change_something_and_reads_outside_a_pass_are_one_error(ranks_result):
    errors = ranks_result[0]["errors"]
    assert len(errors) == 4, errors
    assert "cannot be moved or cast" in errors[0] and "float64" in errors[0]
    assert "cannot be moved or cast" in errors[1] and "float16" in errors[1]
    assert all("outside a forward or backward pass" in e and "collective_reads" in e for e in errors[2:])
    assert all("\n" not in e for e in errors)
