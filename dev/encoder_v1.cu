// Encoder v1: the first fused bf16 encoder - fc1 + ReLU, fc21/fc22, the sampling and the KL in one
// launch - as vae.cu first had it, and the same encoder as today's on mma.sync (encoder_mma_kernel,
// written out below), both measured against today's encoder (vae.cu's encoder_launch: the wgmma kernel).
//
// The design: a block per (slice, row tile), a fresh grid per batch.
//   grid     5 slices of 80 hidden units x ceil(B / 64) row tiles: 80 blocks at B = 1024 (on 132 SMs),
//            320 at 4096, 785 at 10000; 128 threads, 4 warps in 2 x 2, each 32 images x 40 units
//            (2 x 5 mma tiles of 16 x 8)
//   fc1      mma_mainloop_v1 over K = 784 in 13 slices of 64 (the last holds 16), a 3-stage cp.async
//            ring: pixels land as uint8 and are widened to bf16 once per slice in shared memory; the
//            slice's 80 rows of fc1 stream through the same ring, so each row tile reads them again
//            (80 x 784 bf16 = 125 KB a block, 98 MB from L2 at B = 10000)
//   h1       x W1^T / 255 + b1, ReLU, bf16, into shared memory (64 x 80): it never reaches global memory
//   fc21/22  each warp multiplies 16 rows of h1 by the slice's 80 columns of [fc21 | fc22]: a partial
//            [mu | logvar] of 64 x 40 per block
//   merge    partials through L2 (5 x 40 fp32 = 800 bytes an image) and a ticket per row tile; the
//            fifth block to arrive adds the 5 in slice order (the same sum whatever the arrival order),
//            the bias, draws eps and writes the z rows and the KL
// Today's encoder kernels turn this around: persistent blocks (one per SM) keep their slice of fc1
// resident in shared memory (134 KB, read once a launch instead of once a row tile), warps take
// 16-image tasks on their own, pixels go from global memory straight into mma fragments and h1 stays
// in registers.
//
// The driver checks both encoders against a float64 CPU encoder on ragged batches with NaN-poisoned
// outputs, checks they agree with each other, then times both, hot (L2 warm) and cold (L2 flushed).
// Everything but the v1 kernel (constants, the generator, the PTX helpers, the parsers, the model) is
// vae.cu's own, through common.h.
//
// Build and run from the repository root (needs data/: make data):
//   make -C dev encoder_v1 && ./dev/encoder_v1
#include "common.h"

// ----------------------------------------------------------------------------
// the mma.sync kernel

// encoder_mma_kernel: vae.cu's encoder design (encoder_wgmma_kernel's) on mma.sync, vae.cu's encoder on GPUs without
// wgmma until the plain path took them over. The decoder's design turned around. fc1's 400 hidden units are cut into
// slices (bf16: 5 of 80 units; fp32: 10 of 40, their hi and lo rows); a block owns one slice and
// keeps its 80 rows of fc1 (134 KB) and its columns of [fc21 | fc22] in shared memory, copied
// once. Its warps then take 16-image tasks on their own:
//   pixels   straight from global memory into mma's A fragments: thread t of a quad loads 16
//            bytes of each of its two rows per 64 pixels (one uint4, the next two in flight while
//            this one is multiplied) and widens them to 16 bits (0..255 are exact). That needs
//            fc1's K in a matching order: k16 step s = 4u + j holds, in the fragment slots (2t,
//            2t+1) and (8+2t, 9+2t), pixels 64u + 16t + 4j + (0, 1) and (2, 3); weights_kernel
//            stores fc1 permuted that way once, K padded to 832 with zeros
//   fc1      16 x 80 per warp, K = 832: 10 mma per k16 step, B by ldmatrix from the resident rows
//   fc21/22  the accumulators (fp32: the hi and lo halves added; scale 1/255, bias, ReLU) are the
//            A fragments of the 16 x 40 partial [mu | logvar] of the slice (relu_to_a): h1 never
//            leaves the registers
//   merge    each warp stores its 16 x 40 partial (L2) and takes a ticket per 16 images; the last
//            slice to arrive adds them all in slice order (whatever order they arrived in:
//            bitwise reproducible and batch invariant), adds the bias, draws eps (keyed by the
//            image's global index) and writes the z rows and KL
// Tasks are dealt round-robin over the blocks first, so a batch of 1024 (64 tasks a slice) runs
// on 130 SMs, a task per warp, not on 40 with 8 each.
// This design's shapes beside vae.cu's (FC1_K, ENC_BN): fc1's rows padded for ldmatrix, the warps of a block.
enum {
    FC1_PITCH = FC1_K + 8, // 1680-byte rows (105 x 16): the 8 rows an ldmatrix phase reads hit 8 bank groups
    ENC_WARPS = 16,
};
template <Precision P> struct EncoderSmem {
    typename Path<P>::T w1[ENC_BN][FC1_PITCH];
    typename Path<P>::T w_enc[MULV_DIM][Path<P>::ENC_W_COLS + 8]; // rows of 176 or 208 bytes: conflict-free loads
    float z[ENC_WARPS][TASK_ROWS][LATENT_DIM], kl_terms[ENC_WARPS][TASK_ROWS][LATENT_DIM]; // a finishing warp's
};

template <Precision P>
__global__ void __launch_bounds__(ENC_WARPS * 32, 1)
    encoder_mma_kernel(const typename Path<P>::T* __restrict__ fc1_wp, const EncoderIO io) {
    typedef typename Path<P>::T T;
    extern __shared__ __align__(16) uint8_t smem_raw[];
    EncoderSmem<P>& sm = *reinterpret_cast<EncoderSmem<P>*>(smem_raw);
    allow_dependent_launch();
    const int slice = blockIdx.x % Path<P>::ENC_SLICES, copies = gridDim.x / Path<P>::ENC_SLICES;
    copy_block_async(&sm.w1[0][0], FC1_PITCH, fc1_wp + (size_t)slice * ENC_BN * FC1_K, FC1_K, ENC_BN, FC1_K);
    copy_enc_weights<P>(sm.w_enc, io, slice);
    cp_async_wait<0>();
    __syncthreads();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int b_row = lane % 8 + (lane / 16) * 8, b_k = ((lane / 8) % 2) * 8; // ldmatrix_x4: two n8 blocks x k16
    const int tasks = ceil_div(io.M, TASK_ROWS);
    for (int task = blockIdx.x / Path<P>::ENC_SLICES + copies * warp; task < tasks; task += copies * ENC_WARPS) {
        const PixelRows rows(io.pixels, task * TASK_ROWS, io.M);
        float acc[2 * ENC_BN / 4] = {};
        uint4 px[FC1_K / 64][2]; // constant indices (the loop is unrolled): registers, ENC_PREFETCH + 1 live
        #pragma unroll
        for (int u = 0; u < ENC_PREFETCH; u++) rows.load(px[u], u);
        #pragma unroll
        for (int u = 0; u < FC1_K / 64; u++) {
            if (u + ENC_PREFETCH < FC1_K / 64) rows.load(px[u + ENC_PREFETCH], u + ENC_PREFETCH);
            uint32_t a[4][4];
            pixel_fragments<T>(a, px[u]);
            #pragma unroll
            for (int j = 0; j < 4; j++)
                #pragma unroll
                for (int nt = 0; nt < ENC_BN / 8; nt += 2) {
                    uint32_t r[4];
                    ldmatrix_x4(r, &sm.w1[nt * 8 + b_row][(4 * u + j) * 16 + b_k]);
                    const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                    mma_m16n8k16<T>(&acc[4 * nt], a[j], b0);
                    mma_m16n8k16<T>(&acc[4 * nt + 4], a[j], b1);
                }
        }
        encoder_finish<P>(acc, sm.w_enc, task * TASK_ROWS, slice, io, sm.z[warp], sm.kl_terms[warp]);
    }
}

// encoder_mma_kernel over B images (bf16), as vae.cu's encoder_launch does the wgmma kernel: whole groups
// of the slices, at most one block per SM and no more than there are 16-image tasks.
static void encoder_mma(Fused* f, EncoderIO io) {
    typedef Path<PRECISION_BF16> Q;
    io.partials = f->enc_partials, io.tickets = f->enc_tickets, io.enc_w = f->enc_w16;
    io.fc1_b = f->fc1_b, io.enc_b = f->enc_b;
    const int tasks = ceil_div(io.M, TASK_ROWS);
    const int copies = f->sms / Q::ENC_SLICES < tasks ? f->sms / Q::ENC_SLICES : tasks;
    encoder_mma_kernel<PRECISION_BF16><<<Q::ENC_SLICES * copies, ENC_WARPS * 32, sizeof(EncoderSmem<PRECISION_BF16>),
                                         f->stream>>>(static_cast<const bf16*>(f->fc1_wp), io);
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------
// the v1 kernel (vae.cu's names with a V1 / _v1 suffix)

// A block tile of X[M,K] W[N,K]^T: BM x BN outputs from WARPS_M x WARPS_N warps, each owning
// MT x NT mma tiles of 16 x 8. K is walked in slices of BK through a STAGES-deep cp.async
// pipeline, so STAGES-1 slices are in flight while the tensor cores work on another. Rows of the
// staged slices are padded by 16 bytes (to an odd number of 16-byte chunks) so that the 8 rows an
// ldmatrix phase reads fall into 8 different groups of shared-memory banks. Pixel rows (uint8)
// land in their own staging buffer and are widened to bf16 once per slice (integers 0..255 are
// exact in bf16; the 1/255 is applied to the fp32 sums), instead of once per fragment by every
// warp that reads them.
// THREADS may exceed the MMA warps: the extra warps help load and then have other work.
template <typename TX, int WARPS_M_, int WARPS_N_, int MT_, int NT_, int STAGES_ = 3, int BK_ = 32,
          int THREADS_ = 32 * WARPS_M_ * WARPS_N_>
struct MmaTileV1 {
    typedef TX InputType;
    static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, MT = MT_, NT = NT_, STAGES = STAGES_, BK = BK_;
    static constexpr int PITCH = BK + 8; // bf16 elements per staged row
    static_assert(BK % 32 == 0, "slices of whole k32 steps (two mma k16)");
    static constexpr int BM = WARPS_M * MT * 16, BN = WARPS_N * NT * 8, MMA_WARPS = WARPS_M * WARPS_N;
    static constexpr int THREADS = THREADS_;
    static_assert(THREADS >= 32 * MMA_WARPS && THREADS % 32 == 0, "whole warps, at least the MMA warps");
    static constexpr bool WIDEN = sizeof(TX) == 1;                  // pixel input
    static constexpr int X_PITCH = WIDEN ? BK + 16 : PITCH; // elements
    struct Smem {
        TX x[STAGES][BM][X_PITCH];
        bf16 w[STAGES][BN][PITCH];
        bf16 x_wide[WIDEN ? BM : 1][PITCH]; // the current pixel slice as bf16
    };
};

// acc[mt][nt] += the warp's share of X[row0.., :] W[col0.., :]^T. Requires K * sizeof(TX) to be a
// multiple of 16 bytes (true for every layer here); rows and columns past M and N read as zeros.
template <typename Tile>
__device__ inline void mma_mainloop_v1(float (&acc)[Tile::MT][Tile::NT][4], typename Tile::Smem& sm,
                                    const typename Tile::InputType* X, const bf16* W, int M, int N, int K, int row0,
                                    int col0) {
    typedef typename Tile::InputType TX;
    // Each thread copies 16-byte chunks at one fixed k offset of rows r, r + ROWS_PER_PASS, ...:
    // the addresses are worked out once here, and each slice only adds k0.
    constexpr int BK = Tile::BK, PITCH = Tile::PITCH;
    constexpr int X_CHUNK = 16 / sizeof(TX), X_CPR = BK / X_CHUNK, W_CPR = BK / 8; // chunks per row
    static_assert(Tile::THREADS % X_CPR == 0 && Tile::THREADS % W_CPR == 0, "one k offset per thread");
    constexpr int X_PASS = Tile::THREADS / X_CPR, W_PASS = Tile::THREADS / W_CPR; // rows per pass
    constexpr int X_PASSES = (Tile::BM + X_PASS - 1) / X_PASS, W_PASSES = (Tile::BN + W_PASS - 1) / W_PASS;
    const int x_r = threadIdx.x / X_CPR, x_k = (threadIdx.x % X_CPR) * X_CHUNK;
    const int w_r = threadIdx.x / W_CPR, w_k = (threadIdx.x % W_CPR) * 8;

    auto load_slice = [&](int stage, int k0) {
        #pragma unroll
        for (int i = 0; i < X_PASSES; i++) {
            const int r = x_r + i * X_PASS;
            if (X_PASSES * X_PASS > Tile::BM && r >= Tile::BM) break;
            const bool valid = row0 + r < M && k0 + x_k < K;
            cp_async16(&sm.x[stage][r][x_k], valid ? X + (size_t)(row0 + r) * K + k0 + x_k : X, valid);
        }
        #pragma unroll
        for (int i = 0; i < W_PASSES; i++) {
            const int r = w_r + i * W_PASS;
            if (W_PASSES * W_PASS > Tile::BN && r >= Tile::BN) break;
            const bool valid = col0 + r < N && k0 + w_k < K;
            cp_async16(&sm.w[stage][r][w_k], valid ? W + (size_t)(col0 + r) * K + k0 + w_k : W, valid);
        }
    };

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int warp_row = (warp / Tile::WARPS_N) * Tile::MT * 16, warp_col = (warp % Tile::WARPS_N) * Tile::NT * 8;
    // the row and column this lane addresses in an ldmatrix: A tiles are 16 rows x (2 x 8 k),
    // B tile pairs are (2 x 8 n) x (2 x 8 k)
    const int a_row = lane % 16, a_k = (lane / 16) * 8;
    const int b_row = lane % 8 + (lane / 16) * 8, b_k = ((lane / 8) % 2) * 8;

    const int num_slices = (K + BK - 1) / BK;
    for (int s = 0; s < Tile::STAGES - 1; s++) {
        if (s < num_slices) load_slice(s, s * BK);
        cp_async_commit(); // empty groups keep the count uniform
    }
    for (int kt = 0; kt < num_slices; kt++) {
        cp_async_wait<Tile::STAGES - 2>(); // slice kt has landed (for this thread's copies) ...
        __syncthreads();                   // ... and for everyone's; slice kt-1's stage is free again
        const int next = kt + Tile::STAGES - 1;
        if (next < num_slices) load_slice(next % Tile::STAGES, next * BK);
        cp_async_commit();
        const int stage = kt % Tile::STAGES;
        const bf16(*xs)[PITCH];
        if constexpr (Tile::WIDEN) {
            for (int c = threadIdx.x; c < Tile::BM * (BK / 16); c += Tile::THREADS) { // 16 pixels per step
                const int r = c / (BK / 16), k = (c % (BK / 16)) * 16;
                const uint4 bytes = *reinterpret_cast<const uint4*>(&sm.x[stage][r][k]);
                const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
                __nv_bfloat162 wide[8];
                #pragma unroll
                for (int i = 0; i < 8; i++)
                    wide[i] = __floats2bfloat162_rn(byte_as_float(words[i / 2], 2 * (i % 2)),
                                                    byte_as_float(words[i / 2], 2 * (i % 2) + 1));
                *reinterpret_cast<uint4*>(&sm.x_wide[r][k]) = *reinterpret_cast<const uint4*>(&wide[0]);
                *reinterpret_cast<uint4*>(&sm.x_wide[r][k + 8]) = *reinterpret_cast<const uint4*>(&wide[4]);
            }
            __syncthreads();
            xs = sm.x_wide;
        } else {
            xs = sm.x[stage];
        }
        if (warp >= Tile::MMA_WARPS) continue; // warp-uniform: loader-only warps
        #pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t a[Tile::MT][4], b[Tile::NT][2];
            #pragma unroll
            for (int mt = 0; mt < Tile::MT; mt++) ldmatrix_x4(a[mt], &xs[warp_row + mt * 16 + a_row][kk + a_k]);
            #pragma unroll
            for (int nt = 0; nt < Tile::NT; nt += 2) {
                const bf16* row = &sm.w[stage][warp_col + nt * 8 + b_row][kk + b_k];
                if (nt + 1 < Tile::NT) {
                    uint32_t r[4];
                    ldmatrix_x4(r, row);
                    b[nt][0] = r[0], b[nt][1] = r[1], b[nt + 1][0] = r[2], b[nt + 1][1] = r[3];
                } else { // odd NT: the last tile alone; lanes 16-31 pass (unused) in-bounds addresses
                    ldmatrix_x2(b[nt][0], b[nt][1], row - (lane / 16) * 8 * PITCH);
                }
            }
            #pragma unroll
            for (int mt = 0; mt < Tile::MT; mt++)
                #pragma unroll
                for (int nt = 0; nt < Tile::NT; nt++) mma_m16n8k16<bf16>(acc[mt][nt], a[mt], b[nt]);
        }
    }
    cp_async_wait<0>();
    __syncthreads(); // shared memory may be reused by the caller's epilogue
}

// Visits the accumulator elements a thread owns as pairs of adjacent columns: f(mma tile row mt,
// half (rows g or g + 8), row in tile, column in tile, value at column, value at column + 1).
template <typename Tile, typename F>
__device__ inline void for_each_acc_pair_v1(const float (&acc)[Tile::MT][Tile::NT][4], F f) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    if (warp >= Tile::MMA_WARPS) return; // loader-only warps own no outputs
    const int warp_row = (warp / Tile::WARPS_N) * Tile::MT * 16, warp_col = (warp % Tile::WARPS_N) * Tile::NT * 8;
    #pragma unroll
    for (int mt = 0; mt < Tile::MT; mt++)
        #pragma unroll
        for (int nt = 0; nt < Tile::NT; nt++)
            #pragma unroll
            for (int half = 0; half < 2; half++)
                f(mt, half, warp_row + mt * 16 + g + 8 * half, warp_col + nt * 8 + 2 * t, acc[mt][nt][2 * half],
                  acc[mt][nt][2 * half + 1]);
}

// encoder_v1_kernel. The 400 hidden units are cut into 5 slices of 80; block (slice s, row tile t)
// computes h1 for the 64 images of t and the 80 units of s (mma_mainloop_v1 over K = 784 pixels),
// keeps it in shared memory (ReLU, bf16) and multiplies it by the matching 80 columns of
// [fc21 | fc22]: a partial [mu | logvar] of its 64 images. Five blocks share a row tile, so a
// batch of 1024 keeps 80 blocks busy where whole rows of h1 per block would give 16. The
// partials meet in L2: each block stores its 64 x 40 and takes a ticket; the fifth to arrive
// adds the five in slice order 0..4 (whatever order they arrived in: bitwise reproducible and
// batch invariant), adds the bias, draws eps (keyed by the image's global index) and writes the
// z rows and KL. 800 bytes of partials an image; h1 (800 bytes in bf16) never leaves the chip.
// (ENC_BN = 80 and MULV_DIM = 40 are vae.cu's; ENC_SLICES = 5 is its bf16 path's.)
constexpr int ENC_SLICES = Path<PRECISION_BF16>::ENC_SLICES, ENC_PITCH = ENC_BN + 8;
typedef MmaTileV1<uint8_t, 2, 2, 2, 5, 3, 64> EncoderTileV1; // 64 images x 80 units, 4 warps, K in slices of 64
static_assert(EncoderTileV1::BN == ENC_BN && HIDDEN_DIM % ENC_SLICES == 0 && ENC_BN % 16 == 0, "slices of k16 steps");
static_assert(EncoderTileV1::THREADS / 32 * 16 == EncoderTileV1::BM, "the partial product: a warp per 16 rows");
struct EncoderSmemV1 {
    EncoderTileV1::Smem mma;
    bf16 h1[EncoderTileV1::BM][ENC_PITCH];   // 176-byte rows: an odd number of 16-byte chunks, no bank conflicts
    bf16 w_enc[MULV_DIM][ENC_PITCH];       // this slice's 80 columns of [fc21 | fc22]
    float z[EncoderTileV1::BM][LATENT_DIM];
    float kl_terms[EncoderTileV1::BM][LATENT_DIM];
    bool last;
};

__global__ void __launch_bounds__(EncoderTileV1::THREADS)
    encoder_v1_kernel(uint4* __restrict__ z_rows, float* __restrict__ kl, float* __restrict__ mulv_out,
                   float* __restrict__ z_out, float* __restrict__ partials, unsigned* __restrict__ tickets,
                   const uint8_t* __restrict__ pixels, const bf16* __restrict__ fc1_w, const float* __restrict__ fc1_b,
                   const bf16* __restrict__ enc_w, const float* __restrict__ enc_b, const float* __restrict__ eps_in,
                   int M, uint32_t first_image, uint64_t seed, bool z_is_mu) {
    constexpr int BM = EncoderTileV1::BM, THREADS = EncoderTileV1::THREADS, GROUPS = LATENT_DIM / 4;
    extern __shared__ __align__(16) uint8_t smem_raw[];
    EncoderSmemV1& sm = *reinterpret_cast<EncoderSmemV1*>(smem_raw);
    const int slice = blockIdx.x, row0 = blockIdx.y * BM, col0 = slice * ENC_BN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

    constexpr int W_CHUNKS = ENC_BN / 8; // the oldest cp.async group: the GEMM's first wait covers it
    for (int c = threadIdx.x; c < MULV_DIM * W_CHUNKS; c += THREADS) {
        const int r = c / W_CHUNKS, k = (c % W_CHUNKS) * 8;
        cp_async16(&sm.w_enc[r][k], enc_w + (size_t)r * HIDDEN_DIM + col0 + k, true);
    }
    cp_async_commit();

    float acc[EncoderTileV1::MT][EncoderTileV1::NT][4] = {};
    mma_mainloop_v1<EncoderTileV1>(acc, sm.mma, pixels, fc1_w, M, HIDDEN_DIM, INPUT_DIM, row0, col0);
    for_each_acc_pair_v1<EncoderTileV1>(acc, [&](int, int, int r, int c, float v0, float v1) {
        v0 = fmaxf(v0 * (1.0f / 255.0f) + fc1_b[col0 + c], 0.0f); // pixels went in as 0..255
        v1 = fmaxf(v1 * (1.0f / 255.0f) + fc1_b[col0 + c + 1], 0.0f);
        *reinterpret_cast<__nv_bfloat162*>(&sm.h1[r][c]) = __floats2bfloat162_rn(v0, v1);
    });
    __syncthreads();

    // partial [mu | logvar] = h1 tile [64 x 80] x this slice of [fc21 | fc22]^T: warp w takes rows 16w..
    float part[MULV_DIM / 8][4] = {};
    #pragma unroll
    for (int ks = 0; ks < ENC_BN / 16; ks++) {
        uint32_t a[4];
        ldmatrix_x4(a, &sm.h1[warp * 16 + lane % 16][ks * 16 + (lane / 16) * 8]);
        #pragma unroll
        for (int nt = 0; nt < MULV_DIM / 8; nt++) {
            const bf16* w = &sm.w_enc[nt * 8 + g][ks * 16 + 2 * t];
            const uint32_t b[2] = {pair_at(w), pair_at(w + 8)};
            mma_m16n8k16<bf16>(part[nt], a, b);
        }
    }
    #pragma unroll
    for (int nt = 0; nt < MULV_DIM / 8; nt++)
        #pragma unroll
        for (int half = 0; half < 2; half++) {
            const int row = row0 + warp * 16 + g + 8 * half;
            if (row < M)
                *reinterpret_cast<float2*>(&partials[((size_t)row * ENC_SLICES + slice) * MULV_DIM + nt * 8 + 2 * t]) =
                    make_float2(part[nt][2 * half], part[nt][2 * half + 1]);
        }
    __threadfence(); // this block's partials are visible to the whole GPU before its ticket is
    __syncthreads();
    if (threadIdx.x == 0) {
        sm.last = atomicAdd(&tickets[blockIdx.y], 1u) == ENC_SLICES - 1;
        if (sm.last) tickets[blockIdx.y] = 0; // every slice has arrived: ready for the next launch
    }
    __syncthreads();
    if (!sm.last) return;
    __threadfence();

    for (int i = threadIdx.x; i < BM * GROUPS; i += THREADS) {
        const int r = i / GROUPS, q = i % GROUPS, row = row0 + r;
        if (row >= M) continue;
        const float* p = partials + (size_t)row * ENC_SLICES * MULV_DIM;
        float4 eps = make_float4(0.0f, 0.0f, 0.0f, 0.0f); // z = mu
        if (!z_is_mu && eps_in) eps = *reinterpret_cast<const float4*>(&eps_in[(size_t)row * LATENT_DIM + 4 * q]);
        else if (!z_is_mu) eps = gaussian4(seed, STREAM_POSTERIOR, first_image + row, 0, q);
        const float e[4] = {eps.x, eps.y, eps.z, eps.w};
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const int latent = 4 * q + j;
            float mu = __ldcg(&p[latent]), logvar = __ldcg(&p[LATENT_DIM + latent]); // L2: written by other SMs
            #pragma unroll
            for (int s = 1; s < ENC_SLICES; s++)
                mu += __ldcg(&p[s * MULV_DIM + latent]), logvar += __ldcg(&p[s * MULV_DIM + LATENT_DIM + latent]);
            mu += enc_b[latent], logvar += enc_b[LATENT_DIM + latent];
            sm.z[r][latent] = latent_z(mu, logvar, e[j], &sm.kl_terms[r][latent]);
            if (mulv_out)
                mulv_out[(size_t)row * MULV_DIM + latent] = mu,
                mulv_out[(size_t)row * MULV_DIM + LATENT_DIM + latent] = logvar;
            if (z_out) z_out[(size_t)row * LATENT_DIM + latent] = sm.z[r][latent];
        }
    }
    __syncthreads();
    for (int r = threadIdx.x; r < BM && row0 + r < M; r += THREADS) {
        float sum = 0.0f; // each image's KL in a fixed order
        for (int j = 0; j < LATENT_DIM; j++) sum += sm.kl_terms[r][j];
        if (kl) kl[row0 + r] = -0.5f * sum;
        store_z_row<PRECISION_BF16>(z_rows + (size_t)(row0 + r) * 4, sm.z[r]);
    }
}

// The v1 encoder of B images: five blocks per 64-image row tile; `tickets` holds one counter per row
// tile (zero between launches: the fifth block resets it), `partials` [B][5][40].
static void encoder_v1_bf16(uint4* z_rows, float* kl, float* mulv_out, float* partials, unsigned* tickets,
                            const uint8_t* pixels, const bf16* fc1_w, const float* fc1_b, const bf16* enc_w,
                            const float* enc_b, int B, uint64_t seed, bool z_is_mu, cudaStream_t stream) {
    const dim3 grid(ENC_SLICES, ceil_div(B, EncoderTileV1::BM));
    encoder_v1_kernel<<<grid, EncoderTileV1::THREADS, sizeof(EncoderSmemV1), stream>>>(
        z_rows, kl, mulv_out, NULL, partials, tickets, pixels, fc1_w, fc1_b, enc_w, enc_b, NULL, B, 0, seed,
        z_is_mu);
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------
// the driver

enum { MAX_B = 10000 }; // the MNIST test set: the largest batch timed
static const int CHECK_B[] = {1, 7, 37, 1023, 4097}; // ragged: multiples of neither 16 nor 64
static const int TIME_B[] = {1024, 4096, 10000};
// bf16 operands (2^-9 relative each) and h1 rounded to bf16 put mu, logvar and KL within ~3e-3 of
// float64; a lost slice (a fifth of every sum) or a wrong row tile moves them by 10% or more.
static const double TOL_REF = 2e-2;
// v1 and today's kernel multiply the same bf16 values (pixels exact, the same rounded weights, h1
// rounded after the same bias and ReLU) and differ only in the fp32 order within fc1's K, which now
// and then rounds an h1 element to the neighbouring bf16: one bf16 step (2^-8) of max |KL| bounds it.
static const double TOL_PATHS = 1.0 / 256;
static const double PEAK_TFLOPS = 770.0; // H100/H200 SXM dense bf16

// [mu | logvar] and KL (z = mu) of n images in float64 from the fp32 weights (cpu_reference.h).
static void cpu_encoder(const HostWeights* w, const uint8_t* pixels, int n, std::vector<double>& mulv,
                        std::vector<double>& kl) {
    std::vector<double> x((size_t)n * INPUT_DIM), mu((size_t)n * LATENT_DIM), logvar((size_t)n * LATENT_DIM);
    for (size_t i = 0; i < x.size(); i++) x[i] = pixels[i] / 255.0;
    cpu_encode(w, PUBLISHED_DIMS, x.data(), n, NULL, mu.data(), logvar.data());
    mulv.resize((size_t)n * MULV_DIM), kl.resize(n);
    for (int b = 0; b < n; b++) {
        std::copy_n(&mu[(size_t)b * LATENT_DIM], LATENT_DIM, &mulv[(size_t)b * MULV_DIM]);
        std::copy_n(&logvar[(size_t)b * LATENT_DIM], LATENT_DIM, &mulv[(size_t)b * MULV_DIM + LATENT_DIM]);
        kl[b] = cpu_kl(&mu[(size_t)b * LATENT_DIM], &logvar[(size_t)b * LATENT_DIM], LATENT_DIM);
    }
}

int main() {
    HostWeights weights;
    Images images;
    vae::load_model_inputs("encoder_v1", &weights, &images);
    if (images.count < MAX_B) fail("%d test images, %d needed", images.count, (int)MAX_B);
    print_device_info(); // also what benchmark_us sizes its L2 flush by

    // The events of both timers go to the legacy default stream, which orders itself with m.stream (a
    // blocking stream): every launch below goes to m.stream, as in vae.cu.
    VAE m;
    vae_init(&m, &weights, MAX_B, PRECISION_BF16, KERNELS_FUSED);
    uint8_t* d_pixels;
    cudaCheck(cudaMalloc(&d_pixels, (size_t)MAX_B * INPUT_DIM));
    cudaCheck(cudaMemcpy(d_pixels, images.pixels, (size_t)MAX_B * INPUT_DIM, cudaMemcpyHostToDevice));
    // v1's own buffers: fc1 in PyTorch's K order ([400][784] bf16; today's kernel has its own order),
    // z rows, partials and a ticket per 64-image row tile
    bf16* fc1_w16;
    uint4* z_rows_v1;
    float *partials_v1, *d_mulv, *d_kl;
    unsigned* tickets_v1;
    const int row_tiles = ceil_div(MAX_B, EncoderTileV1::BM);
    cudaCheck(cudaMalloc(&fc1_w16, (size_t)HIDDEN_DIM * INPUT_DIM * sizeof(bf16)));
    cudaCheck(cudaMalloc(&z_rows_v1, (size_t)MAX_B * 4 * sizeof(uint4)));
    cudaCheck(cudaMalloc(&partials_v1, (size_t)MAX_B * ENC_SLICES * MULV_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&tickets_v1, row_tiles * sizeof(unsigned)));
    cudaCheck(cudaMemset(tickets_v1, 0, row_tiles * sizeof(unsigned)));
    cudaCheck(cudaMalloc(&d_mulv, (size_t)(MAX_B + 1) * MULV_DIM * sizeof(float))); // + 1: a row that must stay NaN
    cudaCheck(cudaMalloc(&d_kl, (size_t)(MAX_B + 1) * sizeof(float)));
    std::vector<bf16> fc1_host((size_t)HIDDEN_DIM * INPUT_DIM); // fc1 in bf16, row-major as in the file
    for (size_t i = 0; i < fc1_host.size(); i++) fc1_host[i] = __float2bfloat16(weights.tensor[FC1_W][i]);
    cudaCheck(cudaMemcpy(fc1_w16, fc1_host.data(), fc1_host.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    cudaCheck(cudaFuncSetAttribute(encoder_v1_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)sizeof(EncoderSmemV1)));
    cudaCheck(cudaStreamSynchronize(m.stream));
    cudaCheck(cudaFuncSetAttribute(encoder_mma_kernel<PRECISION_BF16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)sizeof(EncoderSmem<PRECISION_BF16>)));
    printf("v1: %d threads, %zu bytes of shared memory a block; mma.sync: %d threads, %zu bytes; production "
           "(wgmma): %d blocks of %d threads, %d bytes\n", EncoderTileV1::THREADS, sizeof(EncoderSmemV1),
           ENC_WARPS * 32, sizeof(EncoderSmem<PRECISION_BF16>), m.fused->sms, ENC_WG_GROUPS * 128,
           enc_wg_smem<PRECISION_BF16>());

    // z rows, KL and (when mulv is given) [mu | logvar] of B images; eps from the generator unless z = mu
    auto run_v1 = [&](int B, float* mulv, bool z_is_mu) {
        encoder_v1_bf16(z_rows_v1, d_kl, mulv, partials_v1, tickets_v1, d_pixels, fc1_w16, m.tensor[FC1_B],
                        static_cast<const bf16*>(m.fused->enc_w16), m.tensor[FC21_B], B, 42, z_is_mu, m.stream);
    };
    auto run_mma = [&](int B, float* mulv, bool z_is_mu) {
        EncoderIO io = {};
        io.z_rows = m.fused->z_rows, io.kl = d_kl, io.mulv_out = mulv, io.pixels = d_pixels, io.M = B, io.seed = 42;
        io.z_is_mu = z_is_mu;
        encoder_mma(m.fused, io);
    };
    auto run_production = [&](int B, float* mulv, bool z_is_mu) {
        EncoderIO io = {};
        io.z_rows = m.fused->z_rows, io.kl = d_kl, io.mulv_out = mulv, io.pixels = d_pixels, io.M = B, io.seed = 42;
        io.z_is_mu = z_is_mu;
        fused_encoder(m.fused, io);
    };

    // Validation: z = mu (no noise), so KL is a function of mu and logvar alone.
    const int max_check = *std::max_element(std::begin(CHECK_B), std::end(CHECK_B));
    std::vector<double> ref_mulv, ref_kl;
    cpu_encoder(&weights, images.pixels, max_check, ref_mulv, ref_kl); // the batches are prefixes of one another
    bool ok = true;
    std::vector<float> mulv((size_t)(max_check + 1) * MULV_DIM), kl_of[3];
    for (auto& k : kl_of) k.resize(max_check + 1);
    for (int B : CHECK_B)
        for (int path = 0; path < 3; path++) { // v1, mma.sync, production
            const char* name = path == 0 ? "v1" : path == 1 ? "mma.sync" : "production";
            std::vector<float>& kl = kl_of[path];
            poison(d_mulv, (size_t)(MAX_B + 1) * MULV_DIM * sizeof(float));
            poison(d_kl, (size_t)(MAX_B + 1) * sizeof(float));
            if (path == 0) run_v1(B, d_mulv, true);
            else if (path == 1) run_mma(B, d_mulv, true);
            else run_production(B, d_mulv, true);
            cudaCheck(cudaStreamSynchronize(m.stream));
            cudaCheck(cudaMemcpy(mulv.data(), d_mulv, (size_t)(B + 1) * MULV_DIM * sizeof(float),
                                 cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(kl.data(), d_kl, (size_t)(B + 1) * sizeof(float), cudaMemcpyDeviceToHost));
            const double e_mu = rel_err(mulv.data(), ref_mulv.data(), B, MULV_DIM, 0, LATENT_DIM);
            const double e_lv = rel_err(mulv.data(), ref_mulv.data(), B, MULV_DIM, LATENT_DIM, LATENT_DIM);
            const double e_kl = rel_err(kl.data(), ref_kl.data(), B, 1, 0, 1);
            const bool past_end = std::isnan(kl[B]) && std::isnan(mulv[(size_t)B * MULV_DIM]); // nothing beyond B
            const bool pass = e_mu <= TOL_REF && e_lv <= TOL_REF && e_kl <= TOL_REF && past_end;
            ok = ok && pass;
            printf("%s %s B=%d vs float64: mu %.2e, logvar %.2e, KL %.2e of max |ref| (tol %.0e)%s\n",
                   pass ? "PASS" : "FAIL", name, B, e_mu, e_lv, e_kl, TOL_REF,
                   past_end ? "" : "; wrote past image B - 1");
            if (path < 2) continue;
            for (int other = 0; other < 2; other++) {
                const double e_paths = rel_err(kl_of[other].data(), kl_of[2].data(), B, 1, 0, 1);
                const bool agree = e_paths <= TOL_PATHS;
                ok = ok && agree;
                printf("%s %s vs production B=%d: KL %.2e of max |KL| (tol %.1e)\n", agree ? "PASS" : "FAIL",
                       other == 0 ? "v1" : "mma.sync", B, e_paths, TOL_PATHS);
            }
        }
    if (!ok) {
        printf("FAIL: validation failed, nothing timed\n");
        return 1;
    }

    // Timing: the ELBO's encoder (z rows and KL, eps drawn by the generator; no mu / logvar written).
    printf("\nus per launch, median of 200: hot = back to back, cold = L2 flushed (%.0f MB written) before each\n",
           std::max<size_t>(256u << 20, 4 * (size_t)device_props().l2CacheSize) / 1048576.0);
    printf("| batch | v1 us hot | v1 us cold | mma.sync us hot | mma.sync us cold | production us hot | production us "
           "cold | production vs v1 (hot / cold) | floor us (%.0f TFLOP/s) |\n|---:|---:|---:|---:|---:|---:|---:|---:|"
           "---:|\n", PEAK_TFLOPS);
    for (int B : TIME_B) {
        const float v1_hot = benchmark_us([&] { run_v1(B, NULL, false); }, 200, 10, false);
        const float v1_cold = benchmark_us([&] { run_v1(B, NULL, false); });
        const float mma_hot = benchmark_us([&] { run_mma(B, NULL, false); }, 200, 10, false);
        const float mma_cold = benchmark_us([&] { run_mma(B, NULL, false); });
        const float prod_hot = benchmark_us([&] { run_production(B, NULL, false); }, 200, 10, false);
        const float prod_cold = benchmark_us([&] { run_production(B, NULL, false); });
        const double flop = 2.0 * B * ((double)INPUT_DIM * HIDDEN_DIM + (double)HIDDEN_DIM * MULV_DIM);
        printf("| %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.2fx / %.2fx | %.2f |\n", B, v1_hot, v1_cold, mma_hot,
               mma_cold, prod_hot, prod_cold, v1_hot / prod_hot, v1_cold / prod_cold,
               flop / (PEAK_TFLOPS * 1e12) * 1e6);
    }
    cudaCheck(cudaGetLastError());

    for (void* p : {(void*)d_pixels, (void*)fc1_w16, (void*)z_rows_v1, (void*)partials_v1, (void*)tickets_v1,
                    (void*)d_mulv, (void*)d_kl})
        cudaCheck(cudaFree(p));
    vae_free(&m);
    free(weights.data), free(images.pixels);
    return 0;
}
