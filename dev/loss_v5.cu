// Loss v5: the plain path's per-row BCE with one logarithm a lane.
//
// vae.cu's decoder_output_kernel (a warp a row, four logits a lane and step) takes each logit's
// log(1 + e^-|l|) with expf and log1pf: in --iwae's passes, which score 262,144 rows of 784 logits at a
// time, that is most of the kernel's ~100 instructions a logit. v5 keeps expf but multiplies the factors
// 1 + e^-|l| (each in (1, 2]; at most 28 a lane) and takes one logf a lane: log1pf's polynomial becomes a
// multiply. Its error: the product's rounding, <= 28 ulp (1.7e-6 relative, the same absolute error in the
// log), and a term below fp32's ulp of 1 (e^-|l| < 6e-8, |l| > 16.6) dropped: together < 1e-4 absolute
// in a row's sum of BCE ~ 20..500, inside the fp32 contract of 1e-5 relative to float64.
//
// Checked against float64 (cpu_bce_term over the same logits, bf16-rounded where the kernel reads bf16),
// both variants, on rows 1, 7, 37, 1023, 4097 and a whole pass, a row scored against image r / K for
// K = 1 (the ELBO) and K = 5000 (--iwae); then timed on the ELBO's 10,000 rows and a --iwae pass.
//
// Build and run:  make -C dev loss_v5 && ./dev/loss_v5
#include "common.h"

using namespace vae;

template <typename L>
__global__ void bce_one_log_kernel(float* bce, const L* __restrict__ logits, const uint8_t* __restrict__ pixels,
                                   int rows, int rows_per_image) {
    const int r = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (r >= rows) return;
    const Four<L>* l_row = reinterpret_cast<const Four<L>*>(logits + (size_t)r * INPUT_DIM);
    const Four<uint8_t>* x_row =
        reinterpret_cast<const Four<uint8_t>*>(pixels + (size_t)(r / rows_per_image) * INPUT_DIM);
    float sum = 0.0f, product = 1.0f;
    for (int i = lane; i < INPUT_DIM / 4; i += 32) {
        const Four<L> stored = l_row[i];
        const Four<uint8_t> px = x_row[i];
        for (int k = 0; k < 4; k++) {
            const float l = as_float(stored.v[k]), x = px.v[k] * (1.0f / 255.0f);
            sum += fmaxf(l, 0.0f) - x * l, product *= 1.0f + expf(-fabsf(l));
        }
    }
    sum += logf(product);
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) bce[r] = sum;
}

template <typename L> static void run_v5(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    launch(bce_one_log_kernel<L>, rows, 4, 128, 0, bce, (const L*)logits, pixels, rows, K);
}

template <typename L> static void run_vae(float* bce, const void* logits, const uint8_t* pixels, int rows, int K) {
    launch(decoder_output_kernel<float, L>, rows, 4, 128, 0, bce, (float*)NULL, (float*)NULL, (const L*)logits,
           pixels, rows, K);
}

typedef void (*Run)(float*, const void*, const uint8_t*, int, int);

int main() {
    print_device_info();
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

    struct V { const char* name; Run f32, f16; } variants[] = {{"vae.cu: expf + log1pf a logit", run_vae<float>,
                                                                 run_vae<bf16>},
                                                                {"v5: one logf a lane", run_v5<float>, run_v5<bf16>}};
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
            for (const V& v : variants)
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
                        printf("check %-32s %s K=%-4d rows=%-6d worst relative error %.2e %s\n", v.name,
                               bf ? "bf16" : "fp32", K, rows, worst, good ? "OK" : "FAIL");
                    ok = ok && good;
                }
        }
    }
    if (!ok) return 1;
    print_kernel_header();
    for (const V& v : variants)
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
    return 0;
}
