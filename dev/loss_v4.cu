// Loss v4: loss_v2 with the BCE term on the fast hardware exp/log.
//
// loss_v2 reaches only ~30% of copy bandwidth at B = 65536: the stable term
// max(l,0) - x l + log1pf(expf(-|l|)) costs ~100 instructions per pixel
// (log1pf is a long polynomial with range reduction), so the kernel is
// instruction-bound, not memory-bound. v4 computes log(1 + e^-|l|) as
// __logf(1 + __expf(-|l|)): two MUFU operations and a few FMAs. The error,
// <= ~1e-6 absolute per pixel, stays far inside the 1e-3 + 1e-4 relative
// tolerance of an image's sum.
//
// Build and run:  make -C dev loss_v4 && ./dev/loss_v4
#include "common.h"

using namespace vae;

constexpr int kLossWarps = 8;  // as loss_v2

// log(1 + e^-|l|) through __logf errs by <= ~1e-6 absolute for 1 + e in [1, 2].
__device__ inline float bce_term_fast(float logit, float x) {
    return fmaxf(logit, 0.0f) - x * logit + __logf(1.0f + __expf(-fabsf(logit)));
}

__global__ void __launch_bounds__(kLossWarps * 32)
    loss_warp_fast_kernel(float* loss, const float* logits, const uint8_t* pixels, const float* kl, int B) {
    const int b = blockIdx.x * kLossWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (b >= B) return;
    const float4* l = reinterpret_cast<const float4*>(logits + size_t(b) * INPUT_DIM);
    const uchar4* x = reinterpret_cast<const uchar4*>(pixels + size_t(b) * INPUT_DIM);
    float sum = 0.0f;
    for (int i = lane; i < INPUT_DIM / 4; i += 32) {
        const float4 lv = l[i];
        const uchar4 xv = x[i];
        sum += bce_term_fast(lv.x, xv.x / 255.0f) + bce_term_fast(lv.y, xv.y / 255.0f) +
               bce_term_fast(lv.z, xv.z / 255.0f) + bce_term_fast(lv.w, xv.w / 255.0f);
    }
    sum = warp_sum(sum);
    if (lane == 0) loss[b] = sum + kl[b];
}

void loss_v4(const LossArgs& a) {
    loss_warp_fast_kernel<<<ceil_div(a.B, kLossWarps), kLossWarps * 32>>>(a.loss, a.logits, a.pixels, a.kl, a.B);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_loss_driver({{"loss_v4_warp_fast", loss_v4}}) ? 0 : 1;
}
