// The dev/ drivers' harness: what a kernel study needs around its kernel, and no model code. vae.cu
// comes first (with TESTING: no CLI), so the model's constants, the generator, the file parsers, the
// PTX helpers and the kernels are the program's own and a driver cannot drift from them. This
// file adds cuBLAS error checks, deterministic inputs, CPU float64 references, validation, the timing
// protocol, the cuBLASLt baseline, the result tables and one validate-then-time driver per kernel
// family. Each dev/*.cu writes out the kernel it studies; where that kernel has a name vae.cu also
// uses, the driver's copy carries a version suffix. GEMM layout (PyTorch nn.Linear): X[M,K] and
// W[N,K] row-major, bias[N], Y[M,N] = act(X · W^T + bias).
#pragma once

#ifndef TESTING
#define TESTING  // vae.cu without its main()
#endif
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"  // the CLI's helpers, which no driver calls
#include "../vae.cu"
#pragma GCC diagnostic pop

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

// ---- CPU reference in double precision. bias may be null (no bias).
inline void cpu_linear(const float* X, const float* W, const float* bias, float* Y, int M, int N, int K, Act act) {
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
        for (int n = 0; n < N; ++n)
            Y[static_cast<size_t>(m) * N + n] = static_cast<float>(act == Act::Relu && acc[n] < 0.0 ? 0.0 : acc[n]);
    }
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
        ref.resize(static_cast<size_t>(kMaxM) * s.N);
        cpu_linear(x.data(), w.data(), b.data(), ref.data(), kMaxM, s.N, s.K, s.act);
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

// One pixel's BCE in float64 from its logit: max(l,0) - x l + log(1 + e^-|l|), x = pixel / 255.
inline double bce_term_ref(double l, double x) {
    return std::max(l, 0.0) - x * l + std::log1p(std::exp(-std::fabs(l)));
}
// What the loss_* and reparam_* variants build on (vae.cu's decoders now form the BCE in their
// epilogue): the same term in fp32, and a sum over a warp's lanes in a fixed order.
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
            sum += 1.0 + lv - mu * mu - std::exp(lv);
        }
        kl[b] = static_cast<float>(-0.5 * sum);
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
            sum += bce_term_ref(logits[i], pixels[i] / 255.0);
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

// ---- AIS: the gradient of BCE(x, logits(z)) w.r.t. z, one evaluation per row per step of a trajectory
// What a gradient variant's launch reads and writes (device pointers). Row r is z[r] scored against
// pixels[r]; the kernel runs `evals` evaluations of every row (the timed loop of a trajectory: the
// same z each time, so the last evaluation's results are the first's) and writes the last.
struct AisGradientArgs {
    const float* z;        // [rows][20]
    const uint8_t* pixels; // [rows][784]
    int rows, evals;
    float *grad, *bce;     // [rows][20], [rows]
};

// data/'s weights and test set, or one line naming the problem and exit 1 (drivers run from the root).
inline void load_model_inputs(const char* driver, HostWeights* w, Images* images) {
    Error err;
    *w = {}, *images = {};
    if (!load_file("data/vae_weights.bin", parse_weights, w, &err) ||
        !load_file("data/t10k-images-idx3-ubyte", parse_idx_images, images, &err))
        fail("%s (make data, then run from the repository root: ./dev/%s)", err.msg, driver);
}

// A gradient kernel's loop over its cluster's tiles of AIS_ROWS rows, as ais_kernel holds them when a
// tile is the block's (both warpgroups evaluate together, as many times: what bf16's turns need):
// thread (warp, g, t) has rows tile * AIS_ROWS + 16 warp + g and + 8 (those past a.rows repeat the
// last one's data and write nothing), latents 8 (i / 2) + 2t + i % 2 of each, and the pixels from
// col0. gradient(z, x_row, grad, bce, true) runs a.evals times (the energy too); the cluster's rank 0
// writes the result.
template <typename Gradient>
__device__ inline void ais_driver_tiles(const AisGradientArgs& a, int col0, Gradient gradient) {
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int tile = cluster_index(); tile < ceil_div(a.rows, AIS_ROWS); tile += cluster_count()) {
        float z[2][AIS_LATENTS], grad[2][AIS_LATENTS], bce[2];
        const uint8_t* x_row[2];
        int row[2];
        for (int half = 0; half < 2; half++) {
            row[half] = tile * AIS_ROWS + warp * TASK_ROWS + g + 8 * half;
            const int r = row[half] < a.rows ? row[half] : a.rows - 1;
            x_row[half] = a.pixels + (size_t)r * INPUT_DIM + col0;
            for (int i = 0; i < AIS_LATENTS; i++) {
                const int j = 8 * (i / 2) + 2 * t + i % 2;
                z[half][i] = j < LATENT_DIM ? a.z[(size_t)r * LATENT_DIM + j] : 0.0f;
            }
        }
        for (int e = 0; e < a.evals; e++) gradient(z, x_row, grad, bce, true);
        for (int half = 0; half < 2 && cluster_rank() == 0; half++) {
            if (row[half] >= a.rows) continue;
            for (int i = 0; i < AIS_LATENTS; i++) {
                const int j = 8 * (i / 2) + 2 * t + i % 2;
                if (j < LATENT_DIM) a.grad[(size_t)row[half] * LATENT_DIM + j] = grad[half][i];
            }
            if (t == 0) a.bce[row[half]] = bce[half];
        }
    }
}

// The roundings of ais_gradient_wgmma<PRECISION_BF16>, for a float64 reference that takes them too: fc4 as
// the kernel holds it (bf16), fc3 in fp16 for the backward product (its hi part alone). fc4's bias
// (three bf16 parts) and fc3's forward (fp16 hi and lo parts in both paths) are ~fp32 and stay exact.
struct AisBf16Weights {
    std::vector<float> fc4_w, fc3_w_backward;
};
inline float round_bf16(double v) { return __bfloat162float(__float2bfloat16_rn((float)v)); }
inline float round_fp16(double v) { return __half2float(__float2half_rn((float)v)); }
inline AisBf16Weights ais_bf16_weights(const HostWeights* w) {
    AisBf16Weights r{std::vector<float>(w->tensor[FC4_W], w->tensor[FC4_W] + TENSOR_SIZES[FC4_W]),
                     std::vector<float>(w->tensor[FC3_W], w->tensor[FC3_W] + TENSOR_SIZES[FC3_W])};
    for (float& v : r.fc4_w) v = round_bf16(v);
    for (float& v : r.fc3_w_backward) v = round_fp16(v);
    return r;
}

// BCE(x, logits(z)) and grad_z BCE in float64 from the fp32 weights (forward, then backward w.r.t. z).
// With bf16 (ais_bf16_weights), also the bf16 path's roundings of its operands: the ReLU's output and
// sigmoid - x to bf16, and dh to fp16 as each block of the cluster holds it, the share of its columns
// of the logits (0..199, .., 600..783), before the blocks add their products with fc3. What is left
// between it and the kernel is float32 sums.
template <typename Z>
inline double cpu_ais_gradient(const HostWeights* w, const uint8_t* pixels, const Z* z, double* grad,
                               const AisBf16Weights* bf16 = nullptr) {
    constexpr int BN = Path<PRECISION_BF16>::AIS_BN, BLOCKS = Path<PRECISION_BF16>::AIS_CLUSTER;
    const float* fc4_w = bf16 ? bf16->fc4_w.data() : w->tensor[FC4_W];
    const float* fc3_w_backward = bf16 ? bf16->fc3_w_backward.data() : w->tensor[FC3_W];
    double pre[HIDDEN_DIM], h[HIDDEN_DIM], dh[BLOCKS][HIDDEN_DIM] = {}, bce = 0.0;
    for (int k = 0; k < HIDDEN_DIM; k++) {
        pre[k] = w->tensor[FC3_B][k];
        for (int j = 0; j < LATENT_DIM; j++) pre[k] += (double)w->tensor[FC3_W][k * LATENT_DIM + j] * z[j];
        h[k] = bf16 ? round_bf16(std::max(pre[k], 0.0)) : std::max(pre[k], 0.0);
    }
    for (int i = 0; i < INPUT_DIM; i++) {
        const float* row = fc4_w + (size_t)i * HIDDEN_DIM;
        double l = w->tensor[FC4_B][i];
        for (int k = 0; k < HIDDEN_DIM; k++) l += (double)row[k] * h[k];
        const double x = pixels[i] / 255.0, sigmoid_minus_x = 1.0 / (1.0 + std::exp(-l)) - x;
        const double g = bf16 ? round_bf16(sigmoid_minus_x) : sigmoid_minus_x;
        bce += std::max(l, 0.0) - x * l + std::log1p(std::exp(-std::fabs(l)));
        double* share = dh[bf16 ? std::min(i / BN, BLOCKS - 1) : 0];
        for (int k = 0; k < HIDDEN_DIM; k++) share[k] += g * row[k];
    }
    for (int j = 0; j < LATENT_DIM; j++) grad[j] = 0.0;
    for (int block = 0; block < (bf16 ? BLOCKS : 1); block++)
        for (int k = 0; k < HIDDEN_DIM; k++)
            if (pre[k] > 0.0) {
                const double d = bf16 ? round_fp16(dh[block][k]) : dh[block][k];
                for (int j = 0; j < LATENT_DIM; j++) grad[j] += d * fc3_w_backward[k * LATENT_DIM + j];
            }
    return bce;
}

// vae.cu's own gradient of the same rows: ais_kernel at T = 1 (no transition), one chain a row started
// at z, its first evaluation's grad and BCE (the outputs test_vae reads as grad0 and bce0).
inline void production_ais_gradient(const VAE* m, const AisGradientArgs& a) {
    const double beta[2] = {0.0, 1.0};
    double *d_beta, *d_log_w;
    int* d_accepted;
    float *d_mulv, *d_step;
    cudaCheck(cudaMalloc(&d_beta, sizeof(beta)));
    cudaCheck(cudaMalloc(&d_log_w, (size_t)a.rows * sizeof(double)));
    cudaCheck(cudaMalloc(&d_accepted, (size_t)a.rows * sizeof(int)));
    cudaCheck(cudaMalloc(&d_mulv, (size_t)a.rows * MULV_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_step, (size_t)a.rows * sizeof(float)));
    cudaCheck(cudaMemcpy(d_beta, beta, sizeof(beta), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemset(d_mulv, 0, (size_t)a.rows * MULV_DIM * sizeof(float))); // p0 = N(0, I): unused at T = 1
    AisIO io = {};
    io.pixels = a.pixels, io.mulv = d_mulv, io.z_start = a.z, io.beta = d_beta, io.n = a.rows, io.chains = 1;
    io.T = 1, io.leapfrog = 1, io.step0 = AIS_STEP_START, io.log_w = d_log_w, io.accepted = d_accepted;
    io.step_out = d_step, io.grad0 = a.grad, io.bce0 = a.bce;
    if (m->precision == PRECISION_FP32)
        ais_launch<PRECISION_FP32>(io, m->fc4_wb, m->w4_map, m->ais_w3, m->ais_state, m->ais_clusters, 0);
    else
        ais_launch<PRECISION_BF16>(io, m->fc4_wb, m->w4_map, m->ais_w3, m->ais_state, m->ais_clusters, 0);
    cudaCheck(cudaGetLastError()), cudaCheck(cudaDeviceSynchronize());
    void* buffers[] = {d_beta, d_log_w, d_accepted, d_mulv, d_step};
    for (void* p : buffers) cudaCheck(cudaFree(p));
}

// Checks each variant's grad and BCE against float64 on ragged row counts (outputs NaN-poisoned; rows
// of 1, 7 and 37 leave tiles of 128 chains partly empty), then times one evaluation at `rows_timed`
// rows (a full round of the GPU's clusters: what --ais keeps in flight) from the difference of
// 20- and 220-evaluation launches, so the weights' load and the launch drop out. z ~ N(0, 0.6^2):
// the spread of the posteriors the chains visit. tol: the variants' relative tolerance on grad against
// float64. Each is also checked against vae.cu's gradient (ais_kernel, model m) at 1e-3: the same
// 16-bit operands, where only the order of fp32 sums may differ (and with it, now and then, the
// rounding of a sigmoid - x to bf16); a lost group of 16 hidden units moves grad by ~4%.
inline bool run_ais_gradient_driver(const std::vector<Variant<AisGradientArgs>>& variants, const VAE* m,
                                    const HostWeights* w, const Images* images, int rows_timed, double tol) {
    const int check_rows[] = {1, 7, 37, 1023, 4097};
    const int max_rows = std::max(rows_timed, 4097);
    std::vector<float> z((size_t)max_rows * LATENT_DIM);
    for (int r = 0; r < max_rows; r++)
        for (int q = 0; q < LATENT_DIM / 4; q++) {
            const float4 g = gaussian4(3, STREAM_PRIOR, r, 0, q);
            const float v[4] = {g.x, g.y, g.z, g.w};
            for (int i = 0; i < 4; i++) z[(size_t)r * LATENT_DIM + 4 * q + i] = 0.6f * v[i];
        }
    std::vector<uint8_t> pixels((size_t)max_rows * INPUT_DIM);
    for (int r = 0; r < max_rows; r++)
        memcpy(&pixels[(size_t)r * INPUT_DIM], images->pixels + (size_t)(r % images->count) * INPUT_DIM, INPUT_DIM);
    std::vector<double> ref_grad((size_t)4097 * LATENT_DIM), ref_bce(4097);
    for (int r = 0; r < 4097; r++)
        ref_bce[r] = cpu_ais_gradient(w, &pixels[(size_t)r * INPUT_DIM], &z[(size_t)r * LATENT_DIM],
                                      &ref_grad[(size_t)r * LATENT_DIM]);
    float* d_z = device_upload(z);
    uint8_t* d_pixels = device_upload(pixels);
    float *d_grad, *d_bce, *d_base_grad, *d_base_bce;
    cudaCheck(cudaMalloc(&d_grad, (size_t)max_rows * LATENT_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_bce, (size_t)max_rows * sizeof(float)));
    cudaCheck(cudaMalloc(&d_base_grad, (size_t)4097 * LATENT_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_base_bce, (size_t)4097 * sizeof(float)));
    bool ok = true;
    for (int rows : check_rows) {
        poison(d_base_grad, (size_t)4097 * LATENT_DIM * sizeof(float)), poison(d_base_bce, 4097 * sizeof(float));
        production_ais_gradient(m, {d_z, d_pixels, rows, 1, d_base_grad, d_base_bce});
        const std::vector<float> base_grad = copy_to_host_float(d_base_grad, (size_t)rows * LATENT_DIM);
        const std::vector<float> base_bce = copy_to_host_float(d_base_bce, rows);
        const std::vector<double> base64_grad(base_grad.begin(), base_grad.end());
        const std::vector<double> base64_bce(base_bce.begin(), base_bce.end());
        for (const auto& v : variants) {
            poison(d_grad, (size_t)max_rows * LATENT_DIM * sizeof(float)), poison(d_bce, max_rows * sizeof(float));
            v.second({d_z, d_pixels, rows, 1, d_grad, d_bce});
            cudaCheck(cudaGetLastError()), cudaCheck(cudaDeviceSynchronize());
            const std::vector<float> grad = copy_to_host_float(d_grad, (size_t)rows * LATENT_DIM);
            const std::vector<float> bce = copy_to_host_float(d_bce, rows);
            const double e_grad = rel_err(grad.data(), ref_grad.data(), rows, LATENT_DIM, 0, LATENT_DIM);
            const double e_bce = rel_err(bce.data(), ref_bce.data(), rows);
            const double d_grad_base = rel_err(grad.data(), base64_grad.data(), rows, LATENT_DIM, 0, LATENT_DIM);
            const double d_bce_base = rel_err(bce.data(), base64_bce.data(), rows);
            const bool good = e_grad <= tol && e_bce <= tol && d_grad_base <= 1e-3 && d_bce_base <= 1e-3;
            printf("check %-20s rows %5d: vs float64 grad %.2e, BCE %.2e (tolerance %.0e); vs ais_kernel grad %.2e, "
                   "BCE %.2e (1e-3) %s\n", v.first, rows, e_grad, e_bce, tol, d_grad_base, d_bce_base,
                   good ? "OK" : "FAIL");
            ok = ok && good;
        }
    }
    if (ok) {
        printf("%-28s %8s %12s %14s %10s %8s %14s\n", "variant", "rows", "us / eval", "evals / s", "TFLOP/s",
               "% floor", "--ais 1000 (s)");
        for (const auto& v : variants) {
            float us[2];
            for (int i = 0; i < 2; i++) {
                const AisGradientArgs a{d_z, d_pixels, rows_timed, i ? 220 : 20, d_grad, d_bce};
                us[i] = benchmark_us([&] { v.second(a); }, 5, 1, false);
            }
            // --ais 1000 over the test set: 10000 images x 16 chains x 999 transitions x 10 evaluations
            const double per_eval = (us[1] - us[0]) / 200.0, evals_per_s = rows_timed / (per_eval * 1e-6);
            const double tflops = evals_per_s * AIS_FLOPS_PER_EVAL * 1e-12;
            printf("%-28s %8d %12.2f %14.3e %10.1f %7.1f%% %14.2f\n", v.first, rows_timed, per_eval, evals_per_s,
                   tflops, 100.0 * tflops / 770.0, 1.6e9 / evals_per_s);
        }
    }
    void* buffers[] = {d_z, d_pixels, d_grad, d_bce, d_base_grad, d_base_bce};
    for (void* p : buffers) cudaCheck(cudaFree(p));
    return ok;
}

// ---- AIS chains: the leapfrog trajectory and the whole transition (dev/ais_hmc_v*.cu)

// One image's C chains in float64, ais_kernel's algorithm written out plainly with vae.cu's keyed
// draws: z from q(z|x) = N(mu, exp(logvar)) (mulv: the encoder's floats the kernel reads), the
// momenta, the uniforms. The step size is a float32 as in the kernel, so both take the same steps
// while their decisions agree; `adapt` moves it after each transition from the image's acceptance.
// bf16: each evaluation with the bf16 path's roundings (cpu_ais_gradient).
struct CpuAisImage {
    std::vector<double> log_w;    // [C]
    std::vector<double> z;        // [C][20] at the end
    std::vector<double> proposal; // [C][40]: the last trajectory's end (z, p) before its test
    std::vector<int> accepted;    // [C]
    std::vector<double> margin;   // [C]: the closest any of its tests came to its threshold, |log u - (H0 - H1)|
    std::vector<double> delta_h;  // [C]: the last transition's H0 - H1
    float step;                   // at the end
};
inline CpuAisImage cpu_ais_image(const HostWeights* w, const uint8_t* pixels, const float* mulv, const double* beta,
                                 int T, int C, int L, uint32_t image, uint64_t seed, float step, bool adapt,
                                 const AisBf16Weights* bf16 = nullptr) {
    CpuAisImage out{std::vector<double>(C, 0.0),      std::vector<double>((size_t)C * LATENT_DIM),
                    std::vector<double>((size_t)C * 2 * LATENT_DIM, NAN), std::vector<int>(C, 0),
                    std::vector<double>(C, INFINITY), std::vector<double>(C, NAN), step};
    std::vector<double> grad((size_t)C * LATENT_DIM), bce(C);
    double logvar_sum = 0.0, inv_var[LATENT_DIM];
    for (int j = 0; j < LATENT_DIM; j++)
        logvar_sum += mulv[LATENT_DIM + j], inv_var[j] = std::exp(-(double)mulv[LATENT_DIM + j]);
    // log p(x, z) - log p0(z) and U_b as in ais_kernel (the log 2 pi terms cancel)
    auto log_densities = [&](const double* z, double bce_z, double* lpxz, double* lp0) {
        double sq = 0.0, mahal = 0.0;
        for (int j = 0; j < LATENT_DIM; j++)
            sq += z[j] * z[j], mahal += (z[j] - mulv[j]) * (z[j] - mulv[j]) * inv_var[j];
        *lpxz = -bce_z - 0.5 * sq, *lp0 = -0.5 * (mahal + logvar_sum);
    };
    for (int c = 0; c < C; c++) {
        double* z = &out.z[(size_t)c * LATENT_DIM];
        for (int j = 0; j < LATENT_DIM; j++)
            z[j] = mulv[j] + gaussian(seed, STREAM_POSTERIOR, image, c, j) * std::exp(0.5 * mulv[LATENT_DIM + j]);
        bce[c] = cpu_ais_gradient(w, pixels, z, &grad[(size_t)c * LATENT_DIM], bf16);
    }
    for (int s = 1; s <= T; s++) {
        int taken = 0; // this transition's acceptances over the image's chains
        for (int c = 0; c < C; c++) {
            double *z = &out.z[(size_t)c * LATENT_DIM], *g = &grad[(size_t)c * LATENT_DIM], lpxz, lp0;
            log_densities(z, bce[c], &lpxz, &lp0);
            out.log_w[c] += (beta[s] - beta[s - 1]) * (lpxz - lp0);
            if (s == T) continue;
            const double b = beta[s];
            double p[LATENT_DIM], kinetic = 0.0;
            for (int j = 0; j < LATENT_DIM; j += 2) {
                const float2 e = gaussian_pair(seed, STREAM_MOMENTUM, image, c, 16 * s + j / 2);
                p[j] = e.x, p[j + 1] = e.y, kinetic += (double)e.x * e.x + (double)e.y * e.y;
            }
            const double h0 = -b * lpxz - (1.0 - b) * lp0 + 0.5 * kinetic, bce0 = bce[c];
            double z0[LATENT_DIM], grad0[LATENT_DIM];
            std::copy(z, z + LATENT_DIM, z0), std::copy(g, g + LATENT_DIM, grad0);
            auto kick = [&](double scale) {
                for (int j = 0; j < LATENT_DIM; j++)
                    p[j] -= scale * out.step * (b * (g[j] + z[j]) + (1.0 - b) * (z[j] - mulv[j]) * inv_var[j]);
            };
            kick(0.5);
            for (int l = 1; l <= L; l++) {
                for (int j = 0; j < LATENT_DIM; j++) z[j] += out.step * p[j];
                bce[c] = cpu_ais_gradient(w, pixels, z, g, bf16);
                kick(l < L ? 1.0 : 0.5);
            }
            for (int j = 0; j < LATENT_DIM && s == T - 1; j++)
                out.proposal[(size_t)c * 2 * LATENT_DIM + j] = z[j],
                out.proposal[(size_t)c * 2 * LATENT_DIM + LATENT_DIM + j] = p[j];
            log_densities(z, bce[c], &lpxz, &lp0);
            kinetic = 0.0;
            for (int j = 0; j < LATENT_DIM; j++) kinetic += p[j] * p[j];
            const double h1 = -b * lpxz - (1.0 - b) * lp0 + 0.5 * kinetic;
            const double log_u = std::log((double)uniform_open0(seed, STREAM_ACCEPT, image, c, s));
            out.margin[c] = std::min(out.margin[c], std::fabs(log_u - (h0 - h1))), out.delta_h[c] = h0 - h1;
            if (log_u < h0 - h1) { // false for NaN
                out.accepted[c]++, taken++;
            } else {
                std::copy(z0, z0 + LATENT_DIM, z), std::copy(grad0, grad0 + LATENT_DIM, g);
                bce[c] = bce0;
            }
        }
        if (adapt && s < T) // ais_kernel's float32 arithmetic, so the steps agree bit for bit
            out.step = fminf(fmaxf(out.step * ((float)taken / C > AIS_TARGET_ACCEPT ? 1.02f : 0.98f), AIS_STEP_MIN),
                             AIS_STEP_MAX);
    }
    return out;
}

// What a chain driver checks and times: T >= 2 weights (T - 1 transitions) of C chains with L leapfrog
// steps each, on the schedule `beta` (T + 1 values), checked on images 0 .. n - 1 for each n of
// check_images. The time is that of one transition (per_transition) or one leapfrog step, from two
// launches that differ by 20 of them (T = 2 and 22 at L, or L = 1 and 21 at T = 2: one transition),
// so the weights' load, the start and the launch drop out.
struct AisChainDriver {
    const char* name;
    int T, C, L;
    std::vector<double> beta;
    std::vector<int> check_images;
    bool per_transition;
};

// Checks each variant (a launcher of one AisIO, the production ais_kernel's interface) against
// cpu_ais_image chain by chain, outputs NaN-poisoned; in bf16 against the reference that takes the bf16
// path's roundings. A Metropolis test whose float64 energy change lies within `band` of log u may go
// either way: fp32's energies (H ~ 100) carry ~1e-5 nat of rounding, so band = 1e-3; bf16's up to 0.19
// nat (measured, H200), so band = 0.2. Such a chain is left out (log u has density <= 1 per nat, so at
// most 2 band of the tests come that close: with three tests a chain, fp32 keeps >= 99% of the chains
// and bf16 >= 21%; 90% and 20% are required). Every other chain must take the same decisions (its count
// of accepted transitions; a different order would show in z) and match in log w, the final z and the
// last trajectory's end (z, p), relative to the largest reference value. fp32: 1e-5 on log w (as
// test_vae's trajectory check against PyTorch float64), 1e-4 on z and p (grad's ~1e-6 relative error
// enters p at each of the L + 1 kicks of step x |grad U| (~5), ~1e-5 of |p| after L = 10, and the
// dynamics amplify it). bf16: 2e-3 on log w (a weighted mean of energies, whose error was at most 0.19
// nat of ~100) and 5e-2 on z and p (grad's few 1e-3 through the same kicks). A chain whose float32
// sums never put a value on the other side of a bf16 rounding boundary matches the rounded reference as
// fp32 does (one chain: 2.1e-6 at its trajectory's end); one value that lands the other way (~2^-24 /
// 2^-9 of the ~1,600 rounded values an evaluation) moves z, and with it more values across boundaries:
// the ends of 592 chains came up to 1.4e-2 apart (against plain float64 8.1e-2, over the 5e-2). Every
// written chain, compared or not, must have a finite log w and z. The last energy change's error is
// printed in nats: the measured width behind `band`. Then each variant's time per unit at rows_timed
// chains, evaluations/s, TFLOP/s, and --ais 1000.
inline bool run_ais_chain_driver(const std::vector<Variant<AisIO>>& variants, VAE* m, const HostWeights* w,
                                 const Images* images, const AisChainDriver& d, int images_timed) {
    const Precision p = m->precision;
    const int max_images = std::max(images_timed, *std::max_element(d.check_images.begin(), d.check_images.end()));
    const size_t max_rows = (size_t)max_images * d.C;
    if (max_images > m->max_batch || max_images > images->count)
        fail("internal: %d images for the chain driver, the model holds %d", max_images, m->max_batch);
    const float step = AIS_STEP_START;
    const uint64_t seed = 7;
    uint8_t* d_pixels = device_upload(std::vector<uint8_t>(images->pixels,
                                                           images->pixels + (size_t)max_images * INPUT_DIM));
    vae_encode(m, d_pixels, max_images);
    cudaCheck(cudaStreamSynchronize(m->stream));
    const std::vector<float> mulv = copy_to_host_float(m->mulv, (size_t)max_images * MULV_DIM);
    float* d_mulv = device_upload(mulv);
    double *d_beta = device_upload(d.beta), *d_log_w;
    int* d_accepted;
    float *d_step, *d_z, *d_proposal, *d_delta_h;
    cudaCheck(cudaMalloc(&d_log_w, max_rows * sizeof(double)));
    cudaCheck(cudaMalloc(&d_accepted, max_rows * sizeof(int)));
    cudaCheck(cudaMalloc(&d_step, max_images * sizeof(float)));
    cudaCheck(cudaMalloc(&d_z, max_rows * LATENT_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_proposal, max_rows * 2 * LATENT_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_delta_h, max_rows * sizeof(float)));
    auto io_for = [&](int n, int T) {
        AisIO io = {};
        io.pixels = d_pixels, io.mulv = d_mulv, io.beta = d_beta, io.n = n, io.chains = d.C, io.T = T;
        io.leapfrog = d.L, io.seed = seed, io.adapt = false, io.step0 = step, io.log_w = d_log_w;
        io.accepted = d_accepted, io.step_out = d_step, io.z_out = d_z, io.proposal = d_proposal;
        io.delta_h = d_delta_h;
        return io;
    };
    const bool fp32 = p == PRECISION_FP32;
    const double tol_w = fp32 ? 1e-5 : 2e-3, tol_zp = fp32 ? 1e-4 : 5e-2, band = fp32 ? 1e-3 : 0.2;
    const double min_compared = fp32 ? 0.9 : 0.2;
    const AisBf16Weights bf16 = fp32 ? AisBf16Weights{} : ais_bf16_weights(w);
    printf("%s, %s: T = %d, C = %d, L = %d, step %.2f, against float64%s\n", d.name, PRECISION_NAMES[p], d.T, d.C,
           d.L, step, fp32 ? "" : " with the bf16 path's roundings");
    bool ok = true;
    for (int n : d.check_images) {
        const size_t rows = (size_t)n * d.C;
        std::vector<double> ref_w(rows), ref_z(rows * LATENT_DIM), ref_prop(rows * 2 * LATENT_DIM);
        std::vector<double> ref_margin(rows), ref_dh(rows);
        std::vector<int> ref_acc(rows);
        for (int i = 0; i < n; i++) {
            const CpuAisImage r = cpu_ais_image(w, images->pixels + (size_t)i * INPUT_DIM, &mulv[(size_t)i * MULV_DIM],
                                                d.beta.data(), d.T, d.C, d.L, i, seed, step, false,
                                                fp32 ? nullptr : &bf16);
            std::copy(r.log_w.begin(), r.log_w.end(), &ref_w[(size_t)i * d.C]);
            std::copy(r.z.begin(), r.z.end(), &ref_z[(size_t)i * d.C * LATENT_DIM]);
            std::copy(r.proposal.begin(), r.proposal.end(), &ref_prop[(size_t)i * d.C * 2 * LATENT_DIM]);
            std::copy(r.accepted.begin(), r.accepted.end(), &ref_acc[(size_t)i * d.C]);
            std::copy(r.margin.begin(), r.margin.end(), &ref_margin[(size_t)i * d.C]);
            std::copy(r.delta_h.begin(), r.delta_h.end(), &ref_dh[(size_t)i * d.C]);
        }
        for (const auto& v : variants) {
            poison(d_log_w, rows * sizeof(double)), poison(d_accepted, rows * sizeof(int));
            poison(d_z, rows * LATENT_DIM * sizeof(float)), poison(d_proposal, rows * 2 * LATENT_DIM * sizeof(float));
            poison(d_delta_h, rows * sizeof(float));
            v.second(io_for(n, d.T));
            cudaCheck(cudaGetLastError()), cudaCheck(cudaDeviceSynchronize());
            std::vector<double> log_w(rows);
            std::vector<int> acc(rows);
            cudaCheck(cudaMemcpy(log_w.data(), d_log_w, rows * sizeof(double), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(acc.data(), d_accepted, rows * sizeof(int), cudaMemcpyDeviceToHost));
            const std::vector<float> z = copy_to_host_float(d_z, rows * LATENT_DIM);
            const std::vector<float> prop = copy_to_host_float(d_proposal, rows * 2 * LATENT_DIM);
            const std::vector<float> dh = copy_to_host_float(d_delta_h, rows);
            // a value not finite on either side fails (std::max would skip a NaN)
            double diff[4] = {}, top[4] = {}; // log w, z, the trajectory's end, the last energy change (absolute)
            auto compare = [&](int k, double got, double ref) {
                diff[k] = std::isfinite(got) && std::isfinite(ref) ? std::max(diff[k], std::fabs(got - ref)) : INFINITY;
                top[k] = std::max(top[k], std::fabs(ref));
            };
            size_t unwritten = 0, near = 0, differ = 0;
            for (size_t r = 0; r < rows; r++) {
                bool finite = std::isfinite(log_w[r]);
                for (int j = 0; j < LATENT_DIM; j++) finite = finite && std::isfinite(z[r * LATENT_DIM + j]);
                if (acc[r] < 0 || acc[r] > d.T - 1 || !finite) { // NaN-poisoned (0xFFFFFFFF), or not finite
                    unwritten++;
                    continue;
                }
                if (!(ref_margin[r] >= band)) { // a test this close may go either way
                    near++;
                    continue;
                }
                if (acc[r] != ref_acc[r]) {
                    differ++;
                    continue;
                }
                compare(0, log_w[r], ref_w[r]);
                for (int j = 0; j < LATENT_DIM; j++) compare(1, z[r * LATENT_DIM + j], ref_z[r * LATENT_DIM + j]);
                for (int j = 0; j < 2 * LATENT_DIM; j++)
                    compare(2, prop[r * 2 * LATENT_DIM + j], ref_prop[r * 2 * LATENT_DIM + j]);
                compare(3, dh[r], ref_dh[r]);
            }
            const double e_w = diff[0] / top[0], e_z = diff[1] / top[1], e_p = diff[2] / top[2];
            const size_t compared = rows - unwritten - near - differ;
            const bool good = unwritten == 0 && differ == 0 && compared >= min_compared * rows && e_w <= tol_w &&
                              e_z <= tol_zp && e_p <= tol_zp && std::isfinite(diff[3]);
            printf("check %-16s images %4d: %5zu of %5zu chains compared (%zu near a threshold), %zu decide otherwise, "
                   "%zu unwritten or not finite; log w %.2e (%.0e), z %.2e, trajectory end (z, p) %.2e (%.0e); last "
                   "energy change off by %.2e nats %s\n", v.first, n, compared, rows, near, differ, unwritten, e_w,
                   tol_w, e_z, e_p, tol_zp, diff[3], good ? "OK" : "FAIL");
            ok = ok && good;
        }
    }
    if (ok) {
        const size_t rows_timed = (size_t)images_timed * d.C;
        const int extra = 20, T_timed = 2 + (d.per_transition ? extra : 0);
        std::vector<double> beta(T_timed + 1);
        ais_schedule(beta.data(), T_timed);
        cudaCheck(cudaFree(d_beta));
        d_beta = device_upload(beta); // both launches' (T = 2 reads b_0 .. b_2 of T = 22's: the cost is the same)
        printf("%-28s %8s %18s %14s %10s %8s %14s\n", "variant", "chains",
               d.per_transition ? "us / transition" : "us / leapfrog step", "evals / s", "TFLOP/s", "% floor",
               "--ais 1000 (s)");
        for (const auto& v : variants) {
            float us[2];
            for (int i = 0; i < 2; i++) {
                AisIO io = io_for(images_timed, d.per_transition ? 2 + i * extra : 2);
                if (!d.per_transition) io.leapfrog = 1 + i * extra;
                us[i] = benchmark_us([&] { v.second(io); }, 5, 1, false);
            }
            const double per_unit = (us[1] - us[0]) / extra;
            const double evals_per_s = rows_timed * (d.per_transition ? d.L : 1) / (per_unit * 1e-6);
            const double tflops = evals_per_s * AIS_FLOPS_PER_EVAL * 1e-12;
            // --ais 1000 over the test set: 10000 images x 16 chains x 999 transitions of 10 evaluations
            printf("%-28s %8zu %18.2f %14.3e %10.1f %7.1f%% %14.2f\n", v.first, rows_timed, per_unit, evals_per_s,
                   tflops, 100.0 * tflops / 770.0, 1.6e9 / evals_per_s);
        }
    }
    void* buffers[] = {d_pixels, d_mulv, d_beta, d_log_w, d_accepted, d_step, d_z, d_proposal, d_delta_h};
    for (void* b : buffers) cudaCheck(cudaFree(b));
    return ok;
}

}  // namespace vae
