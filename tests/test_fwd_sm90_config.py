"""The sm90 forward's tuning table, option handling and support checks (CPU)."""

import pytest

from fa4.config import AttnProblem, KernelOptions
from fa4.fwd import sm90


def _problem(d=128, dv=None, sq=4096, sk=4096, **kw):
    return AttnProblem(dtype="bf16", batch=2, seqlen_q=sq, seqlen_k=sk, heads=8, heads_k=8, head_dim=d,
                       head_dim_v=dv or d, softmax_scale=d**-0.5, **kw)


@pytest.mark.parametrize("d,expect", [  # (tile_m, tile_n, stages, rescale_o_before_pv): TUNING's measurements
    (64, (192, 128, 2, False)), (96, (128, 128, 2, False)), (128, (128, 128, 2, False)),
    (192, (128, 112, 2, True)), (256, (128, 80, 2, True)),
])
def test_tuning_table(d, expect):
    cfg = sm90.make_config(_problem(d), None, "sm_90a", True)
    assert (cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.rescale_o_before_pv) == expect
    assert cfg.rescale_threshold == 0.0 and not cfg.sum_rounded and cfg.exp2_emu_frac == 0.0
    # d64's three warpgroups take turns around their K-block steps (v0.12); the others run free.
    assert cfg.pingpong == (d == 64) and cfg.pp_steps_only == (d == 64)
    # O staged by stmatrix at d256 only (v0.58: d256 causal +0-2%, d64 both ways, d128 -1%).
    assert cfg.stmatrix_o == (d == 256)
    assert not sm90.make_config(_problem(256, 128), None, "sm_90a", True).stmatrix_o


@pytest.mark.parametrize("d,dv,mask,one", [
    (192, None, "causal", True), (192, None, "local", True), (192, None, None, False), (160, None, "causal", True),
    (192, 128, "causal", False), (128, None, "causal", False), (64, None, "local", False), (256, None, "causal", False),
    (256, None, "local", True), (256, None, None, False), (128, None, "local", False), (256, 128, "local", False)])
def test_one_step_loop_by_bucket(d, dv, mask, one):
    """one_step_loop is the default where it measured as fast as the separate loops and compiles faster
    (RESULTS v0.36): causal and local tiles of the 192 bucket with head_dim_v == head_dim; the others
    keep the separate loops (faster there), except d256 windows (v0.56: ONE_STEP_LOOP_LOCAL_BUCKETS, for the
    compile time, at equal speed within the leases' spread)."""
    kw = dict(causal=True) if mask == "causal" else dict(local=True, window_left=512, window_right=0) if mask else {}
    assert sm90.make_config(_problem(d, dv, **kw), None, "sm_90a", True).one_step_loop == one


@pytest.mark.parametrize("d,dv,mask,fold", [
    (64, None, "causal", True), (128, None, "causal", True), (256, None, "causal", True), (192, 128, "causal", True),
    (192, None, "causal", False), (64, None, "local", True), (128, None, "local", False), (256, None, "local", False),
    (128, None, None, False)])
def test_fold_first_by_mask(d, dv, mask, fold):
    """fold_first is the default for causal tiles with separate loops (RESULTS v0.44) and for local
    windows at d64 (v0.45: faster there; 2-5% slower at d128), not where one step body serves every
    block (d192), not without a mask (nothing to fold into)."""
    kw = dict(causal=True) if mask == "causal" else dict(local=True, window_left=512, window_right=0) if mask else {}
    assert sm90.make_config(_problem(d, dv, **kw), None, "sm_90a", True).fold_first == fold


def test_fold_first_not_with_user_functions_or_block_skip():
    """A tile with user functions or block skipping keeps its first block's own code (``folds_first``),
    so its config does not claim a fold."""
    assert not sm90._fold_first(True, False, 128, False, True, ())
    assert not sm90._fold_first(True, False, 128, False, False, (0, 128, 128))
    assert not sm90._fold_first(False, True, 64, False, True, ())
    assert sm90._fold_first(True, False, 128, False, False, ())
    assert sm90._fold_first(False, True, 64, False, False, ())


def test_pingpong_belongs_to_the_table_tile():
    """A user's tile_m or a decode tile runs without the table's ping-pong."""
    assert not sm90.make_config(_problem(64), KernelOptions(tile_m=128), "sm_90a", True).pingpong
    assert not sm90.make_config(_problem(64, sq=1), None, "sm_90a", True).pingpong


@pytest.mark.parametrize("d,sk,causal,dynamic,sections", [
    (128, 1024, False, False, 0), (128, 16384, False, False, 0), (128, 1024, True, False, 0),
    (128, 1025, True, True, 16), (128, 8192, True, True, 16), (256, 8192, True, True, 16),
    (256, 8192, False, True, 0), (192, 2048, False, True, 0), (256, 1024, False, False, 0),
    (128, 8192, False, False, 0), (128, 4096, False, False, 0)])
def test_grid_order_by_length(d, sk, causal, dynamic, sections):
    """The measured choice (RESULTS v0.8, v0.16): always persistent; static with one-pair L2
    sections, except masked rows past s_k 1024 (tiles claimed dynamically, 16 MB sections) and
    rows without a mask past s_k 1024 at head dims > 128 (dynamic, one-pair sections); v0.50: d128
    without a mask from s_k 4096 with K/V multicast, persistent (Note [K/V multicast]); v0.52: d128
    causal from s_k 8192 too, keeping the dynamic grid (Note [Pair claims])."""
    cfg = sm90.make_config(_problem(d, sq=sk, sk=sk, causal=causal), None, "sm_90a", True)
    mcast = d == 128 and sk >= (sm90.KV_MCAST_CAUSAL_MIN_SEQLEN_K if causal else sm90.KV_MCAST_MIN_SEQLEN_K)
    assert cfg.kv_mcast == mcast
    assert cfg.persistent and cfg.dynamic_sched == dynamic
    assert cfg.l2_section_mb == sections


@pytest.mark.parametrize("extra", [dict(gqa=True, causal=True), dict(varlen_q=True, varlen_k=True, total_q=16384, total_k=16384),
                                   dict(has_seqused_k=True), dict(local=True), dict(sq=1),
                                   dict(causal=True, sk=4096)])
def test_kv_mcast_only_dense_non_causal(extra):
    """K/V multicast (v0.50) takes only dense d128 tiles without a window or lengths, from s_k 4096
    (causal ones from 8192, v0.52; packed GQA ones without a mask, v0.53): both tiles of a cluster must walk the same K blocks (Note [K/V
    multicast]); decode tiles keep their grid; shorter keys gain nothing (H100 s1k within 1%)."""
    assert sm90.make_config(_problem(128, sq=8192, sk=8192), None, "sm_90a", True).kv_mcast
    assert sm90.make_config(_problem(128, sq=8192, sk=4096), None, "sm_90a", True).kv_mcast
    assert not sm90.make_config(_problem(128, sq=8192, sk=2048), None, "sm_90a", True).kv_mcast
    assert not sm90.make_config(_problem(112, sq=8192, sk=8192), None, "sm_90a", True).kv_mcast  # not measured
    kw = {**dict(sq=8192, sk=8192), **extra}
    if kw.get("local"):
        kw.update(window_left=256, window_right=0)
    if kw.pop("gqa", False):
        problem = AttnProblem(dtype="bf16", batch=2, seqlen_q=8192, seqlen_k=8192, heads=8, heads_k=2, head_dim=128,
                              head_dim_v=128, softmax_scale=128**-0.5, causal=kw.get("causal", False))
    else:
        problem = _problem(128, **kw)
    assert not sm90.make_config(problem, None, "sm_90a", True).kv_mcast


@pytest.mark.parametrize("heads_k,sk,sms,taken", [(2, 8192, 132, True), (2, 4096, 132, True), (1, 4096, 132, True),
                                                  (2, 2048, 132, False), (2, 16384, 114, False)])
def test_kv_mcast_gqa_rule(monkeypatch, heads_k, sk, sms, taken):
    """v0.53 (KV_MCAST_GQA): packed GQA rows without a mask (whole positions a tile: g = 4, 8) take
    multicast from s_k 4096 on the persistent grid (H100 gqa-d128-s4k +3.5% / +3.9%), not on the plain
    grid (not measured; off the measured SM counts with no driver count); explain names the switch. Off,
    they keep their grid."""
    monkeypatch.setattr(sm90, "_resident_pairs", lambda index: None)
    monkeypatch.setattr(sm90, "_num_sms", lambda device: sms)
    problem = AttnProblem(dtype="bf16", batch=2, seqlen_q=sk, seqlen_k=sk, heads=8, heads_k=heads_k, head_dim=128,
                          head_dim_v=128, softmax_scale=128**-0.5)
    cfg = sm90.make_config(problem, None, "sm_90a", True, num_sms=sms)
    assert cfg.qhead_per_kvhead == 8 // heads_k and cfg.pack_tma_takes
    assert cfg.kv_mcast == taken, cfg
    if taken:
        assert cfg.persistent and not cfg.dynamic_sched
        sm90.FlashFwdSm90.can_implement(cfg)
        assert "KV_MCAST_GQA" in " ".join(sm90.explain_notes(problem, None, cfg))
        mha = _problem(128, sq=sk, sk=sk)
        mha_cfg = sm90.make_config(mha, None, "sm_90a", True, num_sms=sms)
        assert mha_cfg.kv_mcast and "KV_MCAST_GQA" not in " ".join(sm90.explain_notes(mha, None, mha_cfg))
    monkeypatch.setattr(sm90, "KV_MCAST_GQA", False)
    assert not sm90.make_config(problem, None, "sm_90a", True, num_sms=sms).kv_mcast


@pytest.mark.parametrize("ragged", [dict(varlen_q=True, varlen_k=True, total_q=16384, total_k=16384),
                                    dict(has_seqused_k=True), dict(has_seqused_q=True)])
@pytest.mark.parametrize("d,sk,dynamic", [(64, 4096, True), (128, 4096, True), (128, 1024, False)])
def test_grid_order_ragged(ragged, d, sk, dynamic):
    """v0.27: ragged rows (varlen, seqused) without a mask past s_k 1024 take the dynamic grid at any
    head dim (one-pair sections); the static snake gave CTAs slots of sequences of different lengths."""
    cfg = sm90.make_config(_problem(d, sq=sk, sk=sk, **ragged), None, "sm_90a", True)
    assert cfg.persistent and cfg.dynamic_sched == dynamic and cfg.l2_section_mb == 0
    # Masked: dynamic past s_k 1024 with 16 MB sections, varlen or not (v0.28: the one-pair sections
    # v0.27 gave masked varlen rows did not hold up over rounds).
    masked = sm90.make_config(_problem(d, sq=sk, sk=sk, causal=True, **ragged), None, "sm_90a", True)
    assert masked.dynamic_sched == (sk > 1024)
    assert masked.l2_section_mb == (16 if sk > 1024 else 0)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kind", ["dense", "varlen", "seqused", "paged"])
def test_decode_tile_and_grid(d, kind, monkeypatch):
    """v0.28: a decode tile (64 rows of a short packed q) takes at most 64-row K blocks and one CTA
    per tile (decode_sweep --grid: -1% / -1.6% time at b64 s8k / b8 s32k); calls with seqused_k or
    a page table keep the table's K blocks (paged: +3% time with 64-row blocks; paged and unpaged with
    seqused_k share their bits), one CTA per tile too (v0.29); a user's tile_n wins; sm90.DECODE_GRID off restores the prefill
    tiles' blocks and grid."""
    kw = {"dense": {}, "varlen": dict(varlen_q=True, varlen_k=True, total_q=8, total_k=30000),
          "seqused": dict(has_seqused_k=True), "paged": dict(has_seqused_k=True, page_size=16)}[kind]
    prob = _problem(d, sq=1, sk=8192, **kw)
    cfg = sm90.make_config(prob, None, "sm_90a", False)
    table_n = sm90.TUNING[d][1]
    assert cfg.tile_m == 64
    assert not cfg.persistent and not cfg.dynamic_sched
    if kind in ("dense", "varlen"):
        assert cfg.tile_n == min(64, table_n)
    else:
        assert cfg.tile_n == table_n  # the table's blocks (v0.29: one CTA per tile)
    assert sm90.make_config(prob, KernelOptions(tile_n=48), "sm_90a", False).tile_n == 48
    # (A varlen prefill's totals: two sequences of that length; a longest length far above the
    # average would take the compact grid, COMPACT_LOOSE_BOUND.)
    pkw = dict(kw, total_q=2 * 4096, total_k=2 * 8192) if kind == "varlen" else kw
    prefill = sm90.make_config(_problem(d, sq=4096, sk=8192, **pkw), None, "sm_90a", False)
    assert prefill.persistent and prefill.tile_n == table_n
    monkeypatch.setattr(sm90, "DECODE_GRID", False)
    old = sm90.make_config(prob, None, "sm_90a", False)
    assert old.persistent and old.tile_n == table_n


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("b,sq,sk,hk,causal", [(64, 1, 8192, 2, False), (8, 1, 32768, 2, False), (1, 1, 512, 2, False),
                                               (4, 4, 2048, 1, True), (2, 1000, 4096, 8, True), (2, 113, 203, 4, False)])
@pytest.mark.parametrize("page_size", [16, 64, 256])
def test_paged_and_seqused_share_a_config(d, b, sq, sk, hk, causal, page_size):
    """test_paged_kv (GPU) checks a paged call's bits against the same call unpaged with seqused_k:
    that holds only if both take the same tiles, grid and split count; only the TMA boxes of the
    pages may differ. (v0.28's first paged decode rule broke it.)"""
    from dataclasses import replace

    from fa4.fwd import common as fwd_common

    kw = dict(dtype="bf16", batch=b, seqlen_q=sq, seqlen_k=sk, heads=8, heads_k=hk, head_dim=d, head_dim_v=d,
              softmax_scale=d**-0.5, causal=causal, has_seqused_k=True)
    flat, paged = AttnProblem(**kw), AttnProblem(**kw, page_size=page_size)
    a = sm90.make_config(flat, None, "sm_90a", False, num_sms=132)
    c = sm90.make_config(paged, None, "sm_90a", False, num_sms=132)
    assert c.page_rows and replace(c, page_rows=0) == a
    assert fwd_common.launch_splits(a, flat, 132) == fwd_common.launch_splits(c, paged, 132)


@pytest.mark.parametrize("b,sk,h,hk,d", [(1, 512, 32, 8, 128), (4, 512, 32, 8, 128), (1, 2048, 32, 8, 128),
                                          (2, 4096, 16, 1, 256), (8, 32768, 32, 8, 128), (64, 8192, 32, 8, 128)])
def test_decode_tiles_keep_the_split_count(b, sk, h, hk, d):
    """The split-KV rule counts K blocks of the tuning table's tile_n (FwdSm90Config.split_tile_n),
    which it was measured with: a decode tile's 64-row blocks would have split b1 s512 into 4
    (the rule keeps 1 at <= 4 blocks) and b1 s2k into 15 instead of 8 (review of v0.28)."""
    from fa4.fwd import common as fwd_common

    prob = AttnProblem(dtype="bf16", batch=b, seqlen_q=1, seqlen_k=sk, heads=h, heads_k=hk, head_dim=d,
                       head_dim_v=d, softmax_scale=d**-0.5)
    cfg = sm90.make_config(prob, None, "sm_90a", False, num_sms=132)
    table_n = sm90.TUNING[d][1]
    assert cfg.tile_n == min(64, table_n) and cfg.split_tile_n == table_n
    want = fwd_common.split_count(prob, cfg.tile_m, table_n, cfg.qhead_per_kvhead, 132)
    assert cfg.split_kv == (want > 1)
    assert fwd_common.launch_splits(cfg, prob, 132) == (want if want > 1 else 1)


def test_decode_and_options():
    assert sm90.make_config(_problem(sq=1), None, "sm_90a", False).tile_m == 64
    cfg = sm90.make_config(_problem(), KernelOptions(tile_m=128, tile_n=64, num_stages=3, rescale_threshold=8.0,
                                                     exp2_emu_frac=0.25), "sm_90a", True)
    assert (cfg.tile_m, cfg.tile_n, cfg.num_stages) == (128, 64, 3)
    assert cfg.rescale_threshold == 8.0 and cfg.sum_rounded and cfg.exp2_emu_frac == 0.25


@pytest.mark.parametrize("opts,match", [
    (KernelOptions(tile_m=96), "tile_m"),
    (KernelOptions(tile_n=72), "tile_n"),
    (KernelOptions(num_stages=5), "num_stages"),
    (KernelOptions(tile_n=256, num_stages=4), "shared memory"),
    (KernelOptions(tile_m=192, tile_n=192, num_stages=1), "registers"),
])
def test_bad_options_name_the_option(opts, match):
    with pytest.raises(ValueError, match=match):
        sm90.make_config(_problem(), opts, "sm_90a", True)


def test_only_sm90a():
    cfg = sm90.make_config(_problem(), None, "sm_90a", True)
    import dataclasses

    with pytest.raises(ValueError, match="sm_90a"):
        sm90.FlashFwdSm90.can_implement(dataclasses.replace(cfg, arch="sm_100a"))
    assert sm90.variants("sm_80") == [] and sm90.variants("sm_100a") == []


def test_forward_tiles_are_checked_before_launch():
    """The forward counts its tiles as the kernels' ``__call__`` do (one tile per CTA: decode tiles,
    the compact varlen grid, the sm80 family; the persistent schedulers index the same range in
    Int32), and past 2^31 - 1 raises a ValueError before launch (reviews of v0.28 / v0.29: only the
    backward checked; the sm80 family's grid and the persistent index wrapped silently)."""
    import torch

    from fa4.fwd import common as fwd_common

    prob = AttnProblem(dtype="bf16", batch=64, seqlen_q=1, seqlen_k=8192, heads=32, heads_k=8, head_dim=128,
                       head_dim_v=128, softmax_scale=128**-0.5)
    cfg = sm90.make_config(prob, None, "sm_90a", False, num_sms=132)
    assert not cfg.persistent and cfg.qhead_per_kvhead == 4
    q = torch.empty(64, 1, 32, 128, device="meta")
    assert fwd_common.forward_tiles(cfg, prob, q, None, 1) == 64 * 8  # one 64-row tile per (batch, kv head)
    assert fwd_common.forward_tiles(cfg, prob, q, None, 3) == 64 * 8 * 3
    from dataclasses import replace

    compact = replace(cfg, varlen_q=True, varlen_k=True, compact_grid=True)
    cu = torch.empty(41, dtype=torch.int32, device="meta")
    qv = torch.empty(1, 5000, 32, 128, device="meta")
    assert fwd_common.forward_tiles(compact, prob, qv, cu, 1) == (5000 * 4 // 64 + 40) * 8
    # Partial boxes (7 q heads per kv head: 9 positions, 63 rows of a 64-row tile) count in blocks of 63.
    seven = replace(cfg, qhead_per_kvhead=7)
    q7 = torch.empty(2, 300, 28, 128, device="meta")
    prob7 = replace(prob, batch=2, seqlen_q=300, heads=28, heads_k=4)
    assert seven.packed_block_rows == 63
    assert fwd_common.forward_tiles(seven, prob7, q7, None, 1) == -(-300 * 7 // 63) * 4 * 2
    qv7 = torch.empty(1, 5000, 28, 128, device="meta")
    assert fwd_common.forward_tiles(replace(compact, qhead_per_kvhead=7), prob7, qv7, cu, 1) == (5000 * 7 // 63 + 40) * 4
    huge = torch.empty(1, 2**28, 32, 128, device="meta")
    with pytest.raises(ValueError, match="past CUDA's grid limit"):
        fwd_common.forward_tiles(compact, prob, huge, cu, 128)
    # The sm80 family (one tile per CTA, no persistent field) and a persistent sm90 config: run()
    # checks them too, before any kernel is looked up.
    from fa4.fwd import sm80

    # (The longest sequence twice the average: not a loose bound, so the plain grids, whose tiles
    # follow max_seqlen; COMPACT_LOOSE_BOUND would take the compact grid, sized by the totals.)
    big = AttnProblem(dtype="bf16", batch=2**15, seqlen_q=2**17, seqlen_k=2**17, heads=128, heads_k=128,
                      head_dim=128, head_dim_v=128, softmax_scale=128**-0.5, varlen_q=True, varlen_k=True,
                      total_q=2**31, total_k=2**31)
    qb = torch.empty(1, 2**31, 128, 128, device="meta")
    cub = torch.empty(2**15 + 1, dtype=torch.int32, device="meta")
    for mod, arch in ((sm80, "sm_80"), (sm90, "sm_90a")):
        c = mod.make_config(big, None, arch, False)
        with pytest.raises(ValueError, match="past CUDA's grid limit"):
            fwd_common.run(c, big, qb, qb, qb, qb, None, cu_seqlens_q=cub, cu_seqlens_k=cub)


def test_loose_bound_takes_the_compact_grids(monkeypatch):
    """Note [Compact varlen grid], v0.29: a varlen call without max_seqlen_q / max_seqlen_k gets the
    packed token count as its longest sequence; with the families' COMPACT_LOOSE_BOUND on (off until
    timed) such calls take the compact grids, and calls with the lengths keep the default grids."""
    from fa4.bwd import sm90 as bwd90
    from fa4.sched.tile import loose_bound

    assert loose_bound(16384, 16384, 8)  # the bound, 8x the average
    assert not loose_bound(3774, 16384, 8)  # the real longest sequence: 1.8x the average
    assert loose_bound(4000, 4100, 100)  # one long sequence among short ones
    assert not loose_bound(1, 64, 64) and loose_bound(64, 64, 64)  # decode with and without max_seqlen_q

    def problem(max_len):
        return AttnProblem(dtype="bf16", batch=8, seqlen_q=max_len, seqlen_k=max_len, heads=16, heads_k=16,
                           head_dim=128, head_dim_v=128, softmax_scale=128**-0.5, causal=True, varlen_q=True,
                           varlen_k=True, total_q=16384, total_k=16384)

    for flag in (False, True):
        monkeypatch.setattr(sm90, "COMPACT_LOOSE_BOUND", flag)
        monkeypatch.setattr(sm90, "COMPACT_WITHOUT_LENGTHS", flag)  # (on by default since v0.38)
        monkeypatch.setattr(bwd90, "COMPACT_LOOSE_BOUND", flag)
        fwd = sm90.make_config(problem(16384), None, "sm_90a", True, num_sms=132)
        bwd = bwd90.make_config(problem(16384), None, "sm_90a", False)
        assert fwd.compact_grid == flag and bwd.compact_grid == flag
        assert fwd.persistent != flag
        exact_f = sm90.make_config(problem(3774), None, "sm_90a", True, num_sms=132)
        exact_b = bwd90.make_config(problem(3774), None, "sm_90a", False)
        assert not exact_f.compact_grid and exact_f.persistent and not exact_b.compact_grid
        assert ("COMPACT_LOOSE_BOUND" in " ".join(bwd90.explain_notes(problem(16384), None, bwd))) == flag
        # Deterministic backwards keep their ordered grid.
        assert not bwd90.make_config(problem(16384), None, "sm_90a", True).compact_grid
        # Decode (b8, GQA 32 / 8, s_k 32k) without the lengths: with the rule, the tile, the packing
        # and the split count of the call with them, on the compact grid.
        from fa4.fwd import common as fwd_common

        kw = dict(dtype="bf16", batch=8, heads=32, heads_k=8, head_dim=128, head_dim_v=128,
                  softmax_scale=128**-0.5, varlen_q=True, varlen_k=True, total_q=8, total_k=8 * 32768)
        exact = AttnProblem(seqlen_q=1, seqlen_k=32768, **kw)
        bound = AttnProblem(seqlen_q=8, seqlen_k=8 * 32768, **kw)
        a = sm90.make_config(exact, None, "sm_90a", False, num_sms=132)
        b = sm90.make_config(bound, None, "sm_90a", False, num_sms=132)
        same = ("tile_m", "tile_n", "qhead_per_kvhead", "split_kv", "persistent")
        assert [getattr(b, f) for f in same] == [getattr(a, f) for f in same] or not flag
        assert b.compact_grid == flag and not a.compact_grid
        if flag:
            assert fwd_common.launch_splits(b, bound, 132) == fwd_common.launch_splits(a, exact, 132) == 2
        notes = " ".join(sm90.explain_notes(bound, None, b))
        assert ("judged on the average" in notes) == flag
        # Short decode sequences (b8, 400 keys): no split with the lengths, nor without them (the
        # split rule reads the average key length where the call gave none; review of v0.29).
        kw4 = dict(kw, total_k=8 * 400)
        e4 = AttnProblem(seqlen_q=1, seqlen_k=400, **kw4)
        b4 = AttnProblem(seqlen_q=8, seqlen_k=8 * 400, **kw4)
        c4 = sm90.make_config(b4, None, "sm_90a", False, num_sms=132)
        assert not sm90.make_config(e4, None, "sm_90a", False, num_sms=132).split_kv
        assert not c4.split_kv or not flag
        # A given length, however skewed the batch (a chunked prefill among decode rows), is what the
        # tile and packing are judged on: the prefill tile, not the decode tile, on the compact grid.
        skew = AttnProblem(dtype="bf16", batch=64, seqlen_q=512, seqlen_k=8192, heads=32, heads_k=8, head_dim=128,
                           head_dim_v=128, softmax_scale=128**-0.5, varlen_q=True, varlen_k=True, total_q=512 + 63,
                           total_k=64 * 8192)
        cs = sm90.make_config(skew, None, "sm_90a", False, num_sms=132)
        assert cs.tile_m == 128 and cs.compact_grid == flag
        # The default since v0.38: only the call without the lengths takes the compact grid.
        monkeypatch.setattr(sm90, "COMPACT_LOOSE_BOUND", False)
        monkeypatch.setattr(sm90, "COMPACT_WITHOUT_LENGTHS", True)
        assert sm90.make_config(problem(16384), None, "sm_90a", True, num_sms=132).compact_grid
        assert not sm90.make_config(skew, None, "sm_90a", False, num_sms=132).compact_grid
        assert not sm90.make_config(problem(3774), None, "sm_90a", True, num_sms=132).compact_grid
    # The families' covering sets do not change with the rule (their problems hold real totals).
    monkeypatch.setattr(bwd90, "COMPACT_LOOSE_BOUND", True)
    monkeypatch.setattr(sm90, "COMPACT_LOOSE_BOUND", True)
    monkeypatch.setattr(sm90, "COMPACT_WITHOUT_LENGTHS", True)
    on = (sm90.variants("sm_90a"), bwd90.variants("sm_90a"))
    monkeypatch.setattr(bwd90, "COMPACT_LOOSE_BOUND", False)
    monkeypatch.setattr(sm90, "COMPACT_LOOSE_BOUND", False)
    monkeypatch.setattr(sm90, "COMPACT_WITHOUT_LENGTHS", False)
    assert on == (sm90.variants("sm_90a"), bwd90.variants("sm_90a"))


def _decode_problem(seqlen_q, seqlen_k, total_k, batch=64):
    return AttnProblem(dtype="bf16", batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads=32, heads_k=8,
                       head_dim=128, head_dim_v=128, softmax_scale=128**-0.5, varlen_q=True, varlen_k=True,
                       total_q=batch, total_k=total_k)


def test_sm80_judges_a_call_without_lengths_on_the_average():
    """The sm80 forward (the default family on Ampere GPUs), like the sm90 one, judges a varlen side
    the call gave no max_seqlen for on the batch's average length: decode b64 GQA 32 / 8 without the
    lengths gets the tile, packing, threads and split count of the call with them. Judged on the
    bound (64 query rows, 64 x 2048 keys), its rows stayed unpacked on the prefill tile."""
    from fa4.fwd import sm80

    exact = _decode_problem(1, 2048, 64 * 2048)
    bound = _decode_problem(64, 64 * 2048, 64 * 2048)
    a = sm80.make_config(exact, None, "sm_80", False, num_sms=108)
    b = sm80.make_config(bound, None, "sm_80", False, num_sms=108)
    fields = ("tile_m", "tile_n", "num_threads", "qhead_per_kvhead", "split_kv")
    assert [getattr(b, f) for f in fields] == [getattr(a, f) for f in fields]
    assert a.qhead_per_kvhead == 4 and a.tile_m == 64


@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("missing", ["q", "k", "both"])
def test_config_and_launch_agree_on_the_split(family, missing):
    """The config's split-KV flag and the launch's split count (``fwd_common.launch_splits``) are
    judged on the same lengths in both families, for each side a call leaves without max_seqlen: a
    config that splits for the bound while the launch takes one split on the average would write
    float32 partials and combine them for nothing (review of v0.38's branch: b8, 256 keys each,
    only max_seqlen_k missing). On b8 GQA 32 / 8 decode rows of 32k keys both split; on 256 keys
    neither does."""
    from fa4.fwd import common as fwd_common
    from fa4.fwd import sm80

    mod, arch = (sm80, "sm_80") if family == "sm80" else (sm90, "sm_90a")
    for keys, splits in ((256, False), (32768, True)):
        sq = 8 if missing in ("q", "both") else 1
        sk = 8 * keys if missing in ("k", "both") else keys
        p = _decode_problem(sq, sk, 8 * keys, batch=8)
        cfg = mod.make_config(p, None, arch, False, num_sms=132)
        assert cfg.split_kv == splits, (missing, keys, cfg)
        assert (fwd_common.launch_splits(cfg, p, 132) > 1) == cfg.split_kv


def test_q_box_transaction_bytes():
    """The Q stage's expected transaction bytes are the bytes its TMA box delivers: ``q_rows`` x d
    elements. A box of the first 126 of 128 rows (``pack_tma_partial``) spans past them at d128 / d256,
    whose tiles have several 64-column blocks: a count from the span (``size_in_bytes``) was 32512
    against 32256 delivered, and the consumers waited for ever (session 42, H100)."""
    import cutlass.cute as cute

    from fa4 import jit

    got = []

    @cute.jit
    def trace():
        for d, g, tile_m in ((128, 6, 128), (128, 5, 128), (256, 7, 128), (64, 5, 192), (128, 6, 64),
                             (128, 4, 128), (128, 1, 128)):
            cfg = sm90.FwdSm90Config(arch="sm_90a", dtype="bf16", head_dim=d, head_dim_v=d, qhead_per_kvhead=g,
                                     tile_m=tile_m, pack_tma_partial=True)
            kernel = sm90.FlashFwdSm90(cfg)
            kernel._setup()
            got.append((cfg.packed_block_rows * d * 2, kernel.tma_bytes_q))

    with jit._target_arch("sm_90a"):  # the warpgroup MMA atoms check the DSL's target
        trace()
    assert [expected for expected, _ in got] == [126 * 256, 125 * 256, 126 * 512, 190 * 128, 60 * 256,
                                                   128 * 256, 128 * 256]
    assert all(expected == bytes_q for expected, bytes_q in got), got


def test_kv_mcast_refuses_what_it_cannot_serve():
    """A multicast config whose tiles could walk different K blocks, or on a dynamic grid, raises
    naming the fields; the static grids (plain or persistent, any L2 sections) serve it (Note [K/V
    multicast])."""
    import dataclasses

    ok = sm90.make_config(_problem(128, sq=8192, sk=8192), None, "sm_90a", True)
    assert ok.kv_mcast
    sm90.FlashFwdSm90.can_implement(ok)
    sm90.FlashFwdSm90.can_implement(dataclasses.replace(ok, persistent=True, l2_section_mb=16))  # pairs of tiles
    sm90.FlashFwdSm90.can_implement(dataclasses.replace(ok, qhead_per_kvhead=2))  # pack GQA: one kv head a pair
    # causal pairs walk the union of their ranges, on any grid but the compact one (Note [Pair claims])
    sm90.FlashFwdSm90.can_implement(dataclasses.replace(ok, causal=True, dynamic_sched=True))
    sm90.FlashFwdSm90.can_implement(dataclasses.replace(ok, causal=True, persistent=False))
    for field, value in [("local", True), ("split_kv", True), ("varlen_k", True), ("mask_mod", "m")]:
        with pytest.raises(ValueError, match=f"kv_mcast.*{field}"):
            sm90.FlashFwdSm90.can_implement(dataclasses.replace(ok, persistent=True, **{field: value}))
    with pytest.raises(ValueError, match="kv_mcast.*compact_grid"):
        sm90.FlashFwdSm90.can_implement(dataclasses.replace(ok, persistent=False, varlen_q=True, compact_grid=True))


@pytest.mark.parametrize("sms,resident,sk,grid", [
    (132, None, 4096, "persistent"), (132, None, 16384, "persistent"), (132, None, 2048, None),
    (114, None, 4096, None), (114, None, 8192, "plain"), (78, None, 16384, "plain"),
    (132, 64, 4096, "persistent"),
    (114, 57, 4096, "persistent"), (114, 56, 4096, None), (114, 56, 16384, "plain"), (78, 39, 8192, "persistent"),
    (115, 57, 4096, "persistent"), (2, 0, 8192, "plain")])
def test_kv_mcast_grid_by_sm_count(monkeypatch, sms, resident, sk, grid):
    """The persistent multicast grid counts on its num_sms // 2 clusters being resident at once: on the
    SM counts where that was measured (KV_MCAST_PERSISTENT_SMS: 132) without asking; elsewhere where
    the driver says so (``resident``, fa4.arch.resident_clusters), from s_k 4096; else (fewer, or
    the driver not asked: None) v0.49's plain-grid multicast from s_k 8192, whose clusters need no
    such count."""
    asked = []
    monkeypatch.setattr(sm90, "_resident_pairs", lambda index: asked.append(index) or resident)
    cfg = sm90.make_config(_problem(128, sq=sk, sk=sk), None, "sm_90a", True, num_sms=sms)
    assert cfg.kv_mcast == (grid is not None)
    if grid is not None:
        assert cfg.persistent == (grid == "persistent") and not cfg.dynamic_sched
        sm90.FlashFwdSm90.can_implement(cfg)
    assert bool(asked) == (sms not in sm90.KV_MCAST_PERSISTENT_SMS), asked  # (the measured counts: not asked)


@pytest.mark.parametrize("sms,sk,taken", [(132, 8192, True), (132, 16384, True), (132, 4096, False),
                                          (114, 16384, False)])
def test_kv_mcast_causal_rule(monkeypatch, sms, sk, taken):
    """The causal multicast rule (v0.52, KV_MCAST_CAUSAL_HEAD_DIMS: d128): a listed head dim's causal
    rows take multicast from KV_MCAST_CAUSAL_MIN_SEQLEN_K (8192) on the persistent grids only, keeping
    their dynamic grid (pair claims); explain names the rule. Off the measured SM counts with no driver
    count they keep their grid (a plain grid of pairs would lose the balance)."""
    assert sm90.KV_MCAST_CAUSAL_HEAD_DIMS == {(128, 128)} and sm90.KV_MCAST_CAUSAL_MIN_SEQLEN_K == 8192
    monkeypatch.setattr(sm90, "_resident_pairs", lambda index: None)
    monkeypatch.setattr(sm90, "_num_sms", lambda device: sms)
    problem = _problem(128, sq=sk, sk=sk, causal=True)
    cfg = sm90.make_config(problem, None, "sm_90a", True, num_sms=sms)
    assert cfg.kv_mcast == taken, cfg
    assert cfg.dynamic_sched and cfg.persistent, cfg
    if taken:
        sm90.FlashFwdSm90.can_implement(cfg)
        text = " ".join(sm90.explain_notes(problem, None, cfg))
        assert "KV_MCAST_CAUSAL_HEAD_DIMS" in text and "Note [Pair claims]" in text, text
    monkeypatch.setattr(sm90, "KV_MCAST_CAUSAL_HEAD_DIMS", frozenset())
    assert not sm90.make_config(problem, None, "sm_90a", True, num_sms=sms).kv_mcast


@pytest.mark.parametrize("d,mask,sk,taken", [
    (128, None, 4096, True), (128, None, 16384, True), (64, None, 8192, True), (96, None, 4096, True),
    (128, None, 2048, False), (128, "causal", 8192, False), (64, "causal", 8192, False), (128, "local", 8192, False),
    (256, None, 8192, False), (192, None, 8192, False)])
def test_overlap_tiles_rule(monkeypatch, d, mask, sk, taken):
    """Note [Tiles overlapped] (v0.53, OVERLAP_TILES, off by default: not faster in five rounds): with
    the switch on, rows without a mask on the static persistent grids (the snake, multicast pairs) from
    s_k 4096 overlap their tiles; causal and local rows (the dynamic grid) and sO in sQ's memory (d192,
    d256) do not; explain names the rule."""
    monkeypatch.setattr(sm90, "OVERLAP_TILES", True)
    kw = dict(causal=True) if mask == "causal" else dict(local=True, window_left=512, window_right=0) if mask else {}
    problem = _problem(d, sq=sk, sk=sk, **kw)
    cfg = sm90.make_config(problem, None, "sm_90a", True, num_sms=132)
    assert cfg.overlap_tiles == taken, cfg
    if taken:
        assert cfg.q_stages == 2 and not cfg.o_in_q and cfg.persistent and not cfg.dynamic_sched
        assert cfg.smem_bytes() <= sm90.SMEM_CAPACITY
        sm90.FlashFwdSm90.can_implement(cfg)
        assert "OVERLAP_TILES" in " ".join(sm90.explain_notes(problem, None, cfg))


def test_overlap_tiles_off_by_default():
    assert not sm90.OVERLAP_TILES
    assert not sm90.make_config(_problem(128, sq=8192, sk=8192), None, "sm_90a", True, num_sms=132).overlap_tiles


def test_overlap_tiles_refuses_what_it_cannot_serve():
    """overlap_tiles raises naming why: one tile per CTA, sO in sQ's memory, packed Q rows copied by
    the consumers, ping-pong turns at a tile's edges, split-KV (Note [Tiles overlapped]); forced on
    where the rule would not give it, explain does not name the rule."""
    import dataclasses

    ok = dataclasses.replace(sm90.make_config(_problem(128, sq=8192, sk=8192), None, "sm_90a", True, num_sms=132),
                             overlap_tiles=True)
    sm90.FlashFwdSm90.can_implement(ok)
    forced = dataclasses.replace(ok, causal=True, dynamic_sched=True)  # an option there
    sm90.FlashFwdSm90.can_implement(forced)
    problem = _problem(128, sq=8192, sk=8192, causal=True)
    text = " ".join(sm90.explain_notes(problem, None, forced))
    assert "tiles overlapped" in text and "OVERLAP_TILES" not in text, text
    cases = [(dict(persistent=False, kv_mcast=False), "persistent=False"),
             (dict(head_dim=256, head_dim_v=256, tile_n=80), "o_in_q"),
             (dict(qhead_per_kvhead=4, pack_tma=False), "packed Q rows"),
             (dict(pingpong=True, pp_steps_only=False), "ping-pong"),
             (dict(split_kv=True), "split_kv")]
    for fields, words in cases:
        with pytest.raises(ValueError, match=f"overlap_tiles.*{words}"):
            sm90.FlashFwdSm90.can_implement(dataclasses.replace(ok, **fields))


def test_wg_store_o_refuses_what_it_cannot_serve():
    """wg_store_o (Note [Warpgroup stores]) raises naming why: O by row stores or as split-KV partials,
    packed GQA rows (a box of positions across heads), sO in sQ's memory; off by default at d128."""
    import dataclasses

    ok = dataclasses.replace(sm90.make_config(_problem(128, sq=2048, sk=2048), None, "sm_90a", True), wg_store_o=True)
    assert not sm90.make_config(_problem(128), None, "sm_90a", True).wg_store_o
    sm90.FlashFwdSm90.can_implement(ok)
    sm90.FlashFwdSm90.can_implement(dataclasses.replace(ok, causal=True, dynamic_sched=True, overlap_tiles=True))
    cases = [(dict(varlen_q=True, varlen_k=True), "stored by rows"), (dict(split_kv=True), "split_kv"),
             (dict(qhead_per_kvhead=4), "packed GQA"), (dict(head_dim=256, head_dim_v=256, tile_n=80), "o_in_q")]
    for fields, words in cases:
        with pytest.raises(ValueError, match=f"wg_store_o.*{words}"):
            sm90.FlashFwdSm90.can_implement(dataclasses.replace(ok, **fields))


@pytest.mark.parametrize("kw,expect", [
    (dict(d=64), True), (dict(d=64, causal=True), True), (dict(d=64, local=True, window_left=256, window_right=0), True),
    (dict(d=64, sq=1, sk=8192, num_splits=1), False),  # the decode tile: one warpgroup
    (dict(d=64, varlen_q=True, varlen_k=True, total_q=4096, total_k=4096), False),  # O by rows
    (dict(d=128), False), (dict(d=96), False), (dict(d=256), False),
    (dict(d=128, causal=True), True),  # v0.56: the d128 causal tile without multicast
    (dict(d=128, causal=True, sq=8192, sk=8192), False),  # (it multicasts K / V from s_k 8192)
    (dict(d=128, causal=True, sq=8192, sk=8192, has_seqused_k=True), False),  # (no multicast, but 8192 keys)
    (dict(d=96, causal=True), False), (dict(d=128, local=True, window_left=256, window_right=0), False),
])
def test_wg_store_o_default(kw, expect):
    """v0.54 (WG_STORE_O_BUCKETS): the d64 tile's three warpgroups store their own rows of O by
    default, where nothing blocks it; not the decode tile, varlen rows, or other head dims, except
    (v0.56, WG_STORE_O_CAUSAL_BUCKETS) the d128 causal tile without K / V multicast. fa4.explain
    names it where it is on."""
    kw = dict(kw)
    d = kw.pop("d")
    problem = _problem(d, **kw)
    cfg = sm90.make_config(problem, None, "sm_90a", True, num_sms=132)  # (multicast's rule reads the SMs)
    assert cfg.wg_store_o == expect, cfg
    if problem.seqlen_q == 1:
        assert cfg.tile_m == 64 and not cfg.split_kv  # (off for the tile, not for a split)
    notes = " ".join(sm90.explain_notes(problem, None, cfg))
    assert ("O stored by warpgroup" in notes) == expect
    if expect:
        assert cfg.num_wg == (3 if d == 64 else 2) and not cfg.wg_store_o_blockers() and not cfg.kv_mcast
        sm90.FlashFwdSm90.can_implement(cfg)


def test_wg_store_o_default_packed_gqa_off():
    """Packed GQA rows at d64 keep one store of the tile (a box of positions across heads)."""
    problem = AttnProblem(dtype="bf16", batch=2, seqlen_q=4096, seqlen_k=4096, heads=8, heads_k=2, head_dim=64,
                          head_dim_v=64, softmax_scale=0.125)
    cfg = sm90.make_config(problem, None, "sm_90a", True)
    assert cfg.qhead_per_kvhead > 1 and not cfg.wg_store_o


def test_wg_store_o_default_needs_the_table_tile():
    """A d64 call whose tile the user sets to 128 rows (two warpgroups) keeps one store of the tile:
    the rule was measured on the table's three-warpgroup tile."""
    from fa4.config import KernelOptions

    cfg = sm90.make_config(_problem(64), KernelOptions(tile_m=128), "sm_90a", True)
    assert cfg.tile_m == 128 and not cfg.split_kv and not cfg.wg_store_o
    assert sm90.make_config(_problem(64), KernelOptions(tile_m=192), "sm_90a", True).wg_store_o
