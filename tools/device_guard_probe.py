"""Whether fa4 needs its device guard (Note [Device guard] in fa4/arch.py): the calls of
tests/test_device_guard_gpu.py on cuda:1 with cuda:0 current, with the guard replaced by a no-op.
Prints, per call, "same bits", "DIFFERENT" or the exception. Needs two GPUs."""
import contextlib
import sys

import torch

import fa4
import fa4.arch
from fa4.testing import random_qkv


def main():
    fa4.arch.device_guard = lambda t: contextlib.nullcontext()
    torch.cuda.set_device(0)
    for arch in sys.argv[1:] or ["sm90", "sm80"]:
        opts = fa4.KernelOptions(arch=arch)
        q, k, v = random_qkv(2, 700, 900, 8, 2, 128, torch.bfloat16, "cuda:0", seed=1)
        g = torch.randn(2, 700, 8, 128, device="cuda:0", dtype=torch.bfloat16)

        def run(q, k, v, g):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out, lse = fa4.flash_attn_func(*leaves, return_lse=True, deterministic=True, causal=True,
                                           kernel_options=opts)
            return (out, lse) + torch.autograd.grad(out, leaves, g)

        want = run(q, k, v, g)
        try:
            got = run(*(t.to("cuda:1") for t in (q, k, v, g)))
            torch.cuda.synchronize(1)
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
                print(arch, name, "same bits" if torch.equal(a.cpu(), b.cpu()) else "DIFFERENT", flush=True)
        except Exception as e:  # report, go on
            print(arch, "exception:", type(e).__name__, str(e)[:300], flush=True)


if __name__ == "__main__":
    main()
