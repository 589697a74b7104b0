// GEMM v7: pipelined tensor-core GEMM with mma.sync, ldmatrix and cp.async,
// bf16 inputs, fp32 accumulation, fused bias + activation epilogue.
//
// Changes vs v6, each removing a stall v6 has:
//  1. Multi-stage pipeline: cp.async copies global -> shared memory without
//     passing through registers and without blocking the thread, so the
//     copies for the next STAGES-1 K-tiles are in flight while the tensor
//     cores work on the current one. v6 stops the tensor cores for every load.
//  2. mma.sync.m16n8k16 with ldmatrix instead of WMMA: the fragment layout is
//     documented, so the epilogue adds the bias, applies the activation and
//     stores bf16 pairs straight from the accumulator registers, with no trip
//     through shared memory.
//  3. Tile shape per layer (template parameters). At M = 4096 these GEMMs are
//     ~2.6 GFLOP, a few microseconds: what matters is spreading the work
//     evenly over all 132 SMs (wave quantisation) while keeping tiles big
//     enough that L2 -> SM traffic stays low. `./dev/gemm_v7 --sweep`
//     validates and times every compiled tile shape on every layer; the
//     dispatch in launch_gemm_v7 picks from those measurements.
//
// Shared memory rows are BK + 8 = 40 bf16 (80 bytes): the 8 row addresses of
// one ldmatrix then fall in 8 different 16-byte bank groups (no conflicts),
// and every row stays 16-byte aligned for cp.async.
//
// Build and run:  make -C dev gemm_v7 && ./dev/gemm_v7  [--sweep]
#include <cstring>
#include <string>

#include "common.h"  // ldmatrix_x4/x2; through it vae.cu's PTX helpers: cp_async16, mma_bf16_m16n8k16

// ---------------------------------------------------------------------------
// Kernel

// One thread's share of copying ROWS x BK tiles of a row-major [rows, K]
// matrix into shared memory, in 16-byte chunks of 8 bf16. The thread always
// handles column c of rows r0, r0 + kRowStep, ...: everything except k0 is
// computed once, so a K step costs a few instructions per chunk.
template <int ROWS, int BK, int kThreads>
struct TileCopier {
    static constexpr int kLd = BK + 8;
    static constexpr int kChunksPerRow = BK / 8;
    static_assert(kThreads % kChunksPerRow == 0, "each thread keeps one column of chunks");
    static constexpr int kRowStep = kThreads / kChunksPerRow;
    static constexpr int kIters = (ROWS + kRowStep - 1) / kRowStep;

    const bf16* base;  // any valid address, read by nothing (zero-size copies point here)
    const bf16* src;   // element (row0 + r0, c)
    size_t step;       // kRowStep rows, in elements
    int r0, c, rows_left;

    __device__ TileCopier(const bf16* matrix, int row0, int rows, int K)
        : base(matrix),
          step(static_cast<size_t>(kRowStep) * K),
          r0(threadIdx.x / kChunksPerRow),
          c((threadIdx.x % kChunksPerRow) * 8) {
        rows_left = rows - row0 - r0;  // chunk j is in range iff j * kRowStep < rows_left
        src = matrix + static_cast<size_t>(row0 + r0) * K + c;
    }

    // Needs K % 8 == 0 and 16-byte aligned rows: then every chunk is wholly
    // inside or wholly outside the matrix, and outside ones are zero-filled.
    __device__ __forceinline__ void copy_async(bf16* dst_tile, int k0, int K) const {
        const bool k_in = k0 + c < K;
#pragma unroll
        for (int j = 0; j < kIters; ++j) {
            const int r = r0 + j * kRowStep;
            if (ROWS % kRowStep != 0 && r >= ROWS) break;
            const bool in = k_in && j * kRowStep < rows_left;
            cp_async16(dst_tile + r * kLd + c, in ? src + j * step + k0 : base, in);
        }
    }

    // Any K and alignment (K = 20): element by element, synchronous.
    __device__ __forceinline__ void copy_sync(bf16* dst_tile, int k0, int K) const {
#pragma unroll
        for (int j = 0; j < kIters; ++j) {
            const int r = r0 + j * kRowStep;
            if (ROWS % kRowStep != 0 && r >= ROWS) break;
            unsigned e[8] = {};
            if (j * kRowStep < rows_left)
                for (int t = 0; t < 8; ++t)
                    if (k0 + c + t < K) e[t] = __bfloat16_as_ushort(src[j * step + k0 + t]);
            *reinterpret_cast<uint4*>(dst_tile + r * kLd + c) =
                make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16, e[6] | e[7] << 16);
        }
    }
};

// Block tile BM x BN, WARPS_M x WARPS_N warps each owning a (BM/WARPS_M) x
// (BN/WARPS_N) sub-tile of m16n8 MMA tiles, K walked in BK steps through a
// ring of STAGES shared-memory buffers.
template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES>
__global__ __launch_bounds__(WARPS_M * WARPS_N * 32) void gemm_mma_pipelined(
    const bf16* __restrict__ X, const bf16* __restrict__ W, const bf16* __restrict__ bias, bf16* __restrict__ Y,
    int M, int N, int K, Act act, bool vec_ok) {
    constexpr int kThreads = WARPS_M * WARPS_N * 32;
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    constexpr int MI = WM / 16, NI = WN / 8;  // MMA tiles per warp
    constexpr int kLd = BK + 8;
    constexpr int kStageElems = (BM + BN) * kLd;
    static_assert(WM % 16 == 0 && WN % 8 == 0, "warp tile must be whole m16n8 MMA tiles");
    static_assert(BK % 16 == 0, "K tile must be whole k16 MMA steps");
    static_assert(STAGES >= 2, "a pipeline needs at least two buffers");

    extern __shared__ __align__(128) unsigned char smem_v7[];
    bf16* smem = reinterpret_cast<bf16*>(smem_v7);  // STAGES x {A: [BM][kLd], B: [BN][kLd]}

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wm0 = (warp / WARPS_N) * WM, wn0 = (warp % WARPS_N) * WN;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int num_k_tiles = ceil_div(K, BK);

    const TileCopier<BM, BK, kThreads> copy_x(X, m0, M, K);
    const TileCopier<BN, BK, kThreads> copy_w(W, n0, N, K);
    auto load_stage = [&](int kt) {
        const int stage = kt % STAGES;
        if (vec_ok) {
            copy_x.copy_async(smem + stage * kStageElems, kt * BK, K);
            copy_w.copy_async(smem + stage * kStageElems + BM * kLd, kt * BK, K);
        } else {
            copy_x.copy_sync(smem + stage * kStageElems, kt * BK, K);
            copy_w.copy_sync(smem + stage * kStageElems + BM * kLd, kt * BK, K);
        }
    };

    // Each lane's ldmatrix row address in stage 0 at k = 0. For A (16x16 per
    // x4): rows lane % 16, k half lane / 16. For B (two n8 tiles per x4):
    // rows lane % 8 (+8 for lanes 16-31), k half (lane / 8) % 2. B is stored
    // [n][k], so these plain loads already give mma's column-major fragments.
    const bf16* a_lane = smem + (wm0 + lane % 16) * kLd + (lane / 16) * 8;
    const bf16* b_lane = smem + BM * kLd + (wn0 + lane % 8 + (lane / 16) * 8) * kLd + ((lane / 8) % 2) * 8;

    // Prologue: STAGES-1 tiles in flight. One commit group per tile, empty
    // past the end of K, so that "group kt is complete" is always what
    // wait_group<STAGES-2> means below.
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_k_tiles) load_stage(s);
        cp_async_commit();
    }

    float acc[MI][NI][4] = {};
    for (int kt = 0; kt < num_k_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of tile kt have landed
        __syncthreads();              // everyone's have; and every warp is done reading tile kt-1
        if (kt + STAGES - 1 < num_k_tiles) load_stage(kt + STAGES - 1);  // into tile kt-1's buffer
        cp_async_commit();

        const int stage_offset = (kt % STAGES) * kStageElems;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            if (kt * BK + kk >= K) break;  // the rest of the last tile is zero padding
            uint32_t a[MI][4], b[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(a[mi], a_lane + stage_offset + mi * 16 * kLd + kk);
#pragma unroll
            for (int ni = 0; ni < NI; ni += 2) {
                const bf16* addr = b_lane + stage_offset + ni * 8 * kLd + kk;
                if (ni + 1 < NI) {
                    uint32_t t[4];
                    ldmatrix_x4(t, addr);
                    b[ni][0] = t[0];
                    b[ni][1] = t[1];
                    b[ni + 1][0] = t[2];
                    b[ni + 1][1] = t[3];
                } else {
                    ldmatrix_x2(b[ni][0], b[ni][1], addr);  // odd NI: lanes 0-15's addresses are the same rows
                }
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) mma_m16n8k16<bf16>(acc[mi][ni], a[mi], b[ni]);
        }
    }

    // Fused epilogue. Accumulator c[0..1] of an m16n8 tile is (row g, cols
    // 2q, 2q+1) and c[2..3] is (row g+8, same cols), g = lane/4, q = lane%4.
    const int g = lane / 4, q = lane % 4;
    const bool paired = N % 2 == 0;  // a bf16x2 store at an even column is 4-byte aligned only if N is even
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
        const int n = n0 + wn0 + ni * 8 + q * 2;
        const float b0 = n < N ? __bfloat162float(bias[n]) : 0.0f;
        const float b1 = n + 1 < N ? __bfloat162float(bias[n + 1]) : 0.0f;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int m = m0 + wm0 + mi * 16 + g + half * 8;
                if (m >= M || n >= N) continue;
                // the activation as a max: with 0 for ReLU, with -inf for none
                const float v0 = fmaxf(acc[mi][ni][2 * half] + b0, act == Act::Relu ? 0.0f : -INFINITY);
                const float v1 = fmaxf(acc[mi][ni][2 * half + 1] + b1, act == Act::Relu ? 0.0f : -INFINITY);
                bf16* y = Y + static_cast<size_t>(m) * N + n;
                if (paired && n + 1 < N) {
                    *reinterpret_cast<__nv_bfloat162*>(y) = __floats2bfloat162_rn(v0, v1);
                } else {
                    y[0] = __float2bfloat16(v0);
                    if (n + 1 < N) y[1] = __float2bfloat16(v1);
                }
            }
    }
}

// ---------------------------------------------------------------------------
// Host side

template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES>
void launch_tile(const GemmArgs<bf16>& g) {
    constexpr int kThreads = WARPS_M * WARPS_N * 32;
    constexpr int kSmemBytes = STAGES * (BM + BN) * (BK + 8) * static_cast<int>(sizeof(bf16));
    const auto kernel = gemm_mma_pipelined<BM, BN, BK, WARPS_M, WARPS_N, STAGES>;
    // Above 48 KB of dynamic shared memory a kernel must opt in, once.
    static const bool opted_in = [&] {
        cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
        return true;
    }();
    (void)opted_in;
    const bool vec_ok = g.K % 8 == 0 && is_aligned(g.X, 16) && is_aligned(g.W, 16);
    const dim3 grid(ceil_div(g.N, BN), ceil_div(g.M, BM));
    kernel<<<grid, kThreads, kSmemBytes>>>(g.X, g.W, g.bias, g.Y, g.M, g.N, g.K, g.act, vec_ok);
    cudaCheck(cudaGetLastError());
}

struct TileConfig {
    const char* name;
    void (*launch)(const GemmArgs<bf16>&);
};

// Tile shapes worth trying here: BMxBN, K step, warps, stages. 400 = 5 x 80
// and 784 = 7 x 112, so some divide the real layers exactly.
constexpr TileConfig kTileConfigs[] = {
    {"64x64_k32_w2x2_s4", launch_tile<64, 64, 32, 2, 2, 4>},
    {"64x128_k64_w2x4_s3", launch_tile<64, 128, 64, 2, 4, 3>},
    {"128x80_k64_w4x2_s3", launch_tile<128, 80, 64, 4, 2, 3>},
    {"128x112_k64_w4x2_s3", launch_tile<128, 112, 64, 4, 2, 3>},
    {"128x128_k32_w2x4_s4", launch_tile<128, 128, 32, 2, 4, 4>},
    {"128x128_k64_w2x4_s3", launch_tile<128, 128, 64, 2, 4, 3>},
    {"128x128_k64_w4x4_s4", launch_tile<128, 128, 64, 4, 4, 4>},
};

// Tile shape per layer, from `--sweep` on an H200: small tiles for the
// narrow fc21+fc22 (more CTAs), 128x128 elsewhere; the long-K layers prefer
// a 64-deep K step (half the barriers), the K = 20 layer has one K step only.
void launch_gemm_v7(const GemmArgs<bf16>& g) {
    if (g.N <= 64)
        launch_tile<64, 64, 32, 2, 2, 4>(g);
    else if (g.K <= 32)
        launch_tile<128, 128, 32, 2, 4, 4>(g);
    else
        launch_tile<128, 128, 64, 2, 4, 3>(g);
}

int main(int argc, char** argv) {
    print_device_info();
    if (argc > 1 && strcmp(argv[1], "--sweep") == 0) {
        bool ok = true;
        for (const TileConfig& c : kTileConfigs)
            ok = run_gemm_driver<bf16>((std::string("gemm_v7_") + c.name).c_str(), c.launch) && ok;
        return ok ? 0 : 1;
    }
    return run_gemm_driver<bf16>("gemm_v7", launch_gemm_v7) ? 0 : 1;
}
