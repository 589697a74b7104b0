// GEMM v8: Hopper warpgroup MMA (wgmma) fed by TMA through an mbarrier
// pipeline, bf16 inputs, fp32 accumulation, fused bias + activation epilogue.
// sm_90a only: wgmma needs the architecture-specific target.
//
// v7 is issue-bound: mma.sync is a warp-wide 16x8x16 product, so every MMA
// costs ~10 more instructions of ldmatrix, address arithmetic and pipeline
// bookkeeping, and at 2-3 warps per scheduler the tensor pipe sits idle 73%
// of the time. It also re-reads X and W through L2 once per tile that needs
// them (54 MB for fc1). v8 removes both costs:
//  1. wgmma.mma_async: one instruction per warpgroup computes a 64 x BN x 16
//     product (BN up to 256) reading A and B straight from shared memory
//     through 64-bit matrix descriptors. No ldmatrix, no fragments; the
//     instruction is asynchronous, so the warpgroup issues a whole K tile of
//     them and waits once.
//  2. TMA (cp.async.bulk.tensor): one thread copies a whole 2-D box
//     global -> shared memory, in the 128-byte swizzled layout wgmma reads
//     without bank conflicts, and zero-fills whatever lies outside the matrix
//     (ragged M, N and K need no code). Completion is counted in bytes on an
//     mbarrier.
//  3. Warp specialisation: warpgroup 0 is the producer (one thread issues
//     TMA into a STAGES-deep ring), warpgroups 1..CONSUMERS each own 64 rows
//     of the tile and only wait, multiply and release. "full" barriers say a
//     stage has landed, "empty" barriers say every consumer is done with it.
//  4. Epilogue through shared memory: each consumer warpgroup writes its
//     64 x BN bf16 tile (bias and activation applied) to shared memory and
//     one thread stores it with TMA, in whole lines; direct bf16x2 stores
//     from registers write 16-byte pieces and measured 1.9 us slower on
//     fc1 and 3.6 us slower on fc4. The bias comes into shared memory with
//     the first stage (one bulk copy): read in the epilogue it cost a cold
//     DRAM round trip after the last MMA (0.4-1.3 us). The staging tile
//     reuses the ring, whose stages are all consumed by then.
//  5. Optional clusters of CN x CM CTAs with TMA multicast: CTAs side by
//     side along N need the same X rows, CTAs along M the same W rows; each
//     fetches one slice and multicasts it to the CTAs that share it, so the
//     tile crosses L2 -> SM once per cluster. A stage may be refilled only
//     when the consumers of every CTA in the cluster have released it, so
//     consumers arrive on the empty barriers of the whole cluster. Measured
//     no faster than no cluster on these shapes (README), so the dispatch
//     does not use them; `--sweep` keeps them.
//
// Tile shapes: BM = 64 x CONSUMERS rows, BN columns (any multiple of 8 up to
// 256), BK = 64 (one 128-byte swizzle row of bf16). 400 = 4 x 100 and 784 =
// 4 x 196, so BN = 200 gives fc1 2 column tiles of 64 rows (2 x 64) and fc4
// 4 of 128 rows (4 x 32): 128 CTAs on 132 SMs, one wave with 2-4% of the
// columns wasted. The last
// K tile of K = 400 or 784 holds 16 real columns; only its first k16 step runs.
//
// TMA needs 16-byte aligned rows (K % 8 == 0, and N % 8 == 0 for the output):
// fc3 (K = 20) falls back to v7's kernel, as does any misaligned input (a copy
// of its synchronous-copy path below: drivers do not include each other).
// fc21+fc22 (N = 40) runs a 64 x 40 tile with one consumer warpgroup.
//
// `./dev/gemm_v8 --sweep` validates and times every compiled configuration,
// plus a step-one kernel with wgmma but no TMA or pipelining (plain 16-byte
// loads into the swizzled layout), kept as the correctness baseline;
// `--profile NAME` launches one configuration once per big layer (and
// cuBLASLt after it) for Nsight Compute.
//
// Build and run:  make -C dev gemm_v8 && ./dev/gemm_v8  [--sweep | --config NAME | --profile NAME]
#include <cstring>
#include <string>

// vae.cu (through common.h) brings CUtensorMap, tensor_map_encoder and the Hopper helpers this
// file shares with its decoder: mbar_init / arrive_expect_tx / wait, tma_load_2d,
// smem_desc_128b, wgmma_fence / commit / wait, fence_accumulators.
#include "common.h"

// ---------------------------------------------------------------------------
// v7's kernel, synchronous-copy path: the fallback for layers TMA cannot read.
// TMA and v7's cp.async both need 16-byte chunks, so a layer that falls back
// here is one v7 itself copies element by element (K = 20 takes this path in
// v7 too). Tile 128 x 128 x 32, 2 x 4 warps, 4 stages: v7's choice for K <= 32.

namespace v7 {
constexpr int BM = 128, BN = 128, BK = 32, WARPS_M = 2, WARPS_N = 4, STAGES = 4;
constexpr int kThreads = WARPS_M * WARPS_N * 32, kLd = BK + 8, kStageElems = (BM + BN) * kLd;
constexpr int kSmemBytes = STAGES * kStageElems * static_cast<int>(sizeof(bf16));

// ROWS x BK tile of a row-major [rows, K] matrix into shared memory, zero-filled
// outside it; each thread keeps one column of 8-element chunks.
template <int ROWS>
__device__ __forceinline__ void copy_tile(bf16* dst, const bf16* matrix, int row0, int rows, int K, int k0) {
    constexpr int kChunksPerRow = BK / 8, kRowStep = kThreads / kChunksPerRow;
    const int r0 = threadIdx.x / kChunksPerRow, c = (threadIdx.x % kChunksPerRow) * 8;
#pragma unroll
    for (int r = r0; r < ROWS; r += kRowStep) {
        unsigned e[8] = {};
        if (row0 + r < rows)
            for (int t = 0; t < 8; ++t)
                if (k0 + c + t < K) e[t] = __bfloat16_as_ushort(matrix[static_cast<size_t>(row0 + r) * K + k0 + c + t]);
        *reinterpret_cast<uint4*>(dst + r * kLd + c) =
            make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16, e[6] | e[7] << 16);
    }
}

__global__ __launch_bounds__(kThreads) void gemm_v7_sync_kernel(const bf16* __restrict__ X, const bf16* __restrict__ W,
                                                                  const bf16* __restrict__ bias, bf16* __restrict__ Y,
                                                                  int M, int N, int K, Act act) {
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, MI = WM / 16, NI = WN / 8;
    extern __shared__ __align__(128) unsigned char smem_v7[];
    bf16* smem = reinterpret_cast<bf16*>(smem_v7);  // STAGES x {A: [BM][kLd], B: [BN][kLd]}
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wm0 = (warp / WARPS_N) * WM, wn0 = (warp % WARPS_N) * WN;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int num_k_tiles = ceil_div(K, BK);
    auto load_stage = [&](int kt) {
        bf16* stage = smem + (kt % STAGES) * kStageElems;
        copy_tile<BM>(stage, X, m0, M, K, kt * BK);
        copy_tile<BN>(stage + BM * kLd, W, n0, N, K, kt * BK);
    };
    const bf16* a_lane = smem + (wm0 + lane % 16) * kLd + (lane / 16) * 8;
    const bf16* b_lane = smem + BM * kLd + (wn0 + lane % 8 + (lane / 16) * 8) * kLd + ((lane / 8) % 2) * 8;
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < num_k_tiles) load_stage(s);
        cp_async_commit();  // empty groups, as in v7: the same barrier pattern
    }
    float acc[MI][NI][4] = {};
    for (int kt = 0; kt < num_k_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (kt + STAGES - 1 < num_k_tiles) load_stage(kt + STAGES - 1);
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
                uint32_t t[4];
                ldmatrix_x4(t, b_lane + stage_offset + ni * 8 * kLd + kk);
                b[ni][0] = t[0], b[ni][1] = t[1], b[ni + 1][0] = t[2], b[ni + 1][1] = t[3];
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) mma_m16n8k16<bf16>(acc[mi][ni], a[mi], b[ni]);
        }
    }
    const int g = lane / 4, q = lane % 4;
    const bool paired = N % 2 == 0;
    const float lo = act == Act::Relu ? 0.0f : -INFINITY;  // the activation as a max
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
                const float v0 = fmaxf(acc[mi][ni][2 * half] + b0, lo), v1 = fmaxf(acc[mi][ni][2 * half + 1] + b1, lo);
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
}  // namespace v7

void launch_gemm_v7(const GemmArgs<bf16>& g) {
    static const bool opted_in = [] {
        cudaCheck(cudaFuncSetAttribute(v7::gemm_v7_sync_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       v7::kSmemBytes));
        return true;
    }();
    (void)opted_in;
    const dim3 grid(ceil_div(g.N, v7::BN), ceil_div(g.M, v7::BM));
    v7::gemm_v7_sync_kernel<<<grid, v7::kThreads, v7::kSmemBytes>>>(g.X, g.W, g.bias, g.Y, g.M, g.N, g.K, g.act);
    cudaCheck(cudaGetLastError());
}

// ---------------------------------------------------------------------------
// PTX wrappers vae.cu does not have: cluster, multicast, bulk copies, wgmma
// from shared memory

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// A consumer's arrival on its own CTA's barrier.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Arrives on the barrier at the same offset in CTA `cta` of this cluster.
// Default (.release.cta) semantics: what the arrival orders is the end of
// this warp's wgmma reads, which wgmma.wait_group already guarantees; a
// .release.cluster arrive adds a cluster-wide memory fence to every K step.
__device__ __forceinline__ void mbar_arrive_cluster(unsigned bar, unsigned cta) {
    asm volatile(
        "{\n.reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
        "r"(cta)
        : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// vae.cu's tma_load_2d, written to the same offset (data and mbarrier) in every CTA of `mask`.
__device__ __forceinline__ void tma_load_2d_multicast(unsigned dst, const CUtensorMap* map, unsigned bar, int c0,
                                                      int c1, uint16_t mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(dst),
        "l"(map), "r"(bar), "r"(c0), "r"(c1), "h"(mask)
        : "memory");
}

// Global -> shared copy of `bytes` contiguous bytes (16-byte aligned, multiple of 16).
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Shared -> global copy of one box; parts outside the tensor are not written.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, unsigned src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(map), "r"(src),
                 "r"(c0), "r"(c1)
                 : "memory");
}
// Commits this thread's bulk stores and waits until their shared-memory
// source has been read (the CTA may then exit or reuse it).
__device__ __forceinline__ void tma_store_commit_and_wait_read() {
    asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// D[64 x N] += A[64 x 16] * B[16 x N], both K-major in shared memory, fp32
// accumulators in registers (N/2 per thread). Inline PTX needs every
// accumulator register spelled out, hence one specialisation per N used.
template <int N>
__device__ void wgmma_bf16(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b);

template <>
__device__ __forceinline__ void wgmma_bf16<40>(float (&d)[20], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19"
        "}, %20, %21, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19])
        : "l"(desc_a), "l"(desc_b)
        : "memory");
}

template <>
__device__ __forceinline__ void wgmma_bf16<104>(float (&d)[52], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n104k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
        "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51"
        "}, %52, %53, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51])
        : "l"(desc_a), "l"(desc_b)
        : "memory");
}

template <>
__device__ __forceinline__ void wgmma_bf16<200>(float (&d)[100], uint64_t desc_a, uint64_t desc_b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n200k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
        "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
        "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99"
        "}, %100, %101, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99])
        : "l"(desc_a), "l"(desc_b)
        : "memory");
}

// ---------------------------------------------------------------------------
// Shared pieces of the kernels

constexpr int kBK = 64;               // bf16 per 128-byte swizzle row
constexpr int kRowBytes = kBK * 2;    // 128
constexpr int kWarpgroup = 128;

// Epilogue of one consumer warpgroup's 64 x BN accumulator tile. wgmma's
// accumulator layout is mma.sync's m16n8 layout repeated: warp w of the
// warpgroup owns rows 16w..16w+15; d[4j + 0..1] is (row g, cols 8j + 2q,
// +1), d[4j + 2..3] is (row g + 8, same cols), g = lane / 4, q = lane % 4.
template <int BN>
__device__ __forceinline__ void store_tile(const float (&d)[BN / 2], const bf16* __restrict__ bias,
                                           bf16* __restrict__ Y, int M, int N, int m_base, int n0, Act act) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int g = lane / 4, q = lane % 4;
    const int r0 = m_base + warp * 16 + g;
    const bool paired = N % 2 == 0;  // a bf16x2 store at an even column is 4-byte aligned only if N is even
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int n = n0 + j * 8 + q * 2;
        if (n >= N) continue;
        const float b0 = __bfloat162float(bias[n]);
        const float b1 = n + 1 < N ? __bfloat162float(bias[n + 1]) : 0.0f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int m = r0 + half * 8;
            if (m >= M) continue;
            // the activation as a max: with 0 for ReLU, with -inf for none
            const float v0 = fmaxf(d[4 * j + 2 * half] + b0, act == Act::Relu ? 0.0f : -INFINITY);
            const float v1 = fmaxf(d[4 * j + 2 * half + 1] + b1, act == Act::Relu ? 0.0f : -INFINITY);
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

// Epilogue through shared memory: the warpgroup writes its 64 x BN bf16 tile
// row-major into `stage` (rows of BN * 2 bytes: consecutive rows shift by
// BN / 2 banks, so the 8 rows of one store land in distinct banks for BN =
// 40, 104, 200), then one thread stores it with TMA: whole 128-byte lines to
// L2 instead of v7's 16-byte pieces, clipped at M and N by the tensor map.
// `bias` holds the tile's columns n0.. (shared memory, loaded with the first stage).
template <int BN>
__device__ __forceinline__ void store_tile_tma(const float (&d)[BN / 2], const bf16* bias,
                                               const CUtensorMap* tmap_y, unsigned char* stage, int N,
                                               int m_base, int n0, Act act) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    const int g = lane / 4, q = lane % 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int c = j * 8 + q * 2, n = n0 + c;
        const float b0 = n < N ? __bfloat162float(bias[c]) : 0.0f;
        const float b1 = n + 1 < N ? __bfloat162float(bias[c + 1]) : 0.0f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = warp * 16 + g + half * 8;
            const float lo = act == Act::Relu ? 0.0f : -INFINITY;
            *reinterpret_cast<__nv_bfloat162*>(stage + (r * BN + c) * 2) =
                __floats2bfloat162_rn(fmaxf(d[4 * j + 2 * half] + b0, lo), fmaxf(d[4 * j + 2 * half + 1] + b1, lo));
        }
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to the TMA engine
    const int barrier_id = 1 + threadIdx.x / kWarpgroup;              // this warpgroup only; 0 is __syncthreads
    asm volatile("bar.sync %0, %1;\n" ::"r"(barrier_id), "n"(kWarpgroup) : "memory");
    if (threadIdx.x % kWarpgroup == 0) {
        tma_store_2d(tmap_y, smem_u32(stage), n0, m_base);
        tma_store_commit_and_wait_read();
    }
}

// The first STEPS k16 steps of one 64-wide K tile, as one wgmma group.
template <int BN, int STEPS = kBK / 16>
__device__ __forceinline__ void mma_k_tile(float (&d)[BN / 2], unsigned a_tile, unsigned b_tile) {
    wgmma_fence();  // the accumulators were last written by earlier wgmmas
    const uint64_t da = smem_desc_128b(a_tile), db = smem_desc_128b(b_tile);
    // a k16 step is +32 bytes along K: +2 in the descriptor's address field (bytes / 16)
#pragma unroll
    for (int kk = 0; kk < STEPS; ++kk) wgmma_bf16<BN>(d, da + 2 * kk, db + 2 * kk);
    wgmma_commit();
}

// A K tile that may be the ragged last one: only the k16 steps that reach
// real columns run (K = 400 and 784 leave 16 of the last 64, so this skips
// 3 of 28 and 3 of 52 steps). Each branch holds a whole fence..commit
// sequence; a condition around single wgmmas inside one makes ptxas
// serialise every wgmma of the kernel.
template <int BN>
__device__ __forceinline__ void mma_k_tile_ragged(float (&d)[BN / 2], unsigned a_tile, unsigned b_tile, int k_left) {
    if (k_left > 48)
        mma_k_tile<BN, 4>(d, a_tile, b_tile);
    else if (k_left > 32)
        mma_k_tile<BN, 3>(d, a_tile, b_tile);
    else if (k_left > 16)
        mma_k_tile<BN, 2>(d, a_tile, b_tile);
    else
        mma_k_tile<BN, 1>(d, a_tile, b_tile);
}

// ---------------------------------------------------------------------------
// Step one: wgmma with plain loads, no TMA, no pipelining. Every thread
// copies 16-byte chunks into the swizzled layout (chunk c of row r goes to
// chunk c ^ (r % 8)), the block syncs, each warpgroup multiplies its 64 rows,
// waits, syncs again. Slow by design: it checks the descriptors and the
// accumulator layout on their own.
template <int BN, int CONSUMERS>
__global__ void __launch_bounds__(CONSUMERS * kWarpgroup)
    gemm_wgmma_simple(const bf16* __restrict__ X, const bf16* __restrict__ W, const bf16* __restrict__ bias,
                      bf16* __restrict__ Y, int M, int N, int K, Act act) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // built for other GPUs, the body is empty and main() refuses to run
    constexpr int BM = 64 * CONSUMERS, kThreads = CONSUMERS * kWarpgroup;
    extern __shared__ unsigned char smem_raw[];
    const unsigned base = smem_u32(smem_raw);
    const unsigned smem = (base + 1023) & ~1023u;  // the swizzle pattern repeats every 1024 bytes
    unsigned char* smem_ptr = smem_raw + (smem - base);
    const unsigned a_tile = smem, b_tile = smem + BM * kRowBytes;
    const int wg = threadIdx.x / kWarpgroup;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;

    float d[BN / 2] = {};
    fence_accumulators(d);
    for (int k0 = 0; k0 < K; k0 += kBK) {
        for (int i = threadIdx.x; i < (BM + BN) * 8; i += kThreads) {
            const int r = i / 8, c = i % 8;
            const bool is_a = r < BM;
            const int row = is_a ? m0 + r : n0 + r - BM, rows = is_a ? M : N;
            const bf16* src = (is_a ? X : W) + static_cast<size_t>(row) * K + k0 + c * 8;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (row < rows && k0 + c * 8 < K) v = *reinterpret_cast<const uint4*>(src);  // K % 8 == 0
            *reinterpret_cast<uint4*>(smem_ptr + r * kRowBytes + ((c ^ (r % 8)) * 16)) = v;
        }
        // Generic-proxy stores must be made visible to the async proxy wgmma reads through.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        mma_k_tile<BN>(d, a_tile + wg * 64 * kRowBytes, b_tile);
        wgmma_wait<0>();
        fence_accumulators(d);
        __syncthreads();
    }
    store_tile<BN>(d, bias, Y, M, N, m0 + wg * 64, n0, act);
#endif
}

// ---------------------------------------------------------------------------
// The kernel: TMA producer warpgroup + CONSUMERS wgmma warpgroups, STAGES
// deep ring. Clusters of CN x CM CTAs: the CN CTAs of a cluster row share
// their X tile, the CM CTAs of a cluster column their W tile; each fetches
// one slice of each and multicasts it to the CTAs that share it.
template <int BN, int CM>
struct WSlices {  // W rows per cluster row; slices stay whole 8-row swizzle groups
    static_assert(CM == 1 || CM == 2, "W is split in at most two slices");
    static constexpr int kFirst = CM == 1 ? BN : ((BN / 2 + 7) / 8) * 8;
    static constexpr int kSecond = BN - kFirst;
};

// Shared memory of one CTA. The TMA-store staging tile reuses the ring: by
// the epilogue every load has landed and every wgmma that read it finished.
template <int BN, int CONSUMERS, int STAGES, bool TMA_STORE>
struct TmaSmem {
    static constexpr int kRing = STAGES * (64 * CONSUMERS + BN) * kRowBytes;
    static constexpr int kOut = TMA_STORE ? CONSUMERS * 64 * BN * 2 : 0;
    static constexpr int kBarriers = kRing > kOut ? kRing : kOut;  // offset of the barriers
    static constexpr int kBias = kBarriers + 16 * STAGES;  // TMA_STORE: the tile's BN bias values
    static constexpr int kBytes = 1024 + kBias + (TMA_STORE ? BN * 2 : 0);
    // Two CTAs per SM when they fit (228 KB per SM, 1 KB reserved per CTA):
    // one CTA's ring fill and epilogue then overlap the other's MMAs.
    static constexpr int kMinBlocks = 2 * (kBytes + 1024) <= 228 * 1024 ? 2 : 1;
};

template <int BN, int CONSUMERS, int CN, int CM, int STAGES, bool TMA_STORE>
__global__ void __launch_bounds__((CONSUMERS + 1) * kWarpgroup,
                                  (TmaSmem<BN, CONSUMERS, STAGES, TMA_STORE>::kMinBlocks))
    gemm_wgmma_tma(const __grid_constant__ CUtensorMap tmap_x, const __grid_constant__ CUtensorMap tmap_w0,
                   const __grid_constant__ CUtensorMap tmap_w1, const __grid_constant__ CUtensorMap tmap_y,
                   const bf16* __restrict__ bias, bf16* __restrict__ Y, int M, int N, int K, Act act) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BM = 64 * CONSUMERS, kCluster = CN * CM;
    constexpr int kABytes = BM * kRowBytes, kBBytes = BN * kRowBytes, kStageBytes = kABytes + kBBytes;
    constexpr int kSliceRows = BM / CN;  // X rows this CTA fetches for its cluster row
    using Slices = WSlices<BN, CM>;
    static_assert(BN % 8 == 0 && BN <= 256, "wgmma N is a multiple of 8 up to 256");
    static_assert(BM % (8 * CN) == 0, "X slices must be whole 8-row swizzle groups");
    static_assert(kStageBytes % 1024 == 0, "every tile stays 1024-byte aligned");
    static_assert(kCluster <= 8, "portable cluster size");

    extern __shared__ unsigned char smem_raw[];
    const unsigned smem = (smem_u32(smem_raw) + 1023) & ~1023u;  // same offset in every CTA
    // Layout: STAGES x {X tile, W tile} (after the main loop: one 64 x BN
    // bf16 output tile per consumer warpgroup), then the barriers.
    const unsigned out0 = smem;
    using Smem = TmaSmem<BN, CONSUMERS, STAGES, TMA_STORE>;
    const unsigned full0 = smem + Smem::kBarriers, empty0 = full0 + 8 * STAGES;
    const unsigned bias_smem = smem + Smem::kBias;
    const int wg = threadIdx.x / kWarpgroup;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int num_k_tiles = ceil_div(K, kBK);
    // Position in the cluster; cluster ranks run x-fastest (rank = cx + cy * CN).
    const int cx = blockIdx.x % CN, cy = blockIdx.y % CM;

    if (threadIdx.x == 0) {
        // Start fetching the descriptors now; the first TMA would otherwise wait for them.
        prefetch_tensor_map(&tmap_x);
        prefetch_tensor_map(&tmap_w0);
        if (CM > 1) prefetch_tensor_map(&tmap_w1);
        if (TMA_STORE) prefetch_tensor_map(&tmap_y);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);  // the local producer's arrive.expect_tx
            mbar_init(empty0 + 8 * s, CONSUMERS * 4 * kCluster);  // every consumer warp of the cluster
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    // Peers multicast into this CTA's barriers: they must exist first.
    if (kCluster > 1)
        cluster_sync();
    else
        __syncthreads();

    if (wg == 0) {
        // Producer: one thread. A stage is refilled when every consumer warp
        // of the cluster released its previous use (phase kt / STAGES - 1).
        if (threadIdx.x == 0) {
            uint16_t row_mask = 0, col_mask = 0;  // CTAs sharing this X tile / this W tile
            for (int i = 0; i < CN; ++i) row_mask |= 1u << (i + cy * CN);
            for (int i = 0; i < CM; ++i) col_mask |= 1u << (cx + i * CN);
            for (int kt = 0; kt < num_k_tiles; ++kt) {
                const int s = kt % STAGES;
                if (kt >= STAGES) mbar_wait(empty0 + 8 * s, (kt / STAGES - 1) & 1);
                const unsigned full = full0 + 8 * s, a_tile = smem + s * kStageBytes, b_tile = a_tile + kABytes;
                // The bias arrives with the first stage: fetched in the
                // epilogue it cost a cold DRAM round trip after the last MMA.
                // N % 8 == 0 (TMA store), so the clipped length is whole 16 bytes.
                const unsigned bias_bytes = TMA_STORE && kt == 0 && n0 < N ? 2 * min(BN, N - n0) : 0;
                mbar_arrive_expect_tx(full, kStageBytes + bias_bytes);  // whole boxes count, zero-filled parts included
                if (bias_bytes > 0) bulk_load(bias_smem, bias + n0, bias_bytes, full);
                if (CN > 1)
                    tma_load_2d_multicast(a_tile + cx * kSliceRows * kRowBytes, &tmap_x, full, kt * kBK,
                                          m0 + cx * kSliceRows, row_mask);
                else
                    tma_load_2d(a_tile, &tmap_x, full, kt * kBK, m0);
                if (CM == 1)
                    tma_load_2d(b_tile, &tmap_w0, full, kt * kBK, n0);
                else if (cy == 0)
                    tma_load_2d_multicast(b_tile, &tmap_w0, full, kt * kBK, n0, col_mask);
                else
                    tma_load_2d_multicast(b_tile + Slices::kFirst * kRowBytes, &tmap_w1, full, kt * kBK,
                                          n0 + Slices::kFirst, col_mask);
            }
        }
    } else {
        // Consumers: warpgroup c multiplies rows 64 (c - 1) .. of the tile.
        // One wgmma group stays in flight: the stage of tile kt - 1 is
        // released once tile kt's group is issued and kt - 1's has finished.
        const int lane = threadIdx.x % 32;
        float d[BN / 2] = {};
        fence_accumulators(d);
        for (int kt = 0; kt < num_k_tiles; ++kt) {
            const int s = kt % STAGES;
            mbar_wait(full0 + 8 * s, (kt / STAGES) & 1);
            const unsigned a_tile = smem + s * kStageBytes;
            mma_k_tile_ragged<BN>(d, a_tile + (wg - 1) * 64 * kRowBytes, a_tile + kABytes, K - kt * kBK);
            wgmma_wait<1>();
            if (kt > 0) {
                const unsigned empty = empty0 + 8 * ((kt - 1) % STAGES);
                if (kCluster > 1) {
                    if (lane < kCluster) mbar_arrive_cluster(empty, lane);  // lane i tells CTA i
                } else if (lane == 0) {
                    mbar_arrive(empty);
                }
            }
        }
        wgmma_wait<0>();
        fence_accumulators(d);
        // The staging tiles overlap stages another consumer warpgroup may still read.
        if (TMA_STORE && CONSUMERS > 1)
            asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS * kWarpgroup) : "memory");
        if (TMA_STORE)
            store_tile_tma<BN>(d, reinterpret_cast<const bf16*>(smem_raw + (bias_smem - smem_u32(smem_raw))), &tmap_y,
                               smem_raw + (out0 - smem_u32(smem_raw)) + (wg - 1) * 64 * BN * 2, N, m0 + (wg - 1) * 64,
                               n0, act);
        else
            store_tile<BN>(d, bias, Y, M, N, m0 + (wg - 1) * 64, n0, act);
    }
    // No CTA may exit while a peer can still arrive on its barriers.
    if (kCluster > 1) cluster_sync();
#endif
}

// ---------------------------------------------------------------------------
// Host side

// Tensor map of a row-major [rows, cols] bf16 matrix read or written in boxes
// of box_rows x box_cols; swizzled (128B, for wgmma operands, box_cols = 64)
// or plain (the output tile). Reads outside the matrix give zeros, writes
// outside are dropped. Maps are cached per (matrix, shape, box), so a timed
// launch does no host work beyond the launch itself.
CUtensorMap tensor_map(const bf16* base, int rows, int cols, int box_cols, int box_rows, bool swizzle) {
    struct Entry {
        const bf16* base;
        int rows, cols, box_cols, box_rows;
        bool swizzle;
        CUtensorMap map;
    };
    static std::vector<Entry> cache;
    for (const Entry& e : cache)
        if (e.base == base && e.rows == rows && e.cols == cols && e.box_cols == box_cols && e.box_rows == box_rows &&
            e.swizzle == swizzle)
            return e.map;
    Entry e{base, rows, cols, box_cols, box_rows, swizzle, {}};
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * sizeof(bf16)};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult r = tensor_map_encoder()(
        &e.map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16*>(base), dims, strides, box, element_strides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "cuTensorMapEncodeTiled failed (%d) for %dx%d, box %dx%d\n", static_cast<int>(r), rows, cols,
                box_rows, box_cols);
        exit(EXIT_FAILURE);
    }
    cache.push_back(e);
    return e.map;
}

// TMA: global address 16-byte aligned, row pitch a multiple of 16 bytes.
bool tma_ok(const GemmArgs<bf16>& g) { return g.K % 8 == 0 && is_aligned(g.X, 16) && is_aligned(g.W, 16); }

template <int BN, int CONSUMERS>
void launch_simple(const GemmArgs<bf16>& g) {
    if (!tma_ok(g)) return launch_gemm_v7(g);  // same 16-byte chunk requirement
    constexpr int BM = 64 * CONSUMERS;
    constexpr int kSmemBytes = 1024 + (BM + BN) * kRowBytes;
    const auto kernel = gemm_wgmma_simple<BN, CONSUMERS>;
    static const bool opted_in = [&] {
        cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
        return true;
    }();
    (void)opted_in;
    const dim3 grid(ceil_div(g.N, BN), ceil_div(g.M, BM));
    kernel<<<grid, CONSUMERS * kWarpgroup, kSmemBytes>>>(g.X, g.W, g.bias, g.Y, g.M, g.N, g.K, g.act);
    cudaCheck(cudaGetLastError());
}

template <int BN, int CONSUMERS, int CN, int CM, int STAGES, bool TMA_STORE>
struct TmaGemm {
    static constexpr int BM = 64 * CONSUMERS;
    static constexpr int kSmemBytes = TmaSmem<BN, CONSUMERS, STAGES, TMA_STORE>::kBytes;
    static_assert(kSmemBytes <= 227 * 1024, "shared memory per block on sm_90");
    static constexpr auto kernel = gemm_wgmma_tma<BN, CONSUMERS, CN, CM, STAGES, TMA_STORE>;

    // Column and row tiles padded to whole clusters; the extra CTAs see only
    // zeros and store nothing.
    static cudaLaunchConfig_t config(const GemmArgs<bf16>& g, cudaLaunchAttribute* attr) {
        static const bool opted_in = [] {
            cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
            return true;
        }();
        (void)opted_in;
        cudaLaunchConfig_t c = {};
        c.gridDim = dim3(ceil_div(g.N, BN * CN) * CN, ceil_div(g.M, BM * CM) * CM);
        c.blockDim = dim3((CONSUMERS + 1) * kWarpgroup);
        c.dynamicSmemBytes = kSmemBytes;
        attr->id = cudaLaunchAttributeClusterDimension;
        attr->val.clusterDim.x = CN;
        attr->val.clusterDim.y = CM;
        attr->val.clusterDim.z = 1;
        c.attrs = attr;
        c.numAttrs = 1;
        return c;
    }

    static void launch(const GemmArgs<bf16>& g) {
        // The TMA store needs Y's rows 16-byte aligned as well.
        if (!tma_ok(g) || (TMA_STORE && (g.N % 8 != 0 || !is_aligned(g.Y, 16) || !is_aligned(g.bias, 16))))
            return launch_gemm_v7(g);
        using Slices = WSlices<BN, CM>;
        const CUtensorMap map_x = tensor_map(g.X, g.M, g.K, kBK, BM / CN, true);
        const CUtensorMap map_w0 = tensor_map(g.W, g.N, g.K, kBK, Slices::kFirst, true);
        const CUtensorMap map_w1 = CM > 1 ? tensor_map(g.W, g.N, g.K, kBK, Slices::kSecond, true) : map_w0;
        const CUtensorMap map_y = TMA_STORE ? tensor_map(g.Y, g.M, g.N, BN, 64, false) : map_w0;
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t c = config(g, &attr);
        cudaCheck(cudaLaunchKernelEx(&c, kernel, map_x, map_w0, map_w1, map_y, g.bias, g.Y, g.M, g.N, g.K, g.act));
        cudaCheck(cudaGetLastError());
    }

    // How many clusters fit on the GPU at once, against how many the grid has.
    static void print_occupancy(const char* name, const GemmArgs<bf16>& g) {
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t c = config(g, &attr);
        int clusters = 0;
        cudaCheck(cudaOccupancyMaxActiveClusters(&clusters, kernel, &c));
        printf("occupancy %s: %d clusters of %d CTAs resident at most; %dx%d (M=%d N=%d) launches %d\n", name,
               clusters, CN * CM, BM, BN, g.M, g.N, c.gridDim.x * c.gridDim.y / (CN * CM));
    }
};

struct V8Config {
    const char* name;
    void (*launch)(const GemmArgs<bf16>&);
    void (*occupancy)(const char*, const GemmArgs<bf16>&);
};
template <int BN, int CONSUMERS, int CN, int CM, int STAGES, bool TMA_STORE>
constexpr V8Config tma_config(const char* name) {
    using G = TmaGemm<BN, CONSUMERS, CN, CM, STAGES, TMA_STORE>;
    return {name, G::launch, G::print_occupancy};
}

// Everything `--sweep` validates and times. Names: BMxBN, cluster CN x CM
// (along N x along M), stages, epilogue (st: direct stores, tma: staged TMA
// store). Each applies to every layer TMA can read (fc3 runs v7).
constexpr V8Config kV8Configs[] = {
    {"simple_128x104", launch_simple<104, 2>, nullptr},
    tma_config<104, 2, 1, 1, 6, false>("128x104_c1x1_s6_st"),
    tma_config<104, 2, 1, 1, 6, true>("128x104_c1x1_s6_tma"),
    tma_config<104, 2, 2, 1, 6, false>("128x104_c2x1_s6_st"),
    tma_config<104, 2, 2, 1, 6, true>("128x104_c2x1_s6_tma"),
    tma_config<104, 2, 1, 2, 6, true>("128x104_c1x2_s6_tma"),
    tma_config<200, 2, 1, 1, 4, false>("128x200_c1x1_s4_st"),
    tma_config<200, 2, 1, 1, 4, true>("128x200_c1x1_s4_tma"),
    tma_config<200, 2, 2, 1, 4, true>("128x200_c2x1_s4_tma"),
    tma_config<200, 2, 1, 2, 4, false>("128x200_c1x2_s4_st"),
    tma_config<200, 2, 1, 2, 4, true>("128x200_c1x2_s4_tma"),
    // 64-row tiles, one consumer warpgroup: 2 column tiles x 64 = 128 CTAs on
    // fc1 (cuBLAS's fc1 shape), 4 x 64 = 256 on fc4; s3 and 64x104 fit 2 per SM.
    tma_config<200, 1, 1, 1, 6, true>("64x200_c1x1_s6_tma"),
    tma_config<200, 1, 1, 2, 6, true>("64x200_c1x2_s6_tma"),
    tma_config<200, 1, 1, 1, 4, true>("64x200_c1x1_s4_tma"),
    tma_config<200, 1, 1, 1, 3, true>("64x200_c1x1_s3_tma"),
    tma_config<200, 1, 1, 2, 3, true>("64x200_c1x2_s3_tma"),
    tma_config<104, 1, 1, 1, 4, true>("64x104_c1x1_s4_tma"),
    tma_config<104, 1, 1, 1, 5, true>("64x104_c1x1_s5_tma"),
    tma_config<104, 1, 1, 2, 5, true>("64x104_c1x2_s5_tma"),
    tma_config<104, 2, 1, 1, 3, true>("128x104_c1x1_s3_tma"),
    tma_config<104, 2, 1, 1, 7, true>("128x104_c1x1_s7_tma"),
    tma_config<104, 2, 1, 1, 5, true>("128x104_c1x1_s5_tma"),
    tma_config<104, 2, 1, 1, 4, true>("128x104_c1x1_s4_tma"),
    tma_config<200, 1, 1, 1, 5, true>("64x200_c1x1_s5_tma"),
    tma_config<200, 2, 1, 1, 5, true>("128x200_c1x1_s5_tma"),
    tma_config<40, 1, 1, 1, 7, false>("64x40_c1x1_s7_st"),
    tma_config<40, 1, 1, 1, 7, true>("64x40_c1x1_s7_tma"),
    tma_config<40, 1, 1, 2, 7, true>("64x40_c1x2_s7_tma"),
};

// Tile per layer, from `--sweep` on an H200: 64 x 40 for the narrow
// fc21+fc22, 64 x 200 with 6 stages up to N = 416 (fc1: 2 column tiles x 64,
// cuBLAS's shape, X read twice instead of 4 times; 11.9 us against 12.7 for
// 128 x 104), 128 x 200 above (fc4: 4 column tiles); no clusters (they cut L2
// traffic but measured no faster here), TMA-store epilogue everywhere.
void launch_gemm_v8(const GemmArgs<bf16>& g) {
    if (g.N <= 40)
        TmaGemm<40, 1, 1, 1, 7, true>::launch(g);
    else if (g.N <= 416)
        TmaGemm<200, 1, 1, 1, 6, true>::launch(g);
    else
        TmaGemm<200, 2, 1, 1, 4, true>::launch(g);
}

// One launch of a configuration on fc1 and fc4 at M = 4096, then cuBLASLt on
// each, nothing else: for Nsight Compute.
void profile(const V8Config& c) {
    CublasLtLinear<bf16> baseline;
    for (int layer : {0, 3}) {
        LayerData<bf16> d(kLayers[layer], 1 + 10 * layer);
        const GemmArgs<bf16> a = d.args(kBatch);
        c.launch(a);
        baseline(a);
        cudaCheck(cudaDeviceSynchronize());
    }
}

int main(int argc, char** argv) {
    print_device_info();
    if (device_props().major != 9) {  // not a failure: this step is Hopper-only
        printf("gemm_v8: skipped, wgmma and TMA need an sm_90 GPU\n");
        return 0;
    }
    // --sweep: every configuration; --config NAME: that one only;
    // --profile NAME: one launch per big layer, no checks (for ncu).
    if (argc > 2 && strcmp(argv[1], "--profile") == 0) {
        for (const V8Config& c : kV8Configs)
            if (strcmp(argv[2], c.name) == 0) {
                profile(c);
                return 0;
            }
        fprintf(stderr, "no configuration named %s\n", argv[2]);
        return 1;
    }
    if (argc > 1 && (strcmp(argv[1], "--sweep") == 0 || (strcmp(argv[1], "--config") == 0 && argc > 2))) {
        bool ok = true, found = false;
        for (const V8Config& c : kV8Configs) {
            if (argc > 2 && strcmp(argv[2], c.name) != 0) continue;
            found = true;
            if (c.occupancy)
                for (int layer : {0, 3})
                    c.occupancy(c.name, {nullptr, nullptr, nullptr, nullptr, kBatch, kLayers[layer].N,
                                         kLayers[layer].K, kLayers[layer].act});
            ok = run_gemm_driver<bf16>((std::string("gemm_v8_") + c.name).c_str(), c.launch) && ok;
        }
        if (!found) fprintf(stderr, "no configuration named %s\n", argv[2]);
        return ok && found ? 0 : 1;
    }
    return run_gemm_driver<bf16>("gemm_v8", launch_gemm_v8) ? 0 : 1;
}
