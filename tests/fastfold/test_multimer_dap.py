"""AlphaFold-Multimer (issue 22) with the inference options: `parallelize_dap` on 1, 2 and 4 gloo ranks, chunking
and in-place residuals, each equal to the plain single-process model in float64.

Tiny multimer model (every component: outer product mean first, the multimer template pair stack, the extra-MSA
stack with global column attention), a complex of three chains A, A', B of 7 + 7 + 5 = 19 residues (odd, not
divisible by 2 or 4: the all-to-all pads), 5 MSA rows + 2 template rows, 3 extra rows (fewer than 4 ranks),
2 templates with absent atoms, two recycling passes. Positions, pLDDT, PAE, pTM, ipTM, ranking confidence and
the representations within 1e-10 relative.
"""

from __future__ import annotations

import pytest
import torch

from lowmem.core_parallel import Axis, Topology, run_on_ranks
from lowmem.fastfold.dap import broadcast_batch, parallelize_dap
from lowmem.fastfold.model import InferenceOptions
from lowmem.fastfold.model.multimer import AlphaFoldMultimer, TemplatePairStackMultimer, multimer_tiny
from lowmem.fastfold.model.testing import random_multimer_batch, randomize_parameters

OUT_KEYS = (
    "final_atom_positions",
    "plddt",
    "predicted_aligned_error",
    "ptm_score",
    "iptm_score",
    "ranking_confidence",
    "distogram_logits",
    "masked_msa_logits",
    "single",
    "pair",
    "msa",
)
CASES = ((None, "out_of_place"), (3, "in_place"), (4, "out_of_place"))
"""(chunk size, residual) per checked forward, all float64; every spawned run checks all of them."""
TOL = 1e-10


def _model() -> AlphaFoldMultimer:
    cfg = multimer_tiny()
    cfg.recycle_early_stop_tolerance = -1.0  # both passes run on every rank
    return randomize_parameters(AlphaFoldMultimer(cfg), seed=1).double().eval()


def _batch() -> dict[str, torch.Tensor]:
    return random_multimer_batch((7, 7, 5), entities=(1, 1, 2), n_seq=5, n_extra=3, n_templ=2, n_recycle=1, seed=2)


def _fold(model: AlphaFoldMultimer, batch: dict, chunk, residual: str) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        out = model(batch, InferenceOptions(chunk_size=chunk, residual=residual))
    assert int(out["num_recycles"]) == 1
    return {k: out[k].clone() for k in OUT_KEYS}


def _compare(got: dict, want: dict, what: str) -> None:
    for key in OUT_KEYS:
        g = torch.as_tensor(got[key])
        assert g.shape == want[key].shape, (what, key)
        err = (g - want[key]).abs().max() / want[key].abs().max().clamp_min(1e-30)
        assert err <= TOL, f"{what}: {key} rel err {err:.2e}"


def _dap_fold(rank: int, world: int) -> list[dict]:
    topo = Topology(world_size=world, rank=rank, dap=world).init()
    group = topo.group(Axis.DAP)
    model = parallelize_dap(_model(), group)
    stacks = [model.evoformer, model.extra_msa_stack, model.template_embedder.template_pair_stack]
    assert all(s.layout.world == world for s in stacks)
    results = []
    for chunk, residual in CASES:
        batch = broadcast_batch(_batch() if rank == 0 else None, group, src=0)
        # numpy: tensors returned through the result queue would travel as shared-memory handles
        results.append({k: v.numpy() for k, v in _fold(model, batch, chunk, residual).items()})
    topo.destroy()
    return results


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return _fold(_model(), _batch(), None, "out_of_place")


def test_chunked_and_in_place_equal_plain(reference):
    model = _model()
    for chunk, residual in [(1, "in_place"), (3, "out_of_place"), (4, "in_place"), ("auto", "in_place")]:
        _compare(_fold(model, _batch(), chunk, residual), reference, f"chunk {chunk}, {residual}")


def test_chunked_template_embedder_equals_plain():
    model = _model()
    batch = {k: v[..., 0] for k, v in _batch().items()}
    emb = model.template_embedder
    templ = {k: v.double() if v.is_floating_point() else v for k, v in batch.items() if k.startswith("template_")}
    g = torch.Generator().manual_seed(5)
    z = torch.randn(19, 19, model.config.c_z, generator=g, dtype=torch.float64)
    pair_mask = torch.ones(19, 19, dtype=torch.float64)
    want = emb(templ, z, pair_mask, batch["asym_id"], InferenceOptions())
    for chunk in (1, 4, 7):
        got = emb(templ, z, pair_mask, batch["asym_id"], InferenceOptions(chunk_size=chunk))
        err = (got - want).abs().max() / want.abs().max()
        assert err <= TOL, (chunk, float(err))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [1, 2, 4])
def test_split_multimer_equals_single_process(world, reference):
    for rank, results in enumerate(run_on_ranks(_dap_fold, world, timeout=150)):
        for (chunk, residual), got in zip(CASES, results):
            _compare(got, reference, f"{world} ranks, rank {rank}, chunk {chunk}, {residual}")


def test_parallelize_dap_finds_the_multimer_stacks():
    model = _model()
    kinds = {type(m) for m in model.modules()}
    assert TemplatePairStackMultimer in kinds
    with pytest.raises(ValueError, match="already split"):
        model.template_embedder.template_pair_stack.layout = object()
        parallelize_dap(model, group="not used")
