"""``fold_first`` (AttnFwdConfig; Note [The first block in the masked loop] in fa4/fwd/sm90.py): a
causal / local tile's first K block runs in the loop over the blocks at the window's right edge
(sm90 local tiles: both edges, Note [Edges first] in fa4/mask.py, which the separate loops walk in
the same order), under a runtime ``is_first``, instead of in its own copy of the step. It visits
the same blocks in the same order, masks the same elements and computes the same softmax (the first block's update
from row maxes of -inf and sums of 0 gives scales of 0 on a zero O), so the outputs must be
bit-identical to the separate first block's, and pass the reference check: every head-dim bucket
(d64's three ping-pong warpgroups, d256's O rescaled before P V), windows narrower and wider than a
tile, more queries than keys and fewer, varlen with seqused_k (the first V block's tail cleared in
the loop's first iteration), packed GQA, softcap and split-KV; for both forward families (the sm80
one's fold has no runtime branch: its step issues nothing for an earlier block)."""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4.testing import random_qkv, random_varlen
from fwd_cases import check, run_with_fields

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _family_runs(request):
    fam = request.node.callspec.params.get("family", "sm90") if hasattr(request.node, "callspec") else "sm90"
    if fam == "sm90" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels run on compute capability 9.x only")


def _both(monkeypatch, call, family="sm90"):
    """``call``'s outputs with the separate first block, then with it folded (one_step_loop off in
    both: with it the fold does not apply)."""
    base = run_with_fields(monkeypatch, family, dict(fold_first=False, one_step_loop=False), call)
    fold = run_with_fields(monkeypatch, family, dict(fold_first=True, one_step_loop=False), call)
    return base, fold


def _same(base, fold):
    for a, b in zip(base, fold):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max().item()


WINDOWS = [None, (5, 0), (0, 70), (200, 1), (1, 300)]
SEQLENS = [(300, 300), (190, 450), (450, 190), (1000, 3000), (1, 1000), (113, 203)]
# Per family, the head dims: every sm90 bucket (d64's three ping-pong warpgroups, d192's separate
# loops, d256's O rescaled before P V); sm80's two-stage d64 and one-stage d128 / d256.
FAMILY_DIMS = [("sm90", d) for d in (64, 96, 128, 192, 256)] + [("sm80", d) for d in (64, 128, 256)]


@pytest.mark.parametrize("family,d", FAMILY_DIMS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("seqlens", SEQLENS)
def test_same_bits_as_separate_first_block(monkeypatch, family, d, window, seqlens):
    q, k, v = random_qkv(2, seqlens[0], seqlens[1], 4, 2, d, torch.bfloat16, "cuda", seed=seqlens[0] + d)
    causal = window is None
    win = (None, None) if causal else window

    def call(opts):
        return fa4.flash_attn_func(q, k, v, causal=causal, window_size=win, return_lse=True, kernel_options=opts)

    base, fold = _both(monkeypatch, call, family)
    check(*fold, q, k, v, causal=causal, window_size=win)
    _same(base, fold)


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["causal", "local"])
def test_same_bits_varlen_seqused(monkeypatch, family, d, mask):
    vb = random_varlen(5, 700, 4, 2, d, torch.bfloat16, "cuda", max_seqlen_k=900, with_seqused_k=True, seed=d + 3)
    causal, win = (True, (None, None)) if mask == "causal" else (False, (100, 30))

    def call(opts):
        return fa4.flash_attn_varlen_func(
            vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
            max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, seqused_k=vb.seqused_k, causal=causal,
            window_size=win, return_lse=True, kernel_options=opts)

    base, fold = _both(monkeypatch, call, family)
    check(*fold, vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
          seqused_k=vb.seqused_k, causal=causal, window_size=win)
    _same(base, fold)


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("case", ["gqa7", "gqa4-softcap", "split3", "fp16-local"])
def test_same_bits_other_paths(monkeypatch, family, case):
    """Packed GQA (7 and 4 q heads per kv head), softcap, split-KV partials, fp16 with a window."""
    dtype = torch.float16 if case == "fp16-local" else torch.bfloat16
    h, hk = {"gqa7": (14, 2), "gqa4-softcap": (8, 2)}.get(case, (4, 4))
    q, k, v = random_qkv(2, 777, 1500, h, hk, 128, dtype, "cuda", seed=len(case))
    causal = case != "fp16-local"
    win = (None, None) if causal else (300, 0)
    kw = dict(softcap=15.0) if case == "gqa4-softcap" else {}
    if case == "split3":
        kw["num_splits"] = 3

    def call(opts):
        return fa4.flash_attn_func(q, k, v, causal=causal, window_size=win, return_lse=True, kernel_options=opts, **kw)

    base, fold = _both(monkeypatch, call, family)
    check(*fold, q, k, v, causal=causal, window_size=win, softcap=kw.get("softcap", 0.0))
    _same(base, fold)
