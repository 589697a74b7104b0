// Loss v5: the plain path's per-row BCE with one logarithm a lane.
//
// vae.cu's decoder_output_kernel (a warp a row, four logits a lane and step) took each logit's
// log(1 + e^-|l|) with expf and log1pf: in --iwae's passes, which score 262,144 rows of 784 logits at a
// time, that is most of the kernel's ~100 instructions a logit. v5 keeps expf but multiplies the factors
// 1 + e^-|l| (each in (1, 2]; at most 28 a lane) and takes one logf a lane: log1pf's polynomial becomes a
// multiply. Its error: the product's rounding, <= 28 ulp (1.7e-6 relative, the same absolute error in the
// log), and a term below fp32's ulp of 1 (e^-|l| < 6e-8, |l| > 16.6) dropped: together < 1e-4 absolute
// in a row's sum of BCE ~ 20..500, inside the fp32 contract of 1e-5 relative to float64.
//
// v5's form is now vae.cu's: its BceLane in bce_kernel (scoring only: --iwae, the ELBO) and in the general
// decoder_output_kernel (recon, AIS's residual). This driver writes out the form before and runs both of vae.cu's;
// common.h's run_bce_driver checks them against float64 and times them.
//
// Build and run:  make -C dev loss_v5 && ./dev/loss_v5
#include "common.h"

using namespace vae;

// The form before v5, as decoder_output_kernel had it: each logit's whole term, log1pf and all.
template <typename L>
__global__ void bce_per_logit_kernel(float* bce, const L* __restrict__ logits, const uint8_t* __restrict__ pixels,
                                     int rows, int rows_per_image) {
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (r >= rows) return;
    const Four<L>* l_row = reinterpret_cast<const Four<L>*>(logits + (size_t)r * INPUT_DIM);
    const uchar4* x_row = reinterpret_cast<const uchar4*>(pixels + (size_t)(r / rows_per_image) * INPUT_DIM);
    float sum = 0.0f;
    for (int i = lane; i < INPUT_DIM / 4; i += 32) {
        const Four<L> stored = l_row[i];
        const uchar4 px = x_row[i];
        const float x[4] = {px.x * (1.0f / 255.0f), px.y * (1.0f / 255.0f), px.z * (1.0f / 255.0f),
                            px.w * (1.0f / 255.0f)};
        for (int k = 0; k < 4; k++) {
            const float l = as_float(stored.v[k]);
            sum += fmaxf(l, 0.0f) - x[k] * l + log1pf(expf(-fabsf(l)));
        }
    }
    sum = warp_sum(sum);
    if (lane == 0) bce[r] = sum;
}

template <typename L> static void run_before(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    launch(bce_per_logit_kernel<L>, rows, 4, 128, 0, bce, (const L*)logits, pixels, rows, K);
}

template <typename L> static void run_v5(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    launch(bce_kernel<L>, rows, 4, 128, 0, bce, (const L*)logits, pixels, rows, K);
}

int main() {
    print_device_info();
    return run_bce_driver({{"before: log1pf a logit", run_before<float>, run_before<bf16>},
                           {"v5 in decoder_output_kernel", run_vae_bce<float>, run_vae_bce<bf16>},
                           {"v5: vae.cu's bce_kernel", run_v5<float>, run_v5<bf16>}})
               ? 0
               : 1;
}
