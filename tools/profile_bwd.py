"""One backward call of fa4 (sm80 path) or of torch SDPA's flash backend, for a profiler.

    ncu --clock-control none -k regex:fa4_bwd_sm80 -c 1 python tools/profile_bwd.py fa4 2 8192 8 256 [causal]
    ncu --clock-control none -k regex:flash_bwd -c 1 python tools/profile_bwd.py fa2 2 8192 8 256 [causal]

Runs a warm-up call first (compiles, caches), then the profiled one: pass ``-c 1`` with a kernel
filter and ``--launch-skip 1`` to profile the second.
"""

import sys

import torch

import fa4


def main():
    who, b, s, h, d = sys.argv[1], *map(int, sys.argv[2:6])
    causal = "causal" in sys.argv[6:]
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        if who == "fa4":
            out, _ = fa4.flash_attn_func(q, k, v, causal=causal, kernel_options=fa4.KernelOptions(arch="sm80"))
            torch.autograd.grad(out, (q, k, v), g)
        else:
            qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            torch.autograd.grad(out, (qt, kt, vt), g.transpose(1, 2))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
