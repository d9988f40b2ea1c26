"""(CPU) The sm90 backward's configs, options and shared-memory budget, the dq_accum fragment order
it shares with its postprocess, and the import graph of fa4/bwd (no cycles: the driver in
fa4/bwd/common.py is what every family plugs into)."""

import ast
import dataclasses
import pathlib

import pytest

from fa4.bwd import common, postprocess, sm90
from fa4.bwd.workspace import head_dim_padded
from fa4.config import AttnProblem, KernelOptions


def _problem(d=128, **kw):
    base = dict(dtype="bf16", batch=2, seqlen_q=1000, seqlen_k=1000, heads=8, heads_k=2, head_dim=d, head_dim_v=d,
                softmax_scale=d**-0.5)
    base.update(kw)
    return AttnProblem(**base)


@pytest.mark.parametrize("d", list(range(32, 257, 8)))
def test_make_config_every_head_dim_fits(d):
    for causal, det in ((False, False), (True, True)):
        cfg = sm90.make_config(_problem(d, causal=causal), None, "sm_90a", det)
        sm90.FlashBwdSm90.can_implement(cfg)
        assert cfg.head_dim == head_dim_padded(d) and cfg.deterministic == (det and not cfg.dq_pass)
        assert cfg.smem_bytes() <= sm90.SMEM_CAPACITY
        assert cfg.tile_n == (128 if cfg.dkv_rs else 64)
        assert cfg.dkv_rs == (cfg.head_dim <= 128)  # dK + dV of 64 rows fit a warpgroup's registers up to 128


def test_smem_estimate_is_the_struct_size():
    """``smem_bytes`` (what can_implement and make_config check) equals the launched struct's size:
    an estimate 1 KB short let a 233472-byte launch through, which the H200 refused."""
    import cutlass.cute as cute

    from fa4.jit import _target_arch

    got = []

    @cute.jit
    def sizes():
        for v in sm90.variants("sm_90a"):
            k = sm90.FlashBwdSm90(v)
            k._setup()
            got.append((v, k.SharedStorage.size_in_bytes()))

    with _target_arch("sm_90a"):
        sizes()
    assert len(got) == len(sm90.variants("sm_90a"))
    for v, n in got:
        assert v.smem_bytes() == n, v
        assert n <= sm90.SMEM_CAPACITY, v


def test_setmaxnreg_split_fits_the_launch_allocation():
    """setmaxnreg.inc blocks until the CTA's pool has the registers: the split must fit what the
    CTA was launched with (a 240/240/32 split hung every sm90 backward on the H200)."""
    for num_wg in sm90._REGS:
        assert sm90.register_budget_ok(num_wg), sm90._REGS[num_wg]
    assert sm90._REGS[2] == (240, 24)


def test_variants_cover_buckets_flags_and_paths():
    vs = sm90.variants("sm_90a")
    assert sm90.variants("sm_80") == [] and sm90.variants("sm_100a") == []
    assert {v.head_dim for v in vs} == set(sm90.TUNING)
    assert {v.dtype for v in vs} == {"bf16", "fp16"}
    for flag in ("causal", "local", "has_softcap", "varlen_q", "varlen_k", "has_seqused_k", "deterministic",
                 "dkv_rs", "dq_direct", "det_rotate", "publish_lag", "publish_peek", "ds_from_p16", "two_cta"):
        assert {getattr(v, flag) for v in vs} == {False, True}, flag
    assert {v.tile_m for v in vs} == {64, 80, 128}
    assert {v.q_stages for v in vs} == {1, 2} and {v.pds_stages for v in vs} == {1, 2}
    assert {(v.dq_stages, v.deterministic) for v in vs} >= {(1, True), (2, True), (2, False)}
    # Deterministic with the ordered direct adds and with the ordered writer warp (Note [Ordered direct dQ]).
    assert {(v.dq_direct, v.deterministic) for v in vs} == {(a, b) for a in (False, True) for b in (False, True)}
    for v in vs:
        sm90.FlashBwdSm90.can_implement(v)
        assert v.REQUIRED_SASS == ("HGMMA", "UTMALDG")


def test_dq_fragment_and_postprocess_agree():
    """The postprocess reads dq_accum in the main kernel's wgmma fragment order (Note [dQ
    accumulator layout]): the same warpgroups, split the same way."""
    for v in sm90.variants("sm_90a"):
        frag = v.dq_fragment
        assert frag.mma == "sm90" and frag.num_threads == 128 * v.num_wg and frag.chunk_threads == 128
        assert frag.atom_m * frag.atom_n == v.num_wg and frag.swap == (v.dq_rows % 64 != 0)
        assert v.dq_rows == (v.tile_m // 2 if v.two_cta else v.tile_m)
        assert frag.mma_shape(v.dq_rows, v.head_dim)[0] % (64 * frag.atom_m) == 0
        post = postprocess.config_for(v)
        assert (post.mma, post.num_threads, post.atom_m, post.atom_n, post.swap, post.tile_m, post.head_dim) == (
            "sm90", frag.num_threads, frag.atom_m, frag.atom_n, frag.swap, v.dq_rows, v.head_dim)
        assert post.ws_tile_m == (v.tile_m if v.two_cta and v.varlen_q else 0)
        postprocess.BwdPostprocess.can_implement(post)
    assert sm90.make_config(_problem(64), KernelOptions(bwd_tile_m=128), "sm_90a").dq_atoms == (2, 1)
    assert sm90.make_config(_problem(128), None, "sm_90a").dq_atoms == (1, 2)


@pytest.mark.parametrize("opts,name", [
    (KernelOptions(bwd_tile_m=128), "bwd_tile_m"),  # d128: 128-row steps exceed the shared memory
    (KernelOptions(bwd_tile_m=96), "bwd_tile_m"),
    (KernelOptions(bwd_tile_n=64), "bwd_tile_n"),
    (KernelOptions(bwd_num_threads=256), "bwd_num_threads"),
])
def test_make_config_rejects_bad_options_by_name(opts, name):
    with pytest.raises(ValueError, match=name):
        sm90.make_config(_problem(128), opts, "sm_90a")


def test_two_cta_configs_and_refusals():
    """KernelOptions.bwd_two_cta: the cluster kernel where it applies (padded head dims 64 and 128, not
    deterministic: Note [Two-CTA dQ]), a ValueError naming the option elsewhere, the grid in pairs
    of K blocks, and explain() saying which kernel runs."""
    two = KernelOptions(bwd_two_cta=True)
    cfg = sm90.make_config(_problem(128), two, "sm_90a")
    assert cfg.two_cta and cfg.cluster_n == 2 and cfg.dq_rows == 32 and cfg.dq_swap and cfg.dq_stages == 1
    assert cfg.smem_bytes() <= sm90.SMEM_CAPACITY
    d64 = sm90.make_config(_problem(64), two, "sm_90a")
    assert d64.dq_rows == 64 and not d64.dq_swap
    assert not sm90.make_config(_problem(128), KernelOptions(bwd_two_cta=False), "sm_90a").two_cta
    for problem, det in ((_problem(128), True), (_problem(256), False), (_problem(96), False)):
        with pytest.raises(ValueError, match="bwd_two_cta"):
            sm90.make_config(problem, two, "sm_90a", det)
    from fa4.bwd import sm80

    with pytest.raises(ValueError, match="bwd_two_cta"):
        sm80.make_config(_problem(128), two, "sm_80")
    with pytest.raises(ValueError, match="bwd_two_cta"):
        KernelOptions(bwd_two_cta=1)
    # 9 K blocks of 128 keys: 5 pairs, 10 CTAs per (batch, kv head).
    assert common.launch_grid(cfg, 2, 2, 1100) == (10 * 2 * 2, 1, 1)
    assert common.launch_grid(sm90.make_config(_problem(128), None, "sm_90a"), 2, 2, 1100) == (9 * 2 * 2, 1, 1)
    assert any("2-CTA" in n for n in sm90.explain_notes(_problem(128), two, cfg))
    assert any("1-CTA" in n for n in sm90.explain_notes(_problem(128), None, sm90.make_config(_problem(128), None,
                                                                                                "sm_90a")))


def test_can_implement_names_the_field():
    base = sm90.make_config(_problem(128), None, "sm_90a")
    for change, field in ((dict(arch="sm_80"), "arch"), (dict(tile_n=64), "tile_n"), (dict(num_wg=3), "num_wg"),
                          (dict(q_stages=3), "q_stages"), (dict(causal=True, local=True), "causal")):
        with pytest.raises(ValueError, match=field):
            sm90.FlashBwdSm90.can_implement(dataclasses.replace(base, **change))
    # (head_dim, head_dim_v) = (192, 128): V, dO, dV of their own head dim, 64-row steps.
    cfg = sm90.make_config(dataclasses.replace(_problem(192), head_dim_v=128), None, "sm_90a")
    assert (cfg.head_dim, cfg.head_dim_v, cfg.hd_v, cfg.tile_m, cfg.dkv_rs) == (192, 128, 128, 64, False)
    assert sm90.make_config(_problem(128), None, "sm_90a").head_dim_v == 0  # equal: 0, one compile key
    with pytest.raises(ValueError, match="head_dim_v"):
        sm90.FlashBwdSm90.can_implement(dataclasses.replace(base, head_dim_v=256))  # dkv_rs: dK + dV registers


def test_workspaces_follow_the_tile():
    p = _problem(72, seqlen_q=1000)
    cfg = sm90.make_config(p, None, "sm_90a", True)
    shapes = common.workspace_shapes(p, cfg, (2, 1000, 8, 72))
    assert shapes["dq_accum"] == (2, 8, 1024, 96) and shapes["lse_log2"] == (2, 8, 1024)
    assert shapes["semaphore"] == (2, 8, 16)


def _top_level_imports(path: pathlib.Path) -> set:
    """Modules of fa4.bwd imported at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "fa4.bwd":
                out |= {f"fa4.bwd.{a.name}" for a in node.names}
            elif node.module.startswith("fa4.bwd."):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("fa4.bwd.")}
    return out


def test_no_import_cycle_in_bwd():
    pkg = pathlib.Path(common.__file__).parent
    graph = {f"fa4.bwd.{p.stem}": _top_level_imports(p) for p in pkg.glob("*.py") if p.stem != "__init__"}
    state = {}

    def visit(m, stack):
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", f"import cycle: {' -> '.join(stack + [m])}"
        state[m] = "open"
        for dep in graph.get(m, ()):
            visit(dep, stack + [m])
        state[m] = "done"

    for m in graph:
        visit(m, [])
    assert "fa4.bwd.common" in graph["fa4.bwd.sm80"] and "fa4.bwd.common" in graph["fa4.bwd.sm90"]
    assert not any(m.endswith(("sm80", "sm90")) for m in graph["fa4.bwd.postprocess"] | graph["fa4.bwd.common"])


def test_deterministic_keeps_the_direct_adds(ordered_dq):
    """Note [Ordered direct dQ]: at head dims whose table adds dQ from registers the deterministic
    config keeps them (the stages of the non-deterministic one, no publish lag); ``det_direct=False``
    gives the ordered writer warp; publish_lag with dq_direct is refused by name."""
    import dataclasses

    for d in (192, 256):
        free = sm90.make_config(_problem(d), None, "sm_90a")
        det = sm90.make_config(_problem(d), None, "sm_90a", True)
        assert free.dq_direct and det.dq_direct and det.deterministic and not det.publish_lag
        assert (det.q_stages, det.pds_stages) == (free.q_stages, free.pds_stages)
        writer = sm90.make_config(_problem(d), None, "sm_90a", True, det_direct=False)
        assert not writer.dq_direct and writer.deterministic
    assert not sm90.make_config(_problem(128), None, "sm_90a", True).dq_direct
    bad = dataclasses.replace(sm90.make_config(_problem(256), None, "sm_90a", True), publish_lag=True)
    with pytest.raises(ValueError, match="publish_lag"):
        sm90.FlashBwdSm90.can_implement(bad)


def test_publish_lag_rule(monkeypatch):
    """PUBLISH_PEEK off (the rule of v0.13): deterministic with a causal mask, the writer's publish lag
    only below DET_LAG_MAX_BLOCKS K blocks; a local window and the rotated order (no mask) keep the
    table's lag; the precompiled set holds the causal d128 kernels with and without it."""
    import dataclasses

    monkeypatch.setattr(sm90, "PUBLISH_PEEK", False)
    P = common.representative_problem
    n = sm90.DET_LAG_MAX_BLOCKS
    for hd in (64, 128):
        for mask in (dict(causal=True), dict(local=True)):
            for s, lag in ((128 * n - 128, True), (128 * n, False), (128 * 4 * n, False)):
                p = dataclasses.replace(P(hd, **mask), seqlen_q=s, seqlen_k=s)
                cfg = sm90.make_config(p, None, "sm_90a", True)
                assert cfg.publish_lag == (lag or "local" in mask), (hd, mask, s)
                assert not cfg.publish_peek
                assert not sm90.make_config(p, None, "sm_90a", False).publish_lag
        long = dataclasses.replace(P(hd), seqlen_q=128 * 4 * n, seqlen_k=128 * 4 * n)
        assert sm90.make_config(long, None, "sm_90a", True).publish_lag
    long = dataclasses.replace(P(128, causal=True), seqlen_q=8192, seqlen_k=8192)
    lag_cfgs = [sm90.make_config(long, None, "sm_90a", True), sm90.make_config(P(128, causal=True), None, "sm_90a", True)]
    monkeypatch.setattr(sm90, "PUBLISH_PEEK", True)
    vs = sm90.variants("sm_90a")
    for cfg in lag_cfgs:  # (with plain launches: the set holds pdl twins of a few defaults only)
        assert dataclasses.replace(cfg, pdl=False) in vs, cfg  # precompiled while PUBLISH_PEEK is on


def test_publish_peek_is_the_deterministic_writer_default(ordered_dq):
    """PUBLISH_PEEK (RESULTS v0.14): every deterministic run with the writer warp peeks, with no
    publish lag, in every order and at every length; the ordered direct adds' sequencing warp peeks
    in the plain orders only (SEQ_PEEK, v0.15); non-deterministic runs do not; the precompiled set
    holds the defaults."""
    import dataclasses

    P = common.representative_problem
    vs = sm90.variants("sm_90a")
    for hd in (64, 96, 128):
        for mask in (dict(), dict(causal=True), dict(local=True)):
            for s in (1024, 4096, 16384):
                p = dataclasses.replace(P(hd, **mask), seqlen_q=s, seqlen_k=s)
                det = sm90.make_config(p, None, "sm_90a", True)
                assert det.publish_peek and not det.publish_lag and not det.dq_direct, (hd, mask, s)
                assert not sm90.make_config(p, None, "sm_90a", False).publish_peek
    for hd in (192, 256):  # the sequencing warp (SEQ_PEEK): peeks in the plain orders, not rotated
        for mask in (dict(causal=True), dict(local=True)):
            direct = sm90.make_config(P(hd, **mask), None, "sm_90a", True)
            assert direct.dq_direct and direct.publish_peek == sm90.SEQ_PEEK and not direct.publish_lag
        rot = sm90.make_config(dataclasses.replace(P(hd), seqlen_q=8192, seqlen_k=8192), None, "sm_90a", True)
        assert rot.dq_direct and rot.det_rotate and not rot.publish_peek
    # (with plain launches: the set holds pdl twins of a few defaults only, PDL_MAX_SEQLEN_K)
    assert dataclasses.replace(sm90.make_config(P(256, causal=True), None, "sm_90a", True), pdl=False) in vs
    assert sm90.make_config(P(256, causal=True), None, "sm_90a", True, det_direct=False).publish_peek
    for cfg in (sm90.make_config(P(128, causal=True), None, "sm_90a", True),
                sm90.make_config(P(64, causal=True), None, "sm_90a", True),
                sm90.make_config(dataclasses.replace(P(128), seqlen_q=8192, seqlen_k=8192), None, "sm_90a", True)):
        assert dataclasses.replace(cfg, pdl=False) in vs, cfg


def test_publish_peek_is_refused_by_name_where_it_cannot_run(ordered_dq):
    """publish_peek (Note [Publish peek]) orders the deterministic dQ adds (the writer warp, or the
    sequencing warp of the ordered direct adds): refused, naming the field, with publish_lag, or
    without determinism."""
    import dataclasses

    P = common.representative_problem
    det = sm90.make_config(P(128, causal=True), None, "sm_90a", True)
    assert det.publish_peek and not det.publish_lag
    sm90.FlashBwdSm90.can_implement(det)
    bad = [dataclasses.replace(det, publish_lag=True),
           dataclasses.replace(sm90.make_config(P(128), None, "sm_90a"), publish_peek=True),
           dataclasses.replace(sm90.make_config(P(256, causal=True), None, "sm_90a"), publish_peek=True)]
    sm90.FlashBwdSm90.can_implement(  # the sequencing warp of the ordered direct adds
        dataclasses.replace(sm90.make_config(P(256, causal=True), None, "sm_90a", True), publish_peek=True))
    for cfg in bad:
        with pytest.raises(ValueError, match="publish_peek"):
            sm90.FlashBwdSm90.can_implement(cfg)


def test_first_store_rule_and_wiring(ordered_dq):
    """Note [First store] (fa4/bwd/sm90.py): deterministic runs with the dQ writer warp store each
    slot's first tile (DQ_FIRST_STORE[True]); non-deterministic runs, the ordered direct adds and the
    two-CTA kernel add into a zeroed accumulator. Where it is on, the driver allocates the slot
    counters (zeroed by the preprocess), the preprocess does not zero dq_accum and the postprocess
    reads the counters; the precompiled set holds both modes with and without determinism."""
    import dataclasses

    P = common.representative_problem
    for hd in (64, 96, 128):
        for mask in (dict(), dict(causal=True), dict(local=True, varlen=True, seqused_k=True)):
            det = sm90.make_config(P(hd, **mask), None, "sm_90a", True)
            free = sm90.make_config(P(hd, **mask), None, "sm_90a", False)
            assert det.dq_first_store == sm90.DQ_FIRST_STORE[True] and not det.dq_direct, (hd, mask)
            assert free.dq_first_store == sm90.DQ_FIRST_STORE[False], (hd, mask)
    assert sm90.DQ_FIRST_STORE == {True: True, False: False}
    for cfg in (sm90.make_config(P(256, causal=True), None, "sm_90a", True),  # the ordered direct adds
                sm90.make_config(P(128), KernelOptions(bwd_two_cta=True), "sm_90a")):
        assert not cfg.dq_first_store
    det = sm90.make_config(P(128, causal=True), None, "sm_90a", True)
    free = sm90.make_config(P(128, causal=True), None, "sm_90a", False)
    p = P(128, causal=True)
    assert common.counts_slots(det) and "semaphore" in common.workspace_shapes(p, det, (2, 1024, 8, 128))
    assert not common.counts_slots(free) and "semaphore" not in common.workspace_shapes(p, free, (2, 1024, 8, 128))
    claims = dataclasses.replace(free, dq_first_store=True)  # the option without determinism
    assert common.counts_slots(claims) and common.workspace_shapes(p, claims, (2, 1024, 8, 128))["semaphore"] == (
        2, 8, 16)
    assert postprocess.config_for(det).counted and postprocess.config_for(claims).counted
    assert not postprocess.config_for(free).counted
    fake = common.fake_args(claims)
    assert fake[12] is not None and common.fake_args(free)[12] is None  # the counters argument
    vs = sm90.variants("sm_90a")
    assert {(v.dq_first_store, v.deterministic) for v in vs} == {(a, b) for a in (False, True) for b in (False, True)}


def test_first_store_is_refused_by_name_where_it_cannot_run():
    """dq_first_store is the writer warp's: refused, naming the field, with dq_direct or two_cta."""
    import dataclasses

    P = common.representative_problem
    sm90.FlashBwdSm90.can_implement(dataclasses.replace(sm90.make_config(P(128), None, "sm_90a"),
                                                        dq_first_store=True))
    for cfg in (sm90.make_config(P(256), None, "sm_90a"),
                sm90.make_config(P(128), KernelOptions(bwd_two_cta=True), "sm_90a")):
        with pytest.raises(ValueError, match="dq_first_store"):
            sm90.FlashBwdSm90.can_implement(dataclasses.replace(cfg, dq_first_store=True))


def test_claims_walk_the_rotated_order_without_a_mask(monkeypatch):
    """With the claims of Note [First store] (DQ_FIRST_STORE[False] on) and CLAIM_ROTATE (an option) a
    non-deterministic run without a mask takes the rotated order, so the K blocks of a pair do not claim the same slot
    at once; with a mask, or with CLAIM_ROTATE off, or without the claims, the plain order. The kernel
    refuses the rotated order for a non-deterministic config without the claims, naming the field."""
    import dataclasses

    P = common.representative_problem
    plain = sm90.make_config(P(128), None, "sm_90a")
    assert not plain.det_rotate and not plain.dq_first_store
    with pytest.raises(ValueError, match="det_rotate"):
        sm90.FlashBwdSm90.can_implement(dataclasses.replace(plain, det_rotate=True))
    monkeypatch.setitem(sm90.DQ_FIRST_STORE, False, True)
    monkeypatch.setattr(sm90, "CLAIM_ROTATE", True)
    for hd in (64, 128):
        cfg = sm90.make_config(P(hd), None, "sm_90a")
        assert cfg.dq_first_store and cfg.det_rotate and not cfg.deterministic, hd
        assert cfg.lane_slots == (hd >= sm90.LANE_SLOTS_MIN_HD)
        sm90.FlashBwdSm90.can_implement(cfg)
        # The sections of the rotated order: one pair, the non-deterministic default without a mask too.
        assert common.launch_sections(cfg, sm90.LAUNCH_ORDER, 64, 8192, 8192, 1, hd, hd) == 1
        causal = sm90.make_config(P(hd, causal=True), None, "sm_90a")
        assert causal.dq_first_store and not causal.det_rotate
    monkeypatch.setattr(sm90, "CLAIM_ROTATE", False)
    assert not sm90.make_config(P(128), None, "sm_90a").det_rotate
    assert any(v.dq_first_store and v.det_rotate and not v.deterministic for v in sm90.variants("sm_90a"))


def test_dq_pass_rule_and_refusals(monkeypatch):
    """Note [dQ pass] (fa4/bwd/dq_sm90.py): the default from padded head dim 160, without determinism
    with a mask only from padded head dim 224 (DQ_PASS_MIN_HD, DQ_PASS_MASKED_MIN_HD); a deterministic run then takes the non-deterministic main
    kernel; KernelOptions.bwd_dq_pass overrides either way and is refused with the 2-CTA kernel and
    on sm80; the main kernel keeps no dq_accum counters; the dQ kernel's config follows the main
    one and refuses tiles that do not fit."""
    from fa4.bwd import dq_sm90, sm80

    assert sm90.DQ_PASS_MIN_HD == {True: 160, False: 160} and sm90.DQ_PASS_MASKED_MIN_HD == 224
    for d, det, want in ((128, False, False), (128, True, False), (136, True, True), (136, False, True),
                         (192, False, True), (192, True, True), (224, False, True), (256, False, True),
                         (256, True, True)):
        for mask in (dict(), dict(causal=True), dict(local=True)):
            cfg = sm90.make_config(_problem(d, **mask), None, "sm_90a", det)
            want_here = want and (det or not mask or d >= 224)
            assert cfg.dq_pass == want_here, (d, det, mask)
            if want_here and det:  # the same kernel as without determinism (but no split GQA group)
                free = sm90.make_config(_problem(d, **mask), KernelOptions(bwd_dq_pass=True), "sm_90a")
                assert cfg == dataclasses.replace(free, kv_split=1)
            if not want_here and det:
                assert cfg.deterministic
    assert not sm90.make_config(_problem(256), KernelOptions(bwd_dq_pass=False), "sm_90a", True).dq_pass
    assert sm90.make_config(_problem(128), KernelOptions(bwd_dq_pass=True), "sm_90a", True).dq_pass
    with pytest.raises(ValueError, match="bwd_dq_pass"):
        sm90.make_config(_problem(128), KernelOptions(bwd_dq_pass=True, bwd_two_cta=True), "sm_90a")
    with pytest.raises(ValueError, match="bwd_dq_pass"):
        sm80.make_config(_problem(128), KernelOptions(bwd_dq_pass=True), "sm_80")
    with pytest.raises(ValueError, match="bwd_dq_pass"):
        KernelOptions(bwd_dq_pass=1)
    assert KernelOptions.from_str(KernelOptions(bwd_dq_pass=False).to_str()) == KernelOptions(bwd_dq_pass=False)
    cfg = sm90.make_config(_problem(192, causal=True), None, "sm_90a", True)
    assert cfg.dq_pass and not common.counts_slots(cfg)
    assert "semaphore" not in common.workspace_shapes(_problem(192), cfg, (2, 1000, 8, 192))
    # With the writer warp's head dims the pass drops the writer, its sdQ tile and the first store.
    monkeypatch.setattr(sm90, "DQ_PASS_MIN_HD", {True: 64, False: 64})
    writer = sm90.make_config(_problem(128), None, "sm_90a", True)
    assert writer.dq_pass and not writer.dq_direct and not writer.dq_first_store and not common.counts_slots(writer)
    assert "sdQ" not in [f[0] for f in writer.smem_fields()]
    plain = sm90.make_config(_problem(128), None, "sm_90a", False)
    assert plain.dq_pass
    for bad in (dataclasses.replace(writer, dq_first_store=True), dataclasses.replace(plain, two_cta=True, kv_split=1)):
        with pytest.raises(ValueError, match="dq_pass"):
            sm90.FlashBwdSm90.can_implement(bad)
    dq = dq_sm90.config_for(cfg)
    assert (dq.head_dim, dq.tile_n, dq.rows_tile_m, dq.causal) == (192, 80, cfg.tile_m, True)
    assert dq_sm90.config_for(sm90.make_config(_problem(256), None, "sm_90a")).tile_n == 48
    with pytest.raises(ValueError, match="shared memory"):
        dq_sm90.FlashBwdDqSm90.can_implement(dataclasses.replace(dq, head_dim=256, tile_n=128))
    with pytest.raises(ValueError, match="tile_m"):
        dq_sm90.FlashBwdDqSm90.can_implement(dataclasses.replace(dq, tile_m=64))


def test_exp2_emulation_rule_and_refusals():
    """BWD_EXP2_EMU_FRAC: the backward's exp2 emulation is on by default only where it measured ahead
    (padded head dim 64 with a causal mask or none, 32 without a mask; asked not deterministic, the 1-CTA
    kernel, the table's steps, head_dim_v == head_dim); KernelOptions.bwd_exp2_emu_frac overrides it,
    is validated, survives the custom ops' string form, is named in fa4.explain's notes, and is
    refused by the sm80 backward."""
    from fa4.bwd import sm80

    assert sm90.BWD_EXP2_EMU_FRAC == {(64, "causal"): 0.125, (64, "none"): 0.125, (32, "none"): 0.5}
    for d, mask, det, want in ((64, dict(causal=True), False, 0.125), (48, dict(causal=True), False, 0.125),
                               (64, dict(causal=True), True, 0.0), (64, dict(), False, 0.125), (64, dict(), True, 0.0),
                               (64, dict(local=True), False, 0.0), (128, dict(causal=True), False, 0.0),
                               (256, dict(causal=True), False, 0.0), (32, dict(), False, 0.5),
                               (32, dict(causal=True), False, 0.0), (32, dict(local=True), False, 0.0),
                               (32, dict(), True, 0.0)):
        assert sm90.make_config(_problem(d, **mask), None, "sm_90a", det).exp2_emu_frac == want, (d, mask, det)
    assert sm90.make_config(_problem(64, causal=True), KernelOptions(bwd_tile_m=64), "sm_90a").exp2_emu_frac == 0.0
    # Not measured: (head_dim, head_dim_v) pairs (64-row steps), the 2-CTA kernel, and a deterministic
    # run that the dQ pass turns into the non-deterministic kernel.
    assert sm90.make_config(_problem(64, causal=True, head_dim_v=128), None, "sm_90a").exp2_emu_frac == 0.0
    assert sm90.make_config(_problem(64, causal=True), KernelOptions(bwd_two_cta=True), "sm_90a").exp2_emu_frac == 0.0
    passed = sm90.make_config(_problem(64, causal=True), KernelOptions(bwd_dq_pass=True), "sm_90a", True)
    assert passed.dq_pass and passed.exp2_emu_frac == 0.0
    on = KernelOptions(bwd_exp2_emu_frac=0.25)
    assert sm90.make_config(_problem(128), on, "sm_90a", True).exp2_emu_frac == 0.25
    assert sm90.make_config(_problem(64, causal=True), KernelOptions(bwd_exp2_emu_frac=0.0),
                            "sm_90a").exp2_emu_frac == 0.0
    assert KernelOptions.from_str(on.to_str()) == on
    notes = sm90.explain_notes(_problem(64, causal=True), None, sm90.make_config(_problem(64, causal=True), None,
                                                                                 "sm_90a"))
    assert any("exp2 emulation" in n for n in notes)
    with pytest.raises(ValueError, match="bwd_exp2_emu_frac"):
        KernelOptions(bwd_exp2_emu_frac=1.5)
    with pytest.raises(ValueError, match="bwd_exp2_emu_frac"):
        sm80.make_config(_problem(128), on, "sm_80")
    with pytest.raises(ValueError, match="exp2_emu_frac"):
        sm90.FlashBwdSm90.can_implement(dataclasses.replace(sm90.make_config(_problem(64), None, "sm_90a"),
                                                            exp2_emu_frac=-0.5))


def test_kv_split_rule_and_refusals(monkeypatch):
    """Note [Split GQA group]: the group is split (a power of two dividing it) until the grid has
    KV_SPLIT_MIN_WAVES waves of CTAs while each keeps KV_SPLIT_MIN_STEPS steps; never when
    determinism is asked or with the 2-CTA kernel; can_implement refuses other splits."""
    def p(b, s, h, hk, d=128, causal=True):
        return AttnProblem("bf16", b, s, s, h, hk, d, d, d ** -0.5, causal=causal)

    monkeypatch.setattr(sm90, "_num_sms", lambda: 132)  # (make_config reads the GPU's)

    assert sm90.kv_split_for(p(2, 8192, 16, 1), 64, 128, 132) == 8   # MQA: 128 CTAs -> 1024
    assert sm90.kv_split_for(p(4, 4096, 32, 8), 64, 128, 132) == 1   # 1024 CTAs already
    assert sm90.kv_split_for(p(2, 8192, 16, 16), 64, 128, 132) == 1  # MHA
    assert sm90.kv_split_for(p(2, 8192, 12, 4), 64, 128, 132) == 1   # group 3
    assert sm90.kv_split_for(p(2, 113, 4, 1), 64, 128, 132) == 1     # 2 m_blocks: too few steps
    assert sm90.kv_split_for(p(2, 1000, 8, 2), 64, 128, 132) == 4
    assert sm90.kv_split_for(p(2, 8192, 16, 1, causal=False), 64, 128, 132) == 1  # one wave already
    assert sm90.kv_split_for(p(1, 4096, 16, 1, causal=False), 64, 128, 132) == 4  # 32 CTAs -> 128
    # The split's own variants, compiled by the CPU tests (the compact grid's add one of 2).
    assert [c.kv_split for c in sm90.variants("sm_90a") if c.kv_split > 1 and not c.compact_grid] == [4, 4, 4]
    assert sm90.make_config(p(2, 8192, 16, 1), None, "sm_90a").kv_split == 8
    assert sm90.make_config(p(2, 8192, 16, 1), None, "sm_90a", True).kv_split == 1
    assert sm90.make_config(p(2, 8192, 16, 1, d=64), KernelOptions(bwd_two_cta=True), "sm_90a").kv_split == 1
    # Asked determinism keeps 1, under the dQ pass too: a split read from the batch would make a
    # sample's bits depend on its batch.
    passed = sm90.make_config(p(2, 8192, 16, 1, d=256), None, "sm_90a", True)
    assert passed.dq_pass and not passed.deterministic and passed.kv_split == 1
    base = sm90.make_config(p(2, 8192, 16, 1), None, "sm_90a")
    for bad in (3, 0, -2):
        with pytest.raises(ValueError, match="kv_split"):
            sm90.FlashBwdSm90.can_implement(dataclasses.replace(base, kv_split=bad))
    cfg = dataclasses.replace(sm90.make_config(p(2, 8192, 16, 1, d=64), None, "sm_90a"), two_cta=True)
    with pytest.raises(ValueError, match="kv_split"):
        sm90.FlashBwdSm90.can_implement(cfg)
    # The ordered deterministic modes take a forced split (exact: Note [Split GQA group]).
    det = sm90.make_config(p(2, 8192, 16, 1), None, "sm_90a", True)
    assert det.deterministic and det.kv_split == 1
    sm90.FlashBwdSm90.can_implement(dataclasses.replace(det, kv_split=8))
    # The sm80 family: the same rule (on since v0.27, sm80.KV_SPLIT); its kernel checks the split.
    from fa4.bwd import sm80

    monkeypatch.setattr(common.arch, "num_sms", lambda *a: 132)
    assert sm80.KV_SPLIT and sm80.make_config(p(2, 8192, 16, 1), None, "sm_90a").kv_split == 8
    monkeypatch.setattr(sm80, "KV_SPLIT", False)
    assert sm80.make_config(p(2, 8192, 16, 1), None, "sm_90a").kv_split == 1
    monkeypatch.setattr(sm80, "KV_SPLIT", True)
    assert sm80.make_config(p(2, 8192, 16, 1), None, "sm_90a", True).kv_split == 1
    with pytest.raises(ValueError, match="kv_split"):
        sm80.FlashBwdSm80.can_implement(dataclasses.replace(sm80.make_config(p(2, 8192, 16, 1), None, "sm_90a"),
                                                            kv_split=3))


def test_kv_split_option(monkeypatch):
    """KernelOptions.bwd_kv_split: a power of two dividing the group; honoured over the rule, with
    determinism too on sm90 (a fixed split keeps a sample's bits independent of its batch), refused
    with the 2-CTA kernel and with sm80's deterministic mode; the 2-CTA default yields to it."""
    from fa4.bwd import common, sm80

    monkeypatch.setattr(common.arch, "num_sms", lambda *a: 132)

    def p(b, s, h, hk, d=128, causal=True):
        return AttnProblem(dtype="bf16", batch=b, seqlen_q=s, seqlen_k=s, heads=h, heads_k=hk, head_dim=d,
                           head_dim_v=d, softmax_scale=d**-0.5, causal=causal)

    for bad in (0, 3, -4, True, 2.0):
        with pytest.raises(ValueError, match="bwd_kv_split"):
            KernelOptions(bwd_kv_split=bad)
    mqa = p(2, 8192, 16, 1)
    assert sm90.make_config(mqa, KernelOptions(bwd_kv_split=1), "sm_90a").kv_split == 1
    assert sm90.make_config(mqa, KernelOptions(bwd_kv_split=4), "sm_90a").kv_split == 4
    det = sm90.make_config(mqa, KernelOptions(bwd_kv_split=8), "sm_90a", True)
    assert det.deterministic and det.kv_split == 8
    sm90.FlashBwdSm90.can_implement(det)
    with pytest.raises(ValueError, match="bwd_kv_split=32 must divide the GQA group"):
        sm90.make_config(mqa, KernelOptions(bwd_kv_split=32), "sm_90a")
    with pytest.raises(ValueError, match="bwd_kv_split=2: the 2-CTA"):
        sm90.make_config(mqa, KernelOptions(bwd_kv_split=2, bwd_two_cta=True), "sm_90a")
    monkeypatch.setattr(sm90, "TWO_CTA", {128: True})
    assert sm90.make_config(mqa, None, "sm_90a").two_cta
    cfg = sm90.make_config(mqa, KernelOptions(bwd_kv_split=2), "sm_90a")
    assert not cfg.two_cta and cfg.kv_split == 2
    # sm80: honoured with and without determinism (v0.28); the rule alone keeps 1 when deterministic.
    assert sm80.make_config(mqa, KernelOptions(bwd_kv_split=2), "sm_90a").kv_split == 2
    assert sm80.make_config(mqa, KernelOptions(bwd_kv_split=1), "sm_90a").kv_split == 1
    det80 = sm80.make_config(mqa, KernelOptions(bwd_kv_split=2), "sm_90a", True)
    assert det80.deterministic and det80.kv_split == 2
    assert sm80.make_config(mqa, None, "sm_90a", True).kv_split == 1
    with pytest.raises(ValueError, match="bwd_kv_split=32 must divide the GQA group"):
        sm80.make_config(mqa, KernelOptions(bwd_kv_split=32), "sm_90a", True)
    # Through the options string (torch.library ops carry it).
    assert KernelOptions.from_str(KernelOptions(bwd_kv_split=4).to_str()).bwd_kv_split == 4


def test_sum_partials_fixed_order():
    """The split's partials are summed by a fixed tree of adds (common.sum_partials): the same bits
    for a sample whatever the batch around it, and the documented order."""
    import torch

    from fa4.bwd.common import sum_partials

    g = torch.Generator().manual_seed(0)
    t = torch.randn(5, 37, 3, 8, 16, generator=g) * torch.logspace(-3, 3, 16)
    whole = sum_partials(t)
    assert whole.shape == (5, 37, 3, 16)
    assert torch.equal(sum_partials(t[2:3]), whole[2:3]) and torch.equal(sum_partials(t[:, 5:9]), whole[:, 5:9])
    p = [t[..., i, :] for i in range(8)]
    assert torch.equal(whole, ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7])))
    assert torch.equal(sum_partials(t[..., :1, :]), t[..., 0, :])


@pytest.mark.parametrize("d", [64, 128, 256])
def test_compact_grid_rule(d, monkeypatch):
    """Note [Compact varlen grid]: with ``COMPACT_VARLEN`` (off by default, v0.28) varlen K rows take
    the compact grid, never deterministic, 2-CTA, first-store or fixed-length ones; can_implement
    refuses it where its order cannot serve."""
    varlen = dict(varlen_q=True, varlen_k=True, total_q=4000, total_k=4000)
    assert not sm90.make_config(_problem(d, causal=True, **varlen), None, "sm_90a").compact_grid
    monkeypatch.setattr(sm90, "COMPACT_VARLEN", True)
    cfg = sm90.make_config(_problem(d, causal=True, **varlen), None, "sm_90a")
    assert cfg.compact_grid == (not cfg.two_cta and not cfg.dq_first_store)
    assert not sm90.make_config(_problem(d, causal=True), None, "sm_90a").compact_grid
    det = sm90.make_config(_problem(d, causal=True, **varlen), None, "sm_90a", True)
    assert not det.compact_grid or (det.dq_pass and not det.deterministic)
    for bad in (dict(varlen_k=False, varlen_q=False), dict(deterministic=True), dict(dq_first_store=True),
                dict(two_cta=True, kv_split=1)):
        with pytest.raises(ValueError, match="compact_grid"):
            sm90.FlashBwdSm90.can_implement(dataclasses.replace(cfg, compact_grid=True, **bad))


def test_sections_of_a_call_without_max_seqlen(monkeypatch):
    """v0.38: a varlen backward whose call gave no max_seqlen (fa4 then holds the packed token
    count) takes the sections it would take with the batch's average lengths, not the ones the
    bound gives (a causal GQA call: one pair per section on the bound, 1.45x the time on the H100);
    a call with the lengths, even a skewed batch's, keeps them; explain says which."""
    monkeypatch.setattr(common.arch, "num_sms", lambda *a, **k: 132)
    monkeypatch.setattr(common.arch, "l2_bytes", lambda *a, **k: common.arch.H200_L2_BYTES)

    def problem(max_len, total=16384, batch=8):
        return AttnProblem(dtype="bf16", batch=batch, seqlen_q=max_len, seqlen_k=max_len, heads=32, heads_k=8,
                           head_dim=128, head_dim_v=128, softmax_scale=128**-0.5, causal=True, varlen_q=True,
                           varlen_k=True, total_q=total, total_k=total)

    bound, given, average = problem(16384), problem(3774), problem(2048)
    cfg = sm90.make_config(bound, None, "sm_90a")
    assert common.section_lengths(bound, 16384) == (2048, 2048)
    assert common.section_lengths(given, 3774) == (3774, 3774)

    def sections(p):
        return common.launch_sections(cfg, sm90.LAUNCH_ORDER, 64, *common.section_lengths(p, p.seqlen_k), 4, 128, 128)

    # Judged on the bound: one pair per section; on the average: as the call with average lengths.
    assert common.launch_sections(cfg, sm90.LAUNCH_ORDER, 64, 16384, 16384, 4, 128, 128) == 1
    assert sections(bound) == sections(average) > 1
    assert sections(given) > 1
    # A dense call (no varlen) and a skewed batch that gave its longest length keep their lengths.
    skew = problem(4000, total=4100, batch=100)
    assert common.section_lengths(skew, 4000) == (4000, 4000)
    dense = dataclasses.replace(given, varlen_q=False, varlen_k=False, total_q=0, total_k=0)
    assert common.section_lengths(dense, 5000) == (5000, 3774)
    notes = " ".join(sm90.explain_notes(bound, None, cfg))
    assert "judged on the average sequence lengths (2048 queries, 2048 keys)" in notes
    assert "judged on the average" not in " ".join(sm90.explain_notes(given, None, sm90.make_config(given, None,
                                                                                                    "sm_90a")))
    # Only max_seqlen_k missing: only the keys are averaged, and the note names them alone.
    k_only = dataclasses.replace(given, seqlen_k=16384)
    assert common.section_lengths(k_only, 16384) == (2048, 3774)
    notes = " ".join(sm90.explain_notes(k_only, None, sm90.make_config(k_only, None, "sm_90a")))
    assert "judged on the average sequence lengths (2048 keys)" in notes


@pytest.mark.parametrize("sk,causal,expect", [(1024, False, True), (1024, True, True), (2048, False, True),
                                              (2049, False, False), (8192, False, False), (8192, True, False)])
def test_pdl_by_length(sk, causal, expect):
    """v0.56 (PDL, PDL_MAX_SEQLEN_K): the backward's programmatic dependent launches where the keys
    number at most 2048 (the short rows gained; d128 s8k lost); the postprocess's config follows the
    main kernel's (run_backward passes the main config's ``pdl`` to the preprocess too)."""
    problem = dataclasses.replace(_problem(128, causal=causal), seqlen_q=sk, seqlen_k=sk)
    cfg = sm90.make_config(problem, None, "sm_90a")
    assert cfg.pdl == expect
    assert postprocess.config_for(cfg).pdl == expect


def test_pdl_post_needs_pdl():
    """``pdl_post=False`` (the postprocess a plain launch) is refused without ``pdl``: the same code
    under a second compile key."""
    cfg = sm90.make_config(dataclasses.replace(_problem(128), seqlen_q=8192, seqlen_k=8192), None, "sm_90a")
    assert not cfg.pdl
    with pytest.raises(ValueError, match="pdl_post"):
        sm90.FlashBwdSm90.can_implement(dataclasses.replace(cfg, pdl_post=False))
    main_only = dataclasses.replace(cfg, pdl=True, pdl_post=False)
    sm90.FlashBwdSm90.can_implement(main_only)
    assert not postprocess.config_for(main_only).pdl


def test_ordered_kernel_for_short_causal_rows(monkeypatch):
    """Note [The ordered kernel for short causal rows]: a call that does not ask for determinism takes
    the deterministic kernel (the same config as asking) at padded head dim 128, causal, at most
    ORDERED_SHORT_MAX_SEQLEN_K keys, MHA, dense, no backward option, four waves of CTAs; nowhere else;
    0 turns it off. fa4.explain() says so."""
    import torch

    import fa4

    monkeypatch.setattr(sm90, "_num_sms", lambda: 132)
    base = dict(batch=16, seqlen_q=1024, seqlen_k=1024, heads=16, heads_k=16, causal=True)

    def cfgs(d=128, opts=None, **kw):
        p = _problem(d, **{**base, **kw})
        return sm90.make_config(p, opts, "sm_90a", False), sm90.make_config(p, opts, "sm_90a", True)

    free, det = cfgs()
    assert free == det and free.deterministic and free.dq_first_store and free.det_up
    # The same config as asking, wherever the rule reaches (Note: two decisions read the asked flag).
    for d, kw in ((120, {}), (128, dict(batch=5)), (128, dict(softcap=30.0)), (128, dict(dtype="fp16")),
                  (128, dict(has_sink=True)), (128, dict(seqlen_q=768, seqlen_k=768, batch=24)),
                  (128, dict(softmax_scale=0.3))):
        free, det = cfgs(d, **kw)
        assert free.deterministic and free == det, (d, kw)
    for kw in (dict(causal=False), dict(seqlen_q=2048, seqlen_k=2048, batch=8), dict(heads_k=4),
               dict(seqlen_q=128), dict(seqlen_q=4096),  # not square
               dict(seqlen_q=256, seqlen_k=256, batch=64),  # under half the bound: unmeasured
               dict(batch=4),  # 4 x 16 x 8 = 512 CTAs: under four waves of 132 SMs
               dict(varlen_q=True, varlen_k=True, total_q=16384, total_k=16384), dict(has_seqused_k=True),
               dict(causal=False, local=True, window_left=256, window_right=0)):
        assert not cfgs(**kw)[0].deterministic, kw
    assert not cfgs(64, heads=32, heads_k=32)[0].deterministic
    assert not cfgs(256, heads=8, heads_k=8)[0].deterministic
    assert not cfgs(192, heads=8, heads_k=8)[0].deterministic
    for opts in (KernelOptions(bwd_tile_m=64), KernelOptions(bwd_dq_pass=False), KernelOptions(bwd_kv_split=1),
                 KernelOptions(bwd_exp2_emu_frac=0.0), KernelOptions(bwd_two_cta=False),
                 KernelOptions(bwd_num_threads=384)):
        assert not cfgs(opts=opts)[0].deterministic, opts
    assert cfgs(opts=KernelOptions(arch="sm90"))[0].deterministic  # the family is not a backward option
    q = torch.empty(16, 1024, 16, 128, dtype=torch.bfloat16, device="meta")
    note = "the deterministic kernel, taken without deterministic=True too"
    assert note in str(fa4.explain(q, q, q, causal=True, capability=(9, 0)))
    assert note not in str(fa4.explain(q, q, q, capability=(9, 0)))
    monkeypatch.setattr(sm90, "ORDERED_SHORT_MAX_SEQLEN_K", 0)
    assert not cfgs()[0].deterministic
    assert note not in str(fa4.explain(q, q, q, causal=True, capability=(9, 0)))
