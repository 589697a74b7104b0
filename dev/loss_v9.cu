// Loss v9: the plain path's per-row BCE in six instructions a logit, on per-image weights 1 - 2x made once.
//
// v7 (vae.cu's BCE_ONLY form before this step) spent about nine instructions on a logit: the logit from bf16,
// e^-|l| (a multiply and the hardware's exp2), the product's fma, the pixel from its byte (a permute and a subtract),
// max(l, 0) (a max and an add) and x l (an fma). ncu on an --iwae lane pass (H200): bound by issue, 82% of cycles
// issuing, at 63% of a copy's bandwidth (bf16, 156 us for 262,144 rows).
// v9: max(l, 0) - x l = (|l| + w l) / 2 with w = 1 - 2x, a float per pixel made once per image (--iwae's 5,000 rows of
// an image share it in L1 and L2), so a logit's term is fma(w, l, |l|) and an add. v9 loads a lane's weights with its
// logits, before any arithmetic; v9b loads each pack's weights as it uses them (32 registers against 50). v9c: v9b with
// e^-|l| as exp2f of an argument held at -126 or above, to drop ptxas's rescaling of subnormal results.
// Prediction: bf16's pass from 156 us to ~110 (six instructions against nine), near the copy's ~100; fp32 unchanged
// (already at the copy's bandwidth).
// Result (H200, 262,144 rows at K = 5000, two calls): v9b bf16 120.6-121.4 us (82% of copy), v9 143.8-144.4 (its 50
// registers), v9c 126.1-126.7 (ptxas keeps its compare and two multiplies after the max, and adds the max: cuobjdump
// counts 416 instructions against 384); fp32 193.9-197.3 against v7's 191.4 (at the copy's bandwidth either way).
// A miss of ~10 us on the prediction: __expf's exp2 costs five instructions, not two (a multiply, a compare, two
// rescaling multiplies and the MUFU), as the counts show: 3 FMUL and 1 FSETP a logit.
// vae.cu's form of v9b (decoder_output_kernel, BCE_ONLY on weights) runs at 127.4-128.5 us: 392 instructions against
// v9b's 384 (more ISETP and IADD3 around its loop), not explained further. Its bytes form, the same BceLane with w from
// the byte in one fma, went from v7's 156 to 145.7 us.
// The weights cost a kernel per group of images, not per pass; this driver makes them once, untimed, so its K = 1 rows
// (an image a row) show only the kernel and are not the program's case.
//
// Build and run:  make -C dev loss_v9 && ./dev/loss_v9
#include "common.h"

using namespace vae;

// EXP_FLOOR: e^-|l| as exp2f of -|l| log2(e) held at -126 and above, where no result is subnormal; ptxas's exp2 of an
// argument it cannot bound adds a compare and two multiplies that rescale subnormal results.
template <typename L, bool PRELOAD, bool EXP_FLOOR = false>
__global__ void bce_v9_kernel(float* bce, const L* __restrict__ logits, const float* __restrict__ weights, int rows,
                              int rows_per_image) {
    constexpr int V = 4, PACKS = INPUT_DIM / V, STEPS = (PACKS + 31) / 32;
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (r >= rows) return;
    const Pack<L, V>* l_row = reinterpret_cast<const Pack<L, V>*>(logits + (size_t)r * INPUT_DIM);
    const Pack<float, V>* w_row = reinterpret_cast<const Pack<float, V>*>(weights + (size_t)(r / rows_per_image) *
                                                                                        INPUT_DIM);
    Pack<L, V> l[STEPS];
    Pack<float, V> w[PRELOAD ? STEPS : 1];
    #pragma unroll
    for (int s = 0; s < STEPS; s++) {
        if (lane + 32 * s >= PACKS) break;
        l[s] = l_row[lane + 32 * s];
        if (PRELOAD) w[s] = w_row[lane + 32 * s];
    }
    float twice = 0.0f, product = 1.0f; // twice: 2 (max(l, 0) - x l) summed
    #pragma unroll
    for (int s = 0; s < STEPS; s++) {
        if (lane + 32 * s >= PACKS) break;
        const Pack<float, V> ws = w_row[PRELOAD ? 0 : lane + 32 * s];
        #pragma unroll
        for (int k = 0; k < V; k++) {
            const float x = as_float(l[s].v[k]), a = fabsf(x);
            twice += fmaf(PRELOAD ? w[s].v[k] : ws.v[k], x, a);
            const float e = EXP_FLOOR ? exp2f(fmaxf(-1.4426950409f * a, -126.0f)) : __expf(-a);
            product = fmaf(product, e, product);
        }
    }
    float sum = 0.5f * twice + logf(product);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) bce[r] = sum;
}

template <typename L> static void run_bytes(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    launch(decoder_output_kernel<float, L, 1, true>, rows, 4, 128, 0, bce, (float*)NULL, (float*)NULL,
           (const L*)logits, pixels, rows, K);
}

// The weights of the harness's images (one an image a row at K = 1), made on the first call.
static const float* weights_of(const uint8_t* pixels) {
    static float* weight = NULL;
    if (weight == NULL) {
        const long long n = (long long)(1 << 18) * INPUT_DIM;
        cudaCheck(cudaMalloc(&weight, n * sizeof(float)));
        pixel_weight_kernel<<<(unsigned)((n + 255) / 256), 256>>>(weight, pixels, n);
        cudaCheck(cudaGetLastError());
        cudaCheck(cudaDeviceSynchronize());
    }
    return weight;
}

template <typename L, bool PRELOAD, bool EXP_FLOOR = false>
static void run_v9(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    const float* weight = weights_of(pixels);
    launch(bce_v9_kernel<L, PRELOAD, EXP_FLOOR>, rows, 4, 128, 0, bce, (const L*)logits, weight, rows, K);
}

template <typename L>
static void run_weights(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    launch(decoder_output_kernel<float, L, 1, true, float>, rows, 4, 128, 0, bce, (float*)NULL, (float*)NULL,
           (const L*)logits, weights_of(pixels), rows, K);
}

int main() {
    print_device_info();
    return run_bce_driver({{"vae.cu's BCE_ONLY on bytes", run_bytes<float>, run_bytes<bf16>},
                           {"v9: weights with the logits", run_v9<float, true>, run_v9<bf16, true>},
                           {"v9b: weights as used", run_v9<float, false>, run_v9<bf16, false>},
                           {"v9c: v9b, exp2 held >= -126", run_v9<float, false, true>, run_v9<bf16, false, true>},
                           {"vae.cu's BCE_ONLY on weights", run_weights<float>, run_weights<bf16>}})
               ? 0
               : 1;
}
