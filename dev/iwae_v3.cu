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

// Sampling + fc3: common.h's iwae_latent_kernel, as in v2.
constexpr int kMergeWarps = 4;

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
