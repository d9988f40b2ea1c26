"""Is a forward call host-bound? Its eager time (``triton.testing.do_bench``, as the benches time it)
beside the same call replayed from a CUDA graph (GPU time alone), for off-grid cases.

    python tools/host_vs_gpu.py [--cases mods-blockdoc-d128,mods-docmask-d128] [--impls fa4,flash-attn-4]

An eager time well above the replay's means the host cannot enqueue the call as fast as the GPU runs
it: the bench then measures the host (v0.35: block-sparse calls build their block table with some 20
small torch launches per call). A call that cannot be captured prints why.
"""

from __future__ import annotations

import argparse

import torch


def graph_ms(fn, iters: int = 20) -> float:
    """Median ms of one call, replayed from a CUDA graph of ``iters`` calls."""
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # warm-up on the side stream (first-call work, compile) before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return triton.testing.do_bench(graph.replay, return_mode="median") / iters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="mods-blockdoc-d128,mods-docmask-d128")
    ap.add_argument("--impls", default="fa4,flash-attn-4")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no GPU")
        return 2
    import triton.testing

    from fa4 import offgrid

    for name in args.cases.split(","):
        q, k, v, lq, lk, causal, varlen, flops = offgrid.build(offgrid.CASES[name])
        extra = offgrid.USER_FUNCS[name][1](q) if name in offgrid.USER_FUNCS else None
        fns = offgrid.callers(q, k, v, lq, lk, causal, varlen, False, extra=extra)
        for impl in args.impls.split(","):
            if impl not in fns:
                continue
            with torch.no_grad():
                eager = triton.testing.do_bench(fns[impl], return_mode="median")
                try:
                    replay = f"{graph_ms(fns[impl]):.3f} ms"
                except Exception as e:  # noqa: BLE001 - a call that cannot be captured says why
                    replay = f"n/a ({type(e).__name__}: {str(e)[:80]})"
            print(f"{name:24s} {impl:14s} eager {eager:.3f} ms | CUDA-graph replay {replay}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
