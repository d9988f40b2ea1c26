"""Note [Fast path] (fa4/ops.py): a repeated dense forward call skips the layers between
flash_attn_func and the kernel, with the same kernel and the same arguments as the full way. On the
CPU: the kernel is a recorder, the tensors CPU tensors under validate.allow_any_device (the
``calls`` fixture of tests/conftest.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fa4
from fa4 import jit, ops
from fa4.fwd import sm90


def _qkv(b=1, sq=128, sk=512, h=16, hk=16, d=128, dv=None):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(b, sq, h, d, generator=gen, dtype=torch.bfloat16),
            torch.randn(b, sk, hk, d, generator=gen, dtype=torch.bfloat16),
            torch.randn(b, sk, hk, dv or d, generator=gen, dtype=torch.bfloat16))


def _fast_entries():
    return list(ops._fast.values())


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(64, 8)), dict(softcap=20.0),
                                dict(return_lse=True), dict(softmax_scale=0.07, causal=True)])
@pytest.mark.parametrize("shape", [dict(), dict(b=2, sq=3, sk=700, h=8, hk=2), dict(d=64, sq=200),
                                   dict(d=192, dv=128, sq=100, sk=300)])
def test_fast_call_launches_what_the_full_way_does(calls, kw, shape):
    q, k, v = _qkv(**shape)
    first = fa4.flash_attn_func(q, k, v, **kw)
    entries = _fast_entries()
    assert len(entries) == 1 and entries[0][0] is not None
    n = len(calls)  # (split-KV: the kernel, then the combine)
    second = fa4.flash_attn_func(q, k, v, **kw)
    assert len(calls) == 2 * n
    (cfg1, a1), (cfg2, a2) = calls[0], calls[n]
    assert cfg1 == cfg2
    assert len(a2) == len(jit.kernel_class(cfg2).fake_args(cfg2)) - 1  # every runtime argument (not the stream)
    # Same tensors in, same scalars; the outputs are fresh tensors of the same shapes and dtypes.
    assert a1[:3] == a2[:3] and a1[5:] == a2[5:]
    for x, y in zip(a1[3:5], a2[3:5]):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.shape == y.shape and x.dtype == y.dtype
            assert n == 2 or x.data_ptr() != y.data_ptr()  # (split-KV's partials are freed: they may be reused)
    assert (first[1] is None) == (second[1] is None) == (not kw.get("return_lse"))
    assert second[0].shape == first[0].shape


def test_fast_path_steps_aside(calls):
    """Gradients, other hints, a cleared plan cache and a misaligned pointer take the full way."""
    q, k, v = _qkv()
    fa4.flash_attn_func(q, k, v)
    (call, _), = _fast_entries()
    assert call is not None
    full = []
    orig = ops.forward
    try:
        ops.forward = lambda *a, **kw: full.append(1) or orig(*a, **kw)
        fa4.flash_attn_func(q, k, v)
        assert not full  # the fast path
        fa4.flash_attn_func(q.requires_grad_(), k, v)  # gradients: the autograd function, the full way
        q.requires_grad_(False)
        assert len(full) == 1
        fa4.flash_attn_func(q, k, v, num_splits=2)  # another signature: the full way once
        assert len(full) == 2
        buf = torch.empty(q.numel() + 8, dtype=q.dtype)
        q_odd = buf[1:1 + q.numel()].view(q.shape)  # a 2-byte offset
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fa4.flash_attn_func(q_odd, k, v)  # the full way, on an aligned copy (Note [Copied layouts])
        assert len(full) == 3
        ops._plans.clear()
        fa4.flash_attn_func(q, k, v)
        assert len(full) == 4
    finally:
        ops.forward = orig


def test_fast_path_validates_what_it_keys(calls):
    """A flag of the wrong type is a different signature, checked the full way."""
    q, k, v = _qkv()
    fa4.flash_attn_func(q, k, v)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        fa4.flash_attn_func(q, k, v, return_lse=1)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        fa4.flash_attn_func(q, k, v, deterministic="yes")


def test_fast_path_honours_nan_filled_outputs(calls):
    q, k, v = _qkv()
    fa4.flash_attn_func(q, k, v)
    ops.set_nan_fill(True)
    try:
        out, _ = fa4.flash_attn_func(q, k, v)  # (the recorder writes nothing)
        assert out.isnan().all()
    finally:
        ops.set_nan_fill(False)


def _same_launches(calls, n, inputs):
    """The first call's launches (``n``: kernel, and combine with split-KV) against the next call's:
    the caller's tensors (``inputs``) in the same places (the same memory, shapes and strides: a
    swapped pair of same-shaped tensors fails), fresh outputs of the same shapes and dtypes."""
    assert len(calls) == 2 * n
    ptrs = {t.data_ptr() for t in inputs if t is not None}
    for (cfg1, a1), (cfg2, a2) in zip(calls[:n], calls[n:]):
        assert cfg1 == cfg2 and len(a1) == len(a2) == len(jit.kernel_class(cfg2).fake_args(cfg2)) - 1
        for x, y in zip(a1, a2):
            if isinstance(x, torch.Tensor):
                assert isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype
                if x.data_ptr() in ptrs:
                    assert y.data_ptr() == x.data_ptr() and y.stride() == x.stride()
                else:
                    assert y.data_ptr() not in ptrs
            else:
                assert x == y


@pytest.mark.parametrize("case", ["packed", "paged-decode", "batched-q-packed-k", "seqused"])
def test_fast_varlen_calls_launch_what_the_full_way_does(calls, case):
    gen = torch.Generator().manual_seed(1)
    bf = dict(dtype=torch.bfloat16)
    lens = torch.tensor([0, 3, 20, 21], dtype=torch.int32)
    kw = {}
    if case == "packed":
        q, k, v = torch.randn(21, 8, 128, **bf), torch.randn(44, 2, 128, **bf), torch.randn(44, 2, 128, **bf)
        kw = dict(cu_seqlens_q=lens, cu_seqlens_k=torch.tensor([0, 5, 14, 44], dtype=torch.int32), max_seqlen_q=17,
                  max_seqlen_k=30, causal=True)
    elif case == "paged-decode":
        q = torch.randn(3, 32, 128, generator=gen, **bf)
        k, v = torch.randn(40, 16, 8, 128, **bf), torch.randn(40, 16, 8, 128, **bf)
        kw = dict(cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32), max_seqlen_q=1,
                  page_table=torch.randint(0, 40, (3, 8), dtype=torch.int32, generator=gen),
                  seqused_k=torch.tensor([100, 17, 128], dtype=torch.int32), max_seqlen_k=128)
    elif case == "batched-q-packed-k":
        q = torch.randn(3, 7, 8, 128, **bf)
        k, v = torch.randn(44, 2, 128, **bf), torch.randn(44, 2, 128, **bf)
        kw = dict(cu_seqlens_k=torch.tensor([0, 5, 14, 44], dtype=torch.int32), max_seqlen_k=30)
    else:
        q, k, v = torch.randn(3, 64, 8, 64, **bf), torch.randn(3, 300, 8, 64, **bf), torch.randn(3, 300, 8, 64, **bf)
        kw = dict(seqused_k=torch.tensor([300, 17, 128], dtype=torch.int32), return_lse=True)
    full = []
    orig = ops.forward
    try:
        ops.forward = lambda *a, **k_: full.append(1) or orig(*a, **k_)
        first = fa4.flash_attn_varlen_func(q, k, v, **kw)
        n = len(calls)
        if case == "paged-decode":
            kw["max_seqlen_k"] = 129  # a decode loop's growing bound: not part of a paged call's key
        second = fa4.flash_attn_varlen_func(q, k, v, **kw)
    finally:
        ops.forward = orig
    assert len(full) == 1, "the second call went the full way"
    _same_launches(calls, n, [q, k, v] + [x for x in kw.values() if isinstance(x, torch.Tensor)])
    assert first[0].shape == second[0].shape and (first[1] is None) == (second[1] is None)
    if first[1] is not None:
        assert first[1].shape == second[1].shape


def test_fast_path_keys_and_staleness(calls, monkeypatch):
    """A paged decode loop keeps its entry whatever form its (unread) max_seqlen_k takes; the SM
    count is read per launch; a paged entry follows FA4_ARCH; clearing the plans clears the entries."""
    np = pytest.importorskip("numpy")
    q = torch.randn(3, 32, 128, dtype=torch.bfloat16)
    k, v = torch.randn(40, 16, 8, 128, dtype=torch.bfloat16), torch.randn(40, 16, 8, 128, dtype=torch.bfloat16)
    kw = dict(cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32), max_seqlen_q=1, num_splits=1,
              page_table=torch.zeros(3, 8, dtype=torch.int32), seqused_k=torch.tensor([100, 17, 128], dtype=torch.int32))
    for mk in (100, np.int32(101), torch.tensor(102), None):
        fa4.flash_attn_varlen_func(q, k, v, max_seqlen_k=mk, **kw)
    assert len(ops._fast) == 1
    monkeypatch.setattr(sm90, "_num_sms", lambda device: 7)
    qd, kd, vd = _qkv()
    fa4.flash_attn_func(qd, kd, vd)
    fa4.flash_attn_func(qd, kd, vd)
    assert calls[-1][1][16] == 7  # (the persistent grid's size, first of the sm90 kernel's extra arguments)
    monkeypatch.setenv("FA4_ARCH", "sm80")
    fa4.flash_attn_varlen_func(q, k, v, **kw)
    assert len(ops._fast) == 3  # a new signature for the paged call under another FA4_ARCH
    ops._plans.clear()
    assert not ops._fast


@pytest.mark.parametrize("nan_fill", [False, True])
def test_empty_like_is_contiguous(nan_fill, monkeypatch):
    """``ops._empty_like`` (every output's allocation, the fast path's too) gives a contiguous tensor
    of the input's shape, dtype and device whatever its strides (Note [Contiguous outputs]), NaN-filled
    in the tests' mode; through ``empty_like``, which costs less host time per call than ``empty``
    (RESULTS v0.41)."""
    monkeypatch.setattr(ops, "_nan_fill", nan_fill)
    base = torch.randn(2, 5, 3, 8, dtype=torch.bfloat16)
    for t in (base, base.transpose(1, 2), base[:, ::2], base.expand(2, 5, 3, 8)):
        out = ops._empty_like(t)
        assert out.shape == t.shape and out.dtype == t.dtype and out.device == t.device and out.is_contiguous()
        if nan_fill:
            assert bool(out.isnan().all())


def test_copied_layouts_never_take_the_fast_path(calls):
    """Note [Copied layouts]: a transposed q runs on a contiguous copy every call, and its signature
    never gets a fast entry (which would launch on the caller's layout); the launches see a q with
    unit last stride and the values of the caller's."""
    q, k, v = _qkv()
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # q's values, last stride != 1
    assert qt.stride(-1) != 1 and torch.equal(qt, q)
    before = set(ops._fast)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fa4.flash_attn_func(qt, k, v)
        fa4.flash_attn_func(qt, k, v)
    assert set(ops._fast) == before  # no entry for the transposed signature
    assert len(calls) == 2
    for _, args in calls:
        launched_q = next(a for a in args
                          if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1:] == q.shape[1:])
        assert launched_q.stride(-1) == 1 and torch.equal(launched_q, q)
