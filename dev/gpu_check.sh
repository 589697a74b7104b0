#!/usr/bin/env bash
# One device call: build everything, run the tests, the program, and the dev drivers.
# Logs and images go to $OUT (default /tmp/vae_out). Usage: bash dev/gpu_check.sh [sections...]
# sections: test vae image interp break bench pytorch iwae sanitize profile dev (default: all of them)
# make test reads the checkpoint and MNIST .gz files from DATA_SRC (default ../shared/data): on a machine
# without that folder, copy them into the tree and pass DATA_SRC=that/folder. With a cold Inductor cache the
# pytorch section compiles for ~9 minutes: run it in a call of its own (or with --batches) the first time.
set -uo pipefail
OUT=${OUT:-/tmp/vae_out}
mkdir -p "$OUT"
sections=${*:-test vae image interp break bench pytorch iwae sanitize profile dev}
status=0
has() { [[ " $sections " == *" $1 "* ]]; }
run() { echo "== $*"; "$@" || { echo "FAILED ($?): $*"; status=1; }; }

nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.sm,clocks.mem --format=csv
run make vae test_vae
if has test; then
    # make test: test_vae, test_prepare_weights.py, test_build.sh, each ending in its own tally
    make test > "$OUT/test.log" 2>&1; rc=$?
    grep -E "NOT OK|^GPU|^ case|passed,|skip" "$OUT/test.log"; grep -A12 "^GPU fp32" "$OUT/test.log" | head -14
    [ $rc -eq 0 ] || { echo "FAILED: make test rc=$rc"; status=1; }
fi
if has vae; then
    run bash -c "./vae -o out 2>&1 | tee $OUT/vae.log"
    run bash -c "./vae --zmu -o out_zmu 2>&1 | tail -5 | tee -a $OUT/vae.log"
    python3 -c "
from PIL import Image
for n in ('recon', 'samples', 'interp'):
    im = Image.open(f'out/{n}.ppm'); im = im.resize((im.width * 2, im.height * 2), Image.NEAREST)
    im.save('$OUT/' + n + '.png')
print('PPM files parse as valid images')
" || status=1
fi
if has image; then
    # a drawn digit: test image 0 as a PGM file, white on black, then black on white with --invert
    python3 -c "
import numpy as np
px = np.fromfile('data/t10k-images-idx3-ubyte', dtype=np.uint8)[16:16 + 784].reshape(28, 28)
open('$OUT/digit.pgm', 'wb').write(b'P5\\n28 28\\n255\\n' + px.tobytes())
open('$OUT/digit_black_on_white.pgm', 'wb').write(b'P5\\n28 28\\n255\\n' + (255 - px).tobytes())
" || status=1
    run bash -c "./vae --image $OUT/digit.pgm --image $OUT/digit_black_on_white.pgm -o out_image 2>&1 | tail -7 | tee $OUT/image.log"
    run bash -c "./vae --image $OUT/digit_black_on_white.pgm --invert --iwae 5000 2>&1 | tail -5 | tee -a $OUT/image.log"
fi
if has interp; then
    run bash -c "./vae --interp 1000 -o out_interp 2>&1 | tail -6 | tee $OUT/interp.log"
fi
if has break; then
    # deliberately drop the bias of every layer: the tests must catch it
    mkdir -p /tmp/broken && sed 's/acc\[i\]\[j\] + bias\[c\]/acc[i][j]/' vae.cu > /tmp/broken/vae.cu
    cp test_vae.cu /tmp/broken/ && (cd /tmp/broken && ln -sf "$OLDPWD/data" data && \
        nvcc -O3 -std=c++17 -arch=sm_90 test_vae.cu -o test_vae -lcublas -lcublasLt && ./test_vae > "$OUT/broken.log" 2>&1)
    echo "broken-bias build: test_vae rc=$? (non-zero expected)"; grep -E "NOT OK" "$OUT/broken.log" | head -12; tail -1 "$OUT/broken.log"
fi
if has bench; then
    run bash -c "./vae --bench 2>&1 | tee $OUT/bench.log"
    TIMEFORMAT='whole ./vae run (load, 10k images, three images written): %R s wall'
    for p in fp32 bf16; do echo "== ./vae --precision $p"; time ./vae --precision $p -o out_$p > "$OUT/vae_$p.log" 2>&1; tail -6 "$OUT/vae_$p.log"; done
fi
if has pytorch; then
    run bash -c "PYTHONUNBUFFERED=1 python3 dev/bench_pytorch.py --vae-bench $OUT/bench.log 2>&1 | tee $OUT/bench_pytorch.log"
fi
if has iwae; then
    for p in fp32 bf16; do
        run bash -c "./vae --iwae 5000 -n 1000 --precision $p | tail -3 | tee -a $OUT/iwae.log"
        run bash -c "./vae --iwae 5000 --precision $p --csv $OUT/iwae_$p.csv | tail -4 | tee -a $OUT/iwae.log"
    done
    run bash -c "PYTHONUNBUFFERED=1 python3 dev/bench_pytorch.py --iwae 5000 2>&1 | tee $OUT/iwae_pytorch.log"
fi
if has sanitize; then run bash -c "SANITIZE_JOBS=16 bash dev/sanitize.sh 2>&1 | grep -E '^(sanitize|cli)' | tee $OUT/sanitize.log"; fi
if has profile; then run bash dev/profile.sh 1024 4096; fi
if has dev; then
    run bash dev/run_gemm.sh
    run bash dev/run_kernels.sh
    run bash -c "make -s -C dev encoder_v1 decoder_v1 && ./dev/encoder_v1 && ./dev/decoder_v1"
fi
exit $status
