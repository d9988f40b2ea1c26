#!/usr/bin/env bash
# Session 48, branch wip/kv-mcast: K/V multicast in clusters of two (Note [K/V multicast] in
# fa4/fwd/sm90.py): its GPU test (bits equal to the plain grid), then five interleaved rounds of
# the non-causal rows (default, plain grid, plain grid with multicast), then its L2 sectors at
# d128 s16k (ncu, base clock) beside the plain grid's.
out=${OUT:-/tmp/out}
timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q -x tests/test_fwd_sm90_gpu.py -k kv_multicast \
  > "$out/mcast_test.log" 2>&1
rc=$?; echo "mcast test rc=$rc"; tail -3 "$out/mcast_test.log"
[ $rc = 0 ] || { grep -E "Error|error|assert" "$out/mcast_test.log" | head -20; exit 1; }
timeout 240 python3 tools/sweep_fwd.py --hdim 64,128,256 --seqlen 8192,16384 --causal no --repeat 5 \
  np:persistent=False,dynamic_sched=False,l2_section_mb=0 \
  mc:persistent=False,dynamic_sched=False,l2_section_mb=0,kv_mcast=True > "$out/mcast_sweep.log" 2>&1
echo "mcast sweep rc=$?"; grep -v Warning "$out/mcast_sweep.log" | tail -8
m=gpu__time_duration.sum,gpc__cycles_elapsed.max,lts__t_sectors_srcunit_tex_op_read.sum,dram__bytes_read.sum
for impl in fa4:persistent=False,dynamic_sched=False,l2_section_mb=0 fa4:persistent=False,dynamic_sched=False,l2_section_mb=0,kv_mcast=True; do
  timeout 100 ncu --clock-control base --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \
    --metrics $m python3 tools/ncu_fwd.py $impl 128,16384,0 > "$out/mcast_ncu.txt" 2>&1
  echo "== $impl rc=$?"; grep -E "duration|cycles|lts|dram" "$out/mcast_ncu.txt"
done
