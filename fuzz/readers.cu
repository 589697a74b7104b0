// The file readers of vae.cu and test_vae.cu, and the gzip layer under the idx reader, built for libFuzzer (see
// fuzz/README.md).
// vae.cu and test_vae.cu are included unchanged; only test_vae's main() is left out.
#define TEST_VAE_NO_MAIN
#include "../test_vae.cu"

// What each reader produced is read back in full, so that AddressSanitizer sees any pointer
// that leads outside what was allocated, and the promises a successful parse makes are checked:
// a broken promise is a crash, which libFuzzer reports and saves.
static volatile double sink;
#define PROMISE(cond) \
    if (!(cond)) __builtin_trap()

// The reader's index (R_WEIGHTS ...) from its name in the Makefile's FUZZ_READERS; idx_gz (gunzip_idx, then the idx
// images reader) comes after test_vae's readers.
enum { R_IDX_GZ = NUM_READERS };
int fuzz_reader_index(const char* name) {
    static const char* names[NUM_READERS + 1] = {"weights",    "idx_images", "idx_labels", "debug_state",
                                                 "iwae_state", "pgm",        "idx_gz"};
    for (int r = 0; r <= NUM_READERS; r++)
        if (!strcmp(name, names[r])) return r;
    fprintf(stderr, "fuzz: no reader named '%s'\n", name);
    exit(EXIT_FAILURE);
}

int fuzz_one(int reader, const uint8_t* data, size_t size) {
    Error err;
    double sum = 0.0;
    if (reader == R_WEIGHTS) {
        HostWeights w = {};
        if (parse_weights(data, size, "fuzz", &w, &err)) {
            PROMISE(size == HEADER_INTS * 4 + w.count * sizeof(float));
            PROMISE(w.dims.h1 >= 1 && w.dims.h1 <= MAX_HIDDEN && w.dims.z >= 1 && w.dims.z <= MAX_LATENT &&
                    w.dims.h3 >= 1 && w.dims.h3 <= MAX_HIDDEN);
            for (int t = 0; t < NUM_TENSORS; t++)
                for (size_t i = 0; i < w.size[t]; i++) {
                    PROMISE(isfinite(w.tensor[t][i]));
                    sum += w.tensor[t][i];
                }
            free(w.data);
        } else {
            PROMISE(err.msg[0] != '\0' && w.data == NULL);
        }
    } else if (reader == R_IDX_GZ) {
        uint8_t* idx = NULL;
        size_t idx_size = 0;
        Images im = {};
        if (gunzip_idx("fuzz.gz", data, size, &idx, &idx_size, &err)) {
            // at most the idx header's promise and one byte: a bomb never gets further
            PROMISE(idx_size <= MAX_FILE_BYTES + 1);
            if (parse_idx_images(idx, idx_size, "fuzz", &im, &err)) {
                PROMISE(im.count > 0 && idx_size == 16 + (size_t)im.count * INPUT_DIM);
                for (size_t i = 0; i < (size_t)im.count * INPUT_DIM; i++) sum += im.pixels[i];
                free(im.pixels);
            }
            free(idx);
        } else {
            PROMISE(err.msg[0] != '\0' && idx == NULL);
        }
    } else if (reader == R_IMAGES) {
        Images im = {};
        if (parse_idx_images(data, size, "fuzz", &im, &err)) {
            PROMISE(im.count > 0 && size == 16 + (size_t)im.count * INPUT_DIM);
            for (size_t i = 0; i < (size_t)im.count * INPUT_DIM; i++) sum += im.pixels[i];
            free(im.pixels);
        } else {
            PROMISE(err.msg[0] != '\0' && im.pixels == NULL);
        }
    } else if (reader == R_LABELS) {
        Labels lb = {};
        if (parse_idx_labels(data, size, "fuzz", &lb, &err)) {
            PROMISE(lb.count > 0 && size == 8 + (size_t)lb.count);
            for (int i = 0; i < lb.count; i++) PROMISE(lb.labels[i] <= 9);
            free(lb.labels);
        } else {
            PROMISE(err.msg[0] != '\0' && lb.labels == NULL);
        }
    } else if (reader == R_PGM) {
        Images im = {};
        if (parse_pgm(data, size, "fuzz", &im, &err)) {
            PROMISE(im.count == 1 && size >= 8 && data[0] == 'P' && (data[1] == '5' || data[1] == '2'));
            for (int i = 0; i < INPUT_DIM; i++) sum += im.pixels[i];
            free(im.pixels);
        } else {
            PROMISE(err.msg[0] != '\0' && im.pixels == NULL);
        }
    } else if (reader == R_IWAE) {
        // parse_iwae_state keeps pointers into its buffer: give it an exactly sized copy
        uint8_t* buf = (uint8_t*)malloc(size > 0 ? size : 1);
        if (buf == NULL) return 0;
        memcpy(buf, data, size);
        IwaeState is = {};
        const int num_images = 10000; // the MNIST test set
        if (parse_iwae_state(buf, size, "fuzz", num_images, PUBLISHED_DIMS, &is, &err)) {
            PROMISE(is.N >= 1 && is.K >= 1 && is.first_image >= 0 && is.first_image + is.N <= num_images);
            PROMISE((uintptr_t)is.log_px64 % 8 == 0);
            for (size_t i = 0; i < (size_t)is.N * is.K * PUBLISHED_DIMS.z; i++) sum += is.eps[i];
            for (int i = 0; i < is.N; i++) sum += is.log_px64[i] + is.log_px32[i];
        } else {
            PROMISE(err.msg[0] != '\0');
        }
        free(buf);
    } else {
        // parse_debug_state keeps pointers into its buffer: give it an exactly sized copy
        uint8_t* buf = (uint8_t*)malloc(size > 0 ? size : 1);
        if (buf == NULL) return 0;
        memcpy(buf, data, size);
        DebugState ds = {};
        const int num_images = 10000; // the MNIST test set
        if (parse_debug_state(buf, size, "fuzz", num_images, PUBLISHED_DIMS, &ds, &err)) {
            for (int c = 0; c < ds.num_cases; c++) {
                const DebugCase* dc = &ds.cases[c];
                PROMISE(dc->B >= 1 && dc->B <= MAX_CASE_BATCH && dc->first_image >= 0 &&
                        dc->first_image + dc->B <= num_images);
                for (int t = 0; t < NUM_DEBUG_TENSORS; t++)
                    for (size_t i = 0; i < (size_t)dc->B * debug_width(ds.dims, t); i++)
                        sum += dc->t64[t][i] + dc->t32[t][i];
            }
        } else {
            PROMISE(err.msg[0] != '\0' && ds.storage64 == NULL);
        }
        free(ds.storage64);
        free(buf);
    }
    sink = sum;
    return 0;
}
