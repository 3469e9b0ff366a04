"""`save_checkpoint(..., frozen=False)`: a fine-tuning run's frozen base (parameters outside the optimizer, with
requires_grad=False) stays out of the checkpoint, Gemini does not gather its chunks for the save, and a load into a
model rebuilt from the same base restores everything else exactly -- on 1, 2 and 4 gloo ranks, ZeRO and Gemini in
every direction. A checkpoint that left out a parameter the loading model trains is refused, as is consolidating
one (the file would lack weights) and an index that both omits and holds a name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowmem import core_parallel
from lowmem.core_parallel import ZeroConfig, run_on_ranks
from lowmem.core_parallel.checkpoint import CheckpointError, CheckpointReader, consolidate_checkpoint
from lowmem.core_parallel.gemini import GeminiConfig
from lowmem.core_parallel.gemini.chunk import Chunk
from tests.core_parallel.test_checkpoint_frozen import cases, close, load_and_compare, train


def build(case: dict, seed: int, base_seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model whose frozen parameters come from `base_seed` (the "pretrained base") and trained ones from `seed`;
    the optimizer holds only the trained parameters, as a LoRA run's does."""
    def model_of(s: int) -> nn.Module:
        torch.manual_seed(s)
        dims = case["dims"]
        return nn.Sequential(*[m for i in range(len(dims) - 1) for m in (nn.Linear(dims[i], dims[i + 1]), nn.Tanh())])

    model, base = model_of(seed), model_of(base_seed)
    params = list(model.parameters())
    frozen = list(case["frozen"])
    if all(frozen):
        frozen[-1] = False
    with torch.no_grad():
        for p, b, f in zip(params, base.parameters(), frozen):
            if f:
                p.copy_(b)
            p.requires_grad_(not f)
    return model, torch.optim.Adam([p for p in params if p.requires_grad], lr=0.01)


def setup(case: dict, kind: str, seed: int):
    model, opt = build(case, seed)
    if kind == "gemini":
        return core_parallel.setup(model, opt, GeminiConfig(chunk_mb=48 * 4 / 2**20))
    return core_parallel.setup(model, opt, ZeroConfig(stage=int(kind[-1])))


class FrozenGathers:
    """Counts the gathers of chunks without trained parameters (Gemini) while active."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = Chunk.gather_fp32

    def __enter__(self) -> FrozenGathers:
        orig, counter = self._orig, self

        def counted(chunk, *args, **kwargs):
            if not chunk.spec.trainable:
                counter.count += 1
            return orig(chunk, *args, **kwargs)

        Chunk.gather_fp32 = counted
        return self

    def __exit__(self, *exc) -> None:
        Chunk.gather_fp32 = self._orig


def omit_round_trip(rank: int, world: int, case: dict, folder: str) -> str | None:
    """Train, save the full checkpoint `ref` and the one without the frozen base `lean`; load `lean` into a model
    rebuilt from the same base with other trained values; it must equal `ref` (weights and optimizer state)."""
    model, opt = setup(case, case["save"], seed=0)
    train(model, opt, rank, world, case["dims"], case["steps"])
    with FrozenGathers() as full_save:
        core_parallel.save_checkpoint(f"{folder}/ref", model, opt)
    with FrozenGathers() as lean_save:
        core_parallel.save_checkpoint(f"{folder}/lean", model, opt, frozen=False)
    frozen_names = {n for n, p in model.named_parameters() if not p.requires_grad}
    close(model)
    if lean_save.count:
        return f"the save without frozen parameters gathered {lean_save.count} frozen chunks"
    if case["save"] == "gemini" and frozen_names and not full_save.count:
        return "the full save gathered no frozen chunk: the counter counts nothing"
    index = json.loads(Path(f"{folder}/lean/index.json").read_text())
    if set(index.get("frozen_omitted", [])) != frozen_names:
        return f"left out {index.get('frozen_omitted')}, the frozen parameters are {sorted(frozen_names)}"
    if set(index["model_keys"]) & frozen_names:
        return f"the model file holds frozen parameters {sorted(set(index['model_keys']) & frozen_names)}"
    return load_and_compare(lambda: setup(case, case["load"], seed=1), f"{folder}/lean", f"{folder}/ref",
                            f"{folder}/again")


def _round_trips(rank: int, world: int, cases: list[dict], tmp: str) -> list[str | None]:
    return [omit_round_trip(rank, world, case, f"{tmp}/{i}") for i, case in enumerate(cases)]


LORA_LIKE = {"dims": [6, 8, 8, 3], "frozen": [True, True, False, False, True, True], "save": "gemini",
             "load": "gemini", "steps": 2}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_random_frozen_bases_left_out_and_restored_on_one_process(tmp_path_factory, case):
    assert omit_round_trip(0, 1, case, str(tmp_path_factory.mktemp("c"))) is None


@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(cases(), min_size=2, max_size=2))
def test_random_frozen_bases_left_out_and_restored_on_ranks(tmp_path_factory, world, batch):
    every_direction = [{**LORA_LIKE, "save": s, "load": t} for s in ("gemini", "zero2") for t in ("gemini", "zero2")]
    tmp = str(tmp_path_factory.mktemp("ranks"))
    results = run_on_ranks(_round_trips, world, [*every_direction, *batch], tmp, timeout=180)
    for rank, problems in enumerate(results):
        assert problems == [None] * len(problems), f"rank {rank}: {problems}"


def _lean_checkpoint(tmp_path: Path) -> Path:
    model, opt = setup(LORA_LIKE, "gemini", seed=0)
    train(model, opt, 0, 1, LORA_LIKE["dims"], 1)
    core_parallel.save_checkpoint(tmp_path / "lean", model, opt, frozen=False)
    close(model)
    return tmp_path / "lean"


def test_a_left_out_parameter_the_loading_model_trains_is_refused(tmp_path):
    path = _lean_checkpoint(tmp_path)
    model, opt = build(LORA_LIKE, seed=1)
    model[0].weight.requires_grad_(True)  # frozen when saved, trained here: its saved value does not exist
    model, opt = core_parallel.setup(model, torch.optim.Adam([p for p in model.parameters() if p.requires_grad]),
                                     ZeroConfig(stage=2))
    with pytest.raises(CheckpointError, match=r"left out frozen parameter '0\.weight'.*which this model trains"):
        core_parallel.load_checkpoint(path, model, opt)


def test_consolidating_a_checkpoint_without_its_frozen_base_is_refused(tmp_path):
    path = _lean_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="left out 4 frozen parameters"):
        consolidate_checkpoint(path, tmp_path / "one.safetensors")
    assert not (tmp_path / "one.safetensors").exists()


def test_an_index_that_omits_a_name_it_also_holds_is_refused(tmp_path):
    path = _lean_checkpoint(tmp_path)
    index = json.loads((path / "index.json").read_text())
    index["frozen_omitted"].append(next(iter(index["params"])))
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'frozen_omitted' names .* which the checkpoint also holds"):
        CheckpointReader(path)
