// GEMM v6: tensor cores through WMMA, bf16 inputs, fp32 accumulation.
//
// Change vs v5: the multiply-adds move from the fp32 FMA units (~60 TFLOP/s
// on an H100/H200) to the tensor cores (~800 TFLOP/s dense bf16 measured),
// and inputs/outputs shrink to bf16, halving memory traffic. Precision
// changes too, so this step is compared with cuBLAS in bf16, not fp32.
//
// Structure: a 64x64 output tile per block of 4 warps (2x2); each warp owns
// a 32x32 sub-tile, i.e. 2x2 WMMA 16x16x16 accumulators. The block stages
// 64x32 tiles of X and W in shared memory with 16-byte loads (guarded scalar
// loads where K % 8 != 0, e.g. K = 20, or at the end of K). W[N,K] row-major
// is exactly the "col_major" K x N operand WMMA wants, so no transpose.
//
// WMMA's accumulator layout is opaque, so the fused epilogue goes through
// shared memory: accumulators are stored there, then every thread adds the
// bias, applies the activation and writes bf16 with bounds checks.
// No pipelining yet: loads and MMAs of a tile alternate, separated by
// barriers, so the tensor cores idle while a tile loads (v7 fixes that).
//
// Build and run:  make -C dev gemm_v6 && ./dev/gemm_v6
#include <mma.h>

#include "common.h"

namespace wmma = nvcuda::wmma;

constexpr int BM = 64, BN = 64, BK = 32;
constexpr int kThreads = 128;         // 4 warps as 2x2, each 32x32 of the tile
constexpr int kTileLd = BK + 8;       // +16 bytes per row: rows start in different banks
constexpr int kOutLd = BN + 4;        // fp32 staging of the output tile

// Loads a ROWS x BK tile of a row-major [rows, K] bf16 matrix into shared
// memory, zero-filled out of range, 8 elements (16 bytes) per step.
template <int ROWS>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int row0, int rows, int K, int k0,
                                          bool vec_ok) {
    constexpr int kChunksPerRow = BK / 8;
    for (int i = threadIdx.x; i < ROWS * kChunksPerRow; i += kThreads) {
        const int r = i / kChunksPerRow, c = (i % kChunksPerRow) * 8;
        const int row = row0 + r, k = k0 + c;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (row < rows) {
            const bf16* p = src + static_cast<size_t>(row) * K;
            if (vec_ok && k + 8 <= K) {
                v = *reinterpret_cast<const uint4*>(p + k);
            } else {
                unsigned e[8];
                for (int j = 0; j < 8; ++j) e[j] = k + j < K ? __bfloat16_as_ushort(p[k + j]) : 0;
                v = make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16, e[6] | e[7] << 16);
            }
        }
        *reinterpret_cast<uint4*>(dst + r * kTileLd + c) = v;
    }
}

__global__ __launch_bounds__(kThreads) void gemm_wmma(const bf16* X, const bf16* W, const bf16* bias, bf16* Y,
                                                      int M, int N, int K, Act act, bool vec_ok) {
    // The input tiles are dead once the K loop ends, so the fp32 output tile
    // reuses their memory. WMMA pointers must be 32-byte aligned.
    constexpr int kInputBytes = (BM + BN) * kTileLd * sizeof(bf16);
    constexpr int kOutputBytes = BM * kOutLd * sizeof(float);
    __shared__ alignas(128) unsigned char smem[kInputBytes > kOutputBytes ? kInputBytes : kOutputBytes];
    bf16* Xs = reinterpret_cast<bf16*>(smem);  // [BM][kTileLd]
    bf16* Ws = Xs + BM * kTileLd;              // [BN][kTileLd]
    float* Cs = reinterpret_cast<float*>(smem);  // [BM][kOutLd]

    const int warp = threadIdx.x / 32;
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;  // warp's sub-tile origin
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    for (int k0 = 0; k0 < K; k0 += BK) {
        load_tile<BM>(Xs, X, m0, M, K, k0, vec_ok);
        load_tile<BN>(Ws, W, n0, N, K, k0, vec_ok);
        __syncthreads();
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b[2];
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], Xs + (wm + i * 16) * kTileLd + kk, kTileLd);
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], Ws + (wn + j * 16) * kTileLd + kk, kTileLd);
            for (int i = 0; i < 2; ++i)
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();  // all warps done with the tiles before they are overwritten
    }

    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(Cs + (wm + i * 16) * kOutLd + wn + j * 16, acc[i][j], kOutLd,
                                    wmma::mem_row_major);
    __syncthreads();
    // Consecutive threads take consecutive columns: coalesced stores. The
    // activation as a max: with 0 for ReLU, with -inf for none.
    const float lo = act == Act::Relu ? 0.0f : -INFINITY;
    for (int i = threadIdx.x; i < BM * BN; i += kThreads) {
        const int r = i / BN, c = i % BN, m = m0 + r, n = n0 + c;
        if (m < M && n < N)
            Y[static_cast<size_t>(m) * N + n] =
                __float2bfloat16(fmaxf(Cs[r * kOutLd + c] + __bfloat162float(bias[n]), lo));
    }
}

void launch_gemm_v6(const GemmArgs<bf16>& g) {
    const bool vec_ok = g.K % 8 == 0 && is_aligned(g.X, 16) && is_aligned(g.W, 16);
    const dim3 grid(ceil_div(g.N, BN), ceil_div(g.M, BM));
    gemm_wmma<<<grid, kThreads>>>(g.X, g.W, g.bias, g.Y, g.M, g.N, g.K, g.act, vec_ok);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_gemm_driver<bf16>("gemm_v6", launch_gemm_v6) ? 0 : 1;
}
