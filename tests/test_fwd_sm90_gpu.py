"""The sm90 (Hopper) forward against the float32 reference, through the public API (Hopper GPUs only).

Calls force the sm90 family (``KernelOptions(arch="sm90")``; it is also the default forward on
compute capability 9.x). Outputs are NaN-filled by the conftest; ``check_close`` applies
FlashAttention's rule to ``out`` and ``lse``.

The dense grid is a pairwise covering array (Note [pruned grid] in test_fwd_sm80_gpu.py) over the
issue's factors: head dims {64, 96, 128, 192, 256}, masks {none, causal, local}, softcap {0, 15},
heads {MHA, GQA, MQA} and seqlens {(1, 1), (1, 4096), (113, 203), (1000, 1000), (4096, 1024),
(8192, 8192)}. Varlen batches always hold a sequence of one query (and one of one key).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import fa4
from fa4.testing import adversarial_scores_qk, attention_ref, check_close, random_qkv
from fwd_cases import (
    VARLEN_CASES, case_id, check, loose_bound_inputs, missing_pairs, pairwise_cases, run_varlen_case, window,
)

SM90 = fa4.KernelOptions(arch="sm90")

HEAD_DIMS = [64, 96, 128, 192, 256]
SEQLENS = [(1, 1), (1, 4096), (113, 203), (1000, 1000), (4096, 1024), (8192, 8192)]


@pytest.fixture(autouse=True)
def _hopper_only(request):
    if "gpu" in request.keywords and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels run on compute capability 9.x only")


CASES = pairwise_cases(HEAD_DIMS, SEQLENS, lambda i, j: i + j // 3)


def test_grid_is_pairwise():
    """Every pair of values of two factors appears in some case (runs on the CPU too)."""
    assert not missing_pairs(CASES, HEAD_DIMS, SEQLENS)


_check = check
_window = window


def _dense(q, k, v, causal, window, softcap, options=SM90):
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
@pytest.mark.parametrize("d", [40, 72, 136])
@pytest.mark.parametrize("causal", [False, True])
def test_unpadded_head_dims(d, causal):
    """Head dims that are not a multiple of 32: the smem tile is padded, TMA zero-fills and clips."""
    q, k, v = random_qkv(2, 257, 130, 4, 2, d, torch.float16, "cuda", seed=d)
    out, lse = _dense(q, k, v, causal, (None, None), 0.0)
    _check(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(0, 0), (5, 0), (0, 70), (200, 1), (1, 300)])
@pytest.mark.parametrize("seqlens", [(300, 300), (190, 450), (450, 190)])
def test_local_windows(window, seqlens):
    q, k, v = random_qkv(1, seqlens[0], seqlens[1], 2, 1, 128, torch.bfloat16, "cuda", seed=window[0] + seqlens[0])
    out, lse = _dense(q, k, v, False, window, 0.0)
    _check(out, lse, q, k, v, window_size=window)


@pytest.mark.gpu
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: "-".join(map(str, c[:6])))
def test_varlen(case):
    run_varlen_case(case, SM90)


# --------------------------------------------------------------------------------------------
# Kernel configurations: tiles, stages, warpgroups, persistent / plain grid, ping-pong, O rescale
# --------------------------------------------------------------------------------------------

CONFIGS = [
    dict(persistent=False),
    dict(persistent=True, dynamic_sched=True),
    dict(one_step_loop=True),
    dict(pingpong=False),
    dict(rescale_o_before_pv=True),
    dict(rescale_o_before_pv=True, rescale_threshold=8.0, sum_rounded=True),
    dict(tile_m=64, pingpong=False),
    dict(tile_m=192, pingpong=False, tile_n=64),
    dict(num_stages=1),
    dict(num_stages=3, tile_n=64),
    dict(tile_n=176),
    dict(sum_rounded=True),
    dict(pingpong=True),
    dict(tile_m=192, pingpong=True, tile_n=64),  # three warpgroups in turn (Note [ping-pong])
    dict(pingpong=True, pp_steps_only=True),  # the turns around the K-block steps only
    dict(tile_m=192, pingpong=True, tile_n=64, pp_steps_only=True),
]


def _with_split_fields(fields):
    """``fields`` with ``pdl`` off where they force ``split_kv`` off: ``pdl`` (the combine launched
    early, the split calls' default since v0.58) serves split calls only, and the config refuses it
    without them."""
    return {"pdl": False, **fields} if fields.get("split_kv") is False else fields


def _run_config(q, k, v, causal, fields, need_lse=True):
    """Launch the sm90 forward with config fields the public options do not expose."""
    import dataclasses

    from fa4 import ops, validate
    from fa4.fwd import sm90

    problem = validate.check_dense(q, k, v, None, causal, (None, None), 0.0)
    cfg = dataclasses.replace(sm90.make_config(problem, None, "sm_90a", need_lse), **_with_split_fields(fields))
    sm90.FlashFwdSm90.can_implement(cfg)
    out = ops._empty(q.shape, q.dtype, q.device)
    lse = ops._empty((q.shape[0], q.shape[2], q.shape[1]), torch.float32, q.device)
    sm90.run(cfg, problem, q, k, v, out, lse)
    return out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("fields", CONFIGS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("causal", [False, True])
def test_configs(fields, causal):
    q, k, v = random_qkv(2, 333, 517, 4, 2, 128, torch.bfloat16, "cuda", seed=7)
    out, lse = _run_config(q, k, v, causal, fields)
    _check(out, lse, q, k, v, causal=causal)


def test_snake_order_covers_every_tile_once():
    """The persistent scheduler's snake: each tile goes to exactly one CTA (runs on the CPU)."""
    from fa4.sched.tile import snake_next

    for tiles, grid in [(1, 1), (7, 3), (132, 132), (2048, 132), (1000, 7)]:
        seen = []
        for cta in range(grid):
            idx = cta
            while idx < tiles:
                seen.append(idx)
                idx = snake_next(idx, cta, grid)
        assert sorted(seen) == list(range(tiles)), (tiles, grid)


@pytest.mark.gpu
@pytest.mark.parametrize("fields", [dict(pingpong=True, pp_steps_only=True),
                                    dict(tile_m=192, tile_n=64, pingpong=True, pp_steps_only=True)])
@pytest.mark.parametrize("causal", [False, True])
def test_pp_steps_only_many_tiles(fields, causal, hang_watchdog):
    """``pp_steps_only`` (Note [ping-pong]): with the turns around the K-block steps only, the last
    arrive of one tile opens the next tile's first turn. A persistent CTA walking many tiles of
    different lengths (causal), two and three warpgroups: the kernel must not hang (the watchdog
    fails the run) and its output must pass the reference check (the turn order itself cannot
    change it)."""
    hang_watchdog(240)
    d = 64 if fields.get("tile_m") == 192 else 128
    q, k, v = random_qkv(4, 2048, 2048, 16, 4, d, torch.bfloat16, "cuda", seed=13)
    out, lse = _run_config(q, k, v, causal, fields)
    _check(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
def test_persistent_many_tiles():
    """More tiles than SMs: every persistent CTA walks several tiles (pipeline phases carry over)."""
    q, k, v = random_qkv(4, 2048, 2048, 16, 4, 128, torch.bfloat16, "cuda", seed=9)
    for causal in (False, True):
        out, lse = _dense(q, k, v, causal, (None, None), 0.0)
        _check(out, lse, q, k, v, causal=causal)


def _force_fields(monkeypatch, num_sms=None, **fields):
    """Every sm90 forward of the test with these config fields on top of make_config's choice;
    ``num_sms``: the persistent grid's size (few CTAs: every CTA claims or walks many tiles)."""
    import dataclasses

    from fa4 import ops
    from fa4.fwd import sm90

    make = sm90.make_config
    fields = _with_split_fields(fields)
    monkeypatch.setattr(sm90, "make_config", lambda *a, **kw: dataclasses.replace(make(*a, **kw), **fields))
    if num_sms is not None:
        monkeypatch.setattr(sm90, "_num_sms", lambda device: num_sms)
    ops._plans.clear()


def _off_and_on(monkeypatch, field, call, num_sms, **fields):
    """``call()`` with config ``field`` forced off, then on (``fields`` on top of make_config's choice,
    on ``num_sms`` CTAs), asserting each run's forward plans took it: ``{False: ..., True: ...}``."""
    from fa4 import ops

    outs = {}
    for on in (False, True):
        _force_fields(monkeypatch, num_sms=num_sms, **{field: on}, **fields)
        outs[on] = call()
        cfgs = [c for (direction, *_), (_, c) in ops._plans.items() if direction == "fwd"]
        assert cfgs and all(getattr(c, field) == on for c in cfgs), cfgs
        monkeypatch.undo()
    ops._plans.clear()
    return outs


@pytest.fixture
def dynamic_scheduler(monkeypatch):
    """Every sm90 forward of the test on the dynamic persistent scheduler (tile claims from a
    global counter, fa4.sched.tile.DynamicTileScheduler), on a grid of 7 CTAs so that small
    problems make real claims too (with the SM count as grid, their first tiles cover them)."""
    from fa4 import ops

    _force_fields(monkeypatch, num_sms=7, persistent=True, dynamic_sched=True)
    yield
    ops._plans.clear()


@pytest.fixture
def one_step_loop(monkeypatch):
    """Every sm90 forward of the test with one step body for masked and free K blocks."""
    from fa4 import ops

    _force_fields(monkeypatch, one_step_loop=True)
    yield
    ops._plans.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(None, 0), (5, 0), (0, 70), (200, 1), (1, 300)])
@pytest.mark.parametrize("seqlens", [(300, 300), (190, 450), (450, 190), (1000, 3000)])
def test_one_step_loop_windows(one_step_loop, window, seqlens):
    """Causal ((None, 0)) and local windows with the window mask as a runtime branch in one step
    body: every block the window cuts is masked, no other."""
    q, k, v = random_qkv(1, seqlens[0], seqlens[1], 2, 1, 128, torch.bfloat16, "cuda", seed=seqlens[0] + 3)
    causal = window == (None, 0)
    win = (None, None) if causal else window
    out, lse = _dense(q, k, v, causal, win, 0.0)
    _check(out, lse, q, k, v, causal=causal, window_size=win)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in VARLEN_CASES if c[4] != "none"], ids=lambda c: "-".join(map(str, c[:6])))
def test_one_step_loop_varlen(one_step_loop, case):
    run_varlen_case(case, SM90)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_dynamic_scheduler_many_tiles(dynamic_scheduler, d, causal):
    """Far more tiles than CTAs, claimed at run time: every tile runs (a skipped one leaves the
    NaN fill), and two runs are bit-identical (a tile's arithmetic does not depend on the CTA that
    claims it). A tile run twice would write the same values: the sanitizer run
    (tools/sanitize_sm90.py) covers the ring's synchronization."""
    q, k, v = random_qkv(4, 2048, 2048, 2048 // d, 2048 // d // 2, d, torch.bfloat16, "cuda", seed=d)
    out, lse = _dense(q, k, v, causal, (None, None), 0.0)
    _check(out, lse, q, k, v, causal=causal)
    out2, lse2 = _dense(q, k, v, causal, (None, None), 0.0)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", VARLEN_CASES[:6], ids=lambda c: "-".join(map(str, c[:6])))
def test_dynamic_scheduler_varlen(dynamic_scheduler, case):
    run_varlen_case(case, SM90)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_dynamic_scheduler_skips_empty_tiles(monkeypatch, d, causal):
    """Note [Skipped claims]: on a varlen batch of very different lengths (most of the grid's tiles
    past their sequence's end) the producer claims past the empty tiles; the output has the same bits
    as with every tile handed to the consumers (skip_empty=False), passes the reference rule, and
    the rows of a sequence of one query are written (NaN-filled outputs)."""
    from fa4 import ops

    cu = torch.tensor([0, 1, 2001, 2004, 2704, 2705], dtype=torch.int32, device="cuda")
    g = torch.Generator("cuda").manual_seed(d)
    q, k, v = (torch.randn(2705, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (4, 2, 2))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2000, max_seqlen_k=2000, causal=causal,
              return_lse=True, kernel_options=SM90)
    outs = {}
    for skip in (True, False):
        _force_fields(monkeypatch, num_sms=7, persistent=True, dynamic_sched=True, skip_empty=skip)
        outs[skip] = fa4.flash_attn_varlen_func(q, k, v, **kw)
        cfgs = [c for (direction, *_), (_, c) in ops._plans.items() if direction == "fwd"]
        assert cfgs and all(c.skip_empty == skip and c.dynamic_sched for c in cfgs), cfgs
        monkeypatch.undo()
    ops._plans.clear()
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    check(outs[True][0], outs[True][1], q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,heads,extra,many", [
    (64, False, (4, 2), 0, False), (128, True, (4, 2), 37, False), (128, True, (8, 2), 0, False),
    (256, False, (3, 3), 5, False), (128, True, (8, 2), 0, True), (64, True, (4, 2), 3, True)])
def test_compact_grid(monkeypatch, d, causal, heads, extra, many):
    """Note [Compact varlen grid] in the forward (``compact_grid``, one CTA per tile): the same bits
    as the plain one-tile-per-CTA grid, the reference rule, on sequences of 0 to 2000 queries
    (NaN-filled outputs: every row of a sequence is written), with packed Q rows past
    ``cu_seqlens_q[-1]`` (``extra``: in no sequence, not compared), d64's three warpgroups, LPT
    (causal) and packed GQA (8 / 2 heads: 4 rows per query), three heads (sections of one), and 40
    or 70 sequences (``many``: the ballot's second and third loads of 32)."""
    from fa4 import ops

    if many:
        lens = torch.randint(0, 200, (40 if d == 128 else 70,), generator=torch.Generator().manual_seed(d)).tolist()
    else:
        lens = [1, 2000, 3, 0, 700, 1, 129]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")
    n = int(cu[-1])
    h, hk = heads
    g = torch.Generator("cuda").manual_seed(d + extra)
    q = torch.randn(n + extra, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=causal,
              return_lse=True, kernel_options=SM90)
    packed = dict(qhead_per_kvhead=h // hk) if h == 4 * hk else {}  # rows packed, forced on both grids
    outs = {}
    for compact in (True, False):
        _force_fields(monkeypatch, persistent=False, dynamic_sched=False, compact_grid=compact, **packed)
        outs[compact] = fa4.flash_attn_varlen_func(q, k, v, **kw)
        cfgs = [c for (direction, *_), (_, c) in ops._plans.items() if direction == "fwd"]
        assert cfgs and all(c.compact_grid == compact and not c.persistent for c in cfgs), cfgs
        assert all(c.qhead_per_kvhead == packed.get("qhead_per_kvhead", c.qhead_per_kvhead) for c in cfgs)
        monkeypatch.undo()
    ops._plans.clear()
    (o1, l1), (o2, l2) = outs[True], outs[False]
    assert torch.equal(o1[:n], o2[:n]) and torch.equal(l1[..., :n], l2[..., :n])
    check(o1[:n], l1[..., :n], q[:n], k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "decode-split", "decode-paged", "prefill-causal", "prefill-gqa"])
def test_loose_bound_rule(monkeypatch, kind):
    """COMPACT_WITHOUT_LENGTHS (v0.29's rule, the default since v0.38): a varlen call without max_seqlen_q /
    max_seqlen_k takes the compact grid and judges its tile, packing and split count on the average
    lengths. On these inputs the average and the longest lengths give the same tile, packing and
    split (asserted), so the call gives the bits of the same call with the lengths (each tile with
    the same K blocks in the same order; only the order of tiles differs), and passes the
    reference rule."""
    from fa4 import ops
    from fa4.fwd import sm90

    lq, lk, h, hk, d, causal, cq, ck, q, k, v = loose_bound_inputs(kind, len(kind))
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, causal=causal, return_lse=True, kernel_options=SM90)
    kk, vv, ref_k = k, v, dict(cu_seqlens_k=ck)
    if kind == "decode-paged":  # vLLM's layout: 16-row pages, seqused_k, no cu_seqlens_k
        from fa4.bench import paged_cache

        kb, vb = (torch.zeros(len(lk), max(lk), hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for i, (start, n) in enumerate(zip(itertools.accumulate([0] + lk[:-1]), lk)):
            kb[i, :n], vb[i, :n] = k[start:start + n], v[start:start + n]
        kk, vv, table, _ = paged_cache(kb, vb, 16)
        used = torch.tensor(lk, dtype=torch.int32, device="cuda")
        kw = dict(cu_seqlens_q=cq, page_table=table, seqused_k=used, causal=causal, return_lse=True,
                  kernel_options=SM90)
    ops._plans.clear()
    exact = fa4.flash_attn_varlen_func(q, kk, vv, max_seqlen_q=max(lq), max_seqlen_k=max(lk), **kw)
    cfg_exact = [c for (direction, *_), (_, c) in ops._plans.items() if direction == "fwd"]
    assert sm90.COMPACT_WITHOUT_LENGTHS
    ops._plans.clear()
    loose = fa4.flash_attn_varlen_func(q, kk, vv, **kw)
    cfgs = [c for (direction, *_), (_, c) in ops._plans.items() if direction == "fwd"]
    ops._plans.clear()
    assert len(cfgs) == len(cfg_exact) == 1 and cfgs[0].compact_grid, (cfgs, cfg_exact)
    (c, e), fields = (cfgs[0], cfg_exact[0]), ("tile_m", "tile_n", "qhead_per_kvhead", "split_kv", "pingpong")
    assert [getattr(c, f) for f in fields] == [getattr(e, f) for f in fields], (c, e)
    assert torch.equal(loose[0], exact[0]) and torch.equal(loose[1], exact[1])
    check(loose[0], loose[1], q, k, v, cu_seqlens_q=cq, causal=causal, **ref_k)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(5, 0), (200, 1)])
def test_dynamic_scheduler_local(dynamic_scheduler, window):
    q, k, v = random_qkv(2, 1000, 1000, 4, 2, 128, torch.bfloat16, "cuda", seed=window[0])
    out, lse = _dense(q, k, v, False, window, 0.0)
    _check(out, lse, q, k, v, window_size=window)


@pytest.mark.gpu
@pytest.mark.parametrize("frac", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("tau", [0.0, 8.0])
@pytest.mark.parametrize("order", ["reversed", "as_is"])
def test_emulation_and_rescale_adversarial(frac, tau, order):
    """Creeping, jumping and cliff-like row maxes (see the sm80 test): every technique passes."""
    d, seqlen_q, seqlen_k, tile_n = 128, 384, 1024, 128
    q, k = adversarial_scores_qk(2, seqlen_q, seqlen_k, 4, 2, d, torch.bfloat16, "cuda", block_n=tile_n, seed=1)
    if order == "reversed":
        k = k.flip(1).contiguous()
    _, _, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, d, torch.bfloat16, "cuda", seed=2)
    opts = fa4.KernelOptions(arch="sm90", exp2_emu_frac=frac, rescale_threshold=tau, tile_n=tile_n)
    for causal in (False, True):
        out, lse = _dense(q, k, v, causal, (None, None), 0.0, options=opts)
        _check(out, lse, q, k, v, causal=causal)


@pytest.mark.gpu
def test_fully_masked_rows():
    q, k, v = random_qkv(1, 300, 50, 2, 2, 128, torch.bfloat16, "cuda", seed=11)
    out, lse = _dense(q, k, v, True, (None, None), 0.0)
    assert torch.all(out[:, :250] == 0)
    assert torch.all(lse[:, :, :250] == -math.inf)
    _check(out, lse, q, k, v, causal=True)


@pytest.mark.gpu
def test_non_contiguous_strides():
    qkv = torch.randn(2, 259, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    out, lse = _dense(q, k, v, True, (None, None), 0.0)
    _check(out, lse, q, k, v, causal=True)


@pytest.mark.gpu
def test_fp16_and_no_lse():
    q, k, v = random_qkv(2, 500, 700, 4, 4, 64, torch.float16, "cuda", seed=5)
    out = fa4.flash_attn_func(q, k, v, causal=True, kernel_options=SM90)[0]
    ref, low = attention_ref(q, k, v, causal=True)[0], attention_ref(q, k, v, causal=True, upcast=False)[0]
    check_close("out", out, ref, low)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_unused_kv_rows_may_hold_nan(family):
    """K/V rows past ``seqused_k`` (an uninitialized KV cache) must not reach the output, even as
    NaN: P is 0 there, but 0 * NaN is NaN in the P V product unless the rows are never multiplied.

    Found by reading the sm90 kernel after the last device run of the session that wrote it: its TMA
    loads whole K/V blocks, so rows between ``seqused_k`` and the block end are real memory. Not yet
    run on a GPU; the sm80 kernel zero-fills those rows in smem."""
    lens_q, lens_k, used = [200, 37, 129], [300, 300, 300], [1, 150, 299]
    dev = "cuda"
    q = torch.randn(sum(lens_q), 4, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(sum(lens_k), 2, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn(sum(lens_k), 2, 128, device=dev, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 200, 237, 366], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 300, 600, 900], dtype=torch.int32, device=dev)
    for b, n in enumerate(used):
        k[300 * b + n: 300 * (b + 1)] = float("nan")
        v[300 * b + n: 300 * (b + 1)] = float("nan")
    seqused = torch.tensor(used, dtype=torch.int32, device=dev)
    out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200,
                                          max_seqlen_k=300, seqused_k=seqused, return_lse=True,
                                          kernel_options=fa4.KernelOptions(arch=family))
    assert not torch.isnan(out).any()
    _check(out, lse, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64), (64, 128)])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("seqlens", [(1, 300), (113, 203), (1000, 1000)])
def test_head_dim_v(family, d, dv, mask, seqlens):
    """(head_dim, head_dim_v) pairs, DeepSeek's (192, 128) among them, dense and varlen; the sm80
    backward raises NotImplementedError (already at the forward call); the sm90 backward's
    gradients are tests/test_bwd_gpu.py::test_bwd_sm90_head_dim_v."""
    sq, sk = seqlens
    opts = fa4.KernelOptions(arch=family)
    q, k, _ = random_qkv(2, sq, sk, 8, 2, d, torch.bfloat16, "cuda", seed=d + dv)
    v = torch.randn(2, sk, 2, dv, dtype=torch.bfloat16, device="cuda")
    causal, win = _window(mask, sq, sk)
    out, lse = fa4.flash_attn_func(q, k, v, causal=causal, window_size=win, return_lse=True, kernel_options=opts)
    assert out.shape == (2, sq, 8, dv)
    _check(out, lse, q, k, v, causal=causal, window_size=win)
    cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32, device="cuda")
    out_v, lse_v = fa4.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_q=cu_q,
                                              cu_seqlens_k=cu_k, causal=causal, window_size=win, return_lse=True,
                                              kernel_options=opts)
    _check(out_v.unflatten(0, (2, sq)), lse_v.unflatten(1, (2, sq)).transpose(0, 1), q, k, v, causal=causal,
           window_size=win)
    if family == "sm80":
        with pytest.raises(NotImplementedError, match="head_dim_v"):
            fa4.flash_attn_func(q.requires_grad_(), k, v, causal=causal, kernel_options=opts)


# Sequences whose queries outnumber their keys (causal: the first rows see no key, so whole tiles
# have no K block), beside sequences with work, and one of seqused_k = 0 below; varlen GQA 6/2.
EMPTY_TILE_LENS = ([1, 840, 1451, 1500, 700, 2000, 3, 1200], [1300, 949, 904, 1, 1500, 300, 5, 1200])


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 192, 256])
@pytest.mark.parametrize("layout", ["varlen", "seqused", "dense"])
def test_empty_tiles_beside_working_tiles(d, layout):
    """Note [Empty tiles and o_in_q]: tiles whose rows see no key, on the same CTAs as tiles with
    work, where sO is sQ's memory (d192, d256; d128 has its own sO). Before the fix the varlen
    d256 case stored wrong O (Q's values, up to 3.8 off) in about half the runs: five runs, each
    NaN-filled and against the reference, all bit-identical."""
    from fa4.testing import varlen_batch

    lq, lk = EMPTY_TILE_LENS
    if layout == "dense":
        q, k, v = random_qkv(2, 2000, 300, 12, 4, d, torch.bfloat16, "cuda", seed=d)
        run = lambda: _dense(q, k, v, True, (None, None), 0.0)  # noqa: E731
        ref_kw = dict(causal=True)
    else:
        used = [min(n, 1000) for n in lk[:-1]] + [0] if layout == "seqused" else None
        vb = varlen_batch(lq, lk, 6, 2, d, torch.bfloat16, "cuda", seqused_k=used, seed=d)
        q, k, v = vb.q, vb.k, vb.v
        ref_kw = dict(causal=True, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, seqused_k=vb.seqused_k)
        run = lambda: fa4.flash_attn_varlen_func(  # noqa: E731
            q, k, v, max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, return_lse=True,
            kernel_options=SM90, **ref_kw)
    first = None
    for _ in range(5):
        out, lse = run()
        if first is None:
            check(out, lse, q, k, v, **ref_kw)
            first = (out, lse)
        else:
            assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), "a run differs from the first"


@pytest.mark.gpu
@pytest.mark.parametrize("d,heads,mask,layout", [
    (128, (16, 4), "causal", "varlen"),  # 128-row tiles, varlen Q by TMA, O by rows
    (128, (8, 2), "none", "dense"),  # O by a TMA store of packed boxes too
    (128, (8, 1), "local", "dense"),  # MQA: g = 8, 16 positions per tile
    (64, (12, 4), "causal", "dense"),  # g = 3 in 192-row tiles (three consumer warpgroups)
    (256, (8, 2), "causal", "varlen"),  # O staged in Q's smem (o_in_q)
    (96, (4, 2), "none", "seqused"),  # unpadded head dim, seqused_k tails
])
def test_packed_rows_by_tma(monkeypatch, d, heads, mask, layout):
    """Packed GQA rows loaded (and stored) by TMA boxes of whole positions (Note [Packed rows by
    TMA]): the reference rule, and bit-identical out / lse to the row-by-row copies (``pack_tma``
    off) on the same inputs: the same smem tiles feed the same GEMMs. Odd lengths, so boxes run
    past sequences and past the tensor."""
    from fa4 import ops
    from fa4.testing import random_varlen

    h, hk = heads
    results = {}
    for tma in (True, False):
        _force_fields(monkeypatch, qhead_per_kvhead=h // hk, pack_tma=tma)
        if layout == "dense":
            q, k, v = random_qkv(3, 113, 1000, h, hk, d, torch.bfloat16, "cuda", seed=d + h)
            causal, win = window(mask, 113, 1000)
            out, lse = fa4.flash_attn_func(q, k, v, causal=causal, window_size=win, return_lse=True,
                                           kernel_options=SM90)
            check(out, lse, q, k, v, causal=causal, window_size=win)
        else:
            vb = random_varlen(5, 301, h, hk, d, torch.bfloat16, "cuda", max_seqlen_k=700,
                               with_seqused_k=layout == "seqused", seed=d + h)
            causal, win = window(mask, 301, 700)
            out, lse = fa4.flash_attn_varlen_func(
                vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, seqused_k=vb.seqused_k, causal=causal,
                window_size=win, return_lse=True, kernel_options=SM90)
            check(out, lse, vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                  seqused_k=vb.seqused_k, causal=causal, window_size=win)
        results[tma] = (out, lse)
        monkeypatch.undo()
        ops._plans.clear()
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


@pytest.mark.gpu
@pytest.mark.parametrize("d,heads,mask,layout", [
    (128, (12, 2), "causal", "varlen"),  # g = 6: 21 positions, 126 of 128 rows; O by rows
    (128, (10, 2), "none", "dense"),  # g = 5: 125 rows, O by a TMA store of the same boxes
    (128, (14, 2), "local", "dense"),  # g = 7: 126 rows
    (64, (10, 2), "causal", "dense"),  # g = 5 in 192-row tiles: 190 rows
    (256, (12, 2), "causal", "varlen"),  # O staged in Q's smem (o_in_q)
    (128, (12, 2), "none", "decode"),  # one query: the 64-row decode tile holds 60 rows
    (128, (12, 2), "causal", "nomax"),  # varlen without max_seqlen: the compact grid's slots
])
def test_packed_rows_by_partial_boxes(monkeypatch, d, heads, mask, layout):
    """Packed rows by TMA boxes of ``tile_m // g`` whole positions where ``g`` does not divide the
    tile (``pack_tma_partial``, forced here for dense rows too: Note [Packed rows by TMA]): the
    reference rule, with odd lengths and a sequence of one query."""
    from fa4.testing import random_varlen

    h, hk = heads
    _force_fields(monkeypatch, qhead_per_kvhead=h // hk, pack_tma_partial=True)
    if layout in ("dense", "decode"):
        sq = 1 if layout == "decode" else 113
        q, k, v = random_qkv(3, sq, 1000, h, hk, d, torch.bfloat16, "cuda", seed=d + h)
        causal, win = window(mask, sq, 1000)
        out, lse = fa4.flash_attn_func(q, k, v, causal=causal, window_size=win, return_lse=True,
                                       kernel_options=SM90)
        check(out, lse, q, k, v, causal=causal, window_size=win)
        return
    vb = random_varlen(5, 301, h, hk, d, torch.bfloat16, "cuda", max_seqlen_k=700, seed=d + h)
    causal, win = window(mask, 301, 700)
    lengths = {} if layout == "nomax" else dict(max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k)
    out, lse = fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                                          causal=causal, window_size=win, return_lse=True, kernel_options=SM90,
                                          **lengths)
    check(out, lse, vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, causal=causal,
          window_size=win)


@pytest.mark.gpu
@pytest.mark.parametrize("d,heads,mask,layout,force_partial", [
    (128, (32, 8), "causal", "dense", False),  # g = 4: whole boxes (the default)
    (128, (28, 4), "causal", "varlen", False),  # g = 7: boxes of 18 positions (the default, ragged Q)
    (128, (64, 8), "none", "varlen", False),  # g = 8 (the default)
    (64, (10, 2), "local", "dense", True),  # g = 5 in 192-row tiles, forced
    (256, (12, 2), "causal", "varlen", False),  # g = 6, O staged in Q's smem
])
def test_packed_error_not_above_unpacked(monkeypatch, d, heads, mask, layout, force_partial):
    """Accuracy is part of speed: packed GQA rows (a default since v0.42 / v0.43) may not move the
    error against the float32 reference above the same call with ``pack_gqa=False``, beyond noise
    (1.05x of the max and mean absolute error, plus one bf16 ulp at the output's scale)."""
    from fa4.testing import random_varlen

    h, hk = heads
    if force_partial:
        _force_fields(monkeypatch, qhead_per_kvhead=h // hk, pack_tma_partial=True)
    errs = {}
    for pack in (None, False):
        if force_partial and pack is False:
            monkeypatch.undo()
            from fa4 import ops
            ops._plans.clear()
        if layout == "dense":
            q, k, v = random_qkv(2, 1000, 1000, h, hk, d, torch.bfloat16, "cuda", seed=d + h)
            causal, win = window(mask, 1000, 1000)
            out = fa4.flash_attn_func(q, k, v, causal=causal, window_size=win, pack_gqa=pack, kernel_options=SM90)
            ref, _ = attention_ref(q, k, v, causal=causal, window_size=win)
        else:
            vb = random_varlen(6, 777, h, hk, d, torch.bfloat16, "cuda", max_seqlen_k=901, seed=d + h)
            causal, win = window(mask, 777, 901)
            out = fa4.flash_attn_varlen_func(
                vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, causal=causal, window_size=win,
                pack_gqa=pack, kernel_options=SM90)
            ref, _ = attention_ref(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                                   causal=causal, window_size=win)
        out = out[0] if isinstance(out, tuple) else out
        diff = (out.float() - ref).abs()
        assert torch.isfinite(diff).all()
        errs[pack] = (diff.max().item(), diff.mean().item(), ref.abs().max().item())
    (pmax, pmean, scale), (umax, umean, _) = errs[None], errs[False]
    ulp = scale * 2.0**-8
    assert pmax <= 1.05 * umax + ulp, errs
    assert pmean <= 1.05 * umean + 1e-6, errs


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("win,scale", [((1024, 0), None), ((300, 77), 0.05), ((2000, 2000), None)],
                         ids=["left1024", "narrow-creep", "wide"])
def test_local_error_not_above_descending_or_flash_attn_4(monkeypatch, d, win, scale):
    """A local tile walks its edges first (Note [Edges first], fa4/mask.py; the d64 / d128 default, an
    option at d256), a speed and compile choice that changes the order the blocks are summed in. Its
    output error against the float32
    reference is no larger than the descending order's (one_step_loop walks n_max - 1 down) on the
    same inputs, nor than flash-attn-4's where it is installed (the device pack's --with-peer): 1.1x
    plus a quarter bf16 ulp of the output's scale in max, 1.1x plus 1% of that in mean; and the
    default order's is no larger than flash-attn-4's by the same rule. A small score scale makes the
    row maxes creep, so the order's rescales matter most there."""
    q, k, v = random_qkv(2, 4096, 4096, 8, 2, d, torch.bfloat16, "cuda", seed=d + win[0])
    scale = d ** -0.5 if scale is None else scale
    ref, _ = attention_ref(q, k, v, softmax_scale=scale, window_size=win)
    cfg = fa4.explain(q, k, v, softmax_scale=scale, window_size=win, kernel_options=SM90).directions["fwd"]["config"]
    assert cfg["local"] and not cfg["block_skip"], cfg
    # d64 / d128 windows walk edges first by default; d256 ones one step body since v0.56
    # (ONE_STEP_LOOP_LOCAL_BUCKETS): there edges first is forced, and the default is the descending order.
    assert cfg["one_step_loop"] == (d == 256), cfg
    if cfg["one_step_loop"]:
        _force_fields(monkeypatch, one_step_loop=False)
    outs = {"edges-first": fa4.flash_attn_func(q, k, v, softmax_scale=scale, window_size=win, kernel_options=SM90)[0]}
    monkeypatch.undo()
    fa4.ops._plans.clear()
    _force_fields(monkeypatch, one_step_loop=True, fold_first=False)
    try:
        outs["descending"] = fa4.flash_attn_func(q, k, v, softmax_scale=scale, window_size=win, kernel_options=SM90)[0]
    finally:
        fa4.ops._plans.clear()  # (the forced plan does not outlive the test)
    try:
        from flash_attn.cute import flash_attn_func as peer
    except ImportError:
        peer = None
    if peer is not None:
        try:
            res = peer(q, k, v, softmax_scale=scale, window_size=win)
            outs["flash-attn-4"] = res[0] if isinstance(res, tuple) else res
        except Exception as e:  # noqa: BLE001 - a shape the peer does not serve: compared with descending only
            print(f"flash-attn-4 not compared: {type(e).__name__}: {str(e)[:200]}")
    errs = {}
    for name, o in outs.items():
        t = (o.float() - ref).abs()
        assert torch.isfinite(t).all(), name
        errs[name] = (t.max().item(), t.mean().item())
    ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().max())).item() - 7)
    for other in errs.keys() - {"edges-first"}:
        assert errs["edges-first"][0] <= 1.1 * errs[other][0] + 0.25 * ulp, errs
        assert errs["edges-first"][1] <= 1.1 * errs[other][1] + 0.0025 * ulp, errs
    if "flash-attn-4" in errs:  # whichever order is the default: no larger than flash-attn-4's
        default = "descending" if cfg["one_step_loop"] else "edges-first"
        assert errs[default][0] <= 1.1 * errs["flash-attn-4"][0] + 0.25 * ulp, errs
        assert errs[default][1] <= 1.1 * errs["flash-attn-4"][1] + 0.0025 * ulp, errs


@pytest.mark.gpu
@pytest.mark.parametrize("heads_k", [4, 1])
@pytest.mark.parametrize("grid", ["plain", "persistent", "dynamic"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 203), (113, 1024), (500, 203), (1000, 1000), (4096, 1024)])
def test_kv_multicast_matches_single_cta(d, seqlen_q, seqlen_k, grid, heads_k, monkeypatch):
    """Note [K/V multicast]: clusters of two CTAs sharing K / V by TMA multicast give the same bits
    as the plain grid without it (the same tiles, blocks and order), and pass the reference rule;
    odd m-block counts (1, 113 and 500 rows: a cluster whose second tile is past the rows) included.
    ``persistent``: three clusters walk the pairs (:class:`fa4.sched.tile.ClusterPairScheduler`);
    ``dynamic``: they claim them (Note [Pair claims]); ``heads_k=1``: pack GQA (4 q heads of one kv
    head in a tile's rows)."""
    from fa4.fwd import sm90

    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, heads_k, d, torch.bfloat16, "cuda", seed=11)
    plain = dict(persistent=False, dynamic_sched=False, l2_section_mb=0, split_kv=False)
    out0, lse0 = _run_config(q, k, v, False, plain)
    if grid != "plain":
        monkeypatch.setattr(sm90, "_num_sms", lambda device: 6)
    out1, lse1 = _run_config(q, k, v, False, dict(plain, kv_mcast=True, persistent=grid != "plain",
                                                  dynamic_sched=grid == "dynamic"))
    _check(out1, lse1, q, k, v, causal=False)
    assert torch.equal(out0, out1)
    assert torch.equal(lse0, lse1)


@pytest.mark.gpu
@pytest.mark.parametrize("heads_k", [4, 1])
@pytest.mark.parametrize("grid", ["plain", "persistent", "dynamic"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 203), (113, 1024), (500, 203), (1000, 1000), (4096, 1024),
                                               (1024, 4096)])
def test_kv_multicast_causal_matches_single_cta(d, seqlen_q, seqlen_k, grid, heads_k, monkeypatch):
    """Note [K/V multicast] under a causal mask: both tiles of a cluster walk the second one's K blocks,
    the first one's past its diagonal masked whole, which leaves its row maxes at -inf and its O at 0
    until its own blocks come: the same bits as the same grid without multicast, and the reference
    rule. Rows that see no key (s_q > s_k) included. ``dynamic``: three clusters claim pairs from the
    counter, CTA 0 handing each to CTA 1 through its shared memory (Note [Pair claims])."""
    from fa4.fwd import sm90

    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, heads_k, d, torch.bfloat16, "cuda", seed=13)
    base = dict(persistent=grid != "plain", dynamic_sched=grid == "dynamic", split_kv=False)
    if grid == "plain":
        base["l2_section_mb"] = 0
    monkeypatch.setattr(sm90, "_num_sms", lambda device: 6)
    out0, lse0 = _run_config(q, k, v, True, base)
    out1, lse1 = _run_config(q, k, v, True, dict(base, kv_mcast=True))
    _check(out1, lse1, q, k, v, causal=True)
    assert torch.equal(out0, out1)
    assert torch.equal(lse0, lse1)


@pytest.mark.gpu
@pytest.mark.parametrize("heads_k", [2, 1])
def test_kv_multicast_gqa_default(monkeypatch, heads_k):
    """v0.53 (KV_MCAST_GQA): a packed GQA row without a mask from s_k 4096 takes K/V multicast by
    default on the persistent grid; its bits equal the same config without multicast, and it passes
    the reference rule."""
    from fa4 import ops

    q, k, v = random_qkv(1, 4096, 4096, 8, heads_k, 128, torch.bfloat16, "cuda", seed=17)
    ops._plans.clear()
    out, lse = _dense(q, k, v, False, (None, None), 0.0)
    cfgs = [c for (direction, *_), (_, c) in ops._plans.items() if direction == "fwd"]
    assert cfgs and all(c.qhead_per_kvhead == 8 // heads_k for c in cfgs), cfgs
    if not all(c.kv_mcast for c in cfgs):
        assert torch.cuda.get_device_properties(0).multi_processor_count != 132, cfgs
        pytest.skip("this GPU's clusters of two are not known to be resident at once: no multicast default")
    _check(out, lse, q, k, v, causal=False)
    _force_fields(monkeypatch, kv_mcast=False)
    out0, lse0 = _dense(q, k, v, False, (None, None), 0.0)
    monkeypatch.undo()
    ops._plans.clear()
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 1000, 1000, 4, 4), (1, 113, 2048, 8, 2), (3, 4096, 1024, 4, 1),
                                   (2, 1, 203, 4, 4)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("grid", ["persistent", "dynamic", "mcast"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_overlap_tiles_matches(monkeypatch, d, causal, grid, shape):
    """Note [Tiles overlapped]: the next tile's first Q K^T under this tile's epilogue gives the same
    bits as the kernel without it and passes the reference rule, on six CTAs walking many tiles: the
    static snake, the dynamic grid (claims), and clusters of two sharing K / V (pairs); GQA packed
    (8/2, 4/1), rows that see no key (causal with s_q > s_k) and a single query row included."""
    b, sq, sk, h, hk = shape
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=d + sq)
    fields = dict(persistent=True, dynamic_sched=grid == "dynamic" or (grid == "mcast" and causal),
                  kv_mcast=grid == "mcast", split_kv=False)
    outs = _off_and_on(monkeypatch, "overlap_tiles", lambda: _dense(q, k, v, causal, (None, None), 0.0), 6,
                       **fields)
    _check(outs[True][0], outs[True][1], q, k, v, causal=causal)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 1000, 1000, 4), (1, 113, 2048, 8), (2, 4096, 1024, 4), (2, 1, 203, 4)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("grid", ["plain", "persistent", "dynamic", "mcast", "overlap"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128])
def test_wg_store_o_matches(monkeypatch, d, causal, grid, shape):
    """Note [Warpgroup stores]: each consumer warpgroup storing its own 64 rows of O (its own barrier and
    TMA store) gives the same bits as one store of the tile, and passes the reference rule; two and
    three warpgroups (d64), rows that end inside a warpgroup's half (113, 1000) or before it (1), on
    every grid, with multicast pairs and with overlapped tiles, on six CTAs."""
    b, sq, sk, h = shape
    q, k, v = random_qkv(b, sq, sk, h, h, d, torch.bfloat16, "cuda", seed=d + sq + 1)
    fields = dict(persistent=grid != "plain", dynamic_sched=grid == "dynamic" or (grid in ("mcast", "overlap")
                                                                                   and causal),
                  kv_mcast=grid == "mcast", overlap_tiles=grid == "overlap", split_kv=False)
    if grid == "plain":
        fields["l2_section_mb"] = 0
    outs = _off_and_on(monkeypatch, "wg_store_o", lambda: _dense(q, k, v, causal, (None, None), 0.0), 6, **fields)
    _check(outs[True][0], outs[True][1], q, k, v, causal=causal)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 1000, 1000, 4, 4), (1, 113, 2048, 8, 2), (2, 1, 203, 4, 4)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (192, 192), (256, 256), (192, 128)])
def test_stmatrix_o_matches(monkeypatch, d, dv, dtype, causal, shape):
    """Note [O staged by stmatrix]: O staged in sO by ``stmatrix`` gives the same bits as by 32-bit
    stores and passes the reference rule: every head-dim bucket and (192, 128), bf16 and fp16, dense
    (one TMA store of the tile, or each warpgroup its own rows up to d128 without packing; packed GQA
    rows 8/2; sO in sQ's memory at d256) and varlen (O stored by rows), rows that end inside a tile
    (113, 1000) or hold one query (a decode tile), on six CTAs where the grid is persistent."""
    b, sq, sk, h, hk = shape
    q, k, _ = random_qkv(b, sq, sk, h, hk, d, dtype, "cuda", seed=d + dv + sq)
    v = torch.randn(b, sk, hk, dv, dtype=dtype, device="cuda")
    outs = _off_and_on(monkeypatch, "stmatrix_o", lambda: _dense(q, k, v, causal, (None, None), 0.0), 6,
                       split_kv=False, wg_store_o=h == hk and d <= 128)
    _check(outs[True][0], outs[True][1], q, k, v, causal=causal)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    cu_q = torch.tensor([i * sq for i in range(b + 1)], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([i * sk for i in range(b + 1)], dtype=torch.int32, device="cuda")
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=sq, max_seqlen_k=sk, causal=causal,
              return_lse=True, kernel_options=SM90)
    outs = _off_and_on(monkeypatch, "stmatrix_o",
                       lambda: fa4.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), **kw), 6,
                       split_kv=False)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    _check(outs[True][0].unflatten(0, (b, sq)), outs[True][1].unflatten(1, (b, sq)).transpose(0, 1), q, k, v,
           causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("skip_empty", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_overlap_tiles_varlen(monkeypatch, d, causal, skip_empty):
    """Note [Tiles overlapped] on a varlen batch whose grid holds many tiles past their sequence's
    end (no K block: the next tile's Q K^T is issued on stale stages and discarded) and sequences of
    one query: the same bits as without it, on the dynamic grid (with and without the producer's
    skipped claims) and the reference rule."""
    cu = torch.tensor([0, 1, 2001, 2004, 2704, 2705], dtype=torch.int32, device="cuda")
    g = torch.Generator("cuda").manual_seed(d + 1)
    q, k, v = (torch.randn(2705, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (4, 2, 2))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2000, max_seqlen_k=2000, causal=causal,
              return_lse=True, kernel_options=SM90)
    outs = _off_and_on(monkeypatch, "overlap_tiles", lambda: fa4.flash_attn_varlen_func(q, k, v, **kw), 7,
                       persistent=True, dynamic_sched=True, skip_empty=skip_empty)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    check(outs[True][0], outs[True][1], q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal)


def test_cluster_pairs_cover_every_tile_once():
    """:class:`fa4.sched.tile.ClusterPairScheduler`: on a grid of clusters of two, each tile goes to
    exactly one CTA, and both CTAs of a cluster hold tiles of one (head, batch) pair, m-blocks 2m and
    2m + 1, at every step (runs on the CPU)."""
    from fa4.sched.tile import pair_tile, snake_next

    for m_blocks, heads, batch, grid, section in [(2, 1, 1, 2, 1), (8, 3, 2, 6, 1), (16, 16, 1, 132, 1),
                                                  (4, 5, 3, 14, 2), (128, 16, 1, 132, 1)]:
        pairs = m_blocks // 2 * heads * batch
        clusters = min(pairs, grid // 2)
        seen = []
        for k in range(clusters):
            idx = k
            while idx < pairs:
                two = [pair_tile(idx, r, m_blocks, heads, batch, section, False) for r in (0, 1)]
                assert two[0][1:] == two[1][1:] and two[1][0] == two[0][0] + 1 and two[0][0] % 2 == 0, two
                seen += two
                idx = snake_next(idx, k, clusters)
        assert sorted(seen) == sorted((m, h, b) for m in range(m_blocks) for h in range(heads) for b in range(batch))


@pytest.mark.gpu
def test_resident_clusters_and_the_multicast_grid():
    """fa4.arch.resident_clusters asks the driver how many clusters of CTAs that each take an SM's
    whole shared memory this GPU holds at once: clusters of one are the SM count (one such CTA per
    SM), clusters of two at most half of it, and a d128 s8k call without a mask takes multicast on
    the persistent grid where all its num_sms // 2 clusters are resident, or on the SM counts where that
    was measured (KV_MCAST_PERSISTENT_SMS), else the plain grid; fa4.explain() gives the reason."""
    from fa4.arch import num_sms, resident_clusters
    from fa4.config import AttnProblem
    from fa4.fwd import sm90

    index = torch.cuda.current_device()
    sms = num_sms(index)
    counts = {size: resident_clusters(index, size) for size in (1, 2, 4)}
    print(f"resident clusters on {torch.cuda.get_device_name(index)} ({sms} SMs): {counts}")
    assert counts[1] == sms, counts
    assert isinstance(counts[2], int) and 1 <= counts[2] <= sms // 2, counts
    assert isinstance(counts[4], int) and 1 <= counts[4] <= counts[2] // 2, counts
    q, k, v = random_qkv(1, 8192, 8192, 16, 16, 128, torch.bfloat16, "cuda", seed=5)
    problem = AttnProblem(dtype="bf16", batch=1, seqlen_q=8192, seqlen_k=8192, heads=16, heads_k=16, head_dim=128,
                          head_dim_v=128, softmax_scale=128**-0.5)
    cfg = sm90.make_config(problem, None, "sm_90a", True)
    measured = sms in sm90.KV_MCAST_PERSISTENT_SMS
    assert cfg.kv_mcast and cfg.persistent == (measured or counts[2] >= sms // 2), (cfg, counts)
    if measured:  # (where v0.50 measured the gains: all its clusters fit, as the count should say)
        assert counts[2] == sms // 2, counts
    text = str(fa4.explain(q, k, v))
    assert ("KV_MCAST_PERSISTENT_SMS" if measured else f"the driver holds {counts[2]} clusters of two at once") in text, text
