"""What packed 16-bit exponentials would cost in accuracy (CPU only, a design probe; no kernel uses them).

The d64 sm90 forward issues 66 ``MUFU.EX2`` a thread per K block, about as many MUFU cycles as the
tensor cores need for the block (RESULTS v0.48). Hopper's MUFU also takes two exponentials per
instruction in 16 bits (PTX ``ex2.approx.f16x2`` / ``ex2.approx.ftz.bf16x2``), at the price of a
16-bit argument and result. This script simulates the softmax's ``P = 2**(s * scale_log2 - m)``
in four ways, on random inputs, against a float32 reference, whole rows at once (the online
rescale does not change the rounding studied here):

* ``fp32``: the kernels' way: fp32 argument and ``P``, ``l`` summed in fp32, ``P`` rounded to the
  input dtype for ``P @ V``;
* ``fp32_l_rounded``: the same with ``l`` summed from the rounded ``P``;
* ``bf16x2``: argument and result rounded to the input dtype (bf16 inputs: ``ex2.approx.ftz.bf16x2``);
* ``f16x2``: argument and result in fp16 (``ex2.approx.f16x2``), then ``P`` rounded to the input
  dtype; ``l`` from that ``P``.

and prints the max and mean absolute error of each against the reference, with PyTorch's own math
in the input dtype (the pass rule's baseline) beside them.

    python tools/packed_exp_accuracy.py [--seeds 3]
"""

from __future__ import annotations

import argparse
import math

import torch


def errors(d: int, scale_mult: float, dtype: torch.dtype, seed: int, s: int = 1024, heads: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(heads, s, d, generator=g).to(dtype) for _ in range(3))
    scale = d ** -0.5 * scale_mult
    raw = q.float() @ k.float().transpose(-1, -2)  # fp32 accumulation, as the tensor cores
    ref = torch.softmax(raw * scale, -1) @ v.float()
    arg = (raw - raw.amax(-1, keepdim=True)) * (scale / math.log(2))
    vf = v.float()

    def out(p_mma, p_sum):
        return ((p_mma @ vf) / p_sum.sum(-1, keepdim=True)).to(dtype).float()

    p32 = torch.exp2(arg)
    p_rounded = p32.to(dtype).float()
    p_b = torch.exp2(arg.to(dtype).float()).to(dtype).float()
    p_h = torch.exp2(arg.clamp(min=-65504).to(torch.float16).float()).to(torch.float16).float().to(dtype).float()
    outs = {"fp32": out(p_rounded, p32), "fp32_l_rounded": out(p_rounded, p_rounded),
            "bf16x2": out(p_b, p_b), "f16x2": out(p_h, p_h)}
    torch_math = (torch.softmax((q @ k.transpose(-1, -2)).float() * scale, -1).to(dtype) @ v).float()
    res = {name: ((o - ref).abs().max().item(), (o - ref).abs().mean().item()) for name, o in outs.items()}
    res["torch_in_dtype"] = ((torch_math - ref).abs().max().item(), (torch_math - ref).abs().mean().item())
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    names = ["fp32", "fp32_l_rounded", "bf16x2", "f16x2", "torch_in_dtype"]
    print("dtype d scale | " + " | ".join(f"{n}: max / mean (x fp32)" for n in names))
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for mult in (0.1, 1.0, 4.0):
                runs = [errors(d, mult, dtype, seed) for seed in range(args.seeds)]
                worst = {n: (max(r[n][0] for r in runs), max(r[n][1] for r in runs)) for n in names}
                base = worst["fp32"]
                cells = [f"{worst[n][0]:.2e} / {worst[n][1]:.1e} ({worst[n][0] / base[0]:.2f} / {worst[n][1] / base[1]:.2f})"
                         for n in names]
                print(f"{str(dtype)[6:]} {d} {mult} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
