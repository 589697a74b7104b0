#!/usr/bin/env bash
# Where the warps of each bf16 kernel wait (Nsight Compute stall reasons, % of active warp cycles).
# Usage: bash dev/ncu_stalls.sh [batch]   (default 4096)
set -uo pipefail
B=${1:-4096}
make -s vae || exit 1
reasons="barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected lg_throttle dispatch_stall no_instruction branch_resolving tex_throttle imc_miss drain membar sleeping"
metrics=gpu__time_duration.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active
for r in $reasons; do metrics+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
ncu --clock-control none -k regex:'encoder_|decoder_' --launch-count 3 --metrics "$metrics" \
    ./vae --precision bf16 -n $B -b $B -o /tmp/ncu_images 2>/dev/null | grep -E "(encoder|decoder)_[a-z]*_kernel|duration|inst_executed|hmma|warps_active|stalled" |
    sed -E 's/smsp__average_warps_issue_stalled_(.*)_per_issue_active.ratio/stall \1 (warps per issue)/'
