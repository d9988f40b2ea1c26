"""Small sm90 forward and backward cases for compute-sanitizer (memcheck, racecheck, synccheck):

    compute-sanitizer --tool racecheck python3 tools/sanitize_sm90.py

Forward: the persistent (static and dynamic, on a 3-CTA grid) and the plain grid (with K/V multicast too, causal pairs and their claims too; overlapped tiles; warpgroup stores), 1/2/3 consumer warpgroups, causal / local, varlen with
a length-1 sequence (and the claims past empty varlen tiles), an unpadded head dim, O through TMA and through plain stores. Backward: P/dS in
registers (d128, GQA, causal) and through smem (d256; the ordered paths with bwd_dq_pass=False from d160),
deterministic (the up order without GQA), varlen with seqused_k, 128-row
steps (d64), the two-CTA backward (d128 causal GQA, d64, varlen with seqused_k). The dQ pass (d256
without a mask, d256 causal GQA, varlen d192 deterministic). Issue 9: pack GQA, split-KV with the
combine, paged K/V, seqused_q. (User functions: tools/sanitize_mods.py.)"""
import dataclasses
import sys

import torch

from fa4 import validate
from fa4.fwd import sm90
from fa4.testing import random_qkv, random_varlen

import fa4

sm90._num_sms = lambda device: 3  # few CTAs: the persistent grids walk and claim many tiles

CASES = [
    (2, 200, 300, 4, 2, 128, True, {}),
    (1, 130, 130, 2, 1, 64, False, {"tile_m": 192, "tile_n": 64}),
    (2, 500, 600, 4, 2, 64, True, {}),  # d64's default: three warpgroups taking turns around the steps
    (1, 100, 70, 2, 2, 256, True, {"persistent": False}),
    (2, 65, 129, 2, 1, 72, False, {"tile_m": 64}),
    # the dynamic scheduler's claims and smem ring (40 tiles over the SM-count grid: make the grid small)
    (2, 640, 700, 4, 2, 128, True, {"persistent": True, "dynamic_sched": True}),
    # K/V multicast in clusters of two (Note [K/V multicast]): 3 m-blocks, so a tile past the rows
    (1, 300, 500, 2, 2, 128, False, {"persistent": False, "dynamic_sched": False, "split_kv": False,
                                     "l2_section_mb": 0, "kv_mcast": True}),
    (1, 500, 260, 2, 2, 64, False, {"persistent": False, "dynamic_sched": False, "split_kv": False,
                                    "l2_section_mb": 0, "kv_mcast": True}),
    # ... and persistent: on the 3-SM grid one cluster walks all 8 pairs (ClusterPairScheduler)
    (2, 500, 400, 4, 4, 128, False, {"persistent": True, "dynamic_sched": False, "split_kv": False,
                                     "kv_mcast": True}),
    # ... causal: a pair walks the union of its ranges; on the dynamic grid CTA 0 claims every pair and
    # hands it to CTA 1 through its shared memory (Note [Pair claims]); 5 m-blocks, rows past s_k
    (2, 700, 650, 4, 4, 128, True, {"persistent": True, "dynamic_sched": True, "split_kv": False,
                                    "kv_mcast": True}),
    (1, 300, 500, 2, 2, 64, True, {"persistent": False, "dynamic_sched": False, "split_kv": False,
                                   "l2_section_mb": 0, "kv_mcast": True}),
    # the next tile's first Q K^T under the epilogue, Q in two stages (Note [Tiles overlapped]): the
    # static snake with GQA, multicast pairs, d64's three warpgroups on the dynamic grid (causal)
    (2, 640, 700, 4, 2, 128, False, {"persistent": True, "dynamic_sched": False, "kv_mcast": False,
                                     "overlap_tiles": True}),
    (2, 500, 400, 4, 4, 128, False, {"persistent": True, "dynamic_sched": False, "split_kv": False,
                                     "kv_mcast": True, "overlap_tiles": True}),
    (2, 500, 600, 4, 2, 64, True, {"persistent": True, "dynamic_sched": True, "overlap_tiles": True}),
    # each warpgroup storing its own 64 rows of O (Note [Warpgroup stores]): two and three warpgroups,
    # rows ending inside a warpgroup's half, with overlapped tiles
    (2, 500, 600, 4, 4, 128, True, {"persistent": True, "dynamic_sched": True, "split_kv": False, "wg_store_o": True,
                                    "overlap_tiles": True}),
    (2, 470, 300, 4, 4, 64, False, {"persistent": True, "dynamic_sched": False, "wg_store_o": True}),
]
MCAST_ONLY = "--mcast" in sys.argv  # the multicast cases alone (device step next73)
OVERLAP_ONLY = "--overlap" in sys.argv  # the overlapped tiles' cases alone (device step next76)
WG_STORE_ONLY = "--wgstore" in sys.argv  # the warpgroup stores' cases alone (device step next80)
for b, sq, sk, h, hk, d, causal, fields in CASES:
    if ((MCAST_ONLY and not fields.get("kv_mcast")) or (OVERLAP_ONLY and not fields.get("overlap_tiles"))
            or (WG_STORE_ONLY and not fields.get("wg_store_o"))):
        continue
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=d)
    problem = validate.check_dense(q, k, v, None, causal, (None, None), 0.0)
    if fields.get("split_kv") is False:  # (pdl, the split calls' default, serves split calls only)
        fields = {"pdl": False, **fields}
    cfg = dataclasses.replace(sm90.make_config(problem, None, "sm_90a", True), **fields)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, sq, dtype=torch.float32, device="cuda")
    sm90.run(cfg, problem, q, k, v, out, lse)
if MCAST_ONLY or OVERLAP_ONLY or WG_STORE_ONLY:
    torch.cuda.synchronize()
    sys.exit(0)
vb = random_varlen(3, 150, 4, 2, 128, torch.bfloat16, "cuda", max_seqlen_k=200, with_seqused_k=True, seed=1)
fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                           max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, seqused_k=vb.seqused_k,
                           causal=True, window_size=(50, 0), kernel_options=fa4.KernelOptions(arch="sm90"))
# The claims past empty varlen tiles (Note [Skipped claims]): lengths 1 / 400 / 3 on the dynamic grid.
cu = torch.tensor([0, 1, 401, 404], dtype=torch.int32, device="cuda")
qs, ks, vs = (torch.randn(404, hh, 128, device="cuda", dtype=torch.bfloat16) for hh in (4, 2, 2))
_make = sm90.make_config
sm90.make_config = lambda *a, **kw: dataclasses.replace(_make(*a, **kw), persistent=True, dynamic_sched=True,
                                                         skip_empty=True)
fa4.flash_attn_varlen_func(qs, ks, vs, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=400, max_seqlen_k=400,
                           causal=True, kernel_options=fa4.KernelOptions(arch="sm90"))
sm90.make_config = _make
fa4.ops._plans.clear()
# The compact varlen grids (Note [Compact varlen grid]): the forward's one tile per CTA and the
# backward's, on the same lengths (a sequence of one, an empty slot, packed rows past cu[-1]).
from fa4.bwd import sm90 as bwd90  # noqa: E402

_bmake = bwd90.make_config
sm90.make_config = lambda *a, **kw: dataclasses.replace(_make(*a, **kw), persistent=False, dynamic_sched=False,
                                                         compact_grid=True)
bwd90.make_config = lambda *a, **kw: dataclasses.replace(_bmake(*a, **kw), compact_grid=True)
qc, kc, vc = (torch.randn(409, hh, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for hh in (4, 2, 2))
out, _ = fa4.flash_attn_varlen_func(qc, kc, vc, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=400, max_seqlen_k=400,
                                    causal=True, kernel_options=fa4.KernelOptions(arch="sm90"))
torch.autograd.grad(out, (qc, kc, vc), torch.randn_like(out))
sm90.make_config, bwd90.make_config = _make, _bmake
fa4.ops._plans.clear()
q, k, v = random_qkv(1, 300, 300, 2, 2, 128, torch.bfloat16, "cuda", seed=3)
fa4.flash_attn_func(q, k, v, window_size=(40, 20), kernel_options=fa4.KernelOptions(arch="sm90"))
# d64 windows fold both edges into one masked step and walk them first (Note [Edges first], fa4/mask.py)
q, k, v = random_qkv(2, 700, 900, 4, 2, 64, torch.bfloat16, "cuda", seed=4)
fa4.flash_attn_func(q, k, v, window_size=(300, 77), kernel_options=fa4.KernelOptions(arch="sm90"))
SM90 = fa4.KernelOptions(arch="sm90")
ORDERED = fa4.KernelOptions(arch="sm90", bwd_dq_pass=False)  # the main kernel's dQ (from d160: not the default)
for b, sq, sk, h, hk, d, causal, det, opts in [
    (2, 200, 300, 4, 2, 128, True, False, SM90),
    (1, 150, 100, 2, 2, 256, False, False, SM90),
    (1, 300, 300, 4, 2, 128, True, True, SM90),
    (1, 300, 300, 4, 2, 128, False, True, SM90),  # the rotated deterministic order
    (1, 300, 200, 4, 2, 256, True, True, ORDERED),  # the ordered direct dQ adds (Note [Ordered direct dQ])
    (1, 200, 300, 4, 2, 256, False, True, ORDERED),  # the same, rotated order
    # The up order (Note [Up order]), the causal deterministic default without GQA: the writer warp
    # (d128; d64's 128-row steps) and the ordered direct adds (d256).
    (1, 300, 300, 2, 2, 128, True, True, SM90),
    (1, 257, 300, 2, 2, 64, True, True, SM90),
    (1, 300, 200, 2, 2, 256, True, True, ORDERED),
    (1, 257, 129, 2, 1, 64, False, False, fa4.KernelOptions(arch="sm90", bwd_tile_m=128)),
    # The two-CTA backward (Note [Two-CTA dQ]): 3 K blocks (the second pair's block past the keys),
    # causal GQA at d128; d64's 64-row halves.
    (2, 200, 300, 4, 2, 128, True, False, fa4.KernelOptions(arch="sm90", bwd_two_cta=True)),
    (1, 257, 129, 2, 1, 64, False, False, fa4.KernelOptions(arch="sm90", bwd_two_cta=True)),
]:
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", requires_grad=True, seed=d + 1)
    out, _ = fa4.flash_attn_func(q, k, v, causal=causal, deterministic=det, kernel_options=opts)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
vb = random_varlen(3, 150, 4, 2, 128, torch.bfloat16, "cuda", max_seqlen_k=200, with_seqused_k=True,
                   requires_grad=True, seed=2)
out, _ = fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                                    max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k,
                                    seqused_k=vb.seqused_k, causal=True, kernel_options=SM90)
torch.autograd.grad(out, (vb.q, vb.k, vb.v), torch.randn_like(out))
out, _ = fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                                    max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k,
                                    seqused_k=vb.seqused_k, causal=True,
                                    kernel_options=fa4.KernelOptions(arch="sm90", bwd_two_cta=True))
torch.autograd.grad(out, (vb.q, vb.k, vb.v), torch.randn_like(out))
# Issue 9: pack GQA, split-KV + combine, paged K/V (TMA chunks of 16 rows), seqused_q.
q, k, v = random_qkv(3, 1, 700, 8, 2, 128, torch.bfloat16, "cuda", seed=5)
fa4.flash_attn_func(q, k, v, pack_gqa=True, num_splits=3, kernel_options=SM90)
fa4.flash_attn_func(q, k, v, pack_gqa=True, num_splits=1, causal=True, kernel_options=SM90)
q, k, v = random_qkv(2, 70, 500, 4, 4, 64, torch.bfloat16, "cuda", seed=6)
fa4.flash_attn_func(q, k, v, num_splits=4, causal=True, kernel_options=SM90)
used = torch.tensor([500, 33], dtype=torch.int32, device="cuda")
fa4.flash_attn_varlen_func(q, k, v, seqused_q=torch.tensor([70, 3], dtype=torch.int32, device="cuda"),
                           seqused_k=used, kernel_options=SM90)
kc = k.reshape(2 * 500 // 20, 20, 4, 64)[:, :16].contiguous()  # 50 pages of 16 rows
pt = torch.randperm(50, device="cuda").to(torch.int32).reshape(2, 25)
fa4.flash_attn_varlen_func(q, kc, kc, page_table=pt, seqused_k=torch.tensor([400, 7], dtype=torch.int32, device="cuda"),
                           kernel_options=SM90)
# The down tail of the up order (Note [Down tail]): with det_tail 2 the last two of four kv heads walk
# down and launch last; the writer warp (d128) and the ordered direct adds (d256).
from fa4.bwd import sm90 as _bwd90  # noqa: E402

_bwd90.DET_TAIL, _bwd90.DET_TAIL_SHARE = 2, 2  # two of the four kv heads walk down
fa4.ops._plans.clear()
for d in (128, 256):
    q, k, v = random_qkv(2, 300, 300, 4, 4, d, torch.bfloat16, "cuda", requires_grad=True, seed=d + 7)
    out, _ = fa4.flash_attn_func(q, k, v, causal=True, deterministic=True, kernel_options=ORDERED)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
# The rotated order in two rounds (Note [Rotation rounds], d192 without a mask with the main
# kernel's dQ): 11 K blocks, rounds of 6 and 5; GQA 4/2.
q, k, v = random_qkv(2, 640, 700, 4, 2, 192, torch.bfloat16, "cuda", requires_grad=True, seed=11)
out, _ = fa4.flash_attn_func(q, k, v, deterministic=True, kernel_options=ORDERED)
torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
# The dQ pass (Note [dQ pass] in fa4/bwd/dq_sm90.py; the default from d160 when deterministic or
# without a mask): causal GQA with a partial last K block (asked for: not the default there), and
# varlen deterministic with seqused_k (the K/V tail cleared in the dQ kernel's smem).
q, k, v = random_qkv(2, 300, 333, 4, 2, 256, torch.bfloat16, "cuda", requires_grad=True, seed=13)
out, _ = fa4.flash_attn_func(q, k, v, causal=True, kernel_options=fa4.KernelOptions(arch="sm90", bwd_dq_pass=True))
torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
vb = random_varlen(3, 200, 4, 2, 192, torch.bfloat16, "cuda", max_seqlen_k=300, with_seqused_k=True,
                   requires_grad=True, seed=14)
out, _ = fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                                    seqused_k=vb.seqused_k, max_seqlen_q=vb.max_seqlen_q,
                                    max_seqlen_k=vb.max_seqlen_k, deterministic=True, kernel_options=SM90)
torch.autograd.grad(out, (vb.q, vb.k, vb.v), torch.randn_like(out))
torch.cuda.synchronize()
print("sanitize cases done")
