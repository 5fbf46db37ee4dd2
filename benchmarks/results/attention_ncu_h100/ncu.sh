#!/usr/bin/env bash
# ncu on kiln's attention kernels: decode b256/b64 at ctx 130 and 1000, prefill 2048.
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/ncu
which ncu || ls /opt/nvidia/nsight-compute/*/ncu
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for c in decode-256-130 decode-64-130 decode-256-1000 prefill-2048; do
  s=$SECONDS
  timeout 150 $NCU --clock-control none --kernel-name regex:paged_attention --launch-skip 2 --launch-count 1 \
     --set full --import-source no python gpu_snap/ncu_attention.py $c > $OUT/ncu/$c.txt 2>&1
  echo "$c rc $? $((SECONDS-s)) s"; grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Block Limit|Registers Per|Dynamic Shared|Compute \(SM\) Throughput|Waves Per SM|No Eligible|Issued Warp" $OUT/ncu/$c.txt | head -30
done
