"""CPU tests of the sm80 forward's pure-Python parts (tuning table, option validation, exp2
emulation constants and element selection, block ranges of the mask, tile order), the coverage of
its compile variants (compiled for every arch by tests/test_compile.py) and the device test kernels.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fa4 import jit
from fa4.config import AttnProblem, KernelOptions
from fa4.fwd import sm80
from fa4.mask import AttentionMask
from fa4.sched.tile import l2_section_size, section_tile
from fa4.softmax import EXP2_POLY, emulated_elements

# Every variant is compiled for every arch by tests/test_compile.py; here, what the set covers.
SM80_VARIANTS = sm80.variants("sm_80")


def test_variants_cover_buckets_and_flags():
    vs = SM80_VARIANTS
    assert {32, 64, 96, 128, 192, 256} <= {v.head_dim for v in vs}
    for flag in ("causal", "local", "has_softcap", "varlen_q", "varlen_k", "has_seqused_k", "has_lse", "q_in_regs",
                 "split_kv"):
        assert {getattr(v, flag) for v in vs} == {False, True}, flag
    assert {v.dtype for v in vs} == {"bf16", "fp16"}
    assert {v.num_stages for v in vs} >= {1, 2}
    assert any(v.head_dim % 32 for v in vs)  # a head dim with predicated columns
    assert any(v.head_dim != v.head_dim_v for v in vs)
    assert {v.qhead_per_kvhead for v in vs} == {1, 4, 6}  # pack GQA
    assert any(v.qhead_per_kvhead > 1 and v.split_kv and v.causal for v in vs)
    assert any(v.split_kv and v.varlen_q for v in vs)
    assert {v.exp2_emu_frac for v in vs} >= {0.0, 1.0} and {v.rescale_threshold for v in vs} >= {0.0, 8.0}
    for v in vs:
        sm80.FlashFwdSm80.can_implement(v)


def test_device_test_kernels_compile():
    from fa4._device_tests import Exp2TestConfig, SoftmaxTestConfig

    assert callable(jit.compile_uncached(Exp2TestConfig(arch="sm_80", dtype="bf16")))
    assert callable(jit.compile_uncached(SoftmaxTestConfig(arch="sm_80", dtype="bf16", exp2_emu_frac=0.25)))


# --------------------------------------------------------------------------------------------
# Tuning table and options
# --------------------------------------------------------------------------------------------


def _problem(d=128, dv=None, sq=1024, sk=1024, **kw):
    return AttnProblem(dtype="bf16", batch=2, seqlen_q=sq, seqlen_k=sk, heads=8, heads_k=8, head_dim=d,
                       head_dim_v=dv or d, softmax_scale=d**-0.5, **kw)


@pytest.mark.parametrize("d,expect", [  # (tile_m, tile_n, threads, K/V stages): see TUNING's measurements
    (32, (128, 128, 128, 2)), (64, (128, 128, 128, 2)), (80, (128, 64, 128, 1)), (96, (128, 64, 128, 1)),
    (128, (128, 64, 128, 1)), (160, (128, 64, 256, 1)), (192, (128, 64, 256, 1)), (256, (128, 64, 256, 1)),
])
def test_tuning_table(d, expect):
    cfg = sm80.make_config(_problem(d), None, "sm_80", True)
    assert (cfg.tile_m, cfg.tile_n, cfg.num_threads, cfg.num_stages) == expect
    # The classic rescale rule by default (docs/RESULTS.md v0.3, accuracy finding).
    assert cfg.exp2_emu_frac == 0.0 and cfg.rescale_threshold == 0.0 and not cfg.sum_rounded
    assert cfg.arch == "sm_80" and cfg.has_lse


def test_threshold_sums_the_rounded_p():
    cfg = sm80.make_config(_problem(128), KernelOptions(rescale_threshold=8.0), "sm_80", True)
    assert cfg.rescale_threshold == 8.0 and cfg.sum_rounded


def test_decode_shapes_use_64_row_tiles():
    cfg = sm80.make_config(_problem(256, sq=1, num_splits=1), None, "sm_90a", False)
    assert (cfg.tile_m, cfg.num_threads) == (64, 128) and not cfg.has_lse
    # 16 tiles of 16 K blocks on 132 SMs: split-KV, which needs the LSE (tests/test_splitkv.py).
    cfg = sm80.make_config(_problem(256, sq=1), None, "sm_90a", False, num_sms=132)
    assert (cfg.tile_m, cfg.split_kv, cfg.has_lse) == (64, True, True)


def test_flags_follow_the_problem():
    p = _problem(causal=True, local=False, softcap=30.0)
    cfg = sm80.make_config(p, None, "sm_80", True)
    assert cfg.causal and not cfg.local and cfg.has_softcap
    p = _problem(causal=False, local=True, window_left=10, window_right=0, varlen_q=True, varlen_k=True,
                 has_seqused_k=True)
    cfg = sm80.make_config(p, None, "sm_80", True)
    assert cfg.local and not cfg.causal and cfg.varlen_q and cfg.varlen_k and cfg.has_seqused_k and cfg.lpt


def test_options_override():
    opts = KernelOptions(tile_m=64, tile_n=128, num_threads=128, num_stages=2, exp2_emu_frac=0.25,
                         rescale_threshold=0.0)
    cfg = sm80.make_config(_problem(128), opts, "sm_90a", True)
    assert (cfg.tile_m, cfg.tile_n, cfg.num_threads, cfg.num_stages) == (64, 128, 128, 2)
    assert cfg.exp2_emu_frac == 0.25 and cfg.rescale_threshold == 0.0


@pytest.mark.parametrize("opts,word", [
    (KernelOptions(tile_m=96), "tile_m"),
    (KernelOptions(tile_n=24), "tile_n"),
    (KernelOptions(num_threads=96), "num_threads"),
    (KernelOptions(num_stages=4), "num_stages"),
    (KernelOptions(tile_n=256, num_stages=3), "num_stages"),  # shared memory
    (KernelOptions(tile_m=256, tile_n=128), "tile_m"),  # accumulator registers
])
def test_option_validation_names_the_option(opts, word):
    with pytest.raises(ValueError, match=word):
        sm80.make_config(_problem(256), opts, "sm_80", True)


def test_smem_capacity_depends_on_arch():
    opts = KernelOptions(num_stages=2)  # d = 256: 64 KB Q + 2 x 64 KB K/V = 192 KB
    with pytest.raises(ValueError):
        sm80.make_config(_problem(256), opts, "sm_80", True)
    assert sm80.make_config(_problem(256), opts, "sm_90a", True).num_stages == 2


# --------------------------------------------------------------------------------------------
# exp2 emulation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 8, 16, 32, 64])
@pytest.mark.parametrize("frac", [0.0, 0.1, 0.25, 0.5, 0.75, 1.0])
def test_emulated_elements_count_and_spread(n, frac):
    sel = emulated_elements(n, frac)
    k = math.floor(frac * n + 0.5)
    assert len(sel) == n and sum(sel) == k
    idx = [i for i, s in enumerate(sel) if s]
    if k >= 2:  # evenly spread: gaps differ by at most one
        gaps = np.diff(idx)
        assert gaps.max() - gaps.min() <= 1
    # Any window of n/k consecutive elements holds about the same number of emulated ones.
    assert emulated_elements(n, 0.0) == (False,) * n and emulated_elements(n, 1.0) == (True,) * n


def _emulate_exp2_numpy(x: np.ndarray) -> np.ndarray:
    """Bit-exact model of fa4.softmax.exp2_emulated (fp32 ops, round-down add, FMA via float64)."""
    x = np.maximum(x.astype(np.float32), np.float32(-127.0))
    n = np.floor(x)
    r = (n + np.float32(12582912.0)).astype(np.float32)  # exact: what add.rm produces
    f = (x - (r - np.float32(12582912.0))).astype(np.float32)
    c0, c1, c2, c3 = (np.float32(c) for c in EXP2_POLY)
    p = np.float32(c3)
    for c in (c2, c1, c0):
        p = (p.astype(np.float64) * f.astype(np.float64) + np.float64(c)).astype(np.float32)  # fma
    bits = p.view(np.int32).astype(np.int64) + (r.view(np.int32).astype(np.int64) << 23)
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def test_exp2_polynomial_accuracy():
    assert EXP2_POLY[0] == 1.0  # so that x <= -127 gives the bit pattern 0
    assert all(np.float32(c) == c for c in EXP2_POLY)
    x = np.linspace(-126.0, 8.0, 2_000_001)
    y = _emulate_exp2_numpy(x)
    ref = np.exp2(x.astype(np.float32).astype(np.float64))
    assert np.max(np.abs(y / ref - 1.0)) <= 1e-4
    assert np.all(_emulate_exp2_numpy(np.array([-127.0, -130.0, -1e30, -np.inf])) == 0.0)


# --------------------------------------------------------------------------------------------
# Mask block ranges (the same Python code the kernels trace), against brute force
# --------------------------------------------------------------------------------------------


def _visible(i, j, sq, sk, causal, local, wl, wr):
    if j >= sk:
        return False
    diag = i + sk - sq
    if local:
        return diag - wl <= j <= diag + wr
    if causal:
        return j <= diag
    return True


MASK_CASES = [
    (sq, sk, causal, local, wl, wr)
    for sq, sk in [(1, 1), (17, 50), (50, 17), (64, 64), (100, 300), (300, 100), (129, 129)]
    for causal, local, wl, wr in [(False, False, 0, 0), (True, False, 0, 0), (False, True, 5, 0),
                                  (False, True, 0, 40), (False, True, 70, 3), (False, True, 1000, 0)]
]


@pytest.mark.parametrize("sq,sk,causal,local,wl,wr", MASK_CASES)
@pytest.mark.parametrize("tile_m,tile_n", [(16, 16), (32, 16), (16, 64)])
def test_mask_block_ranges(sq, sk, causal, local, wl, wr, tile_m, tile_n):
    mask = AttentionMask(tile_m, tile_n, causal, local, sq, sk, wl, wr)
    vis = np.array([[_visible(i, j, sq, sk, causal, local, wl, wr) for j in range(sk)] for i in range(sq)])
    n_blocks, m_blocks = math.ceil(sk / tile_n), math.ceil(sq / tile_m)
    for m in range(m_blocks):
        rows = vis[m * tile_m:(m + 1) * tile_m]
        live = [n for n in range(n_blocks) if rows[:, n * tile_n:(n + 1) * tile_n].any()]
        n_min, n_max = mask.n_block_range(m)
        got = list(range(n_min, n_max))
        # The range holds every live block and (windows are convex) nothing outside their span.
        assert set(live) <= set(got)
        if live:
            assert got == list(range(live[0], live[-1] + 1))
        # Masked / unmasked split: blocks between the two boundaries need no window mask.
        right, left = mask.n_block_min_no_right_mask(m), mask.n_block_max_left_mask(m)
        row_ids = np.arange(m * tile_m, min((m + 1) * tile_m, sq))
        for n in got:
            block_vis = rows[:, n * tile_n:(n + 1) * tile_n]
            in_k = np.arange(n * tile_n, (n + 1) * tile_n) < sk
            if (causal or local) and left <= n < right and in_k.all():
                assert block_vis.all(), (m, n)
        del row_ids
    for n in range(n_blocks):
        cols = vis[:, n * tile_n:(n + 1) * tile_n]
        live = [m for m in range(m_blocks) if cols[m * tile_m:(m + 1) * tile_m].any()]
        m_min, m_max = mask.m_block_range(n)
        assert set(live) <= set(range(m_min, m_max))
        if live:
            assert list(range(m_min, m_max)) == list(range(live[0], live[-1] + 1))


# --------------------------------------------------------------------------------------------
# Tile order
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,h,b,section", [(7, 3, 2, 1), (7, 3, 2, 4), (1, 16, 3, 48), (12, 5, 1, 5), (3, 1, 1, 1)])
@pytest.mark.parametrize("reverse", [False, True])
def test_section_tile_is_a_bijection_with_lpt_order(m, h, b, section, reverse):
    tiles = [section_tile(t, m, h, b, section, reverse) for t in range(m * h * b)]
    assert len(set(tiles)) == m * h * b
    assert all(0 <= mb < m and 0 <= hh < h and 0 <= bb < b for mb, hh, bb in tiles)
    if reverse:  # within the first section, the longest (last) m-blocks come first
        first = tiles[: min(section, h * b)]
        assert all(mb == m - 1 for mb, _, _ in first)


@pytest.mark.parametrize("lens,tile,heads,section,mult,reverse", [
    ([1, 840, 1451, 3, 700, 2000, 129, 64], 128, 6, 4, 1, False), ([1300, 949, 1, 3, 1500], 64, 3, 3, 1, False),
    ([128, 128, 256], 128, 2, 1, 1, False), ([5], 128, 1, 8, 1, False), ([0, 7, 0, 300], 128, 4, 16, 1, False),
    (list(range(1, 70)), 64, 2, 2, 1, False), ([1, 840, 1451, 3, 700], 128, 8, 8, 1, True),
    ([1, 33, 200, 0, 17], 64, 4, 2, 4, True), ([300, 5], 192, 2, 2, 6, False), ([40, 7], 128, 12, 24, 1, False)])
@pytest.mark.parametrize("base,extra", [(0, 0), (0, 300), (200, 0)])
def test_compact_varlen_grid(lens, tile, heads, section, mult, reverse, base, extra):
    """Note [Compact varlen grid] (the twin of compact_tile): every block of every sequence and head
    has exactly one slot, each sequence at most one empty slot per head (more for the last one when
    the packed tensor has ``extra`` rows past the batch), with ``cu[0] = base`` too; inside a
    sequence's sections the slots are slowest, from its first block up, or with ``reverse`` (LPT)
    from its last block down; a section divides the heads."""
    from fa4.sched.tile import host_compact_tiles

    cu = [base]
    for n in lens:
        cu.append(cu[-1] + n)
    rows = cu[-1] - base + extra
    tiles = host_compact_tiles(cu, tile, heads, section, mult, reverse, rows)
    assert len(tiles) == heads * (rows * mult // tile + len(lens))
    assert all(0 <= h < heads and 0 <= b < len(lens) for _, h, b in tiles)
    for b, n in enumerate(lens):
        blocks = -(-n * mult // tile)
        for h in range(heads):
            mine = sorted(x for x, hh, bb in tiles if bb == b and hh == h)
            assert mine[:blocks] == list(range(blocks)), (b, h, mine)
            assert all(x >= blocks for x in mine[blocks:])  # the rest: empty slots, past the blocks
            if b < len(lens) - 1 or not extra:
                assert len(mine) - blocks <= 1, (b, h, mine)
    last0 = -(-lens[0] * mult // tile) - 1
    first = tiles[:min(section, heads)]
    assert all(b == 0 and x == (last0 if reverse and last0 >= 0 else 0) for x, _, b in first[:1])


def test_l2_section_size():
    assert l2_section_size(8192, 512, 1, 1000) == 6  # 24 MB / (8192 * 512 B)
    assert l2_section_size(8192, 512, 4, 1000) == 24  # GQA: 4 q heads share a kv head
    assert l2_section_size(10**7, 1024, 1, 64) == 1
    assert l2_section_size(1, 64, 1, 7) == 7
    assert l2_section_size(8192, 512, 1, 1000, budget=8 << 20) == 2
    # Powers of two (Note [Section sizes], the sm90 forward): 6 -> 4, 24 -> 16, never 0.
    assert l2_section_size(8192, 512, 1, 1000, pow2=True) == 4
    assert l2_section_size(8192, 512, 4, 1000, pow2=True) == 16
    assert l2_section_size(10**7, 1024, 1, 64, pow2=True) == 1
    assert l2_section_size(8192, 1024, 1, 3, budget=32 << 20, pow2=True) == 3  # at most the pairs


def test_floor_pow2():
    from fa4.sched.tile import floor_pow2

    for n in list(range(0, 70)) + [2**20 - 1, 2**20, 2**30 + 7]:
        p = floor_pow2(n)
        assert p == (1 if n < 2 else 1 << (min(n, 2**20).bit_length() - 1)), n


def test_section_tail_model():
    """Note [Section sizes]: a greedy model of the dynamic scheduler (132 SMs, tile time = K blocks
    + 2) on d256 s8k causal (b2 h8, 128 x 80 tiles) in the LPT section order: one-pair sections
    leave SMs idle at the end, power-of-two sections of 2-8 pairs do not, 3 pairs (a small last
    section) do again."""
    import heapq
    import math

    def useful_share(pairs):
        nm, heads, batch = 64, 8, 2
        times = []
        for idx in range(nm * heads * batch):
            m, _, _ = section_tile(idx, nm, heads, batch, pairs, True)
            times.append(min(math.ceil((m + 1) * 128 / 80), math.ceil(8192 / 80)) + 2)
        free = [0.0] * 132
        for t in times:
            heapq.heappush(free, heapq.heappop(free) + t)
        return sum(times) / 132 / max(free)

    assert useful_share(1) < 0.92 and useful_share(3) < 0.9
    assert min(useful_share(p) for p in (2, 4, 8)) > 0.99
    assert l2_section_size(1, 64, 4, 7, budget=0) == 1  # the sm90 persistent order: one pair per section
    # One pair per section: m-blocks fastest, pairs in order.
    assert [section_tile(t, 3, 2, 1, 1, False) for t in range(4)] == [(0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 0)]
