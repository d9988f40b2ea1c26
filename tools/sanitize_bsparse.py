"""compute-sanitizer cases of block sparsity's skip path in the sm90 forward (fa4/block_sparse.py,
FwdSm90Config.block_skip): aligned and unaligned block sizes, a tile with no visible block, full
blocks, split-KV, and the three-warpgroup ping-pong tile (d64); and of the sm90 backward's
(Note [Block skip in the backward]):

    compute-sanitizer --tool racecheck python3 tools/sanitize_bsparse.py"""
import os
import sys

import torch

import fa4
from fa4.testing import random_qkv

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from mods_cases import MASK_MODS, random_block_sparse  # noqa: E402

SM90 = fa4.KernelOptions(arch="sm90")
for d, (sq, sk), block, user, splits in ((128, (333, 555), (128, 128), None, 1), (64, (400, 700), (64, 192), "doc64", 1),
                                         (128, (4, 2000), (128, 128), None, 3), (256, (300, 333), (100, 37), None, 1)):
    bst, _ = random_block_sparse(2, 4, sq, sk, block, "cuda", seed=d, empty_row=True)
    q, k, v = random_qkv(2, sq, sk, 4, 4, d, torch.bfloat16, "cuda", seed=d)
    fa4.flash_attn_func(q, k, v, mask_mod=MASK_MODS[user]()[0] if user else None, block_sparse_tensors=bst,
                        num_splits=splits, pack_gqa=False, kernel_options=SM90)
# The backward's narrowing (Note [Block skip in the backward]): GQA, two-CTA with an odd count of K
# blocks (the last pair's second block past the keys), the dQ pass of a deterministic run.
from mods_cases import document_block_sparse  # noqa: E402

for d, (sq, sk), (h, hk), opts, det in ((128, (700, 900), (8, 2), {}, False),
                                        (128, (600, 1100), (4, 4), {"bwd_two_cta": True}, False),
                                        (64, (500, 700), (8, 2), {}, True)):
    bst, _ = document_block_sparse(2, h, sq, sk, (128, 128), "cuda", seed=d)
    q, k, v = random_qkv(2, sq, sk, h, hk, d, torch.bfloat16, "cuda", requires_grad=True, seed=d)
    out, _ = fa4.flash_attn_func(q, k, v, block_sparse_tensors=bst, deterministic=det,
                                 kernel_options=fa4.KernelOptions(arch="sm90", **opts))
    out.float().sum().backward()
torch.cuda.synchronize()
print("block-sparse sanitize cases done")
