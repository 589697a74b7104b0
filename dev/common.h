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
