"""A first look at the sm90 forward on a GPU: a few shapes, max error against the float32
reference next to the same math in bf16 PyTorch, and a rough time. Exits non-zero on a NaN."""
import sys
import time

import torch

import fa4
from fa4.testing import attention_ref, random_qkv

SM90 = fa4.KernelOptions(arch="sm90")
bad = False
for (b, sq, sk, h, hk, d, causal) in [(1, 128, 128, 1, 1, 128, False), (2, 1000, 1000, 4, 2, 128, False),
                                     (2, 1000, 1000, 4, 2, 128, True), (1, 4096, 4096, 8, 8, 64, True),
                                     (1, 2048, 2048, 4, 4, 256, True), (2, 113, 203, 4, 1, 96, False)]:
    q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=d + sq)
    out, lse = fa4.flash_attn_func(q, k, v, causal=causal, return_lse=True, kernel_options=SM90)
    torch.cuda.synchronize()
    ref, lse_ref = attention_ref(q, k, v, causal=causal)
    pt = attention_ref(q, k, v, causal=causal, upcast=False)[0]
    err = (out.float() - ref).abs().max().item()
    err_pt = (pt.float() - ref).abs().max().item()
    lerr = (lse - lse_ref).abs().max().item()
    t = time.time()
    for _ in range(10):
        fa4.flash_attn_func(q, k, v, causal=causal, kernel_options=SM90)
    torch.cuda.synchronize()
    ms = (time.time() - t) / 10 * 1e3
    nan = bool(torch.isnan(out).any())
    bad |= nan or err > 2 * err_pt + 1e-3
    print(f"b{b} {sq}x{sk} h{h}/{hk} d{d} causal={causal}: err {err:.5f} (bf16 torch {err_pt:.5f}) lse err {lerr:.2e}"
          f" nan={nan} {ms:.3f} ms", flush=True)
sys.exit(1 if bad else 0)
