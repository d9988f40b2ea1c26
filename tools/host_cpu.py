"""Host time per repeated forward call on the CPU, kernels stubbed (no GPU needed):

    python tools/host_cpu.py [TREE ...]

Each TREE is a directory holding an ``fa4/`` package (default: this checkout); give several to
compare them, e.g. main's unpacked beside the working tree (``git archive main fa4 | tar -x -C
/tmp/main``). Every tree runs in its own process, the trees interleaved over ``--rounds`` rounds,
and the minimum per row and tree is printed (this machine's noise is one-sided).

What is timed is the path from ``flash_attn_func`` / ``flash_attn_with_kvcache`` to the launch:
the fast path (Note [Fast path] in fa4/ops.py) of the latency rows, and a kvcache decode step. The
kernels are recorders, the GPU an sm_90 of 132 SMs and the tensors CPU tensors under
``validate.allow_any_device``, as the ``calls`` fixture of tests/conftest.py sets up. RESULTS v0.41
found a 3-4 us regression of the latency rows this way (the outputs' allocation) before the GPU.
"""
import argparse
import os
import subprocess
import sys

ROWS = ((1, 128, 512, 16, 16, 128), (8, 1, 512, 32, 8, 128))  # (b, sq, sk, h, h_k, d): bench.LATENCY_SHAPES'
CALLS = 2000


def measure(calls: int) -> None:
    """In the child process: print ``row us`` lines, the minimum of 5 batches of ``calls`` calls."""
    import time
    import warnings

    import torch

    import fa4
    from fa4 import jit, validate
    from fa4.fwd import sm90

    warnings.simplefilter("ignore")
    jit.get_kernel = lambda cfg: (lambda *a: None)
    sm90._num_sms = lambda device: 132
    fa4.arch.device_capability = lambda index: (9, 0)
    torch.cuda.current_device = lambda: None

    def best(fn, n):
        fn()
        fn()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            times.append((time.perf_counter() - t) / n * 1e6)
        return min(times)

    print(f"fa4: {os.path.dirname(os.path.dirname(fa4.__file__))}", flush=True)
    with validate.allow_any_device():
        gen = torch.Generator().manual_seed(0)
        for b, sq, sk, h, hk, d in ROWS:
            q = torch.randn(b, sq, h, d, generator=gen, dtype=torch.bfloat16)
            k, v = (torch.randn(b, sk, hk, d, generator=gen, dtype=torch.bfloat16) for _ in range(2))
            print(f"flash_attn_func b{b} sq{sq} sk{sk} h{h}/{hk} d{d}: "
                  f"{best(lambda: fa4.flash_attn_func(q, k, v), calls):.2f}", flush=True)
        q = torch.randn(8, 1, 32, 128, generator=gen, dtype=torch.bfloat16)
        kc, vc = (torch.randn(8, 512, 8, 128, generator=gen, dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((8,), 300, dtype=torch.int32)
        print(f"flash_attn_with_kvcache b8 h32/8 d128 cache 512: "
              f"{best(lambda: fa4.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True), calls // 4):.2f}",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*", default=[os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=CALLS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        measure(args.calls)
        return 0
    best: dict = {}
    for _ in range(args.rounds):
        for tree in args.trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), CUTE_DSL_ARCH="sm_90a")
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--calls", str(args.calls)],
                                 env=env, capture_output=True, text=True, cwd=os.path.abspath(tree))
            if run.returncode:
                print(run.stderr[-2000:], file=sys.stderr)
                return run.returncode
            lines = run.stdout.splitlines()
            if lines[0] != f"fa4: {os.path.abspath(tree)}":  # (an installed fa4 ahead of the tree's)
                print(f"{tree}: imported {lines[0]}", file=sys.stderr)
                return 1
            for line in lines[1:]:
                row, us = line.rsplit(": ", 1)
                key = (tree, row)
                best[key] = min(best.get(key, float("inf")), float(us))
    width = max(len(t) for t in args.trees)
    for (tree, row), us in best.items():
        print(f"{tree:<{width}}  {row}: {us:.2f} us (min of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
