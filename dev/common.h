// The dev/ drivers' harness: what every kernel study needs around its kernel, and no model code. vae.cu
// comes first (with TESTING: no CLI), so the model's constants, the generator, the file parsers, the
// PTX helpers and the kernels are the program's own and a driver cannot drift from them; then
// ../cpu_reference.h, the float64 CPU model that test_vae.cu checks against too. This file adds
// deterministic inputs, validation, the timing protocol, the cuBLASLt baseline, the result tables and
// one validate-then-time driver per kernel family (GEMM, reparameterisation, loss, conversion). What
// only the AIS drivers need (their drivers, the float64 AIS) lives with them in ais_common.h. Each
// dev/*.cu writes out the kernel it studies; where that kernel has a name vae.cu also uses, the
// driver's copy carries a version suffix. GEMM layout (PyTorch nn.Linear): X[M,K] and W[N,K]
// row-major, bias[N], Y[M,N] = act(X · W^T + bias).
#pragma once

#ifndef TESTING
#define TESTING  // vae.cu without its main()
#endif
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"  // the CLI's helpers, which no driver calls
#include "../vae.cu"
#pragma GCC diagnostic pop
#include "../cpu_reference.h"

#include <algorithm>  // vae.cu brings the C headers (stdint, stdio, stdlib, math)
#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>
#include <cublasLt.h>
#include <cublas_v2.h>

// ---- Error checking: cudaCheck and cublasCheck come from vae.cu

// ---- ldmatrix, for the mma.sync drivers (vae.cu's kernels are on wgmma, which reads shared memory itself)
// The warp loads four (x4) or two (x2) 8x8 16-bit matrices from shared memory, lane i giving the address of
// one 16-byte row (lanes 0-7 matrix 0, 8-15 matrix 1, ...), and every lane receives exactly the registers
// mma.sync expects. One instruction replaces 4 (or 2) 32-bit shared loads per lane, and its address math is
// done once per fragment.
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ inline void ldmatrix_x2(uint32_t& r0, uint32_t& r1, const void* row) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

inline bool is_aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// ---- The problem: the VAE's four Linear layers at batch M = 4096
enum class Act { None, Relu };

inline const char* act_name(Act act) { return act == Act::Relu ? "relu" : "none"; }

struct LayerShape {
    const char* name;
    int K, N;  // in_features, out_features
    Act act;
};

constexpr int kBatch = 4096;
constexpr LayerShape kLayers[] = {
    {"fc1", INPUT_DIM, HIDDEN_DIM, Act::Relu},           // encoder hidden
    {"fc21+fc22", HIDDEN_DIM, 2 * LATENT_DIM, Act::None}, // mu and logvar as one 40-wide GEMM
    {"fc3", LATENT_DIM, HIDDEN_DIM, Act::Relu},          // decoder hidden
    {"fc4", HIDDEN_DIM, INPUT_DIM, Act::None},           // decoder logits (sigmoid lives in the loss)
};
// Ragged M, multiples of no tile size; all prefixes of the largest, so one CPU reference serves every M.
constexpr int kCheckM[] = {kBatch, 1, 37, 1023, 4097};
constexpr int kMaxM = 4097;

inline double gemm_flops(int M, int N, int K) { return 2.0 * M * N * K; }

// ---- Element types: fp32 and bf16 share the drivers through these traits
template <typename T> struct ElemTraits;  // not "Precision": vae.cu's fp32 / bf16 switch has that name

template <> struct ElemTraits<float> {
    static constexpr const char* name = "fp32";
    static constexpr cudaDataType_t cuda_type = CUDA_R_32F;
    // fp32 accumulation over K <= 784 of O(1) terms errs by ~1e-6; TF32
    // inputs would err by ~1e-3, so this tolerance also catches a TF32 path.
    static constexpr double atol = 1e-4, rtol = 1e-4;
    static float to_float(float v) { return v; }
    static float from_float(float v) { return v; }
};

template <> struct ElemTraits<__nv_bfloat16> {
    static constexpr const char* name = "bf16";
    static constexpr cudaDataType_t cuda_type = CUDA_R_16BF;
    // The reference uses the same bf16-rounded inputs, so the only sizeable
    // error is rounding the output to bf16 (8 significant bits: <= 2^-9 ~ 0.2%
    // relative); 1e-2 leaves 5x headroom for fp32 accumulation-order changes.
    static constexpr double atol = 1e-3, rtol = 1e-2;
    static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }
};

// ---- Deterministic inputs
// Fixed-seed xorshift64*: the same inputs on every run and every machine.
struct Rng {
    uint64_t state;
    explicit Rng(uint64_t seed) : state(seed * 0x9E3779B97F4A7C15ull + 1) {}
    uint32_t next_u32() {
        state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
        return static_cast<uint32_t>((state * 0x2545F4914F6CDD1Dull) >> 32);
    }
    // Uniform in [-scale, -scale/64] U [scale/64, scale]: never zero, so an ignored input shows in validation.
    float next_nonzero(float scale) {
        const float u = (next_u32() >> 8) * (1.0f / 16777216.0f);  // [0, 1)
        const float magnitude = scale * (1.0f / 64.0f + u * (63.0f / 64.0f));
        return (next_u32() & 1u) ? magnitude : -magnitude;
    }
};

inline void fill_random(std::vector<float>& v, uint64_t seed, float scale) {
    Rng rng(seed);
    for (float& x : v) x = rng.next_nonzero(scale);
}

// Round host values to T's precision in place so the CPU reference sees exactly the numbers the GPU gets.
template <typename T>
void round_to(std::vector<float>& v) {
    for (float& x : v) x = ElemTraits<T>::to_float(ElemTraits<T>::from_float(x));
}

template <typename T>
std::vector<T> convert_to(const std::vector<float>& v) {
    std::vector<T> out(v.size());
    std::transform(v.begin(), v.end(), out.begin(), ElemTraits<T>::from_float);
    return out;
}

// ---- Validation
struct CheckResult {
    bool ok = true;
    double max_abs = 0.0, max_rel = 0.0;
    size_t first_bad = SIZE_MAX;
    float bad_got = 0.0f, bad_ref = 0.0f;
};

// |got - ref| <= atol + rtol*|ref| elementwise; NaN (an unwritten, poisoned element) always fails.
inline CheckResult validate(const float* got, const float* ref, size_t n, double atol, double rtol) {
    CheckResult r;
    for (size_t i = 0; i < n; ++i) {
        const double diff = std::fabs(static_cast<double>(got[i]) - ref[i]);
        const bool good = diff <= atol + rtol * std::fabs(static_cast<double>(ref[i]));
        if (!good && r.ok) r.ok = false, r.first_bad = i, r.bad_got = got[i], r.bad_ref = ref[i];
        if (std::isnan(diff)) continue;
        r.max_abs = std::max(r.max_abs, diff);
        r.max_rel = std::max(r.max_rel, diff / std::max(std::fabs(static_cast<double>(ref[i])), 1e-6));
    }
    return r;
}

// Fill a device buffer with 0xFF bytes: NaN in fp32, bf16 and fp16, so an unwritten output fails validation.
inline void poison(void* dev_ptr, size_t bytes) { cudaCheck(cudaMemset(dev_ptr, 0xFF, bytes)); }

template <typename T>
T* device_upload(const std::vector<T>& host) {
    T* dev = nullptr;
    cudaCheck(cudaMalloc(&dev, std::max<size_t>(host.size(), 1) * sizeof(T)));
    cudaCheck(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return dev;
}

template <typename T>
std::vector<float> copy_to_host_float(const T* dev_ptr, size_t n) {
    std::vector<T> tmp(n);
    cudaCheck(cudaMemcpy(tmp.data(), dev_ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<float> out(n);
    std::transform(tmp.begin(), tmp.end(), out.begin(), ElemTraits<T>::to_float);
    return out;
}

// ---- Device info
inline cudaDeviceProp& device_props() { static cudaDeviceProp props; return props; }

// Prints the GPU and exits 1 with one line when there is none.
inline void print_device_info() {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0)
        fail("no CUDA device available (%s)", err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0");
    cudaDeviceProp& p = device_props();
    cudaCheck(cudaGetDeviceProperties(&p, 0));
    printf("device: %s, sm_%d%d, %d SMs, L2 %.0f MB\n", p.name, p.major, p.minor, p.multiProcessorCount,
           p.l2CacheSize / 1048576.0);
}

// max |got - ref| / max |ref| over columns col..col+count-1 of rows x pitch values (a plain array:
// n rows of 1); infinity when a value is not finite (an unwritten output is NaN-poisoned).
template <typename T>
double rel_err(const float* got, const T* ref, size_t rows, size_t pitch = 1, size_t col = 0, size_t count = 1) {
    double diff = 0.0, top = 0.0;
    for (size_t r = 0; r < rows; r++)
        for (size_t j = col; j < col + count; j++) {
            const double g = got[r * pitch + j], e = ref[r * pitch + j];
            if (!std::isfinite(g)) return INFINITY;
            diff = std::max(diff, std::fabs(g - e)), top = std::max(top, std::fabs(e));
        }
    return diff / top;
}

// ---- Timing
// Median time of `launch` in microseconds. `cold`: each repeat follows a write of a buffer larger
// than L2 (outside the timed region; it keeps the GPU busy, so launch latency is not timed either),
// as a layer meets the cache in a real forward pass; otherwise back to back with the L2 warm.
template <typename F>
float benchmark_us(F&& launch, int repeats = 200, int warmup = 10, bool cold = true) {
    static void* flush_buffer = nullptr;
    static size_t flush_bytes = 0;
    if (!flush_buffer) {
        flush_bytes = std::max<size_t>(256u << 20, 4 * static_cast<size_t>(device_props().l2CacheSize));
        cudaCheck(cudaMalloc(&flush_buffer, flush_bytes));
    }
    for (int i = 0; i < warmup; ++i) launch();
    cudaCheck(cudaDeviceSynchronize());

    std::vector<cudaEvent_t> start(repeats), stop(repeats);
    for (int i = 0; i < repeats; ++i) cudaCheck(cudaEventCreate(&start[i])), cudaCheck(cudaEventCreate(&stop[i]));
    for (int i = 0; i < repeats; ++i) {
        if (cold) cudaCheck(cudaMemsetAsync(flush_buffer, i & 0xFF, flush_bytes));
        cudaCheck(cudaEventRecord(start[i]));
        launch();
        cudaCheck(cudaEventRecord(stop[i]));
    }
    cudaCheck(cudaEventSynchronize(stop[repeats - 1]));
    std::vector<float> us(repeats);
    for (int i = 0; i < repeats; ++i) {
        cudaCheck(cudaEventElapsedTime(&us[i], start[i], stop[i]));  // ms
        us[i] *= 1000.0f;
        cudaCheck(cudaEventDestroy(start[i])), cudaCheck(cudaEventDestroy(stop[i]));
    }
    std::sort(us.begin(), us.end());
    return us[repeats / 2];
}

// ---- What a GEMM variant is: a host function that launches it
template <typename T>
struct GemmArgs {
    const T *X, *W, *bias;  // [M,K], [N,K], [N]
    T* Y;                   // [M,N]
    int M, N, K;
    Act act;
};

template <typename T>
using GemmLauncher = std::function<void(const GemmArgs<T>&)>;

// ---- cuBLASLt baseline: Y = act(X W^T + bias) with the bias (and ReLU) fused into
// the GEMM epilogue, fp32 accumulation. For fp32 inputs the compute type is
// CUBLAS_COMPUTE_32F, which never uses TF32 tensor cores, so it is a true
// fp32 baseline.
//
// cuBLAS is column-major. Row-major Y[M,N] is column-major Y^T[N,M] = W X^T:
// W (row-major [N,K]) is column-major [K,N] used transposed, and X (row-major
// [M,K]) is column-major [K,M] used as is. The bias then runs along the rows
// of the column-major result, which is what the BIAS epilogue broadcasts.
template <typename T>
class CublasLtLinear {
public:
    CublasLtLinear() { cublasCheck(cublasLtCreate(&handle_)), cudaCheck(cudaMalloc(&workspace_, kWorkspaceBytes)); }
    ~CublasLtLinear() {
        for (Plan& p : plans_) {
            cublasLtMatrixLayoutDestroy(p.layout_w), cublasLtMatrixLayoutDestroy(p.layout_x);
            cublasLtMatrixLayoutDestroy(p.layout_y), cublasLtMatmulDescDestroy(p.desc);
        }
        cudaFree(workspace_), cublasLtDestroy(handle_);
    }
    CublasLtLinear(const CublasLtLinear&) = delete;
    CublasLtLinear& operator=(const CublasLtLinear&) = delete;

    void operator()(const GemmArgs<T>& g) {
        Plan& p = plan_for(g);
        cublasCheck(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
        const float alpha = 1.0f, beta = 0.0f;
        cublasCheck(cublasLtMatmul(handle_, p.desc, &alpha, g.W, p.layout_w, g.X, p.layout_x, &beta, g.Y, p.layout_y,
                                   g.Y, p.layout_y, &p.algo, workspace_, kWorkspaceBytes, 0));
    }

private:
    static constexpr size_t kWorkspaceBytes = 32u << 20;
    struct Plan {
        int M, N, K;
        Act act;
        cublasLtMatmulDesc_t desc;
        cublasLtMatrixLayout_t layout_w, layout_x, layout_y;
        cublasLtMatmulAlgo_t algo;
    };

    // Descriptors and the heuristic's algorithm are built once per shape, so
    // the timed call is only the matmul launch.
    Plan& plan_for(const GemmArgs<T>& g) {
        for (Plan& p : plans_)
            if (p.M == g.M && p.N == g.N && p.K == g.K && p.act == g.act) return p;
        const cudaDataType_t type = ElemTraits<T>::cuda_type;
        Plan p{g.M, g.N, g.K, g.act, nullptr, nullptr, nullptr, nullptr, {}};
        cublasCheck(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* value, size_t bytes) {
            cublasCheck(cublasLtMatmulDescSetAttribute(p.desc, attr, value, bytes));
        };
        const cublasOperation_t transpose = CUBLAS_OP_T, no_transpose = CUBLAS_OP_N;
        set(CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose));
        set(CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose, sizeof(no_transpose));
        const cublasLtEpilogue_t epilogue = g.act == Act::Relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS;
        set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue));
        const int32_t bias_type = type;
        set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type));
        set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias));
        cublasCheck(cublasLtMatrixLayoutCreate(&p.layout_w, type, g.K, g.N, g.K));
        cublasCheck(cublasLtMatrixLayoutCreate(&p.layout_x, type, g.K, g.M, g.K));
        cublasCheck(cublasLtMatrixLayoutCreate(&p.layout_y, type, g.N, g.M, g.N));
        cublasLtMatmulPreference_t pref;
        cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
        const size_t ws = kWorkspaceBytes;
        cublasCheck(
            cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
        cublasLtMatmulHeuristicResult_t result;
        int found = 0;
        cublasCheck(cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.layout_w, p.layout_x, p.layout_y,
                                                   p.layout_y, pref, 1, &result, &found));
        cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
        if (found == 0) fail("cuBLASLt has no algorithm for M=%d N=%d K=%d", g.M, g.N, g.K);
        p.algo = result.algo;
        plans_.push_back(p);
        return plans_.back();
    }

    cublasLtHandle_t handle_ = nullptr;
    void* workspace_ = nullptr;
    std::vector<Plan> plans_;
};

// ---- Result table (markdown; run_gemm.sh parses the rows)
inline void print_table_header() {
    printf("| variant | MxKxN | act | time us | TFLOP/s | cuBLAS us | %% of cuBLAS | check |\n");
    printf("|---|---|---|---|---|---|---|---|\n");
}

// "% of cuBLAS" is baseline time / variant time: 100% matches the library, above 100% beats it.
inline void print_result_row(const char* variant, int M, int K, int N, Act act, float us,
                             float baseline_us, bool ok) {
    const double tflops = gemm_flops(M, N, K) / (us * 1e-6) / 1e12;
    printf("| %s | %dx%dx%d | %s | %.2f | %.1f | %.2f | %.0f%% | %s |\n", variant, M, K, N,
           act_name(act), us, tflops, baseline_us, 100.0 * baseline_us / us, ok ? "OK" : "FAIL");
}

// ---- The driver every GEMM variant shares
// One layer's inputs at the largest M, on host and device, plus the reference.
template <typename T>
struct LayerData {
    LayerShape shape;
    std::vector<float> ref;  // [kMaxM, N]
    T *X = nullptr, *W = nullptr, *bias = nullptr, *Y = nullptr;

    explicit LayerData(const LayerShape& s, uint64_t seed) : shape(s) {
        std::vector<float> x(static_cast<size_t>(kMaxM) * s.K), w(static_cast<size_t>(s.N) * s.K), b(s.N);
        // Weights scaled like nn.Linear's init so outputs are O(1) on every
        // layer and one tolerance fits all.
        const float w_scale = 1.0f / std::sqrt(static_cast<float>(s.K));
        fill_random(x, seed, 1.0f), fill_random(w, seed + 1, w_scale), fill_random(b, seed + 2, w_scale);
        round_to<T>(x), round_to<T>(w), round_to<T>(b);
        const std::vector<double> x64(x.begin(), x.end());
        std::vector<double> y64(static_cast<size_t>(kMaxM) * s.N);
        cpu_linear(y64.data(), x64.data(), w.data(), b.data(), kMaxM, s.N, s.K, s.act == Act::Relu);
        ref.assign(y64.begin(), y64.end());
        X = device_upload(convert_to<T>(x)), W = device_upload(convert_to<T>(w));
        bias = device_upload(convert_to<T>(b));
        cudaCheck(cudaMalloc(&Y, ref.size() * sizeof(T)));
    }
    ~LayerData() { for (T* p : {X, W, bias, Y}) cudaFree(p); }
    LayerData(const LayerData&) = delete;
    LayerData& operator=(const LayerData&) = delete;

    GemmArgs<T> args(int M) const { return {X, W, bias, Y, M, shape.N, shape.K, shape.act}; }
};

// Runs `launch` once at every checked M into a poisoned output and compares it
// with the reference. Returns false and prints the first mismatch if any.
template <typename T>
bool check_layer(const char* variant, const LayerData<T>& d, const GemmLauncher<T>& launch) {
    const LayerShape& s = d.shape;
    double max_abs = 0.0, max_rel = 0.0;
    for (int M : kCheckM) {
        const size_t n = static_cast<size_t>(M) * s.N;
        poison(d.Y, static_cast<size_t>(kMaxM) * s.N * sizeof(T));
        launch(d.args(M));
        cudaCheck(cudaGetLastError()), cudaCheck(cudaDeviceSynchronize());
        const std::vector<float> got = copy_to_host_float(d.Y, n);
        const CheckResult r = validate(got.data(), d.ref.data(), n, ElemTraits<T>::atol, ElemTraits<T>::rtol);
        if (!r.ok) {
            printf("check %s %s M=%d K=%d N=%d %s: FAIL at (m=%zu, n=%zu): got %g, expected %g\n", variant, s.name, M,
                   s.K, s.N, act_name(s.act), r.first_bad / s.N, r.first_bad % s.N, r.bad_got, r.bad_ref);
            return false;
        }
        max_abs = std::max(max_abs, r.max_abs), max_rel = std::max(max_rel, r.max_rel);
    }
    printf("check %s %s K=%d N=%d %s, M in {4096,1,37,1023,4097}: OK (max abs err %.2e, max rel err %.2e)\n",
           variant, s.name, s.K, s.N, act_name(s.act), max_abs, max_rel);
    return true;
}

// Validates `launch` on every layer and ragged M, then times it against the
// cuBLASLt baseline of the same precision at M = 4096. Returns false on any
// mismatch (before timing anything).
template <typename T>
bool run_gemm_driver(const char* variant, const GemmLauncher<T>& launch) {
    printf("\n== %s (%s) ==\n", variant, ElemTraits<T>::name);
    std::vector<LayerData<T>*> layers;
    bool ok = true;
    for (size_t i = 0; i < std::size(kLayers); ++i) {
        layers.push_back(new LayerData<T>(kLayers[i], 1 + 10 * i));  // gemm_v8 --profile makes the same data
        ok = check_layer(variant, *layers.back(), launch) && ok;  // check every layer, even after a failure
    }
    if (ok) {
        CublasLtLinear<T> baseline;
        print_table_header();
        for (LayerData<T>* d : layers) {
            const GemmArgs<T> a = d->args(kBatch);
            const float us = benchmark_us([&] { launch(a); });
            const float baseline_us = benchmark_us([&] { baseline(a); });
            print_result_row(variant, kBatch, a.K, a.N, a.act, us, baseline_us, true);
        }
    } else {
        printf("%s: validation FAILED, not timed\n", variant);
    }
    for (LayerData<T>* d : layers) delete d;
    return ok;
}

// ---- Memory roofline and result rows for bandwidth-bound kernels
// Device-to-device cudaMemcpy of 512 MB timed like every kernel here (cold L2, median): the practical
// bandwidth ceiling of this GPU, read + write, measured once per driver run; ~4.3 TB/s on an H200.
inline double copy_bandwidth_gbs() {
    static double gbs = 0.0;
    if (gbs != 0.0) return gbs;
    const size_t bytes = 512u << 20;
    void *src = nullptr, *dst = nullptr;
    cudaCheck(cudaMalloc(&src, bytes)), cudaCheck(cudaMalloc(&dst, bytes));
    cudaCheck(cudaMemset(src, 1, bytes));
    const float us =
        benchmark_us([&] { cudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, 50, 3);
    gbs = 2.0 * bytes / (us * 1e-6) / 1e9;
    cudaCheck(cudaFree(src)), cudaCheck(cudaFree(dst));
    printf("memory roofline: device-to-device copy of 512 MB = %.0f GB/s (read + write), measured here\n", gbs);
    return gbs;
}

// One markdown table shape for every non-GEMM driver; run_kernels.sh collects the rows.
inline void print_kernel_header() {
    printf("| variant | problem | time us | throughput | %% of roofline | check |\n|---|---|---|---|---|---|\n");
}

// bytes: what the kernel must move at least (inputs read once, outputs written once); roofline: the copy.
inline void print_mem_row(const char* variant, const char* problem, float us, double bytes) {
    const double gbs = bytes / (us * 1e-6) / 1e9;
    printf("| %s | %s | %.2f | %.0f GB/s | %.0f%% of copy | OK |\n", variant, problem, us, gbs,
           100.0 * gbs / copy_bandwidth_gbs());
}

// Compares and prints one line; false on a mismatch (the caller exits non-zero). `what`: the output, n elements.
inline bool check_output(const char* variant, const char* what, int B, const float* got, const float* ref, size_t n,
                         size_t row_len, double atol, double rtol) {
    const CheckResult r = validate(got, ref, n, atol, rtol);
    if (!r.ok) {
        printf("check %s %s B=%d: FAIL at (image %zu, %zu): got %.7g, expected %.7g\n", variant, what, B,
               r.first_bad / row_len, r.first_bad % row_len, r.bad_got, r.bad_ref);
        return false;
    }
    printf("check %s %s B=%d: OK (max abs err %.2e, max rel err %.2e)\n", variant, what, B, r.max_abs, r.max_rel);
    return true;
}

// ---- The non-GEMM families (reparam_*, loss_*, convert_*): inputs, references, one driver each. Each
// validates every variant on every checked size into NaN-poisoned outputs first and times only when all
// of them pass; a false return means the caller exits non-zero.

namespace vae {

constexpr int kMulv = 2 * LATENT_DIM;  // one image's [mu | logvar]

// What a variant is: a name and a host function that launches it.
template <typename Args>
using Variant = std::pair<const char*, std::function<void(const Args&)>>;

// What the loss_* and reparam_* variants build on (vae.cu's decoders now form the BCE in their
// epilogue): cpu_bce_term in fp32, and a sum over a warp's lanes in a fixed order.
__device__ inline float bce_term(float logit, uint8_t pixel) {
    return fmaxf(logit, 0.0f) - ((float)pixel / 255.0f) * logit + log1pf(expf(-fabsf(logit)));
}
__device__ inline float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// z and KL of images first_image .. first_image + B - 1 in float64, eps from
// vae.cu's generator run on the host (the same Philox words as the device).
inline void cpu_reparam(const float* mulv, float* z, float* kl, int B, uint32_t first_image, uint64_t seed) {
    for (int b = 0; b < B; ++b) {
        double sum = 0.0;
        for (int j = 0; j < LATENT_DIM; ++j) {
            const double mu = mulv[size_t(b) * kMulv + j], lv = mulv[size_t(b) * kMulv + LATENT_DIM + j];
            const double eps = gaussian(seed, STREAM_POSTERIOR, first_image + b, 0, j);
            z[size_t(b) * LATENT_DIM + j] = static_cast<float>(mu + eps * std::exp(0.5 * lv));
            sum += cpu_kl_term(mu, lv);
        }
        kl[b] = static_cast<float>(sum);
    }
}

// `count` images of 784 uint8 pixels: the MNIST test images (data/, read by
// vae.cu's parser, from the repository root or from dev/) repeated, or random.
inline std::vector<uint8_t> load_pixels(int count, bool* from_file = nullptr) {
    std::vector<uint8_t> px(size_t(count) * INPUT_DIM);
    Images images = {};
    for (const char* path : {"data/t10k-images-idx3-ubyte", "../data/t10k-images-idx3-ubyte"}) {
        Error err;
        if (load_file(path, parse_idx_images, &images, &err)) break;
    }
    if (from_file) *from_file = images.pixels != nullptr;
    if (images.pixels) {
        const size_t n = size_t(images.count) * INPUT_DIM;
        for (size_t i = 0; i < px.size(); ++i) px[i] = images.pixels[i % n];
        free(images.pixels);
    } else {
        Rng rng(7);
        for (uint8_t& p : px) p = static_cast<uint8_t>(rng.next_u32() >> 24);
    }
    return px;
}

// data/'s weights and test set, or one line naming the problem and exit 1 (drivers run from the root).
inline void load_model_inputs(const char* driver, HostWeights* w, Images* images) {
    Error err;
    *w = {}, *images = {};
    if (!load_file("data/vae_weights.bin", parse_weights, w, &err) ||
        !load_file("data/t10k-images-idx3-ubyte", parse_idx_images, images, &err))
        fail("%s (make data, then run from the repository root: ./dev/%s)", err.msg, driver);
}

// Reparameterisation: z[B][20] = mu + eps exp(logvar / 2), kl[B], from
// mulv[B][40] = [mu | logvar] per image; eps keyed by image first_image + b.
struct ReparamArgs { float *z, *kl; const float* mulv; int B; uint32_t first_image; uint64_t seed; };

inline bool run_reparam_driver(const std::vector<Variant<ReparamArgs>>& variants) {
    constexpr int kBig = 1 << 20;                          // 1M images, 256 MB moved: the bandwidth regime
    const int time_b[] = {4096, kBig}, check_b[] = {1, 37, 1023, 4096, 4097, kBig};
    const uint32_t first_image = 1000;                     // not 0, so the image offset is exercised
    const uint64_t seed = 0x5EEDull << 32 | 42;            // both key words in use
    std::vector<float> mulv(size_t(kBig) * kMulv);
    Rng rng(3);
    for (int b = 0; b < kBig; ++b)
        for (int j = 0; j < LATENT_DIM; ++j) {
            mulv[size_t(b) * kMulv + j] = rng.next_nonzero(2.0f);            // mu
            mulv[size_t(b) * kMulv + LATENT_DIM + j] = rng.next_nonzero(3.0f);  // logvar: sigma in 0.22..4.5
        }
    std::vector<float> z_ref(size_t(kBig) * LATENT_DIM), kl_ref(kBig);
    cpu_reparam(mulv.data(), z_ref.data(), kl_ref.data(), kBig, first_image, seed);
    float* d_mulv = device_upload(mulv);
    float *d_z, *d_kl;
    cudaCheck(cudaMalloc(&d_z, z_ref.size() * sizeof(float)));
    cudaCheck(cudaMalloc(&d_kl, kl_ref.size() * sizeof(float)));

    // z: the host's cosf / sinf(2 pi u) and the device's sincospif(2u) differ by ~1e-6
    // of eps (|eps| < 6), times sigma <= 4.5: ~3e-5 absolute. KL: 20 fp32 terms
    // of magnitude <= 25, in any order: ~1e-4 absolute. A dropped term or a
    // wrong key moves either by O(1).
    bool ok = true;
    for (const auto& v : variants)
        for (int B : check_b) {
            poison(d_z, z_ref.size() * sizeof(float)), poison(d_kl, kl_ref.size() * sizeof(float));
            v.second({d_z, d_kl, d_mulv, B, first_image, seed});
            cudaCheck(cudaGetLastError()), cudaCheck(cudaDeviceSynchronize());
            const std::vector<float> z = copy_to_host_float(d_z, size_t(B) * LATENT_DIM);
            const std::vector<float> kl = copy_to_host_float(d_kl, B);
            ok = check_output(v.first, "z", B, z.data(), z_ref.data(), z.size(), LATENT_DIM, 1e-4, 1e-4) && ok;
            ok = check_output(v.first, "kl", B, kl.data(), kl_ref.data(), kl.size(), 1, 1e-3, 1e-4) && ok;
        }
    if (ok) {
        print_kernel_header();
        for (const auto& v : variants)
            for (int B : time_b) {
                const ReparamArgs a{d_z, d_kl, d_mulv, B, first_image, seed};
                const float us = benchmark_us([&] { v.second(a); });
                print_mem_row(v.first, ("B=" + std::to_string(B)).c_str(), us,
                              double(B) * (kMulv + LATENT_DIM + 1) * sizeof(float));
            }
    }
    for (float* p : {d_mulv, d_z, d_kl}) cudaCheck(cudaFree(p));
    return ok;
}

// Loss: loss[b] = sum over 784 pixels of BCE(logits, pixels / 255) + kl[b].
struct LossArgs { float* loss; const float* logits; const uint8_t* pixels; const float* kl; int B; };

inline bool run_loss_driver(const std::vector<Variant<LossArgs>>& variants) {
    constexpr int kBig = 65536;  // 257 MB read: the bandwidth regime
    const int time_b[] = {4096, kBig}, check_b[] = {1, 37, 1023, 4096, 4097, kBig};
    std::vector<float> logits(size_t(kBig) * INPUT_DIM), kl(kBig);
    fill_random(logits, 11, 8.0f);  // both signs, up to |8|: every branch of the stable form
    fill_random(kl, 12, 20.0f);
    for (float& v : kl) v = std::fabs(v);
    const std::vector<uint8_t> pixels = load_pixels(kBig);
    std::vector<float> ref(kBig);
    for (int b = 0; b < kBig; ++b) {
        double sum = kl[b];
        for (size_t i = size_t(b) * INPUT_DIM; i < size_t(b + 1) * INPUT_DIM; ++i)
            sum += cpu_bce_term(logits[i], pixels[i] / 255.0);
        ref[b] = float(sum);
    }
    float *d_logits = device_upload(logits), *d_kl = device_upload(kl), *d_loss;
    uint8_t* d_pixels = device_upload(pixels);
    cudaCheck(cudaMalloc(&d_loss, kBig * sizeof(float)));

    // 785 fp32 terms of magnitude <= 9 summed in any order: relative error
    // ~1e-5 of a sum in the thousands; a dropped pixel moves it by >= 1e-3.
    bool ok = true;
    for (const auto& v : variants)
        for (int B : check_b) {
            poison(d_loss, kBig * sizeof(float));
            v.second({d_loss, d_logits, d_pixels, d_kl, B});
            cudaCheck(cudaGetLastError()), cudaCheck(cudaDeviceSynchronize());
            const std::vector<float> got = copy_to_host_float(d_loss, B);
            ok = check_output(v.first, "loss", B, got.data(), ref.data(), got.size(), 1, 1e-3, 1e-4) && ok;
        }
    if (ok) {
        print_kernel_header();
        for (const auto& v : variants)
            for (int B : time_b) {
                const LossArgs a{d_loss, d_logits, d_pixels, d_kl, B};
                const float us = benchmark_us([&] { v.second(a); });
                print_mem_row(v.first, ("B=" + std::to_string(B)).c_str(), us,
                              double(B) * (INPUT_DIM * (sizeof(float) + 1) + 2 * sizeof(float)));
            }
    }
    for (void* p : std::initializer_list<void*>{d_logits, d_kl, d_loss, d_pixels}) cudaCheck(cudaFree(p));
    return ok;
}

// fp32 -> bf16 conversion of n elements (round to nearest even).
struct ConvertArgs { bf16* dst; const float* src; size_t n; };

inline bool run_convert_driver(const std::vector<Variant<ConvertArgs>>& variants) {
    constexpr size_t kBig = size_t(64) << 20;  // 64M elements, 384 MB moved
    struct Case {
        const char* name;
        size_t n, offset;  // offset: elements into the buffers; 1 makes both pointers misaligned
        bool timed;
    };
    const Case cases[] = {{"fc1.w 400x784", size_t(HIDDEN_DIM) * INPUT_DIM, 0, true},
                          {"fc21+22.w 40x400", size_t(kMulv) * HIDDEN_DIM, 0, true},
                          {"fc3.w 400x20", size_t(HIDDEN_DIM) * LATENT_DIM, 0, true},
                          {"fc4.w 784x400", size_t(INPUT_DIM) * HIDDEN_DIM, 0, true},
                          {"n=1", 1, 0, false}, {"n=37", 37, 0, false}, {"n=1023", 1023, 0, false},
                          {"n=4097", 4097, 0, false}, {"n=4097, both pointers +1 element", 4097, 1, false},
                          {"n=64M+3", kBig + 3, 0, false}, {"n=64M", kBig, 0, true}};
    const size_t cap = kBig + 8;
    std::vector<float> src(cap);
    fill_random(src, 21, 4.0f);
    // Exact comparison: host and device both round to nearest even, so every
    // element must match bit for bit (rtol = atol = 0; NaN never matches).
    std::vector<float> ref(cap);
    for (size_t i = 0; i < cap; ++i) ref[i] = __bfloat162float(__float2bfloat16(src[i]));
    float* d_src = device_upload(src);
    bf16* d_dst;
    cudaCheck(cudaMalloc(&d_dst, cap * sizeof(bf16)));

    bool ok = true;
    for (const auto& v : variants)
        for (const Case& c : cases) {
            poison(d_dst, cap * sizeof(bf16));
            v.second({d_dst + c.offset, d_src + c.offset, c.n});
            cudaCheck(cudaGetLastError()), cudaCheck(cudaDeviceSynchronize());
            // one element past the end too: it must stay poisoned (no overrun)
            const std::vector<float> got = copy_to_host_float(d_dst + c.offset, c.n + 1);
            const CheckResult r = validate(got.data(), ref.data() + c.offset, c.n, 0.0, 0.0);
            const bool tail_ok = std::isnan(got[c.n]);
            if (!r.ok || !tail_ok) {
                printf("check %s %s: FAIL at %zu: got %g, expected %g%s\n", v.first, c.name, r.first_bad, r.bad_got,
                       r.bad_ref, tail_ok ? "" : " (or wrote past the end)");
                ok = false;
            } else {
                printf("check %s %s: OK (bit-exact)\n", v.first, c.name);
            }
        }
    if (ok) {
        print_kernel_header();
        for (const auto& v : variants)
            for (const Case& c : cases) {
                if (!c.timed) continue;
                const ConvertArgs a{d_dst, d_src, c.n};
                const float us = benchmark_us([&] { v.second(a); });
                print_mem_row(v.first, c.name, us, double(c.n) * (sizeof(float) + sizeof(bf16)));
            }
    }
    cudaCheck(cudaFree(d_src)), cudaCheck(cudaFree(d_dst));
    return ok;
}

// The plain path's per-row BCE (vae.cu's decoder_output_kernel and the loss_v7 variants): bce[r] of `rows` rows of
// 784 logits (float or bf16) against image r / K. A variant runs on the default stream.
typedef void (*BceRun)(float* bce, const void* logits, const uint8_t* pixels, int rows, int K);
struct BceVariant { const char* name; BceRun f32, f16; };

template <typename L> inline void run_vae_bce(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    launch(decoder_output_kernel<float, L>, rows, 4, 128, 0, bce, (float*)NULL, (float*)NULL, (const L*)logits,
           pixels, rows, K);
}

// Checks each variant against float64 (cpu_bce_term over the logits it reads, bf16-rounded for bf16) on rows 1, 7, 37,
// 1023, 4097 and a whole --iwae pass, for K = 1 (the ELBO) and K = 5000 (--iwae), to the fp32 contract (1e-5 relative
// of a row); then times them on the ELBO's 10,000 rows and a pass. False on a mismatch.
inline bool run_bce_driver(const std::vector<BceVariant>& variants) {
    constexpr int PASS = 1 << 18; // the plain path's decoder rows a --iwae pass (PLAIN_DECODER_ROWS)
    const int images = PASS; // K = 1 needs an image a row
    std::vector<float> logits((size_t)PASS * INPUT_DIM);
    fill_random(logits, 21, 10.0f); // both signs up to |10|: every branch of the stable form
    for (size_t i = 0; i < logits.size(); i += 97) logits[i] *= 4.0f; // some beyond |16.6|, whose terms drop
    std::vector<bf16> logits16(logits.size());
    std::vector<float> rounded(logits.size());
    for (size_t i = 0; i < logits.size(); i++)
        logits16[i] = __float2bfloat16_rn(logits[i]), rounded[i] = __bfloat162float(logits16[i]);
    const std::vector<uint8_t> pixels = load_pixels(images);
    float* d_logits = device_upload(logits);
    bf16* d_logits16;
    cudaCheck(cudaMalloc(&d_logits16, logits16.size() * sizeof(bf16)));
    cudaCheck(cudaMemcpy(d_logits16, logits16.data(), logits16.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    uint8_t* d_pixels = device_upload(pixels);
    float* d_bce;
    cudaCheck(cudaMalloc(&d_bce, PASS * sizeof(float)));

    bool ok = true;
    for (int bf = 0; bf < 2; bf++) {
        const std::vector<float>& in = bf ? rounded : logits;
        for (int K : {1, 5000}) {
            std::vector<float> ref(PASS);
            for (int r = 0; r < PASS; r++) {
                double sum = 0.0;
                const size_t x0 = (size_t)(r / K) * INPUT_DIM;
                for (int i = 0; i < INPUT_DIM; i++)
                    sum += cpu_bce_term(in[(size_t)r * INPUT_DIM + i], pixels[x0 + i] / 255.0);
                ref[r] = (float)sum;
            }
            for (const BceVariant& v : variants)
                for (int rows : {1, 7, 37, 1023, 4097, PASS}) {
                    poison(d_bce, PASS * sizeof(float));
                    (bf ? v.f16 : v.f32)(d_bce, bf ? (const void*)d_logits16 : d_logits, d_pixels, rows, K);
                    cudaCheck(cudaDeviceSynchronize());
                    const std::vector<float> got = copy_to_host_float(d_bce, rows);
                    double worst = 0.0;
                    for (int r = 0; r < rows; r++)
                        worst = std::max(worst, std::fabs(got[r] - (double)ref[r]) / std::fabs((double)ref[r]));
                    const bool good = worst <= 1e-5; // the fp32 contract; NaN (unwritten) fails
                    if (!good || rows == PASS)
                        printf("check %-28s %s K=%-4d rows=%-6d worst relative error %.2e %s\n", v.name,
                               bf ? "bf16" : "fp32", K, rows, worst, good ? "OK" : "FAIL");
                    ok = ok && good;
                }
        }
    }
    if (!ok) return false;
    print_kernel_header();
    for (const BceVariant& v : variants)
        for (int bf = 0; bf < 2; bf++)
            for (int rows : {10000, PASS}) {
                const int K = rows == PASS ? 5000 : 1;
                const float us = benchmark_us([&] {
                    (bf ? v.f16 : v.f32)(d_bce, bf ? (const void*)d_logits16 : d_logits, d_pixels, rows, K);
                });
                char problem[64];
                snprintf(problem, sizeof(problem), "%s rows=%d K=%d", bf ? "bf16" : "fp32", rows, K);
                print_mem_row(v.name, problem, us, (double)rows * (INPUT_DIM * (bf ? 2 : 4) + 4));
            }
    for (void* p : std::initializer_list<void*>{d_logits, d_logits16, d_pixels, d_bce}) cudaCheck(cudaFree(p));
    return true;
}

}  // namespace vae
