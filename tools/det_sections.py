"""Time the sm90 deterministic backward against launch sections (GPU): for each row, the
non-deterministic backward, then the deterministic one with ``LAUNCH_ORDER.det_section`` = each
value (None: the default), and ``DET_DIRECT`` off (the ordered writer warp); median of
``triton.testing.do_bench`` of ``torch.autograd.grad``, TFLOP/s (2.5x the forward's FLOPs).

    python tools/det_sections.py [--hdim 256] [--sections 8,32,128]
"""

from __future__ import annotations

import argparse

import torch
import triton

import fa4
from fa4 import ops
from fa4.bwd import sm90
from fa4.testing import random_qkv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", default="256")
    ap.add_argument("--sections", default="8,32,128")
    args = ap.parse_args()
    opts = fa4.KernelOptions(arch="sm90")
    for d in (int(x) for x in args.hdim.split(",")):
        s, b, h = 8192, 16384 // 8192, 2048 // d
        for causal in (False, True):
            q, k, v = random_qkv(b, s, s, h, h, d, torch.bfloat16, "cuda", requires_grad=True, seed=1)
            g = torch.randn_like(q)
            flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)

            def t(det):
                out, _ = fa4.flash_attn_func(q, k, v, causal=causal, deterministic=det, kernel_options=opts)
                ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
                return flops / ms / 1e9

            row = [f"nondet {t(False):.1f}"]
            for sec in [None] + [int(x) for x in args.sections.split(",")]:
                sm90.LAUNCH_ORDER.det_section = sec
                row.append(f"sec{sec} {t(True):.1f}")
            sm90.LAUNCH_ORDER.det_section = None
            sm90.DET_DIRECT = False
            ops._plans.clear()
            row.append(f"writer {t(True):.1f}")
            sm90.DET_DIRECT = True
            ops._plans.clear()
            print(f"d{d} s{s} {'causal' if causal else 'full'}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
