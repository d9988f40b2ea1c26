"""One split-GQA backward case (Note [Split GQA group]) for compute-sanitizer memcheck: head dim 80
(padded 96, so the partials' column predicate matters), varlen with seqused_k, MQA causal, split
forced to 8; checks the gradients against the float32 reference with the tests' rule.

    compute-sanitizer --tool memcheck python3 tools/kv_split_check.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import fa4  # noqa: E402
from fa4.bwd import sm90  # noqa: E402
from fa4.testing import attention_ref, check_close, grad_noise_floor, random_varlen  # noqa: E402

sm90.kv_split_for = lambda *a, **k: 8
vb = random_varlen(3, 700, 8, 1, 80, torch.bfloat16, "cuda", max_seqlen_k=900, with_seqused_k=True,
                   requires_grad=True, seed=5)
var = dict(cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, seqused_k=vb.seqused_k)
out, _ = fa4.flash_attn_varlen_func(vb.q, vb.k, vb.v, max_seqlen_q=vb.max_seqlen_q, max_seqlen_k=vb.max_seqlen_k,
                                    causal=True, **var)
g = torch.randn_like(out)
grads = torch.autograd.grad(out, (vb.q, vb.k, vb.v), g)
q32 = [t.detach().float().requires_grad_() for t in (vb.q, vb.k, vb.v)]
ref = torch.autograd.grad(attention_ref(*q32, upcast=True, causal=True, **var)[0], q32, g.float())
qlp = [t.detach().requires_grad_() for t in (vb.q, vb.k, vb.v)]
pt = torch.autograd.grad(attention_ref(*qlp, upcast=False, causal=True, **var)[0], qlp, g)
floors = grad_noise_floor(vb.q, vb.k, vb.v, g)
for name, a, r, p in zip(("dq", "dk", "dv"), grads, ref, pt):
    check_close(name, a, r, p, extra_atol=floors[name])
print("kv_split check passed")
