"""Shared pieces of the forward GPU tests of every family: mask kinds, the reference check, the
pairwise grid builder and the varlen cases (Note [pruned grid] in test_fwd_sm80_gpu.py)."""

from __future__ import annotations

import itertools

import torch

import fa4
from fa4.testing import attention_ref, check_close, random_varlen

FAMILY_MODULES = {"sm80": "fa4.fwd.sm80", "sm90": "fa4.fwd.sm90"}


def run_with_fields(monkeypatch, family: str, fields: dict, call):
    """``call(KernelOptions(arch=family))`` with the family's ``make_config`` results overridden by
    ``fields`` (config fields the public options do not expose); the plan cache is cleared around
    it, so the override takes effect and does not leak into later calls."""
    import dataclasses
    import importlib

    from fa4 import ops

    mod = importlib.import_module(FAMILY_MODULES[family])
    make = mod.make_config
    monkeypatch.setattr(mod, "make_config", lambda *a, **kw: dataclasses.replace(make(*a, **kw), **fields))
    ops._plans.clear()
    try:
        return call(fa4.KernelOptions(arch=family))
    finally:
        monkeypatch.setattr(mod, "make_config", make)
        ops._plans.clear()


MASKS = ["none", "causal", "local"]
SOFTCAPS = [0.0, 15.0]
HEADS = [(4, 4), (6, 2), (4, 1)]  # MHA, GQA, MQA


def window(mask: str, seqlen_q: int, seqlen_k: int):
    """(causal, window_size) for a mask kind; the local window is narrower than a tile on one side
    and wider on the other, bottom-right aligned."""
    if mask == "causal":
        return True, (None, None)
    if mask == "local":
        return False, (max(seqlen_k // 3, 7), 37)
    return False, (None, None)


def check(out, lse, q, k, v, **ref_kw):
    """``out`` and ``lse`` against the float32 reference with FlashAttention's rule."""
    out_ref, lse_ref = attention_ref(q, k, v, **ref_kw)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False, **ref_kw)
    check_close("out", out, out_ref, out_pt)
    check_close("lse", lse, lse_ref, lse_pt)


def pairwise_cases(head_dims, seqlens, softcap_of):
    """Head dim i with seqlens j for every (i, j); mask and heads are Latin-square functions of
    (i, j) and the softcap ``softcap_of(i, j)`` (an index into SOFTCAPS)."""
    return [(d, s, MASKS[(i + j) % 3], SOFTCAPS[softcap_of(i, j) % 2], HEADS[(i + 2 * j) % 3])
            for i, d in enumerate(head_dims) for j, s in enumerate(seqlens)]


def missing_pairs(cases, head_dims, seqlens):
    """Pairs of values of two factors that no case covers (empty for a pairwise grid)."""
    factors = [head_dims, seqlens, MASKS, SOFTCAPS, HEADS]
    missing = []
    for a, b in itertools.combinations(range(len(factors)), 2):
        seen = {(c[a], c[b]) for c in cases}
        missing += [(a, b, p) for p in itertools.product(factors[a], factors[b]) if p not in seen]
    return missing


def case_id(c) -> str:
    return f"d{c[0]}-s{c[1][0]}x{c[1][1]}-{c[2]}-cap{c[3]:g}-h{c[4][0]}k{c[4][1]}"


VARLEN_CASES = [
    # (d, batch, max_seqlen_q, max_seqlen_k, mask, seqused_k, heads); every batch holds a sequence
    # of one query and one of one key (random_varlen)
    (64, 5, 300, 300, "none", False, (4, 4)),
    (128, 7, 1000, 513, "causal", False, (6, 2)),
    (128, 4, 129, 2000, "local", True, (4, 1)),
    (256, 3, 700, 700, "causal", True, (2, 2)),
    (96, 9, 64, 1100, "none", True, (4, 2)),
    (192, 2, 1, 77, "causal", False, (4, 4)),
]


def run_varlen_case(case, options) -> None:
    d, batch, max_q, max_k, mask, seqused, heads = case
    vb = random_varlen(batch, max_q, heads[0], heads[1], d, torch.bfloat16, "cuda", max_seqlen_k=max_k,
                       with_seqused_k=seqused, seed=batch * 31 + d)
    causal, win = window(mask, max_q, max_k)
    out, lse = fa4.flash_attn_varlen_func(
        vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, max_seqlen_q=vb.max_seqlen_q,
        max_seqlen_k=vb.max_seqlen_k, seqused_k=vb.seqused_k, causal=causal, window_size=win,
        return_lse=True, kernel_options=options)
    check(out, lse, vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
          seqused_k=vb.seqused_k, causal=causal, window_size=win)


LOOSE_KINDS = ["decode", "decode-split", "prefill-causal", "prefill-gqa"]


def loose_bound_inputs(kind: str, seed: int):
    """Inputs of the tests of varlen calls without max_seqlen (both families): ``(lq, lk, h, hk, d,
    causal, cu_seqlens_q, cu_seqlens_k, q, k, v)``. ``kind``: decode rows (48 sequences of 1 query;
    ``decode-split``: 8, with keys long enough to split), a causal MHA d64 prefill or a causal GQA
    16 / 4 d128 prefill of 9 sequences (``decode-paged`` builds as ``decode``); ``seed`` draws the
    lengths, the data is seeded by ``len(kind)``."""
    g = torch.Generator().manual_seed(seed)
    if kind.startswith("decode"):
        b = 8 if kind == "decode-split" else 48
        lq = [1] * b
        lk = torch.randint(1, 9000 if kind == "decode-split" else 3000, (b,), generator=g).tolist()
        h, hk, d, causal = 32, 8, 128, False
    else:
        lq = lk = torch.randint(1, 1500, (9,), generator=g).tolist()
        h, hk, d, causal = (8, 8, 64, True) if kind == "prefill-causal" else (16, 4, 128, True)
    cq, ck = (torch.tensor([0] + list(itertools.accumulate(ls)), dtype=torch.int32, device="cuda") for ls in (lq, lk))
    gd = torch.Generator("cuda").manual_seed(len(kind))
    q = torch.randn(sum(lq), h, d, device="cuda", dtype=torch.bfloat16, generator=gd)
    k, v = (torch.randn(sum(lk), hk, d, device="cuda", dtype=torch.bfloat16, generator=gd) for _ in range(2))
    return lq, lk, h, hk, d, causal, cq, ck, q, k, v
