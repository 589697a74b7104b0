/*
test_vae.cu: checks vae.cu against PyTorch.

    make test        prepares data/ if missing, builds, runs this

Host checks (run everywhere, GPU or not): the weight, idx and reference-state files load; a
plain-loop float64 CPU forward pass over our weights and pixel reader reproduces PyTorch's
float64 activations; the generator matches the published Philox4x32-10 answers; every kind of
malformed file and bad flag is rejected with a message instead of a crash.
GPU checks: every activation of vae_forward against PyTorch's float64 reference (outputs
poisoned with NaN beforehand, so an unwritten element fails); per-image results identical across
batch sizes; the same seed reproduces bit for bit; full-test-set mean losses.
Ends with "N passed, N failed, N skipped"; exits non-zero if anything failed.
*/
#define TESTING
#include "vae.cu"

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

// Tolerances, as max |ours - float64 reference| / max |reference| over a tensor.
//  - float64 CPU loops vs PyTorch float64: only the summation order differs (~1e-16 per term).
//  - fp32 GPU vs float64: fp32 rounds at 6e-8; sums of up to 784 products and four layers in
//    a row stay well inside 1e-5 (PyTorch's own float32 lands near 1e-6, printed beside).
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

enum { DEBUG_MAGIC = 0x44454156 /* "VAED" */, DEBUG_VERSION = 1, MAX_CASES = 8 };
enum { T_X, T_EPS, T_H1, T_MU, T_LOGVAR, T_Z, T_H3, T_LOGITS, T_RECON, T_BCE, T_KL, NUM_DEBUG_TENSORS };
static const int DEBUG_WIDTH[NUM_DEBUG_TENSORS] = {INPUT_DIM,  LATENT_DIM, HIDDEN_DIM, LATENT_DIM, LATENT_DIM, LATENT_DIM,
                                                   HIDDEN_DIM, INPUT_DIM,  INPUT_DIM,  1,          1};
static const char* DEBUG_NAMES[NUM_DEBUG_TENSORS] = {"x",  "eps",    "h1",    "mu",  "logvar", "z",
                                                     "h3", "logits", "recon", "bce", "kl"};

typedef struct {
    int B, first_image;
    const double* t64[NUM_DEBUG_TENSORS]; // PyTorch float64
    const float* t32[NUM_DEBUG_TENSORS];  // PyTorch float32, same eps
} DebugCase;

typedef struct {
    uint8_t* buf;
    int num_cases;
    DebugCase cases[MAX_CASES];
} DebugState;

static bool parse_debug_state(uint8_t* buf, size_t size, const char* name, DebugState* s, Error* err) {
    const size_t header_bytes = HEADER_INTS * sizeof(int32_t);
    if (size < header_bytes) return set_error(err, "%s: %zu bytes, shorter than its header. " PREPARE_HINT, name, size);
    if (read_le32(buf) != DEBUG_MAGIC || read_le32(buf + 4) != DEBUG_VERSION)
        return set_error(err, "%s: not a version-%d reference state file. " PREPARE_HINT, name, DEBUG_VERSION);
    if (read_le32(buf + 8) != INPUT_DIM || read_le32(buf + 12) != HIDDEN_DIM || read_le32(buf + 16) != LATENT_DIM)
        return set_error(err, "%s: dims do not match the model. " PREPARE_HINT, name);
    s->num_cases = read_le32(buf + 20);
    if (s->num_cases < 1 || s->num_cases > MAX_CASES)
        return set_error(err, "%s: %d cases, expected 1..%d. " PREPARE_HINT, name, s->num_cases, MAX_CASES);
    size_t offset = header_bytes;
    for (int c = 0; c < s->num_cases; c++) {
        DebugCase* dc = &s->cases[c];
        dc->B = read_le32(buf + 4 * (8 + 2 * c));
        dc->first_image = read_le32(buf + 4 * (9 + 2 * c));
        if (dc->B < 1 || dc->B > 100000 || dc->first_image < 0)
            return set_error(err, "%s: case %d has batch %d from image %d. " PREPARE_HINT, name, c, dc->B, dc->first_image);
        for (int t = 0; t < NUM_DEBUG_TENSORS; t++) {
            const size_t n = (size_t)dc->B * DEBUG_WIDTH[t];
            if (offset + n * (sizeof(double) + sizeof(float)) > size)
                return set_error(err, "%s: truncated in case %d, tensor %s. " PREPARE_HINT, name, c, DEBUG_NAMES[t]);
            dc->t64[t] = (const double*)(buf + offset); // offsets stay 4-byte aligned; x86 and malloc make this safe
            offset += n * sizeof(double);
            dc->t32[t] = (const float*)(buf + offset);
            offset += n * sizeof(float);
        }
    }
    if (offset != size) return set_error(err, "%s: %zu bytes, expected %zu. " PREPARE_HINT, name, size, offset);
    s->buf = buf;
    return true;
}

// ----------------------------------------------------------------------------
// a plain-loop float64 forward pass: the simplest statement of the model

typedef struct {
    double *h1, *mu, *logvar, *z, *h3, *logits, *recon, *bce, *kl;
} CpuActs;

static void cpu_linear(double* y, const double* x, const float* W, const float* b, int B, int out, int in, bool relu) {
    for (int i = 0; i < B; i++)
        for (int o = 0; o < out; o++) {
            double acc = b[o];
            for (int k = 0; k < in; k++) acc += (double)W[(size_t)o * in + k] * x[(size_t)i * in + k];
            y[(size_t)i * out + o] = relu && acc < 0 ? 0.0 : acc;
        }
}

static CpuActs cpu_forward(const HostWeights* w, const double* x, const float* eps, int B) {
    CpuActs a;
    double** all[] = {&a.h1, &a.mu, &a.logvar, &a.z, &a.h3, &a.logits, &a.recon, &a.bce, &a.kl};
    const int widths[] = {HIDDEN_DIM, LATENT_DIM, LATENT_DIM, LATENT_DIM, HIDDEN_DIM, INPUT_DIM, INPUT_DIM, 1, 1};
    for (int i = 0; i < 9; i++) *all[i] = (double*)calloc((size_t)B * widths[i], sizeof(double));
    cpu_linear(a.h1, x, w->tensor[FC1_W], w->tensor[FC1_B], B, HIDDEN_DIM, INPUT_DIM, true);
    cpu_linear(a.mu, a.h1, w->tensor[FC21_W], w->tensor[FC21_B], B, LATENT_DIM, HIDDEN_DIM, false);
    cpu_linear(a.logvar, a.h1, w->tensor[FC22_W], w->tensor[FC22_B], B, LATENT_DIM, HIDDEN_DIM, false);
    for (int i = 0; i < B * LATENT_DIM; i++) a.z[i] = a.mu[i] + eps[i] * exp(0.5 * a.logvar[i]);
    cpu_linear(a.h3, a.z, w->tensor[FC3_W], w->tensor[FC3_B], B, HIDDEN_DIM, LATENT_DIM, true);
    cpu_linear(a.logits, a.h3, w->tensor[FC4_W], w->tensor[FC4_B], B, INPUT_DIM, HIDDEN_DIM, false);
    for (int i = 0; i < B; i++) {
        for (int j = 0; j < INPUT_DIM; j++) {
            const double l = a.logits[(size_t)i * INPUT_DIM + j], xi = x[(size_t)i * INPUT_DIM + j];
            a.recon[(size_t)i * INPUT_DIM + j] = 1.0 / (1.0 + exp(-l));
            a.bce[i] += fmax(l, 0.0) - xi * l + log1p(exp(-fabs(l)));
        }
        for (int j = 0; j < LATENT_DIM; j++) {
            const double mu = a.mu[i * LATENT_DIM + j], lv = a.logvar[i * LATENT_DIM + j];
            a.kl[i] += -0.5 * (1.0 + lv - mu * mu - exp(lv));
        }
    }
    return a;
}

static void cpu_free(CpuActs* a) {
    double* all[] = {a->h1, a->mu, a->logvar, a->z, a->h3, a->logits, a->recon, a->bce, a->kl};
    for (double* p : all) free(p);
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
        CpuActs a = cpu_forward(w, x, dc->t32[T_EPS], dc->B);
        const double* ours[] = {a.h1, a.mu, a.logvar, a.z, a.h3, a.logits, a.recon, a.bce, a.kl};
        for (int t = T_H1; t < NUM_DEBUG_TENSORS; t++)
            check_diff(DEBUG_NAMES[t], diff(ours[t - T_H1], dc->t64[t], (size_t)dc->B * DEBUG_WIDTH[t]), TOL_FLOAT64);
        cpu_free(&a);
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

// Feeds a parser a corrupted copy of a good file; it must refuse with a message.
typedef bool (*Parser)(const uint8_t*, size_t, const char*, void*, Error*);

static bool weights_parser(const uint8_t* b, size_t n, const char* name, void* out, Error* e) {
    HostWeights w = {};
    bool ok = parse_weights(b, n, name, &w, e);
    free(w.data);
    (void)out;
    return ok;
}
static bool images_parser(const uint8_t* b, size_t n, const char* name, void* out, Error* e) {
    Images im = {};
    bool ok = parse_idx_images(b, n, name, &im, e);
    free(im.pixels);
    (void)out;
    return ok;
}
static bool labels_parser(const uint8_t* b, size_t n, const char* name, void* out, Error* e) {
    Labels lb = {};
    bool ok = parse_idx_labels(b, n, name, &lb, e);
    free(lb.labels);
    (void)out;
    return ok;
}

static void expect_rejected(Parser parse, const uint8_t* buf, size_t size, const char* what) {
    Error err = {};
    const bool accepted = parse(buf, size, "corrupt", NULL, &err);
    char* hint = strstr(err.msg, ". HINT:"); // the hint is the same for all; keep the lines short
    if (hint != NULL) *hint = '\0';
    check(!accepted && err.msg[0] != '\0', "rejects %s: %s", what, accepted ? "ACCEPTED" : err.msg);
}

static void put_le32(uint8_t* p, uint32_t v) { p[0] = v, p[1] = v >> 8, p[2] = v >> 16, p[3] = v >> 24; }
static void put_be32(uint8_t* p, uint32_t v) { p[0] = v >> 24, p[1] = v >> 16, p[2] = v >> 8, p[3] = v; }

// Truncations at several offsets, and single header fields changed, of one good file.
static void corrupt_file_suite(const char* path, Parser parse, bool big_endian, const int* fields, int num_fields) {
    uint8_t* good;
    size_t size;
    Error err;
    if (!check(read_file(path, &good, &size, &err), "read %s", path)) return;
    check(parse(good, size, path, NULL, &err), "accepts the good %s", path);
    uint8_t* bad = (uint8_t*)malloc(size + 1);
    const size_t cuts[] = {0, 1, 3, 7, 15, 100, 1023, 1024, 1025, size / 2, size - 4, size - 1};
    for (size_t cut : cuts) {
        if (cut >= size) continue;
        char what[64];
        snprintf(what, sizeof(what), "a copy cut to %zu bytes", cut);
        memcpy(bad, good, cut);
        expect_rejected(parse, bad, cut, what);
    }
    memcpy(bad, good, size);
    bad[size] = 0;
    expect_rejected(parse, bad, size + 1, "one byte too many");
    const uint32_t values[] = {0, 0xffffffffu, 0x7fffffffu, 12345};
    for (int f = 0; f < num_fields; f++)
        for (uint32_t v : values) {
            memcpy(bad, good, size);
            uint8_t* p = bad + 4 * fields[f];
            const uint32_t original = big_endian ? read_be32(p) : (uint32_t)read_le32(p);
            if (original == v) continue;
            big_endian ? put_be32(p, v) : put_le32(p, v);
            char what[64];
            snprintf(what, sizeof(what), "header field %d = 0x%x", fields[f], v);
            expect_rejected(parse, bad, size, what);
        }
    free(bad);
    free(good);
}

static void test_corrupt_files(const char* weights_path, const char* images_path, const char* labels_path) {
    printf("malformed inputs are rejected with a message\n");
    const int weight_fields[] = {0, 1, 2, 3, 4, 5, 6, 7};
    corrupt_file_suite(weights_path, weights_parser, false, weight_fields, 8);
    const int image_fields[] = {0, 1, 2, 3};
    corrupt_file_suite(images_path, images_parser, true, image_fields, 4);
    const int label_fields[] = {0, 1};
    corrupt_file_suite(labels_path, labels_parser, true, label_fields, 2);

    // a non-finite weight, a label that is no digit, a directory, a missing file
    uint8_t* buf;
    size_t size;
    Error err;
    if (read_file(weights_path, &buf, &size, &err)) {
        const float nan = NAN;
        memcpy(buf + HEADER_INTS * 4 + 4 * 12345, &nan, 4);
        expect_rejected(weights_parser, buf, size, "a NaN weight");
        free(buf);
    }
    if (read_file(labels_path, &buf, &size, &err)) {
        buf[8 + 17] = 10;
        expect_rejected(labels_parser, buf, size, "label 10");
        free(buf);
    }
    check(!read_file("data", &buf, &size, &err), "read_file refuses a directory: %s", err.msg);
    check(!read_file("data/no-such-file", &buf, &size, &err), "read_file reports a missing file: %s", err.msg);
}

static void test_cli() {
    printf("command line\n");
    struct {
        std::initializer_list<const char*> args;
        bool ok;
    } cases[] = {
        {{}, true},
        {{"-b", "37", "-n", "1023", "-s", "18446744073709551615", "--zmu", "-o", "x", "--csv", "y.csv"}, false},
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
    };
    for (auto& c : cases) {
        char* argv[32] = {(char*)"vae"};
        int argc = 1;
        char line[256] = "vae";
        for (const char* a : c.args) {
            argv[argc++] = (char*)a;
            snprintf(line + strlen(line), sizeof(line) - strlen(line), " %s", a);
        }
        Config cfg;
        Error err = {};
        const bool ok = parse_args(argc, argv, &cfg, &err);
        check(ok == c.ok, "%s -> %s", line, ok ? "accepted" : err.msg);
    }
    Config cfg;
    Error err;
    char* argv[] = {(char*)"vae", (char*)"-b", (char*)"37", (char*)"-n", (char*)"1023", (char*)"--zmu"};
    check(parse_args(6, argv, &cfg, &err) && cfg.batch == 37 && cfg.count == 1023 && cfg.z_is_mu,
          "values reach the config");
}

static void test_ppm() {
    printf("image output\n");
    float tiles[2 * INPUT_DIM];
    for (int i = 0; i < 2 * INPUT_DIM; i++) tiles[i] = (i % 29) / 28.0f;
    Error err;
    const char* path = "data/test_grid.ppm";
    bool ok = write_ppm_grid(path, tiles, 1, 2, &err);
    uint8_t* buf;
    size_t size;
    ok = ok && read_file(path, &buf, &size, &err);
    const char* header = "P6\n59 30\n255\n";
    check(ok && size == strlen(header) + 59 * 30 * 3 && !memcmp(buf, header, strlen(header)),
          "write_ppm_grid writes a valid 59x30 P6 file");
    if (ok) free(buf);
    remove(path);
    check(!write_ppm_grid("no-such-dir/x.ppm", tiles, 1, 2, &err), "an unwritable path is reported: %s", err.msg);
}

// ----------------------------------------------------------------------------
// GPU checks

static void poison(void* p, size_t bytes) { cudaCheck(cudaMemset(p, 0xff, bytes)); } // 0xffffffff is a NaN

static void poison_activations(VAE* m) {
    const size_t B = (size_t)m->max_batch;
    poison(m->h1, B * HIDDEN_DIM * 4), poison(m->mulv, B * 2 * LATENT_DIM * 4), poison(m->z, B * LATENT_DIM * 4);
    poison(m->h3, B * HIDDEN_DIM * 4), poison(m->logits, B * INPUT_DIM * 4), poison(m->recon, B * INPUT_DIM * 4);
    if (m->precision == PRECISION_BF16) { // 0xffff is a bf16 NaN too
        poison(m->h1_16, B * HIDDEN_DIM * 2), poison(m->h3_16, B * HIDDEN_DIM * 2);
        poison(m->bce_partial, B * FC4_COL_BLOCKS * 4);
    }
}

static float* to_host(const float* d, size_t n) {
    float* h = (float*)malloc(n * sizeof(float));
    cudaCheck(cudaMemcpy(h, d, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

static float* to_host(const bf16* d, size_t n) {
    bf16* raw = (bf16*)malloc(n * sizeof(bf16));
    cudaCheck(cudaMemcpy(raw, d, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    float* h = (float*)malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = __bfloat162float(raw[i]);
    free(raw);
    return h;
}

static void test_gpu_activations(VAE* m, const uint8_t* d_pixels, const DebugState* ds) {
    const bool bf16_path = m->precision == PRECISION_BF16;
    const double tol = TOLERANCE[m->precision];
    printf("GPU %s forward vs PyTorch float64, PyTorch's dumped eps (PyTorch float32's own error in brackets)\n",
           PRECISION_NAMES[m->precision]);
    float *d_eps, *d_bce, *d_kl;
    cudaCheck(cudaMalloc(&d_eps, 4096 * LATENT_DIM * sizeof(float)));
    cudaCheck(cudaMalloc(&d_bce, 4096 * sizeof(float)));
    cudaCheck(cudaMalloc(&d_kl, 4096 * sizeof(float)));
    for (int c = 0; c < ds->num_cases; c++) {
        const DebugCase* dc = &ds->cases[c];
        const int B = dc->B;
        printf(" case B=%d from image %d\n", B, dc->first_image);
        cudaCheck(cudaMemcpy(d_eps, dc->t32[T_EPS], (size_t)B * LATENT_DIM * 4, cudaMemcpyHostToDevice));
        poison_activations(m);
        poison(d_bce, B * 4), poison(d_kl, B * 4);
        const ForwardOptions opt = {0, false, d_eps, true, true};
        vae_forward(m, d_pixels + (size_t)dc->first_image * INPUT_DIM, B, dc->first_image, &opt, d_bce, d_kl);
        cudaCheck(cudaDeviceSynchronize());
        float* h1 = bf16_path ? to_host(m->h1_16, (size_t)B * HIDDEN_DIM) : to_host(m->h1, (size_t)B * HIDDEN_DIM);
        float* mulv = to_host(m->mulv, (size_t)B * 2 * LATENT_DIM);
        float* z = to_host(m->z, (size_t)B * LATENT_DIM);
        float* h3 = bf16_path ? to_host(m->h3_16, (size_t)B * HIDDEN_DIM) : to_host(m->h3, (size_t)B * HIDDEN_DIM);
        float* logits = to_host(m->logits, (size_t)B * INPUT_DIM);
        float* recon = to_host(m->recon, (size_t)B * INPUT_DIM);
        float* bce = to_host(d_bce, B);
        float* kl = to_host(d_kl, B);
        const Diff d[] = {
            diff(h1, dc->t64[T_H1], (size_t)B * HIDDEN_DIM),
            diff(mulv, dc->t64[T_MU], (size_t)B * LATENT_DIM, 2 * LATENT_DIM, LATENT_DIM),
            diff(mulv + LATENT_DIM, dc->t64[T_LOGVAR], (size_t)B * LATENT_DIM, 2 * LATENT_DIM, LATENT_DIM),
            diff(z, dc->t64[T_Z], (size_t)B * LATENT_DIM),
            diff(h3, dc->t64[T_H3], (size_t)B * HIDDEN_DIM),
            diff(logits, dc->t64[T_LOGITS], (size_t)B * INPUT_DIM),
            diff(recon, dc->t64[T_RECON], (size_t)B * INPUT_DIM),
            diff(bce, dc->t64[T_BCE], B),
            diff(kl, dc->t64[T_KL], B),
        };
        for (int t = T_H1; t < NUM_DEBUG_TENSORS; t++) {
            const size_t n = (size_t)B * DEBUG_WIDTH[t];
            char extra[64];
            snprintf(extra, sizeof(extra), "  [PyTorch fp32 rel %.2e]", diff(dc->t32[t], dc->t64[t], n).rel);
            check_diff(DEBUG_NAMES[t], d[t - T_H1], tol, extra);
        }
        float* all[] = {h1, mulv, z, h3, logits, recon, bce, kl};
        for (float* p : all) free(p);

        if (bf16_path) continue;
        // the fp32 decoder alone (used for samples and interpolations), fed PyTorch's z
        float* z_ref = (float*)malloc((size_t)B * LATENT_DIM * 4);
        for (int i = 0; i < B * LATENT_DIM; i++) z_ref[i] = (float)dc->t64[T_Z][i];
        cudaCheck(cudaMemcpy(d_eps, z_ref, (size_t)B * LATENT_DIM * 4, cudaMemcpyHostToDevice));
        poison_activations(m);
        vae_decode(m, d_eps, B);
        recon = to_host(m->recon, (size_t)B * INPUT_DIM);
        check_diff("decode", diff(recon, dc->t64[T_RECON], (size_t)B * INPUT_DIM), TOL_FP32, "  (vae_decode of PyTorch's z)");
        free(recon);
        free(z_ref);
    }
    cudaCheck(cudaFree(d_eps));
    cudaCheck(cudaFree(d_bce));
    cudaCheck(cudaFree(d_kl));
}

// Per-image BCE and KL of images 0..count-1 evaluated in batches of `batch` with generated eps.
static void gpu_losses(VAE* m, const uint8_t* d_pixels, int count, int batch, uint64_t seed, bool z_is_mu, float* bce,
                       float* kl) {
    float *d_bce, *d_kl;
    cudaCheck(cudaMalloc(&d_bce, (size_t)count * 4));
    cudaCheck(cudaMalloc(&d_kl, (size_t)count * 4));
    poison(d_bce, (size_t)count * 4), poison(d_kl, (size_t)count * 4);
    const ForwardOptions opt = {seed, z_is_mu, NULL, false, false};
    for (int first = 0; first < count; first += batch) {
        const int B = count - first < batch ? count - first : batch;
        vae_forward(m, d_pixels + (size_t)first * INPUT_DIM, B, first, &opt, d_bce + first, d_kl + first);
    }
    cudaCheck(cudaMemcpy(bce, d_bce, (size_t)count * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(kl, d_kl, (size_t)count * 4, cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(d_bce));
    cudaCheck(cudaFree(d_kl));
}

static void test_gpu_invariance(VAE* m, const uint8_t* d_pixels) {
    printf("GPU %s determinism and batch invariance (sampled eps, bitwise)\n", PRECISION_NAMES[m->precision]);
    const int count = 4097;
    float *bce[4], *kl[4];
    const int batches[] = {4097, 1, 37, 4097};
    const uint64_t seeds[] = {7, 7, 7, 8};
    for (int r = 0; r < 4; r++) {
        bce[r] = (float*)malloc(count * 4), kl[r] = (float*)malloc(count * 4);
        gpu_losses(m, d_pixels, count, batches[r], seeds[r], false, bce[r], kl[r]);
    }
    bool finite = true;
    for (int i = 0; i < count; i++) finite = finite && isfinite(bce[0][i]) && isfinite(kl[0][i]);
    check(finite, "every per-image loss of %d images is written and finite", count);
    for (int r = 1; r < 3; r++)
        check(!memcmp(bce[0], bce[r], count * 4) && !memcmp(kl[0], kl[r], count * 4),
              "batch %d gives the same %d per-image BCE and KL bits as batch 4097", batches[r], count);
    float* again_bce = (float*)malloc(count * 4);
    float* again_kl = (float*)malloc(count * 4);
    gpu_losses(m, d_pixels, count, 4097, 7, false, again_bce, again_kl);
    check(!memcmp(bce[0], again_bce, count * 4) && !memcmp(kl[0], again_kl, count * 4),
          "the same seed twice gives bitwise-identical losses");
    check(memcmp(bce[0], bce[3], count * 4) != 0 && !memcmp(kl[0], kl[3], count * 4),
          "another seed changes BCE (the noise) but not KL (which depends on mu, logvar only)");
    for (int r = 0; r < 4; r++) free(bce[r]), free(kl[r]);
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
    const ForwardOptions opt = {seed, false, NULL, false, true};
    vae_forward(m, d_pixels + (size_t)first * INPUT_DIM, B, first, &opt, d_bce, d_kl);
    float* mulv = to_host(m->mulv, (size_t)B * 2 * LATENT_DIM);
    float* z = to_host(m->z, (size_t)B * LATENT_DIM);
    double worst = 0.0;
    for (int b = 0; b < B; b++)
        for (int j = 0; j < LATENT_DIM; j++) {
            const double mu = mulv[b * 2 * LATENT_DIM + j], sigma = exp(0.5 * mulv[b * 2 * LATENT_DIM + LATENT_DIM + j]);
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

static double fp32_mean_bce_zmu = NAN; // set by the fp32 run, compared against by bf16

static void test_gpu_test_set(VAE* m, const uint8_t* d_pixels, int count) {
    printf("GPU %s full test set (%d images) vs the PyTorch float64 means\n", PRECISION_NAMES[m->precision], count);
    float* bce = (float*)malloc((size_t)count * 4);
    float* kl = (float*)malloc((size_t)count * 4);
    for (int sampled = 0; sampled < 2; sampled++) {
        gpu_losses(m, d_pixels, count, 4096, 0, !sampled, bce, kl);
        double sb = 0.0, sk = 0.0;
        for (int i = 0; i < count; i++) sb += bce[i], sk += kl[i];
        sb /= count, sk /= count;
        if (m->precision == PRECISION_BF16) {
            if (!sampled)
                check(fabs(sb - fp32_mean_bce_zmu) <= 0.05, "z = mu: mean BCE %.4f, fp32 %.4f: within 0.05 (KL %.4f)", sb,
                      fp32_mean_bce_zmu, sk);
            else
                check(fabs(sb - 77.41) <= 0.2, "sampled: mean BCE %.4f (PyTorch float64 77.41 +- 0.2)", sb);
        } else if (!sampled) {
            fp32_mean_bce_zmu = sb;
            // fp32 sums of ~70 per image, averaged in double: far inside 1e-3
            check(fabs(sb - 69.1652) <= 1e-3, "z = mu: mean BCE %.4f (PyTorch float64 69.1652 +- 0.001)", sb);
            check(fabs(sk - 25.7547) <= 1e-3, "z = mu: mean KL %.4f (PyTorch float64 25.7547 +- 0.001)", sk);
        } else {
            // Monte-Carlo over 10k images: the standard error of the mean BCE is ~0.05
            check(fabs(sb - 77.41) <= 0.2, "sampled: mean BCE %.4f (PyTorch float64 77.41 +- 0.2)", sb);
            check(fabs(sb + sk - 103.17) <= 0.2, "sampled: mean loss %.4f (PyTorch float64 103.17 +- 0.2)", sb + sk);
        }
    }
    free(bce);
    free(kl);
}

// ----------------------------------------------------------------------------

int main() {
    const char* weights_path = "data/vae_weights.bin";
    const char* images_path = "data/t10k-images-idx3-ubyte";
    const char* labels_path = "data/t10k-labels-idx1-ubyte";
    const char* debug_path = "data/vae_debug_state.bin";
    Error err;
    HostWeights weights = {};
    Images images = {};
    Labels labels = {};
    DebugState ds = {};
    uint8_t* debug_buf;
    size_t debug_size;
    printf("loading inputs\n");
    bool loaded = check(load_weights(weights_path, &weights, &err), "load %s", weights_path) &&
                  check(load_images(images_path, &images, &err), "load %s", images_path) &&
                  check(load_labels(labels_path, &labels, &err), "load %s", labels_path) &&
                  check(read_file(debug_path, &debug_buf, &debug_size, &err) &&
                            parse_debug_state(debug_buf, debug_size, debug_path, &ds, &err),
                        "load %s", debug_path);
    if (!loaded) {
        printf("  %s\n", err.msg);
    } else {
        bool in_range = true;
        for (int c = 0; c < ds.num_cases; c++) in_range = in_range && ds.cases[c].first_image + ds.cases[c].B <= images.count;
        if (check(in_range, "reference cases lie inside the test set")) test_cpu_forward(&weights, &images, &ds);
        test_corrupt_files(weights_path, images_path, labels_path);
    }
    test_generator();
    test_cli();
    test_ppm();

    int devices = 0;
    const cudaError_t status = cudaGetDeviceCount(&devices);
    const char* gpu_checks[] = {"GPU fp32 activations vs PyTorch", "GPU fp32 batch invariance and determinism",
                                "GPU fp32 generator keying",       "GPU fp32 full test set losses",
                                "GPU bf16 activations vs PyTorch", "GPU bf16 batch invariance and determinism",
                                "GPU bf16 generator keying",       "GPU bf16 full test set losses"};
    if (status != cudaSuccess || devices == 0 || !loaded) {
        const char* why = !loaded ? "inputs did not load" : "no CUDA device";
        for (const char* what : gpu_checks) skip(what, why);
    } else {
        cudaDeviceProp prop;
        cudaCheck(cudaGetDeviceProperties(&prop, 0));
        printf("GPU: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
        uint8_t* d_pixels;
        cudaCheck(cudaMalloc(&d_pixels, (size_t)images.count * INPUT_DIM));
        cudaCheck(cudaMemcpy(d_pixels, images.pixels, (size_t)images.count * INPUT_DIM, cudaMemcpyHostToDevice));
        for (Precision precision : {PRECISION_FP32, PRECISION_BF16}) {
            VAE m;
            vae_init(&m, &weights, 4097, precision);
            test_gpu_activations(&m, d_pixels, &ds);
            test_gpu_invariance(&m, d_pixels);
            test_gpu_generator_keying(&m, d_pixels);
            test_gpu_test_set(&m, d_pixels, images.count);
            vae_free(&m);
        }
        cudaCheck(cudaFree(d_pixels));
    }
    printf("%d passed, %d failed, %d skipped\n", n_passed, n_failed, n_skipped);
    return n_failed > 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}
