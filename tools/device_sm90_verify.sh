#!/usr/bin/env bash
# Device run: sm90 sweep of the defaults vs the plain grid, the whole GPU test suite, compute-sanitizer.
# Usage (device tool, carry [".device"]):  . .device/env.sh && bash tools/device_sm90_verify.sh [sweep,test,sanitize]
set -uo pipefail
steps=${1:-sweep,test,sanitize}
out=${OUT:-/tmp/out}; mkdir -p "$out"
export FA4_CACHE_DIR=${FA4_CACHE_DIR:-/tmp/fa4c}
has() { [[ ",$steps," == *",$1,"* ]]; }
timeout 120 python3 -m fa4 compile --arch sm_90a --jobs 15 > "$out/compile.log" 2>&1; tail -2 "$out/compile.log"
if has sweep; then
  timeout 240 python3 tools/sweep_fwd.py np:persistent=False,dynamic_sched=False 2>&1 | grep -v Warning | tee "$out/sweep.log" | tail -13
fi
if has test; then
  timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider -n 15 -x tests 2>&1 | tee "$out/gpu_tests.log" | tail -8
fi
if has sanitize; then
  for tool in memcheck racecheck synccheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 3 python3 tools/sanitize_sm90.py > "$out/sanitize_$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.log" | tail -1)"
  done
fi
