"""Pack GQA and split-KV on the host (CPU): the packed mask's block ranges against brute force,
the split ranges, fa4's choices of packing and split counts, and the argument checks."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import fa4
from fa4 import validate
from fa4.config import AttnProblem
from fa4.fwd import common as fwd_common
from fa4.mask import AttentionMask
from fa4.sched.tile import split_range
from fa4.testing import attention_mask, attention_ref


@pytest.mark.parametrize("g", [2, 3, 4, 6])
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 300), (5, 70), (17, 50), (40, 40), (33, 129)])
@pytest.mark.parametrize("causal,local,wl,wr", [(False, False, 0, 0), (True, False, 0, 0), (False, True, 5, 0),
                                                (False, True, 0, 40), (False, True, 70, 3)])
@pytest.mark.parametrize("tile_m,tile_n", [(16, 16), (64, 32)])
@pytest.mark.parametrize("partial", [False, True])
def test_packed_mask_block_ranges(g, sq, sk, causal, local, wl, wr, tile_m, tile_n, partial):
    """Packed row p is query p // g: the block ranges cover every visible key of the tile's rows,
    and the blocks between the two mask boundaries need no window mask. ``partial``: blocks of
    ``tile_m // g`` whole positions (``row_block``, Note [Packed rows by TMA])."""
    block = (tile_m // g) * g if partial else tile_m
    mask = AttentionMask(tile_m, tile_n, causal, local, sq, sk, wl, wr, g, block if partial else 0)
    assert mask.rows == block
    rows = sq * g
    allowed = attention_mask(sq, sk, causal=causal, window_size=(wl, wr) if local else (None, None)).numpy()
    vis = allowed[np.arange(rows) // g]  # packed row p is query p // g
    for m in range(math.ceil(rows / block)):
        tile = vis[m * block:(m + 1) * block]
        live = [n for n in range(math.ceil(sk / tile_n)) if tile[:, n * tile_n:(n + 1) * tile_n].any()]
        n_min, n_max = mask.n_block_range(m)
        assert set(live) <= set(range(n_min, n_max)), (m, live, n_min, n_max)
        if live:
            assert list(range(n_min, n_max)) == list(range(live[0], live[-1] + 1))
        right, left = mask.n_block_min_no_right_mask(m), mask.n_block_max_left_mask(m)
        for n in range(n_min, n_max):
            in_k = np.arange(n * tile_n, (n + 1) * tile_n) < sk
            if (causal or local) and left <= n < right and in_k.all():
                assert tile[:, n * tile_n:(n + 1) * tile_n].all(), (m, n)


@pytest.mark.parametrize("n_min,n_max", [(0, 0), (0, 1), (3, 4), (0, 10), (5, 261)])
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
def test_split_ranges_partition_the_blocks(n_min, n_max, splits):
    ranges = [split_range(n_min, n_max, s, splits) for s in range(splits)]
    blocks = [n for lo, hi in ranges for n in range(lo, hi)]
    assert blocks == list(range(n_min, n_max))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1


def _problem(b, sq, sk, h, hk, **kw):
    return AttnProblem("bf16", b, sq, sk, h, hk, 128, 128, 0.1, **kw)


def test_pack_decision():
    assert fwd_common.pack_gqa(_problem(64, 1, 8192, 32, 8), 64) == 4
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 32, 8), 128) == 1  # prefill: no fewer tiles
    assert fwd_common.pack_gqa(_problem(2, 16, 8192, 32, 8), 64) == 4
    # Packing must save clearly more tiles than its row-by-row path costs (PACK_GQA_MAX_TILE_SHARE):
    # 118 packed tiles against 120 do not (a varlen batch's longest sequence, v0.26), 7 against 8 do.
    assert fwd_common.pack_gqa(_problem(2, 3774, 3774, 32, 8), 128) == 1
    assert fwd_common.pack_gqa(_problem(2, 200, 200, 32, 8), 128) == 4
    assert fwd_common.pack_gqa(_problem(2, 100, 100, 32, 8), 128) == 1
    assert fwd_common.pack_gqa(_problem(2, 1, 100, 32, 32), 64) == 1  # MHA
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 32, 8, pack_gqa=True), 128) == 4
    assert fwd_common.pack_gqa(_problem(64, 1, 8192, 32, 8, pack_gqa=False), 64) == 1
    # A family packing whole positions cheaply (sm90's TMA boxes, PACK_WHOLE_ROWS_MAX_GROUP) packs
    # any length where the tile holds whole positions of at most that many heads, and not with user
    # functions or a block table (block skipping needs unpacked rows).
    whole = fwd_common.PACK_WHOLE_ROWS_MAX_GROUP
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 32, 8), 128, whole) == 4
    assert fwd_common.pack_gqa(_problem(2, 3774, 3774, 16, 8), 192, whole) == 2
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 36, 6), 128, whole) == 1  # 6 does not divide 128
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 36, 6), 128, whole, partial_boxes=True) == 6
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 48, 6), 128, whole, partial_boxes=True) == 8
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 64, 4), 128, whole, partial_boxes=True) == 1  # 16 > 8
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 24, 8), 128, whole) == 1  # 3 does not divide 128
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 24, 8), 192, whole) == 3
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 32, 8, mask_mod="m"), 128, whole) == 1
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 32, 8, block_table=(0, 128, 128)), 128, whole) == 1
    assert fwd_common.pack_gqa(_problem(2, 8192, 8192, 32, 8, pack_gqa=False), 128, whole) == 1


def test_split_count_heuristic():
    ns = fwd_common.num_splits
    assert ns(_problem(64, 1, 8192, 32, 8), 512, 128, 132) == 1  # tiles fill the GPU
    s = ns(_problem(8, 1, 32768, 32, 8), 64, 128, 132)
    assert s > 1 and 64 * s >= 0.9 * 132
    s1 = ns(_problem(1, 1, 20000, 32, 8), 8, 128, 132)
    assert 8 * s1 >= 0.9 * 132 and s1 <= 157 // 2
    assert ns(_problem(1, 1, 512, 32, 8), 8, 128, 132) == 1  # 4 K blocks: never split
    assert ns(_problem(64, 1, 8192, 32, 8, num_splits=5), 512, 128, 132) == 5  # explicit
    assert ns(_problem(1, 1, 100, 32, 8, num_splits=1000), 8, 128, 132) == fwd_common.MAX_SPLITS


def test_sm90_configs_for_decode():
    from fa4.fwd import sm90

    cfg = sm90.make_config(_problem(64, 1, 8192, 32, 8), None, "sm_90a", False, num_sms=132)
    assert (cfg.qhead_per_kvhead, cfg.split_kv, cfg.tile_m) == (4, False, 64)
    cfg = sm90.make_config(_problem(8, 1, 32768, 32, 8), None, "sm_90a", False, num_sms=132)
    assert (cfg.qhead_per_kvhead, cfg.split_kv, cfg.has_lse) == (4, True, True)
    # Prefill: packed by TMA boxes up to 8 q heads per kv head (PACK_WHOLE_ROWS_MAX_GROUP, v0.43),
    # not past it (MQA 16 / 1); with a ragged Q, a group that does not divide the tile by boxes of
    # tile_m // g positions (7 in 128 rows: 18 positions, 126 rows), not with dense rows.
    cfg = sm90.make_config(_problem(2, 4096, 4096, 32, 8), None, "sm_90a", True, num_sms=132)
    assert (cfg.qhead_per_kvhead, cfg.split_kv, cfg.pack_tma) == (4, False, True)
    cfg = sm90.make_config(_problem(1, 4096, 4096, 28, 4, varlen_q=True, varlen_k=True, total_q=6000, total_k=6000), None, "sm_90a", True,
                           num_sms=132)
    assert (cfg.qhead_per_kvhead, cfg.pack_tma_takes, cfg.packed_block_rows) == (7, True, 126)
    cfg = sm90.make_config(_problem(2, 4096, 4096, 28, 4), None, "sm_90a", True, num_sms=132)
    assert cfg.qhead_per_kvhead == 1
    cfg = sm90.make_config(_problem(2, 4096, 4096, 64, 8), None, "sm_90a", True, num_sms=132)
    assert (cfg.qhead_per_kvhead, cfg.packed_block_rows) == (8, 128)
    cfg = sm90.make_config(_problem(2, 4096, 4096, 16, 1), None, "sm_90a", True, num_sms=132)
    assert (cfg.qhead_per_kvhead, cfg.split_kv) == (1, False)
    # Queries of at most 64 positions keep the decode tile's rule (the whole-rows rule would move
    # s_q 17-64 into a larger packed tile: not measured).
    cfg = sm90.make_config(_problem(8, 64, 8192, 32, 8), None, "sm_90a", False, num_sms=132)
    assert (cfg.qhead_per_kvhead, cfg.tile_m, cfg.persistent) == (1, 64, False)
    # Packed boxes of tile_m // g positions (pack_tma_partial): 21 positions of 6 heads fill 126 of
    # 128 rows; not with user functions, whose positions assume whole tiles, nor past the tile.
    cfg = sm90.make_config(_problem(2, 4096, 4096, 36, 6, pack_gqa=True), None, "sm_90a", False, num_sms=132)
    assert (cfg.qhead_per_kvhead, cfg.tile_m, cfg.pack_tma_takes, cfg.packed_block_rows) == (6, 128, True, 126)
    off = dataclasses.replace(cfg, pack_tma_partial=False)
    assert (off.pack_tma_takes, off.packed_block_rows) == (False, 128)
    assert dataclasses.replace(cfg, mask_mod="m").packed_block_rows == 128
    assert dataclasses.replace(cfg, qhead_per_kvhead=130).pack_tma_takes is False
    # The sm80 family (row copies) keeps the tile-share rule at any group size.
    assert fwd_common.rows_plan(_problem(2, 4096, 4096, 32, 8), 128, None)[0] == 1


def test_hint_arguments_are_checked():
    assert validate.check_num_splits(None) == 0
    assert validate.check_num_splits(-3) == 0
    assert validate.check_num_splits(4) == 4
    with pytest.raises(TypeError, match="num_splits"):
        validate.check_num_splits(2.0)
    with pytest.raises(TypeError, match="num_splits"):
        validate.check_num_splits(True)
    from fa4.interface import _with_hints

    p = _problem(1, 1, 10, 4, 2)
    assert _with_hints(p, None, None) is p
    assert _with_hints(p, 3, True).num_splits == 3 and _with_hints(p, 3, True).pack_gqa is True
    with pytest.raises(TypeError, match="pack_gqa"):
        _with_hints(p, None, 1)


def test_sm80_configs_for_decode():
    """The sm80 family makes the same decisions on its own tiles (64-row tiles for packed decode
    rows, K blocks of 64 at d128)."""
    from fa4.config import KernelOptions
    from fa4.fwd import sm80

    cfg = sm80.make_config(_problem(64, 1, 8192, 32, 8), None, "sm_80", False, num_sms=108)
    assert (cfg.qhead_per_kvhead, cfg.split_kv, cfg.tile_m, cfg.num_threads) == (4, False, 64, 128)
    cfg = sm80.make_config(_problem(8, 1, 32768, 32, 8), None, "sm_80", False, num_sms=108)
    assert (cfg.qhead_per_kvhead, cfg.split_kv, cfg.has_lse, cfg.tile_m) == (4, True, True, 64)
    assert fwd_common.split_count(_problem(8, 1, 32768, 32, 8), 64, 64, 4, 108) == fwd_common.num_splits(
        _problem(8, 1, 32768, 32, 8), 64, 64, 108)
    cfg = sm80.make_config(_problem(2, 4096, 4096, 32, 8), None, "sm_80", True, num_sms=108)
    assert (cfg.qhead_per_kvhead, cfg.split_kv, cfg.tile_m) == (1, False, 128)
    # 32 query positions x 4 heads = 128 packed rows: the table's 128-row tile.
    cfg = sm80.make_config(_problem(4, 32, 8192, 32, 8), None, "sm_80", True, num_sms=108)
    assert (cfg.qhead_per_kvhead, cfg.tile_m) == (4, 128)
    # The hints are honoured; a user tile is the one the packing decision sees.
    cfg = sm80.make_config(_problem(1, 1, 4096, 4, 2, num_splits=4, pack_gqa=False), None, "sm_80", False)
    assert (cfg.qhead_per_kvhead, cfg.split_kv, cfg.has_lse) == (1, True, True)
    cfg = sm80.make_config(_problem(2, 100, 100, 8, 2, pack_gqa=True), KernelOptions(tile_m=128), "sm_80", True)
    assert (cfg.qhead_per_kvhead, cfg.tile_m, cfg.split_kv) == (4, 128, False)
    with pytest.raises(ValueError, match="split_kv needs has_lse"):
        sm80.FlashFwdSm80.can_implement(dataclasses.replace(cfg, split_kv=True, has_lse=False))


def test_explain_shows_split_and_pack():
    q = torch.empty(8, 1, 32, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(8, 32768, 8, 128, dtype=torch.bfloat16, device="meta")
    ex = fa4.explain(q, k, k, capability=(9, 0))
    text = str(ex)
    assert "qhead_per_kvhead': 4" in text and "split_kv': True" in text


# --------------------------------------------------------------------------------------------
# Host-side pieces that are plain torch (CPU): the sink composition and the page gather
# --------------------------------------------------------------------------------------------


def _ref_with_sink(q, k, v, sink, causal):
    """Explicit float64 attention with a sink column (value 0) appended to every row."""
    from fa4.testing import attention_mask

    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = s.masked_fill(~attention_mask(q.shape[1], k.shape[1], causal=causal), float("-inf"))
    full = torch.cat([s, sink[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)], dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v), torch.logsumexp(full, dim=-1)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_sink_composition_matches_the_sink_column(packed, causal):
    """interface._apply_sink on the out / lse of attention without the sink equals attention with a
    sink column (float64, CPU), for batched and packed q, rows with no key included."""
    from fa4.interface import _apply_sink

    torch.manual_seed(0)
    b, sq, sk, h, hk, d = 2, 9, 5, 4, 2, 8
    q, k, v = (torch.randn(b, n, hh, d, dtype=torch.float64) for n, hh in ((sq, h), (sk, hk), (sk, hk)))
    sink = torch.randn(h, dtype=torch.float64)
    out0, lse0 = attention_ref(q, k, v, causal=causal, upcast=False)  # rows with no key: 0 / -inf
    want, want_lse = _ref_with_sink(q, k, v, sink, causal)
    if packed:
        out, lse = _apply_sink(out0.flatten(0, 1), lse0.transpose(0, 1).flatten(1, 2), sink, True, True)
        out, lse = out.unflatten(0, (b, sq)), lse.unflatten(1, (b, sq)).transpose(0, 1)
    else:
        out, lse = _apply_sink(out0, lse0, sink, False, True)
    # The LSE and the sink scale run in float32 (as on the GPU): float32 tolerances.
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-6)
    out_m, lse_m = _apply_sink(out0, lse0, torch.full((h,), float("-inf"), dtype=torch.float64), False, True)
    assert not out_m.isnan().any() and not lse_m.isnan().any()


def test_gather_pages_builds_the_batched_cache():
    """ops._gather_pages: sequence b's key j is row j % page_size of page page_table[b, j // page_size]."""
    from fa4 import ops

    torch.manual_seed(1)
    num_pages, page_size, hk, d = 11, 3, 2, 4
    kc, vc = torch.randn(num_pages, page_size, hk, d), torch.randn(num_pages, page_size, hk, d)
    table = torch.tensor([[4, 0, 9], [7, 7, 2]], dtype=torch.int32)
    problem = _problem(2, 1, 9, 4, 2, page_size=page_size)
    kk, vv, none = ops._gather_pages(problem, kc, vc, table)
    assert none is None and kk.shape == (2, 9, hk, d)
    for bb in range(2):
        for j in range(9):
            page = table[bb, j // page_size]
            assert torch.equal(kk[bb, j], kc[page, j % page_size]) and torch.equal(vv[bb, j], vc[page, j % page_size])


@pytest.mark.parametrize("page_size,cap,tma", [(16, (9, 0), True), (256, (9, 0), True), (12, (9, 0), False),
                                               (1, (9, 0), False), (16, (8, 0), False)])
def test_explain_paged_calls(page_size, cap, tma):
    """explain() plans a paged call as ops.forward runs it: TMA page chunks on sm90 for page sizes
    that are multiples of 8, else a gather first (with a note naming why), never an error."""
    q = torch.empty(4, 1, 32, 128, dtype=torch.bfloat16, device="meta")
    kc = torch.empty(64, page_size, 8, 128, dtype=torch.bfloat16, device="meta")
    pt = torch.empty(4, 16, dtype=torch.int32, device="meta")
    used = torch.empty(4, dtype=torch.int32, device="meta")
    ex = fa4.explain(q, kc, kc, page_table=pt, seqused_k=used, capability=cap)
    cfg = ex.directions["fwd"]["config"]
    text = str(ex)
    if tma:
        assert cfg["page_rows"] == math.gcd(page_size, cfg["tile_n"]) and "gathered" not in text
    else:
        assert cfg["page_rows"] == 0 and "gathered" in text
