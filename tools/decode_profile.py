"""Where a decode call's time goes (issue 9): each implementation on the decode shapes, timed with
``triton.testing.do_bench`` (median, µs) and profiled with ``torch.profiler``: the average device
time of each kernel it launches, and the span of one call on the device (first kernel start to last
kernel end, calls separated by a sleep). ``python3 tools/decode_profile.py [--fa4-only]``.

fa4 runs with its default split count and with explicit ones, on the contiguous cache and on the
shuffled paged cache of 16-row pages; the peers (cuDNN via SDPA, flash-attn-4 contiguous and paged)
run with their defaults."""
import collections
import statistics
import sys
import time

import torch
import triton

import fa4
from fa4.bench import DECODE_SHAPES, PAGE_SIZE, paged_cache
from fa4.testing import random_qkv


def profile(fn, calls=12):
    """(kernel name -> average µs per call, average device span of a call in µs)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
            time.sleep(2e-3)
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0),
        key=lambda e: e.time_range.start)
    per_name = collections.defaultdict(float)
    spans, start, end = [], None, None
    for e in kernels:
        per_name[e.name[:60]] += e.device_time / calls
        if start is None or e.time_range.start - end > 1000:  # a new call (after the 2 ms sleep)
            if start is not None:
                spans.append(end - start)
            start = e.time_range.start
        end = e.time_range.end
    if start is not None:
        spans.append(end - start)
    return dict(per_name), (statistics.median(spans) if spans else float("nan"))


def main():
    fa4_only = "--fa4-only" in sys.argv
    for shape in DECODE_SHAPES:
        q, k, v = random_qkv(shape.batch, 1, shape.seqlen_k, shape.heads, shape.hk, shape.hdim, torch.bfloat16,
                             "cuda", seed=0)
        kc, vc, table, used = paged_cache(k, v, PAGE_SIZE)
        impls = {}
        # The wave arithmetic of a split count S (memory-bound CTAs of equal speed): rounds
        # ceil(tiles * S / SMs) of n_blocks / S blocks each; S = 33 balances 64 and 512 tiles on 132 SMs.
        for splits in (None, 1, 2, 3, 4, 8, 16, 33):
            impls[f"fa4 splits={splits}"] = (lambda s=splits: fa4.flash_attn_func(q, k, v, num_splits=s))
        for splits in (None, 1, 2, 4, 16, 33):
            impls[f"fa4-paged16 splits={splits}"] = (lambda s=splits: fa4.flash_attn_varlen_func(
                q, kc, vc, page_table=table, seqused_k=used, num_splits=s))
        if not fa4_only:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            from torch.nn.functional import scaled_dot_product_attention

            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

            impls["cudnn"] = cudnn
            try:
                from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

                impls["flash-attn-4"] = lambda: flash_attn_func(q, k, v)
                impls["flash-attn-4-paged16"] = lambda: flash_attn_varlen_func(q, kc, vc, page_table=table,
                                                                               seqused_k=used)
            except ImportError as e:
                print(f"flash-attn-4 not importable: {e}")
        print(f"== b{shape.batch} sk{shape.seqlen_k} (K+V {shape.kv_bytes / 1e9:.2f} GB)", flush=True)
        for name, fn in impls.items():
            try:
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                kernels, span = profile(fn)
            except Exception as e:  # report and go on
                print(f"{name:26s} ERR {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            ks = "; ".join(f"{n} {t:.1f}" for n, t in sorted(kernels.items(), key=lambda kv: -kv[1]))
            print(f"{name:26s} bench {ms * 1e3:6.1f} us ({shape.kv_bytes / ms / 1e9:4.2f} TB/s)  span {span:6.1f} us  "
                  f"kernels: {ks}", flush=True)
        del kc, vc


if __name__ == "__main__":
    main()
