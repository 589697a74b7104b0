// Sampling v1: the plain path's sample_kernel (fc3's input rows for --iwae and the ELBO), its z rows stored by each
// thread (v0) against vae.cu's, which stages a block's rows in shared memory and stores them as one contiguous run.
//
// v0: a thread a row, its z row (bf16: z_pad(20) = 24 values in three parts, 144 bytes; fp32: 96) stored by the thread
// in 8-byte (bf16) or 16-byte packs, so every warp store touches 32 rows' scattered segments. ncu: 80 us for an --iwae
// pass of 260,000 rows (base clocks, H200), where the 38 MB written take ~10 at full bandwidth.
// v1 (vae.cu's sample_kernel): the block's 64 rows staged in shared memory, then stored a pack a thread, contiguous.
// Predicted ~10-15 us at 262,144 rows. Result (this driver, H200): bf16 78.6 -> 25.2 us at 262,144 rows (3.1x), Z = 33
// 132.6 -> 96.8; fp32, whose 16-byte packs already filled whole segments, 22.3 -> 23.3 (no gain). What is left is the
// draws' arithmetic (5 Philox blocks, 10 Box-Muller pairs, 40 expf a row).
//
// Checks: v0 and v1 write the same bytes (z rows, log ratios) on 1, 7, 37, 1023, 4097, 130,000 and 262,144 rows (K =
// 5,000), bf16 and fp32, Z = 20 (the published instance) and Z = 33 (MAX_LATENT's); and the z rows' parts, summed,
// equal float64's mu + eps exp(logvar / 2) to 1e-6 of its scale in fp32, 2e-5 in bf16's two parts (eps from the same
// Philox draws on the host). Then both are timed on 130,000 and 262,144 rows.
//
// Build and run:  make -C dev sample_v1 && ./dev/sample_v1
#include "common.h"

using namespace vae;

// v0: vae.cu's sample_kernel before staging, a thread a row and its own stores.
template <typename T, int ZMAX>
__global__ void sample_v0_kernel(T* z_input, float* log_ratio, const float* __restrict__ mulv, int rows, int nz, int K,
                                 uint32_t first_image, uint64_t seed) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    nz = latents<ZMAX>(nz);
    float z[ZMAX], row_kl, ratio;
    sample_latents(z, nz, &row_kl, &ratio, mulv + (size_t)(r / K) * 2 * nz, NULL, first_image + r / K, r % K, seed,
                   false);
    store_z_input(z_input + (size_t)r * z_pad(nz) * z_parts<T>(), z, nz);
    log_ratio[r] = ratio;
}

enum { MAX_ROWS = 262144, K = 5000 };

template <typename T, int ZMAX> static bool run(const char* name, int nz) {
    const Precision precision = std::is_same<T, bf16>::value ? PRECISION_BF16 : PRECISION_FP32;
    const int width = z_width(precision, nz), images = ceil_div(MAX_ROWS, K);
    const uint64_t seed = 42;
    std::vector<float> mulv((size_t)images * 2 * nz);
    fill_random(mulv, 3, 1.0f); // logvar in [-1, 1]
    float* d_mulv = device_upload(mulv);
    T *d_z[2];
    float* d_ratio[2];
    for (int v = 0; v < 2; v++) {
        cudaCheck(cudaMalloc(&d_z[v], (size_t)MAX_ROWS * width * sizeof(T)));
        cudaCheck(cudaMalloc(&d_ratio[v], MAX_ROWS * sizeof(float)));
    }
    auto variant = [&](int v, int rows) {
        if (v == 0)
            launch(sample_v0_kernel<T, ZMAX>, rows, SAMPLE_ROWS, SAMPLE_ROWS, 0, d_z[0], d_ratio[0], d_mulv, rows, nz,
                   K, 0u, seed);
        else
            launch(sample_kernel<T, ZMAX>, rows, SAMPLE_ROWS, SAMPLE_ROWS, 0, d_z[1], (float*)NULL, (float*)NULL,
                   d_ratio[1], d_mulv, (const float*)NULL, rows, nz, K, 0u, seed, false);
    };
    bool ok = true;
    for (int rows : {1, 7, 37, 1023, 4097, 130000, (int)MAX_ROWS}) {
        std::vector<std::vector<T>> z(2, std::vector<T>((size_t)rows * width));
        std::vector<std::vector<float>> ratio(2, std::vector<float>(rows));
        for (int v = 0; v < 2; v++) {
            poison(d_z[v], (size_t)MAX_ROWS * width * sizeof(T)), poison(d_ratio[v], MAX_ROWS * sizeof(float));
            variant(v, rows);
            cudaCheck(cudaMemcpy(z[v].data(), d_z[v], z[v].size() * sizeof(T), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(ratio[v].data(), d_ratio[v], rows * sizeof(float), cudaMemcpyDeviceToHost));
        }
        const bool same = memcmp(z[0].data(), z[1].data(), z[0].size() * sizeof(T)) == 0 &&
                          memcmp(ratio[0].data(), ratio[1].data(), rows * sizeof(float)) == 0;
        double diff = 0.0, top = 0.0;
        for (int r = 0; r < rows; r++) // the parts summed back against float64, a row's latents
            for (int j = 0; j < nz; j++) {
                const int image = r / K, pad = z_pad(nz);
                const float4 e = gaussian4(seed, STREAM_POSTERIOR, image, r % K, j / 4);
                const float eps = (&e.x)[j % 4];
                const double mu = mulv[(size_t)image * 2 * nz + j], logvar = mulv[(size_t)image * 2 * nz + nz + j];
                const double want = mu + eps * std::exp(0.5 * logvar);
                double got = 0.0;
                for (int p = 0; p < z_parts<T>(); p++) // bf16: [zh | ...] [zl | ...] [zh | ...]; zh + zl is z
                    if (p < 2) got += (double)ElemTraits<T>::to_float(z[1][(size_t)r * width + p * pad + j]);
                if (!std::isfinite(got)) got = INFINITY;
                diff = std::max(diff, std::fabs(got - want)), top = std::max(top, std::fabs(want));
            }
        // fp32's z carries 24 bits (6e-8) and eps's host and device sines differ by ~1e-7; bf16's hi + lo carry 16
        // (7.6e-6 of a value), the bits fc3's product sees (NOTES, 'fc3 in parts')
        const double rel = diff / top, tol = std::is_same<T, bf16>::value ? 2e-5 : 1e-6;
        const bool good = same && rel <= tol;
        if (!good || rows == MAX_ROWS)
            printf("check %s Z=%d rows=%-6d v0 and v1 %s; z within %.2e of float64 (tol %.0e) %s\n", name, nz, rows,
                   same ? "bitwise equal" : "DIFFER", rel, tol, good ? "OK" : "FAIL");
        ok = ok && good;
    }
    const char* names[] = {"v0: a thread's own stores", "v1: vae.cu, staged"};
    for (int rows : {130000, (int)MAX_ROWS})
        for (int v = 0; v < 2; v++) {
            const float us = benchmark_us([&] { variant(v, rows); });
            const double bytes = (double)rows * (width * sizeof(T) + sizeof(float));
            printf("| %-26s | %s | %2d | %6d | %8.2f | %6.0f GB/s |\n", names[v], name, nz, rows, us, bytes / us * 1e-3);
        }
    for (int v = 0; v < 2; v++) cudaCheck(cudaFree(d_z[v])), cudaCheck(cudaFree(d_ratio[v]));
    cudaCheck(cudaFree(d_mulv));
    return ok;
}

int main() {
    print_device_info();
    printf("| variant | type | Z | rows | time us | z rows + ratios written |\n|---|---|---|---|---|---|\n");
    bool ok = run<bf16, LATENT_DIM>("bf16", LATENT_DIM);
    ok = run<float, LATENT_DIM>("fp32", LATENT_DIM) && ok;
    ok = run<bf16, MAX_LATENT>("bf16", 33) && ok;
    ok = run<float, MAX_LATENT>("fp32", 33) && ok;
    printf("%s\n", ok ? "all checks passed" : "CHECKS FAILED");
    return ok ? 0 : 1;
}
