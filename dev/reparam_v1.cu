// Reparameterisation v1: z = mu + eps exp(logvar / 2) and the per-image KL,
// one thread per (image, latent), the KL summed with atomicAdd.
//
// The obvious mapping: 20 B threads, each draws its own eps (Philox4x32-10,
// keyed by seed, stream, image, sample, latent as in vae.cu), writes its z and
// adds its KL term into kl[image], which a memset zeroes first. Two costs: the
// memset is a second operation, and the KL is summed in whatever order the
// atomics land, so it is not bitwise reproducible from run to run.
//
// Build and run:  make -C dev reparam_v1 && ./dev/reparam_v1
#include "common.h"

using namespace vae;

__global__ void reparam_atomic_kernel(float* z, float* kl, const float* mulv, int B, uint32_t first_image,
                                      uint64_t seed) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= B * LATENT_DIM) return;
    const int b = i / LATENT_DIM, j = i % LATENT_DIM;
    float kl_term;
    z[i] = latent_z(mulv[size_t(b) * kMulv + j], mulv[size_t(b) * kMulv + LATENT_DIM + j],
                    gaussian(seed, STREAM_POSTERIOR, first_image + b, 0, j), &kl_term);
    atomicAdd(&kl[b], -0.5f * kl_term);
}

void reparam_v1(const ReparamArgs& a) {
    cudaCheck(cudaMemsetAsync(a.kl, 0, size_t(a.B) * sizeof(float)));
    reparam_atomic_kernel<<<ceil_div(a.B * LATENT_DIM, 256), 256>>>(a.z, a.kl, a.mulv, a.B, a.first_image, a.seed);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_reparam_driver({{"reparam_v1_atomic", reparam_v1}}) ? 0 : 1;
}
