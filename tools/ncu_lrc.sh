#!/usr/bin/env bash
# Session 48: do the L2 request coalescers (LRC, one a GPC) merge flash-attn-4's K/V reads more than
# fa4's? tools/ncu_l2.sh found fa4 reading 46% more L2 sectors than flash-attn-4 at d128 s16k (20%
# at d64 s8k) with the same DRAM bytes, both below the K/V volume the tiles request. This lists
# the chip's lrc__ metrics, then reads those of sectors / requests for both kernels (base clock).
out=${OUT:-/tmp/out}
ncu --query-metrics --chip gh100 > "$out/metrics_gh100.txt" 2>&1
grep -E '^(lrc|lts__t_requests)' "$out/metrics_gh100.txt" | cut -c1-150 | head -40
m=$(grep -oE '^lrc__[a-z_0-9]+' "$out/metrics_gh100.txt" | sort -u | grep -vE 'pct|ratio|per_' | head -16 | sed 's/$/.sum/' | paste -sd,)
m="gpu__time_duration.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,$m"
echo "metrics: $m"
i=0
for shape in 128,16384,0 64,8192,0; do
  for impl in fa4 peer; do
    i=$((i+1)); f="$out/ncului_$i.txt"
    timeout 120 ncu --clock-control base --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \
      --metrics "$m" python3 tools/ncu_fwd.py $impl $shape > "$f" 2>&1
    rc=$?
    if [ $rc != 0 ]; then  # an lrc__ name ncu refuses: those of sectors / requests only
      m2=$(echo "$m" | tr , '\n' | grep -E 'duration|lts|sector|request' | paste -sd,)
      timeout 120 ncu --clock-control base --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \
        --metrics "$m2" python3 tools/ncu_fwd.py $impl $shape > "$f" 2>&1
      rc=$?
    fi
    echo "== $shape $impl rc=$rc"
    grep -E "duration|lts|lrc|ERR|rror" "$f" | grep -v Profiling | cut -c1-120
  done
done
