/*
test_vae.cu: checks vae.cu against PyTorch.

    make test        prepares data/ if missing, builds, runs this

    ./test_vae --quick --precision bf16    a GPU subset for compute-sanitizer (dev/sanitize.sh)
    ./test_vae --exhaustive                every case of the sampled sweeps (make test-exhaustive)

Host checks (run everywhere, GPU or not): the weight, idx and reference-state files load; a
plain-loop float64 CPU forward pass (cpu_reference.h) over our weights and pixel reader
reproduces PyTorch's float64 activations; the generator matches the published Philox4x32-10
answers; a corpus of corrupt files (truncated at every header byte, every header field set to 0,
1, -1, huge, off by one, byte-swapped, non-finite weights, bad labels, directories, empty and
oversized files) is refused with a message by the parsers, and by ./vae as one line and exit
status 1 when ./vae is built (a sample of each family: each ./vae run costs ~85 ms, its CUDA
libraries loading, and ~1,340 of the inputs are ones it reads; --exhaustive sends every one); bad flags likewise.
GPU checks: every activation of vae_forward against PyTorch's float64 reference (outputs
poisoned with NaN beforehand, so an unwritten element fails); per-image results identical across
batch sizes; the same seed reproduces bit for bit; full-test-set mean losses; a batch too large
for the GPU ends in one clear line.
Ends with "N passed, N failed, N skipped"; exits non-zero if anything failed.
*/
#define TESTING
#include "vae.cu"
#include "cpu_reference.h" // the float64 CPU model the checks compare against

#include <chrono>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <sys/wait.h>

// ----------------------------------------------------------------------------
// a minimal test harness: each check prints one line and is counted

static int n_passed = 0, n_failed = 0, n_skipped = 0;

static bool check(bool ok, const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    printf("  %-7s ", ok ? "ok" : "NOT OK");
    vprintf(fmt, args);
    printf("\n");
    va_end(args);
    ok ? n_passed++ : n_failed++;
    return ok;
}

static void skip(const char* what, const char* why) {
    printf("  %-7s %s (%s)\n", "skip", what, why);
    n_skipped++;
}

// --exhaustive: every case of the sweeps that the default run samples (./vae on the corrupt inputs, AIS's and
// BDMC's T = 1000). The checks are the same ones; sampling changes how much backs them.
static bool exhaustive = false;

static double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One line with a phase's wall time, from `since` (now_s()); returns now, the next phase's start.
static double phase_done(const char* what, double since) {
    const double now = now_s();
    printf("  (%s: %.1f s)\n", what, now - since);
    return now;
}

// Tolerances, as max |ours - float64 reference| / max |reference| over a tensor.
//  - float64 CPU loops vs PyTorch float64: only the summation order differs (~1e-16 per term).
//  - fp32 GPU vs float64: operands as two fp16 parts (22 bits) and fp32 accumulation in the tensor
//    cores, which truncates; sums of up to 784 products and four layers in a row stay inside 1e-5
//    (2.8e-6 at worst when this was written; PyTorch's own float32 lands near 1e-6, printed beside).
//  - bf16 GPU vs float64: bf16 operands carry 8 significant bits (rounding 2^-9 = 2e-3 relative),
//    and h1, h3 are rounded to bf16 between layers as well; through four layers that compounds
//    to about 1e-2 of a tensor's scale.
static const double TOL_FLOAT64 = 1e-10;
static const double TOL_FP32 = 1e-5;
static const double TOL_BF16 = 2e-2;
static const double TOLERANCE[] = {TOL_FP32, TOL_BF16}; // by Precision

typedef struct {
    double max_abs, rel; // rel: max_abs over the largest |reference| value
} Diff;

template <typename T>
static Diff diff(const T* got, const double* ref, size_t n, size_t stride = 1, size_t width = 0) {
    // width > 0 compares `width` values out of every `stride` (a column slice of a wider tensor)
    if (width == 0) width = stride;
    double max_abs = 0.0, scale = 0.0;
    for (size_t i = 0; i < n; i++) {
        const size_t g = (i / width) * stride + i % width;
        const double d = fabs((double)got[g] - ref[i]);
        max_abs = (d > max_abs || d != d) ? d : max_abs; // NaN sticks
        scale = fmax(scale, fabs(ref[i]));
    }
    return Diff{max_abs, scale > 0 ? max_abs / scale : max_abs};
}

static bool check_diff(const char* what, Diff d, double tol, const char* extra = "") {
    return check(d.rel <= tol, "%-8s max abs %.2e  rel %.2e  tol %.0e%s", what, d.max_abs, d.rel, tol, extra);
}

// ----------------------------------------------------------------------------
// the reference state written by prepare_weights.py

enum { DEBUG_MAGIC = 0x44454156 /* "VAED" */, DEBUG_VERSION = 1, MAX_CASES = 8, MAX_CASE_BATCH = 4096 };
enum { T_X, T_EPS, T_H1, T_MU, T_LOGVAR, T_Z, T_H3, T_LOGITS, T_RECON, T_BCE, T_KL, NUM_DEBUG_TENSORS };
// A tensor's values an image, for a model of size d.
static int debug_width(ModelDims d, int t) {
    const int widths[NUM_DEBUG_TENSORS] = {INPUT_DIM, d.z, d.h1, d.z, d.z, d.z, d.h3, INPUT_DIM, INPUT_DIM, 1, 1};
    return widths[t];
}
static const char* DEBUG_NAMES[NUM_DEBUG_TENSORS] = {"x",  "eps",    "h1",    "mu",  "logvar", "z",
                                                     "h3", "logits", "recon", "bce", "kl"};

typedef struct {
    int B, first_image;
    const double* t64[NUM_DEBUG_TENSORS]; // PyTorch float64
    const float* t32[NUM_DEBUG_TENSORS];  // PyTorch float32, same eps
} DebugCase;

typedef struct {
    ModelDims dims;
    uint8_t* buf;      // the file, which t32 points into (float32 data is 4-byte aligned there)
    double* storage64; // the float64 tensors, copied out: in the file some are only 4-byte aligned
    int num_cases;
    DebugCase cases[MAX_CASES];
} DebugState;

// The dump's sizes (784, H1 and Z in header[2..4], H3 in header[h3_at], or 0 there for H1) against those of the model
// it was made from.
static bool state_dims_match(const uint8_t* buf, int h3_at, ModelDims dims, const char* name, Error* err) {
    const int h3 = read_le32(buf + 4 * h3_at) != 0 ? read_le32(buf + 4 * h3_at) : read_le32(buf + 12);
    if (read_le32(buf + 8) != INPUT_DIM || read_le32(buf + 12) != dims.h1 || read_le32(buf + 16) != dims.z ||
        h3 != dims.h3)
        return set_error(err, "%s: dims 784-%d-%d-%d do not match the model's 784-%d-%d-%d. " PREPARE_HINT, name,
                         read_le32(buf + 12), read_le32(buf + 16), h3, dims.h1, dims.z, dims.h3);
    return true;
}
// Every count is checked against the file's size before anything is allocated or read (the
// fuzzer in fuzz/ feeds this arbitrary bytes); num_images bounds each case's images.
static bool parse_debug_state(uint8_t* buf, size_t size, const char* name, int num_images, ModelDims dims,
                              DebugState* s, Error* err) {
    const size_t header_bytes = HEADER_INTS * sizeof(int32_t);
    if (size < header_bytes) return set_error(err, "%s: %zu bytes, shorter than its header. " PREPARE_HINT, name, size);
    if (read_le32(buf) != DEBUG_MAGIC || read_le32(buf + 4) != DEBUG_VERSION)
        return set_error(err, "%s: not a version-%d reference state file. " PREPARE_HINT, name, DEBUG_VERSION);
    if (!state_dims_match(buf, 6, dims, name, err)) return false;
    s->dims = dims;
    s->num_cases = read_le32(buf + 20);
    if (s->num_cases < 1 || s->num_cases > MAX_CASES)
        return set_error(err, "%s: %d cases, expected 1..%d. " PREPARE_HINT, name, s->num_cases, MAX_CASES);
    // first pass: validate the cases and the size; B <= 4096 keeps every product far from overflow
    size_t offset = header_bytes, doubles = 0;
    for (int c = 0; c < s->num_cases; c++) {
        DebugCase* dc = &s->cases[c];
        dc->B = read_le32(buf + 4 * (8 + 2 * c));
        dc->first_image = read_le32(buf + 4 * (9 + 2 * c));
        if (dc->B < 1 || dc->B > MAX_CASE_BATCH || dc->first_image < 0 || (int64_t)dc->first_image + dc->B > num_images)
            return set_error(err, "%s: case %d has batch %d from image %d, outside the %d test images. " PREPARE_HINT,
                             name, c, dc->B, dc->first_image, num_images);
        for (int t = 0; t < NUM_DEBUG_TENSORS; t++) {
            const size_t n = (size_t)dc->B * debug_width(dims, t);
            if (n * (sizeof(double) + sizeof(float)) > size - offset)
                return set_error(err, "%s: truncated in case %d, tensor %s. " PREPARE_HINT, name, c, DEBUG_NAMES[t]);
            offset += n * (sizeof(double) + sizeof(float));
            doubles += n;
        }
    }
    if (offset != size) return set_error(err, "%s: %zu bytes, expected %zu. " PREPARE_HINT, name, size, offset);
    // second pass: point at the float32 data, copy the float64 data out
    s->storage64 = (double*)malloc(doubles * sizeof(double));
    if (s->storage64 == NULL) return set_error(err, "%s: out of host memory", name);
    double* dst = s->storage64;
    offset = header_bytes;
    for (int c = 0; c < s->num_cases; c++)
        for (int t = 0; t < NUM_DEBUG_TENSORS; t++) {
            const size_t n = (size_t)s->cases[c].B * debug_width(dims, t);
            memcpy(dst, buf + offset, n * sizeof(double));
            s->cases[c].t64[t] = dst;
            dst += n, offset += n * sizeof(double);
            s->cases[c].t32[t] = (const float*)(buf + offset);
            offset += n * sizeof(float);
        }
    s->buf = buf;
    return true;
}

// ----------------------------------------------------------------------------
// host checks

static void test_cpu_forward(const HostWeights* w, const Images* images, const DebugState* ds) {
    printf("CPU float64 forward vs PyTorch float64 (validates weights file, reader and dump)\n");
    for (int c = 0; c < ds->num_cases; c++) {
        const DebugCase* dc = &ds->cases[c];
        printf(" case B=%d from image %d\n", dc->B, dc->first_image);
        const size_t npix = (size_t)dc->B * INPUT_DIM;
        double* x = (double*)malloc(npix * sizeof(double));
        float* x32 = (float*)malloc(npix * sizeof(float));
        for (size_t i = 0; i < npix; i++) {
            const uint8_t p = images->pixels[(size_t)dc->first_image * INPUT_DIM + i];
            x[i] = p / 255.0;
            x32[i] = (float)p / 255.0f; // what the GPU computes from each byte
        }
        check_diff("x", diff(x, dc->t64[T_X], npix), 0.0, "  (our idx reader, float64)");
        Diff dx32 = diff(x32, dc->t64[T_X], npix);
        Diff dx32_torch = diff(dc->t32[T_X], dc->t64[T_X], npix);
        check(dx32.max_abs == dx32_torch.max_abs && !memcmp(x32, dc->t32[T_X], npix * sizeof(float)),
              "x float32 from uint8 / 255 equals PyTorch's float32 x bit for bit");
        const CpuActs a = cpu_forward(w, ds->dims, x, dc->t32[T_EPS], dc->B);
        const double* ours[] = {a.h1.data(), a.mu.data(),     a.logvar.data(), a.z.data(), a.h3.data(),
                                a.logits.data(), a.recon.data(), a.bce.data(), a.kl.data()};
        for (int t = T_H1; t < NUM_DEBUG_TENSORS; t++)
            check_diff(DEBUG_NAMES[t], diff(ours[t - T_H1], dc->t64[t], (size_t)dc->B * debug_width(ds->dims, t)),
                       TOL_FLOAT64);
        free(x);
        free(x32);
    }
}

static void test_generator() {
    printf("random numbers: Philox4x32-10 known answers (Random123) and Gaussian moments\n");
    struct {
        uint4 counter;
        uint2 key;
        uint4 expected;
    } kat[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
        {{~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}, {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
        {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
         {0xa4093822u, 0x299f31d0u},
         {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
    };
    for (auto& k : kat) {
        uint4 r = philox4x32(k.counter, k.key);
        check(r.x == k.expected.x && r.y == k.expected.y && r.z == k.expected.z && r.w == k.expected.w,
              "philox4x32(%08x..., key %08x...) = %08x %08x %08x %08x", k.counter.x, k.key.x, r.x, r.y, r.z, r.w);
    }
    // 200k draws: the mean's standard error is 0.0022 and the variance's 0.0032; 5 sigma bounds
    const int n = 200000;
    double sum = 0.0, sum2 = 0.0;
    for (int i = 0; i < n; i++) {
        const double g = gaussian(42, STREAM_POSTERIOR, (uint32_t)(i / LATENT_DIM), 0, (uint32_t)(i % LATENT_DIM));
        sum += g, sum2 += g * g;
    }
    const double mean = sum / n, var = sum2 / n - mean * mean;
    check(fabs(mean) < 0.011 && fabs(var - 1.0) < 0.016, "gaussian: mean %.4f, variance %.4f over %d draws", mean, var,
          n);
    check(gaussian(1, STREAM_POSTERIOR, 5, 0, 3) != gaussian(2, STREAM_POSTERIOR, 5, 0, 3) &&
              gaussian(1, STREAM_POSTERIOR, 5, 0, 3) != gaussian(1, STREAM_PRIOR, 5, 0, 3),
          "gaussian: seed and stream change the draw");
}

// ----------------------------------------------------------------------------
// corrupt inputs: every broken file must be refused with a message, both by the parser in
// this process and by ./vae (when it is built), as one line on stderr and exit status 1

// A scratch folder for the files written here, and ./vae when it is up to date (NULL: not run).
static char scratch[64] = "";
static const char* vae_bin = NULL;

static int remove_entry(const char* path, const struct stat*, int, struct FTW*) { return remove(path); }

// Makes the scratch folder: img/ will hold a broken images file beside the good labels, lab/
// the reverse, out/ is ./vae's -o. ./vae is used when it is at least as new as vae.cu (make test
// does not build it; CI does); otherwise those runs are reported as skipped.
static bool scratch_open(const char* images_path, const char* labels_path) {
    snprintf(scratch, sizeof(scratch), "/tmp/test_vae.XXXXXX");
    if (mkdtemp(scratch) == NULL) snprintf(scratch, sizeof(scratch), "/tmp/test_vae.XXXXXX"); // none made
    char abs_images[PATH_MAX], abs_labels[PATH_MAX], path[128];
    bool ok = strcmp(scratch, "/tmp/test_vae.XXXXXX") != 0 && realpath(images_path, abs_images) != NULL &&
              realpath(labels_path, abs_labels) != NULL;
    for (const char* sub : {"img", "lab", "out"}) {
        snprintf(path, sizeof(path), "%s/%s", scratch, sub);
        ok = ok && mkdir(path, 0755) == 0;
    }
    snprintf(path, sizeof(path), "%s/img/t10k-labels-idx1-ubyte", scratch);
    ok = ok && symlink(abs_labels, path) == 0;
    snprintf(path, sizeof(path), "%s/lab/t10k-images-idx3-ubyte", scratch);
    ok = ok && symlink(abs_images, path) == 0;
    if (!check(ok, "scratch folder %s", scratch)) {
        printf("  %s\n", strerror(errno));
        return false;
    }
    struct stat vae_st, src_st;
    if (stat("vae", &vae_st) == 0 && stat("vae.cu", &src_st) == 0 && vae_st.st_mtime >= src_st.st_mtime)
        vae_bin = "./vae";
    else
        skip("./vae runs on corrupt inputs and bad flags", "./vae is missing or older than vae.cu: make vae");
    return true;
}

// Removes the scratch folder, if mkdtemp made one (FTW_PHYS: the links to data/ go, not their targets).
static void scratch_close() {
    struct stat st;
    if (strcmp(scratch, "/tmp/test_vae.XXXXXX") != 0 && stat(scratch, &st) == 0)
        check(nftw(scratch, remove_entry, 16, FTW_DEPTH | FTW_PHYS) == 0, "remove %s", scratch);
}

// ----------------------------------------------------------------------------
// importance-weighted log-likelihood (--iwae)

enum { IWAE_MAGIC = 0x49454156 /* "VAEI" */, IWAE_VERSION = 1 };
typedef struct {
    uint8_t* buf;
    int N, K, first_image;
    const float* eps;       // [N][K][Z], drawn by PyTorch
    const double* log_px64; // PyTorch float64
    const float* log_px32;  // PyTorch float32, same eps
} IwaeState;

// Every count is checked against the file's size before anything is read (fuzz/ feeds this
// arbitrary bytes). The float64 data starts 1024 + 4 Z N K bytes into the file: 8-byte aligned where Z N K is even,
// as it is for Z = 20 and the dumps' N = 4 (an odd one is refused).
static bool parse_iwae_state(uint8_t* buf, size_t size, const char* name, int num_images, ModelDims dims, IwaeState* s,
                             Error* err) {
    const size_t header_bytes = HEADER_INTS * sizeof(int32_t);
    if (size < header_bytes) return set_error(err, "%s: %zu bytes, shorter than its header. " PREPARE_HINT, name, size);
    if (read_le32(buf) != IWAE_MAGIC || read_le32(buf + 4) != IWAE_VERSION)
        return set_error(err, "%s: not a version-%d IWAE reference file. " PREPARE_HINT, name, IWAE_VERSION);
    if (!state_dims_match(buf, 8, dims, name, err)) return false;
    s->N = read_le32(buf + 20), s->K = read_le32(buf + 24), s->first_image = read_le32(buf + 28);
    if (s->N < 1 || s->N > 1000 || s->K < 1 || s->K > 1000 || s->first_image < 0 ||
        (int64_t)s->first_image + s->N > num_images)
        return set_error(err, "%s: %d images x %d samples from image %d, outside the %d test images. " PREPARE_HINT,
                         name, s->N, s->K, s->first_image, num_images);
    const size_t eps_floats = (size_t)s->N * s->K * dims.z;
    if (eps_floats % 2 != 0)
        return set_error(err, "%s: %zu eps values, an odd count (its float64 data would be unaligned). " PREPARE_HINT,
                         name, eps_floats);
    const size_t expected = header_bytes + eps_floats * 4 + (size_t)s->N * (8 + 4);
    if (size != expected) return set_error(err, "%s: %zu bytes, expected %zu. " PREPARE_HINT, name, size, expected);
    s->eps = (const float*)(buf + header_bytes);
    s->log_px64 = (const double*)(buf + header_bytes + eps_floats * 4);
    s->log_px32 = (const float*)(buf + header_bytes + eps_floats * 4 + (size_t)s->N * 8);
    s->buf = buf;
    return true;
}


typedef struct {
    int num_images;           // bounds the debug state's cases
    int tried, rejected;      // parser calls on corrupt input, and how many refused with a message
    int vae_cases;            // those inputs that ./vae reads (it does not read the reference states)
    int vae_tried, vae_clean; // the ones given to ./vae (all, or a sample), and its clean one-line refusals
    int family_cases;         // vae_cases of the current family so far: picks the sample
    char first_msg[160];      // one refusal per family, printed as an example
} Corpus;

// Without --exhaustive, ./vae gets the first case of each family and every 16th after it. The corpus holds ~1,340
// inputs that ./vae reads (1,025 of them the weights file cut at each header byte) and each run costs ~85 ms, its CUDA
// libraries loading: ~2 minutes in all, ~9 s sampled. The parsers in process still get every case, and every family
// still reaches ./vae.
enum { VAE_SAMPLE_EVERY = 16 };

enum { R_WEIGHTS, R_IMAGES, R_LABELS, R_DEBUG, R_IWAE, R_PGM, NUM_READERS };
static const char* READER_NAMES[NUM_READERS] = {"weights", "idx images", "idx labels", "debug state", "IWAE state",
                                                "PGM image"};

// Parses buf as reader r's format and frees what that built. False, with a message, on refusal.
static bool parse_as(int r, const uint8_t* buf, size_t size, int num_images, Error* err) {
    err->msg[0] = '\0';
    bool ok = false;
    if (r == R_WEIGHTS) {
        HostWeights w = {};
        ok = parse_weights(buf, size, "corrupt", &w, err);
        free(w.data);
    } else if (r == R_IMAGES) {
        Images im = {};
        ok = parse_idx_images(buf, size, "corrupt", &im, err);
        free(im.pixels);
    } else if (r == R_LABELS) {
        Labels lb = {};
        ok = parse_idx_labels(buf, size, "corrupt", &lb, err);
        free(lb.labels);
    } else if (r == R_PGM) {
        Images im = {};
        ok = parse_pgm(buf, size, "corrupt", &im, err);
        free(im.pixels);
    } else if (r == R_IWAE) {
        uint8_t* copy = (uint8_t*)malloc(size > 0 ? size : 1); // parse_iwae_state keeps pointers into it
        if (copy == NULL) return set_error(err, "out of host memory");
        memcpy(copy, buf, size);
        IwaeState is = {};
        ok = parse_iwae_state(copy, size, "corrupt", num_images, PUBLISHED_DIMS, &is, err);
        free(copy);
    } else {
        uint8_t* copy = (uint8_t*)malloc(size > 0 ? size : 1); // parse_debug_state keeps pointers into it
        if (copy == NULL) return set_error(err, "out of host memory");
        memcpy(copy, buf, size);
        DebugState ds = {};
        ok = parse_debug_state(copy, size, "corrupt", num_images, PUBLISHED_DIMS, &ds, err);
        free(ds.storage64);
        free(copy);
    }
    return ok;
}

static bool write_whole_file(const char* path, const uint8_t* buf, size_t size) {
    FILE* f = fopen(path, "wb");
    if (f == NULL) return false;
    const bool ok = size == 0 || fwrite(buf, 1, size, f) == size;
    return fclose(f) == 0 && ok;
}

// What a run of ./vae did: its exit status (-1: it did not exit normally) and what it wrote to
// stdout and stderr, NUL-terminated (a NUL byte in them ends the text early: compare the sizes).
typedef struct {
    int status;
    char *out, *err;
    size_t out_size, err_size;
} VaeRun;

static void vae_run_free(VaeRun* r) {
    free(r->out);
    free(r->err);
}

// Runs ./vae with the n arguments at args, stdout and stderr going to files in the scratch folder.
static VaeRun run_vae(const char* const* args, int n) {
    VaeRun r = {-1, NULL, NULL, 0, 0};
    char out_path[128], err_path[128];
    snprintf(out_path, sizeof(out_path), "%s/stdout", scratch);
    snprintf(err_path, sizeof(err_path), "%s/stderr", scratch);
    const char* argv[24] = {vae_bin};
    int argc = 1;
    for (int i = 0; i < n; i++)
        if (argc < 23) argv[argc++] = args[i];
    fflush(stdout);
    const pid_t pid = fork();
    if (pid < 0) return r;
    if (pid == 0) {
        const int out = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        const int err = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (out < 0 || err < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0) _exit(126);
        execv(vae_bin, (char* const*)argv);
        _exit(127);
    }
    int status;
    if (waitpid(pid, &status, 0) != pid) return r;
    r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    Error err;
    uint8_t *out = NULL, *msg = NULL;
    if (read_file(out_path, &out, &r.out_size, &err) && read_file(err_path, &msg, &r.err_size, &err)) {
        r.out = (char*)realloc(out, r.out_size + 1), r.err = (char*)realloc(msg, r.err_size + 1);
        if (r.out != NULL) r.out[r.out_size] = '\0';
        if (r.err != NULL) r.err[r.err_size] = '\0';
        if (r.out == NULL || r.err == NULL) r.status = -1;
    } else {
        free(out);
        free(msg);
    }
    return r;
}
static VaeRun run_vae(std::initializer_list<const char*> args) { return run_vae(args.begin(), (int)args.size()); }

// Whether text is exactly one line "vae: error: ..." that mentions `what`.
static bool one_error_line(const char* text, size_t size, const char* what) {
    const char* newline = strchr(text, '\n');
    return strlen(text) == size && !strncmp(text, "vae: error: ", 12) && newline != NULL && newline[1] == '\0' &&
           strstr(text, what) != NULL;
}

// True when ./vae with args exited with status 1, wrote nothing to stdout and exactly one line
// "vae: error: ..." to stderr that contains `must_mention` (the broken file's path or the bad
// flag: a refusal for another reason, such as the missing GPU after an input was wrongly
// accepted, does not count). `why` gets the line, or what went wrong.
static bool vae_refuses(std::initializer_list<const char*> args, const char* must_mention, char* why, size_t why_size) {
    VaeRun r = run_vae(args);
    bool ok = false;
    if (r.out == NULL) {
        snprintf(why, why_size, "./vae did not run");
    } else if (r.status != 1) {
        snprintf(why, why_size, r.status < 0 ? "killed by a signal" : "exit status %d", r.status);
    } else {
        ok = r.out_size == 0 && one_error_line(r.err, r.err_size, must_mention);
        snprintf(why, why_size, "%s%s", r.out_size > 0 ? "wrote to stdout; " : "", r.err);
        why[strcspn(why, "\n")] = '\0';
    }
    vae_run_free(&r);
    return ok;
}

// Keeps a family's first refusal as its example, without the hint (the same for all).
static void remember_msg(Corpus* c, const char* msg) {
    if (c->first_msg[0] != '\0') return;
    const char* hint = strstr(msg, ". HINT:");
    snprintf(c->first_msg, sizeof(c->first_msg), "%.*s", (int)(hint != NULL ? hint - msg : 150), msg);
}

// A corrupt input for reader r: the parser must refuse it with a message, and so must ./vae.
static void expect_refused(Corpus* c, int r, const uint8_t* buf, size_t size, const char* what) {
    Error err;
    c->tried++;
    if (!parse_as(r, buf, size, c->num_images, &err) && err.msg[0] != '\0') {
        c->rejected++;
        remember_msg(c, err.msg);
    } else {
        check(false, "%s: %s was accepted", READER_NAMES[r], what);
    }
    if (vae_bin == NULL || r == R_DEBUG || r == R_IWAE) return; // ./vae does not read the reference states
    c->vae_cases++;
    if (c->family_cases++ % VAE_SAMPLE_EVERY != 0 && !exhaustive) return;
    // ./vae reads the weights from -w, both idx files from -d and greymaps from --image: put the
    // broken one where it looks
    static const char* where[] = {"w.bin", "img/t10k-images-idx3-ubyte", "lab/t10k-labels-idx1-ubyte", "", "",
                                  "digit.pgm"};
    char path[128], data_dir[128], out_dir[128], why[256];
    snprintf(path, sizeof(path), "%s/%s", scratch, where[r]);
    snprintf(data_dir, sizeof(data_dir), "%s/%s", scratch, r == R_IMAGES ? "img" : "lab");
    snprintf(out_dir, sizeof(out_dir), "%s/out", scratch);
    if (!write_whole_file(path, buf, size)) {
        check(false, "write %s: %s", path, strerror(errno));
        return;
    }
    c->vae_tried++;
    const bool clean = r == R_WEIGHTS ? vae_refuses({"-w", path, "-o", out_dir}, path, why, sizeof(why))
                     : r == R_PGM     ? vae_refuses({"--image", path, "-o", out_dir}, path, why, sizeof(why))
                                      : vae_refuses({"-d", data_dir, "-o", out_dir}, path, why, sizeof(why));
    if (clean) c->vae_clean++;
    else check(false, "./vae on %s %s: %s", READER_NAMES[r], what, why);
}

// A family of corrupt inputs is reported as one check, with one of its messages as an example.
typedef struct {
    int tried, rejected, vae_cases, vae_tried, vae_clean;
} Mark;
static Mark family_start(Corpus* c) {
    c->first_msg[0] = '\0';
    c->family_cases = 0;
    return Mark{c->tried, c->rejected, c->vae_cases, c->vae_tried, c->vae_clean};
}
static void family_done(Corpus* c, Mark m, const char* what) {
    const int tried = c->tried - m.tried, rejected = c->rejected - m.rejected;
    const int vae_cases = c->vae_cases - m.vae_cases;
    const int vae_tried = c->vae_tried - m.vae_tried, vae_clean = c->vae_clean - m.vae_clean;
    char vae[96] = "";
    if (vae_tried > 0 && vae_tried < vae_cases)
        snprintf(vae, sizeof(vae), ", ./vae %d/%d (sampled 1 in %d of %d)", vae_clean, vae_tried, VAE_SAMPLE_EVERY,
                 vae_cases);
    else if (vae_tried > 0)
        snprintf(vae, sizeof(vae), ", ./vae %d/%d (every case)", vae_clean, vae_tried);
    check(tried > 0 && rejected == tried && vae_clean == vae_tried, "%s: %d/%d refused%s (e.g. %s)", what, rejected,
          tried, vae, c->first_msg);
}

static uint32_t get32(const uint8_t* p, bool big_endian) { return big_endian ? read_be32(p) : (uint32_t)read_le32(p); }
static void put32(uint8_t* p, uint32_t v, bool big_endian) {
    if (big_endian) p[0] = v >> 24, p[1] = v >> 16, p[2] = v >> 8, p[3] = v;
    else p[0] = v, p[1] = v >> 8, p[2] = v >> 16, p[3] = v >> 24;
}
static uint32_t byte_swap(uint32_t v) { return v >> 24 | (v >> 8 & 0xff00) | (v << 8 & 0xff0000) | v << 24; }

// The corruptions of one good file: truncation at every byte of the header and at a few places
// in the data, padding, and each header field set to 0, 1, -1, huge, off by one and
// byte-swapped. `fields` lists the int32 header fields that carry meaning; the rest of a
// 256-int header is reserved and ignored by the readers.
static void corrupt_one_file(Corpus* c, int r, const uint8_t* good, size_t size, size_t header_bytes, bool big_endian,
                             const int* fields, int num_fields) {
    uint8_t* bad = (uint8_t*)malloc(size + 4096);
    if (bad == NULL) {
        check(false, "memory for a corrupt copy of %s", READER_NAMES[r]);
        return;
    }
    char what[96], title[128];

    Mark m = family_start(c);
    for (size_t cut = 0; cut <= header_bytes && cut < size; cut++) {
        snprintf(what, sizeof(what), "a copy cut to %zu bytes", cut);
        expect_refused(c, r, good, cut, what);
    }
    for (size_t cut : {header_bytes + 1, header_bytes + 4, size / 2, size - 4, size - 1}) {
        if (cut <= header_bytes || cut >= size) continue;
        snprintf(what, sizeof(what), "a copy cut to %zu bytes", cut);
        expect_refused(c, r, good, cut, what);
    }
    snprintf(title, sizeof(title), "%s cut at every header byte 0..%zu and 5 places in the data", READER_NAMES[r],
             header_bytes);
    family_done(c, m, title);

    m = family_start(c);
    memcpy(bad, good, size);
    memset(bad + size, 0, 4096);
    expect_refused(c, r, bad, size + 1, "one byte too many");
    expect_refused(c, r, bad, size + 4096, "4096 bytes too many");
    snprintf(title, sizeof(title), "%s padded by 1 and 4096 bytes", READER_NAMES[r]);
    family_done(c, m, title);

    if (num_fields == 0) { // a text header (PGM): its own family in test_corrupt_files
        free(bad);
        return;
    }
    m = family_start(c);
    for (int f = 0; f < num_fields; f++) {
        const uint32_t original = get32(good + 4 * fields[f], big_endian);
        // the debug state's odd fields from 9 on, and the IWAE state's field 7, are a first image:
        // any value that keeps the images inside the test set is valid, so only values outside
        // every range are tried
        const bool first_image =
            (r == R_DEBUG && fields[f] >= 9 && fields[f] % 2 == 1) || (r == R_IWAE && fields[f] == 7);
        for (uint32_t v :
             {0u, 1u, 0xffffffffu, 0x7fffffffu, 0x80000000u, original + 1, original - 1, byte_swap(original)}) {
            if (v == original || (first_image && v != 0xffffffffu && v != 0x7fffffffu && v != 0x80000000u)) continue;
            memcpy(bad, good, size);
            put32(bad + 4 * fields[f], v, big_endian);
            snprintf(what, sizeof(what), "header field %d = %d (0x%x)", fields[f], (int32_t)v, v);
            expect_refused(c, r, bad, size, what);
        }
    }
    snprintf(title, sizeof(title), "%s header fields set to 0, 1, -1, huge, +-1, byte-swapped", READER_NAMES[r]);
    family_done(c, m, title);
    free(bad);
}

// 784 pixels as a 28x28 greymap: P5 (binary; maxval 255 or 65535, samples scaled to it) or P2
// (ASCII, with comments and uneven whitespace), optionally inverted (black on white).
static bool write_pgm(const char* path, const uint8_t* pixels, bool ascii, int maxval, bool invert) {
    FILE* f = fopen(path, "wb");
    if (f == NULL) return false;
    bool ok = fprintf(f, ascii ? "P2\n# a digit\n28  28 # width, height\n%d\n" : "P5\n28 28\n%d\n", maxval) > 0;
    for (int i = 0; i < INPUT_DIM && ok; i++) {
        const int v = (invert ? 255 - pixels[i] : pixels[i]) * maxval / 255;
        if (ascii) ok = fprintf(f, "%d%s", v, i % 28 == 27 ? "\n" : " ") > 0;
        else if (maxval > 255) ok = fputc(v >> 8, f) != EOF && fputc(v & 255, f) != EOF;
        else ok = fputc(v, f) != EOF;
    }
    return fclose(f) == 0 && ok;
}

static void test_corrupt_files(const char* const paths[NUM_READERS], int num_images) {
    printf("corrupt inputs are refused with a message, in process and by ./vae (one line, exit status 1)\n");
    Corpus c = {};
    c.num_images = num_images;
    uint8_t* good[NUM_READERS] = {};
    size_t size[NUM_READERS] = {};
    Error err;
    bool all_read = true;
    for (int r = 0; r < NUM_READERS; r++)
        all_read = check(read_file(paths[r], &good[r], &size[r], &err) &&
                             parse_as(r, good[r], size[r], num_images, &err),
                         "the good %s parses", paths[r]) &&
                   all_read;
    if (all_read) {
        // the header fields that carry meaning (int32 indices; README.md, File formats)
        const int weight_fields[] = {0, 1, 2, 3, 4, 5, 6, 7, 8}, image_fields[] = {0, 1, 2, 3}, label_fields[] = {0, 1};
        int debug_fields[6 + 2 * MAX_CASES] = {0, 1, 2, 3, 4, 5}, num_debug_fields = 6;
        for (int i = 0; i < 2 * read_le32(good[R_DEBUG] + 20) && i < 2 * MAX_CASES; i++)
            debug_fields[num_debug_fields++] = 8 + i; // each case's batch and first image
        corrupt_one_file(&c, R_WEIGHTS, good[R_WEIGHTS], size[R_WEIGHTS], HEADER_INTS * 4, false, weight_fields, 9);
        corrupt_one_file(&c, R_IMAGES, good[R_IMAGES], size[R_IMAGES], 16, true, image_fields, 4);
        corrupt_one_file(&c, R_LABELS, good[R_LABELS], size[R_LABELS], 8, true, label_fields, 2);
        corrupt_one_file(&c, R_DEBUG, good[R_DEBUG], size[R_DEBUG], HEADER_INTS * 4, false, debug_fields,
                         num_debug_fields);
        const int iwae_fields[] = {0, 1, 2, 3, 4, 5, 6, 7};
        corrupt_one_file(&c, R_IWAE, good[R_IWAE], size[R_IWAE], HEADER_INTS * 4, false, iwae_fields, 8);
        corrupt_one_file(&c, R_PGM, good[R_PGM], size[R_PGM], strlen("P5\n28 28\n255\n"), false, NULL, 0);

        // greymap headers: other sizes and formats, maxvals out of range, samples above maxval,
        // ASCII samples missing or not numbers
        Mark m = family_start(&c);
        const char* bad_headers[] = {"P5\n27 28\n255\n", "P5\n28 29\n255\n", "P5\n0 28\n255\n",
                                     "P5\n280 280\n255\n", "P5\n28 28\n0\n", "P5\n28 28\n65536\n",
                                     "P5\n28 28\n99999999999\n", "P5 28 28\n",
                                     "P5\n-28 28\n255\n", "P5\n28x28\n255\n", "P6\n28 28\n255\n",
                                     "P4\n28 28\n", "P3\n28 28\n255\n", "P7\n", "\x89PNG\r\n\x1a\n",
                                     "p5\n28 28\n255\n", "P2\n28 28\n255\n1 2 x", "P2\n28 28\n255\n1 2 3",
                                     "P2\n28 28\n255\n256", "P2\n28 28\n255\n-1"};
        for (const char* h : bad_headers) {
            uint8_t bad[INPUT_DIM + 64];
            const size_t n = strlen(h);
            memcpy(bad, h, n);
            memset(bad + n, 7, INPUT_DIM); // P5 samples, valid under any maxval from 7 on
            char what[96];
            snprintf(what, sizeof(what), "header '%.*s'", (int)strcspn(h, "\n"), h);
            expect_refused(&c, R_PGM, (const uint8_t*)bad, h[1] == '2' ? n : n + INPUT_DIM, what);
        }
        uint8_t above[16 + INPUT_DIM]; // maxval 200 with a sample of 201
        const size_t header = (size_t)snprintf((char*)above, 16, "P5\n28 28\n200\n");
        memset(above + header, 3, INPUT_DIM);
        above[header + INPUT_DIM - 1] = 201;
        expect_refused(&c, R_PGM, above, header + INPUT_DIM, "a sample above maxval");
        family_done(&c, m, "PGM: other sizes and formats, bad maxvals, samples above maxval, bad ASCII samples");

        m = family_start(&c);
        uint8_t* bad = (uint8_t*)malloc(size[R_WEIGHTS]);
        if (bad == NULL) {
            check(false, "memory for a corrupt weights file");
        } else {
            size_t first = 0;
            for (int t = 0; t < NUM_TENSORS; t++) {
                for (size_t i : {first, first + tensor_size(PUBLISHED_DIMS, t) - 1})
                    for (float v : {NAN, INFINITY, -INFINITY}) {
                        memcpy(bad, good[R_WEIGHTS], size[R_WEIGHTS]);
                        memcpy(bad + HEADER_INTS * 4 + 4 * i, &v, 4);
                        char what[96];
                        snprintf(what, sizeof(what), "%s at float %zu (%s)",
                                 v != v ? "NaN" : v > 0 ? "+Inf" : "-Inf", i, TENSOR_NAMES[t]);
                        expect_refused(&c, R_WEIGHTS, bad, size[R_WEIGHTS], what);
                    }
                first += tensor_size(PUBLISHED_DIMS, t);
            }
            free(bad);
        }
        family_done(&c, m, "weights with NaN, +Inf, -Inf at both ends of every tensor");

        m = family_start(&c);
        bad = (uint8_t*)malloc(size[R_LABELS]);
        if (bad == NULL) {
            check(false, "memory for a corrupt labels file");
        } else {
            for (size_t i : {(size_t)8, size[R_LABELS] - 1})
                for (int v : {10, 255}) {
                    memcpy(bad, good[R_LABELS], size[R_LABELS]);
                    bad[i] = (uint8_t)v;
                    char what[64];
                    snprintf(what, sizeof(what), "label %d at byte %zu", v, i);
                    expect_refused(&c, R_LABELS, bad, size[R_LABELS], what);
                }
            free(bad);
        }
        family_done(&c, m, "labels 10 and 255 at both ends");

        m = family_start(&c);
        for (int r = 0; r < NUM_READERS; r++)
            for (int other = 0; other < NUM_READERS; other++) {
                if (other == r) continue;
                char what[96];
                snprintf(what, sizeof(what), "the %s file", READER_NAMES[other]);
                expect_refused(&c, r, good[other], size[other], what);
            }
        family_done(&c, m, "each good file given as each other kind");
    }
    for (int r = 0; r < NUM_READERS; r++) free(good[r]);

    // Paths that are no good file: read_file refuses them before any parser runs. A sparse file
    // of 1 GiB + 1 is refused by its size before a byte is read.
    Mark m = family_start(&c);
    char empty[128], huge[128], dir_path[128];
    snprintf(empty, sizeof(empty), "%s/empty", scratch);
    snprintf(huge, sizeof(huge), "%s/huge", scratch);
    snprintf(dir_path, sizeof(dir_path), "%s/out", scratch);
    const int fd = open(huge, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const bool made = write_whole_file(empty, NULL, 0) && fd >= 0 && ftruncate(fd, (off_t)MAX_FILE_BYTES + 1) == 0;
    if (fd >= 0 && close(fd) != 0) check(false, "close %s: %s", huge, strerror(errno));
    char missing[128];
    snprintf(missing, sizeof(missing), "%s/no-such-file", scratch);
    if (check(made, "an empty file and a sparse 1 GiB + 1 file in %s", scratch)) {
        for (const char* f :
             {(const char*)dir_path, (const char*)missing, (const char*)empty, "/dev/null", (const char*)huge}) {
            for (int r = 0; r < NUM_READERS; r++) {
                uint8_t* buf = NULL;
                size_t n = 0;
                Error e = {};
                c.tried++;
                const bool ok = read_file(f, &buf, &n, &e) && parse_as(r, buf, n, num_images, &e);
                free(buf);
                if (!ok && e.msg[0] != '\0') c.rejected++;
                else check(false, "%s as %s was accepted", f, READER_NAMES[r]);
                if (!ok) remember_msg(&c, e.msg);
            }
            if (vae_bin == NULL) continue;
            // ./vae -w at it, and -d at a folder where each idx file in turn is it
            char why[256], out_dir[128];
            snprintf(out_dir, sizeof(out_dir), "%s/out", scratch);
            // 5 paths x 4 runs, every one: each path meets its own branch of read_file, each flag its own reader
            c.vae_cases++, c.vae_tried++;
            if (vae_refuses({"-w", f, "-o", out_dir}, f, why, sizeof(why))) c.vae_clean++;
            else check(false, "./vae -w %s: %s", f, why);
            c.vae_cases++, c.vae_tried++;
            if (vae_refuses({"--image", f, "-o", out_dir}, f, why, sizeof(why))) c.vae_clean++;
            else check(false, "./vae --image %s: %s", f, why);
            for (const char* sub : {"img", "lab"}) {
                char dir[128], path[160];
                snprintf(dir, sizeof(dir), "%s/%s", scratch, sub);
                snprintf(path, sizeof(path), "%s/%s", dir,
                         !strcmp(sub, "img") ? "t10k-images-idx3-ubyte" : "t10k-labels-idx1-ubyte");
                bool placed = remove(path) == 0 || errno == ENOENT;
                if (f == dir_path) placed = placed && mkdir(path, 0755) == 0;
                else if (f != missing) placed = placed && symlink(f, path) == 0;
                if (!placed) {
                    check(false, "place %s at %s: %s", f, path, strerror(errno));
                    continue;
                }
                if (f == missing && !strcmp(sub, "lab")) continue; // the labels are optional: test_cli runs it
                c.vae_cases++, c.vae_tried++;
                if (vae_refuses({"-d", dir, "-o", out_dir}, path, why, sizeof(why))) c.vae_clean++;
                else check(false, "./vae -d with %s as %s: %s", f, path, why);
                if (f == dir_path && rmdir(path) != 0) check(false, "rmdir %s: %s", path, strerror(errno));
            }
        }
    }
    family_done(&c, m, "a directory, a missing file, an empty file, /dev/null, a 1 GiB + 1 file");
    if (remove(empty) != 0 || remove(huge) != 0) check(false, "remove %s and %s: %s", empty, huge, strerror(errno));

    char sample[80];
    if (c.vae_cases == 0)
        snprintf(sample, sizeof(sample), "./vae not run");
    else if (c.vae_tried < c.vae_cases)
        snprintf(sample, sizeof(sample), "sampled 1 in %d per family of %d; --exhaustive: all", VAE_SAMPLE_EVERY,
                 c.vae_cases);
    else
        snprintf(sample, sizeof(sample), "every case");
    printf("  corrupt inputs: %d tried, %d rejected; through ./vae: %d tried (%s), %d clean one-line errors\n",
           c.tried, c.rejected, c.vae_tried, sample, c.vae_clean);
}

// Parses one command line (argv[0] = "vae") into cfg; err gets the refusal.
static bool parse_line(std::initializer_list<const char*> args, Config* cfg, Error* err, char* line, size_t line_size) {
    static char* argv[48];
    int argc = 0;
    argv[argc++] = (char*)"vae";
    snprintf(line, line_size, "vae");
    for (const char* a : args) {
        argv[argc++] = (char*)a;
        snprintf(line + strlen(line), line_size - strlen(line), " %s", a);
    }
    err->msg[0] = '\0';
    return parse_args(argc, argv, cfg, err);
}

// Every file in folder whose name starts with prefix (temporary files left behind).
static int files_starting(const char* folder, const char* prefix) {
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "ls -a '%s' | grep -c '^%s'", folder, prefix);
    FILE* p = popen(cmd, "r");
    int n = -1;
    if (p != NULL && fscanf(p, "%d", &n) != 1) n = -1;
    if (p != NULL) pclose(p);
    return n;
}

static bool file_is(const char* path, const char* text) {
    uint8_t* buf;
    size_t size;
    Error err;
    if (!read_file(path, &buf, &size, &err)) return false;
    const bool same = size == strlen(text) && !memcmp(buf, text, size);
    free(buf);
    return same;
}

// The fields after "index,label," of the CSV row of image `index` in text (NULL: none).
static const char* csv_values(const char* text, int index, char* out, size_t out_size) {
    char start[32];
    snprintf(start, sizeof(start), "\n%d,", index);
    const char* row = strstr(text, start);
    if (row == NULL || (row = strchr(row + strlen(start), ',')) == NULL) return NULL;
    snprintf(out, out_size, "%.*s", (int)strcspn(row + 1, "\n"), row + 1);
    return out;
}

// Whether the files a/name and b/name both read and are equal byte for byte.
static bool same_files(const char* a, const char* b, const char* name) {
    char path_a[256], path_b[256];
    snprintf(path_a, sizeof(path_a), "%s/%s", a, name), snprintf(path_b, sizeof(path_b), "%s/%s", b, name);
    uint8_t *text_a = NULL, *text_b = NULL;
    size_t size_a = 0, size_b = 0;
    Error err;
    const bool same = read_file(path_a, &text_a, &size_a, &err) && read_file(path_b, &text_b, &size_b, &err) &&
                      size_a == size_b && !memcmp(text_a, text_b, size_a);
    free(text_a), free(text_b);
    return same;
}
// The line of text that starts with `start`, its first `length` characters (all of it: 0), or "" where there is none.
static void line_starting(const char* text, const char* start, size_t length, char* out, size_t out_size) {
    const char* line = text != NULL ? strstr(text, start) : NULL;
    const size_t n = line != NULL ? strcspn(line, "\n") : 0;
    snprintf(out, out_size, "%.*s", (int)(length > 0 && length < n ? length : n), line != NULL ? line : "");
}
// A child process that holds all but 1.5 GB of GPU `device`'s free memory until it is killed (its pid, or -1 where the
// allocation failed). CUDA stays out of this process: a child forked after it starts CUDA could not use it.
static pid_t hold_gpu_memory(int device) {
    int ready[2];
    if (pipe(ready) != 0) return -1;
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
        size_t free_bytes = 0, total_bytes = 0;
        void* hold = NULL;
        const size_t keep = (size_t)3 << 29;
        const char held = cudaSetDevice(device) == cudaSuccess &&
                          cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess && free_bytes > keep &&
                          cudaMalloc(&hold, free_bytes - keep) == cudaSuccess;
        if (write(ready[1], &held, 1) != 1 || !held) _exit(1);
        for (;;) pause();
    }
    char held = 0;
    close(ready[1]);
    const bool ok = pid > 0 && read(ready[0], &held, 1) == 1 && held;
    close(ready[0]);
    if (pid > 0 && !ok) kill(pid, SIGKILL), waitpid(pid, NULL, 0);
    return ok ? pid : -1;
}
// --devices through ./vae: each mode's results from several GPU threads against one GPU's, byte for byte: the CSVs,
// the ELBO's and --interp's pictures, --bdmc's bounds. Every GPU of the machine where it has several; on one GPU,
// three threads on it, which take the slices in an order of their own just the same. Then a GPU that fails (out of
// memory: a child process holds all but 1.5 GB of it) ends the run in one line that names it, and writes nothing.
static void test_devices() {
    setenv("VAE_TEST_REPEAT_GPUS", "1", 1); // --devices 0,0,0: the several-GPU path on one GPU
    fflush(stdout);
    const pid_t counter = fork(); // the GPUs, counted in a child: this process stays out of CUDA (hold_gpu_memory)
    if (counter == 0) {
        int count = 0;
        _exit(cudaGetDeviceCount(&count) == cudaSuccess ? std::min(count, 100) : 0);
    }
    int status = 0;
    const int gpus = counter > 0 && waitpid(counter, &status, 0) == counter && WIFEXITED(status) ? WEXITSTATUS(status)
                                                                                                : 0;
    const char* devices = gpus > 1 ? "all" : "0,0,0";
    const char* modes[][10] = {{"-s", "5", "-b", "7", "-n", "37", "-o", NULL},
                               {"--zmu", "--kernels", "plain", "--precision", "bf16", "-n", "37", "-o", NULL},
                               {"--iwae", "8", "-n", "37", NULL},
                               {"--iwae", "5", "--kernels", "plain", "--precision", "bf16", "-n", "37", NULL},
                               {"--ais", "3", "--chains", "4", "-n", "2000", NULL}, // several fused rounds
                               {"--ais", "3", "--kernels", "plain", "-n", "300", NULL},
                               {"--bdmc", "2000", "--ais", "3", NULL},
                               {"--bdmc", "300", "--ais", "3", "--kernels", "plain", NULL},
                               {"--interp", "120", "-o", NULL}};
    for (const auto& mode : modes) {
        char what[96] = "", out[2][160];
        const char* args[20];
        int n = 0;
        const bool bdmc = !strcmp(mode[0], "--bdmc"), interp = !strcmp(mode[0], "--interp");
        bool pictures = false;
        for (const char* const* a = mode; *a != NULL; a++) {
            args[n++] = *a;
            pictures = pictures || !strcmp(*a, "-o");
            if (strcmp(*a, "-o")) snprintf(what + strlen(what), sizeof(what) - strlen(what), "%s ", *a);
        }
        VaeRun run[2];
        for (int several = 0; several < 2; several++) {
            int m = n;
            snprintf(out[several], sizeof(out[several]), "%s/devices_out%d", scratch, several);
            if (pictures) args[m++] = out[several];
            args[m++] = "-q";
            if (!bdmc && !interp) args[m++] = "--csv", args[m++] = "-";
            if (several) args[m++] = "--devices", args[m++] = devices;
            run[several] = run_vae(args, m);
        }
        bool same = run[0].status == 0 && run[1].status == 0 && run[0].out != NULL && run[1].out != NULL;
        for (const char* start : {"lower bound", "upper bound", "gap"}) { // --bdmc: the bounds, not the times
            char a[160], b[160];
            line_starting(same && bdmc ? run[0].out : NULL, start, strcmp(start, "gap") ? 22 : 0, a, sizeof(a));
            line_starting(same && bdmc ? run[1].out : NULL, start, strcmp(start, "gap") ? 22 : 0, b, sizeof(b));
            same = same && (!bdmc || (a[0] != '\0' && !strcmp(a, b)));
        }
        if (same && !bdmc && !interp) // the CSV on stdout
            same = run[0].out_size == run[1].out_size && run[0].out_size > 0 &&
                   !memcmp(run[0].out, run[1].out, run[0].out_size);
        for (const char* name : {"recon.ppm", "samples.ppm", "interp.ppm"})
            same = same && (!pictures || (interp && strcmp(name, "interp.ppm")) || same_files(out[0], out[1], name));
        same = same && (!interp || strstr(run[1].out, "bitwise identical both ways"));
        check(same, "--devices %s %s: the results are one GPU's byte for byte (exit %d, %d)", devices, what,
              run[0].status, run[1].status);
        vae_run_free(&run[0]), vae_run_free(&run[1]);
    }

    const int target = gpus > 1 ? 1 : 0; // the GPU to fail
    char csv[160], name[32];
    snprintf(csv, sizeof(csv), "%s/devices.csv", scratch);
    snprintf(name, sizeof(name), "GPU %d (", target);
    const pid_t holder = hold_gpu_memory(target);
    VaeRun v = run_vae({"--devices", gpus > 1 ? "0,1" : "0,0", "--iwae", "65536", "--kernels", "plain", "-n", "100",
                        "--csv", csv});
    if (holder > 0) kill(holder, SIGKILL), waitpid(holder, NULL, 0);
    check(holder > 0 && v.status == 1 && v.err != NULL && one_error_line(v.err, v.err_size, name) &&
              strstr(v.err, "smaller -b") == NULL && access(csv, F_OK) != 0 && // --iwae takes no -b
              files_starting(scratch, "devices.csv.") == 0,
          "--devices with GPU %d out of memory: exit 1, one line naming it (no -b hint), no CSV (%.*s)", target,
          v.err != NULL ? (int)strcspn(v.err, "\n") : 0, v.err != NULL ? v.err : "");
    vae_run_free(&v);
    unsetenv("VAE_TEST_REPEAT_GPUS");
}

// The total of the last line of `out` that starts with "time" (in s or ms) against its parts: every "N s" or "N ms"
// inside its brackets (rates such as "evaluations/s" are no part). True when there are two parts or more and they
// add up to the total within the rounding of the printed digits (0.005 of the line's unit each, at most).
static bool time_adds_up(const char* out, char* line, size_t line_size) {
    const char* at = NULL;
    for (const char* p = out; p != NULL && *p != '\0'; p = strchr(p, '\n'), p = p ? p + 1 : p)
        if (!strncmp(p, "time ", 5)) at = p;
    snprintf(line, line_size, "%.*s", at ? (int)strcspn(at, "\n") : 0, at ? at : "");
    if (at == NULL) return false;
    char* end;
    const double total = strtod(at + 5, &end);
    const double unit = !strncmp(end, " ms", 3) ? 1e-3 : 1.0;
    const char* open = strchr(at, '('), *stop = at + strcspn(at, "\n");
    double sum = 0.0;
    int parts = 0;
    for (const char* p = open; p != NULL && p < stop; p++) {
        if (!isdigit((unsigned char)*p) || isdigit((unsigned char)p[-1]) || p[-1] == '.') continue;
        const double v = strtod(p, &end);
        const double scale = !strncmp(end, " ms", 3) && strchr(",;:)", end[3]) ? 1e-3
                           : !strncmp(end, " s", 2) && strchr(",;:)", end[2])  ? 1.0
                                                                                : 0.0;
        if (scale > 0.0) sum += v * scale, parts++;
        p = end - 1;
    }
    return parts >= 2 && fabs(sum - total * unit) <= (parts + 1) * 0.005 * unit; // each printed to 2 or 3 decimals
}

// Every mode prints one "time" line whose parts add up to it, and --ais names --ais-iwae without it and prints the
// IWAE of the inference gap with it.
static void test_times() {
    printf("printed times: each mode's parts and their total\n");
    char interp_dir[160], line[512];
    snprintf(interp_dir, sizeof(interp_dir), "%s/times", scratch);
    const std::initializer_list<const char*> runs[] = {
        {"-n", "100", "-o", interp_dir, "-q"},           {"--iwae", "8", "-n", "37", "-q"},
        {"--ais", "3", "-n", "37", "-q"},                {"--ais", "3", "-n", "37", "--ais-iwae", "-q"},
        {"--bdmc", "37", "--ais", "3", "-q"},            {"--interp", "5", "-o", interp_dir, "-q"},
    };
    for (const auto& args : runs) {
        char text[160] = "./vae";
        for (const char* a : args) snprintf(text + strlen(text), sizeof(text) - strlen(text), " %s", a);
        VaeRun v = run_vae(args);
        bool ok = v.status == 0 && v.out != NULL && time_adds_up(v.out, line, sizeof(line));
        if (ok && !strncmp(text, "./vae --ais 3", 13)) {
            const bool with_iwae = strstr(text, "--ais-iwae") != NULL;
            ok = with_iwae ? strstr(v.out, "> IWAE (K = 336, as many decoder evaluations)") && strstr(line, "; IWAE ")
                           : strstr(v.out, "add --ais-iwae)") && !strstr(line, "IWAE");
        }
        check(ok, "%s: %s (exit %d)", text, line, v.status);
        vae_run_free(&v);
    }
}

// --shard K/N through ./vae: the three shards' CSVs, the first whole and the others' rows after their two header
// lines, are byte for byte one run's over all the images, in each mode that writes one (a GPU run). Only the '#' line's
// commit and the run would differ, and they do not: a shard's '#' line is the whole run's.
static void test_shards() {
    const char* odd = "data/family/vae_784_97_33_101.bin"; // make family's model of odd sizes
    const char* modes[][8] = {{"--zmu", NULL}, {"-s", "5", NULL}, {"--iwae", "8", NULL},
                              {"--ais", "3", "--chains", "4", NULL}, {"--ais", "3", "--kernels", "plain", NULL},
                              {"-w", odd, "--precision", "bf16", "--ais", "3", NULL}};
    for (const auto& mode : modes) {
        if (mode[0][0] == '-' && mode[0][1] == 'w' && access(odd, R_OK) != 0) {
            skip("--shard on a model of odd sizes", "no data/family: make family (needs PyTorch)");
            continue;
        }
        char what[64] = "";
        const char* args[16];
        int n = 0;
        for (const char* const* a = mode; *a != NULL; a++) {
            args[n++] = *a;
            snprintf(what + strlen(what), sizeof(what) - strlen(what), "%s ", *a);
        }
        for (const char* a : {"-n", "37", "-q", "--csv", "-"}) args[n++] = a;
        char out_dir[160]; // the whole run's pictures (the ELBO's); a shard writes none
        snprintf(out_dir, sizeof(out_dir), "%s/shards_out", scratch);
        args[n] = "-o", args[n + 1] = out_dir;
        bool elbo = true;
        for (const char* const* a = mode; *a != NULL; a++) elbo = elbo && strcmp(*a, "--iwae") && strcmp(*a, "--ais");
        VaeRun whole = run_vae(args, elbo ? n + 2 : n);
        bool ran = whole.status == 0 && whole.out != NULL;
        char* merged = (char*)calloc(ran ? whole.out_size + 1 : 1, 1);
        size_t at = 0;
        for (const char* shard : {"0/3", "1/3", "2/3"}) {
            args[n] = "--shard", args[n + 1] = shard;
            VaeRun part = run_vae(args, n + 2);
            ran = ran && part.status == 0 && part.out != NULL;
            const char* rows = ran ? part.out : NULL;
            for (int skip = shard[0] == '0' ? 0 : 2; rows != NULL && skip > 0; skip--) {
                rows = strchr(rows, '\n');
                if (rows != NULL) rows++;
            }
            const size_t size = rows != NULL ? strlen(rows) : 0;
            ran = ran && rows != NULL && at + size <= whole.out_size;
            if (ran) memcpy(merged + at, rows, size), at += size;
            vae_run_free(&part);
        }
        check(ran && at == whole.out_size && !memcmp(merged, whole.out, at),
              "--shard 0/3, 1/3, 2/3 of %s-n 37: the CSVs merged are one run's byte for byte", what);
        free(merged);
        vae_run_free(&whole);
    }
}

static void test_cli(int num_images, const Images* images) {
    printf("command line\n");
    static char long_path[MAX_PATH_ARG + 2]; // one character over the limit; +1 is exactly at it
    memset(long_path, 'a', MAX_PATH_ARG + 1);
    long_path[MAX_PATH_ARG + 1] = '\0';
    struct {
        std::initializer_list<const char*> args;
        bool ok;
    } cases[] = {
        {{}, true},
        {{"-b", "37", "-n", "1023", "-s", "18446744073709551615", "--zmu", "-o", "x", "--csv", "y.csv"}, true},
        {{"-b", "37", "-n", "1023", "-s", "9", "--zmu", "-o", "x", "--csv", "y.csv", "-w", "w", "-d", "d"}, true},
        {{"-b", "0"}, false},
        {{"-b", "-3"}, false},
        {{"-b", "12x"}, false},
        {{"-b", "99999999999"}, false},
        {{"-b"}, false},
        {{"-n", "0"}, false},
        {{"-n", ""}, false},
        {{"-s", "-1"}, false},
        {{"-w"}, false},
        {{"-o", ""}, false},
        {{"--bogus"}, false},
        {{"--precision", "bf16", "--bench"}, true},
        {{"--precision", "fp16"}, false},
        {{"--precision"}, false},
        {{"-h"}, true},
        // edge values, a flag where a value belongs, a value missing at the end, stray words
        {{"-b", "1"}, true},
        {{"-b", "1048576"}, true}, // MAX_BATCH; main clamps the batch to the image count
        {{"-b", "1048577"}, false},
        {{"-n", "2147483647"}, true}, // main checks -n against the data: see the ./vae runs
        {{"-n", "2147483648"}, false},
        {{"-n", "-1"}, false},
        {{"-b", "0x10"}, false},
        {{"-b", "1e3"}, false},
        {{"-b", "+5"}, false},
        {{"-b", " 5"}, false},
        {{"-s", "9223372036854775808"}, true},
        {{"-s", "18446744073709551616"}, false},
        {{"-b", "-n", "5"}, false},
        {{"-n", "5", "-b"}, false},
        {{"-n"}, false},
        {{"-s"}, false},
        {{"-d"}, false},
        {{"-o"}, false},
        {{"--csv"}, false},
        {{"-d", ""}, false},
        {{"extra"}, false},
        {{"-"}, false},
        {{"--"}, true},
        {{"--", "extra"}, false},
        {{"-q", "--", "-b"}, false},
        {{"-B", "5"}, false},
        {{"--zmu=1"}, false},
        {{"--precision", "BF16"}, false},
        {{"-d", long_path}, false},
        {{"-o", long_path}, false},
        {{"-w", long_path + 1}, true},
        // long names, --name=value, -q, --version
        {{"--weights", "w", "--data", "d", "--batch-size", "37", "--count", "1023", "--seed", "9", "--out", "x",
          "--csv", "y.csv", "--precision=bf16", "--zmu", "--quiet"}, true},
        {{"--batch-size=0"}, false},
        {{"--csv="}, false},
        {{"--weights="}, false},
        {{"--help"}, true},
        {{"--version"}, true},
        {{"-q"}, true},
        {{"-qh"}, true},
        // --bench: its own flags; the ones it has no use for are refused
        {{"--bench", "--bench-batches", "64,128", "--precision", "bf16", "-n", "200", "-s", "3", "--zmu"}, true},
        {{"--bench-batches", "64"}, false},
        {{"--bench", "--bench-batches", "0"}, false},
        {{"--bench", "--bench-batches", "64,"}, false},
        {{"--bench", "--bench-batches", ",64"}, false},
        {{"--bench", "--bench-batches", "64,,128"}, false},
        {{"--bench", "--bench-batches", "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17"}, false},
        {{"--bench", "--csv", "x.csv"}, false},
        {{"--bench", "-o", "x"}, false},
        {{"--bench", "-b", "5"}, false},
        {{"--bench", "--iwae", "4"}, false},
        {{"--bench", "--image", "a.pgm"}, false},
        // --iwae and --interp
        {{"--iwae", "8", "-n", "64", "--precision", "bf16", "--csv", "x.csv", "-s", "2"}, true},
        {{"--iwae", "8", "-b", "5"}, false},
        {{"--iwae", "8", "-o", "x"}, false},
        {{"--iwae", "8", "--zmu"}, false},
        {{"--iwae", "0"}, false},
        {{"--iwae", "65537"}, false},
        {{"--interp", "2", "-o", "x", "-d", "d", "-w", "w"}, true},
        {{"--interp", "1000"}, true},
        {{"--interp", "1"}, false},
        {{"--interp", "1001"}, false},
        {{"--interp", "5", "--csv", "x.csv"}, false},
        {{"--interp", "5", "--precision", "bf16"}, true},
        {{"--interp", "5", "-s", "3"}, false},
        {{"--interp", "5", "--iwae", "3"}, false},
        // --ais and --bdmc
        {{"--ais", "1000", "--chains", "16", "--leapfrog", "10", "--ais-init", "q", "-n", "64", "--csv", "x"}, true},
        {{"--ais", "100000", "--chains", "128", "--leapfrog", "1000", "--ais-init=prior", "--precision", "bf16"}, true},
        {{"--ais", "1", "--chains", "1", "--leapfrog", "1", "-s", "3", "--image", "a.pgm"}, true},
        {{"--ais", "0"}, false},
        {{"--ais", "100001"}, false},
        {{"--ais", "10", "--chains", "0"}, false},
        {{"--ais", "10", "--chains", "129"}, true}, // on the plain path
        {{"--ais", "10", "--chains", "256", "--kernels", "plain"}, true},
        {{"--ais", "10", "--chains", "257"}, false},
        {{"--ais", "10", "--chains", "129", "--kernels", "fused"}, false},
        {{"--ais", "10", "--chains", "128", "--kernels", "fused"}, true},
        {{"--ais", "10", "--leapfrog", "0"}, false},
        {{"--ais", "10", "--leapfrog", "1001"}, false},
        {{"--ais", "10", "--ais-init", "posterior"}, false},
        {{"--ais", "10", "--zmu"}, false},
        {{"--ais", "10", "-b", "64"}, false},
        {{"--ais", "10", "-o", "x"}, false},
        {{"--ais", "10", "--iwae", "5"}, false},
        {{"--ais", "10", "--bench"}, false},
        {{"--chains", "16"}, false},
        {{"--leapfrog", "5"}, false},
        {{"--ais-init", "prior"}, false},
        {{"--iwae", "5", "--chains", "16"}, false},
        {{"--bdmc", "64", "--ais", "100", "--chains", "8", "--leapfrog", "5", "--ais-init", "prior", "-s", "2"}, true},
        {{"--ais", "100", "--bdmc", "100000", "--precision", "bf16", "-q"}, true},
        {{"--bdmc", "64"}, false},
        {{"--bdmc", "0", "--ais", "10"}, false},
        {{"--bdmc", "100001", "--ais", "10"}, false},
        {{"--bdmc", "8", "--ais", "10", "-n", "5"}, false},
        {{"--bdmc", "8", "--ais", "10", "--csv", "x.csv"}, false},
        {{"--bdmc", "8", "--ais", "10", "--image", "a.pgm"}, false},
        {{"--bdmc", "8", "--ais", "10", "-d", "d"}, false},
        // --image
        {{"--image", "a.pgm"}, true},
        {{"--image", "a.pgm", "--image=b.pgm", "--invert", "--csv", "-", "-o", "x"}, true},
        {{"--image", "a.pgm", "--iwae", "16"}, true},
        {{"--invert"}, false},
        {{"--image"}, false},
        {{"--image", ""}, false},
        {{"--image", "a.pgm", "-d", "data"}, false},
        {{"--image", "a.pgm", "-n", "1"}, false},
        {{"--image", "a.pgm", "--interp", "3"}, false},
        // --shard K/N
        {{"--shard", "3/8", "--csv", "x.csv", "-n", "100"}, true},
        {{"--shard", "0/1"}, true},
        {{"--iwae", "8", "--shard", "7/8"}, true},
        {{"--ais", "10", "--shard=99999/100000"}, true},
        {{"--shard", "8/8"}, false},
        {{"--shard", "0/0"}, false},
        {{"--shard", "0/100001"}, false},
        {{"--shard", "-1/8"}, false},
        {{"--shard", "3"}, false},
        {{"--shard", "3/"}, false},
        {{"--shard", "/8"}, false},
        {{"--shard", "a/b"}, false},
        {{"--shard", "1/2/3"}, false},
        {{"--shard", "1/8", "-o", "x"}, false},
        {{"--shard", "1/8", "--image", "a.pgm"}, false},
        {{"--shard", "1/8", "--bench"}, false},
        {{"--shard", "1/8", "--interp", "5"}, false},
        {{"--shard", "1/8", "--bdmc", "8", "--ais", "10"}, false},
        // --devices: every mode (--bench times the first GPU)
        {{"--devices", "all"}, true},
        {{"--devices", "0,1", "--iwae", "8", "--shard", "1/2"}, true},
        {{"--devices", "0,0,0", "--ais", "10"}, false}, // a GPU twice: the tests' variable only (test_devices)
        {{"--devices", "1,0", "--ais", "10"}, true},
        {{"--ais", "10", "--ais-iwae"}, true},
        {{"--ais-iwae"}, false},
        {{"--iwae", "8", "--ais-iwae"}, false},
        {{"--bdmc", "8", "--ais", "10", "--ais-iwae"}, false},
        {{"--devices", "63", "--bdmc", "8", "--ais", "10"}, true},
        {{"--devices", "1,0", "--bench"}, true},
        {{"--devices", "2", "--interp", "5"}, true},
        {{"--devices", ""}, false},
        {{"--devices", "64"}, false},
        {{"--devices", "-1"}, false},
        {{"--devices", "0,"}, false},
        {{"--devices", ",0"}, false},
        {{"--devices", "0,,1"}, false},
        {{"--devices", "a"}, false},
        {{"--devices", "All"}, false},
        {{"--devices", "0 1"}, false},
    };
    char line[512];
    for (auto& c : cases) {
        Config cfg;
        Error err;
        const bool ok = parse_line(c.args, &cfg, &err, line, sizeof(line));
        check(ok == c.ok && (ok || err.msg[0] != '\0'), "%s -> %s", line, ok ? "accepted" : err.msg);
    }
    Config cfg;
    Error err;
    check(parse_line({"-b", "37", "-n", "1023", "--zmu"}, &cfg, &err, line, sizeof(line)) && cfg.batch == 37 &&
              cfg.count == 1023 && cfg.z_is_mu && cfg.mode == MODE_ELBO, "values reach the config");
    check(parse_line({"-b", "37", "-b", "5"}, &cfg, &err, line, sizeof(line)) && cfg.batch == 5,
          "a repeated flag: the last value wins");
    check(parse_line({"--batch-size=37", "--count", "1023", "--seed=18446744073709551615", "--precision=bf16", "-q",
                      "--weights", "w.bin", "--data=d", "--out", "o", "--csv=-"}, &cfg, &err, line, sizeof(line)) &&
              cfg.batch == 37 && cfg.count == 1023 && cfg.seed == UINT64_MAX && cfg.precision == PRECISION_BF16 &&
              cfg.quiet && !strcmp(cfg.weights_path, "w.bin") && !strcmp(cfg.data_dir, "d") &&
              !strcmp(cfg.out_dir, "o") && !strcmp(cfg.csv_path, "-"),
          "long names and --name=value reach the config");
    check(parse_line({"--bench", "--bench-batches", "64,1,1048576"}, &cfg, &err, line, sizeof(line)) &&
              cfg.mode == MODE_BENCH && cfg.num_bench_batches == 3 && cfg.bench_batches[0] == 64 &&
              cfg.bench_batches[1] == 1 && cfg.bench_batches[2] == MAX_BATCH, "--bench-batches 64,1,1048576");
    check(parse_line({"--bench"}, &cfg, &err, line, sizeof(line)) && cfg.num_bench_batches == 4 &&
              cfg.bench_batches[3] == 10000 && !(cfg.given & OPT_BIT(OPT_PRECISION)),
          "--bench alone: 1024, 2048, 4096, 10000 in both precisions");
    check(parse_line({"--image", "a.pgm", "--image", "b.pgm", "--invert"}, &cfg, &err, line, sizeof(line)) &&
              cfg.num_image_files == 2 && !strcmp(cfg.image_paths[1], "b.pgm") && cfg.invert, "--image repeats");
    check(parse_line({"--shard", "3/8"}, &cfg, &err, line, sizeof(line)) && cfg.shard == 3 && cfg.num_shards == 8,
          "--shard 3/8 reaches the config");
    check(parse_line({"--devices", "2,0,1"}, &cfg, &err, line, sizeof(line)) && cfg.num_devices == 3 &&
              cfg.devices[0] == 2 && cfg.devices[1] == 0 && cfg.devices[2] == 1 && !cfg.all_devices,
          "--devices 2,0,1 reaches the config in order");
    check(!parse_line({"--devices", "0,1,0"}, &cfg, &err, line, sizeof(line)) && strstr(err.msg, "GPU 0 twice") &&
              strstr(err.msg, "HINT"), "a GPU listed twice is refused before any GPU is looked at: %s", err.msg);
    setenv("VAE_TEST_REPEAT_GPUS", "1", 1);
    check(parse_line({"--devices", "0,0,0"}, &cfg, &err, line, sizeof(line)) && cfg.num_devices == 3,
          "VAE_TEST_REPEAT_GPUS (the tests' several-GPU runs on one GPU) lets --devices 0,0,0 through");
    unsetenv("VAE_TEST_REPEAT_GPUS");
    {
        Error minus = {}, zero = {};
        const bool both = !parse_line({"--bench", "--bench-batches", "-1"}, &cfg, &minus, line, sizeof(line)) &&
                          !parse_line({"--bench", "--bench-batches", "64,0"}, &cfg, &zero, line, sizeof(line));
        check(both && strstr(minus.msg, "-1 is outside 1..1048576") && strstr(zero.msg, "0 is outside 1..1048576"),
              "--bench-batches -1 and 0 get the same words: %s / %s", minus.msg, zero.msg);
    }
    {
        char range[64];
        snprintf(range, sizeof(range), "images per forward pass, 1..%d (default 4096)", (int)MAX_BATCH);
        check(strstr(USAGE, range) && strstr(USAGE, "evaluate the first N images, 1 or more (default all)"),
              "-h gives the ranges of -b (1..%d) and -n", (int)MAX_BATCH);
    }
    // where CUDA finds no GPU: no driver, a driver older than the runtime, or a driver without GPUs
    check(!no_gpu_error(cudaErrorInsufficientDriver, 0, 13000, &err) && strstr(err.msg, "no NVIDIA driver") &&
              !strstr(err.msg, "insufficient"), "no driver: %s", err.msg);
    check(!no_gpu_error(cudaErrorInsufficientDriver, 12020, 13000, &err) && strstr(err.msg, "up to 12.2") &&
              strstr(err.msg, "CUDA 13.0") && strstr(err.msg, "update the NVIDIA driver"), "an old driver: %s",
          err.msg);
    // (cudaSuccess with no devices: cudaGetErrorString of another status would start CUDA in this process, which
    // test_gpu_out_of_memory's and hold_gpu_memory's children need untouched)
    check(!no_gpu_error(cudaSuccess, 13000, 13000, &err) && strstr(err.msg, "no CUDA device available (0 devices)") &&
              strstr(err.msg, "nvidia-smi"), "a driver without GPUs: %s", err.msg);
    check(parse_line({"--devices", "0,1", "--devices", "all"}, &cfg, &err, line, sizeof(line)) && cfg.all_devices &&
              cfg.num_devices == 0, "--devices all after a list: every GPU");
    {
        char many[200] = "0";
        for (int i = 1; i <= MAX_DEVICES; i++) strcat(many, ",0");
        check(!parse_line({"--devices", many}, &cfg, &err, line, sizeof(line)) && strstr(err.msg, "up to 64"),
              "--devices with %d GPUs listed: %s", MAX_DEVICES + 1, err.msg);
    }
    check(!parse_line({"--shard", "1/8", "-o", "x"}, &cfg, &err, line, sizeof(line)) && strstr(err.msg, "--shard") &&
              strstr(err.msg, "drop -o"), "--shard with -o: one line naming both: %s", err.msg);
    check(!parse_line({"-s", "18446744073709551616"}, &cfg, &err, line, sizeof(line)) && strstr(err.msg, "outside"),
          "a seed past 2^64 - 1 is out of range: %s", err.msg);
    check(!parse_line({"--batch-size=0"}, &cfg, &err, line, sizeof(line)) && strstr(err.msg, "--batch-size 0"),
          "a message names the flag as it was spelled: %s", err.msg);
    check(!parse_line({"--iwae", "8", "-b", "5"}, &cfg, &err, line, sizeof(line)) && strstr(err.msg, "-b") &&
              strstr(err.msg, "HINT"), "a flag a mode does not read is refused, not ignored: %s", err.msg);
    check(parse_line({"--ais", "500", "--chains", "8", "--leapfrog", "3", "--ais-init", "prior"}, &cfg, &err, line,
                     sizeof(line)) &&
              cfg.mode == MODE_AIS && cfg.ais_t == 500 && cfg.chains == 8 && cfg.leapfrog == 3 && cfg.ais_from_prior,
          "--ais 500 --chains 8 --leapfrog 3 --ais-init prior reach the config");
    check(parse_line({"--bdmc", "7", "--ais", "9"}, &cfg, &err, line, sizeof(line)) && cfg.mode == MODE_BDMC &&
              cfg.bdmc_n == 7 && cfg.ais_t == 9 && cfg.chains == 16 && cfg.leapfrog == 10 && !cfg.ais_from_prior,
          "--bdmc 7 --ais 9: BDMC with the defaults C = 16, L = 10, from q");
    check(!parse_line({"--bdmc", "7"}, &cfg, &err, line, sizeof(line)) && strstr(err.msg, "--ais T"),
          "--bdmc without --ais asks for T: %s", err.msg);
    // each GPU family as the driver reports it: compute capability and the shared memory a block may opt into
    // (64 KB T4, 163 KB A100, 99 KB RTX 30xx/40xx/50xx and L4, 227 KB H100/H200/B200), and the engine auto picks
    check(!gpu_supported("Tesla V100", 7, 0, PRECISION_FP32, &err) && strstr(err.msg, "Tesla V100") &&
              strstr(err.msg, "7.0") && strstr(err.msg, "7.5"), "a GPU below sm_75 is refused with its name: %s",
          err.msg);
    check(gpu_supported("Tesla T4", 7, 5, PRECISION_FP32, &err) &&
              !gpu_supported("Tesla T4", 7, 5, PRECISION_BF16, &err) &&
              strstr(err.msg, "bf16") && strstr(err.msg, "--precision fp32"),
          "sm_75 runs fp32; bf16 there is refused in one line that names fp32: %s", err.msg);
    const struct {
        const char* name;
        int major, minor;
        size_t smem;
        bool fused_code, fused;
    } families[] = {
        {"Tesla T4", 7, 5, 65536, false, false},         {"A100", 8, 0, 166912, false, false},
        {"RTX 3090", 8, 6, 101376, false, false},        {"RTX 4090", 8, 9, 101376, false, false},
        {"RTX 5090", 12, 0, 101376, false, false},       {"H100, portable binary", 9, 0, 232448, true, true},
        {"H100 under CUDA_FORCE_PTX_JIT", 9, 0, 232448, false, false}, {"B200", 10, 0, 232448, false, false},
    };
    bool picks_ok = true;
    char picks[512] = "";
    for (const auto& f : families) {
        bool fused = !f.fused;
        const bool ok =
            pick_engine(KERNELS_AUTO, PUBLISHED_DIMS, f.major, f.minor, f.smem, f.fused_code, &fused, &err) &&
            gpu_supported(f.name, f.major, f.minor, PRECISION_FP32, &err);
        picks_ok = picks_ok && ok && fused == f.fused;
        snprintf(picks + strlen(picks), sizeof(picks) - strlen(picks), "%s%s: %s", picks[0] ? ", " : "", f.name,
                 !ok ? "refused" : fused ? "fused" : "plain");
    }
    check(picks_ok, "auto picks the fused kernels only where sm_90a code runs: %s", picks);
    bool fused = true;
    check(!pick_engine(KERNELS_FUSED, PUBLISHED_DIMS, 8, 6, 101376, false, &fused, &err) &&
              strstr(err.msg, "--kernels plain") &&
              pick_engine(KERNELS_PLAIN, PUBLISHED_DIMS, 9, 0, 232448, true, &fused, &err) && !fused,
          "--kernels fused on an sm_86 GPU is one line naming --kernels plain; --kernels plain runs plain on Hopper");
    check(!pick_engine(KERNELS_AUTO, PUBLISHED_DIMS, 9, 0, 200000, true, &fused, &err) || !fused,
          "a Hopper GPU that gave a block less than the fused kernels' %zu bytes would run the plain path",
          (size_t)FUSED_SMEM_BYTES);
    const ModelDims other = {512, 2, 512};
    check(pick_engine(KERNELS_AUTO, other, 9, 0, 232448, true, &fused, &err) && !fused &&
              !pick_engine(KERNELS_FUSED, other, 9, 0, 232448, true, &fused, &err) &&
              strstr(err.msg, "784-512-2-512") && strstr(err.msg, "--kernels plain"),
          "a 784-512-2-512 model runs the plain path on an H100; --kernels fused is one line naming its size: %s",
          err.msg);
    // Through ./vae: each of these must end it before the GPU is touched, with one line naming
    // the problem and exit status 1 (the cases that need a GPU are in dev/sanitize.sh).
    if (vae_bin == NULL) return; // reported as skipped by scratch_open
    char one_more[32], one_more_flag[48], out_dir[128], csv[160], no_file[160], no_dir[160];
    snprintf(one_more, sizeof(one_more), "%d", num_images + 1);
    snprintf(one_more_flag, sizeof(one_more_flag), "-n %d", num_images + 1);
    snprintf(out_dir, sizeof(out_dir), "%s/out", scratch);
    snprintf(csv, sizeof(csv), "%s/no-such-folder/x.csv", scratch);
    snprintf(no_dir, sizeof(no_dir), "%s/no/such/folder", scratch);
    snprintf(no_file, sizeof(no_file), "%s/no-such.pgm", scratch);
    struct {
        std::initializer_list<const char*> args;
        const char* mention;
    } runs[] = {
        {{"--bogus"}, "'--bogus'"},
        {{"extra"}, "'extra'"},
        {{"-b"}, "-b needs a value"},
        {{"-n", "5", "-b"}, "-b needs a value"},
        {{"-w"}, "-w needs a value"},
        {{"-b", "0"}, "-b 0"},
        {{"--batch-size=0"}, "--batch-size 0"},
        {{"-b", "1048577"}, "-b 1048577"},
        {{"-b", "-n", "5"}, "'-n'"},
        {{"--precision", "fp16"}, "fp16"},
        {{"-s", "18446744073709551616"}, "is outside 0..18446744073709551615"},
        {{"-n", one_more, "-o", out_dir}, one_more_flag}, // one more image than the test set holds
        {{"-n", "2147483647", "-o", out_dir}, "-n 2147483647"},
        {{"-o", "data/vae_weights.bin"}, "not a folder"},
        {{"-o", "data/vae_weights.bin/a/b"}, "data/vae_weights.bin is not a folder"},
        {{"-d", no_dir}, "no such folder. HINT: pass -d with the folder that holds t10k-images-idx3-ubyte"},
        {{"-d", "data/vae_weights.bin"}, "not a folder"},
        {{"-d", out_dir}, "t10k-images-idx3-ubyte: No such file or directory. HINT: pass -d with the folder"},
        {{"--csv", csv, "-o", out_dir}, csv},
        {{"--csv", scratch, "-o", out_dir}, "a folder"},
        {{"--bench", "-n", "100"}, "--bench-batches"},
        {{"--bench", "--bench-batches", "64,101", "-n", "100"}, "101"},
        {{"--shard", "5/8", "-n", "4"}, "fewer than 8 blocks"},
        {{"--bench", "--csv", "x.csv"}, "--csv does not apply to --bench"},
        {{"--interp", "1001"}, "--interp 1001"},
        {{"--image", no_file, "-o", out_dir}, no_file},
        {{"--image", no_file, "-d", "data"}, "-d does not apply to --image"},
    };
    for (auto& r : runs) {
        char text[256] = "./vae", why[256];
        for (const char* a : r.args) snprintf(text + strlen(text), sizeof(text) - strlen(text), " %s", a);
        check(vae_refuses(r.args, r.mention, why, sizeof(why)), "%s -> %s", text, why);
    }
    VaeRun v = run_vae({"--version"});
    check(v.status == 0 && !strncmp(v.out, "vae.cu " VAE_VERSION " (commit ", 16) && strstr(v.out, "CUDA runtime"),
          "./vae --version -> %.*s", v.out ? (int)strcspn(v.out, "\n") : 0, v.out ? v.out : "");
    vae_run_free(&v);

    // A failed run leaves an existing file as it was and creates nothing; a run that succeeds
    // replaces it whole. Without a GPU the run below fails for that reason alone, after finding
    // and validating the weights and images: the quick start's only error on such a machine.
    char results[160], new_out[192], new_top[160]; // -o makes its missing parents, as mkdir -p does
    snprintf(results, sizeof(results), "%s/results.csv", scratch);
    snprintf(new_top, sizeof(new_top), "%s/new_out", scratch);
    snprintf(new_out, sizeof(new_out), "%s/a/b", new_top);
    const char* precious = "precious results\n";
    char why[256];
    struct stat st;
    bool ok = write_whole_file(results, (const uint8_t*)precious, strlen(precious));
    check(ok && vae_refuses({"-w", no_file, "--csv", results, "-o", new_out}, no_file, why, sizeof(why)) &&
              file_is(results, precious) && stat(new_top, &st) != 0 && files_starting(scratch, "results.csv.") == 0,
          "a refused run leaves --csv's file untouched and makes no -o folder (%s)", why);
    v = run_vae({"-n", "64", "--csv", results, "-o", new_out});
    const bool no_gpu = v.status == 1 && one_error_line(v.err, v.err_size, "no CUDA device");
    if (no_gpu) {
        check(v.out_size == 0 && file_is(results, precious) && stat(new_top, &st) != 0 &&
                  files_starting(scratch, "results.csv.") == 0,
              "./vae without a GPU: its only error is the GPU; --csv's file untouched, no -o folder or parent (%.*s)",
              (int)strcspn(v.err, "\n"), v.err);
        if (access("/proc/driver/nvidia/version", F_OK) != 0) // no driver loaded: say so, not CUDA's words
            check(strstr(v.err, "no NVIDIA driver") && !strstr(v.err, "insufficient"),
                  "./vae on a machine without an NVIDIA driver says so: %.*s", (int)strcspn(v.err, "\n"), v.err);
    } else {
        char ppm[224];
        snprintf(ppm, sizeof(ppm), "%s/interp.ppm", new_out);
        uint8_t* text = NULL;
        size_t size = 0;
        Error e;
        const bool read = read_file(results, &text, &size, &e);
        int rows = 0;
        for (size_t i = 0; read && i < size; i++) rows += text[i] == '\n';
        check(v.status == 0 && read && !strncmp((const char*)text, "# vae.cu ", 9) &&
                  strstr((const char*)text, "\nindex,label,bce,kl\n0,7,") && rows == 2 + 64 && stat(ppm, &st) == 0 &&
                  files_starting(scratch, "results.csv.") == 0 && files_starting(new_out, ".*ppm.") == 0,
              "./vae -n 64 --csv -o DIR/a/b: replaced whole ('#' line, header, 64 rows), three images in the folder "
              "made with its parents, no temporary files (exit %d)", v.status);
        free(text);
        test_shards();
        test_devices();
    }
    vae_run_free(&v);

    // the labels are optional: without them every label is -1 and there is no digit interpolation
    char no_labels[160], link[192], abs_images[PATH_MAX];
    snprintf(no_labels, sizeof(no_labels), "%s/no_labels", scratch);
    snprintf(link, sizeof(link), "%s/t10k-images-idx3-ubyte", no_labels);
    ok = mkdir(no_labels, 0755) == 0 && realpath("data/t10k-images-idx3-ubyte", abs_images) != NULL &&
         symlink(abs_images, link) == 0;
    v = run_vae({"-d", no_labels, "-n", "5", "--csv", "-", "-o", out_dir});
    if (no_gpu) check(ok && v.status == 1 && one_error_line(v.err, v.err_size, "no CUDA device"),
                      "-d without a labels file: the images are read and validated; only the GPU is missing");
    else check(ok && v.status == 0 && strstr(v.out, "\n4,-1,") && strstr(v.err, "skipped interp.ppm"),
               "-d without a labels file: label -1, interp.ppm skipped (exit %d)", v.status);
    vae_run_free(&v);
    if (no_gpu) {
        skip("./vae runs on a GPU (--csv -, --image, --iwae --image, --bench, --interp)", "no CUDA device");
        return;
    }

    // --csv -: the CSV alone on stdout, the summary on stderr
    v = run_vae({"-n", "3", "--csv", "-", "-o", out_dir});
    int lines = 0;
    for (size_t i = 0; i < v.out_size; i++) lines += v.out[i] == '\n';
    check(v.status == 0 && lines == 5 && v.out[0] == '#' && strstr(v.err, "mean loss"),
          "--csv -: '#' line, header and 3 rows on stdout, the summary on stderr");
    vae_run_free(&v);

    // --image: a greymap of test image 0 gives that image's losses (the noise is keyed by the
    // image's place, 0 in both runs), as P5 and as P2 drawn black on white with --invert
    if (images == NULL) return;
    char p5[160], p2[160], expected[128] = "", got[128] = "", got_inverted[128] = "";
    snprintf(p5, sizeof(p5), "%s/zero.pgm", scratch);
    snprintf(p2, sizeof(p2), "%s/zero_inverted.pgm", scratch);
    ok = write_pgm(p5, images->pixels, false, 255, false) && write_pgm(p2, images->pixels, true, 255, true);
    VaeRun test = run_vae({"-n", "1", "--csv", "-", "-o", out_dir});
    VaeRun drawn = run_vae({"--image", p5, "--csv", "-", "-o", out_dir});
    VaeRun inverted = run_vae({"--image", p2, "--invert", "--csv", "-", "-o", out_dir});
    ok = ok && test.status == 0 && drawn.status == 0 && inverted.status == 0 &&
         csv_values(test.out, 0, expected, sizeof(expected)) && csv_values(drawn.out, 0, got, sizeof(got)) &&
         csv_values(inverted.out, 0, got_inverted, sizeof(got_inverted)) && !strcmp(expected, got) &&
         !strcmp(expected, got_inverted) && strstr(drawn.out, "\n0,-1,") && strstr(drawn.err, "zero.pgm: BCE");
    check(ok, "--image of test image 0 (P5; P2 black on white with --invert): its BCE, KL %s (test set: %s)", got,
          expected);
    vae_run_free(&test), vae_run_free(&drawn), vae_run_free(&inverted);
    test = run_vae({"--iwae", "16", "-n", "1", "--csv", "-"});
    drawn = run_vae({"--iwae", "16", "--image", p5, "--csv", "-"});
    ok = test.status == 0 && drawn.status == 0 && csv_values(test.out, 0, expected, sizeof(expected)) &&
         csv_values(drawn.out, 0, got, sizeof(got)) && !strcmp(expected, got) && strstr(drawn.err, "log p(x)");
    check(ok, "--iwae 16 --image: BCE, KL, log p(x) %s as for the test image (%s)", got, expected);
    vae_run_free(&test), vae_run_free(&drawn);

    v = run_vae({"--bench", "--bench-batches", "64,37", "--precision", "bf16", "-n", "100", "-q"});
    check(v.status == 0 && strstr(v.out, "| bf16 | 64 |") && strstr(v.out, "| bf16 | 37 |") &&
              !strstr(v.out, "| fp32 |") && strstr(v.out, "latency us | throughput us"),
          "--bench --bench-batches 64,37 --precision bf16: two rows, latency and throughput");
    vae_run_free(&v);
    char interp_dir[160], interp_ppm[192];
    snprintf(interp_dir, sizeof(interp_dir), "%s/interp", scratch);
    snprintf(interp_ppm, sizeof(interp_ppm), "%s/interp.ppm", interp_dir);
    v = run_vae({"--interp", "12", "-o", interp_dir, "-q"});
    check(v.status == 0 && strstr(v.out, "66 pairs x 11 steps = 726 decodes") && strstr(v.out, "bitwise identical") &&
              stat(interp_ppm, &st) == 0, "--interp 12: 66 pairs, batched and one pair per call agree bit for bit");
    vae_run_free(&v);
    test_times();
}

// A user's -w file, missing or not a weights file, gets a hint that converts their checkpoint: prepare_weights.py
// --checkpoint with the Python the Makefile found (not 'make data', which writes data/'s file only).
static void test_hints() {
    printf("hints name the fix for a user's weights file\n");
    if (vae_bin == NULL) return skip("hints through ./vae", "./vae is missing or older than vae.cu: make vae");
    char why[512], not_weights[160];
    const bool refused = vae_refuses({"-w", "/nonexistent/my_vae.bin"}, "prepare_weights.py --checkpoint", why,
                                     sizeof(why));
    check(refused && strstr(why, VAE_PYTHON " prepare_weights.py"), "-w with a missing file: %s", why);
    snprintf(not_weights, sizeof(not_weights), "%s/my_vae.pth", scratch);
    FILE* f = fopen(not_weights, "wb");
    for (int i = 0; f != NULL && i < 4096; i++) fputc(0x80, f);
    const bool written = f != NULL && fclose(f) == 0;
    check(written && vae_refuses({"-w", not_weights}, "--checkpoint FILE", why, sizeof(why)),
          "-w with a file that is no weights file (a checkpoint): %s", why);
    remove(not_weights);
}

// The idx files as MNIST ships them, gzipped (gunzip_idx under read_file): the real test images gzipped here read back
// as the same images; cut, flipped, trailed and bomb streams are each refused with a message. The bomb is an idx header
// promising one image, then 64 MB of zeros (a 64 KB stream): it stops one byte past the promise, not at 64 MB.
static bool gzip_bytes(const uint8_t* in, size_t size, uint8_t** out, size_t* out_size) {
    z_stream zs = {};
    if (deflateInit2(&zs, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK) return false;
    *out = (uint8_t*)malloc(deflateBound(&zs, size));
    zs.next_in = (Bytef*)in, zs.avail_in = (uInt)size, zs.next_out = *out, zs.avail_out = (uInt)deflateBound(&zs, size);
    const bool ok = *out != NULL && deflate(&zs, Z_FINISH) == Z_STREAM_END;
    *out_size = zs.total_out;
    deflateEnd(&zs);
    return ok;
}
static void test_gzip(const char* images_path, const Images* images) {
    printf("gzipped idx files (-d with MNIST's .gz files)\n");
    uint8_t *plain = NULL, *packed = NULL, *back = NULL;
    size_t plain_size = 0, packed_size = 0, back_size = 0;
    Error err = {};
    char gz_dir[160], gz_path[224];
    snprintf(gz_dir, sizeof(gz_dir), "%s/gz", scratch);
    snprintf(gz_path, sizeof(gz_path), "%s/t10k-images-idx3-ubyte.gz", gz_dir);
    bool ok = read_file(images_path, &plain, &plain_size, &err) && gzip_bytes(plain, plain_size, &packed, &packed_size);
    FILE* f = ok && mkdir(gz_dir, 0700) == 0 ? fopen(gz_path, "wb") : NULL;
    ok = f != NULL && fwrite(packed, 1, packed_size, f) == packed_size && fclose(f) == 0;
    Images im = {};
    ok = ok && load_file(gz_path, parse_idx_images, &im, &err) && im.count == images->count &&
         !memcmp(im.pixels, images->pixels, (size_t)im.count * INPUT_DIM);
    check(ok, "the test images gzipped (%zu of %zu bytes) read back as the same %d images%s%s", packed_size, plain_size,
          im.count, err.msg[0] ? ": " : "", err.msg);
    free(im.pixels);
    // ./vae reads the folder: it goes past the inputs to the GPU (or, without one, stops only there)
    if (vae_bin == NULL) {
        skip("./vae -d with only the .gz images", "./vae is missing or older than vae.cu: make vae");
    } else {
        VaeRun v = run_vae({"-d", gz_dir, "-n", "3", "-q", "--csv", "-"});
        if (v.err != NULL) v.err[strcspn(v.err, "\n")] = '\0';
        check(v.out != NULL && (v.status == 0 || strstr(v.err, "no CUDA device")) && !strstr(v.err, ".gz:"),
              "./vae -d with only t10k-images-idx3-ubyte.gz: read (exit %d%s%s)", v.status, v.status ? ": " : "",
              v.err ? v.err : "");
        vae_run_free(&v);
    }
    int refused = 0, tried = 0;
    const size_t cuts[] = {0, 1, 9, 10, 18, 100, packed_size / 2, packed_size - 8, packed_size - 1};
    for (size_t cut : cuts) {
        tried++;
        if (!gunzip_idx("cut.gz", packed, cut, &back, &back_size, &err) && back == NULL && err.msg[0]) refused++;
    }
    uint8_t* bad = (uint8_t*)malloc(packed_size + 4);
    memcpy(bad, packed, packed_size);
    bad[packed_size / 2] ^= 0x40; // a bit of the deflate data, or of what the CRC guards
    tried++, refused += !gunzip_idx("flipped.gz", bad, packed_size, &back, &back_size, &err) && back == NULL;
    memcpy(bad, packed, packed_size), memcpy(bad + packed_size, "junk", 4);
    tried++, refused += !gunzip_idx("trailed.gz", bad, packed_size + 4, &back, &back_size, &err) && back == NULL &&
                        strstr(err.msg, "follow");
    check(refused == tried, "gzip streams cut at 9 places, with a bit flipped, and with bytes after them: %d/%d "
          "refused with a message", refused, tried);
    free(bad);
    const size_t bomb_size = (size_t)64 << 20;
    uint8_t* bomb = (uint8_t*)calloc(bomb_size, 1);
    uint8_t *packed_bomb = NULL, *text = NULL;
    size_t packed_bomb_size = 0, text_size = 0;
    memcpy(bomb, plain, 16);
    bomb[7] = 1, bomb[4] = bomb[5] = bomb[6] = 0; // one image: the header promises 16 + 784 bytes
    ok = bomb != NULL && gzip_bytes(bomb, bomb_size, &packed_bomb, &packed_bomb_size) &&
         !gunzip_idx("bomb.gz", packed_bomb, packed_bomb_size, &back, &back_size, &err);
    check(ok && strstr(err.msg, "promises") && back_size == 16 + INPUT_DIM + 1,
          "a gzip bomb (%zu bytes that expand to 64 MB, its header promising one image) stops at %zu bytes: %s",
          packed_bomb_size, back_size, err.msg);
    // an idx header whose dimensions multiply to no data (zero images), then more bytes: refused, and the 16 bytes
    // inflated to read the header fit the buffer (fuzz_idx_gz found them written past a buffer sized to the promise)
    uint8_t empty[64] = {0, 0, 8, 3, 0, 0, 0, 0, 0, 0, 0, 28, 0, 0, 0, 28};
    uint8_t* packed_empty = NULL;
    size_t packed_empty_size = 0;
    ok = gzip_bytes(empty, sizeof(empty), &packed_empty, &packed_empty_size) &&
         !gunzip_idx("empty.gz", packed_empty, packed_empty_size, &back, &back_size, &err);
    check(ok && strstr(err.msg, "promises"), "an idx header of zero images with bytes after it is refused: %s",
          err.msg);
    free(packed_empty);
    const char prose[] = "not an idx file, but a long enough line of text to pass sixteen bytes";
    ok = gzip_bytes((const uint8_t*)prose, sizeof(prose), &text, &text_size) &&
         !gunzip_idx("text.gz", text, text_size, &back, &back_size, &err);
    check(ok && strstr(err.msg, "no idx header"),
          "a gzip of text is refused: %s", err.msg);
    free(bomb), free(packed_bomb), free(text), free(plain), free(packed);
    remove(gz_path), rmdir(gz_dir);
}

static void test_ppm() {
    printf("image output\n");
    float tiles[2 * INPUT_DIM];
    for (int i = 0; i < 2 * INPUT_DIM; i++) tiles[i] = (i % 29) / 28.0f;
    Error err;
    const char* path = "data/test_grid.ppm";
    remove(path);
    bool ok = write_ppm_grid(path, "a test grid", tiles, 1, 2, &err);
    struct stat st;
    check(ok && stat(path, &st) != 0 && errno == ENOENT, "write_ppm_grid writes nothing at its path before the commit");
    ok = ok && outputs_commit(&err, NULL);
    uint8_t* buf;
    size_t size;
    ok = ok && read_file(path, &buf, &size, &err);
    const char* header = "P6\n59 30\n255\n";
    check(ok && size == strlen(header) + 59 * 30 * 3 && !memcmp(buf, header, strlen(header)),
          "write_ppm_grid writes a valid 59x30 P6 file");
    if (ok) free(buf);
    remove(path);
    check(!write_ppm_grid("no-such-dir/x.ppm", "a test grid", tiles, 1, 2, &err), "an unwritable path is reported: %s",
          err.msg);
    // what an exit before the commit does (fail() and cudaCheck reach it through atexit)
    char dir[96], in_dir[128];
    snprintf(dir, sizeof(dir), "%s/made_by_the_run", scratch);
    snprintf(in_dir, sizeof(in_dir), "%s/x.ppm", dir);
    ok = output_dir_make(dir, &err) && write_ppm_grid(in_dir, "a test grid", tiles, 1, 2, &err) && stat(dir, &st) == 0;
    outputs_discard();
    check(ok && stat(dir, &st) != 0 && errno == ENOENT,
          "an exit before the commit removes the temporary file and the folder the run made");
}

// The greymap forms a drawn digit may come in all give MNIST's pixels: P5 at maxval 255 and 65535
// (16-bit samples), P2 with comments, black on white with --invert (main's 255 - p).
static void test_pgm(const Images* images) {
    printf("PGM images (--image)\n");
    const uint8_t* pixels = images->pixels + 7 * INPUT_DIM; // a test image with grey edges
    struct {
        bool ascii;
        int maxval;
        bool invert;
        const char* what;
    } forms[] = {{false, 255, false, "P5, maxval 255"},
                 {false, 65535, false, "P5, maxval 65535 (two bytes a sample)"},
                 {true, 255, false, "P2 with comments"},
                 {true, 65535, false, "P2, maxval 65535"},
                 {false, 255, true, "P5, black on white, inverted back"}};
    for (auto& f : forms) {
        char path[96];
        snprintf(path, sizeof(path), "%s/form.pgm", scratch);
        Images im = {};
        Error err = {};
        const bool ok = write_pgm(path, pixels, f.ascii, f.maxval, f.invert) && load_file(path, parse_pgm, &im, &err);
        int differ = 0;
        for (int i = 0; ok && i < INPUT_DIM; i++) differ += (f.invert ? 255 - im.pixels[i] : im.pixels[i]) != pixels[i];
        check(ok && im.count == 1 && differ == 0, "%s: the test image's 784 pixels%s%s", f.what, ok ? "" : ": ",
              err.msg);
        free(im.pixels);
        remove(path);
    }
    Images im = {};
    Error err;
    const char* binary = "P1\n28 28\n";
    check(!parse_pgm((const uint8_t*)binary, strlen(binary), "digit.png", &im, &err) &&
              strstr(err.msg, "HINT: convert"),
          "another format is refused with a conversion command: %s", err.msg);
    char small[64];
    snprintf(small, sizeof(small), "P5\n32 32\n255\n");
    check(!parse_pgm((const uint8_t*)small, strlen(small), "big.pgm", &im, &err) && strstr(err.msg, "32x32") &&
              strstr(err.msg, "28x28!"), "another size is refused with a resize command: %s", err.msg);
    uint8_t one_bit[16 + INPUT_DIM];
    const size_t header = (size_t)snprintf((char*)one_bit, 16, "P5 28 28 1\n");
    for (int i = 0; i < INPUT_DIM; i++) one_bit[header + i] = i % 2;
    one_bit[header + INPUT_DIM] = '\n'; // a trailing newline is allowed
    const bool ok = parse_pgm(one_bit, header + INPUT_DIM + 1, "bits.pgm", &im, &err);
    check(ok && im.pixels[0] == 0 && im.pixels[1] == 255,
          "maxval 1 scales to 0 and 255; a trailing newline is allowed%s%s", ok ? "" : ": ", ok ? "" : err.msg);
    free(im.pixels);
}

// ----------------------------------------------------------------------------
// GPU checks

static void poison(void* p, size_t bytes) { cudaCheck(cudaMemset(p, 0xff, bytes)); } // 0xffffffff is a NaN

// Every kernel of the plain path fits the 48 KB of shared memory any GPU gives a block without asking
// (they launch with none dynamic).
static void test_gpu_plain_shared_memory() {
    cudaFuncAttributes attr;
    const void* plain_kernels[] = {
        (const void*)pixels_to_input_kernel<fp16>,   (const void*)pixels_to_input_kernel<bf16>,
        (const void*)fp16_parts_kernel<false>,       (const void*)fp16_parts_kernel<true>,
        (const void*)decoder_output_kernel<float, float, 1, true>,
        (const void*)decoder_output_kernel<float, bf16, 1, true>,
        (const void*)decoder_output_kernel<float, float, 1, true, float>,
        (const void*)decoder_output_kernel<float, bf16, 1, true, float>, (const void*)pixel_weight_kernel,
        (const void*)decoder_output_kernel<fp16, float, FP16_PARTS>,
        (const void*)sample_kernel<float, LATENT_DIM>, (const void*)sample_kernel<bf16, LATENT_DIM>,
        (const void*)sample_kernel<float, MAX_LATENT>, (const void*)sample_kernel<bf16, MAX_LATENT>,
        (const void*)z_input_kernel<float, LATENT_DIM>, (const void*)z_input_kernel<bf16, LATENT_DIM>,
        (const void*)z_input_kernel<float, MAX_LATENT>, (const void*)z_input_kernel<bf16, MAX_LATENT>,
        (const void*)decoder_output_kernel<float>,   (const void*)decoder_output_kernel<fp16>,
        (const void*)relu_backward_kernel<float, float>, (const void*)relu_backward_kernel<fp16, bf16>,
        (const void*)plain_weights_kernel<float>,    (const void*)plain_weights_kernel<bf16>,
        (const void*)iwae_logsumexp_kernel, (const void*)iwae_merge_kernel,
        (const void*)ais_start_kernel<float, LATENT_DIM>, (const void*)ais_start_kernel<bf16, LATENT_DIM>,
        (const void*)ais_start_kernel<float, MAX_LATENT>, (const void*)ais_start_kernel<bf16, MAX_LATENT>,
        (const void*)ais_begin_kernel<float, LATENT_DIM>, (const void*)ais_begin_kernel<bf16, LATENT_DIM>,
        (const void*)ais_begin_kernel<float, MAX_LATENT>, (const void*)ais_begin_kernel<bf16, MAX_LATENT>,
        (const void*)ais_kick_kernel<float, LATENT_DIM, false>, (const void*)ais_kick_kernel<bf16, LATENT_DIM, false>,
        (const void*)ais_kick_kernel<float, MAX_LATENT, false>, (const void*)ais_kick_kernel<bf16, MAX_LATENT, false>,
        (const void*)ais_kick_kernel<float, LATENT_DIM, true>, (const void*)ais_kick_kernel<bf16, LATENT_DIM, true>,
        (const void*)ais_kick_kernel<float, MAX_LATENT, true>, (const void*)ais_kick_kernel<bf16, MAX_LATENT, true>,
        (const void*)ais_adapt_kernel,               (const void*)ais_estimate_kernel,
        (const void*)interp_latents_kernel,          (const void*)fc3_weights_kernel<float>,
        (const void*)fc3_weights_kernel<bf16>,
    };
    size_t most = 0;
    for (const void* k : plain_kernels) {
        cudaCheck(cudaFuncGetAttributes(&attr, k));
        most = std::max(most, attr.sharedSizeBytes);
    }
    check(most <= 48 * 1024, "the plain path's %zu kernels need at most %zu bytes of shared memory a block (48 KB "
          "fit every GPU from sm_75)", sizeof(plain_kernels) / sizeof(plain_kernels[0]), most);
}

// The engine a model runs, to build another model like it.
static Kernels kernels_of(const VAE* m) { return m->fused ? KERNELS_FUSED : KERNELS_PLAIN; }

static void poison_activations(VAE* m) {
    const size_t B = (size_t)m->max_batch, R = (size_t)m->decoder_rows;
    const ModelDims d = m->dims;
    if (m->h1) poison(m->h1, B * d.h1 * 4), poison(m->h3, B * d.h3 * 4); // fp32 only
    poison(m->mulv, B * 2 * d.z * 4), poison(m->z, B * d.z * 4);
    poison(m->logits, B * INPUT_DIM * 4), poison(m->recon, B * INPUT_DIM * 4);
    poison(m->row_log_ratio, R * 4), poison(m->bce_parts, R * m->bce_parts_per_row * 4);
    if (!m->fused) { // the plain path's 16-bit or fp32 activations (0xffff is a bf16 NaN too)
        const Plain* pl = m->plain;
        poison(pl->x, B * INPUT_DIM * (pl->parts ? 2 * sizeof(fp16) : pl->type_size));
        poison(pl->h1, B * d.h1 * pl->type_size);
        poison(pl->z_input, R * z_width(m->precision, d.z) * pl->type_size), poison(pl->h3, R * d.h3 * pl->type_size);
        if (pl->h3_parts) poison(pl->h3_parts, R * FP16_PARTS * d.h3 * sizeof(fp16));
        return;
    }
    const int z_k = m->precision == PRECISION_FP32 ? Path<PRECISION_FP32>::Z_K : Path<PRECISION_BF16>::Z_K;
    poison(m->fused->z_rows, R * z_k * 2); // 0xffff is a bf16 and an fp16 NaN too
    poison(m->fused->enc_partials, B * MAX_ENC_SLICES * MULV_DIM * 4);
}

static float* to_host(const float* d, size_t n) {
    float* h = (float*)malloc(n * sizeof(float));
    cudaCheck(cudaMemcpy(h, d, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

static void test_gpu_activations(VAE* m, const uint8_t* d_pixels, const DebugState* ds) {
    const bool bf16_path = m->precision == PRECISION_BF16;
    const double tol = TOLERANCE[m->precision];
    printf("GPU %s forward vs PyTorch float64, PyTorch's dumped eps (PyTorch float32's own error in brackets)\n",
           PRECISION_NAMES[m->precision]);
    const ModelDims dims = m->dims;
    const int Z = dims.z;
    float *d_eps, *d_bce, *d_kl;
    cudaCheck(cudaMalloc(&d_eps, MAX_CASE_BATCH * Z * sizeof(float)));
    cudaCheck(cudaMalloc(&d_bce, MAX_CASE_BATCH * sizeof(float)));
    cudaCheck(cudaMalloc(&d_kl, MAX_CASE_BATCH * sizeof(float)));
    for (int c = 0; c < ds->num_cases; c++) {
        const DebugCase* dc = &ds->cases[c];
        const int B = dc->B;
        printf(" case B=%d from image %d\n", B, dc->first_image);
        cudaCheck(cudaMemcpy(d_eps, dc->t32[T_EPS], (size_t)B * Z * 4, cudaMemcpyHostToDevice));
        poison_activations(m);
        poison(d_bce, B * 4), poison(d_kl, B * 4);
        const ForwardOptions opt = {0, false, true};
        m->probe.eps = d_eps, m->probe.keep_activations = true;
        vae_forward(m, d_pixels + (size_t)dc->first_image * INPUT_DIM, B, dc->first_image, &opt, d_bce, d_kl);
        m->probe = Probe{};
        cudaCheck(cudaDeviceSynchronize());
        // the bf16 path keeps h1 and h3 on chip: mu, logvar and the logits show their errors
        float* h1 = bf16_path ? NULL : to_host(m->h1, (size_t)B * dims.h1);
        float* mulv = to_host(m->mulv, (size_t)B * 2 * Z);
        float* z = to_host(m->z, (size_t)B * Z);
        float* h3 = bf16_path ? NULL : to_host(m->h3, (size_t)B * dims.h3);
        float* logits = to_host(m->logits, (size_t)B * INPUT_DIM);
        float* recon = to_host(m->recon, (size_t)B * INPUT_DIM);
        float* bce = to_host(d_bce, B);
        float* kl = to_host(d_kl, B);
        const Diff none = {};
        const Diff d[] = {
            h1 ? diff(h1, dc->t64[T_H1], (size_t)B * dims.h1) : none,
            diff(mulv, dc->t64[T_MU], (size_t)B * Z, 2 * Z, Z),
            diff(mulv + Z, dc->t64[T_LOGVAR], (size_t)B * Z, 2 * Z, Z),
            diff(z, dc->t64[T_Z], (size_t)B * Z),
            h3 ? diff(h3, dc->t64[T_H3], (size_t)B * dims.h3) : none,
            diff(logits, dc->t64[T_LOGITS], (size_t)B * INPUT_DIM),
            diff(recon, dc->t64[T_RECON], (size_t)B * INPUT_DIM),
            diff(bce, dc->t64[T_BCE], B),
            diff(kl, dc->t64[T_KL], B),
        };
        for (int t = T_H1; t < NUM_DEBUG_TENSORS; t++) {
            if (bf16_path && (t == T_H1 || t == T_H3)) continue;
            const size_t n = (size_t)B * debug_width(dims, t);
            char extra[64];
            snprintf(extra, sizeof(extra), "  [PyTorch fp32 rel %.2e]", diff(dc->t32[t], dc->t64[t], n).rel);
            check_diff(DEBUG_NAMES[t], d[t - T_H1], tol, extra);
        }
        float* all[] = {h1, mulv, z, h3, logits, recon, bce, kl};
        for (float* p : all) free(p);

        // the decoder alone (the pictures and --interp), fed PyTorch's z
        float* z_ref = (float*)malloc((size_t)B * Z * 4);
        for (int i = 0; i < B * Z; i++) z_ref[i] = (float)dc->t64[T_Z][i];
        cudaCheck(cudaMemcpy(d_eps, z_ref, (size_t)B * Z * 4, cudaMemcpyHostToDevice));
        poison_activations(m);
        vae_decode(m, d_eps, B);
        recon = to_host(m->recon, (size_t)B * INPUT_DIM);
        check_diff("decode", diff(recon, dc->t64[T_RECON], (size_t)B * INPUT_DIM), tol,
                   "  (vae_decode of PyTorch's z)");
        free(recon);
        free(z_ref);
    }
    cudaCheck(cudaFree(d_eps));
    cudaCheck(cudaFree(d_bce));
    cudaCheck(cudaFree(d_kl));
}

// vae_decode_interpolations (the pictures and --interp) against the float64 CPU model: the means of
// images 0..3, pairs (0,1), (2,3), (3,0), 11 steps each, in the model's precision.
static void test_gpu_interpolation(VAE* m, const HostWeights* w, const Images* images, const uint8_t* d_pixels) {
    enum { N = 4, PAIRS = 3, ROWS = PAIRS * INTERP_STEPS };
    const int2 pairs[PAIRS] = {{0, 1}, {2, 3}, {3, 0}};
    double x[N * INPUT_DIM];
    for (int i = 0; i < N * INPUT_DIM; i++) x[i] = images->pixels[i] / 255.0;
    const CpuActs a = cpu_forward(w, PUBLISHED_DIMS, x, NULL, N);
    double z[ROWS * LATENT_DIM], logits[ROWS * INPUT_DIM];
    for (int r = 0; r < ROWS; r++) {
        const double t = (double)(r % INTERP_STEPS) / (INTERP_STEPS - 1);
        const int2 p = pairs[r / INTERP_STEPS];
        for (int j = 0; j < LATENT_DIM; j++)
            z[r * LATENT_DIM + j] = (1 - t) * a.mu[p.x * LATENT_DIM + j] + t * a.mu[p.y * LATENT_DIM + j];
    }
    cpu_decode(w, PUBLISHED_DIMS, z, ROWS, NULL, logits);
    for (double& l : logits) l = 1.0 / (1.0 + exp(-l));
    int2* d_pairs;
    cudaCheck(cudaMalloc(&d_pairs, sizeof(pairs)));
    cudaCheck(cudaMemcpy(d_pairs, pairs, sizeof(pairs), cudaMemcpyHostToDevice));
    static float tiles[ROWS * INPUT_DIM];
    poison(m->recon, (size_t)ROWS * INPUT_DIM * sizeof(float));
    vae_encode(m, d_pixels, N);
    vae_decode_interpolations(m, d_pairs, 0, ROWS, INTERP_STEPS);
    cudaCheck(cudaMemcpy(tiles, m->recon, sizeof(tiles), cudaMemcpyDeviceToHost));
    check_diff("interp", diff(tiles, logits, ROWS * INPUT_DIM), TOLERANCE[m->precision],
               "  (3 pairs x 11 steps between latent means, vs float64)");
    cudaCheck(cudaFree(d_pairs));
}

// Per-image BCE and KL of images 0..count-1 evaluated in batches of `batch` with generated eps.
static void gpu_losses(VAE* m, const uint8_t* d_pixels, int count, int batch, uint64_t seed, bool z_is_mu, float* bce,
                       float* kl) {
    float *d_bce, *d_kl;
    cudaCheck(cudaMalloc(&d_bce, (size_t)count * 4));
    cudaCheck(cudaMalloc(&d_kl, (size_t)count * 4));
    poison(d_bce, (size_t)count * 4), poison(d_kl, (size_t)count * 4);
    const ForwardOptions opt = {seed, z_is_mu, false};
    for (int first = 0; first < count; first += batch) {
        const int B = count - first < batch ? count - first : batch;
        vae_forward(m, d_pixels + (size_t)first * INPUT_DIM, B, first, &opt, d_bce + first, d_kl + first);
    }
    cudaCheck(cudaMemcpy(bce, d_bce, (size_t)count * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(kl, d_kl, (size_t)count * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(d_bce));
    cudaCheck(cudaFree(d_kl));
}

// count <= m->max_batch images: in one batch, in batches of `small` and of 37.
static void test_gpu_invariance(VAE* m, const uint8_t* d_pixels, int count, int small) {
    printf("GPU %s determinism and batch invariance (sampled eps, bitwise)\n", PRECISION_NAMES[m->precision]);
    enum { RUNS = 6, OTHER_SEED = RUNS - 1 };
    float *bce[RUNS], *kl[RUNS];
    const int batches[RUNS] = {count, small, 7, 37, 1024, count}; // the last with another seed
    const uint64_t seeds[RUNS] = {7, 7, 7, 7, 7, 8};
    for (int r = 0; r < RUNS; r++) {
        bce[r] = (float*)malloc(count * 4), kl[r] = (float*)malloc(count * 4);
        gpu_losses(m, d_pixels, count, batches[r], seeds[r], false, bce[r], kl[r]);
    }
    bool finite = true;
    for (int i = 0; i < count; i++) finite = finite && isfinite(bce[0][i]) && isfinite(kl[0][i]);
    check(finite, "every per-image loss of %d images is written and finite", count);
    for (int r = 1; r < OTHER_SEED; r++)
        check(!memcmp(bce[0], bce[r], count * 4) && !memcmp(kl[0], kl[r], count * 4),
              "batch %d gives the same %d per-image BCE and KL bits as batch %d", batches[r], count, count);
    float* again_bce = (float*)malloc(count * 4);
    float* again_kl = (float*)malloc(count * 4);
    gpu_losses(m, d_pixels, count, count, 7, false, again_bce, again_kl);
    check(!memcmp(bce[0], again_bce, count * 4) && !memcmp(kl[0], again_kl, count * 4),
          "the same seed twice gives bitwise-identical losses");
    check(memcmp(bce[0], bce[OTHER_SEED], count * 4) != 0 && !memcmp(kl[0], kl[OTHER_SEED], count * 4),
          "another seed changes BCE (the noise) but not KL (which depends on mu, logvar only)");
    for (int r = 0; r < RUNS; r++) free(bce[r]), free(kl[r]);
    free(again_bce);
    free(again_kl);
}

// The device's eps, recovered as (z - mu) / sigma, must be the host generator's draw for the
// same (seed, global image index, latent): this pins the keying, not just the distribution.
static void test_gpu_generator_keying(VAE* m, const uint8_t* d_pixels) {
    printf("GPU %s generator keyed by (seed, image index, latent)\n", PRECISION_NAMES[m->precision]);
    const int B = 37, first = 1000;
    const uint64_t seed = 0x123456789abcdefull;
    float *d_bce, *d_kl;
    cudaCheck(cudaMalloc(&d_bce, B * 4));
    cudaCheck(cudaMalloc(&d_kl, B * 4));
    const ForwardOptions opt = {seed, false, false};
    m->probe.keep_activations = true;
    vae_forward(m, d_pixels + (size_t)first * INPUT_DIM, B, first, &opt, d_bce, d_kl);
    m->probe = Probe{};
    float* mulv = to_host(m->mulv, (size_t)B * 2 * LATENT_DIM);
    float* z = to_host(m->z, (size_t)B * LATENT_DIM);
    double worst = 0.0;
    for (int b = 0; b < B; b++)
        for (int j = 0; j < LATENT_DIM; j++) {
            const double mu = mulv[b * 2 * LATENT_DIM + j];
            const double sigma = exp(0.5 * mulv[b * 2 * LATENT_DIM + LATENT_DIM + j]);
            const double eps = (z[b * LATENT_DIM + j] - mu) / sigma;
            worst = fmax(worst, fabs(eps - gaussian(seed, STREAM_POSTERIOR, first + b, 0, j)));
        }
    // z carries fp32 rounding of mu + eps*sigma; divided by sigma (>= ~0.05 here) that stays < 1e-4
    check(worst < 1e-4, "device eps equals the host draw for images %d..%d: max difference %.2e", first, first + B - 1,
          worst);
    free(mulv);
    free(z);
    cudaCheck(cudaFree(d_bce));
    cudaCheck(cudaFree(d_kl));
}

static void gpu_iwae(VAE* m, const uint8_t* d_pixels, int first, int n, int K, uint64_t seed, const float* d_eps,
                     float* log_px);

// What the plain-against-fused comparison looks at, from one model: per-image BCE and KL (sampled eps),
// IWAE's log p(x), the interpolation decodes and the reconstructions of the pictures.
enum { COMPARE_IWAE = 37, COMPARE_RECON = 16, COMPARE_INTERP_ROWS = 3 * INTERP_STEPS };
typedef struct {
    float *bce, *kl, log_px[COMPARE_IWAE], interp[COMPARE_INTERP_ROWS * INPUT_DIM], recon[COMPARE_RECON * INPUT_DIM];
} EngineResults;

static EngineResults engine_results(VAE* m, const uint8_t* d_pixels, int count) {
    EngineResults r;
    r.bce = (float*)malloc((size_t)count * 4), r.kl = (float*)malloc((size_t)count * 4);
    gpu_losses(m, d_pixels, count, count, 7, false, r.bce, r.kl);
    poison_activations(m);
    gpu_iwae(m, d_pixels, 1000, COMPARE_IWAE, 37, 5, NULL, r.log_px);
    const int2 pairs[3] = {{0, 1}, {2, 3}, {3, 0}};
    int2* d_pairs;
    cudaCheck(cudaMalloc(&d_pairs, sizeof(pairs)));
    cudaCheck(cudaMemcpy(d_pairs, pairs, sizeof(pairs), cudaMemcpyHostToDevice));
    poison_activations(m);
    vae_encode(m, d_pixels, 4);
    vae_decode_interpolations(m, d_pairs, 0, COMPARE_INTERP_ROWS, INTERP_STEPS);
    cudaCheck(cudaMemcpy(r.interp, m->recon, sizeof(r.interp), cudaMemcpyDeviceToHost));
    float* d_loss;
    cudaCheck(cudaMalloc(&d_loss, 2 * COMPARE_RECON * sizeof(float)));
    poison_activations(m);
    const ForwardOptions opt = {0, true, true}; // recon.ppm's: z = mu
    vae_forward(m, d_pixels, COMPARE_RECON, 0, &opt, d_loss, d_loss + COMPARE_RECON);
    cudaCheck(cudaMemcpy(r.recon, m->recon, sizeof(r.recon), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(d_loss));
    cudaCheck(cudaFree(d_pairs));
    return r;
}

// The largest |a - b| / max(|b|, floor) over n values; NaN anywhere counts as infinitely far.
static double worst_relative(const float* a, const float* b, int n, double floor) {
    double worst = 0.0;
    for (int i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - b[i]) / fmax(fabs((double)b[i]), floor);
        worst = d == d ? fmax(worst, d) : INFINITY;
    }
    return worst;
}

// The plain path against the fused kernels, both run here, in one precision. fp32: each is within ~1e-6
// of float64 per image (check_per_image_fp32), so 1e-5 relative. bf16: the two round at different places
// (the fused kernels' h1 and h3 in registers, bias in three parts; the plain path's in memory, bias in
// bf16), each per-image BCE within ~3e-3 of fp32's (test_gpu_test_set): 1e-2 relative; pixels in [0, 1]
// within TOL_BF16.
static void test_gpu_plain_vs_fused(const HostWeights* w, Precision p, const uint8_t* d_pixels, int count) {
    printf("GPU %s: the plain path against the fused kernels\n", PRECISION_NAMES[p]);
    EngineResults r[2];
    for (int fused = 0; fused < 2; fused++) {
        VAE m;
        vae_init(&m, w, count, p, fused ? KERNELS_FUSED : KERNELS_PLAIN);
        r[fused] = engine_results(&m, d_pixels, count);
        vae_free(&m);
    }
    const double rel = p == PRECISION_FP32 ? 1e-5 : 1e-2, pixel = p == PRECISION_FP32 ? 1e-5 : TOL_BF16;
    const double bce = worst_relative(r[0].bce, r[1].bce, count, 0.0);
    const double kl = worst_relative(r[0].kl, r[1].kl, count, 0.0);
    check(bce < rel && kl < rel, "per-image BCE and KL of %d images (sampled eps) within %.0e relative: worst %.2e, "
          "%.2e", count, rel, bce, kl);
    const double iwae = worst_relative(r[0].log_px, r[1].log_px, COMPARE_IWAE, 0.0);
    check(iwae < rel, "IWAE K = 37, log p(x) of %d images within %.0e relative: worst %.2e", COMPARE_IWAE, rel, iwae);
    const double interp = worst_relative(r[0].interp, r[1].interp, COMPARE_INTERP_ROWS * INPUT_DIM, 1.0);
    const double recon = worst_relative(r[0].recon, r[1].recon, COMPARE_RECON * INPUT_DIM, 1.0);
    check(interp < pixel && recon < pixel, "the interpolation decodes (3 pairs x 11) and the reconstructions (%d "
          "images, z = mu) within %.0e: worst %.2e, %.2e", COMPARE_RECON, pixel, interp, recon);
    for (int k = 0; k < 2; k++) free(r[k].bce), free(r[k].kl);
}

static double fp32_mean_bce_zmu = NAN; // set by the fp32 run, compared against by bf16
static float* fp32_bce_zmu = NULL;      // the fp32 run's per-image BCE (z = mu), checked against float64

// Each image's z = mu BCE and KL (the GPU's, fp32) against the float64 CPU model, the worst relative
// error over all `count` images. fp32 sums of 784 terms whose logits carry ~2e-6 of rounding: ~1e-6.
static void check_per_image_fp32(const HostWeights* w, const Images* images, int count, const float* bce,
                                 const float* kl) {
    enum { CHUNK = 500 };
    static double x[CHUNK * INPUT_DIM];
    double worst_bce = 0.0, worst_kl = 0.0;
    int at_bce = 0, at_kl = 0;
    for (int first = 0; first < count; first += CHUNK) {
        const int n = count - first < CHUNK ? count - first : CHUNK;
        for (int i = 0; i < n * INPUT_DIM; i++) x[i] = images->pixels[(size_t)first * INPUT_DIM + i] / 255.0;
        const CpuActs a = cpu_forward(w, PUBLISHED_DIMS, x, NULL, n);
        for (int i = 0; i < n; i++) {
            const double eb = fabs(bce[first + i] - a.bce[i]) / a.bce[i], ek = fabs(kl[first + i] - a.kl[i]) / a.kl[i];
            if (eb > worst_bce) worst_bce = eb, at_bce = first + i;
            if (ek > worst_kl) worst_kl = ek, at_kl = first + i;
        }
    }
    check(worst_bce <= 1e-4 && worst_kl <= 1e-4,
          "z = mu: every image's BCE and KL within 1e-4 of float64 (relative): max %.2e (image %d), %.2e (image %d)",
          worst_bce, at_bce, worst_kl, at_kl);
}

static void test_gpu_test_set(VAE* m, const HostWeights* w, const Images* images, const uint8_t* d_pixels,
                              int count) {
    printf("GPU %s full test set (%d images) vs the PyTorch float64 means\n", PRECISION_NAMES[m->precision], count);
    float* bce = (float*)malloc((size_t)count * 4);
    float* kl = (float*)malloc((size_t)count * 4);
    for (int sampled = 0; sampled < 2; sampled++) {
        gpu_losses(m, d_pixels, count, 4096, 0, !sampled, bce, kl);
        double sb = 0.0, sk = 0.0;
        for (int i = 0; i < count; i++) sb += bce[i], sk += kl[i];
        sb /= count, sk /= count;
        if (m->precision == PRECISION_BF16) {
            // against the fp32 run's mean, or PyTorch's when this run skipped fp32 (--precision bf16)
            const bool have_fp32 = !isnan(fp32_mean_bce_zmu);
            const double ref = have_fp32 ? fp32_mean_bce_zmu : 69.1652;
            if (sampled) {
                check(fabs(sb - 77.41) <= 0.2, "sampled: mean BCE %.4f (PyTorch float64 77.41 +- 0.2)", sb);
                continue;
            }
            check(fabs(sb - ref) <= 0.05, "z = mu: mean BCE %.4f, %s %.4f: within 0.05 (KL %.4f)", sb,
                  have_fp32 ? "fp32" : "PyTorch float64", ref, sk);
            if (fp32_bce_zmu != NULL) {
                // each image's bf16 rounding error, ~3e-3 of its BCE at worst: 0.2427 (image 7917) when this
                // check was written; a change to the bf16 path may move it, but not above that
                double worst = 0.0;
                int at = 0;
                for (int i = 0; i < count; i++) {
                    const double d = fabs((double)bce[i] - fp32_bce_zmu[i]);
                    if (d > worst) worst = d, at = i;
                }
                check(worst <= 0.243, "z = mu: per-image |BCE - fp32 BCE| at most 0.243: max %.4f (image %d)", worst,
                      at);
            }
        } else if (!sampled) {
            fp32_mean_bce_zmu = sb;
            if (fp32_bce_zmu == NULL) fp32_bce_zmu = (float*)malloc((size_t)count * sizeof(float));
            memcpy(fp32_bce_zmu, bce, (size_t)count * sizeof(float));
            // fp32 sums of ~70 per image, averaged in double: far inside 1e-3
            check(fabs(sb - 69.1652) <= 1e-3, "z = mu: mean BCE %.4f (PyTorch float64 69.1652 +- 0.001)", sb);
            check(fabs(sk - 25.7547) <= 1e-3, "z = mu: mean KL %.4f (PyTorch float64 25.7547 +- 0.001)", sk);
            check_per_image_fp32(w, images, count, bce, kl);
        } else {
            // Monte-Carlo over 10k images: the standard error of the mean BCE is ~0.05
            check(fabs(sb - 77.41) <= 0.2, "sampled: mean BCE %.4f (PyTorch float64 77.41 +- 0.2)", sb);
            check(fabs(sb + sk - 103.17) <= 0.2, "sampled: mean loss %.4f (PyTorch float64 103.17 +- 0.2)", sb + sk);
        }
    }
    free(bce);
    free(kl);
}

// A batch too large for the GPU must end the program with one line naming the batch, not a
// crash. The CLI caps -b at 2^20 and clamps it to the image count, which fits on any current GPU,
// so this drives device_alloc's out-of-memory path directly, at 2^30 images (1.7 TB for h1
// alone). It runs in a child because fail() exits, and before this process touches CUDA: a
// forked child cannot use its parent's CUDA context.
enum { OOM_BATCH = 1 << 30 };
static void test_gpu_out_of_memory(const HostWeights* w) {
    printf("GPU out of memory: vae_init at batch %d\n", OOM_BATCH);
    char err_path[128];
    snprintf(err_path, sizeof(err_path), "%s/oom_stderr", scratch);
    fflush(stdout);
    const pid_t pid = fork();
    if (pid < 0) {
        check(false, "fork: %s", strerror(errno));
        return;
    }
    if (pid == 0) {
        const int fd = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || dup2(fd, 2) < 0) _exit(126);
        int devices = 0;
        if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) _exit(77);
        VAE m;
        set_out_of_memory_hint(MODE_ELBO, OOM_BATCH); // as main does for the ELBO at -b 2^30
        vae_init(&m, w, OOM_BATCH, PRECISION_FP32, KERNELS_AUTO); // must fail() with exit status 1
        _exit(0);
    }
    int status;
    uint8_t* msg = NULL;
    size_t size = 0;
    Error err;
    if (!check(waitpid(pid, &status, 0) == pid, "waitpid: %s", strerror(errno))) return;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) return skip("GPU out-of-memory message", "no CUDA device");
    if (!check(read_file(err_path, &msg, &size, &err), "read the child's stderr: %s", err.msg)) return;
    char text[512], batch[64];
    snprintf(text, sizeof(text), "%.*s", (int)size, (const char*)msg);
    snprintf(batch, sizeof(batch), "HINT: use a -b below %d", OOM_BATCH);
    const char* newline = strchr(text, '\n');
    check(WIFEXITED(status) && WEXITSTATUS(status) == 1 && !strncmp(text, "vae: error: out of GPU memory", 29) &&
              strstr(text, batch) != NULL && newline != NULL && newline[1] == '\0',
          "exit status %d, one line: %.*s", WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status),
          (int)strcspn(text, "\n"), text);
    free(msg);
}

// ----------------------------------------------------------------------------

// log p(x) in float64 from the dumped eps with the plain-loop forward pass: each of the N x K
// rows is one sample; log p(z) - log q(z|x) = 1/2 sum_j (eps_j^2 + logvar_j - z_j^2).
static void cpu_iwae(const HostWeights* w, const Images* images, const IwaeState* s, double* log_px) {
    const int rows = s->N * s->K;
    double* x = (double*)malloc((size_t)rows * INPUT_DIM * sizeof(double));
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < INPUT_DIM; j++)
            x[(size_t)r * INPUT_DIM + j] = images->pixels[(size_t)(s->first_image + r / s->K) * INPUT_DIM + j] / 255.0;
    const CpuActs a = cpu_forward(w, PUBLISHED_DIMS, x, s->eps, rows);
    for (int i = 0; i < s->N; i++) {
        double top = -INFINITY, sum = 0.0;
        double* log_w = (double*)malloc(s->K * sizeof(double));
        for (int k = 0; k < s->K; k++) {
            const int r = i * s->K + k;
            double ratio = 0.0;
            for (int j = 0; j < LATENT_DIM; j++) {
                const double e = s->eps[(size_t)r * LATENT_DIM + j], z = a.z[r * LATENT_DIM + j];
                ratio += 0.5 * (e * e + a.logvar[r * LATENT_DIM + j] - z * z);
            }
            log_w[k] = -a.bce[r] + ratio;
            top = fmax(top, log_w[k]);
        }
        for (int k = 0; k < s->K; k++) sum += exp(log_w[k] - top);
        log_px[i] = top + log(sum) - log((double)s->K);
        free(log_w);
    }
    free(x);
}

static void test_cpu_iwae(const HostWeights* w, const Images* images, const IwaeState* s) {
    printf("CPU float64 IWAE vs PyTorch float64 (%d images x %d samples from image %d)\n", s->N, s->K,
           s->first_image);
    double* log_px = (double*)malloc(s->N * sizeof(double));
    cpu_iwae(w, images, s, log_px);
    check_diff("log p(x)", diff(log_px, s->log_px64, s->N), TOL_FLOAT64,
               "  (Gaussian terms with their log(2 pi) on PyTorch's side)");
    free(log_px);
}

// GPU log p(x) of n images from first, K samples each (eps: device noise or NULL).
static void gpu_iwae(VAE* m, const uint8_t* d_pixels, int first, int n, int K, uint64_t seed, const float* d_eps,
                     float* log_px) {
    float* d_log_px;
    cudaCheck(cudaMalloc(&d_log_px, (size_t)n * 4));
    poison(d_log_px, (size_t)n * 4);
    m->probe.eps = d_eps;
    vae_iwae(m, d_pixels + (size_t)first * INPUT_DIM, n, first, K, seed, d_log_px);
    m->probe = Probe{};
    cudaCheck(cudaMemcpy(log_px, d_log_px, (size_t)n * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(d_log_px));
}

// IWAE's log p(x) with PyTorch's dumped eps, against PyTorch float64.
static void test_gpu_iwae_dump(VAE* m, const uint8_t* d_pixels, const IwaeState* s) {
    const Precision p = m->precision;
    printf("GPU %s IWAE vs PyTorch float64, PyTorch's dumped eps (PyTorch float32's own error in brackets)\n",
           PRECISION_NAMES[p]);
    float* d_eps;
    const size_t eps_bytes = (size_t)s->N * s->K * m->dims.z * 4;
    cudaCheck(cudaMalloc(&d_eps, eps_bytes));
    cudaCheck(cudaMemcpy(d_eps, s->eps, eps_bytes, cudaMemcpyHostToDevice));
    poison_activations(m);
    float* log_px = (float*)malloc(s->N * 4);
    gpu_iwae(m, d_pixels, s->first_image, s->N, s->K, 0, d_eps, log_px);
    char extra[64];
    snprintf(extra, sizeof(extra), "  [PyTorch fp32 rel %.2e]", diff(s->log_px32, s->log_px64, s->N).rel);
    check_diff("log p(x)", diff(log_px, s->log_px64, s->N), TOLERANCE[p], extra);
    cudaCheck(cudaFree(d_eps));
    free(log_px);
}

static void test_gpu_iwae(VAE* m, const HostWeights* w, const uint8_t* d_pixels, const IwaeState* s,
                          int test_set_count) {
    const Precision p = m->precision;
    test_gpu_iwae_dump(m, d_pixels, s);

    // K = 1 is one sample of the ELBO path: the same eps (sample 0), so log p(x) must equal
    // -BCE + log p(z) - log q(z|x) of that path's z, mu and logvar.
    printf("GPU %s IWAE with K = 1 vs the ELBO path's sample, and invariance\n", PRECISION_NAMES[p]);
    const int B = 37, first = 1000;
    const uint64_t seed = 99;
    float *d_bce, *d_kl;
    cudaCheck(cudaMalloc(&d_bce, B * 4));
    cudaCheck(cudaMalloc(&d_kl, B * 4));
    const ForwardOptions opt = {seed, false, false};
    m->probe.keep_activations = true;
    vae_forward(m, d_pixels + (size_t)first * INPUT_DIM, B, first, &opt, d_bce, d_kl);
    m->probe = Probe{};
    float* bce = to_host(d_bce, B);
    float* mulv = to_host(m->mulv, (size_t)B * 2 * LATENT_DIM);
    float* z = to_host(m->z, (size_t)B * LATENT_DIM);
    double expected[B];
    for (int b = 0; b < B; b++) {
        double ratio = 0.0;
        for (int j = 0; j < LATENT_DIM; j++) {
            const double e = gaussian(seed, STREAM_POSTERIOR, first + b, 0, j), zj = z[b * LATENT_DIM + j];
            ratio += 0.5 * (e * e + mulv[b * 2 * LATENT_DIM + LATENT_DIM + j] - zj * zj);
        }
        expected[b] = -(double)bce[b] + ratio;
    }
    float one[B];
    gpu_iwae(m, d_pixels, first, B, 1, seed, NULL, one);
    // fp32: the same kernels on the same z, up to the order of the ratio's sum. bf16: the IWAE
    // encoder runs in fp32, the ELBO path's in bf16, so mu and logvar differ at bf16 precision.
    check_diff("K=1", diff(one, expected, B), TOLERANCE[p]);

    // per-image results do not depend on how many images share a pass, and the seed repeats
    const int K = 37;
    float together[B], again[B], alone[B];
    gpu_iwae(m, d_pixels, first, B, K, seed, NULL, together);
    gpu_iwae(m, d_pixels, first, B, K, seed, NULL, again);
    for (int b = 0; b < B; b++) gpu_iwae(m, d_pixels, first + b, 1, K, seed, NULL, &alone[b]);
    check(!memcmp(together, alone, sizeof(together)), "K=%d: %d images in one pass give the same bits as one at a time",
          K, B);
    check(!memcmp(together, again, sizeof(together)), "K=%d: the same seed twice gives bitwise-identical log p(x)", K);

    // K above LSE_CHUNK: an image's samples in chunks merged in order. K = 2000 is two chunks, the last partial;
    // 2 x 1024 samples, the second half a copy of the first, must give the first half's log p(x) (a chunk lost or
    // merged twice moves it by log 2). Two images of 2,000 rows need 4,000 decoder rows: the test's model has 4,097;
    // the plain engine's lanes take 2,048 each, so there the two images run one a lane, on both lanes' buffers.
    const int big_k = 2000;
    if (m->decoder_rows >= 2 * big_k) {
        const int Z = m->dims.z, half = LSE_CHUNK;
        gpu_iwae(m, d_pixels, first, 2, big_k, seed, NULL, together);
        for (int b = 0; b < 2; b++) gpu_iwae(m, d_pixels, first + b, 1, big_k, seed, NULL, &alone[b]);
        check(!memcmp(together, alone, 2 * sizeof(float)), "K=%d (2 chunks): 2 images in one call (%s) give the same "
              "bits as one at a time", big_k, vae_iwae_lanes(m, big_k) > 1 ? "a lane each" : "one pass");
        float* eps = (float*)malloc((size_t)B * 2 * half * Z * sizeof(float)), *d_eps;
        for (int b = 0; b < B; b++)
            for (int k = 0; k < half; k++)
                for (int j = 0; j < Z; j++)
                    eps[((size_t)b * half + k) * Z + j] = gaussian(seed, STREAM_PRIOR, first + b, k, j);
        cudaCheck(cudaMalloc(&d_eps, (size_t)B * 2 * half * Z * sizeof(float)));
        cudaCheck(cudaMemcpy(d_eps, eps, (size_t)B * half * Z * sizeof(float), cudaMemcpyHostToDevice));
        gpu_iwae(m, d_pixels, first, B, half, seed, d_eps, together);
        for (int b = 0; b < B; b++) // image b's 2 x 1024 rows: its 1024 twice
            for (int copy = 0; copy < 2; copy++)
                cudaCheck(cudaMemcpy(d_eps + ((size_t)b * 2 + copy) * half * Z, eps + (size_t)b * half * Z,
                                     (size_t)half * Z * sizeof(float), cudaMemcpyHostToDevice));
        float doubled[B];
        gpu_iwae(m, d_pixels, first, B, 2 * half, seed, d_eps, doubled);
        double worst = 0.0;
        for (int b = 0; b < B; b++) worst = fmax(worst, fabs((double)doubled[b] - together[b]) / fabs(together[b]));
        check(worst < 1e-6, "K=2048 of 1024 samples twice = K=1024 of them: worst relative difference %.2e over %d "
              "images (float32 rounding; a lost chunk would be log 2)", worst, B);
        cudaCheck(cudaFree(d_eps));
        free(eps);
    } else {
        skip("IWAE with K above a logsumexp chunk", "--quick: the model holds too few decoder rows");
    }
    free(bce), free(mulv), free(z);
    cudaCheck(cudaFree(d_bce));
    cudaCheck(cudaFree(d_kl));

    // the whole test set with K = 5000 (50 million decoder passes): PyTorch's mean NLL on the
    // H200 is 98.25 (fp32 98.247, bf16 98.253 in one run); seeds move it by ~0.01
    if (test_set_count == 0) {
        skip("GPU IWAE over the whole test set", "--quick");
        return;
    }
    printf("GPU %s IWAE, K = 5000, the whole test set\n", PRECISION_NAMES[p]);
    VAE big; // K = 5000 rows per image need a model sized for --iwae
    vae_init(&big, w, IWAE_ROWS, p, kernels_of(m), IWAE_PASS_ROWS);
    float* all = (float*)malloc((size_t)test_set_count * 4);
    gpu_iwae(&big, d_pixels, 0, test_set_count, 5000, 0, NULL, all);
    vae_free(&big);
    double sum = 0.0;
    for (int i = 0; i < test_set_count; i++) sum += all[i];
    const double nll = -sum / test_set_count;
    check(fabs(nll - 98.25) < 0.05, "mean NLL %.4f (PyTorch 98.25 +- 0.05)", nll);
    free(all);
}


// ----------------------------------------------------------------------------
// AIS (--ais, --bdmc): the gradient, the transitions, the estimator

// The reference itself, by central differences (h = 1e-5: truncation ~1e-10, rounding ~1e-9).
static void test_cpu_ais_gradient(const HostWeights* w, const Images* images) {
    printf("host float64 gradient of BCE w.r.t. z against central differences\n");
    double worst = 0.0, scale = 0.0;
    for (int image : {0, 1, 4242}) {
        double z[LATENT_DIM], grad[LATENT_DIM], unused[LATENT_DIM];
        for (int j = 0; j < LATENT_DIM; j++) z[j] = 0.8 * sin(1.7 * j + image);
        const uint8_t* x = images->pixels + (size_t)image * INPUT_DIM;
        cpu_bce_grad(w, PUBLISHED_DIMS, x, z, grad);
        for (int j = 0; j < LATENT_DIM; j++) {
            const double h = 1e-5, zj = z[j];
            z[j] = zj + h;
            const double up = cpu_bce_grad(w, PUBLISHED_DIMS, x, z, unused);
            z[j] = zj - h;
            const double down = cpu_bce_grad(w, PUBLISHED_DIMS, x, z, unused);
            z[j] = zj;
            worst = fmax(worst, fabs((up - down) / (2 * h) - grad[j])), scale = fmax(scale, fabs(grad[j]));
        }
    }
    check(worst <= 1e-6 * scale, "grad_z BCE vs central differences, 3 images x 20 latents: max abs %.2e (%.2e of the "
          "largest)", worst, worst / scale);
}

// One AIS launch of the tests and its results on the host.
typedef struct {
    int T, chains, leapfrog;
    bool from_prior, adapt;
    float step;
    uint64_t seed;
    const double* beta;   // host [T + 1], or NULL: ais_schedule
    const float* z_start; // host [n][20]: the reverse run, or NULL
    const float* p_start; // host [n * C][20]: the first transition's momenta, or NULL: drawn
} AisSpec;
typedef struct {
    double *log_w, *log_px;
    int* accepted;
    float *z, *grad0, *bce0, *delta_h, *step, *ess, *acceptance;
    float* proposal; // [n * C][40]: the last trajectory's end (z, p)
} AisOut;

static AisOut gpu_ais(VAE* m, const uint8_t* d_pixels, int first, int n, const AisSpec& spec) {
    const size_t rows = (size_t)n * spec.chains;
    double *d_beta, *d_log_w, *d_log_px;
    int* d_accepted;
    float *d_f, *d_z_start = NULL, *d_p_start = NULL;
    // z, grad0, bce0, delta_h | step, ess, acceptance | proposal
    const size_t floats = rows * (3 * LATENT_DIM + 2) + 3 * (size_t)n + rows * 2 * LATENT_DIM;
    cudaCheck(cudaMalloc(&d_beta, (spec.T + 1) * sizeof(double)));
    cudaCheck(cudaMalloc(&d_log_w, rows * sizeof(double)));
    cudaCheck(cudaMalloc(&d_log_px, n * sizeof(double)));
    cudaCheck(cudaMalloc(&d_accepted, rows * sizeof(int)));
    cudaCheck(cudaMalloc(&d_f, floats * sizeof(float)));
    poison(d_log_w, rows * sizeof(double)), poison(d_accepted, rows * sizeof(int)), poison(d_f, floats * sizeof(float));
    double* beta = (double*)malloc((spec.T + 1) * sizeof(double));
    if (spec.beta) memcpy(beta, spec.beta, (spec.T + 1) * sizeof(double));
    else ais_schedule(beta, spec.T);
    cudaCheck(cudaMemcpy(d_beta, beta, (spec.T + 1) * sizeof(double), cudaMemcpyHostToDevice));
    free(beta);
    if (spec.z_start) {
        cudaCheck(cudaMalloc(&d_z_start, (size_t)n * LATENT_DIM * sizeof(float)));
        cudaCheck(cudaMemcpy(d_z_start, spec.z_start, (size_t)n * LATENT_DIM * sizeof(float), cudaMemcpyHostToDevice));
    }
    if (spec.p_start) {
        cudaCheck(cudaMalloc(&d_p_start, rows * LATENT_DIM * sizeof(float)));
        cudaCheck(cudaMemcpy(d_p_start, spec.p_start, rows * LATENT_DIM * sizeof(float), cudaMemcpyHostToDevice));
    }
    AisIO io = {};
    io.pixels = d_pixels + (size_t)first * INPUT_DIM, io.z_start = d_z_start, io.beta = d_beta, io.n = n;
    io.chains = spec.chains, io.T = spec.T, io.leapfrog = spec.leapfrog, io.first_image = (uint32_t)first;
    io.seed = spec.seed, io.reverse = spec.z_start != NULL, io.step0 = spec.step;
    io.log_w = d_log_w, io.accepted = d_accepted;
    Probe& probe = m->probe; // the run's hooks: vae_ais copies them into io
    probe.fixed_step = !spec.adapt, probe.z_out = d_f, probe.grad0 = d_f + rows * LATENT_DIM;
    probe.bce0 = d_f + 2 * rows * LATENT_DIM, probe.delta_h = probe.bce0 + rows, io.step_out = probe.delta_h + rows;
    probe.p_start = d_p_start, probe.proposal = io.step_out + 3 * n;
    vae_ais(m, io, spec.from_prior);
    m->probe = Probe{};
    launch(ais_estimate_kernel, n, 128, 128, m->stream, d_log_px, io.step_out + n, io.step_out + 2 * n, d_log_w,
           d_accepted, n, spec.chains, spec.T - 1, io.reverse);
    cudaCheck(cudaStreamSynchronize(m->stream));
    AisOut out;
    out.log_w = (double*)malloc(rows * sizeof(double)), out.log_px = (double*)malloc(n * sizeof(double));
    out.accepted = (int*)malloc(rows * sizeof(int));
    out.z = to_host(d_f, floats);
    out.grad0 = out.z + rows * LATENT_DIM, out.bce0 = out.z + 2 * rows * LATENT_DIM, out.delta_h = out.bce0 + rows;
    out.step = out.delta_h + rows, out.ess = out.step + n, out.acceptance = out.ess + n;
    out.proposal = out.acceptance + n;
    cudaCheck(cudaMemcpy(out.log_w, d_log_w, rows * sizeof(double), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(out.log_px, d_log_px, n * sizeof(double), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(out.accepted, d_accepted, rows * sizeof(int), cudaMemcpyDeviceToHost));
    void* buffers[] = {d_beta, d_log_w, d_log_px, d_accepted, d_f, d_z_start, d_p_start};
    for (void* p : buffers) cudaCheck(cudaFree(p));
    return out;
}
static void ais_out_free(AisOut* o) { free(o->log_w), free(o->log_px), free(o->accepted), free(o->z); }

static double mean_log_px(const AisOut& o, int n) {
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += o.log_px[i];
    return sum / n;
}

// Leapfrog is reversible: from its end (z_L, -p_L) the same L steps come back to (z_0, -p_0). One
// chain per image, so each image's z_start is a chain's; fp32 only: bf16's gradient rounds z's
// neighbourhood to different bits, so its trajectories are not exactly time-symmetric.
static void test_gpu_leapfrog_reversible(VAE* m, const uint8_t* d_pixels) {
    const int n = 64, L = 10;
    const double beta[3] = {0.0, 0.5, 1.0}; // the one transition targets b = 0.5: both energy terms count
    static float p0[n * LATENT_DIM], back_z[n * LATENT_DIM], back_p[n * LATENT_DIM];
    for (int i = 0; i < n * LATENT_DIM; i++) p0[i] = (float)(1.3 * sin(0.37 * i + 1.0));
    const AisSpec start = {1, 1, L, false, false, 0.03f, 21, NULL, NULL, NULL};
    AisOut s = gpu_ais(m, d_pixels, 0, n, start); // T = 1: z is the start
    const AisSpec forward = {2, 1, L, false, false, 0.03f, 21, beta, NULL, p0};
    AisOut f = gpu_ais(m, d_pixels, 0, n, forward);
    for (int r = 0; r < n; r++)
        for (int j = 0; j < LATENT_DIM; j++) {
            back_z[r * LATENT_DIM + j] = f.proposal[r * 2 * LATENT_DIM + j];
            back_p[r * LATENT_DIM + j] = -f.proposal[r * 2 * LATENT_DIM + LATENT_DIM + j];
        }
    const AisSpec backward = {2, 1, L, false, false, 0.03f, 21, beta, back_z, back_p};
    AisOut b = gpu_ais(m, d_pixels, 0, n, backward);
    double worst_z = 0.0, worst_p = 0.0, moved = 0.0;
    bool finite = true; // an unwritten (NaN-poisoned) or diverged value fails, where fmax would skip it
    for (int r = 0; r < n; r++)
        for (int j = 0; j < LATENT_DIM; j++) {
            const int i = r * LATENT_DIM + j;
            const double z_back = b.proposal[r * 2 * LATENT_DIM + j];
            const double p_back = b.proposal[r * 2 * LATENT_DIM + LATENT_DIM + j];
            finite = finite && std::isfinite(z_back) && std::isfinite(p_back) && std::isfinite(back_z[i]) &&
                     std::isfinite(s.z[i]);
            worst_z = fmax(worst_z, fabs(z_back - s.z[i]) / fmax(1.0, fabs(s.z[i])));
            worst_p = fmax(worst_p, fabs(p_back + p0[i]) / fmax(1.0, fabs(p0[i])));
            moved = fmax(moved, fabs(back_z[i] - s.z[i]));
        }
    // fp32 rounding of z and p over 2 x 10 steps, grown by the trajectory's sensitivity: ~1e-6
    check(finite && worst_z < 1e-5 && worst_p < 1e-5 && moved > 0.1, "leapfrog (L = %d, 64 chains) run back from "
          "(z_L, -p_L) returns to (z_0, -p_0): worst %.2e in z, %.2e in p (z moved up to %.2f)%s", L, worst_z, worst_p,
          moved, finite ? "" : "; NOT FINITE");
    ais_out_free(&s), ais_out_free(&f), ais_out_free(&b);
}

// The BCE of `rows` latents given in fp32 (device [rows][20]) against one image's pixels, into bce[rows],
// in passes of the model's decoder rows (the tests' quadrature over a grid of z).
static void vae_score(VAE* m, const float* z, int rows, const uint8_t* pixels, float* bce) {
    for (int first = 0; first < rows; first += m->decoder_rows) {
        const int n = rows - first < m->decoder_rows ? rows - first : m->decoder_rows;
        const float* z_pass = z + (size_t)first * LATENT_DIM;
        if (!m->fused) {
            plain_set_z(m->plain, z_pass, n, m->stream);
            plain_decode(m->plain, decoder_rows_from(m->plain, 0), pixels, n, n, bce + first, NULL, false, m->stream);
            continue;
        }
        if (m->precision == PRECISION_FP32)
            launch(z_rows_kernel<PRECISION_FP32>, n, 128, 128, m->stream, m->fused->z_rows, z_pass, n);
        else launch(z_rows_kernel<PRECISION_BF16>, n, 128, 128, m->stream, m->fused->z_rows, z_pass, n);
        fused_decoder(m->fused, pixels, n, n, bce + first, NULL, NULL);
    }
}

// A toy model whose log p(x) is exact by quadrature: fc3's columns for all but the two latents that
// weigh most zeroed, so p(x|z) depends on (z_a, z_b) only and the other 18 integrate to 1. Its log
// p(x) = log of the 2-D integral of p(x|z) N(z; 0, I), by the midpoint rule on a 1024^2 grid over
// [-6, 6]^2 (h = 0.012, a few points per posterior standard deviation; the prior's mass beyond 6 is
// e^-18), each point's BCE from the GPU decoder in fp32. AIS from the prior at T = 1000 must come
// within 0.05 on average (its bias), and no image may exceed the exact value by 0.5 (a stochastic
// lower bound can only pass it by its noise). fp32 only: in bf16 the decoder that scores the grid
// rounds z and W3 where ais_kernel does not, a difference of the models rather than of AIS.
static void test_gpu_ais_toy(const HostWeights* w, const uint8_t* d_pixels, Kernels kernels) {
    HostWeights toy = *w;
    toy.data = (float*)malloc(w->count * sizeof(float));
    memcpy(toy.data, w->data, w->count * sizeof(float));
    for (int t = 0; t < NUM_TENSORS; t++) toy.tensor[t] = toy.data + (w->tensor[t] - w->data);
    float* w3 = toy.data + (w->tensor[FC3_W] - w->data);
    double norm[LATENT_DIM] = {};
    for (int k = 0; k < HIDDEN_DIM; k++)
        for (int j = 0; j < LATENT_DIM; j++) norm[j] += (double)w3[k * LATENT_DIM + j] * w3[k * LATENT_DIM + j];
    int a = 0, b = 1;
    for (int j = 0; j < LATENT_DIM; j++) {
        if (norm[j] > norm[a]) b = a, a = j;
        else if (j != a && (norm[j] > norm[b] || b == a)) b = j;
    }
    for (int k = 0; k < HIDDEN_DIM; k++)
        for (int j = 0; j < LATENT_DIM; j++)
            if (j != a && j != b) w3[k * LATENT_DIM + j] = 0.0f;
    const int G = 1024, rows = G * G, n = 32;
    const double R = 6.0, h = 2.0 * R / G;
    VAE toy_m;
    vae_init(&toy_m, &toy, n, PRECISION_FP32, kernels, rows);
    float* z = (float*)calloc((size_t)rows * LATENT_DIM, sizeof(float));
    for (int r = 0; r < rows; r++) {
        z[(size_t)r * LATENT_DIM + a] = (float)(-R + (r / G + 0.5) * h);
        z[(size_t)r * LATENT_DIM + b] = (float)(-R + (r % G + 0.5) * h);
    }
    float *d_z, *d_bce;
    cudaCheck(cudaMalloc(&d_z, (size_t)rows * LATENT_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_bce, (size_t)rows * sizeof(float)));
    cudaCheck(cudaMemcpy(d_z, z, (size_t)rows * LATENT_DIM * sizeof(float), cudaMemcpyHostToDevice));
    double exact[n], worst_edge = -INFINITY; // the largest density on the grid's edge, relative to its peak
    for (int i = 0; i < n; i++) {
        poison(d_bce, (size_t)rows * sizeof(float));
        vae_score(&toy_m, d_z, rows, d_pixels + (size_t)i * INPUT_DIM, d_bce);
        float* bce = to_host(d_bce, rows);
        double top = -INFINITY, sum = 0.0;
        auto log_joint = [&](int r) {
            const double za = z[(size_t)r * LATENT_DIM + a], zb = z[(size_t)r * LATENT_DIM + b];
            return -(double)bce[r] - 0.5 * (za * za + zb * zb) - log(2.0 * M_PI);
        };
        double border = -INFINITY; // the grid's edge: what lies beyond it must be negligible
        for (int r = 0; r < rows; r++) {
            const double v = log_joint(r);
            top = fmax(top, v);
            if (r / G == 0 || r / G == G - 1 || r % G == 0 || r % G == G - 1) border = fmax(border, v);
        }
        for (int r = 0; r < rows; r++) sum += exp(log_joint(r) - top);
        exact[i] = top + log(sum * h * h);
        worst_edge = fmax(worst_edge, border - top);
        free(bce);
    }
    const AisSpec spec = {1000, 16, 10, true, true, AIS_STEP_START, 0, NULL, NULL, NULL};
    AisOut o = gpu_ais(&toy_m, d_pixels, 0, n, spec);
    double mean_diff = 0.0, worst_above = -INFINITY;
    for (int i = 0; i < n; i++)
        mean_diff += (o.log_px[i] - exact[i]) / n, worst_above = fmax(worst_above, o.log_px[i] - exact[i]);
    check(worst_edge < -30.0, "toy model: the quadrature grid holds the posterior (its edge at most e^%.0f of the "
          "peak; want below e^-30)", worst_edge);
    check(fabs(mean_diff) < 0.05 && worst_above < 0.5, "toy model (latents %d, %d only), %d images: AIS T = 1000 from "
          "the prior minus exact log p(x) %.4f on average (within 0.05), at most %+.4f (below 0.5); image 0 %.4f vs "
          "%.4f", a, b, n, mean_diff, worst_above, o.log_px[0], exact[0]);
    ais_out_free(&o);
    cudaCheck(cudaFree(d_z)), cudaCheck(cudaFree(d_bce));
    free(z), free(toy.data);
    vae_free(&toy_m);
}

// Test 10: the trajectory against dev/ais_pytorch.py, an AIS written in PyTorch float64 from the
// maths and fed the same keyed noise (its own Philox and Box-Muller): ./vae --ais 5 --chains 4
// --leapfrog 3 over 8 images, per image log p(x) within 1e-5 in fp32 (2e-2 in bf16) and, in fp32,
// the same acceptance: every one of the 128 Metropolis decisions alike. In float64 the closest of
// them comes 3.2e-3 nat from its threshold, ~300x float32's rounding of H ~ 100, so an exact match
// is what fp32 owes. The plain path runs it again in bf16 with 256 chains, more than the fused kernel
// holds (in fp32 its 8,192 decisions would likely put one within float32's rounding of its threshold).
// make test names the Python with PyTorch (VAE_TEST_PYTHON). The Pythons run in the background while the GPU checks go
// on (each imports torch and replays the chains on the CPU: 2-4 s, 13 of them), and wait_background checks them.
typedef struct {
    pid_t pid;
    char out[128];  // its stdout and stderr
    char what[192]; // the check's text, before the Python's last line
} Background;

static Background background[32];
static int num_background = 0;

// The check on one dev/ais_pytorch.py: it exited with status 0 and its last line starts with "ok". `last` is the
// reason when it did not run.
static void check_trajectory(const char* what, bool ran, int status, char* last) {
    last[strcspn(last, "\n")] = '\0';
    check(ran && WIFEXITED(status) && WEXITSTATUS(status) == 0 && !strncmp(last, "ok", 2), "%s: %s", what, last);
}

static void test_gpu_ais_pytorch(Precision p, Kernels kernels, int chains,
                                 const char* weights_path = "data/vae_weights.bin") {
    const char* python = getenv("VAE_TEST_PYTHON");
    if (vae_bin == NULL || python == NULL || python[0] == '\0') {
        skip("AIS against PyTorch float64 (dev/ais_pytorch.py)", "needs ./vae and VAE_TEST_PYTHON (make test)");
        return;
    }
    static int runs = 0; // each its own csv and output file: the Pythons read theirs after this returns
    const int id = runs++;
    char csv[128], out[128], cmd[640], line[256], last[256] = "(no output)", c[16], what[192];
    snprintf(csv, sizeof(csv), "%s/ais%d.csv", scratch, id);
    snprintf(out, sizeof(out), "%s/ais%d.out", scratch, id);
    snprintf(c, sizeof(c), "%d", chains);
    snprintf(what, sizeof(what), "%s %s, %s: the trajectory of %d chains against PyTorch float64 with the same noise",
             PRECISION_NAMES[p], KERNELS_NAMES[kernels], weights_path, chains);
    VaeRun r = run_vae({"-w", weights_path, "--ais", "5", "--chains", c, "--leapfrog", "3", "-n", "8", "--precision",
                        PRECISION_NAMES[p], "--kernels", KERNELS_NAMES[kernels], "--csv", csv, "-q"});
    const bool ran = r.status == 0;
    vae_run_free(&r);
    if (!ran) {
        snprintf(last, sizeof(last), "./vae --ais 5 failed");
        check_trajectory(what, false, -1, last);
        return;
    }
    // OMP_NUM_THREADS: 13 may run at once, and torch would start a thread per core in each
    snprintf(cmd, sizeof(cmd), "OMP_NUM_THREADS=2 %s dev/ais_pytorch.py -w %s --check %s --precision %s "
             "--transitions 5 --chains %d --leapfrog 3 2>&1", python, weights_path, csv, PRECISION_NAMES[p], chains);
    const int max_background = (int)(sizeof(background) / sizeof(background[0]));
    fflush(stdout); // the child's copy of the buffer must not be written twice
    const pid_t pid = num_background < max_background ? fork() : -1;
    if (pid == 0) {
        const int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) _exit(126);
        execl("/bin/sh", "sh", "-c", cmd, (char*)NULL);
        _exit(127);
    }
    if (pid > 0) {
        Background* b = &background[num_background++];
        b->pid = pid;
        snprintf(b->out, sizeof(b->out), "%s", out);
        snprintf(b->what, sizeof(b->what), "%s", what);
        return;
    }
    FILE* f = popen(cmd, "r"); // no fork (or too many at once): here and now
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) snprintf(last, sizeof(last), "%s", line);
    const int status = f != NULL ? pclose(f) : -1;
    check_trajectory(what, true, status, last);
}

// Waits for the Pythons that test_gpu_ais_pytorch started and checks each.
static void wait_background() {
    if (num_background == 0) return;
    printf("AIS trajectories against PyTorch float64 (dev/ais_pytorch.py, run in the background)\n");
    for (int i = 0; i < num_background; i++) {
        const Background* b = &background[i];
        int status = -1;
        char line[256], last[256] = "(no output)";
        const bool waited = waitpid(b->pid, &status, 0) == b->pid;
        FILE* f = waited ? fopen(b->out, "r") : NULL;
        if (!waited) snprintf(last, sizeof(last), "waitpid: %s", strerror(errno));
        while (f != NULL && fgets(line, sizeof(line), f) != NULL) snprintf(last, sizeof(last), "%s", line);
        if (f != NULL) fclose(f);
        check_trajectory(b->what, waited, status, last);
    }
    num_background = 0;
}

// each engine's (fused, plain) whole-test-set mean at T = 100 by precision: bf16 is compared against fp32,
// the plain path against the fused kernels
static double ais_means[2][2] = {{NAN, NAN}, {NAN, NAN}};

static void test_gpu_ais(VAE* m, const HostWeights* w, const Images* images, const uint8_t* d_pixels, bool quick) {
    const Precision p = m->precision;
    const double tol = TOLERANCE[p];
    printf("GPU %s AIS: the gradient against float64, T = 1 against IWAE\n", PRECISION_NAMES[p]);
    const int first = 100, n = 7, C = 16;
    const AisSpec one = {1, C, 10, false, true, AIS_STEP_START, 5, NULL, NULL, NULL};
    AisOut a = gpu_ais(m, d_pixels, first, n, one);
    double* grad64 = (double*)malloc((size_t)n * C * LATENT_DIM * sizeof(double));
    double bce64[n * 16];
    for (int r = 0; r < n * C; r++) {
        double z[LATENT_DIM];
        for (int j = 0; j < LATENT_DIM; j++) z[j] = a.z[r * LATENT_DIM + j]; // T = 1: no transition, z is the start
        const uint8_t* x = images->pixels + (size_t)(first + r / C) * INPUT_DIM;
        bce64[r] = cpu_bce_grad(w, PUBLISHED_DIMS, x, z, grad64 + r * LATENT_DIM);
    }
    check_diff("grad", diff(a.grad0, grad64, (size_t)n * C * LATENT_DIM), tol, "  (112 chains' grad_z BCE)");
    check_diff("BCE", diff(a.bce0, bce64, (size_t)n * C), tol);
    float iwae[n];
    gpu_iwae(m, d_pixels, first, n, C, 5, NULL, iwae);
    // the same z (the same eps, keyed alike); the log p0 terms and the logsumexp run in another order and
    // precision (float32 in IWAE). fp32: the same decoder arithmetic, so 1e-5. bf16: the fused AIS runs fc3 in
    // ~fp32 (ais_gradient_wgmma) where its IWAE decoder rounds z and W3 to bf16, so the two differ at bf16's
    // tolerance (the plain path's two are one decoder)
    check_diff("T=1=IWAE", diff(iwae, a.log_px, n), p == PRECISION_FP32 ? 1e-5 : tol,
               "  (--ais 1 --chains 16 against --iwae 16, per image)");
    free(grad64);
    ais_out_free(&a);

    printf("GPU %s AIS: at b = 0 the chains keep N(0, I); the energy error of a leapfrog trajectory\n",
           PRECISION_NAMES[p]);
    {
        const int T = 41, images4 = 4, chains = 128;
        double zero[T + 1] = {};
        const AisSpec still = {T, chains, 10, true, true, AIS_STEP_START, 9, zero, NULL, NULL};
        AisOut s = gpu_ais(m, d_pixels, 0, images4, still);
        const int rows = images4 * chains;
        double worst_mean = 0.0, worst_var = 0.0;
        int moved = 0;
        bool finite = true; // fmax below would skip a latent whose mean or variance is NaN
        for (int r = 0; r < rows * LATENT_DIM; r++) finite = finite && std::isfinite(s.z[r]);
        for (int j = 0; j < LATENT_DIM; j++) {
            double sum = 0.0, sum_sq = 0.0;
            for (int r = 0; r < rows; r++) {
                const double v = s.z[r * LATENT_DIM + j];
                sum += v, sum_sq += v * v;
            }
            const double mean = sum / rows, var = sum_sq / rows - mean * mean;
            worst_mean = fmax(worst_mean, fabs(mean) / sqrt(1.0 / rows));
            worst_var = fmax(worst_var, fabs(var - 1.0) / sqrt(2.0 / rows));
        }
        for (int r = 0; r < rows; r++) moved += s.accepted[r] > 0;
        check(finite && worst_mean < 4.0 && worst_var < 4.0 && moved > rows / 2,
              "%d chains after %d transitions at b = 0: every latent's mean and variance within 4 standard errors of "
              "N(0, 1) (worst %.2f, %.2f); %d chains moved%s", rows, T - 1, worst_mean, worst_var, moved,
              finite ? "" : "; z NOT FINITE");
        ais_out_free(&s);
    }
    if (p == PRECISION_FP32) { // bf16's energies carry rounding noise (~0.1 nat) that no step size removes
        double mean_error[2];
        for (int half = 0; half < 2; half++) {
            const AisSpec jump = {2, C, 10, false, false, half ? 0.02f : 0.04f, 3, NULL, NULL, NULL};
            AisOut e = gpu_ais(m, d_pixels, 0, 8, jump);
            double sum = 0.0;
            for (int r = 0; r < 8 * C; r++) sum += fabs(e.delta_h[r]);
            mean_error[half] = sum / (8 * C);
            ais_out_free(&e);
        }
        const double ratio = mean_error[0] / mean_error[1];
        check(ratio > 3.0 && ratio < 5.5, "halving the leapfrog step cuts the energy error %.2fx (|H1 - H0| %.2e -> "
              "%.2e; expected ~4, second order)", ratio, mean_error[0], mean_error[1]);
        test_gpu_leapfrog_reversible(m, d_pixels);
        if (quick) skip("AIS on the toy model against quadrature (32 passes of 1M decoder rows)", "--quick");
        else test_gpu_ais_toy(w, d_pixels, kernels_of(m));
    }
    test_gpu_ais_pytorch(p, kernels_of(m), 4);
    if (!m->fused && p == PRECISION_BF16) test_gpu_ais_pytorch(p, KERNELS_PLAIN, 256);

    printf("GPU %s AIS: determinism and batch invariance (bitwise)\n", PRECISION_NAMES[p]);
    {
        const int count = quick ? m->max_batch : 1024; // --quick's model holds fewer images
        const AisSpec spec = {20, C, 3, false, true, AIS_STEP_START, 11, NULL, NULL, NULL};
        AisOut all = gpu_ais(m, d_pixels, 0, count, spec), again = gpu_ais(m, d_pixels, 0, count, spec);
        bool written = true; // two NaN-poisoned buffers would compare equal
        for (size_t r = 0; r < (size_t)count * C; r++) written = written && std::isfinite(all.log_w[r]);
        for (size_t i = 0; i < (size_t)count * C * LATENT_DIM; i++) written = written && std::isfinite(all.z[i]);
        check(written, "T = 20 over %d images: every log weight and final z written and finite", count);
        bool same = !memcmp(all.log_w, again.log_w, count * C * sizeof(double));
        check(same, "T = 20: a rerun gives bitwise-identical log weights");
        for (int size : {1, 7, 37}) {
            bool ok = true;
            for (int start : {0, size, count / 3, count / 2, count - size}) {
                AisOut part = gpu_ais(m, d_pixels, start, size, spec);
                ok = ok && !memcmp(part.log_w, all.log_w + (size_t)start * C, (size_t)size * C * sizeof(double)) &&
                     !memcmp(part.z, all.z + (size_t)start * C * LATENT_DIM, (size_t)size * C * LATENT_DIM * 4);
                ais_out_free(&part);
            }
            check(ok, "T = 20: images in launches of %d (from 0, %d, %d, %d, %d) give the same log weights and z as "
                  "%d together", size, size, count / 3, count / 2, count - size, count);
        }
        ais_out_free(&all), ais_out_free(&again);
    }

    printf("GPU %s AIS: the estimate tightens with T\n", PRECISION_NAMES[p]);
    if (quick) {
        skip("AIS: NLL falling with T on 1024 images", "--quick");
    } else {
        const int count = 1024; // the T = 100 -> 1000 step is ~0.04 nats; 1024 images average the noise below that
        // T = 1000 only with --exhaustive (1000 of the ladder's 1111 transitions): T = 100 already lies ~0.65 nats
        // below IWAE-5000 (NLL 98.905, 96.855, 96.69-96.70 at T = 1, 10, 100; IWAE-5000 97.35)
        double nll[4] = {NAN, NAN, NAN, NAN};
        const int Ts[4] = {1, 10, 100, 1000}, steps = exhaustive ? 4 : 3;
        for (int i = 0; i < steps; i++) {
            const AisSpec spec = {Ts[i], C, 10, false, true, AIS_STEP_START, 0, NULL, NULL, NULL};
            AisOut o = gpu_ais(m, d_pixels, 0, count, spec);
            nll[i] = -mean_log_px(o, count);
            ais_out_free(&o);
        }
        VAE big; // K = 5000 rows per image need a model sized for --iwae
        vae_init(&big, w, IWAE_ROWS, p, kernels_of(m), IWAE_PASS_ROWS);
        static float iwae[count];
        gpu_iwae(&big, d_pixels, 0, count, 5000, 0, NULL, iwae);
        vae_free(&big);
        double iwae_nll = 0.0;
        for (int i = 0; i < count; i++) iwae_nll -= iwae[i] / count;
        if (exhaustive)
            check(nll[0] > nll[1] && nll[1] > nll[2] && nll[2] > nll[3] && nll[3] < iwae_nll,
                  "%d images: NLL %.4f (T = 1) > %.4f (10) > %.4f (100) > %.4f (1000); below IWAE-5000's %.4f", count,
                  nll[0], nll[1], nll[2], nll[3], iwae_nll);
        else
            check(nll[0] > nll[1] && nll[1] > nll[2] && nll[2] < iwae_nll,
                  "%d images: NLL %.4f (T = 1) > %.4f (10) > %.4f (100); below IWAE-5000's %.4f (T = 1000: "
                  "--exhaustive)", count, nll[0], nll[1], nll[2], iwae_nll);
    }
    // BDMC through ./vae: the bounds must close as T grows. 1024 images: at 64 the T = 100 gap's standard
    // error is ~0.05 nats, as large as its step to T = 1000 (~0.08): seeds 1..6 gave -0.007 .. 0.17 at T = 100.
    // T = 1000 only with --exhaustive: 1000 of the ladder's 1110 transitions. Over both engines and precisions the
    // gap measured 0.91-0.93 at T = 10, 0.099-0.111 at T = 100 and 0.010-0.016 at T = 1000, so the bounds are 0.2 at
    // T = 100 (~2x the measured gap, 4.5x below T = 10's) and 0.05 at T = 1000 (~3x)
    double gaps[3] = {NAN, NAN, NAN};
    const char* Ts[3] = {"10", "100", "1000"};
    const int runs = exhaustive ? 3 : 2;
    bool bdmc_ok = vae_bin != NULL;
    for (int i = 0; i < runs && bdmc_ok; i++) {
        VaeRun r = run_vae({"--bdmc", "1024", "--ais", Ts[i], "--precision", PRECISION_NAMES[p], "--kernels",
                            KERNELS_NAMES[kernels_of(m)], "-q"});
        double lower = NAN, upper = NAN;
        const char *lo = r.out ? strstr(r.out, "lower bound") : NULL, *up = r.out ? strstr(r.out, "upper bound") : NULL;
        bdmc_ok = r.status == 0 && lo && up && sscanf(lo, "lower bound %lf", &lower) == 1 &&
                  sscanf(up, "upper bound %lf", &upper) == 1;
        gaps[i] = upper - lower;
        if (!bdmc_ok) printf("  ./vae --bdmc 1024 --ais %s: exit %d, %s\n", Ts[i], r.status, r.err ? r.err : "");
        vae_run_free(&r);
    }
    if (bdmc_ok && exhaustive)
        check(gaps[0] > gaps[1] && gaps[1] > gaps[2] && gaps[2] >= 0.0 && gaps[2] < 0.05,
              "BDMC, 1024 simulated images: upper - lower %.4f (T = 10) > %.4f (100) > %.4f (1000) >= 0, below 0.05",
              gaps[0], gaps[1], gaps[2]);
    else if (bdmc_ok)
        check(gaps[0] > gaps[1] && gaps[1] >= 0.0 && gaps[1] < 0.2,
              "BDMC, 1024 simulated images: upper - lower %.4f (T = 10) > %.4f (100) >= 0, below 0.2 (T = 1000: "
              "--exhaustive)", gaps[0], gaps[1]);
    else
        check(false, "./vae --bdmc 1024 --ais T ran and printed both bounds");
    if (quick) {
        skip("AIS over the whole test set, fp32 against bf16", "--quick");
        return;
    }
    const AisSpec spec = {100, C, 10, false, true, AIS_STEP_START, 0, NULL, NULL, NULL};
    double sum = 0.0;
    for (int start = 0; start < images->count; start += 4096) {
        const int size = images->count - start < 4096 ? images->count - start : 4096;
        AisOut o = gpu_ais(m, d_pixels, start, size, spec);
        sum += mean_log_px(o, size) * size;
        ais_out_free(&o);
    }
    const double mean = sum / images->count;
    const int engine = m->fused ? 0 : 1;
    ais_means[engine][p] = mean;
    const double fp32_mean = ais_means[engine][PRECISION_FP32], fused_mean = ais_means[0][p];
    if (p == PRECISION_BF16 && fp32_mean == fp32_mean)
        check(fabs(mean - fp32_mean) < 0.02, "T = 100 over the %d test images: bf16's mean log p(x) %.4f within "
              "0.02 of fp32's %.4f", images->count, mean, fp32_mean);
    else if (p == PRECISION_BF16)
        skip("AIS, fp32 against bf16", "the fp32 run did not run");
    // the two engines' chains see the same noise but round differently, so they part after a few transitions:
    // their means agree as two AIS estimates of the same log p(x) do
    if (!m->fused && fused_mean == fused_mean)
        check(fabs(mean - fused_mean) < 0.02, "T = 100 over the %d test images: the plain path's mean log p(x) %.4f "
              "within 0.02 of the fused kernels' %.4f", images->count, mean, fused_mean);
}

static const char* TEST_USAGE =
    "usage: test_vae [--quick | --exhaustive] [--gpu-only] [--precision fp32|bf16] [--kernels plain|fused]\n"
    "  --quick      a GPU subset sized for compute-sanitizer: batch invariance on %d images in\n"
    "               batches of %d, %d, 7, 37 and 1024 instead of 4097 images in batches of 4097, 1, 7, 37, 1024\n"
    "               (batch 1 still runs in the B = 1 reference case); the full-test-set means\n"
    "               and the out-of-memory check are skipped\n"
    "  --exhaustive every case: ./vae on each corrupt input (not 1 in 16 per family), AIS and BDMC at T = 1000 too\n"
    "  --gpu-only   skip the host checks (the inputs are still loaded and checked)\n"
    "  --precision  run the GPU checks of one precision only; the other's are skipped\n"
    "  --kernels    run the GPU checks of one engine only (plain: as on a GPU without the fused kernels)\n";
// past the fp32 (64) and bf16 (128) row tiles, so partial tiles run; 10 batches of 13, not 130
// of 1, which racecheck would take minutes over
enum { QUICK_IMAGES = 130, QUICK_SMALL_BATCH = 13 };

// ----------------------------------------------------------------------------
// Other sizes of the family (make family writes each model's weights and PyTorch float64 dumps): the plain path runs
// them, and every activation, IWAE with the dumped eps and AIS's trajectory are checked against PyTorch float64.

// the last has odd sizes: H1 and H3 not multiples of four (the ReLU backward's tail, odd leading dimensions), an odd Z
// above 32 (the last momentum pair half used, 32 counters a transition)
static const ModelDims FAMILY[] = {{512, 2, 512}, {256, 64, 256}, {300, 10, 500}, {97, 33, 101}};

// The CPU reference against each model's dumps always; the GPU checks with d_pixels (NULL: skipped for gpu_skip).
static void test_family(const Images* images, const uint8_t* d_pixels, const char* gpu_skip,
                        const bool run_precision[2]) {
    const int num_images = images->count;
    for (ModelDims d : FAMILY) {
        char stem[64], weights_path[96], debug_path[96], iwae_path[96];
        snprintf(stem, sizeof(stem), "data/family/vae_784_%d_%d_%d", d.h1, d.z, d.h3);
        snprintf(weights_path, sizeof(weights_path), "%s.bin", stem);
        snprintf(debug_path, sizeof(debug_path), "%s_debug_state.bin", stem);
        snprintf(iwae_path, sizeof(iwae_path), "%s_iwae_state.bin", stem);
        printf("the 784-%d-%d-%d model (%s) on the plain path\n", d.h1, d.z, d.h3, weights_path);
        if (access(weights_path, R_OK) != 0) {
            skip("models of other sizes", "no data/family: make family (needs PyTorch)");
            continue;
        }
        Error err = {};
        HostWeights w = {};
        DebugState ds = {};
        IwaeState is = {};
        uint8_t *debug_buf = NULL, *iwae_buf = NULL;
        size_t debug_size = 0, iwae_size = 0;
        const bool loaded =
            check(load_file(weights_path, parse_weights, &w, &err) && w.dims.h1 == d.h1 && w.dims.z == d.z &&
                      w.dims.h3 == d.h3,
                  "load %s: a 784-%d-%d-%d model", weights_path, d.h1, d.z, d.h3) &&
            check(read_file(debug_path, &debug_buf, &debug_size, &err) &&
                      parse_debug_state(debug_buf, debug_size, debug_path, num_images, d, &ds, &err),
                  "load %s", debug_path) &&
            check(read_file(iwae_path, &iwae_buf, &iwae_size, &err) &&
                      parse_iwae_state(iwae_buf, iwae_size, iwae_path, num_images, d, &is, &err),
                  "load %s", iwae_path);
        if (!loaded) printf("  %s\n", err.msg);
        if (loaded) test_cpu_forward(&w, images, &ds);
        if (loaded && d_pixels == NULL) skip("GPU: the plain path on a model of another size", gpu_skip);
        for (Precision p : {PRECISION_FP32, PRECISION_BF16}) {
            if (!loaded || !run_precision[p] || d_pixels == NULL) continue;
            if (p == PRECISION_BF16 && gpu_attribute(cudaDevAttrComputeCapabilityMajor) < 8) {
                skip("bf16 on a model of another size", "no bf16 tensor cores before sm_80");
                continue;
            }
            VAE m;
            vae_init(&m, &w, 64, p, KERNELS_AUTO, 1024); // the dumps' cases (37 images; 4 x 37 IWAE rows)
            check(!m.fused, "auto runs the plain path for a model of another size");
            test_gpu_activations(&m, d_pixels, &ds);
            test_gpu_iwae_dump(&m, d_pixels, &is);
            vae_free(&m);
            test_gpu_ais_pytorch(p, KERNELS_AUTO, 4, weights_path);
        }
        free(w.data), free(ds.storage64), free(debug_buf), free(iwae_buf);
    }
}

#ifndef TEST_VAE_NO_MAIN // fuzz/ includes this file for parse_debug_state
int main(int argc, char** argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); // line by line into make test's pipe too: the progress shows as it comes
    const double start = now_s();
    bool quick = false, gpu_only = false, usage_ok = true, run_precision[2] = {true, true};
    Kernels kernels = KERNELS_AUTO; // both engines where both run
    for (int i = 1; i < argc && usage_ok; i++) {
        if (!strcmp(argv[i], "--quick")) {
            quick = true;
        } else if (!strcmp(argv[i], "--exhaustive")) {
            exhaustive = true;
        } else if (!strcmp(argv[i], "--gpu-only")) {
            gpu_only = true;
        } else if (!strcmp(argv[i], "--kernels") && i + 1 < argc &&
                   (!strcmp(argv[i + 1], "plain") || !strcmp(argv[i + 1], "fused"))) {
            kernels = !strcmp(argv[++i], "plain") ? KERNELS_PLAIN : KERNELS_FUSED;
        } else if (!strcmp(argv[i], "--precision") && i + 1 < argc &&
                   (!strcmp(argv[i + 1], "fp32") || !strcmp(argv[i + 1], "bf16"))) {
            run_precision[PRECISION_FP32] = !strcmp(argv[++i], "fp32");
            run_precision[PRECISION_BF16] = !run_precision[PRECISION_FP32];
        } else {
            usage_ok = false;
        }
    }
    if (!usage_ok || (quick && exhaustive)) {
        fprintf(stderr, TEST_USAGE, QUICK_IMAGES, QUICK_IMAGES, QUICK_SMALL_BATCH);
        return 2;
    }
    const char* weights_path = "data/vae_weights.bin";
    const char* images_path = "data/t10k-images-idx3-ubyte";
    const char* labels_path = "data/t10k-labels-idx1-ubyte";
    const char* debug_path = "data/vae_debug_state.bin";
    const char* iwae_path = "data/vae_iwae_state.bin";
    Error err;
    HostWeights weights = {};
    Images images = {};
    Labels labels = {};
    DebugState ds = {};
    uint8_t* debug_buf = NULL;
    size_t debug_size;
    IwaeState iwae = {};
    uint8_t* iwae_buf = NULL;
    size_t iwae_size;
    printf("loading inputs\n");
    bool loaded = check(load_file(weights_path, parse_weights, &weights, &err), "load %s", weights_path) &&
                  check(load_file(images_path, parse_idx_images, &images, &err), "load %s", images_path) &&
                  check(load_file(labels_path, parse_idx_labels, &labels, &err), "load %s", labels_path) &&
                  check(read_file(debug_path, &debug_buf, &debug_size, &err) &&
                            parse_debug_state(debug_buf, debug_size, debug_path, images.count, PUBLISHED_DIMS, &ds,
                                              &err),
                        "load %s (its cases lie inside the test set)", debug_path) &&
                  check(read_file(iwae_path, &iwae_buf, &iwae_size, &err) &&
                            parse_iwae_state(iwae_buf, iwae_size, iwae_path, images.count, PUBLISHED_DIMS, &iwae,
                                             &err),
                        "load %s (its images lie inside the test set)", iwae_path);
    if (!loaded) printf("  %s\n", err.msg);
    const bool have_scratch = scratch_open(images_path, labels_path);
    if (gpu_only) {
        skip("host checks", "--gpu-only");
    } else {
        if (loaded) {
            test_cpu_forward(&weights, &images, &ds);
            test_cpu_iwae(&weights, &images, &iwae);
            test_cpu_ais_gradient(&weights, &images);
            char pgm_path[96];
            snprintf(pgm_path, sizeof(pgm_path), "%s/first.pgm", scratch);
            check(have_scratch && write_pgm(pgm_path, images.pixels, false, 255, false), "write %s", pgm_path);
            const char* paths[NUM_READERS] = {weights_path, images_path, labels_path, debug_path, iwae_path, pgm_path};
            test_corrupt_files(paths, images.count);
            test_pgm(&images);
        }
        test_generator();
        test_cli(loaded ? images.count : 10000, loaded ? &images : NULL);
        test_hints();
        if (loaded) test_gzip(images_path, &images);
        test_ppm();
    }
    double phase = phase_done("host checks", start);

    // before anything here touches CUDA: see test_gpu_out_of_memory
    if (quick) skip("GPU out-of-memory message", "--quick: compute-sanitizer reports the failed cudaMalloc");
    else if (loaded && have_scratch) test_gpu_out_of_memory(&weights);
    else skip("GPU out-of-memory message", "inputs or scratch folder missing");

    int devices = 0;
    const cudaError_t status = cudaGetDeviceCount(&devices);
    const char* no_gpu = !loaded                                  ? "inputs did not load"
                         : status != cudaSuccess || devices == 0 ? "no CUDA device"
                                                                 : NULL;
    // the engines here: the plain path always, the fused kernels where this GPU and build run them
    bool engine_runs[2] = {false, false}; // fused, plain
    if (no_gpu == NULL) {
        engine_runs[0] = kernels != KERNELS_PLAIN && use_fused(KERNELS_AUTO, PUBLISHED_DIMS);
        engine_runs[1] = kernels != KERNELS_FUSED;
        if (kernels == KERNELS_FUSED && !engine_runs[0])
            use_fused(KERNELS_FUSED, PUBLISHED_DIMS); // its one-line refusal
    }
    if (no_gpu == NULL) test_gpu_plain_shared_memory();
    for (Precision precision : {PRECISION_FP32, PRECISION_BF16}) {
        const char* name = PRECISION_NAMES[precision];
        for (int engine = 0; engine < 2; engine++) {
            const char* engine_name = engine == 0 ? "fused" : "plain";
            char what[5][96];
            snprintf(what[0], sizeof(what[0]), "GPU %s %s activations vs PyTorch", engine_name, name);
            snprintf(what[1], sizeof(what[1]), "GPU %s %s batch invariance and determinism", engine_name, name);
            snprintf(what[2], sizeof(what[2]), "GPU %s %s generator keying", engine_name, name);
            snprintf(what[3], sizeof(what[3]), "GPU %s %s full test set losses", engine_name, name);
            snprintf(what[4], sizeof(what[4]), "GPU %s %s IWAE, AIS, interpolation", engine_name, name);
            if ((engine == 0 && kernels == KERNELS_PLAIN) || (engine == 1 && kernels == KERNELS_FUSED))
                continue; // --kernels: the other engine is not asked for
            const char* why = no_gpu                     ? no_gpu
                            : !run_precision[precision]  ? "--precision"
                            : !engine_runs[engine]       ? "this GPU and build have no sm_90a code (the fused kernels)"
                                                         : NULL;
            if (why != NULL) {
                for (int i = 0; i < 5; i++) skip(what[i], why);
                continue;
            }
            cudaDeviceProp prop;
            cudaCheck(cudaGetDeviceProperties(&prop, 0));
            if (precision == PRECISION_BF16 && prop.major < 8) {
                skip(what[0], "bf16 needs sm_80: vae refuses --precision bf16 here");
                continue;
            }
            printf("GPU: %s (sm_%d%d), the %s engine%s\n", prop.name, prop.major, prop.minor, engine_name,
                   quick ? ", --quick" : "");
            uint8_t* d_pixels;
            cudaCheck(cudaMalloc(&d_pixels, (size_t)images.count * INPUT_DIM));
            cudaCheck(cudaMemcpy(d_pixels, images.pixels, (size_t)images.count * INPUT_DIM, cudaMemcpyHostToDevice));
            const int invariance_images = quick ? QUICK_IMAGES : 4097;
            int max_batch = invariance_images;
            for (int c = 0; c < ds.num_cases; c++) max_batch = ds.cases[c].B > max_batch ? ds.cases[c].B : max_batch;
            VAE m;
            vae_init(&m, &weights, max_batch, precision, engine == 0 ? KERNELS_FUSED : KERNELS_PLAIN);
            test_gpu_activations(&m, d_pixels, &ds);
            test_gpu_invariance(&m, d_pixels, invariance_images, quick ? QUICK_SMALL_BATCH : 1);
            test_gpu_generator_keying(&m, d_pixels);
            test_gpu_interpolation(&m, &weights, &images, d_pixels);
            if (quick) skip(what[3], "--quick");
            else test_gpu_test_set(&m, &weights, &images, d_pixels, images.count);
            test_gpu_iwae(&m, &weights, d_pixels, &iwae, quick ? 0 : images.count);
            if (!m.fused || m.fused->ais_clusters > 0) test_gpu_ais(&m, &weights, &images, d_pixels, quick);
            else skip("GPU AIS", "this GPU and build have no sm_90a code (AIS's fused kernel runs on Hopper)");
            vae_free(&m);
            if (engine == 1 && engine_runs[0])
                test_gpu_plain_vs_fused(&weights, precision, d_pixels, invariance_images);
            cudaCheck(cudaFree(d_pixels));
            char block[32];
            snprintf(block, sizeof(block), "GPU %s %s", engine_name, name);
            phase = phase_done(block, phase);
        }
    }
    const char* family_gpu_skip = no_gpu ? no_gpu : kernels == KERNELS_FUSED ? "--kernels fused" : NULL;
    uint8_t* d_pixels = NULL;
    if (family_gpu_skip == NULL) {
        cudaCheck(cudaMalloc(&d_pixels, (size_t)images.count * INPUT_DIM));
        cudaCheck(cudaMemcpy(d_pixels, images.pixels, (size_t)images.count * INPUT_DIM, cudaMemcpyHostToDevice));
    }
    if (loaded) test_family(&images, d_pixels, family_gpu_skip, run_precision);
    if (d_pixels != NULL) cudaCheck(cudaFree(d_pixels));
    phase = phase_done("other model sizes", phase);
    if (num_background > 0) {
        wait_background();
        phase_done("waiting for the PyTorch trajectory checks", phase);
    }
    free(fp32_bce_zmu);
    scratch_close();
    free(weights.data);
    free(images.pixels);
    free(labels.labels);
    free(ds.storage64);
    free(debug_buf);
    free(iwae_buf);
    printf("test_vae: %.1f s\n", now_s() - start);
    printf("%d passed, %d failed, %d skipped\n", n_passed, n_failed, n_skipped);
    return n_failed > 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}
#endif
