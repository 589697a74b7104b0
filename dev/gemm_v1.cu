// GEMM v1: naive fp32, one thread per output element.
//
// Y[M,N] = act(X[M,K] · W[N,K]^T + b[N]). Thread (m, n) walks K alone, and
// consecutive threads of a warp take consecutive rows m. That is the obvious
// mapping and the slow one: both X and W are K-contiguous, so at each step k
// the 32 lanes of a warp read X[m..m+31][k], 32 addresses K*4 bytes apart
// (32 different 32-byte sectors per load instruction, 4 useful bytes in each),
// and all read the same W[n][k] (a broadcast). The stores Y[m..m+31][n] are
// N*4 bytes apart too. The L1 cache rescues some reuse, but every load
// instruction still costs ~32 cache transactions instead of 1.
//
// Build and run:  make -C dev gemm_v1 && ./dev/gemm_v1
#include "common.h"

__global__ void gemm_naive(const float* X, const float* W, const float* bias, float* Y,
                           int M, int N, int K, Act act) {
    const int m = blockIdx.x * blockDim.x + threadIdx.x;  // lanes along M: the uncoalesced choice
    const int n = blockIdx.y * blockDim.y + threadIdx.y;
    if (m >= M || n >= N) return;
    const float* x = X + static_cast<size_t>(m) * K;
    const float* w = W + static_cast<size_t>(n) * K;
    float acc = 0.0f;
    for (int k = 0; k < K; ++k) acc += x[k] * w[k];
    // the activation as a max: with 0 for ReLU, with -inf for none
    Y[static_cast<size_t>(m) * N + n] = fmaxf(acc + bias[n], act == Act::Relu ? 0.0f : -INFINITY);
}

void launch_gemm_v1(const GemmArgs<float>& g) {
    const dim3 block(32, 8);
    const dim3 grid(ceil_div(g.M, 32), ceil_div(g.N, 8));
    gemm_naive<<<grid, block>>>(g.X, g.W, g.bias, g.Y, g.M, g.N, g.K, g.act);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_gemm_driver<float>("gemm_v1", launch_gemm_v1) ? 0 : 1;
}
