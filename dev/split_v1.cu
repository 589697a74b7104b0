// Split v1: fp32 accuracy from 16-bit tensor cores, measured on the VAE's own layers.
//
// Hypothesis. An fp32 value x is the sum of three bf16 parts, x0 = bf16(x), x1 = bf16(x - x0),
// x2 = bf16(x - x0 - x1): 3 x 8 = 24 significant bits, all of fp32's. A product of two such
// sums has 9 partial products; those with i + j > 2 are below 2^-24 of the result and can go.
// The tensor cores multiply bf16 exactly and accumulate in fp32, so six mma per k16 step
// ((0,0), (0,1), (1,0), (0,2), (1,1), (2,0)) should give an fp32 GEMM within a few 1e-7 of
// float64, provided the small products are not lost in the big accumulator: the tensor cores
// truncate when they add, so the corrections are summed in an accumulator of their own (or
// first). CUTLASS's "3xTF32" does the same with two tf32 parts (11 bits each, 3 products:
// big x big, big x small, small x big) on m16n8k8. fc1 needs less: its pixels 0..255 are exact
// in bf16, so only fc1's weights are split, 3 products (the 1/255 goes to the epilogue).
//
// What this measures. Each scheme on a plain mma.sync kernel (one warp = 16 rows x 32 columns,
// fragments straight from global memory, operands split beforehand), on the model's four layers
// with its real weights and real activations (pixels -> h1 -> mu -> h3, from a float64 CPU
// pass), at M = 1, 37, 1023 and 4097 rows into NaN-poisoned outputs: the error per tensor,
// max |y - y64| / max |y64|, against the float64 reference, which vae.cu's fp32 path must meet
// at 1e-5. Then the time at M = 4096 against cuBLAS fp32 (no TF32) and against the same kernel
// with one bf16 product (the bf16 path's arithmetic). The kernel is not the production design
// (that is the fused encoder and decoder); the accuracy is the result, the times only say what
// the extra products cost relative to one.
//
// Prediction: one bf16 product ~2e-3; bf16 x 2 parts, 3 products ~1e-5; 3 parts, 6 products
// ~3e-7 with the corrections in their own accumulator, worse with one accumulator, big products
// first; 3xTF32 ~5e-7; fc1 with exact pixels and 3 weight parts ~2e-7.
//
// Result (H200; dev/README.md has the table): one product 6e-4 .. 3.8e-3; 2 parts 1e-6 .. 1.1e-5
// (fc3 misses 1e-5); 3 parts, 6 products 1.6e-7 .. 5.4e-7 with the corrections apart, up to
// 2.9e-6 in one accumulator (small products first helps at most 2x, on fc3; the accumulator of
// their own 4-6x); 3xTF32 3e-7 .. 1.4e-6, 2-3x worse for the same 6 products a k16 step, on an
// instruction of half the rate; fc1's exact pixels x 3 weight parts 3.8e-7 with half the products.
// Right about the schemes, half right about the order. The fp32 path's design follows: bf16
// parts, corrections in their own accumulator, fc1 with only its weights split. A scheme that
// misses its bound fails the run.
//
// Build and run from the repository root (needs data/: make data):
//   make -C dev split_v1 && ./dev/split_v1
#include "common.h"

// ----------------------------------------------------------------------------
// splitting fp32 operands into parts (once per operand; not timed)

// bf16 parts: parts[p][r][k] for p < P, with K padded to Kp (a multiple of 16) by zeros. Each
// remainder x - x0 - ... is exact in fp32, so the parts sum to x to 2^-8 of the last part.
__global__ void split_bf16_kernel(bf16* parts, const float* src, int rows, int K, int Kp, int P) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * Kp) return;
    const int r = i / Kp, k = i % Kp;
    float rest = k < K ? src[(size_t)r * K + k] : 0.0f;
    for (int p = 0; p < P; p++) {
        const bf16 part = __float2bfloat16(rest);
        parts[(size_t)p * rows * Kp + i] = part;
        rest -= __bfloat162float(part);
    }
}

// tf32 parts (fp32 bit patterns with 10 mantissa bits): big = tf32(x), small = tf32(x - big).
__device__ inline float to_tf32(float x) {
    uint32_t y;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(y) : "f"(x));
    return __uint_as_float(y);
}
__global__ void split_tf32_kernel(float* parts, const float* src, int rows, int K, int Kp) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * Kp) return;
    const int r = i / Kp, k = i % Kp;
    const float x = k < K ? src[(size_t)r * K + k] : 0.0f, big = to_tf32(x);
    parts[i] = big;
    parts[(size_t)rows * Kp + i] = to_tf32(x - big);
}

// ----------------------------------------------------------------------------
// the kernels

// D += A (16x8, row-major) * B (8x8, column-major), tf32 inputs, fp32 accumulators. With g = lane / 4
// and t = lane % 4: a[0] = A[g][t], a[1] = A[g+8][t], a[2] = A[g][t+4], a[3] = A[g+8][t+4];
// b[0] = B[t][g], b[1] = B[t+4][g]; d as in mma_bf16_m16n8k16.
__device__ inline void mma_tf32_m16n8k8(float* d, const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

enum Order { BIG_FIRST, SMALL_FIRST, OWN_ACCUMULATOR }; // where the correction products go
enum { SPLIT_WARPS = 4, WARP_COLS = 32 };

// Both kernels' warp tile: 16 rows from row0 x 32 columns from col0 of Y, in the m16n8 layout
// (acc[nt] = n8 block nt, rows g and g + 8). Y = (big + corrections) * scale + bias, then ReLU.
__device__ inline void store_warp_tile(float* Y, const float (&acc)[WARP_COLS / 8][4],
                                       const float (&cor)[WARP_COLS / 8][4], int row0, int col0, int M, int N,
                                       float scale, const float* bias, bool relu) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int nt = 0; nt < WARP_COLS / 8; nt++)
        for (int i = 0; i < 4; i++) {
            const int r = row0 + g + 8 * (i / 2), c = col0 + nt * 8 + 2 * t + i % 2;
            if (r >= M || c >= N) continue;
            const float v = (acc[nt][i] + cor[nt][i]) * scale + bias[c];
            Y[(size_t)r * N + c] = relu ? fmaxf(v, 0.0f) : v;
        }
}

// Y[M][N] = act(scale * sum over the kept products A_i W_j^T + bias), parts i < PA of A ([PA][a_rows][Kp])
// and j < PB of W ([PB][N][Kp]), the products with i + j <= MAX_SUM. One warp: 16 rows x 32 columns.
template <int PA, int PB, int MAX_SUM, Order ORDER>
__global__ void __launch_bounds__(SPLIT_WARPS * 32)
    split_bf16_gemm_kernel(float* Y, const bf16* A, int a_rows, const bf16* W, const float* bias, int M, int N,
                           int Kp, float scale, bool relu) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int row0 = (blockIdx.y * SPLIT_WARPS + warp) * 16, col0 = blockIdx.x * WARP_COLS;
    float acc[WARP_COLS / 8][4] = {}, cor[WARP_COLS / 8][4] = {};
    auto pair = [&](const bf16* base, int row, int rows, int k) {
        return row < rows ? pair_at(base + (size_t)row * Kp + k) : 0u;
    };
    for (int k0 = 0; k0 < Kp; k0 += 16) {
        uint32_t a[PA][4], b[PB][WARP_COLS / 8][2];
        #pragma unroll
        for (int p = 0; p < PA; p++) {
            const bf16* part = A + (size_t)p * a_rows * Kp;
            a[p][0] = pair(part, row0 + g, M, k0 + 2 * t), a[p][1] = pair(part, row0 + g + 8, M, k0 + 2 * t);
            a[p][2] = pair(part, row0 + g, M, k0 + 8 + 2 * t), a[p][3] = pair(part, row0 + g + 8, M, k0 + 8 + 2 * t);
        }
        #pragma unroll
        for (int p = 0; p < PB; p++)
            #pragma unroll
            for (int nt = 0; nt < WARP_COLS / 8; nt++) {
                const bf16* part = W + (size_t)p * N * Kp;
                b[p][nt][0] = pair(part, col0 + nt * 8 + g, N, k0 + 2 * t);
                b[p][nt][1] = pair(part, col0 + nt * 8 + g, N, k0 + 8 + 2 * t);
            }
        #pragma unroll
        for (int step = 0; step <= MAX_SUM; step++) {
            const int sum = ORDER == SMALL_FIRST ? MAX_SUM - step : step; // i + j of this round
            #pragma unroll
            for (int i = 0; i < PA; i++) {
                const int j = sum - i;
                if (j < 0 || j >= PB) continue;
                #pragma unroll
                for (int nt = 0; nt < WARP_COLS / 8; nt++)
                    mma_m16n8k16<bf16>(ORDER == OWN_ACCUMULATOR && sum > 0 ? cor[nt] : acc[nt], a[i], b[j][nt]);
            }
        }
    }
    store_warp_tile(Y, acc, cor, row0, col0, M, N, scale, bias, relu);
}

// 3xTF32: big x big into one accumulator, big x small + small x big into another, per k8 step.
__global__ void __launch_bounds__(SPLIT_WARPS * 32)
    split_tf32_gemm_kernel(float* Y, const float* A, int a_rows, const float* W, const float* bias, int M, int N,
                           int Kp, float scale, bool relu) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int row0 = (blockIdx.y * SPLIT_WARPS + warp) * 16, col0 = blockIdx.x * WARP_COLS;
    float acc[WARP_COLS / 8][4] = {}, cor[WARP_COLS / 8][4] = {};
    auto at = [&](const float* base, int row, int rows, int k) {
        return row < rows ? __float_as_uint(base[(size_t)row * Kp + k]) : 0u;
    };
    for (int k0 = 0; k0 < Kp; k0 += 8) {
        uint32_t a[2][4], b[2][WARP_COLS / 8][2];
        for (int p = 0; p < 2; p++) {
            const float* part = A + (size_t)p * a_rows * Kp;
            a[p][0] = at(part, row0 + g, M, k0 + t), a[p][1] = at(part, row0 + g + 8, M, k0 + t);
            a[p][2] = at(part, row0 + g, M, k0 + t + 4), a[p][3] = at(part, row0 + g + 8, M, k0 + t + 4);
            for (int nt = 0; nt < WARP_COLS / 8; nt++) {
                const float* w = W + (size_t)p * N * Kp;
                b[p][nt][0] = at(w, col0 + nt * 8 + g, N, k0 + t),
                b[p][nt][1] = at(w, col0 + nt * 8 + g, N, k0 + t + 4);
            }
        }
        for (int nt = 0; nt < WARP_COLS / 8; nt++) {
            mma_tf32_m16n8k8(cor[nt], a[0], b[1][nt]);
            mma_tf32_m16n8k8(cor[nt], a[1], b[0][nt]);
            mma_tf32_m16n8k8(acc[nt], a[0], b[0][nt]);
        }
    }
    store_warp_tile(Y, acc, cor, row0, col0, M, N, scale, bias, relu);
}

// ----------------------------------------------------------------------------
// the driver

// One layer: fp32 inputs X [kMaxM][K] (fc1: the pixels as 0..255, scale 1/255), its weights and
// bias, the float64 reference.
struct SplitLayer {
    const char* name;
    int K, N;
    bool relu, pixels;
    float scale;
    std::vector<float> x, w, b;
    std::vector<double> ref; // [kMaxM][N]
};

// The layer in float64 (cpu_reference.h), on the inputs as the model sees them (pixels / 255).
static std::vector<double> reference(const SplitLayer& l) {
    std::vector<double> x(l.x.size()), y((size_t)kMaxM * l.N);
    for (size_t i = 0; i < x.size(); i++) x[i] = l.pixels ? l.x[i] / 255.0 : l.x[i];
    cpu_linear(y.data(), x.data(), l.w.data(), l.b.data(), kMaxM, l.N, l.K, l.relu);
    return y;
}

struct Scheme {
    const char* name;
    int products;  // per k16 step (3xTF32: per k16, two k8 steps of 3)
    double bound;  // the error it must stay within: bf16's 2e-2, or fp32's 1e-5 (2 parts: 1e-4, a study)
    bool fc1_only; // A taken as exact (one part): only the pixels are
    std::function<void(float*, const void*, const void*, const float*, int, int, int, float, bool)> run;
};

template <int PA, int PB, int MAX_SUM, Order ORDER>
static Scheme bf16_scheme(const char* name, int products, double bound, bool fc1_only = false) {
    return {name, products, bound, fc1_only,
            [](float* y, const void* a, const void* w, const float* bias, int M, int N, int Kp, float scale,
               bool relu) {
                const dim3 grid(ceil_div(N, WARP_COLS), ceil_div(M, 16 * SPLIT_WARPS));
                split_bf16_gemm_kernel<PA, PB, MAX_SUM, ORDER><<<grid, SPLIT_WARPS * 32>>>(
                    y, (const bf16*)a, kMaxM, (const bf16*)w, bias, M, N, Kp, scale, relu);
                cudaCheck(cudaGetLastError());
            }};
}

int main() {
    print_device_info();
    HostWeights hw = {};
    Error err;
    if (!load_file("data/vae_weights.bin", parse_weights, &hw, &err) &&
        !load_file("../data/vae_weights.bin", parse_weights, &hw, &err))
        fail("%s", err.msg);
    bool from_file = false;
    const std::vector<uint8_t> px = vae::load_pixels(kMaxM, &from_file);
    if (!from_file) fail("data/t10k-images-idx3-ubyte is missing. HINT: make data");
    auto tensor = [&](int t) { return std::vector<float>(hw.tensor[t], hw.tensor[t] + hw.size[t]); };

    // the layers, each fed the float64 forward pass's activations rounded to fp32 (z = mu)
    SplitLayer fc1{"fc1", INPUT_DIM, HIDDEN_DIM, true, true, 1.0f / 255.0f, {}, tensor(FC1_W), tensor(FC1_B), {}};
    fc1.x.assign(px.begin(), px.end());
    fc1.ref = reference(fc1);
    std::vector<float> enc_w = tensor(FC21_W), enc_b = tensor(FC21_B);
    for (float v : tensor(FC22_W)) enc_w.push_back(v);
    for (float v : tensor(FC22_B)) enc_b.push_back(v);
    SplitLayer fc2x{"fc21+fc22", HIDDEN_DIM, MULV_DIM, false, false, 1.0f, {}, enc_w, enc_b, {}};
    fc2x.x.assign(fc1.ref.begin(), fc1.ref.end());
    fc2x.ref = reference(fc2x);
    SplitLayer fc3{"fc3", LATENT_DIM, HIDDEN_DIM, true, false, 1.0f, {}, tensor(FC3_W), tensor(FC3_B), {}};
    for (int m = 0; m < kMaxM; m++)
        for (int j = 0; j < LATENT_DIM; j++) fc3.x.push_back((float)fc2x.ref[(size_t)m * MULV_DIM + j]);
    fc3.ref = reference(fc3);
    SplitLayer fc4{"fc4", HIDDEN_DIM, INPUT_DIM, false, false, 1.0f, {}, tensor(FC4_W), tensor(FC4_B), {}};
    fc4.x.assign(fc3.ref.begin(), fc3.ref.end());
    fc4.ref = reference(fc4);

    const Scheme schemes[] = {
        bf16_scheme<1, 1, 0, BIG_FIRST>("bf16, 1 product (the bf16 path)", 1, 2e-2),
        bf16_scheme<2, 2, 1, OWN_ACCUMULATOR>("bf16 x 2 parts, 3 products", 3, 1e-4),
        bf16_scheme<3, 3, 2, BIG_FIRST>("bf16 x 3, 6 products, one accumulator, big first", 6, 1e-5),
        bf16_scheme<3, 3, 2, SMALL_FIRST>("bf16 x 3, 6 products, one accumulator, small first", 6, 1e-5),
        bf16_scheme<3, 3, 2, OWN_ACCUMULATOR>("bf16 x 3, 6 products, corrections apart", 6, 1e-5),
        bf16_scheme<1, 3, 2, OWN_ACCUMULATOR>("exact A x bf16 x 3 weights, 3 products", 3, 1e-5, true),
        {"3xTF32, corrections apart", 6, 1e-5, false,
         [](float* y, const void* a, const void* w, const float* bias, int M, int N, int Kp, float scale, bool relu) {
             const dim3 grid(ceil_div(N, WARP_COLS), ceil_div(M, 16 * SPLIT_WARPS));
             split_tf32_gemm_kernel<<<grid, SPLIT_WARPS * 32>>>(y, (const float*)a, kMaxM, (const float*)w, bias, M,
                                                                 N, Kp, scale, relu);
             cudaCheck(cudaGetLastError());
         }},
    };
    const int tf32_scheme = (int)std::size(schemes) - 1;

    bool all_ok = true;
    CublasLtLinear<float> cublas;
    printf(
        "\n| layer | scheme | products / k16 | error vs float64 (max over M) | us at M = 4096 | vs cuBLAS fp32 | vs 1 "
        "product |\n|---|---|---:|---:|---:|---:|---:|\n");
    for (SplitLayer* l : {&fc1, &fc2x, &fc3, &fc4}) {
        const int Kp = ceil_div(l->K, 16) * 16;
        float *x, *w, *bias, *y, *w_tf32, *x_tf32;
        bf16 *x_parts, *w_parts;
        cudaCheck(cudaMalloc(&x, l->x.size() * 4)), cudaCheck(cudaMalloc(&w, l->w.size() * 4));
        cudaCheck(cudaMalloc(&bias, l->b.size() * 4)), cudaCheck(cudaMalloc(&y, (size_t)kMaxM * l->N * 4));
        cudaCheck(cudaMalloc(&x_parts, (size_t)3 * kMaxM * Kp * 2));
        cudaCheck(cudaMalloc(&w_parts, (size_t)3 * l->N * Kp * 2));
        cudaCheck(cudaMalloc(&x_tf32, (size_t)2 * kMaxM * Kp * 4));
        cudaCheck(cudaMalloc(&w_tf32, (size_t)2 * l->N * Kp * 4));
        cudaCheck(cudaMemcpy(x, l->x.data(), l->x.size() * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(w, l->w.data(), l->w.size() * 4, cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(bias, l->b.data(), l->b.size() * 4, cudaMemcpyHostToDevice));
        launch(split_bf16_kernel, (long long)kMaxM * Kp, 256, 256, 0, x_parts, x, kMaxM, l->K, Kp, 3);
        launch(split_bf16_kernel, (long long)l->N * Kp, 256, 256, 0, w_parts, w, l->N, l->K, Kp, 3);
        launch(split_tf32_kernel, (long long)kMaxM * Kp, 256, 256, 0, x_tf32, x, kMaxM, l->K, Kp);
        launch(split_tf32_kernel, (long long)l->N * Kp, 256, 256, 0, w_tf32, w, l->N, l->K, Kp);
        // cuBLAS fp32 takes the scale folded into its input: the pixels / 255 (its own fp32 rounding)
        std::vector<float> x_scaled = l->x;
        for (float& v : x_scaled) v *= l->scale;
        float* x_cublas;
        cudaCheck(cudaMalloc(&x_cublas, x_scaled.size() * 4));
        cudaCheck(cudaMemcpy(x_cublas, x_scaled.data(), x_scaled.size() * 4, cudaMemcpyHostToDevice));
        const GemmArgs<float> g = {x_cublas, w, bias, y, kBatch, l->N, l->K, l->relu ? Act::Relu : Act::None};
        const float cublas_us = benchmark_us([&] { cublas(g); });
        float one_product_us = 0.0f;
        for (int s = 0; s < (int)std::size(schemes); s++) {
            const Scheme& sc = schemes[s];
            if (sc.fc1_only && !l->pixels) continue;
            const void* a = s == tf32_scheme ? (const void*)x_tf32 : (const void*)x_parts;
            const void* b = s == tf32_scheme ? (const void*)w_tf32 : (const void*)w_parts;
            double worst = 0.0;
            for (int M : kCheckM) {
                poison(y, (size_t)kMaxM * l->N * 4);
                sc.run(y, a, b, bias, M, l->N, Kp, l->scale, l->relu);
                cudaCheck(cudaDeviceSynchronize());
                const std::vector<float> got = copy_to_host_float(y, (size_t)M * l->N);
                worst = std::max(worst, rel_err(got.data(), l->ref.data(), (size_t)M * l->N));
            }
            const float us = benchmark_us([&] { sc.run(y, a, b, bias, kBatch, l->N, Kp, l->scale, l->relu); });
            if (s == 0) one_product_us = us;
            const bool ok = worst <= sc.bound; // false for NaN too: an unwritten output
            all_ok = all_ok && ok;
            printf("| %s | %s | %d | %.2e%s | %.2f | %.0f%% | %.2fx |\n", l->name, sc.name, sc.products, worst,
                   ok ? "" : " FAIL (above its bound, or unwritten)", us, 100.0 * cublas_us / us,
                   us / one_product_us);
        }
        printf("| %s | cuBLAS fp32 (CUBLAS_COMPUTE_32F) | - | - | %.2f | 100%% | - |\n", l->name, cublas_us);
        for (void* p : {(void*)x, (void*)w, (void*)bias, (void*)y, (void*)x_parts, (void*)w_parts, (void*)x_tf32,
                        (void*)w_tf32, (void*)x_cublas})
            cudaCheck(cudaFree(p));
    }
    free(hw.data);
    printf("\n%s\n", all_ok ? "every scheme wrote every output within its bound"
                              : "FAIL: a scheme missed its bound or left outputs unwritten");
    return all_ok ? 0 : 1;
}
