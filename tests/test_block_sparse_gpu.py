"""flash_attn.cute's block_sparse_tensors on the GPU (fa4/block_sparse.py): outputs and gradients
against the float32 reference masked by the same block lists, both families (the sm90 forward
skipping the hidden blocks, including unaligned block sizes and a tile with no visible block; the
sm90 backward narrowing each K block's Q blocks, Note [Block skip in the backward]); and against
flash-attn-4's own block-sparse forward on the same inputs where it is installed."""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4.testing import attention_ref, check_close, grad_noise_floor, random_qkv
from fwd_cases import check
from mods_cases import MASK_MODS, block_sparse_twin, document_block_sparse, random_block_sparse


def _grads(out, lse, inputs, ref_kw):
    """(out, lse) gradients against the float32 reference's, by the pass rule with the floor."""
    gen = torch.Generator("cuda").manual_seed(3)
    g = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    glse = torch.randn(lse.shape, device="cuda", generator=gen)
    got = torch.autograd.grad((out, lse), inputs, (g, glse))
    q32 = [t.detach().float().requires_grad_() for t in inputs]
    want = torch.autograd.grad(attention_ref(*q32, **ref_kw), q32, (g.float(), glse))
    qlp = [t.detach().requires_grad_() for t in inputs]
    pt = torch.autograd.grad(attention_ref(*qlp, upcast=False, **ref_kw), qlp, (g, glse))
    floors = grad_noise_floor(*inputs, g)
    for name, a, r, p in zip(("dq", "dk", "dv"), got, want, pt):
        check_close(name, a, r, p, extra_atol=floors[name])


def _skipping() -> bool:
    """Whether a forward plan made since the plan cache was cleared skips blocks (FwdSm90Config.block_skip)."""
    return any(getattr(cfg, "block_skip", ()) for _, cfg in fa4.ops._plans.values()
               if type(cfg).__name__.startswith("Fwd"))


CASES = [  # (family, head dim, (seqlen_q, seqlen_k), block size, user mask_mod, causal, heads broadcast)
    ("sm90", 128, (1000, 1000), (128, 128), None, False, False),
    ("sm90", 64, (700, 1300), (64, 192), "doc64", False, True),
    ("sm90", 128, (1000, 1000), (128, 128), None, True, False),
    ("sm90", 256, (300, 333), (100, 37), "head_parity", False, False),
    ("sm80", 128, (1000, 777), (128, 128), "doc100", False, False),
    # K rows of more than 32 kernel blocks: Note [Narrowing by ballot] reads them in chunks of 32
    ("sm90", 64, (300, 5000), (64, 192), None, False, False),
    ("sm90", 128, (500, 4500), (128, 128), None, True, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("family,d,seqlens,block,user,causal,hb", CASES,
                         ids=[f"{f}-d{d}-{a}x{b}-{bq}x{bk}-{u}-{'causal' if c else 'full'}{'-hb' if h else ''}"
                              for f, d, (a, b), (bq, bk), u, c, h in CASES])
def test_block_sparse_forward_and_backward(family, d, seqlens, block, user, causal, hb):
    """Random lists of mask and full blocks (and a q block of batch 0 that sees nothing: its rows
    are 0 with lse -inf); forward and gradients against the reference with the same mask."""
    sq, sk = seqlens
    bst, state = random_block_sparse(2, 8, sq, sk, block, "cuda", seed=d + sq, heads_broadcast=hb, empty_row=True)
    um, ut = MASK_MODS[user]() if user else (None, None)
    q, k, v = random_qkv(2, sq, sk, 8, 2, d, torch.bfloat16, "cuda", requires_grad=True, seed=d)
    opts = fa4.KernelOptions(arch=family)
    fa4.ops._plans.clear()
    # (unpacked rows: with pack GQA the sm90 forward computes every block)
    out, lse = fa4.flash_attn_func(q, k, v, mask_mod=um, block_sparse_tensors=bst, causal=causal, return_lse=True,
                                   pack_gqa=False, kernel_options=opts)
    assert _skipping() == (family == "sm90")
    twin = block_sparse_twin(state, block, ut)
    with torch.no_grad():
        check(out, lse, q, k, v, mask_fn=twin, causal=causal)
    _grads(out, lse, (q, k, v), dict(mask_fn=twin, causal=causal))


@pytest.mark.gpu
def test_block_sparse_decode_packed_and_split():
    """Decode shapes with packed GQA rows and split-KV: the table is indexed by the q head."""
    bst, state = random_block_sparse(4, 16, 4, 3000, (128, 128), "cuda", seed=5)
    q, k, v = random_qkv(4, 4, 3000, 16, 2, 128, torch.bfloat16, "cuda", seed=5)
    for pack_gqa, splits in ((True, 3), (False, 1), (False, 3)):  # (unpacked: the blocks skipped, split or not)
        out, lse = fa4.flash_attn_func(q, k, v, block_sparse_tensors=bst, pack_gqa=pack_gqa, num_splits=splits,
                                       return_lse=True, kernel_options=fa4.KernelOptions(arch="sm90"))
        check(out, lse, q, k, v, mask_fn=block_sparse_twin(state, (128, 128)))


@pytest.mark.gpu
@pytest.mark.parametrize("user", [None, "doc64"])
def test_block_sparse_matches_flash_attn_4(user):
    """The same call through flash_attn.cute (its sm90 forward's tile is 128 x 128 at d128, the lists'
    block size): the two outputs agree within the rule's tolerance of the reference."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("compared on Hopper")
    cute_api = pytest.importorskip("flash_attn.cute")
    peer_bs = pytest.importorskip("flash_attn.cute.block_sparsity")
    bst, state = random_block_sparse(2, 8, 1024, 1024, (128, 128), "cuda", seed=9)
    peer_bst = peer_bs.BlockSparseTensorsTorch(bst.mask_block_cnt, bst.mask_block_idx, bst.full_block_cnt,
                                               bst.full_block_idx, block_size=(128, 128))
    um, ut = MASK_MODS[user]() if user else (None, None)
    q, k, v = random_qkv(2, 1024, 1024, 8, 8, 128, torch.bfloat16, "cuda", seed=10)
    ours, _ = fa4.flash_attn_func(q, k, v, mask_mod=um, block_sparse_tensors=bst, return_lse=True)
    theirs = cute_api.flash_attn_func(q, k, v, mask_mod=um, block_sparse_tensors=peer_bst)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    ref, _ = attention_ref(q.float(), k.float(), v.float(), mask_fn=block_sparse_twin(state, (128, 128), ut))
    err_ours = (ours.float() - ref).abs().max().item()
    err_theirs = (theirs.float() - ref).abs().max().item()
    # Both read the lists the same way (a different reading would put flash-attn-4 far off the reference).
    assert err_theirs <= 0.02 and err_ours <= 0.02, (err_ours, err_theirs)
    assert err_ours <= 2 * err_theirs + 1e-3, (err_ours, err_theirs)


def _table_case(full, heads_broadcast, seqlen_k, seed=11):
    """Random lists of 3 batches, 5 heads, 1000 queries in 64 x 100 blocks, with the edge cases the
    table drops or resolves: junk past the counts, indices outside [0, Nb), counts past the rows'
    entries and below zero, a block in both lists (whole wins)."""
    bst, state = random_block_sparse(3, 5, 1000, seqlen_k, (64, 100), "cuda", seed=seed, full=full,
                                     heads_broadcast=heads_broadcast, empty_row=True)
    nb = state.shape[3]
    if full:
        bst.mask_block_idx[0, 0, 1, 0] = 3
        bst.mask_block_cnt[0, 0, 1] = max(int(bst.mask_block_cnt[0, 0, 1]), 1)
        bst.full_block_idx[0, 0, 1, 0] = 3
        bst.full_block_cnt[0, 0, 1] = max(int(bst.full_block_cnt[0, 0, 1]), 1)
    bst.mask_block_cnt[1, 0, 2] = nb + 7
    bst.mask_block_cnt[2, 0, 3] = -4
    bst.mask_block_idx[1, 0, 2, 0] = -2
    bst.mask_block_idx[1, 0, 2, 1] = nb
    return bst, state


def _check_table(bst, seqlen_k, monkeypatch):
    """The kernel's table equals the torch build's, also where the memory held junk before."""
    from fa4 import block_sparse

    want = block_sparse._table_torch(bst, 3, 5, 1000, seqlen_k, (64, 100))
    with monkeypatch.context() as m:
        m.setattr(block_sparse, "_table_torch", None)  # (the kernel must serve the calls below)
        got = block_sparse.table(bst, 3, 5, 1000, seqlen_k, (64, 100))
        torch.cuda.synchronize()
        assert got.shape == want.shape and got.dtype == want.dtype == torch.int8
        assert torch.equal(got, want)
        size = got.untyped_storage().nbytes()
        for _ in range(3):  # the allocator hands the freed block back, filled with 7s
            del got
            torch.full((size,), 7, dtype=torch.int8, device="cuda")
            got = block_sparse.table(bst, 3, 5, 1000, seqlen_k, (64, 100))
            assert torch.equal(got, want)
    return want


@pytest.mark.gpu
@pytest.mark.parametrize("full,heads_broadcast", [(True, False), (False, True), (True, True)])
def test_table_kernel_matches_torch(full, heads_broadcast, monkeypatch):
    """Note [One launch for the table]: the one-launch table equals the torch scatters' on random
    lists (:func:`_table_case`'s edge cases), with rows shorter than a CTA's threads and longer
    (13 and 300 K blocks: a thread's loop runs once, then three times)."""
    for seqlen_k in (1300, 30000):
        bst, _ = _table_case(full, heads_broadcast, seqlen_k)
        want = _check_table(bst, seqlen_k, monkeypatch)
        if full:
            assert int(want[0, 0, 1, 3]) == 2


@pytest.mark.gpu
def test_table_kernel_takes_broadcast_lists(monkeypatch):
    """Lists broadcast over heads beside lists that are not (the kernel reads stride-0 views), and
    lists broadcast over the batch."""
    from mods_cases import BlockSparseTensorsTorch

    bst, _ = _table_case(True, False, 1300)
    heads1 = BlockSparseTensorsTorch(bst.mask_block_cnt[:, :1].contiguous(), bst.mask_block_idx[:, :1].contiguous(),
                                     bst.full_block_cnt, bst.full_block_idx, block_size=(64, 100))
    _check_table(heads1, 1300, monkeypatch)
    batch1 = BlockSparseTensorsTorch(bst.mask_block_cnt[:1].contiguous(), bst.mask_block_idx[:1].contiguous(),
                                     bst.full_block_cnt[:1].contiguous(), bst.full_block_idx, block_size=(64, 100))
    _check_table(batch1, 1300, monkeypatch)


def _bwd_skip() -> set:
    """The ``block_skip`` values of the backward plans made since the plan cache was cleared."""
    return {cfg.block_skip for _, cfg in fa4.ops._plans.values() if type(cfg).__name__ in ("BwdSm90Config",
                                                                                         "BwdSm80Config")}


BWD_CASES = [  # (head dim, (seqlen_q, seqlen_k), block, (heads, kv heads), causal, KernelOptions fields,
    #             deterministic, user mask_mod)
    # more than 32 m_blocks a K block: the ballot of Note [Block skip in the backward] reads them in chunks
    (128, (4500, 700), (128, 128), (8, 2), False, {}, False, None),
    (64, (2000, 1500), (64, 192), (8, 2), True, {}, False, None),
    # the user's mask_mod inside the boundary blocks (the steps' INNER mode), whole blocks without one
    (128, (1000, 1000), (128, 128), (8, 2), False, {}, False, "doc64"),
    # an odd number of K blocks (9): the last pair's second block is past the keys
    (128, (1000, 1100), (128, 128), (8, 8), False, {"bwd_two_cta": True}, False, None),
    (128, (1000, 1000), (128, 128), (8, 2), False, {"bwd_kv_split": 2}, False, None),
    (128, (1000, 1000), (128, 128), (8, 2), False, {"bwd_dq_pass": True}, False, "doc64"),
    # deterministic: through the dQ pass (BLOCK_SPARSE_DET_DQ_PASS) both kernels narrow, the same bits on
    # every run; told to keep the ordered dQ, every block is computed
    (256, (700, 900), (100, 37), (8, 2), False, {}, True, "head_parity"),
    (64, (1000, 1000), (64, 192), (8, 8), True, {}, True, None),
    (64, (1000, 1000), (64, 192), (8, 8), False, {"bwd_dq_pass": False}, True, None),
    # the sm80 backward narrows too (not deterministic; its forward computes every block)
    (128, (1500, 900), (128, 128), (8, 2), False, {"arch": "sm80"}, False, "doc64"),
    (64, (1000, 1000), (64, 192), (8, 8), True, {"arch": "sm80"}, True, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("d,seqlens,block,heads,causal,opts,det,user", BWD_CASES,
                         ids=[f"d{d}-{a}x{b}-{bq}x{bk}-h{h}/{hk}{'-causal' if c else ''}-{'-'.join(o) or 'default'}"
                              f"{'-det' if det else ''}{'-' + u if u else ''}"
                              for d, (a, b), (bq, bk), (h, hk), c, o, det, u in BWD_CASES])
def test_block_sparse_backward_skips(d, seqlens, block, heads, causal, opts, det, user):
    """Note [Block skip in the backward]: document-mask lists (the heads of a GQA group cut their
    documents differently, two K blocks no query sees, a q block that sees nothing): gradients against
    the reference with the same mask, exact zeros where nothing is seen, the backward's plan
    narrowing (or, deterministic without the dQ pass, not), the same bits on a second run when
    deterministic."""
    sq, sk = seqlens
    h, hk = heads
    bst, state = document_block_sparse(2, h, sq, sk, block, "cuda", seed=d + sq)
    um, ut = MASK_MODS[user]() if user else (None, None)
    q, k, v = random_qkv(2, sq, sk, h, hk, d, torch.bfloat16, "cuda", requires_grad=True, seed=d + 1)
    kw = dict(block_sparse_tensors=bst, mask_mod=um, causal=causal, return_lse=True, deterministic=det,
              kernel_options=fa4.KernelOptions(**{"arch": "sm90", **opts}))
    fa4.ops._plans.clear()
    out, lse = fa4.flash_attn_func(q, k, v, **kw)
    twin = block_sparse_twin(state, block, ut)
    with torch.no_grad():
        check(out, lse, q, k, v, mask_fn=twin, causal=causal)
    _grads(out, lse, (q, k, v), dict(mask_fn=twin, causal=causal))
    skipping = not (det and (opts.get("bwd_dq_pass") is False or opts.get("arch") == "sm80"))
    assert {bs[1:] for bs in _bwd_skip()} == ({tuple(block)} if skipping else {()})  # ((slot, bq, bk) or ())
    gen = torch.Generator("cuda").manual_seed(5)
    g = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    out, _ = fa4.flash_attn_func(q, k, v, **kw)  # (_grads freed the first call's graph)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    nb = state.shape[3]
    hidden_keys = slice((nb - 2) * block[1], sk)
    assert not dk[:, hidden_keys].any() and not dv[:, hidden_keys].any()
    assert not dq[0, :block[0]].any()
    if det:
        out2, _ = fa4.flash_attn_func(q, k, v, **kw)
        again = torch.autograd.grad(out2, (q, k, v), g)
        for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), again):
            assert torch.equal(a, b), name
