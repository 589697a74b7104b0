// AIS HMC v1: ais_kernel's leapfrog step and its whole transition, each checked against float64 and
// timed on its own (the gradient alone is dev/ais_gradient_v1.cu).
//
// Leapfrog step: z += eps p, the gradient (the decoder forward and backward w.r.t. z), p -= eps
// grad U_b: 1.29 MFLOP a chain for the gradient against ~60 FLOPs for the two updates. Prediction: a
// step costs one evaluation of ais_gradient_v1 within 2%. More than that is the price of the HMC
// state ais_kernel keeps in registers beside the gradient's (z, p, the start's z, grad and BCE, mu
// and 1 / var: ~60 registers a thread): spills, or warps the scheduler cannot find ready; the gap is
// what moving that state out of registers (the plan for dev/ais_gradient_v2.cu's wgmma) would win.
// Check: one transition on the schedule 0, 1, 1 (the trajectory targets the posterior) from
// z ~ q(z|x), C = 1, L = 10, on 1, 7, 37 and 1023 images: the trajectory's end (z_L, p_L) before its
// Metropolis test, the decision, the final z and the weight. Time: L = 1 against L = 21.
//
// Transition: a momentum draw (10 Philox calls a chain), the start's energy, L leapfrog steps, the
// end's energy, the Metropolis test (one more Philox call), the block's barriers around each image's
// acceptance count. At L = 10, 10 evaluations and a few hundred FLOPs besides: the prediction is 10
// leapfrog steps within 3%, and its projection of --ais 1000 (999 transitions a chain) matches
// ./vae's measured 13.4 s (bf16) and 35.0 s (fp32), both on mma.sync then. Check: T = 4 (three
// transitions on the sigmoid schedule) of C = 16 chains from q on 1, 7 and 37 images, decision by
// decision. Time: T = 2 against T = 22.
// Both at a fixed step of 0.05 (no adaptation: chains stay independent, so a decision that goes the
// other way costs one chain's comparison, not its image's) and a full round of the GPU's clusters.
//
// Result (H200, bf16's ais_kernel still on mma.sync, since replaced by the wgmma gradient,
// dev/ais_gradient_v2.cu): a leapfrog step 30.29 us (bf16, 3,840 chains) and 41.09 us (fp32, 1,920):
// 19% and 14% over the gradient alone (25.41 and 36.00 us on the H100): missed, the HMC state in
// registers costs 7-10x the 2% predicted. A transition 303.27 and 412.10 us, 10.01 and 10.03 steps:
// held; its projection of --ais 1000, 12.64 s and 34.34 s, against ./vae's 12.70 s and 34.51 s. fp32
// matches float64 within 4.5e-6 at every trajectory's end; bf16 as dev/ais_common.h's run_ais_chain_driver
// says. Since then part of that state left the registers (vae.cu's AIS_STATE_SLOTS: mu, 1 / var and the
// start's z, grad and BCE in memory; z and p stay).
//
// The float64 reference (dev/ais_common.h's cpu_ais_image) is itself checked without a GPU against
// dev/ais_pytorch.py's AIS, written from the maths: --reference CSV runs it with step-size adaptation
// on 8 images at T = 5, C = 4, L = 3, seed 0 (its encoder: cpu_encode) and writes ./vae --csv's
// format for ais_pytorch.py --check (1.5e-8 apart, every acceptance alike).
//
// Build and run from the repository root (needs data/: make data; sm_90a, thread block clusters):
//   make -C dev ais_hmc_v1 && ./dev/ais_hmc_v1
//   ./dev/ais_hmc_v1 --reference /tmp/ref.csv && python3 dev/ais_pytorch.py --check /tmp/ref.csv
#include "ais_common.h"

// The reference's AIS in ./vae --csv's columns (index, label, log_px, ess, acceptance; label -1,
// ess 0: ais_pytorch.py reads log_px and acceptance), on the host alone.
static void write_reference_csv(const HostWeights* w, const Images* images, const char* path) {
    const int n = 8, T = 5, C = 4, L = 3;
    std::vector<double> beta(T + 1);
    ais_schedule(beta.data(), T);
    std::vector<double> x((size_t)n * INPUT_DIM), mu((size_t)n * LATENT_DIM), logvar((size_t)n * LATENT_DIM);
    for (size_t i = 0; i < x.size(); i++) x[i] = images->pixels[i] / 255.0;
    cpu_encode(w, PUBLISHED_DIMS, x.data(), n, NULL, mu.data(), logvar.data());
    std::vector<float> mulv((size_t)n * MULV_DIM); // the encoder's floats, as ais_kernel reads them
    FILE* f = fopen(path, "w");
    if (f == NULL) fail("%s: %s", path, strerror(errno));
    fprintf(f, "index,label,log_px,ess,acceptance\n");
    for (int i = 0; i < n; i++) {
        std::copy_n(&mu[(size_t)i * LATENT_DIM], LATENT_DIM, &mulv[(size_t)i * MULV_DIM]);
        std::copy_n(&logvar[(size_t)i * LATENT_DIM], LATENT_DIM, &mulv[(size_t)i * MULV_DIM + LATENT_DIM]);
        const vae::CpuAisImage r = vae::cpu_ais_image(w, images->pixels + (size_t)i * INPUT_DIM,
                                                      &mulv[(size_t)i * MULV_DIM], beta.data(), T, C, L, i, 0,
                                                      AIS_STEP_START, true);
        const double top = *std::max_element(r.log_w.begin(), r.log_w.end());
        double sum = 0.0;
        int taken = 0;
        for (int c = 0; c < C; c++) sum += std::exp(r.log_w[c] - top), taken += r.accepted[c];
        fprintf(f, "%d,-1,%.9f,0,%.6f\n", i, top + std::log(sum / C), (double)taken / (C * (T - 1)));
    }
    if (fclose(f) != 0) fail("%s: %s", path, strerror(errno));
    printf("wrote %s: check it with python3 dev/ais_pytorch.py --check %s\n", path, path);
}

template <Precision P> static bool study(const HostWeights* w, const Images* images) {
    VAE m;
    vae_init(&m, w, images->count, P, KERNELS_FUSED);
    const Fused* f = m.fused;
    if (f->ais_clusters == 0) fail("no sm_90a code for this GPU: build with make -C dev ais_hmc_v1 on a Hopper GPU");
    auto production = [&](const AisIO& io) {
        ais_launch<P>(io, f->fc4_wb, f->w4_map, f->ais_w3, f->ais_state, f->ais_clusters, 0);
    };
    const vae::AisChainDriver leapfrog = {"leapfrog step", 2, 1, 10, {0.0, 1.0, 1.0}, {1, 7, 37, 1023}, false};
    std::vector<double> beta(5);
    ais_schedule(beta.data(), 4);
    const vae::AisChainDriver transition = {"transition", 4, 16, 10, beta, {1, 7, 37}, true};
    bool ok = true;
    for (const vae::AisChainDriver& d : {leapfrog, transition}) {
        const int images_timed = std::min(fused_ais_images(f, d.C), images->count);
        ok = vae::run_ais_chain_driver({{"v1 ais_kernel", production}}, &m, w, images, d, images_timed) && ok;
    }
    vae_free(&m);
    return ok;
}

int main(int argc, char** argv) {
    HostWeights weights;
    Images images;
    vae::load_model_inputs("ais_hmc_v1", &weights, &images);
    if (argc == 3 && !strcmp(argv[1], "--reference")) {
        write_reference_csv(&weights, &images, argv[2]);
        free(weights.data), free(images.pixels);
        return 0;
    }
    if (argc != 1) fail("usage: ./dev/ais_hmc_v1 [--reference CSV]");
    print_device_info();
    const bool ok = study<PRECISION_BF16>(&weights, &images) & study<PRECISION_FP32>(&weights, &images);
    free(weights.data), free(images.pixels);
    return ok ? 0 : 1;
}
