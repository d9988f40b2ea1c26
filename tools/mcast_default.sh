#!/usr/bin/env bash
# Session 48, branch wip/kv-mcast with K/V multicast the d128 non-causal default (KV_MCAST_BUCKETS):
# five rounds of d128 s1k-s16k against the old default (persistent, no multicast), the forward grid
# beside the peers, then the sm90 forward's GPU tests (as many as the time allows).
out=${OUT:-/tmp/out}
timeout 90 python3 tools/sweep_fwd.py --hdim 128 --seqlen 1024,4096,8192,16384 --causal no --repeat 5 \
  old:kv_mcast=False,persistent=True > "$out/mcd_sweep.log" 2>&1
echo "sweep rc=$?"; grep -v Warning "$out/mcd_sweep.log" | tail -5
timeout 90 python3 -m fa4.bench --mode fwd --causal both --repeats 3 --out "$out/mcd_bench" > "$out/mcd_bench.log" 2>&1
echo "bench rc=$?"; grep -E '^# (gpu|bf16|fwd)' "$out/mcd_bench.log"; grep -E '^ *[0-9]+ +[0-9]+ +[0-9]+ ' "$out/mcd_bench.log" | cut -c1-125
timeout 110 python3 -m pytest -m gpu -p no:cacheprovider -q -x $(python3 -c "import xdist" 2>/dev/null && printf -- '-n 12') tests/test_fwd_sm90_gpu.py > "$out/mcd_tests.log" 2>&1
echo "tests rc=$?"; tail -4 "$out/mcd_tests.log"
