// AIS gradient v2: v1's design (dev/ais_gradient_v1.cu) with fc4's two products on Hopper's wgmma
// (bf16). Same cluster of 4 blocks per 128 chains, same resident column block of 200 logits, same fc3
// (mma.sync, fp16 hi and lo parts), epilogue, W3 backward and merge: vae.cu's own ais_fc3_chunk,
// ais_epilogue, ais_w3_backward and ais_merge then (the first and third now v1's). What changes is who
// multiplies by W4:
//   forward   per 64 hidden units, each warp runs fc3 for its 16 rows (4 chunks of 16), and the
//             warpgroup issues 4 m64n200k16 wgmmas with those ReLUs as A from registers and W4's
//             slice as B from shared memory (K-major, the 128-byte swizzle TMA writes: the decoder's
//             layout); the next group's fc3 runs while they do
//   backward  dh[64 x 64 hidden] = (sigmoid - x)[64 x 200] W4[200 x 64]: A = the epilogue's values
//             (13 k16 steps, in registers), B = the same shared memory read MN-major (wgmma's
//             transpose bit, 16-bit types only): a k16 step of pixels is 16 rows of 128 bytes, two
//             8-row swizzle atoms 1024 bytes apart. 7 groups of n64; the last one's units 400..447
//             are fc4's bias parts and TMA's zeros, computed and dropped: an n16 wgmma would save
//             that 12% of the backward's products, but an MN-major tile narrower than the 64-wide
//             swizzle atom is not a layout the PTX ISA describes
// Hypothesis: v1 is bound by the issue of mma.sync and ldmatrix, not by the tensor cores: each warp
// loads every B fragment of fc4 for 16 rows, 1,275 mma.sync and ~1,900 ldmatrix a warp per
// evaluation. A wgmma reads B once for 64 rows and is one instruction per 64 x 200 x 16: fc4's
// instructions drop ~30x, its shared-memory reads 4x. fc3 stays on mma.sync (300 a warp, 3
// products: ~19% of v1's MMAs) and becomes the larger share of the issue.
// Arithmetic: 41 MFLOP of fc4 per block per evaluation at ~5.8 TFLOP/s an SM (770 / 132) is 7 us;
// fc3's 2,400 mma.sync a block ~3 us if not overlapped; the epilogue's 25,600 exp2 + divide ~1.7 us
// of the SFU, under the other warpgroup's MMAs. Prediction: ~12 us an evaluation of 128 rows per
// cluster, against v1's measured ~35 (from --ais 1000: 13.4 s); --ais 1000 ~5 s.
// Shared memory: fc4's 7 slices of 200 x 64 bf16 (179,200 bytes) + fc3 hi and lo (38,400) + the
// shares (128 x 24 floats: 12,288) + the whole AIS's step sizes and acceptances (1,024) = 230,920
// of the 232,448 a block may have (less 1,024 to align): the mask of fc3's ReLU moves into
// registers (a 32-bit word per 64 hidden units: 7 a thread).
// The driver then ran the whole AIS on this gradient (ais_v2_kernel: vae.cu's ais_chains around it)
// beside ais_kernel, through dev/ais_hmc_v1.cu's transition check and time.
// Result (H200): 22.40 us an evaluation (221 TFLOP/s), against v1's 25.41 (H100): 12% faster, not
// the 3x predicted; grad equal to ais_kernel's bit for bit. The whole AIS: 251.2 us a transition
// against ais_kernel's 303.3 (-17%), --ais 1000 ~10.5 s. Half right about the instructions, wrong
// about what binds: fc4's issue was not the limit, and fc3, the epilogue and the two cluster barriers
// an evaluation now take most of the time with only two warpgroups a block to hide them (the ncu
// capture caught the 1-row launch, so that is inferred from ais_kernel's profile, not measured here).
// Then vae.cu's bf16 gradient (ais_gradient_wgmma, ais_load_weights_wgmma: ais_kernel<PRECISION_BF16>).
// Since the warpgroups run apart (their own tiles, their own meetings in the merge) and take turns at
// the tensor cores (ais_turn_wait): 17.61 us an evaluation (281 TFLOP/s), the whole AIS 207.7 us a
// transition against 224.6 on the mma.sync gradient (H200). Since then fc3 and its backward moved onto
// wgmma too (ais_fc3_wgmma, fc3's parts in core matrices: the design above is v2's, the header's
// numbers are history): the whole AIS 141.9 us a transition, 118.0 once fc3's ReLU mask came off fc4's
// A fragments, 114.6 with fc3 in four k16 steps and the chain state in memory; the gradient alone
// here, which evaluates with the energy every time, 12.45 us, then 18.83 once the epilogue loaded its
// pixels first (it spills in this kernel; worklog, AIS), 17.70 while ptxas serialized this kernel's
// wgmmas for want of registers, 10.69 since 7602c85 and 2ab90a6 (no longer serialized).
// fp32 on the same design (ais_gradient_wgmma<PRECISION_FP32>; the mma.sync gradient is v1's now,
// and the whole AIS on it, this driver's baseline kernel before, is retired): fc4's hi and lo copies
// as 8 x 8 core matrices without swizzle (AisFc4Cores: K = 408, 169,728 bytes; two copies in 64-wide
// swizzle slices, 186,368, do not fit beside fc3 and the shares), every product three wgmmas (lo hi,
// hi lo, hi hi): m64n104k16 forward, m64n64k16 MN-major backward, and the backward through fc3 with
// its lo part too.
// Hypothesis: fp32 on mma.sync was bound by the issue of its mma.sync and ldmatrix as bf16 had been,
// three times over; on wgmma it becomes tensor work, 3 x 2.06 PFLOP of fp16 products for --ais 1000.
// Arithmetic: 6.2 PFLOP at bf16's 55% of 770 TFLOP/s is 14.6 s; the epilogue and merge no longer hide
// behind the other warpgroup's products as well, and fp32's lo parts double the A fragments'
// registers (spills). Prediction: --ais 1000 fp32 15 to 20 s, against 31.1 s.
// Result (H200, one call): the gradient alone 18.08 us an evaluation of 1,920 rows against v1's 28.58
// (1.58x), ais_kernel 205.42 us a transition; --ais 100 3.09 -> 1.71 s, --ais 1000 31.1 -> 17.19 s:
// inside the prediction, at 47% of the 8.0 s floor. Its first build had ptxas serialize the wgmmas
// (worklog, AIS); fp32 keeps one buffer of A and dh where bf16 has two (fewer spills: -4%).
// This driver now checks and times both precisions: the gradient alone as below, then the whole
// transition on ais_kernel itself.
//
// Build and run from the repository root (needs data/: make data; sm_90a):
//   make -C dev ais_gradient_v2 && ./dev/ais_gradient_v2
#include "ais_common.h"

template <Precision P>
__global__ void __launch_bounds__(AIS_THREADS, 1)
    gradient_v2_kernel(const typename Path<P>::T* __restrict__ fc4_wb, const __grid_constant__ CUtensorMap w4_map,
                       const fp16* __restrict__ ais_w3, const vae::AisGradientArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    AisWgmmaSmem<P>& sm = smem_aligned_1024<AisWgmmaSmem<P>>(smem_raw);
    int skip;
    const int col0 = ais_columns<P>(cluster_rank(), &skip);
    ais_load_weights_wgmma(sm, w4_map, fc4_wb, ais_w3, col0);
    ais_meet_init<Path<P>::AIS_CLUSTER>(sm.meet);
    if (threadIdx.x >= 128) named_bar_arrive(AIS_BAR_TURN, 256); // warpgroup 0 takes the first turn
    uint32_t merges = 0;
    const uint32_t w4 = (uint32_t)__cvta_generic_to_shared(&sm.w4);
    vae::ais_driver_tiles(a, col0, [&](const float (&z)[2][AIS_LATENTS], const uint8_t* const (&x_row)[2],
                                       float (&grad)[2][AIS_LATENTS], float (&bce)[2], bool energy) {
        ais_gradient_wgmma<P>(sm, w4, merges, z, x_row, skip, grad, bce, energy);
    });
    if (threadIdx.x < 128) named_bar_sync(AIS_BAR_TURN, 256); // warpgroup 1's last hand-over
    cluster_sync();
#endif
}

template <Precision P> static bool study(const HostWeights* w, const Images* images) {
    typedef typename Path<P>::T T;
    VAE m;
    vae_init(&m, w, images->count, P, KERNELS_FUSED);
    const Fused* f = m.fused;
    if (f->ais_clusters == 0)
        fail("no sm_90a code for this GPU: build with make -C dev ais_gradient_v2 on a Hopper GPU");
    const int smem = ais_smem<P>();
    cudaCheck(cudaFuncSetAttribute(gradient_v2_kernel<P>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t probe = ais_config<P>(&attr, 1, 0);
    int clusters = 0;
    cudaCheck(cudaOccupancyMaxActiveClusters(&clusters, gradient_v2_kernel<P>, &probe));
    printf("%s: clusters of %d blocks, %d bytes of shared memory a block, %d clusters at once (%d for ais_kernel)\n",
           PRECISION_NAMES[P], Path<P>::AIS_CLUSTER, smem, clusters, f->ais_clusters);
    auto launch_v2 = [&](const vae::AisGradientArgs& a) {
        const int tiles = ceil_div(a.rows, AIS_ROWS);
        cudaLaunchAttribute attr2;
        const cudaLaunchConfig_t cfg = ais_config<P>(&attr2, clusters < tiles ? clusters : tiles, 0);
        cudaCheck(cudaLaunchKernelEx(&cfg, gradient_v2_kernel<P>, static_cast<const T*>(f->fc4_wb), f->w4_map,
                                     static_cast<const fp16*>(f->ais_w3), a));
    };
    // bf16: the same bf16 operands as v1 (fc4's, a few 1e-3 from float64); fp32: ~1e-6
    const double tol = P == PRECISION_BF16 ? 2e-2 : 1e-5;
    bool ok = vae::run_ais_gradient_driver({{P == PRECISION_BF16 ? "v2 wgmma bf16" : "v2 wgmma fp32", launch_v2}}, &m,
                                           w, images, clusters * AIS_ROWS, tol);
    // the whole transition (dev/ais_hmc_v1.cu's transition check and time) on ais_kernel itself
    auto production = [&](const AisIO& io) {
        ais_launch<P>(io, f->fc4_wb, f->w4_map, f->ais_w3, f->ais_state, f->ais_clusters, 0);
    };
    std::vector<double> beta(5);
    ais_schedule(beta.data(), 4);
    const vae::AisChainDriver transition = {"transition", 4, 16, 10, beta, {1, 7, 37}, true};
    ok = vae::run_ais_chain_driver({{"v2 ais_kernel", production}}, &m, w, images, transition,
                                   fused_ais_images(f, 16)) && ok;
    vae_free(&m);
    return ok;
}

int main() {
    HostWeights weights;
    Images images;
    vae::load_model_inputs("ais_gradient_v2", &weights, &images);
    print_device_info();
    const bool ok = study<PRECISION_BF16>(&weights, &images) & study<PRECISION_FP32>(&weights, &images);
    free(weights.data), free(images.pixels);
    return ok ? 0 : 1;
}
