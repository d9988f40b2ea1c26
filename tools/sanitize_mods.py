"""compute-sanitizer cases of the user score / mask functions (fa4/mods.py) with aux tables sized to
the sequences exactly (the indices of the tile's rows and keys past a sequence are clamped, so
memcheck must see no read past a table), forward and backward:

    compute-sanitizer --tool memcheck python3 tools/sanitize_mods.py

(A script of its own: these kernels are not in the disk cache, so each sanitizer run compiles them.)"""
import os
import sys

import torch

import fa4
from fa4.testing import random_qkv, random_varlen

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from mods_cases import derivative, doc_ids, rel_bias_table  # noqa: E402

SM90 = fa4.KernelOptions(arch="sm90")
fn, _, ids = doc_ids(2, 333, "cuda", seed=1)
q, k, v = random_qkv(2, 333, 333, 4, 2, 64, torch.bfloat16, "cuda", seed=21)
fa4.flash_attn_func(q, k, v, mask_mod=fn, aux_tensors=[ids], kernel_options=SM90)
vb = random_varlen(3, 300, 4, 2, 128, torch.bfloat16, "cuda", max_seqlen_k=300, seed=22)
fn, _, ids = doc_ids(3, 300, "cuda", seed=2)
fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k,
                           max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k, causal=True, mask_mod=fn,
                           aux_tensors=[ids], kernel_options=SM90)
fn, _, table = rel_bias_table(8, 700, "cuda", seed=3)
q, k, v = random_qkv(2, 3, 700, 8, 2, 128, torch.bfloat16, "cuda", seed=23)
fa4.flash_attn_func(q, k, v, score_mod=fn, aux_tensors=[table], pack_gqa=True, num_splits=2, kernel_options=SM90)
# The backward through a mask_mod with an aux table: the 1-CTA kernel (d128) and the dQ pass (d256).
for d in (128, 256):
    fn, _, ids = doc_ids(2, 333, "cuda", seed=d)
    q, k, v = random_qkv(2, 333, 333, 4, 2, d, torch.bfloat16, "cuda", requires_grad=True, seed=d + 30)
    out, _ = fa4.flash_attn_func(q, k, v, mask_mod=fn, aux_tensors=[ids], kernel_options=SM90)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
# The backward through a score_mod with its derivative (an aux bias table).
fn, _, table = rel_bias_table(4, 333, "cuda", seed=4)
q, k, v = random_qkv(2, 333, 333, 4, 2, 128, torch.bfloat16, "cuda", requires_grad=True, seed=40)
out, _ = fa4.flash_attn_func(q, k, v, score_mod=fn, score_mod_bwd=derivative("rel_bias"), aux_tensors=[table],
                             causal=True, kernel_options=SM90)
torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
torch.cuda.synchronize()
print("sanitize cases done")
