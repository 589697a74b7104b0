// Loss v7: the plain path's per-row BCE with a lane's loads all in flight before its arithmetic.
//
// v6 (dev/README.md's table: __expf, the pixel byte by a byte permute, ~10 instructions a logit) took a lane's four
// logits and four pixels a step, each step's loads waited for before its arithmetic: a warp kept 256 bytes (bf16) in
// flight, and bce_kernel ran at 57% of a copy's bandwidth on an --iwae pass (bf16, 173 us on an H200), the general
// decoder_output_kernel (AIS's residual) at 42%. To cover ~1 us of DRAM latency at ~4.8 TB/s an SM needs ~36 KB in
// flight. v7 (vae.cu's RowShare): a lane's packs of logits and their pixels all loaded before the first is used.
// Prediction: bf16's pass near the copy's time, ~100 us; fp32's (91% of copy) a little faster.
// Result (H200): in 16-byte packs (8 bf16), bf16 172.8 -> 198.9 us, slower: 98 packs a row give the busiest lane 32
// logits against v6's 28, and bf16's kernel is bound by issue. In packs of four (vae.cu's), bf16 173.9 -> 158.1 us
// (63% of copy), decoder_output_kernel's bf16 pass to 185.7, fp32 212.3 -> 192.0 (103% of copy).
//
// This driver writes out v6's form and runs vae.cu's kernel in both forms (BCE_ONLY: the sigmoid compiled out);
// common.h's run_bce_driver checks them against float64 and times them.
//
// Build and run:  make -C dev loss_v7 && ./dev/loss_v7
#include "common.h"

using namespace vae;

// v6's form: four logits and four pixels a step, each step's loads used at once.
template <typename L>
__global__ void bce_v6_kernel(float* bce, const L* __restrict__ logits, const uint8_t* __restrict__ pixels, int rows,
                              int rows_per_image) {
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (r >= rows) return;
    const Four<L>* l_row = reinterpret_cast<const Four<L>*>(logits + (size_t)r * INPUT_DIM);
    const uint32_t* x_row = reinterpret_cast<const uint32_t*>(pixels + (size_t)(r / rows_per_image) * INPUT_DIM);
    BceLane part;
    for (int i = lane; i < INPUT_DIM / 4; i += 32) {
        const Four<L> stored = l_row[i];
        const uint32_t px = x_row[i];
        for (int k = 0; k < 4; k++) {
            const float l = as_float(stored.v[k]);
            part.add(l, pixel_weight(byte_as_float(px, k)), __expf(-fabsf(l)));
        }
    }
    const float sum = part.row_sum();
    if (lane == 0) bce[r] = sum;
}

template <typename L> static void run_v6(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    launch(bce_v6_kernel<L>, rows, 4, 128, 0, bce, (const L*)logits, pixels, rows, K);
}

template <typename L> static void run_v7(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    launch(decoder_output_kernel<float, L, 1, true>, rows, 4, 128, 0, bce, (float*)NULL, (float*)NULL,
           (const L*)logits, pixels, rows, K);
}

int main() {
    print_device_info();
    return run_bce_driver({{"v6: a step's loads at a time", run_v6<float>, run_v6<bf16>},
                           {"v7 in decoder_output_kernel", run_vae_bce<float>, run_vae_bce<bf16>},
                           {"v7: vae.cu's BCE_ONLY form", run_v7<float>, run_v7<bf16>}})
               ? 0
               : 1;
}
