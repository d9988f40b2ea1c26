"""Kernel times of the backward with and without the dQ pass (Note [dQ pass], branch wip/dq-pass):
``python3 tools/dq_pass_profile.py 256,8192,0 ...`` (torch.profiler, as tools/bwd_profile.py)."""
import sys

import torch

import fa4
from decode_profile import profile
from fa4.bench import grid_shape
from fa4.testing import random_qkv

for row in sys.argv[1:]:
    d, s, causal = (int(x) for x in row.split(","))
    shape = grid_shape(d, s, bool(causal))
    q, k, v = random_qkv(shape.batch, s, s, shape.heads, shape.heads, d, torch.bfloat16, "cuda", seed=0)
    dout = torch.randn_like(q)
    for det in (False, True):
        for on in (False, True):
            opts = fa4.KernelOptions(arch="sm90", bwd_dq_pass=on)
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out, _ = fa4.flash_attn_func(qq, kk, vv, causal=bool(causal), deterministic=det, kernel_options=opts)
            fn = lambda: torch.autograd.grad(out, (qq, kk, vv), dout, retain_graph=True)  # noqa: E731
            fn()
            print(f"d{d} s{s} causal={bool(causal)} det={det} dq_pass={on}:", profile(fn), flush=True)
