// GEMM v5: 2-D register blocking and 16-byte vector loads, fp32.
//
// Change vs v4: each thread computes a TM x TN = 8 x 4 block of outputs. Per
// k it loads 8 X values and 4 W values (three 16-byte shared loads) and does
// 32 FMAs, so shared-memory traffic is ~1 load instruction per 10 FMAs
// instead of ~1 per 1. The block tile is 128x64 with 256 threads.
//
// Global memory is read in float4 (16-byte) chunks, four times fewer load
// instructions than v4. A float4 load needs a 16-byte aligned address, which
// holds when K % 4 == 0 and the base pointer is aligned (the driver checks
// both: K = 784, 400, 20 all qualify). Chunks that would cross the end of K,
// and every chunk when the check fails, fall back to guarded scalar loads.
// The output uses float4 stores under the same kind of check.
//
// Build and run:  make -C dev gemm_v5 && ./dev/gemm_v5
#include "common.h"

// Four consecutive elements A[row][k..k+3] of a row-major [rows, K] matrix,
// zero where out of range.
__device__ __forceinline__ float4 load_chunk4(const float* A, int row, int k, int rows, int K, bool vec_ok) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (row >= rows) return v;
    const float* p = A + static_cast<size_t>(row) * K;
    if (vec_ok && k + 3 < K) return *reinterpret_cast<const float4*>(p + k);
    if (k + 0 < K) v.x = p[k + 0];
    if (k + 1 < K) v.y = p[k + 1];
    if (k + 2 < K) v.z = p[k + 2];
    if (k + 3 < K) v.w = p[k + 3];
    return v;
}

// Loads a ROWS x BK tile, k-major into shared memory (dst[k][row]).
template <int ROWS, int BK, int kThreads>
__device__ __forceinline__ void load_tile_transposed(float (*dst)[ROWS + 4], const float* src, int row0,
                                                     int rows, int K, int k0, bool vec_ok) {
    constexpr int kChunksPerRow = BK / 4;
#pragma unroll
    for (int i = threadIdx.x; i < ROWS * kChunksPerRow; i += kThreads) {
        const int r = i / kChunksPerRow, c = (i % kChunksPerRow) * 4;
        const float4 v = load_chunk4(src, row0 + r, k0 + c, rows, K, vec_ok);
        dst[c + 0][r] = v.x;
        dst[c + 1][r] = v.y;
        dst[c + 2][r] = v.z;
        dst[c + 3][r] = v.w;
    }
}

template <int BM, int BN, int BK, int TM, int TN>
__global__ __launch_bounds__((BM / TM) * (BN / TN)) void gemm_2d_blocking(
    const float* X, const float* W, const float* bias, float* Y, int M, int N, int K, Act act,
    bool vec_in, bool vec_out) {
    constexpr int kThreads = (BM / TM) * (BN / TN);
    static_assert(TM % 4 == 0 && TN == 4 && BK % 4 == 0, "float4 reads of the register blocks");
    // +4 floats per row keeps rows 16-byte aligned for float4 reads and
    // limits the transposed stores to 2-way bank conflicts.
    __shared__ alignas(16) float Xs[BK][BM + 4];
    __shared__ alignas(16) float Ws[BK][BN + 4];
    const int tn = threadIdx.x % (BN / TN);  // column block of this thread
    const int tm = threadIdx.x / (BN / TN);  // row block of this thread
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;

    float acc[TM][TN] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        load_tile_transposed<BM, BK, kThreads>(Xs, X, m0, M, K, k0, vec_in);
        load_tile_transposed<BN, BK, kThreads>(Ws, W, n0, N, K, k0, vec_in);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            float x[TM], w[TN];
#pragma unroll
            for (int i = 0; i < TM; i += 4) {
                const float4 v = *reinterpret_cast<const float4*>(&Xs[kk][tm * TM + i]);
                x[i] = v.x; x[i + 1] = v.y; x[i + 2] = v.z; x[i + 3] = v.w;
            }
            const float4 v = *reinterpret_cast<const float4*>(&Ws[kk][tn * TN]);
            w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += x[i] * w[j];
        }
        __syncthreads();
    }

    const int n = n0 + tn * TN;
    float b[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j) b[j] = n + j < N ? bias[n + j] : 0.0f;
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int m = m0 + tm * TM + i;
        if (m >= M) break;
        float out[TN];
#pragma unroll
        // the activation as a max: with 0 for ReLU, with -inf for none
        for (int j = 0; j < TN; ++j) out[j] = fmaxf(acc[i][j] + b[j], act == Act::Relu ? 0.0f : -INFINITY);
        float* y = Y + static_cast<size_t>(m) * N + n;
        if (vec_out && n + TN <= N) {
            *reinterpret_cast<float4*>(y) = make_float4(out[0], out[1], out[2], out[3]);
        } else {
#pragma unroll
            for (int j = 0; j < TN; ++j)
                if (n + j < N) y[j] = out[j];
        }
    }
}

void launch_gemm_v5(const GemmArgs<float>& g) {
    constexpr int BM = 128, BN = 64, BK = 16, TM = 8, TN = 4;
    const bool vec_in = g.K % 4 == 0 && is_aligned(g.X, 16) && is_aligned(g.W, 16);
    const bool vec_out = g.N % 4 == 0 && is_aligned(g.Y, 16);
    const dim3 grid(ceil_div(g.N, BN), ceil_div(g.M, BM));
    gemm_2d_blocking<BM, BN, BK, TM, TN><<<grid, (BM / TM) * (BN / TN)>>>(
        g.X, g.W, g.bias, g.Y, g.M, g.N, g.K, g.act, vec_in, vec_out);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_gemm_driver<float>("gemm_v5", launch_gemm_v5) ? 0 : 1;
}
