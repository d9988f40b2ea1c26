"""One forward + backward per shape, for ncu on the device (profile only the backward kernel):

    ncu --clock-control none --kernel-name regex:fa4_bwd_sm90 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats python3 tools/ncu_bwd.py [d,s,causal ...]

Shapes default to FlashAttention's grid rows d128 s8192 and d256 s8192 (bf16, 16k tokens, 2048 model dim)."""
import sys

import torch

import fa4

shapes = [tuple(int(x) for x in a.split(",")) for a in sys.argv[1:]] or [(128, 8192, 0), (256, 8192, 0)]
for d, s, causal in shapes:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out, _ = fa4.flash_attn_func(q, k, v, causal=bool(causal))
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
print("done")
