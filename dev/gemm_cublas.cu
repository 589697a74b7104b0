// GEMM baselines from the vendor libraries, the yardstick for every variant.
//
//  - cublas_sgemm_unfused: cublasSgemm (fp32, default math mode, so no TF32)
//    followed by a separate bias + activation kernel. Shows what an unfused
//    epilogue costs: one more read and write of Y.
//  - cublaslt_fp32: cuBLASLt with CUBLAS_COMPUTE_32F and the bias (+ ReLU)
//    fused into the GEMM epilogue (CUBLASLT_EPILOGUE_BIAS / RELU_BIAS). This
//    is the baseline the fp32 variants v1-v5 are compared with.
//  - cublaslt_bf16: the same with bf16 inputs and output, fp32 accumulation:
//    the baseline for the tensor-core variants v6-v7.
// Each is validated like the hand-written kernels; its "% of cuBLAS" column is
// measured against the fused cuBLASLt call of the same precision, so the two
// cuBLASLt rows show ~100% and their spread is the timing noise.
// It also times an empty kernel under the same protocol: the floor under every
// number in the table (launch + event overhead after an L2 flush).
//
// Build and run:  make -C dev gemm_cublas && ./dev/gemm_cublas
#include "common.h"

__global__ void bias_act(float* Y, const float* bias, int M, int N, Act act) {
    const size_t total = static_cast<size_t>(M) * N;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        // the activation as a max: with 0 for ReLU, with -inf for none
        Y[i] = fmaxf(Y[i] + bias[i % N], act == Act::Relu ? 0.0f : -INFINITY);
}

__global__ void empty_kernel() {}

int main() {
    print_device_info();
    const float floor_us = benchmark_us([] {
        empty_kernel<<<1, 32>>>();
        cudaCheck(cudaGetLastError());
    });
    printf("timing floor (empty kernel, same protocol): %.2f us\n", floor_us);

    cublasHandle_t handle;
    cublasCheck(cublasCreate(&handle));
    cublasCheck(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
    // Row-major Y = X W^T is column-major Y^T = W X^T (see CublasLtLinear).
    const GemmLauncher<float> sgemm_unfused = [&](const GemmArgs<float>& g) {
        const float alpha = 1.0f, beta = 0.0f;
        cublasCheck(cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, g.N, g.M, g.K, &alpha, g.W, g.K, g.X, g.K,
                                &beta, g.Y, g.N));
        const int blocks = static_cast<int>(std::min<size_t>((static_cast<size_t>(g.M) * g.N + 255) / 256, 4096));
        bias_act<<<blocks, 256>>>(g.Y, g.bias, g.M, g.N, g.act);
        cudaCheck(cudaGetLastError());
    };

    CublasLtLinear<float> lt_fp32;
    CublasLtLinear<__nv_bfloat16> lt_bf16;
    bool ok = run_gemm_driver<float>("cublas_sgemm_unfused", sgemm_unfused);
    ok = run_gemm_driver<float>("cublaslt_fp32", [&](const GemmArgs<float>& g) { lt_fp32(g); }) && ok;
    ok = run_gemm_driver<__nv_bfloat16>("cublaslt_bf16", [&](const GemmArgs<__nv_bfloat16>& g) { lt_bf16(g); }) && ok;

    cublasCheck(cublasDestroy(handle));
    return ok ? 0 : 1;
}
