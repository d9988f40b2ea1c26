"""flash_attn_with_kvcache (Note [KV cache calls] in fa4/kvcache.py) on the CPU: the rotary embedding
against complex multiplication, and the whole call with the attention kernel replaced by an
emulator that reads the cache the way the kernel does (batched rows or pages, ``seqused_k`` keys),
against a reference built from the logical sequences. The cache is checked after the call: the new
tokens at their positions, everything else untouched. tests/test_kvcache_gpu.py runs the kernels."""

from __future__ import annotations

import pytest
import torch
from kvcache_cases import make_case, reference, rotary_ref, rotary_tables

import fa4
from fa4 import interface, kvcache, validate
from fa4.testing import attention_ref


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 64])
def test_rotary_matches_complex_multiplication(interleaved, rotary_dim):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3, 64, generator=gen).to(torch.bfloat16)
    cos, sin = rotary_tables(40, rotary_dim, "cpu")
    pos = torch.randint(0, 40, (2, 5), generator=gen)
    got = kvcache._rotary(x, cos, sin, pos, interleaved)
    want = rotary_ref(x, cos, sin, pos, interleaved)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])
    # float32 against float64 math, both rounded to bf16: at most one bf16 step apart.
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    # Position 0 is the identity rotation.
    zero = kvcache._rotary(x, cos, sin, torch.zeros_like(pos), interleaved)
    assert torch.equal(zero, x)
    # A strided view (q from a packed qkv) and a float32 tensor rotate the same way.
    packed = torch.stack((x, x, x), dim=2)[:, :, 1]
    assert not packed.is_contiguous() and torch.equal(kvcache._rotary(packed, cos, sin, pos, interleaved), got)
    f32 = kvcache._rotary(x.float(), cos, sin, pos, interleaved)
    assert (f32 - rotary_ref(x.float(), cos, sin, pos, interleaved)).abs().max() < 1e-5


def test_rotary_of_a_key_with_a_strided_last_dim():
    """A new k whose head_dim is not the unit-stride dimension (a transposed copy): rotated like
    its contiguous twin."""
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(2, 3, 4, 64, generator=gen).to(torch.bfloat16)
    odd = k.transpose(2, 3).contiguous().transpose(2, 3)
    assert odd.stride(-1) != 1
    cos, sin = rotary_tables(16, 64, "cpu")
    pos = torch.randint(0, 16, (2, 3), generator=gen)
    for interleaved in (True, False):
        assert torch.equal(kvcache._rotary(odd, cos, sin, pos, interleaved), kvcache._rotary(k, cos, sin, pos, interleaved))


@pytest.fixture
def emulated(monkeypatch):
    """The attention kernel replaced by an emulator of what it reads; the calls it got."""
    calls = []

    def emulate(q, k, v, seqused_k=None, page_table=None, softmax_scale=None, causal=False, window_size=(None, None),
                learnable_sink=None, softcap=0.0, num_splits=None, pack_gqa=None, return_lse=False,
                kernel_options=None):
        calls.append(dict(q=q, k=k, v=v, seqused_k=seqused_k, page_table=page_table, causal=causal,
                          window_size=window_size, num_splits=num_splits, return_lse=return_lse,
                          learnable_sink=learnable_sink))
        assert seqused_k is None or seqused_k.dtype == torch.int32
        assert page_table is None or page_table.dtype == torch.int32
        win = tuple(None if (w is None or w < 0) else w for w in window_size)
        outs, lses = [], []
        for b in range(q.shape[0]):
            if page_table is not None:
                keys = k[page_table[b].long()].flatten(0, 1)
                vals = v[page_table[b].long()].flatten(0, 1)
            else:
                keys, vals = k[b], v[b]
            n = int(seqused_k[b]) if seqused_k is not None else keys.shape[0]
            o, l = attention_ref(q[b:b + 1], keys[None, :n], vals[None, :n], softmax_scale=softmax_scale,
                                 causal=causal, window_size=win, softcap=softcap)
            outs.append(o.to(q.dtype))
            lses.append(l)
        return torch.cat(outs), (torch.cat(lses) if return_lse else None)

    monkeypatch.setattr(interface, "flash_attn_varlen_func", emulate)
    with validate.allow_any_device():  # (the call's checks run on these CPU tensors)
        yield calls


def _check_cache(k_cache, v_cache, extra, cache_seqlens, logical, new_k, new_v, layout):
    """The cache now holds the new tokens at ``cache_seqlens[b] ...`` and its old contents elsewhere."""
    for b in range(new_k.shape[0]):
        if layout == "paged":
            kc = k_cache[extra["block_table"][b].long()].flatten(0, 1)
            vc = v_cache[extra["block_table"][b].long()].flatten(0, 1)
        else:
            row = int(extra["cache_batch_idx"][b]) if layout == "batch_idx" else b
            kc, vc = k_cache[row], v_cache[row]
        old_k, old_v = logical(b)
        kc, vc = kc[:old_k.shape[0]], vc[:old_v.shape[0]]
        n, s = int(cache_seqlens[b]), new_k.shape[1]
        assert torch.equal(vc[n:n + s], new_v[b])
        assert (kc[n:n + s].float() - new_k[b].float()).abs().max() <= 2 ** -7 * new_k.float().abs().max()
        keep = torch.ones(old_k.shape[0], dtype=torch.bool)
        keep[n:n + s] = False
        assert torch.equal(kc[keep], old_k[keep]) and torch.equal(vc[keep], old_v[keep])


@pytest.mark.parametrize("layout", ["batched", "batch_idx", "paged"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("causal,window,seqlen_q,seqlen_new", [
    (False, (-1, -1), 1, 1), (True, (-1, -1), 1, 1), (True, (-1, -1), 3, 3), (False, (-1, -1), 3, 2),
    (False, (8, 0), 2, 2)])
def test_kvcache_call(emulated, layout, rotary, causal, window, seqlen_q, seqlen_new):
    q, k_cache, v_cache, k, v, lens, extra, logical = make_case(layout, seqlen_q=seqlen_q, seqlen_new=seqlen_new)
    rot = rotary_tables(128, 32 if rotary == "neox" else 64, "cpu") if rotary else None
    interleaved = rotary != "neox"
    rkw = dict(rotary_cos=rot[0], rotary_sin=rot[1], rotary_interleaved=interleaved) if rot else {}
    out, lse = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=causal,
                                           window_size=window, return_softmax_lse=True, **extra, **rkw)
    want, want_lse, new_k = reference(q, k, v, lens, logical, rotary=rot, interleaved=interleaved, causal=causal,
                                      window_size=window)
    assert out.shape == (3, seqlen_q, 4, 64) and out.dtype == q.dtype and lse.shape == (3, 4, seqlen_q)
    assert (out.float() - want).abs().max() < 2e-2
    assert (lse - want_lse).abs().max() < 2e-2
    _check_cache(k_cache, v_cache, extra, lens, logical, new_k, v, layout)
    call, = emulated
    assert torch.equal(call["seqused_k"], lens + seqlen_new)
    assert (call["page_table"] is not None) == (layout != "batched")
    assert call["causal"] == causal and tuple(call["window_size"]) == window


def test_kvcache_without_new_tokens(emulated):
    """No k / v: attention over the first cache_seqlens tokens (an int too), or the whole cache."""
    q, k_cache, v_cache, _, _, lens, extra, logical = make_case("paged", seqlen_q=2)
    before = k_cache.clone()
    out = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, **extra)
    want, _, _ = reference(q, q.new_zeros(3, 0, 2, 64), q.new_zeros(3, 0, 2, 64), lens, logical, causal=True)
    assert (out.float() - want).abs().max() < 2e-2 and torch.equal(k_cache, before)
    assert torch.equal(emulated[-1]["seqused_k"], lens)
    fa4.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=40, **extra)
    assert torch.equal(emulated[-1]["seqused_k"], torch.full((3,), 40, dtype=torch.int32))
    fa4.flash_attn_with_kvcache(q, k_cache, v_cache, **extra)
    assert emulated[-1]["seqused_k"] is None
    q, k_cache, v_cache, _, _, _, _, _ = make_case("batched")
    fa4.flash_attn_with_kvcache(q, k_cache, v_cache)
    assert emulated[-1]["k"].shape[0] == 3  # the first batch rows of a larger cache, as a view
    assert emulated[-1]["k"].data_ptr() == k_cache.data_ptr()


def test_kvcache_passes_the_sink(emulated):
    """learnable_sink reaches the attention call, checked before the append."""
    q, k_cache, v_cache, k, v, lens, _, _ = make_case("batched")
    sink = torch.randn(4)
    fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, learnable_sink=sink)
    assert emulated[-1]["learnable_sink"] is sink
    before = k_cache.clone()
    with pytest.raises(ValueError, match="learnable_sink must have shape"):
        fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens + 1, learnable_sink=sink[:2])
    assert torch.equal(k_cache, before) and len(emulated) == 1


def test_kvcache_takes_no_gradients(emulated):
    q, k_cache, v_cache, k, v, lens, _, _ = make_case("batched")
    out = fa4.flash_attn_with_kvcache(q.requires_grad_(), k_cache, v_cache, k, v, cache_seqlens=lens)
    assert not out.requires_grad


def test_kvcache_bad_inputs(emulated):
    q, k_cache, v_cache, k, v, lens, extra, _ = make_case("paged")
    call = fa4.flash_attn_with_kvcache
    for name in ("cache_leftpad", "alibi_slopes", "qv"):
        with pytest.raises(NotImplementedError, match=name):
            call(q, k_cache, v_cache, **{name: lens})
    with pytest.raises(ValueError, match="k and v together"):
        call(q, k_cache, v_cache, k, cache_seqlens=lens, **extra)
    with pytest.raises(ValueError, match="cache_seqlens is required"):
        call(q, k_cache, v_cache, k, v, **extra)
    with pytest.raises(ValueError, match="need k and v"):
        cos, sin = rotary_tables(128, 64, "cpu")
        call(q, k_cache, v_cache, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, **extra)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin together"):
        call(q, k_cache, v_cache, k, v, rotary_cos=cos, cache_seqlens=lens, **extra)
    with pytest.raises(ValueError, match="rotary_dim"):
        big = rotary_tables(128, 128, "cpu")
        call(q, k_cache, v_cache, k, v, rotary_cos=big[0], rotary_sin=big[1], cache_seqlens=lens, **extra)
    with pytest.raises(ValueError, match="cache_batch_idx cannot be used with a paged cache"):
        call(q, k_cache, v_cache, cache_batch_idx=lens, **extra)
    with pytest.raises(ValueError, match="block_table or page_table"):
        call(q, k_cache, v_cache, page_table=extra["block_table"], **extra)
    with pytest.raises(ValueError, match="shape \\(batch, seqlen_new, heads_k, head_dim\\)"):
        call(q, k_cache, v_cache, k[:, :, :1], v, cache_seqlens=lens, **extra)
    with pytest.raises(TypeError, match="cache's dtype"):
        call(q, k_cache, v_cache, k.half(), v, cache_seqlens=lens, **extra)
    with pytest.raises(ValueError, match="cache_seqlens must be an int32"):
        call(q, k_cache, v_cache, k, v, cache_seqlens=lens[:2], **extra)
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):
        call(q, k_cache, v_cache, k, v, cache_seqlens=-1, **extra)
    with pytest.raises(TypeError, match="rotary_interleaved must be a bool"):
        call(q, k_cache, v_cache, k, v, cache_seqlens=lens, rotary_interleaved=1, **extra)
    with pytest.raises(ValueError, match="fewer than q's batch"):
        call(q, k_cache[:2], v_cache[:2])
    with pytest.raises(ValueError, match="must be 4-D"):
        call(q[0], k_cache, v_cache)
    with pytest.raises(ValueError, match="fewer than the cache's"):
        short = rotary_tables(64, 64, "cpu")
        call(q, k_cache, v_cache, k, v, rotary_cos=short[0], rotary_sin=short[1], cache_seqlens=lens, **extra)
    for name, value in (("cu_seqlens_q", lens), ("cu_seqlens_k_new", lens), ("max_seqlen_q", 4),
                        ("rotary_seqlens", lens), ("q_descale", lens), ("scheduler_metadata", object()),
                        ("attention_chunk", 64)):
        with pytest.raises(NotImplementedError, match=name):
            call(q, k_cache, v_cache, **{name: value})


@pytest.mark.parametrize("bad", [dict(window_size=(-2, -1)), dict(causal=1), dict(softcap=-1.0),
                                 dict(num_splits="2"), dict(pack_gqa=1), dict(return_softmax_lse=1), dict(heads=3),
                                 dict(q_dtype=torch.float16)])
def test_kvcache_bad_call_leaves_the_cache_alone(emulated, bad):
    """Every argument is checked before the append writes the cache (a failed call changes nothing)."""
    bad = dict(bad)
    q, k_cache, v_cache, k, v, lens, extra, _ = make_case("paged", heads=bad.pop("heads", 4))
    if "q_dtype" in bad:
        q = q.to(bad.pop("q_dtype"))
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises((ValueError, TypeError)):
        fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, **extra, **bad)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    assert not emulated


def test_kvcache_sm_margin_is_an_ignored_hint(emulated):
    q, k_cache, v_cache, k, v, lens, extra, _ = make_case("batched")
    interface._hint_warned.discard("sm_margin")  # (one warning a process)
    with pytest.warns(UserWarning, match="sm_margin"):
        fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, sm_margin=8)
    assert len(emulated) == 1


@pytest.mark.parametrize("window", [(-1, 10 ** 6), (10 ** 6, -1), (40, -1)])
def test_kvcache_rotary_positions_follow_flash_attns_local_rule(emulated, window):
    """A window side at least the cache's length is unbounded for the queries' rotary positions
    (flash_attn: every query at cache_seqlens when the call is neither causal nor local)."""
    q, k_cache, v_cache, k, v, lens, extra, logical = make_case("batched", seqlen_q=3, seqlen_new=3)
    cos, sin = rotary_tables(128, 64, "cpu")
    out = fa4.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                      window_size=window)
    want, _, _ = reference(q, k, v, lens, logical, rotary=(cos, sin), window_size=window, capacity=96)
    assert (out.float() - want).abs().max() < 2e-2
