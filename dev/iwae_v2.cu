// IWAE v2: vae.cu's design, three kernels per pass, no logits in memory.
//
//   1. sampling + fc3 in one block: 64 rows' z go straight into a bf16 tile in
//      shared memory (with each row's log p(z) - log q(z|x)), and the block's
//      4 warps multiply it by fc3 (staged in shared memory once per block) on
//      the tensor cores; only h3 (bf16) is written. z never reaches memory.
//   2. fc4 with the BCE in its epilogue (common.h's fc4_bce_bf16_kernel with
//      the pixel row of image r / K): the logits stay in registers; each of
//      the 7 column blocks writes one partial per row.
//   3. one warp per image adds each row's 7 partials in a fixed order (the
//      finalize that vae.cu runs as its own kernel) and folds the K
//      log-weights into a running logsumexp.
// Against v1: the 205 MB of fp32 logits per pass are never written nor read,
// and z's round trip and two launches are gone.
//
// Build and run:  make -C dev iwae_v2 && ./dev/iwae_v2
#include "common.h"

using namespace vae;

constexpr int kLseWarps = 4;
// Sampling + fc3: common.h's iwae_latent_kernel; fc4 + BCE: common.h's fc4_bce_bf16_kernel, row r
// against the pixels of image r / K.

// log_px[i]: row BCE = its 7 partials in a fixed order, log w = log_ratio - BCE,
// a running logsumexp per lane, then a shuffle tree.
__global__ void __launch_bounds__(kLseWarps * 32)
    iwae_logsumexp_kernel(float* __restrict__ log_px, const float* __restrict__ bce_partial,
                          const float* __restrict__ log_ratio, int images, int K) {
    const int image = blockIdx.x * kLseWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (image >= images) return;
    float m = -INFINITY, s = 0.0f;
    for (int k = lane; k < K; k += 32) {
        const size_t r = size_t(image) * K + k;
        float bce = 0.0f;
#pragma unroll
        for (int j = 0; j < kFc4ColBlocks; j++) bce += bce_partial[r * kFc4ColBlocks + j];
        logsumexp_merge(m, s, log_ratio[r] - bce, 1.0f);
    }
    for (int offset = 16; offset > 0; offset /= 2)
        logsumexp_merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    if (lane == 0) log_px[image] = m + logf(s) - logf(float(K));
}

struct Scratch {
    bf16* h3 = nullptr;
    float *partial = nullptr, *log_ratio = nullptr;
};

void iwae_v2(const Scratch& s, const DeviceModel& w, const IwaeArgs& a) {
    static const bool once = (allow_smem(fc4_bce_bf16_kernel, sizeof(Fc4Tile::Smem)), true);
    (void)once;
    for_each_iwae_pass(a, [&](int first, int images) {
        const int rows = images * a.K;
        iwae_latent_kernel<<<ceil_div(rows, kLatentRows), kLatentWarps * 32>>>(
            s.h3, s.log_ratio, a.mulv + size_t(first) * kMulv, w.fc3_w, w.fc3_b, rows, a.K, a.first_image + first,
            a.seed);
        cudaCheck(cudaGetLastError());
        fc4_bce_bf16_kernel<<<dim3(kFc4ColBlocks, ceil_div(rows, Fc4Tile::BM)), Fc4Tile::THREADS, sizeof(Fc4Tile::Smem)>>>(
            s.partial, s.h3, w.fc4_w, w.fc4_b, a.pixels + size_t(first) * kIn, rows, a.K);
        cudaCheck(cudaGetLastError());
        iwae_logsumexp_kernel<<<ceil_div(images, kLseWarps), kLseWarps * 32>>>(a.log_px + first, s.partial, s.log_ratio,
                                                                               images, a.K);
        cudaCheck(cudaGetLastError());
    });
}

int main() {
    print_device_info();
    const HostModel model = load_model();
    const DeviceModel w(model);
    Scratch s;
    const size_t rows = kIwaeMaxRows;
    cudaCheck(cudaMalloc(&s.h3, rows * kHidden * sizeof(bf16)));
    cudaCheck(cudaMalloc(&s.partial, rows * kFc4ColBlocks * sizeof(float)));
    cudaCheck(cudaMalloc(&s.log_ratio, rows * sizeof(float)));
    const bool ok = run_iwae_driver(model, w, {{"iwae_v2_fused_3_kernels", [&](const IwaeArgs& a) { iwae_v2(s, w, a); }}});
    for (void* p : std::initializer_list<void*>{s.h3, s.partial, s.log_ratio}) cudaCheck(cudaFree(p));
    return ok ? 0 : 1;
}
