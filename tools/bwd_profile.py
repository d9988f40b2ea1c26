"""Where a backward call's time goes (issue 8): fa4 (non-deterministic and deterministic) and its
peers on grid rows, timed as ``fa4.bench`` times the backward (median of do_bench of
``torch.autograd.grad``) and profiled with ``torch.profiler`` (the average device time of each
kernel of one call, and the call's device span). ``python3 tools/bwd_profile.py [--claims] d,s,causal
...``, e.g. ``128,1024,1 128,8192,0``; ``--claims`` adds ``fa4-claims``, the non-deterministic kernel
with the first store (Note [First store] in fa4/bwd/sm90.py, ``DQ_FIRST_STORE[False]``; in the rotated
order without a mask, ``CLAIM_ROTATE``), and ``fa4-claims-plain``, the same in the plain order (rows
without a mask only). The host's time per call (:func:`host_us`) is printed too."""
import sys
import time

import torch
import triton

import fa4
from decode_profile import profile
from fa4.bwd import sm90
from fa4.bench import _results, flash_attn4_impl, fa4_impl, grid_shape, sdpa_impl
from fa4.testing import random_qkv


def host_us(fn, calls=20, busy=False):
    """The host's time per call, the device left running behind it (no sync inside the loop): what
    ``do_bench`` adds to a call's device time when the host, not the device, is behind. ``busy``:
    about a second of device work is queued first, so that no call can wait for the device."""
    torch.cuda.synchronize()
    if busy:
        torch.cuda._sleep(int(2e9))
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def row_inputs(row):
    """``"d,s,causal"`` -> (d, s, causal, grid shape, q, k, v, dout) on the standard grid (bf16, seed 0)."""
    d, s, causal = (int(x) for x in row.split(","))
    shape = grid_shape(d, s, bool(causal))
    q, k, v = random_qkv(shape.batch, s, s, shape.heads, shape.heads, d, torch.bfloat16, "cuda", seed=0)
    return d, s, causal, shape, q, k, v, torch.randn_like(q)


def main(rows, claims=False):
    impls = [fa4_impl({}, False), fa4_impl({}, True, name="fa4-det"), flash_attn4_impl(False),
             sdpa_impl("cudnn", "CUDNN_ATTENTION")]
    if claims:
        impls[1:1] = [fa4_impl({}, False, name="fa4-claims"), fa4_impl({}, False, name="fa4-claims-plain")]
    default, rotate = sm90.DQ_FIRST_STORE[False], sm90.CLAIM_ROTATE
    for row in rows:
        d, s, causal, shape, q, k, v, dout = row_inputs(row)
        print(f"== d{d} s{s} causal={bool(causal)} (b{shape.batch} h{shape.heads})", flush=True)
        for impl in impls:
            if impl.name == "fa4-claims-plain" and causal:
                continue  # (a mask: the plain order either way)
            forced = impl.name.startswith("fa4-claims")
            sm90.DQ_FIRST_STORE[False] = forced or default  # the non-deterministic first store (plans re-made)
            sm90.CLAIM_ROTATE = impl.name == "fa4-claims" or (rotate and impl.name != "fa4-claims-plain")
            fa4.ops._plans.clear()
            try:
                prepared = impl.setup(q, k, v, bool(causal), True)
                with prepared.context():
                    fn, _ = _results(prepared, "bwd", dout)
                    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                    kernels, span = profile(fn, calls=8)
                    host = host_us(fn)
            except Exception as e:  # report and go on
                print(f"{impl.name:14s} ERR {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            ks = "; ".join(f"{n[:48]} {t:.1f}" for n, t in sorted(kernels.items(), key=lambda kv: -kv[1]))
            print(f"{impl.name:14s} bench {ms * 1e3:7.1f} us  span {span:7.1f} us  host {host:6.1f} us  kernels(us): {ks}",
                  flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--claims"]
    main(args or ["128,1024,1", "128,1024,0", "128,4096,1", "128,16384,0", "64,8192,0"], "--claims" in sys.argv)
