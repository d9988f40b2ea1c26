"""flash_attn_with_kvcache on the GPU (Note [KV cache calls] in fa4/kvcache.py): the append, the
rotary embedding and the decode kernels together, against the float32 reference with the pass
rule, in the three cache layouts (batched rows, rows by ``cache_batch_idx``, pages by
``block_table``), causal / local / plain, MHA and GQA, one and several queries. The outputs are
NaN-filled by the conftest. Also: the call's output equals flash_attn_varlen_func's on the same
(already appended) cache, bit for bit."""

from __future__ import annotations

import pytest
import torch
from kvcache_cases import make_case, reference, rotary_tables

import fa4
from fa4 import kvcache
from fa4.testing import check_close

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")


@pytest.mark.parametrize("layout", ["batched", "batch_idx", "paged"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("causal,window,seqlen_q,seqlen_new,heads,d", [
    (False, (-1, -1), 1, 1, 8, 128), (True, (-1, -1), 1, 1, 8, 64), (True, (-1, -1), 4, 4, 8, 128),
    (True, (-1, -1), 6, 2, 4, 128), (False, (-1, -1), 3, 0, 8, 64), (True, (256, 0), 2, 2, 8, 128),
    # 7 q heads per kv head (Qwen2.5's 28 / 4): packed decode tiles of 9 positions, 63 of 64 rows (v0.43)
    (True, (-1, -1), 1, 1, 14, 128), (True, (-1, -1), 5, 5, 14, 128)])
def test_kvcache_against_reference(layout, rotary, causal, window, seqlen_q, seqlen_new, heads, d):
    torch.manual_seed(0)
    q, k_cache, v_cache, k, v, lens, extra, logical = make_case(
        layout, batch=5, seqlen_q=seqlen_q, seqlen_new=max(seqlen_new, 1), heads=heads, heads_k=2, d=d,
        cache_len=1000, page_size=64, device="cuda")
    if seqlen_new == 0:
        k = v = None
        rotary = None
    rot = rotary_tables(1024, d // 2 if rotary == "neox" else d, "cuda") if rotary else None
    interleaved = rotary != "neox"
    rkw = dict(rotary_cos=rot[0], rotary_sin=rot[1], rotary_interleaved=interleaved) if rot else {}
    out, lse = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=causal,
                                           window_size=window, return_softmax_lse=True, **extra, **rkw)
    zero = q.new_zeros(q.shape[0], 0, 2, d)
    kk, vv = (k, v) if k is not None else (zero, zero)
    kw = dict(rotary=rot, interleaved=interleaved, causal=causal, window_size=window, rotate=kvcache._rotary)
    ref, ref_lse, _ = reference(q, kk, vv, lens, logical, **kw)
    pt, _, _ = reference(q, kk, vv, lens, logical, upcast=False, **kw)
    check_close("out", out, ref, pt)
    assert torch.isfinite(lse).all() and (lse - ref_lse).abs().max() < 1e-2


@pytest.mark.parametrize("layout", ["batched", "paged"])
def test_kvcache_equals_the_varlen_call(layout):
    """After the append, the same attention through flash_attn_varlen_func: the same bits."""
    q, k_cache, v_cache, k, v, lens, extra, _ = make_case(layout, batch=4, seqlen_q=1, heads=16, heads_k=2, d=128,
                                                          cache_len=2048, page_size=128, device="cuda")
    out = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True, **extra)
    pages = extra.get("block_table")
    k_att, v_att = (k_cache, v_cache) if pages is not None else (k_cache[:4], v_cache[:4])
    again, _ = fa4.flash_attn_varlen_func(q, k_att, v_att, seqused_k=lens + 1, page_table=pages, causal=True)
    assert torch.equal(out, again)


def test_kvcache_decode_loop():
    """Twenty decode steps, one token each, from an empty cache: each step's output against the
    reference over every token appended so far."""
    torch.manual_seed(3)
    b, h, hk, d, steps = 3, 8, 2, 128, 20
    k_cache = torch.randn(b, 64, hk, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(b, 64, hk, d, device="cuda", dtype=torch.bfloat16)
    keys, vals = [], []
    cos, sin = rotary_tables(64, d, "cuda")
    for t in range(steps):
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, 1, hk, d, device="cuda", dtype=torch.bfloat16)
        out = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                          cache_seqlens=t, causal=True)
        pos = torch.full((b, 1), t, device="cuda")
        keys.append(kvcache._rotary(k, cos, sin, pos, True))
        vals.append(v)
        qr = kvcache._rotary(q, cos, sin, pos, True)
        kk, vv = torch.cat(keys, 1), torch.cat(vals, 1)
        from fa4.testing import attention_ref
        ref, _ = attention_ref(qr, kk, vv, causal=True)
        pt, _ = attention_ref(qr, kk, vv, causal=True, upcast=False)
        check_close(f"step {t}", out, ref, pt)
        assert torch.equal(k_cache[:, :t + 1], kk) and torch.equal(v_cache[:, :t + 1], vv)


@pytest.mark.parametrize("window", [(-1, -1), (128, 0)])
def test_kvcache_with_sinks(window):
    """learnable_sink (gpt-oss's decode: sinks and a sliding window): the reference's out and lse
    composed with a sink column of logit sink[h] and value 0."""
    q, k_cache, v_cache, k, v, lens, extra, logical = make_case("paged", batch=4, seqlen_q=1, heads=8, heads_k=2,
                                                                d=64, cache_len=700, page_size=16, device="cuda")
    sink = torch.randn(8, device="cuda") * 2
    out, lse = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True, window_size=window,
                                           learnable_sink=sink, return_softmax_lse=True, **extra)

    def with_sink(o, l):
        s = sink.to(l.dtype)[None, :, None]
        return o * torch.sigmoid(l - s).transpose(1, 2)[..., None].to(o.dtype), torch.logaddexp(l, s)

    ref, ref_lse, _ = reference(q, k, v, lens, logical, causal=True, window_size=window)
    pt, pt_lse, _ = reference(q, k, v, lens, logical, causal=True, window_size=window, upcast=False)
    ref, ref_lse = with_sink(ref, ref_lse)
    pt, _ = with_sink(pt, pt_lse)
    check_close("out", out, ref, pt)
    assert (lse - ref_lse).abs().max() < 1e-2


def test_kvcache_under_torch_compile():
    """A decode step compiled with fullgraph=True (the append mutates the caches inside the graph):
    the output and the caches of the eager call (Inductor may fuse the rotary's float32 math
    differently: the rotated keys may differ by a bf16 step)."""
    q, k_cache, v_cache, k, v, lens, extra, _ = make_case("paged", batch=3, seqlen_q=1, heads=8, heads_k=2, d=128,
                                                          cache_len=512, page_size=64, device="cuda")
    cos, sin = rotary_tables(512, 128, "cuda")

    def step(q, kc, vc, k, v, lens, table):
        return fa4.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                           block_table=table, causal=True)

    kc2, vc2 = k_cache.clone(), v_cache.clone()
    eager = step(q, k_cache, v_cache, k, v, lens, extra["block_table"])
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(q, kc2, vc2, k, v, lens, extra["block_table"])
    torch.testing.assert_close(compiled, eager, atol=2e-2, rtol=0)
    torch.testing.assert_close(kc2, k_cache, atol=2 ** -7 * float(k_cache.abs().max()), rtol=0)
    assert torch.equal(vc2, v_cache)
