"""The forward's cost per tile and per K block, fa4 against flash-attn-4 (GPU).

Times the forward (median of ``triton.testing.do_bench``) at a fixed query length and a range of key
lengths, without a mask, and fits ``time * SMs = tiles * c + tiles * blocks * t`` by least squares:
``t`` is an SM's time per K block of a tile in the steady state, ``c`` what a tile costs on top (its
first ``Q K^T`` and softmax, last ``P V``, epilogue, the hand-over to the next tile). A tile's rows
are the kernel's ``tile_m`` (fa4's config; flash-attn-4 uses the same tiles on sm90 at d64 / d128).
Every fa4 config (the default and each variant) launches the same way, without LSE, through the fast
path's launch where it has one: with few K blocks a call is ~60 us of GPU time, and a slower host path
would be timed instead (session 52's first version timed its variants through ``run`` with LSE).

    python tools/tile_cost.py [--hdim 64,128] [--seqlen-q 16384] [--heads 16] [--seqlen-k 128,256,...] [name:field=value,...]
"""

from __future__ import annotations

import argparse
import ast
import math

import torch


def _fit(xs, ys):
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", default="64,128")
    ap.add_argument("--seqlen-q", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seqlen-k", default="128,256,512,1024,2048",
                    help="(below 4096: the d128 rows without a mask take K/V multicast from there, another kernel)")
    ap.add_argument("variants", nargs="*", help="name:field=value,... of FwdSm90Config fields (timed beside the default)")
    args = ap.parse_args()
    from dataclasses import replace

    from triton.testing import do_bench

    from fa4.config import AttnProblem
    from fa4.fwd import sm90

    try:
        from flash_attn.cute import flash_attn_func as peer
    except Exception:  # noqa: BLE001
        peer = None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# {torch.cuda.get_device_name(0)}, {sms} SMs")
    variants = []
    for spec in args.variants:
        name, _, body = spec.partition(":")
        variants.append((name, {k: ast.literal_eval(v) for k, v in (i.split("=", 1) for i in body.split(","))}))
    for d in (int(x) for x in args.hdim.split(",")):
        rows, tiles_of = {}, {}
        for sk in (int(x) for x in args.seqlen_k.split(",")):
            q = torch.randn(1, args.seqlen_q, args.heads, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, sk, args.heads, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            prob = AttnProblem("bf16", 1, args.seqlen_q, sk, args.heads, args.heads, d, d, d ** -0.5)
            base = sm90.make_config(prob, None, "sm_90a", need_lse=False)
            # Every fa4 config the same way: the first call the full way (run), then the fast path's launch
            # (Note [Fast path] in fa4/ops.py: no per-call host work), without LSE.
            cfgs = {"fa4": base, **{name: replace(base, **fields) for name, fields in variants}}
            fns = {}
            for name, cfg in cfgs.items():
                sm90.run(cfg, prob, q, k, v, out, None)
                fast = sm90.prepare_launch(cfg, prob, q.device)
                fns[name] = ((lambda fast=fast: fast(q, k, v, out, None)) if fast is not None else
                             (lambda cfg=cfg: sm90.run(cfg, prob, q, k, v, out, None)))
                tiles_of[name] = (cfg.tile_m, cfg.tile_n)
            if peer is not None:
                fns["flash-attn-4"] = lambda: peer(q, k, v)
                tiles_of["flash-attn-4"] = (base.tile_m, base.tile_n)
            for name, fn in fns.items():
                fn()
                ms = do_bench(fn, warmup=50, rep=200)
                tile_m, tile_n = tiles_of[name]
                tiles = math.ceil(args.seqlen_q / tile_m) * args.heads
                blocks = math.ceil(sk / tile_n)
                rows.setdefault(name, []).append((blocks, ms * 1e3 * sms / tiles, ms))
        print(f"## d{d}: per tile, SM-us (us x SMs / tiles); the peer counted in fa4's tiles "
              f"({tiles_of['fa4'][0]} x {tiles_of['fa4'][1]})")
        for name, pts in rows.items():
            c, t = _fit([p[0] for p in pts], [p[1] for p in pts])
            cells = " ".join(f"{b}:{y:.2f}" for b, y, _ in pts)
            print(f"{name:>14}: c = {c:.2f} us/tile, t = {t:.3f} us/block ({c / t:.2f} blocks)  [{cells}]")


if __name__ == "__main__":
    main()
