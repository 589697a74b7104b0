#!/usr/bin/env bash
# test_build.sh: checks the Makefile's choice of GPU code, without a GPU (make test runs it).
#   - no GPU found (nvidia-smi absent or failing): a portable fat binary, sm_75 + sm_80 + its PTX + sm_90a,
#     with a notice when nvidia-smi printed an error instead of a compute capability;
#   - GPU_ARCH in its forms (90, 9.0, sm_90, sm_90a; 86, 8.6, sm_86) and nvidia-smi's answer;
#   - older than sm_75, or not a compute capability: make stops with one line; make help says no build notice;
#   - vae and test_vae link cuBLASLt (the plain path's matrix products) and not cuBLAS;
#   - a built ./vae holds the code its nvcc line promises (cuobjdump), when there is one;
#   - README.md's command-line block is ./vae -h's output, byte for byte, when there is a ./vae.
# Ends with "N passed, N failed, N skipped"; exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")"
passed=0 failed=0 skipped=0
check() { # check WHAT CONDITION-RESULT(0/1) [DETAIL]
    if [ "$2" -eq 0 ]; then echo "  ok      $1"; passed=$((passed + 1))
    else echo "  NOT OK  $1${3:+: $3}"; failed=$((failed + 1)); fi
}
skip() { echo "  skip    $1 ($2)"; skipped=$((skipped + 1)); }

fake=$(mktemp -d)
trap 'rm -rf "$fake"' EXIT
# nvidia-smi as a machine without a GPU has it: absent (no output), or failing with an error on stdout
fake_smi() { printf '#!/bin/sh\n%s\n' "$1" > "$fake/nvidia-smi" && chmod +x "$fake/nvidia-smi"; }
# the nvcc command make would run for vae, and what make printed besides; without the calling make's variables
# (make test GPU_ARCH=80 passes GPU_ARCH down, in MAKEFLAGS and the environment), so each case gets only what it names
plan() { PATH="$fake:$PATH" env -u GPU_ARCH MAKEFLAGS= MAKELEVEL= make -s -n -B -f Makefile vae "$@" 2>&1; }
portable='-gencode arch=compute_75,code=sm_75 -gencode arch=compute_80,code=\[sm_80,compute_80\] -gencode arch=compute_90a,code=sm_90a'

echo "Makefile: GPU code for the GPU a user has"
fake_smi 'exit 127'
out=$(plan); echo "$out" | grep -q -- "nvcc .*$portable" && echo "$out" | grep -q 'no GPU detected'
check "no nvidia-smi answer: a portable binary (sm_75, sm_80, its PTX, sm_90a), said so" $? "$out"
fake_smi "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"; exit 9"
out=$(plan); echo "$out" | grep -q -- "nvcc .*$portable" && echo "$out" | grep -q "nvidia-smi gave no compute capability"
check "nvidia-smi failing with an error: the portable binary, with a notice" $? "$(echo "$out" | head -2)"
for answer in 9.0 8.6 7.5 12.0; do
    fake_smi "echo $answer"
    want=$([ "$answer" = 9.0 ] && echo 'arch=compute_90a,code=sm_90a' || echo "-arch=sm_${answer/./}")
    out=$(plan); echo "$out" | grep -q -- "nvcc .*$want"
    check "nvidia-smi says $answer: builds $want" $? "$out"
done
fake_smi 'exit 127'
for arch in 90 9.0 sm_90 sm_90a " 9.0 "; do
    out=$(plan GPU_ARCH="$arch"); echo "$out" | grep -q -- 'nvcc .*-gencode arch=compute_90a,code=sm_90a ' &&
        ! echo "$out" | grep -q compute_80
    check "GPU_ARCH='$arch': sm_90a only" $? "$out"
done
for arch in 86 8.6 sm_86 80 75 7.5; do
    out=$(plan GPU_ARCH="$arch"); echo "$out" | grep -q -- "nvcc .*-arch=sm_${arch//[^0-9]/} "
    check "GPU_ARCH=$arch: -arch=sm_${arch//[^0-9]/}" $? "$out"
done
for arch in 70 7.0 sm_70 60; do
    out=$(plan GPU_ARCH="$arch"); rc=$?
    [ $rc -ne 0 ] && [ "$(echo "$out" | grep -c .)" -eq 1 ] && echo "$out" | grep -q 'older than sm_75'
    check "GPU_ARCH=$arch: make stops with one line" $? "rc $rc: $out"
done
for arch in junk 9.x sm_ "NVIDIA-SMI has failed"; do
    out=$(plan GPU_ARCH="$arch"); rc=$?
    [ $rc -ne 0 ] && [ "$(echo "$out" | grep -c .)" -eq 1 ] && echo "$out" | grep -q 'not a compute capability'
    check "GPU_ARCH='$arch': make stops with one line" $? "rc $rc: $out"
done

out=$(PATH="$fake:$PATH" env -u GPU_ARCH MAKEFLAGS= MAKELEVEL= make -s help 2>&1); rc=$?
[ $rc -eq 0 ] && echo "$out" | head -n 1 | grep -q '^make vae ' && ! echo "$out" | grep -q 'building for'
check "make help: the targets from its first line, no build notice" $? "$(echo "$out" | head -n 2)"

echo "Makefile: what each target links"
for target in vae test_vae; do
    out=$(PATH="$fake:$PATH" make -s -n -B "$target" 2>&1 | grep "nvcc .* -o $target")
    [ -n "$out" ] && echo "$out" | grep -q -- '-lcublasLt' && ! echo "$out" | grep -qE -- '-lcublas( |$)'
    check "$target links cuBLASLt, not cuBLAS" $? "$out"
done
if [ -x vae ] && command -v cuobjdump > /dev/null; then
    ! ldd vae | grep -q 'libcublas\.'; check "./vae loads libcublasLt, not libcublas" $?
    # the code the Makefile's nvcc line for this machine (and this make's GPU_ARCH) promises, against what the
    # binary holds
    line=$(make -s -n -B vae 2>/dev/null | grep 'nvcc .* -o vae')
    want=$(echo "$line" | grep -oE 'code=\[?sm_[0-9]+a?|-arch=sm_[0-9]+a?' | grep -oE 'sm_[0-9]+a?' | sort -u)
    have=$(cuobjdump --list-elf vae 2>&1 | grep -oE 'sm_[0-9]+a?' | sort -u)
    [ -n "$want" ] && [ "$want" = "$have" ]
    check "./vae holds the code its nvcc line promises: $(echo $want)" $? "holds $(echo $have)"
    if echo "$line" | grep -q compute_80; then
        cuobjdump --list-ptx vae 2>&1 | grep -qE '(sm|compute)_80\.ptx' # cuobjdump names it vae.sm_80.ptx
        check "./vae (portable) carries compute_80 PTX for GPUs newer than its code" $?
    fi
elif [ ! -x vae ]; then
    skip "what ./vae holds" "no ./vae: make vae builds it"
else
    skip "what ./vae holds" "no cuobjdump on PATH (CUDA's cuda-cuobjdump package)"
fi
echo "README.md: the command line as ./vae -h prints it"
if [ -x vae ]; then
    # the lines between the two markers, less the code fence's first and last line
    awk '/^<!-- end \.\/vae -h -->$/ { f = 0 } f; /^<!-- \.\/vae -h -->$/ { f = 1 }' README.md | sed '1d;$d' \
        > "$fake/readme_help"
    ./vae -h > "$fake/help" 2>&1
    cmp -s "$fake/help" "$fake/readme_help"; rc=$?
    check "README.md's block between <!-- ./vae -h --> and <!-- end ./vae -h --> is ./vae -h's output" $rc \
        "$(diff "$fake/help" "$fake/readme_help" | head -n 6)"
else
    skip "README.md's command-line block against ./vae -h" "no ./vae: make vae builds it"
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
