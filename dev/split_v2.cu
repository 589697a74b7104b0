// Split v2: fp32 accuracy on the tensor cores in the fused encoder and decoder, as vae.cu's
// --precision fp32 runs it (the kernels are vae.cu's; this driver checks and times them).
//
// Hypothesis: split_v1 needed six bf16 products (three parts each side) for 1e-5, because bf16
// has 8 significant bits. fp16 has 11: two parts, hi = fp16(v) and lo = fp16(v - hi), carry 22
// bits, and a w = ah wh + ah wl + al wh needs three products (al wl is 2^-22 of it). fp16 and bf16
// run at the same rate, so that is half the tensor work of six bf16 products and two weight copies
// instead of three, which is what lets the weights stay resident: fc1 in slices of 40 units (hi
// and lo rows fill the 80 rows a bf16 slice has), fc4 in 9 column blocks of 88 (two copies beside
// fc3, 209 KB). The lo parts are not scaled: below fp16's normal range (6e-5) they keep an
// absolute precision of 3e-8, far below what a sum of 20 to 800 terms of size ~1 can show, so all
// three products go into one accumulator, the small ones first.
// Arithmetic: fc1 2 products (pixels are exact in fp16), fc21/22, fc3 and fc4 3: 2.6x the bf16
// path's tensor work, plus fc3 recomputed by 9 column blocks instead of 4. Predicted: about 2.5x
// the bf16 forward pass (59 us at B = 10000: ~150 us), against 758 us for the SIMT GEMMs it
// replaces (gemm_v9) and 459-516 us for PyTorch's fastest fp32.
// Result (H200): dev/README.md, "fp32 on the tensor cores".
//
// The driver runs vae_forward (z = mu) into NaN-poisoned activations on ragged batches with both of
// vae.cu's engines and checks every activation against a float64 CPU forward pass, then times the
// forward pass in both precisions beside cuBLASLt fp32 (CUBLAS_COMPUTE_32F, no TF32) running the
// same four layers alone.
//
// Build and run from the repository root (needs data/: make data):
//   make -C dev split_v2 && ./dev/split_v2
#include "common.h"

static const int CHECK_B[] = {1, 7, 37, 1023, 4097}; // ragged: multiples of neither 16 nor 64
static const int TIME_B[] = {1024, 4096, 10000};
enum { MAX_B = 10000, NUM_ACTS = 7 };
// Per tensor, max |ours - float64| / max |float64|: vae.cu's bound for fp32 (test_vae) and for bf16.
static const double TOL[] = {1e-5, 2e-2}; // by Precision

// Every activation of B images (z = mu) in float64 (cpu_reference.h): [h1 | mu | logvar | h3 | logits | bce | kl].
static std::vector<std::vector<double>> cpu_forward64(const HostWeights* w, const uint8_t* pixels, int B) {
    std::vector<double> x((size_t)B * INPUT_DIM);
    for (size_t i = 0; i < x.size(); i++) x[i] = pixels[i] / 255.0;
    const CpuActs a = cpu_forward(w, PUBLISHED_DIMS, x.data(), NULL, B);
    return {a.h1, a.mu, a.logvar, a.h3, a.logits, a.bce, a.kl};
}

int main() {
    HostWeights weights;
    Images images;
    vae::load_model_inputs("split_v2", &weights, &images);
    print_device_info();
    const int max_check = *std::max_element(std::begin(CHECK_B), std::end(CHECK_B));
    const auto ref = cpu_forward64(&weights, images.pixels, max_check); // the batches are prefixes of one another
    uint8_t* d_pixels;
    float* d_losses;
    cudaCheck(cudaMalloc(&d_pixels, (size_t)MAX_B * INPUT_DIM));
    cudaCheck(cudaMemcpy(d_pixels, images.pixels, (size_t)MAX_B * INPUT_DIM, cudaMemcpyHostToDevice));
    cudaCheck(cudaMalloc(&d_losses, 2 * MAX_B * sizeof(float)));

    // Validation: every activation of each batch, both precisions, both instruction sets.
    bool ok = true;
    printf("| precision | kernels | batch | h1 | mu | logvar | h3 | logits | bce | kl |\n"
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (Precision p : {PRECISION_FP32, PRECISION_BF16}) {
        for (int engine = 0; engine < 2; engine++) { // vae.cu's plain path (cuBLASLt), then the fused kernels
            VAE m;
            vae_init(&m, &weights, MAX_B, p, engine ? KERNELS_FUSED : KERNELS_PLAIN);
            for (int B : CHECK_B) {
                poison(m.mulv, (size_t)MAX_B * MULV_DIM * 4), poison(m.logits, (size_t)MAX_B * INPUT_DIM * 4);
                poison(d_losses, 2 * MAX_B * sizeof(float));
                if (m.h1) poison(m.h1, (size_t)MAX_B * HIDDEN_DIM * 4), poison(m.h3, (size_t)MAX_B * HIDDEN_DIM * 4);
                const ForwardOptions opt = {0, true, false};
                m.probe.keep_activations = true;
                vae_forward(&m, d_pixels, B, 0, &opt, d_losses, d_losses + MAX_B);
                m.probe = Probe{};
                cudaCheck(cudaStreamSynchronize(m.stream));
                const float* outs[NUM_ACTS] = {m.h1, m.mulv, m.mulv, m.h3, m.logits, d_losses, d_losses + MAX_B};
                const size_t widths[NUM_ACTS] = {HIDDEN_DIM, LATENT_DIM, LATENT_DIM, HIDDEN_DIM, INPUT_DIM, 1, 1};
                const size_t pitch[NUM_ACTS] = {HIDDEN_DIM, MULV_DIM, MULV_DIM, HIDDEN_DIM, INPUT_DIM, 1, 1};
                printf("| %s | %s | %d |", PRECISION_NAMES[p], engine ? "fused" : "plain", B);
                for (int t = 0; t < NUM_ACTS; t++) {
                    if (outs[t] == NULL) { // bf16 keeps h1 and h3 on chip
                        printf(" - |");
                        continue;
                    }
                    const size_t col = t == 2 ? LATENT_DIM : 0; // logvar: the second half of [mu | logvar]
                    std::vector<float> all((size_t)B * pitch[t]), got((size_t)B * widths[t]);
                    cudaCheck(cudaMemcpy(all.data(), outs[t], all.size() * sizeof(float), cudaMemcpyDeviceToHost));
                    for (size_t i = 0; i < got.size(); i++)
                        got[i] = all[i / widths[t] * pitch[t] + col + i % widths[t]];
                    const double e = rel_err(got.data(), ref[t].data(), got.size());
                    ok = ok && e <= TOL[p];
                    printf(" %.2e%s |", e, e <= TOL[p] ? "" : " FAIL");
                }
                printf("\n");
            }
            vae_free(&m);
        }
    }
    if (!ok) {
        printf("FAIL: an activation is outside its bound (fp32 %.0e, bf16 %.0e), nothing timed\n", TOL[0], TOL[1]);
        return 1;
    }

    // Timing: the forward pass + loss (z = mu), L2 warm, against cuBLASLt fp32 on the four layers alone.
    CublasLtLinear<float> cublas;
    float *d_x, *d_h, *d_mulv, *d_y;
    cudaCheck(cudaMalloc(&d_x, (size_t)MAX_B * INPUT_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_h, (size_t)MAX_B * HIDDEN_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_mulv, (size_t)MAX_B * MULV_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_y, (size_t)MAX_B * INPUT_DIM * sizeof(float)));
    std::vector<float> x((size_t)MAX_B * INPUT_DIM);
    for (size_t i = 0; i < x.size(); i++) x[i] = images.pixels[i] / 255.0f;
    cudaCheck(cudaMemcpy(d_x, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
    VAE fp32, bf16_model;
    vae_init(&fp32, &weights, MAX_B, PRECISION_FP32, KERNELS_FUSED);
    vae_init(&bf16_model, &weights, MAX_B, PRECISION_BF16, KERNELS_FUSED);
    printf("\nus per forward pass + loss (z = mu), median of 200, L2 warm; cuBLASLt fp32: its four GEMMs with\n"
           "bias and ReLU fused, nothing else\n"
           "| batch | vae.cu fp32 | vae.cu bf16 | cuBLASLt fp32 layers | fp32 vs cuBLAS fp32 | fp32 vs bf16 path |\n"
           "|---:|---:|---:|---:|---:|---:|\n");
    for (int B : TIME_B) {
        const ForwardOptions opt = {0, true, false};
        auto forward = [&](VAE* m) { vae_forward(m, d_pixels, B, 0, &opt, d_losses, d_losses + MAX_B); };
        const float us32 = benchmark_us([&] { forward(&fp32); }, 200, 10, false);
        const float us16 = benchmark_us([&] { forward(&bf16_model); }, 200, 10, false);
        const float us_cublas = benchmark_us(
            [&] {
                cublas({d_x, fp32.tensor[FC1_W], fp32.tensor[FC1_B], d_h, B, HIDDEN_DIM, INPUT_DIM, Act::Relu});
                cublas({d_h, fp32.tensor[FC21_W], fp32.tensor[FC21_B], d_mulv, B, MULV_DIM, HIDDEN_DIM, Act::None});
                cublas({d_mulv, fp32.tensor[FC3_W], fp32.tensor[FC3_B], d_h, B, HIDDEN_DIM, LATENT_DIM, Act::Relu});
                cublas({d_h, fp32.tensor[FC4_W], fp32.tensor[FC4_B], d_y, B, INPUT_DIM, HIDDEN_DIM, Act::None});
            },
            200, 10, false);
        printf("| %d | %.1f | %.1f | %.1f | %.2fx faster | %.0f%% of its speed |\n", B, us32, us16, us_cublas,
               us_cublas / us32, 100.0 * us16 / us32);
    }
    cudaCheck(cudaGetLastError());
    vae_free(&fp32), vae_free(&bf16_model);
    for (void* p : {(void*)d_x, (void*)d_h, (void*)d_mulv, (void*)d_y, (void*)d_pixels, (void*)d_losses})
        cudaCheck(cudaFree(p));
    free(weights.data), free(images.pixels);
    return 0;
}
