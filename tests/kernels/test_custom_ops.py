"""The kernels as torch.library custom ops: schemas and fake (meta) implementations checked by opcheck,
torch.compile(fullgraph=True) without graph breaks, selective activation checkpointing by op name."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lowmem import kernels
from lowmem.kernels import backend
from tests.kernels._tolerance import check

OPS = getattr(torch.ops, backend.OP_NAMESPACE)
NAMES = ("attention_fwd", "attention_bwd", "softmax_fwd", "softmax_bwd", "layer_norm_fwd", "layer_norm_bwd")
# opcheck's dynamic-shape AOT test reruns the op several times: cheap on the PyTorch path, slow in Triton's
# interpreter, where the schema, autograd-registration and fake-tensor checks run (the AOT one for layer_norm,
# whose only custom op is the Triton one, and in test_compile_fullgraph_triton)
FULL = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
NO_AOT = FULL[:3]


def _rand(*shape, seed=0, dtype=torch.float32, grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return t.requires_grad_(grad)


def _mask(*shape, seed=0):
    m = torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > 0.3
    m.view(-1, shape[-1])[0] = False  # a fully masked row
    return m


def test_ops_are_registered_under_the_package_namespace():
    assert backend.OP_NAMESPACE == kernels.__name__.partition(".")[0]
    for name in NAMES:
        assert hasattr(OPS, name), name
    schema = str(OPS.attention_fwd.default._schema)
    assert "Tensor? bias" in schema and "Tensor? mask" in schema and "str backend" in schema


def _permuted(t):
    """The same shape with a non-contiguous layout (a leaf, so it can require grad)."""
    return t.detach().transpose(-2, -3).contiguous().transpose(-2, -3).requires_grad_(t.requires_grad)


def _attention_args(backend_name, bias_shape, grad=True, permuted=False):
    lead_kv = (1, 3) if backend_name == "cpu" else (2, 3)  # the PyTorch path broadcasts k/v over q's lead
    q = _rand(2, 3, 5, 8, seed=1, grad=grad)
    q = _permuted(q) if permuted else q
    k, v = _rand(*lead_kv, 6, 8, seed=2, grad=grad), _rand(*lead_kv, 6, 8, seed=3, grad=grad)
    bias = None if bias_shape is None else _rand(*bias_shape, seed=4, grad=grad)
    return q, k, v, bias, _mask(2, 1, 1, 6, seed=5)


@pytest.mark.parametrize("backend_name, bias_shape, permuted", [
    ("cpu", (1, 3, 5, 6), False), ("cpu", (1, 1, 1, 6), True), ("cpu", None, False), ("triton", (1, 3, 1, 6), True)])
def test_opcheck_attention(backend_name, bias_shape, permuted):
    """Fakes match the real outputs' shapes, dtypes and strides (contiguous even for a permuted q)."""
    q, k, v, bias, mask = _attention_args(backend_name, bias_shape, permuted=permuted)
    assert q.is_contiguous() != permuted
    fwd_args = (q, k, v, bias, mask, 0.3, 2, backend_name)
    torch.library.opcheck(OPS.attention_fwd, fwd_args, test_utils=FULL if backend_name == "cpu" else NO_AOT)
    with torch.no_grad():
        out, lse = OPS.attention_fwd(*fwd_args)
    detached = [None if t is None else t.detach() for t in (q, k, v, bias)]
    for bias_grad in (bias is not None, False) if bias is not None else (False,):
        bwd_args = (torch.randn_like(out), *detached, mask, out, lse, 0.3, 2, bias_grad, backend_name)
        torch.library.opcheck(OPS.attention_bwd, bwd_args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend_name, x_shape, bias_shape, bias_dtype", [
    ("cpu", (2, 3, 5, 6), (2, 1, 5, 6), torch.float32),
    ("cpu", (3, 6), (2, 3, 6), torch.float64),  # a bias that widens x promotes the PyTorch path's dtype
    ("triton", (2, 3, 5, 6), (2, 1, 5, 6), torch.float32),
])
def test_opcheck_softmax(backend_name, x_shape, bias_shape, bias_dtype):
    x = _rand(*x_shape, seed=6, grad=True)
    x = _permuted(x) if len(x_shape) > 2 else x
    bias = _rand(*bias_shape, seed=7, dtype=bias_dtype, grad=True)
    mask = _mask(*x_shape[:-1], x_shape[-1], seed=8)
    args = (x, mask, bias, 0.5, backend_name)
    torch.library.opcheck(OPS.softmax_fwd, args, test_utils=FULL if backend_name == "cpu" else NO_AOT)
    with torch.no_grad():
        p = OPS.softmax_fwd(*args)
    torch.library.opcheck(OPS.softmax_bwd, (p, torch.randn_like(p), backend_name),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("affine", [True, False])
def test_opcheck_layer_norm(affine):
    x = _rand(2, 3, 8, seed=9, grad=True)
    w, b = (_rand(8, seed=10, grad=True), _rand(8, seed=11, grad=True)) if affine else (None, None)
    torch.library.opcheck(OPS.layer_norm_fwd, (x, w, b, 1e-5), test_utils=FULL if affine else NO_AOT)
    with torch.no_grad():
        _, mean, rstd = OPS.layer_norm_fwd(x, w, b, 1e-5)
    dw = None if w is None else w.detach()
    torch.library.opcheck(OPS.layer_norm_bwd, (torch.randn_like(x), x.detach(), dw, mean, rstd),
                          test_utils=("test_schema", "test_faketensor"))


def test_ops_reject_an_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        OPS.softmax_fwd(torch.randn(2, 3), None, None, 1.0, "cuda")


# ----------------------------------------------------------------------------------------------------------
# torch.compile


def _compile(fn):
    """fn compiled with fullgraph=True (a graph break raises) through AOTAutograd; returns it and its graphs."""
    graphs = []

    def record(gm, _example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record)), graphs


def _ours(gm) -> dict[str, list]:
    """Our custom ops in a graph, with their arguments."""
    return {str(n.target).split(".")[1]: list(n.args) for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith(backend.OP_NAMESPACE + ".")}


def _model(q, k, v, bias, x, sbias, w, b, *, mask, smask):
    o = kernels.attention(q, k, v, bias=bias, mask=mask)
    p = kernels.softmax(x, mask=smask, bias=sbias, scale=0.7)
    return kernels.layer_norm(o, w, b), p


def _model_inputs():
    g = torch.Generator().manual_seed(12)
    tensors = [torch.randn(*s, generator=g, dtype=torch.float64) for s in
               ((2, 2, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8), (2, 1, 5, 6), (2, 2, 3, 7), (2, 1, 3, 7), (8,), (8,))]
    kwargs = {"mask": _mask(2, 1, 1, 6, seed=13), "smask": _mask(2, 2, 1, 7, seed=14)}
    return tensors, kwargs


def _compiled_matches_reference(backend_name):
    """Compile `_model` under `backend_name`, check outputs and gradients against float64; return the graphs."""
    tensors, kwargs = _model_inputs()
    x64 = [t.clone().requires_grad_(True) for t in tensors]
    x32 = [t.float().requires_grad_(True) for t in tensors]
    xl = [t.float().requires_grad_(True) for t in tensors]
    compiled, graphs = _compile(functools.partial(_model, **kwargs))
    with kernels.use_backend(backend_name):
        outs = compiled(*x32)
    with kernels.use_backend("torch"):
        refs64, refsl = _model(*x64, **kwargs), _model(*xl, **kwargs)
    g = torch.Generator().manual_seed(15)
    cot = [torch.randn(r.shape, generator=g, dtype=torch.float64) for r in refs64]
    loss = lambda rs: sum((r * c.to(r.dtype)).sum() for r, c in zip(rs, cot))  # noqa: E731
    for name, a, b, c in zip(("layer_norm(attention)", "softmax"), outs, refsl, refs64):
        check(a, b, c.detach(), name, torch.float32)
    for i, (a, b, c) in enumerate(zip(torch.autograd.grad(loss(outs), x32), torch.autograd.grad(loss(refsl), xl),
                                      torch.autograd.grad(loss(refs64), x64))):
        check(a, b, c, f"grad of input {i}", torch.float32)
    assert len(graphs) == 2, "one forward and one backward graph"
    return graphs


def test_compile_fullgraph_pytorch_path():
    fw, bw = _compiled_matches_reference("auto")
    # layer_norm's PyTorch path is F.layer_norm, an aten op compile already sees
    assert set(_ours(fw)) == {"attention_fwd", "softmax_fwd"}
    assert set(_ours(bw)) == {"attention_bwd", "softmax_bwd"}
    assert all(args[-1] == "cpu" for args in _ours(fw).values())


def test_compile_fullgraph_triton():
    fw, bw = _compiled_matches_reference("triton")
    assert set(_ours(fw)) == {"attention_fwd", "softmax_fwd", "layer_norm_fwd"}
    assert set(_ours(bw)) == {"attention_bwd", "softmax_bwd", "layer_norm_bwd"}
    assert _ours(fw)["attention_fwd"][-1] == "triton" and _ours(bw)["softmax_bwd"][-1] == "triton"


def test_compile_reference_backend_has_no_custom_ops():
    """The backend is chosen while Dynamo traces: `torch` compiles the plain reference."""
    fw, bw = _compiled_matches_reference("torch")
    assert not _ours(fw) and not _ours(bw)


# ----------------------------------------------------------------------------------------------------------
# selective activation checkpointing


@pytest.mark.parametrize("save_ours", [True, False])
def test_selective_checkpointing_sees_the_ops(save_ours, monkeypatch):
    attention_module = importlib.import_module(kernels.__name__ + ".attention")
    calls = []
    chunked_fwd = attention_module._chunked_fwd
    monkeypatch.setattr(attention_module, "_chunked_fwd", lambda *a: calls.append(1) or chunked_fwd(*a))
    q, k, v, bias, mask = _attention_args("cpu", (1, 3, 5, 6))

    def fn(q, k, v, bias):
        o = kernels.attention(q, k, v, bias=bias, mask=mask, block_q=2)
        return kernels.softmax(o.sin(), bias=bias[..., :1, :1], scale=2.0)

    seen = []
    ours = {OPS.attention_fwd.default, OPS.softmax_fwd.default}

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return CheckpointPolicy.MUST_SAVE if save_ours and op in ours else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    out = checkpoint(fn, q, k, v, bias, use_reentrant=False, context_fn=context_fn)
    got = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
    assert ours <= set(seen)
    # saved: the forward ran once; recomputed: once more in the backward
    assert len(calls) == (1 if save_ours else 2)
    calls.clear()
    want = torch.autograd.grad(fn(q, k, v, bias).square().sum(), (q, k, v, bias))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
