"""compute-sanitizer cases of block sparsity's skip path in the sm90 forward (fa4/block_sparse.py,
FwdSm90Config.block_skip): aligned and unaligned block sizes, a tile with no visible block, full
blocks, split-KV, and the three-warpgroup ping-pong tile (d64):

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
torch.cuda.synchronize()
print("block-sparse sanitize cases done")
