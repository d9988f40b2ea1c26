"""``rescale_skip`` (Note [Conditional rescale] in fa4/softmax.py): with a rescale threshold of 0 a
warp skips the O multiplication of a K block in which none of its rows grew its max. Every skipped
scale is exactly 1, so outputs and LSE must be bit-identical to the kernel that always multiplies
(and pass the reference check), for both forward families, with O rescaled after the softmax or
before the next ``P V`` (sm90), on inputs whose row maxes never move after the first block, move in
every block, or are random."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import fa4
from fa4 import ops
from fa4.testing import random_qkv, random_varlen
from fwd_cases import check

FAMILIES = {"sm80": "fa4.fwd.sm80", "sm90": "fa4.fwd.sm90"}


def _run(monkeypatch, family, fields, call):
    mod = importlib.import_module(FAMILIES[family])
    make = mod.make_config
    monkeypatch.setattr(mod, "make_config", lambda *a, **kw: dataclasses.replace(make(*a, **kw), **fields))
    ops._plans.clear()
    try:
        return call(fa4.KernelOptions(arch=family, rescale_threshold=0.0))
    finally:
        monkeypatch.setattr(mod, "make_config", make)
        ops._plans.clear()


@pytest.fixture(autouse=True)
def _family_runs(request):
    fam = request.node.callspec.params.get("family") if hasattr(request.node, "callspec") else None
    if "gpu" in request.keywords and fam == "sm90" and torch.cuda.is_available() \
            and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels run on compute capability 9.x only")


def _shaped(q, k, kind):
    """``random``: as drawn. Otherwise every query gets a shared direction ``u`` (``q + 3u``) and
    the keys a multiple of it: ``fixed``, key 0 alone (``3 sqrt(d) u``, far above the rest for most
    rows), so maxes rarely move after the first block; ``growing``, a ramp along the keys, so
    every block moves every row's max."""
    if kind == "random":
        return q, k
    d = q.shape[-1]
    g = torch.Generator(device="cpu").manual_seed(d)
    u = torch.randn(d, generator=g).to(q.device)
    u = u / u.norm()
    q = (q.float() + 3 * u).to(q.dtype)
    kf = k.float()
    if kind == "fixed":
        kf[:, 0] = 3 * d**0.5 * u
    else:
        ramp = torch.linspace(0.0, 2.0 * d**0.5, k.shape[1], device=k.device)[None, :, None, None]
        kf = kf + ramp * u
    return q, kf.to(k.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(113, 203), (1000, 1000), (1, 4096)])
@pytest.mark.parametrize("kind", ["random", "fixed", "growing"])
def test_same_bits_as_always_rescaling(monkeypatch, family, d, causal, seqlens, kind):
    q, k, v = random_qkv(2, seqlens[0], seqlens[1], 4, 2, d, torch.bfloat16, "cuda", seed=seqlens[0] + d)
    q, k = _shaped(q, k, kind)

    def call(opts):
        return fa4.flash_attn_func(q, k, v, causal=causal, return_lse=True, kernel_options=opts)

    out0, lse0 = _run(monkeypatch, family, dict(rescale_skip=False), call)
    out1, lse1 = _run(monkeypatch, family, dict(rescale_skip=True), call)
    check(out1, lse1, q, k, v, causal=causal)
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)
    if family == "sm90":  # O rescaled before the next P V, behind the same branch
        out2, lse2 = _run(monkeypatch, family, dict(rescale_skip=True, rescale_o_before_pv=True), call)
        out3, lse3 = _run(monkeypatch, family, dict(rescale_skip=False, rescale_o_before_pv=True), call)
        assert torch.equal(out2, out3) and torch.equal(lse2, lse3)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_same_bits_varlen_local(monkeypatch, family):
    """Rows with no visible key (a local window past the keys, seqused_k) keep -inf maxes."""
    vb = random_varlen(5, 700, 4, 2, 128, torch.bfloat16, "cuda", max_seqlen_k=900, with_seqused_k=True, seed=5)

    def call(opts):
        return fa4.flash_attn_varlen_func(
            vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
            max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, seqused_k=vb.seqused_k,
            window_size=(60, 0), return_lse=True, kernel_options=opts)

    out0, lse0 = _run(monkeypatch, family, dict(rescale_skip=False), call)
    out1, lse1 = _run(monkeypatch, family, dict(rescale_skip=True), call)
    check(out1, lse1, vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
          seqused_k=vb.seqused_k, window_size=(60, 0))
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)
