// Loss v8: the plain path's per-row BCE with the next row's loads in flight while a warp sums the current one.
//
// v7 (vae.cu's decoder_output_kernel, BCE_ONLY form): a warp a row, a lane's packs all loaded before its arithmetic.
// ncu (H200, real clocks) on an --iwae lane pass of 131,072 bf16 rows: 74-78 us, 65% of the warps' slots active at 40
// registers, where the 206 MB read take ~48 us at full bandwidth. A warp loads, waits, then sums: its loads and its
// arithmetic take turns.
// v8: a grid that just fills the GPU (the occupancy API's blocks an SM, times the SMs), each warp striding over rows;
// the next row's packs are loaded into a second RowShare before the current row is summed, so a warp's arithmetic runs
// with its next loads in flight. Same arithmetic, same order in a row: the bits of v7.
// Prediction: bf16's pass from v7's ~63% of copy to ~80%.
// Result (H200, this driver, 262,144 rows at K = 5000): a miss. bf16 v7 155.97 us (63% of copy) against v8 257.89
// (38%), with a grid of two waves 252.51, held to 64 registers (spilling) 574.21; fp32 v7 194.21 (101%) against v8
// 214.98 (92%). Why: two rows' packs in registers take 100 (bf16) and 89 (fp32) registers, so 4 (bf16) or 5 (fp32)
// blocks of 128 fit an SM against v7's 12 at 40; a third of the warps with twice the loads each keep fewer bytes in
// flight than v7's many warps, which already overlap one another's loads and arithmetic.
//
// Build and run:  make -C dev loss_v8 && ./dev/loss_v8
#include "common.h"

using namespace vae;

template <typename L, int MIN_BLOCKS>
__global__ void __launch_bounds__(128, MIN_BLOCKS)
    bce_v8_kernel(float* bce, const L* __restrict__ logits, const uint8_t* __restrict__ pixels, int rows,
                  int rows_per_image) {
    typedef RowShare<L> Share;
    constexpr int V = Share::V;
    const int lane = threadIdx.x % 32, warps = gridDim.x * blockDim.x / 32;
    int r = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    if (r >= rows) return;
    auto row = [&](int at) {
        return Share(logits + (size_t)at * INPUT_DIM, pixels + (size_t)(at / rows_per_image) * INPUT_DIM, lane);
    };
    Share next = row(r);
    for (; r < rows; r += warps) {
        const Share share = next;
        if (r + warps < rows) next = row(r + warps);
        BceLane part;
        #pragma unroll
        for (int s = 0; s < Share::STEPS; s++) {
            if (!Share::has(lane, s)) break;
            const Pack<float, V> w = share.weights(s);
            for (int k = 0; k < V; k++) {
                const float l = share.logit(s, k);
                part.add(l, w.v[k], __expf(-fabsf(l)));
            }
        }
        const float sum = part.row_sum();
        if (lane == 0) bce[r] = sum;
    }
}

template <typename L> static void run_v7(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    launch(decoder_output_kernel<float, L, 1, true>, rows, 4, 128, 0, bce, (float*)NULL, (float*)NULL,
           (const L*)logits, pixels, rows, K);
}

// v8 on a grid of `waves` times the blocks of 128 threads that fit the GPU at once; MIN_BLOCKS: __launch_bounds__'s.
template <typename L, int WAVES, int MIN_BLOCKS>
static void run_v8(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    static int fit = 0;
    if (fit == 0) {
        cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, bce_v8_kernel<L, MIN_BLOCKS>, 128, 0));
        fit *= device_props().multiProcessorCount;
    }
    const int blocks = std::min(ceil_div(rows, 4), WAVES * fit);
    bce_v8_kernel<L, MIN_BLOCKS><<<blocks, 128>>>(bce, (const L*)logits, pixels, rows, K);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    for (int b : {1, 8}) {
        int fit32 = 0, fit16 = 0;
        cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit32, b == 1 ? bce_v8_kernel<float, 1>
                                                                                : bce_v8_kernel<float, 8>, 128, 0));
        cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit16, b == 1 ? bce_v8_kernel<bf16, 1>
                                                                                : bce_v8_kernel<bf16, 8>, 128, 0));
        printf("v8, launch bounds' minimum %d: %d (fp32) and %d (bf16) blocks of 128 an SM\n", b, fit32, fit16);
    }
    return run_bce_driver({{"v7: vae.cu's BCE_ONLY form", run_v7<float>, run_v7<bf16>},
                           {"v8: next row in flight", run_v8<float, 1, 1>, run_v8<bf16, 1, 1>},
                           {"v8, grid of two waves", run_v8<float, 2, 1>, run_v8<bf16, 2, 1>},
                           {"v8, <= 64 registers", run_v8<float, 1, 8>, run_v8<bf16, 1, 8>}})
               ? 0
               : 1;
}
