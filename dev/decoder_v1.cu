// Decoder v1: the first step of the bf16 decoder, and the fused design vae.cu runs today on two
// instruction sets. It writes out decoder_mma_kernel (mma.sync, any GPU from sm_80: vae.cu's decoder on
// GPUs without wgmma until the plain path took them over) and checks and times it beside vae.cu's
// decoder_wgmma_kernel (Hopper's wgmma + TMA, sm_90a, through fused_decoder).
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
// Build and run from the repository root (needs data/: make data) on an H100 or H200:
//   make -C dev decoder_v1 && ./dev/decoder_v1
#include "common.h"

// ----------------------------------------------------------------------------
// the mma.sync kernel

// decoder_mma_kernel: the decoder on mma.sync (sm_80's instructions). A block owns one column
// block: its DEC_BN rows of fc4 (bf16: 200, 163 KB; fp32: 88 in two copies, 144 KB) and all of
// fc3 (32 or 58 KB) are copied into shared memory once, and its 8 warps then take 16-row tasks,
// dealt round-robin over the block's copies first, on their own (no block-wide barrier after the
// copy). Per task a warp runs fc3 in chunks of 80 hidden units (10 n8 blocks, K = Z_K), turns
// each chunk's accumulators into fc4's A fragments in registers (relu_to_a), and multiplies them
// by fc4's rows through ldmatrix: the same dataflow as the wgmma kernel, 16 rows at a time instead
// of 64. Rows of 816 bytes (51 x 16) put the 8 rows an ldmatrix phase reads in 8 different bank
// groups; fc3's rows of 80 or 144 bytes make its fragment loads conflict-free.
enum { DEC_MMA_WARPS = 8 };
template <Precision P> struct DecoderMmaSmem {
    typename Path<P>::T w4[Path<P>::SPLIT ? 2 : 1][Path<P>::DEC_BN][FC4_K];
    typename Path<P>::T w3[HIDDEN_DIM][Path<P>::Z_K + 8];
};
template <Precision P>
__global__ void __launch_bounds__(DEC_MMA_WARPS * 32, 1)
    decoder_mma_kernel(const typename Path<P>::T* __restrict__ fc4_wb, const typename Path<P>::T* __restrict__ fc3_wb,
                       const DecoderIO io) {
    typedef Path<P> Q;
    typedef typename Q::T T;
    constexpr int DEC_BN = Q::DEC_BN, DEC_COL_BLOCKS = Q::DEC_COL_BLOCKS, Z_STEPS = Q::Z_K / 16;
    extern __shared__ __align__(16) uint8_t smem_raw[];
    DecoderMmaSmem<P>& sm = *reinterpret_cast<DecoderMmaSmem<P>*>(smem_raw);
    const int cb = blockIdx.x % DEC_COL_BLOCKS, col0 = cb < DEC_COL_BLOCKS - 1 ? cb * DEC_BN : INPUT_DIM - DEC_BN;
    for (int copy = 0; copy < (Q::SPLIT ? 2 : 1); copy++)
        copy_block_async(&sm.w4[copy][0][0], FC4_K, fc4_wb + ((size_t)copy * INPUT_DIM + col0) * FC4_K, FC4_K, DEC_BN,
                         FC4_K);
    copy_block_async(&sm.w3[0][0], Q::Z_K + 8, fc3_wb, Q::Z_K, HIDDEN_DIM, Q::Z_K);
    cp_async_wait<0>();
    __syncthreads();
    wait_for_prior_grid(); // the z rows

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int b_row = lane % 8 + (lane / 16) * 8, b_k = ((lane / 8) % 2) * 8; // ldmatrix_x4: two n8 blocks x k16
    const uint32_t a_bias[4] = {bias_ones<T>(t), bias_ones<T>(t), 0u, 0u};
    const int tasks = ceil_div(io.rows, TASK_ROWS), copies = gridDim.x / DEC_COL_BLOCKS; // tasks dealt round-robin
    for (int task = blockIdx.x / DEC_COL_BLOCKS + copies * warp; task < tasks; task += copies * DEC_MMA_WARPS) {
        uint32_t z_a[Z_STEPS][4];
        load_z_fragments(z_a, io.z_rows, task * TASK_ROWS, io.rows);
        float logit[DEC_BN / 2] = {};
        #pragma unroll 1
        for (int c = 0; c < DEC_CHUNKS; c++) {
            float h[2 * DEC_CHUNK / 4] = {};
            #pragma unroll
            for (int nt = 0; nt < DEC_CHUNK / 8; nt++)
                #pragma unroll
                for (int kk = 0; kk < Z_STEPS; kk++) {
                    const T* w = &sm.w3[c * DEC_CHUNK + nt * 8 + g][kk * 16 + 2 * t];
                    const uint32_t b[2] = {pair_at(w), pair_at(w + 8)};
                    mma_m16n8k16<T>(&h[4 * nt], z_a[kk], b);
                }
            if (io.h3 && cb == 0) store_hidden(io.h3, h, task * TASK_ROWS, io.rows, c * DEC_CHUNK);
            uint32_t a[DEC_STEPS][4], a_lo[DEC_STEPS][4];
            relu_to_a<T>(a, a_lo, h);
            #pragma unroll
            for (int s = 0; s < DEC_STEPS; s++) {
                const int k = (c * DEC_STEPS + s) * 16;
                #pragma unroll
                for (int nt = 0; nt < DEC_BN / 8; nt += 2) {
                    const T* row = &sm.w4[0][nt * 8 + b_row][k + b_k];
                    const T* row_lo = row + DEC_BN * FC4_K; // fp32: the same place in the lo copy
                    if (nt + 1 < DEC_BN / 8) {
                        uint32_t r[4], q[4] = {};
                        ldmatrix_x4(r, row);
                        if constexpr (Q::SPLIT) ldmatrix_x4(q, row_lo);
                        const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]}, c0[2] = {q[0], q[1]},
                                       c1[2] = {q[2], q[3]};
                        mma_parts<T>(&logit[4 * nt], a[s], a_lo[s], b0, c0);
                        mma_parts<T>(&logit[4 * nt + 4], a[s], a_lo[s], b1, c1);
                    } else { // an odd count of n8 blocks: the last alone; lanes 16-31 pass (unused) in-bounds addresses
                        uint32_t b[2], b_lo[2] = {};
                        ldmatrix_x2(b[0], b[1], row - (lane / 16) * 8 * FC4_K);
                        if constexpr (Q::SPLIT) ldmatrix_x2(b_lo[0], b_lo[1], row_lo - (lane / 16) * 8 * FC4_K);
                        mma_parts<T>(&logit[4 * nt], a[s], a_lo[s], b, b_lo);
                    }
                }
            }
        }
        #pragma unroll
        for (int nt = 0; nt < DEC_BN / 8; nt++) { // k16 step 25: the bias; B's K = 408..415 (past the rows) as zeros
            const uint32_t b[2] = {pair_at(&sm.w4[0][nt * 8 + g][HIDDEN_DIM + 2 * t]), 0u};
            mma_m16n8k16<T>(&logit[4 * nt], a_bias, b);
        }
        decoder_epilogue<P>(logit, task * TASK_ROWS, cb, io);
    }
}

// decoder_mma_kernel over io.rows z rows (bf16), as vae.cu's decoder_launch does the wgmma kernel: blocks
// in groups of the column blocks, at most one per SM and no more than there are 16-row tasks.
static void decoder_mma(Fused* f, const uint8_t* pixels, int rows, int rows_per_image, float* bce, float* logits) {
    typedef Path<PRECISION_BF16> Q;
    const DecoderIO io = {f->z_rows, pixels, rows, rows_per_image, bce, f->bce_parts, f->dec_tickets, logits, NULL,
                          NULL};
    const int copies_needed = ceil_div(rows, TASK_ROWS);
    const int copies = f->sms / Q::DEC_COL_BLOCKS < copies_needed ? f->sms / Q::DEC_COL_BLOCKS : copies_needed;
    decoder_mma_kernel<PRECISION_BF16><<<Q::DEC_COL_BLOCKS * copies, DEC_MMA_WARPS * 32,
                                         sizeof(DecoderMmaSmem<PRECISION_BF16>), f->stream>>>(
        static_cast<const bf16*>(f->fc4_wb), static_cast<const bf16*>(f->fc3_wb), io);
    cudaCheck(cudaGetLastError());
}

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

// Logits [n][784] and per-row BCE of n latents in float64 from the fp32 weights (cpu_reference.h); row r
// is compared with image r.
static void cpu_decoder(const HostWeights* w, const float* z, const uint8_t* pixels, int n,
                        std::vector<double>& logits, std::vector<double>& bce) {
    const std::vector<double> z64(z, z + (size_t)n * LATENT_DIM);
    std::vector<double> x(INPUT_DIM);
    logits.resize((size_t)n * INPUT_DIM), bce.resize(n);
    cpu_decode(w, PUBLISHED_DIMS, z64.data(), n, NULL, logits.data());
    for (int r = 0; r < n; r++) {
        for (int p = 0; p < INPUT_DIM; p++) x[p] = pixels[(size_t)r * INPUT_DIM + p] / 255.0;
        bce[r] = cpu_bce(&logits[(size_t)r * INPUT_DIM], x.data(), INPUT_DIM);
    }
}

int main() {
    HostWeights weights;
    Images images;
    vae::load_model_inputs("decoder_v1", &weights, &images);
    if (images.count < MAX_IMAGES) fail("%d test images, %d needed", images.count, (int)MAX_IMAGES);
    print_device_info(); // also what benchmark_us sizes its L2 flush by

    // decoder_rows = 1M: z rows (64 bytes a row), BCE shares and tickets for the longest pass. The
    // events of both timers go to the legacy default stream, which orders itself with m.stream (a
    // blocking stream), where every launch below goes, as in vae.cu.
    VAE m;
    vae_init(&m, &weights, MAX_IMAGES, PRECISION_BF16, KERNELS_FUSED, MAX_ROWS);
    const int decoders = 2;
    cudaCheck(cudaFuncSetAttribute(decoder_mma_kernel<PRECISION_BF16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)sizeof(DecoderMmaSmem<PRECISION_BF16>)));
    printf("decoders: mma.sync (%zu bytes of shared memory a block) and wgmma (%d bytes); %d SMs\n",
           sizeof(DecoderMmaSmem<PRECISION_BF16>), dec_wg_smem<PRECISION_BF16>(), m.fused->sms);

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
    launch(z_rows_kernel<PRECISION_BF16>, MAX_ROWS, 128, 128, m.stream, m.fused->z_rows, d_z, (int)MAX_ROWS);
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
            // the ELBO's pass: pixels in, per-row BCE out, no logits
            poison(d_bce, (MAX_ROWS + 1) * sizeof(float));
            if (d == 1) fused_decoder(m.fused, d_pixels, rows, 1, d_bce, NULL, NULL);
            else decoder_mma(m.fused, d_pixels, rows, 1, d_bce, NULL);
            cudaCheck(cudaStreamSynchronize(m.stream));
            cudaCheck(cudaMemcpy(bce[d].data(), d_bce, (rows + 1) * sizeof(float), cudaMemcpyDeviceToHost));
            // the pictures' pass: no pixels, logits out
            poison(d_logits, (size_t)(MAX_CHECK + 1) * INPUT_DIM * sizeof(float));
            if (d == 1) fused_decoder(m.fused, NULL, rows, 1, NULL, d_logits, NULL);
            else decoder_mma(m.fused, NULL, rows, 1, NULL, d_logits);
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
        const double e_paths = rel_err(bce[1].data(), bce[0].data(), rows);
        const bool agree = e_paths <= TOL_PATHS;
        ok = ok && agree;
        printf("%s wgmma vs mma.sync rows=%d: BCE %.2e of max |BCE| (tol %.0e)\n", agree ? "PASS" : "FAIL", rows,
               e_paths, TOL_PATHS);
    }
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
        for (int rows : TIME_ROWS) {
            const int rows_per_image = rows <= MAX_IMAGES ? 1 : rows / MAX_IMAGES;
            auto pass = [&] {
                if (d == 1) fused_decoder(m.fused, d_pixels, rows, rows_per_image, d_bce, NULL, NULL);
                else decoder_mma(m.fused, d_pixels, rows, rows_per_image, d_bce, NULL);
            };
            const float hot = benchmark_us(pass, 200, 10, false), cold = benchmark_us(pass);
            const double flop = 2.0 * rows * ((double)LATENT_DIM * HIDDEN_DIM + (double)HIDDEN_DIM * INPUT_DIM);
            const double tf_hot = flop / (hot * 1e-6) / 1e12, tf_cold = flop / (cold * 1e-6) / 1e12;
            printf("| %s | %d | %.1f | %.1f | %.1f | %.1f%% | %.1f | %.1f%% |\n", DECODER_NAMES[d], rows, hot, cold,
                   tf_hot, 100.0 * tf_hot / PEAK_TFLOPS, tf_cold, 100.0 * tf_cold / PEAK_TFLOPS);
        }
    }
    cudaCheck(cudaGetLastError());

    for (void* p : {(void*)d_z, (void*)d_bce, (void*)d_logits, (void*)d_pixels}) cudaCheck(cudaFree(p));
    vae_free(&m);
    free(weights.data), free(images.pixels);
    return 0;
}
