// GEMM v2: coalesced fp32, one warp per output element.
//
// Change vs v1: the lanes of a warp now split the K loop instead of taking
// different rows. X and W are both K-contiguous, so lane l reads X[m][k0+l]
// and W[n][k0+l]: each warp-wide load is one contiguous 128-byte line, the
// ideal pattern. (Putting lanes along N instead would coalesce the stores but
// leave W strided: with K-contiguous operands only lanes along K coalesce the
// loads.) The 32 partial sums are combined with 5 register shuffles, and
// lane 0 applies bias + activation and writes the output.
//
// The 8 warps of a block compute 8 neighbouring outputs of one row m, so the
// X row is fetched once and then hit in L1. Still no reuse of W across rows:
// every output reads its full W row from L2, which bounds this version.
//
// Build and run:  make -C dev gemm_v2 && ./dev/gemm_v2
#include "common.h"

constexpr int kWarpsPerBlock = 8;

__global__ __launch_bounds__(kWarpsPerBlock * 32) void gemm_coalesced(
    const float* X, const float* W, const float* bias, float* Y, int M, int N, int K, Act act) {
    const int lane = threadIdx.x % 32;
    const int n = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
    const int m = blockIdx.y;
    if (n >= N || m >= M) return;  // whole warps leave together, so the shuffles below stay full-warp
    const float* x = X + static_cast<size_t>(m) * K;
    const float* w = W + static_cast<size_t>(n) * K;
    float partial = 0.0f;
    for (int k = lane; k < K; k += 32) partial += x[k] * w[k];
    for (int offset = 16; offset > 0; offset /= 2) partial += __shfl_xor_sync(0xffffffffu, partial, offset);
    // the activation as a max: with 0 for ReLU, with -inf for none
    if (lane == 0) Y[static_cast<size_t>(m) * N + n] = fmaxf(partial + bias[n], act == Act::Relu ? 0.0f : -INFINITY);
}

void launch_gemm_v2(const GemmArgs<float>& g) {
    const dim3 grid(ceil_div(g.N, kWarpsPerBlock), g.M);  // gridDim.y limits M to 65535
    gemm_coalesced<<<grid, kWarpsPerBlock * 32>>>(g.X, g.W, g.bias, g.Y, g.M, g.N, g.K, g.act);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_gemm_driver<float>("gemm_v2", launch_gemm_v2) ? 0 : 1;
}
