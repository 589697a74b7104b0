// Reparameterisation v3: every thread busy, KL through shared memory.
//
// A 320-thread block takes 16 images: thread i handles latent i % 20 of image
// i / 20 (as in v1, no idle lanes, and consecutive threads read consecutive
// floats of mu and of logvar), parks its KL term in shared memory, and after
// one barrier 16 threads each add their image's 20 terms in order. No atomics,
// no memset, reproducible like v2, without v2's 12 idle lanes per warp.
//
// Build and run:  make -C dev reparam_v3 && ./dev/reparam_v3
#include "common.h"

using namespace vae;

constexpr int kImagesPerBlock = 16, kThreads = kImagesPerBlock * LATENT_DIM;  // 320 = 10 full warps

__global__ void __launch_bounds__(kThreads)
    reparam_smem_kernel(float* z, float* kl, const float* mulv, int B, uint32_t first_image, uint64_t seed) {
    __shared__ float terms[kImagesPerBlock][LATENT_DIM];
    const int local = threadIdx.x / LATENT_DIM, j = threadIdx.x % LATENT_DIM;
    const int b = blockIdx.x * kImagesPerBlock + local;
    float kl_term = 0.0f;
    if (b < B)
        z[size_t(b) * LATENT_DIM + j] = latent_z(mulv[size_t(b) * kMulv + j], mulv[size_t(b) * kMulv + LATENT_DIM + j],
                                              gaussian(seed, STREAM_POSTERIOR, first_image + b, 0, j), &kl_term);
    terms[local][j] = kl_term;
    __syncthreads();
    if (threadIdx.x < kImagesPerBlock) {
        const int bb = blockIdx.x * kImagesPerBlock + threadIdx.x;
        if (bb < B) {
            float sum = 0.0f;
#pragma unroll
            for (int k = 0; k < LATENT_DIM; ++k) sum += terms[threadIdx.x][k];
            kl[bb] = -0.5f * sum;
        }
    }
}

void reparam_v3(const ReparamArgs& a) {
    reparam_smem_kernel<<<ceil_div(a.B, kImagesPerBlock), kThreads>>>(a.z, a.kl, a.mulv, a.B, a.first_image, a.seed);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_reparam_driver({{"reparam_v3_smem", reparam_v3}}) ? 0 : 1;
}
