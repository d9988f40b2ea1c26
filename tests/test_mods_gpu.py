"""score_mod / mask_mod in the sm90 forward against the float32 reference (Hopper GPUs only).

The functions are the flash_attn.cute-style ones of tests/mods_cases.py; the reference applies
their torch twins (fa4.testing.attention_ref's ``score_fn`` / ``mask_fn``). Outputs are NaN-filled
by the conftest; ``check`` applies FlashAttention's rule to ``out`` and ``lse``.
"""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4.testing import attention_ref, check_close, grad_noise_floor, random_qkv, random_varlen
from fwd_cases import check
from mods_cases import MASK_MODS, SCORE_MODS

SM90 = fa4.KernelOptions(arch="sm90")


@pytest.fixture(autouse=True)
def _hopper_only(request):
    if "gpu" in request.keywords and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels run on compute capability 9.x only")


def _call(q, k, v, score=None, mask=None, **kw):
    sm, st = SCORE_MODS[score]() if score else (None, None)
    mm, mt = MASK_MODS[mask]() if mask else (None, None)
    out, lse = fa4.flash_attn_func(q, k, v, score_mod=sm, mask_mod=mm, return_lse=True, kernel_options=SM90, **kw)
    ref_kw = {key: val for key, val in kw.items() if key in ("causal", "window_size", "softmax_scale")}
    check(out, lse, q, k, v, score_fn=st, mask_fn=mt, **ref_kw)
    return out, lse


# (score_mod, mask_mod, head dim, (seqlen_q, seqlen_k), mask)
CASES = [
    ("identity", None, 64, (113, 203), "none"),
    ("alibi", None, 128, (1000, 1000), "causal"),
    ("alibi", None, 256, (113, 203), "none"),
    ("tanh_cap", None, 128, (1000, 1000), "none"),
    ("tanh_cap", None, 64, (4096, 1024), "causal"),
    ("batch_bias", None, 128, (203, 113), "local"),
    (None, "causal_mask", 128, (1000, 1000), "none"),
    (None, "causal_mask", 64, (113, 203), "none"),
    (None, "doc64", 128, (1000, 1000), "none"),
    (None, "causal_doc100", 128, (1000, 1000), "none"),
    (None, "head_parity", 256, (300, 300), "none"),
    (None, "blind7", 64, (203, 113), "none"),
    ("alibi", "doc100", 96, (1000, 1000), "none"),
    ("identity", "blind7", 128, (17, 4096), "none"),
]


def _mask_kw(mask):
    return {"none": {}, "causal": dict(causal=True), "local": dict(window_size=(150, 20))}[mask]


@pytest.mark.gpu
@pytest.mark.parametrize("score,mask,d,seqlens,win", CASES,
                         ids=[f"{s}-{m}-d{d}-{a}x{b}-{w}" for s, m, d, (a, b), w in CASES])
def test_functions_dense(score, mask, d, seqlens, win):
    q, k, v = random_qkv(2, seqlens[0], seqlens[1], 8, 2, d, torch.bfloat16, "cuda", seed=d + seqlens[0])
    _call(q, k, v, score, mask, **_mask_kw(win))


@pytest.mark.gpu
def test_doc_masks_of_two_sizes_do_not_share_a_kernel():
    """Two closures of the same code with different captured values in one process: each gets its
    own kernel (Note [User functions in the compile key]), so each matches its own reference."""
    q, k, v = random_qkv(1, 500, 500, 4, 4, 64, torch.bfloat16, "cuda", seed=5)
    out64, _ = _call(q, k, v, mask="doc64")
    out100, _ = _call(q, k, v, mask="doc100")
    assert not torch.equal(out64, out100)


@pytest.mark.gpu
def test_mask_mod_causal_matches_causal():
    """A causal mask_mod gives the causal kernel's result within the rule (the reference's causal
    mask), and the pair causal=True + mask_mod is refused (flash_attn.cute would ignore causal)."""
    q, k, v = random_qkv(2, 777, 1025, 8, 2, 128, torch.bfloat16, "cuda", seed=11)
    out_m, lse_m = _call(q, k, v, mask="causal_mask")
    check(out_m, lse_m, q, k, v, causal=True)
    with pytest.raises(ValueError, match="ignores causal and window_size"):
        fa4.flash_attn_func(q, k, v, causal=True, mask_mod=MASK_MODS["causal_mask"]()[0], kernel_options=SM90)


@pytest.mark.gpu
@pytest.mark.parametrize("pack_gqa", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_functions_with_packed_heads_and_splits(pack_gqa, num_splits, seqlen_q):
    """Decode shapes: the packed tile's rows are several q heads (the head index the functions see
    is the q head's), and split-KV partials go through the combine."""
    q, k, v = random_qkv(4, seqlen_q, 3000, 16, 2, 128, torch.bfloat16, "cuda", seed=seqlen_q)
    _call(q, k, v, "alibi", "head_parity", pack_gqa=pack_gqa, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_functions_varlen(d):
    """Varlen with a one-token sequence and seqused_k: the functions see positions in the sequence
    and the sequence's index as the batch index."""
    vb = random_varlen(5, 700, 8, 2, d, torch.bfloat16, "cuda", max_seqlen_k=900, with_seqused_k=True, seed=d)
    _check_varlen(vb, SM90, "batch_bias", "causal_mask")


def _check_varlen(vb, opts, score=None, mask=None, **kw):
    """A varlen call with seqused_k and the named functions, against the reference."""
    sm, st = SCORE_MODS[score]() if score else (None, None)
    mm, mt = MASK_MODS[mask]() if mask else (None, None)
    out, lse = fa4.flash_attn_varlen_func(
        vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, max_seqlen_q=vb.max_seqlen_q,
        max_seqlen_k=vb.max_seqlen_k, seqused_k=vb.seqused_k, score_mod=sm, mask_mod=mm, return_lse=True,
        kernel_options=opts, **kw)
    check(out, lse, vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
          seqused_k=vb.seqused_k, score_fn=st, mask_fn=mt, **kw)


@pytest.mark.gpu
def test_score_mod_backward_needs_its_derivative():
    """Note [Refusing in the backward]: with inputs that require grad the forward runs (the same
    output as under no_grad); its backward raises."""
    q, k, v = random_qkv(1, 128, 128, 4, 4, 64, torch.bfloat16, "cuda", seed=1, requires_grad=True)
    out_g, _ = fa4.flash_attn_func(q, k, v, score_mod=SCORE_MODS["identity"]()[0])
    with pytest.raises(ValueError, match="needs its derivative, score_mod_bwd"):
        out_g.sum().backward()
    with torch.no_grad():
        out, _ = fa4.flash_attn_func(q, k, v, score_mod=SCORE_MODS["identity"]()[0])
    assert not torch.isnan(out).any() and torch.equal(out, out_g.detach())


# --- the backward through a mask_mod (sm90) --------------------------------------------------


def _mask_grads(q, k, v, fn, twin, aux=None, opts=SM90, deterministic=False, ref=True, score=None, aux_scalars=None,
                **kw):
    """fa4's (out, lse) gradients with a mask_mod (and ``score``: a score_mod name, with its
    derivative) against the float32 reference's, by the pass rule (with the gradient cancellation
    floor); returns fa4's (dq, dk, dv)."""
    from mods_cases import derivative

    sm, st = SCORE_MODS[score]() if score else (None, None)
    fns = dict(score_mod=sm, score_mod_bwd=derivative(score) if score else None)
    out, lse = fa4.flash_attn_func(q, k, v, mask_mod=fn, aux_tensors=aux, aux_scalars=aux_scalars, return_lse=True,
                                   deterministic=deterministic, kernel_options=opts, **fns, **kw)
    gen = torch.Generator("cuda").manual_seed(3)
    g = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    glse = torch.randn(lse.shape, device="cuda", generator=gen)
    got = torch.autograd.grad((out, lse), (q, k, v), (g, glse))
    if not ref:
        return got
    q32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    o_ref, l_ref = attention_ref(*q32, mask_fn=twin, score_fn=st, **kw)
    want = torch.autograd.grad((o_ref, l_ref), q32, (g.float(), glse))
    qlp = [t.detach().requires_grad_() for t in (q, k, v)]
    o_pt, l_pt = attention_ref(*qlp, upcast=False, mask_fn=twin, score_fn=st, **kw)
    pt = torch.autograd.grad((o_pt, l_pt), qlp, (g, glse))
    floors = grad_noise_floor(q, k, v, g)
    for name, a, r, p in zip(("dq", "dk", "dv"), got, want, pt):
        check_close(name, a, r, p, extra_atol=floors[name])
    return got


def _check_out_grads(out, inputs, ref_kw):
    """The gradients of ``out`` (a random cotangent) against the float32 reference's (``ref_kw``:
    attention_ref's arguments), by the pass rule with the gradient cancellation floor."""
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, g)
    q32 = [t.detach().float().requires_grad_() for t in inputs]
    want = torch.autograd.grad(attention_ref(*q32, **ref_kw)[0], q32, g.float())
    qlp = [t.detach().requires_grad_() for t in inputs]
    pt = torch.autograd.grad(attention_ref(*qlp, upcast=False, **ref_kw)[0], qlp, g)
    floors = grad_noise_floor(*inputs, g)
    for name, a, r, p in zip(("dq", "dk", "dv"), got, want, pt):
        check_close(name, a, r, p, extra_atol=floors[name])


BWD_CASES = [  # (mask_mod, head dim, (seqlen_q, seqlen_k), window): d256 takes the dQ pass
    ("doc64", 64, (1000, 1000), "none"),
    ("causal_doc100", 128, (1000, 1000), "none"),
    ("head_parity", 128, (113, 203), "none"),
    ("blind7", 64, (203, 113), "none"),
    ("causal_mask", 256, (300, 333), "none"),
    ("causal_doc100", 256, (1000, 1000), "none"),
    ("head_parity", 96, (1000, 1000), "none"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("mask,d,seqlens,win", BWD_CASES,
                         ids=[f"{m}-d{d}-{a}x{b}-{w}" for m, d, (a, b), w in BWD_CASES])
def test_mask_mod_backward(mask, d, seqlens, win):
    fn, twin = MASK_MODS[mask]()
    q, k, v = random_qkv(2, seqlens[0], seqlens[1], 8, 2, d, torch.bfloat16, "cuda", requires_grad=True, seed=d)
    _mask_grads(q, k, v, fn, twin, **_mask_kw(win))


@pytest.mark.gpu
@pytest.mark.parametrize("two_cta,deterministic", [(True, False), (False, True)])
def test_mask_mod_backward_paths(two_cta, deterministic):
    """The 2-CTA backward (dS halves exchanged) and the deterministic one (20 runs, the same bits)
    with a document mask."""
    fn, twin = MASK_MODS["causal_doc100"]()
    opts = fa4.KernelOptions(arch="sm90", bwd_two_cta=two_cta)
    q, k, v = random_qkv(2, 1024, 1024, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=9)
    first = _mask_grads(q, k, v, fn, twin, opts=opts, deterministic=deterministic)
    if deterministic:
        for _ in range(19):
            again = _mask_grads(q, k, v, fn, twin, opts=opts, deterministic=True, ref=False)
            for name, a, b in zip(("dq", "dk", "dv"), first, again):
                assert torch.equal(a, b), f"{name} differs between deterministic runs"


@pytest.mark.gpu
def test_mask_mod_backward_aux_and_varlen():
    """An aux doc-id mask, dense, and a varlen batch with a one-token sequence."""
    from mods_cases import doc_ids

    fn, twin, ids = doc_ids(2, 700, "cuda", seed=4)
    q, k, v = random_qkv(2, 700, 700, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=4)
    _mask_grads(q, k, v, fn, twin, aux=[ids])
    vb = random_varlen(4, 500, 8, 2, 64, torch.bfloat16, "cuda", max_seqlen_k=500, requires_grad=True, seed=5)
    fn, twin = MASK_MODS["doc64"]()
    out, lse = fa4.flash_attn_varlen_func(
        vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, max_seqlen_q=vb.max_seqlen_q,
        max_seqlen_k=vb.max_seqlen_k, mask_mod=fn, return_lse=True, kernel_options=SM90)
    _check_out_grads(out, (vb.q, vb.k, vb.v), dict(cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                                                   mask_fn=twin))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_aux_doc_ids_mask(d):
    """A mask read from an aux tensor of per-position document ids ``(batch, seqlen)``, sized to the
    sequence exactly (1000 positions: the tile's rows and keys past it index the table clamped,
    never out of bounds)."""
    from mods_cases import doc_ids

    fn, twin, ids = doc_ids(2, 1000, "cuda", seed=d)
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, d, torch.bfloat16, "cuda", seed=d)
    out, lse = fa4.flash_attn_func(q, k, v, mask_mod=fn, aux_tensors=[ids], return_lse=True, kernel_options=SM90)
    check(out, lse, q, k, v, mask_fn=twin)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_aux_tensor_without_unit_stride(family):
    """Note [Aux tensors' unit stride]: the kernels take aux tensors with the last stride 1; a
    transposed (column-major) table is copied at the launch, and the outputs and gradients match
    the same table passed contiguous, bit for bit (the deterministic backward: dQ's atomic adds
    would differ between any two runs), and the reference."""
    from mods_cases import doc_ids

    fn, twin, ids = doc_ids(2, 1000, "cuda", seed=11)
    strided = ids.t().contiguous().t()  # the same values, column-major: stride (1, 2)
    assert strided.stride(-1) != 1
    q, k, v = random_qkv(2, 1000, 1000, 4, 2, 128, torch.bfloat16, "cuda", seed=11)
    opts = fa4.KernelOptions(arch=family)
    runs = []
    for table in (ids, ids, strided):  # the contiguous table twice: the control
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = fa4.flash_attn_func(*leaves, mask_mod=fn, aux_tensors=[table], return_lse=True,
                                       deterministic=True, kernel_options=opts)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        runs.append((out, lse) + grads)
    names = ("out", "lse", "dq", "dk", "dv")

    def differ(a, b):
        return [f"{n} (max {(x.float() - y.float()).abs().max().item():.3g})"
                for n, x, y in zip(names, a, b) if not torch.equal(x, y)]

    assert not differ(runs[0], runs[1]), f"the same contiguous table twice: {differ(runs[0], runs[1])}"
    assert not differ(runs[0], runs[2]), f"column-major against contiguous: {differ(runs[0], runs[2])}"
    check(runs[1][0], runs[1][1], q, k, v, mask_fn=twin)


@pytest.mark.gpu
@pytest.mark.parametrize("pack_gqa", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_aux_rel_bias_decode(pack_gqa, num_splits):
    """A per-head relative-position bias table (float32 aux tensor) on decode shapes: packed heads
    index it by their own q head; split-KV partials merge in the combine."""
    from mods_cases import rel_bias_table

    fn, twin, table = rel_bias_table(16, 3000, "cuda", seed=num_splits)
    q, k, v = random_qkv(4, 4, 3000, 16, 2, 128, torch.bfloat16, "cuda", seed=7)
    out, lse = fa4.flash_attn_func(q, k, v, score_mod=fn, aux_tensors=[table], pack_gqa=pack_gqa,
                                   num_splits=num_splits, return_lse=True, kernel_options=SM90)
    check(out, lse, q, k, v, score_fn=twin)


@pytest.mark.gpu
def test_aux_doc_ids_varlen():
    """Varlen: the table is indexed by the sequence's index and positions in the sequence."""
    from mods_cases import doc_ids

    vb = random_varlen(4, 600, 8, 2, 128, torch.bfloat16, "cuda", max_seqlen_k=600, seed=3)
    fn, twin, ids = doc_ids(4, 600, "cuda", seed=3)
    out, lse = fa4.flash_attn_varlen_func(
        vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, max_seqlen_q=vb.max_seqlen_q,
        max_seqlen_k=vb.max_seqlen_k, mask_mod=fn, aux_tensors=[ids], return_lse=True, kernel_options=SM90)
    check(out, lse, vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, mask_fn=twin)



# --- the backward through a score_mod (its score_mod_bwd) -------------------------------------

SCORE_BWD_CASES = [  # (score_mod, mask_mod, head dim, (seqlen_q, seqlen_k), mask); d256: the dQ pass
    ("alibi", None, 128, (1000, 1000), "causal"),
    ("tanh_cap", None, 64, (113, 203), "none"),
    ("tanh_cap", None, 256, (300, 333), "none"),
    ("batch_bias", None, 128, (203, 113), "local"),
    ("alibi", "doc100", 96, (1000, 1000), "none"),
    ("tanh_cap", "head_parity", 128, (1000, 1000), "none"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("score,mask,d,seqlens,win", SCORE_BWD_CASES,
                         ids=[f"{s}-{m}-d{d}-{a}x{b}-{w}" for s, m, d, (a, b), w in SCORE_BWD_CASES])
def test_score_mod_backward(score, mask, d, seqlens, win):
    fn, twin = MASK_MODS[mask]() if mask else (None, None)
    q, k, v = random_qkv(2, seqlens[0], seqlens[1], 8, 2, d, torch.bfloat16, "cuda", requires_grad=True, seed=d + 1)
    _mask_grads(q, k, v, fn, twin, score=score, **_mask_kw(win))


@pytest.mark.gpu
def test_tanh_cap_score_mod_matches_softcap_backward():
    """The softcap written as a score_mod (flash_attn.cute builds its softcap so) and fa4's own
    softcap: gradients within the rule of the same reference."""
    q, k, v = random_qkv(2, 700, 700, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=12)
    got = _mask_grads(q, k, v, None, None, score="tanh_cap", causal=True)
    out, lse = fa4.flash_attn_func(q, k, v, softcap=20.0, causal=True, return_lse=True, kernel_options=SM90)
    gen = torch.Generator("cuda").manual_seed(3)
    g = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    glse = torch.randn(lse.shape, device="cuda", generator=gen)
    own = torch.autograd.grad((out, lse), (q, k, v), (g, glse))
    for name, a, b in zip(("dq", "dk", "dv"), got, own):
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= 0.05 * scale, name


@pytest.mark.gpu
@pytest.mark.parametrize("two_cta,deterministic", [(True, False), (False, True)])
def test_score_mod_backward_paths(two_cta, deterministic):
    """The 2-CTA backward and the deterministic one (5 runs, the same bits) through ALiBi."""
    opts = fa4.KernelOptions(arch="sm90", bwd_two_cta=two_cta)
    q, k, v = random_qkv(2, 1024, 1024, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=13)
    first = _mask_grads(q, k, v, None, None, opts=opts, deterministic=deterministic, score="alibi", causal=True)
    if deterministic:
        for _ in range(4):
            again = _mask_grads(q, k, v, None, None, opts=opts, deterministic=True, ref=False, score="alibi",
                                causal=True)
            for name, a, b in zip(("dq", "dk", "dv"), first, again):
                assert torch.equal(a, b), f"{name} differs between deterministic runs"


@pytest.mark.gpu
def test_score_mod_backward_aux_table():
    """A relative-position bias table (aux tensor) through the backward: its derivative with respect
    to the scores is the identity."""
    from mods_cases import derivative, rel_bias_table

    fn, twin, table = rel_bias_table(8, 700, "cuda", seed=6)
    q, k, v = random_qkv(2, 700, 700, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=14)
    out, lse = fa4.flash_attn_func(q, k, v, score_mod=fn, score_mod_bwd=derivative("rel_bias"),
                                   aux_tensors=[table], causal=True, return_lse=True, kernel_options=SM90)
    _check_out_grads(out, (q, k, v), dict(score_fn=twin, causal=True))


@pytest.mark.skipif(not fa4.interface._dynamo_guards_function_ids(),
                    reason="user functions under torch.compile need torch >= 2.13 (fa4 refuses them before)")
@pytest.mark.gpu
def test_torch_compile_with_functions_matches_eager():
    """torch.compile(fullgraph=True) of a training step with a score_mod (and its derivative) and an
    aux-table mask_mod: the same outputs and gradients as the eager calls (the custom ops carry the
    functions' keys and the table)."""
    from mods_cases import derivative, doc_ids

    sm, _ = SCORE_MODS["alibi"]()
    fn, _, ids = doc_ids(2, 512, "cuda", seed=8)
    q, k, v = random_qkv(2, 512, 512, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=15)
    g = torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16)

    sb = derivative("alibi")  # (made outside the traced function: the DSL's decorator cannot be traced)

    def step(q, k, v, ids):
        out, _ = fa4.flash_attn_func(q, k, v, score_mod=sm, score_mod_bwd=sb, mask_mod=fn,
                                     aux_tensors=[ids], kernel_options=SM90)
        return (out.float() * g.float()).sum()

    eager = torch.autograd.grad(step(q, k, v, ids), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v, ids), (q, k, v))
    for name, a, b in zip(("dq", "dk", "dv"), eager, compiled):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("score", ["alibi", "batch_bias"])
def test_score_mod_backward_varlen(score):
    """Varlen with seqused_k and a one-token sequence: positions and lengths per sequence (ALiBi
    reads seqlen_info), the sequence's index as the batch (batch_bias)."""
    from mods_cases import derivative

    vb = random_varlen(5, 600, 8, 2, 128, torch.bfloat16, "cuda", max_seqlen_k=700, with_seqused_k=True,
                       requires_grad=True, seed=16)
    sm, st = SCORE_MODS[score]()
    out, lse = fa4.flash_attn_varlen_func(
        vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, max_seqlen_q=vb.max_seqlen_q,
        max_seqlen_k=vb.max_seqlen_k, seqused_k=vb.seqused_k, score_mod=sm, score_mod_bwd=derivative(score),
        causal=True, return_lse=True, kernel_options=SM90)
    _check_out_grads(out, (vb.q, vb.k, vb.v), dict(cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                                                   seqused_k=vb.seqused_k, score_fn=st, causal=True))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["kv_split2", "det_d256", "blind_rows"])
def test_user_functions_backward_paths(case):
    """Paths the default configs of the cases above may not take on every GPU: a split GQA group
    (pinned), the deterministic dQ pass (d256), and a score_mod on rows the mask_mod hides."""
    if case == "kv_split2":
        opts = fa4.KernelOptions(arch="sm90", bwd_kv_split=2)
        q, k, v = random_qkv(2, 512, 512, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=17)
        _mask_grads(q, k, v, *MASK_MODS["doc64"](), opts=opts, score="alibi")
    elif case == "det_d256":
        q, k, v = random_qkv(2, 400, 400, 4, 2, 256, torch.bfloat16, "cuda", requires_grad=True, seed=18)
        first = _mask_grads(q, k, v, *MASK_MODS["causal_doc100"](), deterministic=True, score="tanh_cap")
        again = _mask_grads(q, k, v, *MASK_MODS["causal_doc100"](), deterministic=True, score="tanh_cap", ref=False)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    else:
        q, k, v = random_qkv(2, 300, 300, 8, 2, 64, torch.bfloat16, "cuda", requires_grad=True, seed=19)
        dq, _, _ = _mask_grads(q, k, v, *MASK_MODS["blind7"](), score="tanh_cap")
        assert torch.equal(dq[:, ::7], torch.zeros_like(dq[:, ::7]))


SM80 = fa4.KernelOptions(arch="sm80")


@pytest.mark.gpu
@pytest.mark.parametrize("score,mask,d,seqlens,win", [
    ("alibi", None, 128, (1000, 1000), "causal"),
    ("alibi", None, 96, (700, 900), "local"),
    ("tanh_cap", "doc100", 64, (113, 203), "none"),
    (None, "head_parity", 256, (300, 300), "none"),
    ("batch_bias", "head_parity", 128, (4, 3000), "none"),  # decode: packed rows
])
def test_sm80_forward_functions(score, mask, d, seqlens, win):
    """The sm80 family's forward (forced on the H200) with the same functions and references."""
    sm, st = SCORE_MODS[score]() if score else (None, None)
    mm, mt = MASK_MODS[mask]() if mask else (None, None)
    q, k, v = random_qkv(2, seqlens[0], seqlens[1], 8, 2, d, torch.bfloat16, "cuda", seed=d + 3)
    out, lse = fa4.flash_attn_func(q, k, v, score_mod=sm, mask_mod=mm, return_lse=True, kernel_options=SM80,
                                   **_mask_kw(win))
    check(out, lse, q, k, v, score_fn=st, mask_fn=mt, **_mask_kw(win))


@pytest.mark.gpu
@pytest.mark.parametrize("pack_gqa", [False, True])
def test_sm80_forward_aux_decode(pack_gqa):
    """sm80: an aux bias table on decode shapes, packed or not, split in three."""
    from mods_cases import rel_bias_table

    fn, twin, table = rel_bias_table(16, 3000, "cuda", seed=2)
    q, k, v = random_qkv(4, 4, 3000, 16, 2, 128, torch.bfloat16, "cuda", seed=21)
    out, lse = fa4.flash_attn_func(q, k, v, score_mod=fn, aux_tensors=[table], pack_gqa=pack_gqa, num_splits=3,
                                   return_lse=True, kernel_options=SM80)
    check(out, lse, q, k, v, score_fn=twin)


@pytest.mark.gpu
@pytest.mark.parametrize("score,mask,d,det", [
    (None, "causal_doc100", 128, False),
    ("tanh_cap", None, 64, False),
    ("alibi", "head_parity", 128, True),
    ("batch_bias", "blind7", 96, False),
])
def test_sm80_backward_functions(score, mask, d, det):
    """The sm80 family's backward (forced on the H200) through mask_mods and score_mods with their
    derivatives; deterministic runs give the same bits twice."""
    fn, twin = MASK_MODS[mask]() if mask else (None, None)
    q, k, v = random_qkv(2, 600, 700, 8, 2, d, torch.bfloat16, "cuda", requires_grad=True, seed=d + 5)
    first = _mask_grads(q, k, v, fn, twin, opts=SM80, deterministic=det, score=score)
    if det:
        again = _mask_grads(q, k, v, fn, twin, opts=SM80, deterministic=True, score=score, ref=False)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
def test_sm80_forward_varlen_and_aux():
    """sm80: varlen with a one-token sequence (the sequence's index as the batch), and a mask read
    from an aux doc-id table."""
    from mods_cases import doc_ids

    vb = random_varlen(5, 600, 8, 2, 128, torch.bfloat16, "cuda", max_seqlen_k=700, with_seqused_k=True, seed=22)
    _check_varlen(vb, SM80, "batch_bias", causal=True)
    fn, twin, ids = doc_ids(2, 1000, "cuda", seed=23)
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, 64, torch.bfloat16, "cuda", seed=23)
    out, lse = fa4.flash_attn_func(q, k, v, mask_mod=fn, aux_tensors=[ids], return_lse=True, kernel_options=SM80)
    check(out, lse, q, k, v, mask_fn=twin)


@pytest.mark.skipif(not fa4.interface._dynamo_guards_function_ids(),
                    reason="user functions under torch.compile need torch >= 2.13 (fa4 refuses them before)")
@pytest.mark.gpu
def test_torch_compile_another_function_retraces():
    """A compiled callable given two closures of other values computes each one's result
    (Note [User functions under torch.compile])."""
    q, k, v = random_qkv(2, 256, 256, 4, 4, 64, torch.bfloat16, "cuda", seed=24)
    compiled = torch.compile(lambda q, k, v, fn: fa4.flash_attn_func(q, k, v, score_mod=fn, kernel_options=SM90)[0],
                             fullgraph=True)
    from mods_cases import alibi
    for slope in (0.05, 0.2):
        fn, twin = alibi(slope)
        out = compiled(q, k, v, fn)
        eager, lse = fa4.flash_attn_func(q, k, v, score_mod=fn, return_lse=True, kernel_options=SM90)
        assert torch.equal(out, eager)
        check(eager, lse, q, k, v, score_fn=twin)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_functions_with_paged_kv_and_sinks(family):
    """Paths the functions pass through without a case of their own above: a paged KV cache (the
    same bits as the same call on the contiguous cache with seqused_k) and a learnable sink (the
    reference's sink composed on the host, ops.compose_sink)."""
    import fa4.ops
    from test_flash_attn_cute_calls_gpu import _paged

    opts = fa4.KernelOptions(arch=family)
    sm, st = SCORE_MODS["alibi"]()
    mm, mt = MASK_MODS["head_parity"]()
    gen = torch.Generator().manual_seed(25)
    q, k, v = random_qkv(3, 5, 900, 16, 2, 128, torch.bfloat16, "cuda", seed=25)
    lens = [900, 333, 17]
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kc, vc, table = _paged(k, v, lens, 16, gen)
    paged, _ = fa4.flash_attn_varlen_func(q, kc, vc, seqused_k=used, page_table=table, score_mod=sm, mask_mod=mm,
                                          kernel_options=opts)
    flat, _ = fa4.flash_attn_varlen_func(q, k, v, seqused_k=used, score_mod=sm, mask_mod=mm, kernel_options=opts)
    assert torch.equal(paged, flat)
    sink = torch.randn(16, device="cuda")
    q, k, v = random_qkv(2, 300, 300, 16, 2, 128, torch.bfloat16, "cuda", seed=26)
    out, lse = fa4.flash_attn_func(q, k, v, score_mod=sm, learnable_sink=sink, return_lse=True, kernel_options=opts)
    o_ref, l_ref = attention_ref(q, k, v, score_fn=st)
    o_pt, l_pt = attention_ref(q, k, v, score_fn=st, upcast=False)
    o_ref, l_ref = fa4.ops.compose_sink(o_ref, l_ref, sink, False)
    o_pt, l_pt = fa4.ops.compose_sink(o_pt, l_pt, sink, False)
    check_close("out", out, o_ref, o_pt)
    check_close("lse", lse, l_ref, l_pt)


# --- aux_scalars: runtime values of the functions --------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_aux_scalars_forward_and_backward(family):
    """A score_mod, its derivative and a mask_mod reading aux_scalars (a float slope, an int band
    width): each pair of values matches its own reference, forward and gradients, and a second pair
    of values runs on the kernels the first compiled (the values are kernel arguments)."""
    from fa4 import jit
    from mods_cases import scalar_alibi_band

    opts = fa4.KernelOptions(arch=family)
    sm, sb, mm, st, mt = scalar_alibi_band()
    q, k, v = random_qkv(2, 700, 1000, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=27)
    misses = []
    for slope, width in ((0.05, 300), (0.2, 77)):
        out, lse = fa4.flash_attn_func(q, k, v, score_mod=sm, score_mod_bwd=sb, mask_mod=mm,
                                       aux_scalars=(slope, width), return_lse=True, kernel_options=opts)
        with torch.no_grad():
            check(out, lse, q, k, v, score_fn=st(slope, width), mask_fn=mt(slope, width))
        _check_out_grads(out, (q, k, v), dict(score_fn=st(slope, width), mask_fn=mt(slope, width)))
        misses.append(jit.cache_info()["misses"])
    assert misses[1] == misses[0], "another aux_scalars value compiled a new kernel"


@pytest.mark.gpu
def test_aux_scalars_with_aux_tensors():
    """A mask reading an aux tensor (document ids) and an aux scalar (a window), forward and backward,
    dense and on decode shapes with packed heads and split-KV."""
    from mods_cases import doc_ids_window

    fn, twin_of, ids = doc_ids_window(2, 1000, "cuda", seed=28)
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=28)
    for width in (64, 500):
        _mask_grads(q, k, v, fn, twin_of(width), aux=[ids], aux_scalars=(width,))
    q, k, v = random_qkv(2, 4, 1000, 16, 2, 128, torch.bfloat16, "cuda", seed=29)
    for pack_gqa, splits in ((True, 3), (False, 1)):
        out, lse = fa4.flash_attn_func(q, k, v, mask_mod=fn, aux_tensors=[ids], aux_scalars=(900,), pack_gqa=pack_gqa,
                                       num_splits=splits, return_lse=True, kernel_options=SM90)
        check(out, lse, q, k, v, mask_fn=twin_of(900))
