#!/usr/bin/env bash
# Where --iwae's time goes: device time per kernel over a whole run (Nsight Systems), then one
# pass of the fused decoder under Nsight Compute (pipe use, issue, stall reasons).
# Usage: bash dev/profile_iwae.sh [K] [images]   (default 5000 1000); logs in ${OUT:-/tmp}
set -uo pipefail
OUT=${OUT:-/tmp}
K=${1:-5000}
N=${2:-1000}
make -s vae || exit 1
if command -v nsys > /dev/null; then
    nsys profile -o "$OUT/iwae_nsys" --force-overwrite true ./vae --iwae "$K" -n "$N" --precision bf16 > /dev/null 2>&1
    nsys stats --report cuda_gpu_kern_sum --format table "$OUT/iwae_nsys.nsys-rep" 2>/dev/null | tee "$OUT/iwae_nsys.log"
fi
# the launches: the untimed warm-up pass (sampling, decoder, logsumexp), then the first timed pass
ncu --clock-control none --kernel-name regex:'sample_z|decoder_wgmma|iwae_logsumexp' --launch-skip 3 --launch-count 3 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --metrics sm__pipe_tensor_op_hgmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warp_latency_issue_stalled_.*\.ratio \
    ./vae --iwae "$K" -n "$N" --precision bf16 2>&1 | grep -v "^iwae:" | tee "$OUT/iwae_ncu.log"
