"""The sm80 forward against the float32 reference, through the public API (GPU only).

Every call forces the sm80 family (``KernelOptions(arch="sm80")``), so on a Hopper / Blackwell GPU
this tests the Ampere path. Outputs are NaN-filled by the conftest, so an element the kernel does
not write fails; ``check_close`` applies FlashAttention's rule (at most 2x the error of a naive
low-precision PyTorch implementation, plus rounding noise) to both ``out`` and ``lse`` (an -inf LSE,
i.e. a row with no visible key, must be exactly -inf, and its output exactly 0).

Note [pruned grid]
    The full cross product head_dim x mask x softcap x heads x seqlens (6 x 3 x 2 x 3 x 5 = 540
    cases, each its own compile for the first 5 factors) would take an hour. Kernel code paths are
    chosen by (head-dim bucket, mask kind, softcap, varlen) at compile time and by the sequence
    shape at run time, and the bugs we fear are interactions of two of them (a mask at an unaligned
    seqlen, a head-dim pad with GQA indexing...). So the dense grid is a *pairwise* covering array:
    every pair of values of any two factors appears in at least one case
    (:func:`_pairwise_cases`, checked by ``test_grid_is_pairwise`` on the CPU), 25 cases, ~20
    compiles. Varlen, the option knobs (tiles, stages, exp2 emulation, rescale threshold) and
    64-bit offsets get their own small lists.
"""

from __future__ import annotations

import math

import pytest
import torch

import fa4
from fa4.testing import adversarial_scores_qk, random_qkv
from fwd_cases import (
    LOOSE_KINDS, VARLEN_CASES, case_id, check, loose_bound_inputs, missing_pairs, pairwise_cases, run_varlen_case,
    window,
)

SM80 = fa4.KernelOptions(arch="sm80")

HEAD_DIMS = [64, 96, 128, 192, 256]
SEQLENS = [(1, 1), (113, 203), (1000, 1000), (1024, 4096), (4096, 1024)]


CASES = pairwise_cases(HEAD_DIMS, SEQLENS, lambda i, j: i // 2 + j // 2)


def test_grid_is_pairwise():
    """Every pair of values of two factors appears in some case (runs on the CPU too)."""
    assert not missing_pairs(CASES, HEAD_DIMS, SEQLENS)


_check = check
_window = window


def _dense(q, k, v, causal, window, softcap, options=SM80):
    return fa4.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True,
                               kernel_options=options)


@pytest.mark.gpu
@pytest.mark.parametrize("d,seqlens,mask,softcap,heads", CASES,
                         ids=[case_id(c) for c in CASES])
def test_dense(d, seqlens, mask, softcap, heads):
    seqlen_q, seqlen_k = seqlens
    batch = 2 if seqlen_q * seqlen_k <= 2**21 else 1
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, heads[0], heads[1], d, torch.bfloat16, "cuda", seed=d + seqlen_q)
    causal, window = _window(mask, seqlen_q, seqlen_k)
    out, lse = _dense(q, k, v, causal, window, softcap)
    _check(out, lse, q, k, v, causal=causal, window_size=window, softcap=softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [32, 40, 72])
@pytest.mark.parametrize("causal", [False, True])
def test_small_and_unpadded_head_dims(d, causal):
    """d = 40 / 72 exercise the head-dim predicates (smem tile padded to 64 / 96); fp16."""
    q, k, v = random_qkv(2, 257, 130, 4, 2, d, torch.float16, "cuda", seed=d)
    out, lse = _dense(q, k, v, causal, (None, None), 0.0)
    _check(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(0, 0), (5, 0), (0, 70), (200, 1), (1, 300)])
@pytest.mark.parametrize("seqlens", [(300, 300), (190, 450), (450, 190)])
def test_local_windows(window, seqlens):
    """Windows narrower and wider than a tile, one-sided, on aligned and bottom-right shapes."""
    q, k, v = random_qkv(1, seqlens[0], seqlens[1], 2, 1, 128, torch.bfloat16, "cuda", seed=window[0] + seqlens[0])
    out, lse = _dense(q, k, v, False, window, 0.0)
    _check(out, lse, q, k, v, window_size=window)


# --------------------------------------------------------------------------------------------
# Varlen
# --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: "-".join(map(str, c[:6])))
def test_varlen(case):
    run_varlen_case(case, SM80)


# --------------------------------------------------------------------------------------------
# Kernel options: tiles, stages, exp2 emulation, conditional rescale
# --------------------------------------------------------------------------------------------

TILE_OPTIONS = [
    fa4.KernelOptions(arch="sm80", tile_n=128),
    fa4.KernelOptions(arch="sm80", num_stages=2),
    fa4.KernelOptions(arch="sm80", num_stages=3, tile_n=32),
    fa4.KernelOptions(arch="sm80", tile_m=64, num_threads=128),
    fa4.KernelOptions(arch="sm80", tile_m=128, num_threads=256, tile_n=128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("opts", TILE_OPTIONS, ids=lambda o: o.to_str())
@pytest.mark.parametrize("causal", [False, True])
def test_tile_options(opts, causal):
    q, k, v = random_qkv(2, 333, 517, 4, 2, 64, torch.bfloat16, "cuda", seed=7)
    out, lse = _dense(q, k, v, causal, (None, None), 0.0, options=opts)
    _check(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("num_stages", [1, 2])
def test_q_in_regs(num_stages):
    """``q_in_regs`` is a compile option the tuning table may pick; drive the launcher directly."""
    import dataclasses

    from fa4 import arch, ops, validate
    from fa4.fwd import sm80

    q, k, v = random_qkv(2, 200, 300, 4, 4, 64, torch.bfloat16, "cuda", seed=3)
    problem = validate.check_dense(q, k, v, None, True, (None, None), 0.0)
    target = arch.target_arch(torch.cuda.get_device_capability())
    cfg = dataclasses.replace(sm80.make_config(problem, SM80, target, True), q_in_regs=True, num_stages=num_stages)
    out = ops._empty(q.shape, q.dtype, q.device)
    lse = ops._empty((2, 4, 200), torch.float32, q.device)
    sm80.run(cfg, problem, q, k, v, out, lse)
    _check(out, lse, q, k, v, causal=True)


EMU_FRACS = [0.0, 0.25, 1.0]
THRESHOLDS = [0.0, 8.0]


@pytest.mark.gpu
@pytest.mark.parametrize("frac", EMU_FRACS)
@pytest.mark.parametrize("tau", THRESHOLDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("order", ["reversed", "as_is"])
def test_emulation_and_rescale_adversarial(frac, tau, causal, order):
    """Row maxes that creep (below tau), jump (above tau) every key block, or jump by 60 nats at
    the end: every (exp2_emu_frac, rescale_threshold) must pass the same rule (identical pass/fail).

    The kernel visits key blocks from the last to the first, so ``reversed`` flips the keys to make
    the maxes grow in the order the kernel sees them (the cliff then comes in its last block);
    ``as_is`` is the easy order (the max is found first). seqlen_k is a multiple of tile_n so the
    generator's blocks are the kernel's blocks."""
    d, seqlen_q, seqlen_k, tile_n = 128, 384, 1024, 64
    q, k = adversarial_scores_qk(2, seqlen_q, seqlen_k, 4, 2, d, torch.bfloat16, "cuda", block_n=tile_n, seed=1)
    if order == "reversed":
        k = k.flip(1).contiguous()
    _, _, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, d, torch.bfloat16, "cuda", seed=2)
    opts = fa4.KernelOptions(arch="sm80", exp2_emu_frac=frac, rescale_threshold=tau, tile_n=tile_n)
    out, lse = _dense(q, k, v, causal, (None, None), 0.0, options=opts)
    _check(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
def test_fully_masked_rows():
    """seqlen_q > seqlen_k with causal: the first rows see no key -> out exactly 0, lse -inf."""
    q, k, v = random_qkv(1, 300, 50, 2, 2, 128, torch.bfloat16, "cuda", seed=11)
    out, lse = _dense(q, k, v, True, (None, None), 0.0)
    assert torch.all(out[:, :250] == 0)
    assert torch.all(lse[:, :, :250] == -math.inf)
    _check(out, lse, q, k, v, causal=True)


@pytest.mark.gpu
def test_non_contiguous_strides():
    """q/k/v as slices of a packed qkv tensor (strides not equal to the compact ones)."""
    qkv = torch.randn(2, 259, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    out, lse = _dense(q, k, v, True, (None, None), 0.0)
    _check(out, lse, q, k, v, causal=True)


@pytest.mark.gpu
def test_64bit_offsets():
    """K/V with more than 2**31 elements (offsets of the last batch entries overflow int32)."""
    batch, seqlen_k, d = 9, 2**21, 128
    if torch.cuda.get_device_properties(0).total_memory < 40 * 2**30:
        pytest.skip("needs ~20 GB of GPU memory")
    k = torch.randn(batch, seqlen_k, 1, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen_k, 1, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, 3, 2, d, device="cuda", dtype=torch.bfloat16)
    out, lse = _dense(q, k, v, False, (None, None), 0.0)
    for b in (0, batch - 1):  # the first entry and one far past 2**31 elements
        sl = slice(b, b + 1)
        _check(out[sl], lse[sl], q[sl], k[sl], v[sl])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", LOOSE_KINDS)
def test_call_without_lengths(kind):
    """The sm80 forward judges a varlen side without max_seqlen on the batch's average length (as the
    sm90 family does, RESULTS v0.41). On the decode and MHA inputs the average and the longest
    lengths give the same tile, packing, threads and split count (asserted), so the call without
    max_seqlen gives the bits of the call with them (the grid is the bound's, its extra tiles
    empty). On the GQA prefill the average (785) packs the rows and the longest (1278) does not, so
    only the reference rule is asserted there. Every call passes the reference rule."""
    from fa4 import ops

    lq, lk, h, hk, d, causal, cq, ck, q, k, v = loose_bound_inputs(kind, len(kind) + 80)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, causal=causal, return_lse=True, kernel_options=SM80)
    runs = {}
    for given in (True, False):
        ops._plans.clear()
        lengths = dict(max_seqlen_q=max(lq), max_seqlen_k=max(lk)) if given else {}
        out = fa4.flash_attn_varlen_func(q, k, v, **lengths, **kw)
        cfgs = [c for (direction, *_), (_, c) in ops._plans.items() if direction == "fwd"]
        assert len(cfgs) == 1, cfgs
        runs[given] = out, cfgs[0]
    ops._plans.clear()
    (exact, e), (loose, c) = runs[True], runs[False]
    fields = ("tile_m", "tile_n", "num_threads", "qhead_per_kvhead", "split_kv")
    if kind == "prefill-gqa":
        assert (c.qhead_per_kvhead, e.qhead_per_kvhead) == (4, 1), (c, e)
    else:
        assert [getattr(c, f) for f in fields] == [getattr(e, f) for f in fields], (c, e)
        assert torch.equal(loose[0], exact[0]) and torch.equal(loose[1], exact[1])
    if kind.startswith("decode"):
        assert c.qhead_per_kvhead == 4 and c.tile_m == 64
    assert c.split_kv == (kind == "decode-split"), c
    for out, lse in (exact, loose):
        check(out, lse, q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=causal)
