"""Disk-cache check on a GPU machine, through the backward preprocess kernel.

    python tools/cache_check.py run CACHE_DIR     # one process: get the kernel (compile or load), run, verify
    python tools/cache_check.py all [CPU_CACHE]   # fresh cache: process 1 compiles, process 2 loads;
                                                  # then (if given) a cache built on a CPU machine is used
Prints one JSON line per process: compile seconds, load milliseconds, correctness.
"""

import json
import os
import subprocess
import sys
import tempfile
import time


def run_once() -> dict:
    import torch

    t_import = time.perf_counter()
    from fa4 import jit
    from fa4.bwd.preprocess import make_config, run_preprocess
    from fa4.bwd.workspace import dq_accum_shape, head_dim_padded, rows_shape

    b, s, h, d = 2, 1000, 8, 128
    torch.manual_seed(0)
    out = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn_like(out)
    lse = torch.randn(b, h, s, device="cuda")
    lse_log2 = torch.full(rows_shape(b, h, s, 64, False), float("nan"), device="cuda")  # 1000 rows -> 1024
    dpsum = torch.full_like(lse_log2, float("nan"))
    dq_accum = torch.full(dq_accum_shape(b, h, s, head_dim_padded(d), 64, False), float("nan"), device="cuda")
    cfg = make_config("bf16", d, "sm_90a", varlen=False, has_dlse=False, has_semaphore=False)
    t0 = time.perf_counter()
    jit.get_kernel(cfg)  # compile or load, timed alone
    get_s = time.perf_counter() - t0
    cfg2 = make_config("bf16", 64, "sm_90a", varlen=True, has_dlse=True, has_semaphore=False)
    t0 = time.perf_counter()
    jit.get_kernel(cfg2)  # a second kernel: the runtime libraries are loaded by now
    get2_s = time.perf_counter() - t0
    run_preprocess(out, dout, lse, lse_log2, dpsum, dq_accum)
    torch.cuda.synchronize()
    ref = (out.float() * dout.float()).sum(-1).transpose(1, 2)
    ok = (torch.allclose(dpsum[..., :s], ref, atol=1e-3, rtol=1e-4) and bool((dq_accum == 0).all())
          and torch.allclose(lse_log2[..., :s], lse * 1.4426950408889634))
    n = 2000
    for _ in range(20):
        run_preprocess(out, dout, lse, lse_log2, dpsum, dq_accum)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        run_preprocess(out, dout, lse, lse_log2, dpsum, dq_accum)
    torch.cuda.synchronize()
    per_call_us = (time.perf_counter() - t0) / n * 1e6
    info = jit.cache_info()
    return {"ok": ok, "get_kernel_s": round(get_s, 4), "second_kernel_s": round(get2_s, 4), "compiles": info["misses"], "disk_hits": info["disk_hits"],
            "compile_s": info["compile_seconds"], "load_ms": round(info["load_seconds"] * 1e3, 2),
            "launch_us_per_call": round(per_call_us, 2), "import_s": round(time.perf_counter() - t_import, 2)}


def main() -> None:
    mode = sys.argv[1]
    if mode == "run":
        os.environ["FA4_CACHE_DIR"] = sys.argv[2]
        print(json.dumps(run_once()))
        return
    fresh = tempfile.mkdtemp(prefix="fa4-cache-")
    runs = [("fresh: compile", fresh), ("second process: load", fresh)]
    if len(sys.argv) > 2:
        runs.append(("cache built on the CPU machine", os.path.abspath(sys.argv[2])))
    for label, cache in runs:
        r = subprocess.run([sys.executable, __file__, "run", cache], capture_output=True, text=True)
        line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]
        print(f"{label}: {line}", flush=True)


if __name__ == "__main__":
    main()
