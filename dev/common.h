// Shared helpers for the dev/ kernel drivers: error checks, deterministic
// inputs, CPU reference, validation, timing, cuBLAS baselines and the result
// table. Every driver includes this file; nothing here is copied elsewhere.
//
// Layout convention (PyTorch nn.Linear): X[M,K] row-major activations,
// W[N,K] row-major weights, bias[N], Y[M,N] = act(X · W^T + bias).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <utility>
#include <vector>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

// ---------------------------------------------------------------------------
// Error checking

inline void cuda_check(cudaError_t err, const char* file, int line) {
    if (err != cudaSuccess) {
        fprintf(stderr, "[CUDA ERROR] at %s:%d: %s\n", file, line, cudaGetErrorString(err));
        exit(EXIT_FAILURE);
    }
}
#define cudaCheck(call) cuda_check((call), __FILE__, __LINE__)

inline void cublas_check(cublasStatus_t status, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "[cuBLAS ERROR] at %s:%d: status %d\n", file, line, static_cast<int>(status));
        exit(EXIT_FAILURE);
    }
}
#define cublasCheck(call) cublas_check((call), __FILE__, __LINE__)

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) { return (a + b - 1) / b; }

inline bool is_aligned(const void* p, size_t bytes) {
    return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// ---------------------------------------------------------------------------
// The problem: the VAE's four Linear layers at batch M = 4096

enum class Act { None, Relu };

inline const char* act_name(Act act) { return act == Act::Relu ? "relu" : "none"; }

__host__ __device__ inline float apply_act(float v, Act act) {
    return act == Act::Relu ? fmaxf(v, 0.0f) : v;
}

struct LayerShape {
    const char* name;
    int K;  // in_features
    int N;  // out_features
    Act act;
};

constexpr int kBatch = 4096;
constexpr LayerShape kLayers[] = {
    {"fc1", 784, 400, Act::Relu},      // encoder hidden
    {"fc21+fc22", 400, 40, Act::None}, // mu and logvar as one 40-wide GEMM
    {"fc3", 20, 400, Act::Relu},       // decoder hidden
    {"fc4", 400, 784, Act::None},      // decoder logits (sigmoid lives in the loss)
};
// Ragged batch sizes that are not multiples of any tile size. All of them are
// prefixes of the largest, so one CPU reference per layer serves every M.
constexpr int kCheckM[] = {kBatch, 1, 37, 1023, 4097};
constexpr int kMaxM = 4097;

inline double gemm_flops(int M, int N, int K) { return 2.0 * M * N * K; }

// ---------------------------------------------------------------------------
// Element types: fp32 and bf16 share the drivers through these traits

template <typename T> struct Precision;

template <> struct Precision<float> {
    static constexpr const char* name = "fp32";
    static constexpr cudaDataType_t cuda_type = CUDA_R_32F;
    // fp32 accumulation over K <= 784 of O(1) terms errs by ~1e-6; TF32
    // inputs would err by ~1e-3, so this tolerance also catches a TF32 path.
    static constexpr double atol = 1e-4, rtol = 1e-4;
    static float to_float(float v) { return v; }
    static float from_float(float v) { return v; }
};

template <> struct Precision<__nv_bfloat16> {
    static constexpr const char* name = "bf16";
    static constexpr cudaDataType_t cuda_type = CUDA_R_16BF;
    // The reference uses the same bf16-rounded inputs, so the only sizeable
    // error is rounding the output to bf16 (8 significant bits: <= 2^-9 ~ 0.2%
    // relative); 1e-2 leaves 5x headroom for fp32 accumulation-order changes.
    static constexpr double atol = 1e-3, rtol = 1e-2;
    static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __nv_bfloat16 from_float(float v) { return __float2bfloat16(v); }
};

// ---------------------------------------------------------------------------
// Deterministic inputs

// Fixed-seed xorshift64*: the same inputs on every run and every machine.
struct Rng {
    uint64_t state;
    explicit Rng(uint64_t seed) : state(seed * 0x9E3779B97F4A7C15ull + 1) {}
    uint32_t next_u32() {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        return static_cast<uint32_t>((state * 0x2545F4914F6CDD1Dull) >> 32);
    }
    // Uniform in [-scale, -scale/64] U [scale/64, scale]: never zero, so an
    // output that ignored an input would show up in validation.
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

// Round host values to T's precision in place so the CPU reference sees
// exactly the numbers the GPU gets.
template <typename T>
void round_to(std::vector<float>& v) {
    for (float& x : v) x = Precision<T>::to_float(Precision<T>::from_float(x));
}

template <typename T>
std::vector<T> convert_to(const std::vector<float>& v) {
    std::vector<T> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = Precision<T>::from_float(v[i]);
    return out;
}

// ---------------------------------------------------------------------------
// CPU reference in double precision. bias may be null (no bias).

inline void cpu_linear(const float* X, const float* W, const float* bias, float* Y,
                       int M, int N, int K, Act act) {
    // W^T in double so the innermost loop walks contiguous memory and vectorises.
    std::vector<double> wt(static_cast<size_t>(K) * N);
    for (int n = 0; n < N; ++n)
        for (int k = 0; k < K; ++k) wt[static_cast<size_t>(k) * N + n] = W[static_cast<size_t>(n) * K + k];
    std::vector<double> acc(N);
    for (int m = 0; m < M; ++m) {
        for (int n = 0; n < N; ++n) acc[n] = bias ? bias[n] : 0.0;
        for (int k = 0; k < K; ++k) {
            const double x = X[static_cast<size_t>(m) * K + k];
            const double* w = &wt[static_cast<size_t>(k) * N];
            for (int n = 0; n < N; ++n) acc[n] += x * w[n];
        }
        for (int n = 0; n < N; ++n) {
            const double v = acc[n];
            Y[static_cast<size_t>(m) * N + n] = static_cast<float>(act == Act::Relu && v < 0.0 ? 0.0 : v);
        }
    }
}

// ---------------------------------------------------------------------------
// Validation

struct CheckResult {
    bool ok = true;
    double max_abs = 0.0, max_rel = 0.0;
    size_t first_bad = SIZE_MAX;
    float bad_got = 0.0f, bad_ref = 0.0f;
};

// |got - ref| <= atol + rtol*|ref| elementwise; NaN (an unwritten, poisoned
// element) always fails because every comparison with NaN is false.
inline CheckResult validate(const float* got, const float* ref, size_t n, double atol, double rtol) {
    CheckResult r;
    for (size_t i = 0; i < n; ++i) {
        const double diff = std::fabs(static_cast<double>(got[i]) - ref[i]);
        const bool good = diff <= atol + rtol * std::fabs(static_cast<double>(ref[i]));
        if (!good && r.ok) {
            r.ok = false;
            r.first_bad = i;
            r.bad_got = got[i];
            r.bad_ref = ref[i];
        }
        if (std::isnan(diff)) continue;
        r.max_abs = std::max(r.max_abs, diff);
        r.max_rel = std::max(r.max_rel, diff / std::max(std::fabs(static_cast<double>(ref[i])), 1e-6));
    }
    return r;
}

// Fill a device buffer with 0xFF bytes: NaN in both fp32 and bf16, so any
// output element a kernel forgets to write fails validation.
inline void poison(void* dev_ptr, size_t bytes) {
    cudaCheck(cudaMemset(dev_ptr, 0xFF, bytes));
}

template <typename T>
std::vector<float> copy_to_host_float(const T* dev_ptr, size_t n) {
    std::vector<T> tmp(n);
    cudaCheck(cudaMemcpy(tmp.data(), dev_ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    std::vector<float> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = Precision<T>::to_float(tmp[i]);
    return out;
}

// ---------------------------------------------------------------------------
// Device info

inline cudaDeviceProp& device_props() {
    static cudaDeviceProp props;
    return props;
}

// Prints the GPU and exits 1 with one line when there is none.
inline void print_device_info() {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        fprintf(stderr, "error: no CUDA device available (%s)\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "device count is 0");
        exit(EXIT_FAILURE);
    }
    cudaDeviceProp& p = device_props();
    cudaCheck(cudaGetDeviceProperties(&p, 0));
    printf("device: %s, sm_%d%d, %d SMs, L2 %.0f MB\n", p.name, p.major, p.minor,
           p.multiProcessorCount, p.l2CacheSize / 1048576.0);
}

// ---------------------------------------------------------------------------
// Timing

// Median time of `launch` in microseconds. Each repeat is preceded by a write
// of a buffer larger than L2, so every repeat starts with a cold cache, as a
// layer does in a real forward pass. The flush is outside the timed region;
// because it keeps the GPU busy, the host enqueues the timed launch before the
// GPU reaches it, so launch latency is not measured either.
template <typename F>
float benchmark_us(F&& launch, int repeats = 200, int warmup = 10) {
    static void* flush_buffer = nullptr;
    static size_t flush_bytes = 0;
    if (!flush_buffer) {
        flush_bytes = std::max<size_t>(256u << 20, 4 * static_cast<size_t>(device_props().l2CacheSize));
        cudaCheck(cudaMalloc(&flush_buffer, flush_bytes));
    }
    for (int i = 0; i < warmup; ++i) launch();
    cudaCheck(cudaDeviceSynchronize());

    std::vector<cudaEvent_t> start(repeats), stop(repeats);
    for (int i = 0; i < repeats; ++i) {
        cudaCheck(cudaEventCreate(&start[i]));
        cudaCheck(cudaEventCreate(&stop[i]));
    }
    for (int i = 0; i < repeats; ++i) {
        cudaCheck(cudaMemsetAsync(flush_buffer, i & 0xFF, flush_bytes));
        cudaCheck(cudaEventRecord(start[i]));
        launch();
        cudaCheck(cudaEventRecord(stop[i]));
    }
    cudaCheck(cudaEventSynchronize(stop[repeats - 1]));
    std::vector<float> us(repeats);
    for (int i = 0; i < repeats; ++i) {
        float ms = 0.0f;
        cudaCheck(cudaEventElapsedTime(&ms, start[i], stop[i]));
        us[i] = ms * 1000.0f;
        cudaCheck(cudaEventDestroy(start[i]));
        cudaCheck(cudaEventDestroy(stop[i]));
    }
    std::sort(us.begin(), us.end());
    return us[repeats / 2];
}

// ---------------------------------------------------------------------------
// What a GEMM variant is: a host function that launches it

template <typename T>
struct GemmArgs {
    const T* X;     // [M,K]
    const T* W;     // [N,K]
    const T* bias;  // [N]
    T* Y;           // [M,N]
    int M, N, K;
    Act act;
};

template <typename T>
using GemmLauncher = std::function<void(const GemmArgs<T>&)>;

// ---------------------------------------------------------------------------
// cuBLASLt baseline: Y = act(X W^T + bias) with the bias (and ReLU) fused into
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
    CublasLtLinear() {
        cublasCheck(cublasLtCreate(&handle_));
        cudaCheck(cudaMalloc(&workspace_, kWorkspaceBytes));
    }
    ~CublasLtLinear() {
        for (Plan& p : plans_) {
            cublasLtMatrixLayoutDestroy(p.layout_w);
            cublasLtMatrixLayoutDestroy(p.layout_x);
            cublasLtMatrixLayoutDestroy(p.layout_y);
            cublasLtMatmulDescDestroy(p.desc);
        }
        cudaFree(workspace_);
        cublasLtDestroy(handle_);
    }
    CublasLtLinear(const CublasLtLinear&) = delete;
    CublasLtLinear& operator=(const CublasLtLinear&) = delete;

    void operator()(const GemmArgs<T>& g) {
        Plan& p = plan_for(g);
        cublasCheck(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                   &g.bias, sizeof(g.bias)));
        const float alpha = 1.0f, beta = 0.0f;
        cublasCheck(cublasLtMatmul(handle_, p.desc, &alpha, g.W, p.layout_w, g.X, p.layout_x, &beta,
                                   g.Y, p.layout_y, g.Y, p.layout_y, &p.algo, workspace_,
                                   kWorkspaceBytes, 0));
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
        const cudaDataType_t type = Precision<T>::cuda_type;
        Plan p{g.M, g.N, g.K, g.act, nullptr, nullptr, nullptr, nullptr, {}};
        cublasCheck(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const cublasOperation_t transpose = CUBLAS_OP_T, no_transpose = CUBLAS_OP_N;
        cublasCheck(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
        cublasCheck(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &no_transpose, sizeof(no_transpose)));
        const cublasLtEpilogue_t epilogue = g.act == Act::Relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS;
        cublasCheck(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
        const int32_t bias_type = type;
        cublasCheck(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
        cublasCheck(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
        cublasCheck(cublasLtMatrixLayoutCreate(&p.layout_w, type, g.K, g.N, g.K));
        cublasCheck(cublasLtMatrixLayoutCreate(&p.layout_x, type, g.K, g.M, g.K));
        cublasCheck(cublasLtMatrixLayoutCreate(&p.layout_y, type, g.N, g.M, g.N));

        cublasLtMatmulPreference_t pref;
        cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
        const size_t ws = kWorkspaceBytes;
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
        cublasLtMatmulHeuristicResult_t result;
        int found = 0;
        cublasCheck(cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.layout_w, p.layout_x, p.layout_y,
                                                   p.layout_y, pref, 1, &result, &found));
        cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
        if (found == 0) {
            fprintf(stderr, "cuBLASLt has no algorithm for M=%d N=%d K=%d\n", g.M, g.N, g.K);
            exit(EXIT_FAILURE);
        }
        p.algo = result.algo;
        plans_.push_back(p);
        return plans_.back();
    }

    cublasLtHandle_t handle_ = nullptr;
    void* workspace_ = nullptr;
    std::vector<Plan> plans_;
};

// ---------------------------------------------------------------------------
// Result table (markdown; run_gemm.sh parses the rows)

inline void print_table_header() {
    printf("| variant | MxKxN | act | time us | TFLOP/s | cuBLAS us | %% of cuBLAS | check |\n");
    printf("|---|---|---|---|---|---|---|---|\n");
}

// "% of cuBLAS" is baseline time / variant time: 100% matches the library,
// above 100% beats it.
inline void print_result_row(const char* variant, int M, int K, int N, Act act, float us,
                             float baseline_us, bool ok) {
    const double tflops = gemm_flops(M, N, K) / (us * 1e-6) / 1e12;
    printf("| %s | %dx%dx%d | %s | %.2f | %.1f | %.2f | %.0f%% | %s |\n", variant, M, K, N,
           act_name(act), us, tflops, baseline_us, 100.0 * baseline_us / us, ok ? "OK" : "FAIL");
}

// ---------------------------------------------------------------------------
// The driver every GEMM variant shares

// One layer's inputs at the largest M, on host and device, plus the reference.
template <typename T>
struct LayerData {
    LayerShape shape;
    std::vector<float> ref;  // [kMaxM, N]
    T *X = nullptr, *W = nullptr, *bias = nullptr, *Y = nullptr;

    explicit LayerData(const LayerShape& s, uint64_t seed) : shape(s) {
        const size_t x_n = static_cast<size_t>(kMaxM) * s.K, w_n = static_cast<size_t>(s.N) * s.K;
        std::vector<float> x(x_n), w(w_n), b(s.N);
        // Weights scaled like nn.Linear's init so outputs are O(1) on every
        // layer and one tolerance fits all.
        const float w_scale = 1.0f / std::sqrt(static_cast<float>(s.K));
        fill_random(x, seed, 1.0f);
        fill_random(w, seed + 1, w_scale);
        fill_random(b, seed + 2, w_scale);
        round_to<T>(x);
        round_to<T>(w);
        round_to<T>(b);
        ref.resize(static_cast<size_t>(kMaxM) * s.N);
        cpu_linear(x.data(), w.data(), b.data(), ref.data(), kMaxM, s.N, s.K, s.act);
        X = upload(x);
        W = upload(w);
        bias = upload(b);
        cudaCheck(cudaMalloc(&Y, ref.size() * sizeof(T)));
    }
    ~LayerData() {
        cudaFree(X);
        cudaFree(W);
        cudaFree(bias);
        cudaFree(Y);
    }
    LayerData(const LayerData&) = delete;
    LayerData& operator=(const LayerData&) = delete;

    GemmArgs<T> args(int M) const { return {X, W, bias, Y, M, shape.N, shape.K, shape.act}; }

private:
    static T* upload(const std::vector<float>& host) {
        const std::vector<T> converted = convert_to<T>(host);
        T* dev = nullptr;
        cudaCheck(cudaMalloc(&dev, converted.size() * sizeof(T)));
        cudaCheck(cudaMemcpy(dev, converted.data(), converted.size() * sizeof(T), cudaMemcpyHostToDevice));
        return dev;
    }
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
        cudaCheck(cudaGetLastError());
        cudaCheck(cudaDeviceSynchronize());
        const std::vector<float> got = copy_to_host_float(d.Y, n);
        const CheckResult r = validate(got.data(), d.ref.data(), n, Precision<T>::atol, Precision<T>::rtol);
        if (!r.ok) {
            printf("check %s %s M=%d K=%d N=%d %s: FAIL at (m=%zu, n=%zu): got %g, expected %g\n",
                   variant, s.name, M, s.K, s.N, act_name(s.act), r.first_bad / s.N, r.first_bad % s.N,
                   r.bad_got, r.bad_ref);
            return false;
        }
        max_abs = std::max(max_abs, r.max_abs);
        max_rel = std::max(max_rel, r.max_rel);
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
    printf("\n== %s (%s) ==\n", variant, Precision<T>::name);
    std::vector<LayerData<T>*> layers;
    uint64_t seed = 1;
    bool ok = true;
    for (const LayerShape& s : kLayers) {
        layers.push_back(new LayerData<T>(s, seed));
        seed += 10;
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

// ===========================================================================
// The rest of the VAE: helpers for the reparam_*, loss_*, convert_* and
// fused_* drivers. Nothing above this line depends on anything below it.

// ---------------------------------------------------------------------------
// Memory roofline and result rows for bandwidth-bound kernels

// Device-to-device cudaMemcpy of 512 MB timed like every kernel here (cold L2,
// median): the practical bandwidth ceiling of this GPU, read + write. It is
// measured once per driver run; ~4.3 TB/s on an H200.
inline double copy_bandwidth_gbs() {
    static double gbs = 0.0;
    if (gbs == 0.0) {
        const size_t bytes = 512u << 20;
        void *src = nullptr, *dst = nullptr;
        cudaCheck(cudaMalloc(&src, bytes));
        cudaCheck(cudaMalloc(&dst, bytes));
        cudaCheck(cudaMemset(src, 1, bytes));
        const float us = benchmark_us([&] { cudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, 50, 3);
        gbs = 2.0 * bytes / (us * 1e-6) / 1e9;
        cudaCheck(cudaFree(src));
        cudaCheck(cudaFree(dst));
        printf("memory roofline: device-to-device copy of 512 MB = %.0f GB/s (read + write), measured here\n", gbs);
    }
    return gbs;
}

// Dense bf16 matrix rate measured on an H200 (README, GEMM section).
constexpr double kBf16PeakTflops = 770.0;

// One markdown table shape for every non-GEMM driver; run_kernels.sh collects
// the rows. `throughput` carries its unit (GB/s or TFLOP/s).
inline void print_kernel_header() {
    printf("| variant | problem | time us | throughput | %% of roofline | check |\n");
    printf("|---|---|---|---|---|---|\n");
}

// bytes: what the kernel must move at least (each input read once, each
// output written once); the roofline is the measured copy bandwidth.
inline void print_mem_row(const char* variant, const char* problem, float us, double bytes) {
    const double gbs = bytes / (us * 1e-6) / 1e9;
    printf("| %s | %s | %.2f | %.0f GB/s | %.0f%% of copy | OK |\n", variant, problem, us, gbs,
           100.0 * gbs / copy_bandwidth_gbs());
}

inline void print_flop_row(const char* variant, const char* problem, float us, double flops) {
    const double tflops = flops / (us * 1e-6) / 1e12;
    printf("| %s | %s | %.2f | %.1f TFLOP/s | %.1f%% of bf16 mma | OK |\n", variant, problem, us, tflops,
           100.0 * tflops / kBf16PeakTflops);
}

// Compares and prints one line; returns false on a mismatch (the caller exits
// non-zero). `what` names the output, `n` elements of it.
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

template <typename T>
T* device_upload(const std::vector<T>& host) {
    T* dev = nullptr;
    cudaCheck(cudaMalloc(&dev, std::max<size_t>(host.size(), 1) * sizeof(T)));
    cudaCheck(cudaMemcpy(dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return dev;
}

namespace vae {

using bf16 = __nv_bfloat16;

constexpr int kIn = 784, kHidden = 400, kLatent = 20, kMulv = 2 * kLatent;
constexpr int kFc3KPad = 32;  // fc3's K = 20 zero-padded to two k16 mma steps
constexpr uint32_t kStreamPosterior = 0;

// Ragged batch sizes every VAE driver validates; all prefixes of the largest,
// so one CPU reference serves them all (the noise is keyed by image index).
constexpr int kCheckB[] = {1, 37, 1023, 4096, 4097};
constexpr int kMaxCheckB = 4097;

// FLOPs of one forward pass per image (the four GEMMs; fc3 counted at K = 20).
constexpr double kFlopsPerImage = 2.0 * (double(kIn) * kHidden + kHidden * kMulv + kLatent * kHidden + double(kHidden) * kIn);

// ---------------------------------------------------------------------------
// Philox4x32-10 and the Gaussian draw, bit for bit as in vae.cu (section
// "random numbers"): eps for (seed, stream, image, sample, latent).

__host__ __device__ inline uint32_t mulhi32(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

__host__ __device__ inline uint4 philox4x32(uint4 c, uint2 k) {
    for (int round = 0; round < 10; round++) {
        const uint32_t hi0 = mulhi32(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const uint32_t hi1 = mulhi32(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += 0x9E3779B9u;
        k.y += 0xBB67AE85u;
    }
    return c;
}

__host__ __device__ inline float gaussian(uint64_t seed, uint32_t stream, uint32_t image, uint32_t sample,
                                          uint32_t latent) {
    const uint4 r = philox4x32(make_uint4(latent, image, sample, stream),
                               make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)));
    const float u1 = ((r.x >> 8) + 1) * (1.0f / 16777216.0f);  // (0, 1]: log stays finite
    const float u2 = (r.y >> 8) * (1.0f / 16777216.0f);        // [0, 1)
#ifdef __CUDA_ARCH__
    const float c = cospif(2.0f * u2);
#else
    const float c = cosf(6.283185307f * u2);
#endif
    return sqrtf(-2.0f * logf(u1)) * c;
}

// One latent coordinate: z = mu + eps exp(logvar / 2) and its KL term
// 1 + logvar - mu^2 - exp(logvar) (an image's KL is -1/2 the sum over its 20).
__device__ inline float latent_z(float mu, float logvar, float eps, float* kl_term) {
    *kl_term = 1.0f + logvar - mu * mu - expf(logvar);
    return mu + eps * expf(0.5f * logvar);
}

// Sum over the 32 lanes of a warp, in the same order every time.
__device__ inline float warp_sum(float v) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Lane j < 20 of a warp holding one image's [mu | logvar] row: its z_j, and the
// image's KL (every lane gets it). Call with the whole warp.
struct LatentSample {
    float z, kl;
};
__device__ inline LatentSample sample_latent(const float* mulv_row, int lane, uint32_t image, uint64_t seed) {
    float z = 0.0f, kl_term = 0.0f;
    if (lane < kLatent)
        z = latent_z(mulv_row[lane], mulv_row[kLatent + lane], gaussian(seed, kStreamPosterior, image, 0, lane), &kl_term);
    return LatentSample{z, -0.5f * warp_sum(kl_term)};
}

// One pixel's binary cross-entropy from its logit, stable for any logit:
// max(l,0) - x l + log(1 + e^-|l|), x = pixel / 255.
__device__ inline float bce_term(float logit, float x) {
    return fmaxf(logit, 0.0f) - x * logit + log1pf(expf(-fabsf(logit)));
}
inline double bce_term_ref(double logit, double x) {
    return std::max(logit, 0.0) - x * logit + std::log1p(std::exp(-std::fabs(logit)));
}

// Host reference of z and KL for images first_image .. first_image + B - 1.
inline void cpu_reparam(const float* mulv, float* z, float* kl, int B, uint32_t first_image, uint64_t seed) {
    for (int b = 0; b < B; ++b) {
        double sum = 0.0;
        for (int j = 0; j < kLatent; ++j) {
            const double mu = mulv[static_cast<size_t>(b) * kMulv + j], lv = mulv[static_cast<size_t>(b) * kMulv + kLatent + j];
            const double eps = gaussian(seed, kStreamPosterior, first_image + b, 0, j);
            z[static_cast<size_t>(b) * kLatent + j] = static_cast<float>(mu + eps * std::exp(0.5 * lv));
            sum += 1.0 + lv - mu * mu - std::exp(lv);
        }
        kl[b] = static_cast<float>(-0.5 * sum);
    }
}

// ---------------------------------------------------------------------------
// Model weights and images: data/vae_weights.bin and the MNIST test set when
// present (the format of vae.cu's parse_weights), else random tensors of the
// same shapes scaled like nn.Linear's init and random pixels.

struct HostModel {
    // PyTorch layout W[out][in]; enc = fc21 rows then fc22 rows (one 40-wide layer)
    std::vector<float> fc1_w, fc1_b, enc_w, enc_b, fc3_w, fc3_b, fc4_w, fc4_b;
    bool from_file = false;
};

inline FILE* open_data_file(const char* name) {
    char path[256];
    for (const char* dir : {"data", "../data"}) {  // from the repository root or from dev/
        snprintf(path, sizeof(path), "%s/%s", dir, name);
        if (FILE* f = fopen(path, "rb")) return f;
    }
    return nullptr;
}

inline HostModel load_model() {
    HostModel m;
    m.fc1_w.resize(size_t(kHidden) * kIn), m.fc1_b.resize(kHidden);
    m.enc_w.resize(size_t(kMulv) * kHidden), m.enc_b.resize(kMulv);
    m.fc3_w.resize(size_t(kHidden) * kLatent), m.fc3_b.resize(kHidden);
    m.fc4_w.resize(size_t(kIn) * kHidden), m.fc4_b.resize(kIn);
    // file order: fc1.w fc1.b fc21.w fc21.b fc22.w fc22.b fc3.w fc3.b fc4.w fc4.b
    const size_t latent_w = size_t(kLatent) * kHidden;
    std::vector<std::pair<float*, size_t>> order = {
        {m.fc1_w.data(), m.fc1_w.size()}, {m.fc1_b.data(), m.fc1_b.size()}, {m.enc_w.data(), latent_w},
        {m.enc_b.data(), kLatent},        {m.enc_w.data() + latent_w, latent_w}, {m.enc_b.data() + kLatent, kLatent},
        {m.fc3_w.data(), m.fc3_w.size()}, {m.fc3_b.data(), m.fc3_b.size()}, {m.fc4_w.data(), m.fc4_w.size()},
        {m.fc4_b.data(), m.fc4_b.size()}};
    if (FILE* f = open_data_file("vae_weights.bin")) {
        int32_t header[256];
        bool ok = fread(header, sizeof(header), 1, f) == 1 && header[0] == 0x31454156 && header[2] == kIn &&
                  header[3] == kHidden && header[4] == kLatent;
        for (auto& t : order) ok = ok && fread(t.first, sizeof(float), t.second, f) == t.second;
        fclose(f);
        if (ok) {
            m.from_file = true;
            return m;
        }
        printf("data/vae_weights.bin did not parse; using random weights\n");
    }
    uint64_t seed = 101;
    auto fill = [&](std::vector<float>& v, int fan_in) { fill_random(v, seed++, 1.0f / std::sqrt(float(fan_in))); };
    fill(m.fc1_w, kIn), fill(m.fc1_b, kIn), fill(m.enc_w, kHidden), fill(m.enc_b, kHidden);
    fill(m.fc3_w, kLatent), fill(m.fc3_b, kLatent), fill(m.fc4_w, kHidden), fill(m.fc4_b, kHidden);
    return m;
}

// `count` images of 784 uint8 pixels: the MNIST test images repeated, or random.
inline std::vector<uint8_t> load_pixels(int count, bool* from_file = nullptr) {
    std::vector<uint8_t> px(size_t(count) * kIn);
    std::vector<uint8_t> file;
    if (FILE* f = open_data_file("t10k-images-idx3-ubyte")) {
        file.resize(size_t(10000) * kIn);
        unsigned char header[16];
        if (fread(header, 16, 1, f) != 1 || fread(file.data(), 1, file.size(), f) != file.size()) file.clear();
        fclose(f);
    }
    if (from_file) *from_file = !file.empty();
    if (!file.empty()) {
        for (size_t i = 0; i < px.size(); ++i) px[i] = file[i % file.size()];
    } else {
        Rng rng(7);
        for (uint8_t& p : px) p = static_cast<uint8_t>(rng.next_u32() >> 24);
    }
    return px;
}

// The weights as the bf16 kernels see them: bf16 matrices (fc3 zero-padded to
// K = 32), fp32 biases, in one allocation each.
struct DeviceModel {
    bf16 *fc1_w = nullptr, *enc_w = nullptr, *fc3_w = nullptr, *fc4_w = nullptr;
    float *fc1_b = nullptr, *enc_b = nullptr, *fc3_b = nullptr, *fc4_b = nullptr;

    explicit DeviceModel(const HostModel& m) {
        std::vector<float> fc3_pad(size_t(kHidden) * kFc3KPad, 0.0f);
        for (int n = 0; n < kHidden; ++n)
            for (int k = 0; k < kLatent; ++k) fc3_pad[size_t(n) * kFc3KPad + k] = m.fc3_w[size_t(n) * kLatent + k];
        fc1_w = device_upload(convert_to<bf16>(m.fc1_w));
        enc_w = device_upload(convert_to<bf16>(m.enc_w));
        fc3_w = device_upload(convert_to<bf16>(fc3_pad));
        fc4_w = device_upload(convert_to<bf16>(m.fc4_w));
        fc1_b = device_upload(m.fc1_b), enc_b = device_upload(m.enc_b);
        fc3_b = device_upload(m.fc3_b), fc4_b = device_upload(m.fc4_b);
    }
    ~DeviceModel() {
        for (void* p : std::initializer_list<void*>{fc1_w, enc_w, fc3_w, fc4_w, fc1_b, enc_b, fc3_b, fc4_b}) cudaFree(p);
    }
    DeviceModel(const DeviceModel&) = delete;
    DeviceModel& operator=(const DeviceModel&) = delete;

    // weight bytes one pass over the network reads
    static constexpr double weight_bytes() {
        return 2.0 * (double(kHidden) * kIn + kMulv * kHidden + kHidden * kFc3KPad + double(kIn) * kHidden) +
               4.0 * (kHidden + kMulv + kHidden + kIn);
    }
};

// CPU float64 reference of the whole forward pass for B images, with the
// weight matrices rounded to bf16 (what the GPU multiplies), activations kept
// at full precision: per-image BCE and KL, and optionally mu|logvar and z.
inline void cpu_forward(const HostModel& m, const uint8_t* pixels, int B, uint32_t first_image, uint64_t seed,
                        float* bce, float* kl) {
    auto rounded = [](std::vector<float> v) { round_to<bf16>(v); return v; };
    const std::vector<float> w1 = rounded(m.fc1_w), we = rounded(m.enc_w), w3 = rounded(m.fc3_w), w4 = rounded(m.fc4_w);
    std::vector<float> x(size_t(B) * kIn), h1(size_t(B) * kHidden), mulv(size_t(B) * kMulv), z(size_t(B) * kLatent),
        h3(size_t(B) * kHidden), logits(size_t(B) * kIn);
    for (size_t i = 0; i < x.size(); ++i) x[i] = pixels[i] / 255.0f;
    cpu_linear(x.data(), w1.data(), m.fc1_b.data(), h1.data(), B, kHidden, kIn, Act::Relu);
    cpu_linear(h1.data(), we.data(), m.enc_b.data(), mulv.data(), B, kMulv, kHidden, Act::None);
    cpu_reparam(mulv.data(), z.data(), kl, B, first_image, seed);
    cpu_linear(z.data(), w3.data(), m.fc3_b.data(), h3.data(), B, kHidden, kLatent, Act::Relu);
    cpu_linear(h3.data(), w4.data(), m.fc4_b.data(), logits.data(), B, kIn, kHidden, Act::None);
    for (int b = 0; b < B; ++b) {
        double sum = 0.0;
        for (int i = 0; i < kIn; ++i)
            sum += bce_term_ref(logits[size_t(b) * kIn + i], pixels[size_t(b) * kIn + i] / 255.0);
        bce[b] = static_cast<float>(sum);
    }
}

// ---------------------------------------------------------------------------
// PTX wrappers for the bf16 tensor-core kernels (sm_80+)

namespace ptx {
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1 (.cg) and registers. Only
// `src_bytes` (0 or 16) are read; the rest of the 16 bytes is zero-filled, so
// out-of-range chunks cost no branch and no memory traffic.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `kPending` of this thread's committed groups are unfinished.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Four 8x8 bf16 matrices from shared memory; lane l gives the address of row
// l % 8 of matrix l / 8 and receives, per matrix, the two elements that the
// mma fragment layout assigns to it.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr)
                 : "memory");
}

// D[16x8] += A[16x16] (row-major) * B[16x8] (column-major), fp32 accumulate.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
}  // namespace ptx

// ---------------------------------------------------------------------------
// vae.cu's bf16 forward pass as separate kernels (fc1; fc21+fc22 + sampling +
// fc3; fc4 with the BCE in its epilogue; a finalize), the same design as the
// program's --precision bf16 path. loss_v3 and fused_* measure against it.

constexpr int kMmaBK = 32, kMmaStages = 3;

// A block tile: BM x BN outputs from WARPS_M x WARPS_N warps, each MT x NT mma
// tiles of 16 x 8; K in slices of 32 through a 3-stage cp.async ring. Rows of
// the staged slices are padded (80 bytes bf16, 48 bytes uint8) so the 8 rows
// one fragment load touches fall into 8 different banks.
template <typename TX, int WARPS_M_, int WARPS_N_, int MT_, int NT_>
struct MmaTile {
    using InputType = TX;
    static constexpr int WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, MT = MT_, NT = NT_;
    static constexpr int BM = WARPS_M * MT * 16, BN = WARPS_N * NT * 8, THREADS = 32 * WARPS_M * WARPS_N;
    static constexpr int X_PITCH = sizeof(TX) == 1 ? kMmaBK + 16 : kMmaBK + 8, W_PITCH = kMmaBK + 8;
    struct Smem {
        TX x[kMmaStages][BM][X_PITCH];
        bf16 w[kMmaStages][BN][W_PITCH];
    };
};

// Two consecutive k of a staged row as a bf16x2 register; pixel rows are
// widened here (0..255 is exact in bf16; the 1/255 goes on the fp32 sum).
__device__ inline uint32_t bf16x2_at(const bf16* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ inline uint32_t bf16x2_at(const uint8_t* p) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(float(p[0]), float(p[1]));
    return *reinterpret_cast<const uint32_t*>(&v);
}

// acc += this warp's share of X[row0.., :] W[col0.., :]^T. Needs K * sizeof(TX)
// to be a multiple of 16 bytes; rows and columns past M and N read as zeros.
template <typename Tile>
__device__ inline void mma_mainloop(float (&acc)[Tile::MT][Tile::NT][4], typename Tile::Smem& sm,
                                    const typename Tile::InputType* X, const bf16* W, int M, int N, int K, int row0,
                                    int col0) {
    using TX = typename Tile::InputType;
    constexpr int X_CHUNK = 16 / sizeof(TX), X_CHUNKS_PER_ROW = kMmaBK / X_CHUNK, W_CHUNKS_PER_ROW = kMmaBK / 8;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int warp_row = (warp / Tile::WARPS_N) * Tile::MT * 16, warp_col = (warp % Tile::WARPS_N) * Tile::NT * 8;

    auto load_slice = [&](int stage, int k0) {
        for (int c = threadIdx.x; c < Tile::BM * X_CHUNKS_PER_ROW; c += Tile::THREADS) {
            const int r = c / X_CHUNKS_PER_ROW, k = (c % X_CHUNKS_PER_ROW) * X_CHUNK;
            const bool valid = row0 + r < M && k0 + k < K;
            ptx::cp_async_16(ptx::smem_addr(&sm.x[stage][r][k]), valid ? X + size_t(row0 + r) * K + k0 + k : X,
                             valid ? 16 : 0);
        }
        for (int c = threadIdx.x; c < Tile::BN * W_CHUNKS_PER_ROW; c += Tile::THREADS) {
            const int r = c / W_CHUNKS_PER_ROW, k = (c % W_CHUNKS_PER_ROW) * 8;
            const bool valid = col0 + r < N && k0 + k < K;
            ptx::cp_async_16(ptx::smem_addr(&sm.w[stage][r][k]), valid ? W + size_t(col0 + r) * K + k0 + k : W,
                             valid ? 16 : 0);
        }
    };

    const int num_slices = ceil_div(K, kMmaBK);
    for (int s = 0; s < kMmaStages - 1; s++) {
        if (s < num_slices) load_slice(s, s * kMmaBK);
        ptx::cp_async_commit();  // empty groups keep the count uniform
    }
    for (int kt = 0; kt < num_slices; kt++) {
        ptx::cp_async_wait<kMmaStages - 2>();
        __syncthreads();
        const int next = kt + kMmaStages - 1;
        if (next < num_slices) load_slice(next % kMmaStages, next * kMmaBK);
        ptx::cp_async_commit();
        const int stage = kt % kMmaStages;
#pragma unroll
        for (int kk = 0; kk < kMmaBK; kk += 16) {
            unsigned a[Tile::MT][4], b[Tile::NT][2];
#pragma unroll
            for (int mt = 0; mt < Tile::MT; mt++) {
                const TX* top = &sm.x[stage][warp_row + mt * 16 + g][kk + 2 * t];
                const TX* bottom = top + 8 * Tile::X_PITCH;
                a[mt][0] = bf16x2_at(top), a[mt][1] = bf16x2_at(bottom);
                a[mt][2] = bf16x2_at(top + 8), a[mt][3] = bf16x2_at(bottom + 8);
            }
#pragma unroll
            for (int nt = 0; nt < Tile::NT; nt++) {
                const bf16* w = &sm.w[stage][warp_col + nt * 8 + g][kk + 2 * t];
                b[nt][0] = bf16x2_at(w), b[nt][1] = bf16x2_at(w + 8);
            }
#pragma unroll
            for (int mt = 0; mt < Tile::MT; mt++)
#pragma unroll
                for (int nt = 0; nt < Tile::NT; nt++) ptx::mma_bf16_16816(acc[mt][nt], a[mt], b[nt]);
        }
    }
    ptx::cp_async_wait<0>();
    __syncthreads();  // shared memory may be reused by the caller's epilogue
}

// f(mt, half, row in tile, column in tile, value at column, value at column + 1)
// for every accumulator pair this thread owns.
template <typename Tile, typename F>
__device__ inline void for_each_acc_pair(const float (&acc)[Tile::MT][Tile::NT][4], F f) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
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

// Y = act(scale X W^T + b), Y in bf16 or fp32 (N even).
template <typename Tile, bool RELU, typename TY>
__global__ void __launch_bounds__(Tile::THREADS)
    linear_bf16_kernel(TY* Y, const typename Tile::InputType* X, const bf16* W, const float* bias, int M, int N, int K,
                       float scale) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    typename Tile::Smem& sm = *reinterpret_cast<typename Tile::Smem*>(smem_raw);
    const int row0 = blockIdx.y * Tile::BM, col0 = blockIdx.x * Tile::BN;
    float acc[Tile::MT][Tile::NT][4] = {};
    mma_mainloop<Tile>(acc, sm, X, W, M, N, K, row0, col0);
    for_each_acc_pair<Tile>(acc, [&](int, int, int r, int c, float v0, float v1) {
        r += row0, c += col0;
        if (r >= M || c >= N) return;
        v0 = v0 * scale + bias[c], v1 = v1 * scale + bias[c + 1];
        if (RELU) v0 = fmaxf(v0, 0.0f), v1 = fmaxf(v1, 0.0f);
        TY* y = Y + size_t(r) * N + c;
        if constexpr (sizeof(TY) == 2) {
            *reinterpret_cast<__nv_bfloat162*>(y) = __floats2bfloat162_rn(v0, v1);
        } else {
            *reinterpret_cast<float2*>(y) = make_float2(v0, v1);
        }
    });
}

// fc21+fc22, sampling and fc3 for 32 images per block (vae.cu's latent_bf16_kernel):
// [mu | logvar] by tensor cores into shared memory, z and KL one warp per image,
// h3 = ReLU(z W3^T + b3) with K = 20 padded to 32.
using LatentTile = MmaTile<bf16, 2, 1, 1, 5>;  // 32 images x 40 outputs, 2 warps
__global__ void __launch_bounds__(LatentTile::THREADS)
    latent_bf16_kernel(bf16* h3, float* kl, const bf16* h1, const bf16* enc_w, const float* enc_b,
                       const bf16* fc3_w_padded, const float* fc3_b, int M, uint32_t first_image, uint64_t seed) {
    constexpr int BM = LatentTile::BM;
    extern __shared__ __align__(16) uint8_t smem_raw[];
    LatentTile::Smem& sm = *reinterpret_cast<LatentTile::Smem*>(smem_raw);
    __shared__ float mulv[BM][kMulv];
    __shared__ __align__(16) bf16 z_tile[BM][kFc3KPad + 8];
    const int row0 = blockIdx.x * BM, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

    float acc[1][LatentTile::NT][4] = {};
    mma_mainloop<LatentTile>(acc, sm, h1, enc_w, M, kMulv, kHidden, row0, 0);
    for_each_acc_pair<LatentTile>(acc, [&](int, int, int r, int c, float v0, float v1) {
        mulv[r][c] = v0 + enc_b[c], mulv[r][c + 1] = v1 + enc_b[c + 1];
    });
    __syncthreads();
    for (int i = 0; i < 16; i++) {  // this warp's 16 images, one at a time across its lanes
        const int r = warp * 16 + i, b = row0 + r;
        float z = 0.0f;  // rows past M and the K padding (lanes 20..31) stay zero
        if (b < M) {     // warp-uniform
            const LatentSample s = sample_latent(mulv[r], lane, first_image + b, seed);
            z = s.z;
            if (lane == 0) kl[b] = s.kl;
        }
        z_tile[r][lane] = __float2bfloat16(z);
    }
    __syncthreads();
    unsigned a[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        const bf16* top = &z_tile[warp * 16 + g][kk * 16 + 2 * t];
        const bf16* bottom = top + 8 * (kFc3KPad + 8);
        a[kk][0] = bf16x2_at(top), a[kk][1] = bf16x2_at(bottom), a[kk][2] = bf16x2_at(top + 8),
        a[kk][3] = bf16x2_at(bottom + 8);
    }
#pragma unroll
    for (int chunk = 0; chunk < kHidden / kMulv; chunk++) {  // 400 outputs as 10 chunks of 5 mma tiles
        float acc3[5][4] = {};
#pragma unroll
        for (int nt = 0; nt < 5; nt++)
#pragma unroll
            for (int kk = 0; kk < 2; kk++) {
                const bf16* w = &fc3_w_padded[(chunk * kMulv + nt * 8 + g) * kFc3KPad + kk * 16 + 2 * t];
                const unsigned b[2] = {bf16x2_at(w), bf16x2_at(w + 8)};
                ptx::mma_bf16_16816(acc3[nt], a[kk], b);
            }
#pragma unroll
        for (int nt = 0; nt < 5; nt++)
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int r = row0 + warp * 16 + g + 8 * half, c = chunk * kMulv + nt * 8 + 2 * t;
                if (r >= M) continue;
                const float v0 = fmaxf(acc3[nt][2 * half] + fc3_b[c], 0.0f);
                const float v1 = fmaxf(acc3[nt][2 * half + 1] + fc3_b[c + 1], 0.0f);
                *reinterpret_cast<__nv_bfloat162*>(&h3[size_t(r) * kHidden + c]) = __floats2bfloat162_rn(v0, v1);
            }
    }
}

// fc4 with the BCE in its epilogue (vae.cu's fc4_bce_bf16_kernel): logits stay
// in registers, become BCE terms against the pixels, and are summed per image:
// quad shuffles, then the 2 warps sharing a row through shared memory. Each
// block writes one partial per image for its 112 columns; no atomics.
using Fc4Tile = MmaTile<bf16, 4, 2, 2, 7>;  // 128 images x 112 pixels, 8 warps
constexpr int kFc4ColBlocks = kIn / Fc4Tile::BN;
static_assert(kIn % Fc4Tile::BN == 0, "column blocks tile the 784 pixels exactly");

__global__ void __launch_bounds__(Fc4Tile::THREADS)
    fc4_bce_bf16_kernel(float* bce_partial, const bf16* h3, const bf16* W, const float* bias, const uint8_t* pixels,
                        int M, int rows_per_image = 1) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    Fc4Tile::Smem& sm = *reinterpret_cast<Fc4Tile::Smem*>(smem_raw);
    __shared__ float row_sums[Fc4Tile::WARPS_N][Fc4Tile::BM];
    const int row0 = blockIdx.y * Fc4Tile::BM, col0 = blockIdx.x * Fc4Tile::BN;
    float acc[Fc4Tile::MT][Fc4Tile::NT][4] = {};
    mma_mainloop<Fc4Tile>(acc, sm, h3, W, M, kIn, kHidden, row0, col0);

    float sums[Fc4Tile::MT][2] = {};
    for_each_acc_pair<Fc4Tile>(acc, [&](int mt, int half, int r, int c, float v0, float v1) {
        r += row0, c += col0;
        if (r >= M) return;
        const int image = rows_per_image == 1 ? r : r / rows_per_image; // IWAE: K rows per image; no division otherwise
        const uint8_t* x = pixels + size_t(image) * kIn + c;
        sums[mt][half] += bce_term(v0 + bias[c], x[0] / 255.0f) + bce_term(v1 + bias[c + 1], x[1] / 255.0f);
    });
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int mt = 0; mt < Fc4Tile::MT; mt++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            float v = sums[mt][half];
            v += __shfl_xor_sync(0xffffffffu, v, 1);  // the 4 lanes of a quad share rows
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (lane % 4 == 0)
                row_sums[warp % Fc4Tile::WARPS_N][(warp / Fc4Tile::WARPS_N) * Fc4Tile::MT * 16 + mt * 16 + lane / 4 + 8 * half] = v;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < Fc4Tile::BM; i += Fc4Tile::THREADS) {
        if (row0 + i >= M) break;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < Fc4Tile::WARPS_N; w++) total += row_sums[w][i];
        bce_partial[size_t(row0 + i) * kFc4ColBlocks + blockIdx.x] = total;
    }
}

// out[r] = the 7 partials of image r in a fixed order (+ kl[r] when given).
__global__ void bce_finalize_kernel(float* out, const float* bce_partial, const float* kl, int M) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= M) return;
    float total = 0.0f;
#pragma unroll
    for (int j = 0; j < kFc4ColBlocks; j++) total += bce_partial[size_t(r) * kFc4ColBlocks + j];
    out[r] = kl ? total + kl[r] : total;
}

using Fc1Tile = MmaTile<uint8_t, 4, 2, 2, 5>;  // 128 images x 80 hidden units (400 = 5 x 80)

// Above 48 KB of dynamic shared memory a kernel must opt in, once.
template <typename K>
void allow_smem(K kernel, size_t bytes) {
    cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

inline void fc1_bf16(bf16* h1, const uint8_t* pixels, const DeviceModel& w, int B) {
    static const bool once = (allow_smem(linear_bf16_kernel<Fc1Tile, true, bf16>, sizeof(Fc1Tile::Smem)), true);
    (void)once;
    const dim3 grid(ceil_div(kHidden, Fc1Tile::BN), ceil_div(B, Fc1Tile::BM));
    linear_bf16_kernel<Fc1Tile, true, bf16><<<grid, Fc1Tile::THREADS, sizeof(Fc1Tile::Smem)>>>(
        h1, pixels, w.fc1_w, w.fc1_b, B, kHidden, kIn, 1.0f / 255.0f);
    cudaCheck(cudaGetLastError());
}

inline void latent_bf16(bf16* h3, float* kl, const bf16* h1, const DeviceModel& w, int B, uint32_t first_image,
                        uint64_t seed) {
    latent_bf16_kernel<<<ceil_div(B, LatentTile::BM), LatentTile::THREADS, sizeof(LatentTile::Smem)>>>(
        h3, kl, h1, w.enc_w, w.enc_b, w.fc3_w, w.fc3_b, B, first_image, seed);
    cudaCheck(cudaGetLastError());
}

// fc4 + BCE epilogue, then the finalize: out = BCE (+ KL when kl is given).
inline void fc4_bce_bf16(float* out, float* bce_partial, const bf16* h3, const bf16* fc4_w, const float* fc4_b,
                         const uint8_t* pixels, const float* kl, int B) {
    static const bool once = (allow_smem(fc4_bce_bf16_kernel, sizeof(Fc4Tile::Smem)), true);
    (void)once;
    const dim3 grid(kFc4ColBlocks, ceil_div(B, Fc4Tile::BM));
    fc4_bce_bf16_kernel<<<grid, Fc4Tile::THREADS, sizeof(Fc4Tile::Smem)>>>(bce_partial, h3, fc4_w, fc4_b, pixels, B);
    cudaCheck(cudaGetLastError());
    bce_finalize_kernel<<<ceil_div(B, 256), 256>>>(out, bce_partial, kl, B);
    cudaCheck(cudaGetLastError());
}

// ---------------------------------------------------------------------------
// The best standalone loss kernel (loss_v2), here because loss_v3 measures
// fusion against it: one warp per image, 16-byte logit loads and 4-byte pixel
// loads, a shuffle sum; out = BCE + KL per image. Deterministic.
constexpr int kLossWarps = 8;
__global__ void __launch_bounds__(kLossWarps * 32)
    loss_warp_kernel(float* loss, const float* logits, const uint8_t* pixels, const float* kl, int B) {
    const int b = blockIdx.x * kLossWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (b >= B) return;  // whole warps leave together
    const float4* l = reinterpret_cast<const float4*>(logits + size_t(b) * kIn);
    const uchar4* x = reinterpret_cast<const uchar4*>(pixels + size_t(b) * kIn);
    float sum = 0.0f;
    for (int i = lane; i < kIn / 4; i += 32) {  // 196 groups of 4 pixels
        const float4 lv = l[i];
        const uchar4 xv = x[i];
        sum += bce_term(lv.x, xv.x / 255.0f) + bce_term(lv.y, xv.y / 255.0f) + bce_term(lv.z, xv.z / 255.0f) +
               bce_term(lv.w, xv.w / 255.0f);
    }
    sum = warp_sum(sum);
    if (lane == 0) loss[b] = sum + kl[b];
}

inline void loss_warp(float* loss, const float* logits, const uint8_t* pixels, const float* kl, int B) {
    loss_warp_kernel<<<ceil_div(B, kLossWarps), kLossWarps * 32>>>(loss, logits, pixels, kl, B);
    cudaCheck(cudaGetLastError());
}

}  // namespace vae

// ---------------------------------------------------------------------------
// Drivers shared by the numbered variants of one family. Each validates every
// variant on every checked size into NaN-poisoned outputs first, and times
// only when all of them pass; a false return means the caller exits non-zero.

template <typename Args>
using Variant = std::pair<const char*, std::function<void(const Args&)>>;

namespace vae {

// Reparameterisation: z[B][20] = mu + eps exp(logvar / 2), kl[B], from
// mulv[B][40] = [mu | logvar] per image; eps keyed by image first_image + b.
struct ReparamArgs {
    float* z;
    float* kl;
    const float* mulv;
    int B;
    uint32_t first_image;
    uint64_t seed;
};

inline bool run_reparam_driver(const std::vector<Variant<ReparamArgs>>& variants) {
    constexpr int kBig = 1 << 20;                          // 1M images, 256 MB moved: the bandwidth regime
    const int time_b[] = {4096, kBig}, check_b[] = {1, 37, 1023, 4096, 4097, kBig};
    const uint32_t first_image = 1000;                     // not 0, so the image offset is exercised
    const uint64_t seed = 0x5EEDull << 32 | 42;            // both key words in use
    std::vector<float> mulv(size_t(kBig) * kMulv);
    Rng rng(3);
    for (int b = 0; b < kBig; ++b)
        for (int j = 0; j < kLatent; ++j) {
            mulv[size_t(b) * kMulv + j] = rng.next_nonzero(2.0f);            // mu
            mulv[size_t(b) * kMulv + kLatent + j] = rng.next_nonzero(3.0f);  // logvar: sigma in 0.22..4.5
        }
    std::vector<float> z_ref(size_t(kBig) * kLatent), kl_ref(kBig);
    cpu_reparam(mulv.data(), z_ref.data(), kl_ref.data(), kBig, first_image, seed);
    float* d_mulv = device_upload(mulv);
    float *d_z, *d_kl;
    cudaCheck(cudaMalloc(&d_z, z_ref.size() * sizeof(float)));
    cudaCheck(cudaMalloc(&d_kl, kl_ref.size() * sizeof(float)));

    // z: the host's cosf(2 pi u) and the device's cospif(2u) differ by ~1e-6
    // of eps (|eps| < 6), times sigma <= 4.5: ~3e-5 absolute. KL: 20 fp32 terms
    // of magnitude <= 25, in any order: ~1e-4 absolute. A dropped term or a
    // wrong key moves either by O(1).
    bool ok = true;
    for (const auto& v : variants)
        for (int B : check_b) {
            poison(d_z, z_ref.size() * sizeof(float));
            poison(d_kl, kl_ref.size() * sizeof(float));
            v.second({d_z, d_kl, d_mulv, B, first_image, seed});
            cudaCheck(cudaGetLastError());
            cudaCheck(cudaDeviceSynchronize());
            const std::vector<float> z = copy_to_host_float(d_z, size_t(B) * kLatent), kl = copy_to_host_float(d_kl, B);
            ok = check_output(v.first, "z", B, z.data(), z_ref.data(), z.size(), kLatent, 1e-4, 1e-4) && ok;
            ok = check_output(v.first, "kl", B, kl.data(), kl_ref.data(), kl.size(), 1, 1e-3, 1e-4) && ok;
        }
    if (ok) {
        print_kernel_header();
        for (const auto& v : variants)
            for (int B : time_b) {
                const ReparamArgs a{d_z, d_kl, d_mulv, B, first_image, seed};
                const float us = benchmark_us([&] { v.second(a); });
                char problem[64];
                snprintf(problem, sizeof(problem), "B=%d", B);
                print_mem_row(v.first, problem, us, double(B) * (kMulv + kLatent + 1) * sizeof(float));
            }
    }
    cudaCheck(cudaFree(d_mulv));
    cudaCheck(cudaFree(d_z));
    cudaCheck(cudaFree(d_kl));
    return ok;
}

// Loss: loss[b] = sum over 784 pixels of BCE(logits, pixels / 255) + kl[b].
struct LossArgs {
    float* loss;
    const float* logits;
    const uint8_t* pixels;
    const float* kl;
    int B;
};

inline bool run_loss_driver(const std::vector<Variant<LossArgs>>& variants) {
    constexpr int kBig = 65536;  // 257 MB read: the bandwidth regime
    const int time_b[] = {4096, kBig}, check_b[] = {1, 37, 1023, 4096, 4097, kBig};
    std::vector<float> logits(size_t(kBig) * kIn), kl(kBig);
    fill_random(logits, 11, 8.0f);  // both signs, up to |8|: every branch of the stable form
    fill_random(kl, 12, 20.0f);
    for (float& v : kl) v = std::fabs(v);
    const std::vector<uint8_t> pixels = load_pixels(kBig);
    std::vector<float> ref(kBig);
    for (int b = 0; b < kBig; ++b) {
        double sum = kl[b];
        for (int i = 0; i < kIn; ++i) sum += bce_term_ref(logits[size_t(b) * kIn + i], pixels[size_t(b) * kIn + i] / 255.0);
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
            cudaCheck(cudaGetLastError());
            cudaCheck(cudaDeviceSynchronize());
            const std::vector<float> got = copy_to_host_float(d_loss, B);
            ok = check_output(v.first, "loss", B, got.data(), ref.data(), got.size(), 1, 1e-3, 1e-4) && ok;
        }
    if (ok) {
        print_kernel_header();
        for (const auto& v : variants)
            for (int B : time_b) {
                const LossArgs a{d_loss, d_logits, d_pixels, d_kl, B};
                const float us = benchmark_us([&] { v.second(a); });
                char problem[64];
                snprintf(problem, sizeof(problem), "B=%d", B);
                print_mem_row(v.first, problem, us, double(B) * (kIn * (sizeof(float) + 1) + 2 * sizeof(float)));
            }
    }
    cudaCheck(cudaFree(d_logits));
    cudaCheck(cudaFree(d_kl));
    cudaCheck(cudaFree(d_loss));
    cudaCheck(cudaFree(d_pixels));
    return ok;
}

// fp32 -> bf16 conversion of n elements (round to nearest even).
struct ConvertArgs {
    bf16* dst;
    const float* src;
    size_t n;
};

inline bool run_convert_driver(const std::vector<Variant<ConvertArgs>>& variants) {
    constexpr size_t kBig = size_t(64) << 20;  // 64M elements, 384 MB moved
    struct Case {
        const char* name;
        size_t n;
        size_t offset;  // elements into the buffers: 1 makes both pointers misaligned
        bool timed;
    };
    const Case cases[] = {
        {"fc1.w 400x784", size_t(kHidden) * kIn, 0, true},
        {"fc21+22.w 40x400", size_t(kMulv) * kHidden, 0, true},
        {"fc3.w 400x20", size_t(kHidden) * kLatent, 0, true},
        {"fc4.w 784x400", size_t(kIn) * kHidden, 0, true},
        {"n=1", 1, 0, false},
        {"n=37", 37, 0, false},
        {"n=1023", 1023, 0, false},
        {"n=4097", 4097, 0, false},
        {"n=4097, both pointers +1 element", 4097, 1, false},
        {"n=64M+3", kBig + 3, 0, false},
        {"n=64M", kBig, 0, true},
    };
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
            cudaCheck(cudaGetLastError());
            cudaCheck(cudaDeviceSynchronize());
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
    cudaCheck(cudaFree(d_src));
    cudaCheck(cudaFree(d_dst));
    return ok;
}

}  // namespace vae

namespace vae {

// The BCE term with the fast hardware exp2/log2 (__expf, __logf) instead of
// expf + log1pf, which cost ~100 instructions per pixel. log(1 + e) through
// __logf errs by <= ~1e-6 absolute for 1 + e in [1, 2]: <= 1e-3 over an
// image's 784 pixels, far inside every BCE tolerance here.
__device__ inline float bce_term_fast(float logit, float x) {
    return fmaxf(logit, 0.0f) - x * logit + __logf(1.0f + __expf(-fabsf(logit)));
}

// ---------------------------------------------------------------------------
// The fused-forward driver (fused_v1, fused_v2): validates every variant and
// vae.cu's separate bf16 path against the float64 CPU network, then times
// them at B = 1024, 4096, 10000.

using FusedLauncher = std::function<void(float* bce, float* kl, const uint8_t* pixels, int B, uint32_t first_image,
                                         uint64_t seed)>;
struct FusedVariant {
    const char* name;
    FusedLauncher launch;
    int bm;       // images per block
    size_t smem;  // bytes of shared memory per block
};

// vae.cu's bf16 path: fc1, latent block (fc21+fc22, sampling, fc3), fc4 + BCE, finalize.
struct SeparatePath {
    bf16 *h1 = nullptr, *h3 = nullptr;
    float* partial = nullptr;
    explicit SeparatePath(int max_b) {
        cudaCheck(cudaMalloc(&h1, size_t(max_b) * kHidden * sizeof(bf16)));
        cudaCheck(cudaMalloc(&h3, size_t(max_b) * kHidden * sizeof(bf16)));
        cudaCheck(cudaMalloc(&partial, size_t(max_b) * kFc4ColBlocks * sizeof(float)));
    }
    ~SeparatePath() {
        cudaFree(h1);
        cudaFree(h3);
        cudaFree(partial);
    }
    SeparatePath(const SeparatePath&) = delete;
    SeparatePath& operator=(const SeparatePath&) = delete;
};

inline bool run_fused_driver(const HostModel& model, const DeviceModel& w, const std::vector<FusedVariant>& variants) {
    constexpr int kMaxB = 10000;
    const int time_b[] = {1024, 4096, 10000};
    const uint32_t first_image = 0;
    const uint64_t seed = 42;
    bool pixels_from_file = false;
    const std::vector<uint8_t> pixels = load_pixels(kMaxB, &pixels_from_file);
    printf("weights: %s; pixels: %s\n", model.from_file ? "data/vae_weights.bin" : "random (uniform +-1/sqrt(K))",
           pixels_from_file ? "MNIST test set" : "random uint8");

    std::vector<float> bce_ref(kMaxCheckB), kl_ref(kMaxCheckB);
    cpu_forward(model, pixels.data(), kMaxCheckB, first_image, seed, bce_ref.data(), kl_ref.data());

    uint8_t* d_pixels = device_upload(pixels);
    float *d_bce, *d_kl;
    cudaCheck(cudaMalloc(&d_bce, kMaxB * sizeof(float)));
    cudaCheck(cudaMalloc(&d_kl, kMaxB * sizeof(float)));
    SeparatePath sep(kMaxB);
    auto separate = [&](int B) {
        fc1_bf16(sep.h1, d_pixels, w, B);
        latent_bf16(sep.h3, d_kl, sep.h1, w, B, first_image, seed);
        fc4_bce_bf16(d_bce, sep.partial, sep.h3, w.fc4_w, w.fc4_b, d_pixels, nullptr, B);
    };

    // Tolerance: the GPU rounds h1, z and h3 to bf16 (2^-9 relative each),
    // which the reference keeps exact; those errors are independent across the
    // 400 hidden units and mostly cancel in a sum over 784 pixels or 20
    // latents. 1e-2 relative (+ a small absolute floor for small KLs) leaves
    // headroom; a dropped bias or a layer reading the wrong rows moves the
    // loss by far more.
    const double atol_bce = 0.1, atol_kl = 0.05, rtol = 1e-2;
    std::vector<std::pair<const char*, std::function<void(int)>>> paths;
    for (const FusedVariant& v : variants)
        paths.push_back({v.name, [&, v](int B) { v.launch(d_bce, d_kl, d_pixels, B, first_image, seed); }});
    paths.push_back({"separate_4_launches", separate});
    bool ok = true;
    for (const auto& p : paths)
        for (int B : kCheckB) {
            poison(d_bce, kMaxB * sizeof(float));
            poison(d_kl, kMaxB * sizeof(float));
            p.second(B);
            cudaCheck(cudaGetLastError());
            cudaCheck(cudaDeviceSynchronize());
            const std::vector<float> bce = copy_to_host_float(d_bce, B), kl = copy_to_host_float(d_kl, B);
            ok = check_output(p.first, "bce", B, bce.data(), bce_ref.data(), B, 1, atol_bce, rtol) && ok;
            ok = check_output(p.first, "kl", B, kl.data(), kl_ref.data(), B, 1, atol_kl, rtol) && ok;
        }
    if (ok && getenv("VAE_CHECK_ONLY")) {
        printf("VAE_CHECK_ONLY set: not timed\n");  // for profilers: validation launches only
    } else if (ok) {
        print_kernel_header();
        for (int B : time_b) {
            char problem[64];
            snprintf(problem, sizeof(problem), "B=%d", B);
            const double flops = kFlopsPerImage * B;
            for (const FusedVariant& v : variants) {
                const float us = benchmark_us([&] { v.launch(d_bce, d_kl, d_pixels, B, first_image, seed); });
                print_flop_row(v.name, problem, us, flops);
                const int blocks = ceil_div(B, v.bm);
                printf("|   L2 -> SM weight traffic | %d blocks x %.2f MB = %.0f MB | | %.1f TB/s | %zu B smem/block | |\n",
                       blocks, DeviceModel::weight_bytes() / 1e6, blocks * DeviceModel::weight_bytes() / 1e6,
                       blocks * DeviceModel::weight_bytes() / (us * 1e-6) / 1e12, v.smem);
            }
            const float t_chain = benchmark_us([&] { separate(B); });
            const float t_fc1 = benchmark_us([&] { fc1_bf16(sep.h1, d_pixels, w, B); });
            const float t_latent = benchmark_us([&] { latent_bf16(sep.h3, d_kl, sep.h1, w, B, first_image, seed); });
            const float t_fc4 = benchmark_us(
                [&] { fc4_bce_bf16(d_bce, sep.partial, sep.h3, w.fc4_w, w.fc4_b, d_pixels, nullptr, B); });
            print_flop_row("separate_4_launches", problem, t_chain, flops);
            printf("|   separate, kernels timed alone: fc1 %.2f + latent %.2f + fc4_bce+finalize %.2f | %s | %.2f | | | |\n",
                   t_fc1, t_latent, t_fc4, problem, t_fc1 + t_latent + t_fc4);
        }
    } else {
        printf("fused: validation FAILED, not timed\n");
    }
    for (void* p : std::initializer_list<void*>{d_pixels, d_bce, d_kl}) cudaCheck(cudaFree(p));
    return ok;
}

}  // namespace vae

// ===========================================================================
// IWAE: helpers for the iwae_* drivers. Nothing above depends on this section.
//
// log p(x) ~ logsumexp_k [log p(x|z_k) + log p(z_k) - log q(z_k|x)] - log K,
// z_k = mu + sigma eps_k, the K samples of an image as K consecutive decoder
// rows (row r = sample r % K of image r / K), log p(x|z) = -BCE and
// log p(z) - log q(z|x) = 1/2 sum_j (eps_j^2 + logvar_j - z_j^2).

namespace vae {

// ---------------------------------------------------------------------------
// vae.cu's current generator, bit for bit (section "random numbers"): one
// Philox4x32-10 call with counter (group, image, sample, stream) gives four
// words, two Box-Muller pairs, the normals of latents 4 group .. 4 group + 3.
// `gaussian` above is the older one-normal-per-call draw that the reparam_*,
// fused_* and loss drivers still validate against; it stays as it is.

__host__ __device__ inline float2 box_muller(uint32_t word1, uint32_t word2) {
    const float u1 = ((word1 >> 8) + 1) * (1.0f / 16777216.0f);  // (0, 1]: log stays finite
    const float u2 = (word2 >> 8) * (1.0f / 16777216.0f);        // [0, 1)
    const float radius = sqrtf(-2.0f * logf(u1));
    float sine, cosine;
#ifdef __CUDA_ARCH__
    sincospif(2.0f * u2, &sine, &cosine);
#else
    sine = sinf(6.283185307f * u2), cosine = cosf(6.283185307f * u2);
#endif
    return make_float2(radius * cosine, radius * sine);
}

__host__ __device__ inline float4 gaussian4(uint64_t seed, uint32_t stream, uint32_t image, uint32_t sample,
                                            uint32_t group) {
    const uint4 r = philox4x32(make_uint4(group, image, sample, stream),
                               make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)));
    const float2 a = box_muller(r.x, r.y), b = box_muller(r.z, r.w);
    return make_float4(a.x, a.y, b.x, b.y);
}
static_assert(kLatent % 4 == 0, "latents come in groups of four draws");

// One row's z for latent group q (4 latents) and that group's share of
// log p(z) - log q(z|x). Every variant samples through this, as vae.cu does.
__device__ inline float iwae_sample_group(float (&z)[4], const float* mulv_row, int q, uint32_t image,
                                          uint32_t sample, uint64_t seed) {
    const float4 e = gaussian4(seed, kStreamPosterior, image, sample, q);
    const float eps[4] = {e.x, e.y, e.z, e.w};
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float logvar = mulv_row[kLatent + 4 * q + j];
        float unused_kl_term;
        z[j] = latent_z(mulv_row[4 * q + j], logvar, eps[j], &unused_kl_term);
        sum += eps[j] * eps[j] + logvar - z[j] * z[j];
    }
    return 0.5f * sum;
}

// Running (max, sum of exp) merge; a pair with max = -inf is empty.
__host__ __device__ inline void logsumexp_merge(float& m, float& s, float m2, float s2) {
    const float top = fmaxf(m, m2);
    if (top == -INFINITY) return;
    s = s * expf(m - top) + s2 * expf(m2 - top);
    m = top;
}

// fc3 padded to K = 32 plus fc4 per decoder row, fc3 counted at K = 20 as the
// useful work.
constexpr double kIwaeFlopsPerRow = 2.0 * (double(kLatent) * kHidden + double(kHidden) * kIn);
constexpr int kIwaeMaxRows = 1 << 16;  // decoder rows per pass, as vae.cu's IWAE_ROWS

// ---------------------------------------------------------------------------
// Float64 CPU reference. The weights are rounded to bf16 (what the GPU
// multiplies). mirror_bf16 = false keeps z and h3 exact: the true network on
// those weights. mirror_bf16 = true rounds z and h3 to bf16 where the GPU
// does, which leaves only fp32 accumulation and last-bit differences of the
// host's and the device's exp / sin / cos, so it can be checked much tighter.
// mulv and pixels start at image first_image.
inline std::vector<double> cpu_iwae(const HostModel& m, const float* mulv, const uint8_t* pixels, int n, int K,
                                    uint32_t first_image, uint64_t seed, bool mirror_bf16) {
    std::vector<float> w3 = m.fc3_w, w4 = m.fc4_w;
    round_to<bf16>(w3);
    round_to<bf16>(w4);
    auto bf16_round = [](double v) { return double(__bfloat162float(__float2bfloat16(float(v)))); };
    std::vector<double> log_px(n), lw(K), z(kLatent), h3(kHidden);
    for (int i = 0; i < n; ++i) {
        const float* mv = mulv + size_t(i) * kMulv;
        const uint8_t* x = pixels + size_t(i) * kIn;
        for (int k = 0; k < K; ++k) {
            double ratio = 0.0;
            for (int q = 0; q < kLatent / 4; ++q) {
                const float4 e4 = gaussian4(seed, kStreamPosterior, first_image + i, k, q);
                const float e[4] = {e4.x, e4.y, e4.z, e4.w};
                for (int j = 0; j < 4; ++j) {
                    const int l = 4 * q + j;
                    const double mu = mv[l], lv = mv[kLatent + l], eps = e[j];
                    const double zl = mu + eps * std::exp(0.5 * lv);
                    ratio += eps * eps + lv - zl * zl;
                    z[l] = mirror_bf16 ? bf16_round(fmaf(e[j], expf(0.5f * mv[kLatent + l]), mv[l])) : zl;  // nvcc contracts to an fma
                }
            }
            for (int h = 0; h < kHidden; ++h) {
                double a = m.fc3_b[h];
                for (int l = 0; l < kLatent; ++l) a += double(w3[size_t(h) * kLatent + l]) * z[l];
                a = std::max(a, 0.0);
                h3[h] = mirror_bf16 ? bf16_round(a) : a;
            }
            double bce = 0.0;
            for (int p = 0; p < kIn; ++p) {
                const float* w = &w4[size_t(p) * kHidden];
                double a = m.fc4_b[p];
                for (int h = 0; h < kHidden; ++h) a += double(w[h]) * h3[h];
                bce += bce_term_ref(a, x[p] / 255.0);
            }
            lw[k] = 0.5 * ratio - bce;
        }
        const double top = *std::max_element(lw.begin(), lw.end());
        double s = 0.0;
        for (double v : lw) s += std::exp(v - top);
        log_px[i] = top + std::log(s) - std::log(double(K));
    }
    return log_px;
}

// ---------------------------------------------------------------------------
// The IWAE driver: log_px[n] of images first_image .. first_image + n - 1 from
// their [mu | logvar] rows and pixels (both starting at that image), K samples
// each, at most max_rows decoder rows per pass (the variant loops over passes).
struct IwaeArgs {
    float* log_px;
    const float* mulv;
    const uint8_t* pixels;
    int n, K;
    uint32_t first_image;
    uint64_t seed;
    int max_rows;  // <= kIwaeMaxRows; small in validation so several passes run
};
struct IwaeVariant {
    const char* name;
    std::function<void(const IwaeArgs&)> launch;
};

// f(first image of the pass relative to a.first_image, images in it).
template <typename F>
inline void for_each_iwae_pass(const IwaeArgs& a, F f) {
    if (a.K < 1 || a.K > a.max_rows || a.max_rows > kIwaeMaxRows) {
        fprintf(stderr, "iwae: K = %d outside 1..max_rows = %d (<= %d)\n", a.K, a.max_rows, kIwaeMaxRows);
        exit(EXIT_FAILURE);
    }
    const int per_pass = a.max_rows / a.K;
    for (int first = 0; first < a.n; first += per_pass) f(first, std::min(per_pass, a.n - first));
}

// Validates every variant against both CPU references on small cases into a
// NaN-poisoned log_px, then, only if all pass, times each at K = 5000 over
// the whole test set. mulv comes from common.h's bf16 encoder kernels (fc1,
// then fc21+fc22 written as fp32) and is copied back, so the GPU and the
// reference start from the same numbers; the encoder is not timed.
inline bool run_iwae_driver(const HostModel& model, const DeviceModel& w, const std::vector<IwaeVariant>& variants) {
    constexpr int kImages = 10000, kTimeK = 5000;
    const uint64_t seed = 42;
    bool pixels_from_file = false;
    const std::vector<uint8_t> pixels = load_pixels(kImages, &pixels_from_file);
    printf("weights: %s; pixels: %s\n", model.from_file ? "data/vae_weights.bin" : "random (uniform +-1/sqrt(K))",
           pixels_from_file ? "MNIST test set" : "random uint8");

    uint8_t* d_pixels = device_upload(pixels);
    bf16* d_h1;
    float *d_mulv, *d_log_px;
    cudaCheck(cudaMalloc(&d_h1, size_t(kImages) * kHidden * sizeof(bf16)));
    cudaCheck(cudaMalloc(&d_mulv, size_t(kImages) * kMulv * sizeof(float)));
    cudaCheck(cudaMalloc(&d_log_px, kImages * sizeof(float)));
    fc1_bf16(d_h1, d_pixels, w, kImages);
    {
        using EncTile = LatentTile;  // 32 images x 40 outputs
        allow_smem(linear_bf16_kernel<EncTile, false, float>, sizeof(EncTile::Smem));
        linear_bf16_kernel<EncTile, false, float><<<dim3(1, ceil_div(kImages, EncTile::BM)), EncTile::THREADS,
                                                    sizeof(EncTile::Smem)>>>(d_mulv, d_h1, w.enc_w, w.enc_b, kImages,
                                                                             kMulv, kHidden, 1.0f);
        cudaCheck(cudaGetLastError());
    }
    const std::vector<float> mulv = copy_to_host_float(d_mulv, size_t(kImages) * kMulv);

    struct Case {
        uint32_t first;
        int n, K, max_rows;
    };
    // offsets not 0 so the image key is exercised; max_rows small in two of
    // them so images fall into several passes
    const Case cases[] = {{7, 5, 37, kIwaeMaxRows}, {1234, 3, 1000, 2048}, {42, 7, 1, 3}};
    // Tolerances on log p(x) (~ -100 nats):
    // - against the exact-activation float64 network: 1e-2 relative (+0.1
    //   nats). The GPU rounds z and h3 to bf16 (2^-9 relative each); per-row
    //   BCE moves by up to ~1e-2 relative (the fused_* bound), and a
    //   logsumexp never moves by more than its largest input does.
    // - against the reference that rounds z and h3 the same way: 1e-3
    //   relative (+0.05). What remains is fp32 accumulation (~1e-5 relative)
    //   and, rarely, a z or h3 element that rounds to the neighbouring bf16
    //   because the host's expf / sincos differ from the device's in the last
    //   bit. A wrong eps key, row-to-image mapping or dropped term moves
    //   log p(x) by far more than 0.1 nats at these K.
    bool ok = true;
    std::vector<std::vector<double>> ref_exact, ref_mirror;
    for (const Case& c : cases) {
        const float* mv = mulv.data() + size_t(c.first) * kMulv;
        const uint8_t* px = pixels.data() + size_t(c.first) * kIn;
        ref_exact.push_back(cpu_iwae(model, mv, px, c.n, c.K, c.first, seed, false));
        ref_mirror.push_back(cpu_iwae(model, mv, px, c.n, c.K, c.first, seed, true));
    }
    for (const IwaeVariant& v : variants)
        for (size_t ci = 0; ci < std::size(cases); ++ci) {
            const Case& c = cases[ci];
            poison(d_log_px, kImages * sizeof(float));
            v.launch({d_log_px, d_mulv + size_t(c.first) * kMulv, d_pixels + size_t(c.first) * kIn, c.n, c.K, c.first,
                      seed, c.max_rows});
            cudaCheck(cudaGetLastError());
            cudaCheck(cudaDeviceSynchronize());
            const std::vector<float> got = copy_to_host_float(d_log_px, c.n);
            std::vector<float> exact(c.n), mirror(c.n);
            for (int i = 0; i < c.n; ++i) exact[i] = float(ref_exact[ci][i]), mirror[i] = float(ref_mirror[ci][i]);
            char what[96];
            snprintf(what, sizeof(what), "log_px K=%d (%d rows/pass) vs fp64", c.K, c.max_rows);
            ok = check_output(v.name, what, c.n, got.data(), exact.data(), c.n, 1, 0.1, 1e-2) && ok;
            snprintf(what, sizeof(what), "log_px K=%d (%d rows/pass) vs fp64 with bf16 z,h3", c.K, c.max_rows);
            ok = check_output(v.name, what, c.n, got.data(), mirror.data(), c.n, 1, 0.05, 1e-3) && ok;
        }
    if (ok && getenv("VAE_CHECK_ONLY")) {
        printf("VAE_CHECK_ONLY set: not timed\n");
    } else if (ok) {
        // ~0.5 s per run: the benchmark helper's median of 5 after 1 warm-up.
        const IwaeArgs a{d_log_px, d_mulv, d_pixels, kImages, kTimeK, 0, seed, kIwaeMaxRows};
        const double rows = double(kImages) * kTimeK, flops = rows * kIwaeFlopsPerRow;
        char problem[64];
        snprintf(problem, sizeof(problem), "N=%d K=%d", kImages, kTimeK);
        print_kernel_header();
        for (const IwaeVariant& v : variants) {
            const float us = benchmark_us([&] { v.launch(a); }, 5, 1);
            print_flop_row(v.name, problem, us, flops);
            poison(d_log_px, kImages * sizeof(float));
            v.launch(a);
            cudaCheck(cudaDeviceSynchronize());
            const std::vector<float> lp = copy_to_host_float(d_log_px, kImages);
            double sum = 0.0;
            for (float x : lp) sum += x;  // a NaN (unwritten image) shows in the mean
            printf("|   %s: %.3g decoder passes/s, mean NLL %.4f nats | %s | %.1f ms | | | |\n", v.name,
                   rows / (us * 1e-6), -sum / kImages, problem, us / 1e3);
        }
        printf("floor: %.1f TFLOP of decoder work at %.0f TFLOP/s = %.1f ms\n", flops / 1e12, kBf16PeakTflops,
               flops / (kBf16PeakTflops * 1e12) * 1e3);
    } else {
        printf("iwae: validation FAILED, not timed\n");
    }
    for (void* p : std::initializer_list<void*>{d_pixels, d_h1, d_mulv, d_log_px}) cudaCheck(cudaFree(p));
    return ok;
}

// IWAE sampling + fc3 in one block (iwae_v2 onwards): 64 rows' z straight into a bf16 tile
// in shared memory, multiplied by fc3 on the tensor cores; only h3 and log_ratio are written.
constexpr int kLatentRows = 64, kLatentWarps = kLatentRows / 16;
constexpr int kZPitch = kFc3KPad + 8;  // 80-byte rows: a fragment's 8 rows hit 8 different banks

// h3[r] = ReLU(z_r W3^T + b3) in bf16 and log_ratio[r] for 64 rows per block;
// mulv starts at the pass's first image.
__global__ void __launch_bounds__(kLatentWarps * 32)
    iwae_latent_kernel(bf16* __restrict__ h3, float* __restrict__ log_ratio, const float* __restrict__ mulv,
                       const bf16* __restrict__ fc3_w_padded, const float* __restrict__ fc3_b, int rows, int K,
                       uint32_t first_image, uint64_t seed) {
    constexpr int GROUPS = kLatent / 4, PAD_GROUPS = kFc3KPad / 4;
    __shared__ __align__(16) bf16 w3[kHidden][kZPitch];
    __shared__ __align__(16) bf16 z_tile[kLatentRows][kZPitch];
    __shared__ float ratio_terms[kLatentRows][GROUPS];
    const int row0 = blockIdx.x * kLatentRows, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4,
              t = lane % 4;

    for (int c = threadIdx.x; c < kHidden * kFc3KPad / 8; c += blockDim.x) {  // 16-byte chunks, async
        const int n = c / (kFc3KPad / 8), k = (c % (kFc3KPad / 8)) * 8;
        ptx::cp_async_16(ptx::smem_addr(&w3[n][k]), fc3_w_padded + size_t(n) * kFc3KPad + k, 16);
    }
    ptx::cp_async_commit();
    // z while the weights arrive: one Philox call per (row, group of 4 latents);
    // rows past `rows` and the K padding are zeros
    for (int i = threadIdx.x; i < kLatentRows * PAD_GROUPS; i += blockDim.x) {
        const int r = i / PAD_GROUPS, q = i % PAD_GROUPS, row = row0 + r;
        float z[4] = {};
        if (q < GROUPS && row < rows) {
            const int image = row / K;
            ratio_terms[r][q] = iwae_sample_group(z, mulv + size_t(image) * kMulv, q, first_image + image, row % K, seed);
        }
        *reinterpret_cast<__nv_bfloat162*>(&z_tile[r][4 * q]) = __floats2bfloat162_rn(z[0], z[1]);
        *reinterpret_cast<__nv_bfloat162*>(&z_tile[r][4 * q + 2]) = __floats2bfloat162_rn(z[2], z[3]);
    }
    ptx::cp_async_wait<0>();
    __syncthreads();
    if (threadIdx.x < kLatentRows && row0 + int(threadIdx.x) < rows) {
        float ratio = 0.0f;
#pragma unroll
        for (int q = 0; q < GROUPS; q++) ratio += ratio_terms[threadIdx.x][q];
        log_ratio[row0 + threadIdx.x] = ratio;
    }

    // fc3: warp w owns rows 16w .. 16w + 15, all 400 outputs as 50 mma tiles
    unsigned a[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        const bf16* top = &z_tile[warp * 16 + g][kk * 16 + 2 * t];
        const bf16* bottom = top + 8 * kZPitch;
        a[kk][0] = bf16x2_at(top), a[kk][1] = bf16x2_at(bottom), a[kk][2] = bf16x2_at(top + 8),
        a[kk][3] = bf16x2_at(bottom + 8);
    }
    const int r_top = row0 + warp * 16 + g;
#pragma unroll 5
    for (int nt = 0; nt < kHidden / 8; nt++) {
        float acc[4] = {};
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            const bf16* wp = &w3[nt * 8 + g][kk * 16 + 2 * t];
            const unsigned b[2] = {bf16x2_at(wp), bf16x2_at(wp + 8)};
            ptx::mma_bf16_16816(acc, a[kk], b);
        }
        const int c = nt * 8 + 2 * t;
        const float b0 = fc3_b[c], b1 = fc3_b[c + 1];
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = r_top + 8 * half;
            if (r >= rows) continue;
            *reinterpret_cast<__nv_bfloat162*>(&h3[size_t(r) * kHidden + c]) =
                __floats2bfloat162_rn(fmaxf(acc[2 * half] + b0, 0.0f), fmaxf(acc[2 * half + 1] + b1, 0.0f));
        }
    }
}

}  // namespace vae
