"""SM clock and board power while fa4's and flash-attn-4's forwards run (device; the peer from
``pack.sh --with-peer``): is a gap between them in the loop's cycles, or in the clocks each one
runs at? Run beside a sampler that writes ``nvidia-smi`` readings with wall-clock stamps::

    nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > smi.csv &
    python3 tools/clocks_fwd.py smi.csv [d,s,causal ...]

Each shape (bf16, b*s = 16k tokens, h*d = 2048, as ``tools/ncu_fwd.py``) is timed with
``triton.testing.do_bench`` (median; session 46's readings in RESULTS v0.47 were its mean, the
default then), fa4 and the peer in turn, three rounds; each timing's window
is stamped, and at the end the sampler's readings inside each window are averaged (SM MHz, W).
"""
import datetime
import statistics
import sys
import time

import torch
from triton.testing import do_bench

from fa4 import flash_attn_func as fa4_fwd

try:
    from flash_attn.cute import flash_attn_func as peer_fwd
except ImportError:  # the peer is optional; fa4 alone still shows its clocks
    peer_fwd = None

smi = sys.argv[1]
shapes = [tuple(int(x) for x in a.split(",")) for a in sys.argv[2:]] or [(128, 8192, 0)]
windows = []  # (shape, impl, round, t0, t1, ms)
for d, s, causal in shapes:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    impls = {"fa4": fa4_fwd}
    if peer_fwd is not None:
        impls["flash-attn-4"] = peer_fwd
    for fn in impls.values():
        fn(q, k, v, causal=bool(causal))
    torch.cuda.synchronize()
    for r in range(3):
        for name, fn in impls.items():
            t0 = time.time()
            ms = do_bench(lambda: fn(q, k, v, causal=bool(causal)), warmup=100, rep=1500, return_mode="median")
            windows.append(((d, s, causal), name, r, t0, time.time(), ms))
            print(f"d{d} s{s} causal={causal} {name} round {r}: {ms:.4f} ms", flush=True)

time.sleep(0.2)
samples = []
for line in open(smi):
    parts = [p.strip() for p in line.split(",")]
    try:
        t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        samples.append((t, float(parts[1].split()[0]), float(parts[2].split()[0]), float(parts[3])))
    except (ValueError, IndexError):
        continue
print(f"{len(samples)} sampler readings")
print("shape impl round: ms, TFLOP/s, mean SM MHz, mean W, max temp C (readings)")
for shape, name, r, t0, t1, ms in windows:
    d, s, causal = shape
    flops = 4 * (16384 // s) * (2048 // d) * s * s * d / (2 if causal else 1)
    inside = [x for x in samples if t0 + 0.3 <= x[0] <= t1]  # past the warm-up's first readings
    if inside:
        mhz = statistics.mean(x[1] for x in inside)
        watts = statistics.mean(x[2] for x in inside)
        temp = max(x[3] for x in inside)
        print(f"d{d} s{s} c{causal} {name:13s} r{r}: {ms:.4f} ms {flops / ms / 1e9:6.1f} TFLOP/s "
              f"{mhz:6.0f} MHz {watts:5.0f} W {temp:3.0f} C ({len(inside)})")
    else:
        print(f"d{d} s{s} c{causal} {name:13s} r{r}: {ms:.4f} ms, no readings in the window")
