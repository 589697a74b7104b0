// IWAE v1: the importance-weighted log-likelihood as five separate kernels.
//
// log p(x) ~ logsumexp_k [log p(x|z_k) + log p(z_k) - log q(z_k|x)] - log K.
// The K samples of an image are K consecutive decoder rows. Per pass of up to
// 65536 rows:
//   1. sampling: one thread per row draws eps (vae.cu's gaussian4), writes z
//      as bf16 [rows][32] (K of fc3 zero-padded) and log p(z) - log q(z|x);
//   2. fc3 GEMM (common.h's mma.sync tile, ReLU) writes h3 in bf16;
//   3. fc4 GEMM writes the rows x 784 logits in fp32;
//   4. one warp per row reads them back and sums the BCE;
//   5. one warp per image folds its K log-weights into a running logsumexp.
// The baseline: every intermediate goes through memory, the logits most of
// all (205 MB written and read again per pass).
//
// Build and run:  make -C dev iwae_v1 && ./dev/iwae_v1
#include "common.h"

using namespace vae;

constexpr int kSampleThreads = 128, kRowWarps = 8, kLseWarps = 4;

// z[r][0..31] (20 latents, then zeros) and log_ratio[r] for rows of images
// first_image.., K rows per image; mulv starts at the pass's first image.
__global__ void iwae_sample_kernel(bf16* __restrict__ z, float* __restrict__ log_ratio, const float* __restrict__ mulv,
                                   int rows, int K, uint32_t first_image, uint64_t seed) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const int image = r / K;
    uint2* out = reinterpret_cast<uint2*>(z + size_t(r) * kFc3KPad);  // 4 bf16 per store
    float ratio = 0.0f;
#pragma unroll
    for (int q = 0; q < kLatent / 4; q++) {
        float zq[4];
        ratio += iwae_sample_group(zq, mulv + size_t(image) * kMulv, q, first_image + image, r % K, seed);
        const __nv_bfloat162 lo = __floats2bfloat162_rn(zq[0], zq[1]), hi = __floats2bfloat162_rn(zq[2], zq[3]);
        out[q] = make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
    }
#pragma unroll
    for (int q = kLatent / 4; q < kFc3KPad / 4; q++) out[q] = make_uint2(0u, 0u);
    log_ratio[r] = ratio;
}

// bce[r] = sum over 784 pixels of BCE(logits[r], pixels of image r / K).
__global__ void __launch_bounds__(kRowWarps * 32)
    iwae_bce_rows_kernel(float* __restrict__ bce, const float* __restrict__ logits, const uint8_t* __restrict__ pixels,
                         int rows, int K) {
    const int r = blockIdx.x * kRowWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= rows) return;  // whole warps leave together
    const float4* l = reinterpret_cast<const float4*>(logits + size_t(r) * kIn);
    const uchar4* x = reinterpret_cast<const uchar4*>(pixels + size_t(r / K) * kIn);
    float sum = 0.0f;
    for (int i = lane; i < kIn / 4; i += 32) {
        const float4 lv = l[i];
        const uchar4 xv = x[i];
        sum += bce_term(lv.x, xv.x / 255.0f) + bce_term(lv.y, xv.y / 255.0f) + bce_term(lv.z, xv.z / 255.0f) +
               bce_term(lv.w, xv.w / 255.0f);
    }
    sum = warp_sum(sum);
    if (lane == 0) bce[r] = sum;
}

// log_px[i] from the K log-weights log_ratio - bce of image i: lanes take
// k = lane, lane + 32, ..., merged by a shuffle tree in a fixed order.
__global__ void __launch_bounds__(kLseWarps * 32)
    iwae_logsumexp_kernel(float* __restrict__ log_px, const float* __restrict__ bce,
                          const float* __restrict__ log_ratio, int images, int K) {
    const int image = blockIdx.x * kLseWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (image >= images) return;
    float m = -INFINITY, s = 0.0f;
    for (int k = lane; k < K; k += 32) {
        const size_t r = size_t(image) * K + k;
        logsumexp_merge(m, s, log_ratio[r] - bce[r], 1.0f);
    }
    for (int offset = 16; offset > 0; offset /= 2)
        logsumexp_merge(m, s, __shfl_xor_sync(0xffffffffu, m, offset), __shfl_xor_sync(0xffffffffu, s, offset));
    if (lane == 0) log_px[image] = m + logf(s) - logf(float(K));
}

using Fc3Tile = MmaTile<bf16, 4, 2, 2, 5>;  // 128 rows x 80 hidden units, K = 32 in one slice

struct Scratch {
    bf16 *z = nullptr, *h3 = nullptr;
    float *logits = nullptr, *bce = nullptr, *log_ratio = nullptr;
};

void iwae_v1(const Scratch& s, const DeviceModel& w, const IwaeArgs& a) {
    static const bool once = (allow_smem(linear_bf16_kernel<Fc3Tile, true, bf16>, sizeof(Fc3Tile::Smem)),
                              allow_smem(linear_bf16_kernel<Fc4Tile, false, float>, sizeof(Fc4Tile::Smem)), true);
    (void)once;
    for_each_iwae_pass(a, [&](int first, int images) {
        const int rows = images * a.K;
        const uint8_t* x = a.pixels + size_t(first) * kIn;
        iwae_sample_kernel<<<ceil_div(rows, kSampleThreads), kSampleThreads>>>(
            s.z, s.log_ratio, a.mulv + size_t(first) * kMulv, rows, a.K, a.first_image + first, a.seed);
        cudaCheck(cudaGetLastError());
        linear_bf16_kernel<Fc3Tile, true, bf16>
            <<<dim3(kHidden / Fc3Tile::BN, ceil_div(rows, Fc3Tile::BM)), Fc3Tile::THREADS, sizeof(Fc3Tile::Smem)>>>(
                s.h3, s.z, w.fc3_w, w.fc3_b, rows, kHidden, kFc3KPad, 1.0f);
        cudaCheck(cudaGetLastError());
        linear_bf16_kernel<Fc4Tile, false, float>
            <<<dim3(kFc4ColBlocks, ceil_div(rows, Fc4Tile::BM)), Fc4Tile::THREADS, sizeof(Fc4Tile::Smem)>>>(
                s.logits, s.h3, w.fc4_w, w.fc4_b, rows, kIn, kHidden, 1.0f);
        cudaCheck(cudaGetLastError());
        iwae_bce_rows_kernel<<<ceil_div(rows, kRowWarps), kRowWarps * 32>>>(s.bce, s.logits, x, rows, a.K);
        cudaCheck(cudaGetLastError());
        iwae_logsumexp_kernel<<<ceil_div(images, kLseWarps), kLseWarps * 32>>>(a.log_px + first, s.bce, s.log_ratio,
                                                                               images, a.K);
        cudaCheck(cudaGetLastError());
    });
}

int main() {
    print_device_info();
    static_assert(kHidden % Fc3Tile::BN == 0, "fc3 column blocks tile the 400 hidden units exactly");
    const HostModel model = load_model();
    const DeviceModel w(model);
    Scratch s;
    const size_t rows = kIwaeMaxRows;
    cudaCheck(cudaMalloc(&s.z, rows * kFc3KPad * sizeof(bf16)));
    cudaCheck(cudaMalloc(&s.h3, rows * kHidden * sizeof(bf16)));
    cudaCheck(cudaMalloc(&s.logits, rows * kIn * sizeof(float)));
    cudaCheck(cudaMalloc(&s.bce, rows * sizeof(float)));
    cudaCheck(cudaMalloc(&s.log_ratio, rows * sizeof(float)));
    const bool ok = run_iwae_driver(model, w, {{"iwae_v1_5_kernels", [&](const IwaeArgs& a) { iwae_v1(s, w, a); }}});
    if (ok && !getenv("VAE_CHECK_ONLY")) {
        // One pass at K = 5000, each kernel alone (the benchmark helper: cold L2, median of 200).
        constexpr int K = 5000, images = kIwaeMaxRows / K, M = images * K;
        const std::vector<uint8_t> pixels = load_pixels(images);
        std::vector<float> mulv(size_t(images) * kMulv);
        fill_random(mulv, 5, 1.0f);  // |mu| <= 1, sigma in 0.6..1.6: the shape of the work is all that matters here
        uint8_t* d_pixels = device_upload(pixels);
        float *d_mulv = device_upload(mulv), *d_log_px;
        cudaCheck(cudaMalloc(&d_log_px, images * sizeof(float)));
        const float t_sample = benchmark_us([&] {
            iwae_sample_kernel<<<ceil_div(M, kSampleThreads), kSampleThreads>>>(s.z, s.log_ratio, d_mulv, M, K, 0, 42);
        });
        const float t_fc3 = benchmark_us([&] {
            linear_bf16_kernel<Fc3Tile, true, bf16>
                <<<dim3(kHidden / Fc3Tile::BN, ceil_div(M, Fc3Tile::BM)), Fc3Tile::THREADS, sizeof(Fc3Tile::Smem)>>>(
                    s.h3, s.z, w.fc3_w, w.fc3_b, M, kHidden, kFc3KPad, 1.0f);
        });
        const float t_fc4 = benchmark_us([&] {
            linear_bf16_kernel<Fc4Tile, false, float>
                <<<dim3(kFc4ColBlocks, ceil_div(M, Fc4Tile::BM)), Fc4Tile::THREADS, sizeof(Fc4Tile::Smem)>>>(
                    s.logits, s.h3, w.fc4_w, w.fc4_b, M, kIn, kHidden, 1.0f);
        });
        const float t_bce = benchmark_us([&] {
            iwae_bce_rows_kernel<<<ceil_div(M, kRowWarps), kRowWarps * 32>>>(s.bce, s.logits, d_pixels, M, K);
        });
        const float t_lse = benchmark_us([&] {
            iwae_logsumexp_kernel<<<ceil_div(images, kLseWarps), kLseWarps * 32>>>(d_log_px, s.bce, s.log_ratio, images, K);
        });
        cudaCheck(cudaGetLastError());
        printf("one pass, %d rows (K = %d), each kernel alone:\n", M, K);
        print_mem_row("  sampling, bf16 z out", "65000 rows", t_sample, double(M) * (kFc3KPad * 2 + 4));
        print_flop_row("  fc3 GEMM", "65000 rows", t_fc3, gemm_flops(M, kHidden, kLatent));
        print_flop_row("  fc4 GEMM, fp32 logits out", "65000 rows", t_fc4, gemm_flops(M, kIn, kHidden));
        print_mem_row("  BCE per row (expf, log1pf)", "65000 rows", t_bce, double(M) * (kIn * 4 + 4));
        printf("|   logsumexp per image | 65000 rows | %.2f | | | |\n", t_lse);
        for (void* p : std::initializer_list<void*>{d_pixels, d_mulv, d_log_px}) cudaCheck(cudaFree(p));
    }
    for (void* p : std::initializer_list<void*>{s.z, s.h3, s.logits, s.bce, s.log_ratio}) cudaCheck(cudaFree(p));
    return ok ? 0 : 1;
}
