"""Checkpoints of models with frozen parameters inside the optimizer load across ZeRO and Gemini in every
direction (gemini -> zero, zero -> gemini, zero -> zero, gemini -> gemini), on one process and on two ranks.

Gemini keeps a frozen parameter in the model file (it never steps it), ZeRO as a sharded parameter with its
master only: after a load the model holds the saved weights and the optimizer the saved state, which a second
save from the loaded run shows (its masters, per-element states and step counters equal the first save's).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowmem import core_parallel
from lowmem.core_parallel import ZeroConfig, run_on_ranks
from lowmem.core_parallel.checkpoint import CheckpointReader
from lowmem.core_parallel.gemini import GeminiConfig

KINDS = ("zero1", "zero2", "gemini")


def build(case: dict, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    dims = case["dims"]
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers += [nn.Linear(dims[i], dims[i + 1]), nn.Tanh()]
    model = nn.Sequential(*layers)
    params = list(model.named_parameters())
    for (_, p), frozen in zip(params, case["frozen"]):
        p.requires_grad_(not frozen)
    if all(not p.requires_grad for _, p in params):
        params[-1][1].requires_grad_(True)
    half = len(params) // 2
    groups = [{"params": [p for _, p in params[:half]]}, {"params": [p for _, p in params[half:]], "lr": 0.03}]
    return model, torch.optim.Adam(groups, lr=0.01)


def setup(case: dict, kind: str, seed: int):
    model, opt = build(case, seed)
    if kind == "gemini":
        return core_parallel.setup(model, opt, GeminiConfig(chunk_mb=48 * 4 / 2**20))
    return core_parallel.setup(model, opt, ZeroConfig(stage=int(kind[-1])))


def train(model, opt, rank: int, world: int, dims: list[int], steps: int) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, dims[0], generator=g), torch.randn(4, dims[-1], generator=g)
        per = 4 // world
        opt.backward(((model(x[rank * per : (rank + 1) * per]) - y[rank * per : (rank + 1) * per]) ** 2).mean())
        opt.step()
        opt.zero_grad()


def close(model) -> None:
    manager = getattr(model, "gemini_manager", None)
    if manager is not None:
        manager.close()


def optimizer_state(folder: str) -> dict[str, dict]:
    """Per parameter: its non-master per-element states and scalars, as the checkpoint records them."""
    reader = CheckpointReader(folder)
    out = {}
    for name in reader.param_names():
        keys = [k for k in reader.tensor_keys(name) if k != "master"]
        out[name] = {**{k: reader.full(name, k) for k in keys}, **reader.scalars(name)}
    return {k: v for k, v in out.items() if v}


def round_trip(rank: int, world: int, case: dict, folder: str) -> str | None:
    """Save with case's `save` kind, load with its `load` kind into a differently initialised model, save
    again; returns a description of the first difference (None: none). Every rank runs it."""
    model, opt = setup(case, case["save"], seed=0)
    train(model, opt, rank, world, case["dims"], case["steps"])
    core_parallel.save_checkpoint(f"{folder}/a", model, opt)
    close(model)
    return load_and_compare(lambda: setup(case, case["load"], seed=1), f"{folder}/a", f"{folder}/a", f"{folder}/b")


def load_and_compare(make, path: str, ref: str, again: str) -> str | None:
    """Load checkpoint `path` into the model and optimizer `make()` builds, save them to `again`; the first
    difference of the loaded weights and of the saved optimizer state from checkpoint `ref` (None: none)."""
    model, opt = make()
    core_parallel.load_checkpoint(path, model, opt)
    got = {k: v.float() for k, v in model.state_dict().items()}
    core_parallel.save_checkpoint(again, model, opt)
    close(model)
    want = CheckpointReader(ref).state_dict("float32")
    if set(got) != set(want):
        return f"state_dict names differ: {sorted(set(got) ^ set(want))}"
    for k in want:
        if not torch.equal(got[k], want[k]):
            return f"weight {k}: loaded {got[k].flatten()[:3]} != saved {want[k].flatten()[:3]}"
    return state_difference(optimizer_state(ref), optimizer_state(again))


def state_difference(a: dict, b: dict) -> str | None:
    """The first difference between two `optimizer_state` results (saved `a`, after the load `b`), or None."""
    if set(a) != set(b):
        return f"optimizer state for different parameters: {sorted(set(a) ^ set(b))}"
    for name in a:
        for key, value in a[name].items():
            other = b[name].get(key)
            if not isinstance(other, torch.Tensor) or not torch.equal(torch.as_tensor(value), other):
                return f"optimizer state {key} of {name}: {other} after the load, {value} saved"
    return None


def _round_trips(rank: int, world: int, cases: list[dict], tmp: str) -> list[str | None]:
    return [round_trip(rank, world, case, f"{tmp}/{i}") for i, case in enumerate(cases)]


@st.composite
def cases(draw) -> dict:
    dims = draw(st.lists(st.integers(1, 9), min_size=2, max_size=4))
    n = 2 * (len(dims) - 1)
    return {"dims": dims, "frozen": draw(st.lists(st.booleans(), min_size=n, max_size=n)),
            "save": draw(st.sampled_from(KINDS)), "load": draw(st.sampled_from(KINDS)),
            "steps": draw(st.integers(1, 2))}


GEMINI_TO_ZERO = {"dims": [5, 7, 3], "frozen": [True, True, False, False], "save": "gemini", "load": "zero2",
                  "steps": 2}


def test_gemini_checkpoint_with_frozen_parameters_in_the_optimizer_loads_under_zero(tmp_path):
    assert round_trip(0, 1, GEMINI_TO_ZERO, str(tmp_path)) is None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_random_frozen_subsets_round_trip_in_every_direction_on_one_process(tmp_path_factory, case):
    assert round_trip(0, 1, case, str(tmp_path_factory.mktemp("c"))) is None


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(cases(), min_size=4, max_size=4))
def test_random_frozen_subsets_round_trip_in_every_direction_on_two_ranks(tmp_path_factory, batch):
    kinds = ("gemini", "zero1")
    every_direction = [{**GEMINI_TO_ZERO, "save": s, "load": t} for s in kinds for t in kinds]
    tmp = str(tmp_path_factory.mktemp("ranks"))
    results = run_on_ranks(_round_trips, 2, [*every_direction, *batch], tmp, timeout=120)
    for rank, problems in enumerate(results):
        assert problems == [None] * len(problems), f"rank {rank}: {problems}"

