// What only the AIS drivers (ais_gradient_v1, ais_gradient_v2, ais_hmc_v1) need beside common.h: the
// gradient's and the chains' validate-then-time drivers, the roundings of bf16's ais_kernel for the
// float64 gradient (cpu_reference.h's cpu_bce_grad), and the float64 AIS of one image those drivers
// check ais_kernel against.
#pragma once

#include "common.h"

namespace vae {

// ---- AIS: the gradient of BCE(x, logits(z)) w.r.t. z, one evaluation per row per step of a trajectory
// What a gradient variant's launch reads and writes (device pointers). Row r is z[r] scored against
// pixels[r]; the kernel runs `evals` evaluations of every row (the timed loop of a trajectory: the
// same z each time, so the last evaluation's results are the first's) and writes the last.
struct AisGradientArgs {
    const float* z;        // [rows][20]
    const uint8_t* pixels; // [rows][784]
    int rows, evals;
    float *grad, *bce;     // [rows][20], [rows]
};

// A gradient kernel's loop over its cluster's tiles of AIS_ROWS rows, as ais_kernel holds them when a
// tile is the block's (both warpgroups evaluate together, as many times: what bf16's turns need):
// thread (warp, g, t) has rows tile * AIS_ROWS + 16 warp + g and + 8 (those past a.rows repeat the
// last one's data and write nothing), latents 8 (i / 2) + 2t + i % 2 of each, and the pixels from
// col0. gradient(z, x_row, grad, bce, true) runs a.evals times (the energy too); the cluster's rank 0
// writes the result.
template <typename Gradient>
__device__ inline void ais_driver_tiles(const AisGradientArgs& a, int col0, Gradient gradient) {
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int tile = cluster_index(); tile < ceil_div(a.rows, AIS_ROWS); tile += cluster_count()) {
        float z[2][AIS_LATENTS], grad[2][AIS_LATENTS], bce[2];
        const uint8_t* x_row[2];
        int row[2];
        for (int half = 0; half < 2; half++) {
            row[half] = tile * AIS_ROWS + warp * TASK_ROWS + g + 8 * half;
            const int r = row[half] < a.rows ? row[half] : a.rows - 1;
            x_row[half] = a.pixels + (size_t)r * INPUT_DIM + col0;
            for (int i = 0; i < AIS_LATENTS; i++) {
                const int j = 8 * (i / 2) + 2 * t + i % 2;
                z[half][i] = j < LATENT_DIM ? a.z[(size_t)r * LATENT_DIM + j] : 0.0f;
            }
        }
        for (int e = 0; e < a.evals; e++) gradient(z, x_row, grad, bce, true);
        for (int half = 0; half < 2 && cluster_rank() == 0; half++) {
            if (row[half] >= a.rows) continue;
            for (int i = 0; i < AIS_LATENTS; i++) {
                const int j = 8 * (i / 2) + 2 * t + i % 2;
                if (j < LATENT_DIM) a.grad[(size_t)row[half] * LATENT_DIM + j] = grad[half][i];
            }
            if (t == 0) a.bce[row[half]] = bce[half];
        }
    }
}

// The roundings of ais_gradient_wgmma<PRECISION_BF16>, for a float64 reference that takes them too
// (cpu_reference.h's cpu_bce_grad with ais_bf16_rounding): fc4 as the kernel holds it (bf16), fc3 in fp16
// for the backward product (its hi part alone); the ReLU's output and sigmoid - x to bf16, and dh to fp16 as
// each block of the cluster holds it, the share of its columns of the logits (0..199, .., 600..783), before
// the blocks add their products with fc3. fc4's bias (three bf16 parts) and fc3's forward (fp16 hi and lo
// parts in both paths) are ~fp32 and stay exact. What is left between the reference and the kernel is
// float32 sums.
struct AisBf16Weights {
    std::vector<float> fc4_w, fc3_w_backward;
};
inline double round_bf16(double v) { return __bfloat162float(__float2bfloat16_rn((float)v)); }
inline double round_fp16(double v) { return __half2float(__float2half_rn((float)v)); }
inline AisBf16Weights ais_bf16_weights(const HostWeights* w) {
    AisBf16Weights r{std::vector<float>(w->tensor[FC4_W], w->tensor[FC4_W] + w->size[FC4_W]),
                     std::vector<float>(w->tensor[FC3_W], w->tensor[FC3_W] + w->size[FC3_W])};
    for (float& v : r.fc4_w) v = (float)round_bf16(v);
    for (float& v : r.fc3_w_backward) v = (float)round_fp16(v);
    return r;
}
// The rounding cpu_bce_grad takes; it points into `weights`, which must outlive it.
inline CpuGradRounding ais_bf16_rounding(const AisBf16Weights& weights) {
    return {weights.fc4_w.data(), weights.fc3_w_backward.data(), round_bf16, round_bf16, round_fp16,
            Path<PRECISION_BF16>::AIS_CLUSTER, Path<PRECISION_BF16>::AIS_BN};
}

// vae.cu's own gradient of the same rows: ais_kernel at T = 1 (no transition), one chain a row started
// at z, its first evaluation's grad and BCE (the outputs test_vae reads as grad0 and bce0).
inline void production_ais_gradient(const VAE* m, const AisGradientArgs& a) {
    const double beta[2] = {0.0, 1.0};
    double *d_beta, *d_log_w;
    int* d_accepted;
    float *d_mulv, *d_step;
    cudaCheck(cudaMalloc(&d_beta, sizeof(beta)));
    cudaCheck(cudaMalloc(&d_log_w, (size_t)a.rows * sizeof(double)));
    cudaCheck(cudaMalloc(&d_accepted, (size_t)a.rows * sizeof(int)));
    cudaCheck(cudaMalloc(&d_mulv, (size_t)a.rows * MULV_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_step, (size_t)a.rows * sizeof(float)));
    cudaCheck(cudaMemcpy(d_beta, beta, sizeof(beta), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemset(d_mulv, 0, (size_t)a.rows * MULV_DIM * sizeof(float))); // p0 = N(0, I): unused at T = 1
    AisIO io = {};
    io.pixels = a.pixels, io.mulv = d_mulv, io.z_start = a.z, io.beta = d_beta, io.n = a.rows, io.chains = 1;
    io.T = 1, io.leapfrog = 1, io.step0 = AIS_STEP_START, io.log_w = d_log_w, io.accepted = d_accepted;
    io.step_out = d_step, io.probe.fixed_step = true, io.probe.grad0 = a.grad, io.probe.bce0 = a.bce;
    const Fused* f = m->fused;
    if (m->precision == PRECISION_FP32)
        ais_launch<PRECISION_FP32>(io, f->fc4_wb, f->w4_map, f->ais_w3, f->ais_state, f->ais_clusters, 0);
    else
        ais_launch<PRECISION_BF16>(io, f->fc4_wb, f->w4_map, f->ais_w3, f->ais_state, f->ais_clusters, 0);
    cudaCheck(cudaGetLastError()), cudaCheck(cudaDeviceSynchronize());
    void* buffers[] = {d_beta, d_log_w, d_accepted, d_mulv, d_step};
    for (void* p : buffers) cudaCheck(cudaFree(p));
}

// Checks each variant's grad and BCE against float64 on ragged row counts (outputs NaN-poisoned; rows
// of 1, 7 and 37 leave tiles of 128 chains partly empty), then times one evaluation at `rows_timed`
// rows (a full round of the GPU's clusters: what --ais keeps in flight) from the difference of
// 20- and 220-evaluation launches, so the weights' load and the launch drop out. z ~ N(0, 0.6^2):
// the spread of the posteriors the chains visit. tol: the variants' relative tolerance on grad against
// float64. Each is also checked against vae.cu's gradient (ais_kernel, model m) at 1e-3: the same
// 16-bit operands, where only the order of fp32 sums may differ (and with it, now and then, the
// rounding of a sigmoid - x to bf16); a lost group of 16 hidden units moves grad by ~4%.
inline bool run_ais_gradient_driver(const std::vector<Variant<AisGradientArgs>>& variants, const VAE* m,
                                    const HostWeights* w, const Images* images, int rows_timed, double tol) {
    const int check_rows[] = {1, 7, 37, 1023, 4097};
    const int max_rows = std::max(rows_timed, 4097);
    std::vector<float> z((size_t)max_rows * LATENT_DIM);
    for (int r = 0; r < max_rows; r++)
        for (int q = 0; q < LATENT_DIM / 4; q++) {
            const float4 g = gaussian4(3, STREAM_PRIOR, r, 0, q);
            const float v[4] = {g.x, g.y, g.z, g.w};
            for (int i = 0; i < 4; i++) z[(size_t)r * LATENT_DIM + 4 * q + i] = 0.6f * v[i];
        }
    std::vector<uint8_t> pixels((size_t)max_rows * INPUT_DIM);
    for (int r = 0; r < max_rows; r++)
        memcpy(&pixels[(size_t)r * INPUT_DIM], images->pixels + (size_t)(r % images->count) * INPUT_DIM, INPUT_DIM);
    const std::vector<double> z64(z.begin(), z.end());
    std::vector<double> ref_grad((size_t)4097 * LATENT_DIM), ref_bce(4097);
    for (int r = 0; r < 4097; r++)
        ref_bce[r] = cpu_bce_grad(w, PUBLISHED_DIMS, &pixels[(size_t)r * INPUT_DIM], &z64[(size_t)r * LATENT_DIM],
                                  &ref_grad[(size_t)r * LATENT_DIM]);
    float* d_z = device_upload(z);
    uint8_t* d_pixels = device_upload(pixels);
    float *d_grad, *d_bce, *d_base_grad, *d_base_bce;
    cudaCheck(cudaMalloc(&d_grad, (size_t)max_rows * LATENT_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_bce, (size_t)max_rows * sizeof(float)));
    cudaCheck(cudaMalloc(&d_base_grad, (size_t)4097 * LATENT_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_base_bce, (size_t)4097 * sizeof(float)));
    bool ok = true;
    for (int rows : check_rows) {
        poison(d_base_grad, (size_t)4097 * LATENT_DIM * sizeof(float)), poison(d_base_bce, 4097 * sizeof(float));
        production_ais_gradient(m, {d_z, d_pixels, rows, 1, d_base_grad, d_base_bce});
        const std::vector<float> base_grad = copy_to_host_float(d_base_grad, (size_t)rows * LATENT_DIM);
        const std::vector<float> base_bce = copy_to_host_float(d_base_bce, rows);
        const std::vector<double> base64_grad(base_grad.begin(), base_grad.end());
        const std::vector<double> base64_bce(base_bce.begin(), base_bce.end());
        for (const auto& v : variants) {
            poison(d_grad, (size_t)max_rows * LATENT_DIM * sizeof(float)), poison(d_bce, max_rows * sizeof(float));
            v.second({d_z, d_pixels, rows, 1, d_grad, d_bce});
            cudaCheck(cudaGetLastError()), cudaCheck(cudaDeviceSynchronize());
            const std::vector<float> grad = copy_to_host_float(d_grad, (size_t)rows * LATENT_DIM);
            const std::vector<float> bce = copy_to_host_float(d_bce, rows);
            const double e_grad = rel_err(grad.data(), ref_grad.data(), rows, LATENT_DIM, 0, LATENT_DIM);
            const double e_bce = rel_err(bce.data(), ref_bce.data(), rows);
            const double d_grad_base = rel_err(grad.data(), base64_grad.data(), rows, LATENT_DIM, 0, LATENT_DIM);
            const double d_bce_base = rel_err(bce.data(), base64_bce.data(), rows);
            const bool good = e_grad <= tol && e_bce <= tol && d_grad_base <= 1e-3 && d_bce_base <= 1e-3;
            printf("check %-20s rows %5d: vs float64 grad %.2e, BCE %.2e (tolerance %.0e); vs ais_kernel grad %.2e, "
                   "BCE %.2e (1e-3) %s\n", v.first, rows, e_grad, e_bce, tol, d_grad_base, d_bce_base,
                   good ? "OK" : "FAIL");
            ok = ok && good;
        }
    }
    if (ok) {
        printf("%-28s %8s %12s %14s %10s %8s %14s\n", "variant", "rows", "us / eval", "evals / s", "TFLOP/s",
               "% floor", "--ais 1000 (s)");
        for (const auto& v : variants) {
            float us[2];
            for (int i = 0; i < 2; i++) {
                const AisGradientArgs a{d_z, d_pixels, rows_timed, i ? 220 : 20, d_grad, d_bce};
                us[i] = benchmark_us([&] { v.second(a); }, 5, 1, false);
            }
            // --ais 1000 over the test set: 10000 images x 16 chains x 999 transitions x 10 evaluations
            const double per_eval = (us[1] - us[0]) / 200.0, evals_per_s = rows_timed / (per_eval * 1e-6);
            const double tflops = evals_per_s * ais_flops_per_eval(PUBLISHED_DIMS) * 1e-12;
            printf("%-28s %8d %12.2f %14.3e %10.1f %7.1f%% %14.2f\n", v.first, rows_timed, per_eval, evals_per_s,
                   tflops, 100.0 * tflops / 770.0, 1.6e9 / evals_per_s);
        }
    }
    void* buffers[] = {d_z, d_pixels, d_grad, d_bce, d_base_grad, d_base_bce};
    for (void* p : buffers) cudaCheck(cudaFree(p));
    return ok;
}

// ---- AIS chains: the leapfrog trajectory and the whole transition (dev/ais_hmc_v*.cu)

// One image's C chains in float64, ais_kernel's algorithm written out plainly with vae.cu's keyed
// draws: z from q(z|x) = N(mu, exp(logvar)) (mulv: the encoder's floats the kernel reads), the
// momenta, the uniforms. The step size is a float32 as in the kernel, so both take the same steps
// while their decisions agree; `adapt` moves it after each transition from the image's acceptance.
// rounding: each evaluation with a GPU path's roundings (ais_bf16_rounding), or NULL for none.
struct CpuAisImage {
    std::vector<double> log_w;    // [C]
    std::vector<double> z;        // [C][20] at the end
    std::vector<double> proposal; // [C][40]: the last trajectory's end (z, p) before its test
    std::vector<int> accepted;    // [C]
    std::vector<double> margin;   // [C]: the closest any of its tests came to its threshold, |log u - (H0 - H1)|
    std::vector<double> delta_h;  // [C]: the last transition's H0 - H1
    float step;                   // at the end
};
inline CpuAisImage cpu_ais_image(const HostWeights* w, const uint8_t* pixels, const float* mulv, const double* beta,
                                 int T, int C, int L, uint32_t image, uint64_t seed, float step, bool adapt,
                                 const CpuGradRounding* rounding = nullptr) {
    CpuAisImage out{std::vector<double>(C, 0.0),      std::vector<double>((size_t)C * LATENT_DIM),
                    std::vector<double>((size_t)C * 2 * LATENT_DIM, NAN), std::vector<int>(C, 0),
                    std::vector<double>(C, INFINITY), std::vector<double>(C, NAN), step};
    std::vector<double> grad((size_t)C * LATENT_DIM), bce(C);
    double logvar_sum = 0.0, inv_var[LATENT_DIM];
    for (int j = 0; j < LATENT_DIM; j++)
        logvar_sum += mulv[LATENT_DIM + j], inv_var[j] = std::exp(-(double)mulv[LATENT_DIM + j]);
    // log p(x, z) - log p0(z) and U_b as in ais_kernel (the log 2 pi terms cancel)
    auto log_densities = [&](const double* z, double bce_z, double* lpxz, double* lp0) {
        double sq = 0.0, mahal = 0.0;
        for (int j = 0; j < LATENT_DIM; j++)
            sq += z[j] * z[j], mahal += (z[j] - mulv[j]) * (z[j] - mulv[j]) * inv_var[j];
        *lpxz = -bce_z - 0.5 * sq, *lp0 = -0.5 * (mahal + logvar_sum);
    };
    for (int c = 0; c < C; c++) {
        double* z = &out.z[(size_t)c * LATENT_DIM];
        for (int j = 0; j < LATENT_DIM; j++)
            z[j] = mulv[j] + gaussian(seed, STREAM_POSTERIOR, image, c, j) * std::exp(0.5 * mulv[LATENT_DIM + j]);
        bce[c] = cpu_bce_grad(w, PUBLISHED_DIMS, pixels, z, &grad[(size_t)c * LATENT_DIM], rounding);
    }
    for (int s = 1; s <= T; s++) {
        int taken = 0; // this transition's acceptances over the image's chains
        for (int c = 0; c < C; c++) {
            double *z = &out.z[(size_t)c * LATENT_DIM], *g = &grad[(size_t)c * LATENT_DIM], lpxz, lp0;
            log_densities(z, bce[c], &lpxz, &lp0);
            out.log_w[c] += (beta[s] - beta[s - 1]) * (lpxz - lp0);
            if (s == T) continue;
            const double b = beta[s];
            double p[LATENT_DIM], kinetic = 0.0;
            for (int j = 0; j < LATENT_DIM; j += 2) {
                const float2 e = gaussian_pair(seed, STREAM_MOMENTUM, image, c, momentum_counter(s, j, LATENT_DIM));
                p[j] = e.x, p[j + 1] = e.y, kinetic += (double)e.x * e.x + (double)e.y * e.y;
            }
            const double h0 = -b * lpxz - (1.0 - b) * lp0 + 0.5 * kinetic, bce0 = bce[c];
            double z0[LATENT_DIM], grad0[LATENT_DIM];
            std::copy(z, z + LATENT_DIM, z0), std::copy(g, g + LATENT_DIM, grad0);
            auto kick = [&](double scale) {
                for (int j = 0; j < LATENT_DIM; j++)
                    p[j] -= scale * out.step * (b * (g[j] + z[j]) + (1.0 - b) * (z[j] - mulv[j]) * inv_var[j]);
            };
            kick(0.5);
            for (int l = 1; l <= L; l++) {
                for (int j = 0; j < LATENT_DIM; j++) z[j] += out.step * p[j];
                bce[c] = cpu_bce_grad(w, PUBLISHED_DIMS, pixels, z, g, rounding);
                kick(l < L ? 1.0 : 0.5);
            }
            for (int j = 0; j < LATENT_DIM && s == T - 1; j++)
                out.proposal[(size_t)c * 2 * LATENT_DIM + j] = z[j],
                out.proposal[(size_t)c * 2 * LATENT_DIM + LATENT_DIM + j] = p[j];
            log_densities(z, bce[c], &lpxz, &lp0);
            kinetic = 0.0;
            for (int j = 0; j < LATENT_DIM; j++) kinetic += p[j] * p[j];
            const double h1 = -b * lpxz - (1.0 - b) * lp0 + 0.5 * kinetic;
            const double log_u = std::log((double)uniform_open0(seed, STREAM_ACCEPT, image, c, s));
            out.margin[c] = std::min(out.margin[c], std::fabs(log_u - (h0 - h1))), out.delta_h[c] = h0 - h1;
            if (log_u < h0 - h1) { // false for NaN
                out.accepted[c]++, taken++;
            } else {
                std::copy(z0, z0 + LATENT_DIM, z), std::copy(grad0, grad0 + LATENT_DIM, g);
                bce[c] = bce0;
            }
        }
        if (adapt && s < T) // ais_kernel's float32 arithmetic, so the steps agree bit for bit
            out.step = fminf(fmaxf(out.step * ((float)taken / C > AIS_TARGET_ACCEPT ? 1.02f : 0.98f), AIS_STEP_MIN),
                             AIS_STEP_MAX);
    }
    return out;
}

// What a chain driver checks and times: T >= 2 weights (T - 1 transitions) of C chains with L leapfrog
// steps each, on the schedule `beta` (T + 1 values), checked on images 0 .. n - 1 for each n of
// check_images. The time is that of one transition (per_transition) or one leapfrog step, from two
// launches that differ by 20 of them (T = 2 and 22 at L, or L = 1 and 21 at T = 2: one transition),
// so the weights' load, the start and the launch drop out.
struct AisChainDriver {
    const char* name;
    int T, C, L;
    std::vector<double> beta;
    std::vector<int> check_images;
    bool per_transition;
};

// Checks each variant (a launcher of one AisIO, the production ais_kernel's interface) against
// cpu_ais_image chain by chain, outputs NaN-poisoned; in bf16 against the reference that takes the bf16
// path's roundings. A Metropolis test whose float64 energy change lies within `band` of log u may go
// either way: fp32's energies (H ~ 100) carry ~1e-5 nat of rounding, so band = 1e-3; bf16's up to 0.19
// nat (measured, H200), so band = 0.2. Such a chain is left out (log u has density <= 1 per nat, so at
// most 2 band of the tests come that close: with three tests a chain, fp32 keeps >= 99% of the chains
// and bf16 >= 21%; 90% and 20% are required). Every other chain must take the same decisions (its count
// of accepted transitions; a different order would show in z) and match in log w, the final z and the
// last trajectory's end (z, p), relative to the largest reference value. fp32: 1e-5 on log w (as
// test_vae's trajectory check against PyTorch float64), 1e-4 on z and p (grad's ~1e-6 relative error
// enters p at each of the L + 1 kicks of step x |grad U| (~5), ~1e-5 of |p| after L = 10, and the
// dynamics amplify it). bf16: 2e-3 on log w (a weighted mean of energies, whose error was at most 0.19
// nat of ~100) and 5e-2 on z and p (grad's few 1e-3 through the same kicks). A chain whose float32
// sums never put a value on the other side of a bf16 rounding boundary matches the rounded reference as
// fp32 does (one chain: 2.1e-6 at its trajectory's end); one value that lands the other way (~2^-24 /
// 2^-9 of the ~1,600 rounded values an evaluation) moves z, and with it more values across boundaries:
// the ends of 592 chains came up to 1.4e-2 apart (against plain float64 8.1e-2, over the 5e-2). Every
// written chain, compared or not, must have a finite log w and z. The last energy change's error is
// printed in nats: the measured width behind `band`. Then each variant's time per unit at rows_timed
// chains, evaluations/s, TFLOP/s, and --ais 1000.
inline bool run_ais_chain_driver(const std::vector<Variant<AisIO>>& variants, VAE* m, const HostWeights* w,
                                 const Images* images, const AisChainDriver& d, int images_timed) {
    const Precision p = m->precision;
    const int max_images = std::max(images_timed, *std::max_element(d.check_images.begin(), d.check_images.end()));
    const size_t max_rows = (size_t)max_images * d.C;
    if (max_images > m->max_batch || max_images > images->count)
        fail("internal: %d images for the chain driver, the model holds %d", max_images, m->max_batch);
    const float step = AIS_STEP_START;
    const uint64_t seed = 7;
    uint8_t* d_pixels = device_upload(std::vector<uint8_t>(images->pixels,
                                                           images->pixels + (size_t)max_images * INPUT_DIM));
    vae_encode(m, d_pixels, max_images);
    cudaCheck(cudaStreamSynchronize(m->stream));
    const std::vector<float> mulv = copy_to_host_float(m->mulv, (size_t)max_images * MULV_DIM);
    float* d_mulv = device_upload(mulv);
    double *d_beta = device_upload(d.beta), *d_log_w;
    int* d_accepted;
    float *d_step, *d_z, *d_proposal, *d_delta_h;
    cudaCheck(cudaMalloc(&d_log_w, max_rows * sizeof(double)));
    cudaCheck(cudaMalloc(&d_accepted, max_rows * sizeof(int)));
    cudaCheck(cudaMalloc(&d_step, max_images * sizeof(float)));
    cudaCheck(cudaMalloc(&d_z, max_rows * LATENT_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_proposal, max_rows * 2 * LATENT_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_delta_h, max_rows * sizeof(float)));
    auto io_for = [&](int n, int T) {
        AisIO io = {};
        io.pixels = d_pixels, io.mulv = d_mulv, io.beta = d_beta, io.n = n, io.chains = d.C, io.T = T;
        io.leapfrog = d.L, io.seed = seed, io.probe.fixed_step = true, io.step0 = step, io.log_w = d_log_w;
        io.accepted = d_accepted, io.step_out = d_step, io.probe.z_out = d_z, io.probe.proposal = d_proposal;
        io.probe.delta_h = d_delta_h;
        return io;
    };
    const bool fp32 = p == PRECISION_FP32;
    const double tol_w = fp32 ? 1e-5 : 2e-3, tol_zp = fp32 ? 1e-4 : 5e-2, band = fp32 ? 1e-3 : 0.2;
    const double min_compared = fp32 ? 0.9 : 0.2;
    const AisBf16Weights bf16 = fp32 ? AisBf16Weights{} : ais_bf16_weights(w);
    const CpuGradRounding bf16_rounding = ais_bf16_rounding(bf16);
    printf("%s, %s: T = %d, C = %d, L = %d, step %.2f, against float64%s\n", d.name, PRECISION_NAMES[p], d.T, d.C,
           d.L, step, fp32 ? "" : " with the bf16 path's roundings");
    bool ok = true;
    for (int n : d.check_images) {
        const size_t rows = (size_t)n * d.C;
        std::vector<double> ref_w(rows), ref_z(rows * LATENT_DIM), ref_prop(rows * 2 * LATENT_DIM);
        std::vector<double> ref_margin(rows), ref_dh(rows);
        std::vector<int> ref_acc(rows);
        for (int i = 0; i < n; i++) {
            const CpuAisImage r = cpu_ais_image(w, images->pixels + (size_t)i * INPUT_DIM, &mulv[(size_t)i * MULV_DIM],
                                                d.beta.data(), d.T, d.C, d.L, i, seed, step, false,
                                                fp32 ? nullptr : &bf16_rounding);
            std::copy(r.log_w.begin(), r.log_w.end(), &ref_w[(size_t)i * d.C]);
            std::copy(r.z.begin(), r.z.end(), &ref_z[(size_t)i * d.C * LATENT_DIM]);
            std::copy(r.proposal.begin(), r.proposal.end(), &ref_prop[(size_t)i * d.C * 2 * LATENT_DIM]);
            std::copy(r.accepted.begin(), r.accepted.end(), &ref_acc[(size_t)i * d.C]);
            std::copy(r.margin.begin(), r.margin.end(), &ref_margin[(size_t)i * d.C]);
            std::copy(r.delta_h.begin(), r.delta_h.end(), &ref_dh[(size_t)i * d.C]);
        }
        for (const auto& v : variants) {
            poison(d_log_w, rows * sizeof(double)), poison(d_accepted, rows * sizeof(int));
            poison(d_z, rows * LATENT_DIM * sizeof(float)), poison(d_proposal, rows * 2 * LATENT_DIM * sizeof(float));
            poison(d_delta_h, rows * sizeof(float));
            v.second(io_for(n, d.T));
            cudaCheck(cudaGetLastError()), cudaCheck(cudaDeviceSynchronize());
            std::vector<double> log_w(rows);
            std::vector<int> acc(rows);
            cudaCheck(cudaMemcpy(log_w.data(), d_log_w, rows * sizeof(double), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(acc.data(), d_accepted, rows * sizeof(int), cudaMemcpyDeviceToHost));
            const std::vector<float> z = copy_to_host_float(d_z, rows * LATENT_DIM);
            const std::vector<float> prop = copy_to_host_float(d_proposal, rows * 2 * LATENT_DIM);
            const std::vector<float> dh = copy_to_host_float(d_delta_h, rows);
            // a value not finite on either side fails (std::max would skip a NaN)
            double diff[4] = {}, top[4] = {}; // log w, z, the trajectory's end, the last energy change (absolute)
            auto compare = [&](int k, double got, double ref) {
                diff[k] = std::isfinite(got) && std::isfinite(ref) ? std::max(diff[k], std::fabs(got - ref)) : INFINITY;
                top[k] = std::max(top[k], std::fabs(ref));
            };
            size_t unwritten = 0, near = 0, differ = 0;
            for (size_t r = 0; r < rows; r++) {
                bool finite = std::isfinite(log_w[r]);
                for (int j = 0; j < LATENT_DIM; j++) finite = finite && std::isfinite(z[r * LATENT_DIM + j]);
                if (acc[r] < 0 || acc[r] > d.T - 1 || !finite) { // NaN-poisoned (0xFFFFFFFF), or not finite
                    unwritten++;
                    continue;
                }
                if (!(ref_margin[r] >= band)) { // a test this close may go either way
                    near++;
                    continue;
                }
                if (acc[r] != ref_acc[r]) {
                    differ++;
                    continue;
                }
                compare(0, log_w[r], ref_w[r]);
                for (int j = 0; j < LATENT_DIM; j++) compare(1, z[r * LATENT_DIM + j], ref_z[r * LATENT_DIM + j]);
                for (int j = 0; j < 2 * LATENT_DIM; j++)
                    compare(2, prop[r * 2 * LATENT_DIM + j], ref_prop[r * 2 * LATENT_DIM + j]);
                compare(3, dh[r], ref_dh[r]);
            }
            const double e_w = diff[0] / top[0], e_z = diff[1] / top[1], e_p = diff[2] / top[2];
            const size_t compared = rows - unwritten - near - differ;
            const bool good = unwritten == 0 && differ == 0 && compared >= min_compared * rows && e_w <= tol_w &&
                              e_z <= tol_zp && e_p <= tol_zp && std::isfinite(diff[3]);
            printf("check %-16s images %4d: %5zu of %5zu chains compared (%zu near a threshold), %zu decide otherwise, "
                   "%zu unwritten or not finite; log w %.2e (%.0e), z %.2e, trajectory end (z, p) %.2e (%.0e); last "
                   "energy change off by %.2e nats %s\n", v.first, n, compared, rows, near, differ, unwritten, e_w,
                   tol_w, e_z, e_p, tol_zp, diff[3], good ? "OK" : "FAIL");
            ok = ok && good;
        }
    }
    if (ok) {
        const size_t rows_timed = (size_t)images_timed * d.C;
        const int extra = 20, T_timed = 2 + (d.per_transition ? extra : 0);
        std::vector<double> beta(T_timed + 1);
        ais_schedule(beta.data(), T_timed);
        cudaCheck(cudaFree(d_beta));
        d_beta = device_upload(beta); // both launches' (T = 2 reads b_0 .. b_2 of T = 22's: the cost is the same)
        printf("%-28s %8s %18s %14s %10s %8s %14s\n", "variant", "chains",
               d.per_transition ? "us / transition" : "us / leapfrog step", "evals / s", "TFLOP/s", "% floor",
               "--ais 1000 (s)");
        for (const auto& v : variants) {
            float us[2];
            for (int i = 0; i < 2; i++) {
                AisIO io = io_for(images_timed, d.per_transition ? 2 + i * extra : 2);
                if (!d.per_transition) io.leapfrog = 1 + i * extra;
                us[i] = benchmark_us([&] { v.second(io); }, 5, 1, false);
            }
            const double per_unit = (us[1] - us[0]) / extra;
            const double evals_per_s = rows_timed * (d.per_transition ? d.L : 1) / (per_unit * 1e-6);
            const double tflops = evals_per_s * ais_flops_per_eval(PUBLISHED_DIMS) * 1e-12;
            // --ais 1000 over the test set: 10000 images x 16 chains x 999 transitions of 10 evaluations
            printf("%-28s %8zu %18.2f %14.3e %10.1f %7.1f%% %14.2f\n", v.first, rows_timed, per_unit, evals_per_s,
                   tflops, 100.0 * tflops / 770.0, 1.6e9 / evals_per_s);
        }
    }
    void* buffers[] = {d_pixels, d_mulv, d_beta, d_log_w, d_accepted, d_step, d_z, d_proposal, d_delta_h};
    for (void* b : buffers) cudaCheck(cudaFree(b));
    return ok;
}

}  // namespace vae
