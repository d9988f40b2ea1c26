"""torch integration on the CPU: the custom ops trace under torch.compile(fullgraph=True) with fake
CUDA tensors (no graph break, forward and backward), and their fake implementations give the
shapes the real kernels produce."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fa4


def _cuda(*shape, dtype=torch.bfloat16, requires_grad=False):
    return torch.empty(*shape, dtype=dtype, device="cuda", requires_grad=requires_grad)


class Attn(torch.nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        out, lse = fa4.flash_attn_func(q, k, v, causal=self.causal, return_lse=True)
        return out.float().sum() + lse.sum(), out


def _compile_graphs(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    return compiled, graphs


@pytest.mark.parametrize("causal", [False, True])
def test_fullgraph_forward_trace(causal):
    with FakeTensorMode():
        q, k, v = _cuda(2, 37, 8, 64), _cuda(2, 53, 2, 64), _cuda(2, 53, 2, 64)
        compiled, graphs = _compile_graphs(Attn(causal), q, k, v)
        loss, out = compiled(q, k, v)
    assert len(graphs) == 1, "graph break"
    code = graphs[0].code
    assert "fa4.fwd" in code, code
    assert out.shape == q.shape and out.dtype == q.dtype


def test_fullgraph_varlen_trace():
    def f(q, k, v, cu_q, cu_k):
        out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=40,
                                              max_seqlen_k=70, causal=True, return_lse=True)
        return out, lse

    with FakeTensorMode():
        q, k, v = _cuda(100, 8, 128), _cuda(150, 8, 128), _cuda(150, 8, 128)
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        compiled, graphs = _compile_graphs(f)
        out, lse = compiled(q, k, v, cu, cu)
    assert len(graphs) == 1
    assert out.shape == (100, 8, 128) and lse.shape == (8, 100) and lse.dtype == torch.float32


def test_registered_backward_calls_the_bwd_op():
    """The autograd formula registered on fa4::fwd traces to one fa4::bwd call with the saved
    tensors. (A CPU-only torch cannot build autograd graphs over fake CUDA tensors, so the formula
    is traced directly; the GPU tests run torch.compile training steps end to end.)"""
    from types import SimpleNamespace

    from torch.fx.experimental.proxy_tensor import make_fx

    from fa4 import ops

    def formula(q, k, v, out, lse, dout, dlse):
        ctx = SimpleNamespace(saved_tensors=(q, k, v, out, lse, None, None, None, None, None, None, None, None),
                              scalars=(33, 33, 0.125, True, False, 33, 0, 0.0, True, "", ""), return_lse=True,
                              needs_input_grad=(True,) * 27)
        return ops._fwd_backward(ctx, dout, dlse)[:3]

    with FakeTensorMode():
        q = _cuda(2, 33, 4, 64)
        lse = torch.empty(2, 4, 33, device="cuda")
        gm = make_fx(formula, tracing_mode="fake")(q, q, q, q, lse, q, lse)
    code = gm.code
    assert "fa4.bwd.default" in code and code.count("fa4.bwd") == 1, code


def test_fake_impl_shapes():
    from fa4 import ops

    with FakeTensorMode():
        q, k = _cuda(3, 11, 6, 96), _cuda(3, 29, 2, 96)
        out, lse = ops.fwd_op(q, k, k, None, None, None, 11, 29, 0.1, False, False, 29, 29, 0.0, True, False, "")
        assert out.shape == q.shape and lse.shape == (3, 6, 11)
        out, lse = ops.fwd_op(q, k, k, None, None, None, 11, 29, 0.1, False, False, 29, 29, 0.0, False, False, "")
        assert lse.numel() == 0
        dq, dk, dv = ops.bwd_op(out, q, k, k, out, lse, None, None, None, None, 11, 29, 0.1, False, False, 29, 29,
                                0.0, False, "")
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_fullgraph_inference_arguments_trace():
    """The issue-9 arguments trace with no graph break: mixed layouts (packed q, batched k/v),
    seqused_q, a paged K/V cache, num_splits / pack_gqa. (learnable_sink adds torch elementwise ops,
    which a CPU-only torch cannot run on fake CUDA tensors: its compiled path is a GPU test.)"""
    def f(q, kb, vb, kc, vc, cu_q, used, table):
        o1, l1 = fa4.flash_attn_varlen_func(q, kb, vb, cu_seqlens_q=cu_q, max_seqlen_q=40, seqused_q=used,
                                            num_splits=3, pack_gqa=True, return_lse=True)
        o2, l2 = fa4.flash_attn_varlen_func(q, kc, vc, cu_seqlens_q=cu_q, max_seqlen_q=40, page_table=table,
                                            seqused_k=used, return_lse=True)
        return o1, l1, o2, l2

    with FakeTensorMode():
        q = _cuda(100, 8, 128)
        kb, vb = _cuda(3, 70, 2, 128), _cuda(3, 70, 2, 128)
        kc, vc = _cuda(20, 16, 2, 128), _cuda(20, 16, 2, 128)
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        used = torch.empty(3, dtype=torch.int32, device="cuda")
        table = torch.empty(3, 5, dtype=torch.int32, device="cuda")
        compiled, graphs = _compile_graphs(f)
        o1, l1, o2, l2 = compiled(q, kb, vb, kc, vc, cu, used, table)
    assert len(graphs) == 1, "graph break"
    assert graphs[0].code.count("fa4.fwd") == 2
    assert o1.shape == o2.shape == (100, 8, 128) and l1.shape == l2.shape == (8, 100)
