"""The backward preprocess alone (issue 8): its tile (rows per CTA) and thread count, with and without
zeroing dq_accum, and the zeroing as torch's fill instead; median of do_bench in µs and the bytes'
rate (O + dO read, lse / dpsum written, dq_accum zeroed). ``python3 tools/preprocess_sweep.py``."""
import dataclasses
import itertools

import torch
import triton

from fa4.bwd import preprocess
from fa4.bwd.workspace import dq_accum_shape, rows_shape

ROWS = [(128, 1024, 16, 16), (128, 8192, 2, 16), (64, 8192, 2, 32)]  # (d, s, b, h): 16k tokens x 2048


def main():
    make = preprocess.make_config
    for d, s, b, h in ROWS:
        o, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lse = torch.randn(b, h, s, device="cuda", dtype=torch.float32)
        lse_log2 = torch.empty(rows_shape(b, h, s, 64, False), device="cuda", dtype=torch.float32)
        dpsum = torch.empty_like(lse_log2)
        dq_accum = torch.empty(dq_accum_shape(b, h, s, d, 64, False), device="cuda", dtype=torch.float32)
        sem = torch.empty(b, h, s // 64, device="cuda", dtype=torch.int32)
        read = 2 * o.numel() * 2 + lse.numel() * 4
        print(f"== d{d} s{s} b{b} h{h}: O + dO {2 * o.numel() * 2 / 1e6:.0f} MB, dq_accum {dq_accum.numel() * 4 / 1e6:.0f} MB",
              flush=True)
        t_fill = triton.testing.do_bench(lambda: dq_accum.zero_(), return_mode="median") * 1e3
        print(f"dq_accum.zero_(): {t_fill:.1f} us", flush=True)
        for (tile_m, threads), zero in itertools.product(((128, 128), (64, 128), (64, 64), (32, 128), (128, 256),
                                                          (64, 256), (32, 64)), (True, False)):
            preprocess.make_config = lambda *a, tm=tile_m, th=threads, **k: dataclasses.replace(
                make(*a, **k), tile_m=tm, num_threads=th)
            try:
                fn = lambda: preprocess.run_preprocess(o, do, lse, lse_log2, dpsum, dq_accum, semaphore=sem,  # noqa: E731
                                                       dq_tile_m=64, zero_dq=zero)
                fn()
                ms = triton.testing.do_bench(fn, return_mode="median")
            except Exception as e:  # report and go on
                print(f"tile_m {tile_m} threads {threads} zero {zero}: ERR {type(e).__name__}: {str(e)[:100]}")
                continue
            nbytes = read + (dq_accum.numel() * 4 if zero else 0)
            print(f"tile_m {tile_m:3d} threads {threads:3d} zero_dq {zero!s:5}: {ms * 1e3:6.1f} us "
                  f"({nbytes / ms / 1e9:.2f} TB/s)", flush=True)
        preprocess.make_config = make


if __name__ == "__main__":
    main()
