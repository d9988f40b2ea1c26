"""Packed GQA rows by TMA (Note [Packed rows by TMA]) under compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool racecheck python3 tools/sanitize_pack.py

Small sm90 forwards on a 3-CTA persistent grid (each CTA walks several tiles, so a tile's Q load
lands under the last tile's epilogue): dense with the packed O store by TMA (d128 causal, d64's
192-row tiles with g = 3), d256 with O in Q's smem, and varlen (Q by TMA, O by rows) with a
sequence of one query and boxes past the tensor's end; then boxes of ``tile_m // g`` positions
(``pack_tma_partial``, g = 6)."""
import torch

import fa4
from fa4.fwd import sm90
from fa4.testing import random_qkv, random_varlen

sm90._num_sms = lambda device: 3
SM90 = fa4.KernelOptions(arch="sm90")
for b, sq, sk, h, hk, d, causal in [(2, 200, 300, 8, 2, 128, True), (1, 130, 250, 12, 4, 64, False),
                                    (2, 100, 170, 8, 2, 256, True)]:
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=d)
    fa4.flash_attn_func(q, k, v, causal=causal, pack_gqa=True, kernel_options=SM90)
vb = random_varlen(4, 150, 8, 2, 128, torch.bfloat16, "cuda", max_seqlen_k=200, seed=1)
fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                           max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, causal=True, pack_gqa=True,
                           kernel_options=SM90)
# Boxes of tile_m // g positions (pack_tma_partial): g = 6, 126 of 128 rows, dense (O by TMA) and varlen.
import dataclasses  # noqa: E402

_make = sm90.make_config
sm90.make_config = lambda *a, **kw: dataclasses.replace(_make(*a, **kw), pack_tma_partial=True)
fa4.ops._plans.clear()
q, k, v = random_qkv(2, 100, 170, 12, 2, 128, torch.bfloat16, "cuda", seed=6)
fa4.flash_attn_func(q, k, v, causal=True, pack_gqa=True, kernel_options=SM90)
vb = random_varlen(4, 150, 12, 2, 128, torch.bfloat16, "cuda", max_seqlen_k=200, seed=2)
fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                           max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, causal=True, pack_gqa=True,
                           kernel_options=SM90)
torch.cuda.synchronize()
print("done")
