// Gemm pick v2: is another of cuBLASLt's algorithms clearly faster than vae.cu's pick for the fp32 products?
//
// The plain path's fp32 AIS (--ais 1000 --precision fp32 --kernels plain) is ~85% two SIMT fp32 products through fc4
// at up to 80,000 rows: fc4_t (fp32 logits) and fc4's backward. gemm_pick_v1 timed the heuristic's first eight
// choices at three row counts. This driver takes its whole list (up to 128) for 4,096 rows and for the timed rows,
// without split-K or workspace (vae.cu's rule, so that a row's bits do not depend on the batch), times each distinct
// one on fc4, fc4's backward and fc1 at 80,000 rows and on the forward products at 10,000, and checks the fastest for
// the batch invariance vae.cu needs (rows 0-36 of a 37-row run bitwise those of the full run). It also prints which
// tile the heuristic puts first for each row count it could be picked for, which is how vae.cu chooses: by the rows
// it asks the heuristic about, not by a tile id that another GPU or cuBLAS version may not have.
//
// Result (H100): dev/README.md, "The plain path's algorithms".
//
// Build and run:  make -C dev gemm_pick_v2 && ./dev/gemm_pick_v2
#include "common.h"

enum { MAX_ROWS = 80000, FEW_ROWS = 37, MAX_IDS = 128, SHOWN = 10 };

// n values of magnitude up to 0.5 from the harness's generator, on the GPU.
static float* random_floats(size_t n, uint64_t seed) {
    std::vector<float> host(n);
    fill_random(host, seed, 0.5f);
    float* p = (float*)device_alloc(n * sizeof(float), "a test buffer");
    cudaCheck(cudaMemcpy(p, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    return p;
}
struct Candidate { uint32_t id, tile, stages, swizzle, custom; cublasLtMatmulAlgo_t algo; float us; };
// Every config attribute used here is 4 bytes (the id and split-K an int32_t, the rest uint32_t).
static uint32_t config_get(const cublasLtMatmulAlgo_t& a, cublasLtMatmulAlgoConfigAttributes_t attr) {
    uint32_t v = 0;
    cublasCheck(cublasLtMatmulAlgoConfigGetAttribute(&a, attr, &v, sizeof(v), NULL));
    return v;
}
// What a configuration is, as cuBLASLt reads it back.
static Candidate describe(const cublasLtMatmulAlgo_t& a) {
    return {config_get(a, CUBLASLT_ALGO_CONFIG_ID), config_get(a, CUBLASLT_ALGO_CONFIG_TILE_ID),
            config_get(a, CUBLASLT_ALGO_CONFIG_STAGES_ID), config_get(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
            config_get(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION), a, 0.0f};
}
// Whether cuBLASLt accepts g.algo for `rows` rows without workspace; with y and x, whether it launches too (outside
// gemm(), whose cublasCheck would end the run: AlgoCheck's yes does not promise a launch).
static bool algo_ok(cublasLtHandle_t lt, const Gemm& g, int rows, void* y = NULL, const void* x = NULL) {
    cublasLtMatrixLayout_t xl = gemm_layout(CUDA_R_32F, g.k, rows, g.k), yl = gemm_layout(CUDA_R_32F, g.m, rows, g.m);
    cublasLtMatmulHeuristicResult_t r = {};
    const float beta = 0.0f;
    bool ok = cublasLtMatmulAlgoCheck(lt, g.desc, g.w_layout, xl, yl, yl, &g.algo, &r) == CUBLAS_STATUS_SUCCESS &&
              r.workspaceSize == 0;
    if (ok && y) ok = cublasLtMatmul(lt, g.desc, &g.alpha, g.w, g.w_layout, x, xl, &beta, y, yl, y, yl, &g.algo, NULL,
                                     0, 0) == CUBLAS_STATUS_SUCCESS && cudaGetLastError() == cudaSuccess;
    cublasCheck(cublasLtMatrixLayoutDestroy(xl)), cublasCheck(cublasLtMatrixLayoutDestroy(yl));
    return ok;
}
// Rows 0-36 of a 37-row run against those of a `rows`-row run, bit for bit.
static const char* rows_match(cublasLtHandle_t lt, const Gemm& g, void* y, void* y_few, const void* x, int rows) {
    if (!algo_ok(lt, g, FEW_ROWS, y_few, x)) return "37 rows: rejected";
    gemm(lt, g, y, x, rows, 0);
    std::vector<float> a((size_t)FEW_ROWS * g.m), b(a.size());
    cudaCheck(cudaMemcpy(a.data(), y_few, a.size() * sizeof(float), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(b.data(), y, b.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0 ? "yes" : "NO";
}
struct Product { const char* name; int out, in; bool backward, relu, bias; float alpha; int pick_rows, rows; };

int main() {
    print_device_info();
    cublasLtHandle_t lt;
    cublasCheck(cublasLtCreate(&lt));
    // vae.cu's fp32 picks (plain_init_weights): the forward pass's fc1 and fc4 for 1,024 rows, the long passes' fc4_t
    // (in fp32 the same product as fc4) for 4,096, the backward products for 2,048
    const Product products[] = {{"fc4", INPUT_DIM, HIDDEN_DIM, false, false, true, 1.0f, 4096, MAX_ROWS},
                                {"fc4 back", INPUT_DIM, HIDDEN_DIM, true, false, false, 1.0f, 2048, MAX_ROWS},
                                {"fc1", HIDDEN_DIM, INPUT_DIM, false, true, true, 1.0f / 255.0f, 1024, MAX_ROWS},
                                {"fc4", INPUT_DIM, HIDDEN_DIM, false, false, true, 1.0f, 1024, 10000},
                                {"fc1", HIDDEN_DIM, INPUT_DIM, false, true, true, 1.0f / 255.0f, 1024, 10000}};
    float *w = random_floats(INPUT_DIM * HIDDEN_DIM, 1), *bias = random_floats(INPUT_DIM, 2);
    float *x = random_floats((size_t)MAX_ROWS * INPUT_DIM, 3), *y = random_floats((size_t)MAX_ROWS * INPUT_DIM, 4);
    float* y_few = random_floats(FEW_ROWS * INPUT_DIM, 5);
    int ids[MAX_IDS], n_ids = 0;
    const cudaDataType_t f32 = CUDA_R_32F;
    cublasCheck(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, f32, f32, f32, f32, f32, MAX_IDS, ids, &n_ids));
    for (int i = 0; i < n_ids; i++) printf("%s%d", i ? "," : "fp32 algorithm ids: ", ids[i]);
    printf("\n%d fp32 algorithm ids; us: median of 20 (warm L2) after a 3-run screen; '*': vae.cu's pick\n", n_ids);
    for (const Product& p : products) {
        Gemm g = gemm_init(lt, w, p.out, p.in, p.in, p.backward, p.relu, p.bias ? bias : NULL, f32, f32, p.alpha,
                           p.pick_rows);  // the algorithm vae.cu would keep
        float best = INFINITY;  // a configuration slower than 1.5x the best so far costs 4 launches, not 24
        auto time_one = [&](Candidate& c) {
            g.algo = c.algo;
            if (!algo_ok(lt, g, p.rows, y, x)) return false;
            c.us = benchmark_us([&] { gemm(lt, g, y, x, p.rows, 0); }, 3, 0, false);
            if (c.us < 1.5f * best) c.us = benchmark_us([&] { gemm(lt, g, y, x, p.rows, 0); }, 20, 3, false);
            best = std::min(best, c.us);
            return true;
        };
        printf("\n%s: the heuristic's first tile when picked for", p.name);
        for (int r : {1024, 2048, 4096, 8192, 10000, 16384, 32768, 40000, 65536, 80000}) {
            Gemm h = gemm_init(lt, w, p.out, p.in, p.in, p.backward, p.relu, p.bias ? bias : NULL, f32, f32, p.alpha,
                               r);
            printf(" %d rows: %u;", r, config_get(h.algo, CUBLASLT_ALGO_CONFIG_TILE_ID));
            gemm_free(&h);
        }
        printf("\n");
        Candidate pick = describe(g.algo);
        if (!time_one(pick)) fail("the heuristic's pick does not run at %d rows", p.rows);
        std::vector<Candidate> valid; // the heuristic's whole list for a short and a long pass, each config once
        long checked = 0;
        auto same = [](const Candidate& a, const Candidate& b) {
            return a.id == b.id && a.tile == b.tile && a.stages == b.stages && a.swizzle == b.swizzle &&
                   a.custom == b.custom;
        };
        for (int pick_rows : {4096, p.rows}) {
            cublasLtMatrixLayout_t xl = gemm_layout(f32, g.k, pick_rows, g.k);
            cublasLtMatrixLayout_t yl = gemm_layout(f32, g.m, pick_rows, g.m);
            cublasLtMatmulPreference_t pref = gemm_preference();
            std::vector<cublasLtMatmulHeuristicResult_t> results(MAX_IDS);
            int found = 0;
            cublasCheck(cublasLtMatmulAlgoGetHeuristic(lt, g.desc, g.w_layout, xl, yl, yl, pref, MAX_IDS,
                                                       results.data(), &found));
            for (int i = 0; i < found; i++, checked++) {
                const Candidate c = describe(results[i].algo);
                bool seen = false;
                for (const Candidate& v : valid) seen = seen || same(v, c);
                if (!seen && config_get(c.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) <= 1) valid.push_back(c);
            }
            cublasCheck(cublasLtMatmulPreferenceDestroy(pref));
            cublasCheck(cublasLtMatrixLayoutDestroy(xl)), cublasCheck(cublasLtMatrixLayoutDestroy(yl));
        }
        std::vector<Candidate> timed;
        for (Candidate& c : valid)
            if (time_one(c)) timed.push_back(c);
        std::sort(timed.begin(), timed.end(), [](const Candidate& a, const Candidate& b) { return a.us < b.us; });
        const double tflop = 2e-6 * p.rows * p.out * p.in;  // over us: TFLOP/s
        printf("\n%s, %d rows: %ld heuristic results, %zu distinct without split-K, %zu ran; pick %.1f us\n", p.name,
               p.rows, checked, valid.size(), timed.size(), pick.us);
        printf("| rank | algo | tile | stages | swizzle | custom | us | TFLOP/s | rows 0-36 as at 37 rows |\n"
               "|---|---|---|---|---|---|---|---|---|\n");
        auto row = [&](const Candidate& c, size_t rank) {
            g.algo = c.algo;
            printf("| %zu%s | %u | %u | %u | %u | %u | %.1f | %.1f | %s |\n", rank, same(c, pick) ? " *" : "", c.id,
                   c.tile, c.stages, c.swizzle, c.custom, c.us, tflop / c.us, rows_match(lt, g, y, y_few, x, p.rows));
        };
        size_t rank = 1;  // the pick's: 1 + the configurations faster than it
        for (size_t i = 0; i < timed.size(); i++) {
            if (i < SHOWN) row(timed[i], i + 1);
            rank += timed[i].us < pick.us;
        }
        row(pick, rank);
        gemm_free(&g);
    }
    for (float* b : {w, bias, x, y, y_few}) cudaCheck(cudaFree(b));
    cublasCheck(cublasLtDestroy(lt));
    return 0;
}
