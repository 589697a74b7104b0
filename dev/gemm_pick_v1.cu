// Gemm pick v1: which cuBLASLt algorithm each of the plain path's products should keep.
//
// The plain path picks one algorithm a product, once, and keeps it for every batch size (vae.cu, part 2: bits
// that do not depend on the batch). gemm_init takes the heuristic's first choice for the rows it is given.
// This driver asks the heuristic for its first eight choices at 1,024, 4,096 and 65,536 rows, for every
// product of both precisions (no workspace, no split-K, as vae.cu asks), and times each at the row counts the
// program runs: a small and a large forward batch, --iwae's decoder passes and an AIS launch. The fastest
// choice over all row counts tells which row count to pick for. Inputs are small random values; the products
// are the plain path's own (gemm_init, gemm).
//
// Result (H200): dev/README.md, "The plain path's algorithms". The DRELU rows time cuBLASLt's ReLU-backward
// epilogue (fc3 keeping its ReLU's bit mask, fc4's backward applying it), which would replace a kernel.
//
// Build and run:  make -C dev gemm_pick_v1 && ./dev/gemm_pick_v1
#include "common.h"

static const int TIME_ROWS[] = {1024, 4096, 10000, 80000};
enum { MAX_ROWS = 80000, MAX_WIDTH = 800, CANDIDATES = 8 };

__global__ void fill_kernel(uint8_t* p, size_t bytes, uint32_t seed, int type_size) {
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i * type_size >= bytes) return;
    const uint32_t bits = philox4x32(make_uint4((uint32_t)i, 0, 0, 0), make_uint2(seed, 0)).x;
    const float v = (bits >> 8) * (1.0f / 16777216.0f) - 0.5f;
    if (type_size == 4) ((float*)p)[i] = v;
    else ((bf16*)p)[i] = __float2bfloat16(v);
}

static void* random_buffer(size_t bytes, uint32_t seed, int type_size) {
    void* p = device_alloc(bytes, "a test buffer");
    fill_kernel<<<(unsigned)((bytes / type_size + 255) / 256), 256>>>((uint8_t*)p, bytes, seed, type_size);
    cudaCheck(cudaGetLastError());
    return p;
}

struct Product {
    const char* name;
    int out, in;
    bool backward, relu, bias;
    bool out_fp32; // the output in fp32 whatever the inputs
    cublasLtEpilogue_t aux; // RELU_AUX (fc3 keeps its ReLU's mask) or DRELU (fc4's backward applies it)
};
enum { MASK_LD = 512 }; // the ReLU mask's bits a row: 400 rounded up to a multiple of 128

int main() {
    print_device_info();
    cublasLtHandle_t lt;
    cublasCheck(cublasLtCreate(&lt));
    const Product products[] = {
        {"fc1", HIDDEN_DIM, INPUT_DIM, false, true, true, false, CUBLASLT_EPILOGUE_DEFAULT},
        {"fc2", MULV_DIM, HIDDEN_DIM, false, false, true, true, CUBLASLT_EPILOGUE_DEFAULT},
        // in = 0: fc3's input width, per precision
        {"fc3", HIDDEN_DIM, 0, false, true, false, false, CUBLASLT_EPILOGUE_DEFAULT},
        {"fc4", INPUT_DIM, HIDDEN_DIM, false, false, true, true, CUBLASLT_EPILOGUE_DEFAULT},
        {"fc4 long", INPUT_DIM, HIDDEN_DIM, false, false, true, false, CUBLASLT_EPILOGUE_DEFAULT},
        {"fc4 back", INPUT_DIM, HIDDEN_DIM, true, false, false, false, CUBLASLT_EPILOGUE_DEFAULT},
        {"fc3 back", HIDDEN_DIM, z_pad(LATENT_DIM), true, false, false, true, CUBLASLT_EPILOGUE_DEFAULT},
        {"fc3 mask", HIDDEN_DIM, 0, false, true, false, false, CUBLASLT_EPILOGUE_RELU_AUX},
        {"fc4 back drelu", INPUT_DIM, HIDDEN_DIM, true, false, false, false, CUBLASLT_EPILOGUE_DRELU},
    };
    void* mask = random_buffer((size_t)MAX_ROWS * MASK_LD / 8, 5, 4);
    for (int p = 0; p < 2; p++) {
        const Precision precision = p == 0 ? PRECISION_FP32 : PRECISION_BF16;
        const int ts = p == 0 ? 4 : 2;
        const cudaDataType_t type = p == 0 ? CUDA_R_32F : CUDA_R_16BF;
        void* w = random_buffer((size_t)MAX_WIDTH * MAX_WIDTH * ts, 1, ts);
        void* bias = random_buffer((size_t)MAX_WIDTH * 4, 2, 4);
        void* x = random_buffer((size_t)MAX_ROWS * MAX_WIDTH * ts, 3, ts);
        void* y = random_buffer((size_t)MAX_ROWS * MAX_WIDTH * 4, 4, 4);
        printf("\n%s: us per product (warm L2, median of 50); '*' marks vae.cu's pick\n", p == 0 ? "fp32" : "bf16");
        printf("| product | picked at | # | tile | stages |");
        for (int r : TIME_ROWS) printf(" %d rows |", r);
        printf(" sum |\n");
        for (const Product& pr : products) {
            const int in = pr.in ? pr.in : z_width(precision, LATENT_DIM);
            const cudaDataType_t out_type = pr.out_fp32 ? CUDA_R_32F : type;
            // the bias in the output's type, as cuBLASLt reads it: fp32 or bf16 (random bytes either way)
            // vae.cu's picks (plain_init_weights): fp32 for 1,024 rows, bf16 for 4,096; the long passes' products
            // (fc4_t, the backward ones) fp32 for 4,096, bf16 for 65,536
            const bool long_only = pr.backward || (!pr.out_fp32 && pr.out == INPUT_DIM);
            const int vae_pick = long_only ? (p == 0 ? 4096 : 65536) : (p == 0 ? 1024 : 4096);
            Gemm g = gemm_init(lt, w, pr.out, in, in, pr.backward, pr.relu, pr.bias ? bias : NULL, type, out_type,
                               1.0f, vae_pick);
            if (pr.aux != CUBLASLT_EPILOGUE_DEFAULT) {
                const int64_t ld = MASK_LD;
                cublasCheck(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &pr.aux,
                                                           sizeof(pr.aux)));
                cublasCheck(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &mask,
                                                           sizeof(mask)));
                cublasCheck(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld,
                                                           sizeof(ld)));
            }
            const cublasLtMatmulAlgo_t picked = g.algo;
            for (int pick : {1024, 4096, 65536}) {
                cublasLtMatrixLayout_t xl = gemm_layout(type, g.k, pick, g.k);
                cublasLtMatrixLayout_t yl = gemm_layout(out_type, g.m, pick, g.m);
                cublasLtMatmulPreference_t pref = gemm_preference();
                cublasLtMatmulHeuristicResult_t results[CANDIDATES];
                int found = 0;
                cublasCheck(cublasLtMatmulAlgoGetHeuristic(lt, g.desc, g.w_layout, xl, yl, yl, pref, CANDIDATES,
                                                           results, &found));
                if (found == 0) printf("| %s | %d | none |\n", pr.name, pick);
                for (int c = 0; c < found; c++) {
                    g.algo = results[c].algo;
                    int32_t tile = 0, stages = 0, splits = 1;
                    cublasCheck(cublasLtMatmulAlgoConfigGetAttribute(&g.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile,
                                                                     sizeof(tile), NULL));
                    cublasCheck(cublasLtMatmulAlgoConfigGetAttribute(&g.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages,
                                                                     sizeof(stages), NULL));
                    cublasCheck(cublasLtMatmulAlgoConfigGetAttribute(&g.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                                     &splits, sizeof(splits), NULL));
                    const bool is_pick = memcmp(&g.algo, &picked, sizeof(picked)) == 0;
                    printf("| %s%s | %d | %d | %d | %d%s |", pr.name, is_pick ? " *" : "", pick, c, tile, stages,
                           splits > 1 ? " split" : "");
                    float sum = 0;
                    for (int r : TIME_ROWS) {
                        const float us = benchmark_us([&] { gemm(lt, g, y, x, r, 0); }, 50, 5, false);
                        sum += us;
                        printf(" %.1f |", us);
                    }
                    printf(" %.1f |\n", sum);
                }
                cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
                cublasCheck(cublasLtMatrixLayoutDestroy(xl));
                cublasCheck(cublasLtMatrixLayoutDestroy(yl));
            }
            g.algo = picked;
            gemm_free(&g);
        }
        for (void* b : {w, bias, x, y}) cudaCheck(cudaFree(b));
    }
    cudaCheck(cudaFree(mask));
    cublasCheck(cublasLtDestroy(lt));
    return 0;
}
