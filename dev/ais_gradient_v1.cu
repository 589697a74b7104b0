// AIS gradient v1: the step that is 95% of --ais, on its own. This driver checks and times vae.cu's
// ais_gradient, the decoder's forward and backward pass w.r.t. z on mma.sync, as fp32's ais_kernel runs
// it (and bf16's did before ais_gradient_wgmma, dev/ais_gradient_v2.cu, replaced it): a cluster of
// blocks (bf16: 4, fp32: 8) per 128 chains, each block one resident column block of fc4 (bf16 200
// logits, fp32 104 in hi and lo copies) and all of fc3 in fp16 hi and lo parts; per evaluation each
// warp runs 16 chains through
//   forward   fc3 16 hidden units at a time (mma.sync, three products: ~fp32), its ReLU straight into
//             fc4's A fragments, fc4 over the block's columns (B by ldmatrix)
//   epilogue  the BCE share and sigmoid(l) - x in place of the logits, in registers
//   backward  (sigmoid - x) W4 over the block's columns (B by ldmatrix.trans of the same rows), the
//             ReLU's mask, then dz += dh W3
//   merge     the blocks' 84-byte shares of each row (grad, BCE) added in rank order through
//             distributed shared memory: two cluster barriers per evaluation (now two mbarriers
//             a warpgroup, where it meets only its counterparts in the other blocks)
// Its kernel here wraps ais_gradient in a loop of `evals` evaluations of the same z, so the time of
// one evaluation is the difference of two loop lengths, the weights' load and the launch left out.
// That is the whole of --ais but the HMC arithmetic (a few hundred FLOPs a chain per evaluation).
//
// Prediction (the worklog's first AIS row): mma.sync at half of wgmma's rate on 1.29 MFLOP an
// evaluation plus fc3's recomputation per column block: ~250 TFLOP/s. Measured --ais 1000: bf16
// 13.4 s = 154 TFLOP/s of useful work, so this driver's number is the upper bound of what the HMC
// loop around it leaves.
// Result (H100): bf16 25.41 us an evaluation at 3,840 rows, 194 TFLOP/s (--ais 1000 10.6 s if the HMC
// loop cost nothing), fp32 36.00 us, 68.6 TFLOP/s: 22% under the prediction. dev/ais_hmc_v1.cu finds
// the loop around it adds 14-19%.
//
// Build and run from the repository root (needs data/: make data; sm_90a, thread block clusters):
//   make -C dev ais_gradient_v1 && ./dev/ais_gradient_v1
#include "common.h"

template <Precision P>
__global__ void __launch_bounds__(AIS_THREADS, 1)
    gradient_v1_kernel(const typename Path<P>::T* __restrict__ fc4_wb, const fp16* __restrict__ ais_w3,
                       const vae::AisGradientArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) uint8_t smem_raw[];
    AisSmem<P>& sm = *reinterpret_cast<AisSmem<P>*>(smem_raw);
    int skip;
    const int col0 = ais_columns<P>(cluster_rank(), &skip);
    ais_load_weights(sm, fc4_wb, ais_w3, col0);
    ais_meet_init<Path<P>::AIS_CLUSTER>(sm.meet);
    uint32_t merges = 0;
    vae::ais_driver_tiles(a, col0, [&](const float (&z)[2][AIS_LATENTS], const uint8_t* const (&x_row)[2],
                                       float (&grad)[2][AIS_LATENTS], float (&bce)[2], bool energy) {
        ais_gradient<P>(sm, merges, z, x_row, skip, grad, bce, energy);
    });
    cluster_sync();
#endif
}

template <Precision P> static int v1_clusters() {
    cudaCheck(cudaFuncSetAttribute(gradient_v1_kernel<P>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)sizeof(AisSmem<P>)));
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t cfg = ais_config<P>(&attr, 1, 0);
    cfg.dynamicSmemBytes = sizeof(AisSmem<P>); // bf16's ais_kernel asks for wgmma's layout
    int clusters = 0;
    cudaCheck(cudaOccupancyMaxActiveClusters(&clusters, gradient_v1_kernel<P>, &cfg));
    return clusters;
}

template <Precision P> static bool study(const HostWeights* w, const Images* images) {
    VAE m;
    vae_init(&m, w, 1, P);
    if (m.ais_clusters == 0)
        fail("no sm_90a code for this GPU: build with make -C dev ais_gradient_v1 on a Hopper GPU");
    const int clusters = v1_clusters<P>();
    printf("%s: clusters of %d blocks, %zu bytes of shared memory a block, %d clusters at once\n", PRECISION_NAMES[P],
           Path<P>::AIS_CLUSTER, sizeof(AisSmem<P>), clusters);
    typedef typename Path<P>::T T;
    auto launch_v1 = [&](const vae::AisGradientArgs& a) {
        const int tiles = ceil_div(a.rows, AIS_ROWS);
        cudaLaunchAttribute attr;
        cudaLaunchConfig_t cfg = ais_config<P>(&attr, clusters < tiles ? clusters : tiles, 0);
        cfg.dynamicSmemBytes = sizeof(AisSmem<P>);
        cudaCheck(cudaLaunchKernelEx(&cfg, gradient_v1_kernel<P>, static_cast<const T*>(m.fc4_wb),
                                     static_cast<const fp16*>(m.ais_w3), a));
    };
    // bf16: fc4's operands in bf16 (2^-9 each) leave a few 1e-3 (the worklog's third AIS row); fp32 ~1e-6
    const double tol = P == PRECISION_BF16 ? 2e-2 : 1e-5;
    const bool ok = vae::run_ais_gradient_driver({{P == PRECISION_BF16 ? "v1 mma.sync bf16" : "v1 mma.sync fp32",
                                                   launch_v1}},
                                                 &m, w, images, clusters * AIS_ROWS, tol);
    vae_free(&m);
    return ok;
}

int main() {
    HostWeights weights;
    Images images;
    vae::load_model_inputs("ais_gradient_v1", &weights, &images);
    print_device_info();
    const bool ok = study<PRECISION_BF16>(&weights, &images) & study<PRECISION_FP32>(&weights, &images);
    free(weights.data), free(images.pixels);
    return ok ? 0 : 1;
}
