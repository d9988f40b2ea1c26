"""Backward kernels on the CPU: every compile variant builds, the tuning table and option checks,
and the deterministic dQ schedule (a pure-Python model of the device order).

Compiles use fake tensors, so no GPU is needed. Which variants compile where:
* preprocess / postprocess: all of ``variants(arch)`` for sm_80, sm_90a and sm_100a;
* the sm80 backward: all of ``variants("sm_80")``, and a subset (the hdim-128 default, the
  deterministic one, one smem stage) for sm_90a and sm_100a, where the family also runs.
"""

import dataclasses

import pytest

from fa4 import jit
from fa4.bwd import common, postprocess, preprocess, sm80
from fa4.config import ARCHS, AttnProblem, KernelOptions
from fa4.sched.semaphore import check_schedule, simulate


# The compiles of the preprocess, postprocess and sm80 backward variants (every arch, with the
# cubin checks) are in tests/test_compile.py, which compiles every variant once.


def test_variants_cover_every_bucket_and_flag():
    for arch in ARCHS:
        vs = sm80.variants(arch)
        assert {v.head_dim for v in vs} == set(range(32, 257, 32))
        assert {v.dtype for v in vs} == {"bf16", "fp16"}
        for flag in ("causal", "local", "has_softcap", "varlen_q", "varlen_k", "has_seqused_k", "deterministic"):
            assert {getattr(v, flag) for v in vs} == {False, True}, (arch, flag)
        assert {v.num_stages for v in vs} == {1, 2}
        for v in vs:
            sm80.FlashBwdSm80.can_implement(v)
        for mod in (preprocess, postprocess):
            cfgs = mod.variants(arch)
            assert {c.head_dim for c in cfgs} == set(range(32, 257, 32))
            for c in cfgs:
                jit.kernel_class(c).can_implement(c)
        pre = preprocess.variants(arch)
        for flag in ("varlen", "has_dlse", "has_semaphore"):
            assert {getattr(c, flag) for c in pre} == {False, True}


# --------------------------------------------------------------------------------------------
# make_config and option validation
# --------------------------------------------------------------------------------------------


def _problem(d=128, **kw):
    base = dict(
        dtype="bf16",
        batch=2,
        seqlen_q=1000,
        seqlen_k=1000,
        heads=8,
        heads_k=2,
        head_dim=d,
        head_dim_v=d,
        softmax_scale=d**-0.5,
    )
    base.update(kw)
    return AttnProblem(**base)


@pytest.mark.parametrize("d", list(range(32, 257, 8)))
@pytest.mark.parametrize("arch", ARCHS)
def test_make_config_every_head_dim(d, arch):
    cfg = sm80.make_config(_problem(d), None, arch)
    assert cfg.head_dim == (d + 31) // 32 * 32
    assert cfg.arch == arch
    sm80.FlashBwdSm80.can_implement(cfg)
    assert cfg.smem_bytes() <= sm80.SMEM_CAPACITY[arch]


def test_make_config_defaults_and_flags():
    cfg = sm80.make_config(_problem(128), None, "sm_80")
    assert (cfg.tile_m, cfg.tile_n, cfg.num_threads, cfg.num_stages) == (64, 128, 256, 2)
    # hdim 256 needs one smem stage on sm_80 (163 KB) but fits two on sm_90a (227 KB).
    assert sm80.make_config(_problem(256), None, "sm_80").num_stages == 1
    assert sm80.make_config(_problem(256), None, "sm_90a").num_stages == 2
    p = _problem(64, causal=True, varlen_q=True, varlen_k=True, has_seqused_k=True, softcap=5.0)
    cfg = sm80.make_config(p, None, "sm_90a", deterministic=True)
    assert cfg.causal and cfg.varlen_q and cfg.varlen_k and cfg.has_seqused_k and cfg.has_softcap
    assert cfg.deterministic and not cfg.local
    assert sm80.make_config(_problem(64, local=True, window_left=10, window_right=3), None, "sm_80").local


def test_make_config_options_override():
    opts = KernelOptions(bwd_tile_m=128, bwd_tile_n=64, bwd_num_threads=128)
    cfg = sm80.make_config(_problem(64), opts, "sm_90a")
    assert (cfg.tile_m, cfg.tile_n, cfg.num_threads) == (128, 64, 128)
    sm80.FlashBwdSm80.can_implement(cfg)
    assert sm80.mma_shape_error(cfg) is None


@pytest.mark.parametrize(
    "opts, d, name",
    [
        (KernelOptions(bwd_tile_m=48), 128, "bwd_tile_m"),
        (KernelOptions(bwd_tile_n=256), 128, "bwd_tile_n"),
        (KernelOptions(bwd_num_threads=512), 128, "bwd_num_threads"),
        (KernelOptions(bwd_tile_m=128, bwd_num_threads=64), 128, "bwd_num_threads"),
        (KernelOptions(bwd_tile_n=32), 96, "bwd_tile_m/bwd_tile_n/bwd_num_threads"),  # no dK/dV warp layout fits
        (KernelOptions(bwd_tile_m=128, bwd_tile_n=128), 256, "bwd_tile_m/bwd_tile_n"),  # shared memory
    ],
)
def test_make_config_rejects_bad_options(opts, d, name):
    with pytest.raises(ValueError, match=name):
        sm80.make_config(_problem(d), opts, "sm_80")


def test_make_config_rejects_bad_arch_and_hdim_v():
    with pytest.raises(ValueError, match="arch"):
        sm80.make_config(_problem(), None, "sm80")
    with pytest.raises(NotImplementedError, match="head_dim_v"):
        sm80.make_config(_problem(128, head_dim_v=64), None, "sm_80")


def test_can_implement_names_the_field():
    good = sm80.make_config(_problem(128), None, "sm_80")
    for field, value, match in (
        ("num_stages", 3, "num_stages"),
        ("head_dim", 100, "head_dim"),
        ("atom_m_dq", 8, "dQ"),
        ("tile_m", 48, "tile_m"),
    ):
        with pytest.raises(ValueError, match=match):
            sm80.FlashBwdSm80.can_implement(dataclasses.replace(good, **{field: value}))
    with pytest.raises(ValueError, match="shared memory"):
        sm80.FlashBwdSm80.can_implement(dataclasses.replace(good, tile_m=128))
    with pytest.raises(ValueError, match="exclusive"):
        sm80.FlashBwdSm80.can_implement(dataclasses.replace(good, causal=True, local=True))
    with pytest.raises(ValueError, match="tile_m"):
        preprocess.BwdPreprocess.can_implement(preprocess.BwdPreprocessConfig("sm_80", "bf16", tile_m=256))
    with pytest.raises(ValueError, match="head_dim"):
        postprocess.BwdPostprocess.can_implement(postprocess.BwdPostprocessConfig("sm_80", "bf16", head_dim=40))


def test_workspace_shapes():
    p = _problem(72, seqlen_q=1000)
    cfg = sm80.make_config(p, None, "sm_80", deterministic=True)
    shapes = common.workspace_shapes(p, cfg, (2, 1000, 8, 72))
    tiled = -(-1000 // cfg.tile_m) * cfg.tile_m  # whole tiles (Note [Padded row tiles])
    assert shapes["dq_accum"] == (2, 8, tiled, 96)
    pv = dataclasses.replace(p, varlen_q=True, varlen_k=True, total_q=3000, total_k=3000)
    cfg_v = sm80.make_config(pv, None, "sm_80")
    rows_v = (3000 // cfg_v.tile_m + 2) * cfg_v.tile_m
    assert common.workspace_shapes(pv, cfg_v, (1, 3000, 8, 72))["dq_accum"] == (1, 8, rows_v, 96)
    assert shapes["lse_log2"] == shapes["dpsum"] == (2, 8, tiled)
    assert shapes["semaphore"] == (2, 8, -(-1000 // cfg.tile_m))


# --------------------------------------------------------------------------------------------
# Deterministic schedule
# --------------------------------------------------------------------------------------------

# Sizes: the GPU test grid's seqlens plus block-boundary cases; windows: none, small, one-sided.
_SIZES = [(1, 1), (113, 203), (1000, 1000), (1024, 4096), (4096, 1024), (64, 64), (65, 129), (300, 17)]
_TILES = [(64, 128), (128, 128), (64, 64), (32, 64), (128, 64)]


def _masks(sq, sk):
    big = max(sq, sk)
    yield False, False, big, big
    yield True, False, big, 0
    for wl in (0, 5, 100, big):
        for wr in (0, 7, 300, big):
            if (wl, wr) != (big, big):
                yield False, True, wl, wr


# Section sizes of the launch order: the default, one pair, and 3 of the 4 pairs (a ragged last
# section).
_SECTIONS = [None, 1, 3]


@pytest.mark.parametrize("sq, sk", _SIZES)
def test_deterministic_schedule_follows_launch_order(sq, sk):
    """Every slot's contributors have ranks 0, 1, ... in launch order: no CTA waits on one launched
    after it (no deadlock), every awaited count is reached, nothing is added twice; and one CTA
    resident at a time runs through without waiting."""
    for tm, tn in _TILES:
        for causal, local, wl, wr in _masks(sq, sk):
            for section in _SECTIONS:
                # Two sequences of different lengths (varlen), 2 kv heads, GQA group of 2.
                visits, rank, _ = sm80.deterministic_schedule(
                    [sq, max(1, sq // 3)], [sk, max(1, sk // 2)], 2, 2, tm, tn, causal, local, wl, wr, section
                )
                check_schedule(visits, rank)


@pytest.mark.parametrize("sq, sk", [(1, 1), (113, 203), (1000, 1000), (300, 17), (65, 129)])
@pytest.mark.parametrize("resident", [1, 3, 7])
def test_deterministic_schedule_few_resident(sq, sk, resident):
    """With only ``resident`` CTAs on the machine (dispatched in launch order as others finish), the
    schedule never gets stuck, whether the resident CTAs advance in lockstep or in a random
    interleaving, and every slot ends with one add per contributor."""
    for tm, tn in [(64, 128), (32, 64)]:
        for causal, local, wl, wr in list(_masks(sq, sk))[:6]:
            for section in _SECTIONS:
                visits, rank, _ = sm80.deterministic_schedule(
                    [sq, max(1, sq // 3)], [sk, max(1, sk // 2)], 2, 2, tm, tn, causal, local, wl, wr, section
                )
                check_schedule(visits, rank, resident=(resident,))
                final = simulate(visits, rank, resident, seed=resident)
                contributors = {}
                for slots in visits:
                    for s in slots:
                        contributors[s] = contributors.get(s, 0) + 1
                assert final == contributors


def test_deterministic_schedule_of_the_ordered_direct_adds():
    """The sm90 order of the ordered direct dQ adds (Note [Ordered direct dQ]: the causal sections
    of ``det_causal_direct`` pairs) keeps ranks in launch order and runs with few CTAs resident."""
    from fa4.bwd import sm90

    for heads_k in (3, 20):  # fewer pairs than a section, and more
        visits, rank, _ = common.deterministic_schedule([700, 300], [900, 400], heads_k, 2, 64, 64, causal=True,
                                                        order=sm90.LAUNCH_ORDER, direct=True)
        check_schedule(visits, rank, resident=(1, 3, 7))


@pytest.mark.parametrize("sq, sk", _SIZES + [(8192, 8192), (640, 1280)])
def test_rotated_schedule(sq, sk):
    """Note [Rotated order]: every slot's ranks are a permutation of 0..n-1, adds happen in rank
    order and the schedule finishes with a pair's K blocks resident at once (lockstep and random
    interleavings); and at equal pace no block ever waits: its rank in a slot is the number of
    blocks that reached the slot at an earlier step (so each block's first slot has rank 0)."""
    for tm, tn in _TILES:
        seqs_q, seqs_k = [sq, max(1, sq // 3)], [sk, max(1, sk // 2)]
        visits, rank, ctas = common.deterministic_schedule(seqs_q, seqs_k, 2, 2, tm, tn, rotated=True)
        num_x = -(-max(seqs_k) // tn)
        check_schedule(visits, rank, resident=(num_x, num_x + 3), launch_ordered=False)
        for seed in range(3):
            simulate(visits, rank, num_x, seed=seed)
        by_pair: dict = {}
        for c, (_, hk, b, _) in enumerate(ctas):
            by_pair.setdefault((hk, b), []).append(c)
        for (hk, b), members in by_pair.items():
            if -(-seqs_q[b] // tm) < -(-seqs_k[b] // tn):
                continue  # fewer m_blocks than K blocks: the plain order (stagger 0)
            first_visit = {}
            for c in members:
                for i, slot in enumerate(visits[c]):
                    first_visit.setdefault(slot, []).append((i, c))
            for slot, arrivals in first_visit.items():
                for i, c in arrivals:
                    assert rank(c, slot) == sum(1 for j, _ in arrivals if j < i), (slot, arrivals)


@pytest.mark.parametrize("sq, sk", [(113, 203), (1000, 1000), (1024, 4096), (4096, 1024), (65, 129), (4096, 4096)])
def test_rotation_rounds_schedule(sq, sk):
    """Note [Rotation rounds]: with R rounds every slot's ranks are still a permutation of 0..n-1
    (run through with a pair's K blocks resident; lockstep, random interleavings, and the writer's
    publish lag under the kernel's rule); round r's contributors hold ranks [r * per, r * per +
    count) after every earlier round's; inside a round no block waits at equal pace (its rank is the
    round's base plus the round's blocks that reached the slot earlier); the stagger at M == N
    (even N) is 2 with R = 2; and the launch sections hold R pairs."""
    from fa4.bwd import sm90

    assert sm90.LAUNCH_ORDER.section_pairs(64, False, True, True, rounds=2) == 2
    for tm, tn in ((64, 64), (64, 128), (128, 128)):
        for rounds in (2, 3):
            seqs_q, seqs_k = [sq, max(1, sq // 3)], [sk, max(1, sk // 2)]
            visits, rank, ctas = common.deterministic_schedule(seqs_q, seqs_k, 2, 2, tm, tn, rotated=True,
                                                               rounds=rounds)
            num_x = -(-max(seqs_k) // tn)
            check_schedule(visits, rank, resident=(num_x, num_x + 3), launch_ordered=False)
            simulate(visits, rank, num_x, seed=rounds)
            blocks = [(-(-seqs_q[b] // tm), -(-seqs_k[b] // tn)) for b in range(2)]
            kernel_lag = lambda c: common.rotation_lags(  # noqa: E731
                blocks[ctas[c][2]][0], common.rotation_round(ctas[c][3], blocks[ctas[c][2]][1], rounds)[2])
            simulate(visits, rank, num_x, publish_lag=kernel_lag)
            by_pair: dict = {}
            for c, (_, hk, b, n) in enumerate(ctas):
                if visits[c]:
                    by_pair.setdefault((hk, b), []).append(c)
            for (hk, b), members in by_pair.items():
                num_m, num_n = blocks[b]
                arrivals: dict = {}
                for c in members:
                    base, _, count = common.rotation_round(ctas[c][3], num_n, rounds)
                    for i, slot in enumerate(visits[c]):
                        assert base <= rank(c, slot) < base + count
                        arrivals.setdefault((slot, base), []).append((i, c))
                if num_m < -(-num_n // rounds):
                    continue  # a round with fewer m_blocks than K blocks: the plain order (stagger 0)
                for (slot, base), seen in arrivals.items():
                    for i, c in seen:
                        assert rank(c, slot) - base == sum(1 for j, _ in seen if j < i), (slot, seen)
    v, r, ctas = common.deterministic_schedule([4096], [4096], 1, 1, 64, 64, rotated=True, rounds=2)
    starts = {ctas[c][3]: v[c][0][2] for c in range(len(v))}
    assert starts[0] - starts[1] == 2 and starts[32] - starts[33] == 2  # the stagger in each round (M = N = 64)


@pytest.mark.parametrize("group", [1, 2, 3])
def test_rotated_schedule_with_the_publish_lag(group):
    """Note [Publish lag] in fa4/bwd/sm90.py: the sm90 writer holds a slot's publish back until it
    has waited for its next slot. In the rotated order that closes a cycle exactly where a pair has
    as many m_blocks as K blocks with a GQA group of 1 (found by a hung d64 sweep, v0.11); with the
    kernel's rule (no lag where the stagger is 1) every rotated schedule runs through, varlen
    pairs of different staggers included."""
    from fa4.bwd import sm90

    tm, tn = 64, 128
    for n in range(1, 11):
        for m in range(n, 3 * n + 2):
            seqs_q, seqs_k = [m * tm, max(1, m * tm // 3) + 5], [n * tn, max(1, n * tn // 2)]
            visits, rank, ctas = common.deterministic_schedule(seqs_q, seqs_k, 1, group, tm, tn, rotated=True)
            blocks = [(-(-seqs_q[b] // tm), -(-seqs_k[b] // tn)) for b in range(2)]
            kernel_lag = lambda c: common.rotation_lags(*blocks[ctas[c][2]])  # noqa: E731  (ctas[c][2]: batch)
            num_x = -(-max(seqs_k) // tn)
            simulate(visits, rank, num_x, publish_lag=kernel_lag)
            simulate(visits, rank, num_x, seed=m, publish_lag=kernel_lag)
            one = common.deterministic_schedule([m * tm], [n * tn], 1, group, tm, tn, rotated=True)
            if m == n and n > 1 and group == 1:
                with pytest.raises(AssertionError, match="deadlock"):
                    simulate(one[0], one[1], n, publish_lag=True)
            else:
                simulate(one[0], one[1], n, publish_lag=True)
    assert sm90.TUNING[128][5] and sm90.TUNING[128][6], "d128 takes both the lag and the rotation"


def test_rotated_order_only_where_safe():
    """The sm90 backward uses the rotated order only deterministic, unmasked, and when a pair's K
    blocks fit on the GPU at once (132 SMs without a GPU); it launches sections of one pair."""
    from fa4.bwd import sm90

    def cfg(sk, **kw):
        p = AttnProblem("bf16", 1, sk, sk, 8, 8, 128, 128, 128**-0.5, **kw)
        return sm90.make_config(p, None, "sm_90a", True)

    assert cfg(8192).det_rotate and cfg(132 * 128).det_rotate
    assert not cfg(133 * 128).det_rotate  # 133 K blocks > 132 SMs
    assert not cfg(8192, causal=True).det_rotate
    assert not sm90.make_config(AttnProblem("bf16", 1, 8192, 8192, 8, 8, 128, 128, 0.1), None, "sm_90a").det_rotate
    order = sm90.LAUNCH_ORDER
    assert order.section_pairs(64, False, True, True) == 1 and order.section_pairs(64, False, True) > 1
    with pytest.raises(ValueError, match="det_rotate"):
        sm90.FlashBwdSm90.can_implement(dataclasses.replace(cfg(8192, causal=True), det_rotate=True))


def test_launch_order_is_rank_major():
    """The deterministic grid: with one section of all pairs the n_block rank x is slowest (every
    pair's x-th K block is launched before any pair's (x+1)-th), kv heads fastest; with sections of
    one pair, x is fastest (the non-deterministic order). Either way a bijection onto the grid."""
    b, hk, sq, sk, tn = 3, 2, 500, 1000, 128
    num_x, pairs = -(-sk // tn), b * hk
    for section in (None, 1, 4, 100):
        _, _, ctas = sm80.deterministic_schedule([sq] * b, [sk] * b, hk, 2, 64, tn, section=section)
        assert len(ctas) == num_x * pairs
        assert len({(x, h, bb) for x, h, bb, _ in ctas}) == len(ctas)
        assert sorted(n for *_, n in ctas) == sorted(list(range(num_x)) * pairs)
        for h in range(hk):  # within a pair, x grows with the launch index
            for bb in range(b):
                xs = [x for x, hh, b2, _ in ctas if (hh, b2) == (h, bb)]
                assert xs == list(range(num_x))
        if section in (None, 100):
            assert [x for x, *_ in ctas] == [i // pairs for i in range(len(ctas))]
            assert [(h, bb) for _, h, bb, _ in ctas[:pairs]] == [(i % hk, i // hk) for i in range(pairs)]
        if section == 1:
            assert [x for x, *_ in ctas] == [i % num_x for i in range(len(ctas))]
    # LPT: x = 0 takes the first K block (the longest one with a causal mask).
    _, _, ctas = sm80.deterministic_schedule([sq], [sk], 1, 1, 64, tn, causal=True)
    assert [n for *_, n in ctas] == list(range(num_x))


def test_deterministic_slots_are_visited_downwards_heads_fastest():
    """Every CTA walks its m_blocks from the last one down, the q heads of its GQA group fastest
    (Note [Deterministic dQ]); and the first K block adds first (rank = n - n_min)."""
    visits, rank, ctas = sm80.deterministic_schedule([1000], [1000], 1, 3, 64, 128, causal=True)
    for c, (_, _, _, n) in enumerate(ctas):
        m_first = n * 128 // 64
        want = [(0, g, m) for m in range(-(-1000 // 64) - 1, m_first - 1, -1) for g in range(3)]
        assert visits[c] == want
        assert all(rank(c, s) == n for s in visits[c])  # causal: n_min = 0


def test_section_pairs():
    order = sm80.LAUNCH_ORDER
    assert order.section_pairs(64, causal=False, deterministic=True) == order.det_no_mask
    assert order.section_pairs(100, causal=True, deterministic=True) == order.det_causal
    assert order.section_pairs(64, causal=False, deterministic=False) == 1
    assert order.section_pairs(64, causal=True, deterministic=False) == order.causal
    assert order.section_pairs(3, causal=True, deterministic=False) == 3
    o = dataclasses.replace(order, det_section=8)
    assert o.section_pairs(32, False, True) == o.section_pairs(32, True, True) == 8
    assert o.section_pairs(5, False, True) == 5
    assert o.section_pairs(64, True, False) == order.causal  # the other mode's knob
    o = dataclasses.replace(order, det_section=0, section=4)
    assert o.section_pairs(5, False, True) == 1
    assert o.section_pairs(32, True, False) == o.section_pairs(32, False, False) == 4
    # The sm90 family's sections for causal deterministic runs with the ordered direct dQ adds.
    from fa4.bwd import sm90

    o = sm90.LAUNCH_ORDER
    assert o.section_pairs(100, True, True, direct=True) == o.det_causal_direct != o.det_causal
    assert o.section_pairs(100, True, True) == o.det_causal
    assert o.section_pairs(100, False, True, direct=True) == o.det_no_mask
    assert dataclasses.replace(o, det_section=3).section_pairs(100, True, True, direct=True) == 3


def test_check_schedule_catches_bad_orders():
    visits, _, _ = sm80.deterministic_schedule([256], [512], 1, 1, 64, 128)
    assert len(visits) == 4
    with pytest.raises(AssertionError):  # ranks against launch order: the first CTA waits on the last
        check_schedule(visits, lambda c, slot: len(visits) - 1 - c)
    with pytest.raises(AssertionError):
        check_schedule([[("a", 0)], [("a", 0)]], lambda c, slot: 0)


def test_simulate_detects_deadlock_and_disorder():
    """The residency simulation itself: CTA 0 waits for CTA 1 in one slot. With both resident it
    completes (CTA 1 adds first), with one at a time it is stuck; check_schedule rejects it anyway."""
    visits = [[("a",)], [("a",)]]

    def rank(c, slot):
        return 1 - c

    assert simulate(visits, rank, 2) == {("a",): 2}
    with pytest.raises(AssertionError, match="deadlock"):
        simulate(visits, rank, 1)
    with pytest.raises(AssertionError):
        check_schedule(visits, rank, resident=(2,))
    # Crossed waits: each CTA's first slot needs the other's second add: stuck at any residency.
    visits = [[("a",), ("b",)], [("b",), ("a",)]]

    def crossed(c, slot):
        return 1 if slot == (("a",) if c == 0 else ("b",)) else 0

    with pytest.raises(AssertionError, match="deadlock"):
        simulate(visits, crossed, 2)


def test_causal_schedule_never_overtakes():
    """Causal (and sliding window), LPT order, m_blocks walked downwards: in every slot, the
    contributor ranked just before a CTA (launched before it) reaches the slot at the same step
    index of its own loop or an earlier one. So a CTA never has to wait for a predecessor that is
    behind in its own work: with both started together it trails by the predecessor's publish,
    launched later it finds the slot ready (Note [Deterministic dQ]). Walking upwards, the block
    ranked last in a slot would reach it first (its diagonal is its first step) and wait for all."""
    tm, tn, sq = 64, 128, 2048
    for causal, local, wl in ((True, False, 0), (False, True, 300)):
        for heads_k, group in ((1, 1), (2, 2), (1, 3)):
            visits, rank, _ = sm80.deterministic_schedule(
                [sq], [sq], heads_k, group, tm, tn, causal, local, wl, 0
            )
            by_slot = {}
            for c, slots in enumerate(visits):
                for step, slot in enumerate(slots):
                    by_slot.setdefault(slot, {})[rank(c, slot)] = step
            for slot, steps in by_slot.items():
                for r in range(1, len(steps)):
                    assert steps[r - 1] <= steps[r], (causal, heads_k, group, slot, steps)


def test_launch_grid_limits():
    cfg = sm80.make_config(_problem(128), None, "sm_90a")
    det = dataclasses.replace(cfg, deterministic=True)
    assert common.launch_grid(cfg, 2, 16, 8192) == (64 * 16 * 2, 1, 1)
    assert common.launch_grid(det, 2, 16, 8192) == (64 * 16 * 2, 1, 1)
    assert common.launch_grid(cfg, 70000, 1, 128) == (70000, 1, 1)  # 1-D: batch is not capped at 65535
    for c in (cfg, det):
        with pytest.raises(ValueError, match="limit"):
            common.launch_grid(c, 2**16, 2**8, 2**7 * 128)  # 2^31 CTAs


def test_block_ranges_cover_the_mask():
    """The host twins of the mask's block ranges (which the schedule uses) include every tile that
    holds an allowed (query, key) pair, for tile sizes as small as 16."""
    from fa4.testing import attention_mask

    for sq, sk in [(1, 1), (13, 29), (100, 100), (70, 300), (300, 70)]:
        for tm, tn in [(64, 128), (16, 16)]:
            for causal, local, wl, wr in _masks(sq, sk):
                big = max(sq, sk)
                win = ((None if wl >= big else wl), (None if wr >= big else wr)) if local else (None, None)
                allowed = attention_mask(sq, sk, causal=causal, window_size=win)
                for n in range(-(-sk // tn)):
                    lo, hi = common.host_m_block_range(n, sq, sk, tm, tn, causal, local, wl, wr)
                    for m in range(-(-sq // tm)):
                        if allowed[m * tm : (m + 1) * tm, n * tn : (n + 1) * tn].any():
                            assert lo <= m < hi, (sq, sk, tm, tn, causal, local, wl, wr, m, n)
                            nlo, nhi = common.host_n_block_range(m, sq, sk, tm, tn, causal, local, wl, wr)
                            assert nlo <= n < nhi


def test_det_model_tells_the_orders_apart():
    """tools/det_model.py (the timing model of the deterministic dQ orders): waiting never makes a
    grid faster; the rotated order runs without waits at equal pace; a pair's K blocks launched
    together in the plain order chain and wait once the publish latency is long; the up order
    waits less than the down order when step times vary."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("det_model", Path(__file__).parents[1] / "tools" / "det_model.py")
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    lat = dict(resident=16, read=0.4, publish=0.9, visible=1.0, stages=2)
    for kw in (dict(rotated=True), dict(section=1), dict(causal=True, section=4)):
        visits, rank, _ = common.deterministic_schedule([2048], [2048], 4, 1, 64, 128, **kw)
        free = model.run(visits, rank, ordered=False, **lat)
        det = model.run(visits, rank, ordered=True, **lat)
        assert det >= free
        if kw.get("rotated"):
            assert det == free
        if kw.get("section") == 1:
            assert det > 1.05 * free
    # The up order (Note [Up order]) never waits at equal pace; with uneven steps (jitter, the same
    # draws for both runs) it still waits less than the down order.
    visits, rank, _ = common.deterministic_schedule([2048], [2048], 4, 1, 64, 128, causal=True, section=4, up=True)
    assert model.run(visits, rank, ordered=True, **lat) == model.run(visits, rank, ordered=False, **lat)
    jit = dict(lat, jitter=0.3, seed=1)
    up = model.run(visits, rank, ordered=True, **jit) / model.run(visits, rank, ordered=False, **jit)
    visits, rank, _ = common.deterministic_schedule([2048], [2048], 4, 1, 64, 128, causal=True, section=4)
    down = model.run(visits, rank, ordered=True, **jit) / model.run(visits, rank, ordered=False, **jit)
    assert 1.0 <= up < down
    # The publish lag (Note [Publish lag]): with sections of one causal pair, each block trails the
    # previous one by a whole step, so the down order waits longer than without the lag when the
    # writer's publish fits in a step; every CTA still finishes.
    visits, rank, _ = common.deterministic_schedule([2048], [2048], 4, 1, 64, 128, causal=True, section=1)
    short = dict(lat, publish=0.6, visible=0.3)
    assert model.run(visits, rank, lag=True, **short) > model.run(visits, rank, **short) \
        >= model.run(visits, rank, ordered=False, **short)


def test_causal_sections_by_l2_bytes(monkeypatch):
    """Note [Causal sections]: the sm90 non-deterministic causal sections hold about 32 MB of Q, dO
    and dQ accumulator (the pairs per section rounded to the nearest power of two), never more than
    the table's count; the sm80 family and the other modes are unchanged; ``section`` overrides."""
    from fa4 import arch as arch_mod
    from fa4.bwd import common, sm90

    o = sm90.LAUNCH_ORDER

    def pairs(d, s, h, group=1, **kw):
        b, tile_n = 16384 // s, 64 if d > 128 else 128
        return o.section_pairs(b * h // group, True, False, pair_bytes=common.pair_bytes(s, group, d, d),
                               n_blocks=s // tile_n, num_sms=132, **kw)

    # The sweep's rows (RESULTS v0.17): d128 s1k / s2k / s4k / s8k / s16k, d64 s8k, d256 s8k.
    assert [pairs(128, s, 16) for s in (1024, 2048, 4096, 8192, 16384)] == [16, 16, 8, 4, 2]
    assert pairs(64, 8192, 32) == 8 and pairs(256, 8192, 8) == 2
    # GQA: a pair holds its group's q heads (34 MB at d128 s8k), but a section keeps about a wave of CTAs.
    assert pairs(128, 8192, 16, group=4) == 2 and pairs(128, 4096, 16, group=4) == 4
    assert pairs(64, 8192, 32, group=4) == 2
    assert o.section_pairs(8, True, False, pair_bytes=common.pair_bytes(8192, 4, 128, 128)) == 1  # no wave given
    assert common.pair_bytes(8192, 1, 128, 128) == 8192 * (2 * 256 + 4 * 128 + 8)
    # A pair larger than the budget: one pair per section, never zero.
    assert o.section_pairs(8, True, False, pair_bytes=1 << 40) == 1
    # Not without a mask, not deterministic, not without the byte count, not on sm80, not over an override.
    pb = common.pair_bytes(16384, 1, 128, 128)
    assert o.section_pairs(16, False, False, pair_bytes=pb) == 1
    assert o.section_pairs(16, True, False) == o.causal == 16
    assert o.section_pairs(16, True, True, pair_bytes=pb) == o.section_pairs(16, True, True)
    assert sm80.LAUNCH_ORDER.section_pairs(16, True, False, pair_bytes=pb) == sm80.LAUNCH_ORDER.causal
    assert dataclasses.replace(o, section=8).section_pairs(16, True, False, pair_bytes=pb) == 8
    # The budget scales with the GPU's L2: half the H200's at d128 s8k takes 2 pairs where 60 MB take 4.
    pb8 = common.pair_bytes(8192, 1, 128, 128)
    assert o.section_pairs(32, True, False, pair_bytes=pb8) == 4
    assert o.section_pairs(32, True, False, pair_bytes=pb8, l2_bytes=30 << 20) == 2
    # Under the dQ pass (deterministic causal from d160, and without determinism from d224 since v0.24)
    # there is no dQ accumulator to count: d256 s8k takes 4 pairs, d192 4, d160 8 (sweep v50), through
    # launch_sections as the launch computes them.
    assert common.pair_bytes(8192, 1, 256, 256, dq_accum=False) == 8192 * (2 * 512 + 8)
    from fa4.config import AttnProblem

    monkeypatch.setattr("fa4.arch.num_sms", lambda *a, **k: 132)
    monkeypatch.setattr("fa4.arch.l2_bytes", lambda *a, **k: arch_mod.H200_L2_BYTES)
    for d, want_det, want_free in ((160, 8, 4), (192, 4, 2), (256, 4, 4)):
        p = AttnProblem("bf16", 2, 8192, 8192, 2048 // d, 2048 // d, d, d, d**-0.5, causal=True)
        got = [common.launch_sections(sm90.make_config(p, None, "sm_90a", det), o, 2 * (2048 // d), 8192, 8192, 1,
                                      d, d) for det in (True, False)]
        assert got == [want_det, want_free], (d, got)


def test_det_causal_sections_hold_four_waves():
    """sm90's causal deterministic sections (v0.12, sweeps v16-v18; v0.14): 16 pairs, or about four
    waves of head-dim-64 work in a power of two pairs when a pair has few K blocks; not for the direct
    adds, nor without a mask."""
    from fa4.bwd import sm90

    o = sm90.LAUNCH_ORDER
    assert o.det_causal == 16 and o.det_causal_waves == 4
    assert o.section_pairs(512, True, True, n_blocks=64, num_sms=132) == 16  # s8k: 16 pairs are 1024 CTAs
    assert o.section_pairs(512, True, True, n_blocks=8, num_sms=132) == 64  # s1k: 66 pairs, rounded to 2^6
    assert o.section_pairs(512, True, True, n_blocks=32, num_sms=132) == 16  # s4k: 16.5 -> 16, not 17
    assert o.section_pairs(512, True, True, n_blocks=4, num_sms=132) == 128  # 132 -> 128
    assert o.section_pairs(40, True, True, n_blocks=8, num_sms=132) == 40  # never more than the pairs
    assert o.section_pairs(512, True, True, n_blocks=8, num_sms=132, direct=True) == o.det_causal_direct
    assert o.section_pairs(512, False, True, n_blocks=8, num_sms=132) == o.det_no_mask
    assert o.section_pairs(512, True, True) == 16  # without the grid's sizes: the table's value
    # The waves count head-dim-64 work (v0.14): half the pairs at d128, the same at d64 and below.
    assert o.section_pairs(512, True, True, n_blocks=8, num_sms=132, head_dim=128) == 32  # d128 s1k
    assert o.section_pairs(512, True, True, n_blocks=16, num_sms=132, head_dim=128) == 16  # d128 s2k
    assert o.section_pairs(512, True, True, n_blocks=32, num_sms=132, head_dim=128) == 16  # the table's floor
    assert o.section_pairs(512, True, True, n_blocks=8, num_sms=132, head_dim=64) == 64
    assert o.section_pairs(512, True, True, n_blocks=8, num_sms=132, head_dim=32) == 64
    assert dataclasses.replace(o, det_section=3).section_pairs(512, True, True, n_blocks=8, num_sms=132) == 3


@pytest.mark.parametrize("sq, sk", _SIZES + [(640, 1280)])
def test_up_order_schedule(sq, sk):
    """Note [Up order] (sm90's ``det_up``): ranks 0, 1, ... in launch order in every slot (no CTA
    waits on one launched after it), so it runs through with 1, 3 or 7 CTAs resident, also with the
    writer's publish lag (Note [Publish lag]) and in random interleavings; and at equal pace the
    blocks reach each slot in rank order (a block's first slot never waits for one behind it)."""
    from fa4.bwd import sm90

    for tm, tn in _TILES:
        for causal, local, wl, wr in _masks(sq, sk):
            if not (causal or local):
                continue
            for section in _SECTIONS:
                seqs_q, seqs_k = [sq, max(1, sq // 3)], [sk, max(1, sk // 2)]
                visits, rank, ctas = common.deterministic_schedule(seqs_q, seqs_k, 2, 2, tm, tn, causal, local, wl,
                                                                   wr, section, order=sm90.LAUNCH_ORDER, up=True)
                check_schedule(visits, rank, resident=(1, 3, 7))
                simulate(visits, rank, 3, publish_lag=True)
                simulate(visits, rank, 7, seed=sq, publish_lag=True)
                arrivals: dict = {}
                for c, slots in enumerate(visits):
                    for i, slot in enumerate(slots):
                        arrivals.setdefault(slot, []).append((i, rank(c, slot)))
                for slot, seen in arrivals.items():
                    by_step = [r for _, r in sorted(seen)]
                    assert by_step == sorted(by_step), (slot, seen)  # earlier arrivals add earlier
                # SPT: within a pair the K blocks launch from the last one down.
                firsts = {}
                for x, hk, b, n in ctas:
                    firsts.setdefault((hk, b), []).append(n)
                assert all(ns == sorted(ns, reverse=True) for ns in firsts.values())


@pytest.mark.parametrize("sq, sk", [(113, 203), (1000, 1000), (1024, 4096), (4096, 1024), (65, 129)])
def test_down_tail_schedule(sq, sk):
    """Note [Down tail] (sm90's ``det_tail``): the last ``tail`` kv heads (the kernel's
    ``min(det_tail, heads_k // det_tail_share)``) walk the down order; ranks stay 0, 1, ... in launch order in every slot (runs through with 1, 3 or 7 CTAs
    resident, with the publish lag too), every down-order CTA launches after every up-order one, no
    section mixes the two, and the down pairs launch longest first (n ascending), the up ones
    shortest first."""
    from fa4.bwd import sm90

    for tm, tn in ((64, 128), (128, 128)):
        for causal, local, wl, wr in _masks(sq, sk):
            if not (causal or local):
                continue
            for section, heads_k, tail in ((None, 4, 1), (1, 4, 2), (3, 4, 1), (2, 3, 1), (16, 8, 1)):
                seqs_q, seqs_k = [sq, max(1, sq // 3), sq], [sk, max(1, sk // 2), sk]
                visits, rank, ctas = common.deterministic_schedule(seqs_q, seqs_k, heads_k, 1, tm, tn, causal, local,
                                                                   wl, wr, section, order=sm90.LAUNCH_ORDER, up=True,
                                                                   tail=tail)
                check_schedule(visits, rank, resident=(1, 3, 7))
                simulate(visits, rank, 3, publish_lag=True)
                downs = [hk >= heads_k - tail for _, hk, _, _ in ctas]
                assert downs == sorted(downs) and any(downs) and not all(downs)
                blocks: dict = {}
                for x, hk, b, n in ctas:
                    blocks.setdefault((hk, b), []).append(n)
                for (hk, b), ns in blocks.items():
                    assert ns == sorted(ns, reverse=hk < heads_k - tail), (hk, b, ns)
    # The model (equal step times): the tail of down-order pairs takes back the SPT tail.
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("det_model", Path(__file__).parents[1] / "tools" / "det_model.py")
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    lat = dict(resident=132, read=0.3, publish=0.6, visible=0.3, stages=2)
    kw = dict(causal=True, section=8)  # the sections of the L2 rule at d128 s4k (test_up_order_config)
    free = model.run(*common.deterministic_schedule([4096] * 4, [4096] * 4, 16, 1, 64, 128, **kw)[:2],
                     ordered=False, **lat)
    up = model.run(*common.deterministic_schedule([4096] * 4, [4096] * 4, 16, 1, 64, 128, up=True, **kw)[:2], **lat)
    tail = model.run(*common.deterministic_schedule([4096] * 4, [4096] * 4, 16, 1, 64, 128, up=True, tail=2,
                                                    **kw)[:2], **lat)
    assert free / up < 0.96 and free / tail > 0.98, (free, up, tail)


def test_rotation_rounds_config(ordered_dq):
    """``det_rounds`` (Note [Rotation rounds]) only with the rotated deterministic order (ValueError
    otherwise); make_config takes it from ``DET_ROUNDS`` there (two at head dim 192, measured), 1
    elsewhere."""
    from fa4.bwd import sm90

    p = AttnProblem("bf16", 2, 8192, 8192, 8, 8, 256, 256, 256**-0.5)
    cfg = sm90.make_config(p, None, "sm_90a", True)
    assert cfg.det_rotate and cfg.det_rounds == 1 and sm90.DET_ROUNDS == {192: 2}
    d192 = sm90.make_config(AttnProblem("bf16", 2, 8192, 8192, 10, 10, 192, 192, 192**-0.5), None, "sm_90a", True)
    assert d192.det_rotate and d192.det_rounds == 2
    assert sm90.make_config(AttnProblem("bf16", 2, 8192, 8192, 10, 10, 192, 192, 192**-0.5, causal=True), None,
                            "sm_90a", True).det_rounds == 1
    sm90.FlashBwdSm90.can_implement(dataclasses.replace(cfg, det_rounds=2))
    causal = sm90.make_config(dataclasses.replace(p, causal=True), None, "sm_90a", True)
    assert causal.det_rounds == 1
    for bad in (dataclasses.replace(causal, det_rounds=2), dataclasses.replace(cfg, det_rounds=0),
                dataclasses.replace(sm90.make_config(p, None, "sm_90a", False), det_rounds=2)):
        with pytest.raises(ValueError, match="det_rounds"):
            sm90.FlashBwdSm90.can_implement(bad)


def test_up_order_config(ordered_dq):
    """``det_up`` only for deterministic masked runs (ValueError otherwise); the default of causal
    deterministic runs (``DET_UP``, v0.19), not of local windows (an option there); make_config takes
    it from ``DET_UP``. Its launch sections are the non-deterministic causal kernel's (bounded by L2
    bytes, Note [Causal sections]), unless ``det_section`` overrides them."""
    from fa4.bwd import common, sm90

    def cfg(det=True, **kw):
        return sm90.make_config(AttnProblem("bf16", 1, 4096, 4096, 8, 8, 128, 128, 128**-0.5, **kw), None,
                                "sm_90a", det)

    assert sm90.DET_UP and cfg(causal=True).det_up
    assert not cfg(local=True, window_left=256, window_right=0).det_up
    gqa = sm90.make_config(AttnProblem("bf16", 1, 4096, 4096, 8, 2, 128, 128, 128**-0.5, causal=True), None,
                           "sm_90a", True)
    assert not gqa.det_up and not sm90.DET_UP_GQA  # GQA keeps the down order (measured, v0.19)
    # The same sections as without determinism: d128 s4k 8 pairs, s16k 2, s1k 16; d64 s8k 8; d256 s8k 2.
    order = sm90.LAUNCH_ORDER
    for hd, s, want in ((128, 4096, 8), (128, 16384, 2), (128, 1024, 16), (64, 8192, 8), (256, 8192, 2)):
        p = AttnProblem("bf16", 16384 // s, s, s, 2048 // hd, 2048 // hd, hd, hd, hd**-0.5, causal=True)
        det, free = (sm90.make_config(p, None, "sm_90a", d) for d in (True, False))
        assert det.det_up
        pairs = p.batch * p.heads_k
        secs = [common.launch_sections(c, order, pairs, s, s, 1, hd, hd) for c in (det, free)]
        assert secs == [want, want], (hd, s, secs)
        down = dataclasses.replace(det, det_up=False)
        assert common.launch_sections(down, order, pairs, s, s, 1, hd, hd) != want or want == 16
        forced = dataclasses.replace(order, det_section=4)
        assert common.launch_sections(det, forced, pairs, s, s, 1, hd, hd) == min(4, pairs)
    # det_tail (Note [Down tail]) follows det_up, as DET_TAIL says; only with det_up, not with step_cursor.
    # The kv heads that walk down: at most det_tail, at most one in det_tail_share; none when off.
    assert cfg(causal=True).det_tail == sm90.DET_TAIL and cfg().det_tail == 0 and gqa.det_tail == 0
    assert (sm90.DET_TAIL, sm90.DET_TAIL_SHARE) == (2, 8)
    assert [common.tail_heads(hk, 2, 8) for hk in (1, 4, 8, 15, 16, 32, 64)] == [0, 0, 1, 1, 2, 2, 2]
    assert common.tail_heads(16, 0, 8) == 0 and common.tail_heads(4, 2, 2) == 2
    sm90.FlashBwdSm90.can_implement(dataclasses.replace(cfg(causal=True), det_tail=8))
    for bad in (dict(det_up=False, det_tail=8), dict(det_tail=8, step_cursor=True), dict(det_tail=-1),
                dict(det_tail=2, det_tail_share=0)):
        with pytest.raises(ValueError, match="det_tail"):
            sm90.FlashBwdSm90.can_implement(dataclasses.replace(cfg(causal=True), **bad))
    with pytest.raises(ValueError, match="det_up"):
        sm90.FlashBwdSm90.can_implement(dataclasses.replace(cfg(), det_up=True))
    with pytest.raises(ValueError, match="det_up"):
        sm90.FlashBwdSm90.can_implement(dataclasses.replace(cfg(False, causal=True), det_up=True))
    sm90.FlashBwdSm90.can_implement(dataclasses.replace(cfg(causal=True), det_up=True))
    old = sm90.DET_UP
    try:
        sm90.DET_UP = True
        assert cfg(causal=True).det_up and not cfg().det_up and not cfg(False, causal=True).det_up
    finally:
        sm90.DET_UP = old


@pytest.mark.parametrize("causal, up, rotated, tail", [(True, True, False, 0), (True, False, False, 0),
                                                       (False, False, True, 0), (False, False, False, 0),
                                                       (True, True, False, 1)])
def test_deterministic_add_order_is_the_pairs_own(causal, up, rotated, tail):
    """The deterministic orders add each slot's tiles in an order of K blocks that depends on the
    (batch, kv head) pair alone, never on the launch position: the same order for pair 0 alone, in a
    batch of five, and with any section size (the CPU side of the GPU test
    test_bwd_sm90_deterministic_batch_invariant)."""
    def order_of_pair0(batch, section):
        visits, rank, ctas = common.deterministic_schedule([1000] * batch, [1000] * batch, 2, 1, 64, 128, causal,
                                                           section=section, up=up, rotated=rotated, tail=tail)
        slots = {}
        for c, (x, hk, b, n) in enumerate(ctas):
            if b == 0:
                for s in visits[c]:
                    slots.setdefault(s, []).append((rank(c, s), n))
        return {s: [n for _, n in sorted(v)] for s, v in slots.items()}

    base = order_of_pair0(1, 1)
    assert base and all(len(v) >= 1 for v in base.values())
    for batch, section in ((5, 1), (5, 2), (5, 16), (3, 4)):
        if rotated and section != 1:
            continue  # the rotated order launches sections of one pair
        assert order_of_pair0(batch, section) == base, (batch, section)
