#!/usr/bin/env bash
# Session 48: where fa4's extra L2 traffic at d128 s16k comes from (ncu next64: 15.0 GB against
# flash-attn-4's 9.7 GB, the same DRAM bytes): L2 sectors by source unit (SMs / the L2 fabric
# between the two partitions), fa4 persistent and on the plain grid, and the peer; d128 s16k and
# d64 s8k, base clock.
out=${OUT:-/tmp/out}
m=gpu__time_duration.sum,gpc__cycles_elapsed.max,lts__t_bytes.sum,lts__t_sectors.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_lookup_hit.sum,lts__t_sectors_srcunit_tex_lookup_miss.sum,dram__bytes_read.sum
i=0
for shape in 128,16384,0 64,8192,0; do
  for impl in fa4 fa4:persistent=False,dynamic_sched=False peer; do
    i=$((i+1)); f="$out/ncul2_$i.txt"
    timeout 100 ncu --clock-control base --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \
      --metrics $m python3 tools/ncu_fwd.py $impl $shape > "$f" 2>&1
    echo "== $shape $impl rc=$?"
    grep -E "x\(|duration|cycles|lts|dram" "$f" | grep -v Profiling | sed 's/kernel_cutlass_kernel_[A-Za-z0-9_]*//' | cut -c1-120
  done
done
