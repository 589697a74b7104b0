#!/usr/bin/env bash
# Builds and runs every GEMM driver in dev/ (gemm_*.cu), logs everything to
# ${OUT:-/tmp}/dev_gemm.log and prints a summary table last: time in us and
# % of cuBLAS (same precision) per variant and layer shape.
#
#   bash dev/run_gemm.sh           # all variants
#   bash dev/run_gemm.sh --sweep   # also every v7 tile shape and v8 configuration
#
# Exits non-zero if a build fails or any driver fails validation.
set -uo pipefail
cd "$(dirname "$0")"

LOG="${OUT:-/tmp}/dev_gemm.log"
mkdir -p "$(dirname "$LOG")"
: >"$LOG"

DRIVERS=()
for src in gemm_*.cu; do DRIVERS+=("${src%.cu}"); done

if ! make -j"$(nproc)" "${DRIVERS[@]}" 2>&1 | tee -a "$LOG"; then
    echo "build failed, see $LOG"
    exit 1
fi

failed=()
run() {
    ./"$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "$* exited with status $rc" | tee -a "$LOG"
        failed+=("$*")
    fi
}
for d in "${DRIVERS[@]}"; do run "$d"; done
if [ "${1:-}" = "--sweep" ]; then run gemm_v7 --sweep; run gemm_v8 --sweep; fi

summary() {
echo
echo "== GEMM summary: time us (% of cuBLAS, same precision; >100% is faster) =="
awk -F'|' '
    function trim(s) { gsub(/^ +| +$/, "", s); return s }
    /^\| / && $3 ~ /^ *[0-9]+x[0-9]+x[0-9]+ *$/ {
        v = trim($2); s = trim($3) " " trim($4)
        if (!(v in seen_v)) { seen_v[v] = 1; variants[++nv] = v }
        if (!(s in seen_s)) { seen_s[s] = 1; shapes[++ns] = s }
        cell[v, s] = trim($5) " (" trim($8) ")"
    }
    END {
        line = "| variant |"; rule = "|---|"
        for (j = 1; j <= ns; j++) { line = line " " shapes[j] " |"; rule = rule "---|" }
        print line; print rule
        for (i = 1; i <= nv; i++) {
            line = "| " variants[i] " |"
            for (j = 1; j <= ns; j++) line = line " " ((variants[i], shapes[j]) in cell ? cell[variants[i], shapes[j]] : "-") " |"
            print line
        }
    }' "$LOG"
}
summary_text=$(summary)
echo "$summary_text" | tee -a "$LOG"
echo "full log: $LOG"

if [ "${#failed[@]}" -ne 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
