// IWAE v4: v3 with the BCE term on the fast hardware exp2 / log2.
//
// v1..v3 showed the unfused v1 (logits through memory) beating v2, which
// keeps them in registers. The BCE term with expf + log1pf is ~100
// instructions; 3.9e10 of them are ~1.2e11 warp instructions, ~115 ms of the
// whole H200's issue slots at K = 5000 over the test set. In v1 that work
// sits in a separate kernel; in v2 / v3 it runs in fc4's epilogue, on the
// same warps as the mma mainloop, and adds to it. common.h's bce_term_fast
// (__expf, __logf: ~15 instructions, <= ~1e-6 absolute per pixel) cuts it
// ~6x. Everything else is v3's code (included below).
//
// Measured on an H200: 373 ms against v3's 409. The fast term saves 45 of the
// fused kernel's 485 us per pass, but the fused kernel still takes 200 us more
// than fc4 with a plain epilogue. The rest of the epilogue's cost is elsewhere
// (dev/README.md, IWAE).
//
// After the driver, one pass (13 images x 5000 = 65000 rows) is timed kernel
// by kernel to show where the time goes.
//
// Build and run:  make -C dev iwae_v4 && ./dev/iwae_v4
#define main iwae_v3_main
#include "iwae_v3.cu"
#undef main

int main() {
    print_device_info();
    const HostModel model = load_model();
    const DeviceModel w(model);
    Scratch s;
    const size_t rows = kIwaeMaxRows, blocks = ceil_div<size_t>(rows, Fc4Tile::BM);
    cudaCheck(cudaMalloc(&s.h3, rows * kHidden * sizeof(bf16)));
    cudaCheck(cudaMalloc(&s.log_ratio, rows * sizeof(float)));
    cudaCheck(cudaMalloc(&s.lse_part, blocks * kSlots * sizeof(float2)));
    bool ok = run_iwae_driver(model, w, {{"iwae_v4_lse_in_fc4_fast_bce", [&](const IwaeArgs& a) { iwae_v3<true>(s, w, a); }}});

    if (ok && !getenv("VAE_CHECK_ONLY")) {
        // One pass at K = 5000, each kernel alone (the benchmark helper: cold L2, median of 200).
        constexpr int K = 5000, images = kIwaeMaxRows / K, M = images * K;
        const std::vector<uint8_t> pixels = load_pixels(images);
        std::vector<float> mulv(size_t(images) * kMulv);
        fill_random(mulv, 5, 1.0f);  // |mu| <= 1, sigma in 0.6..1.6: the shape of the work is all that matters here
        uint8_t* d_pixels = device_upload(pixels);
        float *d_mulv = device_upload(mulv), *d_logits, *d_log_px;
        cudaCheck(cudaMalloc(&d_logits, size_t(M) * kIn * sizeof(float)));
        cudaCheck(cudaMalloc(&d_log_px, images * sizeof(float)));
        allow_smem(linear_bf16_kernel<Fc4Tile, false, float>, sizeof(Fc4Tile::Smem));
        allow_smem(iwae_fc4_lse_kernel<false>, sizeof(Fc4Tile::Smem));
        allow_smem(iwae_fc4_lse_kernel<true>, sizeof(Fc4Tile::Smem));
        const float t_latent = benchmark_us([&] {
            iwae_latent_kernel<<<ceil_div(M, kLatentRows), kLatentWarps * 32>>>(s.h3, s.log_ratio, d_mulv, w.fc3_w,
                                                                               w.fc3_b, M, K, 0, 42);
        });
        const float t_gemm = benchmark_us([&] {
            linear_bf16_kernel<Fc4Tile, false, float>
                <<<dim3(kFc4ColBlocks, ceil_div(M, Fc4Tile::BM)), Fc4Tile::THREADS, sizeof(Fc4Tile::Smem)>>>(
                    d_logits, s.h3, w.fc4_w, w.fc4_b, M, kIn, kHidden, 1.0f);
        });
        auto fc4_lse = [&](auto kernel) {
            return benchmark_us([&] {
                kernel<<<ceil_div(M, Fc4Tile::BM), Fc4Tile::THREADS, sizeof(Fc4Tile::Smem)>>>(
                    s.lse_part, s.h3, w.fc4_w, w.fc4_b, d_pixels, s.log_ratio, M, K);
            });
        };
        const float t_precise = fc4_lse(iwae_fc4_lse_kernel<false>), t_fast = fc4_lse(iwae_fc4_lse_kernel<true>);
        const float t_merge = benchmark_us([&] {
            iwae_lse_merge_kernel<<<ceil_div(images, kMergeWarps), kMergeWarps * 32>>>(d_log_px, s.lse_part, images, K);
        });
        cudaCheck(cudaGetLastError());
        const double fc4_flops = gemm_flops(M, kIn, kHidden), fc3_flops = gemm_flops(M, kHidden, kLatent);
        printf("one pass, %d rows (K = %d), each kernel alone:\n", M, K);
        print_flop_row("  sampling+fc3 (v2-v4)", "65000 rows", t_latent, fc3_flops);
        print_flop_row("  fc4 GEMM, fp32 logits out (v1)", "65000 rows", t_gemm, fc4_flops);
        print_flop_row("  fc4+BCE(expf,log1pf)+LSE (v3)", "65000 rows", t_precise, fc4_flops);
        print_flop_row("  fc4+BCE(__expf,__logf)+LSE (v4)", "65000 rows", t_fast, fc4_flops);
        printf("|   lse merge | 65000 rows | %.2f | | | |\n", t_merge);
        for (void* p : std::initializer_list<void*>{d_pixels, d_mulv, d_logits, d_log_px}) cudaCheck(cudaFree(p));
    }
    for (void* p : std::initializer_list<void*>{s.h3, s.log_ratio, s.lse_part}) cudaCheck(cudaFree(p));
    return ok ? 0 : 1;
}
