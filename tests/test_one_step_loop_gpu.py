"""``one_step_loop`` (fa4.mask.walk_blocks): the K blocks after a tile's first through one step body
with the window mask as a runtime branch. It visits the same blocks and masks the same ones as the
default separate loops, so the outputs must pass the reference check, and where both walk the
same order be bit-identical to the separate loops' (both families, causal and local windows,
dense and varlen). The order is the same except for sm90's local tiles, whose separate loops walk
both edges of the window before the free blocks (Note [Edges first] in fa4/mask.py) while one
step body walks them descending: there both pass the reference check instead."""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4.testing import random_qkv, random_varlen
from fwd_cases import check, run_with_fields


def _run(monkeypatch, family, one, call):
    return run_with_fields(monkeypatch, family, dict(one_step_loop=one), call)


def _same_order(family, causal) -> bool:
    """Whether one_step_loop and the separate loops visit a tile's K blocks in the same order."""
    return family == "sm80" or causal


@pytest.fixture(autouse=True)
def _family_runs(request):
    fam = request.node.callspec.params.get("family") if hasattr(request.node, "callspec") else None
    if "gpu" in request.keywords and fam == "sm90" and torch.cuda.is_available() \
            and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels run on compute capability 9.x only")


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("window", [None, (5, 0), (0, 70), (200, 1), (1, 300)])
@pytest.mark.parametrize("seqlens", [(300, 300), (190, 450), (450, 190), (1000, 3000)])
def test_same_bits_as_separate_loops(monkeypatch, family, window, seqlens):
    q, k, v = random_qkv(2, seqlens[0], seqlens[1], 4, 2, 128, torch.bfloat16, "cuda", seed=seqlens[0])
    causal = window is None
    win = (None, None) if causal else window

    def call(opts):
        return fa4.flash_attn_func(q, k, v, causal=causal, window_size=win, return_lse=True, kernel_options=opts)

    out0, lse0 = _run(monkeypatch, family, False, call)
    out1, lse1 = _run(monkeypatch, family, True, call)
    check(out1, lse1, q, k, v, causal=causal, window_size=win)
    if _same_order(family, causal):
        assert torch.equal(out0, out1) and torch.equal(lse0, lse1)
    else:
        check(out0, lse0, q, k, v, causal=causal, window_size=win)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("mask", ["causal", "local"])
def test_same_bits_varlen(monkeypatch, family, mask):
    vb = random_varlen(5, 700, 4, 2, 64, torch.bfloat16, "cuda", max_seqlen_k=900, with_seqused_k=True, seed=11)
    causal, win = (True, (None, None)) if mask == "causal" else (False, (100, 30))

    def call(opts):
        return fa4.flash_attn_varlen_func(
            vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
            max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, seqused_k=vb.seqused_k, causal=causal,
            window_size=win, return_lse=True, kernel_options=opts)

    out0, lse0 = _run(monkeypatch, family, False, call)
    out1, lse1 = _run(monkeypatch, family, True, call)
    for out, lse in ((out1, lse1),) if _same_order(family, causal) else ((out1, lse1), (out0, lse0)):
        check(out, lse, vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
              seqused_k=vb.seqused_k, causal=causal, window_size=win)
    if _same_order(family, causal):
        assert torch.equal(out0, out1) and torch.equal(lse0, lse1)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(5, 0), (200, 1), (1, 300), (1024, 0)])
@pytest.mark.parametrize("seqlens", [(190, 450), (1000, 3000)])
def test_head_dim_256_windows(monkeypatch, window, seqlens):
    """d256 windows, the candidate for one step body by default (ONE_STEP_LOOP_LOCAL_BUCKETS in
    fa4/fwd/sm90.py): both walks against the reference, GQA 4 / 2, bf16 (the order differs: no bit
    comparison)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels run on compute capability 9.x only")
    q, k, v = random_qkv(2, seqlens[0], seqlens[1], 4, 2, 256, torch.bfloat16, "cuda", seed=seqlens[1] + window[0])

    def call(opts):
        return fa4.flash_attn_func(q, k, v, window_size=window, return_lse=True, kernel_options=opts)

    for one in (True, False):
        out, lse = _run(monkeypatch, "sm90", one, call)
        check(out, lse, q, k, v, causal=False, window_size=window)
