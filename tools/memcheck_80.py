"""One small backward with the 80-row experiment (tile_m=80, swapped dQ wgmma), for compute-sanitizer
memcheck: which kernel reads or writes out of bounds (RESULTS v0.7)."""
import dataclasses

import torch

import fa4
from fa4.bwd import sm90
from fa4.testing import random_qkv

make = sm90.make_config
sm90.make_config = lambda *a, **k: dataclasses.replace(make(*a, **k), tile_m=80, dq_stages=1, ds_from_p16=True)
q, k, v = random_qkv(1, 200, 130, 2, 1, 128, torch.bfloat16, "cuda", requires_grad=True, seed=3)
out, _ = fa4.flash_attn_func(q, k, v, kernel_options=fa4.KernelOptions(arch="sm90"))
torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
torch.cuda.synchronize()
print("done")
