"""flash_attn.cute calls that a drop-in must take as that API does (CPU: the kernel is a recorder, the
tensors CPU tensors under validate.allow_any_device: the ``calls`` fixture of tests/conftest.py):

* ``out`` (and the gradients) contiguous whatever q's strides (Note [Contiguous outputs] in fa4/ops.py);
* the lse returned whenever an input requires grad (Note [lse with inputs that require grad] in
  fa4/interface.py);
* head dims 8, 16 and 24 run on zero-padded copies (Note [Small head dims] in fa4/interface.py);
* the varlen call's split-KV scheduling knobs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fa4
from fa4 import interface


def _rand(*shape, requires_grad=False):
    gen = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, generator=gen, dtype=torch.bfloat16).requires_grad_(requires_grad)


def test_out_is_contiguous_for_a_transposed_q(calls):
    """q, k, v in SDPA's (b, h, s, d) memory, passed as (b, s, h, d) views: out is contiguous, so the
    usual ``out.view(b, s, h * d)`` works, as with flash_attn.cute's."""
    b, h, s, d = 2, 4, 64, 64
    q, k, v = (_rand(b, h, s, d).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    out, _ = fa4.flash_attn_func(q, k, v, causal=True)
    assert out.shape == (b, s, h, d) and out.is_contiguous()
    out.view(b, s, h * d)
    # (192, 128): v's head dim
    q, k = (_rand(b, h, s, 192).transpose(1, 2) for _ in range(2))
    out, _ = fa4.flash_attn_func(q, k, _rand(b, s, h, 128))
    assert out.shape == (b, s, h, 128) and out.is_contiguous()


def test_gradients_are_contiguous(calls):
    """The backward's dq, dk, dv are contiguous for transposed inputs (the custom op's fake
    implementation says so; a compiled graph checks the real strides against it)."""
    b, h, s, d = 1, 2, 32, 64
    q, k, v = (_rand(b, h, s, d).transpose(1, 2).requires_grad_() for _ in range(3))
    out, _ = fa4.flash_attn_func(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert any(type(cfg).__name__.startswith("Bwd") for cfg, _ in calls)  # (the backward's kernels ran)
    assert all(g.is_contiguous() and g.shape == q.shape for g in grads)


@pytest.mark.parametrize("varlen", [False, True])
def test_lse_comes_back_when_an_input_requires_grad(calls, varlen):
    """Note [lse with inputs that require grad]: ``out, lse = f(q, k, v)`` in training gives the lse
    (as flash_attn.cute does), also under no_grad on leaves that require grad; an inference call
    without return_lse gives None."""
    b, s, h, d = 2, 40, 4, 64

    def call(**kw):
        if varlen:
            cu = torch.tensor([0, s, 2 * s], dtype=torch.int32)
            t = [x.reshape(b * s, h, d).detach().requires_grad_(x.requires_grad) for x in (q, k, v)]
            return fa4.flash_attn_varlen_func(*t, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s,
                                              **kw)
        return fa4.flash_attn_func(q, k, v, **kw)

    want = (h, b * s) if varlen else (b, h, s)
    q, k, v = (_rand(b, s, h, d) for _ in range(3))
    assert call()[1] is None
    assert tuple(call(return_lse=True)[1].shape) == want
    q.requires_grad_()
    out, lse = call()
    assert lse is not None and tuple(lse.shape) == want and lse.dtype == torch.float32
    assert out.requires_grad and lse.requires_grad
    with torch.no_grad():
        assert call()[1] is not None


def test_small_head_dims_run_padded(calls):
    """Note [Small head dims]: d 16 (and v's 8) run as 32 on zero-padded copies with the real head
    dim's softmax_scale, the output cut back to v's head dim, contiguous; a one-time warning;
    explain says so; paged K/V still refuse."""
    b, s, h = 2, 50, 4
    q, k, v = _rand(b, s, h, 16), _rand(b, s, h, 16), _rand(b, s, h, 8)
    interface._hint_warned.discard("small_head_dim")
    with pytest.warns(UserWarning, match="padded with zeros to 32"):
        out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (b, s, h, 8) and out.is_contiguous() and lse.shape == (b, h, s)
    cfg, args = calls[0]
    assert cfg.head_dim == 32 and cfg.head_dim_v == 32
    kq, kk, kv = args[:3]
    assert kq.shape[-1] == kk.shape[-1] == kv.shape[-1] == 32
    assert torch.equal(kq[..., :16], q) and not kq[..., 16:].any() and not kv[..., 8:].any()
    assert pytest.approx(16 ** -0.5) in [a for a in args if isinstance(a, float)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa4.flash_attn_func(q, k, v, softmax_scale=0.3)  # (once per process)
    assert pytest.approx(0.3) in [a for a in calls[-1][1] if isinstance(a, float)]
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    out, _ = fa4.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=30,
                                        max_seqlen_k=30)
    assert out.shape == (s, h, 8) and calls[-1][0].head_dim == 32
    assert any("padded with zeros" in n for n in fa4.explain(q, k, v, capability=(9, 0)).notes)
    pages = _rand(4, 16, h, 16)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 8 in"):
        fa4.flash_attn_varlen_func(q[0], pages, pages, cu_seqlens_q=cu, max_seqlen_q=30,
                                   page_table=torch.zeros(2, 2, dtype=torch.int32),
                                   seqused_k=torch.tensor([20, 30], dtype=torch.int32))
    for bad in (4, 12, 264):  # not a multiple of 8 or over 256: refused as before
        with pytest.raises(ValueError, match="head_dim"):
            fa4.flash_attn_func(_rand(1, 8, 2, bad), _rand(1, 8, 2, bad), _rand(1, 8, 2, bad))
    # another error of a small-head-dim call names the user's shapes, not the padded ones
    with pytest.raises(ValueError, match=r"k \(1, 8, 2, 16\) and v \(1, 9, 2, 16\)"):
        fa4.flash_attn_func(_rand(1, 8, 2, 16), _rand(1, 8, 2, 16), _rand(1, 9, 2, 16))
    # the lse under no_grad on leaves that require grad, as at other head dims
    leaf = _rand(2, 50, 4, 16, requires_grad=True)
    with torch.no_grad():
        assert fa4.flash_attn_func(leaf, k, v)[1] is not None
    assert interface._warn_padded._dynamo_marked_constant  # (no graph break under torch.compile)


def test_varlen_scheduling_knobs(calls):
    """flash_attn.cute's ``disable_scheduler_metadata`` (fa4 builds none) is taken; ``seqlen_k_per_split``
    is a hint fa4 ignores, with a one-time warning; wrong types are refused by name."""
    q = _rand(60, 4, 64)
    cu = torch.tensor([0, 25, 60], dtype=torch.int32)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=35, max_seqlen_k=35)
    fa4.flash_attn_varlen_func(q, q, q, disable_scheduler_metadata=True, **kw)
    interface._hint_warned.discard("seqlen_k_per_split")
    with pytest.warns(UserWarning, match="seqlen_k_per_split=256 is a performance hint"):
        fa4.flash_attn_varlen_func(q, q, q, seqlen_k_per_split=256, **kw)
    with pytest.raises(TypeError, match="disable_scheduler_metadata"):
        fa4.flash_attn_varlen_func(q, q, q, disable_scheduler_metadata=1, **kw)
    with pytest.raises(ValueError, match="seqlen_k_per_split must be positive"):
        fa4.flash_attn_varlen_func(q, q, q, seqlen_k_per_split=0, **kw)
    with pytest.raises(TypeError, match="seqlen_k_per_split"):
        fa4.flash_attn_varlen_func(q, q, q, seqlen_k_per_split=2.0, **kw)
    # metadata that the call disables is not read (flash_attn.cute's rule), else refused by name
    fa4.flash_attn_varlen_func(q, q, q, scheduler_metadata=object(), disable_scheduler_metadata=True, **kw)
    with pytest.raises(NotImplementedError, match="scheduler_metadata"):
        fa4.flash_attn_varlen_func(q, q, q, scheduler_metadata=object(), **kw)


def test_backward_only_refusals_wait_for_the_backward(calls):
    """Note [Refusing in the backward]: a score_mod without score_mod_bwd, paged K/V and seqused_q run
    their forward with inputs that require grad (flash_attn.cute's do); the backward raises the reason."""
    from mods_cases import SCORE_MODS

    q = _rand(2, 40, 4, 64, requires_grad=True)
    k, v = _rand(2, 40, 4, 64), _rand(2, 40, 4, 64)
    out, lse = fa4.flash_attn_func(q, k, v, score_mod=SCORE_MODS["identity"]()[0])
    assert len(calls) == 1 and out.requires_grad and lse is not None
    with pytest.raises(ValueError, match="needs its derivative, score_mod_bwd"):
        out.float().sum().backward()
    pages = _rand(6, 16, 4, 64)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    used = torch.tensor([40, 33], dtype=torch.int32)
    out, _ = fa4.flash_attn_varlen_func(q, pages, pages, page_table=table, seqused_k=used, causal=True)
    assert out.shape == q.shape and out.requires_grad
    with pytest.raises(NotImplementedError, match="page_table"):
        out.float().sum().backward()
    out, _ = fa4.flash_attn_varlen_func(q, k, v, seqused_q=used)
    loss = out.float().sum()
    for _ in range(2):  # a fresh exception each time (a retained graph runs the node again)
        with pytest.raises(NotImplementedError, match="seqused_q") as e:
            loss.backward(retain_graph=True)
        assert len(list(e.traceback)) < 12
    with torch.no_grad():
        assert not fa4.flash_attn_varlen_func(q, k, v, seqused_q=used)[0].requires_grad
