"""The public API end to end on a GPU: torch.compile training steps, autograd corner cases, the
visible fallback on GPUs without a native kernel family, empty problems, odd gradient layouts."""

import warnings

import pytest
import torch

import fa4
from fa4.testing import attention_ref, check_close, random_qkv

SM80 = fa4.KernelOptions(arch="sm80")
pytestmark = pytest.mark.gpu


def _loss(q, k, v, g, **kw):
    out, lse = fa4.flash_attn_func(q, k, v, return_lse=True, **kw)
    return (out.float() * g.float()).sum() + lse.sum(), out, lse


def _grads_of(fn, q, k, v, g, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    loss, out, lse = fn(q, k, v, g, **kw)
    loss.backward()
    return out, lse, q.grad, k.grad, v.grad


def test_torch_compile_fullgraph_matches_eager():
    """fullgraph compile of the forward (custom op) with AOTAutograd's backward (registered autograd
    -> fa4::bwd) gives bit-identical results to eager (same kernels; deterministic backward)."""
    q, k, v = random_qkv(2, 300, 300, 8, 2, 128, torch.bfloat16, "cuda", seed=1)
    g = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    kw = dict(causal=True, deterministic=True, kernel_options=SM80)
    eager = _grads_of(_loss, q, k, v, g, **kw)
    torch._dynamo.reset()
    compiled = _grads_of(torch.compile(_loss, fullgraph=True), q, k, v, g, **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), eager, compiled):
        assert torch.equal(a, b), name


def test_torch_compile_module_training_step():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(256, 3 * 256, dtype=torch.bfloat16, device="cuda")

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 4, 64).unbind(2)  # strided views, no copies
            return fa4.flash_attn_func(q, k, v, causal=True, kernel_options=SM80)[0].sum()

    m = Block()
    x = torch.randn(2, 129, 256, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    loss = torch.compile(m, fullgraph=True)(x)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_expanded_output_gradient():
    """out.sum() hands the backward an expanded (stride 0) gradient: copied, not rejected."""
    q, k, v = random_qkv(1, 77, 77, 2, 2, 64, torch.float16, "cuda", requires_grad=True, seed=2)
    out, _ = fa4.flash_attn_func(q, k, v, kernel_options=SM80)
    out.sum().backward()
    q32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    attention_ref(*q32)[0].sum().backward()
    qlp = [t.detach().requires_grad_() for t in (q, k, v)]
    attention_ref(*qlp, upcast=False)[0].float().sum().backward()
    for name, t, r, p in zip(("dq", "dk", "dv"), (q, k, v), q32, qlp):
        check_close(name, t.grad, r.grad, p.grad, extra_atol=1e-3)


def test_natural_dispatch_on_this_gpu_falls_back_visibly(monkeypatch):
    monkeypatch.delenv("FA4_ARCH", raising=False)
    from fa4 import arch

    arch._warned.clear()
    q, k, v = random_qkv(1, 64, 64, 2, 2, 64, torch.bfloat16, "cuda", seed=3)
    cc = torch.cuda.get_device_capability()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out, _ = fa4.flash_attn_func(q, k, v)
    if cc[0] == 10:  # no sm100 kernels yet: the sm80 family runs, with a warning
        assert any("fa4.explain" in str(x.message) for x in w)
        assert "fallback" in str(fa4.explain(q, k, v))
    if cc[0] == 9:  # the Hopper forward is native: no warning for a forward-only call
        assert not any("fa4.explain" in str(x.message) for x in w)
        assert "[fwd] family=sm90" in str(fa4.explain(q, k, v))
    ref = attention_ref(q, k, v)[0]
    check_close("out", out, ref, attention_ref(q, k, v, upcast=False)[0])


@pytest.mark.parametrize("shape_q,shape_k", [((0, 5, 2, 64), (0, 5, 2, 64)), ((2, 0, 2, 64), (2, 7, 2, 64)),
                                              ((2, 9, 2, 64), (2, 0, 2, 64))])
def test_empty_problems(shape_q, shape_k):
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape_k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape_k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, lse = fa4.flash_attn_func(q, k, v, return_lse=True, kernel_options=SM80)
    assert out.shape == q.shape and lse.shape == (shape_q[0], shape_q[2], shape_q[1])
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_cache_info_counts_this_process():
    info0 = fa4.cache_info()
    q, k, v = random_qkv(1, 64, 64, 2, 2, 64, torch.bfloat16, "cuda", seed=4)
    fa4.flash_attn_func(q, k, v, kernel_options=SM80)
    fa4.flash_attn_func(q, k, v, kernel_options=SM80)
    info1 = fa4.cache_info()
    assert info1["memory_hits"] >= info0["memory_hits"] + 1


@pytest.mark.parametrize("how", ["none", "cuda_tensor", "cpu_tensor"])
def test_varlen_max_seqlen_optional(how):
    """flash_attn.cute-style calls: max_seqlen_q/k omitted or given as 0-dim tensors (issue 9)."""
    from fa4.testing import random_varlen

    vb = random_varlen(4, 300, 4, 2, 128, torch.bfloat16, "cuda", max_seqlen_k=500, seed=8)
    mq, mk = {"none": (None, None),
              "cuda_tensor": (torch.tensor(vb.max_seqlen_q, device="cuda"), torch.tensor(vb.max_seqlen_k, device="cuda")),
              "cpu_tensor": (torch.tensor(vb.max_seqlen_q), torch.tensor(vb.max_seqlen_k))}[how]
    out, lse = fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                                          max_seqlen_q=mq, max_seqlen_k=mk, causal=True, return_lse=True)
    ref = attention_ref(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, causal=True)
    low = attention_ref(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, causal=True,
                        upcast=False)
    check_close("out", out, ref[0], low[0])
    check_close("lse", lse, ref[1], low[1])


@pytest.mark.gpu
def test_bad_bwd_kv_split_raises_before_the_forward(monkeypatch):
    """A bwd_kv_split that does not fit the problem is refused when the forward is called with inputs
    that require grad (not later, in autograd's backward), and before any kernel launch."""
    q = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 256, 1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    from fa4 import ops

    def no_launch(*a, **kw):
        raise AssertionError("the forward ran")
    monkeypatch.setattr(ops, "forward", no_launch)
    with pytest.raises(ValueError, match="bwd_kv_split=8 must divide the GQA group"):
        fa4.flash_attn_func(q, k, k, kernel_options=fa4.KernelOptions(bwd_kv_split=8))
    with torch.no_grad():  # no backward asked: the option is not read
        monkeypatch.undo()
        out, _ = fa4.flash_attn_func(q, k, k, kernel_options=fa4.KernelOptions(bwd_kv_split=8))
    assert out.shape == q.shape


def _grads_check(out, inputs, ref_kw, lse=None):
    """Gradients of ``out`` (and ``lse``) against the float32 reference's, by the pass rule with the floor."""
    from fa4.testing import grad_noise_floor

    gen = torch.Generator("cuda").manual_seed(3)
    g = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    glse = None if lse is None else torch.randn(lse.shape, device="cuda", generator=gen)

    def grads(outs, wrt, g_out):
        o, l_ = outs
        if glse is None:
            return torch.autograd.grad(o, wrt, g_out)
        return torch.autograd.grad((o, l_), wrt, (g_out, glse))

    got = grads((out, lse), inputs, g)
    q32 = [t.detach().float().requires_grad_() for t in inputs]
    want = grads(attention_ref(*q32, **ref_kw), q32, g.float())
    qlp = [t.detach().requires_grad_() for t in inputs]
    pt = grads(attention_ref(*qlp, upcast=False, **ref_kw), qlp, g)
    floors = grad_noise_floor(*inputs, g)
    for name, a, r, p in zip(("dq", "dk", "dv"), got, want, pt):
        check_close(name, a, r, p, extra_atol=floors[name])


@pytest.mark.parametrize("d,dv", [(8, 8), (16, 16), (24, 24), (64, 16), (16, 64)])
@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_small_head_dims(d, dv, family):
    """Note [Small head dims]: flash_attn.cute's head dims 8-24 (q/k or v) run on zero-padded copies:
    outputs, lse and gradients against the float32 reference; out is v's head dim and contiguous."""
    if family == "sm90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels run on compute capability 9.x only")
    if family == "sm80" and dv != d:
        pytest.skip("the sm80 backward takes head_dim_v == head_dim only")
    gen = torch.Generator("cuda").manual_seed(d + dv)
    q = torch.randn(2, 200, 4, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    k = torch.randn(2, 300, 2, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    v = torch.randn(2, 300, 2, dv, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True,
                                       kernel_options=fa4.KernelOptions(arch=family))
    assert out.shape == (2, 200, 4, dv) and out.is_contiguous()
    ref_out, ref_lse = attention_ref(q.float(), k.float(), v.float(), causal=True)
    pt_out, pt_lse = attention_ref(q, k, v, causal=True, upcast=False)
    check_close("out", out, ref_out, pt_out)
    check_close("lse", lse, ref_lse, pt_lse)
    _grads_check(out, (q, k, v), dict(causal=True), lse)


def test_transposed_inputs_give_contiguous_out_and_right_gradients():
    """Note [Contiguous outputs]: q, k, v as (b, s, h, d) views of SDPA's (b, h, s, d) memory: out is
    contiguous (``out.view(b, s, h * d)`` works), and outputs and gradients pass the reference."""
    b, h, s, d = 2, 8, 257, 128
    gen = torch.Generator("cuda").manual_seed(7)
    base = [torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
            for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.is_contiguous()
    out.view(b, s, h * d)
    ref_out, ref_lse = attention_ref(q.float(), k.float(), v.float(), causal=True)
    pt_out, pt_lse = attention_ref(q, k, v, causal=True, upcast=False)
    check_close("out", out, ref_out, pt_out)
    _grads_check(out, (q, k, v), dict(causal=True))


def test_lse_without_return_lse_in_training():
    """Note [lse with inputs that require grad]: a training call gives the lse without return_lse, the
    same as with it, and a loss on it gives the same gradients as with return_lse=True."""
    q, k, v = random_qkv(2, 300, 300, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=4)
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, deterministic=True)
    out2, lse2 = fa4.flash_attn_func(q, k, v, causal=True, deterministic=True, return_lse=True)
    assert lse is not None and torch.equal(lse, lse2) and torch.equal(out, out2)
    g = torch.randn_like(out)
    a = torch.autograd.grad((out.float() * g.float()).sum() + lse.sum(), (q, k, v))
    b = torch.autograd.grad((out2.float() * g.float()).sum() + lse2.sum(), (q, k, v))
    for name, x, y in zip(("dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), name


def test_small_head_dim_under_torch_compile():
    """Note [Small head dims] traced whole (fullgraph): the padding and its one-time warning in the
    graph, the same outputs and gradients as eager."""
    q, k, v = random_qkv(2, 100, 100, 4, 4, 16, torch.bfloat16, "cuda", seed=6)
    g = torch.randn(2, 100, 4, 16, device="cuda", dtype=torch.bfloat16)
    kw = dict(causal=True, deterministic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = _grads_of(_loss, q, k, v, g, **kw)
        torch._dynamo.reset()
        compiled = _grads_of(torch.compile(_loss, fullgraph=True), q, k, v, g, **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), eager, compiled):
        assert torch.equal(a, b), name


def _layouts(t, kind):
    """``t``'s values in a layout the kernels cannot read in place (Note [Copied layouts])."""
    if kind == "transposed":  # last stride != 1
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "odd-stride":  # head rows 4 elements apart: strides not multiples of 8
        wide = torch.empty(*t.shape[:-1], t.shape[-1] + 4, dtype=t.dtype, device=t.device)
        wide[..., :t.shape[-1]] = t
        return wide[..., :t.shape[-1]]
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)  # "misaligned": 2 bytes past a 16-byte base
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.parametrize("kind", ["transposed", "odd-stride", "misaligned"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_copied_layouts_match_contiguous(kind, varlen):
    """Note [Copied layouts]: q, k, v that the kernels cannot read in place (as flash_attn.cute takes
    them) run on contiguous copies: the same out, lse and gradients, bit for bit, as the contiguous
    inputs, the gradients in the caller's layout."""
    q, k, v = random_qkv(2, 113, 203, 8, 2, 64, torch.bfloat16, "cuda", seed=7)
    g = torch.randn(2, 113, 8, 64, device="cuda", dtype=torch.bfloat16)
    if varlen:
        q, k, v, g = (t.flatten(0, 1) for t in (q, k, v, g))
        cu_q = torch.tensor([0, 113, 226], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 203, 406], dtype=torch.int32, device="cuda")

        def fn(q, k, v, g):
            out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=113,
                                                  max_seqlen_k=203, causal=True, return_lse=True)
            return (out.float() * g.float()).sum() + lse.sum(), out, lse
    else:
        def fn(q, k, v, g):
            return _loss(q, k, v, g, causal=True)
    want = _grads_of(fn, q, k, v, g)
    for name in ("q", "k", "v"):
        args = {"q": q, "k": k, "v": v}
        args[name] = _layouts(args[name], kind)
        assert fa4.validate.layout_misfit(args[name]) is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the odd layout itself is the leaf the gradient lands on
            leaves = {n: t.detach().requires_grad_() for n, t in args.items()}
            assert fa4.validate.layout_misfit(leaves[name]) is not None
            loss, out, lse = fn(leaves["q"], leaves["k"], leaves["v"], g)
            loss.backward()
        got = (out, lse, leaves["q"].grad, leaves["k"].grad, leaves["v"].grad)
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), want, got):
            assert torch.equal(a, b), (name, what)


@pytest.mark.parametrize("kind", ["transposed", "misaligned"])
def test_copied_layouts_under_torch_compile(kind):
    """q in a layout the kernels cannot read in place (Note [Copied layouts]) under
    torch.compile(fullgraph=True): a transposed q's copy is traced into the graph (no graph break); a
    misaligned one, whose pointer a trace cannot see, is copied in the fa4::fwd op (and the
    backward's launcher). The results match eager's bit for bit."""
    q, k, v = random_qkv(2, 300, 300, 8, 2, 128, torch.bfloat16, "cuda", seed=3)
    g = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    qt = _layouts(q, kind)
    kw = dict(causal=True, deterministic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = _grads_of(_loss, q, k, v, g, **kw)
        torch._dynamo.reset()
        qt_leaf = qt.detach().requires_grad_()
        k_leaf, v_leaf = (t.detach().clone().requires_grad_() for t in (k, v))
        loss, out, lse = torch.compile(_loss, fullgraph=True)(qt_leaf, k_leaf, v_leaf, g, **kw)
        loss.backward()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), eager, (out, lse, qt_leaf.grad, k_leaf.grad, v_leaf.grad)):
        assert torch.equal(a, b), name
