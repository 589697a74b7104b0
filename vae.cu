/*
vae.cu: a pretrained MNIST variational autoencoder, evaluated and sampled on the GPU.

The model (Kingma & Welling, as in the PyTorch examples), PyTorch Linear layout W[out][in]:
    encoder   h1 = ReLU(fc1 x)              784 -> 400
              mu = fc21 h1, logvar = fc22 h1 400 -> 20 each (computed as one 40-wide layer)
    sampling  z = mu + eps * exp(logvar / 2), eps ~ N(0, I)
    decoder   h3 = ReLU(fc3 z)              20 -> 400
              logits = fc4 h3, recon = sigmoid(logits)   400 -> 784
    loss      BCE(recon, x) summed over pixels + KL(q(z|x) || N(0, I)), per image

Build and run (make vae also prepares data/ when it is missing):
    make vae && ./vae                 evaluate the MNIST test set, write three images
    ./vae -h                          all options

Two engines run the model. The plain path, which a reader meets first, runs every mode on any GPU from sm_75 (T4) on:
the four layers are cuBLASLt matmuls and a few short kernels do the rest. The Hopper engine (wgmma, TMA, thread-block
clusters) is picked at start where it runs (--kernels). The file reads top to bottom in '// ----' sections; main comes
last but for the appendix, the Hopper engine. test_vae.cu defines TESTING, which leaves out the modes and main.
*/
#include <cuda.h> // CUtensorMap and its enums only: the encoder comes through the runtime, no -lcuda
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cublasLt.h>
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#include <unistd.h>
#include <zlib.h> // -d reads MNIST's idx files as shipped, gzipped

// ---- utilities ------------------------------------------------------------------------------------------------------
// The file and CLI parsers return their errors, so the tests can feed them broken input; the program prints and exits.
typedef struct { char msg[512]; } Error;
static bool set_error(Error* err, const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(err->msg, sizeof(err->msg), fmt, args);
    va_end(args);
    return false;
}

// Each GPU's thread names it here. The first failure ends the run in one line (quick_exit: exit would tear CUDA down).
static thread_local char failing_gpu[320] = "";
static std::atomic<bool> failed{false};
[[noreturn]] static void fail(const char* fmt, ...) {
    if (failed.exchange(true))
        for (;;) pause(); // another thread is failing: its line is the one, and its exit ends this thread too
    va_list args;
    va_start(args, fmt);
    fprintf(stderr, "vae: error: %s", failing_gpu);
    vfprintf(stderr, fmt, args);
    fprintf(stderr, "\n");
    va_end(args);
    if (failing_gpu[0] == '\0') exit(EXIT_FAILURE);
    fflush(stdout);
    quick_exit(EXIT_FAILURE);
}

static void cuda_check(cudaError_t status, const char* file, int line) {
    if (status != cudaSuccess) fail("CUDA: %s at %s:%d", cudaGetErrorString(status), file, line);
}

#define cudaCheck(call) cuda_check((call), __FILE__, __LINE__)
__host__ __device__ inline int ceil_div(int a, int b) { return (a + b - 1) / b; }
#ifndef VAE_PYTHON
#define VAE_PYTHON "python3" // the Makefile passes the Python it found with numpy
#endif
#define PREPARE_HINT "HINT: run 'make data'"
#define CHECKPOINT_HINT                                                                                                \
    "HINT: convert a PyTorch checkpoint of the VAE: " VAE_PYTHON " prepare_weights.py --checkpoint FILE"
#define WEIGHTS_HINT                                                                                                   \
    "HINT: 'make data' writes data/vae_weights.bin; a checkpoint of your own converts with " VAE_PYTHON                \
    " prepare_weights.py --checkpoint FILE"
#define MAX_FILE_BYTES (1ull << 30) // no input of this model comes near 1 GiB
static int32_t read_le32(const uint8_t* p) { return (int32_t)(p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24); }
static uint32_t read_be32(const uint8_t* p) { return (uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]; }

// A gzipped idx file, inflated to at most its header's promised size + 1: a gzip bomb is refused there, not at 1 GiB.
static bool gunzip_idx(const char* path, const uint8_t* in, size_t in_size, uint8_t** out, size_t* out_size,
                       Error* err) {
    z_stream zs = {};
    if (inflateInit2(&zs, 16 + MAX_WBITS) != Z_OK) return set_error(err, "%s: zlib did not start", path); // +16: gzip
    uint8_t head[16];
    zs.next_in = (Bytef*)in, zs.avail_in = (uInt)in_size; // in_size <= MAX_FILE_BYTES
    zs.next_out = head, zs.avail_out = sizeof(head);
    int status = inflate(&zs, Z_NO_FLUSH);
    const size_t head_size = sizeof(head) - zs.avail_out;
    const int dims = head_size >= 4 ? head[3] : 0;
    const bool idx = dims >= 1 && dims <= 3 && head_size >= 4 + 4u * dims;
    unsigned long long promise = head_size;
    for (int d = 0; idx && d < dims; d++)
        promise = std::min((d == 0 ? 1 : promise) * read_be32(head + 4 + 4 * d), MAX_FILE_BYTES);
    if (idx) promise = std::min(promise + 4 + 4 * dims, MAX_FILE_BYTES);
    // deflate packs at most ~1032:1: no buffer beyond what the stream can fill, nor below what is inflated
    promise = std::max<unsigned long long>(std::min(promise, 1032ull * in_size + 64), head_size);
    *out = (uint8_t*)malloc(promise + 1);
    if (*out == NULL) return inflateEnd(&zs), set_error(err, "%s: out of host memory for %llu bytes", path, promise);
    memcpy(*out, head, head_size);
    zs.next_out = *out + head_size, zs.avail_out = (uInt)(promise + 1 - head_size);
    if (status == Z_OK) status = inflate(&zs, Z_FINISH);
    *out_size = promise + 1 - zs.avail_out;
    const char* why = status != Z_STREAM_END && zs.avail_out == 0
                          ? (idx ? "it expands past the size its idx header promises" : "it holds no idx header")
                      : status != Z_STREAM_END ? (zs.msg ? zs.msg : "the gzip stream is cut short")
                      : zs.avail_in > 0        ? "bytes follow its gzip stream"
                                               : NULL;
    inflateEnd(&zs);
    if (why == NULL) return true;
    free(*out), *out = NULL;
    return set_error(err, "%s: not a whole gzip file of an idx file (%s). HINT: fetch it again, or run 'make data'",
                     path, why);
}

static bool read_file(const char* path, uint8_t** data, size_t* size, Error* err,
                      const char* missing_hint = PREPARE_HINT) {
    struct stat st;
    if (stat(path, &st) != 0) return set_error(err, "%s: %s. %s", path, strerror(errno), missing_hint);
    if (!S_ISREG(st.st_mode))
        return set_error(err, "%s: not a regular file. HINT: pass the path of the file itself", path);
    if ((unsigned long long)st.st_size > MAX_FILE_BYTES)
        return set_error(err, "%s: %lld bytes is far larger than any input of this model. HINT: check the path",
                         path, (long long)st.st_size);
    FILE* f = fopen(path, "rb");
    if (f == NULL) return set_error(err, "%s: %s. HINT: check the file's permissions", path, strerror(errno));
    *size = (size_t)st.st_size, *data = (uint8_t*)malloc(*size > 0 ? *size : 1);
    if (*data == NULL) return fclose(f), set_error(err, "%s: out of host memory reading %zu bytes", path, *size);
    size_t got = fread(*data, 1, *size, f);
    fclose(f);
    if (got != *size) {
        free(*data), *data = NULL;
        return set_error(err, "%s: read %zu of %zu bytes. HINT: check the disk and the file", path, got, *size);
    }
    const size_t length = strlen(path);
    if (length < 3 || strcmp(path + length - 3, ".gz") != 0) return true;
    uint8_t* packed = *data;
    const bool ok = gunzip_idx(path, packed, *size, data, size, err);
    free(packed);
    return ok;
}

enum { MAX_OUTPUTS = 8, MAX_PATH = 4096 }; // outputs go to temporary names, renamed when the run succeeds
static struct { char final_path[MAX_PATH], temp_path[MAX_PATH + 8], what[128]; } pending_outputs[MAX_OUTPUTS];
static int num_pending_outputs = 0;

static char created_dir[MAX_PATH] = "";
static int created_levels = 0; // how many of created_dir's last components this run made (mkdir -p)
static void outputs_discard() {
    for (int i = 0; i < num_pending_outputs; i++) remove(pending_outputs[i].temp_path);
    num_pending_outputs = 0;
    for (; created_levels > 0; created_levels--) { // deepest first, each only if empty: nothing of anyone else's goes
        rmdir(created_dir);
        char* slash = strrchr(created_dir, '/'); // output_dir_make left no '/' at the end
        if (slash == NULL) break;
        *slash = '\0';
    }
    created_levels = 0;
}

static void discard_outputs_at_exit() {
    static bool registered = false;
    if (!registered) registered = atexit(outputs_discard) == 0 && at_quick_exit(outputs_discard) == 0;
}

static bool output_dir_make(const char* dir, Error* err) {
    discard_outputs_at_exit();
    snprintf(created_dir, sizeof(created_dir), "%s", dir);
    for (size_t n = strlen(created_dir); n > 1 && created_dir[n - 1] == '/'; n--) created_dir[n - 1] = '\0';
    for (char* slash = created_dir + 1;; slash++) { // each ancestor, then the folder itself
        slash = strchr(slash, '/');
        if (slash != NULL) *slash = '\0';
        if (mkdir(created_dir, 0777) == 0) created_levels++;
        else if (errno != EEXIST)
            return set_error(err, "%s: cannot create the folder (%s). HINT: pass -o with a writable folder",
                             created_dir, strerror(errno));
        if (slash == NULL) return true;
        *slash = '/';
    }
}

static FILE* output_open(const char* path, const char* what) {
    discard_outputs_at_exit();
    if (num_pending_outputs == MAX_OUTPUTS || strlen(path) >= MAX_PATH) {
        errno = ENAMETOOLONG;
        return NULL;
    }
    char* temp = pending_outputs[num_pending_outputs].temp_path;
    snprintf(pending_outputs[num_pending_outputs].final_path, MAX_PATH, "%s", path);
    snprintf(temp, MAX_PATH + 8, "%s.XXXXXX", path);
    snprintf(pending_outputs[num_pending_outputs].what, sizeof(pending_outputs[0].what), "%s", what);
    const int fd = mkstemp(temp);
    if (fd < 0) return NULL;
    num_pending_outputs++; // from here on an exit removes it
    const mode_t mask = umask(0);
    umask(mask);
    FILE* f = fchmod(fd, 0666 & ~mask) == 0 ? fdopen(fd, "wb") : NULL;
    if (f == NULL) close(fd);
    return f;
}

static bool outputs_commit(Error* err, FILE* report) {
    for (int i = 0; i < num_pending_outputs; i++) {
        if (rename(pending_outputs[i].temp_path, pending_outputs[i].final_path) != 0)
            return set_error(err, "%s: cannot move %s into place (%s). HINT: check the folder's permissions",
                             pending_outputs[i].final_path, pending_outputs[i].temp_path, strerror(errno));
        if (report != NULL) fprintf(report, "wrote %s (%s)\n", pending_outputs[i].final_path, pending_outputs[i].what);
    }
    num_pending_outputs = 0, created_levels = 0;
    return true;
}

// ---- the model's shapes, and its weights as the file formats section reads them -------------------------------------
// PyTorch's VAE example, 784-H1-Z-H3; the fused kernels are built for the published 784-400-20-400 alone.
enum { INPUT_DIM = 784, HIDDEN_DIM = 400, LATENT_DIM = 20, IMAGE_SIDE = 28, MULV_DIM = 2 * LATENT_DIM };
enum { MAX_HIDDEN = 4096, MAX_LATENT = 64 }; // the bounds of H1, H3 and Z, as prepare_weights.py --checkpoint's
typedef struct { int h1, z, h3; } ModelDims;
static const ModelDims PUBLISHED_DIMS = {HIDDEN_DIM, LATENT_DIM, HIDDEN_DIM};
static bool is_published(ModelDims d) {
    return d.h1 == PUBLISHED_DIMS.h1 && d.z == PUBLISHED_DIMS.z && d.h3 == PUBLISHED_DIMS.h3;
}

typedef enum { PRECISION_FP32, PRECISION_BF16 } Precision; // fp32 within 1e-5 of float64; bf16 16-bit operands
enum { HEADER_INTS = 256, WEIGHTS_MAGIC = 0x31454156 /* "VAE1" */, WEIGHTS_VERSION = 2, DTYPE_FLOAT32 = 1 };

enum { FC1_W, FC1_B, FC21_W, FC21_B, FC22_W, FC22_B, FC3_W, FC3_B, FC4_W, FC4_B, NUM_TENSORS }; // in file order
static size_t tensor_size(ModelDims d, int t) {
    const size_t sizes[NUM_TENSORS] = {(size_t)d.h1 * INPUT_DIM, (size_t)d.h1, (size_t)d.z * d.h1, (size_t)d.z,
                                       (size_t)d.z * d.h1,       (size_t)d.z,  (size_t)d.h3 * d.z, (size_t)d.h3,
                                       (size_t)INPUT_DIM * d.h3, INPUT_DIM};
    return sizes[t];
}

static const char* TENSOR_NAMES[NUM_TENSORS] = {"fc1.weight", "fc1.bias", "fc21.weight", "fc21.bias", "fc22.weight",
                                                "fc22.bias", "fc3.weight", "fc3.bias", "fc4.weight", "fc4.bias"};
typedef struct {
    float* data; // all tensors back to back, in file order
    const float* tensor[NUM_TENSORS];
    size_t size[NUM_TENSORS], count; // each tensor's floats, and all of them
    ModelDims dims;
} HostWeights;

typedef struct {
    uint64_t seed;
    bool z_is_mu;    // z = mu (no noise): the deterministic reconstruction
    bool want_recon; // also write recon = sigmoid(logits)
} ForwardOptions;

// The tests' hooks (VAE::probe; zero in the program), device arrays a row per image or chain: noise given, what's kept.
typedef struct {
    const float* eps;            // [rows][Z]: the forward pass's or --iwae's noise, or NULL: the generator's
    bool keep_activations;       // the forward pass also writes mulv, z and logits (fp32: h1 and h3)
    bool fixed_step;             // AIS keeps its first step size
    const float* p_start;        // AIS: [rows][Z] the first transition's momentum, or NULL: drawn
    float *z_out, *grad0, *bce0; // AIS: [rows][Z] the final z; the first evaluation's grad BCE [rows][Z] and BCE [rows]
    float *delta_h, *proposal;   // AIS: the last H0 - H1 [rows]; the last trajectory's end (z, p) before its test
} Probe;

// ---- random numbers -------------------------------------------------------------------------------------------------
// Philox4x32-10 (Salmon et al. 2011), counter-based: a draw is a pure function of its keys, whatever the batch.
__host__ __device__ inline uint32_t mulhi32(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return (uint32_t)(((uint64_t)a * b) >> 32);
#endif
}

__host__ __device__ inline uint4 philox4x32(uint4 c, uint2 k) {
    for (int round = 0; round < 10; round++) {
        uint32_t hi0 = mulhi32(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        uint32_t hi1 = mulhi32(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
        k.x += 0x9E3779B9u, k.y += 0xBB67AE85u;
    }
    return c;
}

enum { STREAM_POSTERIOR = 0, STREAM_PRIOR = 1, STREAM_MOMENTUM = 2, STREAM_ACCEPT = 3, STREAM_SIMULATE = 4 };

__host__ __device__ inline float2 box_muller(uint32_t word1, uint32_t word2) {
    const float u1 = ((word1 >> 8) + 1) * (1.0f / 16777216.0f); // (0, 1]: log stays finite
    const float u2 = (word2 >> 8) * (1.0f / 16777216.0f);       // [0, 1)
    const float radius = sqrtf(-2.0f * logf(u1));
    float sine, cosine;
#ifdef __CUDA_ARCH__
    sincospif(2.0f * u2, &sine, &cosine); // no large-argument reduction path (and its stack) on the device
#else
    sine = sinf(6.283185307f * u2), cosine = cosf(6.283185307f * u2);
#endif
    return make_float2(radius * cosine, radius * sine);
}

// Keyed by (seed, stream, image, row: a sample or chain, counter: a latent group, or momentum_counter's).
__host__ __device__ inline uint4 philox_keyed(uint64_t seed, uint32_t stream, uint32_t image, uint32_t row,
                                              uint32_t counter) {
    return philox4x32(make_uint4(counter, image, row, stream), make_uint2((uint32_t)seed, (uint32_t)(seed >> 32)));
}

__host__ __device__ inline float4 gaussian4(uint64_t seed, uint32_t stream, uint32_t image, uint32_t sample,
                                            uint32_t group) {
    const uint4 r = philox_keyed(seed, stream, image, sample, group);
    const float2 a = box_muller(r.x, r.y), b = box_muller(r.z, r.w);
    return make_float4(a.x, a.y, b.x, b.y);
}

__host__ __device__ inline float gaussian(uint64_t seed, uint32_t stream, uint32_t image, uint32_t sample,
                                          uint32_t latent) {
    const float4 g = gaussian4(seed, stream, image, sample, latent / 4);
    const uint32_t i = latent % 4;
    return i == 0 ? g.x : i == 1 ? g.y : i == 2 ? g.z : g.w;
}

__host__ __device__ inline float2 gaussian_pair(uint64_t seed, uint32_t stream, uint32_t image, uint32_t chain,
                                                uint32_t counter) {
    const uint4 r = philox_keyed(seed, stream, image, chain, counter);
    return box_muller(r.x, r.y);
}

// Transition s's counter of latent pair j / 2: 16 pairs a transition, 32 for a Z above 32.
__host__ __device__ inline uint32_t momentum_counter(int s, int j, int z) { return (z <= 32 ? 16 : 32) * s + j / 2; }
static_assert(MAX_LATENT <= 64, "momentum_counter's 32 pairs a transition hold every latent");
__host__ __device__ inline float uniform_open0(uint64_t seed, uint32_t stream, uint32_t image, uint32_t chain,
                                               uint32_t counter) {
    return ((philox_keyed(seed, stream, image, chain, counter).x >> 8) + 1) * (1.0f / 16777216.0f);
}

// ---- the plain path, part 1: the short kernels for what cuBLAS does not do ------------------------------------------
// Every mode on any GPU from sm_75 on: cuBLASLt's matmuls (part 2) and these kernels, a thread a row or four elements.
// Activations are row-major [row][feature] in T: float (fp32's large products reading fp16 parts of them), or bf16 for
// the matmuls' inputs, with fp32 wherever a value is summed or compared. A row is a pure function of its image and
// noise, in any batch.

// z_j = mu_j + eps_j exp(logvar_j / 2), and its term 1 + logvar_j - mu_j^2 - exp(logvar_j) of KL = -1/2 sum_j term_j.
__device__ inline float latent_z(float mu, float logvar, float eps, float* kl_term) {
    *kl_term = 1.0f + logvar - mu * mu - expf(logvar);
    return mu + eps * expf(0.5f * logvar);
}

__device__ inline float4 posterior_eps(const float* eps_row, int q, int nz, uint32_t image, uint32_t sample,
                                       uint64_t seed, bool z_is_mu) {
    if (z_is_mu) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (eps_row == NULL) return gaussian4(seed, STREAM_POSTERIOR, image, sample, q);
    float e[4];
    for (int i = 0; i < 4; i++) e[i] = 4 * q + i < nz ? eps_row[4 * q + i] : 0.0f;
    return make_float4(e[0], e[1], e[2], e[3]);
}

// Latents on the line between two images' means: row r (from first_row) is step r % steps of pair r / steps.
__global__ void interp_latents_kernel(float* z, const float* mulv, const int2* pairs, long long first_row, int rows,
                                      int steps, int nz) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * nz) return;
    const long long row = first_row + i / nz;
    const int j = i % nz, step = (int)(row % steps);
    const int2 pair = pairs[row / steps];
    const float t = (float)step / (float)(steps - 1);
    z[i] = (1.0f - t) * mulv[pair.x * 2 * nz + j] + t * mulv[pair.y * 2 * nz + j];
}

typedef __nv_bfloat16 bf16;
typedef __half fp16;

__device__ inline void store_as(float* p, float v) { *p = v; }
__device__ inline void store_as(bf16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ inline void store_as(fp16* p, float v) { *p = __float2half_rn(v); }
__device__ inline float as_float(float v) { return v; }
__device__ inline float as_float(bf16 v) { return __bfloat162float(v); }
__device__ inline float as_float(fp16 v) { return __half2float(v); }

template <typename T, int N> struct alignas(N * sizeof(T)) Pack { T v[N]; }; // one access of N values
template <typename T> using Four = Pack<T, 4>;

// fc3's bias rides in K (ones in z's row); bf16 in hi and lo parts (dev/NOTES.md, 'fc3 in parts (plain path)'):
//   fp32  [z | 1 | 0 0 0]                       against  [W3 | b3 | 0 0 0]
//   bf16  [zh | 1 1 1 | 0] [zl | 0] [zh | 0]    against  [W3h | b3's three parts | 0] [W3h | 0] [W3l | 0]
__host__ __device__ constexpr int z_pad(int nz) { return (nz + 3 + 3) / 4 * 4; } // z, three ones, whole fours
template <typename T> __host__ __device__ constexpr int z_parts() { return std::is_same<T, bf16>::value ? 3 : 1; }
__host__ __device__ constexpr int z_width(Precision p, int nz) { return z_pad(nz) * (p == PRECISION_BF16 ? 3 : 1); }

// A row's latents in registers, arrays of compile-time length ZMAX, the first nz used (LATENT_DIM's loops: no tests).
template <int ZMAX> __host__ __device__ constexpr int latents(int nz) { return ZMAX == LATENT_DIM ? LATENT_DIM : nz; }

// AIS's loops over latents: unrolled in the published instance (arrays in registers), not in MAX_LATENT's (they spill).
#define VAE_PRAGMA(...) _Pragma(#__VA_ARGS__)
#define UNROLL_LATENTS(trips) VAE_PRAGMA(unroll(ZMAX == LATENT_DIM ? (trips) : 1))
// Part p of v in the 16-bit type T: 0 its T value, 1 that of what it leaves, 2 of what both leave (remainders exact).
template <typename T> __device__ inline T split_part(float v, int p) {
    T part;
    for (int q = 0; q < p; q++) store_as(&part, v), v -= as_float(part);
    store_as(&part, v);
    return part;
}

__device__ inline float bf16_part(float v, int p) { return as_float(split_part<bf16>(v, p)); }

template <typename T, int ZMAX> __device__ inline void store_z_input(T* row, const float (&z)[ZMAX], int nz) {
    constexpr int PARTS = z_parts<T>();
    const int pad = z_pad(nz);
    for (int part = 0; part < PARTS; part++) {
        #pragma unroll
        for (int g = 0; g < z_pad(ZMAX) / 4; g++) {
            if (4 * g >= pad) break;
            Four<T> out;
            for (int i = 0; i < 4; i++) {
                const int k = 4 * g + i;
                const float v = k < ZMAX && k < nz ? z[k < ZMAX ? k : 0] : 0.0f, hi = PARTS == 1 ? v : bf16_part(v, 0);
                const float ones = part == 0 && k >= nz && k < nz + PARTS ? 1.0f : 0.0f;
                store_as(&out.v[i], k >= nz ? ones : part == 1 ? bf16_part(v, 1) : hi);
            }
            reinterpret_cast<Four<T>*>(row + part * pad)[g] = out;
        }
    }
}

// fc3's rows [H3][z_width] as above: [W3 | b3 | 0] in T, or bf16's blocks of parts.
template <typename T>
__global__ void fc3_weights_kernel(T* dst, const float* __restrict__ w3, const float* __restrict__ b3, int h3, int nz) {
    const int pad = z_pad(nz), width = pad * z_parts<T>(), i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= h3 * width) return;
    const int n = i / width, block = i % width / pad, k = i % pad, bias_parts = z_parts<T>();
    const bool parts = std::is_same<T, bf16>::value;
    float v = 0.0f;
    if (k < nz) v = parts ? bf16_part(w3[n * nz + k], block == 2) : w3[n * nz + k];
    else if (block == 0 && k < nz + bias_parts) v = parts ? bf16_part(b3[n], k - nz) : b3[n];
    store_as(&dst[i], v);
}

template <typename T> struct Backward { typedef T type; }; // AIS's backward's type
template <typename T> constexpr bool on_parts() { return std::is_same<T, float>::value; } // fp32 runs fp16 parts
template <> struct Backward<bf16> { typedef fp16 type; }; // 11 bits: the gradient 2.3e-3 of its scale off float64
static_assert(sizeof(Backward<bf16>::type) == sizeof(bf16), "the backward's buffers are sized in T");

// The pixels, exact in T, as fc1's input (its alpha = 1/255 scales them), four a thread (one a thread: 4x the time);
// `copies` of each row side by side (fp32's fc1 on fp16 parts reads [x | x], below).
template <typename T> __global__ void pixels_to_input_kernel(T* x, const uint8_t* pixels, long long n, int copies) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * i >= n) return;
    const Four<uint8_t> px = reinterpret_cast<const Four<uint8_t>*>(pixels)[i];
    Four<T> v;
    for (int k = 0; k < 4; k++) store_as(&v.v[k], (float)px.v[k]);
    const long long row = 4 * i / INPUT_DIM, col = 4 * i % INPUT_DIM;
    for (int c = 0; c < copies; c++) reinterpret_cast<Four<T>*>(x + (row * copies + c) * INPUT_DIM + col)[0] = v;
}

// fp32's large products (fc1, fc4, AIS's fc4 backward) run on the tensor cores in fp16 parts, as the fused kernels do
// (dev/NOTES.md, 'fp32 on fp16 parts'): hi = fp16(v) and lo = fp16(v - hi) carry 22 of fp32's 24 bits, and a w =
// a_lo w_hi + a_hi w_lo + a_hi w_hi (a_lo w_lo is 2^-22 of it) is one product three times as long, with fp32 sums: an
// activation's row [lo | hi | hi] against the weights' [hi | lo | hi]; exact pixels drop the first block ([x | x]
// against [lo | hi]). Every value must stay below fp16's 65,504.
enum { FP16_PARTS = 3 };
__host__ __device__ constexpr int activation_part(int block) { return block == 0 ? 1 : 0; }
__host__ __device__ constexpr int weight_part(int block) { return block == 1 ? 1 : 0; }

// src[rows][cols] as fp16 parts, each row's blocks first_block .. 2 side by side (h3; fc1's and fc4's weights); with
// rows = 1 a whole matrix's blocks follow one another (fc4's backward stacks W4's along its K).
template <bool WEIGHTS>
__global__ void fp16_parts_kernel(fp16* dst, const float* __restrict__ src, long long rows, long long cols,
                                  int first_block) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    const long long r = i / cols, c = i % cols, blocks = FP16_PARTS - first_block;
    const float v = src[i];
    for (int b = first_block; b < FP16_PARTS; b++) {
        const int part = WEIGHTS ? weight_part(b) : activation_part(b);
        dst[(r * blocks + b - first_block) * cols + c] = split_part<fp16>(v, part);
    }
}

// Both engines' z = mu + sigma eps of sample `sample` of an image (sample 0: the ELBO's draw), its KL, and log p(z) -
// log q(z|x) = sum_j (eps_j^2 + logvar_j - z_j^2) / 2 (the log(2 pi) cancel), summed over j in order.
template <int ZMAX>
__device__ inline void sample_latents(float (&z)[ZMAX], int nz, float* kl, float* log_ratio, const float* mulv_row,
                                      const float* eps_row, uint32_t image, uint32_t sample, uint64_t seed,
                                      bool z_is_mu) {
    float kl_sum = 0.0f, ratio = 0.0f;
    #pragma unroll
    for (int q = 0; q < (ZMAX + 3) / 4; q++) {
        if (4 * q >= nz) break;
        const float4 e = posterior_eps(eps_row, q, nz, image, sample, seed, z_is_mu);
        const float eps[4] = {e.x, e.y, e.z, e.w};
        for (int i = 0; i < 4 && 4 * q + i < ZMAX; i++) {
            const int j = 4 * q + i;
            if (j >= nz) break;
            float kl_term;
            z[j] = latent_z(mulv_row[j], mulv_row[nz + j], eps[i], &kl_term);
            kl_sum += kl_term, ratio += eps[i] * eps[i] + mulv_row[nz + j] - z[j] * z[j];
        }
    }
    *kl = -0.5f * kl_sum, *log_ratio = 0.5f * ratio;
}

// fc3's inputs, row r sample r % K of image r / K (the ELBO: K = 1). kl, log_ratio, z_out NULL: not wanted. A thread
// a row, its z row staged in shared memory: the block's rows are contiguous in z_input, so it stores them coalesced
// (a thread's own 144-byte row is a scattered segment of every warp store: 81 us a 262,144-row pass, 6% of it).
enum { SAMPLE_ROWS = 64 }; // a block's rows: 128 would leave 53 of 132 SMs idle at the ELBO's 10,000

template <typename T, int ZMAX>
__global__ void __launch_bounds__(SAMPLE_ROWS)
    sample_kernel(T* z_input, float* z_out, float* kl, float* log_ratio, const float* __restrict__ mulv,
                  const float* __restrict__ eps_in, int rows, int nz, int K, uint32_t first_image, uint64_t seed,
                  bool z_is_mu) {
    __shared__ Four<T> staged[SAMPLE_ROWS * z_pad(ZMAX) * z_parts<T>() / 4];
    const int first = blockIdx.x * SAMPLE_ROWS, r = first + threadIdx.x;
    nz = latents<ZMAX>(nz);
    const int width = z_pad(nz) * z_parts<T>() / 4; // a z row's Fours
    if (r < rows) {
        float z[ZMAX], row_kl, ratio;
        sample_latents(z, nz, &row_kl, &ratio, mulv + (size_t)(r / K) * 2 * nz,
                       eps_in ? eps_in + (size_t)r * nz : NULL, first_image + r / K, r % K, seed, z_is_mu);
        store_z_input(reinterpret_cast<T*>(staged + threadIdx.x * width), z, nz);
        #pragma unroll
        for (int j = 0; j < ZMAX; j++)
            if (z_out && j < nz) z_out[(size_t)r * nz + j] = z[j];
        if (kl) kl[r] = row_kl;
        if (log_ratio) log_ratio[r] = ratio;
    }
    __syncthreads();
    Four<T>* out = reinterpret_cast<Four<T>*>(z_input) + (size_t)first * width;
    for (int i = threadIdx.x; i < min(rows - first, (int)SAMPLE_ROWS) * width; i += SAMPLE_ROWS) out[i] = staged[i];
}

// fc3's inputs from latents given in fp32 (prior samples, interpolations, the tests' z).
template <typename T, int ZMAX>
__global__ void z_input_kernel(T* z_input, const float* __restrict__ z, int rows, int nz) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    nz = latents<ZMAX>(nz);
    float row[ZMAX];
    #pragma unroll
    for (int j = 0; j < ZMAX; j++) row[j] = j < nz ? z[(size_t)r * nz + j] : 0.0f;
    store_z_input(z_input + (size_t)r * z_pad(nz) * z_parts<T>(), row, nz);
}

// A lane's share of a row's BCE, sum max(l, 0) - x l + log(1 + e^-|l|) over its logits (dev/loss_v7.cu, loss_v9.cu):
// - max(l, 0) - x l = (|l| + w l) / 2 with w = 1 - 2x (pixel_weight): an fma and an add a logit;
// - the log terms as one product of the factors 1 + e^-|l| (at most 28 a lane, each in (1, 2]) and one log; e^-|l| by
//   the hardware's exp2 (__expf: 2 instructions against expf's ~10; off by (2 + 1.2|l|) ulp of e^-|l|, at most 2.4e-7
//   a logit; a row's sum measured within 2.3e-7 of float64).
// row_sum adds the lanes' shares in a fixed shuffle tree.
struct BceLane {
    float twice = 0.0f, product = 1.0f; // twice: the sum of |l| + w l
    __device__ void add(float l, float w, float e) {
        twice += fmaf(w, l, fabsf(l)), product = fmaf(product, e, product);
    }
    __device__ float row_sum() const {
        float s = 0.5f * twice + logf(product);
        for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
        return s;
    }
};

// w = 1 - 2x from a pixel's byte in one fma: 1 at 0, within 2 ulp of (255 - 2 byte) / 255 elsewhere.
__device__ inline float pixel_weight(float byte) { return fmaf(byte, -2.0f / 255.0f, 1.0f); }

// --iwae's pixel weights, once for an image's K rows: six instructions a logit, not nine (bf16 1.3x; dev/loss_v9.cu).
__global__ void pixel_weight_kernel(float* weight, const uint8_t* __restrict__ pixels, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) weight[i] = pixel_weight(pixels[i]);
}

// Byte k of a word (four pixels) as a float, exactly: the byte under the exponent of 2^23 (one byte permute), less
// 2^23. An int-to-float conversion runs at a quarter of the rate on the pipe that also computes the exponentials.
__device__ inline float byte_as_float(uint32_t four, int k) {
    return __uint_as_float(__byte_perm(four, 0x4b000000u, 0x7540 | k)) - 8388608.0f;
}

// A lane's share of a row: its logits in packs of four and their pixels (X: bytes, or --iwae's weights). Logits and
// bytes are loaded before any is used (fp32's pass at a copy's bandwidth; dev/loss_v7.cu); weights, shared in L1 by an
// image's rows, as used (all first: 50 registers against 32, bf16 1.2x slower; dev/loss_v9.cu). Packs of 8 bf16 give
// the busiest lane 32 logits against 28, and bf16's kernel is bound by issue. Pack s: columns 4 (lane + 32 s) on.
template <typename L, typename X = uint8_t> struct RowShare {
    static constexpr int V = 4, PACKS = INPUT_DIM / V, STEPS = (PACKS + 31) / 32;
    static constexpr bool BYTES = std::is_same<X, uint8_t>::value;
    static_assert(INPUT_DIM % V == 0, "rows of whole packs");
    Pack<L, V> l[STEPS];
    Pack<uint8_t, V> x[BYTES ? STEPS : 1];
    const Pack<X, V>* x_lane; // the lane's first pack of pixels
    __device__ RowShare(const L* l_row, const X* pixels, int lane)
        : x_lane(reinterpret_cast<const Pack<X, V>*>(pixels) + lane) {
        #pragma unroll
        for (int s = 0; s < STEPS; s++) {
            const int i = lane + 32 * s;
            if (i >= PACKS) break;
            l[s] = reinterpret_cast<const Pack<L, V>*>(l_row)[i];
            if (BYTES && pixels) x[s] = reinterpret_cast<const Pack<uint8_t, V>*>(pixels)[i];
        }
    }
    __device__ static bool has(int lane, int s) { return lane + 32 * s < PACKS; }
    __device__ float logit(int s, int k) const { return as_float(l[s].v[k]); }
    __device__ float pixel(int s, int k) const { // bytes only
        return byte_as_float(reinterpret_cast<const uint32_t*>(x[BYTES ? s : 0].v)[k / 4], k % 4);
    }
    __device__ Pack<float, V> weights(int s) const {
        Pack<float, V> w;
        if constexpr (BYTES)
            for (int k = 0; k < V; k++) w.v[k] = pixel_weight(pixel(s, k));
        else w = x_lane[32 * s];
        return w;
    }
};

// Row r's logits l against image r / rows_per_image: its BCE, recon = sigmoid(l), and residual = sigmoid(l) - x (AIS's
// backward's start; in fp32 as FP16_PARTS parts), each where asked for; BCE_ONLY, the BCE alone with no sigmoid
// compiled in (--iwae's passes on weights X = float, the ELBO: bf16's 1.2x faster). A warp a row.
template <typename R, typename L = float, int PARTS = 1, bool BCE_ONLY = false, typename X = uint8_t>
__global__ void decoder_output_kernel(float* bce, float* recon, R* residual, const L* __restrict__ logits,
                                      const X* __restrict__ pixels, int rows, int rows_per_image) {
    typedef RowShare<L, X> Share;
    static_assert(BCE_ONLY || Share::BYTES, "the residual takes the pixels' bytes");
    constexpr int V = Share::V;
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (r >= rows) return;
    const Share share(logits + (size_t)r * INPUT_DIM,
                      pixels ? pixels + (size_t)(r / rows_per_image) * INPUT_DIM : NULL, lane);
    const bool want_sigmoid = !BCE_ONLY && (recon != NULL || residual != NULL);
    BceLane part;
    #pragma unroll
    for (int s = 0; s < Share::STEPS; s++) {
        if (!Share::has(lane, s)) break;
        const int i = lane + 32 * s;
        Pack<float, V> sigmoid, d, w;
        if (BCE_ONLY || (bce && pixels)) w = share.weights(s);
        for (int k = 0; k < V; k++) {
            const float l = share.logit(s, k), e = __expf(-fabsf(l));
            if (want_sigmoid) {
                const float q = __fdividef(1.0f, 1.0f + e); // 1 + e in [1, 2]: within __fdividef's range
                sigmoid.v[k] = l >= 0.0f ? q : e * q;
            }
            if (!BCE_ONLY && pixels == NULL) continue;
            if (!BCE_ONLY && residual) d.v[k] = sigmoid.v[k] - share.pixel(s, k) * (1.0f / 255.0f);
            if (BCE_ONLY || bce) part.add(l, w.v[k], e);
        }
        if (!BCE_ONLY && recon) reinterpret_cast<Pack<float, V>*>(recon + (size_t)r * INPUT_DIM)[i] = sigmoid;
        for (int p = 0; !BCE_ONLY && residual && pixels && p < PARTS; p++) {
            Pack<R, V> stored;
            for (int k = 0; k < V; k++) stored.v[k] = split_part<R>(d.v[k], PARTS == 1 ? 0 : activation_part(p));
            reinterpret_cast<Pack<R, V>*>(residual + ((size_t)r * PARTS + p) * INPUT_DIM)[i] = stored;
        }
    }
    const float sum = part.row_sum();
    if (bce && pixels && lane == 0) bce[r] = sum;
}

// The ReLU's backward: grad is zero where the layer's output h is. Four values a thread.
template <typename G, typename H> __global__ void relu_backward_kernel(G* grad, const H* __restrict__ h, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * i >= n) return;
    if (4 * i + 4 > n) {
        for (long long k = 4 * i; k < n; k++)
            if (!(as_float(h[k]) > 0.0f)) store_as(&grad[k], 0.0f);
        return;
    }
    Four<G> g = reinterpret_cast<Four<G>*>(grad)[i];
    const Four<H> hidden = reinterpret_cast<const Four<H>*>(h)[i];
    for (int k = 0; k < 4; k++)
        if (!(as_float(hidden.v[k]) > 0.0f)) store_as(&g.v[k], 0.0f);
    reinterpret_cast<Four<G>*>(grad)[i] = g;
}

// W[rows][cols] (fp32) as T in rows of `pitch`, zeros past cols (fc3's backward copy: [W3 | 0]).
template <typename T>
__global__ void plain_weights_kernel(T* dst, const float* __restrict__ w, int rows, int cols, int pitch) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * pitch) return;
    const int r = (int)(i / pitch), c = (int)(i % pitch);
    store_as(&dst[i], c < cols ? w[(size_t)r * cols + c] : 0.0f);
}

// --iwae K (Burda et al.): log p(x) ~ logsumexp_k [log_ratio_k - BCE_k] - log K as a running (max, sum of exp), an
// image's rows in chunks of LSE_CHUNK, a block each (K = 159,856: 157 blocks), merged in order by iwae_merge_kernel.
__device__ inline void logsumexp_merge(float& m, float& s, float m2, float s2) {
    const float top = fmaxf(m, m2);
    if (top == -INFINITY) return; // both empty
    s = s * expf(m - top) + s2 * expf(m2 - top), m = top;
}

enum { LSE_THREADS = 256, LSE_CHUNK = 1024 };

__global__ void __launch_bounds__(LSE_THREADS)
    iwae_logsumexp_kernel(float* __restrict__ log_px, float2* __restrict__ partials,
                          const float* __restrict__ bce_parts, int parts, const float* __restrict__ log_ratio, int K) {
    __shared__ float warp_m[LSE_THREADS / 32], warp_s[LSE_THREADS / 32];
    const int chunks = ceil_div(K, LSE_CHUNK), image = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, end = min(K, (chunk + 1) * LSE_CHUNK);
    float m = -INFINITY, s = 0.0f;
    for (int k = chunk * LSE_CHUNK + threadIdx.x; k < end; k += LSE_THREADS) {
        const size_t r = (size_t)image * K + k;
        float bce = 0.0f;
        for (int p = 0; p < parts; p++) bce += bce_parts[r * parts + p];
        logsumexp_merge(m, s, log_ratio[r] - bce, 1.0f);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, offset), s2 = __shfl_xor_sync(0xffffffffu, s, offset);
        logsumexp_merge(m, s, m2, s2);
    }
    if (lane == 0) warp_m[warp] = m, warp_s[warp] = s;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < LSE_THREADS / 32; w++) logsumexp_merge(m, s, warp_m[w], warp_s[w]);
    if (chunks == 1) log_px[image] = m + logf(s) - logf((float)K);
    else partials[blockIdx.x] = make_float2(m, s);
}

// An image's chunks' (max, sum) merged in chunk order, a thread an image.
__global__ void iwae_merge_kernel(float* __restrict__ log_px, const float2* __restrict__ partials, int images, int K) {
    const int image = blockIdx.x * blockDim.x + threadIdx.x, chunks = ceil_div(K, LSE_CHUNK);
    if (image >= images) return;
    float m = -INFINITY, s = 0.0f;
    for (int c = 0; c < chunks; c++) {
        const float2 p = partials[(size_t)image * chunks + c];
        logsumexp_merge(m, s, p.x, p.y);
    }
    log_px[image] = m + logf(s) - logf((float)K);
}

// ---- the plain path, part 1 (continued): annealed importance sampling (--ais T, --bdmc N) ---------------------------
// AIS (Neal 2001; Wu et al., ICLR 2017) moves C chains per image from p0 = q(z|x) (or N(0, I)) to the posterior through
// f_b = p0^(1-b) p(x, z)^b, 0 = b_0 < ... < b_T = 1, each with a float64 weight (log p(x) ~ logsumexp log w - log C)
//   log w = sum_t (b_t - b_{t-1}) [log p(x, z_{t-1}) - log p0(z_{t-1})]
// and an HMC transition between weights: p ~ N(0, I), L leapfrog steps on U_b = -log f_b, a Metropolis test on
// H = U_b + |p|^2 / 2 (float32: H ~ 100, differences ~1e-5), each step the decoder's backward pass (1.29 MFLOP):
//   grad_z BCE = W3^T (mask . (W4^T (sigmoid(logits) - x)))        mask = fc3's ReLU
// BDMC (Grosse et al. 2015) runs the chains backwards from an exact posterior sample: an upper bound.
constexpr float AIS_STEP_START = 0.05f, AIS_STEP_MIN = 1e-4f, AIS_STEP_MAX = 0.5f, AIS_TARGET_ACCEPT = 0.65f;
static double ais_flops_per_eval(ModelDims d) { return 4.0 * ((double)d.z * d.h3 + (double)d.h3 * INPUT_DIM); }

struct AisIO { // what an AIS run over n images reads and writes; row r is chain r % C of image r / C
    const uint8_t* pixels; // [n][784]
    const float* mulv;     // [n][2 Z]: p0 = N(mu, exp(logvar)): q(z|x), or zeros for the prior
    const float* z_start;  // [n][Z]: where every chain of an image starts (BDMC's reverse run), or NULL: z ~ p0
    const double* beta;    // [T + 1]: the schedule, 0 .. 1
    int n, chains, T, leapfrog;
    uint32_t first_image;  // the generator's image index of image 0
    uint64_t seed;
    bool reverse;          // run the schedule from b_T to b_0: the weights of BDMC's upper bound
    float step0;
    double* log_w;         // [n * C]
    int* accepted;         // [n * C]: transitions accepted
    float* step_out;       // [n]: the step size at the end
    Probe probe;           // the model's
};

// AIS's steps, written once: the plain path's kernels and the fused kernel call these, so both run one algorithm.

__host__ __device__ inline float ais_target(const AisIO& io, int s) {
    return (float)io.beta[io.reverse ? io.T - s : s];
}

// (b_s - b_{s-1}) [log p(x, z) - log p0(z)]; the reverse run's from the other end, negated.
__host__ __device__ inline double ais_weight_term(const AisIO& io, int s, float lpxz, float lp0) {
    const int at = io.reverse ? io.T + 1 - s : s;
    const double d_beta = io.beta[at] - io.beta[at - 1];
    return (io.reverse ? -d_beta : d_beta) * (double)(lpxz - lp0);
}

__device__ inline float ais_start_z(const AisIO& io, int image, int chain, int j, int nz, float mu, float logvar) {
    float kl_term;
    return io.z_start ? io.z_start[(size_t)image * nz + j]
                      : latent_z(mu, logvar, gaussian(io.seed, STREAM_POSTERIOR, io.first_image + image, chain, j),
                                 &kl_term);
}

__host__ __device__ inline float2 ais_momentum(const AisIO& io, int image, int chain, int s, int j, int nz) {
    return gaussian_pair(io.seed, STREAM_MOMENTUM, io.first_image + image, chain, momentum_counter(s, j, nz));
}

__host__ __device__ inline void ais_density_terms(float z, float mu, float inv_var, float* sq, float* mahal) {
    const float d = z - mu;
    *sq = fmaf(z, z, *sq), *mahal = fmaf(d * d, inv_var, *mahal);
}

// log p(x, z) = -BCE - |z|^2 / 2 and log p0(z) = -(sum (z - mu)^2 / var + sum logvar) / 2 (the log 2 pi cancel).
__host__ __device__ inline void ais_log_densities(float bce, float sq, float mahal, float logvar_sum, float* lpxz,
                                                  float* lp0) {
    *lpxz = -bce - 0.5f * sq, *lp0 = -0.5f * (mahal + logvar_sum);
}

// H = U_b(z) + |p|^2 / 2, U_b = -b log p(x, z) - (1 - b) log p0(z); a kick is p - scaled_step dU_b/dz.
__host__ __device__ inline float ais_energy(float beta, float lpxz, float lp0, float kinetic) {
    return -beta * lpxz - (1.0f - beta) * lp0 + 0.5f * kinetic;
}

__host__ __device__ inline float ais_kick(float p, float z, float grad_bce, float mu, float inv_var, float beta,
                                          float scaled_step) {
    const float grad_u = beta * (grad_bce + z) + (1.0f - beta) * (z - mu) * inv_var;
    return fmaf(-scaled_step, grad_u, p);
}

__host__ __device__ inline float ais_drift(float z, float p, float step) { return fmaf(step, p, z); }

// Accepted with probability min(1, e^(H0 - H1)); never for a non-finite proposal.
__host__ __device__ inline bool ais_accept(const AisIO& io, int image, int chain, int s, float h0, float h1) {
    return logf(uniform_open0(io.seed, STREAM_ACCEPT, io.first_image + image, chain, s)) < h0 - h1;
}

__host__ __device__ inline float ais_adapted_step(const AisIO& io, float step, int taken, int C) {
    const float rate = (float)taken / C;
    if (io.probe.fixed_step) return step;
    return fminf(fmaxf(step * (rate > AIS_TARGET_ACCEPT ? 1.02f : 0.98f), AIS_STEP_MIN), AIS_STEP_MAX);
}

// The plain path's chains; z, p and the start latent by latent, [nz][rows]: a warp's rows of a latent are 128 bytes.
enum { PLAIN_AIS_ROWS = 1 << 16 }; // chains a set holds: ~920 MB in fp32 for H3 = 400, ~4.2 GB for 4,096
struct AisChains {
    float *z, *p, *z0, *grad0; // [nz][PLAIN_AIS_ROWS]
    float* grad;               // [rows][z_pad(nz)]
    float *bce, *bce0, *h0;    // [rows]
    int* took;                 // [rows]: this transition's proposal accepted
    int nz;
    template <int ZMAX> __device__ void load(const float* a, size_t r, float (&v)[ZMAX]) const {
        UNROLL_LATENTS(ZMAX)
        for (int j = 0; j < ZMAX; j++) v[j] = j < latents<ZMAX>(nz) ? a[j * (size_t)PLAIN_AIS_ROWS + r] : 0.0f;
    }
    template <int ZMAX> __device__ void store(float* a, size_t r, const float (&v)[ZMAX]) const {
        UNROLL_LATENTS(ZMAX)
        for (int j = 0; j < ZMAX; j++)
            if (j < latents<ZMAX>(nz)) a[j * (size_t)PLAIN_AIS_ROWS + r] = v[j];
    }
    template <int ZMAX> __device__ void load_grad(size_t r, float (&v)[ZMAX]) const {
        const int used = latents<ZMAX>(nz);
        const Four<float>* row = reinterpret_cast<const Four<float>*>(grad + r * z_pad(used));
        UNROLL_LATENTS((ZMAX + 3) / 4)
        for (int q = 0; q < (ZMAX + 3) / 4; q++) {
            const Four<float> four = 4 * q < used ? row[q] : Four<float>{};
            for (int k = 0; k < 4 && 4 * q + k < ZMAX; k++) v[4 * q + k] = four.v[k];
        }
    }
};

template <int ZMAX> struct AisPrior { // p0's mean, 1 / variance, sum of log variances (unused: 0, 1, no terms)
    float mu[ZMAX], inv_var[ZMAX], logvar_sum = 0.0f;
    __device__ AisPrior(const float* mulv_row, int nz) {
        UNROLL_LATENTS(ZMAX)
        for (int j = 0; j < ZMAX; j++) {
            mu[j] = j < nz ? mulv_row[j] : 0.0f, inv_var[j] = j < nz ? expf(-mulv_row[nz + j]) : 1.0f;
            if (j < nz) logvar_sum += mulv_row[nz + j];
        }
    }
    __device__ void log_densities(const float (&z)[ZMAX], float bce, float* lpxz, float* lp0) const {
        float sq = 0.0f, mahal = 0.0f;
        UNROLL_LATENTS(ZMAX)
        for (int j = 0; j < ZMAX; j++) ais_density_terms(z[j], mu[j], inv_var[j], &sq, &mahal);
        ais_log_densities(bce, sq, mahal, logvar_sum, lpxz, lp0);
    }
    __device__ void kick(float (&p)[ZMAX], const float (&z)[ZMAX], const float (&grad_bce)[ZMAX], float beta,
                         float scaled_step) const {
        UNROLL_LATENTS(ZMAX)
        for (int j = 0; j < ZMAX; j++) p[j] = ais_kick(p[j], z[j], grad_bce[j], mu[j], inv_var[j], beta, scaled_step);
    }
};

template <typename T, int ZMAX>
__device__ inline void drift_chain(const AisChains& c, T* z_input, size_t r, float (&z)[ZMAX], const float (&p)[ZMAX],
                                   float step) {
    UNROLL_LATENTS(ZMAX)
    for (int j = 0; j < ZMAX; j++) z[j] = ais_drift(z[j], p[j], step);
    c.store(c.z, r, z), store_z_input(z_input + r * z_pad(latents<ZMAX>(c.nz)) * z_parts<T>(), z, latents<ZMAX>(c.nz));
}

// The chains' start: z ~ p0 (or z_start), no weight yet, nothing accepted, each image at the first step size.
template <typename T, int ZMAX> __global__ void ais_start_kernel(AisIO io, AisChains c, T* z_input) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= io.n * io.chains) return;
    const int image = r / io.chains, chain = r % io.chains, nz = latents<ZMAX>(c.nz);
    const float* mulv = io.mulv + (size_t)image * 2 * nz;
    float z[ZMAX];
    #pragma unroll
    for (int j = 0; j < ZMAX; j++) z[j] = j < nz ? ais_start_z(io, image, chain, j, nz, mulv[j], mulv[nz + j]) : 0.0f;
    c.store(c.z, r, z), store_z_input(z_input + (size_t)r * z_pad(nz) * z_parts<T>(), z, nz);
    io.log_w[r] = 0.0, io.accepted[r] = 0;
    if (chain == 0) io.step_out[image] = io.step0;
}

// Step s's term of the log weight; then, before s = T, transition s's start: p, H0, half a kick, a drift.
template <typename T, int ZMAX> __global__ void ais_begin_kernel(AisIO io, AisChains c, T* z_input, int s) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= io.n * io.chains) return;
    const int image = r / io.chains, chain = r % io.chains, nz = latents<ZMAX>(c.nz);
    const AisPrior<ZMAX> prior(io.mulv + (size_t)image * 2 * nz, nz);
    float z[ZMAX], grad[ZMAX], p[ZMAX];
    c.load(c.z, r, z), c.load_grad(r, grad);
    const float bce = c.bce[r];
    #pragma unroll
    for (int j = 0; j < ZMAX; j++)
        if (s == 1 && io.probe.grad0 && j < nz) io.probe.grad0[(size_t)r * nz + j] = grad[j];
    if (s == 1 && io.probe.grad0) io.probe.bce0[r] = bce;
    float lpxz, lp0;
    prior.log_densities(z, bce, &lpxz, &lp0);
    io.log_w[r] += ais_weight_term(io, s, lpxz, lp0);
    if (s == io.T) {
        #pragma unroll
        for (int j = 0; j < ZMAX; j++)
            if (io.probe.z_out && j < nz) io.probe.z_out[(size_t)r * nz + j] = z[j];
        return;
    }
    const float beta = ais_target(io, s);
    float kinetic = 0.0f;
    #pragma unroll
    for (int j = 0; j < ZMAX; j += 2) { // an odd Z's last pair draws two and keeps one
        const float* given = io.probe.p_start && s == 1 ? io.probe.p_start + (size_t)r * nz + j : NULL;
        float2 e = j >= nz ? make_float2(0.0f, 0.0f)
                   : given ? make_float2(given[0], j + 1 < nz ? given[1] : 0.0f)
                           : ais_momentum(io, image, chain, s, j, nz);
        if (j + 1 >= nz) e.y = 0.0f;
        p[j] = e.x;
        if (j + 1 < ZMAX) p[j + 1] = e.y;
        kinetic = fmaf(e.x, e.x, fmaf(e.y, e.y, kinetic));
    }
    c.h0[r] = ais_energy(beta, lpxz, lp0, kinetic);
    c.bce0[r] = bce, c.store(c.z0, r, z), c.store(c.grad0, r, grad);
    const float step = io.step_out[image];
    prior.kick(p, z, grad, beta, 0.5f * step), c.store(c.p, r, p);
    drift_chain(c, z_input, r, z, p, step);
}

// After gradient evaluation l of L: a whole kick and the next drift, or (LAST, l = L) the last half kick, H1 and the
// Metropolis test, where a rejected proposal returns to the start (as ais_chains: kick(l < L ? 1 : 0.5)).
template <typename T, int ZMAX, bool LAST> __global__ void ais_kick_kernel(AisIO io, AisChains c, T* z_input, int s) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= io.n * io.chains) return;
    const int image = r / io.chains, chain = r % io.chains, nz = latents<ZMAX>(c.nz);
    const AisPrior<ZMAX> prior(io.mulv + (size_t)image * 2 * nz, nz);
    const float beta = ais_target(io, s), step = io.step_out[image];
    float z[ZMAX], grad[ZMAX], p[ZMAX];
    c.load(c.z, r, z), c.load_grad(r, grad), c.load(c.p, r, p);
    prior.kick(p, z, grad, beta, LAST ? 0.5f * step : step);
    if constexpr (!LAST) {
        c.store(c.p, r, p);
        return drift_chain(c, z_input, r, z, p, step);
    }
    if (io.probe.proposal && s == io.T - 1)
        UNROLL_LATENTS(ZMAX)
        for (int j = 0; j < ZMAX && j < nz; j++)
            io.probe.proposal[(size_t)r * 2 * nz + j] = z[j], io.probe.proposal[((size_t)r * 2 + 1) * nz + j] = p[j];
    float lpxz, lp0, kinetic = 0.0f;
    prior.log_densities(z, c.bce[r], &lpxz, &lp0);
    UNROLL_LATENTS(ZMAX)
    for (int j = 0; j < ZMAX; j++) kinetic = fmaf(p[j], p[j], kinetic);
    const float h1 = ais_energy(beta, lpxz, lp0, kinetic);
    const bool accept = ais_accept(io, image, chain, s, c.h0[r], h1);
    if (io.probe.delta_h) io.probe.delta_h[r] = c.h0[r] - h1;
    if (!accept) { // back to the start: z, grad (fc3's backward's row) and BCE
        c.bce[r] = c.bce0[r], c.load(c.z0, r, z), c.load(c.grad0, r, grad);
        c.store(c.z, r, z);
        UNROLL_LATENTS(ZMAX)
        for (int j = 0; j < ZMAX; j++)
            if (j < nz) c.grad[(size_t)r * z_pad(nz) + j] = grad[j];
    }
    io.accepted[r] += accept, c.took[r] = accept;
}

// Each image's step size from its chains' acceptance in this transition, counted in chain order.
__global__ void ais_adapt_kernel(AisIO io, AisChains c) {
    const int image = blockIdx.x * blockDim.x + threadIdx.x;
    if (image >= io.n) return;
    int taken = 0;
    for (int k = 0; k < io.chains; k++) taken += c.took[(size_t)image * io.chains + k];
    io.step_out[image] = ais_adapted_step(io, io.step_out[image], taken, io.chains);
}

// Per image, its chains in order, in float64: log p(x) (negated in reverse: the upper bound), ESS and acceptance.
__global__ void ais_estimate_kernel(double* __restrict__ log_px, float* __restrict__ ess,
                                    float* __restrict__ acceptance, const double* __restrict__ log_w,
                                    const int* __restrict__ accepted, int n, int C, int transitions, bool reverse) {
    const int image = blockIdx.x * blockDim.x + threadIdx.x;
    if (image >= n) return;
    const double* w = log_w + (size_t)image * C;
    double top = -INFINITY;
    long long taken = 0;
    for (int c = 0; c < C; c++) top = fmax(top, w[c]), taken += accepted[(size_t)image * C + c];
    double sum = 0.0, sum_sq = 0.0;
    for (int c = 0; c < C; c++) {
        const double e = exp(w[c] - top);
        sum += e, sum_sq += e * e;
    }
    const double estimate = top + log(sum) - log((double)C);
    log_px[image] = reverse ? -estimate : estimate, ess[image] = (float)(sum * sum / sum_sq);
    acceptance[image] = transitions > 0 ? (float)((double)taken / ((double)C * transitions)) : 0.0f;
}

// ---- the plain path, part 2: the model on cuBLASLt ------------------------------------------------------------------
// Each Linear layer is one cuBLASLt matmul, its bias and ReLU in the epilogue. Row-major W[out][in] and X[rows][in]
// read column-major are W^T and X^T, so the forward Y = X W^T + b and the backward dX = dY W (AIS's gradient) are
//   Y^T (out x rows) = W (out x in: op T) X^T (in x rows: op N)              m = out, n = rows, k = in
//   dX^T (in x rows) = W^T (in x out: W's bytes, op N) dY^T (out x rows)     m = in, n = rows, k = out
// and Y^T column-major is Y row-major: no copy or transpose. Each product keeps one algorithm, picked once with no
// workspace or split-K (cuBLASLt's default changes with the batch and splits K): no row's bits depend on the batch.
static void cublas_check(cublasStatus_t status, const char* file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) fail("cuBLAS: %s at %s:%d", cublasLtGetStatusString(status), file, line);
}

#define cublasCheck(call) cublas_check((call), __FILE__, __LINE__)
typedef struct {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t w_layout;
    cublasLtMatmulAlgo_t algo;
    cudaDataType_t in_type, out_type;
    int m, k;    // Y^T is m x rows, the sums run over k
    const void* w;
    float alpha; // the product's scale: fc1's 1/255
} Gemm;

static cublasLtMatrixLayout_t gemm_layout(cudaDataType_t type, int rows, int cols, int ld) {
    cublasLtMatrixLayout_t layout;
    cublasCheck(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld));
    return layout;
}

static cublasLtMatmulPreference_t gemm_preference() {
    cublasLtMatmulPreference_t pref;
    cublasCheck(cublasLtMatmulPreferenceCreate(&pref));
    const size_t workspace = 0;
    const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                                     sizeof(workspace)));
    cublasCheck(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reduction,
                                                     sizeof(reduction)));
    return pref;
}

// Y = alpha X W^T (+ bias) (ReLU), or backward dX = dY W; the algorithm the heuristic's first for pick_rows rows.
static Gemm gemm_init(cublasLtHandle_t lt, const void* w, int out, int in, int pitch, bool backward, bool relu,
                      const void* bias, cudaDataType_t in_type, cudaDataType_t out_type, float alpha, int pick_rows) {
    Gemm g = {};
    g.w = w, g.in_type = in_type, g.out_type = out_type, g.alpha = alpha;
    g.m = backward ? in : out, g.k = backward ? out : in;
    cublasCheck(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F)); // fp32 sums, never TF32
    const cublasOperation_t op_w = backward ? CUBLAS_OP_N : CUBLAS_OP_T, op_x = CUBLAS_OP_N;
    cublasCheck(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_w, sizeof(op_w)));
    cublasCheck(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_x, sizeof(op_x)));
    const cublasLtEpilogue_t epilogue = bias ? (relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS)
                                             : (relu ? CUBLASLT_EPILOGUE_RELU : CUBLASLT_EPILOGUE_DEFAULT);
    cublasCheck(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    if (bias)
        cublasCheck(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    g.w_layout = gemm_layout(in_type, in, out, pitch);
    cublasLtMatrixLayout_t x = gemm_layout(in_type, g.k, pick_rows, g.k);
    cublasLtMatrixLayout_t y = gemm_layout(out_type, g.m, pick_rows, g.m);
    cublasLtMatmulPreference_t pref = gemm_preference();
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    cublasCheck(cublasLtMatmulAlgoGetHeuristic(lt, g.desc, g.w_layout, x, y, y, pref, 1, &result, &found));
    if (found == 0)
        fail("cuBLASLt has no algorithm for a %d x %d x %d product on this GPU. HINT: --precision fp32", g.m,
             pick_rows, g.k);
    g.algo = result.algo;
    int32_t splits = 1;
    cublasCheck(cublasLtMatmulAlgoConfigGetAttribute(&g.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits),
                                                     NULL));
    if (splits > 1) fail("internal: cuBLASLt picked split-K (%d) where none was allowed", splits);
    cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
    cublasCheck(cublasLtMatrixLayoutDestroy(x)), cublasCheck(cublasLtMatrixLayoutDestroy(y));
    return g;
}

static void gemm_free(Gemm* g) {
    if (g->desc) cublasCheck(cublasLtMatmulDescDestroy(g->desc));
    if (g->w_layout) cublasCheck(cublasLtMatrixLayoutDestroy(g->w_layout));
    memset(g, 0, sizeof(*g));
}

static void gemm(cublasLtHandle_t lt, const Gemm& g, void* y, const void* x, int rows, cudaStream_t stream) {
    cublasLtMatrixLayout_t x_layout = gemm_layout(g.in_type, g.k, rows, g.k);
    cublasLtMatrixLayout_t y_layout = gemm_layout(g.out_type, g.m, rows, g.m);
    const float beta = 0.0f;
    cublasCheck(cublasLtMatmul(lt, g.desc, &g.alpha, g.w, g.w_layout, x, x_layout, &beta, y, y_layout, y, y_layout,
                               &g.algo, NULL, 0, stream));
    cublasCheck(cublasLtMatrixLayoutDestroy(x_layout)), cublasCheck(cublasLtMatrixLayoutDestroy(y_layout));
}

// Long runs (--iwae, --ais) alternate between PLAIN_LANES streams, each with its own buffers: one lane's short kernels
// (bandwidth) run beside another's matmuls (tensor cores).
enum { PLAIN_LANES = 2 };

typedef struct { // AIS's buffers, a set a lane
    void *z_input, *h3, *h3_parts, *residual, *dh; // h3_parts: fp32's (else NULL)
    float* logits;
    AisChains chains;
    cudaStream_t stream;
} AisWork;

typedef struct {
    ModelDims dims;
    Precision precision;
    cudaDataType_t type, backward_type; // T and AIS's backward's Backward<T>: CUDA_R_32F, or CUDA_R_16BF and CUDA_R_16F
    size_t type_size;
    bool parts; // fp32: fc1, fc4 and fc4's backward on fp16 parts (FP16_PARTS)
    cublasLtHandle_t lt;
    void* weights; // W1, b1, W2, [W3 | b3], W4 in T (fp32: W1, W4 in fp16 parts); b2, b4 fp32; the backward's W4, W3
    Gemm fc1, fc2, fc3, fc4, fc4_t; // fc4_t: fc4 with its logits in T, where only the BCE or gradient reads them
    void *x, *h1;          // [max_batch][784] (fp32: [784 | 784] in fp16), [max_batch][H1]
    float *mulv, *z, *recon; // fp32 [max_batch][2 Z] ([mu | logvar]), [max_batch][Z], [max_batch][784]
    void *z_input, *h3;    // [rows][z_width], [rows][H3]
    void* h3_parts;        // fp32's [rows][3 H3] fp16 parts of h3, fc4's input (else NULL)
    float *logits, *bce, *log_ratio; // [rows][784], [rows], [rows] fp32
    float* pixel_weight;             // --iwae's [max_batch][784] w = 1 - 2x (pixel_weight), allocated by its first run
    Gemm fc4_backward, fc3_backward;
    AisWork ais[PLAIN_LANES];        // allocated by AIS's first run
    cudaStream_t lanes[PLAIN_LANES]; // lanes[0]: the caller's stream, set by plain_fork
    cudaEvent_t fork, join;
} Plain;

static char out_of_memory_hint[192] = "use a smaller batch"; // the fix the run's mode has (set_out_of_memory_hint)
static void* device_alloc(size_t bytes, const char* what) {
    void* p = NULL;
    cudaError_t status = cudaMalloc(&p, bytes);
    if (status == cudaErrorMemoryAllocation)
        fail("out of GPU memory allocating %s (%zu bytes). HINT: %s", what, bytes, out_of_memory_hint);
    cudaCheck(status);
    return p;
}

template <typename... Params, typename... Args>
static void launch(void (*kernel)(Params...), long long items, int per_block, int threads, cudaStream_t stream,
                   Args... args) {
    kernel<<<(unsigned)((items + per_block - 1) / per_block), threads, 0, stream>>>(Params(args)...);
    cudaCheck(cudaGetLastError());
}

// The weights in the path's types (fc22's rows follow fc21's: one [2Z][H1] layer), and the products.
template <typename T> static void plain_init_weights(Plain* pl, const float* const* t, cudaStream_t stream) {
    typedef typename Backward<T>::type B;
    constexpr bool parts = on_parts<T>();
    typedef typename std::conditional<parts, fp16, T>::type TC;   // fc1's and fc4's operands
    typedef typename std::conditional<parts, fp16, B>::type BC;   // fc4's backward's
    const int H1 = pl->dims.h1, Z = pl->dims.z, H3 = pl->dims.h3, MULV = 2 * Z, pad = z_pad(Z), zk = pad * z_parts<T>();
    const int k1 = parts ? 2 * INPUT_DIM : INPUT_DIM, k4 = parts ? FP16_PARTS * H3 : H3; // fc1's and fc4's K
    const int back_k = parts ? FP16_PARTS * INPUT_DIM : INPUT_DIM;                          // fc4's backward's
    size_t bytes = 0;
    auto slot = [&](size_t size) {
        const size_t at = bytes;
        bytes += (size + 255) / 256 * 256;
        return at;
    };
    const size_t w1 = slot((size_t)H1 * k1 * sizeof(TC)), b1 = slot(H1 * sizeof(T));
    const size_t w2 = slot((size_t)MULV * H1 * sizeof(T)), b2 = slot(MULV * sizeof(float));
    const size_t w3 = slot((size_t)H3 * zk * sizeof(T)); // with b3 in it
    const size_t w4 = slot((size_t)INPUT_DIM * k4 * sizeof(TC)), b4 = slot(INPUT_DIM * sizeof(float));
    const size_t b4_type = slot(INPUT_DIM * sizeof(T));
    const size_t w3_back = slot((size_t)H3 * pad * sizeof(B)), w4_back = slot((size_t)back_k * H3 * sizeof(BC));
    uint8_t* base = (uint8_t*)device_alloc(bytes, "the plain path's weights");
    pl->weights = base;
    const cudaDataType_t f32 = CUDA_R_32F, type = pl->type, back = pl->backward_type;
    auto convert = [&](auto u, size_t at, int k, int rows, int cols, int pitch) {
        typedef decltype(u) U;
        launch(plain_weights_kernel<U>, (long long)rows * pitch, 256, 256, stream, (U*)(base + at), t[k], rows, cols,
               pitch);
        return (const void*)(base + at);
    };
    auto split = [&](size_t at, int k, long long rows, long long cols, int first_block) { // weights in fp16 parts
        launch(fp16_parts_kernel<true>, rows * cols, 256, 256, stream, (fp16*)(base + at), t[k], rows, cols,
               first_block);
        return (const void*)(base + at);
    };
    const cudaDataType_t tc = parts ? CUDA_R_16F : type, back_in = parts ? CUDA_R_16F : back;
    // the batch each algorithm is picked for (dev/NOTES.md, 'algorithm picks (plain path)'): fp32's SIMT products (fc2,
    // fc3, fc3's backward) their own, the tensor cores' (bf16's, fp32's fp16 parts) 4,096, or 65,536 for long passes
    // (and bf16's fc3, whose K of 72 runs 17% faster a row on that pick's tile: dev/NOTES.md)
    const int pick = type == f32 ? 1024 : 4096, tc_pick = 4096, long_pick = 65536;
    const int backward_pick = type == f32 ? 2048 : long_pick;
    // fc1: h1 = ReLU(x / 255 W1^T + b1) in T (fp32: [x | x] against [W1 lo | W1 hi]); fc2: [mu | logvar] = h1 W2^T + b2
    const void* fc1_w = parts ? split(w1, FC1_W, H1, INPUT_DIM, 1) : convert(T(), w1, FC1_W, H1, INPUT_DIM, INPUT_DIM);
    pl->fc1 = gemm_init(pl->lt, fc1_w, H1, k1, k1, false, true, convert(T(), b1, FC1_B, 1, H1, H1), tc, type,
                        1.0f / 255.0f, tc_pick);
    pl->fc2 = gemm_init(pl->lt, convert(T(), w2, FC21_W, MULV, H1, H1), MULV, H1, H1, false, false,
                        convert(0.0f, b2, FC21_B, 1, MULV, MULV), type, f32, 1.0f, pick);
    // fc3: h3 = ReLU([z | 1] [W3 | b3]^T) in T (the bias in K; bf16 in parts); fc4: logits = h3 W4^T + b4 in fp32
    // (fp32: h3's parts against [W4 hi | W4 lo | W4 hi])
    launch(fc3_weights_kernel<T>, (long long)H3 * zk, 256, 256, stream, (T*)(base + w3), t[FC3_W], t[FC3_B], H3, Z);
    pl->fc3 = gemm_init(pl->lt, base + w3, H3, zk, zk, false, true, NULL, type, type, 1.0f,
                        type == f32 ? pick : long_pick);
    const void* fc4_w = parts ? split(w4, FC4_W, INPUT_DIM, H3, 0) : convert(T(), w4, FC4_W, INPUT_DIM, H3, H3);
    pl->fc4 = gemm_init(pl->lt, fc4_w, INPUT_DIM, k4, k4, false, false,
                        convert(0.0f, b4, FC4_B, 1, INPUT_DIM, INPUT_DIM), tc, f32, 1.0f, tc_pick);
    pl->fc4_t = gemm_init(pl->lt, fc4_w, INPUT_DIM, k4, k4, false, false,
                          convert(T(), b4_type, FC4_B, 1, INPUT_DIM, INPUT_DIM), tc, type, 1.0f, long_pick);
    // AIS's backward: dh = residual W4 in B (fp32: the residual's parts against W4's blocks stacked, [hi; lo; hi]),
    // then grad BCE = dh W3 in fp32 (z_pad(Z) wide)
    const void* back_w = parts ? split(w4_back, FC4_W, 1, (long long)INPUT_DIM * H3, 0)
                               : convert(B(), w4_back, FC4_W, INPUT_DIM, H3, H3);
    pl->fc4_backward = gemm_init(pl->lt, back_w, back_k, H3, H3, true, false, NULL, back_in, back, 1.0f, long_pick);
    pl->fc3_backward = gemm_init(pl->lt, convert(B(), w3_back, FC3_W, H3, Z, pad), H3, pad, pad, true, false, NULL,
                                 back, f32, 1.0f, backward_pick);
}

static Plain* plain_init(const float* const* tensors, ModelDims dims, Precision precision, int max_batch, int rows,
                         cudaStream_t stream) {
    Plain* pl = (Plain*)calloc(1, sizeof(Plain));
    if (pl == NULL) fail("out of host memory for the plain path's state");
    pl->dims = dims, pl->precision = precision;
    const bool bf = precision == PRECISION_BF16;
    pl->type = bf ? CUDA_R_16BF : CUDA_R_32F, pl->backward_type = bf ? CUDA_R_16F : CUDA_R_32F; // T, Backward<T>
    pl->type_size = bf ? sizeof(bf16) : sizeof(float), pl->parts = !bf;
    cublasCheck(cublasLtCreate(&pl->lt));
    for (int l = 1; l < PLAIN_LANES; l++) cudaCheck(cudaStreamCreateWithFlags(&pl->lanes[l], cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&pl->fork, &pl->join}) cudaCheck(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    (precision == PRECISION_BF16 ? plain_init_weights<bf16> : plain_init_weights<float>)(pl, tensors, stream);
    const size_t B = (size_t)max_batch, R = (size_t)rows, t = pl->type_size;
    const int zk = z_width(precision, dims.z);
    pl->x = device_alloc(B * INPUT_DIM * (pl->parts ? 2 * sizeof(fp16) : t), "the pixels as fc1's input");
    pl->h1 = device_alloc(B * dims.h1 * t, "h1");
    pl->mulv = (float*)device_alloc(B * 2 * dims.z * sizeof(float), "mu/logvar");
    pl->z = (float*)device_alloc(B * dims.z * sizeof(float), "z");
    pl->z_input = device_alloc(R * zk * t, "fc3's input"), pl->h3 = device_alloc(R * dims.h3 * t, "h3");
    if (pl->parts) pl->h3_parts = device_alloc(R * FP16_PARTS * dims.h3 * sizeof(fp16), "h3's fp16 parts");
    pl->logits = (float*)device_alloc(R * INPUT_DIM * sizeof(float), "the logits");
    pl->bce = (float*)device_alloc(R * sizeof(float), "the rows' BCE");
    pl->log_ratio = (float*)device_alloc(R * sizeof(float), "the rows' log-density ratios");
    pl->recon = (float*)device_alloc(B * INPUT_DIM * sizeof(float), "recon");
    return pl;
}

static void plain_free(Plain* pl) {
    void* buffers[] = {pl->weights, pl->x,      pl->h1,  pl->mulv,      pl->z,     pl->z_input,     pl->h3,
                       pl->h3_parts, pl->logits, pl->bce, pl->log_ratio, pl->recon, pl->pixel_weight};
    for (void* p : buffers) cudaCheck(cudaFree(p)); // cudaFree(NULL) is a no-op
    for (AisWork& w : pl->ais) {
        void* ais_buffers[] = {w.z_input, w.h3, w.h3_parts, w.residual, w.dh, w.logits, w.chains.z};
        for (void* p : ais_buffers) cudaCheck(cudaFree(p));
    }
    for (int l = 1; l < PLAIN_LANES; l++) cudaCheck(cudaStreamDestroy(pl->lanes[l]));
    cudaCheck(cudaEventDestroy(pl->fork)), cudaCheck(cudaEventDestroy(pl->join));
    Gemm* gemms[] = {&pl->fc1, &pl->fc2, &pl->fc3, &pl->fc4, &pl->fc4_t, &pl->fc4_backward, &pl->fc3_backward};
    for (Gemm* g : gemms) gemm_free(g);
    cublasCheck(cublasLtDestroy(pl->lt)), free(pl);
}

// The other lanes start after what `stream` has queued (lane 0 is `stream`); plain_join makes `stream` wait for them.
static void plain_fork(Plain* pl, cudaStream_t stream) {
    pl->lanes[0] = stream, cudaCheck(cudaEventRecord(pl->fork, stream));
    for (int l = 1; l < PLAIN_LANES; l++) cudaCheck(cudaStreamWaitEvent(pl->lanes[l], pl->fork, 0));
}

static void plain_join(Plain* pl) {
    for (int l = 1; l < PLAIN_LANES; l++)
        cudaCheck(cudaEventRecord(pl->join, pl->lanes[l])), cudaCheck(cudaStreamWaitEvent(pl->lanes[0], pl->join, 0));
}

// The decoder's buffers from row `first` on: a --iwae lane's share of them.
typedef struct { void *z_input, *h3, *h3_parts; float *logits, *bce, *log_ratio; } DecoderRows;

static DecoderRows decoder_rows_from(const Plain* pl, size_t first) {
    const size_t t = pl->type_size, H3 = pl->dims.h3;
    DecoderRows d;
    d.z_input = (uint8_t*)pl->z_input + first * z_width(pl->precision, pl->dims.z) * t;
    d.h3 = (uint8_t*)pl->h3 + first * H3 * t;
    d.h3_parts = pl->h3_parts ? (uint8_t*)pl->h3_parts + first * FP16_PARTS * H3 * sizeof(fp16) : NULL;
    d.logits = pl->logits + first * INPUT_DIM, d.bce = pl->bce + first, d.log_ratio = pl->log_ratio + first;
    return d;
}

static void plain_encode(Plain* pl, const uint8_t* pixels, int B, cudaStream_t stream) {
    const long long n = (long long)B * INPUT_DIM;
    if (pl->parts) launch(pixels_to_input_kernel<fp16>, n / 4, 256, 256, stream, (fp16*)pl->x, pixels, n, 2);
    else launch(pixels_to_input_kernel<bf16>, n / 4, 256, 256, stream, (bf16*)pl->x, pixels, n, 1);
    gemm(pl->lt, pl->fc1, pl->h1, pl->x, B, stream);
    gemm(pl->lt, pl->fc2, pl->mulv, pl->h1, B, stream);
}

// f(T(), ZMAX) (a std::integral_constant): where the run-time precision and Z pick the kernels' template instances.
template <typename F> static void with_type_and_zmax(const Plain* pl, F f) {
    const std::integral_constant<int, LATENT_DIM> published;
    const std::integral_constant<int, MAX_LATENT> largest;
    const bool small = pl->dims.z == LATENT_DIM;
    if (pl->precision == PRECISION_BF16) small ? f(bf16(), published) : f(bf16(), largest);
    else small ? f(0.0f, published) : f(0.0f, largest);
}

static void plain_sample(Plain* pl, void* z_input, int rows, int K, const float* mulv, const float* eps,
                         uint32_t first_image, uint64_t seed, bool z_is_mu, float* z_out, float* kl, float* log_ratio,
                         cudaStream_t stream) {
    with_type_and_zmax(pl, [&](auto t, auto zmax) {
        typedef decltype(t) T;
        launch(sample_kernel<T, decltype(zmax)::value>, rows, SAMPLE_ROWS, SAMPLE_ROWS, stream, (T*)z_input, z_out,
               kl, log_ratio, mulv, eps, rows, pl->dims.z, K, first_image, seed, z_is_mu);
    });
}

static void plain_set_z(Plain* pl, const float* z, int rows, cudaStream_t stream) {
    with_type_and_zmax(pl, [&](auto t, auto zmax) {
        typedef decltype(t) T;
        launch(z_input_kernel<T, decltype(zmax)::value>, rows, 128, 128, stream, (T*)pl->z_input, z, rows, pl->dims.z);
    });
}

// fc4's input: h3, or in fp32 its fp16 parts (h3_parts).
static const void* fc4_input(const Plain* pl, const void* h3, void* h3_parts, int rows, cudaStream_t stream) {
    if (!pl->parts) return h3;
    const long long H3 = pl->dims.h3;
    launch(fp16_parts_kernel<false>, rows * H3, 256, 256, stream, (fp16*)h3_parts, (const float*)h3, (long long)rows,
           H3, 0);
    return h3_parts;
}

// t_logits (--iwae, bf16's ELBO where no one reads them): fc4_t writes the logits in T, in bf16 half the bytes.
// X: the pixels' bytes, or --iwae's weights (the BCE alone).
template <typename X>
static void plain_decode(Plain* pl, const DecoderRows& d, const X* pixels, int rows, int rows_per_image, float* bce,
                         float* recon, bool t_logits, cudaStream_t stream) {
    gemm(pl->lt, pl->fc3, d.h3, d.z_input, rows, stream);
    gemm(pl->lt, t_logits ? pl->fc4_t : pl->fc4, d.logits, fc4_input(pl, d.h3, d.h3_parts, rows, stream), rows, stream);
    const bool bce_only = recon == NULL && bce != NULL; // scoring only
    auto output = [&](auto l) { // L: the logits' type
        typedef decltype(l) L;
        auto kernel = decoder_output_kernel<float, L, 1, true, X>;
        if constexpr (std::is_same<X, uint8_t>::value) kernel = bce_only ? kernel : decoder_output_kernel<float, L>;
        launch(kernel, rows, 4, 128, stream, bce, recon, (float*)NULL, (const L*)d.logits, pixels, rows,
               rows_per_image);
    };
    if (t_logits && pl->precision == PRECISION_BF16) output(bf16());
    else output(0.0f);
}

static void plain_forward(Plain* pl, const uint8_t* pixels, int B, uint32_t first_image, const ForwardOptions* opt,
                          const Probe& probe, float* bce, float* kl, cudaStream_t stream) {
    const bool keep = probe.keep_activations;
    plain_encode(pl, pixels, B, stream);
    plain_sample(pl, pl->z_input, B, 1, pl->mulv, probe.eps, first_image, opt->seed, opt->z_is_mu,
                 keep ? pl->z : NULL, kl, NULL, stream);
    const bool t_logits = !keep && pl->precision == PRECISION_BF16; // the tests' activations keep fp32 logits
    plain_decode(pl, decoder_rows_from(pl, 0), pixels, B, 1, bce, opt->want_recon ? pl->recon : NULL, t_logits, stream);
}

// A --iwae pass on the decoder's rows from `first` on, in lane `lane`, against the group's images from `image` on.
static void plain_iwae_pass(Plain* pl, size_t first, int lane, int image, const float* mulv, const float* eps,
                            int rows, int K, uint32_t first_image, uint64_t seed) {
    const DecoderRows d = decoder_rows_from(pl, first);
    cudaStream_t stream = pl->lanes[lane];
    plain_sample(pl, d.z_input, rows, K, mulv, eps, first_image, seed, false, NULL, NULL, d.log_ratio, stream);
    plain_decode(pl, d, pl->pixel_weight + (size_t)image * INPUT_DIM, rows, K, d.bce, NULL, true, stream);
}

// AIS's gradient at w.z_input into chains.grad, and the BCE at a trajectory's ends (`energy`); between, logits in T.
template <typename T>
static void plain_ais_gradient(Plain* pl, const AisIO& io, const AisWork& w, int rows, bool energy) {
    typedef typename Backward<T>::type B;
    constexpr int PARTS = on_parts<T>() ? FP16_PARTS : 1;
    typedef typename std::conditional<on_parts<T>(), fp16, B>::type R; // the residual: fc4's backward's input
    gemm(pl->lt, pl->fc3, w.h3, w.z_input, rows, w.stream);
    gemm(pl->lt, energy ? pl->fc4 : pl->fc4_t, w.logits, fc4_input(pl, w.h3, w.h3_parts, rows, w.stream), rows,
         w.stream);
    if (energy)
        launch(decoder_output_kernel<R, float, PARTS>, rows, 4, 128, w.stream, w.chains.bce, (float*)NULL,
               (R*)w.residual, (const float*)w.logits, io.pixels, rows, io.chains);
    else launch(decoder_output_kernel<R, T, PARTS>, rows, 4, 128, w.stream, (float*)NULL, (float*)NULL,
                (R*)w.residual, (const T*)w.logits, io.pixels, rows, io.chains);
    gemm(pl->lt, pl->fc4_backward, w.dh, w.residual, rows, w.stream);
    const long long hidden = (long long)rows * pl->dims.h3;
    launch(relu_backward_kernel<B, T>, (hidden + 3) / 4, 256, 256, w.stream, (B*)w.dh, (const T*)w.h3, hidden);
    gemm(pl->lt, pl->fc3_backward, w.chains.grad, w.dh, rows, w.stream);
}

// Step s: 0 the chains' start and first gradient; 1 .. T - 1 the weight's term, then transition s; T the last term.
template <typename T, int ZMAX> static void plain_ais_step(Plain* pl, const AisIO& io, const AisWork& w, int s) {
    const int rows = io.n * io.chains;
    T* z_input = (T*)w.z_input;
    if (s == 0) {
        launch(ais_start_kernel<T, ZMAX>, rows, 128, 128, w.stream, io, w.chains, z_input);
        return plain_ais_gradient<T>(pl, io, w, rows, true);
    }
    launch(ais_begin_kernel<T, ZMAX>, rows, 128, 128, w.stream, io, w.chains, z_input, s);
    if (s == io.T) return;
    for (int l = 1; l <= io.leapfrog; l++) {
        plain_ais_gradient<T>(pl, io, w, rows, l == io.leapfrog);
        if (l < io.leapfrog)
            launch(ais_kick_kernel<T, ZMAX, false>, rows, 128, 128, w.stream, io, w.chains, z_input, s);
    }
    launch(ais_kick_kernel<T, ZMAX, true>, rows, 128, 128, w.stream, io, w.chains, z_input, s);
    launch(ais_adapt_kernel, io.n, 128, 128, w.stream, io, w.chains);
}

static AisIO ais_slice(AisIO io, int first, int n, int nz) {
    const size_t rows = (size_t)first * io.chains;
    io.n = n, io.first_image += (uint32_t)first;
    io.pixels += (size_t)first * INPUT_DIM, io.mulv += (size_t)first * 2 * nz;
    if (io.z_start) io.z_start += (size_t)first * nz;
    io.log_w += rows, io.accepted += rows, io.step_out += first;
    Probe& p = io.probe;
    if (p.z_out) p.z_out += rows * nz;
    if (p.grad0) p.grad0 += rows * nz, p.bce0 += rows;
    if (p.delta_h) p.delta_h += rows;
    if (p.p_start) p.p_start += rows * nz;
    if (p.proposal) p.proposal += rows * 2 * nz;
    return io;
}

static void plain_ais_alloc(Plain* pl) {
    const size_t R = PLAIN_AIS_ROWS, t = pl->type_size, Z = pl->dims.z, H3 = pl->dims.h3;
    const int zk = z_width(pl->precision, pl->dims.z);
    for (AisWork& w : pl->ais) {
        w.z_input = device_alloc(R * zk * t, "the AIS chains' fc3 input");
        w.h3 = device_alloc(R * H3 * t, "the AIS chains' h3");
        w.logits = (float*)device_alloc(R * INPUT_DIM * sizeof(float), "the AIS chains' logits");
        w.residual = device_alloc(R * INPUT_DIM * (pl->parts ? FP16_PARTS * sizeof(fp16) : t),
                                  "the AIS chains' sigmoid - x");
        w.h3_parts = pl->parts ? device_alloc(R * FP16_PARTS * H3 * sizeof(fp16), "the AIS chains' h3 parts") : NULL;
        w.dh = device_alloc(R * H3 * t, "the AIS chains' dh");
        const size_t floats = R * (4 * Z + z_pad(Z) + 3) + R; // z p z0 grad0 | grad | bce bce0 h0 | took
        float* f = (float*)device_alloc(floats * sizeof(float), "the AIS chains");
        AisChains& c = w.chains;
        c.z = f, c.p = f + R * Z, c.z0 = f + 2 * R * Z, c.grad0 = f + 3 * R * Z;
        c.grad = f + 4 * R * Z, c.bce = c.grad + R * z_pad(Z), c.bce0 = c.bce + R, c.h0 = c.bce0 + R;
        c.took = (int*)(c.h0 + R), c.nz = (int)Z;
    }
}

// AIS in parts of at most PLAIN_AIS_ROWS chains, a part a lane, so every lane always has work queued.
static void plain_ais(Plain* pl, const AisIO& io, cudaStream_t stream) {
    if (pl->ais[0].z_input == NULL) plain_ais_alloc(pl);
    const int parts = PLAIN_LANES * ceil_div(io.n, PLAIN_LANES * (PLAIN_AIS_ROWS / io.chains));
    const int images = ceil_div(io.n, parts);
    plain_fork(pl, stream); // the other lanes start after the encoder
    for (int k = 0; k < PLAIN_LANES; k++) pl->ais[k].stream = pl->lanes[k];
    for (int first = 0; first < io.n; first += PLAIN_LANES * images) {
        AisIO part[PLAIN_LANES];
        int count = 0;
        for (int at = first; at < io.n && count < PLAIN_LANES; at += images)
            part[count++] = ais_slice(io, at, io.n - at < images ? io.n - at : images, pl->dims.z);
        with_type_and_zmax(pl, [&](auto t, auto zmax) {
            for (int s = 0; s <= io.T; s++)
                for (int k = 0; k < count; k++)
                    plain_ais_step<decltype(t), decltype(zmax)::value>(pl, part[k], pl->ais[k], s);
        });
    }
    plain_join(pl);
}

// ---- the model's interface: one model, either engine ----------------------------------------------------------------
static const char* PRECISION_NAMES[] = {"fp32", "bf16"};

typedef enum { KERNELS_AUTO, KERNELS_PLAIN, KERNELS_FUSED } Kernels; // the engine; auto: fused wherever it runs
static const char* KERNELS_NAMES[] = {"auto", "plain", "fused"};

struct Fused; // the Hopper engine's state: the appendix after main
typedef struct {
    ModelDims dims;
    int max_batch;
    Precision precision;
    cudaStream_t stream;
    float* params;                    // one device allocation holding the fp32 tensors below
    const float* tensor[NUM_TENSORS]; // file order; fc22's rows and bias follow fc21's: one layer yields [mu | logvar]
    Plain* plain;                     // the engine: exactly one of the two
    Fused* fused;
    float *h1, *mulv, *z, *h3, *logits, *recon; // fp32, [max_batch][...] (h1, h3: fp32 runs only)
    int decoder_rows, bce_parts_per_row; // per decoder row: log p(z) - log q(z|x), BCE in column blocks' parts
    float *row_log_ratio, *bce_parts;
    float2* lse_partials; // the logsumexp's (max, sum) per chunk of LSE_CHUNK rows: 2 decoder_rows / LSE_CHUNK at most
    Probe probe;          // the tests' hooks, zero in the program
} VAE;

// The Hopper engine's entry points (the appendix). fused_init makes its state and points m's views at it.
static Fused* fused_init(VAE* m);
static void fused_free(Fused* f);
static void fused_encode(Fused* f, const uint8_t* pixels, int B);
static void fused_decode(Fused* f, const float* z, int B);
static void fused_forward(Fused* f, const uint8_t* pixels, int B, uint32_t first_image, const ForwardOptions* opt,
                          const Probe& probe, float* bce, float* kl);
static void fused_iwae_pass(Fused* f, const uint8_t* pixels, const float* mulv, const float* eps, int rows, int K,
                            uint32_t first_image, uint64_t seed);
static int fused_ais_images(const Fused* f, int C);
static void fused_ais(Fused* f, const AisIO& io);
static bool gpu_runs_sm90a_code(); // whether the code loaded for this GPU is sm_90a's
enum { FUSED_AIS_CHAINS = 128 };     // the most chains an image the fused AIS kernel holds (its AIS_ROWS)
enum { FUSED_SMEM_BYTES = 231976 }; // the most shared memory a fused block asks for (ais_kernel's in bf16)

static bool kernels_fit(Kernels kernels, ModelDims dims, Error* err) {
    if (kernels != KERNELS_FUSED || is_published(dims)) return true;
    return set_error(err, "--kernels fused: the fused kernels are built for the 784-400-20-400 model; this one is "
                     "784-%d-%d-%d. HINT: --kernels plain (or auto) runs every size", dims.h1, dims.z, dims.h3);
}

// The engine (auto: fused where it can run); false, with the reason, where asked-for fused kernels cannot run.
static bool pick_engine(Kernels kernels, ModelDims dims, int major, int minor, size_t smem_optin, bool fused_code,
                        bool* fused, Error* err) {
    if (!kernels_fit(kernels, dims, err)) return false;
    const bool can = fused_code && major == 9 && smem_optin >= FUSED_SMEM_BYTES && is_published(dims);
    if (kernels == KERNELS_FUSED && !can)
        return set_error(err, "--kernels fused: the fused kernels need an sm_90 GPU (H100, H200) and a binary with "
                         "sm_90a code; this is sm_%d%d%s. HINT: --kernels plain (or auto) runs every mode on any GPU",
                         major, minor, major == 9 ? " without that code (rebuild: make clean && make vae)" : "");
    *fused = can && kernels != KERNELS_PLAIN;
    return true;
}

static int gpu_attribute(cudaDeviceAttr attribute) {
    int device, value;
    cudaCheck(cudaGetDevice(&device)), cudaCheck(cudaDeviceGetAttribute(&value, attribute, device));
    return value;
}

static bool use_fused(Kernels kernels, ModelDims dims) {
    const int major = gpu_attribute(cudaDevAttrComputeCapabilityMajor);
    const int minor = gpu_attribute(cudaDevAttrComputeCapabilityMinor);
    const int smem = gpu_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
    const bool fused_code = kernels != KERNELS_PLAIN && is_published(dims) && gpu_runs_sm90a_code();
    bool fused = false;
    Error err;
    if (!pick_engine(kernels, dims, major, minor, (size_t)smem, fused_code, &fused, &err)) fail("%s", err.msg);
    return fused;
}

// The plain path's rows a pass: at most 2^18, and ~2 GB of buffers (a row ~7.5 KB in fp32 for H3 = 400, ~44 KB for
// 4,096, whose --iwae would otherwise need ~12 GB).
enum { PLAIN_DECODER_ROWS = 1 << 18 };
constexpr size_t PLAIN_DECODER_BYTES = (size_t)2 << 30;
static int plain_decoder_rows(ModelDims d, Precision precision, int asked) {
    const size_t t = precision == PRECISION_BF16 ? sizeof(bf16) : sizeof(float);
    const size_t parts = precision == PRECISION_FP32 ? FP16_PARTS * sizeof(fp16) * d.h3 : 0; // fp32's h3 parts
    const size_t row = (z_width(precision, d.z) + d.h3) * t + parts + INPUT_DIM * sizeof(float) + 2 * sizeof(float);
    return std::min({asked, (int)PLAIN_DECODER_ROWS, (int)(PLAIN_DECODER_BYTES / row)});
}

// max_batch: images a forward pass; decoder_rows: a --iwae pass's rows (a fused row costs at most 172 bytes).
static void vae_init(VAE* m, const HostWeights* w, int max_batch, Precision precision, Kernels kernels,
                     int decoder_rows = 0) {
    memset(m, 0, sizeof(*m)), m->dims = w->dims, m->max_batch = max_batch, m->precision = precision;
    cudaCheck(cudaStreamCreate(&m->stream));
    // device layout: fc1.w fc1.b | fc21.w fc22.w | fc21.b fc22.b | fc3.w fc3.b fc4.w fc4.b
    const int order[NUM_TENSORS] = {FC1_W, FC1_B, FC21_W, FC22_W, FC21_B, FC22_B, FC3_W, FC3_B, FC4_W, FC4_B};
    float* at = m->params = (float*)device_alloc(w->count * sizeof(float), "the weights");
    for (int t : order) {
        cudaCheck(cudaMemcpy(at, w->tensor[t], w->size[t] * sizeof(float), cudaMemcpyHostToDevice));
        m->tensor[t] = at, at += w->size[t];
    }
    if (use_fused(kernels, m->dims)) {
        m->decoder_rows = std::max(decoder_rows, max_batch);
        m->fused = fused_init(m);
    } else {
        const int rows = std::max(plain_decoder_rows(m->dims, precision, decoder_rows), max_batch);
        Plain* pl = m->plain = plain_init(m->tensor, m->dims, precision, max_batch, rows, m->stream);
        m->mulv = pl->mulv, m->z = pl->z, m->logits = pl->logits, m->recon = pl->recon;
        m->decoder_rows = rows, m->bce_parts = pl->bce, m->bce_parts_per_row = 1, m->row_log_ratio = pl->log_ratio;
        if (precision == PRECISION_FP32) m->h1 = (float*)pl->h1, m->h3 = (float*)pl->h3;
    }
    // K > LSE_CHUNK samples an image: decoder_rows / K images of at most 2 K / LSE_CHUNK chunks
    m->lse_partials = (float2*)device_alloc((2 * (size_t)m->decoder_rows / LSE_CHUNK + 1) * sizeof(float2),
                                            "the logsumexp's partials");
    cudaCheck(cudaStreamSynchronize(m->stream));
}

static void vae_free(VAE* m) {
    if (m->fused) fused_free(m->fused);
    if (m->plain) plain_free(m->plain);
    cudaCheck(cudaFree(m->lse_partials)), cudaCheck(cudaFree(m->params));
    cudaCheck(cudaStreamDestroy(m->stream)), memset(m, 0, sizeof(*m));
}

// vae_encode gives m->mulv, vae_decode m->recon, vae_forward BCE and KL: on m->stream, allocating and copying nothing.
static void vae_encode(VAE* m, const uint8_t* pixels, int B) {
    if (m->fused) return fused_encode(m->fused, pixels, B);
    plain_encode(m->plain, pixels, B, m->stream);
}

static void vae_decode(VAE* m, const float* z, int B) {
    if (m->fused) return fused_decode(m->fused, z, B);
    plain_set_z(m->plain, z, B, m->stream);
    const uint8_t* no_pixels = NULL;
    plain_decode(m->plain, decoder_rows_from(m->plain, 0), no_pixels, B, 1, NULL, m->recon, false, m->stream);
}

static void vae_decode_interpolations(VAE* m, const int2* d_pairs, long long first_row, int rows, int steps) {
    launch(interp_latents_kernel, (long long)rows * m->dims.z, 256, 256, m->stream, m->z, m->mulv, d_pairs, first_row,
           rows, steps, m->dims.z);
    vae_decode(m, m->z, rows);
}

static void vae_forward(VAE* m, const uint8_t* pixels, int B, uint32_t first_image, const ForwardOptions* opt,
                        float* bce, float* kl) {
    if (B < 1 || B > m->max_batch) fail("internal: batch %d outside 1..%d", B, m->max_batch);
    if (m->fused) return fused_forward(m->fused, pixels, B, first_image, opt, m->probe, bce, kl);
    plain_forward(m->plain, pixels, B, first_image, opt, m->probe, bce, kl, m->stream);
}

// The lanes a --iwae pass alternates between (the plain engine's, where a lane's share of the rows holds K), and the
// rows each: a multiple of 8 rows, so that every lane's buffers start 16-byte aligned.
static int vae_iwae_lanes(const VAE* m, int K) {
    return m->plain && m->decoder_rows / PLAIN_LANES / 8 * 8 >= K ? PLAIN_LANES : 1;
}
static int vae_iwae_lane_rows(const VAE* m, int K) {
    return vae_iwae_lanes(m, K) == 1 ? m->decoder_rows : m->decoder_rows / PLAIN_LANES / 8 * 8;
}

// IWAE's log p(x), K samples an image: the n x K rows in passes of as many images as a lane's rows hold.
static void vae_iwae(VAE* m, const uint8_t* pixels, int n, uint32_t first_image, int K, uint64_t seed, float* log_px) {
    if (K < 1 || K > m->decoder_rows) fail("internal: %d samples per image outside 1..%d", K, m->decoder_rows);
    const int images_per_pass = vae_iwae_lane_rows(m, K) / K, lanes = vae_iwae_lanes(m, K);
    const size_t lane_rows = vae_iwae_lane_rows(m, K);
    int pass = 0;
    // The encoder runs over as many images as m->mulv holds: a pass's few (13 at K = 5000) would not fill the GPU.
    for (int group = 0; group < n; group += m->max_batch) {
        const int group_size = n - group < m->max_batch ? n - group : m->max_batch;
        const long long group_pixels = (long long)group_size * INPUT_DIM;
        vae_encode(m, pixels + (size_t)group * INPUT_DIM, group_size);
        if (m->plain) { // the group's pixel weights, then the lanes
            float*& weights = m->plain->pixel_weight;
            const size_t bytes = (size_t)m->max_batch * INPUT_DIM * sizeof(float);
            if (!weights) weights = (float*)device_alloc(bytes, "the pixel weights");
            launch(pixel_weight_kernel, group_pixels, 256, 256, m->stream, weights, pixels + (size_t)group * INPUT_DIM,
                   group_pixels);
            plain_fork(m->plain, m->stream);
        }
        for (int first = group; first < group + group_size; first += images_per_pass, pass++) {
            const int images = std::min(group + group_size - first, images_per_pass), rows = images * K;
            const int lane = pass % lanes;
            const size_t row0 = lane * lane_rows;
            const uint32_t image = first_image + (uint32_t)first;
            const uint8_t* x = pixels + (size_t)first * INPUT_DIM;
            const float* mulv = m->mulv + (size_t)(first - group) * 2 * m->dims.z;
            const float* eps = m->probe.eps ? m->probe.eps + (size_t)first * K * m->dims.z : NULL;
            if (m->fused) fused_iwae_pass(m->fused, x, mulv, eps, rows, K, image, seed);
            else plain_iwae_pass(m->plain, row0, lane, first - group, mulv, eps, rows, K, image, seed);
            cudaStream_t stream = m->plain ? m->plain->lanes[lane] : m->stream;
            // a lane's partials: at most 2 lane_rows / LSE_CHUNK (above), so the lanes' stay apart
            float2* partials = m->lse_partials + row0 / LSE_CHUNK * 2;
            const int chunks = ceil_div(K, LSE_CHUNK);
            launch(iwae_logsumexp_kernel, (long long)images * chunks, 1, LSE_THREADS, stream, log_px + first, partials,
                   m->bce_parts + row0 * m->bce_parts_per_row, m->bce_parts_per_row, m->row_log_ratio + row0, K);
            if (chunks > 1) launch(iwae_merge_kernel, images, 128, 128, stream, log_px + first, partials, images, K);
        }
        if (m->plain) plain_join(m->plain);
    }
}

// Wu et al.'s sigmoid schedule, scaled to 0 .. 1: dense at both ends, where f_b changes fastest.
static void ais_schedule(double* beta, int T) {
    const double s0 = 1.0 / (1.0 + exp(4.0)), s1 = 1.0 / (1.0 + exp(-4.0));
    for (int t = 0; t <= T; t++) beta[t] = (1.0 / (1.0 + exp(-4.0 * (2.0 * t / T - 1.0))) - s0) / (s1 - s0);
    beta[0] = 0.0, beta[T] = 1.0;
}

// Images one vae_ais call takes: a round of the fused kernel's clusters, or the plain path's lanes' sets of chains.
static int vae_ais_round(const VAE* m, int C) {
    const int round = m->fused ? fused_ais_images(m->fused, C) : PLAIN_LANES * (PLAIN_AIS_ROWS / C);
    if (round == 0) fail("the fused AIS kernel fits no cluster on this GPU. HINT: --kernels plain runs --ais anywhere");
    return round < m->max_batch ? round : m->max_batch;
}

// AIS over io.n images from p0 = q(z|x) (the encoder's) or N(0, I); the caller fills in the rest of io.
static void vae_ais(VAE* m, AisIO io, bool from_prior) {
    if (io.n < 1 || io.n > m->max_batch) fail("internal: %d AIS images outside 1..%d", io.n, m->max_batch);
    if (from_prior) cudaCheck(cudaMemsetAsync(m->mulv, 0, (size_t)io.n * 2 * m->dims.z * sizeof(float), m->stream));
    else vae_encode(m, io.pixels, io.n);
    io.mulv = m->mulv, io.probe = m->probe;
    if (m->fused) return fused_ais(m->fused, io);
    plain_ais(m->plain, io, m->stream);
}

// ---- file formats: the weights file written by prepare_weights.py, MNIST idx files, PGM images ----------------------
template <typename T> static bool host_copy(T** out, const void* src, size_t count, const char* name, Error* err) {
    *out = (T*)malloc(count * sizeof(T));
    if (*out == NULL) return set_error(err, "%s: out of host memory", name);
    memcpy(*out, src, count * sizeof(T));
    return true;
}

static bool parse_weights(const uint8_t* buf, size_t size, const char* name, HostWeights* w, Error* err) {
    const size_t header_bytes = HEADER_INTS * sizeof(int32_t);
    if (size < header_bytes)
        return set_error(err, "%s: %zu bytes, shorter than the %zu-byte header. " WEIGHTS_HINT, name, size,
                         header_bytes);
    int32_t magic = read_le32(buf), version = read_le32(buf + 4);
    if (magic != WEIGHTS_MAGIC)
        return set_error(err, "%s: bad magic 0x%08x, not a vae.cu weights file. " CHECKPOINT_HINT, name,
                         (unsigned)magic);
    if (version != WEIGHTS_VERSION)
        return set_error(err, "%s: version %d, this program reads version %d. " WEIGHTS_HINT, name, version,
                         WEIGHTS_VERSION);
    const int32_t in = read_le32(buf + 8); // the sizes; fc3's units at header[8]
    const ModelDims dims = {read_le32(buf + 12), read_le32(buf + 16), read_le32(buf + 32)};
    if (in != INPUT_DIM || dims.h1 < 1 || dims.h1 > MAX_HIDDEN || dims.z < 1 || dims.z > MAX_LATENT || dims.h3 < 1 ||
        dims.h3 > MAX_HIDDEN)
        return set_error(err, "%s: a %d-%d-%d-%d VAE; vae.cu evaluates 784-H1-Z-H3 with H1 and H3 in 1..%d and Z in "
                         "1..%d. " CHECKPOINT_HINT, name, in, dims.h1, dims.z, dims.h3, MAX_HIDDEN, MAX_LATENT);
    int32_t dtype = read_le32(buf + 20), num_tensors = read_le32(buf + 24), total = read_le32(buf + 28);
    size_t expected = 0;
    for (int i = 0; i < NUM_TENSORS; i++) expected += tensor_size(dims, i);
    if (dtype != DTYPE_FLOAT32 || num_tensors != NUM_TENSORS || total < 0 || (size_t)total != expected)
        return set_error(err, "%s: header says dtype %d, %d tensors, %d floats; expected dtype %d, %d tensors, %zu "
                         "floats. " WEIGHTS_HINT, name, dtype, num_tensors, total, DTYPE_FLOAT32, NUM_TENSORS,
                         expected);
    if (size != header_bytes + expected * sizeof(float))
        return set_error(err, "%s: %zu bytes, the header promises %zu (truncated or padded). " WEIGHTS_HINT, name, size,
                         header_bytes + expected * sizeof(float));
    w->count = expected, w->dims = dims;
    if (!host_copy(&w->data, buf + header_bytes, expected, name, err)) return false;
    for (int t = 0; t < NUM_TENSORS; t++) {
        w->size[t] = tensor_size(dims, t), w->tensor[t] = t == 0 ? w->data : w->tensor[t - 1] + w->size[t - 1];
        for (size_t i = 0; i < w->size[t]; i++)
            if (!isfinite(w->tensor[t][i])) {
                set_error(err, "%s: %s[%zu] is %f; the weights must be finite. " WEIGHTS_HINT, name, TENSOR_NAMES[t], i,
                          w->tensor[t][i]);
                free(w->data), w->data = NULL;
                return false;
            }
    }
    return true;
}

typedef struct { int count; uint8_t* pixels; } Images; // pixels: [count][784], row-major 28x28 per image
typedef struct { int count; uint8_t* labels; } Labels; // labels: [count], 0..9
// idx format: big-endian magic 0x0000 08 NN (unsigned bytes, NN dims), NN big-endian sizes, data.
static bool parse_idx_images(const uint8_t* buf, size_t size, const char* name, Images* out, Error* err) {
    if (size < 16)
        return set_error(err, "%s: %zu bytes, shorter than the 16-byte idx3 header. " PREPARE_HINT, name, size);
    uint32_t magic = read_be32(buf), count = read_be32(buf + 4), rows = read_be32(buf + 8), cols = read_be32(buf + 12);
    if (magic != 0x00000803)
        return set_error(err, "%s: magic 0x%08x, expected 0x00000803 (idx3 unsigned bytes). " PREPARE_HINT, name,
                         magic);
    if (rows != IMAGE_SIDE || cols != IMAGE_SIDE)
        return set_error(err, "%s: images are %ux%u, the model takes %dx%d. " PREPARE_HINT, name, rows, cols,
                         IMAGE_SIDE, IMAGE_SIDE);
    if (count == 0 || count > INT32_MAX)
        return set_error(err, "%s: header claims %u images. " PREPARE_HINT, name, count);
    size_t expected = 16 + (size_t)count * INPUT_DIM; // count < 2^31, so no overflow in 64 bits
    if (size != expected)
        return set_error(err, "%s: header claims %u images (%zu bytes) but the file holds %zu bytes. " PREPARE_HINT,
                         name, count, expected, size);
    out->count = (int)count;
    return host_copy(&out->pixels, buf + 16, expected - 16, name, err);
}

static bool parse_idx_labels(const uint8_t* buf, size_t size, const char* name, Labels* out, Error* err) {
    if (size < 8)
        return set_error(err, "%s: %zu bytes, shorter than the 8-byte idx1 header. " PREPARE_HINT, name, size);
    uint32_t magic = read_be32(buf), count = read_be32(buf + 4);
    if (magic != 0x00000801)
        return set_error(err, "%s: magic 0x%08x, expected 0x00000801 (idx1 unsigned bytes). " PREPARE_HINT, name,
                         magic);
    if (count == 0 || count > INT32_MAX || size != 8 + (size_t)count)
        return set_error(err, "%s: header claims %u labels but the file holds %zu. " PREPARE_HINT, name, count,
                         size - 8);
    for (uint32_t i = 0; i < count; i++)
        if (buf[8 + i] > 9)
            return set_error(err, "%s: label %u is %d, not a digit. " PREPARE_HINT, name, i, buf[8 + i]);
    out->count = (int)count;
    return host_copy(&out->labels, buf + 8, count, name, err);
}

// Netpbm greymap, P5 (bytes; two, big-endian, above maxval 255) or P2 (decimal), '#' comments; rescaled to 0..255.
#define PGM_HINT \
    "HINT: convert it with ImageMagick: convert DIGIT.png -colorspace Gray -resize '28x28!' -depth 8 digit.pgm"
static bool pgm_number(const uint8_t* buf, size_t size, size_t* pos, uint32_t max, uint32_t* out) {
    size_t p = *pos;
    while (p < size && (isspace(buf[p]) || buf[p] == '#'))
        if (buf[p++] == '#')
            while (p < size && buf[p] != '\n' && buf[p] != '\r') p++;
    if (p == size || !isdigit(buf[p])) return false;
    uint64_t v = 0;
    while (p < size && isdigit(buf[p]) && v <= max) v = v * 10 + (buf[p++] - '0');
    if (v > max || (p < size && !isspace(buf[p]) && buf[p] != '#')) return false;
    *pos = p, *out = (uint32_t)v;
    return true;
}

static bool parse_pgm(const uint8_t* buf, size_t size, const char* name, Images* out, Error* err) {
    if (size < 2 || buf[0] != 'P' || (buf[1] != '5' && buf[1] != '2'))
        return set_error(err, "%s: not a PGM greymap (P5 or P2). " PGM_HINT, name);
    const bool ascii = buf[1] == '2';
    size_t pos = 2;
    uint32_t width, height, maxval;
    if (!pgm_number(buf, size, &pos, 1u << 20, &width) || !pgm_number(buf, size, &pos, 1u << 20, &height) ||
        !pgm_number(buf, size, &pos, 65535, &maxval) || maxval == 0)
        return set_error(err, "%s: the PGM header (width, height, maxval 1..65535) is malformed. " PGM_HINT, name);
    if (width != IMAGE_SIDE || height != IMAGE_SIDE)
        return set_error(err, "%s: a %ux%u image; the model takes %dx%d. " PGM_HINT, name, width, height, IMAGE_SIDE,
                         IMAGE_SIDE);
    uint8_t pixels[INPUT_DIM];
    const size_t bytes_per_sample = maxval > 255 ? 2 : 1;
    if (!ascii) {
        if (pos == size || !isspace(buf[pos]) || size - pos - 1 < INPUT_DIM * bytes_per_sample)
            return set_error(err, "%s: truncated: %zu bytes of samples, a 28x28 image needs %zu. " PGM_HINT, name,
                             pos == size ? 0 : size - pos - 1, INPUT_DIM * bytes_per_sample);
        pos++; // the single whitespace byte that ends the header
    }
    for (int i = 0; i < INPUT_DIM; i++) {
        uint32_t v;
        if (ascii) {
            if (!pgm_number(buf, size, &pos, maxval, &v))
                return set_error(err, "%s: sample %d is missing or above maxval %u. " PGM_HINT, name, i, maxval);
        } else {
            v = bytes_per_sample == 2 ? (uint32_t)buf[pos] << 8 | buf[pos + 1] : buf[pos], pos += bytes_per_sample;
            if (v > maxval)
                return set_error(err, "%s: sample %d is %u, above maxval %u. " PGM_HINT, name, i, v, maxval);
        }
        pixels[i] = (uint8_t)((v * 255 + maxval / 2) / maxval);
    }
    for (; pos < size; pos++) // a trailing newline is common; anything else is not one 28x28 image
        if (!isspace(buf[pos]))
            return set_error(err, "%s: %zu bytes after the 28x28 image. HINT: pass one image per file", name,
                             size - pos);
    out->count = 1;
    return host_copy(&out->pixels, pixels, INPUT_DIM, name, err);
}

template <typename T>
static bool load_file(const char* path, bool (*parse)(const uint8_t*, size_t, const char*, T*, Error*), T* out,
                      Error* err, const char* missing_hint = PREPARE_HINT) {
    uint8_t* buf = NULL;
    size_t size = 0;
    if (!read_file(path, &buf, &size, err, missing_hint)) return false;
    bool ok = parse(buf, size, path, out, err);
    free(buf);
    return ok;
}

// ---- image output ---------------------------------------------------------------------------------------------------
// Tiles (28x28 floats in [0,1]) as a rows x cols grid in a binary PPM, white on black, with 1-pixel grey borders.
static bool write_ppm_grid(const char* path, const char* what, const float* tiles, int rows, int cols, Error* err) {
    const int cell = IMAGE_SIDE + 1, width = cols * cell + 1, height = rows * cell + 1;
    uint8_t* rgb = (uint8_t*)malloc((size_t)width * height * 3);
    if (rgb == NULL) return set_error(err, "%s: out of host memory", path);
    memset(rgb, 96, (size_t)width * height * 3);
    for (int t = 0; t < rows * cols; t++) {
        const int x0 = (t % cols) * cell + 1, y0 = (t / cols) * cell + 1;
        for (int y = 0; y < IMAGE_SIDE; y++)
            for (int x = 0; x < IMAGE_SIDE; x++) {
                const float v = fminf(fmaxf(tiles[(size_t)t * INPUT_DIM + y * IMAGE_SIDE + x], 0.0f), 1.0f);
                uint8_t* px = rgb + ((size_t)(y0 + y) * width + x0 + x) * 3;
                px[0] = px[1] = px[2] = (uint8_t)lrintf(v * 255.0f);
            }
    }
    FILE* f = output_open(path, what);
    bool ok = f != NULL && fprintf(f, "P6\n%d %d\n255\n", width, height) > 0 &&
              fwrite(rgb, 3, (size_t)width * height, f) == (size_t)width * height;
    if (f != NULL && fclose(f) != 0) ok = false;
    const int saved_errno = errno;
    free(rgb);
    return ok || set_error(err, "%s: cannot write (%s). HINT: pass -o with a writable folder", path,
                           strerror(saved_errno));
}

// ---- command line ---------------------------------------------------------------------------------------------------
#define VAE_VERSION "1.0"
#ifndef VAE_GIT_COMMIT // the Makefile passes the checkout's commit
#define VAE_GIT_COMMIT "unknown"
#endif
// The plain path runs from sm_75 on (its kernels take at most 48 KB of shared memory); bf16 needs sm_80's tensor cores.
static bool gpu_supported(const char* name, int major, int minor, Precision precision, Error* err) {
    if (major * 10 + minor < 75)
        return set_error(err, "%s has compute capability %d.%d; vae.cu needs 7.5 or newer (T4, RTX 20xx and later). "
                         "HINT: run on a newer NVIDIA GPU", name, major, minor);
    if (precision == PRECISION_BF16 && major < 8)
        return set_error(err, "%s (sm_%d%d) has no bf16 tensor cores; --precision bf16 needs sm_80 or newer. HINT: "
                         "--precision fp32", name, major, minor);
    return true;
}

static bool no_gpu_error(cudaError_t status, int driver, int runtime, Error* err) {
    const char* lead = "no CUDA device available";
    if (driver == 0)
        return set_error(err, "%s: this machine has no NVIDIA driver (libcuda.so.1 was not found). HINT: run on a "
                         "machine with an NVIDIA GPU and its driver installed (nvidia-smi then lists the GPU)", lead);
    if (status == cudaErrorInsufficientDriver || driver < runtime)
        return set_error(err, "%s: the NVIDIA driver supports CUDA up to %d.%d; this vae was built with CUDA %d.%d. "
                         "HINT: update the NVIDIA driver, or rebuild with a CUDA toolkit of %d.%d or older", lead,
                         driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10, driver / 1000,
                         driver % 1000 / 10);
    return set_error(err, "%s (%s). HINT: run on a machine with an NVIDIA GPU (nvidia-smi lists the GPUs its driver "
                     "sees)", lead, status != cudaSuccess ? cudaGetErrorString(status) : "0 devices");
}

typedef enum { MODE_ELBO, MODE_IWAE, MODE_BENCH, MODE_INTERP, MODE_AIS, MODE_BDMC } Mode;
static const char* MODE_NAMES[] = {"elbo", "iwae", "bench", "interp", "ais", "bdmc"};

static void set_out_of_memory_hint(Mode mode, int batch) {
    const char* fixed_size = "this mode's buffers have a fixed size: free the GPU's memory (nvidia-smi lists the "
                             "processes that hold it) or choose another GPU with --devices";
    if (mode == MODE_ELBO) snprintf(out_of_memory_hint, sizeof(out_of_memory_hint), "use a -b below %d", batch);
    else snprintf(out_of_memory_hint, sizeof(out_of_memory_hint), "%s",
                  mode == MODE_BENCH ? "pass smaller --bench-batches" : fixed_size);
}

enum Option {
    OPT_WEIGHTS, OPT_DATA, OPT_IMAGE, OPT_INVERT, OPT_COUNT, OPT_BATCH, OPT_SEED, OPT_ZMU, OPT_PRECISION, OPT_OUT,
    OPT_CSV, OPT_QUIET, OPT_IWAE, OPT_BENCH, OPT_BENCH_BATCHES, OPT_INTERP, OPT_AIS, OPT_CHAINS, OPT_LEAPFROG,
    OPT_AIS_INIT, OPT_AIS_IWAE, OPT_BDMC, OPT_KERNELS, OPT_SHARD, OPT_DEVICES, OPT_VERSION, OPT_HELP, NUM_OPTIONS
};

static const struct { const char* name; char letter; bool takes_value; } OPTIONS[NUM_OPTIONS] = {
    {"weights", 'w', true}, {"data", 'd', true},         {"image", 0, true},          {"invert", 0, false},
    {"count", 'n', true},   {"batch-size", 'b', true},   {"seed", 's', true},         {"zmu", 0, false},
    {"precision", 0, true}, {"out", 'o', true},          {"csv", 0, true},            {"quiet", 'q', false},
    {"iwae", 0, true},      {"bench", 0, false},         {"bench-batches", 0, true},  {"interp", 0, true},
    {"ais", 0, true},       {"chains", 0, true},         {"leapfrog", 0, true},       {"ais-init", 0, true},
    {"ais-iwae", 0, false}, {"bdmc", 0, true},           {"kernels", 0, true},        {"shard", 0, true},
    {"devices", 0, true},   {"version", 0, false},       {"help", 'h', false},
};

#define OPT_BIT(o) (1u << (o))
// The options each mode reads; any other given with it is refused, not ignored (--kernels: every mode, in parse_args).
#define O(name) OPT_BIT(OPT_##name)
constexpr unsigned COMMON = O(WEIGHTS) | O(PRECISION) | O(DEVICES) | O(QUIET);
constexpr unsigned IMAGES = O(DATA) | O(IMAGE) | O(INVERT) | O(COUNT);
constexpr unsigned AIS_RUN = O(AIS) | O(CHAINS) | O(LEAPFROG) | O(AIS_INIT) | O(SEED);
static const unsigned MODE_OPTIONS[] = {
    COMMON | IMAGES | O(BATCH) | O(SEED) | O(ZMU) | O(OUT) | O(CSV) | O(SHARD), // elbo: the evaluation, images, CSV
    // iwae: sizes its own passes (no -b), writes no images (no -o), samples z (no --zmu)
    COMMON | IMAGES | O(SEED) | O(CSV) | O(IWAE) | O(SHARD),
    COMMON | O(DATA) | O(COUNT) | O(SEED) | O(ZMU) | O(BENCH) | O(BENCH_BATCHES),
    COMMON | O(DATA) | O(OUT) | O(INTERP), // interp: decodes latent means (no noise), writes interp.ppm
    // ais: the chains sample their own z (no --zmu) in launches it sizes (no -b), writes no images
    COMMON | IMAGES | O(CSV) | AIS_RUN | O(AIS_IWAE) | O(SHARD),
    COMMON | AIS_RUN | O(BDMC), // bdmc: simulates its own images (no inputs but the weights)
};

#undef O
enum { MAX_IMAGE_FILES = 256, MAX_BENCH_BATCHES = 16, MAX_DEVICES = 64 };
typedef struct {
    Mode mode;
    const char *weights_path, *data_dir;
    const char* image_paths[MAX_IMAGE_FILES]; // --image: evaluated instead of the test set
    int num_image_files;
    bool invert;
    const char *out_dir, *csv_path; // csv_path NULL: no per-image CSV; "-": standard output
    int batch, count;               // count: images to evaluate; 0 = all
    uint64_t seed;
    bool z_is_mu;
    Precision precision;
    Kernels kernels;
    bool quiet;
    int iwae_k, interp_n; // --iwae: samples per image; --interp: images whose every pair is interpolated
    int ais_t, chains, leapfrog; // --ais: intermediate distributions, chains per image, leapfrog steps
    bool ais_from_prior;         // --ais-init prior: p0 = N(0, I) instead of q(z|x)
    bool ais_iwae;               // --ais-iwae: also IWAE with as many decoder evaluations as AIS made
    int bdmc_n;                  // --bdmc: simulated images
    int shard, num_shards;       // --shard K/N: block K of N of the images (N = 0: all of them)
    int devices[MAX_DEVICES], num_devices; // --devices: the GPUs the run spreads over (0: GPU 0 alone)
    bool all_devices;                      // --devices all: every GPU of the machine (main lists them)
    int bench_batches[MAX_BENCH_BATCHES], num_bench_batches;
    bool help, version;
    unsigned given;                 // OPT_BIT of every option on the command line
    char flag[NUM_OPTIONS][24];     // each as it was spelled there ("-b" or "--batch-size"), for messages
} Config;

static const char* USAGE =
    "usage: vae [options]\n"
    "Evaluates the pretrained MNIST VAE on the test set (mean BCE, KL, loss = BCE + KL) and writes\n"
    "recon.ppm, samples.ppm and interp.ppm. Values go as '-b 64', '--batch-size 64' or '--batch-size=64';\n"
    "'--' ends the options.\n"
    "inputs\n"
    "  -w, --weights FILE   weights file (default data/vae_weights.bin)\n"
    "  -d, --data DIR       folder with t10k-images-idx3-ubyte, or .gz as MNIST ships it (default data);\n"
    "                       t10k-labels-idx1-ubyte[.gz] beside it is optional (label -1 without it)\n"
    "      --image FILE     instead of the test set: a 28x28 PGM (P5 or P2), a white digit on black as\n"
    "                       in MNIST; repeat for more; each is printed with its losses\n"
    "      --invert         the --image files are black on white\n"
    "  -n, --count N        evaluate the first N images, 1 or more (default all)\n"
    "      --shard K/N      of those, the K-th of N contiguous blocks (K = 0..N-1), for a cluster's array\n"
    "                       jobs: --csv rows keep their index among all; no pictures\n"
    "evaluation\n"
    "  -b, --batch-size N   images per forward pass, 1..1048576 (default 4096)\n"
    "  -s, --seed N         seed of the noise eps, 0..2^64-1 (default 0)\n"
    "      --zmu            use z = mu instead of sampling z\n"
    "      --precision P    fp32 (default): within 1e-5 of float64; bf16 (sm_80 on): 2-3x faster, ~1e-2\n"
    "      --kernels K      auto (default): fused where they run (H100, H200; sm_90a code), else plain;\n"
    "                       plain: cuBLASLt and short kernels (sm_75 on); fused: TMA and clusters\n"
    "      --devices L      the GPUs to spread the images over: all, or a list like 0,1 (default 0); on\n"
    "                       GPUs of one model the results are one GPU's, byte for byte\n"
    "outputs\n"
    "  -o, --out DIR        folder for the images (default out; made with its parents if missing)\n"
    "      --csv FILE       also write per-image results (index, label, the mode's values) after a '#'\n"
    "                       line naming the run; '-' writes them to stdout and the summary to stderr\n"
    "  -q, --quiet          results and errors only: no start-up table, progress or 'wrote' lines\n"
    "other runs, instead of the evaluation\n"
    "      --iwae K         importance-weighted log p(x), K samples per image (1..65536): mean NLL, its\n"
    "                       standard error, time, beside the ELBO; --csv adds per-image log p(x)\n"
    "      --bench          time forward+loss per batch size (latency, throughput) on the first GPU, in\n"
    "                       each precision and engine that runs, or those --precision and --kernels name\n"
    "      --bench-batches L  --bench's batch sizes, comma-separated (default 1024,2048,4096,10000)\n"
    "      --interp N       every pair of the first N test images (2..1000), 11 steps each, decoded\n"
    "                       batched and one pair per call: both times; the first pairs in interp.ppm\n"
    "      --ais T          log p(x) by annealed importance sampling over T distributions (1..100000), HMC\n"
    "                       in the latent space: mean NLL, acceptance, time, beside the ELBO\n"
    "      --chains C       --ais: chains per image (1..256, default 16; above 128 on the plain path)\n"
    "      --leapfrog L     --ais: leapfrog steps per HMC transition (1..1000, default 10; 1 is MALA)\n"
    "      --ais-init P     --ais: start from q (the encoder's q(z|x), default) or prior (N(0, I))\n"
    "      --ais-iwae       --ais: also IWAE with as many decoder evaluations (defaults: K = 159,856)\n"
    "      --bdmc N         with --ais T: N simulated images (z ~ p(z), x ~ p(x|z), binary), forward AIS\n"
    "                       (a lower bound of log p(x)) and reverse AIS from the true z (an upper bound)\n"
    "      --version        version, commit, CUDA runtime and driver\n"
    "  -h, --help           this help\n";
// A whole number in min..max. Digits only: "0x10", "1e3", " 5" and "+5" are refused.
static bool parse_number(const char* flag, const char* text, unsigned long long min, unsigned long long max,
                         unsigned long long* out, Error* err) {
    if (text == NULL || text[0] == '\0')
        return set_error(err, "%s needs a value. HINT: vae -h lists the options", flag);
    const char* digits = text[0] == '-' ? text + 1 : text;
    const bool whole = digits[0] != '\0' && digits[strspn(digits, "0123456789")] == '\0';
    if (!whole) return set_error(err, "%s '%s' is not a whole number. HINT: vae -h lists the options", flag, text);
    errno = 0;
    const unsigned long long v = strtoull(digits, NULL, 10);
    if (text[0] == '-' || errno == ERANGE || v < min || v > max)
        return set_error(err, "%s %s is outside %llu..%llu. HINT: vae -h lists the options", flag, text, min, max);
    *out = v;
    return true;
}

enum { MAX_BATCH = 1 << 20 }; // 1M images of activations is ~7 GB: a sane upper bound
enum { MAX_SHARDS = 100000 };  // --shard's N as parsed; main refuses an N above the number of images
enum { MAX_PATH_ARG = 4000 }; // paths are joined in 4096-byte buffers: a longer one would be cut and name another file
enum { IWAE_ROWS = 1 << 16 };  // --iwae's largest K, and the images its encoder takes at once
enum { IWAE_PASS_ROWS = 1 << 21 }; // rows per decoder pass (at most 172 bytes each: z row, BCE parts, log ratio)
enum { INTERP_MAX_IMAGES = 1000, INTERP_STEPS = 11 }; // t = 0, 0.1, ..., 1
enum { AIS_MAX_T = 100000, AIS_MAX_CHAINS = 256, AIS_MAX_LEAPFROG = 1000, BDMC_MAX_IMAGES = 100000 };
static bool parse_path(const char* flag, const char* value, const char** out, Error* err) {
    if (value[0] == '\0') return set_error(err, "%s needs a value. HINT: vae -h lists the options", flag);
    if (strlen(value) > MAX_PATH_ARG)
        return set_error(err, "%s: a path of %zu characters, longer than %d. HINT: use a shorter path", flag,
                         strlen(value), (int)MAX_PATH_ARG);
    return *out = value, true;
}

static bool parse_int(const char* flag, const char* text, int min, int max, int* out, Error* err) {
    unsigned long long v = 0;
    return parse_number(flag, text, min, max, &v, err) ? (*out = (int)v, true) : false;
}

template <typename E, int N>
static bool parse_choice(const char* flag, const char* value, const char* const (&names)[N], E* out, Error* err) {
    char list[64] = "";
    for (int i = 0; i < N; i++) {
        if (!strcmp(value, names[i])) return *out = (E)i, true;
        strcat(strcat(list, i == 0 ? "" : i + 1 < N ? ", " : " or "), names[i]);
    }
    return set_error(err, "%s needs %s, got '%s'. HINT: vae -h lists the options", flag, list, value);
}

static bool parse_int_list(const char* flag, const char* value, char separator, int min, int max, int* out,
                           int max_count, int* count, const char* what, Error* err) {
    const char separators[2] = {separator, '\0'};
    *count = 0;
    for (const char* item = value;; item++) {
        char text[24];
        const size_t len = strcspn(item, separators);
        snprintf(text, sizeof(text), "%.*s", (int)(len < sizeof(text) - 1 ? len : sizeof(text) - 1), item);
        const size_t sign = text[0] == '-'; // "-1" is a number out of range, as parse_int says
        if (*count == max_count || len >= sizeof(text) || len == sign ||
            strspn(text + sign, "0123456789") != len - sign)
            return set_error(err, "%s '%s' is not a list of up to %d %s. HINT: vae -h lists the options", flag, value,
                             max_count, what);
        if (!parse_int(flag, text, min, max, &out[(*count)++], err)) return false;
        item += len;
        if (*item == '\0') return true;
    }
}

static bool apply_option(Config* cfg, int o, const char* flag, const char* value, Error* err) {
    switch (o) {
    case OPT_WEIGHTS: return parse_path(flag, value, &cfg->weights_path, err);
    case OPT_DATA: return parse_path(flag, value, &cfg->data_dir, err);
    case OPT_OUT: return parse_path(flag, value, &cfg->out_dir, err);
    case OPT_CSV: return parse_path(flag, value, &cfg->csv_path, err);
    case OPT_IMAGE:
        if (cfg->num_image_files == MAX_IMAGE_FILES)
            return set_error(err, "%s: more than %d images. HINT: evaluate them in several runs", flag,
                             MAX_IMAGE_FILES);
        return parse_path(flag, value, &cfg->image_paths[cfg->num_image_files++], err);
    case OPT_INVERT: cfg->invert = true; return true;
    case OPT_ZMU: cfg->z_is_mu = true; return true;
    case OPT_AIS_IWAE: cfg->ais_iwae = true; return true;
    case OPT_QUIET: cfg->quiet = true; return true;
    case OPT_BENCH: cfg->mode = MODE_BENCH; return true;
    case OPT_VERSION: cfg->version = true; return true;
    case OPT_HELP: cfg->help = true; return true;
    case OPT_PRECISION: return parse_choice(flag, value, PRECISION_NAMES, &cfg->precision, err);
    case OPT_BATCH: return parse_int(flag, value, 1, MAX_BATCH, &cfg->batch, err);
    case OPT_COUNT: return parse_int(flag, value, 1, INT32_MAX, &cfg->count, err);
    case OPT_SEED: return parse_number(flag, value, 0, UINT64_MAX, (unsigned long long*)&cfg->seed, err);
    case OPT_IWAE: cfg->mode = MODE_IWAE; return parse_int(flag, value, 1, IWAE_ROWS, &cfg->iwae_k, err);
    case OPT_INTERP: cfg->mode = MODE_INTERP; return parse_int(flag, value, 2, INTERP_MAX_IMAGES, &cfg->interp_n, err);
    case OPT_AIS:
        if (cfg->mode != MODE_BDMC) cfg->mode = MODE_AIS;
        return parse_int(flag, value, 1, AIS_MAX_T, &cfg->ais_t, err);
    case OPT_BDMC: cfg->mode = MODE_BDMC; return parse_int(flag, value, 1, BDMC_MAX_IMAGES, &cfg->bdmc_n, err);
    case OPT_CHAINS: return parse_int(flag, value, 1, AIS_MAX_CHAINS, &cfg->chains, err);
    case OPT_LEAPFROG: return parse_int(flag, value, 1, AIS_MAX_LEAPFROG, &cfg->leapfrog, err);
    case OPT_KERNELS: return parse_choice(flag, value, KERNELS_NAMES, &cfg->kernels, err);
    case OPT_SHARD: { // K/N: both whole numbers, N in 1..MAX_SHARDS, K in 0..N-1
        int kn[2], count = 0;
        if (!parse_int_list(flag, value, '/', 0, MAX_SHARDS, kn, 2, &count, "K/N", err) || count != 2 || kn[1] == 0 ||
            kn[0] >= kn[1])
            return set_error(err, "%s '%s' is not K/N, the K-th (0..N-1) of N blocks with N up to %d (e.g. 0/8). HINT: "
                             "vae -h lists the options", flag, value, (int)MAX_SHARDS);
        return cfg->shard = kn[0], cfg->num_shards = kn[1], true;
    }
    case OPT_DEVICES: // "all", or GPU numbers, each once
        cfg->num_devices = 0, cfg->all_devices = !strcmp(value, "all");
        if (cfg->all_devices) return true;
        if (!parse_int_list(flag, value, ',', 0, MAX_DEVICES - 1, cfg->devices, MAX_DEVICES, &cfg->num_devices,
                            "GPU numbers like 0,1 (or all)", err))
            return false;
        // The tests run the several-GPU path on one GPU by listing it again (a thread each) under this variable.
        for (int i = 0; i < cfg->num_devices && getenv("VAE_TEST_REPEAT_GPUS") == NULL; i++)
            for (int j = 0; j < i; j++)
                if (cfg->devices[i] == cfg->devices[j])
                    return set_error(err, "%s %s lists GPU %d twice. HINT: name each GPU once, e.g. --devices 0,1, or "
                                     "pass --devices all", flag, value, cfg->devices[i]);
        return true;
    case OPT_AIS_INIT: return parse_choice(flag, value, {"q", "prior"}, &cfg->ais_from_prior, err);
    case OPT_BENCH_BATCHES:
        return parse_int_list(flag, value, ',', 1, MAX_BATCH, cfg->bench_batches, MAX_BENCH_BATCHES,
                              &cfg->num_bench_batches, "batch sizes like 1024,4096", err);
    }
    return set_error(err, "internal: option %d has no handler", o);
}

static bool parse_args(int argc, char** argv, Config* cfg, Error* err) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->weights_path = "data/vae_weights.bin", cfg->data_dir = "data", cfg->out_dir = "out", cfg->batch = 4096;
    cfg->chains = 16, cfg->leapfrog = 10;
    auto spell = [](int o, bool long_form, char (&flag)[24]) {
        if (long_form || OPTIONS[o].letter == 0) snprintf(flag, sizeof(flag), "--%s", OPTIONS[o].name);
        else snprintf(flag, sizeof(flag), "-%c", OPTIONS[o].letter);
    };
    for (int o = 0; o < NUM_OPTIONS; o++) spell(o, false, cfg->flag[o]); // for options the command line did not spell
    for (int b : {1024, 2048, 4096, 10000}) cfg->bench_batches[cfg->num_bench_batches++] = b;

    // getopt_long's tables: long options answer LONG_CODE + o; '+' stops at a non-option, ':' reports a missing value.
    enum { LONG_CODE = 1000 };
    struct option long_options[NUM_OPTIONS + 1] = {};
    char short_options[3 * NUM_OPTIONS + 3] = "+:", *end = short_options + 2;
    for (int o = 0; o < NUM_OPTIONS; o++) {
        long_options[o] = {OPTIONS[o].name, OPTIONS[o].takes_value ? required_argument : no_argument, NULL,
                           LONG_CODE + o};
        if (OPTIONS[o].letter != 0) *end++ = OPTIONS[o].letter;
        if (OPTIONS[o].letter != 0 && OPTIONS[o].takes_value) *end++ = ':';
    }
    auto option_of = [&](int code, char (&flag)[24]) {
        for (int o = 0; o < NUM_OPTIONS; o++)
            if (code == LONG_CODE + o || (OPTIONS[o].letter != 0 && code == OPTIONS[o].letter))
                return spell(o, !strncmp(argv[optind - 1], "--", 2), flag), o;
        return -1;
    };
    optind = 0; // 0: restart GNU getopt's scan from scratch (the tests parse many command lines)
    opterr = 0;
    for (int code; (code = getopt_long(argc, argv, short_options, long_options, NULL)) != -1;) {
        if (code == '?' && optopt != 0 && optopt < LONG_CODE)
            return set_error(err, "unknown option '-%c'. HINT: vae -h lists the options", optopt);
        if (code == '?' && optopt == 0)
            return set_error(err, "unknown option '%s'. HINT: vae -h lists the options", argv[optind - 1]);
        char flag[24]; // a known option; with ':' (value missing) or '?' (a value it takes none of) in optopt
        const int known = code == ':' || code == '?' ? optopt : code, o = option_of(known, flag);
        if (o < 0) return set_error(err, "internal: getopt code %d", known);
        if (code == ':') return set_error(err, "%s needs a value. HINT: vae -h lists the options", flag);
        if (code == '?')
            return set_error(err, "%s takes no value, got '%s'. HINT: vae -h lists the options", flag,
                             argv[optind - 1]);
        if (!apply_option(cfg, o, flag, optarg, err)) return false;
        cfg->given |= OPT_BIT(o), snprintf(cfg->flag[o], sizeof(cfg->flag[o]), "%s", flag);
    }
    if (optind < argc)
        return set_error(err, "unexpected argument '%s'. HINT: vae -h lists the options; files go after a flag "
                         "(-w, -d, --image ...)", argv[optind]);
    if (cfg->help || cfg->version) return true;

    const int modes[] = {OPT_IWAE, OPT_BENCH, OPT_INTERP, OPT_AIS}; // one mode, and only the options it reads
    for (int a : modes)
        for (int b : modes)
            if (a < b && (cfg->given & OPT_BIT(a)) && (cfg->given & OPT_BIT(b)))
                return set_error(err, "%s and %s are separate runs. HINT: pass one of them", cfg->flag[a],
                                 cfg->flag[b]);
    const int mode_option[] = {-1, OPT_IWAE, OPT_BENCH, OPT_INTERP, OPT_AIS, OPT_BDMC}; // by Mode
    const char* mode_flag = cfg->mode == MODE_ELBO ? "the evaluation" : cfg->flag[mode_option[cfg->mode]];
    if (cfg->mode == MODE_BDMC && !(cfg->given & OPT_BIT(OPT_AIS)))
        return set_error(err, "%s runs AIS both ways and needs its T. HINT: add --ais T (e.g. --ais 1000)",
                         cfg->flag[OPT_BDMC]);
    if (cfg->chains > FUSED_AIS_CHAINS && cfg->kernels == KERNELS_FUSED)
        return set_error(err, "%s %d: the fused AIS kernel holds at most %d chains an image. HINT: --kernels plain "
                         "(or auto) runs more, or --chains %d", cfg->flag[OPT_CHAINS], cfg->chains, FUSED_AIS_CHAINS,
                         FUSED_AIS_CHAINS);
    for (int o : {OPT_CHAINS, OPT_LEAPFROG, OPT_AIS_INIT, OPT_AIS_IWAE})
        if (cfg->mode == MODE_ELBO && (cfg->given & OPT_BIT(o)))
            return set_error(err, "%s applies to --ais only. HINT: add --ais T or drop %s", cfg->flag[o], cfg->flag[o]);
    if (cfg->mode == MODE_ELBO && (cfg->given & OPT_BIT(OPT_BENCH_BATCHES)))
        return set_error(err, "%s applies to --bench only. HINT: add --bench or drop %s", cfg->flag[OPT_BENCH_BATCHES],
                         cfg->flag[OPT_BENCH_BATCHES]);
    for (int o = 0; o < NUM_OPTIONS; o++)
        if ((cfg->given & OPT_BIT(o)) && !((MODE_OPTIONS[cfg->mode] | OPT_BIT(OPT_KERNELS)) & OPT_BIT(o)))
            return set_error(err, "%s does not apply to %s. HINT: drop %s", cfg->flag[o], mode_flag, cfg->flag[o]);
    if (cfg->invert && cfg->num_image_files == 0) // --image replaces the test set, which -d and -n choose from
        return set_error(err, "%s applies to --image files. HINT: add --image FILE or drop %s", cfg->flag[OPT_INVERT],
                         cfg->flag[OPT_INVERT]);
    for (int o : {OPT_DATA, OPT_COUNT, OPT_SHARD})
        if (cfg->num_image_files > 0 && (cfg->given & OPT_BIT(o)))
            return set_error(err, "%s does not apply to --image, which replaces the test set. HINT: drop %s",
                             cfg->flag[o], cfg->flag[o]);
    if (cfg->num_shards > 0 && (cfg->given & OPT_BIT(OPT_OUT)))
        return set_error(err, "%s writes no pictures (a shard's would be of its block only). HINT: drop %s",
                         cfg->flag[OPT_SHARD], cfg->flag[OPT_OUT]);
    return true;
}

#ifndef TESTING
static FILE* console = stdout; // stderr when --csv - takes stdout; informational lines unless -q
static bool quiet = false;
static void say(const char* fmt, ...) {
    if (quiet) return;
    va_list args;
    va_start(args, fmt);
    vfprintf(console, fmt, args);
    va_end(args);
}

static void print_version() {
    int runtime = 0, driver = 0;
    cudaCheck(cudaRuntimeGetVersion(&runtime));
    const bool has_driver = cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0; // 0: no driver installed
    printf("vae.cu %s (commit %s)\n", VAE_VERSION, VAE_GIT_COMMIT);
    printf("CUDA runtime %d.%d, driver ", runtime / 1000, runtime % 1000 / 10);
    if (has_driver) printf("%d.%d\n", driver / 1000, driver % 1000 / 10);
    else printf("none found\n");
#ifdef VAE_BUILT_FOR // the Makefile's targets, sm_90a included (nvcc's list below says 900 for sm_90 and sm_90a)
    printf("built for %s\n", VAE_BUILT_FOR);
#elif defined(__CUDA_ARCH_LIST__) // nvcc's list of the architectures this binary has code for, e.g. 800,900
#define VAE_STRING(...) #__VA_ARGS__
#define VAE_EXPAND(...) VAE_STRING(__VA_ARGS__)
    printf("built for %s (nvcc's architecture list: 800 is sm_80)\n", VAE_EXPAND(__CUDA_ARCH_LIST__));
#endif
}

static void parent_folder(const char* path, char folder[MAX_PATH]) {
    snprintf(folder, MAX_PATH, "%s", path);
    char* slash = strrchr(folder, '/');
    while (slash != NULL && slash != folder && slash[1] == '\0') *slash = '\0', slash = strrchr(folder, '/'); // "a/b/"
    if (slash == NULL) snprintf(folder, MAX_PATH, ".");
    else slash[slash == folder ? 1 : 0] = '\0';
}

// Outputs are checked before any work: -o a writable folder or one mkdir -p can make, --csv a writable file.
static void check_output_dir(const char* flag, const char* dir) {
    struct stat st;
    char existing[MAX_PATH]; // the folder itself, else its nearest ancestor that exists
    snprintf(existing, sizeof(existing), "%s", dir);
    while (stat(existing, &st) != 0) {
        if (errno != ENOENT && errno != ENOTDIR) // ENOTDIR: a file on the way, which the loop comes to
            fail("%s %s: cannot create the folder (%s: %s). HINT: pass %s with a writable folder", flag, dir, existing,
                 strerror(errno), flag);
        char parent[MAX_PATH];
        parent_folder(existing, parent);
        if (!strcmp(parent, existing))
            fail("%s %s: no folder above it exists. HINT: pass %s with a writable folder", flag, dir, flag);
        memcpy(existing, parent, sizeof(existing));
    }
    const bool is_dir = !strcmp(existing, dir);
    if (!S_ISDIR(st.st_mode))
        fail("%s %s: %s is not a folder. HINT: pass %s with a writable folder", flag, dir, is_dir ? "it" : existing,
             flag);
    if (access(existing, W_OK) != 0)
        fail("%s %s: cannot %s (%s%s%s). HINT: pass %s with a writable folder", flag, dir,
             is_dir ? "write there" : "create the folder", is_dir ? "" : existing, is_dir ? "" : ": ", strerror(errno),
             flag);
}

static void check_output_file(const char* flag, const char* path) {
    struct stat st;
    char folder[MAX_PATH];
    parent_folder(path, folder);
    const bool is_folder = stat(path, &st) == 0 && S_ISDIR(st.st_mode);
    if (is_folder || stat(folder, &st) != 0 || !S_ISDIR(st.st_mode) || access(folder, W_OK) != 0)
        fail("%s %s: cannot write (%s). HINT: pass a writable path", flag, path,
             is_folder ? "a folder" : "its folder is missing or not writable");
}

static void print_separator() { say("+-----------+------------------------------------------------+\n"); }
static void print_row(const char* key, const char* fmt, ...) {
    char value[256];
    va_list args;
    va_start(args, fmt);
    vsnprintf(value, sizeof(value), fmt, args);
    va_end(args);
    say("| %-9s | %-46s |\n", key, value);
}

static Kernels run_kernels(const Config* cfg) {
    const bool ais = cfg->mode == MODE_AIS || cfg->mode == MODE_BDMC;
    return ais && cfg->chains > FUSED_AIS_CHAINS ? KERNELS_PLAIN : cfg->kernels;
}

static void print_kernels_row(const Config* cfg, ModelDims dims, bool fused) {
    if (fused) print_row("kernels", "fused: Hopper's tensor cores, TMA, clusters");
    else if (cfg->kernels == KERNELS_PLAIN) print_row("kernels", "plain: cuBLASLt (--kernels plain)");
    else if (!is_published(dims)) print_row("kernels", "plain: cuBLASLt (fused: 784-400-20-400 only)");
    else if (run_kernels(cfg) == KERNELS_PLAIN)
        print_row("kernels", "plain: cuBLASLt (--chains above %d)", FUSED_AIS_CHAINS);
    else print_row("kernels", "plain: cuBLASLt (no sm_90a code for this GPU)");
}

static void write_grid(const Config* cfg, const char* name, const char* what, const float* tiles, int rows, int cols) {
    char path[MAX_PATH];
    Error err;
    snprintf(path, sizeof(path), "%s/%s", cfg->out_dir, name);
    if (!output_dir_make(cfg->out_dir, &err) || !write_ppm_grid(path, what, tiles, rows, cols, &err))
        fail("%s", err.msg);
}

enum { RECON_COLS = 16, SAMPLE_SIDE = 8, IMAGE_TILES_MAX = 10 * INTERP_STEPS };
static_assert(SAMPLE_SIDE * SAMPLE_SIDE <= IMAGE_TILES_MAX && 2 * RECON_COLS <= IMAGE_TILES_MAX, "image batches fit");
static void write_images(VAE* m, const Images* images, const Labels* labels, int count, const uint8_t* d_pixels,
                         const Config* cfg) {
    const int Z = m->dims.z;
    float* tiles = (float*)malloc((size_t)IMAGE_TILES_MAX * (INPUT_DIM + Z) * sizeof(float));
    if (tiles == NULL) fail("out of host memory for the images");
    float *z = tiles + (size_t)IMAGE_TILES_MAX * INPUT_DIM, *d_z, *d_loss;
    cudaCheck(cudaMalloc(&d_z, (IMAGE_TILES_MAX * Z + 2 * RECON_COLS) * sizeof(float)));
    d_loss = d_z + IMAGE_TILES_MAX * Z;

    const int n_recon = count < RECON_COLS ? count : RECON_COLS; // recon.ppm: images over reconstructions
    const ForwardOptions opt = {cfg->seed, cfg->z_is_mu, true};
    vae_forward(m, d_pixels, n_recon, 0, &opt, d_loss, d_loss + RECON_COLS);
    for (int i = 0; i < RECON_COLS * INPUT_DIM; i++)
        tiles[i] = i < n_recon * INPUT_DIM ? images->pixels[i] / 255.0f : 0.0f;
    memset(tiles + RECON_COLS * INPUT_DIM, 0, RECON_COLS * INPUT_DIM * sizeof(float));
    cudaCheck(cudaMemcpy(tiles + RECON_COLS * INPUT_DIM, m->recon, (size_t)n_recon * INPUT_DIM * sizeof(float),
                         cudaMemcpyDeviceToHost));
    const char* what = cfg->num_image_files > 0 ? "top: the --image files, bottom: reconstructions"
                                                : "top: test images, bottom: reconstructions";
    write_grid(cfg, "recon.ppm", what, tiles, 2, RECON_COLS);

    const int n_samples = SAMPLE_SIDE * SAMPLE_SIDE; // samples.ppm: decodes of z ~ N(0, I)
    for (int s = 0; s < n_samples; s++)
        for (int j = 0; j < Z; j++) z[s * Z + j] = gaussian(cfg->seed, STREAM_PRIOR, s, 0, j);
    cudaCheck(cudaMemcpy(d_z, z, (size_t)n_samples * Z * sizeof(float), cudaMemcpyHostToDevice));
    vae_decode(m, d_z, n_samples);
    cudaCheck(cudaMemcpy(tiles, m->recon, (size_t)n_samples * INPUT_DIM * sizeof(float), cudaMemcpyDeviceToHost));
    write_grid(cfg, "samples.ppm", "decodes of z ~ N(0, I)", tiles, SAMPLE_SIDE, SAMPLE_SIDE);

    int first[10], rows = 0; // interp.ppm: row d walks the latent mean of a test 'd' to that of a 'd+1'
    int2 pairs[10];
    for (int d = 0; d < 10; d++) first[d] = -1; // each digit's first image
    for (int i = count - 1; i >= 0 && labels->labels != NULL; i--) first[labels->labels[i]] = i;
    uint8_t* d_pair_pixels; // the images of the pairs, gathered into one batch
    cudaCheck(cudaMalloc(&d_pair_pixels, (size_t)20 * INPUT_DIM));
    for (int d = 0; d < 10; d++) {
        if (first[d] < 0 || first[(d + 1) % 10] < 0) continue;
        for (int k = 0; k < 2; k++)
            cudaCheck(cudaMemcpy(d_pair_pixels + (size_t)(2 * rows + k) * INPUT_DIM,
                                 d_pixels + (size_t)first[(d + k) % 10] * INPUT_DIM, INPUT_DIM,
                                 cudaMemcpyDeviceToDevice));
        pairs[rows] = make_int2(2 * rows, 2 * rows + 1), rows++;
    }
    if (rows == 0) {
        say("skipped interp.ppm: %s\n", labels->labels == NULL ? "the images have no labels"
                                        : "the evaluated images hold no two consecutive digits (raise -n)");
    } else {
        int2* d_pairs;
        cudaCheck(cudaMalloc(&d_pairs, sizeof(pairs)));
        cudaCheck(cudaMemcpy(d_pairs, pairs, sizeof(pairs), cudaMemcpyHostToDevice));
        vae_encode(m, d_pair_pixels, 2 * rows);
        vae_decode_interpolations(m, d_pairs, 0, rows * INTERP_STEPS, INTERP_STEPS);
        cudaCheck(cudaMemcpy(tiles, m->recon, (size_t)rows * INTERP_STEPS * INPUT_DIM * sizeof(float),
                             cudaMemcpyDeviceToHost));
        write_grid(cfg, "interp.ppm", "row d: latent mean of a test 'd' to one of a 'd+1'", tiles, rows, INTERP_STEPS);
        cudaCheck(cudaFree(d_pairs));
    }
    free(tiles), cudaCheck(cudaFree(d_pair_pixels)), cudaCheck(cudaFree(d_z));
}

// ---- many GPUs (--devices) ------------------------------------------------------------------------------------------
// Each GPU takes slices of the work from one counter; keyed noise and fixed-order sums keep the one-GPU run's bytes.
typedef struct {
    int device, sm, sms; // the CUDA device number, its compute capability (90: 9.0) and SMs
    bool fused;          // the engine this run takes on it: fused or plain (use_fused)
    char name[256], label[300]; // label: "GPU 1 (NVIDIA H100 80GB HBM3): ", for failing_gpu
    VAE m;
    uint8_t* pixels; // the run's images, [count][784]
} Gpu;

typedef struct { int count; Gpu* gpu; } Gpus;

template <typename Work> static void on_each_gpu(Gpus* gs, Work work) {
    auto drive = [&](Gpu* g) {
        if (gs->count > 1) snprintf(failing_gpu, sizeof(failing_gpu), "%s", g->label);
        cudaCheck(cudaSetDevice(g->device)), work(g);
    };
    std::vector<std::thread> threads;
    for (int i = 1; i < gs->count; i++) threads.emplace_back(drive, &gs->gpu[i]);
    drive(&gs->gpu[0]);
    for (std::thread& t : threads) t.join();
    failing_gpu[0] = '\0'; // what fails from here on is the run's, not one GPU's
}

static void vae_free_all(Gpus* gs) { on_each_gpu(gs, [](Gpu* g) { vae_free(&g->m); }); }

struct Slices { // the work no GPU has taken yet; the time from the last GPU ready to the last done
    std::atomic<int> next{0};
    const int count, gpus;
    std::mutex lock;
    std::condition_variable all_ready;
    int ready = 0;
    double start_ms = 0.0, end_ms = 0.0;
    Slices(int n, const Gpus* gs) : count(n), gpus(gs->count) {}
    bool take(int want, int* first, int* n) {
        *first = next.fetch_add(want), *n = std::min(want, count - *first);
        return *first < count;
    }
    static double now_ms() {
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
    }
    void ready_to_start() {
        std::unique_lock<std::mutex> hold(lock);
        if (++ready == gpus) start_ms = now_ms(), all_ready.notify_all();
        else all_ready.wait(hold, [&] { return ready == gpus; });
    }
    void done() {
        std::lock_guard<std::mutex> hold(lock);
        end_ms = std::max(end_ms, now_ms());
    }
    double ms() const { return end_ms - start_ms; }
};

// The one loop over the GPUs: body makes a GPU's buffers and warms up, then slices(size, run) runs the slices it takes.
template <typename Body> static double over_slices(Gpus* gs, int count, Body body) {
    Slices slices(count, gs);
    on_each_gpu(gs, [&](Gpu* g) {
        body(g, [&](int size, auto run) {
            cudaCheck(cudaStreamSynchronize(g->m.stream)), slices.ready_to_start();
            for (int first, n; slices.take(size, &first, &n);) run(first, n);
            cudaCheck(cudaStreamSynchronize(g->m.stream)), slices.done();
        });
    });
    return slices.ms();
}

struct Progress { // on stderr unless -q: a bar on a terminal, else a line every 10%
    std::mutex lock;
    const char* what;
    const long long total;
    long long done = 0;
    int decile = -1;
    Progress(const char* what_, long long total_) : what(what_), total(total_) {}
    void add(long long n) {
        std::lock_guard<std::mutex> hold(lock);
        done += n;
        if (quiet) return;
        if (isatty(STDERR_FILENO)) {
            const int width = 40, filled = (int)(width * done / total);
            fprintf(stderr, "\r%s [%.*s%*s] %3d%% (%lld/%lld)", what, filled,
                    "########################################", width - filled, "", (int)(100 * done / total), done,
                    total);
            if (done == total) fputc('\n', stderr);
        } else if ((int)(10 * done / total) != decile) {
            decile = (int)(10 * done / total), fprintf(stderr, "%s: %lld/%lld\n", what, done, total);
        }
    }
};

// --devices' GPUs (GPU 0 by default; the first alone for --bench), each checked for this binary's code and --precision.
static Gpus open_gpus(const Config* cfg, ModelDims dims) {
    int available = 0, devices[MAX_DEVICES], count = 0;
    const cudaError_t status = cudaGetDeviceCount(&available);
    if (status != cudaSuccess || available == 0) {
        int driver = 0, runtime = 0;
        Error err;
        if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
        cudaCheck(cudaRuntimeGetVersion(&runtime));
        no_gpu_error(status, driver, runtime, &err);
        fail("%s", err.msg);
    }
    if (cfg->all_devices) for (; count < available && count < MAX_DEVICES; count++) devices[count] = count;
    for (; count < cfg->num_devices; count++) {
        devices[count] = cfg->devices[count];
        if (devices[count] >= available)
            fail("%s: there is no GPU %d; this machine's %d GPU%s 0..%d. HINT: pass --devices all, or GPU numbers of "
                 "0..%d (nvidia-smi -L lists them)", cfg->flag[OPT_DEVICES], devices[count], available,
                 available > 1 ? "s are" : " is", available - 1, available - 1);
    }
    if (count == 0) devices[count++] = 0;
    if (cfg->mode == MODE_BENCH) count = 1;
    Gpus gs = {count, (Gpu*)calloc(count, sizeof(Gpu))};
    if (gs.gpu == NULL) fail("out of host memory for %d GPUs", count);
    for (int i = 0; i < count; i++) {
        Gpu* g = &gs.gpu[i];
        cudaDeviceProp prop;
        if (count > 1) snprintf(failing_gpu, sizeof(failing_gpu), "GPU %d: ", devices[i]); // until its name is known
        cudaCheck(cudaGetDeviceProperties(&prop, devices[i]));
        g->device = devices[i], g->sm = 10 * prop.major + prop.minor, g->sms = prop.multiProcessorCount;
        snprintf(g->name, sizeof(g->name), "%s", prop.name);
        snprintf(g->label, sizeof(g->label), "GPU %d (%s): ", g->device, g->name);
        if (count > 1) snprintf(failing_gpu, sizeof(failing_gpu), "%s", g->label);
        cudaCheck(cudaSetDevice(devices[i]));
        Error err;
        if (!gpu_supported(prop.name, prop.major, prop.minor, cfg->precision, &err)) fail("%s", err.msg);
        cudaFuncAttributes attr; // a binary built for other GPUs has no kernel this one can load
        const cudaError_t loaded = cudaFuncGetAttributes(&attr, iwae_logsumexp_kernel);
        if (loaded != cudaSuccess)
            fail("this vae has no code for the %s (sm_%d): %s. HINT: rebuild it here: make clean && make vae", g->name,
                 g->sm, cudaGetErrorString(loaded));
        g->fused = use_fused(run_kernels(cfg), dims);
    }
    failing_gpu[0] = '\0', cudaCheck(cudaSetDevice(gs.gpu[0].device));
    return gs;
}

// A --shard run's images are first .. first + count - 1 of all: the noise, indices and labels use those global indices.
typedef struct { const char* images; int count; const Labels* labels; int first; } Inputs;

static void write_csv(const Config* cfg, const Inputs* in, const char* columns,
                      std::initializer_list<const float*> values) {
    const bool to_stdout = !strcmp(cfg->csv_path, "-");
    FILE* f = to_stdout ? stdout : output_open(cfg->csv_path, "per-image results");
    if (f == NULL) fail("--csv %s: cannot write (%s). HINT: pass a writable path", cfg->csv_path, strerror(errno));
    char run[160] = "";
    if (cfg->mode == MODE_AIS)
        snprintf(run, sizeof(run), ", T %d, chains %d, leapfrog %d, from %s", cfg->ais_t, cfg->chains, cfg->leapfrog,
                 cfg->ais_from_prior ? "the prior" : "q(z|x)");
    bool ok = fprintf(f, "# vae.cu %s (commit %s): mode %s, precision %s, seed %llu, z %s%s, weights %s, images %s\n",
                      VAE_VERSION, VAE_GIT_COMMIT, MODE_NAMES[cfg->mode], PRECISION_NAMES[cfg->precision],
                      (unsigned long long)cfg->seed, cfg->z_is_mu ? "mu" : "sampled", run, cfg->weights_path,
                      in->images) > 0;
    ok = ok && fprintf(f, "index,label,%s\n", columns) > 0;
    for (int i = 0; i < in->count && ok; i++) {
        ok = fprintf(f, "%d,%d", in->first + i, in->labels->labels ? in->labels->labels[in->first + i] : -1) > 0;
        for (const float* v : values) ok = ok && fprintf(f, ",%.6f", v[i]) > 0;
        ok = ok && fputc('\n', f) != EOF;
    }
    if (to_stdout ? fflush(f) != 0 : fclose(f) != 0) ok = false;
    if (!ok) fail("--csv %s: write failed (%s). HINT: check the disk", cfg->csv_path, strerror(errno));
}

struct Timer {
    cudaStream_t stream;
    cudaEvent_t start, stop;
    Timer(cudaStream_t s) : stream(s) {
        cudaCheck(cudaEventCreate(&start)), cudaCheck(cudaEventCreate(&stop)), restart();
    }
    ~Timer() { cudaCheck(cudaEventDestroy(start)), cudaCheck(cudaEventDestroy(stop)); }
    void restart() { cudaCheck(cudaEventRecord(start, stream)); }
    float elapsed_ms() {
        float ms;
        cudaCheck(cudaEventRecord(stop, stream)), cudaCheck(cudaEventSynchronize(stop));
        cudaCheck(cudaEventElapsedTime(&ms, start, stop));
        return ms;
    }
};

// Per-image BCE and KL to the host, on every GPU in slices of whole batches (about 8 a GPU); returns the time in ms.
static double evaluate(Gpus* gs, int count, int image0, int batch, const Config* cfg, float* bce, float* kl) {
    const ForwardOptions opt = {cfg->seed, cfg->z_is_mu, false};
    const int slice = batch * ceil_div(ceil_div(count, 8 * gs->count), batch);
    return over_slices(gs, count, [&](Gpu* g, auto slices) {
        VAE* m = &g->m;
        float* d_losses = (float*)device_alloc((size_t)2 * slice * sizeof(float), "the losses");
        vae_forward(m, g->pixels, batch, 0, &opt, d_losses, d_losses + slice); // the warm-up
        slices(slice, [&](int first, int n) {
            for (int b = 0; b < n; b += batch)
                vae_forward(m, g->pixels + (size_t)(first + b) * INPUT_DIM, std::min(batch, n - b), image0 + first + b,
                            &opt, d_losses + b, d_losses + slice + b);
            cudaCheck(cudaMemcpyAsync(bce + first, d_losses, n * sizeof(float), cudaMemcpyDeviceToHost, m->stream));
            cudaCheck(cudaMemcpyAsync(kl + first, d_losses + slice, n * sizeof(float), cudaMemcpyDeviceToHost,
                                      m->stream));
            cudaCheck(cudaStreamSynchronize(m->stream));
        });
        cudaCheck(cudaFree(d_losses));
    });
}

static double mean_of(const float* v, int n) {
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += v[i];
    return sum / n;
}

template <typename V> static double print_mean_nll(const char* label, const V* log_px, int count) {
    double sum = 0.0, sum_sq = 0.0;
    for (int i = 0; i < count; i++) sum += log_px[i], sum_sq += (double)log_px[i] * log_px[i];
    const double mean = sum / count, var = count > 1 ? (sum_sq - count * mean * mean) / (count - 1) : 0.0;
    fprintf(console, "%s%10.4f   (-log p(x), nats; ", label, -mean);
    if (count > 1) fprintf(console, "standard error %.4f)\n", sqrt(fmax(var, 0.0) / count));
    else fprintf(console, "one image: no standard error)\n");
    return mean;
}

static const char* on_gpus(const Gpus* gs) {
    static char text[32];
    snprintf(text, sizeof(text), gs->count > 1 ? " on %d GPUs" : "", gs->count);
    return text;
}

static void run_elbo(const HostWeights* w, const Images* images, const Inputs* in, Gpus* gs, const Config* cfg) {
    const int count = in->count, batch = cfg->batch < count ? cfg->batch : count;
    on_each_gpu(gs, [&](Gpu* g) { // the pictures take batches of up to 110
        vae_init(&g->m, w, batch > IMAGE_TILES_MAX ? batch : IMAGE_TILES_MAX, cfg->precision, cfg->kernels);
    });
    float* bce = (float*)malloc((size_t)2 * count * sizeof(float));
    if (bce == NULL) fail("out of host memory for %d losses", count);
    float* kl = bce + count;
    const double ms = evaluate(gs, count, in->first, batch, cfg, bce, kl);
    if (cfg->num_image_files > 0)
        for (int i = 0; i < count; i++)
            fprintf(console, "%s: BCE %.4f  KL %.4f  loss %.4f\n", cfg->image_paths[i], bce[i], kl[i], bce[i] + kl[i]);
    const double mean_bce = mean_of(bce, count), mean_kl = mean_of(kl, count);
    fprintf(console, "evaluated %d images in %.3f ms%s (%.0f images/s)\n", count, ms, on_gpus(gs), count / (ms * 1e-3));
    fprintf(console, "mean BCE   %10.4f\n", mean_bce);
    fprintf(console, "mean KL    %10.4f\n", mean_kl);
    fprintf(console, "mean loss  %10.4f   (BCE + KL = -ELBO)\n", mean_bce + mean_kl);
    if (cfg->csv_path != NULL) write_csv(cfg, in, "bce,kl", {bce, kl});
    if (cfg->num_shards == 0) { // the pictures: a few decodes, and the files written
        const double start = Slices::now_ms();
        write_images(&gs->gpu[0].m, images, in->labels, count, gs->gpu[0].pixels, cfg);
        const double pictures_ms = Slices::now_ms() - start;
        fprintf(console, "time       %10.3f ms (evaluation %.3f ms, pictures %.3f ms)\n", ms + pictures_ms, ms,
                pictures_ms);
    }
    free(bce), vae_free_all(gs);
}

// IWAE's log p(x) to the host, on every GPU in slices of whole decoder passes, ~2% of the images each.
static double iwae_all(Gpus* gs, int count, int image0, int K, const Config* cfg, Progress* progress, float* log_px) {
    return over_slices(gs, count, [&](Gpu* g, auto slices) {
        VAE* m = &g->m;
        const int per_pass = vae_iwae_lane_rows(m, K) / K;
        const int slice = std::min(per_pass * ceil_div(ceil_div(count, per_pass), 50), ceil_div(count, gs->count));
        float* d_log_px = (float*)device_alloc((size_t)slice * sizeof(float), "log p(x)");
        vae_iwae(m, g->pixels, 1, 0, K, cfg->seed, d_log_px); // the warm-up
        slices(slice, [&](int first, int n) {
            vae_iwae(m, g->pixels + (size_t)first * INPUT_DIM, n, image0 + first, K, cfg->seed, d_log_px);
            cudaCheck(cudaMemcpyAsync(log_px + first, d_log_px, n * sizeof(float), cudaMemcpyDeviceToHost, m->stream));
            cudaCheck(cudaStreamSynchronize(m->stream));
            if (progress != NULL) progress->add(n);
        });
        cudaCheck(cudaFree(d_log_px));
    });
}

static void run_iwae(const HostWeights* w, const Inputs* in, Gpus* gs, const Config* cfg) {
    const int K = cfg->iwae_k, count = in->count;
    on_each_gpu(gs, [&](Gpu* g) { vae_init(&g->m, w, IWAE_ROWS, cfg->precision, cfg->kernels, IWAE_PASS_ROWS); });
    float* results = (float*)malloc((size_t)3 * count * sizeof(float)); // log p(x), BCE, KL
    if (results == NULL) fail("out of host memory for %d results", count);
    float *log_px = results, *bce = results + count, *kl = results + 2 * count;
    Progress progress("iwae", count);
    const double iwae_ms = iwae_all(gs, count, in->first, K, cfg, &progress, log_px);
    const double elbo_ms = evaluate(gs, count, in->first, count < 4096 ? count : 4096, cfg, bce, kl);
    if (cfg->num_image_files > 0)
        for (int i = 0; i < count; i++)
            fprintf(console, "%s: BCE %.4f  KL %.4f  loss %.4f  log p(x) %.4f\n", cfg->image_paths[i], bce[i], kl[i],
                    bce[i] + kl[i], log_px[i]);
    fprintf(console, "IWAE, K = %d samples per image, %d images (%s)\n", K, count, PRECISION_NAMES[cfg->precision]);
    fprintf(console, "mean -ELBO %10.4f   (BCE + KL, one sample; the bound IWAE tightens)\n",
            mean_of(bce, count) + mean_of(kl, count));
    print_mean_nll("mean NLL   ", log_px, count);
    fprintf(console, "time       %10.2f ms%s (IWAE %.2f ms: %.3g decoder passes/s, progress reports included; ELBO "
            "%.2f ms)\n", iwae_ms + elbo_ms, on_gpus(gs), iwae_ms, (double)count * K / (iwae_ms * 1e-3), elbo_ms);
    if (cfg->csv_path != NULL) write_csv(cfg, in, "bce,kl,log_px", {bce, kl, log_px});
    free(results), vae_free_all(gs);
}

typedef struct { double *beta, *log_w, *log_px; int* accepted; float *step, *ess, *acceptance; } AisBuffers;
static AisBuffers ais_buffers(int n, const Config* cfg) { // one allocation, beta first: cudaFree(b.beta) frees all
    const size_t rows = (size_t)n * cfg->chains, T = cfg->ais_t;
    AisBuffers b; // doubles (beta [T + 1], log_w [rows], log_px [n]), then accepted [rows], step, ess, acceptance [n]
    b.beta = (double*)device_alloc((T + 1 + rows + n) * sizeof(double) + (rows + 3 * n) * 4, "the AIS buffers");
    b.log_w = b.beta + T + 1, b.log_px = b.log_w + rows, b.accepted = (int*)(b.log_px + n);
    b.step = (float*)(b.accepted + rows), b.ess = b.step + n, b.acceptance = b.step + 2 * n;
    double* beta = (double*)malloc((cfg->ais_t + 1) * sizeof(double));
    if (beta == NULL) fail("out of host memory for the AIS schedule");
    ais_schedule(beta, cfg->ais_t);
    cudaCheck(cudaMemcpy(b.beta, beta, (cfg->ais_t + 1) * sizeof(double), cudaMemcpyHostToDevice)), free(beta);
    return b;
}

typedef struct { double* log_px; float *step, *ess, *acceptance; } AisResults; // host arrays of n each
// AIS forward, or reverse from the host's z_start, on every GPU in slices of whole rounds; the estimates to `out`.
static double ais_all(Gpus* gs, int n, int image0, const Config* cfg, const float* z_start, const char* what,
                      AisResults out) {
    Progress progress(what, n);
    return over_slices(gs, n, [&](Gpu* g, auto slices) {
        VAE* m = &g->m;
        const int C = cfg->chains, Z = m->dims.z, round = vae_ais_round(m, C), rounds = ceil_div(n, round);
        int slice = m->fused ? round * ceil_div(rounds, 50) : ceil_div(n, gs->count * ceil_div(rounds, gs->count));
        if (slice > m->max_batch) slice = m->max_batch / round * round;
        AisBuffers b = ais_buffers(slice, cfg);
        float* d_z = NULL;
        if (z_start != NULL) {
            d_z = (float*)device_alloc((size_t)n * Z * sizeof(float), "the AIS start z");
            cudaCheck(cudaMemcpy(d_z, z_start, (size_t)n * Z * sizeof(float), cudaMemcpyHostToDevice));
        }
        AisIO io = {};
        io.beta = b.beta, io.chains = C, io.T = std::min(2, cfg->ais_t), io.leapfrog = 1, io.seed = cfg->seed;
        io.step0 = AIS_STEP_START, io.n = 1, io.pixels = g->pixels;
        io.log_w = b.log_w, io.accepted = b.accepted, io.step_out = b.step;
        vae_ais(m, io, cfg->ais_from_prior); // the warm-up
        io.T = cfg->ais_t, io.leapfrog = cfg->leapfrog, io.reverse = z_start != NULL;
        slices(slice, [&](int first, int k) {
            io.n = k, io.first_image = (uint32_t)(image0 + first), io.pixels = g->pixels + (size_t)first * INPUT_DIM;
            io.z_start = d_z != NULL ? d_z + (size_t)first * Z : NULL;
            vae_ais(m, io, cfg->ais_from_prior);
            launch(ais_estimate_kernel, k, 128, 128, m->stream, b.log_px, b.ess, b.acceptance, b.log_w, b.accepted, k,
                   C, cfg->ais_t - 1, io.reverse);
            const std::pair<float*, float*> floats[] = {{out.step, b.step}, {out.ess, b.ess},
                                                        {out.acceptance, b.acceptance}};
            for (auto f : floats)
                cudaCheck(cudaMemcpyAsync(f.first + first, f.second, k * sizeof(float), cudaMemcpyDeviceToHost,
                                          m->stream));
            cudaCheck(cudaMemcpyAsync(out.log_px + first, b.log_px, k * sizeof(double), cudaMemcpyDeviceToHost,
                                      m->stream));
            cudaCheck(cudaStreamSynchronize(m->stream)), progress.add(k);
        });
        cudaCheck(cudaFree(d_z)), cudaCheck(cudaFree(b.beta));
    });
}

enum { AIS_BATCH = 8192 }; // images per AIS launch at most (a round of the GPU's clusters is up to 4,224 at C = 1)
static void run_ais(const HostWeights* w, const Inputs* in, Gpus* gs, const Config* cfg) {
    const int count = in->count, C = cfg->chains, T = cfg->ais_t, L = cfg->leapfrog;
    const long long evals_per_image = (long long)C * (1 + (long long)(T - 1) * L); // gradient evaluations
    const bool iwae = cfg->ais_iwae; // IWAE's K = evals_per_image: one image's rows must fit a decoder pass
    on_each_gpu(gs, [&](Gpu* g) {
        vae_init(&g->m, w, AIS_BATCH, cfg->precision, run_kernels(cfg), iwae ? IWAE_PASS_ROWS : 0);
    });
    for (int i = 0; i < gs->count && iwae; i++)
        if (evals_per_image > gs->gpu[i].m.decoder_rows)
            fail("%s: IWAE with K = C (1 + (T - 1) L) = %lld samples an image needs that many decoder rows a pass; "
                 "the %s engine takes %d. HINT: a smaller --ais T, --chains or --leapfrog, or drop %s",
                 cfg->flag[OPT_AIS_IWAE], evals_per_image, gs->gpu[i].m.fused ? "fused" : "plain",
                 gs->gpu[i].m.decoder_rows, cfg->flag[OPT_AIS_IWAE]);

    double* log_px = (double*)malloc((size_t)count * sizeof(double));
    float* results = (float*)malloc((size_t)7 * count * sizeof(float));
    if (log_px == NULL || results == NULL) fail("out of host memory for %d results", count);
    float *step = results, *ess = results + count, *acceptance = results + 2 * count, *bce = results + 3 * count;
    float *kl = results + 4 * count, *iwae_px = results + 5 * count, *ais_px = results + 6 * count;
    const double ais_ms = ais_all(gs, count, in->first, cfg, NULL, "ais", {log_px, step, ess, acceptance});
    const double elbo_ms = evaluate(gs, count, in->first, count < 4096 ? count : 4096, cfg, bce, kl);
    Progress progress("iwae", count);
    const double iwae_ms = iwae ? iwae_all(gs, count, in->first, (int)evals_per_image, cfg, &progress, iwae_px) : 0.0;
    double accept = 0.0, ess_sum = 0.0, iwae_sum = 0.0;
    float step_min = step[0], step_max = step[0];
    for (int i = 0; i < count; i++) {
        accept += acceptance[i], ess_sum += ess[i], iwae_sum += iwae ? iwae_px[i] : 0.0, ais_px[i] = (float)log_px[i];
        step_min = fminf(step_min, step[i]), step_max = fmaxf(step_max, step[i]);
        if (cfg->num_image_files > 0)
            fprintf(console, "%s: -ELBO %.4f  log p(x) %.4f (AIS), %.4f (IWAE)\n", cfg->image_paths[i], bce[i] + kl[i],
                    log_px[i], iwae ? iwae_px[i] : NAN);
    }
    const double elbo = -(mean_of(bce, count) + mean_of(kl, count)), evals = (double)count * evals_per_image;
    fprintf(console, "AIS, T = %d distributions, C = %d chains, L = %d leapfrog steps, from %s; %d images (%s)\n", T,
            C, L, cfg->ais_from_prior ? "the prior" : "q(z|x)", count, PRECISION_NAMES[cfg->precision]);
    const double mean = print_mean_nll("mean NLL    ", log_px, count);
    if (T > 1)
        fprintf(console, "acceptance  %10.4f   (mean; step sizes %.4g .. %.4g; effective sample size %.2f of %d)\n",
                accept / count, step_min, step_max, ess_sum / count, C);
    fprintf(console, "time        %10.3f s%s  (AIS %.3f s: %.3g gradient evaluations/s, %.1f TFLOP/s of decoder "
            "work; ELBO %.3f s", (ais_ms + elbo_ms + iwae_ms) * 1e-3, on_gpus(gs), ais_ms * 1e-3,
            evals / (ais_ms * 1e-3), evals * ais_flops_per_eval(w->dims) / (ais_ms * 1e9), elbo_ms * 1e-3);
    if (iwae) fprintf(console, "; IWAE %.3f s)\n", iwae_ms * 1e-3);
    else fprintf(console, ")\n");
    if (iwae) fprintf(console, "inference gap: -ELBO %.4f > IWAE (K = %lld, as many decoder evaluations) %.4f > AIS "
                      "%.4f nats\n", -elbo, evals_per_image, -iwae_sum / count, -mean);
    else fprintf(console, "inference gap: -ELBO %.4f > AIS %.4f nats (IWAE with as many decoder evaluations, K = %lld, "
                 "between them: add --ais-iwae)\n", -elbo, -mean, evals_per_image);
    if (cfg->csv_path != NULL) write_csv(cfg, in, "log_px,ess,acceptance", {ais_px, ess, acceptance});
    free(log_px), free(results), vae_free_all(gs);
}

// Images simulated from the model: AIS forward (a lower bound) and reverse from the true z (an upper one) on log p(x).
static void run_bdmc(const HostWeights* w, Gpus* gs, const Config* cfg) {
    const int n = cfg->bdmc_n, Z = w->dims.z;
    on_each_gpu(gs, [&](Gpu* g) { vae_init(&g->m, w, AIS_BATCH, cfg->precision, run_kernels(cfg)); });
    VAE* m = &gs->gpu[0].m; // simulates the images
    float* z = (float*)malloc((size_t)n * Z * sizeof(float) + (size_t)AIS_BATCH * INPUT_DIM * sizeof(float));
    uint8_t* pixels = (uint8_t*)malloc((size_t)n * INPUT_DIM);
    double* bounds = (double*)malloc((size_t)2 * n * sizeof(double));
    float* estimates = (float*)malloc((size_t)3 * n * sizeof(float)); // step sizes, ESS, acceptance: not reported
    if (z == NULL || pixels == NULL || bounds == NULL || estimates == NULL)
        fail("out of host memory for %d simulated images", n);
    float* recon = z + (size_t)n * Z;
    const double simulation_start = Slices::now_ms();
    for (int i = 0; i < n; i++)
        for (int j = 0; j < Z; j++) z[(size_t)i * Z + j] = gaussian(cfg->seed, STREAM_SIMULATE, i, 0, j);
    float* d_z = (float*)device_alloc((size_t)n * Z * sizeof(float), "the simulated z");
    cudaCheck(cudaMemcpy(d_z, z, (size_t)n * Z * sizeof(float), cudaMemcpyHostToDevice));
    for (int first = 0; first < n; first += AIS_BATCH) {
        const int B = n - first < AIS_BATCH ? n - first : AIS_BATCH;
        vae_decode(m, d_z + (size_t)first * Z, B);
        cudaCheck(cudaMemcpy(recon, m->recon, (size_t)B * INPUT_DIM * sizeof(float), cudaMemcpyDeviceToHost));
        for (int k = 0; k < B * INPUT_DIM; k++) { // pixel k % 784 of image first + k / 784
            const float u = uniform_open0(cfg->seed, STREAM_SIMULATE, first + k / INPUT_DIM, 1, k % INPUT_DIM);
            pixels[(size_t)first * INPUT_DIM + k] = u <= recon[k] ? 255 : 0;
        }
    }
    cudaCheck(cudaFree(d_z));
    on_each_gpu(gs, [&](Gpu* g) {
        g->pixels = (uint8_t*)device_alloc((size_t)n * INPUT_DIM, "the simulated images");
        cudaCheck(cudaMemcpy(g->pixels, pixels, (size_t)n * INPUT_DIM, cudaMemcpyHostToDevice));
    });
    const double simulation_ms = Slices::now_ms() - simulation_start;
    double ms[2];
    for (int reverse = 0; reverse < 2; reverse++) {
        const AisResults out = {bounds + (size_t)reverse * n, estimates, estimates + n, estimates + 2 * n};
        ms[reverse] = ais_all(gs, n, 0, cfg, reverse ? z : NULL, reverse ? "bdmc reverse" : "bdmc forward", out);
    }
    double lower = 0.0, upper = 0.0, gap_min = INFINITY, gap_max = -INFINITY;
    for (int i = 0; i < n; i++) {
        const double gap = bounds[n + i] - bounds[i];
        lower += bounds[i], upper += bounds[n + i], gap_min = fmin(gap_min, gap), gap_max = fmax(gap_max, gap);
    }
    fprintf(console, "BDMC, %d simulated images; AIS with T = %d, C = %d chains, L = %d leapfrog steps, from %s (%s)\n",
            n, cfg->ais_t, cfg->chains, cfg->leapfrog, cfg->ais_from_prior ? "the prior" : "q(z|x)",
            PRECISION_NAMES[cfg->precision]);
    fprintf(console, "lower bound %10.4f   (mean log p(x), forward AIS; %.3f s%s)\n", lower / n, ms[0] * 1e-3,
            on_gpus(gs));
    fprintf(console, "upper bound %10.4f   (mean log p(x), reverse AIS from the true z; %.3f s%s)\n", upper / n,
            ms[1] * 1e-3, on_gpus(gs));
    fprintf(console, "gap         %10.4f   (nats, upper - lower; per image %.4f .. %.4f)\n", (upper - lower) / n,
            gap_min, gap_max);
    fprintf(console, "time        %10.3f s%s  (simulating the images %.3f s, forward %.3f s, reverse %.3f s)\n",
            (simulation_ms + ms[0] + ms[1]) * 1e-3, on_gpus(gs), simulation_ms * 1e-3, ms[0] * 1e-3, ms[1] * 1e-3);
    free(z), free(pixels), free(bounds), free(estimates), vae_free_all(gs);
}

// Graph replays: latency the median one from an idle GPU, throughput 200 back to back / 200 (as dev/bench_pytorch.py).
static void run_bench(const HostWeights* w, const uint8_t* d_pixels, const Config* cfg) {
    enum { WARMUP = 20, REPS = 200 };
    const ModelDims d = w->dims;
    const double flops_per_image = 2.0 * ((double)INPUT_DIM * d.h1 + 2.0 * d.h1 * d.z + (double)d.z * d.h3 +
                                          (double)d.h3 * INPUT_DIM);
    // the floor: the FLOPs at the dense bf16 rate an H200 sustains, or the bytes that must move at its bandwidth
    const double floor_flops = 770e12, floor_bytes_per_s = 4.2e12;
    const int max_batch = *std::max_element(cfg->bench_batches, cfg->bench_batches + cfg->num_bench_batches);
    float* d_losses = (float*)device_alloc((size_t)2 * max_batch * sizeof(float), "the losses");
    printf("forward + loss per batch, z %s: CUDA graph replays after %d warm-up; latency = median of %d single\n"
           "replays from an idle GPU, throughput = %d back-to-back replays / %d (images/s and TFLOP/s from it);\n"
           "floor = the FLOPs at 770 TFLOP/s or the bytes at 4.2 TB/s\n", cfg->z_is_mu ? "= mu" : "sampled", WARMUP,
           REPS, REPS, REPS);
    printf("| kernels | precision | batch | latency us | throughput us | images/s | TFLOP/s | floor us | "
           "%% of floor |\n");
    printf("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    Kernels engines[2] = {cfg->kernels, KERNELS_FUSED};
    int num_engines = 1;
    if (cfg->kernels == KERNELS_AUTO) engines[0] = KERNELS_PLAIN, num_engines = use_fused(KERNELS_AUTO, d) ? 2 : 1;
    const bool has_bf16 = gpu_attribute(cudaDevAttrComputeCapabilityMajor) >= 8; // bf16 tensor cores: sm_80 on
    for (int run = 0; run < 2 * num_engines; run++) { // each engine in both precisions
        const int p = run % 2;
        if ((cfg->given & OPT_BIT(OPT_PRECISION)) && p != (int)cfg->precision) continue;
        if (p == PRECISION_BF16 && !(cfg->given & OPT_BIT(OPT_PRECISION)) && !has_bf16) continue;
        VAE m;
        vae_init(&m, w, max_batch, (Precision)p, engines[run / 2]);
        const char* engine = m.fused ? "fused" : "plain";
        for (int b = 0; b < cfg->num_bench_batches; b++) {
            const int B = cfg->bench_batches[b];
            const ForwardOptions opt = {cfg->seed, cfg->z_is_mu, false};
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            cudaCheck(cudaStreamBeginCapture(m.stream, cudaStreamCaptureModeGlobal));
            vae_forward(&m, d_pixels, B, 0, &opt, d_losses, d_losses + max_batch);
            cudaCheck(cudaStreamEndCapture(m.stream, &graph)), cudaCheck(cudaGraphInstantiate(&exec, graph, 0));
            for (int i = 0; i < WARMUP; i++) cudaCheck(cudaGraphLaunch(exec, m.stream));
            cudaCheck(cudaStreamSynchronize(m.stream));
            Timer timer(m.stream);
            float us[REPS];
            for (int i = 0; i < REPS; i++) { // each from an idle GPU (elapsed_ms waits): the launch is in the latency
                timer.restart();
                cudaCheck(cudaGraphLaunch(exec, m.stream));
                us[i] = 1000.0f * timer.elapsed_ms();
            }
            timer.restart();
            for (int i = 0; i < REPS; i++) cudaCheck(cudaGraphLaunch(exec, m.stream));
            const float burst_ms = timer.elapsed_ms();
            std::sort(us, us + REPS);
            const double latency_us = us[REPS / 2], throughput_us = 1000.0 * burst_ms / REPS;
            const double weight_bytes = (double)w->count * (p == PRECISION_FP32 ? 4 : 2);
            const double floor_us = 1e6 * fmax(flops_per_image * B / floor_flops,
                                               ((double)B * (INPUT_DIM + 2 * sizeof(float)) + weight_bytes) /
                                                   floor_bytes_per_s);
            const double tflops = flops_per_image * B / (throughput_us * 1e6);
            printf("| %s | %s | %d | %.1f | %.1f | %.3g | %.1f | %.1f | %.1f%% |\n", engine, PRECISION_NAMES[p], B,
                   latency_us, throughput_us, B / (throughput_us * 1e-6), tflops, floor_us,
                   100.0 * floor_us / throughput_us);
            cudaCheck(cudaGraphExecDestroy(exec)), cudaCheck(cudaGraphDestroy(graph));
        }
        vae_free(&m);
    }
    cudaCheck(cudaFree(d_losses));
}

// Every pair of the first N images in long passes (every GPU), then a pair a call, as an interactive loop would ask.
static void run_interp(const HostWeights* w, Gpus* gs, const Config* cfg) {
    const int n = cfg->interp_n, num_pairs = n * (n - 1) / 2, decodes = num_pairs * INTERP_STEPS;
    const int pass_rows = IWAE_ROWS - IWAE_ROWS % INTERP_STEPS; // whole pairs per pass
    const size_t pair_floats = (size_t)INTERP_STEPS * INPUT_DIM;
    int2* pairs = (int2*)malloc((size_t)num_pairs * sizeof(int2));
    float* tiles = (float*)malloc((size_t)IMAGE_TILES_MAX * INPUT_DIM * sizeof(float));
    float* last = (float*)malloc((size_t)2 * pair_floats * sizeof(float)); // the last pair, both ways
    if (pairs == NULL || tiles == NULL || last == NULL) fail("out of host memory for %d pairs", num_pairs);
    for (int a = 0, p = 0; a < n; a++)
        for (int b = a + 1; b < n; b++) pairs[p++] = make_int2(a, b);
    std::vector<int2*> d_pairs(gs->count);
    const double batched_ms = over_slices(gs, decodes, [&](Gpu* g, auto slices) {
        VAE* m = &g->m;
        int2*& here = d_pairs[g - gs->gpu];
        vae_init(m, w, pass_rows, cfg->precision, cfg->kernels);
        here = (int2*)device_alloc((size_t)num_pairs * sizeof(int2), "the pairs");
        cudaCheck(cudaMemcpy(here, pairs, (size_t)num_pairs * sizeof(int2), cudaMemcpyHostToDevice));
        vae_encode(m, g->pixels, n); // m->mulv holds the N means from here on; decoding leaves it alone
        vae_decode_interpolations(m, here, 0, INTERP_STEPS, INTERP_STEPS); // the warm-up
        slices(pass_rows, [&](int first, int rows) {
            vae_decode_interpolations(m, here, first, rows, INTERP_STEPS);
            if (gs->count > 1) cudaCheck(cudaStreamSynchronize(m->stream)); // one GPU queues passes back to back
        });
    });

    VAE* m = &gs->gpu[0].m; // the last pass again here, for the check (another engine may have run it)
    const double rest_start = Slices::now_ms(); // the check and the picture, beside the two timed ways
    const int last_pass = (decodes - 1) / pass_rows * pass_rows, last_rows = decodes - last_pass;
    vae_decode_interpolations(m, d_pairs[0], last_pass, last_rows, INTERP_STEPS);
    cudaCheck(cudaMemcpy(last, m->recon + (size_t)(last_rows - INTERP_STEPS) * INPUT_DIM, pair_floats * sizeof(float),
                         cudaMemcpyDeviceToHost));
    const int report_every = num_pairs / 100 > 0 ? num_pairs / 100 : 1;
    Progress progress("one pair per call", num_pairs);
    const double single_start = Slices::now_ms();
    for (int p = 0, reported = 0; p < num_pairs; p++) {
        vae_decode_interpolations(m, d_pairs[0], (long long)p * INTERP_STEPS, INTERP_STEPS, INTERP_STEPS);
        cudaCheck(cudaStreamSynchronize(m->stream));
        if ((p + 1) % report_every == 0 || p + 1 == num_pairs) progress.add(p + 1 - reported), reported = p + 1;
    }
    const double single_end = Slices::now_ms(), single_ms = single_end - single_start; // each pair waited for
    cudaCheck(cudaMemcpy(last + pair_floats, m->recon, pair_floats * sizeof(float), cudaMemcpyDeviceToHost));
    const bool same = !memcmp(last, last + pair_floats, pair_floats * sizeof(float));

    fprintf(console, "interpolation: %d images, %d pairs x %d steps = %d decodes (%s)\n", n, num_pairs, INTERP_STEPS,
            decodes, PRECISION_NAMES[cfg->precision]);
    fprintf(console, "batched          %10.2f ms%s (%.3g decodes/s, passes of %d)\n", batched_ms, on_gpus(gs),
            decodes / (batched_ms * 1e-3), pass_rows);
    fprintf(console, "one pair a call  %10.2f ms (%.3g decodes/s, %d calls)\n", single_ms, decodes / (single_ms * 1e-3),
            num_pairs);
    fprintf(console, "batched is %.1fx faster; the last pair's images are %s both ways\n", single_ms / batched_ms,
            same ? "bitwise identical" : "DIFFERENT");
    if (!same) fail("--interp: the batched and the one-pair decodes differ. HINT: this is a bug; please report it");

    const int rows = num_pairs < 10 ? num_pairs : 10;
    vae_decode_interpolations(m, d_pairs[0], 0, rows * INTERP_STEPS, INTERP_STEPS);
    cudaCheck(cudaMemcpy(tiles, m->recon, (size_t)rows * pair_floats * sizeof(float), cudaMemcpyDeviceToHost));
    char what[96];
    snprintf(what, sizeof(what), "the first %d pairs, t = 0, 0.1, ..., 1", rows);
    write_grid(cfg, "interp.ppm", what, tiles, rows, INTERP_STEPS);
    const double rest_ms = single_start - rest_start + Slices::now_ms() - single_end;
    fprintf(console, "time             %10.2f ms (batched %.2f ms, one pair a call %.2f ms, the check and interp.ppm "
            "%.2f ms)\n", batched_ms + single_ms + rest_ms, batched_ms, single_ms, rest_ms);
    free(pairs), free(tiles), free(last);
    on_each_gpu(gs, [&](Gpu* g) { cudaCheck(cudaFree(d_pairs[g - gs->gpu])), vae_free(&g->m); });
}

static void idx_path(char path[MAX_PATH], const char* dir, const char* name) {
    struct stat st;
    snprintf(path, MAX_PATH, "%s/%s", dir, name);
    if (stat(path, &st) != 0 && errno == ENOENT) snprintf(path, MAX_PATH, "%s/%s.gz", dir, name);
    if (stat(path, &st) != 0 && errno == ENOENT) snprintf(path, MAX_PATH, "%s/%s", dir, name); // neither: name it
}

static void load_image_files(const Config* cfg, Images* images) {
    images->count = cfg->num_image_files, images->pixels = (uint8_t*)malloc((size_t)images->count * INPUT_DIM);
    if (images->pixels == NULL) fail("out of host memory for %d images", images->count);
    for (int i = 0; i < images->count; i++) {
        Images one = {};
        Error err;
        if (!load_file(cfg->image_paths[i], parse_pgm, &one, &err, "HINT: check the --image path")) fail("%s", err.msg);
        for (int p = 0; p < INPUT_DIM; p++)
            images->pixels[(size_t)i * INPUT_DIM + p] = cfg->invert ? 255 - one.pixels[p] : one.pixels[p];
        free(one.pixels);
    }
}

int main(int argc, char** argv) {
    Config cfg;
    Error err;
    if (!parse_args(argc, argv, &cfg, &err)) fail("%s", err.msg);
    if (cfg.help || cfg.version) {
        if (cfg.help) printf("%s", USAGE);
        else print_version();
        return 0;
    }
    quiet = cfg.quiet;
    if (cfg.csv_path != NULL && !strcmp(cfg.csv_path, "-")) console = stderr;

    HostWeights weights = {}; // every input read and validated before touching the GPU
    Images images = {};
    Labels labels = {}; // none: every label is -1
    char images_path[MAX_PATH], labels_path[MAX_PATH];
    const bool own_weights = cfg.given & OPT_BIT(OPT_WEIGHTS); // -w: a missing file is the user's, not make data's
    if (!load_file(cfg.weights_path, parse_weights, &weights, &err, own_weights ? WEIGHTS_HINT : PREPARE_HINT) ||
        !kernels_fit(cfg.kernels, weights.dims, &err))
        fail("%s", err.msg);
    if (cfg.num_image_files > 0) {
        load_image_files(&cfg, &images);
        snprintf(images_path, sizeof(images_path), "%d --image file%s", images.count, images.count > 1 ? "s" : "");
    } else if (cfg.mode != MODE_BDMC) { // --bdmc simulates its images: no test set
        const bool own_data = cfg.given & OPT_BIT(OPT_DATA); // -d names the user's folder: 'make data' makes data/
        const char* data_hint = own_data ? "HINT: pass -d with the folder that holds t10k-images-idx3-ubyte or its .gz"
                                         : PREPARE_HINT;
        struct stat st;
        const int missing = stat(cfg.data_dir, &st) == 0 ? 0 : errno;
        if (missing != 0 || !S_ISDIR(st.st_mode))
            fail("%s %s: %s. %s", cfg.flag[OPT_DATA], cfg.data_dir,
                 missing == ENOENT ? "no such folder" : missing != 0 ? strerror(missing) : "not a folder", data_hint);
        idx_path(images_path, cfg.data_dir, "t10k-images-idx3-ubyte");
        idx_path(labels_path, cfg.data_dir, "t10k-labels-idx1-ubyte");
        if (!load_file(images_path, parse_idx_images, &images, &err, data_hint)) fail("%s", err.msg);
        const bool have_labels = stat(labels_path, &st) == 0 || errno != ENOENT; // optional, but never half-read
        if (have_labels && !load_file(labels_path, parse_idx_labels, &labels, &err)) fail("%s", err.msg);
        if (have_labels && labels.count != images.count)
            fail("%s holds %d labels for %d images in %s. " PREPARE_HINT, labels_path, labels.count, images.count,
                 images_path);
    }
    if (cfg.count > images.count)
        fail("%s %d: %s holds only %d images. HINT: pass %s %d or less", cfg.flag[OPT_COUNT], cfg.count, images_path,
             images.count, cfg.flag[OPT_COUNT], images.count);
    const int total = cfg.count > 0 ? cfg.count : images.count;
    const int first = cfg.num_shards > 0 ? (int)((long long)total * cfg.shard / cfg.num_shards) : 0;
    const int count = cfg.num_shards > 0 ? (int)((long long)total * (cfg.shard + 1) / cfg.num_shards) - first : total;
    if (cfg.num_shards > total)
        fail("%s %d/%d: the %d images make fewer than %d blocks. HINT: pass --shard K/N with N of at most %d",
             cfg.flag[OPT_SHARD], cfg.shard, cfg.num_shards, total, cfg.num_shards, total);
    if (cfg.mode == MODE_BENCH)
        for (int b = 0; b < cfg.num_bench_batches; b++)
            if (cfg.bench_batches[b] > count)
                fail("--bench times batches of up to %d images, but only %d are evaluated (%s). HINT: pass "
                     "--bench-batches with sizes of at most %d, or a larger -n", cfg.bench_batches[b], count,
                     cfg.count > 0 ? cfg.flag[OPT_COUNT] : images_path, count);
    if (cfg.mode == MODE_INTERP && cfg.interp_n > count)
        fail("%s %d: %s holds only %d images. HINT: pass %s %d or less", cfg.flag[OPT_INTERP], cfg.interp_n,
             images_path, count, cfg.flag[OPT_INTERP], count);
    if ((cfg.mode == MODE_ELBO && cfg.num_shards == 0) || cfg.mode == MODE_INTERP)
        check_output_dir(cfg.flag[OPT_OUT], cfg.out_dir);
    if (cfg.csv_path != NULL && strcmp(cfg.csv_path, "-") != 0) check_output_file(cfg.flag[OPT_CSV], cfg.csv_path);

    const int batch = cfg.batch < count ? cfg.batch : count;
    set_out_of_memory_hint(cfg.mode, batch);
    Gpus gpus = open_gpus(&cfg, weights.dims);
    const ModelDims dims = weights.dims;
    print_separator();
    if (gpus.count == 1) {
        print_row("device", "%s", gpus.gpu[0].name);
        print_row("arch", "sm_%d, %d SMs", gpus.gpu[0].sm, gpus.gpu[0].sms);
        if (cfg.mode == MODE_BENCH && (cfg.all_devices || cfg.num_devices > 1))
            print_row("devices", "--bench times one GPU: %d", gpus.gpu[0].device);
    } else {
        print_row("devices", "%d GPUs, each taking slices as it frees up", gpus.count);
        for (int i = 0; i < gpus.count; i++) {
            const Gpu* g = &gpus.gpu[i];
            char key[16];
            snprintf(key, sizeof(key), "gpu %d", g->device);
            print_row(key, "%s, sm_%d: %s", g->name, g->sm, g->fused ? "fused" : "plain");
        }
    }
    print_row("weights", "%s", cfg.weights_path);
    print_row("dims", "%d -> %d -> %d -> %d -> %d", INPUT_DIM, dims.h1, dims.z, dims.h3, INPUT_DIM);
    if (cfg.num_shards > 0)
        print_row("images", "%d-%d of %d from %s (--shard %d/%d)", first, first + count - 1, total, images_path,
                  cfg.shard, cfg.num_shards);
    else if (cfg.mode != MODE_BDMC) print_row("images", "%d from %s", count, images_path);
    if (labels.labels == NULL && cfg.mode != MODE_BDMC) print_row("labels", "none (each image's label is -1)");
    if (cfg.mode == MODE_ELBO) print_row("batch", "%d", batch);
    print_row("precision", "%s", PRECISION_NAMES[cfg.precision]);
    if (cfg.mode != MODE_BENCH && gpus.count == 1) print_kernels_row(&cfg, dims, gpus.gpu[0].fused);
    if (cfg.mode == MODE_ELBO || cfg.mode == MODE_BENCH)
        print_row("z", "%s", cfg.z_is_mu ? "mu (--zmu)" : "mu + eps * sigma, sampled");
    if (cfg.mode != MODE_INTERP) print_row("seed", "%llu", (unsigned long long)cfg.seed);
    if (cfg.mode == MODE_IWAE) print_row("iwae", "K = %d importance samples per image", cfg.iwae_k);
    if (cfg.mode == MODE_INTERP)
        print_row("interp", "all pairs of %d images, %d steps each", cfg.interp_n, INTERP_STEPS);
    if (cfg.mode == MODE_AIS)
        print_row("ais", "T = %d, C = %d chains, L = %d leapfrog steps, from %s", cfg.ais_t, cfg.chains, cfg.leapfrog,
                  cfg.ais_from_prior ? "the prior" : "q(z|x)");
    if (cfg.mode == MODE_BDMC)
        print_row("bdmc", "%d simulated images, T = %d, C = %d, L = %d, from %s", cfg.bdmc_n, cfg.ais_t, cfg.chains,
                  cfg.leapfrog, cfg.ais_from_prior ? "the prior" : "q(z|x)");
    print_separator();

    if (cfg.mode != MODE_BDMC) // the images stay on each GPU as uint8 for the whole run
        on_each_gpu(&gpus, [&](Gpu* g) {
            g->pixels = (uint8_t*)device_alloc((size_t)count * INPUT_DIM, "the images");
            cudaCheck(cudaMemcpy(g->pixels, images.pixels + (size_t)first * INPUT_DIM, (size_t)count * INPUT_DIM,
                                 cudaMemcpyHostToDevice));
        });
    const Inputs inputs = {images_path, count, &labels, first};
    if (cfg.mode == MODE_ELBO) run_elbo(&weights, &images, &inputs, &gpus, &cfg);
    else if (cfg.mode == MODE_IWAE) run_iwae(&weights, &inputs, &gpus, &cfg);
    else if (cfg.mode == MODE_BENCH) run_bench(&weights, gpus.gpu[0].pixels, &cfg);
    else if (cfg.mode == MODE_AIS) run_ais(&weights, &inputs, &gpus, &cfg);
    else if (cfg.mode == MODE_BDMC) run_bdmc(&weights, &gpus, &cfg);
    else run_interp(&weights, &gpus, &cfg);
    if (!outputs_commit(&err, quiet ? NULL : console)) fail("%s", err.msg);

    on_each_gpu(&gpus, [](Gpu* g) { cudaCheck(cudaFree(g->pixels)); });
    free(gpus.gpu), free(weights.data), free(images.pixels), free(labels.labels);
    return 0;
}
#endif // TESTING

// ==== appendix: the Hopper engine ====================================================================================
#define BY_PRECISION(precision, f) ((precision) == PRECISION_FP32 ? f<PRECISION_FP32> : f<PRECISION_BF16>)

// ---- kernels: the tensor cores, one encoder kernel and one decoder kernel, in either precision ----------------------
// A forward pass in two launches, 16-bit operands and fp32 sums: the encoder (pixels -> z rows, KL) and the decoder (z
// rows -> per-row BCE), hidden layers and logits on chip. Path<P> holds what the precisions change: bf16 one product a
// multiply, fp32 three on fp16 parts, within 1e-5 of float64 (dev/NOTES.md, 'the tensor-core kernels').
template <Precision P> struct Path;
template <> struct Path<PRECISION_BF16> {
    typedef bf16 T;
    static constexpr bool SPLIT = false;
    static constexpr int ENC_UNITS = 80, ENC_SLICES = 5;  // fc1's hidden units per encoder block
    static constexpr int ENC_STEPS = 5, ENC_W_COLS = 80;  // h1's k16 steps into fc21/22; their columns a slice
    static constexpr int DEC_BN = 200, DEC_COL_BLOCKS = 4; // fc4's logits per decoder block (one m64n200 wgmma)
    static constexpr int Z_K = 32;                        // a z row's K
    static constexpr int AIS_CLUSTER = 4, AIS_BN = 200;   // ais_kernel: fc4's column blocks, one a block
};

template <> struct Path<PRECISION_FP32> {
    typedef fp16 T;
    static constexpr bool SPLIT = true;
    static constexpr int ENC_UNITS = 40, ENC_SLICES = 10; // hi and lo rows of 40 units fill the 80 of a slice
    static constexpr int ENC_STEPS = 3, ENC_W_COLS = 96;  // 40 units padded to 48, hi then lo
    static constexpr int DEC_BN = 88, DEC_COL_BLOCKS = 9; // two 88-row copies of fc4 fit beside fc3 (209 KB)
    static constexpr int Z_K = 64;
    static constexpr int AIS_CLUSTER = 8, AIS_BN = 104;   // 8 of 104 in two copies of cores (AisFc4Cores)
};

template <typename T> __device__ inline uint32_t pack2(float lo, float hi) { // lo in the low half
    uint32_t v;
    if constexpr (std::is_same<T, bf16>::value) *reinterpret_cast<__nv_bfloat162*>(&v) = __floats2bfloat162_rn(lo, hi);
    else *reinterpret_cast<__half2*>(&v) = __floats2half2_rn(lo, hi);
    return v;
}

template <typename T> __device__ inline void pack_parts(uint32_t& hi, uint32_t& lo, float a, float b) {
    hi = pack2<T>(a, b), lo = 0u; // bf16: no lo part
    if constexpr (std::is_same<T, fp16>::value) {
        const float2 back = __half22float2(*reinterpret_cast<const __half2*>(&hi));
        lo = pack2<T>(a - back.x, b - back.y);
    }
}

__device__ inline float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// D += A (16x16, row-major) B (16x8, column-major), fp32 D; with g = lane / 4, t = lane % 4, a register holds two k:
//   a[0] = A[g][2t..]  a[1] = A[g+8][2t..]  a[2] = A[g][2t+8..]  a[3] = A[g+8][2t+8..]
//   b[0] = B[2t..][g]  b[1] = B[2t+8..][g]       (B[k][n] = W[n][k]: rows of W are columns of B)
//   d[0], d[1] = D[g][2t], D[g][2t+1]    d[2], d[3] = D[g+8][2t], D[g+8][2t+1]
#define MMA_M16N8K16(TYPE)                                                                                             \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "          \
                 "{%8,%9}, {%0,%1,%2,%3};\n"                                                                           \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
template <typename T> __device__ inline void mma_m16n8k16(float* d, const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    if constexpr (std::is_same<T, bf16>::value) MMA_M16N8K16("bf16");
    else MMA_M16N8K16("f16");
}

// d += a b in the path's precision: bf16 one product; fp32 the two corrections (al bh, ah bl), then ah bh.
template <typename T>
__device__ inline void mma_parts(float* d, const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                 const uint32_t (&b_hi)[2], const uint32_t (&b_lo)[2]) {
    if constexpr (std::is_same<T, fp16>::value) mma_m16n8k16<T>(d, a_lo, b_hi), mma_m16n8k16<T>(d, a_hi, b_lo);
    mma_m16n8k16<T>(d, a_hi, b_hi);
}

__device__ inline uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared; !valid writes zeros and reads nothing, so tiles past a matrix's edge need no edge case.
__device__ inline void cp_async16(void* smem, const void* gmem, bool valid) {
    const uint32_t dst = smem_addr(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}

__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING> __device__ inline void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

template <typename T>
__device__ inline void copy_block_async(T* dst, int dst_pitch, const T* __restrict__ src, int src_pitch, int rows,
                                       int cols) {
    for (int c = threadIdx.x; c < rows * (cols / 8); c += blockDim.x) {
        const int r = c / (cols / 8), k = (c % (cols / 8)) * 8;
        cp_async16(dst + r * dst_pitch + k, src + (size_t)r * src_pitch + k, true);
    }
    cp_async_commit();
}

// The last of `arrivals` warps to store a 16-row task's share gets true, every share visible, and resets the ticket.
__device__ inline bool last_to_arrive(unsigned* ticket, unsigned arrivals) {
    __threadfence(); // this warp's shares are visible to the whole GPU before its ticket is
    __syncwarp();
    unsigned arrived = 0;
    if (threadIdx.x % 32 == 0) arrived = atomicAdd(ticket, 1u);
    if (__shfl_sync(0xffffffffu, arrived, 0) != arrivals - 1) return false;
    __threadfence();
    if (threadIdx.x % 32 == 0) *ticket = 0; // every share has arrived
    return true;
}

// Programmatic dependent launch: the decoder loads its weights while the encoder runs, and waits here for its z rows.
__device__ inline void allow_dependent_launch() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__device__ inline void wait_for_prior_grid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

__device__ inline uint32_t pair_at(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }

// fc4's logits in column blocks of DEC_BN, the last from 784 - DEC_BN (its dec_overlap() left to the block before).
enum {
    DEC_CHUNK = 80, DEC_CHUNKS = HIDDEN_DIM / DEC_CHUNK, DEC_STEPS = DEC_CHUNK / 16, BIAS_PARTS = 3,
    TASK_ROWS = 16,        // rows of one warp's task (encoder and decoder): the unit of a cross-block merge
    FC4_K = HIDDEN_DIM + 8, // fc4's K with the bias parts: 816-byte rows, a 16-byte multiple for TMA
    AIS_W3_K = 24,          // ais_kernel's fc3 rows [W3 | bias parts | 0] in memory (AisW3Cores on chip)
};

template <Precision P> __host__ __device__ constexpr int dec_overlap() {
    return Path<P>::DEC_COL_BLOCKS * Path<P>::DEC_BN - INPUT_DIM;
}

static_assert(LATENT_DIM + BIAS_PARTS <= Path<PRECISION_BF16>::Z_K && FC4_K - HIDDEN_DIM >= BIAS_PARTS &&
                  HIDDEN_DIM % 64 <= 48, "the 3 bias parts fit the K padding, in fc4's k16 step 25");
static_assert(3 * LATENT_DIM + BIAS_PARTS <= Path<PRECISION_FP32>::Z_K, "fp32's z row: zh, the ones, zl, zh");
static_assert(HIDDEN_DIM % DEC_CHUNK == 0 && DEC_CHUNK % 16 == 0, "chunks are whole k16 steps");
static_assert(dec_overlap<PRECISION_BF16>() % 8 == 0 && dec_overlap<PRECISION_FP32>() % 8 == 0 &&
                  dec_overlap<PRECISION_FP32>() >= 0 && INPUT_DIM % 2 == 0, "the overlaps are whole n8 blocks");
enum {
    ENC_BN = 80,               // fc1's rows a block keeps: one slice (bf16: 80 units; fp32: 40 units' hi and lo)
    MAX_ENC_SLICES = Path<PRECISION_FP32>::ENC_SLICES,
    FC1_K = 832,               // 13 blocks of 64 pixels: 784 and zeros
    ENC_PREFETCH = 2,          // pixel blocks loaded ahead of the one multiplied
};

static_assert(Path<PRECISION_BF16>::ENC_UNITS == ENC_BN && 2 * Path<PRECISION_FP32>::ENC_UNITS == ENC_BN &&
                  FC1_K % 64 == 0 && (int)FC1_K >= (int)INPUT_DIM && INPUT_DIM % 16 == 0,
              "a slice is 80 rows of fc1 in both paths; pixels come in 16-byte loads");
// The weights in the kernels' 16-bit layouts, once at load: element i of `layer` (each layout at its branch).
enum Layer { LAYER_FC1, LAYER_ENC, LAYER_FC3, LAYER_FC4, LAYER_AIS_FC3 };
template <Precision P>
__global__ void weights_kernel(typename Path<P>::T* __restrict__ dst, Layer layer, const float* __restrict__ w,
                               const float* __restrict__ b, long long count) {
    typedef Path<P> Q;
    typedef typename Q::T T;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    float v = 0.0f; // the source value, and which of its parts goes here
    int part = 0;
    if (layer == LAYER_FC1) { // [slices * 80][832] in the K order of the pixel fragments (pixel_fragments)
        const int n = (int)(i / FC1_K), k = (int)(i % FC1_K), s = k / 16, slot = k % 16, u = s / 4, j = s % 4;
        const int t = (slot % 8) / 2, pixel = 64 * u + 16 * t + 4 * j + (slot / 8) * 2 + slot % 2;
        const int unit = n / ENC_BN * Q::ENC_UNITS + n % ENC_BN % Q::ENC_UNITS;
        part = n % ENC_BN / Q::ENC_UNITS;
        v = pixel < INPUT_DIM ? w[(size_t)unit * INPUT_DIM + pixel] : 0.0f;
    } else if (layer == LAYER_ENC) { // [40][slices][ENC_W_COLS]: a slice's units, or their hi then lo parts
        const int row = (int)(i / (Q::ENC_SLICES * Q::ENC_W_COLS)), c = (int)(i % (Q::ENC_SLICES * Q::ENC_W_COLS));
        const int slice = c / Q::ENC_W_COLS, k = c % Q::ENC_W_COLS % (16 * Q::ENC_STEPS);
        part = c % Q::ENC_W_COLS / (16 * Q::ENC_STEPS);
        v = k < Q::ENC_UNITS ? w[(size_t)row * HIDDEN_DIM + slice * Q::ENC_UNITS + k] : 0.0f;
    } else if (layer == LAYER_FC3) { // [400][Z_K]: [W3 | bias parts | 0], fp32 [W3h | bias parts | W3h | W3l | 0]
        const int n = (int)(i / Q::Z_K), k = (int)(i % Q::Z_K), zk = k - LATENT_DIM - BIAS_PARTS;
        if (k < LATENT_DIM) v = w[n * LATENT_DIM + k];
        else if (k < LATENT_DIM + BIAS_PARTS) v = b[n], part = k - LATENT_DIM;
        else if (Q::SPLIT && zk < 2 * LATENT_DIM) v = w[n * LATENT_DIM + zk % LATENT_DIM], part = zk / LATENT_DIM;
    } else { // LAYER_AIS_FC3 [parts][400][24], LAYER_FC4 [parts][784][408]: [W | bias parts | 0], then [W lo | 0]
        const bool fc3 = layer == LAYER_AIS_FC3;
        const int rows = fc3 ? HIDDEN_DIM : INPUT_DIM, in = fc3 ? LATENT_DIM : HIDDEN_DIM, ld = fc3 ? AIS_W3_K : FC4_K;
        const int n = (int)(i / ld % rows), k = (int)(i % ld), copy = (int)(i / ld / rows);
        if (k < in) v = w[(size_t)n * in + k], part = copy;
        else if (copy == 0 && k < in + BIAS_PARTS) v = b[n], part = k - in;
    }
    dst[i] = split_part<T>(v, part);
}

__device__ inline float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ inline float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// A z row in fc3's A fragment order: uint4 4h + t holds thread t's pairs for k16 steps 2h, 2h + 1, at K = 32h + (2t,
// 2t+1), (8+2t, ..), (16+2t, ..), (24+2t, ..). K 0..19: z; 20..22: 1 (times the bias parts); fp32 then zl and zh.
template <Precision P> __device__ inline void store_z_row(uint4* row, const float* z) {
    typedef typename Path<P>::T T;
    float k[Path<P>::Z_K];
    for (int i = 0; i < Path<P>::Z_K; i++) {
        const int zk = i - LATENT_DIM - BIAS_PARTS, j = zk % LATENT_DIM;
        k[i] = i < LATENT_DIM ? z[i] : i < LATENT_DIM + BIAS_PARTS ? 1.0f : 0.0f;
        if (Path<P>::SPLIT && zk >= 0 && zk < 2 * LATENT_DIM) k[i] = as_float(split_part<T>(z[j], 1 - zk / LATENT_DIM));
    }
    for (int h = 0; h < Path<P>::Z_K / 32; h++)
        for (int t = 0; t < 4; t++) {
            const float* q = k + 32 * h + 2 * t;
            row[4 * h + t] = make_uint4(pack2<T>(q[0], q[1]), pack2<T>(q[8], q[9]), pack2<T>(q[16], q[17]),
                                        pack2<T>(q[24], q[25]));
        }
}

// z rows of latents given in fp32 (prior samples, interpolations), a thread a row.
template <Precision P> __global__ void z_rows_kernel(uint4* __restrict__ z_rows, const float* __restrict__ z, int B) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < B) store_z_row<P>(z_rows + (size_t)r * Path<P>::Z_K / 8, z + (size_t)r * LATENT_DIM);
}

// ReLU of a warp's m16n8 accumulators (h[4j..4j+3] = n8 block j, rows g, g + 8) as the next layer's A fragments: a[s] =
// blocks 2s (k 2t..) and 2s + 1 (k 8 + 2t..), so h1 and h3 stay in registers; fp16 adds the lo parts.
template <typename T, int STEPS, int H>
__device__ inline void relu_to_a(uint32_t (&hi)[STEPS][4], uint32_t (&lo)[STEPS][4], const float (&h)[H]) {
    for (int s = 0; s < STEPS; s++)
        for (int i = 0; i < 4; i++) {
            const int j = 8 * s + 2 * i;
            if (j >= H) {
                hi[s][i] = lo[s][i] = 0u;
            } else if constexpr (std::is_same<T, bf16>::value) {
                const __nv_bfloat162 v = __hmax2(__floats2bfloat162_rn(h[j], h[j + 1]), __float2bfloat162_rn(0.0f));
                hi[s][i] = *reinterpret_cast<const uint32_t*>(&v);
            } else {
                pack_parts<fp16>(hi[s][i], lo[s][i], fmaxf(h[j], 0.0f), fmaxf(h[j + 1], 0.0f));
            }
        }
}

template <int H> __device__ inline void store_hidden(float* out, const float (&h)[H], int row16, int rows, int col0) {
    const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int j = 0; j < H / 4; j++)
        for (int half = 0; half < 2; half++)
            if (row16 + g + 8 * half < rows)
                *reinterpret_cast<float2*>(&out[(size_t)(row16 + g + 8 * half) * HIDDEN_DIM + col0 + 8 * j + 2 * t]) =
                    make_float2(fmaxf(h[4 * j + 2 * half], 0.0f), fmaxf(h[4 * j + 2 * half + 1], 0.0f));
}

struct EncoderIO {
    uint4* z_rows;              // [M][Z_K / 8]
    float *kl, *mulv_out, *z_out, *h1; // [M], [M][40], [M][20], [M][400], or NULL
    float* partials;            // [M][slices][40]
    unsigned* tickets;          // [M / 16 rounded up], zero between passes
    const uint8_t* pixels;      // [M][784]
    const float* fc1_b;
    const void* enc_w;          // [fc21 | fc22] in the path's type and layout (weights_kernel)
    const float* enc_b;
    const float* eps;           // [M][20] (tests) or NULL: the generator
    int M;
    uint32_t first_image;
    uint64_t seed;
    bool z_is_mu;
};

struct PixelRows { // rows g and g + 8's 16-byte pixel loads (zeros past the edges), and their A fragments
    const uint4 *top, *bottom;
    bool top_live, bottom_live;
    __device__ PixelRows(const uint8_t* pixels, int row16, int M) {
        const int g = threadIdx.x % 32 / 4;
        top = reinterpret_cast<const uint4*>(pixels + (size_t)(row16 + g) * INPUT_DIM);
        bottom = top + 8 * INPUT_DIM / 16;
        top_live = row16 + g < M, bottom_live = row16 + g + 8 < M;
    }
    __device__ void load(uint4 (&px)[2], int u) const {
        const int t = threadIdx.x % 4;
        const bool inside = 64 * u + 16 * t < INPUT_DIM;
        px[0] = top_live && inside ? top[4 * u + t] : make_uint4(0, 0, 0, 0);
        px[1] = bottom_live && inside ? bottom[4 * u + t] : make_uint4(0, 0, 0, 0);
    }
};

template <typename T> __device__ inline void pixel_fragments(uint32_t (&a)[4][4], const uint4 (&px)[2]) {
    const uint32_t words[2][4] = {{px[0].x, px[0].y, px[0].z, px[0].w}, {px[1].x, px[1].y, px[1].z, px[1].w}};
    for (int j = 0; j < 4; j++) // k16 step j: rows g, g + 8 at slots (2t, 2t+1) and (8+2t, 9+2t): bytes 4j .. 4j+3
        for (int i = 0; i < 4; i++)
            a[j][i] =
                pack2<T>(byte_as_float(words[i % 2][j], (i / 2) * 2), byte_as_float(words[i % 2][j], (i / 2) * 2 + 1));
}

// After fc1, a warp's 16 images: h1 as A fragments, the slice's partial [mu | logvar]; the last slice merges, z and KL.
template <Precision P>
__device__ inline void encoder_finish(const float (&acc)[2 * ENC_BN / 4],
                                      const typename Path<P>::T (*w_enc)[Path<P>::ENC_W_COLS + 8], int row16,
                                      int slice, const EncoderIO& io, float (*z_s)[LATENT_DIM],
                                      float (*kl_s)[LATENT_DIM]) {
    typedef Path<P> Q;
    typedef typename Q::T T;
    constexpr int GROUPS = LATENT_DIM / 4, UNITS = Q::ENC_UNITS, SLICES = Q::ENC_SLICES;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, col0 = slice * UNITS, M = io.M;
    if (row16 >= M) return; // the whole warp (a wgmma task's last warps may lie past the images)
    float h[2 * UNITS / 4]; // the ReLU comes in relu_to_a
    #pragma unroll
    for (int nt = 0; nt < UNITS / 8; nt++)
        for (int i = 0; i < 4; i++) {
            float x_w = acc[4 * nt + i];
            if constexpr (Q::SPLIT) x_w += acc[4 * (nt + UNITS / 8) + i]; // x wh + x wl
            h[4 * nt + i] = x_w * (1.0f / 255.0f) + io.fc1_b[col0 + nt * 8 + 2 * t + i % 2];
        }
    if (io.h1) store_hidden(io.h1, h, row16, M, col0);
    uint32_t h1[Q::ENC_STEPS][4], h1_lo[Q::ENC_STEPS][4];
    relu_to_a<T>(h1, h1_lo, h);
    float part[MULV_DIM / 8][4] = {};
    for (int s = 0; s < Q::ENC_STEPS; s++)
        for (int nt = 0; nt < MULV_DIM / 8; nt++) {
            const T* w = &w_enc[nt * 8 + g][s * 16 + 2 * t];
            const T* w_lo = w + 16 * Q::ENC_STEPS; // fp32: the lo parts follow the hi parts
            const uint32_t b[2] = {pair_at(w), pair_at(w + 8)}, b_lo[2] = {pair_at(w_lo), pair_at(w_lo + 8)};
            mma_parts<T>(part[nt], h1[s], h1_lo[s], b, b_lo);
        }
    for (int nt = 0; nt < MULV_DIM / 8; nt++)
        for (int half = 0; half < 2; half++) {
            const int row = row16 + g + 8 * half;
            if (row < M)
                *reinterpret_cast<float2*>(&io.partials[((size_t)row * SLICES + slice) * MULV_DIM + nt * 8 + 2 * t]) =
                    make_float2(part[nt][2 * half], part[nt][2 * half + 1]);
        }
    if (!last_to_arrive(&io.tickets[row16 / TASK_ROWS], SLICES)) return;

    for (int i = lane; i < TASK_ROWS * GROUPS; i += 32) {
        const int r = i / GROUPS, q = i % GROUPS, row = row16 + r;
        if (row >= M) continue;
        const float* p = io.partials + (size_t)row * SLICES * MULV_DIM;
        const float4 eps = posterior_eps(io.eps ? io.eps + (size_t)row * LATENT_DIM : NULL, q, LATENT_DIM,
                                         io.first_image + row, 0, io.seed, io.z_is_mu);
        const float e[4] = {eps.x, eps.y, eps.z, eps.w};
        for (int j = 0; j < 4; j++) {
            const int latent = 4 * q + j;
            float mu = __ldcg(&p[latent]), logvar = __ldcg(&p[LATENT_DIM + latent]); // L2: other SMs wrote them
            for (int s = 1; s < SLICES; s++)
                mu += __ldcg(&p[s * MULV_DIM + latent]), logvar += __ldcg(&p[s * MULV_DIM + LATENT_DIM + latent]);
            mu += io.enc_b[latent], logvar += io.enc_b[LATENT_DIM + latent];
            z_s[r][latent] = latent_z(mu, logvar, e[j], &kl_s[r][latent]);
            if (io.mulv_out) io.mulv_out[(size_t)row * MULV_DIM + latent] = mu;
            if (io.mulv_out) io.mulv_out[(size_t)row * MULV_DIM + LATENT_DIM + latent] = logvar;
            if (io.z_out) io.z_out[(size_t)row * LATENT_DIM + latent] = z_s[r][latent];
        }
    }
    __syncwarp();
    if (lane < TASK_ROWS && row16 + lane < M) {
        float sum = 0.0f; // each image's KL in a fixed order
        for (int j = 0; j < LATENT_DIM; j++) sum += kl_s[lane][j];
        if (io.kl) io.kl[row16 + lane] = -0.5f * sum;
        store_z_row<P>(io.z_rows + (size_t)(row16 + lane) * Q::Z_K / 8, z_s[lane]);
    }
    __syncwarp(); // z_s is rewritten by this warp's next finishing task
}

template <Precision P>
__device__ inline void copy_enc_weights(typename Path<P>::T (*dst)[Path<P>::ENC_W_COLS + 8], const EncoderIO& io,
                                        int slice) {
    constexpr int COLS = Path<P>::ENC_W_COLS;
    const typename Path<P>::T* src = static_cast<const typename Path<P>::T*>(io.enc_w);
    copy_block_async(&dst[0][0], COLS + 8, src + slice * COLS, Path<P>::ENC_SLICES * COLS, MULV_DIM, COLS);
}

// fc3's A fragments (Z_K / 16 k16 steps) of rows row16 + g and + 8 (zeros past the rows): two 16-byte loads per two.
template <int STEPS>
__device__ inline void load_z_fragments(uint32_t (&z_a)[STEPS][4], const uint4* __restrict__ z_rows, int row16,
                                        int rows) {
    const int lane = threadIdx.x % 32, row = row16 + lane / 4, t = lane % 4;
    for (int h = 0; h < STEPS / 2; h++) {
        const size_t at = (size_t)row * (STEPS / 2) * 4 + 4 * h + t, below = at + 8 * (STEPS / 2) * 4;
        const uint4 top = row < rows ? z_rows[at] : make_uint4(0, 0, 0, 0);
        const uint4 bottom = row + 8 < rows ? z_rows[below] : make_uint4(0, 0, 0, 0);
        uint32_t(&a)[4] = z_a[2 * h], (&b)[4] = z_a[2 * h + 1];
        a[0] = top.x, a[1] = bottom.x, a[2] = top.y, a[3] = bottom.y;
        b[0] = top.z, b[1] = bottom.z, b[2] = top.w, b[3] = bottom.w;
    }
}

struct DecoderIO { // row r against image r / rows_per_image (no pixels: decode only)
    const uint4* z_rows;   // [rows][Z_K / 8]
    const uint8_t* pixels; // [rows / rows_per_image][784] or NULL
    int rows, rows_per_image;
    float* bce;            // [rows], or NULL: the parts are the result (a ticket costs a fence per 16 rows)
    float* parts;          // [rows][column blocks]: each column block's share of a row's BCE
    unsigned* tickets;     // [rows / 16 rounded up]: column blocks done with 16 rows (zero between passes)
    float *logits, *recon; // [rows][784] or NULL
    float* h3;             // [rows][400] or NULL (tests)
};

// A warp's 16 rows x DEC_BN logits (m16n8 layout): BCE = (1/2 - x) l + |l| / 2 + log(1 + e^-|l|), one log a row and
// thread; the column block completing 16 rows (a ticket) adds their parts in block order: batch invariant.
template <Precision P>
__device__ inline void decoder_epilogue(const float (&logit)[Path<P>::DEC_BN / 2], int row16, int cb,
                                        const DecoderIO& io) {
    constexpr int DEC_BN = Path<P>::DEC_BN, DEC_COL_BLOCKS = Path<P>::DEC_COL_BLOCKS;
    if (row16 >= io.rows) return; // the whole warp
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int col0 = cb < DEC_COL_BLOCKS - 1 ? cb * DEC_BN : INPUT_DIM - DEC_BN;
    const int skip = cb < DEC_COL_BLOCKS - 1 ? 0 : dec_overlap<P>() / 8; // n8 blocks left to the block before
    #pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = row16 + g + 8 * half;
        const bool live = row < io.rows; // rows past the end run along (whole-warp shuffles), write nothing
        if (live && (io.logits || io.recon)) {
            const size_t at = (size_t)row * INPUT_DIM + col0;
            for (int j = 0; j < DEC_BN / 8; j++) {
                if (j < skip) continue;
                const int c = 8 * j + 2 * t;
                const float l0 = logit[4 * j + 2 * half], l1 = logit[4 * j + 2 * half + 1];
                if (io.logits) *reinterpret_cast<float2*>(&io.logits[at + c]) = make_float2(l0, l1);
                if (io.recon)
                    *reinterpret_cast<float2*>(&io.recon[at + c]) =
                        make_float2(1.0f / (1.0f + expf(-l0)), 1.0f / (1.0f + expf(-l1)));
            }
        }
        if (io.pixels == NULL) continue;
        const uint8_t* x = io.pixels + (size_t)((live ? row : 0) / io.rows_per_image) * INPUT_DIM + col0;
        float dot = 0.0f, abs_sum = 0.0f, prod0 = 1.0f, prod1 = 1.0f; // sum (1/2 - x) l; sum |l|; prod 1 + e^-|l|
        for (int j = 0; j < DEC_BN / 8; j++) {
            if (j < skip) continue;
            const int c = 8 * j + 2 * t;
            const uint32_t px = *reinterpret_cast<const uint16_t*>(&x[c]); // two pixels
            const float l0 = logit[4 * j + 2 * half], l1 = logit[4 * j + 2 * half + 1];
            dot = fmaf(fmaf(byte_as_float(px, 0), -1.0f / 255.0f, 0.5f), l0, dot);
            dot = fmaf(fmaf(byte_as_float(px, 1), -1.0f / 255.0f, 0.5f), l1, dot);
            abs_sum += fabsf(l0) + fabsf(l1);
            prod0 = fmaf(prod0, fast_exp2(-fabsf(l0) * 1.4426950409f), prod0);
            prod1 = fmaf(prod1, fast_exp2(-fabsf(l1) * 1.4426950409f), prod1);
        }
        const float sum = quad_sum(dot + 0.5f * abs_sum + 0.6931471806f * fast_log2(prod0 * prod1));
        if (live && t == 0) io.parts[(size_t)row * DEC_COL_BLOCKS + cb] = sum;
    }
    if (io.bce == NULL) return; // the caller adds the parts itself (--iwae's logsumexp does)
    if (!last_to_arrive(&io.tickets[row16 / TASK_ROWS], DEC_COL_BLOCKS)) return;
    const int row = row16 + lane;
    if (lane < TASK_ROWS && row < io.rows) {
        float sum = __ldcg(&io.parts[(size_t)row * DEC_COL_BLOCKS]);
        for (int p = 1; p < DEC_COL_BLOCKS; p++) sum += __ldcg(&io.parts[(size_t)row * DEC_COL_BLOCKS + p]);
        io.bce[row] = sum;
    }
}

// bf16's or fp16's 1s at K = 400..402 (times fc4's bias parts), as thread t's A register pair.
template <typename T> __device__ inline uint32_t bias_ones(int t) {
    return t == 0 ? pack2<T>(1.0f, 1.0f) : t == 1 ? pack2<T>(1.0f, 0.0f) : 0u;
}

// ---- kernels: the decoder on Hopper (wgmma, TMA, mbarriers; sm_90a) -------------------------------------------------
// A block keeps its column block of fc4 and all of fc3 in shared memory; two warpgroups take 64-row tiles in turns at
// the tensor cores, one's epilogue beside the other's wgmmas (dev/NOTES.md, 'the decoder on Hopper').

// mbarriers, whose wait traps after ~1 s rather than hang: a pipeline bug fails the launch loudly.
__device__ inline void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ inline void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ inline void mbar_wait(uint32_t bar, uint32_t parity) {
    const long long start = clock64();
    for (uint32_t done = 0; !done;) {
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        if (!done && clock64() - start > 2000000000ll) __trap();
    }
}

__device__ inline void mbar_expect_load(uint32_t bar, uint32_t bytes) {
    mbar_init(bar, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    mbar_arrive_expect_tx(bar, bytes);
}

template <typename S> __device__ inline S& smem_aligned_1024(uint8_t* raw) {
    const uint32_t addr = (uint32_t)__cvta_generic_to_shared(raw);
    return *reinterpret_cast<S*>(raw + ((addr + 1023) & ~1023u) - addr);
}

__device__ inline void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int col, int row) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
                 "[%2];\n" ::"r"(dst), "l"(map), "r"(bar), "r"(col), "r"(row) : "memory");
}

// wgmma's shared-memory descriptor: core matrices `leading` bytes apart along K and `stride` along M or N, in layout 0
// (no swizzle), 1 (TMA's 128-byte swizzle) or 2 (its 64-byte one).
__device__ inline uint64_t smem_desc(uint32_t addr, uint32_t leading, uint32_t stride, uint64_t layout = 0) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)(leading >> 4) << 16 | (uint64_t)(stride >> 4) << 32 |
           layout << 62;
}

// K-major 128-byte rows in TMA's 128-byte swizzle: 8-row groups 1024 bytes apart; a k16 step is +32 bytes.
__device__ inline uint64_t smem_desc_128b(uint32_t addr) { return smem_desc(addr, 16, 1024, 1); }

__device__ inline void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING> __device__ inline void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

// An empty asm "writes" each accumulator: no access moves across a wgmma.wait_group, which the compiler cannot see.
template <int R> __device__ inline void fence_accumulators(float (&d)[R]) {
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x N] (+)= A B, A from registers in mma.sync's layout, that of an m16n8 accumulator pair (one wgmma's D is the
// next one's A): SHAPE, R accumulators as ACC and their "+f" list, A_OPS, PRED (accumulate), TRANS_B (imm-trans-b).
#define WGMMA_RS(SHAPE, ACC, A_OPS, PRED, TRANS_B, ...)                                                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\nwgmma.mma_async.sync.aligned." SHAPE " {" ACC "}, " \
                 A_OPS ", p, 1, 1, " TRANS_B ";\n}\n"                                                                  \
                 : __VA_ARGS__                                                                                         \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"((int)accumulate)                       \
                 : "memory")
#define WG_ACC10(t) "%" #t "0, %" #t "1, %" #t "2, %" #t "3, %" #t "4, %" #t "5, %" #t "6, %" #t "7, %" #t "8, %" #t "9"
#define WG_D10(t)                                                                                                      \
    "+f"(d[t##0]), "+f"(d[t##1]), "+f"(d[t##2]), "+f"(d[t##3]), "+f"(d[t##4]), "+f"(d[t##5]), "+f"(d[t##6]),           \
        "+f"(d[t##7]), "+f"(d[t##8]), "+f"(d[t##9])
__device__ inline void wgmma_m64n200k16_rs(float (&d)[100], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
    WGMMA_RS("m64n200k16.f32.bf16.bf16", WG_ACC10() ", " WG_ACC10(1) ", " WG_ACC10(2) ", " WG_ACC10(3) ", " WG_ACC10(4)
             ", " WG_ACC10(5) ", " WG_ACC10(6) ", " WG_ACC10(7) ", " WG_ACC10(8) ", " WG_ACC10(9),
             "{%100, %101, %102, %103}, %104", "%105", "0", WG_D10(), WG_D10(1), WG_D10(2), WG_D10(3), WG_D10(4),
             WG_D10(5), WG_D10(6), WG_D10(7), WG_D10(8), WG_D10(9));
}

template <typename T>
__device__ inline void wgmma_m64n80k16_rs(float (&d)[40], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
#define WG_M64N80(TYPE)                                                                                                \
    WGMMA_RS("m64n80k16.f32." TYPE "." TYPE, WG_ACC10() ", " WG_ACC10(1) ", " WG_ACC10(2) ", " WG_ACC10(3),            \
             "{%40, %41, %42, %43}, %44", "%45", "0", WG_D10(), WG_D10(1), WG_D10(2), WG_D10(3))
    if constexpr (std::is_same<T, bf16>::value) WG_M64N80("bf16");
    else WG_M64N80("f16");
}

template <int R>
__device__ inline void wgmma_fc4(float (&d)[R], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
    if constexpr (R == 100) wgmma_m64n200k16_rs(d, a, desc_b, accumulate);
    else WGMMA_RS("m64n88k16.f32.f16.f16", WG_ACC10() ", " WG_ACC10(1) ", " WG_ACC10(2) ", " WG_ACC10(3)
                  ", %40, %41, %42, %43", "{%44, %45, %46, %47}, %48", "%49", "0", WG_D10(), WG_D10(1), WG_D10(2),
                  WG_D10(3), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]));
}

// A constant A fragment materialised here, before a wgmma.fence, not between wgmmas (where ptxas would add a fence).
template <int R> __device__ inline void pin_registers(uint32_t (&a)[R]) {
    for (int i = 0; i < R; i++) asm volatile("" : "+r"(a[i])::"memory");
}

enum { BAR_TURN = 1 }; // named barriers 1, 2 (0 is __syncthreads): the warpgroups' turns at the tensor cores
__device__ inline void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ inline void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

enum { DEC_WG_SLICES = (HIDDEN_DIM + 63) / 64, DEC_WG_THREADS = 256 }; // fc4's K in swizzled 64-wide rows; 2 warpgroups

static_assert(FC4_K <= DEC_WG_SLICES * 64, "the bias parts fit the last slice");

template <Precision P> struct DecoderWgmmaSmem { // fc4's column block (fp32: and lo copy), fc3; swizzled rows
    typename Path<P>::T w4[Path<P>::SPLIT ? 2 : 1][DEC_WG_SLICES][Path<P>::DEC_BN][64];
    typename Path<P>::T w3[HIDDEN_DIM][Path<P>::Z_K];
    uint64_t loaded;
};

template <Precision P> constexpr int dec_wg_smem() { return sizeof(DecoderWgmmaSmem<P>) + 1024; } // + room to align
template <Precision P> __global__ void __launch_bounds__(DEC_WG_THREADS, 1)
    decoder_wgmma_kernel(const __grid_constant__ CUtensorMap w4_map, const __grid_constant__ CUtensorMap w3_map,
                         const DecoderIO io) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) // other targets compile an empty body; the host never launches it there
    typedef Path<P> Q;
    typedef typename Q::T T;
    constexpr int DEC_BN = Q::DEC_BN, DEC_COL_BLOCKS = Q::DEC_COL_BLOCKS, Z_STEPS = Q::Z_K / 16;
    extern __shared__ uint8_t smem_raw[];
    DecoderWgmmaSmem<P>& sm = smem_aligned_1024<DecoderWgmmaSmem<P>>(smem_raw);
    const int cb = blockIdx.x % DEC_COL_BLOCKS, col0 = cb < DEC_COL_BLOCKS - 1 ? cb * DEC_BN : INPUT_DIM - DEC_BN;

    if (threadIdx.x == 0) {
        const uint32_t bar = smem_addr(&sm.loaded);
        mbar_expect_load(bar, sizeof(sm.w4) + sizeof(sm.w3));
        for (int copy = 0; copy < (Q::SPLIT ? 2 : 1); copy++)
            for (int s = 0; s < DEC_WG_SLICES; s++)
                tma_load_2d(smem_addr(&sm.w4[copy][s][0][0]), &w4_map, bar, 64 * s, copy * INPUT_DIM + col0);
        tma_load_2d(smem_addr(&sm.w3[0][0]), &w3_map, bar, 0, 0);
        tma_load_2d(smem_addr(&sm.w3[HIDDEN_DIM / 2][0]), &w3_map, bar, 0, HIDDEN_DIM / 2);
    }
    __syncthreads();
    mbar_wait(smem_addr(&sm.loaded), 0);
    wait_for_prior_grid(); // the z rows

    // The copies of a column block deal 64-row tiles round-robin; both warpgroups take as many turns (barriers match)
    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, t = lane % 4;
    const int tiles = (io.rows + 63) / 64, copies = gridDim.x / DEC_COL_BLOCKS;
    const uint32_t w3_tile = smem_addr(&sm.w3[0][0]), w4_tile = smem_addr(&sm.w4[0][0][0][0]);
    const uint32_t w4_lo_tile = w4_tile + DEC_WG_SLICES * DEC_BN * 128; // fp32's lo copy
    uint32_t z_a[Z_STEPS][4]; // fc3's A fragments: z rows g and g + 8 of this warp's 16 in a tile
    auto load_z = [&](int tile) { load_z_fragments(z_a, io.z_rows, tile * 64 + warp * 16, io.rows); };
    float h[2 * DEC_CHUNK / 4];
    auto fc3_chunk = [&](int c) {
        wgmma_fence();
        const uint32_t tile = w3_tile + c * DEC_CHUNK * Q::Z_K * sizeof(T);
        const uint64_t desc = Q::Z_K == 32 ? smem_desc(tile, 16, 512, 2) : smem_desc_128b(tile);
        for (int s = 0; s < Z_STEPS; s++) wgmma_m64n80k16_rs<T>(h, z_a[s], desc + 2 * s, s > 0);
        wgmma_commit();
    };
    uint32_t a[2][DEC_STEPS][4], a_lo[2][DEC_STEPS][4]; // a tile's first fc3 chunk runs before its turn
    auto to_a = [&](int buffer, int tile, int c) {
        if (io.h3 && cb == 0) store_hidden(io.h3, h, tile * 64 + warp * 16, io.rows, c * DEC_CHUNK);
        relu_to_a<T>(a[buffer], a_lo[buffer], h);
    };
    uint32_t a_bias[4] = {bias_ones<T>(t), bias_ones<T>(t), 0u, 0u};
    load_z(blockIdx.x / DEC_COL_BLOCKS + wg * copies);
    fc3_chunk(0);
    wgmma_wait<0>();
    fence_accumulators(h);
    to_a(0, blockIdx.x / DEC_COL_BLOCKS + wg * copies, 0);
    if (wg == 1) named_bar_arrive(BAR_TURN + 0, 256); // warpgroup 0 takes the first turn
    for (int first = blockIdx.x / DEC_COL_BLOCKS; first < tiles; first += 2 * copies) {
        const int tile = first + wg * copies;
        const bool live_tile = tile < tiles;

        // This warpgroup's turn. A tile past the rows multiplies zeros: a condition would serialise the wgmmas.
        named_bar_sync(BAR_TURN + wg, 256);
        float logit[DEC_BN / 2];
        #pragma unroll
        for (int c = 0; c < DEC_CHUNKS; c++) {
            if (c + 1 < DEC_CHUNKS) fc3_chunk(c + 1); // this chunk's fc4 runs while its result is converted
            if (c + 1 == DEC_CHUNKS) pin_registers(a_bias); // materialised before the fence, not between wgmmas
            wgmma_fence();
            for (int s = 0; s < DEC_STEPS; s++) { // fc4's k16 step c * 5 + s: slice ks / 4, +32 bytes per step
                const int ks = c * DEC_STEPS + s, at = (ks / 4) * DEC_BN * 128;
                const uint64_t desc = smem_desc_128b(w4_tile + at) + 2 * (ks % 4);
                if constexpr (Q::SPLIT) { // the corrections al wh and ah wl first
                    wgmma_fc4(logit, a_lo[c % 2][s], desc, ks > 0);
                    wgmma_fc4(logit, a[c % 2][s], smem_desc_128b(w4_lo_tile + at) + 2 * (ks % 4), true);
                }
                wgmma_fc4(logit, a[c % 2][s], desc, Q::SPLIT || ks > 0);
            }
            if (c + 1 == DEC_CHUNKS) { // k16 step 25: the bias, times A = 1 in K = 400..402
                constexpr int ks = HIDDEN_DIM / 16;
                const uint64_t desc = smem_desc_128b(w4_tile + (ks / 4) * DEC_BN * 128) + 2 * (ks % 4);
                wgmma_fc4(logit, a_bias, desc, true);
            }
            wgmma_commit();
            if (c + 1 < DEC_CHUNKS) { // the next chunk's fc3 is done; this chunk's fc4 may still run
                wgmma_wait<1>();
                fence_accumulators(h);
                to_a((c + 1) % 2, tile, c + 1);
                if (c + 2 == DEC_CHUNKS) load_z(tile + 2 * copies); // z_a's last reader is done
            }
        }
        named_bar_arrive(BAR_TURN + 1 - wg, 256); // the other warpgroup's turn
        fc3_chunk(0); // the next tile's, behind the other warpgroup's first MMAs
        wgmma_wait<0>();
        fence_accumulators(logit), fence_accumulators(h);
        to_a(0, tile + 2 * copies, 0);
        if (!live_tile) continue;

        decoder_epilogue<P>(logit, tile * 64 + warp * 16, cb, io);
    }
    if (wg == 0) named_bar_sync(BAR_TURN + 0, 256); // warpgroup 1's last hand-over
#endif
}

// The encoder: a block keeps a slice of fc1's units and their [fc21 | fc22] columns; warpgroups widen 64 images' pixels
// into A fragments, the last slice merges (dev/NOTES.md, 'encoder_wgmma_kernel').
enum { ENC_WG_GROUPS = 4, ENC_WG_SLICES = FC1_K / 64 };
template <Precision P> struct EncoderWgmmaSmem {
    typename Path<P>::T w1[ENC_WG_SLICES][ENC_BN][64]; // K-major, 128-byte rows: 10 KB a slice, each 1024-byte aligned
    typename Path<P>::T w_enc[MULV_DIM][Path<P>::ENC_W_COLS + 8];
    float z[4 * ENC_WG_GROUPS][TASK_ROWS][LATENT_DIM], kl_terms[4 * ENC_WG_GROUPS][TASK_ROWS][LATENT_DIM];
    uint64_t loaded;
};

static_assert(sizeof(bf16) * ENC_BN * 64 % 1024 == 0, "every weight tile starts 1024-byte aligned");
template <Precision P> constexpr int enc_wg_smem() { return sizeof(EncoderWgmmaSmem<P>) + 1024; }
template <Precision P> __global__ void __launch_bounds__(ENC_WG_GROUPS * 128, 1)
    encoder_wgmma_kernel(const __grid_constant__ CUtensorMap w1_map, const EncoderIO io) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) // other targets compile an empty body; the host never launches it there
    typedef typename Path<P>::T T;
    extern __shared__ uint8_t smem_raw[];
    EncoderWgmmaSmem<P>& sm = smem_aligned_1024<EncoderWgmmaSmem<P>>(smem_raw);
    allow_dependent_launch();
    const int slice = blockIdx.x % Path<P>::ENC_SLICES, copies = gridDim.x / Path<P>::ENC_SLICES;
    const int row0 = slice * ENC_BN; // of fc1's rows in the kernels' layout
    if (threadIdx.x == 0) {
        const uint32_t bar = smem_addr(&sm.loaded);
        mbar_expect_load(bar, sizeof(sm.w1));
        for (int s = 0; s < ENC_WG_SLICES; s++) tma_load_2d(smem_addr(&sm.w1[s][0][0]), &w1_map, bar, 64 * s, row0);
    }
    copy_enc_weights<P>(sm.w_enc, io, slice);
    cp_async_wait<0>();
    __syncthreads();
    mbar_wait(smem_addr(&sm.loaded), 0);

    const int wg = threadIdx.x / 128, warp = threadIdx.x / 32;
    const uint32_t w1_tile = smem_addr(&sm.w1[0][0][0]);
    const int tasks = ceil_div(io.M, 64); // whole warpgroups: a task past the rows is never dealt
    for (int task = blockIdx.x / Path<P>::ENC_SLICES + copies * wg; task < tasks; task += copies * ENC_WG_GROUPS) {
        const int row16 = task * 64 + (warp % 4) * 16;
        const PixelRows rows(io.pixels, row16, io.M);
        float acc[2 * ENC_BN / 4];
        uint4 px[ENC_WG_SLICES][2]; // registers (constant indices): ENC_PREFETCH + 1 pixel blocks live
        uint32_t a[2][4][4]; // the A fragments of two pixel blocks: one read by wgmmas in flight, one filling
        for (int u = 0; u < ENC_PREFETCH; u++) rows.load(px[u], u);
        #pragma unroll
        for (int u = 0; u < ENC_WG_SLICES; u++) {
            if (u + ENC_PREFETCH < ENC_WG_SLICES) rows.load(px[u + ENC_PREFETCH], u + ENC_PREFETCH);
            pixel_fragments<T>(a[u % 2], px[u]);
            wgmma_fence();
            for (int j = 0; j < 4; j++) // k16 step 4u + j: slice u, +32 bytes per step
                wgmma_m64n80k16_rs<T>(acc, a[u % 2][j], smem_desc_128b(w1_tile + u * ENC_BN * 128) + 2 * j, u + j > 0);
            wgmma_commit();
            wgmma_wait<1>(); // the group before, which read a[(u + 1) % 2], is done
        }
        wgmma_wait<0>();
        fence_accumulators(acc);
        encoder_finish<P>(acc, sm.w_enc, row16, slice, io, sm.z[warp], sm.kl_terms[warp]);
    }
#endif
}

// ---- kernels: sampling z as the fused decoder's z rows --------------------------------------------------------------
struct SampleOut {
    uint4* z_rows;     // [rows][Z_K / 8]: the decoder's input (store_z_row)
    float* kl;         // [rows]: KL(q(z|x) || N(0, I)) of the row's image, the ELBO's
    float* log_ratio;  // [rows]: log p(z) - log q(z|x), --iwae's
};

// z rows drawn as sample_kernel draws them (row r: sample r % K of image r / K); NULL outputs not wanted.
template <Precision P>
__global__ void sample_z_kernel(SampleOut out, const float* __restrict__ mulv, const float* __restrict__ eps_in,
                                int rows, int K, uint32_t first_image, uint64_t seed, bool z_is_mu) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float z[LATENT_DIM], kl, ratio;
    sample_latents(z, LATENT_DIM, &kl, &ratio, mulv + (size_t)(r / K) * MULV_DIM,
                   eps_in ? eps_in + (size_t)r * LATENT_DIM : NULL, first_image + r / K, r % K, seed, z_is_mu);
    if (out.z_rows) store_z_row<P>(out.z_rows + (size_t)r * Path<P>::Z_K / 8, z);
    if (out.kl) out.kl[r] = kl;
    if (out.log_ratio) out.log_ratio[r] = ratio;
}

// ---- kernels: annealed importance sampling on Hopper, ais_kernel: every transition of a cluster's chains on chip ----
// The plain path's AIS on the same bits. A thread holds rows g, g + 8 and latents 8 (i / 2) + 2t + i % 2, i < 6 (below
// 20): an m16n8 accumulator's layout, so the gradient's accumulators are the chain state's own registers.
enum {
    AIS_WARPS = 8,
    AIS_ROWS = AIS_WARPS * TASK_ROWS, // chains a cluster holds at a time
    AIS_BAR_GROUP = 1,                // named barriers 1, 2: a tile's warps (ais_chains)
    AIS_BAR_TURN = 3,                 // 3, 4: the warpgroups' turns at the tensor cores (ais_turn_wait)
    AIS_LATENTS = 6,                  // latents a thread holds per row
    AIS_SHARE = 24,                   // floats of a block's share of a row: grad, BCE, padding (ais_merge)
};

// A thread's chain state, which in registers would spill: slot s of thread i of block b at state[(b * AIS_STATE_SLOTS +
// s) * AIS_THREADS + i]. Not __restrict__: with it nvcc keeps the state in registers.
enum {
    AIS_THREADS = AIS_WARPS * 32,
    AIS_SLOT_MU = 0, AIS_SLOT_INV_VAR = 2 * AIS_LATENTS, AIS_SLOT_Z0 = 4 * AIS_LATENTS,
    AIS_SLOT_GRAD0 = 6 * AIS_LATENTS, AIS_SLOT_BCE0 = 8 * AIS_LATENTS, AIS_STATE_SLOTS = AIS_SLOT_BCE0 + 2,
};

// A tile: a warpgroup's 64 chains if two hold as many images as 128 do (C = 16), so the two run apart; else 128.
__host__ __device__ inline int ais_tile_rows(int C) {
    return 2 * (AIS_ROWS / 2 / C) >= AIS_ROWS / C ? AIS_ROWS / 2 : AIS_ROWS;
}

__host__ __device__ inline int ais_cluster_images(int C) {
    return AIS_ROWS / ais_tile_rows(C) * (ais_tile_rows(C) / C);
}

struct AisMeet { uint64_t stored[2], added[2]; }; // per warpgroup: the other blocks' shares stored; ours read

__device__ inline void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

__device__ inline uint32_t cluster_rank() {
    uint32_t v = 0;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(v));
    return v;
}

__device__ inline uint32_t cluster_index() {
    uint32_t v = 0;
    asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(v));
    return v;
}

__device__ inline uint32_t cluster_count() {
    uint32_t v = 1;
    asm volatile("mov.u32 %0, %%nclusterid.x;\n" : "=r"(v));
    return v;
}

__device__ inline uint32_t cluster_address(const float* p, uint32_t rank) {
    uint32_t remote = 0;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
    return remote;
}

__device__ inline float2 cluster_load2(const float* p, uint32_t rank) {
    float2 v = make_float2(0.0f, 0.0f);
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(cluster_address(p, rank))
                 : "memory");
    return v;
}

__device__ inline float4 cluster_load4(const float* p, uint32_t rank) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(cluster_address(p, rank)) : "memory");
    return v;
}

// Cluster mbarriers: a fence releases, the arrivals are relaxed, the wait acquires; shared-memory-only fences where
// they suffice, as a full one also invalidates the L1, where spilled registers live. No time limit (compute-sanitizer).
__device__ inline void fence_cluster() { asm volatile("fence.acq_rel.cluster;\n" ::: "memory"); }

__device__ inline void fence_shared_release() {
    asm volatile("fence.release.sync_restrict::shared::cta.cluster;\n" ::: "memory");
}

template <int CLUSTER> __device__ inline void arrive_at_other_blocks(uint32_t bar) {
    const uint32_t own_rank = cluster_rank();
    for (uint32_t rank = 0; rank < (uint32_t)CLUSTER; rank++)
        if (rank != own_rank)
            asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                         "mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(rank)
                         : "memory");
}

__device__ inline void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.relaxed.cluster.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    asm volatile("fence.acquire.sync_restrict::shared::cluster.cluster;\n" ::: "memory");
}

// fc3 in fp16 hi and lo parts in both paths (bf16 moves grad 7% near the mode); the backward through W3: one product.
typedef fp16 AisW3;

// z as fc3's A: latents 0..15 as a k16 step of hi parts and one of lo parts, the rest of all three products in k24:
//   K  0..7   z hi 16..19, 1, 1, 1, 0   times  W3 hi 16..19, the bias parts, 0
//   K  8..11  z hi 16..19               times  W3 lo 16..19
//   K 12..15  z lo 16..19               times  W3 hi 16..19
// Thread t holds K 2t, 2t + 1 and 8 + 2t, 9 + 2t: lanes t = 2, 3 take z lo 16..19 from lanes 0, 1.
struct AisZFragments { uint32_t k16[4], k16_lo[4], k24[4]; };
__device__ inline AisZFragments ais_z_fragments(const float (&z)[2][AIS_LATENTS]) {
    const int t = threadIdx.x % 4;
    AisZFragments f;
    for (int half = 0; half < 2; half++) {
        pack_parts<AisW3>(f.k16[half], f.k16_lo[half], z[half][0], z[half][1]);
        pack_parts<AisW3>(f.k16[2 + half], f.k16_lo[2 + half], z[half][2], z[half][3]);
        const float k20 = t < 2 ? z[half][4] : 1.0f, k21 = t < 2 ? z[half][5] : t == 2 ? 1.0f : 0.0f;
        uint32_t k8, k8_lo;
        pack_parts<AisW3>(k8, k8_lo, k20, k21);
        const uint32_t lo_of_lane_t_minus_2 = __shfl_sync(0xffffffffu, k8_lo, (threadIdx.x % 32 & ~3) | (t & 1));
        f.k24[half] = k8, f.k24[2 + half] = t < 2 ? k8 : lo_of_lane_t_minus_2;
    }
    return f;
}

// fc3's parts in 128-byte cores [unit / 8][k / 8][unit % 8][k % 8]: hi K = 32 [W3 hi | bias parts | 0 | W3 lo 16..19,
// W3 hi 16..19], lo K = 16. Forward: a k16 step two cores 128 bytes apart, 8 units 512 (hi) or 256 (lo); backward
// (MN-major, N = 24): two unit groups 512 apart, a row's cores 128 (fp32's lo: N = 16 from lo, 8 from hi's last core).
struct AisW3Cores { AisW3 hi[HIDDEN_DIM / 8][4][8][8], lo[HIDDEN_DIM / 8][2][8][8]; };

enum : uint32_t { AIS_W3_CORE_BYTES = 128, AIS_W3_HI_GROUP_BYTES = 4 * 128, AIS_W3_LO_GROUP_BYTES = 2 * 128 };
// sigmoid(l) - x over each logit (zero before n8 block `skip`); with ENERGY the row's BCE share, as decoder_epilogue's.
template <bool ENERGY, int N>
__device__ inline void ais_epilogue(float (&logit)[N], const uint8_t* const (&x_row)[2], int skip,
                                    float (&bce_share)[2]) {
    const int t = threadIdx.x % 4;
    uint32_t pixels[2][N / 4]; // all first: loaded where used, they come in small batches, each an L2 round trip
    for (int half = 0; half < 2; half++)
        for (int j = 0; j < N / 4; j++)
            pixels[half][j] = *reinterpret_cast<const uint16_t*>(&x_row[half][8 * j + 2 * t]);
    #pragma unroll
    for (int half = 0; half < 2; half++) {
        float dot = 0.0f, abs_sum = 0.0f, prod0 = 1.0f, prod1 = 1.0f;
        for (int j = 0; j < N / 4; j++) {
            const uint32_t px = pixels[half][j];
            float* l = &logit[4 * j + 2 * half];
            const float b0 = byte_as_float(px, 0), b1 = byte_as_float(px, 1);
            if (ENERGY && j >= skip) {
                const float x0 = __fmul_rn(b0, 1.0f / 255.0f), x1 = __fmul_rn(b1, 1.0f / 255.0f);
                const float e0 = fast_exp2(-fabsf(l[0]) * 1.4426950409f), e1 = fast_exp2(-fabsf(l[1]) * 1.4426950409f);
                dot = fmaf(0.5f - x0, l[0], fmaf(0.5f - x1, l[1], dot));
                abs_sum += fabsf(l[0]) + fabsf(l[1]);
                prod0 = fmaf(prod0, e0, prod0), prod1 = fmaf(prod1, e1, prod1);
            }
            const float s0 = __fdividef(1.0f, 1.0f + fast_exp2(l[0] * -1.4426950409f));
            const float s1 = __fdividef(1.0f, 1.0f + fast_exp2(l[1] * -1.4426950409f));
            l[0] = j >= skip ? fmaf(b0, -1.0f / 255.0f, s0) : 0.0f;
            l[1] = j >= skip ? fmaf(b1, -1.0f / 255.0f, s1) : 0.0f;
        }
        bce_share[half] = ENERGY ? quad_sum(dot + 0.5f * abs_sum + 0.6931471806f * fast_log2(prod0 * prod1)) : 0.0f;
    }
}

// The epilogue's values as the backward's A fragments (fp32: and lo parts), k16 step s the columns 16s .. 16s + 15.
template <typename T, int N, int K_STEPS>
__device__ inline void ais_epilogue_to_a(float (&logit)[N], const uint8_t* const (&x_row)[2], int skip, bool energy,
                                         float (&bce_share)[2], uint32_t (&ga)[K_STEPS][4],
                                         uint32_t (&ga_lo)[K_STEPS][4]) {
    static_assert(K_STEPS == (N / 4 + 1) / 2, "a k16 step per two n8 blocks of logits");
    if (energy) ais_epilogue<true>(logit, x_row, skip, bce_share);
    else ais_epilogue<false>(logit, x_row, skip, bce_share);
    for (int s = 0; s < K_STEPS; s++) {
        const bool full = 2 * s + 1 < N / 4;
        pack_parts<T>(ga[s][0], ga_lo[s][0], logit[8 * s], logit[8 * s + 1]);
        pack_parts<T>(ga[s][1], ga_lo[s][1], logit[8 * s + 2], logit[8 * s + 3]);
        pack_parts<T>(ga[s][2], ga_lo[s][2], full ? logit[8 * s + 4] : 0.0f, full ? logit[8 * s + 5] : 0.0f);
        pack_parts<T>(ga[s][3], ga_lo[s][3], full ? logit[8 * s + 6] : 0.0f, full ? logit[8 * s + 7] : 0.0f);
    }
}

// The cluster's merge: store this block's (dz, BCE share), meet, add all blocks' in rank order (dev/NOTES.md, 'the
// cluster merge'). A row holds lane t's latents 2t, 2t + 1, 8 + 2t, 9 + 2t at 4t .. 4t + 3, then 16 + 2t, 17 + 2t
// (t < 2), the BCE (t = 2) or zeros at 16 + 2t.
template <int CLUSTER>
__device__ inline void ais_merge(float (*share)[AIS_SHARE], AisMeet& meet, uint32_t& merges, const float (&dz)[3][4],
                                 const float (&bce_share)[2], float (&grad)[2][AIS_LATENTS], float (&bce)[2]) {
    static_assert(AIS_SHARE >= 24, "a row holds the four lanes' 16-byte groups, then their 8-byte pairs");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const uint32_t stored = smem_addr(&meet.stored[warp / 4]), added = smem_addr(&meet.added[warp / 4]);
    if (merges > 0) mbar_wait_cluster(added, (merges - 1) & 1);
    for (int half = 0; half < 2; half++) {
        float* own = share[warp * TASK_ROWS + g + 8 * half];
        *reinterpret_cast<float4*>(&own[4 * t]) =
            make_float4(dz[0][2 * half], dz[0][2 * half + 1], dz[1][2 * half], dz[1][2 * half + 1]);
        *reinterpret_cast<float2*>(&own[16 + 2 * t]) = t < 2    ? make_float2(dz[2][2 * half], dz[2][2 * half + 1])
                                                        : t == 2 ? make_float2(bce_share[half], 0.0f)
                                                                 : make_float2(0.0f, 0.0f);
    }
    fence_shared_release();
    arrive_at_other_blocks<CLUSTER>(stored);
    mbar_wait_cluster(stored, merges & 1);
    for (int half = 0; half < 2; half++) {
        const float* row = share[warp * TASK_ROWS + g + 8 * half];
        float4 v4[CLUSTER];
        float2 v2[CLUSTER];
        for (uint32_t rank = 0; rank < (uint32_t)CLUSTER; rank++)
            v4[rank] = cluster_load4(&row[4 * t], rank), v2[rank] = cluster_load2(&row[16 + 2 * t], rank);
        float4 sum4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        float2 sum2 = make_float2(0.0f, 0.0f);
        for (int rank = 0; rank < CLUSTER; rank++) {
            sum4.x += v4[rank].x, sum4.y += v4[rank].y, sum4.z += v4[rank].z, sum4.w += v4[rank].w;
            sum2.x += v2[rank].x, sum2.y += v2[rank].y;
        }
        // latents past 20 stay zero: their z and p enter |z|^2 and |p|^2
        grad[half][0] = sum4.x, grad[half][1] = sum4.y, grad[half][2] = sum4.z, grad[half][3] = sum4.w;
        grad[half][4] = t < 2 ? sum2.x : 0.0f, grad[half][5] = t < 2 ? sum2.y : 0.0f;
        bce[half] = __shfl_sync(0xffffffffu, sum2.x, (lane & ~3) | 2);
    }
    merges++;
}

// The `added` arrivals, in the next evaluation after its forward products: there the full fence holds nothing up.
template <int CLUSTER> __device__ inline void ais_release_shares(AisMeet& meet, uint32_t merges) {
    if (merges == 0) return;
    fence_cluster(); // after reads of other blocks' shared memory
    arrive_at_other_blocks<CLUSTER>(smem_addr(&meet.added[threadIdx.x / 128]));
}

template <int CLUSTER> __device__ inline void ais_meet_init(AisMeet& meet) {
    if (threadIdx.x < 2) {
        mbar_init(smem_addr(&meet.stored[threadIdx.x]), (CLUSTER - 1) * 128);
        mbar_init(smem_addr(&meet.added[threadIdx.x]), (CLUSTER - 1) * 128);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    cluster_sync();
}

template <Precision P> __device__ inline int ais_columns(uint32_t rank, int* skip) {
    constexpr int BN = Path<P>::AIS_BN, CLUSTER = Path<P>::AIS_CLUSTER;
    *skip = rank < CLUSTER - 1 ? 0 : (CLUSTER * BN - INPUT_DIM) / 8;
    return rank < CLUSTER - 1 ? (int)rank * BN : INPUT_DIM - BN;
}

// A cluster's tiles through all their transitions, every block on the same bits; rank 0 writes the results.
template <typename Gradient>
__device__ inline void ais_chains(const AisIO& io, float* state, uint32_t rank, int col0, float* step_of,
                                  int* accepted_of, Gradient gradient) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int C = io.chains, tile_rows = ais_tile_rows(C), groups = AIS_ROWS / tile_rows;
    const int per_tile = tile_rows / C, tiles = ceil_div(io.n, per_tile);
    const int group = warp * TASK_ROWS / tile_rows, first_warp = group * tile_rows / TASK_ROWS;
    const int tid = threadIdx.x - 32 * first_warp; // the thread's index in its group
    step_of += group * tile_rows, accepted_of += group * tile_rows;
    auto group_sync = [&] { named_bar_sync(AIS_BAR_GROUP + group, 2 * tile_rows); };
    for (int first = cluster_index() * groups; first < tiles; first += cluster_count() * groups) {
        const int tile = first + group; // past the last: a tile of dead rows, as many evaluations as the other
        int local[2], image[2], chain[2];
        bool live[2];
        const uint8_t* x_row[2];
        float z[2][AIS_LATENTS], logvar_sum[2];
        float* slots = state + (size_t)blockIdx.x * AIS_STATE_SLOTS * AIS_THREADS + threadIdx.x;
        auto slot = [&](int s) -> float& { return slots[s * AIS_THREADS]; };
        auto mu = [&](int half, int i) -> float& { return slot(AIS_SLOT_MU + AIS_LATENTS * half + i); };
        auto inv_var = [&](int half, int i) -> float& { return slot(AIS_SLOT_INV_VAR + AIS_LATENTS * half + i); };
        #pragma unroll
        for (int half = 0; half < 2; half++) {
            const int row = (warp - first_warp) * TASK_ROWS + g + 8 * half;
            local[half] = row / C, chain[half] = row % C, image[half] = tile * per_tile + local[half];
            live[half] = local[half] < per_tile && image[half] < io.n;
            const int im = live[half] ? image[half] : 0; // dead rows run along on image 0, write nothing
            x_row[half] = io.pixels + (size_t)im * INPUT_DIM + col0;
            logvar_sum[half] = 0.0f;
            #pragma unroll
            for (int i = 0; i < AIS_LATENTS; i++) {
                const int j = 8 * (i / 2) + 2 * t + i % 2;
                mu(half, i) = inv_var(half, i) = z[half][i] = 0.0f;
                if (j >= LATENT_DIM) continue;
                const float* mulv = io.mulv + (size_t)im * MULV_DIM;
                const float m = mulv[j], logvar = mulv[LATENT_DIM + j];
                mu(half, i) = m, inv_var(half, i) = expf(-logvar), logvar_sum[half] += logvar;
                z[half][i] = ais_start_z(io, im, chain[half], j, LATENT_DIM, m, logvar);
            }
            logvar_sum[half] = quad_sum(logvar_sum[half]);
        }
        if (tid < per_tile) step_of[tid] = io.step0, accepted_of[tid] = 0;
        group_sync();

        float grad[2][AIS_LATENTS], bce[2];
        gradient(z, x_row, grad, bce, true);
        const size_t row0 = (size_t)tile * per_tile * C + (warp - first_warp) * TASK_ROWS + g; // launch's rows
        if (io.probe.grad0 && rank == 0)
            for (int half = 0; half < 2; half++)
                for (int i = 0; i < AIS_LATENTS; i++) {
                    const int j = 8 * (i / 2) + 2 * t + i % 2;
                    if (live[half] && j < LATENT_DIM)
                        io.probe.grad0[(row0 + 8 * half) * LATENT_DIM + j] = grad[half][i];
                    if (live[half] && j == 0) io.probe.bce0[row0 + 8 * half] = bce[half];
                }
        // log p(x, z) and log p0(z) per row (a row's four lanes added by shuffles)
        auto log_densities = [&](const float (&zz)[2][AIS_LATENTS], const float (&b)[2], float (&lpxz)[2],
                                 float (&lp0)[2]) {
            for (int half = 0; half < 2; half++) {
                float sq = 0.0f, mahal = 0.0f;
                for (int i = 0; i < AIS_LATENTS; i++)
                    ais_density_terms(zz[half][i], mu(half, i), inv_var(half, i), &sq, &mahal);
                ais_log_densities(b[half], quad_sum(sq), quad_sum(mahal), logvar_sum[half], &lpxz[half], &lp0[half]);
            }
        };
        double log_w[2] = {0.0, 0.0};
        int accepted[2] = {0, 0};
        float delta_h[2] = {0.0f, 0.0f};
        for (int s = 1; s <= io.T; s++) {
            float lpxz[2], lp0[2];
            log_densities(z, bce, lpxz, lp0);
            for (int half = 0; half < 2; half++) log_w[half] += ais_weight_term(io, s, lpxz[half], lp0[half]);
            if (s == io.T) break;
            const float beta = ais_target(io, s);
            float p[2][AIS_LATENTS], step[2], h0[2]; // HMC: momentum, H0, L leapfrog steps, the test
            #pragma unroll
            for (int half = 0; half < 2; half++) {
                float kinetic = 0.0f;
                #pragma unroll
                for (int i = 0; i < AIS_LATENTS; i += 2) {
                    const int j = 8 * (i / 2) + 2 * t;
                    const bool injected = io.probe.p_start && s == 1 && live[half] && j < LATENT_DIM;
                    const float* given = injected ? io.probe.p_start + (row0 + 8 * half) * LATENT_DIM + j : NULL;
                    const float2 e = j >= LATENT_DIM ? make_float2(0.0f, 0.0f)
                                     : injected      ? make_float2(given[0], given[1])
                                                     : ais_momentum(io, image[half], chain[half], s, j, LATENT_DIM);
                    p[half][i] = e.x, p[half][i + 1] = e.y;
                    kinetic = fmaf(e.x, e.x, fmaf(e.y, e.y, kinetic));
                }
                h0[half] = ais_energy(beta, lpxz[half], lp0[half], quad_sum(kinetic));
                step[half] = step_of[local[half] < per_tile ? local[half] : 0];
                slot(AIS_SLOT_BCE0 + half) = bce[half];
                for (int i = 0; i < AIS_LATENTS; i++)
                    slot(AIS_SLOT_Z0 + AIS_LATENTS * half + i) = z[half][i],
                    slot(AIS_SLOT_GRAD0 + AIS_LATENTS * half + i) = grad[half][i];
            }
            // p -= eps/2 grad U first, then L times: z += eps p, the gradient, p -= eps grad U (eps/2 at the end)
            auto kick = [&](float scale) {
                for (int half = 0; half < 2; half++)
                    for (int i = 0; i < AIS_LATENTS; i++)
                        p[half][i] = ais_kick(p[half][i], z[half][i], grad[half][i], mu(half, i), inv_var(half, i),
                                              beta, scale * step[half]);
            };
            kick(0.5f);
            for (int l = 1; l <= io.leapfrog; l++) {
                for (int half = 0; half < 2; half++)
                    for (int i = 0; i < AIS_LATENTS; i++) z[half][i] = ais_drift(z[half][i], p[half][i], step[half]);
                gradient(z, x_row, grad, bce, l == io.leapfrog);
                kick(l < io.leapfrog ? 1.0f : 0.5f);
            }
            log_densities(z, bce, lpxz, lp0);
            if (io.probe.proposal && s == io.T - 1 && rank == 0)
                for (int half = 0; half < 2; half++)
                    for (int i = 0; i < AIS_LATENTS; i++) {
                        const int j = 8 * (i / 2) + 2 * t + i % 2;
                        float* out = io.probe.proposal + (row0 + 8 * half) * 2 * LATENT_DIM + j;
                        if (live[half] && j < LATENT_DIM) out[0] = z[half][i], out[LATENT_DIM] = p[half][i];
                    }
            for (int half = 0; half < 2; half++) {
                float kinetic = 0.0f;
                for (int i = 0; i < AIS_LATENTS; i++) kinetic = fmaf(p[half][i], p[half][i], kinetic);
                const float h1 = ais_energy(beta, lpxz[half], lp0[half], quad_sum(kinetic));
                const bool accept = ais_accept(io, image[half], chain[half], s, h0[half], h1);
                delta_h[half] = h0[half] - h1;
                if (!accept) {
                    bce[half] = slot(AIS_SLOT_BCE0 + half);
                    for (int i = 0; i < AIS_LATENTS; i++)
                        z[half][i] = slot(AIS_SLOT_Z0 + AIS_LATENTS * half + i),
                        grad[half][i] = slot(AIS_SLOT_GRAD0 + AIS_LATENTS * half + i);
                }
                accepted[half] += accept;
                if (accept && live[half] && t == 0) atomicAdd(&accepted_of[local[half]], 1);
            }
            group_sync();
            if (tid < per_tile) { // each image's step size, from the acceptance of its C chains
                step_of[tid] = ais_adapted_step(io, step_of[tid], accepted_of[tid], C);
                accepted_of[tid] = 0;
            }
            group_sync();
        }
        if (rank == 0) {
            for (int half = 0; half < 2; half++) {
                if (!live[half]) continue;
                const size_t row = row0 + 8 * half;
                if (t == 0) io.log_w[row] = log_w[half], io.accepted[row] = accepted[half];
                if (t == 0 && io.probe.delta_h) io.probe.delta_h[row] = delta_h[half];
                if (io.probe.z_out)
                    for (int i = 0; i < AIS_LATENTS; i++) {
                        const int j = 8 * (i / 2) + 2 * t + i % 2;
                        if (j < LATENT_DIM) io.probe.z_out[row * LATENT_DIM + j] = z[half][i];
                    }
            }
            if (tid < per_tile && tile * per_tile + tid < io.n) io.step_out[tile * per_tile + tid] = step_of[tid];
        }
        group_sync(); // the step sizes are the next tile's
    }
}

// The gradient on wgmma: per 64 units fc3, then fc4 with its ReLU as A; backward dh = (sigmoid - x) W4 (fc4 read
// MN-major), masked, dz += dh W3. fp32: three products on fp16 parts (dev/NOTES.md, 'the fused AIS gradient').
enum { AIS_WG_GROUPS = DEC_WG_SLICES };
static_assert((int)AIS_ROWS == (int)FUSED_AIS_CHAINS, "the interface's count of the chains a cluster holds");
static_assert(AIS_WG_GROUPS >= 2, "the backward hands its turn over as it issues its last group (q + 2 == groups)");

// fc4's column block: bf16 K in 64-wide slices of 200 rows, the decoder's swizzle; fp32 hi and lo copies of 104 rows in
// cores [copy][column / 8][k / 8][column % 8][k % 8], K = 408. Forward: a k16 step two cores 128 bytes apart, 8 columns
// 6,528 apart; backward (MN-major): two column groups 6,528 apart, 8 units 128.
struct AisFc4Swizzled { bf16 w[AIS_WG_GROUPS][Path<PRECISION_BF16>::AIS_BN][64]; };
struct AisFc4Cores { fp16 w[2][Path<PRECISION_FP32>::AIS_BN / 8][FC4_K / 8][8][8]; };
enum : uint32_t { AIS_FC4_GROUP_BYTES = FC4_K / 8 * 128 };
enum : uint32_t { AIS_FC4_COPY_BYTES = Path<PRECISION_FP32>::AIS_BN / 8 * AIS_FC4_GROUP_BYTES };
template <Precision P> struct AisWgmmaSmem {
    std::conditional_t<P == PRECISION_BF16, AisFc4Swizzled, AisFc4Cores> w4;
    AisW3Cores w3; // right after w4: the backward's last k16 step reads 8 rows past it
    float share[AIS_ROWS][AIS_SHARE];
    AisMeet meet;
    float step[AIS_ROWS];
    int accepted[AIS_ROWS];
    uint64_t loaded;
};

static_assert(offsetof(AisWgmmaSmem<PRECISION_BF16>, w3) == sizeof(AisFc4Swizzled) &&
                  offsetof(AisWgmmaSmem<PRECISION_FP32>, w3) == sizeof(AisFc4Cores),
              "the rows the backward's last k16 step reads past fc4 (times zero A) are fc3's: finite");
static_assert(Path<PRECISION_FP32>::AIS_BN % 8 == 0 && FC4_K % 8 == 0, "fp32's fc4 in whole core matrices");
static_assert(Path<PRECISION_BF16>::DEC_BN == Path<PRECISION_BF16>::AIS_BN,
              "ais_kernel loads its column block with the decoder's tensor map, whose box is DEC_BN rows");
// A tile read MN-major in the 128-byte swizzle: 64 values along N a row, 8-row atoms along K 1024 bytes apart.
__device__ inline uint64_t smem_desc_128b_mn(uint32_t addr) { return smem_desc(addr, 1024, 1024, 1); }

template <typename T, bool MN_MAJOR>
__device__ inline void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
    static_assert(std::is_same<T, fp16>::value || MN_MAJOR, "bf16 is read MN-major only");
#define WG_M64N64(TYPE, TRANS_B)                                                                                       \
    WGMMA_RS("m64n64k16.f32." TYPE "." TYPE, WG_ACC10() ", " WG_ACC10(1) ", " WG_ACC10(2) ", %30, %31",                \
             "{%32, %33, %34, %35}, %36", "%37", TRANS_B, WG_D10(), WG_D10(1), WG_D10(2), "+f"(d[30]), "+f"(d[31]))
    if constexpr (std::is_same<T, bf16>::value) WG_M64N64("bf16", "1");
    else if constexpr (MN_MAJOR) WG_M64N64("f16", "1");
    else WG_M64N64("f16", "0");
}

// Turns at the tensor cores: a warpgroup issues its forward products in one, its backward in the next, merging between.
__device__ inline void ais_turn_wait() { named_bar_sync(AIS_BAR_TURN + threadIdx.x / 128, 256); }
__device__ inline void ais_turn_pass() { named_bar_arrive(AIS_BAR_TURN + 1 - threadIdx.x / 128, 256); }

// The narrow N: fc3's last 16 units (K-major), the backward through fc3 (24; fp32 also 16, 8), fp32's fc4's last 16.
template <int N, bool MN_MAJOR>
__device__ inline void wgmma_f16_narrow_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b,
                                           bool accumulate) {
    static_assert(N == 8 || N == 16 || N == 24, "the narrow N: 8, 16, 24");
#define WG_D8 "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define WG_NARROW(TRANS_B)                                                                                             \
    if constexpr (N == 8) WGMMA_RS("m64n8k16.f32.f16.f16", "%0, %1, %2, %3", "{%4, %5, %6, %7}, %8", "%9", TRANS_B,   \
                                   "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]));                                   \
    else if constexpr (N == 16) WGMMA_RS("m64n16k16.f32.f16.f16", "%0, %1, %2, %3, %4, %5, %6, %7",                    \
                                         "{%8, %9, %10, %11}, %12", "%13", TRANS_B, WG_D8);                            \
    else WGMMA_RS("m64n24k16.f32.f16.f16", WG_ACC10() ", %10, %11", "{%12, %13, %14, %15}, %16", "%17",              \
                  TRANS_B, WG_D10(), "+f"(d[10]), "+f"(d[11]))
    if constexpr (MN_MAJOR) WG_NARROW("1");
    else WG_NARROW("0");
}

__device__ inline void wgmma_m64n104k16_f16_rs(float (&d)[52], const uint32_t (&a)[4], uint64_t desc_b,
                                               bool accumulate) {
    WGMMA_RS("m64n104k16.f32.f16.f16", WG_ACC10() ", " WG_ACC10(1) ", " WG_ACC10(2) ", " WG_ACC10(3) ", " WG_ACC10(4)
             ", %50, %51", "{%52, %53, %54, %55}, %56", "%57", "0", WG_D10(), WG_D10(1), WG_D10(2), WG_D10(3),
             WG_D10(4), "+f"(d[50]), "+f"(d[51]));
}

// fc3's ReLU mask off fc4's A fragments, 32 bits per 64 units: pair j (register r of k16 step i: j = 4i + r) at bits j
// and 16 + j, each half 1 if positive (min.relu.s16x2 with 1) (dev/NOTES.md, 'the ReLU mask').
__device__ inline uint32_t relu_pair_flags(uint32_t pair, int j) {
    uint32_t flags;
    asm("min.relu.s16x2 %0, %1, %2;\n" : "=r"(flags) : "r"(pair), "r"(0x00010001u));
    return flags << j;
}

// Pair j's AND mask: its flags to bits 15 and 31, which prmt's selector 0xBB99 spreads over each half.
__device__ inline uint32_t relu_pair_keep(uint32_t mask, int j) {
    uint32_t keep;
    asm("prmt.b32 %0, %1, 0, 0xBB99;\n" : "=r"(keep) : "r"(mask << (15 - j)));
    return keep;
}

// fc3 of group q's N units as one wgmma group: lo hi, hi lo, hi hi, then k24, the mma.sync gradient's order and sums.
template <int N> __device__ inline void ais_fc3_wgmma(float (&h)[N / 2], uint32_t w3, int q, const AisZFragments& za) {
    constexpr uint32_t CORE = AIS_W3_CORE_BYTES, HI = AIS_W3_HI_GROUP_BYTES, LO = AIS_W3_LO_GROUP_BYTES;
    const uint32_t hi = w3 + q * 8 * HI, lo = w3 + HIDDEN_DIM / 8 * HI + q * 8 * LO;
    auto product = [&](const uint32_t (&a)[4], uint32_t b, uint32_t group, bool accumulate) {
        if constexpr (N == 64) wgmma_m64n64k16_rs<fp16, false>(h, a, smem_desc(b, CORE, group), accumulate);
        else wgmma_f16_narrow_rs<16, false>(h, a, smem_desc(b, CORE, group), accumulate);
    };
    wgmma_fence();
    product(za.k16_lo, hi, HI, false), product(za.k16, lo, LO, true), product(za.k16, hi, HI, true);
    product(za.k24, hi + 2 * CORE, HI, true);
    wgmma_commit();
}

// BCE and grad_z BCE for the warpgroup's 64 rows.
template <Precision P>
__device__ inline void ais_gradient_wgmma(AisWgmmaSmem<P>& sm, uint32_t w4, uint32_t& merges,
                                          const float (&z)[2][AIS_LATENTS], const uint8_t* const (&x_row)[2],
                                          int skip, float (&grad)[2][AIS_LATENTS], float (&bce)[2], bool energy) {
    typedef Path<P> Q;
    typedef typename Q::T T;
    constexpr bool SPLIT = Q::SPLIT;
    constexpr int BN = Q::AIS_BN, K_STEPS = (BN + 15) / 16, SLICE_BYTES = BN * 128;
    constexpr uint32_t CORE = AIS_W3_CORE_BYTES, GROUP = AIS_FC4_GROUP_BYTES, COPY = AIS_FC4_COPY_BYTES;
    const int t = threadIdx.x % 4;
    const AisZFragments za = ais_z_fragments(z);
    constexpr int BUFFERS = SPLIT ? 1 : 2; // fc4's A and dh: bf16 two, wgmmas reading one while warps write the other
    uint32_t mask[AIS_WG_GROUPS]; // fc3's ReLU: group q's pair j at bits j and 16 + j (relu_pair_flags)
    float logit[BN / 2];
    uint32_t a[BUFFERS][4][4], a_lo[BUFFERS][4][4]; // group q's A fragments in a[q % BUFFERS]
    const uint32_t a_bias[4] = {bias_ones<T>(t), bias_ones<T>(t), 0u, 0u};
    const uint32_t w3 = smem_addr(&sm.w3); // fc3 of q + 1 runs before fc4 of q; bf16 takes its ReLU meanwhile
    float h[32];
    auto fc3_group = [&](int q) {
        if (q < AIS_WG_GROUPS - 1) ais_fc3_wgmma<64>(h, w3, q, za);
        else ais_fc3_wgmma<16>(*reinterpret_cast<float(*)[8]>(h), w3, q, za);
    };
    auto to_a = [&](int q) { // group q's ReLU as fc4's A fragments, and its mask
        const int chunks = q < AIS_WG_GROUPS - 1 ? 4 : 1; // 400 = 6 x 64 + 16
        fence_accumulators(h);
        uint32_t mask_part[4] = {0u, 0u, 0u, 0u}; // ORed at the end, not one by one: no dependent chain
        for (int i = 0; i < 4; i++) {
            if (i < chunks) {
                const float(&chunk)[8] = *reinterpret_cast<const float(*)[8]>(&h[8 * i]);
                uint32_t hi[1][4], lo[1][4];
                relu_to_a<T>(hi, lo, chunk);
                for (int r = 0; r < 4; r++) {
                    mask_part[i] |= relu_pair_flags(hi[0][r], 4 * i + r);
                    a[q % BUFFERS][i][r] = hi[0][r];
                    if constexpr (SPLIT) a_lo[q % BUFFERS][i][r] = lo[0][r];
                }
            } else if (i == chunks) { // the last group's next k16 step: K = 400..415, the bias parts
                for (int r = 0; r < 4; r++) a[q % BUFFERS][i][r] = a_bias[r];
            }
        }
        mask[q] = (mask_part[0] | mask_part[1]) | (mask_part[2] | mask_part[3]);
    };
    auto fc4_step = [&](int q, int i, bool bias) { // bf16 one product; fp32 three (the bias step one)
        if constexpr (SPLIT) {
            const uint32_t step = w4 + (4 * q + i) * 2 * CORE;
            auto desc = [&](uint32_t at) { return smem_desc(at, CORE, GROUP); };
            if (!bias) {
                wgmma_m64n104k16_f16_rs(logit, a_lo[q % BUFFERS][i], desc(step), q + i > 0);
                wgmma_m64n104k16_f16_rs(logit, a[q % BUFFERS][i], desc(step + COPY), true);
            }
            wgmma_m64n104k16_f16_rs(logit, a[q % BUFFERS][i], desc(step), true);
        } else {
            wgmma_m64n200k16_rs(logit, a[q % BUFFERS][i], smem_desc_128b(w4 + q * SLICE_BYTES) + 2 * i, q + i > 0);
        }
    };
    fc3_group(0); // before the turn: a turn starts with fc4
    ais_turn_wait();
    wgmma_wait<0>();
    to_a(0);
    #pragma unroll
    for (int q = 0; q < AIS_WG_GROUPS; q++) {
        const int chunks = q < AIS_WG_GROUPS - 1 ? 4 : 1;
        if (q + 1 < AIS_WG_GROUPS) fc3_group(q + 1);
        wgmma_fence();
        for (int i = 0; i < 4; i++)
            if (i < chunks + (q == AIS_WG_GROUPS - 1 ? 1 : 0)) fc4_step(q, i, i == chunks);
        wgmma_commit();
        if (q + 1 == AIS_WG_GROUPS) ais_turn_pass();
        if (q + 1 < AIS_WG_GROUPS) {
            wgmma_wait<BUFFERS - 1>(); // fc3 of q + 1 is done (and fc4 of q - 1 or q, whose A buffer it overwrites)
            to_a(q + 1);
        }
    }
    ais_release_shares<Q::AIS_CLUSTER>(sm.meet, merges);
    wgmma_wait<0>();
    fence_accumulators(logit);
    float bce_share[2];
    uint32_t ga[K_STEPS][4], ga_lo[K_STEPS][4];
    ais_epilogue_to_a<T>(logit, x_row, skip, energy, bce_share, ga, ga_lo);
    float dz[3][4], dh[BUFFERS][32]; // group q's dh in dh[q % BUFFERS]
    if constexpr (!SPLIT) // bf16's products all accumulate; fp32's first (lo hi) writes them
        for (int i = 0; i < 12; i++) dz[i / 4][i % 4] = 0.0f;
    float(&dz_acc)[12] = *reinterpret_cast<float(*)[12]>(&dz[0][0]); // W3's m64n24 accumulators: n8 block j at 4j
    float dz_lo[8], dz_lo16[4]; // fp32's hi lo products apart: on dz_acc, ptxas serializes every wgmma
    uint32_t masked[4][4], masked_lo[4][4]; // group q's dh through fc3's ReLU as W3's A fragments
    auto backward_group = [&](int q) {
        wgmma_fence();
        if constexpr (SPLIT) { // units 64q.. are cores 8q.. of each column group; the last group's 16 on N = 16
            for (int s = 0; s < K_STEPS; s++) {
                const uint32_t at = w4 + q * 8 * CORE + 2 * s * GROUP;
                const uint64_t hi = smem_desc(at, GROUP, CORE), lo = smem_desc(at + COPY, GROUP, CORE);
                if (q < AIS_WG_GROUPS - 1) {
                    wgmma_m64n64k16_rs<fp16, true>(dh[q % BUFFERS], ga_lo[s], hi, s > 0);
                    wgmma_m64n64k16_rs<fp16, true>(dh[q % BUFFERS], ga[s], lo, true);
                    wgmma_m64n64k16_rs<fp16, true>(dh[q % BUFFERS], ga[s], hi, true);
                } else {
                    float(&d)[8] = *reinterpret_cast<float(*)[8]>(&dh[q % BUFFERS][0]);
                    wgmma_f16_narrow_rs<16, true>(d, ga_lo[s], hi, s > 0);
                    wgmma_f16_narrow_rs<16, true>(d, ga[s], lo, true);
                    wgmma_f16_narrow_rs<16, true>(d, ga[s], hi, true);
                }
            }
        } else {
            const uint32_t slice = w4 + q * SLICE_BYTES;
            for (int s = 0; s < K_STEPS; s++)
                wgmma_m64n64k16_rs<bf16, true>(dh[q % BUFFERS], ga[s], smem_desc_128b_mn(slice + 2048 * s), s > 0);
        }
        wgmma_commit();
    };
    ais_turn_wait();
    backward_group(0);
    #pragma unroll
    for (int q = 0; q < AIS_WG_GROUPS; q++) {
        if (BUFFERS == 2 && q + 1 < AIS_WG_GROUPS) {
            backward_group(q + 1);
            if (q + 2 == AIS_WG_GROUPS) ais_turn_pass(); // after issuing the last group
            wgmma_wait<1>();
        } else {
            wgmma_wait<0>();
        }
        // dz += masked W3 per 64 units, in the mma.sync gradient's order; its A is free after the next wait
        fence_accumulators(dh[q % BUFFERS]);
        const int chunks = q < AIS_WG_GROUPS - 1 ? 4 : 1;
        for (int i = 0; i < 4; i++)
            if (i < chunks)
                for (int r = 0; r < 4; r++) {
                    const int v = 8 * i + 2 * r;
                    const uint32_t keep = relu_pair_keep(mask[q], 4 * i + r);
                    uint32_t hi, lo;
                    pack_parts<fp16>(hi, lo, dh[q % BUFFERS][v], dh[q % BUFFERS][v + 1]);
                    masked[i][r] = hi & keep, masked_lo[i][r] = lo & keep;
                }
        wgmma_fence();
        for (int i = 0; i < 4; i++)
            if (i < chunks) { // units 16 (4q + i) .. + 15: two core groups of fc3's hi part, K-adjacent
                const uint32_t units = w3 + (4 * q + i) * 2 * AIS_W3_HI_GROUP_BYTES;
                const uint64_t hi = smem_desc(units, AIS_W3_HI_GROUP_BYTES, CORE);
                if constexpr (SPLIT) { // lo hi; hi lo: latents 0..15 from the lo part, 16..19 the hi's last core
                    const uint32_t lo_units = w3 + HIDDEN_DIM / 8 * AIS_W3_HI_GROUP_BYTES +
                                              (4 * q + i) * 2 * AIS_W3_LO_GROUP_BYTES;
                    wgmma_f16_narrow_rs<24, true>(dz_acc, masked_lo[i], hi, q + i > 0);
                    wgmma_f16_narrow_rs<16, true>(dz_lo, masked[i],
                                                  smem_desc(lo_units, AIS_W3_LO_GROUP_BYTES, CORE), q + i > 0);
                    wgmma_f16_narrow_rs<8, true>(dz_lo16, masked[i],
                                                 smem_desc(units + 3 * CORE, AIS_W3_HI_GROUP_BYTES, CORE),
                                                 q + i > 0);
                }
                wgmma_f16_narrow_rs<24, true>(dz_acc, masked[i], hi, true);
            }
        wgmma_commit();
        if (BUFFERS == 1 && q + 1 < AIS_WG_GROUPS) { // dh read: the next group may write it
            backward_group(q + 1);
            if (q + 2 == AIS_WG_GROUPS) ais_turn_pass();
        }
    }
    wgmma_wait<0>();
    fence_accumulators(dz_acc);
    if constexpr (SPLIT) {
        fence_accumulators(dz_lo), fence_accumulators(dz_lo16);
        for (int i = 0; i < 4; i++) dz[0][i] += dz_lo[i], dz[1][i] += dz_lo[4 + i], dz[2][i] += dz_lo16[i];
    }
    ais_merge<Q::AIS_CLUSTER>(sm.share, sm.meet, merges, dz, bce_share, grad, bce);
}

// fc4's column block col0 (bf16 by TMA, fp32 by cp.async into its cores) and fc3's parts.
template <Precision P>
__device__ inline void ais_load_weights_wgmma(AisWgmmaSmem<P>& sm, const CUtensorMap& w4_map,
                                              const typename Path<P>::T* __restrict__ fc4_wb,
                                              const fp16* __restrict__ ais_w3, int col0) {
    if constexpr (P == PRECISION_BF16) {
        if (threadIdx.x == 0) {
            const uint32_t bar = smem_addr(&sm.loaded);
            mbar_expect_load(bar, sizeof(sm.w4));
            for (int s = 0; s < AIS_WG_GROUPS; s++)
                tma_load_2d(smem_addr(&sm.w4.w[s][0][0]), &w4_map, bar, 64 * s, col0);
        }
    } else {
        constexpr int BN = Path<P>::AIS_BN, K8 = FC4_K / 8;
        for (int c = threadIdx.x; c < 2 * BN * K8; c += blockDim.x) {
            const int copy = c / (BN * K8), col = c / K8 % BN, k8 = c % K8;
            cp_async16(&sm.w4.w[copy][col / 8][k8][col % 8][0],
                       fc4_wb + ((size_t)copy * INPUT_DIM + col0 + col) * FC4_K + 8 * k8, true);
        }
    }
    for (int c = threadIdx.x; c < HIDDEN_DIM * 6; c += blockDim.x) { // fc3's parts
        const int unit = c / 6, k8 = c % 6;
        const fp16* hi = ais_w3 + (size_t)unit * AIS_W3_K;
        const fp16* lo = hi + (size_t)HIDDEN_DIM * AIS_W3_K;
        if (k8 < 3) {
            cp_async16(&sm.w3.hi[unit / 8][k8][unit % 8][0], hi + 8 * k8, true);
        } else if (k8 < 5) {
            cp_async16(&sm.w3.lo[unit / 8][k8 - 3][unit % 8][0], lo + 8 * (k8 - 3), true);
        } else {
            *reinterpret_cast<uint2*>(&sm.w3.hi[unit / 8][3][unit % 8][0]) = *reinterpret_cast<const uint2*>(lo + 16);
            *reinterpret_cast<uint2*>(&sm.w3.hi[unit / 8][3][unit % 8][4]) = *reinterpret_cast<const uint2*>(hi + 16);
        }
    }
    cp_async_commit();
    cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); // cp.async's and stores' writes, for wgmma
    __syncthreads();
    if constexpr (P == PRECISION_BF16) mbar_wait(smem_addr(&sm.loaded), 0);
}

// Block r of a cluster keeps column block r of fc4 and all of fc3; the blocks add their gradients' shares over DSMEM.
template <Precision P> __global__ void __launch_bounds__(AIS_THREADS, 1)
    ais_kernel(const typename Path<P>::T* __restrict__ fc4_wb, const __grid_constant__ CUtensorMap w4_map,
               const fp16* __restrict__ ais_w3, float* state, const AisIO io) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) // other targets compile an empty body; the host never launches it there
    extern __shared__ __align__(16) uint8_t smem_raw[];
    const uint32_t rank = cluster_rank();
    int skip;
    const int col0 = ais_columns<P>(rank, &skip);
    uint32_t merges = 0; // the thread's merges (ais_merge)
    AisWgmmaSmem<P>& sm = smem_aligned_1024<AisWgmmaSmem<P>>(smem_raw);
    ais_load_weights_wgmma(sm, w4_map, fc4_wb, ais_w3, col0);
    ais_meet_init<Path<P>::AIS_CLUSTER>(sm.meet);
    if (threadIdx.x >= 128) named_bar_arrive(AIS_BAR_TURN, 256); // warpgroup 0 takes the first turn
    const uint32_t w4 = smem_addr(&sm.w4);
    ais_chains(io, state, rank, col0, sm.step, sm.accepted,
               [&](const float (&z)[2][AIS_LATENTS], const uint8_t* const (&x_row)[2], float (&grad)[2][AIS_LATENTS],
                   float (&bce)[2], bool energy) {
                   ais_gradient_wgmma<P>(sm, w4, merges, z, x_row, skip, grad, bce, energy);
               });
    if (threadIdx.x < 128) named_bar_sync(AIS_BAR_TURN, 256); // warpgroup 1's last hand-over
    cluster_sync(); // no block leaves while another may still read its shares or arrive at its barriers
#endif
}

// ---- launchers (every launch goes to the model's stream, so a forward pass can be graph-captured) -------------------
// cuTensorMapEncodeTiled is the driver's; the runtime hands out its address, so the program needs no -lcuda.
static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] { // once, for whichever GPU's thread asks first
        void* fn = NULL;
        cudaDriverEntryPointQueryResult found;
        cudaCheck(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || fn == NULL)
            fail("the driver has no cuTensorMapEncodeTiled. HINT: update the NVIDIA driver");
        return (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }();
    return encode;
}

// A 16-bit matrix's TMA map: boxes of box_rows x 64 (32) columns, 128 (64)-byte swizzle, zeros past the edges.
static CUtensorMap tensor_map_16bit(const void* base, int rows, int cols, int box_rows, int box_cols = 64) {
    CUtensorMap map;
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}; // innermost first
    const cuuint64_t row_pitch[1] = {(cuuint64_t)cols * 2};
    const cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows}, element_strides[2] = {1, 1};
    const CUtensorMapSwizzle swizzle = box_cols == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
    if (box_cols != 64 && box_cols != 32) fail("internal: TMA boxes are 32 or 64 values wide, not %d", box_cols);
    const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, (void*)base, dims, row_pitch,
                                            box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        fail("internal: cuTensorMapEncodeTiled failed (%d) for a %d x %d matrix", (int)r, rows, cols);
    return map;
}

// A block per SM, in whole groups of the slices, at most a group a 64-image task.
template <Precision P>
static void encoder_launch(const EncoderIO& io, const CUtensorMap& w1_map, int sms, cudaStream_t stream) {
    constexpr int SLICES = Path<P>::ENC_SLICES;
    const int tasks = ceil_div(io.M, 64), copies = sms / SLICES < tasks ? sms / SLICES : tasks;
    encoder_wgmma_kernel<P><<<SLICES * copies, ENC_WG_GROUPS * 128, enc_wg_smem<P>(), stream>>>(w1_map, io);
    cudaCheck(cudaGetLastError());
}

// Groups of the column blocks, at most a block per SM and a group a 64-row tile; a programmatic dependent launch.
template <Precision P>
static void decoder_launch(const DecoderIO& io, const CUtensorMap& w4_map, const CUtensorMap& w3_map, int sms,
                           cudaStream_t stream) {
    constexpr int BLOCKS = Path<P>::DEC_COL_BLOCKS;
    const int copies = std::min(sms / BLOCKS, ceil_div(io.rows, 64));
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization, attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(BLOCKS * copies), cfg.stream = stream, cfg.attrs = &attr, cfg.numAttrs = 1;
    cfg.blockDim = dim3(DEC_WG_THREADS), cfg.dynamicSmemBytes = dec_wg_smem<P>();
    cudaCheck(cudaLaunchKernelEx(&cfg, decoder_wgmma_kernel<P>, w4_map, w3_map, io));
}

template <Precision P> constexpr int ais_smem() { return (int)sizeof(AisWgmmaSmem<P>) + 1024; } // + room to align
template <Precision P>
static cudaLaunchConfig_t ais_config(cudaLaunchAttribute* attr, int clusters, cudaStream_t stream) {
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = Path<P>::AIS_CLUSTER, attr->val.clusterDim.y = 1, attr->val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(Path<P>::AIS_CLUSTER * clusters), cfg.blockDim = dim3(AIS_THREADS);
    cfg.dynamicSmemBytes = ais_smem<P>(), cfg.stream = stream, cfg.attrs = attr, cfg.numAttrs = 1;
    return cfg;
}

template <Precision P>
static void ais_launch(const AisIO& io, const void* fc4_wb, const CUtensorMap& w4_map, const void* ais_w3,
                       float* state, int clusters, cudaStream_t stream) {
    typedef typename Path<P>::T T;
    const int rounds = ceil_div(io.n, ais_cluster_images(io.chains));
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = ais_config<P>(&attr, clusters < rounds ? clusters : rounds, stream);
    cudaCheck(cudaLaunchKernelEx(&cfg, ais_kernel<P>, static_cast<const T*>(fc4_wb), w4_map,
                                 static_cast<const fp16*>(ais_w3), state, io));
}

// ---- the Hopper engine's state, and the interface's entry points ----------------------------------------------------
// 1 where the code loaded for this GPU is sm_90a's: the host picks the engine from what runs, not what could.
__global__ void has_wgmma_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    *out = 1;
#else
    *out = 0;
#endif
}

static bool gpu_runs_sm90a_code() {
    int *d_flag = NULL, flag = 0;
    cudaCheck(cudaMalloc(&d_flag, sizeof(int)));
    launch(has_wgmma_kernel, 1, 1, 1, 0, d_flag);
    cudaCheck(cudaMemcpy(&flag, d_flag, sizeof(int), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(d_flag));
    return flag == 1;
}

// The published model for the fused kernels: 16-bit weights and their TMA maps, z rows, merges, AIS's state, views.
struct Fused {
    Precision precision;
    cudaStream_t stream; // the model's
    int sms, max_batch, decoder_rows;
    const float *fc1_b, *enc_b; // fp32 biases, the model's
    void* params16;
    const void *fc1_wp, *enc_w16, *fc3_wb, *fc4_wb, *ais_w3; // ais_w3: fc3 for ais_kernel, [parts][400][24]
    CUtensorMap w1_map, w4_map, w3_map;
    uint4* z_rows;                       // [decoder_rows][Z_K / 8]
    float* enc_partials;                 // [max_batch][slices][40]
    unsigned *enc_tickets, *dec_tickets; // per 16 images, per 16 decoder rows; zero between launches
    int ais_clusters;                    // ais_kernel's clusters at once; 0 without sm_90a code (--ais needs it)
    float* ais_state;                    // ais_kernel's chain state for ais_clusters (AIS_STATE_SLOTS a thread)
    float *h1, *h3, *mulv, *z, *logits, *recon; // [max_batch][...] (h1, h3: fp32 only, for the tests)
    float *bce_parts, *row_log_ratio;           // [decoder_rows][DEC_COL_BLOCKS], [decoder_rows]
};

template <Precision P> static void fused_init_path(Fused* f, const float* const* tensor) {
    typedef typename Path<P>::T T;
    constexpr int COPIES = Path<P>::SPLIT ? 2 : 1;
    const size_t B = (size_t)f->max_batch, R = (size_t)f->decoder_rows;
    const size_t fc1 = (size_t)Path<P>::ENC_SLICES * ENC_BN * FC1_K,
                 enc = (size_t)MULV_DIM * Path<P>::ENC_SLICES * Path<P>::ENC_W_COLS,
                 fc3 = (size_t)HIDDEN_DIM * Path<P>::Z_K, fc4 = (size_t)COPIES * INPUT_DIM * FC4_K,
                 ais_fc3 = (size_t)2 * HIDDEN_DIM * AIS_W3_K; // fp16 hi and lo in both paths (AisW3Cores)
    T* p = (T*)device_alloc((fc1 + enc + fc3 + fc4 + ais_fc3) * sizeof(T), "the 16-bit weights");
    f->params16 = p;
    auto convert = [&](Layer layer, const float* w, const float* b, size_t count) {
        T* dst = p;
        p += count;
        launch(weights_kernel<P>, count, 256, 256, f->stream, dst, layer, w, b, (long long)count);
        return dst;
    };
    f->fc1_wp = convert(LAYER_FC1, tensor[FC1_W], NULL, fc1);
    f->enc_w16 = convert(LAYER_ENC, tensor[FC21_W], NULL, enc);
    f->fc3_wb = convert(LAYER_FC3, tensor[FC3_W], tensor[FC3_B], fc3);
    f->fc4_wb = convert(LAYER_FC4, tensor[FC4_W], tensor[FC4_B], fc4);
    f->ais_w3 = p;
    launch(weights_kernel<PRECISION_FP32>, ais_fc3, 256, 256, f->stream, (fp16*)p, LAYER_AIS_FC3, tensor[FC3_W],
           tensor[FC3_B], (long long)ais_fc3);
    f->z_rows = (uint4*)device_alloc(R * Path<P>::Z_K * 2, "z rows");
    const cudaFuncAttribute max_smem = cudaFuncAttributeMaxDynamicSharedMemorySize;
    cudaCheck(cudaFuncSetAttribute(ais_kernel<P>, max_smem, ais_smem<P>()));
    cudaCheck(cudaFuncSetAttribute(encoder_wgmma_kernel<P>, max_smem, enc_wg_smem<P>()));
    cudaCheck(cudaFuncSetAttribute(decoder_wgmma_kernel<P>, max_smem, dec_wg_smem<P>()));
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = ais_config<P>(&attr, 1, 0);
    cudaCheck(cudaOccupancyMaxActiveClusters(&f->ais_clusters, ais_kernel<P>, &cfg));
    if (f->ais_clusters > 0) // not without sm_90a code, where --ais stops at vae_ais_round
        f->ais_state = (float*)device_alloc((size_t)f->ais_clusters * Path<P>::AIS_CLUSTER * AIS_STATE_SLOTS *
                                            AIS_THREADS * sizeof(float), "the AIS chains' state");
    f->w1_map = tensor_map_16bit(f->fc1_wp, Path<P>::ENC_SLICES * ENC_BN, FC1_K, ENC_BN);
    f->w4_map = tensor_map_16bit(f->fc4_wb, COPIES * INPUT_DIM, FC4_K, Path<P>::DEC_BN);
    f->w3_map = tensor_map_16bit(f->fc3_wb, HIDDEN_DIM, Path<P>::Z_K, HIDDEN_DIM / 2, Path<P>::Z_K);
    if (P == PRECISION_FP32) { // the tests' view of the hidden layers
        f->h1 = (float*)device_alloc(B * HIDDEN_DIM * sizeof(float), "h1");
        f->h3 = (float*)device_alloc(B * HIDDEN_DIM * sizeof(float), "h3");
    }
    f->bce_parts = (float*)device_alloc(R * Path<P>::DEC_COL_BLOCKS * sizeof(float), "BCE parts");
    f->mulv = (float*)device_alloc(B * MULV_DIM * sizeof(float), "mu/logvar");
    f->z = (float*)device_alloc(B * LATENT_DIM * sizeof(float), "z");
    f->logits = (float*)device_alloc(B * INPUT_DIM * sizeof(float), "logits");
    f->recon = (float*)device_alloc(B * INPUT_DIM * sizeof(float), "recon");
    f->row_log_ratio = (float*)device_alloc(R * sizeof(float), "per-row log-density ratios");
    f->enc_partials = (float*)device_alloc(B * MAX_ENC_SLICES * MULV_DIM * sizeof(float), "encoder partials");
    const size_t enc_tickets = ceil_div(f->max_batch, TASK_ROWS), dec_tickets = ceil_div(f->decoder_rows, TASK_ROWS);
    f->enc_tickets = (unsigned*)device_alloc((enc_tickets + dec_tickets) * sizeof(unsigned), "tickets");
    f->dec_tickets = f->enc_tickets + enc_tickets;
    cudaCheck(cudaMemset(f->enc_tickets, 0, (enc_tickets + dec_tickets) * sizeof(unsigned)));
}

static Fused* fused_init(VAE* m) {
    Fused* f = (Fused*)calloc(1, sizeof(Fused));
    if (f == NULL) fail("out of host memory for the fused kernels' state");
    f->precision = m->precision, f->stream = m->stream, f->sms = gpu_attribute(cudaDevAttrMultiProcessorCount);
    f->max_batch = m->max_batch, f->decoder_rows = m->decoder_rows;
    f->fc1_b = m->tensor[FC1_B], f->enc_b = m->tensor[FC21_B];
    BY_PRECISION(m->precision, fused_init_path)(f, m->tensor);
    m->h1 = f->h1, m->h3 = f->h3, m->mulv = f->mulv, m->z = f->z, m->logits = f->logits, m->recon = f->recon;
    m->bce_parts = f->bce_parts, m->row_log_ratio = f->row_log_ratio;
    m->bce_parts_per_row = m->precision == PRECISION_FP32 ? Path<PRECISION_FP32>::DEC_COL_BLOCKS
                                                          : Path<PRECISION_BF16>::DEC_COL_BLOCKS;
    return f;
}

static void fused_free(Fused* f) {
    void* buffers[] = {f->h1, f->mulv, f->z, f->h3, f->logits, f->recon, f->bce_parts, f->params16, f->z_rows,
                       f->row_log_ratio, f->enc_partials, f->enc_tickets, f->ais_state};
    for (void* p : buffers) cudaCheck(cudaFree(p)); // cudaFree(NULL) is a no-op
    free(f);
}

static_assert(std::max({enc_wg_smem<PRECISION_FP32>(), enc_wg_smem<PRECISION_BF16>(), dec_wg_smem<PRECISION_FP32>(),
                        dec_wg_smem<PRECISION_BF16>(), ais_smem<PRECISION_FP32>(), ais_smem<PRECISION_BF16>()}) ==
                  FUSED_SMEM_BYTES && FUSED_SMEM_BYTES <= 232448,
              "the interface's count of the shared memory the fused kernels ask for, within a block's 227 KB");

// With pixels, row r is scored against image r / rows_per_image, its BCE into bce[r] (NULL: left in f->bce_parts).
static void fused_decoder(Fused* f, const uint8_t* pixels, int rows, int rows_per_image, float* bce, float* logits,
                          float* recon, float* h3 = NULL) {
    const DecoderIO io = {f->z_rows, pixels, rows, rows_per_image, bce, f->bce_parts, f->dec_tickets, logits, recon,
                          h3};
    BY_PRECISION(f->precision, decoder_launch)(io, f->w4_map, f->w3_map, f->sms, f->stream);
}

static void fused_encoder(Fused* f, EncoderIO io) {
    io.partials = f->enc_partials, io.tickets = f->enc_tickets, io.enc_w = f->enc_w16;
    io.fc1_b = f->fc1_b, io.enc_b = f->enc_b;
    BY_PRECISION(f->precision, encoder_launch)(io, f->w1_map, f->sms, f->stream);
}

static void fused_encode(Fused* f, const uint8_t* pixels, int B) {
    EncoderIO io = {};
    io.z_rows = f->z_rows, io.mulv_out = f->mulv, io.pixels = pixels, io.M = B, io.z_is_mu = true;
    fused_encoder(f, io);
}

static void fused_decode(Fused* f, const float* z, int B) {
    launch(BY_PRECISION(f->precision, z_rows_kernel), B, 128, 128, f->stream, f->z_rows, z, B);
    fused_decoder(f, NULL, B, 1, NULL, NULL, f->recon);
}

static void fused_forward(Fused* f, const uint8_t* pixels, int B, uint32_t first_image, const ForwardOptions* opt,
                          const Probe& probe, float* bce, float* kl) {
    const bool keep = probe.keep_activations;
    EncoderIO io = {};
    io.z_rows = f->z_rows, io.kl = kl, io.mulv_out = keep ? f->mulv : NULL, io.z_out = keep ? f->z : NULL;
    io.h1 = keep ? f->h1 : NULL, io.pixels = pixels, io.eps = probe.eps, io.M = B, io.first_image = first_image;
    io.seed = opt->seed, io.z_is_mu = opt->z_is_mu;
    fused_encoder(f, io);
    fused_decoder(f, pixels, B, 1, bce, keep ? f->logits : NULL, opt->want_recon ? f->recon : NULL,
                  keep ? f->h3 : NULL);
}

// No tickets: the logsumexp adds each row's BCE parts itself, in the same order.
static void fused_iwae_pass(Fused* f, const uint8_t* pixels, const float* mulv, const float* eps, int rows, int K,
                            uint32_t first_image, uint64_t seed) {
    const SampleOut out = {f->z_rows, NULL, f->row_log_ratio};
    launch(BY_PRECISION(f->precision, sample_z_kernel), rows, 128, 128, f->stream, out, mulv, eps, rows, K,
           first_image, seed, false);
    fused_decoder(f, pixels, rows, K, NULL, NULL, NULL);
}

static int fused_ais_images(const Fused* f, int C) { return f->ais_clusters * ais_cluster_images(C); }

static void fused_ais(Fused* f, const AisIO& io) {
    BY_PRECISION(f->precision, ais_launch)(io, f->fc4_wb, f->w4_map, f->ais_w3, f->ais_state, f->ais_clusters,
                                           f->stream);
}
