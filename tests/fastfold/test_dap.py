"""parallelize_dap: the split model's outputs equal the single-process model's on 1, 2 and 4 gloo ranks.

Tiny model, awkward sizes: 37 residues, 5 MSA rows (+2 template-angle rows), 3 extra rows (fewer than 4
ranks), 2 templates, one pass. float64 within 1e-10 relative, float32 (chunked, in-place
residuals) within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lowmem.core_parallel import Axis, RankError, Topology, run_on_ranks
from lowmem.fastfold.dap import broadcast_batch, parallelize_dap
from lowmem.fastfold.model import AlphaFold, InferenceOptions, config
from lowmem.fastfold.model.testing import random_batch, randomize_parameters

OUT_KEYS = (
    "final_atom_positions",
    "plddt",
    "predicted_aligned_error",
    "ptm_score",
    "distogram_logits",
    "masked_msa_logits",
    "single",
    "pair",
    "msa",
)
CASES = (("float64", None, "out_of_place"), ("float32", 4, "in_place"))
"""(dtype, chunk size, residual) per checked forward; every spawned run checks all of them."""
TOL = {"float64": 1e-10, "float32": 1e-5}


def _model(dtype: str) -> AlphaFold:
    cfg = config.tiny(templates=True, tm=True)
    torch.manual_seed(0)
    model = randomize_parameters(AlphaFold(cfg), seed=1)
    return model.to(getattr(torch, dtype)).eval()


def _batch() -> dict[str, torch.Tensor]:
    cfg = config.tiny(templates=True, tm=True)
    return random_batch(cfg, n_res=37, n_seq=5, n_extra=3, n_templ=2, n_recycle=0, seed=2)


def _fold(model: AlphaFold, batch: dict, chunk, residual: str) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(batch, InferenceOptions(chunk_size=chunk, residual=residual))
    return {k: out[k].clone() for k in OUT_KEYS}


def _dap_fold(rank: int, world: int, fail_rank: int | None = None) -> list[dict[str, torch.Tensor]]:
    topo = Topology(world_size=world, rank=rank, dap=world).init()
    group = topo.group(Axis.DAP)
    results = []
    for dtype, chunk, residual in CASES:
        batch = broadcast_batch(_batch() if rank == 0 else None, group, src=0)
        model = parallelize_dap(_model(dtype), group)
        if rank == fail_rank:
            model.evoformer.blocks[1].msa_att_row.mha.register_forward_pre_hook(_fail)
        # numpy: tensors returned through the result queue would travel as shared-memory handles
        results.append({k: v.numpy() for k, v in _fold(model, batch, chunk, residual).items()})
    topo.destroy()
    return results


def _fail(*_args) -> None:
    raise RuntimeError("injected failure in Evoformer block 1")


@pytest.fixture(scope="module")
def reference() -> list[dict[str, torch.Tensor]]:
    batch = _batch()
    return [_fold(_model(dtype), batch, None, "out_of_place") for dtype, _, _ in CASES]


def _compare(results: list[dict], reference: list[dict], world: int, rank: int) -> None:
    for (dtype, chunk, _), got, want in zip(CASES, results, reference):
        for key in OUT_KEYS:
            got[key] = torch.as_tensor(got[key])
            err = (got[key] - want[key]).abs().max() / want[key].abs().max().clamp_min(1e-30)
            assert got[key].shape == want[key].shape, key
            assert err <= TOL[dtype], f"{world} ranks, rank {rank}, {dtype}, chunk {chunk}: {key} rel err {err:.2e}"


def test_one_rank_group_runs_the_plan(reference):
    from lowmem.core_parallel.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    try:
        _compare(_dap_fold(0, 1), reference, 1, 0)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_split_model_equals_single_process(world, reference):
    for rank, results in enumerate(run_on_ranks(_dap_fold, world, timeout=150)):
        _compare(results, reference, world, rank)


@pytest.mark.distributed
def test_failing_rank_stops_the_others():
    with pytest.raises(RankError, match="injected failure in Evoformer block 1") as info:
        run_on_ranks(_dap_fold, 2, 1, timeout=120)
    assert info.value.rank == 1


def test_no_group_leaves_the_model_alone():
    model = _model("float32")
    forwards = [m.forward for m in model.modules()]
    assert parallelize_dap(model, None) is model
    assert [m.forward for m in model.modules()] == forwards
    assert broadcast_batch({"x": torch.ones(2)}, None)["x"].tolist() == [1.0, 1.0]
