#!/usr/bin/env bash
# One GPU-machine session: environment facts, parallel precompile, GPU tests, benchmark.
# Usage (device tool, carry [".device"]):  . .device/env.sh && bash tools/device_session.sh STEPS [pytest args...]
# STEPS: comma list of env,compile,test,bench,latency (default env,compile,test). Logs go to $OUT.
set -uo pipefail
steps=${1:-env,compile,test}; shift || true
out=${OUT:-/tmp/out}; mkdir -p "$out"
export FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4-cache}
has() { [[ ",$steps," == *",$1,"* ]]; }
if has env; then
  { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
    python3 -c "import torch, cutlass, tvm_ffi; print('torch', torch.__version__, 'cuda', torch.version.cuda); print('dsl', cutlass.__version__ if hasattr(cutlass,'__version__') else '?', 'tvm_ffi', tvm_ffi.__version__)"
  } 2>&1 | tee "$out/env.log"
fi
if has compile; then
  # compile the sm_90a variants that the tests and the bench need, 12 processes (file-locked cache)
  timeout 300 python3 -m fa4 compile --arch sm_90a --jobs 12 ${FA4_COMPILE_FILTER:-} 2>&1 | tail -60 | tee "$out/compile.log"
fi
if has test; then
  timeout 420 python3 -m pytest -m gpu -x -q -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_tests.log" | tail -40
fi
if has bench; then
  timeout 400 python3 -m fa4.bench --mode both --out "$out/bench" ${FA4_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | tail -60
fi
if has latency; then
  timeout 120 python3 -m fa4.bench --latency --out "$out/latency" 2>&1 | tee "$out/latency.log" | tail -20
fi
