"""flash_attn.cute-style call sequences, run unchanged on fa4 (issue 9), on the GPU.

Each test makes the calls a flash_attn.cute user makes, with that API's argument names and shapes:
varlen without ``max_seqlen``, ``seqused_q``, the mixed layouts (packed q with batched k/v and the
reverse, forward and backward), a paged KV cache (``page_table``; compared bit for bit with the
same K/V unpaged, and against the float32 reference), split-KV through ``num_splits``, and
``flash_attn_combine`` merging partial results computed on chunks of the keys (how ring / context
parallel attention uses it). Outputs are NaN-filled by the conftest.
"""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4.interface import _apply_sink
from fa4.testing import attention_ref, check_close, grad_noise_floor, random_qkv, random_varlen
from fwd_cases import check


FAMILIES = {"sm90": fa4.KernelOptions(arch="sm90"), "sm80": fa4.KernelOptions(arch="sm80")}


@pytest.fixture(autouse=True)
def _hopper_only(request):
    family = getattr(request.node, "callspec", None) and request.node.callspec.params.get("family", "sm90")
    if (family != "sm80" and "gpu" in request.keywords and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] != 9):
        pytest.skip("the sm90 kernels run on compute capability 9.x only")


def _cu(lengths, device="cuda"):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("max_seqlen", [None, "tensor"])
def test_varlen_without_max_seqlen(max_seqlen):
    vb = random_varlen(5, 300, 8, 2, 128, torch.bfloat16, "cuda", seed=1)
    ms = (None, None) if max_seqlen is None else (torch.tensor(vb.max_seqlen_q, device="cuda"),
                                                  torch.tensor(vb.max_seqlen_k, device="cuda"))
    out, lse = fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q,
                                          cu_seqlens_k=vb.cu_seqlens_k, max_seqlen_q=ms[0], max_seqlen_k=ms[1],
                                          causal=True, return_lse=True)
    check(out, lse, vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_without_max_seqlen_backward(deterministic):
    """The gradients of a varlen GQA causal call without max_seqlen (v0.38: its launch sections are
    judged on the average lengths, its forward runs the compact grid): the reference rule, and with
    ``deterministic`` the bits of the same call with the lengths given (the sections order the CTAs,
    never a dQ slot's adds; the forward's outputs are compared first)."""
    lens = [1, 700, 5, 1000, 130, 300, 2, 900]  # a longest length over twice the average
    # 8 kv heads: 64 (batch, kv head) pairs, so the sections differ (the average: 64 pairs, the
    # lengths: 32, the bound: 16); with 2 kv heads every rule gives all 16 pairs.
    h, hk, d = 32, 8, 128
    cu = _cu(lens)
    g = torch.Generator("cuda").manual_seed(7)
    q = torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(sum(lens), hk, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    dout = torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, return_lse=True, deterministic=deterministic)
    out, lse = fa4.flash_attn_varlen_func(q, k, v, **kw)
    got = torch.autograd.grad(out, (q, k, v), dout)
    check(out, lse, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    leaves32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    leaveslp = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention_ref(*leaves32, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)[0], leaves32,
                              dout.float())
    pt = torch.autograd.grad(attention_ref(*leaveslp, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, upcast=False)[0],
                             leaveslp, dout)
    floors = grad_noise_floor(q, k, v, dout)
    for name, a, r, p in zip(("dq", "dk", "dv"), got, ref, pt):
        check_close(name, a, r, p, extra_atol=floors[name])
    if deterministic:
        out2, lse2 = fa4.flash_attn_varlen_func(q, k, v, max_seqlen_q=max(lens), max_seqlen_k=max(lens), **kw)
        assert torch.equal(out2, out) and torch.equal(lse2, lse)
        for a, b in zip(got, torch.autograd.grad(out2, (q, k, v), dout)):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("packed_q", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_seqused_q(family, splits, packed_q, causal):
    """Only the first seqused_q[b] queries of each sequence are computed and written (the rest of
    out keeps what it held: NaN here)."""
    b, sq, sk, h, hk, d = 4, 37, 300, 8, 2, 64
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=2)
    used = torch.tensor([37, 1, 20, 5], dtype=torch.int32, device="cuda")
    if packed_q:
        cu_q = _cu([sq] * b)
        out, lse = fa4.flash_attn_varlen_func(q.reshape(b * sq, h, d), k, v, cu_seqlens_q=cu_q, seqused_q=used,
                                              causal=causal, return_lse=True, num_splits=splits,
                                              kernel_options=FAMILIES[family])
        out, lse = out.reshape(b, sq, h, d), lse.reshape(h, b, sq).transpose(0, 1)
    else:
        out, lse = fa4.flash_attn_varlen_func(q, k, v, seqused_q=used, causal=causal, return_lse=True,
                                              num_splits=splits, kernel_options=FAMILIES[family])
    for i, n in enumerate(used.tolist()):
        # A sequence of n queries attends bottom-right aligned to its sk keys.
        check(out[i:i + 1, :n], lse[i:i + 1, :, :n], q[i:i + 1, :n], k[i:i + 1], v[i:i + 1], causal=causal)
        assert out[i, n:].isnan().all()  # not written


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("which", ["packed_q", "packed_kv"])
def test_mixed_layouts_forward_and_backward(family, which):
    """Packed q with batched k/v, and batched q with packed k/v: against the same call with both
    sides packed (the reference's layout), forward and gradients."""
    b, h, hk, d = 3, 8, 2, 128
    lens_q, sk = [5, 1, 130], 257
    lens_k, sq = [300, 1, 70], 33
    if which == "packed_q":
        q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=_cu(lens_q), causal=True, return_lse=True,
                                              kernel_options=FAMILIES[family])
        cu_q, cu_k = _cu(lens_q), _cu([sk] * b)
        ref_args = (q, k.reshape(b * sk, hk, d), v.reshape(b * sk, hk, d))
    else:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_k=_cu(lens_k), causal=True, return_lse=True,
                                              kernel_options=FAMILIES[family])
        cu_q, cu_k = _cu([sq] * b), _cu(lens_k)
        ref_args = (q.reshape(b * sq, h, d), k, v)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    out_ref, lse_ref = attention_ref(*ref_args, **kw)
    out_pt, lse_pt = attention_ref(*ref_args, upcast=False, **kw)
    o = out.reshape(out_ref.shape)
    check_close("out", o, out_ref, out_pt)
    lse_flat = lse if which == "packed_q" else lse.permute(1, 0, 2).reshape(h, -1)
    check_close("lse", lse_flat, lse_ref, lse_pt)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    leaves32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    leaveslp = [t.detach().requires_grad_() for t in (q, k, v)]

    def ref_out(ts, upcast):
        a = (ts[0], ts[1].reshape(b * sk, hk, d), ts[2].reshape(b * sk, hk, d)) if which == "packed_q" else (
            ts[0].reshape(b * sq, h, d), ts[1], ts[2])
        return attention_ref(*a, upcast=upcast, **kw)[0]

    gflat = g.reshape(out_ref.shape)
    ref = torch.autograd.grad(ref_out(leaves32, True), leaves32, gflat.float())
    pt = torch.autograd.grad(ref_out(leaveslp, False), leaveslp, gflat)
    floors = grad_noise_floor(q, k, v, g)
    for name, a, r, p in zip(("dq", "dk", "dv"), got, ref, pt):
        check_close(name, a, r, p, extra_atol=floors[name])


def _paged(k, v, lens, page_size, gen):
    """Scatter batched k/v (b, sk, hk, d) into a shuffled paged cache with room to spare; pages past a
    sequence's length hold NaN (unused cache slots may hold anything)."""
    b, sk = k.shape[:2]
    max_pages = -(-sk // page_size)
    num_pages = b * max_pages + 3
    perm = torch.randperm(num_pages, generator=gen)[: b * max_pages].reshape(b, max_pages)
    kc = torch.full((num_pages, page_size) + k.shape[2:], float("nan"), dtype=k.dtype, device=k.device)
    vc = torch.full_like(kc, float("nan"))
    for i in range(b):
        for p in range(max_pages):
            rows = slice(p * page_size, min((p + 1) * page_size, lens[i]))
            n = rows.stop - rows.start
            if n > 0:
                kc[perm[i, p], :n] = k[i, rows]
                vc[perm[i, p], :n] = v[i, rows]
    return kc, vc, perm.to(torch.int32).to(k.device)


PAGED_CASES = [(f, p, d) for f in FAMILIES for p in (1, 16, 48, 128, 256) for d in (128,)] + [
    ("sm90", p, 256) for p in (16, 128, 256)]  # d256: tile_n 80, blocks straddle pages


@pytest.mark.gpu
@pytest.mark.parametrize("family,page_size,d", PAGED_CASES)
@pytest.mark.parametrize("shape", [(5, 1, 1000, 32, 8), (3, 40, 700, 8, 2)], ids=["decode", "prefill"])
@pytest.mark.parametrize("causal", [False, True])
def test_paged_kv(family, page_size, d, shape, causal):
    """Paged K/V through page_table: bit for bit the same K/V unpaged (seqused_k lengths), and the
    float32 reference's rule (sm80 and page sizes the TMA path does not take: gathered first)."""
    b, sq, sk, h, hk = shape
    opts = FAMILIES[family]
    gen = torch.Generator().manual_seed(page_size + sq)
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=page_size)
    lens = torch.randint(1, sk + 1, (b,), generator=gen).tolist()
    lens[0] = sk
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kc, vc, pt = _paged(k, v, lens, page_size, gen)
    max_pages = pt.shape[1]
    out, lse = fa4.flash_attn_varlen_func(q, kc, vc, page_table=pt, seqused_k=used, causal=causal, return_lse=True,
                                          kernel_options=opts)
    # The same call unpaged: batched k/v of max_pages * page_size rows.
    pad = max_pages * page_size - sk
    kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad))
    vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad))
    out_u, lse_u = fa4.flash_attn_varlen_func(q, kp, vp, seqused_k=used, causal=causal, return_lse=True,
                                              kernel_options=opts)
    assert torch.equal(out, out_u)
    assert torch.equal(lse, lse_u)
    for i, n in enumerate(lens):
        check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 256])
def test_paged_kv_without_seqused_k(page_size):
    """Without seqused_k every sequence has the table's capacity, max_pages * page_size keys."""
    b, sk, h, hk, d = 2, 512, 8, 2, 128
    gen = torch.Generator().manual_seed(page_size)
    q, k, v = random_qkv(b, 3, sk, h, hk, d, torch.bfloat16, "cuda", seed=5)
    kc, vc, pt = _paged(k, v, [sk] * b, page_size, gen)
    out, lse = fa4.flash_attn_varlen_func(q, kc, vc, page_table=pt, causal=True, return_lse=True)
    check(out, lse, q, k, v, causal=True)


@pytest.mark.gpu
def test_paged_kv_with_splits_and_pack():
    b, sk, h, hk, d = 4, 5000, 32, 8, 128
    gen = torch.Generator().manual_seed(9)
    q, k, v = random_qkv(b, 1, sk, h, hk, d, torch.bfloat16, "cuda", seed=9)
    lens = [5000, 17, 4096, 1]
    kc, vc, pt = _paged(k, v, lens, 16, gen)
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for splits in (None, 1, 6):
        out, lse = fa4.flash_attn_varlen_func(q, kc, vc, page_table=pt, seqused_k=used, num_splits=splits,
                                              return_lse=True)
        for i, n in enumerate(lens):
            check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n])


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [2, 5])
def test_combine_of_key_chunks(chunks):
    """flash_attn_combine merges attention over disjoint key chunks (return_lse=True each) into the
    attention over all keys (dense and packed layouts)."""
    b, sq, sk, h, hk, d = 2, 50, 3000, 8, 2, 128
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=chunks)
    bounds = torch.linspace(0, sk, chunks + 1).round().long().tolist()
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        o, l = fa4.flash_attn_func(q, k[:, lo:hi], v[:, lo:hi], return_lse=True)
        outs.append(o.float())
        lses.append(l.transpose(1, 2))  # (b, sq, h)
    out, lse = fa4.flash_attn_combine(torch.stack(outs), torch.stack(lses), out_dtype=torch.bfloat16)
    check(out, lse.transpose(1, 2), q, k, v)
    # Packed (varlen) partials: (splits, total_q, h, d) / (splits, total_q, h).
    out_v, lse_v = fa4.flash_attn_combine(torch.stack(outs).flatten(1, 2), torch.stack(lses).flatten(1, 2),
                                          out_dtype=torch.bfloat16, cu_seqlens=_cu([sq] * b))
    assert torch.equal(out_v, out.flatten(0, 1))
    assert torch.equal(lse_v, lse.flatten(0, 1))


def _sink_ref(q, k, v, sink, causal, upcast):
    """Attention with a sink logit per q head appended to every row's scores (value 0), computed
    explicitly (float32 when ``upcast``, else in the input dtype)."""
    from fa4.testing import attention_mask

    dt = torch.float32 if upcast else q.dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    allowed = attention_mask(q.shape[1], k.shape[1], causal=causal, device=q.device)
    s = s.masked_fill(~allowed, float("-inf"))
    col = sink.to(dt)[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
    full = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(full.float(), dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 500), (77, 300), (300, 77)])
def test_learnable_sink_forward_and_backward(family, causal, sq, sk):
    """learnable_sink: forward (out, lse) and the gradients of q, k, v and the sink, against the
    explicit reference with the sink column, under the pass rule."""
    b, h, hk, d = 2, 8, 2, 64
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=sq, requires_grad=True)
    torch.manual_seed(sq + 1000 * causal)  # the sink and dout too: not the draws of whichever test ran before
    sink = (torch.randn(h, device="cuda") * 2).requires_grad_()
    out, lse = fa4.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, return_lse=True,
                                   kernel_options=FAMILIES[family])
    ref, lse_ref = _sink_ref(q, k, v, sink, causal, True)
    pt, lse_pt = _sink_ref(q, k, v, sink, causal, False)
    check_close("out", out, ref, pt)
    check_close("lse", lse, lse_ref, lse_pt)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, sink), g)
    want = torch.autograd.grad(ref, (q, k, v, sink), g.float())
    want_pt = torch.autograd.grad(pt, (q, k, v, sink), g)
    floors = grad_noise_floor(q, k, v, g)
    for name, a, r, p in zip(("dq", "dk", "dv"), got[:3], want[:3], want_pt[:3]):
        check_close(name, a, r, p, extra_atol=floors[name])
    # dsink = -sum over rows of p_sink * (dout . out): the sum cancels, and the bf16 rounding of out
    # dominates it (RESULTS v0.7: out rounded exactly from float32 gives larger errors than fa4 on
    # some of these inputs). So the bf16 baselines are both ways of computing it in the input dtype:
    # PyTorch with a sink column, and PyTorch's own bf16 attention composed with the sink like fa4's.
    o_pt, lse_pt0 = attention_ref(q.detach(), k.detach(), v.detach(), causal=causal, upcast=False)
    s_pt = sink.detach().clone().requires_grad_()
    composed, _ = _apply_sink(o_pt, lse_pt0, s_pt, False, False)
    dsink_composed = torch.autograd.grad(composed, s_pt, g)[0]
    err = lambda x: (x.float() - want[3]).abs().max().item()  # noqa: E731
    assert err(got[3]) <= 2 * max(err(want_pt[3]), err(dsink_composed)) + 1e-3 * want[3].abs().max().item()


@pytest.mark.gpu
def test_torch_compile_inference_calls():
    """torch.compile(fullgraph=True) over a decode step with a paged cache and a learnable sink,
    and over a split, packed call: the same results as eager."""
    b, sk, h, hk, d = 3, 900, 8, 2, 128
    gen = torch.Generator().manual_seed(4)
    q, k, v = random_qkv(b, 1, sk, h, hk, d, torch.bfloat16, "cuda", seed=4)
    lens = [900, 5, 333]
    kc, vc, pt = _paged(k, v, lens, 16, gen)
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sink = torch.randn(h, device="cuda")

    def step(q, kc, vc, pt, used, sink):
        return fa4.flash_attn_varlen_func(q, kc, vc, page_table=pt, seqused_k=used, learnable_sink=sink,
                                          return_lse=True)

    def split(q, k, v):
        return fa4.flash_attn_func(q, k, v, num_splits=4, pack_gqa=True, return_lse=True)

    torch._dynamo.reset()
    for fn, args, exact in ((step, (q, kc, vc, pt, used, sink), False), (split, (q, k, v), True)):
        eager = fn(*args)
        compiled = torch.compile(fn, fullgraph=True)(*args)
        for a, e in zip(compiled, eager):
            if exact:  # only fa4's kernels: bit-identical
                assert torch.equal(a, e)
            else:  # the sink's elementwise steps may be fused by inductor: rounding differences only
                torch.testing.assert_close(a.float(), e.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
def test_learnable_sink_packed_q():
    """learnable_sink with packed q (the LSE is (h, total_q)) against the explicit reference, per
    sequence; and a -inf sink on rows with no key gives out 0, not NaN."""
    b, sq, sk, h, hk, d = 3, 20, 100, 8, 2, 64
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=8)
    sink = torch.randn(h, device="cuda")
    out, lse = fa4.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                          cu_seqlens_q=_cu([sq] * b), cu_seqlens_k=_cu([sk] * b), causal=True,
                                          learnable_sink=sink, return_lse=True)
    ref, lse_ref = _sink_ref(q, k, v, sink, True, True)
    pt, lse_pt = _sink_ref(q, k, v, sink, True, False)
    check_close("out", out.unflatten(0, (b, sq)), ref, pt)
    check_close("lse", lse.unflatten(1, (b, sq)).transpose(0, 1), lse_ref, lse_pt)
    # sq > sk causal: the first rows see no key; with a -inf sink they stay 0 / -inf.
    q2, k2, v2 = random_qkv(1, 50, 20, h, hk, d, torch.bfloat16, "cuda", seed=9)
    out2, lse2 = fa4.flash_attn_func(q2, k2, v2, causal=True, learnable_sink=torch.full((h,), -torch.inf,
                                                                                         device="cuda"),
                                     return_lse=True)
    assert not out2.isnan().any() and (out2[:, :30] == 0).all() and (lse2[:, :, :30] == -torch.inf).all()


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_learnable_sink_with_split_kv(family, num_splits):
    """A decode-like call with a sink and split-KV: the partials are over the keys alone and the
    combine adds the sink (branch wip/sink-in-kernel); the same results as the reference with a
    sink column, and as the unsplit call within the pass rule."""
    b, sq, sk, h, hk, d = 4, 3, 2000, 8, 2, 128
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=num_splits)
    torch.manual_seed(num_splits)
    sink = torch.randn(h, device="cuda") * 3
    out, lse = fa4.flash_attn_func(q, k, v, learnable_sink=sink, num_splits=num_splits, return_lse=True,
                                   kernel_options=FAMILIES[family])
    ref, lse_ref = _sink_ref(q, k, v, sink, False, True)
    pt, lse_pt = _sink_ref(q, k, v, sink, False, False)
    check_close("out", out, ref, pt)
    check_close("lse", lse, lse_ref, lse_pt)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_learnable_sink_gradient_alone(family):
    """Only the sink takes a gradient (q, k, v frozen): no backward kernel is needed, and the
    forward-only arguments (seqused_q) still work, as they did with the host composition."""
    b, sq, sk, h, hk, d = 2, 40, 300, 8, 2, 64
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=5)
    torch.manual_seed(5)
    sink = (torch.randn(h, device="cuda") * 2).requires_grad_()
    g = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    ref, _ = _sink_ref(q, k, v, sink, False, True)
    want = torch.autograd.grad(ref, sink, g.float())[0]
    out = fa4.flash_attn_func(q, k, v, learnable_sink=sink, kernel_options=FAMILIES[family])
    out = out[0] if isinstance(out, tuple) else out
    got = torch.autograd.grad(out, sink, g)[0]
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    if family == "sm90":  # seqused_q is forward only: the sink's gradient comes from the composition
        qp = q.reshape(b * sq, h, d)
        cu = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device="cuda")
        used = torch.full((b,), sq, dtype=torch.int32, device="cuda")
        out2 = fa4.flash_attn_varlen_func(qp, k, v, cu_seqlens_q=cu, max_seqlen_q=sq, seqused_q=used,
                                          learnable_sink=sink, kernel_options=FAMILIES[family])
        out2 = out2[0] if isinstance(out2, tuple) else out2
        got2 = torch.autograd.grad(out2, sink, g.reshape(b * sq, h, d))[0]
        torch.testing.assert_close(got2.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
