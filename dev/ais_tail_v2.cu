// AIS tail v2: the plain path's gradient through fc3's ReLU and fc3 in one pass, against the two launches it would
// replace. A miss: vae.cu keeps the two launches.
//
// The plain path's AIS gradient ends in two launches after fc4's backward product dh = (sigmoid - x) W4: the ReLU's
// backward (vae.cu's relu_backward_kernel: dh zeroed where h3 is, in place) and fc3's backward product grad = dh W3 on
// cuBLASLt (W3 in the backward's type, fp16 for bf16). Per row of H3 = 400 that is dh read three times and written
// once plus h3 read once: 5 x 800 bytes in bf16, 5 x 1,600 in fp32.
// v1: one pass, dh and h3 read once, the mask applied on the way, W3 (fp32, exact in both precisions) in shared memory,
// a warp a row, its lanes' 20 sums added in a fixed shuffle tree. Predicted ~20 us at 40,000 rows (bf16) against the
// two launches' ~40. Result, in vae.cu: 269 us (H200): its latent loops (vae.cu's UNROLL_LATENTS) left the 20 sums
// on the stack; written out here with plain unroll, 96 us.
// v2: eight units' loads in flight before their products, two rows a warp (each load of W3 serves both): predicted
// ~25 us. Result: 153 us (vae.cu's form then, W3's columns in passes for any size; this driver's v2 holds all 20 in
// one and is untimed), slower than v1: 80 registers and 48 KB a block leave 24 warps an SM, and a row's 8,000
// products (fp32 FMAs, a shared-memory load each) are more than the bytes saved are worth on an H200.
// The two launches take 38.5 us at 40,000 rows (bf16; 61.4 less the 22.9 of the dh copy this driver adds so that the
// in-place ReLU starts from the same dh each time), 93.5 in fp32: the tensor cores do fc3's backward product faster
// than the SIMT cores, and the ReLU's pass costs less than the products a fused pass adds.
//
// Each variant is checked against float64 on rows 1, 7, 37, 1023, 4097 and an AIS part of 40,000 (the two launches to
// their fp16 W3's 2e-3 in bf16), then timed on 40,000 and 65,536 rows.
//
// Build and run:  make -C dev ais_tail_v2 && ./dev/ais_tail_v2
#include "common.h"

using namespace vae;

enum { FC3_BACKWARD_THREADS = 256, FC3_BACKWARD_FLOATS = 12288, FC3_BACKWARD_BATCH = 8 }; // 48 KB of W3's columns

// v1: a warp a row, one hidden unit's loads at a time.
template <typename G, typename H, int ZMAX>
__global__ void __launch_bounds__(FC3_BACKWARD_THREADS)
    fc3_backward_v1_kernel(float* grad, const G* __restrict__ dh, const H* __restrict__ h3,
                           const float* __restrict__ w3, int rows, int h3_dim, int nz) {
    __shared__ float w[FC3_BACKWARD_FLOATS];
    const int lane = threadIdx.x % 32, warps = blockDim.x / 32, pad = z_pad(nz), stride = nz | 1;
    for (int i = threadIdx.x; i < h3_dim * nz; i += blockDim.x) w[i / nz * stride + i % nz] = w3[i];
    __syncthreads();
    for (int r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += gridDim.x * warps) {
        float acc[ZMAX] = {};
        for (int k = lane; k < h3_dim; k += 32) {
            const size_t at = (size_t)r * h3_dim + k;
            const float g = as_float(h3[at]) > 0.0f ? as_float(dh[at]) : 0.0f;
            #pragma unroll
            for (int j = 0; j < ZMAX; j++) acc[j] = fmaf(g, w[k * stride + j], acc[j]);
        }
        #pragma unroll
        for (int j = 0; j < ZMAX; j++) {
            float sum = acc[j];
            for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
            if (lane == j % 32) grad[(size_t)r * pad + j] = sum;
        }
        if (lane < pad - nz) grad[(size_t)r * pad + nz + lane] = 0.0f;
    }
}

// v2: a warp two rows, eight hidden units' loads in flight before their products.
template <typename G, typename H, int ZMAX>
__global__ void __launch_bounds__(FC3_BACKWARD_THREADS)
    fc3_backward_v2_kernel(float* grad, const G* __restrict__ dh, const H* __restrict__ h3,
                           const float* __restrict__ w3, int rows, int h3_dim, int nz) {
    constexpr int BATCH = FC3_BACKWARD_BATCH;
    __shared__ float w[FC3_BACKWARD_FLOATS];
    const int lane = threadIdx.x % 32, warps = blockDim.x / 32, pad = z_pad(nz), stride = nz | 1;
    for (int i = threadIdx.x; i < h3_dim * nz; i += blockDim.x) w[i / nz * stride + i % nz] = w3[i];
    __syncthreads();
    for (int r0 = 2 * (blockIdx.x * warps + threadIdx.x / 32); r0 < rows; r0 += 2 * gridDim.x * warps) {
        float acc[2][ZMAX] = {};
        for (int k0 = 0; k0 < h3_dim; k0 += 32 * BATCH) {
            float g[2][BATCH]; // mask . dh; zero past the rows and the hidden units
            #pragma unroll
            for (int b = 0; b < BATCH; b++)
                #pragma unroll
                for (int i = 0; i < 2; i++) {
                    const int k = k0 + 32 * b + lane;
                    const bool in = k < h3_dim && r0 + i < rows;
                    const size_t at = (size_t)(r0 + i) * h3_dim + k;
                    const float h = in ? as_float(h3[at]) : 0.0f, d = in ? as_float(dh[at]) : 0.0f;
                    g[i][b] = h > 0.0f ? d : 0.0f;
                }
            #pragma unroll
            for (int b = 0; b < BATCH; b++) {
                const float* w_row = w + min(k0 + 32 * b + lane, h3_dim - 1) * stride;
                #pragma unroll
                for (int j = 0; j < ZMAX; j++) {
                    const float wj = w_row[j];
                    acc[0][j] = fmaf(g[0][b], wj, acc[0][j]), acc[1][j] = fmaf(g[1][b], wj, acc[1][j]);
                }
            }
        }
        #pragma unroll
        for (int i = 0; i < 2; i++) {
            if (r0 + i >= rows) break;
            #pragma unroll
            for (int j = 0; j < ZMAX; j++) {
                float sum = acc[i][j];
                for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
                if (lane == j % 32) grad[(size_t)(r0 + i) * pad + j] = sum;
            }
            if (lane < pad - nz) grad[(size_t)(r0 + i) * pad + nz + lane] = 0.0f;
        }
    }
}

enum { H3 = HIDDEN_DIM, Z = LATENT_DIM, PAD = z_pad(LATENT_DIM), MAX_ROWS = 65536 };

// G: dh's type, H: h3's (the plain path's pairs: fp16 and bf16, or fp32 and fp32).
template <typename G, typename H> static bool run(const char* name, double tol_before) {
    const cudaDataType_t g_type = std::is_same<G, float>::value ? CUDA_R_32F : CUDA_R_16F;
    std::vector<float> dh((size_t)MAX_ROWS * H3), h3(dh.size()), w3((size_t)H3 * Z);
    fill_random(dh, 7, 0.5f), fill_random(h3, 8, 1.0f), fill_random(w3, 9, 0.1f); // h3 < 0: about half masked
    std::vector<G> dh_t(dh.size());
    std::vector<H> h3_t(h3.size());
    for (size_t i = 0; i < dh.size(); i++) {
        dh_t[i] = G(dh[i]), h3_t[i] = H(h3[i]);
        dh[i] = static_cast<float>(dh_t[i]), h3[i] = static_cast<float>(h3_t[i]); // the values the GPU sees
    }
    G* d_dh = device_upload(dh_t);
    G* d_work;
    cudaCheck(cudaMalloc(&d_work, dh_t.size() * sizeof(G)));
    H* d_h3 = device_upload(h3_t);
    float* d_w3 = device_upload(w3);
    G* d_w3_padded;
    float* d_grad;
    cudaCheck(cudaMalloc(&d_w3_padded, (size_t)H3 * PAD * sizeof(G)));
    cudaCheck(cudaMalloc(&d_grad, (size_t)MAX_ROWS * PAD * sizeof(float)));
    launch(plain_weights_kernel<G>, (long long)H3 * PAD, 256, 256, 0, d_w3_padded, d_w3, H3, Z, PAD);
    cublasLtHandle_t lt;
    cublasCheck(cublasLtCreate(&lt));
    Gemm product = gemm_init(lt, d_w3_padded, H3, PAD, PAD, true, false, NULL, g_type, CUDA_R_32F, 1.0f,
                             std::is_same<G, float>::value ? 2048 : 65536);
    const int sms = device_props().multiProcessorCount;
    auto before = [&](int rows) {
        cudaCheck(cudaMemcpyAsync(d_work, d_dh, (size_t)rows * H3 * sizeof(G), cudaMemcpyDeviceToDevice));
        launch(relu_backward_kernel<G, H>, (long long)rows * H3 / 4, 256, 256, 0, d_work, d_h3, (long long)rows * H3);
        gemm(lt, product, d_grad, d_work, rows, 0);
    };
    auto v1 = [&](int rows) {
        const int blocks = std::min(ceil_div(rows, FC3_BACKWARD_THREADS / 32), 4 * sms);
        launch(fc3_backward_v1_kernel<G, H, LATENT_DIM>, blocks, 1, FC3_BACKWARD_THREADS, 0, d_grad, d_dh, d_h3, d_w3,
               rows, H3, Z);
    };
    auto v2 = [&](int rows) {
        const int blocks = std::min(ceil_div(rows, FC3_BACKWARD_THREADS / 32), 4 * sms);
        launch(fc3_backward_v2_kernel<G, H, LATENT_DIM>, blocks, 1, FC3_BACKWARD_THREADS, 0, d_grad, d_dh, d_h3, d_w3,
               rows, H3, Z);
    };
    const char* names[] = {"vae.cu: ReLU + cuBLASLt", "v1: a load at a time", "v2: two rows, loads batched"};
    auto run_variant = [&](int variant, int rows) { variant == 0 ? before(rows) : variant == 1 ? v1(rows) : v2(rows); };
    std::vector<double> ref((size_t)MAX_ROWS * Z);
    for (int r = 0; r < MAX_ROWS; r++)
        for (int j = 0; j < Z; j++) {
            double sum = 0.0;
            for (int k = 0; k < H3; k++)
                if (h3[(size_t)r * H3 + k] > 0.0f) sum += (double)dh[(size_t)r * H3 + k] * w3[(size_t)k * Z + j];
            ref[(size_t)r * Z + j] = sum;
        }
    bool ok = true;
    for (int variant = 0; variant < 3; variant++)
        for (int rows : {1, 7, 37, 1023, 4097, 40000}) {
            poison(d_grad, (size_t)MAX_ROWS * PAD * sizeof(float));
            run_variant(variant, rows);
            cudaCheck(cudaDeviceSynchronize());
            const std::vector<float> got = copy_to_host_float(d_grad, (size_t)rows * PAD);
            double diff = 0.0, top = 0.0;
            bool finite = true;
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < PAD; j++) {
                    const float g = got[(size_t)r * PAD + j];
                    const double e = j < Z ? ref[(size_t)r * Z + j] : 0.0;
                    finite = finite && std::isfinite(g);
                    diff = std::max(diff, std::fabs(g - e)), top = std::max(top, std::fabs(e));
                }
            const double rel = finite ? diff / top : INFINITY, tol = variant == 0 ? tol_before : 1e-5;
            const bool good = rel <= tol;
            if (!good || rows == 40000)
                printf("check %-24s %s rows=%-6d relative error %.2e (tol %.0e) %s\n", names[variant], name, rows, rel,
                       tol, good ? "OK" : "FAIL");
            ok = ok && good;
        }
    for (int rows : {40000, 65536}) {
        const float copy_us = benchmark_us([&] {
            cudaCheck(cudaMemcpyAsync(d_work, d_dh, (size_t)rows * H3 * sizeof(G), cudaMemcpyDeviceToDevice));
        });
        printf("| %-32s | %s | %6d | %8.2f | (in 'before': the ReLU's backward writes dh in place) |\n",
               "dh's copy alone", name, rows, copy_us);
        for (int variant = 0; variant < 3; variant++) {
            const float us = benchmark_us([&] { run_variant(variant, rows); });
            const double bytes = (double)rows * H3 * (sizeof(G) + sizeof(H)) + (double)rows * PAD * sizeof(float);
            printf("| %-32s | %s | %6d | %8.2f | %6.0f GB/s |\n", names[variant], name, rows, us, bytes / us * 1e-3);
        }
    }
    gemm_free(&product);
    cublasCheck(cublasLtDestroy(lt));
    void* buffers[] = {d_dh, d_work, d_h3, d_w3, d_w3_padded, d_grad};
    for (void* p : buffers) cudaCheck(cudaFree(p));
    return ok;
}

int main() {
    print_device_info();
    printf("| variant | dh, h3 | rows | time us | one pass (dh, h3 read, grad written) |\n|---|---|---|---|---|\n");
    const bool ok = run<fp16, bf16>("fp16, bf16", 2e-3) & run<float, float>("fp32, fp32", 1e-5);
    printf("%s\n", ok ? "all checks passed" : "CHECKS FAILED");
    return ok ? 0 : 1;
}
