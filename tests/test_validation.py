"""Every bad input is rejected before any launch with a TypeError/ValueError naming the argument.

Runs on the CPU: CUDA tensors are FakeTensors (shapes, dtypes, devices, strides; no storage), and
the kernel drivers are replaced by a function that fails the test if anything gets that far.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fa4
from fa4 import ops, validate

BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel driver was reached: validation let a bad input through")

    monkeypatch.setattr(ops, "forward", boom)
    monkeypatch.setattr(ops, "backward", boom)


@pytest.fixture
def fake():
    with FakeTensorMode(allow_non_fake_inputs=True) as m:
        yield m


def cuda(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def qkv(b=2, sq=33, sk=65, h=8, hk=2, d=64, dtype=BF16):
    return cuda(b, sq, h, d, dtype=dtype), cuda(b, sk, hk, d, dtype=dtype), cuda(b, sk, hk, d, dtype=dtype)


def raises(exc, match, fn, *a, **k):
    with pytest.raises(exc, match=match):
        fn(*a, **k)


def test_valid_call_reaches_the_driver(fake):
    q, k, v = qkv()
    with pytest.raises(AssertionError, match="driver was reached"):
        fa4.flash_attn_func(q, k, v, causal=True)


@pytest.mark.parametrize("bad", [torch.float32, torch.float64, torch.int8])
def test_dtype_must_be_half(fake, bad):
    q, k, v = qkv()
    raises(TypeError, "q must be torch.float16 or torch.bfloat16", fa4.flash_attn_func, q.to(bad), k, v)
    raises(TypeError, "k must be torch.float16 or torch.bfloat16", fa4.flash_attn_func, q, k.to(bad), v)


def test_dtypes_must_match(fake):
    q, k, v = qkv()
    raises(TypeError, "v must have the same dtype as q", fa4.flash_attn_func, q, k, v.to(FP16))
    raises(TypeError, "k must have the same dtype as q", fa4.flash_attn_func, q, k.to(FP16), v)


def test_not_a_tensor(fake):
    q, k, v = qkv()
    raises(TypeError, "k must be a torch.Tensor", fa4.flash_attn_func, q, 3, v)


def test_device_must_be_cuda_and_same(fake):
    q, k, v = qkv()
    raises(ValueError, "must be CUDA tensors", fa4.flash_attn_func, q.to("cpu"), k.to("cpu"), v.to("cpu"))
    raises(ValueError, "k must be on the same device as q", fa4.flash_attn_func, q, k.to("cpu"), v)


@pytest.mark.parametrize("shape_q,shape_k,match", [
    ((2, 33, 8), (2, 65, 2, 64), "q must have 4 dimensions"),
    ((2, 33, 8, 64), (2, 65, 64), "k must have 4 dimensions"),
    ((2, 33, 8, 64), (3, 65, 2, 64), "batch"),
    ((2, 33, 8, 64), (2, 65, 3, 64), "divisible"),
    ((2, 33, 8, 64), (2, 65, 2, 32), "k head_dim"),
])
def test_rank_and_shapes(fake, shape_q, shape_k, match):
    raises(ValueError, match, fa4.flash_attn_func, cuda(*shape_q), cuda(*shape_k), cuda(*shape_k))


def test_k_v_shapes_equal(fake):
    q, k, _ = qkv()
    raises(ValueError, "k and v must have the same shape but for the head dim", fa4.flash_attn_func, q, k,
           cuda(2, 64, 2, 64))
    raises(ValueError, "head_dim_v", fa4.flash_attn_func, q, k, cuda(2, 65, 2, 20))
    with pytest.raises(AssertionError, match="driver was reached"):  # (head_dim, head_dim_v) = (64, 128)
        fa4.flash_attn_func(q, k, cuda(2, 65, 2, 128))


@pytest.mark.parametrize("d", [4, 12, 100, 264, 512])
def test_head_dim_limits(fake, d):
    q, k, v = qkv(d=d)
    raises(ValueError, "head_dim must be a multiple of 8", fa4.flash_attn_func, q, k, v)


@pytest.mark.parametrize("d", [8, 16, 24])
def test_small_head_dims_are_padded(fake, d):
    """Note [Small head dims]: flash_attn.cute's 8-24 run as 32 (tests/test_dropin.py checks the call)."""
    q, k, v = qkv(d=d)
    with pytest.raises(AssertionError, match="driver was reached"):
        fa4.flash_attn_func(q, k, v)


def _driver_sees(monkeypatch):
    """Replace the forward driver by one that records the q, k, v it is given, then stops."""
    seen = []

    def record(problem, q, k, v, *a, **kw):
        seen.append((q, k, v))
        raise AssertionError("driver was reached")

    monkeypatch.setattr(ops, "forward", record)
    return seen


def _runs_on_copies(monkeypatch, call, q, k, v, misfit):
    """``call(q, k, v)`` reaches the driver with the tensors named in ``misfit`` copied into
    contiguous, 16-byte aligned ones and the others as given (Note [Copied layouts]), with the
    one-time warning."""
    from fa4 import interface

    interface._hint_warned.discard("copied_layout")
    seen = _driver_sees(monkeypatch)
    with pytest.warns(UserWarning, match="contiguous copies"), pytest.raises(AssertionError, match="driver"):
        call(q, k, v)
    (got,) = seen
    for name, given, t in zip("qkv", (q, k, v), got):
        if name in misfit:
            assert t is not given and t.is_contiguous() and t.shape == given.shape, name
            assert validate.layout_misfit(t) is None, name
        else:
            assert t is given, name


def test_last_dim_not_contiguous_runs_on_a_copy(fake, monkeypatch):
    """flash_attn.cute copies a q / k / v whose last stride is not 1; fa4 does too (it raised before)."""
    q, k, v = qkv()
    qt = cuda(2, 33, 64, 8).transpose(-1, -2)  # (2, 33, 8, 64) with last stride 8
    assert validate.layout_misfit(qt) == "its last stride is 8, not 1"
    _runs_on_copies(monkeypatch, fa4.flash_attn_func, qt, k, v, "q")
    vt = cuda(2, 65, 64, 2).transpose(-1, -2)
    _runs_on_copies(monkeypatch, fa4.flash_attn_func, q, k, vt, "v")
    # varlen: (total, heads, head_dim)
    cu = torch.tensor([0, 33], dtype=torch.int32, device="cuda")
    kt = cuda(33, 64, 2).transpose(-1, -2)
    _runs_on_copies(monkeypatch, lambda q, k, v: fa4.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=33, max_seqlen_k=33), cuda(33, 8, 64), kt,
        cuda(33, 2, 64), "k")


def test_paged_cache_in_another_layout_raises(fake):
    """Note [Copied layouts]: not a paged K/V cache, whose whole capacity a copy would move on every
    decode step: it raises by name, as before (q is still copied)."""
    q = cuda(2, 3, 8, 64)
    cache = cuda(16, 16, 64, 2).transpose(-1, -2)  # (pages, page_size, heads_k, d), last stride 2
    pt = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    raises(ValueError, "k must be contiguous in its last dimension", fa4.flash_attn_varlen_func, q, cache,
           cache, page_table=pt)


def test_explain_names_the_copied_tensor(monkeypatch):
    q, k, v = (torch.empty(2, 33, 8, 64, dtype=BF16, device="meta"),
               torch.empty(2, 65, 64, 2, dtype=BF16, device="meta").transpose(-1, -2),
               torch.empty(2, 65, 2, 64, dtype=BF16, device="meta"))
    ex = fa4.explain(q, k, v, capability=(9, 0))
    assert any(n.startswith("k: its last stride is 2, not 1") and "Copied layouts" in n for n in ex.notes), ex.notes


def test_strides_multiple_of_16_bytes(fake, monkeypatch):
    q, _, _ = qkv()
    ok = torch.empty_strided((2, 65, 2, 64), (65 * 2 * 72, 2 * 72, 72, 1), dtype=BF16, device="cuda")
    with pytest.raises(AssertionError, match="driver was reached"):  # padded rows of 72 elements are fine
        fa4.flash_attn_func(q, ok, ok)
    odd = torch.empty_strided((2, 65, 2, 64), (65 * 2 * 68, 2 * 68, 68, 1), dtype=BF16, device="cuda")
    # the checks still name it (flash_attn_with_kvcache's caches, which are not copied) ...
    raises(ValueError, "stride 68 of dimension 2 must be a multiple of 8", validate.check_dense, q, odd, odd,
           None, False, (None, None), 0.0)
    # ... and the attention calls run on copies, as flash_attn.cute's (Note [Copied layouts])
    assert validate.layout_misfit(odd) == "its stride 68 of dimension 2 is not a multiple of 8 elements"
    _runs_on_copies(monkeypatch, fa4.flash_attn_func, q, odd, odd.clone(), "k")


def test_pointer_alignment_on_real_tensors():
    # Real (CPU) storage so the pointer exists; device checks are lifted as fa4.explain does.
    buf = torch.empty(2 * 65 * 2 * 64 + 8, dtype=BF16)
    t = buf[1:1 + 2 * 65 * 2 * 64].view(2, 65, 2, 64)  # 2-byte offset
    q = torch.empty(2, 33, 8, 64, dtype=BF16)
    with validate.allow_any_device():
        raises(ValueError, "k must be 16-byte aligned", validate.check_dense, q, t, t, None, False, (None, None), 0.0)


@pytest.mark.parametrize("window,exc,match", [
    ((-2, None), ValueError, "window_size left must be >= 0"),
    ((None, -5), ValueError, "window_size right must be >= 0"),
    ((1.5, None), TypeError, "window_size left must be an int"),
    ((3,), TypeError, "window_size must be a pair"),
    (5, TypeError, "window_size must be a pair"),
])
def test_window_sizes(fake, window, exc, match):
    q, k, v = qkv()
    raises(exc, match, fa4.flash_attn_func, q, k, v, window_size=window)


@pytest.mark.parametrize("softcap,exc", [(-1.0, ValueError), (float("nan"), ValueError), ("1", TypeError)])
def test_softcap(fake, softcap, exc):
    q, k, v = qkv()
    raises(exc, "softcap", fa4.flash_attn_func, q, k, v, softcap=softcap)


@pytest.mark.parametrize("scale,exc", [(0.0, ValueError), (-1.0, ValueError), (float("inf"), ValueError), ("a", TypeError)])
def test_softmax_scale(fake, scale, exc):
    q, k, v = qkv()
    raises(exc, "softmax_scale", fa4.flash_attn_func, q, k, v, softmax_scale=scale)


def test_flags_must_be_bool(fake):
    q, k, v = qkv()
    raises(TypeError, "causal must be a bool", fa4.flash_attn_func, q, k, v, causal=1)
    raises(TypeError, "deterministic must be a bool", fa4.flash_attn_func, q, k, v, deterministic="yes")


def test_numpy_bools_are_flags(fake, monkeypatch):
    """A flag read from a numpy array is the same choice as the Python bool: the entry points make it
    one (flags are compile keys); ints stay refused above."""
    np = pytest.importorskip("numpy")
    seen = []

    def driver(*a, **k):
        seen.append(a)
        raise AssertionError("a kernel driver was reached")

    monkeypatch.setattr(ops, "forward", driver)
    q, k, v = qkv()
    with pytest.raises(AssertionError, match="driver was reached"):
        fa4.flash_attn_func(q, k, v, causal=np.bool_(True), deterministic=np.bool_(False), return_lse=np.bool_(True),
                            pack_gqa=np.bool_(False))
    problem = next(x for x in seen[0] if hasattr(x, "causal"))
    assert problem.causal is True
    qp, kp, vp, cu_q, cu_k, mq, mk = varlen_inputs()
    with pytest.raises(AssertionError, match="driver was reached"):
        fa4.flash_attn_varlen_func(qp, kp, vp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk,
                                   causal=np.bool_(False), return_lse=np.bool_(False),
                                   disable_scheduler_metadata=np.bool_(True))
    assert "causal=True" in str(fa4.explain(q, k, v, causal=np.bool_(True), capability=(9, 0)))


@pytest.mark.parametrize("arg", ["qv"])
def test_unsupported_arguments_raise(fake, arg):
    q, k, v = qkv()
    raises(NotImplementedError, repr(arg), fa4.flash_attn_func, q, k, v, **{arg: q})


def test_block_sparse_tensors_must_be_the_named_tuple(fake):
    q, k, v = qkv()
    raises(TypeError, "block_sparse_tensors must be a BlockSparseTensorsTorch-like", fa4.flash_attn_func, q, k, v,
           block_sparse_tensors=q)


@pytest.mark.parametrize("arg", ["score_mod", "mask_mod"])
def test_user_functions_must_be_callable(fake, arg):
    """score_mod / mask_mod are supported (fa4/mods.py); a non-callable is a TypeError naming it."""
    q, k, v = qkv()
    raises(TypeError, f"{arg} must be a callable", fa4.flash_attn_func, q, k, v, **{arg: q})


def test_score_mod_bwd_needs_a_score_mod(fake):
    q, k, v = qkv()
    raises(ValueError, "no score_mod was given", fa4.flash_attn_func, q, k, v, score_mod_bwd=lambda *a, **kw: a[0])


def test_kernel_options_type_and_values(fake):
    q, k, v = qkv()
    raises(TypeError, "kernel_options must be a fa4.KernelOptions", fa4.flash_attn_func, q, k, v, kernel_options={"tile_m": 64})
    raises(ValueError, "exp2_emu_frac", fa4.KernelOptions, exp2_emu_frac=1.5)
    raises(ValueError, "tile_m", fa4.KernelOptions, tile_m=0)
    raises(ValueError, "arch", fa4.KernelOptions, arch="sm70")


# ---------------------------------------------------------------------------------------------
# varlen
# ---------------------------------------------------------------------------------------------


def varlen_inputs(lens_q=(3, 17, 1), lens_k=(5, 9, 30), h=4, hk=2, d=64):
    cu_q = torch.empty(len(lens_q) + 1, dtype=torch.int32, device="cuda")  # values are not read by validation
    cu_k = torch.empty(len(lens_k) + 1, dtype=torch.int32, device="cuda")
    q = cuda(sum(lens_q), h, d)
    k, v = cuda(sum(lens_k), hk, d), cuda(sum(lens_k), hk, d)
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def test_varlen_valid_reaches_driver(fake):
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    with pytest.raises(AssertionError, match="driver was reached"):
        fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)


@pytest.mark.parametrize("mq,mk,want", [
    (None, None, (21, 44)),  # the packed token counts: upper bounds, no device sync
    (torch.tensor(17), torch.tensor(30, dtype=torch.int64), (17, 30)),  # CPU 0-dim tensors: their values
    (torch.tensor(17, device="meta"), 30, (21, 30)),  # a device tensor is not read: the bound
])
def test_varlen_max_seqlen_optional(mq, mk, want):
    from fa4 import validate

    q, k, v = torch.empty(21, 4, 64, dtype=BF16), torch.empty(44, 2, 64, dtype=BF16), torch.empty(44, 2, 64, dtype=BF16)
    cu_q, cu_k = torch.tensor([0, 3, 20, 21], dtype=torch.int32), torch.tensor([0, 5, 14, 44], dtype=torch.int32)
    with validate.allow_any_device():
        p = validate.check_varlen(q, k, v, cu_q, cu_k, mq, mk, None, None, False, (None, None), 0.0)
    assert (p.seqlen_q, p.seqlen_k) == want


def test_varlen_cu_seqlens_checks(fake):
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    f = fa4.flash_attn_varlen_func
    raises(TypeError, "cu_seqlens_q must be torch.int32", f, q, k, v, cu_seqlens_q=torch.empty(4, dtype=torch.int64, device="cuda"), cu_seqlens_k=cu_k,
           max_seqlen_q=mq, max_seqlen_k=mk)
    raises(ValueError, "cu_seqlens_k must have length batch \\+ 1 = 4", f, q, k, v, cu_seqlens_q=cu_q,
           cu_seqlens_k=torch.empty(3, dtype=torch.int32, device="cuda"), max_seqlen_q=mq, max_seqlen_k=mk)
    raises(ValueError, "cu_seqlens_k must be on the same device", f, q, k, v, cu_seqlens_q=cu_q,
           cu_seqlens_k=torch.empty(4, dtype=torch.int32), max_seqlen_q=mq, max_seqlen_k=mk)
    raises(TypeError, "max_seqlen_q must be an int or a 0-dim integer tensor", f, q, k, v, cu_seqlens_q=cu_q,
           cu_seqlens_k=cu_k, max_seqlen_q=torch.tensor(3.0), max_seqlen_k=mk)
    raises(TypeError, "max_seqlen_k must be an int or a 0-dim integer tensor", f, q, k, v, cu_seqlens_q=cu_q,
           cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=torch.tensor([3]))
    raises(TypeError, "max_seqlen_k must be an int", f, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
           max_seqlen_q=mq, max_seqlen_k=3.0)
    raises(ValueError, "q must have 3 dimensions", f, cuda(1, 21, 4, 64), k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
           max_seqlen_q=mq, max_seqlen_k=mk)
    raises(TypeError, "seqused_q must be an int32", f, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
           max_seqlen_k=mk, seqused_q=torch.empty(3, dtype=torch.int64, device="cuda"))
    raises(ValueError, "seqused_q must have shape", f, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
           max_seqlen_k=mk, seqused_q=torch.empty(4, dtype=torch.int32, device="cuda"))
    raises(TypeError, "seqused_k must be an int32", f, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
           max_seqlen_q=mq, max_seqlen_k=mk, seqused_k=torch.empty(3, dtype=torch.int64, device="cuda"))
    raises(ValueError, "seqused_k must have shape", f, q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
           max_seqlen_q=mq, max_seqlen_k=mk, seqused_k=cu_k)


def test_performance_hints_warn_once(fake):
    """A hint fa4 does not use warns once (min_seqlen_k); num_splits / pack_gqa are used by both
    forward families and their types are checked."""
    from fa4 import interface

    interface._hint_warned.clear()
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    with pytest.warns(UserWarning, match="min_seqlen_k"):
        with pytest.raises(AssertionError, match="driver was reached"):
            fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
                                       max_seqlen_k=mk, min_seqlen_k=3)
    q, k, v = qkv()
    with pytest.raises(TypeError, match="num_splits"):
        fa4.flash_attn_func(q, k, v, num_splits="4")
    with pytest.raises(TypeError, match="pack_gqa"):
        fa4.flash_attn_func(q, k, v, pack_gqa="yes")


@pytest.mark.parametrize("causal,window,sq,sk,expect", [
    (False, (None, None), 10, 20, (False, False, 20, 20)),
    (True, (None, None), 10, 20, (True, False, 20, 0)),
    (False, (None, 0), 10, 20, (True, False, 20, 0)),   # window (None, 0) is the causal mask
    (True, (4, None), 10, 20, (False, True, 4, 0)),     # causal + left window -> local, right = 0
    (False, (3, 2), 10, 20, (False, True, 3, 2)),
    (False, (100, 100), 10, 20, (False, False, 20, 20)),  # windows wider than the problem are no mask
])
def test_masking_normalization(causal, window, sq, sk, expect):
    assert validate._masking(causal, window, sq, sk) == expect


def test_kernel_ready_layouts():
    """What the kernels are handed: unchanged when fit, a zero-copy view when only size-1 dims have
    odd strides, a compact copy otherwise (transposed, expanded, misaligned)."""
    base = torch.randn(1, 5, 2, 64).to(BF16)
    assert validate.kernel_ready(base) is base
    odd = base.as_strided((1, 5, 2, 64), (77, 128, 64, 1))
    fixed = validate.kernel_ready(odd)
    assert fixed.data_ptr() == odd.data_ptr() and fixed.stride() == (0, 128, 64, 1) and torch.equal(fixed, odd)
    for t in (torch.randn(3, 2, 5, 72).to(BF16).transpose(1, 2)[..., 4:68],  # transposed, base 8 bytes off
              torch.randn(1, 1, 1, 64).to(BF16).expand(2, 3, 4, 64),
              torch.zeros(1289, dtype=BF16)[1:1281].view(2, 5, 2, 64)):
        r = validate.kernel_ready(t)
        assert r.stride(-1) == 1 and all(s % 8 == 0 for s in r.stride()[:-1]) and r.data_ptr() % 16 == 0
        assert torch.equal(r, t)


def test_mixed_layouts_and_paged_checks(fake):
    """Each side packed, batched or paged on its own; the shapes are checked against each other."""
    f = fa4.flash_attn_varlen_func
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    kb, vb = cuda(3, 40, 2, 64), cuda(3, 40, 2, 64)
    with pytest.raises(AssertionError, match="driver was reached"):  # packed q, batched k/v
        f(q, kb, vb, cu_seqlens_q=cu_q)
    raises(ValueError, "k must have 4 dimensions", f, q, k, v, cu_seqlens_q=cu_q)
    raises(ValueError, "k and v batch \\(2\\) must equal the batch of q \\(3\\)", f, q, cuda(2, 40, 2, 64),
           cuda(2, 40, 2, 64), cu_seqlens_q=cu_q)
    qb = cuda(3, 7, 4, 64)
    with pytest.raises(AssertionError, match="driver was reached"):  # batched q, packed k/v
        f(qb, k, v, cu_seqlens_k=cu_k)
    raises(ValueError, "cu_seqlens_k must have length batch \\+ 1 = 3", f, cuda(2, 7, 4, 64), k, v, cu_seqlens_k=cu_k)
    # paged
    kc, vc = cuda(10, 16, 2, 64), cuda(10, 16, 2, 64)
    pt = torch.zeros(3, 4, dtype=torch.int32, device="cuda")
    used = torch.zeros(3, dtype=torch.int32, device="cuda")
    with pytest.raises(AssertionError, match="driver was reached"):
        f(q, kc, vc, cu_seqlens_q=cu_q, page_table=pt, seqused_k=used)
    raises(TypeError, "page_table must be an int32", f, q, kc, vc, cu_seqlens_q=cu_q, page_table=pt.long())
    raises(ValueError, "page_table must have shape \\(batch, max_pages\\) with batch = 3", f, q, kc, vc,
           cu_seqlens_q=cu_q, page_table=torch.zeros(2, 4, dtype=torch.int32, device="cuda"))
    raises(ValueError, "page_table must be on the same device", f, q, kc, vc, cu_seqlens_q=cu_q,
           page_table=torch.zeros(3, 4, dtype=torch.int32))
    raises(ValueError, "cu_seqlens_k and page_table are exclusive", f, q, kc, vc, cu_seqlens_q=cu_q,
           cu_seqlens_k=cu_k, page_table=pt)
    raises(ValueError, "k must have 4 dimensions", f, q, k, v, cu_seqlens_q=cu_q, page_table=pt)


def test_learnable_sink_checks(fake):
    q, k, v = qkv()
    raises(TypeError, "learnable_sink must be a float32", fa4.flash_attn_func, q, k, v,
           learnable_sink=torch.zeros(8, dtype=torch.int32, device="cuda"))
    raises(ValueError, "learnable_sink must have shape \\(heads,\\) = \\(8,\\)", fa4.flash_attn_func, q, k, v,
           learnable_sink=torch.zeros(2, device="cuda"))
    with pytest.raises(AssertionError, match="driver was reached"):
        fa4.flash_attn_func(q, k, v, learnable_sink=torch.zeros(8, device="cuda"))


def test_varlen_validation_cache(fake):
    """Note [validation cache] for flash_attn_varlen_func: a repeated call reuses the problem (the
    same object), a change of any argument's shape or a max_seqlen value is validated afresh.
    (The cached path's pointer re-check needs real CUDA tensors: fake ones have no pointers.)"""
    from fa4 import validate

    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    args = (q, k, v, cu_q, cu_k, mq, mk, None, None, True, (None, None), 0.0)
    p1 = validate.check_varlen(*args)
    assert validate.check_varlen(*args) is p1
    assert p1 == validate._check_varlen(*args)
    p2 = validate.check_varlen(q, k, v, cu_q, cu_k, mq + 1, mk, None, None, True, (None, None), 0.0)
    assert p2.seqlen_q == mq + 1 and p2 is not p1
    short = torch.empty(3, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="cu_seqlens_k must have length"):
        validate.check_varlen(q, k, v, cu_q, short, mq, mk, None, None, True, (None, None), 0.0)


# Found by an audit of bad inputs (v0.32): each used to pass, or to fail deep inside, or late.


def test_positional_arguments_landing_on_qv(fake):
    """flash_attn.cute's qv is the fourth parameter: a FlashAttention-2-style positional call, or
    cu_seqlens given by position, gets a message saying so."""
    q, k, v = qkv()
    raises(TypeError, "qv must be a torch.Tensor or None, got 0.0: qv is flash_attn.cute's fourth parameter",
           fa4.flash_attn_func, q, k, v, 0.0, 0.125, True)
    q, k, v, cu_q, cu_k, mq, mk = varlen_inputs()
    raises(NotImplementedError, "looks like cu_seqlens given by position", fa4.flash_attn_varlen_func, q, k, v, cu_q,
           cu_k, mq, mk)


def test_numpy_scalars_are_numbers(fake):
    np = pytest.importorskip("numpy")
    q, k, v = qkv()
    with pytest.raises(AssertionError, match="driver was reached"):
        fa4.flash_attn_func(q, k, v, softmax_scale=np.float32(0.1), window_size=(np.int64(8), np.int32(0)),
                            softcap=np.float64(30.0), num_splits=np.int64(2))
    raises(TypeError, "softmax_scale must be a float", fa4.flash_attn_func, q, k, v, softmax_scale=np.bool_(True))


@pytest.mark.parametrize("name,value,match", [
    ("softmax_scale", 10 ** 400, "softmax_scale must be a finite positive number"),
    ("softmax_scale", 1e39, "softmax_scale must be a normal float32 value"),
    ("softmax_scale", 1e-40, "softmax_scale must be a normal float32 value"),
    ("softcap", 10 ** 400, "softcap must be a finite number"),
    ("softcap", 1e-40, "softcap must be 0 or a normal float32 value"),
])
def test_scalars_in_float32_range(fake, name, value, match):
    q, k, v = qkv()
    raises(ValueError, match, fa4.flash_attn_func, q, k, v, **{name: value})


def test_paged_cache_without_pages(fake):
    q, _, _, cu_q, _, _, _ = varlen_inputs()
    kc = cuda(0, 16, 2, 64)
    raises(ValueError, r"the paged cache\) must have num_pages >= 1", fa4.flash_attn_varlen_func, q, kc, kc,
           cu_seqlens_q=cu_q, page_table=torch.zeros(3, 4, dtype=torch.int32, device="cuda"))


def test_max_seqlen_above_the_packed_tokens_is_the_bound():
    q, k, v = torch.empty(21, 4, 64, dtype=BF16), torch.empty(44, 2, 64, dtype=BF16), torch.empty(44, 2, 64, dtype=BF16)
    cu_q, cu_k = torch.tensor([0, 3, 20, 21], dtype=torch.int32), torch.tensor([0, 5, 14, 44], dtype=torch.int32)
    with validate.allow_any_device():
        p = validate.check_varlen(q, k, v, cu_q, cu_k, 2 ** 40, 10 ** 6, None, None, False, (None, None), 0.0)
    assert (p.seqlen_q, p.seqlen_k) == (21, 44)


def test_kernel_options_field_types():
    raises(TypeError, "KernelOptions.exp2_emu_frac must be a float", fa4.KernelOptions, exp2_emu_frac="0.5")
    raises(TypeError, "KernelOptions.rescale_threshold must be a float", fa4.KernelOptions, rescale_threshold="1")
    assert fa4.KernelOptions(bwd_tile_m=64).sets_backward() and not fa4.KernelOptions(tile_m=64).sets_backward()


def test_sm90_forward_refuses_a_thread_count_it_does_not_run():
    from fa4.config import AttnProblem
    from fa4.fwd import sm90

    p = AttnProblem("bf16", 2, 1024, 1024, 8, 8, 128, 128, 128 ** -0.5)
    assert sm90.make_config(p, fa4.KernelOptions(num_threads=384), "sm_90a", True).tile_m == 128
    raises(ValueError, "KernelOptions.num_threads=33: the sm90 forward runs 384 threads", sm90.make_config, p,
           fa4.KernelOptions(num_threads=33), "sm_90a", True)


def test_backward_options_checked_before_the_forward(fake, monkeypatch):
    """A backward option the backward's family refuses raises before the forward runs (the driver
    fixture fails the test if the forward is reached)."""
    from fa4 import arch

    monkeypatch.setattr(arch, "device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    q, k, v = (t.requires_grad_() for t in qkv(d=128))
    for opts, match in ((fa4.KernelOptions(bwd_tile_m=7), "bwd_tile_m=7"),
                        (fa4.KernelOptions(bwd_num_threads=33), "bwd_num_threads=33")):
        raises(ValueError, match, fa4.flash_attn_func, q, k, v, kernel_options=opts)


def test_block_sparse_argument_checks(fake):
    from mods_cases import BlockSparseTensorsTorch

    q, k, v = qkv(sq=256, sk=256, d=128)
    cnt = torch.zeros(2, 8, 2, dtype=torch.int32, device="cuda")
    idx = torch.zeros(2, 8, 2, 2, dtype=torch.int32, device="cuda")
    raises(TypeError, "block_sparse_tensors.mask_block_cnt must be a torch.Tensor, got NoneType", fa4.flash_attn_func,
           q, k, v, block_sparse_tensors=BlockSparseTensorsTorch(None, idx, cnt, idx, block_size=None))
    bst = BlockSparseTensorsTorch(cnt, idx, None, None, block_size=(128, 128))
    raises(ValueError, "aux_tensors are read by score_mod / mask_mod only", fa4.flash_attn_func, q, k, v,
           block_sparse_tensors=bst, aux_tensors=[torch.zeros(4, device="cuda")])
    q0, k0, v0 = qkv(sq=256, sk=0, d=128)  # no keys: no blocks; the dense call's empty result
    with pytest.raises(AssertionError, match="driver was reached"):
        fa4.flash_attn_func(q0, k0, v0, block_sparse_tensors=bst)
