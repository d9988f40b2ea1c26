"""One forward + backward per shape, for ncu on the device (profile only the backward kernel):

    ncu --clock-control none --kernel-name regex:fa4_bwd_sm90 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats python3 tools/ncu_bwd.py [peer] [det] [up] [d,s,causal ...]

``up``: fa4's deterministic masked runs in the up order (``fa4.bwd.sm90.DET_UP``, Note [Up order]).

Shapes default to FlashAttention's grid rows d128 s8192 and d256 s8192 (bf16, 16k tokens, 2048 model dim)."""
import sys

import torch

import fa4

args = sys.argv[1:]
peer = bool(args) and args[0] == "peer"  # flash-attn-4's backward instead (``peer d,s,causal ...``)
if args and args[0] in ("peer", "fa4"):
    args = args[1:]
det = "det" in args  # deterministic=True (``[peer] det d,s,causal ...``)
if "up" in args:
    from fa4.bwd import sm90

    sm90.DET_UP = True
args = [a for a in args if a not in ("det", "up")]
if peer:
    from flash_attn.cute import flash_attn_func
else:
    flash_attn_func = fa4.flash_attn_func
shapes = [tuple(int(x) for x in a.split(",")) for a in args] or [(128, 8192, 0), (256, 8192, 0)]
for d, s, causal in shapes:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    res = flash_attn_func(q, k, v, causal=bool(causal), deterministic=det)
    out = res[0] if isinstance(res, tuple) else res
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
print("done")
