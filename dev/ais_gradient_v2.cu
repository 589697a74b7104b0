// AIS gradient v2: v1's design (dev/ais_gradient_v1.cu) with fc4's two products on Hopper's wgmma
// (bf16). Same cluster of 4 blocks per 128 chains, same resident column block of 200 logits, same
// fc3 (mma.sync, fp16 hi and lo parts), epilogue, W3 backward and merge: vae.cu's own ais_fc3_chunk,
// ais_epilogue, ais_w3_backward and ais_merge. What changes is who multiplies by W4:
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
// shares (128 x 22 floats: 11,264) + the whole AIS's step sizes and acceptances (1,024) = 229,896
// of the 232,448 a block may have (less 1,024 to align): the mask of fc3's ReLU moves into
// registers (a 32-bit word per 64 hidden units: 7 a thread).
// The driver then runs the whole AIS on this gradient (ais_v2_kernel: vae.cu's ais_chains around it)
// beside ais_kernel, through dev/ais_hmc_v1.cu's transition check and time.
// Result (H200): 22.40 us an evaluation (221 TFLOP/s), against v1's 25.41 (H100): 12% faster, not
// the 3x predicted; grad equal to ais_kernel's bit for bit. The whole AIS: 251.2 us a transition
// against ais_kernel's 303.3 (-17%), --ais 1000 ~10.5 s. Half right about the instructions, wrong
// about what binds: fc4's issue was not the limit, and fc3, the epilogue and the two cluster barriers
// an evaluation now take most of the time with only two warpgroups a block to hide them (the ncu
// capture caught the 1-row launch, so that is inferred from ais_kernel's profile, not measured here).
//
// Build and run from the repository root (needs data/: make data; sm_90a):
//   make -C dev ais_gradient_v2 && ./dev/ais_gradient_v2
#include "common.h"

constexpr int V2_BN = Path<PRECISION_BF16>::AIS_BN, V2_CLUSTER = Path<PRECISION_BF16>::AIS_CLUSTER;
constexpr int V2_GROUPS = DEC_WG_SLICES, V2_SLICE_BYTES = V2_BN * 128, V2_K_STEPS = (V2_BN + 15) / 16;
constexpr int V2_SHARE = LATENT_DIM + 2; // a row's share: 20 grad components, the BCE, one to keep float2s aligned

struct AisWgmmaSmem {
    bf16 w4[V2_GROUPS][V2_BN][64]; // the block's fc4 rows, K in 64-wide slices, 128-byte swizzle (TMA)
    fp16 w3[2][HIDDEN_DIM][AIS_W3_K]; // right after w4: the backward's last k16 step reads 8 rows past it
    float share[AIS_ROWS][V2_SHARE];
    float step[AIS_ROWS]; // ais_chains' (the whole AIS below): the tile's step sizes, its acceptances
    int accepted[AIS_ROWS];
    uint64_t loaded;
};
static_assert(offsetof(AisWgmmaSmem, w3) == sizeof(bf16) * V2_GROUPS * V2_BN * 64,
              "the 8 rows the backward's last k16 step reads past fc4 (times zero A) are fc3's: finite");
static_assert(sizeof(AisWgmmaSmem) + 1024 <= 232448, "fits a block's shared memory, with room to align");

// wgmma descriptor of a 16-bit tile read MN-major in the 128-byte swizzle layout: rows of 64
// values (128 bytes) along N, 8-row atoms along K 1024 bytes apart (the stride field); the
// leading field, the step between 64-wide N atoms, is not used at N <= 64.
__device__ inline uint64_t smem_desc_128b_mn(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)(1024 >> 4) << 16 | (uint64_t)(1024 >> 4) << 32 |
           (uint64_t)1 << 62;
}

// D[64 x N] (+)= A[64 x 16] B[16 x N], A from registers (bf16), B MN-major (imm-trans-b = 1).
__device__ inline void wgmma_m64n64k16_rs_mn(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                   "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                   "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"((int)accumulate)
                 : "memory");
}
// BCE and grad_z BCE for the warpgroup's 64 rows (each warp its 16, z as in ais_gradient); w4: the
// shared-memory address of sm.w4.
__device__ inline void ais_gradient_v2(AisWgmmaSmem& sm, uint32_t w4, const float (&z)[2][AIS_LATENTS],
                                       const uint8_t* const (&x_row)[2], int skip, float (&grad)[2][AIS_LATENTS],
                                       float (&bce)[2]) {
    const int t = threadIdx.x % 4;
    uint32_t za[2][4], za_lo[2][4];
    ais_z_fragments(z, za, za_lo);
    uint32_t mask[V2_GROUPS]; // fc3's ReLU: bit 8i + b of group q is value b of chunk 4q + i
    float logit[V2_BN / 2];
    uint32_t a[2][4][4]; // two groups' A fragments: one being read by wgmma, one being written
    const uint32_t a_bias[4] = {bias_ones<bf16>(t), bias_ones<bf16>(t), 0u, 0u};
    #pragma unroll
    for (int q = 0; q < V2_GROUPS; q++) {
        const int chunks = q < V2_GROUPS - 1 ? 4 : 1; // 400 = 6 x 64 + 16
        mask[q] = 0u;
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            if (i < chunks) {
                float h[8];
                mask[q] |= ais_fc3_chunk(sm.w3, za, za_lo, 4 * q + i, h) << (8 * i);
                uint32_t hi[1][4], lo[1][4];
                relu_to_a<bf16>(hi, lo, h);
                #pragma unroll
                for (int r = 0; r < 4; r++) a[q % 2][i][r] = hi[0][r];
            } else if (i == chunks) { // the last group's next k16 step: K = 400..415, the bias parts
                #pragma unroll
                for (int r = 0; r < 4; r++) a[q % 2][i][r] = a_bias[r];
            }
        }
        wgmma_fence();
        #pragma unroll
        for (int i = 0; i < 4; i++)
            if (i < chunks + (q == V2_GROUPS - 1 ? 1 : 0))
                wgmma_m64n200k16_rs(logit, a[q % 2][i], smem_desc_128b(w4 + q * V2_SLICE_BYTES) + 2 * i, q + i > 0);
        wgmma_commit();
        wgmma_wait<1>(); // the group before is done: its A registers are free for the next
    }
    wgmma_wait<0>();
    fence_accumulators(logit);
    float bce_share[2];
    ais_epilogue(logit, x_row, skip, bce_share);
    uint32_t ga[V2_K_STEPS][4];
    #pragma unroll
    for (int s = 0; s < V2_K_STEPS; s++) {
        ga[s][0] = pack2<bf16>(logit[8 * s], logit[8 * s + 1]);
        ga[s][1] = pack2<bf16>(logit[8 * s + 2], logit[8 * s + 3]);
        const bool full = 2 * s + 1 < V2_BN / 8; // the last step's K 8..15 are past the block's 200 columns
        ga[s][2] = full ? pack2<bf16>(logit[8 * s + 4], logit[8 * s + 5]) : 0u;
        ga[s][3] = full ? pack2<bf16>(logit[8 * s + 6], logit[8 * s + 7]) : 0u;
    }
    float dz[3][4] = {};
    #pragma unroll
    for (int q = 0; q < V2_GROUPS; q++) {
        float dh[32];
        const uint32_t slice = w4 + q * V2_SLICE_BYTES;
        wgmma_fence();
        #pragma unroll
        for (int s = 0; s < V2_K_STEPS; s++)
            wgmma_m64n64k16_rs_mn(dh, ga[s], smem_desc_128b_mn(slice + 2048 * s), s > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_accumulators(dh);
        #pragma unroll
        for (int i = 0; i < 4; i++)
            if (i < (q < V2_GROUPS - 1 ? 4 : 1))
                ais_w3_backward<false>(sm.w3, 4 * q + i, *reinterpret_cast<const float(*)[8]>(&dh[8 * i]),
                                       (mask[q] >> (8 * i)) & 0xFFu, dz);
    }
    ais_merge<V2_CLUSTER>(sm.share, dz, bce_share, grad, bce);
}

// The block's weights: fc4's column block col0 by TMA, fc3's hi and lo parts by cp.async.
__device__ inline void v2_load_weights(AisWgmmaSmem& sm, const CUtensorMap& w4_map, const fp16* __restrict__ ais_w3,
                                       int col0) {
    auto addr = [](const void* p) { return (uint32_t)__cvta_generic_to_shared(p); };
    if (threadIdx.x == 0) {
        const uint32_t bar = addr(&sm.loaded);
        mbar_expect_load(bar, sizeof(sm.w4));
        for (int s = 0; s < V2_GROUPS; s++) tma_load_2d(addr(&sm.w4[s][0][0]), &w4_map, bar, 64 * s, col0);
    }
    for (int copy = 0; copy < 2; copy++)
        copy_block_async(&sm.w3[copy][0][0], AIS_W3_K, ais_w3 + (size_t)copy * HIDDEN_DIM * AIS_W3_K, AIS_W3_K,
                         HIDDEN_DIM, AIS_W3_K);
    cp_async_wait<0>();
    // fc3's rows, written by cp.async (the generic proxy), are also read by the backward's wgmma (the async
    // proxy: the 8 rows past fc4): this fence makes the writes visible to it
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    mbar_wait(addr(&sm.loaded), 0);
}

__global__ void __launch_bounds__(AIS_WARPS * 32, 1)
    gradient_v2_kernel(const __grid_constant__ CUtensorMap w4_map, const fp16* __restrict__ ais_w3,
                       const vae::AisGradientArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    AisWgmmaSmem& sm = smem_aligned_1024<AisWgmmaSmem>(smem_raw);
    int skip;
    const int col0 = ais_columns<PRECISION_BF16>(cluster_rank(), &skip);
    v2_load_weights(sm, w4_map, ais_w3, col0);
    cluster_arrive();
    const uint32_t w4 = (uint32_t)__cvta_generic_to_shared(&sm.w4[0][0][0]);
    vae::ais_driver_tiles(a, col0, [&](const float (&z)[2][AIS_LATENTS], const uint8_t* const (&x_row)[2],
                                       float (&grad)[2][AIS_LATENTS], float (&bce)[2]) {
        ais_gradient_v2(sm, w4, z, x_row, skip, grad, bce);
    });
    cluster_wait();
#endif
}

// The whole AIS on this gradient: vae.cu's ais_chains (the HMC arithmetic) with ais_gradient_v2 in
// place of ais_gradient, so its transitions are ais_kernel's but for the gradient. The HMC state
// (~60 values a thread) now lives beside v2's 255 registers: this kernel's time says what that costs.
__global__ void __launch_bounds__(AIS_WARPS * 32, 1)
    ais_v2_kernel(const __grid_constant__ CUtensorMap w4_map, const fp16* __restrict__ ais_w3, const AisIO io) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    AisWgmmaSmem& sm = smem_aligned_1024<AisWgmmaSmem>(smem_raw);
    const uint32_t rank = cluster_rank();
    int skip;
    const int col0 = ais_columns<PRECISION_BF16>(rank, &skip);
    v2_load_weights(sm, w4_map, ais_w3, col0);
    cluster_arrive();
    const uint32_t w4 = (uint32_t)__cvta_generic_to_shared(&sm.w4[0][0][0]);
    ais_chains(io, rank, col0, sm.step, sm.accepted,
               [&](const float (&z)[2][AIS_LATENTS], const uint8_t* const (&x_row)[2], float (&grad)[2][AIS_LATENTS],
                   float (&bce)[2]) { ais_gradient_v2(sm, w4, z, x_row, skip, grad, bce); });
    cluster_wait();
#endif
}

int main() {
    HostWeights weights;
    Images images;
    vae::load_model_inputs("ais_gradient_v2", &weights, &images);
    print_device_info();
    VAE m;
    vae_init(&m, &weights, images.count, PRECISION_BF16);
    if (m.ais_clusters == 0)
        fail("no sm_90a code for this GPU: build with make -C dev ais_gradient_v2 on a Hopper GPU");
    const int smem = (int)sizeof(AisWgmmaSmem) + 1024;
    cudaCheck(cudaFuncSetAttribute(gradient_v2_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaCheck(cudaFuncSetAttribute(ais_v2_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    auto config = [&](cudaLaunchAttribute* attr, int clusters) {
        cudaLaunchConfig_t cfg = ais_config<PRECISION_BF16>(attr, clusters, 0);
        cfg.dynamicSmemBytes = smem;
        return cfg;
    };
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t probe = config(&attr, 1);
    int clusters = 0, ais_clusters = 0;
    cudaCheck(cudaOccupancyMaxActiveClusters(&clusters, gradient_v2_kernel, &probe));
    cudaCheck(cudaOccupancyMaxActiveClusters(&ais_clusters, ais_v2_kernel, &probe));
    printf("bf16: clusters of %d blocks, %d bytes of shared memory a block, %d clusters at once (%d for AIS)\n",
           V2_CLUSTER, smem, clusters, ais_clusters);
    auto launch_v2 = [&](const vae::AisGradientArgs& a) {
        const int tiles = ceil_div(a.rows, AIS_ROWS);
        cudaLaunchAttribute attr2;
        const cudaLaunchConfig_t cfg = config(&attr2, clusters < tiles ? clusters : tiles);
        cudaCheck(cudaLaunchKernelEx(&cfg, gradient_v2_kernel, m.w4_map, static_cast<const fp16*>(m.ais_w3), a));
    };
    // the same bf16 operands as v1 (fc4's, a few 1e-3 from float64); only the order of fp32 sums differs
    bool ok = vae::run_ais_gradient_driver({{"v2 wgmma bf16", launch_v2}}, &m, &weights, &images,
                                           clusters * AIS_ROWS, 2e-2);
    // the whole transition beside ais_kernel's (dev/ais_hmc_v1.cu's transition check and time)
    auto production = [&](const AisIO& io) {
        ais_launch<PRECISION_BF16>(io, m.fc4_wb, m.ais_w3, m.ais_clusters, 0);
    };
    auto ais_v2 = [&](const AisIO& io) {
        const int tiles = ceil_div(io.n, AIS_ROWS / io.chains);
        cudaLaunchAttribute attr2;
        const cudaLaunchConfig_t cfg = config(&attr2, ais_clusters < tiles ? ais_clusters : tiles);
        cudaCheck(cudaLaunchKernelEx(&cfg, ais_v2_kernel, m.w4_map, static_cast<const fp16*>(m.ais_w3), io));
    };
    std::vector<double> beta(5);
    ais_schedule(beta.data(), 4);
    const vae::AisChainDriver transition = {"transition", 4, 16, 10, beta, {1, 7, 37}, true};
    ok = vae::run_ais_chain_driver({{"v1 ais_kernel", production}, {"v2 wgmma", ais_v2}}, &m, &weights, &images,
                                   transition, std::min(m.ais_clusters, ais_clusters) * (AIS_ROWS / 16)) && ok;
    vae_free(&m);
    free(weights.data), free(images.pixels);
    return ok ? 0 : 1;
}
