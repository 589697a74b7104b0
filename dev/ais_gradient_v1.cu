// AIS gradient v1: the step that is 95% of --ais, on its own. This driver checks and times
// ais_gradient, the decoder's forward and backward pass w.r.t. z on mma.sync, as bf16's ais_kernel
// ran it until ais_gradient_wgmma (dev/ais_gradient_v2.cu) replaced it, and fp32's until that
// function took fp32 too (written out here with its shared memory and loads: vae.cu no longer runs
// it): a cluster of blocks (bf16: 4, fp32: 8) per 128 chains, each block one resident column block of
// fc4 (bf16 200 logits, fp32 104 in hi and lo copies) and all of fc3 in fp16 hi and lo parts; per
// evaluation each warp runs 16 chains through
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
#include "ais_common.h"

// The block's shared memory: fc4's and fc3's rows as ldmatrix and the fragment loads read them.
template <Precision P> struct AisSmem {
    typename Path<P>::T w4[Path<P>::SPLIT ? 2 : 1][Path<P>::AIS_BN][FC4_K]; // the block's columns of fc4
    fp16 w3[2][HIDDEN_DIM][AIS_W3_K];                                       // all of fc3, hi and lo parts
    float share[AIS_ROWS][AIS_SHARE];             // the block's share of each row's grad and BCE (ais_merge)
    AisMeet meet;
    uint8_t mask[AIS_WARPS][HIDDEN_DIM / 16][32]; // fc3's ReLU, a byte per lane and 16 hidden units
    float step[AIS_ROWS];                         // the tiles' images' step sizes (ais_chains)
    int accepted[AIS_ROWS];                       // their chains' acceptances in this transition
};

// ldmatrix of 8 x 8 tiles transposed: W's rows as the B fragments of W^T.
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ inline void ldmatrix_x2_trans(uint32_t& r0, uint32_t& r1, const void* row) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

// fc3's pre-activations of hidden units 16c .. 16c + 15 (an m16n8 accumulator pair) and their ReLU's
// mask, a bit per value: per n8 block the two corrections (lo hi, hi lo), then hi hi, as mma_parts,
// then k24 (its B from the rows: K 8..11 of lane t < 2 are W3 lo 16 + 2t, 17 + 2t, K 12..15 of lane
// t >= 2 W3 hi 12 + 2t, 13 + 2t).
__device__ inline uint32_t ais_fc3_chunk(const AisW3 (&w3)[2][HIDDEN_DIM][AIS_W3_K], const AisZFragments& za, int c,
                                         float (&h)[8]) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    #pragma unroll
    for (int i = 0; i < 8; i++) h[i] = 0.0f;
    #pragma unroll
    for (int j = 0; j < 2; j++) {
        const AisW3* hi = &w3[0][16 * c + 8 * j + g][2 * t];
        const AisW3* lo = &w3[1][16 * c + 8 * j + g][2 * t];
        const uint32_t b[2] = {pair_at(hi), pair_at(hi + 8)}, b_lo[2] = {pair_at(lo), pair_at(lo + 8)};
        mma_parts<AisW3>(&h[4 * j], za.k16, za.k16_lo, b, b_lo);
        const uint32_t b24[2] = {pair_at(hi + 16), t < 2 ? pair_at(lo + 16) : pair_at(hi + 12)};
        mma_m16n8k16<AisW3>(&h[4 * j], za.k24, b24);
    }
    uint32_t bits = 0;
    #pragma unroll
    for (int i = 0; i < 8; i++) bits |= (h[i] > 0.0f ? 1u : 0u) << i;
    return bits;
}

// dz += (dh masked by fc3's ReLU) W3 over hidden units 16c .. 16c + 15 (dh: an m16n8 accumulator
// pair; B: W3's rows by ldmatrix.trans); three products in fp32's path, one in bf16's.
template <bool SPLIT>
__device__ inline void ais_w3_backward(const AisW3 (&w3)[2][HIDDEN_DIM][AIS_W3_K], int c, const float (&dh)[8],
                                       uint32_t bits, float (&dz)[3][4]) {
    const int lane = threadIdx.x % 32;
    const int t_row = lane % 8 + ((lane / 8) % 2) * 8, t_col = (lane / 16) * 8; // ldmatrix_x4_trans: k16 x two n8
    float m[8];
    #pragma unroll
    for (int i = 0; i < 8; i++) m[i] = (bits >> i) & 1u ? dh[i] : 0.0f;
    uint32_t a[4], a_lo[4];
    pack_parts<AisW3>(a[0], a_lo[0], m[0], m[1]);
    pack_parts<AisW3>(a[1], a_lo[1], m[2], m[3]);
    pack_parts<AisW3>(a[2], a_lo[2], m[4], m[5]);
    pack_parts<AisW3>(a[3], a_lo[3], m[6], m[7]);
    uint32_t r[4], q[4] = {}, r2[2], q2[2] = {};
    const AisW3* row = &w3[0][16 * c + t_row][0];
    ldmatrix_x4_trans(r, row + t_col);
    ldmatrix_x2_trans(r2[0], r2[1], row + 16);
    if constexpr (SPLIT) {
        ldmatrix_x4_trans(q, row + HIDDEN_DIM * AIS_W3_K + t_col);
        ldmatrix_x2_trans(q2[0], q2[1], row + HIDDEN_DIM * AIS_W3_K + 16);
    }
    const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]}, c0[2] = {q[0], q[1]}, c1[2] = {q[2], q[3]};
    if constexpr (SPLIT) {
        mma_parts<AisW3>(dz[0], a, a_lo, b0, c0), mma_parts<AisW3>(dz[1], a, a_lo, b1, c1);
        mma_parts<AisW3>(dz[2], a, a_lo, r2, q2);
    } else {
        mma_m16n8k16<AisW3>(dz[0], a, b0), mma_m16n8k16<AisW3>(dz[1], a, b1), mma_m16n8k16<AisW3>(dz[2], a, r2);
    }
}

// BCE(x, logits(z)) and grad_z BCE for a warp's 16 rows z[half][i]: this block's columns col0 ..
// col0 + AIS_BN - 1 of the product (its first `skip` n8 blocks are the block before's), then the
// cluster's shares added in rank order. x_row[half]: the row's image's pixels from col0. Its bf16
// instance equals vae.cu's ais_gradient_wgmma<PRECISION_BF16> bit for bit; fp32's adds its hi lo
// products through fc3 in another order.
template <Precision P>
__device__ inline void ais_gradient(AisSmem<P>& sm, uint32_t& merges, const float (&z)[2][AIS_LATENTS],
                                    const uint8_t* const (&x_row)[2], int skip, float (&grad)[2][AIS_LATENTS],
                                    float (&bce)[2], bool energy) {
    typedef Path<P> Q;
    typedef typename Q::T T;
    constexpr int BN = Q::AIS_BN, K_STEPS = (BN + 15) / 16; // fc4's backward K: the block's columns
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const AisZFragments za = ais_z_fragments(z);
    ais_release_shares<Path<P>::AIS_CLUSTER>(sm.meet, merges);
    // forward: fc3 16 hidden units at a time, their ReLU straight into fc4 (decoder_mma_kernel's loop)
    const int b_row = lane % 8 + (lane / 16) * 8, b_k = ((lane / 8) % 2) * 8; // ldmatrix_x4: two n8 blocks x k16
    float logit[BN / 2] = {};
    #pragma unroll 1
    for (int c = 0; c < HIDDEN_DIM / 16; c++) {
        float h[8];
        sm.mask[warp][c][lane] = (uint8_t)ais_fc3_chunk(sm.w3, za, c, h);
        uint32_t a[1][4], a_lo[1][4];
        relu_to_a<T>(a, a_lo, h);
        #pragma unroll
        for (int nt = 0; nt < BN / 8; nt += 2) {
            const T* row = &sm.w4[0][nt * 8 + b_row][16 * c + b_k];
            const T* row_lo = row + BN * FC4_K;
            if (nt + 1 < BN / 8) {
                uint32_t r[4], q[4] = {};
                ldmatrix_x4(r, row);
                if constexpr (Q::SPLIT) ldmatrix_x4(q, row_lo);
                const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]}, c0[2] = {q[0], q[1]}, c1[2] = {q[2], q[3]};
                mma_parts<T>(&logit[4 * nt], a[0], a_lo[0], b0, c0);
                mma_parts<T>(&logit[4 * nt + 4], a[0], a_lo[0], b1, c1);
            } else { // the odd last n8 block
                uint32_t b[2], b_lo[2] = {};
                ldmatrix_x2(b[0], b[1], row - (lane / 16) * 8 * FC4_K);
                if constexpr (Q::SPLIT) ldmatrix_x2(b_lo[0], b_lo[1], row_lo - (lane / 16) * 8 * FC4_K);
                mma_parts<T>(&logit[4 * nt], a[0], a_lo[0], b, b_lo);
            }
        }
    }
    const uint32_t a_bias[4] = {bias_ones<T>(t), bias_ones<T>(t), 0u, 0u};
    #pragma unroll
    for (int nt = 0; nt < BN / 8; nt++) {
        const uint32_t b[2] = {pair_at(&sm.w4[0][nt * 8 + g][HIDDEN_DIM + 2 * t]), 0u};
        mma_m16n8k16<T>(&logit[4 * nt], a_bias, b);
    }
    float bce_share[2];
    uint32_t ga[K_STEPS][4], ga_lo[K_STEPS][4];
    ais_epilogue_to_a<T>(logit, x_row, skip, energy, bce_share, ga, ga_lo);
    // backward: dh3 = (sigmoid - x) W4 over the block's columns (B: ldmatrix.trans of the same rows),
    // masked by the ReLU, then grad += dh3 W3, 16 hidden units at a time
    const int t_row = lane % 8 + ((lane / 8) % 2) * 8, t_col = (lane / 16) * 8; // ldmatrix_x4_trans: k16 x two n8
    float dz[3][4] = {};
    #pragma unroll 1
    for (int c = 0; c < HIDDEN_DIM / 16; c++) {
        float dh[8] = {};
        #pragma unroll
        for (int s = 0; s < K_STEPS; s++) {
            if (16 * s + 16 <= BN) {
                const T* row = &sm.w4[0][16 * s + t_row][16 * c + t_col];
                uint32_t r[4], q[4] = {};
                ldmatrix_x4_trans(r, row);
                if constexpr (Q::SPLIT) ldmatrix_x4_trans(q, row + BN * FC4_K);
                const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]}, c0[2] = {q[0], q[1]}, c1[2] = {q[2], q[3]};
                mma_parts<T>(&dh[0], ga[s], ga_lo[s], b0, c0);
                mma_parts<T>(&dh[4], ga[s], ga_lo[s], b1, c1);
            } else { // a last half step: 8 columns, K 8..15 of B zero
                const T* row = &sm.w4[0][16 * s + lane % 8][16 * c + ((lane / 8) % 2) * 8];
                uint32_t r0, r1, q0 = 0u, q1 = 0u;
                ldmatrix_x2_trans(r0, r1, row);
                if constexpr (Q::SPLIT) ldmatrix_x2_trans(q0, q1, row + BN * FC4_K);
                const uint32_t b0[2] = {r0, 0u}, b1[2] = {r1, 0u}, c0[2] = {q0, 0u}, c1[2] = {q1, 0u};
                mma_parts<T>(&dh[0], ga[s], ga_lo[s], b0, c0);
                mma_parts<T>(&dh[4], ga[s], ga_lo[s], b1, c1);
            }
        }
        ais_w3_backward<Q::SPLIT>(sm.w3, c, dh, sm.mask[warp][c][lane], dz);
    }
    ais_merge<Q::AIS_CLUSTER>(sm.share, sm.meet, merges, dz, bce_share, grad, bce);
}

// All of fc3's hi and lo parts into the block's shared memory as rows, by cp.async over the whole block.
__device__ inline void ais_copy_fc3_rows(AisW3 (&w3)[2][HIDDEN_DIM][AIS_W3_K], const fp16* __restrict__ ais_w3) {
    for (int copy = 0; copy < 2; copy++)
        copy_block_async(&w3[copy][0][0], AIS_W3_K, ais_w3 + (size_t)copy * HIDDEN_DIM * AIS_W3_K, AIS_W3_K,
                         HIDDEN_DIM, AIS_W3_K);
}

// The block's resident weights: fc4's rows col0 .. col0 + AIS_BN - 1 (both copies in fp32) and all of
// fc3's hi and lo parts, by cp.async over the whole block.
template <Precision P>
__device__ inline void ais_load_weights(AisSmem<P>& sm, const typename Path<P>::T* __restrict__ fc4_wb,
                                        const fp16* __restrict__ ais_w3, int col0) {
    constexpr int BN = Path<P>::AIS_BN;
    for (int copy = 0; copy < (Path<P>::SPLIT ? 2 : 1); copy++)
        copy_block_async(&sm.w4[copy][0][0], FC4_K, fc4_wb + ((size_t)copy * INPUT_DIM + col0) * FC4_K, FC4_K, BN,
                         FC4_K);
    ais_copy_fc3_rows(sm.w3, ais_w3);
    cp_async_wait<0>();
    __syncthreads();
}

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
    cfg.dynamicSmemBytes = sizeof(AisSmem<P>); // ais_kernel asks for wgmma's layout
    int clusters = 0;
    cudaCheck(cudaOccupancyMaxActiveClusters(&clusters, gradient_v1_kernel<P>, &cfg));
    return clusters;
}

template <Precision P> static bool study(const HostWeights* w, const Images* images) {
    VAE m;
    vae_init(&m, w, 1, P, KERNELS_FUSED);
    const Fused* f = m.fused;
    if (f->ais_clusters == 0)
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
        cudaCheck(cudaLaunchKernelEx(&cfg, gradient_v1_kernel<P>, static_cast<const T*>(f->fc4_wb),
                                     static_cast<const fp16*>(f->ais_w3), a));
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
