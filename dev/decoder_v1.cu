// Decoder v1: the first step of the bf16 decoder, and the design vae.cu runs today - one design on two
// instruction sets. This driver has no kernel of its own: it checks and times vae.cu's
// decoder_mma_kernel (mma.sync, any GPU from sm_80) and decoder_wgmma_kernel (Hopper's wgmma + TMA,
// sm_90a), both through vae.cu's decoder_launch.
//
// The design: z rows in, per-row BCE out; h3 and the logits never reach memory.
//   columns  fc4's 784 logits in 4 column blocks of 200 (the last starts at 584 and leaves its first
//            16 to block 2). A block owns one and keeps its 200 rows of fc4 resident in shared memory
//            (163 KB for mma.sync, 179 KB in wgmma's swizzled 64-wide slices) with all of fc3 (32 / 25
//            KB), loaded once: persistent blocks, one per SM, in groups of the 4 column blocks
//   h3       fc3 in chunks of 80 hidden units; a chunk's accumulators (ReLU, bf16) are the A fragments
//            of fc4's 5 k16 steps over it, in registers: h3 never leaves them
//   biases   in the K padding: z rows hold 1 at K = 20..22 and fc4 has an extra k16 step, times the
//            bias split into 3 bf16 parts (~fp32 exact): the tensor cores add them
//   BCE      in the epilogue, from the logits in registers, one log2 per row and thread; each column
//            block's share of a row goes through L2, and the block that completes 16 rows (a ticket
//            per 16 rows) adds the 4 shares in block order: reproducible bit for bit, batch invariant
//   issue    mma.sync: 8 warps take 16-row tasks on their own; wgmma: 2 warpgroups take 64-row tiles
//            in turns at the tensor cores, one's epilogue running under the other's MMAs
//
// The driver decodes N(0,1) latents (vae.cu's generator, the prior's stream) into z rows with vae.cu's
// z_rows_kernel, checks both decoders' per-row BCE and logits against a float64 CPU decoder on ragged
// row counts with NaN-poisoned outputs, checks the two agree with each other, then times both, hot
// (L2 warm) and cold (L2 flushed), up to 1,000,000 rows (--iwae's regime: 100 rows an image).
//
// Build and run from the repository root (needs data/: make data). The wgmma kernel needs sm_90a;
// an sm_90 or sm_80 build checks and times the mma.sync kernel alone:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a dev/decoder_v1.cu -o dev/decoder_v1 -lcublas
//   ./dev/decoder_v1
#include "common.h"

enum {
    MAX_IMAGES = 10000,  // the MNIST test set
    MAX_ROWS = 1000000,  // the largest pass timed: 100 rows an image, as --iwae's K = 100
    MAX_CHECK = 4097,    // the largest row count checked against float64
};
static const int CHECK_ROWS[] = {1, 7, 37, 1023, MAX_CHECK}; // ragged: multiples of neither 16 nor 64
static const int TIME_ROWS[] = {1024, 4096, 10000, MAX_ROWS};
// bf16 operands (z, both weights: 2^-9 relative each) and h3 rounded to bf16 put the logits and a
// row's BCE within ~5e-3 of float64; a lost column block or chunk moves them by 20% or more.
static const double TOL_REF = 2e-2;
// The two decoders multiply the same bf16 values and share the epilogue; they differ in the fp32
// order inside the MMAs, which now and then rounds an h3 element to the neighbouring bf16.
static const double TOL_PATHS = 1e-4;
static const double PEAK_TFLOPS = 770.0; // H100/H200 SXM dense bf16
static const char* DECODER_NAMES[] = {"mma.sync", "wgmma"};

// Logits [n][784] and per-row BCE of n latents in float64 from the fp32 weights; row r is compared
// with image r.
static void cpu_decoder(const HostWeights* w, const float* z, const uint8_t* pixels, int n,
                        std::vector<double>& logits, std::vector<double>& bce) {
    logits.assign((size_t)n * INPUT_DIM, 0.0), bce.assign(n, 0.0);
    std::vector<double> w4((size_t)INPUT_DIM * HIDDEN_DIM), h3(HIDDEN_DIM);
    for (size_t i = 0; i < w4.size(); i++) w4[i] = w->tensor[FC4_W][i];
    for (int r = 0; r < n; r++) {
        for (int u = 0; u < HIDDEN_DIM; u++) {
            double a = w->tensor[FC3_B][u];
            for (int j = 0; j < LATENT_DIM; j++)
                a += (double)w->tensor[FC3_W][u * LATENT_DIM + j] * z[(size_t)r * LATENT_DIM + j];
            h3[u] = a > 0.0 ? a : 0.0;
        }
        double sum = 0.0;
        for (int p = 0; p < INPUT_DIM; p++) {
            double l = w->tensor[FC4_B][p];
            const double* row = &w4[(size_t)p * HIDDEN_DIM];
            for (int u = 0; u < HIDDEN_DIM; u++) l += row[u] * h3[u];
            logits[(size_t)r * INPUT_DIM + p] = l;
            sum += vae::bce_term_ref(l, pixels[(size_t)r * INPUT_DIM + p] / 255.0);
        }
        bce[r] = sum;
    }
}

int main() {
    HostWeights weights = {};
    Images images = {};
    Error err;
    if (!load_file("data/vae_weights.bin", parse_weights, &weights, &err) ||
        !load_file("data/t10k-images-idx3-ubyte", parse_idx_images, &images, &err))
        fail("%s (run from the repository root: ./dev/decoder_v1)", err.msg);
    if (images.count < MAX_IMAGES) fail("%d test images, %d needed", images.count, (int)MAX_IMAGES);
    print_device_info(); // also what benchmark_us sizes its L2 flush by

    // decoder_rows = 1M: z rows (64 bytes a row), BCE shares and tickets for the longest pass. The
    // events of both timers go to the legacy default stream, which orders itself with m.stream (a
    // blocking stream), where every launch below goes, as in vae.cu.
    VAE m;
    vae_init(&m, &weights, MAX_IMAGES, PRECISION_BF16, KERNELS_FUSED, MAX_ROWS);
    const bool has_wgmma = m.wgmma;
    const int decoders = has_wgmma ? 2 : 1;
    printf("decoders: mma.sync (%zu bytes of shared memory a block)%s; %d SMs\n",
           sizeof(DecoderMmaSmem<PRECISION_BF16>),
           has_wgmma ? " and wgmma" : "; no wgmma in this build or on this GPU (sm_90a): mma.sync alone", m.sms);

    // z: N(0,1) draws, latent 4q..4q+3 of row r from one Philox call; z rows as vae_decode makes them
    std::vector<float> z((size_t)MAX_ROWS * LATENT_DIM);
    for (int r = 0; r < MAX_ROWS; r++)
        for (int q = 0; q < LATENT_DIM / 4; q++) {
            const float4 g = gaussian4(7, STREAM_PRIOR, r, 0, q);
            float* dst = &z[(size_t)r * LATENT_DIM + 4 * q];
            dst[0] = g.x, dst[1] = g.y, dst[2] = g.z, dst[3] = g.w;
        }
    float *d_z, *d_bce, *d_logits;
    uint8_t* d_pixels;
    cudaCheck(cudaMalloc(&d_z, z.size() * sizeof(float)));
    cudaCheck(cudaMemcpy(d_z, z.data(), z.size() * sizeof(float), cudaMemcpyHostToDevice));
    launch(z_rows_kernel<PRECISION_BF16>, MAX_ROWS, 128, 128, m.stream, m.z_rows, d_z, (int)MAX_ROWS);
    cudaCheck(cudaGetLastError());
    cudaCheck(cudaMalloc(&d_pixels, (size_t)MAX_IMAGES * INPUT_DIM));
    cudaCheck(cudaMemcpy(d_pixels, images.pixels, (size_t)MAX_IMAGES * INPUT_DIM, cudaMemcpyHostToDevice));
    cudaCheck(cudaMalloc(&d_bce, (MAX_ROWS + 1) * sizeof(float))); // + 1: a value that must stay NaN
    cudaCheck(cudaMalloc(&d_logits, (size_t)(MAX_CHECK + 1) * INPUT_DIM * sizeof(float)));
    cudaCheck(cudaStreamSynchronize(m.stream));

    // Validation: row r against image r. The row counts are prefixes of one another: one reference.
    std::vector<double> ref_logits, ref_bce;
    cpu_decoder(&weights, z.data(), images.pixels, MAX_CHECK, ref_logits, ref_bce);
    bool ok = true;
    std::vector<float> bce[2] = {std::vector<float>(MAX_CHECK + 1), std::vector<float>(MAX_CHECK + 1)};
    std::vector<float> logits((size_t)(MAX_CHECK + 1) * INPUT_DIM);
    for (int rows : CHECK_ROWS) {
        for (int d = 0; d < decoders; d++) {
            m.wgmma = d == 1;
            // the ELBO's pass: pixels in, per-row BCE out, no logits
            poison(d_bce, (MAX_ROWS + 1) * sizeof(float));
            vae_decoder(&m, d_pixels, rows, 1, d_bce, NULL, NULL);
            cudaCheck(cudaStreamSynchronize(m.stream));
            cudaCheck(cudaMemcpy(bce[d].data(), d_bce, (rows + 1) * sizeof(float), cudaMemcpyDeviceToHost));
            // the pictures' pass: no pixels, logits out
            poison(d_logits, (size_t)(MAX_CHECK + 1) * INPUT_DIM * sizeof(float));
            vae_decoder(&m, NULL, rows, 1, NULL, d_logits, NULL);
            cudaCheck(cudaStreamSynchronize(m.stream));
            cudaCheck(cudaMemcpy(logits.data(), d_logits, (size_t)(rows + 1) * INPUT_DIM * sizeof(float),
                                 cudaMemcpyDeviceToHost));
            const double e_bce = rel_err(bce[d].data(), ref_bce.data(), rows);
            const double e_logits = rel_err(logits.data(), ref_logits.data(), (size_t)rows * INPUT_DIM);
            bool past_end = std::isnan(bce[d][rows]); // nothing written beyond row rows - 1
            for (int p = 0; p < INPUT_DIM; p++) past_end = past_end && std::isnan(logits[(size_t)rows * INPUT_DIM + p]);
            const bool pass = e_bce <= TOL_REF && e_logits <= TOL_REF && past_end;
            ok = ok && pass;
            printf("%s %s rows=%d vs float64: BCE %.2e, logits %.2e of max |ref| (tol %.0e)%s\n",
                   pass ? "PASS" : "FAIL", DECODER_NAMES[d], rows, e_bce, e_logits, TOL_REF,
                   past_end ? "" : "; wrote past the last row");
        }
        if (decoders < 2) continue;
        const double e_paths = rel_err(bce[1].data(), bce[0].data(), rows);
        const bool agree = e_paths <= TOL_PATHS;
        ok = ok && agree;
        printf("%s wgmma vs mma.sync rows=%d: BCE %.2e of max |BCE| (tol %.0e)\n", agree ? "PASS" : "FAIL", rows,
               e_paths, TOL_PATHS);
    }
    m.wgmma = has_wgmma;
    if (!ok) {
        printf("FAIL: validation failed, nothing timed\n");
        return 1;
    }

    // Timing: BCE passes (pixels in, per-row BCE out), rows up to 10000 one an image, 1M rows 100 an image.
    printf("\nus per pass, median of 200: hot = back to back, cold = L2 flushed (%.0f MB written) before each;\n"
           "TFLOP/s of the useful 2 x rows x (20 x 400 + 400 x 784) FLOPs against %.0f TFLOP/s\n",
           std::max<size_t>(256u << 20, 4 * (size_t)device_props().l2CacheSize) / 1048576.0, PEAK_TFLOPS);
    printf("| decoder | rows | us hot | us cold | TFLOP/s hot | %% of peak hot | TFLOP/s cold | %% of peak cold |\n"
           "|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int d = 0; d < decoders; d++) {
        m.wgmma = d == 1;
        for (int rows : TIME_ROWS) {
            const int rows_per_image = rows <= MAX_IMAGES ? 1 : rows / MAX_IMAGES;
            auto pass = [&] { vae_decoder(&m, d_pixels, rows, rows_per_image, d_bce, NULL, NULL); };
            const float hot = benchmark_us(pass, 200, 10, false), cold = benchmark_us(pass);
            const double flop = 2.0 * rows * ((double)LATENT_DIM * HIDDEN_DIM + (double)HIDDEN_DIM * INPUT_DIM);
            const double tf_hot = flop / (hot * 1e-6) / 1e12, tf_cold = flop / (cold * 1e-6) / 1e12;
            printf("| %s | %d | %.1f | %.1f | %.1f | %.1f%% | %.1f | %.1f%% |\n", DECODER_NAMES[d], rows, hot, cold,
                   tf_hot, 100.0 * tf_hot / PEAK_TFLOPS, tf_cold, 100.0 * tf_cold / PEAK_TFLOPS);
        }
    }
    m.wgmma = has_wgmma;
    cudaCheck(cudaGetLastError());

    for (void* p : {(void*)d_z, (void*)d_bce, (void*)d_logits, (void*)d_pixels}) cudaCheck(cudaFree(p));
    vae_free(&m);
    free(weights.data), free(images.pixels);
    return 0;
}
