"""Where a deterministic backward is not bit-exact: run it several times on one varlen (or dense)
problem and print, per gradient, the rows (sequence, row in the sequence, m_block) and heads that
differ between runs.

    python tools/det_diag.py --d 256 --mask causal --varlen 4,1500,1300 --seed 1756 [--runs 5]
        [--writer] [--section N] [--no-seqused]

``--varlen B,MAXQ,MAXK``: ``fa4.testing.random_varlen`` with seqused_k (the GPU tests' inputs);
``--dense SQ,SK``: a batch of 2. GQA 6/2, bf16. ``--writer``: the ordered writer warp where the
table adds dQ directly (``DET_DIRECT`` off).
"""

from __future__ import annotations

import argparse

import torch

import fa4
from fa4.bwd import sm90
from fa4.testing import random_qkv, random_varlen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--mask", default="causal", choices=["none", "causal", "local"])
    ap.add_argument("--varlen", default=None)
    ap.add_argument("--dense", default=None)
    ap.add_argument("--lens", default=None, help="explicit varlen lengths: 'q1,q2,.../k1,k2,...' (no seqused_k)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--writer", action="store_true")
    ap.add_argument("--section", type=int, default=None)
    ap.add_argument("--no-seqused", action="store_true")
    ap.add_argument("--tile-m", type=int, default=64)
    ap.add_argument("--nondet", action="store_true", help="deterministic=False (dk, dv should still repeat)")
    ap.add_argument("--ref", action="store_true", help="also the max error of every run against float32, per sequence")
    ap.add_argument("--fixed-fwd", action="store_true", help="one forward, then only the backward repeats")
    ap.add_argument("--fwd-static", action="store_true", help="the forward on the static persistent grid")
    a = ap.parse_args()
    if a.fwd_static:
        from fa4.fwd import sm90 as fwd90

        fwd90.DYNAMIC_MIN_SEQLEN_K_MASKED = 1 << 30
    if a.writer:
        sm90.DET_DIRECT = False
    if a.section is not None:
        sm90.LAUNCH_ORDER.det_section = a.section
    opts = fa4.KernelOptions(arch="sm90")
    if a.varlen or a.lens:
        if a.lens:
            from fa4.testing import varlen_batch

            lq, lk = ([int(x) for x in part.split(",")] for part in a.lens.split("/"))
            vb = varlen_batch(lq, lk, 6, 2, a.d, torch.bfloat16, "cuda", requires_grad=True, seed=a.seed)
        else:
            b, mq, mk = (int(x) for x in a.varlen.split(","))
            vb = random_varlen(b, mq, 6, 2, a.d, torch.bfloat16, "cuda", max_seqlen_k=mk,
                               with_seqused_k=not a.no_seqused, requires_grad=True, seed=a.seed)
        q, k, v = vb.q, vb.k, vb.v
        sq, sk = vb.max_seqlen_q, vb.max_seqlen_k
        print("seqlens_q", vb.seqlens_q, "seqlens_k", vb.seqlens_k,
              "seqused_k", None if vb.seqused_k is None else vb.seqused_k.tolist())
        kw = dict(cu_seqlens_q=vb.cu_seqlens_q, cu_seqlens_k=vb.cu_seqlens_k, seqused_k=vb.seqused_k,
                  max_seqlen_q=sq, max_seqlen_k=sk)
        call = fa4.flash_attn_varlen_func
        starts = vb.cu_seqlens_q.tolist()
        starts_k = vb.cu_seqlens_k.tolist()
    else:
        sq, sk = (int(x) for x in a.dense.split(","))
        q, k, v = random_qkv(2, sq, sk, 6, 2, a.d, torch.bfloat16, "cuda", requires_grad=True, seed=a.seed)
        kw = {}
        call = fa4.flash_attn_func
        starts = starts_k = None
    window = (max(sk // 3, 1) + 5, sq // 5 + 1) if a.mask == "local" else (None, None)
    kw.update(causal=a.mask == "causal", window_size=window)
    g = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=torch.Generator("cuda").manual_seed(a.seed))

    fixed = call(q, k, v, deterministic=not a.nondet, kernel_options=opts, **kw)[0] if a.fixed_fwd else None

    def run():
        out = fixed if fixed is not None else call(q, k, v, deterministic=not a.nondet, kernel_options=opts, **kw)[0]
        return [t.clone() for t in torch.autograd.grad(out, (q, k, v), g, retain_graph=fixed is not None)]

    ref = None
    if a.ref:
        from fa4.testing import attention_ref

        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        rkw = {key: kw[key] for key in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k") if key in kw}
        out32, lse32 = attention_ref(q32, k32, v32, causal=kw["causal"], window_size=window, **rkw)
        ref = torch.autograd.grad(out32, (q32, k32, v32), g.float())
        for r in range(2):  # the forward alone: out and lse against float32, per sequence
            with torch.no_grad():
                out, lse = call(q, k, v, kernel_options=opts, return_lse=True, **kw)
            eo = (out.float() - out32).abs()
            fin = torch.isfinite(lse32)
            el = torch.where(fin, (lse.float() - lse32).abs(), torch.zeros_like(lse32))
            bad_inf = int((torch.isfinite(lse) != fin).sum())
            per = []
            for s0, s1 in zip((starts or [0, eo.shape[0]])[:-1], (starts or [0, eo.shape[0]])[1:]):
                e, l = (eo[s0:s1], el[..., s0:s1]) if starts is not None else (eo, el)
                per.append(f"{e.nan_to_num(float('inf')).max().item():.1e}/{l.nan_to_num(float('inf')).max().item():.1e}")
            print(f"forward {r}: out/lse max error per sequence {per}, lse finiteness mismatches {bad_inf}")

    def report(r, grads):
        for name, x, y in zip(("dq", "dk", "dv"), grads, ref):
            err = (x.float() - y).abs()
            bounds = (starts if name == "dq" else starts_k) or [0, err.shape[0]]
            per = []
            for s0, s1 in zip(bounds[:-1], bounds[1:]):
                e = err[s0:s1] if starts is not None else err
                per.append(f"{e.nan_to_num(float('inf')).max().item():.2e}" if e.numel() else "-")
            print(f"run {r}: {name} max error per sequence {per} (|ref| max {y.abs().max().item():.2e})")

    first = run()
    if ref is not None:
        report(0, first)
    bad = 0
    for r in range(1, a.runs):
        grads = run()
        if ref is not None:
            report(r, grads)
        for name, x, y in zip(("dq", "dk", "dv"), first, grads):
            diff = (x.float() - y.float()).abs()
            nan = torch.isnan(x) != torch.isnan(y)
            rows = ((diff > 0) | nan).any(-1)  # varlen (total, h), dense (b, s, h)
            if not rows.any():
                continue
            bad += 1
            print(f"run {r}: {name} differs, max {diff.nan_to_num(0).max().item():.3e}, {int(rows.sum())} (row, head) pairs")
            if starts is not None:  # (total, h, d) -> per sequence (of q for dq, of k for dk, dv)
                idx = rows.nonzero()
                bounds = starts if name == "dq" else starts_k
                for s in range(len(bounds) - 1):
                    sel = idx[(idx[:, 0] >= bounds[s]) & (idx[:, 0] < bounds[s + 1])]
                    if len(sel):
                        local = sel[:, 0] - bounds[s]
                        print(f"  seq {s}: rows {local.min().item()}..{local.max().item()} "
                              f"blocks of {a.tile_m} {sorted(set((local // a.tile_m).tolist()))[:12]} heads {sorted(set(sel[:, 1].tolist()))}")
            else:
                idx = rows.nonzero()
                print(f"  batch/rows: {sorted(set(idx[:, 0].tolist()))} m_blocks "
                      f"{sorted(set((idx[:, 1] // a.tile_m).tolist()))[:12]}")
    print("bit-exact" if not bad else f"NOT bit-exact ({bad} differing gradient comparisons)")


if __name__ == "__main__":
    main()
