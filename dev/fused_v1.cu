// Fused forward v1: the whole VAE (fc1, fc21+fc22, sampling + KL, fc3, fc4,
// BCE) in ONE launch.
//
// A block takes BM images through all four layers; the activations never
// leave shared memory:
//   x   [BM][784] bf16   the pixels (0..255 exact in bf16), read once from
//                        global; kept to the end for the BCE
//   h   [BM][400] bf16   h1, then h3 (h1 is dead once mu|logvar exist)
//   mulv [BM][40] fp32, z [BM][32] bf16 (K padded with zeros for the mma)
// Each layer is a block-wide GEMM with M = BM: every warp covers all BM rows
// and owns the n8 column tiles warp, warp + 8, ... (<= 7 of them: 400 and 392
// columns are 50 and 49 tiles), mma.sync m16n8k16 with fp32 accumulators; A
// comes from the activations in shared memory by ldmatrix, W streams from
// global (L2: the 1.3 MB of bf16 weights stay resident there) through a
// STAGES-deep cp.async ring of [rows][BK] slices. fc4 runs as two chunks of
// 392 columns and turns its accumulators straight into BCE terms.
//
// What it saves: the separate path (vae.cu's --precision bf16: fc1, latent
// block, fc4 + BCE epilogue, finalize) writes and re-reads h1 and h3 (1600
// bytes per image each way) and pays 4 launches with a drain between each.
// What it costs: every block streams ALL the weights, 1.31 MB, so L2 -> SM
// traffic is (B / BM) x 1.31 MB, versus ~4 reads of each weight tile per
// 128-row tile in the separate GEMMs; and a block per BM images leaves SMs
// idle at small B (B = 1024, BM = 32: 32 blocks for 132 SMs).
//
// Build and run:  make -C dev fused_v1 && ./dev/fused_v1
#include "common.h"

using namespace vae;

template <int BM_, int BK_, int STAGES_>
struct FusedConfig {
    static constexpr int BM = BM_, BK = BK_, STAGES = STAGES_;
    static constexpr int kWarps = 8, kThreads = 32 * kWarps;
    static constexpr int MT = BM / 16;
    static constexpr int kMaxNT = 7;           // n8 tiles per warp: 50 (N = 400) or 49 (N = 392) over 8 warps
    static constexpr int kMaxRows = kHidden;   // W rows per chunk: 400, 40, 400, 392
    static constexpr int kFc4Chunk = kIn / 2;  // 392
    // Row pitches (elements) whose byte size is 16 mod 128 or 80: the 8 rows
    // one ldmatrix reads fall into 8 distinct 16-byte bank groups.
    static constexpr int kWPitch = BK + 8, kXPitch = kIn + 8, kHPitch = kHidden + 8, kZPitch = kFc3KPad + 8;
    static constexpr size_t kStageBytes = size_t(kMaxRows) * kWPitch * 2;
    static constexpr size_t kRingOff = 0;
    static constexpr size_t kXOff = kRingOff + STAGES * kStageBytes;
    static constexpr size_t kHOff = kXOff + size_t(BM) * kXPitch * 2;
    static constexpr size_t kMulvOff = kHOff + size_t(BM) * kHPitch * 2;
    static constexpr size_t kZOff = kMulvOff + size_t(BM) * kMulv * 4;
    static constexpr size_t kBceOff = kZOff + size_t(BM) * kZPitch * 2;
    static constexpr size_t kSmemBytes = kBceOff + size_t(kWarps) * BM * 4;
    static_assert(BM % 16 == 0 && BK % 16 == 0 && STAGES >= 2, "whole mma tiles, a real pipeline");
    static_assert(kHidden / 8 <= kWarps * kMaxNT && kFc4Chunk / 8 <= kWarps * kMaxNT, "tiles fit the warps");
};

// acc[mt][i] = A[BM][K] (shared, bf16, row pitch a_pitch) x W[n0 .. n0+rows][K]^T
// for this warp's column tiles j = warp + 8 i. K % 16 == 0; W rows 16-byte aligned.
template <class C>
__device__ __forceinline__ void block_gemm(float (&acc)[C::MT][C::kMaxNT][4], unsigned a_smem, int a_pitch,
                                           const bf16* __restrict__ W, int K, int n0, int rows, unsigned ring) {
    constexpr int kChunksPerRow = C::BK / 8;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
        for (int i = 0; i < C::kMaxNT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][i][e] = 0.0f;

    const int num_k = ceil_div(K, C::BK);
    auto load = [&](int kt) {
        const unsigned stage = ring + unsigned((kt % C::STAGES) * C::kStageBytes);
        const int k0 = kt * C::BK;
        for (int c = threadIdx.x; c < rows * kChunksPerRow; c += C::kThreads) {
            const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
            const bool in = k0 + col < K;
            ptx::cp_async_16(stage + (r * C::kWPitch + col) * 2, in ? W + size_t(n0 + r) * K + k0 + col : W, in ? 16 : 0);
        }
    };
    for (int s = 0; s < C::STAGES - 1; ++s) {
        if (s < num_k) load(s);
        ptx::cp_async_commit();  // empty groups keep "group kt done" = wait<STAGES-2>
    }
    // ldmatrix lane addresses: A x4 = rows lane % 16, k half lane / 16;
    // B x2 = rows lane % 8, k half (lane / 8) % 2 (W is [n][k]: already col-major B)
    const unsigned a_lane = a_smem + ((lane % 16) * a_pitch + (lane / 16) * 8) * 2;
    const unsigned b_lane = ((lane % 8) * C::kWPitch + ((lane / 8) % 2) * 8) * 2;
    for (int kt = 0; kt < num_k; ++kt) {
        ptx::cp_async_wait<C::STAGES - 2>();
        __syncthreads();  // slice kt landed for all; everyone is done with slice kt-1's stage
        if (kt + C::STAGES - 1 < num_k) load(kt + C::STAGES - 1);
        ptx::cp_async_commit();
        const unsigned stage = ring + unsigned((kt % C::STAGES) * C::kStageBytes) + b_lane;
#pragma unroll
        for (int kk = 0; kk < C::BK; kk += 16) {
            const int k = kt * C::BK + kk;
            if (k >= K) break;
            unsigned a[C::MT][4];
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt) ptx::ldmatrix_x4(a[mt], a_lane + (mt * 16 * a_pitch + k) * 2);
#pragma unroll
            for (int i = 0; i < C::kMaxNT; ++i) {
                const int j = warp + C::kWarps * i;
                if (j * 8 >= rows) break;  // warp-uniform
                unsigned b[2];
                ptx::ldmatrix_x2(b, stage + (j * 8 * C::kWPitch + kk) * 2);
#pragma unroll
                for (int mt = 0; mt < C::MT; ++mt) ptx::mma_bf16_16816(acc[mt][i], a[mt], b);
            }
        }
    }
    ptx::cp_async_wait<0>();
    __syncthreads();  // the ring is free for the next layer
}

// f(mt, half, row, column in chunk, value at column, value at column + 1)
template <class C, typename F>
__device__ __forceinline__ void for_each_pair(const float (&acc)[C::MT][C::kMaxNT][4], int rows, F f) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < C::kMaxNT; ++i) {
        const int j = warp + C::kWarps * i;
        if (j * 8 >= rows) break;
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                f(mt, half, mt * 16 + g + 8 * half, j * 8 + 2 * t, acc[mt][i][2 * half], acc[mt][i][2 * half + 1]);
    }
}

__device__ __forceinline__ void store_bf16x2(bf16* p, float v0, float v1) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, 1)
    fused_forward_kernel(float* __restrict__ bce, float* __restrict__ kl, const uint8_t* __restrict__ pixels,
                         const bf16* fc1_w, const float* __restrict__ fc1_b, const bf16* enc_w,
                         const float* __restrict__ enc_b, const bf16* fc3_w, const float* __restrict__ fc3_b,
                         const bf16* fc4_w, const float* __restrict__ fc4_b, int B, uint32_t first_image,
                         uint64_t seed) {
    constexpr int BM = C::BM;
    extern __shared__ __align__(128) uint8_t smem[];
    bf16* x_s = reinterpret_cast<bf16*>(smem + C::kXOff);
    bf16* h_s = reinterpret_cast<bf16*>(smem + C::kHOff);
    float* mulv_s = reinterpret_cast<float*>(smem + C::kMulvOff);
    bf16* z_s = reinterpret_cast<bf16*>(smem + C::kZOff);
    float* bce_s = reinterpret_cast<float*>(smem + C::kBceOff);  // [warp][row]
    const unsigned ring = ptx::smem_addr(smem + C::kRingOff);
    const int row0 = blockIdx.x * BM, warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    // Pixels -> bf16, 16 per thread and step (784 = 49 x 16); rows past B are zeros.
    constexpr int kChunks = kIn / 16;
    for (int c = threadIdx.x; c < BM * kChunks; c += C::kThreads) {
        const int r = c / kChunks, col = (c % kChunks) * 16;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (row0 + r < B) v = __ldg(reinterpret_cast<const uint4*>(pixels + size_t(row0 + r) * kIn + col));
        const unsigned words[4] = {v.x, v.y, v.z, v.w};
        unsigned packed[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            const unsigned w = words[q / 2] >> (16 * (q % 2));
            const __nv_bfloat162 p = __floats2bfloat162_rn(float(w & 0xFF), float((w >> 8) & 0xFF));
            packed[q] = *reinterpret_cast<const unsigned*>(&p);
        }
        uint4* dst = reinterpret_cast<uint4*>(x_s + r * C::kXPitch + col);
        dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
    for (int i = threadIdx.x; i < C::kWarps * BM; i += C::kThreads) bce_s[i] = 0.0f;
    __syncthreads();

    float acc[C::MT][C::kMaxNT][4];
    // fc1: h1 = ReLU(x W1^T / 255 + b1)
    block_gemm<C>(acc, ptx::smem_addr(x_s), C::kXPitch, fc1_w, kIn, 0, kHidden, ring);
    for_each_pair<C>(acc, kHidden, [&](int, int, int r, int c, float v0, float v1) {
        store_bf16x2(h_s + r * C::kHPitch + c, fmaxf(v0 * (1.0f / 255.0f) + fc1_b[c], 0.0f),
                     fmaxf(v1 * (1.0f / 255.0f) + fc1_b[c + 1], 0.0f));
    });
    __syncthreads();

    // fc21 + fc22: [mu | logvar] = h1 Wenc^T + benc (5 column tiles: warps 0-4)
    block_gemm<C>(acc, ptx::smem_addr(h_s), C::kHPitch, enc_w, kHidden, 0, kMulv, ring);
    for_each_pair<C>(acc, kMulv, [&](int, int, int r, int c, float v0, float v1) {
        mulv_s[r * kMulv + c] = v0 + enc_b[c];
        mulv_s[r * kMulv + c + 1] = v1 + enc_b[c + 1];
    });
    __syncthreads();

    // z = mu + eps sigma and the KL, one warp per image; z's K padding (lanes 20-31) is zero
    for (int r = warp; r < BM; r += C::kWarps) {
        const int b = row0 + r;
        float z = 0.0f;
        if (b < B) {  // warp-uniform
            const LatentSample s = sample_latent(mulv_s + r * kMulv, lane, first_image + b, seed);
            z = s.z;
            if (lane == 0) kl[b] = s.kl;
        }
        z_s[r * C::kZPitch + lane] = __float2bfloat16(z);
    }
    __syncthreads();

    // fc3: h3 = ReLU(z W3^T + b3), over h1
    block_gemm<C>(acc, ptx::smem_addr(z_s), C::kZPitch, fc3_w, kFc3KPad, 0, kHidden, ring);
    for_each_pair<C>(acc, kHidden, [&](int, int, int r, int c, float v0, float v1) {
        store_bf16x2(h_s + r * C::kHPitch + c, fmaxf(v0 + fc3_b[c], 0.0f), fmaxf(v1 + fc3_b[c + 1], 0.0f));
    });
    __syncthreads();

    // fc4 + BCE, two chunks of 392 pixels; the logits never leave the registers
    for (int chunk = 0; chunk < 2; ++chunk) {
        const int n0 = chunk * C::kFc4Chunk;
        block_gemm<C>(acc, ptx::smem_addr(h_s), C::kHPitch, fc4_w, kHidden, n0, C::kFc4Chunk, ring);
        float sums[C::MT][2] = {};
        for_each_pair<C>(acc, C::kFc4Chunk, [&](int mt, int half, int r, int c, float v0, float v1) {
            const int n = n0 + c;
            const __nv_bfloat162 px = *reinterpret_cast<const __nv_bfloat162*>(x_s + r * C::kXPitch + n);
            sums[mt][half] += bce_term(v0 + fc4_b[n], __low2float(px) / 255.0f) +
                              bce_term(v1 + fc4_b[n + 1], __high2float(px) / 255.0f);
        });
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float v = sums[mt][half];
                v += __shfl_xor_sync(0xffffffffu, v, 1);  // the 4 lanes of a quad share a row
                v += __shfl_xor_sync(0xffffffffu, v, 2);
                if (lane % 4 == 0) bce_s[warp * BM + mt * 16 + lane / 4 + 8 * half] += v;  // own slot: no race
            }
    }
    __syncthreads();
    for (int r = threadIdx.x; r < BM; r += C::kThreads) {
        if (row0 + r >= B) break;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < C::kWarps; ++w) total += bce_s[w * BM + r];  // fixed order: reproducible
        bce[row0 + r] = total;
    }
}

template <class C>
void launch_fused(float* bce, float* kl, const uint8_t* pixels, const DeviceModel& w, int B, uint32_t first_image,
                  uint64_t seed) {
    static const bool once = (allow_smem(fused_forward_kernel<C>, C::kSmemBytes), true);
    (void)once;
    fused_forward_kernel<C><<<ceil_div(B, C::BM), C::kThreads, C::kSmemBytes>>>(
        bce, kl, pixels, w.fc1_w, w.fc1_b, w.enc_w, w.enc_b, w.fc3_w, w.fc3_b, w.fc4_w, w.fc4_b, B, first_image, seed);
    cudaCheck(cudaGetLastError());
}

#define FUSED_VARIANT(name, bm, bk, st)                                                              \
    FusedVariant {                                                                                     \
        name, [&w](float* bce, float* kl, const uint8_t* px, int B, uint32_t first, uint64_t seed) {  \
            launch_fused<FusedConfig<bm, bk, st>>(bce, kl, px, w, B, first, seed);                    \
        },                                                                                             \
            bm, FusedConfig<bm, bk, st>::kSmemBytes                                                    \
    }

int main() {
    print_device_info();
    const HostModel model = load_model();
    const DeviceModel w(model);
    // The first is fused_v1 proper; the others vary the W slice depth and the image tile.
    const std::vector<FusedVariant> variants = {
        FUSED_VARIANT("fused_v1_bm32_bk32_s3", 32, 32, 3),
        FUSED_VARIANT("fused_v1_bm32_bk64_s2", 32, 64, 2),
        FUSED_VARIANT("fused_v1_bm32_bk16_s4", 32, 16, 4),
        FUSED_VARIANT("fused_v1_bm16_bk32_s3", 16, 32, 3),
    };
    return run_fused_driver(model, w, variants) ? 0 : 1;
}
