"""Module-level known answers: each module against a float64 reference written from the supplement's
formulas (outputs and gradients), including masking, gating and the incoming triangle multiplication."""

from __future__ import annotations

import math

import pytest
import torch

from lowmem.fastfold.common.rigid import Rigid, quat_to_rot
from lowmem.fastfold.model.config import StructureModuleConfig
from lowmem.fastfold.model.evoformer import (
    GlobalAttention,
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    OuterProductMean,
    Transition,
    TriangleAttention,
    TriangleMultiplication,
)
from lowmem.fastfold.model.options import InferenceOptions
from lowmem.fastfold.model.structure_module import InvariantPointAttention
from lowmem.fastfold.model.testing import randomize_parameters

OPTS = InferenceOptions()
CHUNK2 = InferenceOptions(chunk_size=2)
FUSED = InferenceOptions(chunk_size=2, residual="in_place")
BOTH = pytest.mark.parametrize("opts", [OPTS, CHUNK2], ids=["whole", "chunk2"])
F64 = torch.float64


def _ln(x, mod):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + mod.eps) * mod.weight + mod.bias


def _lin(x, mod):
    return x @ mod.weight.T + (mod.bias if mod.bias is not None else 0)


def _grads(fn, params, *inputs):
    out = fn(*inputs)
    w = torch.randn(out.shape, dtype=out.dtype)  # not randn_like: the same weights whatever out's strides
    return torch.autograd.grad((out * w).sum(), [*params, *inputs])


def _check_with_grads(module, ref_fn, ours_fn, inputs):
    params = list(module.parameters())
    a, b = ours_fn(*inputs), ref_fn(*inputs)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.manual_seed(7)
    ga = _grads(ours_fn, params, *inputs)
    torch.manual_seed(7)
    gb = _grads(ref_fn, params, *inputs)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)


def _mask(shape, g, p=0.3):
    m = (torch.rand(shape, generator=g) > p).to(F64)
    m[..., 0] = 1  # keep at least one key per row
    return m


@BOTH
@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_triangle_multiplication(direction, opts):
    g = torch.Generator().manual_seed(0)
    mod = randomize_parameters(TriangleMultiplication(5, 3, direction).to(F64), seed=1)
    z = torch.randn(6, 6, 5, generator=g, dtype=F64, requires_grad=True)
    mask = _mask((6, 6), g)

    def ref(z):
        x = _ln(z, mod.layer_norm_in)
        a = mask[..., None] * _lin(x, mod.linear_a_p) * torch.sigmoid(_lin(x, mod.linear_a_g))
        b = mask[..., None] * _lin(x, mod.linear_b_p) * torch.sigmoid(_lin(x, mod.linear_b_g))
        n = z.shape[0]
        p = torch.zeros(n, n, a.shape[-1], dtype=F64)
        for i in range(n):
            for j in range(n):
                for k in range(n):  # Alg. 11: a_ik * b_jk; Alg. 12: a_ki * b_kj
                    p[i, j] += a[i, k] * b[j, k] if direction == "outgoing" else a[k, i] * b[k, j]
        return torch.sigmoid(_lin(x, mod.linear_g)) * _lin(_ln(p, mod.layer_norm_out), mod.linear_z)

    _check_with_grads(mod, ref, lambda z: mod(z, mask, opts), [z])
    _check_fused(mod, ref, lambda z: mod.residual_(z, mask, FUSED), z)


def _check_fused(module, ref_fn, fused_fn, x, *rest):
    """The fused chunked residual (`residual_` with chunking and in-place adds) gives x + ref(x) exactly as
    the reference does, and writes into x."""
    with torch.no_grad():
        expected = x + ref_fn(x, *rest)
        x = x.detach().clone()
        out = fused_fn(x, *rest)
    assert out.data_ptr() == x.data_ptr()
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


@BOTH
def test_outer_product_mean(opts):
    g = torch.Generator().manual_seed(1)
    mod = randomize_parameters(OuterProductMean(6, 5, 3).to(F64), seed=2)
    m = torch.randn(4, 5, 6, generator=g, dtype=F64, requires_grad=True)
    mask = _mask((4, 5), g)

    def ref(m):
        x = _ln(m, mod.layer_norm)
        a, b = _lin(x, mod.linear_1) * mask[..., None], _lin(x, mod.linear_2) * mask[..., None]
        outer = torch.einsum("sic,sje->ijce", a, b).reshape(5, 5, 9)
        norm = torch.einsum("si,sj->ij", mask, mask)[..., None]
        return _lin(outer, mod.linear_out) / (1e-3 + norm)

    _check_with_grads(mod, ref, lambda m: mod(m, mask, opts), [m])
    z = torch.randn(5, 5, 5, generator=g, dtype=F64)
    with torch.no_grad():
        expected = z + ref(m)
        out = mod.residual_(z.clone(), m, mask, FUSED)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def _attention_ref(mha, q_x, kv_x, mask, bias):
    h, c = mha.heads, mha.head_dim
    q = _lin(q_x, mha.linear_q).unflatten(-1, (h, c))
    k = _lin(kv_x, mha.linear_k).unflatten(-1, (h, c))
    v = _lin(kv_x, mha.linear_v).unflatten(-1, (h, c))
    logits = torch.einsum("...qhc,...khc->...hqk", q, k) / math.sqrt(c) + bias
    logits = torch.where(mask, logits, torch.tensor(-1e9, dtype=F64))
    o = torch.einsum("...hqk,...khc->...qhc", torch.softmax(logits, -1), v)
    if mha.linear_g is not None:
        o = o * torch.sigmoid(_lin(q_x, mha.linear_g)).unflatten(-1, (h, c))
    return _lin(o.flatten(-2), mha.linear_o)


@BOTH
def test_msa_row_attention_with_pair_bias(opts):
    g = torch.Generator().manual_seed(2)
    mod = randomize_parameters(MSARowAttentionWithPairBias(6, 4, 2, 3).to(F64), seed=3)
    m = torch.randn(3, 5, 6, generator=g, dtype=F64, requires_grad=True)
    z = torch.randn(5, 5, 4, generator=g, dtype=F64, requires_grad=True)
    mask = _mask((3, 5), g)

    def ref(m, z):
        bias = torch.einsum("qkc,hc->hqk", _ln(z, mod.layer_norm_z), mod.linear_z.weight)
        x = _ln(m, mod.layer_norm_m)
        return _attention_ref(mod.mha, x, x, mask[:, None, None, :] > 0, bias)

    _check_with_grads(mod, ref, lambda m, z: mod(m, z, mask, opts), [m, z])
    _check_fused(mod, ref, lambda m, z: mod.residual_(m, z, mask, FUSED), m, z)


@BOTH
@pytest.mark.parametrize("node", ["starting", "ending"])
def test_triangle_attention(node, opts):
    g = torch.Generator().manual_seed(3)
    mod = randomize_parameters(TriangleAttention(4, 2, 3, node).to(F64), seed=4)
    z = torch.randn(5, 5, 4, generator=g, dtype=F64, requires_grad=True)
    mask = _mask((5, 5), g)

    def ref(z):
        zt, mt = (z, mask) if node == "starting" else (z.transpose(0, 1), mask.T)
        x = _ln(zt, mod.layer_norm)
        bias = torch.einsum("jkc,hc->hjk", x, mod.linear.weight)  # b_jk (Alg. 13 line 3)
        out = _attention_ref(mod.mha, x, x, mt[:, None, None, :] > 0, bias)
        return out if node == "starting" else out.transpose(0, 1)

    _check_with_grads(mod, ref, lambda z: mod(z, mask, opts), [z])
    _check_fused(mod, ref, lambda z: mod.residual_(z, mask, FUSED), z)


def test_global_attention():
    g = torch.Generator().manual_seed(4)
    mod = randomize_parameters(GlobalAttention(6, 2, 3).to(F64), seed=5)
    x = torch.randn(4, 7, 6, generator=g, dtype=F64, requires_grad=True)
    mask = _mask((4, 7), g)

    def ref(x):
        q_avg = (x * mask[..., None]).sum(1) / (mask.sum(1)[:, None] + 1e-10)
        q = _lin(q_avg, mod.linear_q).unflatten(-1, (2, 3)) / math.sqrt(3)
        k, v = _lin(x, mod.linear_k), _lin(x, mod.linear_v)
        logits = torch.einsum("bhc,bkc->bhk", q, k)
        logits = torch.where(mask[:, None, :] > 0, logits, torch.tensor(-1e9, dtype=F64))
        o = torch.einsum("bhk,bkc->bhc", torch.softmax(logits, -1), v)
        gate = torch.sigmoid(_lin(x, mod.linear_g)).unflatten(-1, (2, 3))
        return _lin((o[:, None] * gate).flatten(-2), mod.linear_o)

    _check_with_grads(mod, ref, lambda x: mod(x, mask), [x])


@BOTH
def test_msa_column_attention(opts):
    g = torch.Generator().manual_seed(8)
    mod = randomize_parameters(MSAColumnAttention(6, 2, 3).to(F64), seed=9)
    m = torch.randn(4, 5, 6, generator=g, dtype=F64, requires_grad=True)
    mask = _mask((4, 5), g)

    def ref(m):  # Alg. 8: attention along each column (over sequences), no bias
        x = _ln(m, mod.layer_norm_m).transpose(0, 1)
        return _attention_ref(mod.mha, x, x, mask.T[:, None, None, :] > 0, 0.0).transpose(0, 1)

    _check_with_grads(mod, ref, lambda m: mod(m, mask, opts), [m])
    _check_fused(mod, ref, lambda m: mod.residual_(m, mask, FUSED), m)


@BOTH
def test_msa_column_global_attention(opts):
    g = torch.Generator().manual_seed(10)
    mod = randomize_parameters(MSAColumnGlobalAttention(6, 2, 3).to(F64), seed=11)
    m = torch.randn(4, 5, 6, generator=g, dtype=F64, requires_grad=True)
    mask = _mask((4, 5), g)
    ga = mod.global_attention

    def ref(m):  # Alg. 19 on each column
        x = _ln(m, mod.layer_norm_m).transpose(0, 1)  # [N, S, C]
        mt = mask.T
        q_avg = (x * mt[..., None]).sum(1) / (mt.sum(1)[:, None] + 1e-10)
        q = _lin(q_avg, ga.linear_q).unflatten(-1, (2, 3)) / math.sqrt(3)
        k, v = _lin(x, ga.linear_k), _lin(x, ga.linear_v)
        logits = torch.where(mt[:, None, :] > 0, torch.einsum("bhc,bkc->bhk", q, k), torch.tensor(-1e9, dtype=F64))
        o = torch.einsum("bhk,bkc->bhc", torch.softmax(logits, -1), v)
        gate = torch.sigmoid(_lin(x, ga.linear_g)).unflatten(-1, (2, 3))
        return _lin((o[:, None] * gate).flatten(-2), ga.linear_o).transpose(0, 1)

    _check_with_grads(mod, ref, lambda m: mod(m, mask, opts), [m])
    _check_fused(mod, ref, lambda m: mod.residual_(m, mask, FUSED), m)


@BOTH
def test_transition(opts):
    g = torch.Generator().manual_seed(12)
    mod = randomize_parameters(Transition(5, 3).to(F64), seed=13)
    x = torch.randn(5, 3, 5, generator=g, dtype=F64, requires_grad=True)

    def ref(x):  # Alg. 9 / 15
        return _lin(torch.relu(_lin(_ln(x, mod.layer_norm), mod.linear_1)), mod.linear_2)

    _check_with_grads(mod, ref, lambda x: mod(x, opts), [x])
    _check_fused(mod, ref, lambda x: mod.residual_(x, FUSED), x)


def _random_frames(n, g):
    q = torch.randn(n, 4, generator=g, dtype=F64)
    return Rigid(quat_to_rot(q / q.norm(dim=-1, keepdim=True)), 3 * torch.randn(n, 3, generator=g, dtype=F64))


def test_invariant_point_attention_is_invariant():
    """Alg. 22: the output does not change when every frame is moved by one global rigid transform."""
    g = torch.Generator().manual_seed(5)
    cfg = StructureModuleConfig(
        c_s=8, c_z=4, ipa_heads=2, ipa_scalar_qk=3, ipa_scalar_v=2, ipa_point_qk=2, ipa_point_v=3
    )
    ipa = randomize_parameters(InvariantPointAttention(cfg).to(F64), seed=6)
    s = torch.randn(6, 8, generator=g, dtype=F64)
    z = torch.randn(6, 6, 4, generator=g, dtype=F64)
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=F64)
    frames = _random_frames(6, g)
    glob = _random_frames(1, g)
    moved = Rigid(glob.rot.expand(6, 3, 3), glob.trans.expand(6, 3)).compose(frames)
    a, b = ipa(s, z, frames, mask), ipa(s, z, moved, mask)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # and it does depend on the frames' relative placement
    assert not torch.allclose(a, ipa(s, z, _random_frames(6, g), mask))


@pytest.mark.parametrize("chunk", [1, 4])
def test_invariant_point_attention_chunked_matches_whole(chunk):
    """Query blocks (with the pair bias and rows supplied from outside, as the structure module does when
    chunking) give the same output and gradients as one block."""
    g = torch.Generator().manual_seed(14)
    cfg = StructureModuleConfig(
        c_s=8, c_z=4, ipa_heads=2, ipa_scalar_qk=3, ipa_scalar_v=2, ipa_point_qk=2, ipa_point_v=3
    )
    ipa = randomize_parameters(InvariantPointAttention(cfg).to(F64), seed=15)
    s = torch.randn(7, 8, generator=g, dtype=F64, requires_grad=True)
    z = torch.randn(7, 7, 4, generator=g, dtype=F64, requires_grad=True)
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0], dtype=F64)
    frames = _random_frames(7, g)

    def blocks(s, z):
        bias = ipa.linear_b(z).movedim(-1, -3)
        return ipa.attend(s, frames, mask, bias, lambda r0, r1: z[r0:r1], chunk)

    _check_with_grads(ipa, lambda s, z: ipa(s, z, frames, mask), blocks, [s, z])
    opts = InferenceOptions(chunk_size=chunk)
    torch.testing.assert_close(ipa(s, z, frames, mask, opts), ipa(s, z, frames, mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [None, 3])
def test_ptm_and_pae_with_a_leading_batch_dim_equal_each_item(chunk):
    """compute_ptm / compute_predicted_aligned_error on [b, N, N, B] equal the per-item float64 results."""
    from lowmem.fastfold.model.config import HeadsConfig
    from lowmem.fastfold.model.heads import compute_predicted_aligned_error, compute_ptm

    cfg = HeadsConfig()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 7, cfg.pae_bins, dtype=torch.float64, generator=g)
    weights = (torch.rand(3, 7, dtype=torch.float64, generator=g) > 0.2).double()
    ptm = compute_ptm(logits, cfg, weights, chunk=chunk)
    pae, _ = compute_predicted_aligned_error(logits, cfg, chunk=chunk)
    assert ptm.shape == (3,) and pae.shape == (3, 7, 7)
    for i in range(3):
        torch.testing.assert_close(ptm[i], compute_ptm(logits[i], cfg, weights[i]), rtol=1e-12, atol=0)
        torch.testing.assert_close(pae[i], compute_predicted_aligned_error(logits[i], cfg)[0], rtol=1e-12, atol=0)
