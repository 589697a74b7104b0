// IWAE v3: the logsumexp folded into the fc4 epilogue.
//
// v2's fc4 splits each row's 784 pixels over 7 column blocks, so no block
// sees a whole row's BCE and a separate kernel must add the partials before
// the logsumexp. Here one block owns 128 whole rows: it runs the mma mainloop
// over the 7 column slices in turn (acc reset per slice, the BCE terms summed
// in registers across them), reduces each row's BCE, forms its log-weight
// log_ratio - BCE and, since the K rows of an image are contiguous, folds the
// rows of each image it touches into one running (max, sum of exp) pair:
// one pair per (block, image) leaves the block instead of 7 floats per row. A
// tiny kernel merges the ~K / 128 pairs of each image in a fixed order.
//
// Sampling + fc3 is v2's kernel. The per-row traffic saved is small (7
// partials read and written); the question is what the 7x fewer, 7x longer
// fc4 blocks cost (one row tile now waits on 7 column slices in sequence).
//
// Build and run:  make -C dev iwae_v3 && ./dev/iwae_v3
#include "common.h"

using namespace vae;

// Sampling + fc3: v2's kernel, unchanged.
constexpr int kLatentRows = 64, kLatentWarps = kLatentRows / 16, kMergeWarps = 4;
constexpr int kZPitch = kFc3KPad + 8;  // 80-byte rows: a fragment's 8 rows hit 8 different banks

// h3[r] = ReLU(z_r W3^T + b3) in bf16 and log_ratio[r] for 64 rows per block;
// mulv starts at the pass's first image.
__global__ void __launch_bounds__(kLatentWarps * 32)
    iwae_latent_kernel(bf16* __restrict__ h3, float* __restrict__ log_ratio, const float* __restrict__ mulv,
                       const bf16* __restrict__ fc3_w_padded, const float* __restrict__ fc3_b, int rows, int K,
                       uint32_t first_image, uint64_t seed) {
    constexpr int GROUPS = kLatent / 4, PAD_GROUPS = kFc3KPad / 4;
    __shared__ __align__(16) bf16 w3[kHidden][kZPitch];
    __shared__ __align__(16) bf16 z_tile[kLatentRows][kZPitch];
    __shared__ float ratio_terms[kLatentRows][GROUPS];
    const int row0 = blockIdx.x * kLatentRows, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4,
              t = lane % 4;

    for (int c = threadIdx.x; c < kHidden * kFc3KPad / 8; c += blockDim.x) {  // 16-byte chunks, async
        const int n = c / (kFc3KPad / 8), k = (c % (kFc3KPad / 8)) * 8;
        ptx::cp_async_16(ptx::smem_addr(&w3[n][k]), fc3_w_padded + size_t(n) * kFc3KPad + k, 16);
    }
    ptx::cp_async_commit();
    // z while the weights arrive: one Philox call per (row, group of 4 latents);
    // rows past `rows` and the K padding are zeros
    for (int i = threadIdx.x; i < kLatentRows * PAD_GROUPS; i += blockDim.x) {
        const int r = i / PAD_GROUPS, q = i % PAD_GROUPS, row = row0 + r;
        float z[4] = {};
        if (q < GROUPS && row < rows) {
            const int image = row / K;
            ratio_terms[r][q] = iwae_sample_group(z, mulv + size_t(image) * kMulv, q, first_image + image, row % K, seed);
        }
        *reinterpret_cast<__nv_bfloat162*>(&z_tile[r][4 * q]) = __floats2bfloat162_rn(z[0], z[1]);
        *reinterpret_cast<__nv_bfloat162*>(&z_tile[r][4 * q + 2]) = __floats2bfloat162_rn(z[2], z[3]);
    }
    ptx::cp_async_wait<0>();
    __syncthreads();
    if (threadIdx.x < kLatentRows && row0 + int(threadIdx.x) < rows) {
        float ratio = 0.0f;
#pragma unroll
        for (int q = 0; q < GROUPS; q++) ratio += ratio_terms[threadIdx.x][q];
        log_ratio[row0 + threadIdx.x] = ratio;
    }

    // fc3: warp w owns rows 16w .. 16w + 15, all 400 outputs as 50 mma tiles
    unsigned a[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        const bf16* top = &z_tile[warp * 16 + g][kk * 16 + 2 * t];
        const bf16* bottom = top + 8 * kZPitch;
        a[kk][0] = bf16x2_at(top), a[kk][1] = bf16x2_at(bottom), a[kk][2] = bf16x2_at(top + 8),
        a[kk][3] = bf16x2_at(bottom + 8);
    }
    const int r_top = row0 + warp * 16 + g;
#pragma unroll 5
    for (int nt = 0; nt < kHidden / 8; nt++) {
        float acc[4] = {};
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const bf16* wp = &w3[nt * 8 + g][kk * 16 + 2 * t];
            const unsigned b[2] = {bf16x2_at(wp), bf16x2_at(wp + 8)};
            ptx::mma_bf16_16816(acc, a[kk], b);
        }
        const int c = nt * 8 + 2 * t;
        const float b0 = fc3_b[c], b1 = fc3_b[c + 1];
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = r_top + 8 * half;
            if (r >= rows) continue;
            *reinterpret_cast<__nv_bfloat162*>(&h3[size_t(r) * kHidden + c]) =
                __floats2bfloat162_rn(fmaxf(acc[2 * half] + b0, 0.0f), fmaxf(acc[2 * half + 1] + b1, 0.0f));
        }
    }
}

// Images a block of 128 rows can touch: 128 when K = 1.
constexpr int kSlots = Fc4Tile::BM;

// fc4 over whole rows + BCE + per-image running logsumexp of the block's rows:
// lse_part[block][s] = (max, sum of exp) of the log-weights of image
// row0 / K + s within this block. kFastBce: the BCE term through __expf /
// __logf (common.h's bce_term_fast; iwae_v4) instead of expf + log1pf.
template <bool kFastBce>
__global__ void __launch_bounds__(Fc4Tile::THREADS)
    iwae_fc4_lse_kernel(float2* __restrict__ lse_part, const bf16* __restrict__ h3, const bf16* __restrict__ W,
                        const float* __restrict__ bias, const uint8_t* __restrict__ pixels,
                        const float* __restrict__ log_ratio, int M, int K) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    Fc4Tile::Smem& sm = *reinterpret_cast<Fc4Tile::Smem*>(smem_raw);
    __shared__ float row_sums[Fc4Tile::WARPS_N][Fc4Tile::BM];
    __shared__ float log_w[Fc4Tile::BM];
    const int row0 = blockIdx.x * Fc4Tile::BM, warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    float sums[Fc4Tile::MT][2] = {};
    for (int col0 = 0; col0 < kIn; col0 += Fc4Tile::BN) {
        float acc[Fc4Tile::MT][Fc4Tile::NT][4] = {};
        mma_mainloop<Fc4Tile>(acc, sm, h3, W, M, kIn, kHidden, row0, col0);  // ends with a barrier: smem reusable
        for_each_acc_pair<Fc4Tile>(acc, [&](int mt, int half, int r, int c, float v0, float v1) {
            r += row0, c += col0;
            if (r >= M) return;
            const uint8_t* x = pixels + size_t(r / K) * kIn + c;
            if constexpr (kFastBce)
                sums[mt][half] += bce_term_fast(v0 + bias[c], x[0] / 255.0f) + bce_term_fast(v1 + bias[c + 1], x[1] / 255.0f);
            else
                sums[mt][half] += bce_term(v0 + bias[c], x[0] / 255.0f) + bce_term(v1 + bias[c + 1], x[1] / 255.0f);
        });
    }
#pragma unroll
    for (int mt = 0; mt < Fc4Tile::MT; mt++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            float v = sums[mt][half];
            v += __shfl_xor_sync(0xffffffffu, v, 1);  // the 4 lanes of a quad share rows
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (lane % 4 == 0)
                row_sums[warp % Fc4Tile::WARPS_N][(warp / Fc4Tile::WARPS_N) * Fc4Tile::MT * 16 + mt * 16 + lane / 4 + 8 * half] = v;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < Fc4Tile::BM; i += Fc4Tile::THREADS) {
        float bce = 0.0f;
#pragma unroll
        for (int w = 0; w < Fc4Tile::WARPS_N; w++) bce += row_sums[w][i];
        log_w[i] = row0 + i < M ? log_ratio[row0 + i] - bce : -INFINITY;
    }
    __syncthreads();
    // one warp per image slot; lanes stride over the image's rows in this block
    const int row_end = min(row0 + Fc4Tile::BM, M), image0 = row0 / K, slots = (row_end - 1) / K - image0 + 1;
    for (int s = warp; s < slots; s += Fc4Tile::THREADS / 32) {
        const int image = image0 + s, begin = max(image * K, row0) - row0, end = min((image + 1) * K, row_end) - row0;
        float m = -INFINITY, sum = 0.0f;
        for (int i = begin + lane; i < end; i += 32) logsumexp_merge(m, sum, log_w[i], 1.0f);
        for (int offset = 16; offset > 0; offset /= 2)
            logsumexp_merge(m, sum, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, sum, offset));
        if (lane == 0) lse_part[size_t(blockIdx.x) * kSlots + s] = make_float2(m, sum);
    }
}

// log_px[i] from the pairs of the blocks that hold image i's rows, merged
// lane-strided then by a shuffle tree: the same order on every run.
__global__ void __launch_bounds__(kMergeWarps * 32)
    iwae_lse_merge_kernel(float* __restrict__ log_px, const float2* __restrict__ lse_part, int images, int K) {
    const int image = blockIdx.x * kMergeWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (image >= images) return;
    const int first_block = image * K / Fc4Tile::BM, last_block = ((image + 1) * K - 1) / Fc4Tile::BM;
    float m = -INFINITY, s = 0.0f;
    for (int b = first_block + lane; b <= last_block; b += 32) {
        const float2 p = lse_part[size_t(b) * kSlots + image - b * Fc4Tile::BM / K];
        logsumexp_merge(m, s, p.x, p.y);
    }
    for (int offset = 16; offset > 0; offset /= 2)
        logsumexp_merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    if (lane == 0) log_px[image] = m + logf(s) - logf(float(K));
}

struct Scratch {
    bf16* h3 = nullptr;
    float* log_ratio = nullptr;
    float2* lse_part = nullptr;
};

template <bool kFastBce>
void iwae_v3(const Scratch& s, const DeviceModel& w, const IwaeArgs& a) {
    static const bool once = (allow_smem(iwae_fc4_lse_kernel<kFastBce>, sizeof(Fc4Tile::Smem)), true);
    (void)once;
    for_each_iwae_pass(a, [&](int first, int images) {
        const int rows = images * a.K;
        iwae_latent_kernel<<<ceil_div(rows, kLatentRows), kLatentWarps * 32>>>(
            s.h3, s.log_ratio, a.mulv + size_t(first) * kMulv, w.fc3_w, w.fc3_b, rows, a.K, a.first_image + first,
            a.seed);
        cudaCheck(cudaGetLastError());
        iwae_fc4_lse_kernel<kFastBce><<<ceil_div(rows, Fc4Tile::BM), Fc4Tile::THREADS, sizeof(Fc4Tile::Smem)>>>(
            s.lse_part, s.h3, w.fc4_w, w.fc4_b, a.pixels + size_t(first) * kIn, s.log_ratio, rows, a.K);
        cudaCheck(cudaGetLastError());
        iwae_lse_merge_kernel<<<ceil_div(images, kMergeWarps), kMergeWarps * 32>>>(a.log_px + first, s.lse_part,
                                                                                   images, a.K);
        cudaCheck(cudaGetLastError());
    });
}

int main() {
    print_device_info();
    const HostModel model = load_model();
    const DeviceModel w(model);
    Scratch s;
    const size_t rows = kIwaeMaxRows, blocks = ceil_div<size_t>(rows, Fc4Tile::BM);
    cudaCheck(cudaMalloc(&s.h3, rows * kHidden * sizeof(bf16)));
    cudaCheck(cudaMalloc(&s.log_ratio, rows * sizeof(float)));
    cudaCheck(cudaMalloc(&s.lse_part, blocks * kSlots * sizeof(float2)));
    const bool ok = run_iwae_driver(model, w, {{"iwae_v3_lse_in_fc4", [&](const IwaeArgs& a) { iwae_v3<false>(s, w, a); }}});
    for (void* p : std::initializer_list<void*>{s.h3, s.log_ratio, s.lse_part}) cudaCheck(cudaFree(p));
    return ok ? 0 : 1;
}
