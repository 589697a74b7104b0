// GEMM v4: 1-D register blocking, fp32.
//
// Change vs v3: each thread computes a column of TM = 8 outputs (8 rows m,
// one column n) instead of one. For each k it loads one W value into a
// register and reuses it for 8 FMAs against 8 X values, so shared-memory
// loads per FMA fall from 2 to ~1.1, and the block tile grows to 64x64 with
// 512 threads, halving the global traffic per output again.
//
// Shared memory is stored k-major (Xs[k][m], Ws[k][n]): lanes hold
// consecutive n, so Ws[k][n] reads are conflict-free, and a thread's 8 rows
// Xs[k][r..r+7] are contiguous (the same for all lanes of a warp: broadcast).
// Global loads keep lanes along K (coalesced) and transpose on the way into
// shared memory; the +4 row padding spreads those transposed stores over
// all 32 banks.
//
// Build and run:  make -C dev gemm_v4 && ./dev/gemm_v4
#include "common.h"

template <int BM, int BN, int BK, int TM>
__global__ __launch_bounds__(BM * BN / TM) void gemm_1d_blocking(
    const float* X, const float* W, const float* bias, float* Y, int M, int N, int K, Act act) {
    constexpr int kThreads = BM * BN / TM;
    static_assert(BN % 32 == 0, "a warp must cover consecutive columns of one row group");
    __shared__ float Xs[BK][BM + 4];
    __shared__ float Ws[BK][BN + 4];
    const int tid = threadIdx.x;
    const int col = tid % BN;          // this thread's column in the tile
    const int row0 = (tid / BN) * TM;  // first of its TM rows
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;

    float acc[TM] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = tid; i < BM * BK; i += kThreads) {
            const int r = i / BK, c = i % BK, m = m0 + r, k = k0 + c;
            Xs[c][r] = (m < M && k < K) ? X[static_cast<size_t>(m) * K + k] : 0.0f;
        }
        for (int i = tid; i < BN * BK; i += kThreads) {
            const int r = i / BK, c = i % BK, n = n0 + r, k = k0 + c;
            Ws[c][r] = (n < N && k < K) ? W[static_cast<size_t>(n) * K + k] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            const float w = Ws[kk][col];
#pragma unroll
            for (int i = 0; i < TM; ++i) acc[i] += Xs[kk][row0 + i] * w;
        }
        __syncthreads();
    }

    const int n = n0 + col;
    if (n >= N) return;
    const float b = bias[n];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int m = m0 + row0 + i;
        // the activation as a max: with 0 for ReLU, with -inf for none
        if (m < M) Y[static_cast<size_t>(m) * N + n] = fmaxf(acc[i] + b, act == Act::Relu ? 0.0f : -INFINITY);
    }
}

void launch_gemm_v4(const GemmArgs<float>& g) {
    constexpr int BM = 64, BN = 64, BK = 8, TM = 8;
    const dim3 grid(ceil_div(g.N, BN), ceil_div(g.M, BM));
    gemm_1d_blocking<BM, BN, BK, TM><<<grid, BM * BN / TM>>>(g.X, g.W, g.bias, g.Y, g.M, g.N, g.K, g.act);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_gemm_driver<float>("gemm_v4", launch_gemm_v4) ? 0 : 1;
}
