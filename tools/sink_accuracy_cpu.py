"""CPU model of the learnable-sink gradient's accuracy (RESULTS v0.6, open bug): dsink through
fa4's host composition (fa4.interface._apply_sink) from an ``out`` rounded like the kernel's
(exactly, or with P rounded to bf16 before P V), against float64 truth and PyTorch's bf16 math with
a sink column.

    python tools/sink_accuracy_cpu.py
"""

import torch

from fa4.interface import _apply_sink

B, SQ, SK, H, HK, D = 2, 300, 77, 8, 2, 64


def ref(q, k, v, sink, dt):
    """Attention with an explicit sink column (value 0), in ``dt``."""
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    g = H // HK
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5
    col = sink.to(dt)[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
    p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def kernel_out(q, k, v, round_p: bool):
    """(out bf16, lse float32) over the keys alone, like the kernel: exact then rounded, or with
    the unnormalized P rounded to bf16 before P V and the float32 row sum."""
    g = H // HK
    kk, vv = k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    sc = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * D**-0.5
    m = sc.amax(-1, keepdim=True)
    p = torch.exp(sc - m)
    l = p.sum(-1, keepdim=True)
    if round_p:
        p = p.bfloat16().double()
    out = (torch.einsum("bhqk,bkhd->bhqd", p, vv) / l).transpose(1, 2).bfloat16()
    return out, (m + l.log()).squeeze(-1).float()


def main() -> None:
    torch.manual_seed(0)
    for round_p in (False, True):
        print("P rounded before P V" if round_p else "exact out, rounded")
        for trial in range(6):
            q, k, v = (torch.randn(B, s, n, D).bfloat16() for s, n in ((SQ, H), (SK, HK), (SK, HK)))
            sink = torch.randn(H) * 2 - 6 * (trial % 2)  # every other trial: small sinks
            g = torch.randn(B, SQ, H, D).bfloat16()
            grads = []
            for kind in ("truth", "pt", "fa4"):
                s = (sink.double() if kind == "truth" else sink.clone()).requires_grad_()
                if kind == "fa4":
                    out, lse = kernel_out(q, k, v, round_p)
                    o, _ = _apply_sink(out, lse, s, False, False)
                else:
                    dt = torch.float64 if kind == "truth" else torch.bfloat16
                    o = ref(q.to(dt), k.to(dt), v.to(dt), s, dt)
                grads.append(torch.autograd.grad(o, s, g.to(o.dtype))[0].double())
            truth, pt, ours = grads
            # The alternative of RESULTS v0.8: dsink from the final composed output, -sum p_sink (g . out').
            out, lse = kernel_out(q, k, v, round_p)
            o_all, lse_all = _apply_sink(out, lse, sink, False, True)
            p_sink = torch.exp(sink[None, :, None] - lse_all)
            alt = -(p_sink * (g.float() * o_all.float()).sum(-1).transpose(1, 2)).sum((0, 2)).double()
            print(f"  max|dsink| {truth.abs().max():.3e}  err pt bf16 {(pt - truth).abs().max():.3e}"
                  f"  err fa4 {(ours - truth).abs().max():.3e}  err alt {(alt - truth).abs().max():.3e}")


if __name__ == "__main__":
    main()
