// Loss v1: per-image BCE + KL with one thread per pixel and atomics.
//
// Thread i handles pixel i % 784 of image i / 784: its stable BCE term
// max(l,0) - x l + log(1 + e^-|l|) goes into loss[image] by atomicAdd (the
// pixel-0 thread also adds the image's KL), after a memset zeroes the sums.
// Every load is coalesced, but 784 atomics land on each image's one address,
// and the sum order, so the result, changes from run to run.
//
// Build and run:  make -C dev loss_v1 && ./dev/loss_v1
#include "common.h"

using namespace vae;

__global__ void loss_atomic_kernel(float* loss, const float* logits, const uint8_t* pixels, const float* kl, int B) {
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= size_t(B) * INPUT_DIM) return;
    const int b = int(i / INPUT_DIM);
    float term = bce_term(logits[i], pixels[i]);
    if (i % INPUT_DIM == 0) term += kl[b];
    atomicAdd(&loss[b], term);
}

void loss_v1(const LossArgs& a) {
    cudaCheck(cudaMemsetAsync(a.loss, 0, size_t(a.B) * sizeof(float)));
    loss_atomic_kernel<<<unsigned((size_t(a.B) * INPUT_DIM + 255) / 256), 256>>>(a.loss, a.logits, a.pixels, a.kl, a.B);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_loss_driver({{"loss_v1_atomic", loss_v1}}) ? 0 : 1;
}
