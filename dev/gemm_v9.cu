// GEMM v9: the fp32 SIMT GEMM vae.cu's --precision fp32 ran from gemm_v5 until the split tensor-core
// path replaced it (dev/README.md, "fp32 on the tensor cores"); kept here as that worklog step.
//
// Change vs v5: 64 x 64 tiles with a 4 x 4 patch per thread (256 threads), the next K slice's global
// loads issued before this slice's FMAs. In vae.cu it read fc1's uint8 pixels directly (scaled by
// 1/255 as it staged them); this driver feeds it fp32 like the other variants. It ran at about half
// of cuBLAS's fp32 rate: the forward pass took 171.6 / 351.0 / 758.0 us at B = 1024 / 4096 / 10000.
//
// Build and run:  make -C dev gemm_v9 && ./dev/gemm_v9
#include "common.h"

// Y[M,N] = act(X[M,K] W[N,K]^T + b[N]), the PyTorch Linear layout, in fp32.
// A 256-thread block computes a 64x64 tile of Y. It walks K in slices of 16, staging the 64x16
// slices of X and W in shared memory stored k-major, so the inner loop reads consecutive
// addresses as float4; the next slice's global loads are issued before this slice's FMAs, so
// their latency is hidden behind the arithmetic. Each thread keeps a 4x4 patch of Y in registers: every value it reads
// from shared memory feeds four FMAs. Bias and activation are applied on the way out (no extra pass). Each thread sums
// its k terms in the same order whatever M is, so an image's result is bitwise independent of the batch it is evaluated
// in.
enum { LIN_TILE = 64, LIN_K = 16, LIN_THREADS = 256 };

template <bool RELU>
__global__ void __launch_bounds__(LIN_THREADS)
    linear_fp32_v9_kernel(float* Y, const float* X, const float* W, const float* bias, int M, int N, int K) {
    __shared__ __align__(16) float Xs[LIN_K][LIN_TILE + 4]; // +4: rows stay 16-byte aligned
    __shared__ __align__(16) float Ws[LIN_K][LIN_TILE + 4];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16; // this thread's 4x4 patch of the tile
    const int row0 = blockIdx.y * LIN_TILE, col0 = blockIdx.x * LIN_TILE;
    const int load_row = threadIdx.x / 4, load_k = (threadIdx.x % 4) * 4; // 64 rows x 16 k, 4 each
    float acc[4][4] = {};

    float x_next[4], w_next[4]; // the next slice, loaded while this one is multiplied
    auto load_slice = [&](int k0) {
        const int xr = row0 + load_row, wr = col0 + load_row;
        for (int i = 0; i < 4; i++) {
            const int k = k0 + load_k + i;
            x_next[i] = (xr < M && k < K) ? X[(size_t)xr * K + k] : 0.0f;
            w_next[i] = (wr < N && k < K) ? W[(size_t)wr * K + k] : 0.0f;
        }
    };
    load_slice(0);
    for (int k0 = 0; k0 < K; k0 += LIN_K) {
        for (int i = 0; i < 4; i++) Xs[load_k + i][load_row] = x_next[i], Ws[load_k + i][load_row] = w_next[i];
        __syncthreads();
        if (k0 + LIN_K < K) load_slice(k0 + LIN_K);
        for (int k = 0; k < LIN_K; k++) {
            const float4 xv = *reinterpret_cast<const float4*>(&Xs[k][ty * 4]);
            const float4 wv = *reinterpret_cast<const float4*>(&Ws[k][tx * 4]);
            const float xs[4] = {xv.x, xv.y, xv.z, xv.w}, ws[4] = {wv.x, wv.y, wv.z, wv.w};
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(xs[i], ws[j], acc[i][j]);
        }
        __syncthreads();
    }
    for (int i = 0; i < 4; i++) {
        const int r = row0 + ty * 4 + i;
        for (int j = 0; j < 4; j++) {
            const int c = col0 + tx * 4 + j;
            if (r < M && c < N) {
                float v = acc[i][j] + bias[c];
                Y[(size_t)r * N + c] = RELU ? fmaxf(v, 0.0f) : v;
            }
        }
    }
}

void launch_gemm_v9(const GemmArgs<float>& g) {
    const dim3 grid(ceil_div(g.N, LIN_TILE), ceil_div(g.M, LIN_TILE));
    if (g.act == Act::Relu)
        linear_fp32_v9_kernel<true><<<grid, LIN_THREADS>>>(g.Y, g.X, g.W, g.bias, g.M, g.N, g.K);
    else
        linear_fp32_v9_kernel<false><<<grid, LIN_THREADS>>>(g.Y, g.X, g.W, g.bias, g.M, g.N, g.K);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_gemm_driver<float>("gemm_v9", launch_gemm_v9) ? 0 : 1;
}
