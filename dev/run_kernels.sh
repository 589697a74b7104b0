#!/usr/bin/env bash
# Builds and runs every non-GEMM driver in dev/ (reparam_*, loss_*, convert_*),
# logs everything to ${OUT:-/tmp}/dev_kernels.log and prints the result rows of
# each family last.
#
#   bash dev/run_kernels.sh                # all families
#   bash dev/run_kernels.sh loss reparam   # only these families
#
# Exits non-zero if a build fails or any driver fails validation.
set -uo pipefail
cd "$(dirname "$0")"

LOG="${OUT:-/tmp}/dev_kernels.log"
mkdir -p "$(dirname "$LOG")"
: >"$LOG"

if [ "$#" -gt 0 ]; then FAMILIES=("$@"); else FAMILIES=(reparam loss convert); fi
DRIVERS=()
for f in "${FAMILIES[@]}"; do
    for src in "$f"_v*.cu; do [ -e "$src" ] && DRIVERS+=("${src%.cu}"); done
done

if ! make -j"$(nproc)" "${DRIVERS[@]}" 2>&1 | tee -a "$LOG"; then
    echo "build failed, see $LOG"
    exit 1
fi

failed=()
for d in "${DRIVERS[@]}"; do
    echo "== ./$d" | tee -a "$LOG"
    ./"$d" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "$d exited with status $rc" | tee -a "$LOG"
        failed+=("$d")
    fi
done

# Collected before anything is appended to the log, so the summary never reads itself.
summary=$(
    echo
    echo "== summary (time us, throughput, % of roofline; roofline = measured device copy or the bf16 mma rate) =="
    grep -m1 '^memory roofline' "$LOG"
    for f in "${FAMILIES[@]}"; do
        echo
        echo "### $f"
        echo "| variant | problem | time us | throughput | % of roofline | check |"
        echo "|---|---|---|---|---|---|"
        awk -v fam="$f" '
            /^== \.\// { name = substr($2, 3); in_fam = index(name, fam "_v") == 1; next }
            in_fam && /^\| / && !/^\| variant/ && !/^\|---/ { print }' "$LOG"
    done
)
echo "$summary" | tee -a "$LOG"
echo "full log: $LOG"

if [ "${#failed[@]}" -ne 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
