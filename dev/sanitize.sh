#!/usr/bin/env bash
# compute-sanitizer on the GPU code, then the command-line edge cases that need a GPU.
#   make sanitize                  builds vae and test_vae, then runs this (on a machine with a GPU)
#   bash dev/sanitize.sh [sections] sections: sanitize cli (default both)
# sanitize: each tool (memcheck: out-of-bounds and misaligned accesses, device leaks; racecheck:
#   shared-memory races; initcheck: reads of uninitialized device memory; synccheck: barrier
#   misuse) on `./vae -n 512`, `./vae --iwae 8 -n 64` and `./test_vae --quick --gpu-only` (the
#   GPU checks on a 130-image subset, batch 1 only in the B = 1 reference case: see test_vae.cu),
#   each in fp32 and bf16: 24 runs, SANITIZE_JOBS (8) at a time, each stopped after
#   SANITIZE_TIMEOUT (600) seconds. SANITIZE_PROGRAMS picks some of the three (default all).
#   One line per tool x program x precision with compute-sanitizer's error count.
# cli: -b larger than -n, -b 1, a huge -b, -n larger than the data, bad flags; then the whole
#   test_vae, whose GPU part includes the out-of-memory message at a batch that cannot fit.
# Logs go to ${OUT:-/tmp}/sanitize/. Exits non-zero on any error or failed case.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
logs=$OUT/sanitize
mkdir -p "$logs" || exit 2
sections=${*:-sanitize cli}
has() { [[ " $sections " == *" $1 "* ]]; }
status=0

for bin in vae test_vae; do
    [ -x "$bin" ] || { echo "sanitize: ./$bin is missing. HINT: make sanitize builds it" >&2; exit 2; }
done

if has sanitize; then
    sanitizer=$(command -v compute-sanitizer || echo "$(dirname "$(command -v nvcc)")/compute-sanitizer")
    [ -x "$sanitizer" ] || { echo "sanitize: compute-sanitizer not found. HINT: it ships with the CUDA toolkit" >&2; exit 2; }
    jobs=${SANITIZE_JOBS:-8}
    runs=()
    for tool in memcheck racecheck initcheck synccheck; do
        for program in ${SANITIZE_PROGRAMS:-vae vae_iwae test_vae}; do
            for precision in fp32 bf16; do runs+=("$tool $program $precision"); done
        done
    done
    run_one() {
        local tool=$1 program=$2 precision=$3 log=$logs/$1_$2_$3.log
        local extra=()
        [ "$tool" = memcheck ] && extra=(--leak-check full)
        local cmd=(./vae -n 512 --precision "$precision" -o "$logs/out_$precision")
        [ "$program" = vae_iwae ] && cmd=(./vae --iwae 8 -n 64 --precision "$precision")
        [ "$program" = test_vae ] && cmd=(./test_vae --quick --gpu-only --precision "$precision")
        local start=$SECONDS
        timeout "${SANITIZE_TIMEOUT:-600}" "$sanitizer" --tool "$tool" "${extra[@]}" --target-processes application-only "${cmd[@]}" > "$log" 2>&1
        local rc=$? errors
        # memcheck, initcheck, synccheck end with "ERROR SUMMARY: N errors"; racecheck with
        # "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)"
        errors=$(sed -n -e 's/.*ERROR SUMMARY: \([0-9]*\) error.*/\1/p' \
            -e 's/.*RACECHECK SUMMARY: .*(\([0-9]*\) error.*/\1/p' "$log" | tail -n 1)
        local verdict=ok
        [ "$rc" -eq 0 ] && [ "${errors:-x}" = 0 ] || verdict=FAILED
        printf 'sanitize %-9s %-8s %s: %s errors, exit %d, %ds  %s\n' "$tool" "$program" "$precision" \
            "${errors:-?}" "$rc" $((SECONDS - start)) "$verdict"
    }
    export -f run_one
    export sanitizer logs SANITIZE_TIMEOUT
    printf '%s\n' "${runs[@]}" | xargs -P "$jobs" -L 1 bash -c 'run_one "$@"' _ | sort > "$logs/summary.txt"
    cat "$logs/summary.txt"
    grep -q FAILED "$logs/summary.txt" && status=1
    [ "$(wc -l < "$logs/summary.txt")" -eq ${#runs[@]} ] || { echo "sanitize: some runs printed no summary"; status=1; }
    total=$(awk '{s += $5} END {print s + 0}' "$logs/summary.txt")
    echo "sanitize: ${#runs[@]} runs, $total errors in all (logs in $logs)"
fi

if has cli; then
    # expect EXIT PATTERN ARGS...: ./vae ARGS must exit with EXIT and print a line matching PATTERN
    expect() {
        local want=$1 pattern=$2 log=$logs/cli.log
        shift 2
        ./vae -o "$logs/out_cli" "$@" > "$log" 2>&1
        local rc=$? lines
        lines=$(grep -c . "$log")
        if [ "$rc" -eq "$want" ] && grep -qE "$pattern" "$log" && { [ "$want" -eq 0 ] || [ "$lines" -eq 1 ]; }; then
            echo "cli ok      ./vae $*: exit $rc, $(grep -m 1 -E "$pattern" "$log" | tr -s ' ')"
        else
            echo "cli FAILED  ./vae $*: exit $rc (want $want), $lines lines:"
            sed 's/^/    /' "$log" | head -n 20
            status=1
        fi
    }
    expect 0 '^\| batch +\| 512 ' -n 512 -b 20000        # -b larger than -n: one batch of all 512
    expect 0 '^\| batch +\| 1 ' -n 300 -b 1               # 300 batches of one image
    expect 0 '^\| batch +\| 1 ' -n 37 -b 1 --precision bf16
    expect 0 '^\| batch +\| 10000 ' -b 1048576            # the largest -b: clamped to the 10000 images
    expect 0 '^\| batch +\| 10000 ' -b 1048576 --precision bf16
    expect 1 '^vae: error: -n 10001: ' -n 10001           # more images than the data holds
    expect 1 '^vae: error: unknown option' --bogus
    expect 1 '^vae: error: -b needs a value' -b
    expect 1 '^vae: error: -b 1048577 is outside' -b 1048577
    ./test_vae > "$logs/test_vae.log" 2>&1
    rc=$?
    grep -E "NOT OK|out of GPU memory|^GPU|skip|passed," "$logs/test_vae.log" | sed 's/^/test_vae: /'
    [ "$rc" -eq 0 ] || { echo "test_vae: FAILED, exit $rc"; status=1; }
fi
exit $status
