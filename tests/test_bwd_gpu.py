"""Gradients of every backward family through the public API, against the float32 reference.

``fa4.flash_attn_func`` / ``flash_attn_varlen_func`` with ``KernelOptions(arch=family)`` for the
sm80 family (``mma.sync``; on an H100/H200 the Ampere path runs) and the sm90 family (wgmma, TMA;
skipped off compute capability 9.x), gradients by autograd, compared with
:func:`fa4.testing.check_close` (at most twice the error of naive low-precision PyTorch, plus
rounding noise). Outputs are NaN-filled (conftest), so an element the kernels forget to write fails.

Note [Why the grid is pruned]
    The full grid -- head dims {64, 96, 128, 192, 256} x mask {none, causal, local} x softcap
    {off, on} x heads {MHA, GQA, MQA} x seqlens {(1,1), (1,4096), (113,203), (1000,1000),
    (1024,4096), (4096,1024)} x {dense, varlen, varlen + seqused_k} x {bf16, fp16} -- is 3240
    cases per family, each
    with a float32 reference and often a fresh compile: hours on one GPU. Bugs in attention kernels
    come from one feature or from the interaction of two (a head dim with a ragged seqlen tile, GQA
    with varlen, a window with s_q != s_k), so the cases form a pairwise covering array
    (:func:`pairwise`): every value pair of any two factors appears in some case, in about 30
    cases per family. The gradient through the LSE, determinism, NaN in unused KV-cache rows and one
    long (8192) sequence have their own tests.
"""

import pytest
import torch

import fa4
from fa4.config import AttnProblem
from fa4.testing import attention_ref, check_close, grad_noise_floor, random_qkv, random_varlen

FAMILIES = ["sm80", "sm90"]


@pytest.fixture(params=FAMILIES)
def family(request):
    """A backward family this GPU runs (sm90: compute capability 9.x only)."""
    if request.param == "sm90" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    return request.param


@pytest.fixture(params=FAMILIES + ["sm90-2cta"])
def family_2cta(request):
    """:func:`family`, and the sm90 family's two-CTA backward (Note [Two-CTA dQ] in fa4/bwd/sm90.py)."""
    if request.param != "sm80" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    return request.param


def _opts(family, **kw):
    if family == "sm90-2cta":
        return fa4.KernelOptions(arch="sm90", bwd_two_cta=True, **kw)
    return fa4.KernelOptions(arch=family, **kw)

FACTORS = {
    "d": [64, 96, 128, 192, 256],
    "seqlens": [(1, 1), (1, 4096), (113, 203), (1000, 1000), (1024, 4096), (4096, 1024)],
    "mask": ["none", "causal", "local"],
    "heads": ["mha", "gqa", "mqa"],
    "layout": ["dense", "varlen", "seqused"],
    "softcap": [0.0, 2.0],
    "dtype": [torch.bfloat16, torch.float16],
}
HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}


def pairwise(factors: dict) -> list[dict]:
    """A small covering array: every value pair of every two factors appears in some row.

    In-parameter-order construction (deterministic): all pairs of the two largest factors, then
    each next factor is added to the existing rows greedily (the value covering most uncovered
    pairs), and rows are appended for pairs still uncovered (other values: first uncovered, else
    cycling)."""
    names = sorted(factors, key=lambda n: -len(factors[n]))
    a, b = names[0], names[1]
    rows = [{a: i, b: j} for i in range(len(factors[a])) for j in range(len(factors[b]))]
    for k, name in enumerate(names[2:], start=2):
        prev = names[:k]
        todo = {(p, pv, v) for p in prev for pv in range(len(factors[p])) for v in range(len(factors[name]))}
        for row in rows:
            best = max(range(len(factors[name])), key=lambda v: (sum((p, row[p], v) in todo for p in prev), -v))
            row[name] = best
            todo -= {(p, row[p], best) for p in prev}
        while todo:
            p, pv, v = min(todo)
            row = {p: pv, name: v}
            for q in prev:
                if q != p:
                    free = [x for x in range(len(factors[q])) if (q, x, v) in todo]
                    row[q] = free[0] if free else len(rows) % len(factors[q])
            todo -= {(q, row[q], v) for q in prev}
            rows.append(row)
    return [{n: factors[n][row[n]] for n in names} for row in rows]


CASES = pairwise(FACTORS)


def _case_id(c) -> str:
    sc = "sc" if c["softcap"] else "nosc"
    dt = "bf16" if c["dtype"] is torch.bfloat16 else "fp16"
    return f"d{c['d']}-{c['seqlens'][0]}x{c['seqlens'][1]}-{c['mask']}-{c['heads']}-{c['layout']}-{sc}-{dt}"


def _window(mask: str, sq: int, sk: int):
    if mask == "local":
        return (max(sk // 3, 1) + 5, sq // 5 + 1)
    return (None, None)


def _leaf32(ts):
    return [t.detach().float().requires_grad_() for t in ts]


def _grads(outs, inputs, grad_outs):
    return torch.autograd.grad(outs, inputs, grad_outs)


def _check_grads(names, got, ref, pt, inputs, dout):
    """The pass rule, with the float32 cancellation floor of Note [gradient cancellation floor]."""
    floors = grad_noise_floor(*inputs, dout)
    for name, g, r, p in zip(names, got, ref, pt):
        check_close(name, g, r, p, extra_atol=floors[name])


def _run_dense(case, family, seed=0, deterministic=False, with_lse=False, opts=None):
    sq, sk = case["seqlens"]
    h, hk = HEADS[case["heads"]]
    kw = dict(causal=case["mask"] == "causal", window_size=_window(case["mask"], sq, sk), softcap=case["softcap"])
    q, k, v = random_qkv(2, sq, sk, h, hk, case["d"], case["dtype"], "cuda", requires_grad=True, seed=seed)
    out, lse = fa4.flash_attn_func(q, k, v, return_lse=True, deterministic=deterministic,
                                   kernel_options=opts or _opts(family), **kw)
    g = torch.randn_like(out)
    glse = torch.randn_like(lse) if with_lse else None
    outs, gouts = ((out, lse), (g, glse)) if with_lse else ((out,), (g,))
    grads = _grads(outs, (q, k, v), gouts)
    return (q, k, v), kw, g, glse, grads


def _reference_dense(qkv, kw, g, glse):
    q32 = _leaf32(qkv)
    out_ref, lse_ref = attention_ref(*q32, upcast=True, **kw)
    ref = _grads(
        (out_ref, lse_ref) if glse is not None else (out_ref,),
        q32,
        (g.float(), glse) if glse is not None else (g.float(),),
    )
    qlp = [t.detach().requires_grad_() for t in qkv]
    out_pt, lse_pt = attention_ref(*qlp, upcast=False, **kw)
    # The low-precision baseline's lse path is float32 already; its out path is in the input dtype.
    pt = _grads((out_pt, lse_pt) if glse is not None else (out_pt,), qlp, (g, glse) if glse is not None else (g,))
    return ref, pt


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bwd(case, family):
    _check_case(case, _opts(family))


# The two-CTA sm90 backward (Note [Two-CTA dQ] in fa4/bwd/sm90.py) serves head dims <= 128; its own
# covering array adds s_k = 300 (three K blocks: the second pair's block 3 lies past the keys).
TWO_CTA_CASES = pairwise({**FACTORS, "d": [64, 128], "seqlens": FACTORS["seqlens"] + [(77, 300)]})


# Padded head dim 32 holds head dim 32 only (the minimum; 40-56 pad to 64): its own table entry, whose
# default without a mask emulates half of the exponentials (BWD_EXP2_EMU_FRAC, v0.25).
SMALL_HD_CASES = pairwise({**FACTORS, "d": [32]})


@pytest.mark.gpu
@pytest.mark.parametrize("case", SMALL_HD_CASES, ids=[_case_id(c) for c in SMALL_HD_CASES])
def test_bwd_sm90_head_dim_32(case):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    _check_case(case, fa4.KernelOptions(arch="sm90"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", TWO_CTA_CASES, ids=[_case_id(c) for c in TWO_CTA_CASES])
def test_bwd_sm90_two_cta(case):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    _check_case(case, fa4.KernelOptions(arch="sm90", bwd_two_cta=True))


# Note [Split GQA group] (fa4/bwd/sm90.py): the q heads of a kv head over ``split`` CTAs, float32
# partials of dK / dV summed by the driver. The rule (kv_split_for) splits some of the covering
# array's MQA rows on its own (s_q >= 1000); these cases force each split on groups of 4 and 8.
KV_SPLIT_CASES = [
    dict(d=128, seqlens=(1000, 1000), mask="causal", heads="mqa8", layout="dense", softcap=0.0,
         dtype=torch.bfloat16, split=8),
    dict(d=64, seqlens=(113, 203), mask="none", heads="gqa4", layout="varlen", softcap=0.0,
         dtype=torch.float16, split=2),
    dict(d=128, seqlens=(1024, 4096), mask="local", heads="mqa8", layout="seqused", softcap=2.0,
         dtype=torch.bfloat16, split=4),
    dict(d=256, seqlens=(4096, 1024), mask="causal", heads="gqa4", layout="dense", softcap=0.0,
         dtype=torch.bfloat16, split=4),
    dict(d=96, seqlens=(1, 4096), mask="none", heads="mqa8", layout="dense", softcap=0.0,
         dtype=torch.bfloat16, split=8),
    dict(d=192, seqlens=(700, 1100), mask="causal", heads="gqa4", layout="varlen", softcap=0.0,
         dtype=torch.bfloat16, split=2),
    # Head dim 80 pads to 96: the partials' column predicate (tools/kv_split_check.py ran this under
    # compute-sanitizer in v0.26; this case was added after that lease).
    dict(d=80, seqlens=(1000, 1000), mask="causal", heads="mqa8", layout="seqused", softcap=0.0,
         dtype=torch.bfloat16, split=8),
]
HEADS.update({"gqa4": (8, 2), "mqa8": (8, 1)})


def _kv_split_problem(case) -> AttnProblem:
    """The AttnProblem of a KV_SPLIT_CASES row (for make_config: the sizes the split rule reads)."""
    h, hk = HEADS[case["heads"]]
    sq, sk = case["seqlens"]
    return AttnProblem("bf16", 2, sq, sk, h, hk, case["d"], case["d"], 0.1, causal=case["mask"] == "causal",
                       local=case["mask"] == "local")


@pytest.mark.gpu
@pytest.mark.parametrize("case", KV_SPLIT_CASES, ids=[f"{_case_id(c)}-split{c['split']}" for c in KV_SPLIT_CASES])
def test_bwd_sm90_kv_split(case, monkeypatch):
    """The split GQA group passes the reference rule for every split, mask and layout (the config
    really carries the split); a deterministic run keeps one CTA per kv head (d256: under the dQ
    pass) and gives the same bits twice."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    split = case["split"]
    monkeypatch.setattr(sm90, "kv_split_for", lambda *a, **k: split)
    fa4.ops._plans.clear()
    try:
        problem = _kv_split_problem(case)
        assert sm90.make_config(problem, None, "sm_90a").kv_split == split
        _check_case(case, fa4.KernelOptions(arch="sm90"))
        if case["d"] == 256:
            assert sm90.make_config(problem, None, "sm_90a", True).kv_split == 1  # determinism asked

            (sq, sk), (h, hk) = case["seqlens"], HEADS[case["heads"]]
            q, k, v = random_qkv(2, sq, sk, h, hk, case["d"], case["dtype"], "cuda", requires_grad=True, seed=3)
            g = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=torch.Generator("cuda").manual_seed(4))

            def run():
                out, _ = fa4.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                             kernel_options=fa4.KernelOptions(arch="sm90"))
                return torch.autograd.grad(out, (q, k, v), g)
            _same_bits_over_runs(run, 2, "deterministic backward with the split GQA group")
    finally:
        fa4.ops._plans.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("case", KV_SPLIT_CASES, ids=[f"{_case_id(c)}-split{c['split']}" for c in KV_SPLIT_CASES])
def test_bwd_sm80_kv_split(case, monkeypatch):
    """The sm80 backward's split GQA group (on by default since v0.27: sm80.KV_SPLIT), forced
    on the same cases as the sm90 family's, under the reference rule."""
    from fa4.bwd import common, sm80

    split = case["split"]
    monkeypatch.setattr(sm80, "KV_SPLIT", True)
    monkeypatch.setattr(common, "kv_split_for", lambda *a, **k: split)
    fa4.ops._plans.clear()
    try:
        problem = _kv_split_problem(case)
        assert sm80.make_config(problem, None, "sm_90a").kv_split == split
        _check_case(case, fa4.KernelOptions(arch="sm80"))
    finally:
        fa4.ops._plans.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("d,mask,layout,heads,split", [
    (128, "causal", "dense", (8, 1), 4),   # the down order (GQA), the writer warp
    (128, "none", "dense", (8, 1), 8),     # the rotated order
    (64, "causal", "varlen", (8, 2), 2),   # 128-row steps
    (64, "none", "varlen", (8, 1), 4),
    (96, "local", "dense", (8, 2), 4),
])
@pytest.mark.parametrize("fam", ["sm90", "sm80"])
def test_bwd_kv_split_deterministic(fam, d, mask, layout, heads, split, monkeypatch, hang_watchdog, ordered_dq):
    """Note [Split GQA group] under the ordered deterministic dQ (a forced split: asked determinism
    keeps 1): each dQ slot belongs to one virtual pair whose K blocks add in the same rank order, so
    the run is bit-exact over runs, dQ has the unsplit run's bits, and dK / dV are correct (dense:
    the reference rule; both: close to the unsplit run, the same sums in another order). The sm80
    family's semaphore-ordered dQ too (v0.28: passed on the H200, so its bwd_kv_split takes
    determinism)."""
    import importlib

    mod = importlib.import_module(f"fa4.bwd.{fam}")
    if fam == "sm90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    opts = fa4.KernelOptions(arch=fam)
    run, (q, k, v), g, kw = _deterministic_run(layout, d, mask, opts, (1000, 1300), (900, 1100), d + split,
                                               heads=heads)
    import dataclasses

    make = mod.make_config
    results = {}
    for s in (split, 1):
        monkeypatch.setattr(mod, "make_config", lambda *a, s=s, **k: dataclasses.replace(make(*a, **k), kv_split=s))
        fa4.ops._plans.clear()
        results[s] = _same_bits_over_runs(run, 3, f"deterministic backward, kv_split={s}")
        cfgs = [cfg for (direction, *_), (_, cfg) in fa4.ops._plans.items() if direction == "bwd"]
        assert cfgs and all(c.kv_split == s and c.deterministic for c in cfgs), cfgs
    monkeypatch.setattr(mod, "make_config", make)
    fa4.ops._plans.clear()
    assert torch.equal(results[split][0], results[1][0]), "dq depends on the split"
    if layout == "dense":
        ref, pt = _reference_dense((q, k, v), dict(kw, softcap=0.0), g, None)
        _check_grads(("dq", "dk", "dv"), results[split], ref, pt, (q, k, v), g)
    for a, b in zip(results[split], results[1]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def _check_case(case, opts):
    """One case of the covering array through the public API, under the pass rule."""
    sq, sk = case["seqlens"]
    h, hk = HEADS[case["heads"]]
    d, dtype = case["d"], case["dtype"]
    kw = dict(causal=case["mask"] == "causal", window_size=_window(case["mask"], sq, sk), softcap=case["softcap"])
    if case["layout"] == "dense":
        qkv, kw, g, _, grads = _run_dense(case, None, opts=opts)
        ref, pt = _reference_dense(qkv, kw, g, None)
    else:
        vb = random_varlen(
            3,
            sq,
            h,
            hk,
            d,
            dtype,
            "cuda",
            max_seqlen_k=sk,
            with_seqused_k=case["layout"] == "seqused",
            requires_grad=True,
            seed=1,
        )
        var = dict(cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, seqused_k=vb.seqused_k)
        out, _ = fa4.flash_attn_varlen_func(
            vb.q,
            vb.k,
            vb.v,
            max_seqlen_q=vb.max_seqlen_q,
            max_seqlen_k=vb.max_seqlen_k,
            kernel_options=opts,
            **var,
            **kw,
        )
        g = torch.randn_like(out)
        grads = _grads((out,), (vb.q, vb.k, vb.v), (g,))
        q32 = _leaf32((vb.q, vb.k, vb.v))
        out_ref, _ = attention_ref(*q32, upcast=True, **var, **kw)
        ref = _grads((out_ref,), q32, (g.float(),))
        qlp = [t.detach().requires_grad_() for t in (vb.q, vb.k, vb.v)]
        out_pt, _ = attention_ref(*qlp, upcast=False, **var, **kw)
        pt = _grads((out_pt,), qlp, (g,))
        qkv = (vb.q, vb.k, vb.v)
    _check_grads(("dq", "dk", "dv"), grads, ref, pt, qkv, g)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64), (64, 128)])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("seqlens", [(1, 300), (113, 203), (1000, 1000)])
def test_bwd_sm90_head_dim_v(d, dv, mask, seqlens):
    """(head_dim, head_dim_v) pairs, DeepSeek's (192, 128) among them (the sm90 backward; V, dO,
    dV have their own head dim): GQA, dense and varlen, deterministic for (192, 128), under the
    pass rule."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    sq, sk = seqlens
    kw = dict(causal=mask == "causal", window_size=_window(mask, sq, sk), softcap=0.0)
    q, k, _ = random_qkv(2, sq, sk, 6, 2, d, torch.bfloat16, "cuda", seed=d + dv + sq)
    v = torch.randn(2, sk, 2, dv, dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    opts = fa4.KernelOptions(arch="sm90")
    det = d == 192
    out, _ = fa4.flash_attn_func(q, k, v, deterministic=det, kernel_options=opts, **kw)
    assert out.shape == (2, sq, 6, dv)
    g = torch.randn_like(out)
    grads = _grads((out,), (q, k, v), (g,))
    ref, pt = _reference_dense((q, k, v), kw, g, None)
    _check_grads(("dq", "dk", "dv"), grads, ref, pt, (q, k, v), g)
    if det:  # the dQ pass (the default there), and the ordered direct adds (bwd_dq_pass=False)
        again = _grads((fa4.flash_attn_func(q, k, v, deterministic=True, kernel_options=opts, **kw)[0],), (q, k, v), (g,))
        assert all(torch.equal(a, b) for a, b in zip(grads, again))
        ordered = fa4.KernelOptions(arch="sm90", bwd_dq_pass=False)
        runs = [_grads((fa4.flash_attn_func(q, k, v, deterministic=True, kernel_options=ordered, **kw)[0],), (q, k, v),
                       (g,)) for _ in range(2)]
        assert all(torch.equal(a, b) for a, b in zip(*runs))
        _check_grads(("dq", "dk", "dv"), runs[0], ref, pt, (q, k, v), g)
    # Varlen: the same batch packed.
    cu_q = torch.tensor([0, sq, 2 * sq], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, sk, 2 * sk], dtype=torch.int32, device="cuda")
    flat = [t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v)]
    out_v, _ = fa4.flash_attn_varlen_func(*flat, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, kernel_options=opts, **kw)
    grads_v = _grads((out_v,), flat, (g.flatten(0, 1),))
    for name, a, r, p in zip(("dq", "dk", "dv"), grads_v, ref, pt):
        check_close(name, a.unflatten(0, (2, -1)), r, p,
                    extra_atol=grad_noise_floor(q, k, v, g)[name])


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("seqlens", [(113, 203), (1000, 1000)])
def test_bwd_grad_through_lse(mask, seqlens, family_2cta):
    """loss uses out and lse (return_lse=True): D - dLSE in the preprocess. With a local window
    some rows see no key (lse = -inf): their gradients must be 0, not NaN."""
    case = dict(d=128, seqlens=seqlens, mask=mask, heads="gqa", softcap=0.0, dtype=torch.bfloat16)
    qkv, kw, g, glse, grads = _run_dense(case, family_2cta, with_lse=True)
    ref, pt = _reference_dense(qkv, kw, g, glse)
    _check_grads(("dq", "dk", "dv"), grads, ref, pt, qkv, g)


@pytest.mark.gpu
def test_bwd_fully_masked_rows_give_zero_grads(family_2cta):
    """s_q > s_k with causal: the first s_q - s_k rows see no key (out 0, lse -inf, dq exactly 0)."""
    q, k, v = random_qkv(1, 300, 100, 2, 1, 64, torch.bfloat16, "cuda", requires_grad=True, seed=5)
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True, kernel_options=_opts(family_2cta))
    dq, dk, dv = torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
    assert torch.equal(dq[:, :200], torch.zeros_like(dq[:, :200]))
    assert not any(t.isnan().any() for t in (dq, dk, dv))


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("heads", ["mha", "gqa"])
def test_bwd_deterministic(mask, heads, family):
    """deterministic=True: 20 backward runs give bit-identical dq, dk, dv (many K blocks add into
    each dQ tile: s_k = 4096), and the result is correct."""
    case = dict(d=128, seqlens=(1024, 4096), mask=mask, heads=heads, softcap=0.0, dtype=torch.bfloat16)
    sq, sk = case["seqlens"]
    h, hk = HEADS[heads]
    kw = dict(causal=mask == "causal", window_size=_window(mask, sq, sk))
    q, k, v = random_qkv(2, sq, sk, h, hk, 128, torch.bfloat16, "cuda", requires_grad=True, seed=7)
    g = torch.randn(2, sq, h, 128, device="cuda", dtype=torch.bfloat16)
    first = None
    for _ in range(20):
        out, _ = fa4.flash_attn_func(q, k, v, deterministic=True, kernel_options=_opts(family), **kw)
        grads = torch.autograd.grad(out, (q, k, v), g)
        if first is None:
            first = grads
        else:
            for name, a, b in zip(("dq", "dk", "dv"), first, grads):
                assert torch.equal(a, b), f"{name} differs between deterministic runs"
    ref, pt = _reference_dense((q, k, v), dict(kw, softcap=0.0), g, None)
    _check_grads(("dq", "dk", "dv"), first, ref, pt, (q, k, v), g)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen", [1000, 1024])
def test_bwd_short_causal_rows_take_the_ordered_kernel(seqlen, monkeypatch):
    """Note [The ordered kernel for short causal rows] (fa4/bwd/sm90.py): a d128 causal call of at
    most 1024 keys that does not ask for determinism runs the deterministic kernel (enough CTAs: 6 x
    16 heads x 8 K blocks, over four waves of 132 SMs). Its gradients have the bits of deterministic=True and pass the reference
    rule; with the rule off the call runs the non-deterministic kernel, within the rule too."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    q, k, v = random_qkv(6, seqlen, seqlen, 16, 16, 128, torch.bfloat16, "cuda", requires_grad=True, seed=11)
    g = torch.randn(6, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16)
    sm90_opts = fa4.KernelOptions(arch="sm90")  # (whatever FA4_ARCH says)
    note = "the deterministic kernel, taken without deterministic=True too"
    assert note in str(fa4.explain(q, k, v, causal=True, kernel_options=sm90_opts))

    def grads(det):
        out, _ = fa4.flash_attn_func(q, k, v, causal=True, deterministic=det, kernel_options=sm90_opts)
        return torch.autograd.grad(out, (q, k, v), g)

    free, asked = grads(False), grads(True)
    for name, a, b in zip(("dq", "dk", "dv"), free, asked):
        assert torch.equal(a, b), f"{name}: the short causal call did not run the deterministic kernel's bits"
    ref, pt = _reference_dense((q, k, v), dict(causal=True, window_size=(None, None), softcap=0.0), g, None)
    _check_grads(("dq", "dk", "dv"), free, ref, pt, (q, k, v), g)
    from fa4 import ops

    monkeypatch.setattr(sm90, "ORDERED_SHORT_MAX_SEQLEN_K", 0)
    ops._plans.clear()  # (the plans' key does not hold the constant)
    try:
        assert note not in str(fa4.explain(q, k, v, causal=True, kernel_options=sm90_opts))
        _check_grads(("dq", "dk", "dv"), grads(False), ref, pt, (q, k, v), g)
    finally:
        ops._plans.clear()


@pytest.mark.gpu
def test_bwd_deterministic_varlen(family):
    vb = random_varlen(
        4, 700, 4, 2, 64, torch.bfloat16, "cuda", max_seqlen_k=1500, with_seqused_k=True, requires_grad=True, seed=11
    )
    var = dict(
        cu_seqlens_q=vb.cu_seqlens_q,
        cu_seqlens_k=vb.cu_seqlens_k,
        seqused_k=vb.seqused_k,
        max_seqlen_q=vb.max_seqlen_q,
        max_seqlen_k=vb.max_seqlen_k,
    )
    g = torch.randn(vb.q.shape, device="cuda", dtype=vb.q.dtype)
    first = None
    for _ in range(5):
        out, _ = fa4.flash_attn_varlen_func(
            vb.q, vb.k, vb.v, causal=True, deterministic=True, kernel_options=_opts(family), **var
        )
        grads = torch.autograd.grad(out, (vb.q, vb.k, vb.v), g)
        if first is None:
            first = grads
        else:
            for a, b in zip(first, grads):
                assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
def test_bwd_deterministic_launch_orders(mask, family, monkeypatch, ordered_dq):
    """The deterministic gradients do not depend on the launch order (sections of 1, 3 or all the
    (batch, kv head) pairs, Note [Deterministic dQ] in fa4/bwd/common.py: the adds into a dQ slot
    follow the ranks, whatever the order), on a grid of 512 CTAs, several times what the GPU holds
    at once (later CTAs wait on CTAs that have finished or are still running), and are correct."""
    import importlib

    mod = importlib.import_module(f"fa4.bwd.{family}")

    sq = sk = 2048
    kw = dict(causal=mask == "causal", window_size=_window(mask, sq, sk))
    q, k, v = random_qkv(4, sq, sk, 16, 8, 128, torch.bfloat16, "cuda", requires_grad=True, seed=13)
    g = torch.randn(4, sq, 16, 128, device="cuda", dtype=torch.bfloat16)
    results = {}
    for section in (None, 1, 3, 10**6):
        monkeypatch.setattr(mod.LAUNCH_ORDER, "det_section", section)
        for _ in range(2):
            out, _ = fa4.flash_attn_func(q, k, v, deterministic=True, kernel_options=_opts(family), **kw)
            grads = torch.autograd.grad(out, (q, k, v), g)
            first = results.setdefault(section, grads)
            for name, a, b in zip(("dq", "dk", "dv"), first, grads):
                assert torch.equal(a, b), f"{name} differs between runs (section {section})"
    base = results[None]
    for section, grads in results.items():
        for name, a, b in zip(("dq", "dk", "dv"), base, grads):
            assert torch.equal(a, b), f"{name} differs between the default order and sections of {section}"
    ref, pt = _reference_dense((q, k, v), dict(kw, softcap=0.0), g, None)
    _check_grads(("dq", "dk", "dv"), base, ref, pt, (q, k, v), g)


def _same_bits_over_runs(run, runs: int, what: str):
    """``run()`` (-> dq, dk, dv) ``runs`` times: every result bit-identical to the first, which is returned."""
    first = run()
    for _ in range(runs - 1):
        for name, a, b in zip(("dq", "dk", "dv"), first, run()):
            assert torch.equal(a, b), f"{name} differs between runs ({what})"
    return first


def _deterministic_run(layout: str, d: int, mask: str, opts, dense_lens, varlen_lens, seed: int,
                       heads=(6, 2), batch: int = 2, **call_kw):
    """A deterministic forward + backward on GQA 6/2 inputs (``heads``), bf16: ``(run, (q, k, v), g,
    kw)`` with ``run() -> (dq, dk, dv)`` and ``kw`` the call's keyword arguments (``call_kw``, e.g.
    ``num_splits``, go to the call only). ``dense_lens``: (s_q, s_k) of a batch of ``batch``;
    ``varlen_lens``: (max s_q, max s_k) of 4 sequences with seqused_k."""
    h, hk = heads
    if layout == "dense":
        sq, sk = dense_lens
        kw = dict(causal=mask == "causal", window_size=_window(mask, sq, sk))
        q, k, v = random_qkv(batch, sq, sk, h, hk, d, torch.bfloat16, "cuda", requires_grad=True, seed=seed)
        call = fa4.flash_attn_func
    else:
        vb = random_varlen(4, varlen_lens[0], h, hk, d, torch.bfloat16, "cuda", max_seqlen_k=varlen_lens[1],
                           with_seqused_k=True, requires_grad=True, seed=seed)
        q, k, v = vb.q, vb.k, vb.v
        kw = dict(cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, seqused_k=vb.seqused_k,
                  max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, causal=mask == "causal",
                  window_size=_window(mask, vb.max_seqlen_q, vb.max_seqlen_k))
        call = fa4.flash_attn_varlen_func
    g = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def run():
        out, _ = call(q, k, v, deterministic=True, kernel_options=opts, **call_kw, **kw)
        return torch.autograd.grad(out, (q, k, v), g)
    return run, (q, k, v), g, kw


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_bwd_sm90_rotated_order(layout, monkeypatch, ordered_dq):
    """Note [Rotated order] (fa4/bwd/common.py): the sm90 deterministic backward without a mask,
    K blocks staggered over the m_blocks, is bit-exact over runs and correct, with GQA, and with
    sequences of several lengths (varlen + seqused_k: a stagger per sequence, some of them 0, the
    plain order); and so is the plain order (the rotation switched off), which adds in another order."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    opts = fa4.KernelOptions(arch="sm90")
    run, (q, k, v), g, _ = _deterministic_run(layout, 128, "none", opts, (2048, 1536), (1500, 1500),
                                              5 if layout == "dense" else 17)
    results = {}
    for rotate in (True, False):
        monkeypatch.setattr(sm90, "DET_ROTATE", rotate)
        fa4.ops._plans.clear()
        results[rotate] = _same_bits_over_runs(run, 5, f"rotated order {rotate}")
    fa4.ops._plans.clear()
    if layout == "dense":
        ref, pt = _reference_dense((q, k, v), dict(causal=False, window_size=(None, None), softcap=0.0), g, None)
        for grads in results.values():
            _check_grads(("dq", "dk", "dv"), grads, ref, pt, (q, k, v), g)
    else:  # against each other: the same sums in two orders
        for a, b in zip(results[True], results[False]):
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("det", [False, True, "up"])
def test_bwd_sm90_step_cursor_same_bits(d, mask, det, monkeypatch, hang_watchdog, ordered_dq):
    """``step_cursor`` (BwdSm90Config: no division by the GQA group per step) visits the same steps
    in the same order as the default, so the gradients are the same bits; varlen with seqused_k,
    GQA 6/2 (three q heads a step of the cursor walks), deterministic in the down and the up order."""
    import dataclasses

    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    if det == "up" and mask == "none":
        pytest.skip("the up order is for masked attention")
    opts = fa4.KernelOptions(arch="sm90")
    vb = random_varlen(4, 900, 6, 2, d, torch.bfloat16, "cuda", max_seqlen_k=1300, with_seqused_k=True,
                       requires_grad=True, seed=d + 3)
    kw = dict(cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, seqused_k=vb.seqused_k,
              max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, causal=mask == "causal",
              window_size=_window(mask, vb.max_seqlen_q, vb.max_seqlen_k), deterministic=bool(det))
    g = torch.randn(vb.q.shape, device="cuda", dtype=vb.q.dtype)
    monkeypatch.setattr(sm90, "DET_UP", det == "up")
    monkeypatch.setattr(sm90, "DET_UP_LOCAL", det == "up")
    make = sm90.make_config
    got = {}
    try:
        for cursor in (False, True):
            monkeypatch.setattr(sm90, "make_config", lambda *a, cursor=cursor, **k: dataclasses.replace(
                make(*a, **k), step_cursor=cursor and not make(*a, **k).det_rotate))
            fa4.ops._plans.clear()
            out, _ = fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, kernel_options=opts, **kw)
            got[cursor] = torch.autograd.grad(out, (vb.q, vb.k, vb.v), g)
    finally:
        monkeypatch.setattr(sm90, "make_config", make)
        fa4.ops._plans.clear()
    for name, a, b in zip(("dq", "dk", "dv"), got[False], got[True]):
        if det:
            assert torch.equal(a, b), f"{name} differs with step_cursor"
        else:  # the dQ adds race without determinism: the same sums in another order
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
            if name != "dq":
                assert torch.equal(a, b), f"{name} differs with step_cursor"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_bwd_sm90_causal_publish_lag_same_bits(d, layout, monkeypatch, hang_watchdog, ordered_dq):
    """Causal deterministic at s_k 4096 runs with the writer's peeked slot (Note [Publish peek],
    PUBLISH_PEEK in fa4/bwd/sm90.py, RESULTS v0.14): bit-exact over runs, the same bits as with the
    publish lag and with neither (the rule of v0.13 above DET_LAG_MAX_BLOCKS K blocks): all three
    move the publishes, not the order of the adds; and correct; GQA 6/2, dense, and varlen with
    seqused_k."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    opts = fa4.KernelOptions(arch="sm90")
    run, qkv, g, kw = _deterministic_run(layout, d, "causal", opts, (4096, 4096), (4096, 4096), seed=d + 17)
    got, modes = _publish_modes(run, monkeypatch, (None, dict(publish_peek=False, publish_lag=True),
                                                   dict(publish_peek=False, publish_lag=False)))
    assert modes[None] == (False, True), "the deterministic default should peek, without the lag"
    for mode, grads in got.items():
        for name, a, b in zip(("dq", "dk", "dv"), got[None], grads):
            assert torch.equal(a, b), f"{name} differs with {mode}"
    if layout == "dense":
        ref, pt = _reference_dense(qkv, dict(causal=True, window_size=(None, None), softcap=0.0), g, None)
        _check_grads(("dq", "dk", "dv"), got[None], ref, pt, qkv, g)


def _publish_modes(run, monkeypatch, modes):
    """``run()`` three times per mode of the sm90 dQ writer (None: the default; else config fields set
    on it), bit-exact over the runs: ``({mode key: grads}, {mode key: the default's (publish_lag,
    publish_peek)})``."""
    import dataclasses

    from fa4.bwd import sm90

    make = sm90.make_config
    got, defaults = {}, {}
    try:
        for mode in modes:
            key = None if mode is None else tuple(sorted(mode.items()))

            def patched(*a, mode=mode, key=key, **k):
                cfg = make(*a, **k)
                defaults[key] = (cfg.publish_lag, cfg.publish_peek)
                return cfg if mode is None else dataclasses.replace(cfg, **mode)
            monkeypatch.setattr(sm90, "make_config", patched)
            fa4.ops._plans.clear()
            got[key] = _same_bits_over_runs(run, 3, f"writer mode {key}")
    finally:
        monkeypatch.setattr(sm90, "make_config", make)
        fa4.ops._plans.clear()
    assert set(defaults) == set(got), "the patched make_config was not called for every mode"
    return got, defaults


def _assert_runs_equal(base, got: dict, what: str) -> None:
    """Every run's (dq, dk, dv) in ``got`` (``{mode: [grads per run]}``) bit-equal to ``base``."""
    for on, runs in got.items():
        for grads in runs:
            for name, a, b in zip(("dq", "dk", "dv"), base, grads):
                assert torch.equal(a, b), f"{name} differs ({what} {on})"


def _first_store_runs(run, monkeypatch, runs: int, det: bool):
    """``run()`` with the sm90 backward's first store on and off (Note [First store] in
    fa4/bwd/sm90.py, ``DQ_FIRST_STORE[det]``), ``runs`` times each: ``{first_store: [grads per
    run]}``, after checking that the patched default really took each mode."""
    from fa4.bwd import sm90

    make = sm90.make_config
    got, seen = {}, {}
    try:
        for on in (True, False):
            monkeypatch.setitem(sm90.DQ_FIRST_STORE, det, on)

            def spy(*a, on=on, **k):
                cfg = make(*a, **k)
                seen[on] = cfg.dq_first_store
                return cfg
            monkeypatch.setattr(sm90, "make_config", spy)
            fa4.ops._plans.clear()
            got[on] = [run() for _ in range(runs)]
    finally:
        monkeypatch.setattr(sm90, "make_config", make)
        fa4.ops._plans.clear()
    assert seen == {True: True, False: False}, f"first store not taken as asked: {seen}"
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_bwd_sm90_first_store_same_bits(d, mask, layout, monkeypatch, hang_watchdog):
    """Deterministic, the rank-0 contributor's stored tile equals its add into a zeroed accumulator
    (Note [First store]): the same bits with the first store on and off, over runs; GQA 6/2, dense
    (s_q 1024 < s_k 2048: the rows of the first m_blocks see few K blocks) and varlen with seqused_k
    (sequences of several lengths); the workspaces are NaN-filled (conftest), so a tile neither
    stored nor zeroed fails. Correct against the float32 reference too (dense)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    opts = fa4.KernelOptions(arch="sm90")
    run, qkv, g, kw = _deterministic_run(layout, d, mask, opts, (1024, 2048), (900, 1300), seed=d + 41)
    got = _first_store_runs(run, monkeypatch, 2, det=True)
    base = got[True][0]
    _assert_runs_equal(base, got, "first store")
    if layout == "dense":
        ref, pt = _reference_dense(qkv, dict(kw, softcap=0.0), g, None)
        _check_grads(("dq", "dk", "dv"), base, ref, pt, qkv, g)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("shape", ["wide", "rows_without_keys", "varlen"])
def test_bwd_sm90_first_store_claims(d, mask, shape, monkeypatch, hang_watchdog):
    """Not deterministic, with the first store (an option, DQ_FIRST_STORE[False]) each slot's first
    writer claims it and stores, the others add after the store (Note [First store]): correct against the float32 reference with the first store on and
    off, over repeated runs (a lost claim or an add before the store would show as a wrong or NaN
    dq: the accumulator is NaN-filled, conftest). ``wide``: 16 heads of s 2048, every K block of a
    pair starting at the same m_block without a mask (the claims contend); ``rows_without_keys``:
    s_q 700 > s_k 300, causal rows that see no key (their tiles never written, dq = 0 from the slot
    counter); ``varlen``: sequences of several lengths with seqused_k, GQA 6/2. ``wide`` walks the
    rotated order without a mask (CLAIM_ROTATE, an option), the others the plain one."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    monkeypatch.setattr(sm90, "CLAIM_ROTATE", shape == "wide")
    opts = fa4.KernelOptions(arch="sm90")
    if shape == "varlen":
        vb = random_varlen(4, 900, 6, 2, d, torch.bfloat16, "cuda", max_seqlen_k=1300, with_seqused_k=True,
                           requires_grad=True, seed=d + 5)
        q, k, v = vb.q, vb.k, vb.v
        kw = dict(cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, seqused_k=vb.seqused_k,
                  max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, causal=mask == "causal",
                  window_size=_window(mask, vb.max_seqlen_q, vb.max_seqlen_k))
        call = fa4.flash_attn_varlen_func
    else:
        b, sq, sk, h, hk = (2, 2048, 2048, 16, 16) if shape == "wide" else (2, 700, 300, 4, 2)
        q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", requires_grad=True, seed=d + 9)
        kw = dict(causal=mask == "causal", window_size=_window(mask, sq, sk))
        call = fa4.flash_attn_func
    g = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def run():
        out, _ = call(q, k, v, kernel_options=opts, **kw)
        return torch.autograd.grad(out, (q, k, v), g)

    got = _first_store_runs(run, monkeypatch, 3, det=False)
    if shape == "varlen":  # against the zeroed accumulator's gradients: the same sums in another order
        for grads in got[True]:
            for a, b in zip(got[False][0], grads):
                assert not b.isnan().any()
                torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
        return
    ref, pt = _reference_dense((q, k, v), dict(kw, softcap=0.0), g, None)
    for on, runs in got.items():
        for grads in runs:
            _check_grads(("dq", "dk", "dv"), grads, ref, pt, (q, k, v), g)
    if shape == "rows_without_keys" and mask == "causal":
        assert torch.equal(got[True][0][0][:, :400], torch.zeros_like(got[True][0][0][:, :400]))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "local"])
def test_bwd_sm90_publish_peek_same_bits(d, mask, monkeypatch, hang_watchdog, ordered_dq):
    """The peeked slot (Note [Publish peek], the default) in the rotated order (no mask, s_q 2048 /
    4096 against s_k 2048: staggers 1 to 4; d64 at s_q = s_k has stagger 1, where the lag would
    close a cycle) and under a local window (the plain order): bit-exact over runs, the same bits
    as with the publish lag (the default of v0.13 there); GQA 6/2."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    opts = fa4.KernelOptions(arch="sm90")
    for sq in (2048, 4096):
        run, _, _, _ = _deterministic_run("dense", d, mask, opts, (sq, 2048), (sq, 2048), seed=d + sq)
        got, modes = _publish_modes(run, monkeypatch, (None, dict(publish_peek=False, publish_lag=True)))
        assert modes[None] == (False, True), "the deterministic default should peek"
        base = got.pop(None)
        for mode, grads in got.items():
            for name, a, b in zip(("dq", "dk", "dv"), base, grads):
                assert torch.equal(a, b), f"{name} differs with {mode} (s_q {sq})"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_bwd_sm90_sequence_peek_same_bits(d, mask, layout, monkeypatch, hang_watchdog, ordered_dq):
    """The sequencing warp of the ordered direct adds with the peeked slot (``publish_peek`` with
    ``dq_direct``, :meth:`FlashBwdSm90.sequence_dq_peek`) and without it: bit-exact over runs, the
    same bits (the peek moves the counter reads, not the order of the adds), and correct; the
    rotated order (no mask, s_q 2048 / 4096 against s_k 2048: staggers 1 to 2), causal and local
    (the plain order, per-step slots), dense and varlen with seqused_k; GQA 6/2."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    opts = fa4.KernelOptions(arch="sm90")
    for sq in ((2048, 4096) if mask == "none" else (1500,)):
        sk = 2048 if mask == "none" else 1300
        run, qkv, g, kw = _deterministic_run(layout, d, mask, opts, (sq, sk), (sq, sk), seed=d + sq)
        got, modes = _publish_modes(run, monkeypatch, (dict(publish_peek=False), dict(publish_peek=True)))
        assert all(lag is False for lag, _ in modes.values()), "the ordered direct adds have no publish lag"
        off, on = got[(("publish_peek", False),)], got[(("publish_peek", True),)]
        for name, a, b in zip(("dq", "dk", "dv"), off, on):
            assert torch.equal(a, b), f"{name} differs with the sequencing warp's peek (s_q {sq})"
        if layout == "dense" and mask != "none":
            ref, pt = _reference_dense(qkv, dict(kw, softcap=0.0), g, None)
            _check_grads(("dq", "dk", "dv"), on, ref, pt, qkv, g)


@pytest.mark.gpu
@pytest.mark.parametrize("d,det", [(128, False), (128, True), (192, False), (192, True), (192, "ordered"),
                                   (256, False), (256, True), (256, "ordered")])
def test_bwd_sm90_empty_tiles_varlen(d, det):
    """Causal varlen with sequences whose queries outnumber their keys (forward tiles and
    backward rows that see no key) beside sequences with work, on more CTAs than SMs: found with
    wrong, run-to-run varying gradients at d192 / d256 in session 14, whose cause was the forward
    (Note [Empty tiles and o_in_q] in fa4/fwd/sm90.py). Three runs: dk and dv identical (dq too
    when deterministic), and the gradients under the pass rule. Deterministic at d192 / d256: the
    dQ pass (the default) and the ordered direct adds (``ordered``: ``bwd_dq_pass=False``)."""
    opts = fa4.KernelOptions(arch="sm90", bwd_dq_pass=False if det == "ordered" else None)
    det = bool(det)
    from fa4.testing import varlen_batch

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    lq, lk = [1, 840, 1451, 1500, 700, 2000], [1300, 949, 904, 1, 1500, 300]
    vb = varlen_batch(lq, lk, 6, 2, d, torch.bfloat16, "cuda", requires_grad=True, seed=d)
    gen = torch.Generator("cuda").manual_seed(d)
    var = dict(cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, causal=True)
    g = torch.randn(vb.q.shape, device="cuda", dtype=vb.q.dtype, generator=gen)
    runs = []
    for _ in range(3):
        out, _ = fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, max_seqlen_q=vb.max_seqlen_q,
                                            max_seqlen_k=vb.max_seqlen_k, deterministic=det,
                                            kernel_options=opts, **var)
        runs.append(_grads((out,), (vb.q, vb.k, vb.v), (g,)))
    for other in runs[1:]:
        for name, a, b in list(zip(("dq", "dk", "dv"), runs[0], other))[0 if det else 1:]:
            assert torch.equal(a, b), f"{name} differs between runs"
    q32 = _leaf32((vb.q, vb.k, vb.v))
    out_ref, _ = attention_ref(*q32, upcast=True, **var)
    ref = _grads((out_ref,), q32, (g.float(),))
    qlp = [t.detach().requires_grad_() for t in (vb.q, vb.k, vb.v)]
    out_pt, _ = attention_ref(*qlp, upcast=False, **var)
    pt = _grads((out_pt,), qlp, (g,))
    _check_grads(("dq", "dk", "dv"), runs[0], ref, pt, (vb.q, vb.k, vb.v), g)


@pytest.mark.gpu
@pytest.mark.parametrize("d,mask,heads,extra,batch", [
    (64, "causal", (6, 2), 0, "mixed"), (128, "causal", (4, 4), 0, "mixed"), (128, "none", (6, 2), 37, "mixed"),
    (256, "causal", (6, 2), 0, "mixed"),
    (128, "local", (8, 1), 129, "mixed"),  # (8, 1): the split rule's virtual kv heads; 129 packed rows past cu[-1]
    (96, "none", (3, 3), 0, "mixed"),  # three kv heads: sections of one head
    (128, "causal", (4, 2), 0, "many"),  # 45 sequences: the ballot's second load of 32
    (64, "none", (4, 2), 0, "seqused"),  # seqused_k: keys past it give dK = dV = 0
])
def test_bwd_sm90_compact_grid(d, mask, heads, extra, batch, monkeypatch):
    """Note [Compact varlen grid] (``compact_grid``): the backward on ``packed K rows // tile_n +
    batch`` slots per kv head gives dK / dV the default grid's bits (each K block's sums are its own
    CTA's, in the same order) and dQ within the pass rule, on sequences of 0 to 2000 keys (several
    in one tile, empty ones), with packed K rows past ``cu_seqlens_k[-1]`` (``extra``), 45 sequences
    (two ballot loads) and seqused_k, so no block is lost or run twice."""
    import dataclasses

    from fa4.bwd import sm90
    from fa4.testing import varlen_batch

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    h, hk = heads
    if batch == "many":
        gen = torch.Generator().manual_seed(d)
        lq = torch.randint(0, 300, (45,), generator=gen).tolist()
        lk = torch.randint(0, 300, (45,), generator=gen).tolist()
        lk[3], lq[7] = 0, 0
    else:
        lq, lk = [1, 840, 1451, 3, 700, 2000, 129, 64], [1300, 949, 1, 3, 1500, 2000, 130, 0]
    used = [min(n, u) for n, u in zip(lk, [700, 5, 1, 3, 1200, 2000, 1, 0])] if batch == "seqused" else None
    vb = varlen_batch(lq, lk, h, hk, d, torch.bfloat16, "cuda", seqused_k=used, requires_grad=False,
                      seed=d + extra)
    k, v = vb.k, vb.v
    if extra:  # packed K / V longer than the batch's keys (rows no sequence owns)
        k, v = (torch.cat([t, torch.randn(extra, *t.shape[1:], device="cuda", dtype=t.dtype)]) for t in (k, v))
    q, k, v = (t.detach().requires_grad_() for t in (vb.q, k, v))
    sq, sk = vb.max_seqlen_q, vb.max_seqlen_k
    var = dict(cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, causal=mask == "causal",
               window_size=(300, 0) if mask == "local" else (None, None))
    if used is not None:
        var["seqused_k"] = vb.seqused_k
    g = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=torch.Generator("cuda").manual_seed(d))
    make = sm90.make_config

    def grads(compact):
        monkeypatch.setattr(sm90, "make_config",
                            lambda *a, **kw: dataclasses.replace(make(*a, **kw), compact_grid=compact))
        fa4.ops._plans.clear()
        try:
            out, _ = fa4.flash_attn_varlen_func(q, k, v, max_seqlen_q=sq, max_seqlen_k=sk,
                                                kernel_options=fa4.KernelOptions(arch="sm90"), **var)
            got = _grads((out,), (q, k, v), (g,))
            cfgs = [c for (direction, *_), (_, c) in fa4.ops._plans.items() if direction == "bwd"]
            assert cfgs and all(c.compact_grid == compact for c in cfgs), cfgs
            return got
        finally:
            monkeypatch.setattr(sm90, "make_config", make)
            fa4.ops._plans.clear()

    compact, default = grads(True), grads(False)
    n = int(vb.cu_seqlens_k[-1])  # the keys the batch owns (the rows past them are no sequence's)
    for name, a, b in list(zip(("dq", "dk", "dv"), compact, default))[1:]:
        assert torch.equal(a[:n], b[:n]), f"{name} differs on the compact grid"
    q32 = _leaf32((q, k[:n], v[:n]))
    out_ref, _ = attention_ref(*q32, upcast=True, **var)
    ref = _grads((out_ref,), q32, (g.float(),))
    qlp = [t.detach().requires_grad_() for t in (q, k[:n], v[:n])]
    out_pt, _ = attention_ref(*qlp, upcast=False, **var)
    pt = _grads((out_pt,), qlp, (g,))
    _check_grads(("dq", "dk", "dv"), (compact[0], compact[1][:n], compact[2][:n]), ref, pt, (q, k[:n], v[:n]), g)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 1)])  # (8, 1): a group the split rule would split
@pytest.mark.parametrize("causal", [True, False])
def test_bwd_sm90_deterministic_batch_invariant(d, heads, causal, monkeypatch, hang_watchdog, ordered_dq):
    """A sample's deterministic gradients do not depend on the rest of its batch: every slot's adds
    come in the order of their K blocks (Note [Deterministic dQ]; the up order, Note [Up order], the
    causal default without GQA; the down order with GQA; the rotated order without a mask, in two
    rounds at d192, Note [Rotation rounds]), not in launch order, so the sections that a batch size brings do not change them. Sample 0 alone and in
    a batch of 5 (more pairs, more sections), and with sections of one pair: the same bits."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    h, hk = heads
    q, k, v = random_qkv(5, 1000, 1000, h, hk, d, torch.bfloat16, "cuda", seed=d + h)
    g = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    opts = fa4.KernelOptions(arch="sm90")

    def grads(b):
        qq, kk, vv = (t[:b].detach().clone().requires_grad_() for t in (q, k, v))
        out, _ = fa4.flash_attn_func(qq, kk, vv, causal=causal, deterministic=True, num_splits=1,
                                     kernel_options=opts)
        return torch.autograd.grad(out, (qq, kk, vv), g[:b])

    alone, batch = grads(1), grads(5)
    monkeypatch.setattr(sm90.LAUNCH_ORDER, "det_section", 1)
    fa4.ops._plans.clear()
    one_pair = grads(5)
    fa4.ops._plans.clear()
    for name, a, b, c in zip(("dq", "dk", "dv"), alone, batch, one_pair):
        assert torch.equal(a[0], b[0]), f"{name} of sample 0 depends on its batch"
        assert torch.equal(b, c), f"{name} depends on the launch sections"


@pytest.mark.gpu
@pytest.mark.parametrize("fam,d,causal,split", [("sm90", 128, True, 8), ("sm90", 64, False, 4),
                                                ("sm90", 256, True, 2), ("sm80", 128, True, 4),
                                                ("sm80", 64, False, 2)])
def test_bwd_deterministic_kv_split_option(fam, d, causal, split, hang_watchdog):
    """``KernelOptions(bwd_kv_split=...)`` with ``deterministic=True`` (an MQA backward a user wants
    deterministic and fast), both families: the same bits over runs, sample 0's bits alone and in a
    batch of 3 (the split is fixed, not read from the batch), dQ's bits as without the split, and
    the pass rule. sm90 d256 runs the dQ pass."""
    if fam == "sm90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    q, k, v = random_qkv(3, 1000, 1000, 8, 1, d, torch.bfloat16, "cuda", seed=d + split)
    g = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def grads(b, s):
        qq, kk, vv = (t[:b].detach().clone().requires_grad_() for t in (q, k, v))
        out, _ = fa4.flash_attn_func(qq, kk, vv, causal=causal, deterministic=True, num_splits=1,
                                     kernel_options=fa4.KernelOptions(arch=fam, bwd_kv_split=s))
        return torch.autograd.grad(out, (qq, kk, vv), g[:b])

    try:
        fa4.ops._plans.clear()
        batch = _same_bits_over_runs(lambda: grads(3, split), 3, f"bwd_kv_split={split}")
        # The option reached the kernel: the backward's plan has the split (and determinism, but under
        # the dQ pass at d256, whose main kernel is the non-deterministic one).
        cfgs = [cfg for (direction, *_), (_, cfg) in fa4.ops._plans.items() if direction == "bwd"]
        assert cfgs and all(c.kv_split == split and (c.deterministic or c.dq_pass) for c in cfgs), cfgs
        assert any(getattr(c, "dq_pass", False) for c in cfgs) == (fam == "sm90" and d == 256), cfgs
        alone, unsplit = grads(1, split), grads(3, 1)
    finally:
        fa4.ops._plans.clear()
    for name, a, b in zip(("dq", "dk", "dv"), alone, batch):
        assert torch.equal(a[0], b[0]), f"{name} of sample 0 depends on its batch"
    assert torch.equal(batch[0], unsplit[0]), "dq depends on the split"
    qkv = (q, k, v)
    ref, pt = _reference_dense(qkv, dict(causal=causal, window_size=(None, None), softcap=0.0), g, None)
    _check_grads(("dq", "dk", "dv"), batch, ref, pt, qkv, g)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["causal", "local"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_bwd_sm90_up_order(d, mask, layout, monkeypatch, hang_watchdog, ordered_dq):
    """Note [Up order] (fa4/bwd/common.py, ``DET_UP``): the deterministic backward with m_blocks
    walked up from the diagonal and the shortest K blocks launched first is bit-exact over runs,
    correct, and independent of the launch sections (one pair per section, and the default); GQA
    6/2, odd lengths, varlen with seqused_k; the writer warp (d64, d128) and the ordered direct adds
    (d256). A wrong rank hangs: the watchdog fails the run instead."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    opts = fa4.KernelOptions(arch="sm90")
    run, (q, k, v), g, kw = _deterministic_run(layout, d, mask, opts, (1000, 1500), (900, 1300),
                                               d + (0 if layout == "dense" else 1))
    monkeypatch.setattr(sm90, "DET_UP", True)
    monkeypatch.setattr(sm90, "DET_UP_LOCAL", True)
    fa4.ops._plans.clear()
    up = _same_bits_over_runs(run, 5, "up order")
    monkeypatch.setattr(sm90.LAUNCH_ORDER, "det_section", 1)
    fa4.ops._plans.clear()
    for name, a, b in zip(("dq", "dk", "dv"), up, run()):
        assert torch.equal(a, b), f"{name} depends on the launch sections in the up order"
    monkeypatch.setattr(sm90.LAUNCH_ORDER, "det_section", None)
    monkeypatch.setattr(sm90, "DET_UP", False)
    monkeypatch.setattr(sm90, "DET_UP_LOCAL", False)
    fa4.ops._plans.clear()
    down = run()
    fa4.ops._plans.clear()
    if layout == "dense":
        ref, pt = _reference_dense((q, k, v), dict(kw, softcap=0.0), g, None)
        _check_grads(("dq", "dk", "dv"), up, ref, pt, (q, k, v), g)
    for a, b in zip(up, down):  # the down order: the same sums in another order
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["causal", "local"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_bwd_sm90_down_tail(d, mask, layout, monkeypatch, hang_watchdog, ordered_dq):
    """Note [Down tail] (fa4/bwd/common.py, ``det_tail``): in the up order the last kv heads walk the
    down order and launch last. MHA with 4 heads, two each way (``det_tail_share`` 2): bit-exact
    over runs, the same bits with sections of one pair, sample 0 alone
    and in its batch the same bits, under the pass rule (dense), and the sums of the plain up order
    (another order of the same adds). The writer warp (d64, d128) and the ordered direct adds (d256);
    odd lengths, varlen with seqused_k. A wrong rank hangs: the watchdog fails the run instead."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    opts = fa4.KernelOptions(arch="sm90")
    seed = d + (0 if layout == "dense" else 1) + (0 if mask == "causal" else 2)
    # num_splits=1: the forward's split count follows the batch size (and so would out / lse).
    run, (q, k, v), g, kw = _deterministic_run(layout, d, mask, opts, (1000, 1300), (900, 1300), seed,
                                               heads=(4, 4), batch=3, num_splits=1)

    def alone():  # sample 0 of the dense batch on its own
        qq, kk, vv = (t[:1].detach().clone().requires_grad_() for t in (q, k, v))
        out, _ = fa4.flash_attn_func(qq, kk, vv, deterministic=True, kernel_options=opts, num_splits=1, **kw)
        return torch.autograd.grad(out, (qq, kk, vv), g[:1])

    monkeypatch.setattr(sm90, "DET_UP", True)
    monkeypatch.setattr(sm90, "DET_UP_LOCAL", True)
    monkeypatch.setattr(sm90, "DET_TAIL", 2)
    monkeypatch.setattr(sm90, "DET_TAIL_SHARE", 2)  # two of the four kv heads
    fa4.ops._plans.clear()
    problem = AttnProblem("bf16", 1, 1000, 1300, 4, 4, d, d, d**-0.5, causal=mask == "causal",
                          local=mask == "local", window_left=100, window_right=0)
    cfg = sm90.make_config(problem, None, "sm_90a", True)
    assert cfg.det_up and cfg.det_tail == 2
    tail = _same_bits_over_runs(run, 5, "down tail")
    if layout == "dense":
        for name, a, b in zip(("dq", "dk", "dv"), alone(), tail):
            assert torch.equal(a[0], b[0]), f"{name} of sample 0 depends on its batch (down tail)"
    monkeypatch.setattr(sm90.LAUNCH_ORDER, "det_section", 1)
    fa4.ops._plans.clear()
    for name, a, b in zip(("dq", "dk", "dv"), tail, run()):
        assert torch.equal(a, b), f"{name} depends on the launch sections (down tail)"
    monkeypatch.setattr(sm90.LAUNCH_ORDER, "det_section", None)
    monkeypatch.setattr(sm90, "DET_TAIL", 0)
    fa4.ops._plans.clear()
    up = run()
    fa4.ops._plans.clear()
    if layout == "dense":
        ref, pt = _reference_dense((q, k, v), dict(kw, softcap=0.0), g, None)
        _check_grads(("dq", "dk", "dv"), tail, ref, pt, (q, k, v), g)
    for a, b in zip(tail, up):  # the plain up order: the same sums, two heads in another order
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    # Only slots with three or more K blocks can change bits with the order (two adds commute), and
    # dq comes out in bf16, which hides most one-ulp float32 differences: the varlen batch has such
    # slots in one sequence only (its single causal query row), too few elements to show one.
    if layout == "dense":
        assert not torch.equal(tail[0], up[0]), "dq has the plain up order's bits: the tail walked no head down"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 192, 256])
@pytest.mark.parametrize("layout", ["dense", "square", "varlen"])
def test_bwd_sm90_rotation_rounds(d, layout, monkeypatch, hang_watchdog, ordered_dq):
    """Note [Rotation rounds] (fa4/bwd/common.py, ``det_rounds``): the rotated deterministic order
    in two rounds per pair (sections of two pairs) is bit-exact over runs and correct: the reference rule (dense) and the sums of
    one round (another order of the same adds); the writer warp (d128) and the ordered direct adds
    (d192, d256); GQA 6/2, odd lengths, varlen with seqused_k (rounds of a sequence's own K blocks).
    A wrong rank hangs: the watchdog fails the run instead."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    opts = fa4.KernelOptions(arch="sm90")
    # "square": s_q == s_k, so as many m_blocks as K blocks at 64 x 64 tiles (stagger 1 -> 2).
    lens = (1024, 1024) if layout == "square" else (1000, 1500)
    run, (q, k, v), g, kw = _deterministic_run("varlen" if layout == "varlen" else "dense", d, "none", opts, lens,
                                               (900, 1300), d + 9 + (0 if layout == "dense" else 1))
    monkeypatch.setattr(sm90, "DET_ROUNDS", {})
    fa4.ops._plans.clear()
    one = run()
    monkeypatch.setattr(sm90, "DET_ROUNDS", {d: 2})
    fa4.ops._plans.clear()
    problem = AttnProblem("bf16", 2, 1000, 1500, 6, 2, d, d, d**-0.5)
    assert sm90.make_config(problem, None, "sm_90a", True).det_rounds == 2
    rounds = _same_bits_over_runs(run, 3, "rotation rounds")
    fa4.ops._plans.clear()
    if layout != "varlen":
        ref, pt = _reference_dense((q, k, v), dict(kw, softcap=0.0), g, None)
        _check_grads(("dq", "dk", "dv"), rounds, ref, pt, (q, k, v), g)
    for a, b in zip(rounds, one):  # one round: the same sums in another order
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(rounds[0], one[0]), "dq has one round's bits: the rounds changed no order"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
@pytest.mark.parametrize("det", [False, True])
def test_bwd_sm90_dq_pass(d, mask, layout, det, monkeypatch, hang_watchdog, ordered_dq):
    """Note [dQ pass] (fa4/bwd/dq_sm90.py, ``dq_pass``): the main kernel computes dK and dV only and
    a second kernel dQ, queries stationary, without reductions. dK and dV have the default's bits;
    dQ passes the reference rule (dense) and matches the default's sums; deterministic runs give
    the same dQ bits every run; GQA 6/2, odd lengths, varlen with seqused_k. The head dims of the
    ordered direct adds (192, 256) and of the writer warp (64, 128; added after the H200 runs of v0.21,
    not yet run there)."""
    import dataclasses

    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    opts = fa4.KernelOptions(arch="sm90")
    run, (q, k, v), g, kw = _deterministic_run(layout, d, mask, opts, (1000, 777), (900, 1300),
                                               d + 29 + (0 if layout == "dense" else 1))
    call = fa4.flash_attn_func if layout == "dense" else fa4.flash_attn_varlen_func

    def grads():
        out, _ = call(q, k, v, kernel_options=opts, deterministic=det, **kw)
        return torch.autograd.grad(out, (q, k, v), g)

    fa4.ops._plans.clear()
    base = grads()
    make = sm90.make_config
    monkeypatch.setattr(sm90, "make_config", lambda *a, **k: dataclasses.replace(make(*a, **k), dq_pass=True,
                                                                                 dq_first_store=False))
    fa4.ops._plans.clear()
    try:
        passed = _same_bits_over_runs(grads, 3, "dq_pass") if det else grads()
    finally:
        fa4.ops._plans.clear()
    for name, a, b in list(zip(("dq", "dk", "dv"), passed, base))[1:]:
        assert torch.equal(a, b), f"{name} differs from the default's bits with dq_pass"
    torch.testing.assert_close(passed[0].float(), base[0].float(), atol=2e-2, rtol=2e-2)
    if layout == "dense":
        ref, pt = _reference_dense((q, k, v), dict(kw, softcap=0.0), g, None)
        _check_grads(("dq", "dk", "dv"), passed, ref, pt, (q, k, v), g)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(160, 160), (192, 192), (224, 224), (256, 256), (192, 128)])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_bwd_sm90_dq_pass_default(dims, mask, softcap, hang_watchdog):
    """The dQ pass as the default (``DQ_PASS_MIN_HD``: from padded head dim 160, deterministic or
    without a mask; ``DQ_PASS_MASKED_MIN_HD``: from 224 with a mask too): deterministic=True runs the same kernels as
    ``KernelOptions(bwd_dq_pass=True)`` without it, so the two give the same bits; 20 deterministic
    runs are bit-exact (GQA 6/2, odd lengths, s_q != s_k); the gradients pass the reference rule;
    softcap and (192, 128)."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    d, dv = dims
    sq, sk = 1000, 777
    kw = dict(causal=mask == "causal", window_size=_window(mask, sq, sk), softcap=softcap)
    q, k, _ = random_qkv(2, sq, sk, 6, 2, d, torch.bfloat16, "cuda", seed=d + dv + int(softcap))
    v = torch.randn(2, sk, 2, dv, dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    g = torch.randn(2, sq, 6, dv, dtype=torch.bfloat16, device="cuda")
    left, right = kw["window_size"]
    problem = AttnProblem("bf16", 2, sq, sk, 6, 2, d, dv, d**-0.5, causal=kw["causal"], local=mask == "local",
                          window_left=left or 0, window_right=right or 0)
    assert sm90.make_config(problem, None, "sm_90a", True).dq_pass
    assert sm90.make_config(problem, None, "sm_90a", False).dq_pass == (mask == "none" or d >= 224)

    def grads(det, **opts):
        out, _ = fa4.flash_attn_func(q, k, v, deterministic=det,
                                     kernel_options=fa4.KernelOptions(arch="sm90", **opts), **kw)
        return torch.autograd.grad(out, (q, k, v), g)

    det = _same_bits_over_runs(lambda: grads(True), 20 if d == 256 and mask == "causal" else 3, "dq_pass default")
    for name, a, b in zip(("dq", "dk", "dv"), det, grads(False, bwd_dq_pass=True)):
        assert torch.equal(a, b), f"{name}: deterministic=True and the dQ pass without it differ"
    ref, pt = _reference_dense((q, k, v), kw, g, None)
    _check_grads(("dq", "dk", "dv"), det, ref, pt, (q, k, v), g)


def _dq_errors(d, causal, scale, runs):
    """dq's max and mean |error| against the float32 reference for each ``runs`` entry (name ->
    function of (q, k, v) giving the output), on GQA 6/2 bf16 inputs with s_q 1000 / s_k 777 (q
    scaled by ``scale``: 3 gives peaked softmaxes), with bf16's ulp at dq's magnitude."""
    q, k, v = random_qkv(2, 1000, 777, 6, 2, d, torch.bfloat16, "cuda", seed=d + int(causal))
    q = (q.float() * scale).bfloat16()
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    g = torch.randn(2, 1000, 6, d, dtype=torch.bfloat16, device="cuda")
    q32 = _leaf32((q, k, v))
    ref = torch.autograd.grad(attention_ref(*q32, causal=causal)[0], q32[0], g.float())[0]
    out = {}
    for name, fn in runs.items():
        (dq,) = torch.autograd.grad(fn(q, k, v), q, g)
        err = (dq.float() - ref).abs()
        out[name] = (err.max().item(), err.mean().item())
    ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().max())).item() - 7)
    return out, ulp


@pytest.mark.gpu
@pytest.mark.parametrize("d", [160, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_bwd_sm90_dq_pass_error_not_larger(d, causal, scale):
    """The dQ pass (a speed technique, the default from head dim 160) may not make dq's error against
    the float32 reference larger than the main kernel's dQ (``bwd_dq_pass=False``) beyond noise:
    max within 1.1x plus a quarter of a bf16 ulp of dq's magnitude, mean within 1.1x."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")

    def fa4_run(dq_pass):
        opts = fa4.KernelOptions(arch="sm90", bwd_dq_pass=dq_pass)
        return lambda q, k, v: fa4.flash_attn_func(q, k, v, causal=causal, kernel_options=opts)[0]
    errs, ulp = _dq_errors(d, causal, scale, {"pass": fa4_run(True), "main": fa4_run(False)})
    assert errs["pass"][0] <= 1.1 * errs["main"][0] + 0.25 * ulp, errs
    assert errs["pass"][1] <= 1.1 * errs["main"][1], errs


@pytest.mark.gpu
@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_sm90_dq_pass_error_vs_flash_attn_4(d, causal):
    """The dQ pass's dq error against the float32 reference is not larger than flash-attn-4's on the
    same inputs (max within 1.1x plus a quarter ulp, mean within 1.1x). Needs flash-attn-4 installed
    (the device pack's --with-peer)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    peer = pytest.importorskip("flash_attn.cute").flash_attn_func

    def peer_run(q, k, v):
        out = peer(q, k, v, causal=causal)
        return out[0] if isinstance(out, tuple) else out
    opts = fa4.KernelOptions(arch="sm90", bwd_dq_pass=True)
    errs, ulp = _dq_errors(d, causal, 1.0, {
        "pass": lambda q, k, v: fa4.flash_attn_func(q, k, v, causal=causal, kernel_options=opts)[0],
        "flash-attn-4": peer_run})
    assert errs["pass"][0] <= 1.1 * errs["flash-attn-4"][0] + 0.25 * ulp, errs
    assert errs["pass"][1] <= 1.1 * errs["flash-attn-4"][1], errs


@pytest.mark.gpu
@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_bwd_sm90_ordered_direct_dq(d, mask, layout, monkeypatch, ordered_dq):
    """Note [Ordered direct dQ] (fa4/bwd/sm90.py): the deterministic backward of the head dims that
    add dQ from registers is bit-exact over runs, gives the same bits as the ordered writer warp
    (``DET_DIRECT`` off: the same adds in the same order), and is correct; GQA, odd lengths, many K
    blocks per dQ slot, and a launch order of one section per pair."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    opts = fa4.KernelOptions(arch="sm90")
    run, (q, k, v), g, kw = _deterministic_run(layout, d, mask, opts, (1000, 1500), (900, 1300),
                                               d if layout == "dense" else d + 1)
    results = {}
    for direct in (True, False):
        monkeypatch.setattr(sm90, "DET_DIRECT", direct)
        fa4.ops._plans.clear()
        results[direct] = _same_bits_over_runs(run, 5, f"ordered direct adds {direct}")
    monkeypatch.setattr(sm90, "DET_DIRECT", True)
    monkeypatch.setattr(sm90.LAUNCH_ORDER, "det_section", 1)
    fa4.ops._plans.clear()
    for name, a, b, c in zip(("dq", "dk", "dv"), results[True], results[False], run()):
        assert torch.equal(a, b), f"{name}: the ordered direct adds and the writer warp differ"
        assert torch.equal(a, c), f"{name} depends on the launch order"
    fa4.ops._plans.clear()
    if layout == "dense":
        ref, pt = _reference_dense((q, k, v), dict(kw, softcap=0.0), g, None)
        _check_grads(("dq", "dk", "dv"), results[True], ref, pt, (q, k, v), g)
    else:
        dense = torch.autograd.grad(
            fa4.flash_attn_varlen_func(q, k, v, kernel_options=opts, **kw)[0], (q, k, v), g)
        for a, b in zip(results[True], dense):  # against the non-deterministic sums (another order)
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("early", [1, 2])
@pytest.mark.parametrize("d,mask,det", [(128, "none", False), (128, "causal", True), (256, "local", False),
                                        (96, "causal", False), (64, "none", False), (64, "causal", True)])
def test_bwd_sm90_stats_early_same_bits(early, d, mask, det, monkeypatch):
    """``stats_early`` (BwdSm90Config) moves only where lse / dpsum are read into registers: the
    gradients are the same bits as with ``stats_early=0`` (deterministic, or one run each of the
    non-deterministic kernel on inputs whose dQ sums in a fixed order: one K block per query row)."""
    import dataclasses

    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    opts = fa4.KernelOptions(arch="sm90")
    sq, sk = (700, 1100) if det else (300, 113)
    kw = dict(causal=mask == "causal", window_size=_window(mask, sq, sk))
    q, k, v = random_qkv(2, sq, sk, 6, 2, d, torch.bfloat16, "cuda", requires_grad=True, seed=early + d)
    g = torch.randn_like(q)

    def run():
        out, _ = fa4.flash_attn_func(q, k, v, deterministic=det, kernel_options=opts, **kw)
        return torch.autograd.grad(out, (q, k, v), g)
    make = sm90.make_config
    got = {}
    try:
        for level in (0, early):
            monkeypatch.setattr(sm90, "make_config",
                                lambda *a, level=level, **k: dataclasses.replace(make(*a, **k), stats_early=level))
            fa4.ops._plans.clear()
            got[level] = run()
    finally:
        monkeypatch.setattr(sm90, "make_config", make)
        fa4.ops._plans.clear()
    for name, a, b in zip(("dq", "dk", "dv"), got[0], got[early]):
        assert not torch.isnan(b).any(), f"{name}: NaN with stats_early={early}"
        assert torch.equal(a, b), f"{name}: stats_early={early} differs from stats_early=0"


@pytest.mark.gpu
@pytest.mark.parametrize("d,mask,frac,softcap,scale", [
    (64, "causal", None, 0.0, 1.0),   # the default (BWD_EXP2_EMU_FRAC)
    (64, "causal", None, 0.0, 3.0),   # peaked softmax
    (64, "none", None, 0.0, 1.0),     # the d64 default without a mask
    (32, "none", None, 0.0, 1.0),     # the d32 default: half of the exponentials
    (32, "none", None, 30.0, 3.0),   # ... with softcap, peaked
    (64, "causal", 0.5, 30.0, 1.0),   # lse read per column, half emulated, softcap
    (128, "none", 0.25, 0.0, 1.0),    # 64-row steps: lse in registers
    (128, "local", 1.0, 0.0, 3.0),    # every exponential emulated
])
def test_bwd_sm90_exp2_emulation_accuracy(d, mask, frac, softcap, scale):
    """Issue 7 / 8's rule for a speed technique: the backward with exp2 emulation (Note [exp2
    emulation]) passes the reference rule, and its error against the float32 reference is not larger
    than the same kernel's with every exponential on MUFU (bwd_exp2_emu_frac=0), beyond noise
    (1.1x plus the cancellation floor and a quarter of a bf16 ulp), for dq, dk and dv; the two runs
    differ in some bit (the emulation ran). GQA 6/2, odd lengths."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    sq, sk = 1000, 777
    kw = dict(causal=mask == "causal", window_size=_window(mask, sq, sk), softcap=softcap)
    q, k, v = random_qkv(2, sq, sk, 6, 2, d, torch.bfloat16, "cuda", requires_grad=False, seed=d + int(scale))
    q = (q.float() * scale).to(q.dtype)  # larger scores: a peaked softmax
    qkv = [t.detach().requires_grad_() for t in (q, k, v)]
    g = torch.randn(2, sq, 6, d, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for f in (0.0, frac):
        opts = fa4.KernelOptions(arch="sm90", bwd_dq_pass=False, bwd_exp2_emu_frac=f)
        out, _ = fa4.flash_attn_func(*qkv, kernel_options=opts, **kw)
        grads[f] = _grads((out,), qkv, (g,))
    from fa4 import validate
    from fa4.bwd import sm90

    cfg = sm90.make_config(
        validate.check_dense(q, k, v, None, kw["causal"], kw["window_size"], softcap),
        fa4.KernelOptions(bwd_exp2_emu_frac=frac), "sm_90a")
    assert cfg.exp2_emu_frac == (sm90.BWD_EXP2_EMU_FRAC[((d + 31) // 32 * 32, mask)] if frac is None else frac)
    # The emulated columns ran: their P differs from MUFU's in low bits, which reach some gradient.
    assert any(not torch.equal(a, b) for a, b in zip(grads[0.0], grads[frac])), "no bit differs: no emulation ran"
    ref, pt = _reference_dense(qkv, kw, g, None)
    _check_grads(("dq", "dk", "dv"), grads[frac], ref, pt, qkv, g)
    floors = grad_noise_floor(*qkv, g)
    for name, off, emu, r in zip(("dq", "dk", "dv"), grads[0.0], grads[frac], ref):
        e_off = (off.float() - r).abs().max().item()
        e_emu = (emu.float() - r).abs().max().item()
        # Noise: the cancellation floor and a quarter of a bf16 ulp of the gradient's magnitude (the
        # maximum errors sit on ulp steps), as the forward's rescale test allows.
        ulp = 2.0 ** (torch.floor(torch.log2(r.abs().max())).item() - 7)
        assert e_emu <= 1.1 * e_off + floors[name] + 0.25 * ulp, (
            f"{name}: error {e_emu:.3e} with emulation, {e_off:.3e} without")


@pytest.mark.gpu
@pytest.mark.parametrize("d,sq,sk,lane_slots", [(128, 1024, 2048, False), (128, 1000, 2000, False),
                                               (64, 1024, 1024, False), (64, 2048, 2048, True)])
def test_bwd_sm90_rotated_stagger_one(d, sq, sk, lane_slots, monkeypatch, hang_watchdog, ordered_dq):
    """Note [Publish lag] (fa4/bwd/sm90.py): the rotated deterministic order with as many m_blocks as
    K blocks and no GQA (stagger 1), where the writer's held-back publish closed a cycle and the
    kernel hung (d128 with s_q = s_k / 2; d64's 128-row steps at s_q = s_k, the hung v0.11 sweep;
    both defaults now). It finishes (a hang fails through the watchdog), bit-exact over runs and
    correct; at d64 also with the lane slots, which its default does not take."""
    import dataclasses

    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog(240)
    if lane_slots:
        make = sm90.make_config

        def with_lanes(problem, options, arch, deterministic=False, **kw):
            cfg = make(problem, options, arch, deterministic, **kw)
            return dataclasses.replace(cfg, lane_slots=True) if cfg.det_rotate else cfg
        monkeypatch.setattr(sm90, "make_config", with_lanes)
    fa4.ops._plans.clear()
    opts = fa4.KernelOptions(arch="sm90")
    q, k, v = random_qkv(2, sq, sk, 3, 3, d, torch.bfloat16, "cuda", requires_grad=True, seed=sq + d)
    g = torch.randn_like(q)

    def run():
        out, _ = fa4.flash_attn_func(q, k, v, deterministic=True, kernel_options=opts)
        return torch.autograd.grad(out, (q, k, v), g)
    try:
        grads = _same_bits_over_runs(run, 3, "stagger 1")
    finally:
        fa4.ops._plans.clear()
    ref, pt = _reference_dense((q, k, v), dict(causal=False, window_size=(None, None), softcap=0.0), g, None)
    _check_grads(("dq", "dk", "dv"), grads, ref, pt, (q, k, v), g)


@pytest.mark.gpu
@pytest.mark.parametrize("d,mask,layout", [(128, "none", "dense"), (128, "causal", "dense"), (128, "none", "varlen"),
                                           (64, "local", "varlen"), (256, "causal", "dense"), (256, "none", "varlen")])
def test_bwd_sm90_lane_slots_same_bits(d, mask, layout, monkeypatch, ordered_dq):
    """Note [Writer slots] (fa4/bwd/sm90.py): the deterministic writer (and, at d256, the sequencing
    warp of the ordered direct adds) reading its steps' slots from 32 lanes at once gives the same
    bits as computing each step's slot in turn. The steps span several 32-step batches (GQA groups
    of 3, up to 2048 rows), so the refresh and the clamp past the last step both run; the rotated
    order (no mask), causal, local and varlen orders all take part."""
    import dataclasses

    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    opts = fa4.KernelOptions(arch="sm90")
    run, *_ = _deterministic_run(layout, d, mask, opts, (2048, 1536), (1500, 1100), d + 7)
    make = sm90.make_config
    got = {}
    try:
        for lanes in (False, True):
            monkeypatch.setattr(sm90, "make_config",
                                lambda *a, lanes=lanes, **k: dataclasses.replace(make(*a, **k), lane_slots=lanes))
            fa4.ops._plans.clear()
            got[lanes] = _same_bits_over_runs(run, 3, f"lane_slots {lanes}")
    finally:
        monkeypatch.setattr(sm90, "make_config", make)
        fa4.ops._plans.clear()
    for name, a, b in zip(("dq", "dk", "dv"), got[False], got[True]):
        assert not torch.isnan(b).any(), f"{name}: NaN with the lane slots"
        assert torch.equal(a, b), f"{name}: the lane slots differ from the per-step slots"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_sm90_ordered_direct_dq_many_ctas(causal, monkeypatch, ordered_dq):
    """The ordered direct dQ adds on a grid of 512 CTAs at d256, several times what the GPU holds at
    once (later CTAs wait on CTAs that have finished or still run): bit-exact over runs and the same
    bits as the ordered writer warp."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    opts = fa4.KernelOptions(arch="sm90")
    q, k, v = random_qkv(4, 2048, 2048, 8, 4, 256, torch.bfloat16, "cuda", requires_grad=True, seed=19)
    g = torch.randn_like(q)

    def run():
        out, _ = fa4.flash_attn_func(q, k, v, causal=causal, deterministic=True, kernel_options=opts)
        return torch.autograd.grad(out, (q, k, v), g)
    results = {}
    for direct in (True, False):
        monkeypatch.setattr(sm90, "DET_DIRECT", direct)
        fa4.ops._plans.clear()
        results[direct] = _same_bits_over_runs(run, 3, f"ordered direct adds {direct}")
    fa4.ops._plans.clear()
    for name, a, b in zip(("dq", "dk", "dv"), results[True], results[False]):
        assert torch.equal(a, b), f"{name}: the ordered direct adds and the writer warp differ"


@pytest.mark.gpu
@pytest.mark.parametrize("d, fields", [
    # The 80-row experiment (refused by make_config; measured slower than the default, 580 vs 598
    # TFLOP/s at d128 s8k) gave NaN gradients until the postprocess limited its gmem writes to the
    # tile (RESULTS v0.7, GPU-confirmed in v0.8).
    (128, dict(tile_m=80, dq_stages=1, ds_from_p16=True)),
    (128, dict(ds_from_p16=True)),
    # d64's 128-row steps with dS from the 16-bit P (the d64 default until v0.13, which issues the dV
    # wgmma after dS^T instead); dv_late at d128; no per-step division by the GQA group (step_cursor, v0.12).
    (64, dict(ds_from_p16=True, dv_late=False)),
    (128, dict(dv_late=True)),
    (128, dict(step_cursor=True)),
])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_sm90_experiments(d, fields, causal, monkeypatch):
    """The sm90 backward's experiments (BwdSm90Config docstring: dS from the 16-bit P, the d64
    default before v0.13; 80-row steps with the swapped dQ wgmma; dV issued late at d128;
    step_cursor), which no default uses: correct under the pass rule, odd sizes."""
    import dataclasses

    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    make = sm90.make_config
    monkeypatch.setattr(sm90, "make_config", lambda *a, **k: dataclasses.replace(make(*a, **k), **fields))
    fa4.ops._plans.clear()
    try:
        q, k, v = random_qkv(2, 1000, 777, 6, 2, d, torch.bfloat16, "cuda", requires_grad=True, seed=21)
        out, _ = fa4.flash_attn_func(q, k, v, causal=causal, kernel_options=fa4.KernelOptions(arch="sm90"))
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
    finally:
        fa4.ops._plans.clear()
    ref, pt = _reference_dense((q, k, v), dict(causal=causal, window_size=(None, None), softcap=0.0), g, None)
    _check_grads(("dq", "dk", "dv"), grads, ref, pt, (q, k, v), g)


@pytest.mark.gpu
def test_bwd_unused_kv_rows_may_hold_nan(family_2cta):
    """K/V rows past ``seqused_k`` (an uninitialized KV cache) must not reach any gradient, even as
    NaN: P is 0 there, but dP = dO V^T and dQ = dS K multiply them (Note [K/V rows past seqused_k]
    in fa4/bwd/sm90.py; the sm80 kernel zero-fills them in smem)."""
    lens_q, used = [200, 37, 129], [1, 150, 299]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(17)
    q = torch.randn(sum(lens_q), 4, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(900, 2, 128, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(900, 2, 128, device=dev, dtype=torch.bfloat16, generator=g)
    for b, n in enumerate(used):
        k[300 * b + n: 300 * (b + 1)] = float("nan")
        v[300 * b + n: 300 * (b + 1)] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    var = dict(cu_seqlens_q=torch.tensor([0, 200, 237, 366], dtype=torch.int32, device=dev),
               cu_seqlens_k=torch.tensor([0, 300, 600, 900], dtype=torch.int32, device=dev),
               seqused_k=torch.tensor(used, dtype=torch.int32, device=dev))
    out, _ = fa4.flash_attn_varlen_func(q, k, v, max_seqlen_q=200, max_seqlen_k=300, causal=True,
                                        kernel_options=_opts(family_2cta), **var)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert not dq.isnan().any(), "NaN from unused K/V rows reached dq"
    for b, n in enumerate(used):  # rows a sequence owns but does not use get zero gradients
        rows = slice(300 * b, 300 * b + n)
        assert not dk[rows].isnan().any() and not dv[rows].isnan().any()
        assert torch.equal(dk[300 * b + n: 300 * (b + 1)], torch.zeros_like(dk[300 * b + n: 300 * (b + 1)]))
    # Against the reference on the used rows (NaN replaced: the reference multiplies them too).
    k0, v0 = (torch.nan_to_num(t.detach()) for t in (k, v))
    q32 = _leaf32((q, k0, v0))
    out_ref, _ = attention_ref(*q32, upcast=True, causal=True, **var)
    ref = _grads((out_ref,), q32, (dout.float(),))
    qlp = [t.detach().requires_grad_() for t in (q, k0, v0)]
    out_pt, _ = attention_ref(*qlp, upcast=False, causal=True, **var)
    pt = _grads((out_pt,), qlp, (dout,))
    _check_grads(("dq", "dk", "dv"), (dq, torch.nan_to_num(dk), torch.nan_to_num(dv)), ref, pt, (q, k0, v0), dout)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_long_sequence(family_2cta, causal):
    """One long sequence (8192 x 8192): many K blocks add into every dQ tile, many Q steps per CTA."""
    case = dict(d=128, seqlens=(8192, 8192), mask="causal" if causal else "none", heads="gqa", softcap=0.0,
                dtype=torch.bfloat16)
    sq, sk = case["seqlens"]
    h, hk = HEADS["gqa"]
    kw = dict(causal=causal, window_size=(None, None), softcap=0.0)
    q, k, v = random_qkv(1, sq, sk, h, hk, 128, torch.bfloat16, "cuda", requires_grad=True, seed=29)
    out, _ = fa4.flash_attn_func(q, k, v, kernel_options=_opts(family_2cta), causal=causal)
    g = torch.randn_like(out)
    grads = _grads((out,), (q, k, v), (g,))
    ref, pt = _reference_dense((q, k, v), kw, g, None)
    _check_grads(("dq", "dk", "dv"), grads, ref, pt, (q, k, v), g)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_bwd_sm90_tile_m_128(d):
    """The sm90 backward with 128-row Q steps (the dQ warpgroups along the rows)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    q, k, v = random_qkv(2, 333, 517, 4, 2, d, torch.float16, "cuda", requires_grad=True, seed=3)
    opts = fa4.KernelOptions(arch="sm90", bwd_tile_m=128)
    if d > 64:  # a tile the shared memory cannot hold is refused by name at the forward, before any launch
        with pytest.raises(ValueError, match="bwd_tile_m=128"):
            fa4.flash_attn_func(q, k, v, causal=True, kernel_options=opts)
        return
    out, _ = fa4.flash_attn_func(q, k, v, causal=True, kernel_options=opts)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref, pt = _reference_dense((q, k, v), dict(causal=True, window_size=(None, None), softcap=0.0), g, None)
    _check_grads(("dq", "dk", "dv"), grads, ref, pt, (q, k, v), g)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [dict(bwd_tile_m=128, bwd_tile_n=64, bwd_num_threads=128), dict(bwd_tile_n=64)])
def test_bwd_sm80_tile_options(opts):
    """Non-default tiles through KernelOptions still give correct gradients."""
    q, k, v = random_qkv(2, 333, 517, 4, 2, 64, torch.float16, "cuda", requires_grad=True, seed=3)
    out, _ = fa4.flash_attn_func(q, k, v, causal=True, kernel_options=fa4.KernelOptions(arch="sm80", **opts))
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref, pt = _reference_dense((q, k, v), dict(causal=True, window_size=(None, None), softcap=0.0), g, None)
    _check_grads(("dq", "dk", "dv"), grads, ref, pt, (q, k, v), g)


def test_pairwise_covers_all_pairs():
    """(CPU) The pruned grid really covers every pair of factor values."""
    names = list(FACTORS)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for va in FACTORS[a]:
                for vb in FACTORS[b]:
                    assert any(c[a] == va and c[b] == vb for c in CASES), (a, va, b, vb)
    assert len(CASES) <= 40, len(CASES)


def _pdl_mode(monkeypatch, on: bool, seen: dict, post: bool = True):
    """The sm90 backward with its programmatic dependent launches on or off (``sm90.PDL``, Note
    [Programmatic dependent launch] in fa4/bwd/sm90.py; ``post`` off: the main kernel alone, the
    postprocess a plain launch); ``seen[on]`` records what make_config gave."""
    import dataclasses

    from fa4.bwd import sm90

    make = sm90.__dict__.get("_make_unpatched", sm90.make_config)
    monkeypatch.setattr(sm90, "_make_unpatched", make, raising=False)
    monkeypatch.setattr(sm90, "PDL", on)
    monkeypatch.setattr(sm90, "PDL_MAX_SEQLEN_K", 1 << 30)  # (every length, whatever the default's bound)

    def spy(*a, **k):
        cfg = make(*a, **k)
        if not post:
            cfg = dataclasses.replace(cfg, pdl_post=False)
        seen[on] = cfg.pdl
        return cfg
    monkeypatch.setattr(sm90, "make_config", spy)
    fa4.ops._plans.clear()


PDL_CASES = CASES + [dict(c, family="sm90-2cta") for c in TWO_CTA_CASES[::4]]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PDL_CASES, ids=[_case_id(c) + ("-2cta" if "family" in c else "") for c in PDL_CASES])
def test_bwd_sm90_pdl(case, monkeypatch):
    """The covering array (and some two-CTA cases) with the main kernel and the postprocess launched as
    programmatic dependents: a read of lse_log2 / dpsum / dq_accum before the preprocess finished
    would read the NaN-filled workspaces (conftest) or a half-written accumulator."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    seen = {}
    _pdl_mode(monkeypatch, True, seen)
    try:
        _check_case(case, _opts(case.get("family", "sm90")))
    finally:
        fa4.ops._plans.clear()
    assert seen.get(True) is True, "the backward did not take pdl"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES[::3], ids=[_case_id(c) for c in CASES[::3]])
def test_bwd_sm90_pdl_main_only(case, monkeypatch):
    """``pdl_post`` off (flash-attn-4's form: the main kernel a programmatic dependent of the
    preprocess, the postprocess a plain launch): a third of the covering array against the reference."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    seen = {}
    _pdl_mode(monkeypatch, True, seen, post=False)
    try:
        _check_case(case, _opts("sm90"))
    finally:
        fa4.ops._plans.clear()
    assert seen.get(True) is True, "the backward did not take pdl"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["none", "causal", "local"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_bwd_sm90_pdl_same_bits(d, mask, layout, monkeypatch, hang_watchdog, ordered_dq):
    """Deterministic, the programmatic dependent launches change no bit: three runs each way, equal
    (d64 / d128: the writer warp; d256: the ordered direct adds and their sequencing warp, the main
    kernel's dQ: ``ordered_dq``), and correct against the float32 reference (dense). (GQA 6/2 here
    keeps one CTA per kv head; a split group's NaN-filled partials put a kernel between the preprocess
    and the main kernel, so that overlap is not exercised by split cases.)"""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    opts = fa4.KernelOptions(arch="sm90")
    run, qkv, g, kw = _deterministic_run(layout, d, mask, opts, (1024, 2048), (900, 1300), seed=d + 73)
    got, seen = {}, {}
    try:
        for on in (True, False):
            _pdl_mode(monkeypatch, on, seen)
            got[on] = [run() for _ in range(3)]
    finally:
        fa4.ops._plans.clear()
    assert seen == {True: True, False: False}, f"pdl not taken as asked: {seen}"
    _assert_runs_equal(got[False][0], got, "pdl")
    if layout == "dense":
        ref, pt = _reference_dense(qkv, dict(kw, softcap=0.0), g, None)
        _check_grads(("dq", "dk", "dv"), got[True][0], ref, pt, qkv, g)


@pytest.mark.gpu
def test_bwd_sm90_pdl_repeated_calls(monkeypatch, hang_watchdog):
    """Twenty forward + backward calls queued without a host sync, deterministic, with the launches
    on: every dq / dk / dv equals one call's with them off (a kernel that read before its predecessor
    finished would differ in some call, the timing of each launch varying with the queue)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    q, k, v = random_qkv(2, 333, 1111, 6, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=5)
    g = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def run():
        out, _ = fa4.flash_attn_func(q, k, v, causal=True, deterministic=True,
                                     kernel_options=fa4.KernelOptions(arch="sm90"))
        return torch.autograd.grad(out, (q, k, v), g)
    seen = {}
    try:
        _pdl_mode(monkeypatch, False, seen)
        base = run()
        _pdl_mode(monkeypatch, True, seen)
        runs = [run() for _ in range(20)]
        torch.cuda.synchronize()
    finally:
        fa4.ops._plans.clear()
    assert seen == {True: True, False: False}
    for i, grads in enumerate(runs):
        for name, a, b in zip(("dq", "dk", "dv"), base, grads):
            assert torch.equal(a, b), f"{name} of call {i} with pdl differs from the call without"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_bwd_sm90_pdl_first_store_claims(d, mask, monkeypatch, hang_watchdog):
    """The first-store claims without determinism (an option, ``DQ_FIRST_STORE[False]``: the slot
    counters and a dq_accum the preprocess does not zero) with the launches on: the writer's claims
    read counters the preprocess zeroes, so a claim before the wait would misread them. Against the
    float32 reference, 16 heads of s 2048 (the claims contend)."""
    from fa4.bwd import sm90

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    hang_watchdog()
    monkeypatch.setitem(sm90.DQ_FIRST_STORE, False, True)
    seen = {}
    _pdl_mode(monkeypatch, True, seen)
    try:
        q, k, v = random_qkv(2, 2048, 2048, 16, 16, d, torch.bfloat16, "cuda", requires_grad=True, seed=d + 3)
        kw = dict(causal=mask == "causal", window_size=(None, None))
        out, _ = fa4.flash_attn_func(q, k, v, kernel_options=fa4.KernelOptions(arch="sm90"), **kw)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
    finally:
        fa4.ops._plans.clear()
    assert seen.get(True) is True
    ref, pt = _reference_dense((q, k, v), dict(kw, softcap=0.0), g, None)
    _check_grads(("dq", "dk", "dv"), grads, ref, pt, (q, k, v), g)
