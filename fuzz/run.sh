#!/usr/bin/env bash
# Runs each reader's libFuzzer target for a bounded time; make fuzz calls it after building.
#   fuzz/run.sh SECONDS READER...
# One line per reader: executions, crashes (any input that made a sanitizer or a promise of
# fuzz/readers.cu fail, saved under fuzz/build/artifacts/READER/), corpus size. The corpus in
# fuzz/build/corpus/READER grows from run to run; the seeds come from data/ (seed_corpus.py).
# Exits non-zero if any reader crashed.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: fuzz/run.sh SECONDS READER..." >&2; exit 2; }
seconds=$1
shift
status=0
total_execs=0
total_crashes=0
for reader in "$@"; do
    bin=fuzz/build/fuzz_$reader corpus=fuzz/build/corpus/$reader artifacts=fuzz/build/artifacts/$reader
    log=fuzz/build/$reader.log
    [ -x "$bin" ] || { echo "fuzz: $bin is missing. HINT: make fuzz builds it" >&2; exit 2; }
    rm -rf "$artifacts" && mkdir -p "$corpus" "$artifacts" || exit 2
    # -rss_limit_mb also caps any single malloc: a reader that trusts a size in a header fails here
    "$bin" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        -artifact_prefix="$artifacts/" "$corpus" "fuzz/build/seeds/$reader" > "$log" 2>&1
    rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    if [ -z "$execs" ]; then # no final stats after a crash: take the last progress line
        execs=$(grep -o '^#[0-9]*' "$log" | tail -n 1 | tr -d '#')
    fi
    crashes=$(find "$artifacts" -type f | wc -l)
    inputs=$(find "$corpus" -type f | wc -l)
    echo "fuzz $reader: ${execs:-0} executions in ${seconds} s, $crashes crashes, corpus $inputs inputs (log $log)"
    if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then
        status=1
        grep -m 3 -E "ERROR|SUMMARY|runtime error|Test unit written" "$log" | sed 's/^/    /'
    fi
    total_execs=$((total_execs + ${execs:-0}))
    total_crashes=$((total_crashes + crashes))
done
echo "fuzz: $total_execs executions, $total_crashes crashes over $# readers"
exit $status
