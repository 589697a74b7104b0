#!/usr/bin/env bash
# Per-kernel device time of one forward pass (Nsight Compute, clocks left alone).
# Usage: [PRECISIONS="bf16"] bash dev/profile.sh [batch ...]   (default 1024 4096); log in ${OUT:-/tmp}/profile.log
set -uo pipefail
OUT=${OUT:-/tmp}
make -s vae || exit 1
for B in ${*:-1024 4096}; do
    for p in ${PRECISIONS:-bf16 fp32}; do
        echo "== ./vae --precision $p -n $B -b $B (first forward pass only)"
        ncu --clock-control none --launch-count 8 --kernel-name regex:'encoder|decoder|bce|linear_fp32|reparam' \
            --metrics gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size,sm__warps_active.avg.pct_of_peak_sustained_active \
            --csv --page raw ./vae --precision $p -n $B -b $B -o /tmp/profile_images 2>/dev/null |
            python3 -c "
import csv, sys
rows = [r for r in csv.reader(sys.stdin) if len(r) > 10]
head = rows[0]; col = {h: i for i, h in enumerate(head)}
keys = ['gpu__time_duration.sum', 'launch__grid_size', 'launch__block_size', 'sm__throughput.avg.pct_of_peak_sustained_elapsed', 'dram__throughput.avg.pct_of_peak_sustained_elapsed', 'sm__warps_active.avg.pct_of_peak_sustained_active']
print('%-40s %10s %8s %6s %8s %8s %8s' % ('kernel', 'time ' + rows[1][col['gpu__time_duration.sum']], 'grid', 'block', 'SM%', 'DRAM%', 'occ%'))
for r in rows[2:]:
    name = r[col['Kernel Name']].split('(')[0][:40]
    print('%-40s %10s %8s %6s %8s %8s %8s' % tuple([name] + [r[col[k]] for k in keys]))
"
    done
done 2>&1 | tee "$OUT/profile.log"
