"""CPU tests of fa4.testing: the attention reference, the pass rule and the input generators."""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4.testing import (
    adversarial_scores_qk,
    attention_mask,
    attention_ref,
    check_close,
    nan_like,
    random_qkv,
    random_varlen,
    rounding_noise,
)

CPU = "cpu"


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: Optional[float] = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention written out per (batch, head) in float64, from the textbook formula.

    ``allowed (sq, sk)`` is the mask; returns ``out (b, sq, h, d)`` and ``lse (b, h, sq)``.
    """
    b, sq, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    group = h // k.shape[2]
    out = torch.zeros(b, sq, h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((b, h, sq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            qh, kh, vh = (t[bi, :, idx].double() for t, idx in ((q, hi), (k, hi // group), (v, hi // group)))
            s = qh @ kh.T * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            for i in range(sq):
                keys = allowed[i].nonzero().flatten()
                if len(keys) == 0:
                    continue
                row = s[i, keys]
                w = torch.exp(row - row.max())
                out[bi, i, hi] = (w / w.sum()) @ vh[keys]
                lse[bi, hi, i] = row.max() + torch.log(w.sum())
    return out, lse


def assert_ref_matches(out, lse, out_n, lse_n, atol=2e-5):
    torch.testing.assert_close(out.double(), out_n, atol=atol, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_n, atol=atol, rtol=1e-5)


# ---------------------------------------------------------------- reference vs textbook formula


@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 113), (113, 1), (113, 203), (203, 113)])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_equals_formula(sq, sk, causal):
    q, k, v = random_qkv(2, sq, sk, 3, 3, 16, torch.float32, CPU, seed=sq * 1000 + sk)
    out, lse = attention_ref(q, k, v, causal=causal)
    allowed = attention_mask(sq, sk, causal=causal)
    assert_ref_matches(out, lse, *naive_attention(q, k, v, allowed))
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert out.shape == (2, sq, 3, 16) and lse.shape == (2, 3, sq)


def test_reference_softmax_scale_and_value_dim():
    q, k, _ = random_qkv(1, 7, 9, 2, 2, 32, torch.float32, CPU, seed=1)
    v = torch.randn(1, 9, 2, 8, generator=torch.Generator().manual_seed(2))
    out, lse = attention_ref(q, k, v, softmax_scale=0.3)
    assert_ref_matches(out, lse, *naive_attention(q, k, v, attention_mask(7, 9), scale=0.3))
    assert out.shape == (1, 7, 2, 8)


def test_reference_bf16_input_upcast_gives_float32():
    q, k, v = random_qkv(1, 17, 33, 2, 1, 64, torch.bfloat16, CPU, seed=3)
    out, lse = attention_ref(q, k, v)
    assert out.dtype == torch.float32
    assert_ref_matches(out, lse, *naive_attention(q, k, v, attention_mask(17, 33)))


def test_reference_low_precision_is_input_dtype_math():
    q, k, v = random_qkv(2, 113, 203, 4, 2, 64, torch.bfloat16, CPU, seed=4)
    out_ref, lse_ref = attention_ref(q, k, v)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False)
    assert out_pt.dtype == torch.bfloat16 and lse_pt.dtype == torch.float32
    err = (out_pt.float() - out_ref).abs().max().item()
    assert 0 < err < 0.05  # bf16 rounding is visible, but small
    assert 0 < (lse_pt - lse_ref).abs().max().item() < 0.05


# ---------------------------------------------------------------- masks


def test_causal_is_bottom_right_aligned_short_q():
    # sq=3, sk=5: row i sees keys 0 .. i + 2.
    mask = attention_mask(3, 5, causal=True)
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
    q, k, v = random_qkv(1, 3, 5, 1, 1, 8, torch.float32, CPU, seed=5)
    out, _ = attention_ref(q, k, v, causal=True)
    first_row, _ = attention_ref(q[:, :1], k[:, :3], v[:, :3])
    torch.testing.assert_close(out[:, :1], first_row)


def test_causal_is_bottom_right_aligned_long_q():
    # sq=5, sk=3: rows 0 and 1 see nothing, row 2 sees key 0 only, row 4 sees everything.
    mask = attention_mask(5, 3, causal=True)
    assert mask.sum(dim=1).tolist() == [0, 0, 1, 2, 3]
    q, k, v = random_qkv(1, 5, 3, 2, 2, 8, torch.float32, CPU, seed=6)
    out, lse = attention_ref(q, k, v, causal=True)
    assert (out[:, :2] == 0).all() and torch.isneginf(lse[:, :, :2]).all()
    torch.testing.assert_close(out[:, 2], v[:, 0])
    scale = 8**-0.5
    torch.testing.assert_close(lse[0, :, 2], (q[0, 2] * k[0, 0]).sum(-1) * scale)


@pytest.mark.parametrize(
    "sq,sk,window,row,expected",
    [
        (6, 6, (2, 1), 3, [1, 2, 3, 4]),
        (6, 6, (0, 0), 0, [0]),
        (6, 6, (None, 1), 2, [0, 1, 2, 3]),
        (6, 6, (1, None), 4, [3, 4, 5]),
        (3, 7, (1, 1), 0, [3, 4, 5]),  # row 0 is aligned with key 0 + 7 - 3 = 4
        (7, 3, (1, 0), 6, [1, 2]),  # row 6 is aligned with key 6 + 3 - 7 = 2
        (7, 3, (1, 0), 1, []),
    ],
)
def test_window_entries(sq, sk, window, row, expected):
    mask = attention_mask(sq, sk, window_size=window)
    assert mask[row].nonzero().flatten().tolist() == expected


def test_causal_sets_right_window_to_zero():
    torch.testing.assert_close(
        attention_mask(9, 13, causal=True, window_size=(3, 5)), attention_mask(9, 13, window_size=(3, 0))
    )


@given(
    sq=st.integers(1, 12),
    sk=st.integers(1, 12),
    left=st.one_of(st.none(), st.integers(0, 12)),
    right=st.one_of(st.none(), st.integers(0, 12)),
)
@settings(max_examples=60, deadline=None)
def test_mask_matches_definition(sq, sk, left, right):
    mask = attention_mask(sq, sk, window_size=(left, right))
    for i in range(sq):
        for j in range(sk):
            lo_ok = left is None or j >= i + sk - sq - left
            hi_ok = right is None or j <= i + sk - sq + right
            assert bool(mask[i, j]) == (lo_ok and hi_ok)


@pytest.mark.parametrize("sq,sk,window", [(113, 203, (17, 5)), (203, 113, (40, 0)), (64, 64, (0, 0)), (1, 113, (3, 3))])
def test_window_reference_equals_formula(sq, sk, window):
    q, k, v = random_qkv(1, sq, sk, 2, 1, 16, torch.float32, CPU, seed=7)
    out, lse = attention_ref(q, k, v, window_size=window)
    assert_ref_matches(out, lse, *naive_attention(q, k, v, attention_mask(sq, sk, window_size=window)))


# ---------------------------------------------------------------- softcap, GQA


@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_equals_formula(softcap, causal):
    q, k, v = random_qkv(1, 33, 47, 2, 2, 32, torch.float32, CPU, seed=8)
    q = q * 3  # push scores into tanh's saturated range
    out, lse = attention_ref(q, k, v, softcap=softcap, causal=causal)
    naive = naive_attention(q, k, v, attention_mask(33, 47, causal=causal), softcap=softcap)
    assert_ref_matches(out, lse, *naive)


def test_softcap_changes_result_and_huge_cap_does_not():
    q, k, v = random_qkv(1, 16, 16, 1, 1, 16, torch.float32, CPU, seed=9)
    q = q * 4
    plain, _ = attention_ref(q, k, v)
    capped, _ = attention_ref(q, k, v, softcap=1.0)
    loose, _ = attention_ref(q, k, v, softcap=1e6)
    assert (plain - capped).abs().max() > 1e-2
    torch.testing.assert_close(loose, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,heads_k", [(6, 2), (6, 1), (4, 4)])
def test_gqa_equals_repeated_heads(heads, heads_k):
    q, k, v = random_qkv(2, 19, 23, heads, heads_k, 16, torch.float32, CPU, requires_grad=True, seed=10)
    group = heads // heads_k
    k_rep = k.detach().repeat_interleave(group, dim=2).requires_grad_()
    v_rep = v.detach().repeat_interleave(group, dim=2).requires_grad_()
    out, lse = attention_ref(q, k, v, causal=True)
    out_rep, lse_rep = attention_ref(q, k_rep, v_rep, causal=True)
    torch.testing.assert_close(out, out_rep)
    torch.testing.assert_close(lse, lse_rep)
    dout = torch.randn_like(out)
    dk, dv = torch.autograd.grad(out, (k, v), dout)
    dk_rep, dv_rep = torch.autograd.grad(out_rep, (k_rep, v_rep), dout)
    torch.testing.assert_close(dk, dk_rep.unflatten(2, (heads_k, group)).sum(3))
    torch.testing.assert_close(dv, dv_rep.unflatten(2, (heads_k, group)).sum(3))


def test_gqa_rejects_uneven_heads():
    q, k, v = random_qkv(1, 4, 4, 5, 2, 8, torch.float32, CPU, seed=11)
    with pytest.raises(ValueError, match="multiple"):
        attention_ref(q, k, v)


# ---------------------------------------------------------------- varlen


@pytest.mark.parametrize("causal,window", [(False, (None, None)), (True, (None, None)), (False, (7, 3))])
@pytest.mark.parametrize("with_seqused_k", [False, True])
def test_varlen_equals_per_sequence_calls(causal, window, with_seqused_k):
    vb = random_varlen(5, 41, 4, 2, 16, torch.float32, CPU, max_seqlen_k=57, with_seqused_k=with_seqused_k, seed=12)
    kwargs = {"causal": causal, "window_size": window}
    out, lse = attention_ref(
        vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, seqused_k=vb.seqused_k, **kwargs
    )
    assert out.shape == vb.q.shape[:2] + (16,) and lse.shape == (4, vb.q.shape[0])
    cu_q, cu_k = vb.cu_seqlens_q.tolist(), vb.cu_seqlens_k.tolist()
    for b in range(5):
        used = vb.seqused_k[b].item() if with_seqused_k else vb.seqlens_k[b]
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b] + used)
        out_b, lse_b = attention_ref(vb.q[qs][None], vb.k[ks][None], vb.v[ks][None], **kwargs)
        torch.testing.assert_close(out[qs], out_b[0])
        torch.testing.assert_close(lse[:, qs], lse_b[0])
        allowed = attention_mask(cu_q[b + 1] - cu_q[b], used, **kwargs)
        naive_out, naive_lse = naive_attention(vb.q[qs][None], vb.k[ks][None], vb.v[ks][None], allowed)
        assert_ref_matches(out[qs][None], lse[:, qs][None], naive_out, naive_lse)


def test_varlen_unused_keys_get_zero_grad():
    vb = random_varlen(3, 9, 2, 2, 8, torch.float32, CPU, with_seqused_k=True, requires_grad=True, seed=13)
    out, _ = attention_ref(
        vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, seqused_k=vb.seqused_k
    )
    (dk,) = torch.autograd.grad(out.sum(), (vb.k,))
    cu_k = vb.cu_seqlens_k.tolist()
    for b, used in enumerate(vb.seqused_k.tolist()):
        assert (dk[cu_k[b] + used : cu_k[b + 1]] == 0).all()


def test_varlen_argument_errors():
    vb = random_varlen(2, 5, 1, 1, 8, torch.float32, CPU, seed=14)
    with pytest.raises(ValueError, match="both"):
        attention_ref(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q)
    with pytest.raises(ValueError, match="rows"):
        attention_ref(vb.q[1:], vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k)
    too_many = torch.tensor(vb.seqlens_k, dtype=torch.int32) + 1
    with pytest.raises(ValueError, match="seqused_k"):
        attention_ref(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, seqused_k=too_many)


# ---------------------------------------------------------------- fully masked rows


@pytest.mark.parametrize("upcast", [True, False])
@pytest.mark.parametrize("softcap", [0.0, 10.0])
def test_fully_masked_rows_zero_out_neginf_lse_finite_grads(upcast, softcap):
    dtype = torch.float32 if upcast else torch.bfloat16
    q, k, v = random_qkv(2, 113, 37, 4, 2, 32, dtype, CPU, requires_grad=True, seed=15)
    out, lse = attention_ref(q, k, v, causal=True, softcap=softcap, upcast=upcast)
    masked = 113 - 37  # rows 0 .. 75 see no key
    assert (out[:, :masked] == 0).all()
    assert torch.isneginf(lse[:, :, :masked]).all() and torch.isfinite(lse[:, :, masked:]).all()
    loss = (out.float() * torch.randn(out.shape)).sum() + lse.masked_fill(torch.isinf(lse), 0).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert (dq[:, :masked] == 0).all()
    assert dq[:, masked:].abs().sum() > 0


def test_varlen_sequence_with_no_key_in_window():
    vb = random_varlen(2, 6, 1, 1, 8, torch.float32, CPU, requires_grad=True, seed=16)
    # The last sequence has 6 queries and 1 key: causal leaves its first 5 rows empty.
    out, lse = attention_ref(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, causal=True)
    start = vb.cu_seqlens_q[1].item()
    assert vb.seqlens_q[-1] == 6 and vb.seqlens_k[-1] == 1
    assert (out[start : start + 5] == 0).all() and torch.isneginf(lse[:, start : start + 5]).all()
    grads = torch.autograd.grad(out.sum(), (vb.q, vb.k, vb.v))
    assert all(torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------- pass rule


def _ref_and_pt():
    """(out_ref, lse_ref), (out_pt, lse_pt) of one bf16 problem."""
    q, k, v = random_qkv(2, 113, 203, 4, 2, 64, torch.bfloat16, CPU, seed=17)
    return attention_ref(q, k, v), attention_ref(q, k, v, upcast=False)


def test_pass_rule_accepts_kernel_like_results():
    (out_ref, lse_ref), (out_pt, lse_pt) = _ref_and_pt()
    # A correct kernel: the float32 result rounded once to bf16.
    report = check_close("out", out_ref.to(torch.bfloat16), out_ref, out_pt)
    assert report.err <= report.bound
    # A slightly perturbed result: at most the low-precision error on top of the rounding.
    err_pt = (out_pt.float() - out_ref).abs().max()
    noise = torch.empty_like(out_ref).uniform_(-1, 1, generator=torch.Generator().manual_seed(0)) * err_pt
    check_close("out", (out_ref + noise).to(torch.bfloat16), out_ref, out_pt)
    check_close("lse", lse_ref + 1e-5, lse_ref, lse_pt)


def test_pass_rule_rejects_wrong_result_and_names_it():
    (out_ref, _), (out_pt, _) = _ref_and_pt()
    wrong = out_ref.to(torch.bfloat16).clone()
    wrong[1, 100, 3, 7] += 0.25
    with pytest.raises(AssertionError) as info:
        check_close("out", wrong, out_ref, out_pt)
    msg = str(info.value)
    assert msg.startswith("out:") and "(1, 100, 3, 7)" in msg and "no NaN" in msg


def test_pass_rule_rejects_wrong_scale():
    q, k, v = random_qkv(1, 113, 113, 2, 2, 64, torch.bfloat16, CPU, seed=18)
    out_ref, _ = attention_ref(q, k, v)
    out_pt, _ = attention_ref(q, k, v, upcast=False)
    wrong, _ = attention_ref(q, k, v, softmax_scale=1.02 * 64**-0.5, upcast=False)
    with pytest.raises(AssertionError):
        check_close("out", wrong, out_ref, out_pt)


@pytest.mark.parametrize("where", [(0, 0, 0, 0), (1, 112, 3, 63)])
def test_pass_rule_nan_always_fails(where):
    (out_ref, _), (out_pt, _) = _ref_and_pt()
    bad = out_ref.to(torch.bfloat16).clone()
    bad[where] = float("nan")
    with pytest.raises(AssertionError, match="1 NaN") as info:
        check_close("out", bad, out_ref, out_pt, extra_atol=1e9)
    assert str(where) in str(info.value)
    with pytest.raises(AssertionError, match="NaN"):
        check_close("out", nan_like(out_pt), out_ref, out_pt, extra_atol=math.inf)


def test_pass_rule_handles_neginf_lse():
    q, k, v = random_qkv(1, 9, 4, 2, 2, 16, torch.bfloat16, CPU, seed=19)
    _, lse_ref = attention_ref(q, k, v, causal=True)
    _, lse_pt = attention_ref(q, k, v, causal=True, upcast=False)
    assert torch.isneginf(lse_ref).any()
    check_close("lse", lse_ref.clone(), lse_ref, lse_pt)
    finite_where_masked = lse_ref.clone()
    finite_where_masked[0, 0, 0] = 0.0
    with pytest.raises(AssertionError, match=r"\(0, 0, 0\)"):
        check_close("lse", finite_where_masked, lse_ref, lse_pt)
    neginf_where_live = lse_ref.clone()
    neginf_where_live[0, 1, 8] = -math.inf
    with pytest.raises(AssertionError, match=r"\(0, 1, 8\)"):
        check_close("lse", neginf_where_live, lse_ref, lse_pt)


def test_pass_rule_fully_masked_output_must_be_exact_zero():
    q, k, v = random_qkv(1, 4, 2, 1, 1, 8, torch.bfloat16, CPU, seed=20)
    ref, _ = attention_ref(q, k, v, window_size=(None, -5))  # every row masked
    pt, _ = attention_ref(q, k, v, window_size=(None, -5), upcast=False)
    check_close("out", torch.zeros_like(pt), ref, pt)
    with pytest.raises(AssertionError):
        check_close("out", torch.full_like(pt, 1e-3), ref, pt)


def test_pass_rule_extra_atol_and_shape():
    (out_ref, _), (out_pt, _) = _ref_and_pt()
    shifted = (out_ref + 0.2).to(torch.bfloat16)
    with pytest.raises(AssertionError):
        check_close("out", shifted, out_ref, out_pt)
    check_close("out", shifted, out_ref, out_pt, extra_atol=0.25)
    with pytest.raises(AssertionError, match="shape"):
        check_close("out", out_pt[:1], out_ref, out_pt)


def test_pass_rule_rejects_nan_reference():
    ref = torch.zeros(3)
    ref[1] = float("nan")
    with pytest.raises(AssertionError, match="reference"):
        check_close("x", torch.zeros(3), ref, torch.zeros(3))


@pytest.mark.parametrize(
    "dtype,magnitude,expected",
    [(torch.bfloat16, 2.0, 2.0**-6), (torch.float16, 1.0, 2.0**-10), (torch.bfloat16, 0.0, 0.0)],
)
def test_rounding_noise(dtype, magnitude, expected):
    assert rounding_noise(dtype, magnitude) == expected
    assert rounding_noise(torch.float32, 10.0) == pytest.approx(2.0**-12 + 10 * 2.0**-20)


# ---------------------------------------------------------------- generators


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_qkv(dtype):
    q, k, v = random_qkv(2, 113, 1, 6, 3, 64, dtype, CPU, requires_grad=True, seed=21)
    assert q.shape == (2, 113, 6, 64) and k.shape == v.shape == (2, 1, 3, 64)
    assert all(t.dtype == dtype and t.requires_grad and t.is_leaf and (t != 0).all() for t in (q, k, v))
    q2, _, _ = random_qkv(2, 113, 1, 6, 3, 64, dtype, CPU, seed=21)
    assert torch.equal(q.detach(), q2)
    q3, _, _ = random_qkv(2, 113, 1, 6, 3, 64, dtype, CPU, seed=22)
    assert not torch.equal(q2, q3)


@pytest.mark.parametrize("batch,max_seqlen", [(1, 113), (2, 1), (7, 203)])
def test_random_varlen(batch, max_seqlen):
    vb = random_varlen(batch, max_seqlen, 4, 2, 16, torch.bfloat16, CPU, with_seqused_k=True, seed=23)
    for lengths, cu, max_len in (
        (vb.seqlens_q, vb.cu_seqlens_q, vb.max_seqlen_q),
        (vb.seqlens_k, vb.cu_seqlens_k, vb.max_seqlen_k),
    ):
        assert len(lengths) == batch and min(lengths) >= 1 and max(lengths) == max_len == max_seqlen
        assert cu.dtype == torch.int32 and cu.tolist() == [sum(lengths[:i]) for i in range(batch + 1)]
    if batch >= 2:
        assert vb.seqlens_q[0] == 1 and vb.seqlens_k[-1] == 1
    assert vb.q.shape == (sum(vb.seqlens_q), 4, 16) and vb.k.shape == (sum(vb.seqlens_k), 2, 16)
    used = vb.seqused_k.tolist()
    assert vb.seqused_k.dtype == torch.int32 and all(1 <= u <= n for u, n in zip(used, vb.seqlens_k))


def test_random_varlen_lengths_are_uneven():
    vb = random_varlen(16, 203, 1, 1, 8, torch.float32, CPU, seed=24)
    assert len(set(vb.seqlens_q)) > 4


@pytest.mark.parametrize("d,seqlen_k", [(64, 1024), (128, 300), (2, 129)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adversarial_scores_block_maxima(d, seqlen_k, dtype):
    block_n, step, jump, huge = 128, 0.5, 8.0, 60.0
    q, k = adversarial_scores_qk(1, 6, seqlen_k, 2, 1, d, dtype, CPU, block_n=block_n, seed=25)
    scores = torch.einsum("qd,kd->qk", q[0, :, 0].double(), k[0, :, 0].double()) * d**-0.5
    n_blocks = math.ceil(seqlen_k / block_n)
    maxima = torch.stack([scores[:, b * block_n : (b + 1) * block_n].max(dim=1).values for b in range(n_blocks)], 1)
    growth = maxima.diff(dim=1)
    assert (growth > 0).all()  # every row's max grows in every block
    rel = 0.05  # the 16-bit rounding of q's ramp coefficient
    assert ((growth[0::3] - step).abs() < step / 2 + rel * step).all()
    assert ((growth[1::3] - jump).abs() < step / 2 + rel * jump).all()
    assert ((growth[2::3, :-1] - step).abs() < step / 2 + rel * step).all()
    assert ((growth[2::3, -1] - step - huge).abs() < step / 2 + rel * huge).all()


def test_adversarial_rejects_tiny_head_dim():
    with pytest.raises(ValueError):
        adversarial_scores_qk(1, 2, 2, 1, 1, 1, torch.bfloat16, CPU)


def test_nan_like():
    t = torch.zeros(3, 2, dtype=torch.bfloat16)
    n = nan_like(t)
    assert n.shape == t.shape and n.dtype == t.dtype and torch.isnan(n).all()


@pytest.mark.parametrize("causal", [False, True])
def test_float32_gqa_reference_equals_its_mha_form(causal):
    """The float32 reference groups each kv head's q heads instead of copying K / V per q head (v0.43:
    a decode test's copy was 8 GiB): the same attention as the MHA form of the same inputs (q head
    ``h`` reads kv head ``h // g``), with a head-dependent score function and mask to pin the head
    order, and the same gradients."""
    torch.manual_seed(3)
    q = torch.randn(2, 29, 12, 16, requires_grad=True)
    k = torch.randn(2, 41, 3, 16, requires_grad=True)
    v = torch.randn(2, 41, 3, 24, requires_grad=True)

    def score_fn(s, b, h, qi, ki):
        return s + 0.1 * h - 0.01 * (qi - ki).abs()

    def mask_fn(b, h, qi, ki):
        return (ki + 2 * h) % 7 != 0

    kw = dict(causal=causal, softcap=4.0, score_fn=score_fn, mask_fn=mask_fn)
    out, lse = attention_ref(q, k, v, **kw)
    out_mha, lse_mha = attention_ref(q, k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2), **kw)
    torch.testing.assert_close(out, out_mha, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_mha, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    grads_mha = torch.autograd.grad((out_mha * w).sum(), (q, k, v))
    for g, g_mha in zip(grads, grads_mha):
        torch.testing.assert_close(g, g_mha, rtol=1e-4, atol=1e-5)
