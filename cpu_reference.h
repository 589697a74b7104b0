// cpu_reference.h: the VAE in float64 on the CPU, the one reference test_vae.cu and the dev/ drivers check the GPU
// against. Plain loops that state the model and nothing else:
//   x (pixels / 255) -> fc1 -> ReLU -> h1 -> fc21 -> mu, fc22 -> logvar -> z = mu + eps exp(logvar / 2)
//     -> fc3 -> ReLU -> h3 -> fc4 -> logits,
// each image's BCE with logits and KL, and grad_z of the BCE (what AIS's leapfrog steps take).
//
// Float64 throughout, so the reference's own rounding (~1e-16 relative) is far below anything the GPU's fp32 or bf16
// can show; test_vae checks it against PyTorch's float64 dumps at 1e-10. Every sum runs in one fixed order (a
// layer's bias first, then its inputs in index order), so every caller gets the same values.
//
// Include it after vae.cu (test_vae.cu and dev/common.h do): the weights come as vae.cu's HostWeights, whose
// tensor[FC1_W] ... tensor[FC4_B] are float arrays in PyTorch's layout (weight[out][in] row-major, bias[out]). The
// model's sizes come at run time (vae.cu's ModelDims), so models other than 784-400-20-400 run through the same
// code. Host C++ only: nothing here needs CUDA.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <algorithm>
#include <vector>

// One Linear layer over `rows` inputs: y[r] = x[r] W^T + b, then max(y, 0) when relu. x: [rows][in], y:
// [rows][out] (not x); W: [out][in] as PyTorch's nn.Linear holds it; b: [out], or NULL for no bias.
// W is copied transposed into float64 once, so that the inner loop runs along a row of outputs: independent sums
// over contiguous memory, which the compiler vectorises without reordering any one of them. A zero input adds
// nothing and is skipped (most MNIST pixels are 0, and so are many of a ReLU's outputs); the weights are finite
// (vae.cu's reader refuses others), so skipping it changes at most the sign of a zero.
inline void cpu_linear(double* y, const double* x, const float* W, const float* b, int rows, int out, int in,
                       bool relu) {
    std::vector<double> wt((size_t)in * out);
    for (int o = 0; o < out; o++)
        for (int k = 0; k < in; k++) wt[(size_t)k * out + o] = W[(size_t)o * in + k];
    for (int r = 0; r < rows; r++) {
        double* acc = y + (size_t)r * out;
        for (int o = 0; o < out; o++) acc[o] = b ? b[o] : 0.0;
        for (int k = 0; k < in; k++) {
            const double xk = x[(size_t)r * in + k];
            if (xk == 0.0) continue;
            const double* w = &wt[(size_t)k * out];
            for (int o = 0; o < out; o++) acc[o] += xk * w[o];
        }
        if (relu)
            for (int o = 0; o < out; o++) acc[o] = acc[o] < 0.0 ? 0.0 : acc[o];
    }
}

// One pixel's BCE with logits, x in [0, 1]: -(x log s + (1 - x) log(1 - s)) with s = sigmoid(logit), in the form
// that neither overflows for large |logit| nor loses log(1 + tiny): max(l, 0) - x l + log(1 + e^-|l|) (PyTorch's).
inline double cpu_bce_term(double logit, double x) {
    return fmax(logit, 0.0) - x * logit + log1p(exp(-fabs(logit)));
}

// One image's BCE: the sum of its n pixels' terms, in pixel order.
inline double cpu_bce(const double* logits, const double* x, int n) {
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += cpu_bce_term(logits[i], x[i]);
    return sum;
}

// One latent's KL(N(mu, e^logvar) || N(0, 1)).
inline double cpu_kl_term(double mu, double logvar) { return -0.5 * (1.0 + logvar - mu * mu - exp(logvar)); }

// One image's KL(q(z|x) || N(0, I)) over its n latents, in latent order.
inline double cpu_kl(const double* mu, const double* logvar, int n) {
    double sum = 0.0;
    for (int j = 0; j < n; j++) sum += cpu_kl_term(mu[j], logvar[j]);
    return sum;
}

// The encoder of `rows` images: h1 = relu(fc1(x)), mu = fc21(h1), logvar = fc22(h1). x: [rows][INPUT_DIM] in [0, 1];
// h1: [rows][d.h1], or NULL when the caller does not want it; mu, logvar: [rows][d.z].
inline void cpu_encode(const HostWeights* w, ModelDims d, const double* x, int rows, double* h1, double* mu,
                       double* logvar) {
    std::vector<double> scratch(h1 ? 0 : (size_t)rows * d.h1);
    if (!h1) h1 = scratch.data();
    cpu_linear(h1, x, w->tensor[FC1_W], w->tensor[FC1_B], rows, d.h1, INPUT_DIM, true);
    cpu_linear(mu, h1, w->tensor[FC21_W], w->tensor[FC21_B], rows, d.z, d.h1, false);
    cpu_linear(logvar, h1, w->tensor[FC22_W], w->tensor[FC22_B], rows, d.z, d.h1, false);
}

// The decoder of `rows` latents: h3 = relu(fc3(z)), logits = fc4(h3) (the sigmoid lives in the loss). z:
// [rows][d.z]; h3: [rows][d.h3], or NULL when the caller does not want it; logits: [rows][INPUT_DIM].
inline void cpu_decode(const HostWeights* w, ModelDims d, const double* z, int rows, double* h3, double* logits) {
    std::vector<double> scratch(h3 ? 0 : (size_t)rows * d.h3);
    if (!h3) h3 = scratch.data();
    cpu_linear(h3, z, w->tensor[FC3_W], w->tensor[FC3_B], rows, d.h3, d.z, true);
    cpu_linear(logits, h3, w->tensor[FC4_W], w->tensor[FC4_B], rows, INPUT_DIM, d.h3, false);
}

// Every activation of a forward pass, row-major per image: h1 [rows][h1], mu, logvar, z [rows][z], h3 [rows][h3],
// logits and recon = sigmoid(logits) [rows][input], and each image's bce and kl [rows].
struct CpuActs {
    std::vector<double> h1, mu, logvar, z, h3, logits, recon, bce, kl;
};

// The whole forward pass of `rows` images x ([rows][INPUT_DIM], in [0, 1]). eps: [rows][d.z] standard normal draws
// (float, as the reference dumps and vae.cu's generator give them), or NULL for z = mu.
inline CpuActs cpu_forward(const HostWeights* w, ModelDims d, const double* x, const float* eps, int rows) {
    const size_t n = (size_t)rows;
    CpuActs a;
    a.h1.resize(n * d.h1), a.mu.resize(n * d.z), a.logvar.resize(n * d.z), a.z.resize(n * d.z);
    a.h3.resize(n * d.h3), a.logits.resize(n * INPUT_DIM), a.recon.resize(n * INPUT_DIM), a.bce.resize(n);
    a.kl.resize(n);
    cpu_encode(w, d, x, rows, a.h1.data(), a.mu.data(), a.logvar.data());
    for (size_t i = 0; i < n * d.z; i++) a.z[i] = eps ? a.mu[i] + eps[i] * exp(0.5 * a.logvar[i]) : a.mu[i];
    cpu_decode(w, d, a.z.data(), rows, a.h3.data(), a.logits.data());
    for (size_t i = 0; i < n * INPUT_DIM; i++) a.recon[i] = 1.0 / (1.0 + exp(-a.logits[i]));
    for (size_t r = 0; r < n; r++) {
        a.bce[r] = cpu_bce(&a.logits[r * INPUT_DIM], &x[r * INPUT_DIM], INPUT_DIM);
        a.kl[r] = cpu_kl(&a.mu[r * d.z], &a.logvar[r * d.z], d.z);
    }
    return a;
}

// How a low-precision GPU path holds the gradient's operands, for a reference that takes the same roundings (dev/
// ais_common.h describes bf16's ais_kernel this way). Each rounding maps a float64 value to the nearest value the
// kernel can hold. The kernel's cluster splits the logits' columns among `blocks` blocks of `block_cols` (the last
// takes the rest); each block rounds its own share of dh3 before the shares' products with fc3 are added.
struct CpuGradRounding {
    const float* fc4_w;          // fc4's weights as the kernel holds them: the forward and the backward product
    const float* fc3_w_backward; // fc3's weights in the backward product dh3 -> grad (its forward stays exact)
    double (*h3)(double);        // h3 after the ReLU
    double (*delta)(double);     // sigmoid(logit) - x, the BCE's derivative w.r.t. the logit
    double (*dh3)(double);       // a block's share of dh3
    int blocks, block_cols;
};

// One image's BCE(x, logits(z)) and its gradient w.r.t. z, grad [d.z], in float64: the decoder's forward pass,
// then back through it. dBCE/dlogit = sigmoid(logit) - x, so dh3 = fc4^T (sigmoid(logits) - x), and
// grad = fc3^T (dh3 where fc3's output was > 0, the ReLU's gate). fc4's row i serves both directions, so one pass
// over it forms logit i and adds its share of dh3. pixels: [INPUT_DIM] bytes, x = pixel / 255. rounding: NULL for the
// plain float64 gradient.
inline double cpu_bce_grad(const HostWeights* w, ModelDims d, const uint8_t* pixels, const double* z, double* grad,
                           const CpuGradRounding* rounding = NULL) {
    const CpuGradRounding* r = rounding;
    const int blocks = r ? r->blocks : 1;
    const float* fc4_w = r ? r->fc4_w : w->tensor[FC4_W];
    const float* fc3_w_backward = r ? r->fc3_w_backward : w->tensor[FC3_W];
    std::vector<double> pre(d.h3), h(d.h3), dh((size_t)blocks * d.h3, 0.0);
    cpu_linear(pre.data(), z, w->tensor[FC3_W], w->tensor[FC3_B], 1, d.h3, d.z, false);
    for (int k = 0; k < d.h3; k++) h[k] = r ? r->h3(fmax(pre[k], 0.0)) : fmax(pre[k], 0.0);
    double bce = 0.0;
    for (int i = 0; i < INPUT_DIM; i++) {
        const float* row = fc4_w + (size_t)i * d.h3;
        double logit = w->tensor[FC4_B][i];
        for (int k = 0; k < d.h3; k++) logit += (double)row[k] * h[k];
        const double x = pixels[i] / 255.0, sigmoid_minus_x = 1.0 / (1.0 + exp(-logit)) - x;
        const double delta = r ? r->delta(sigmoid_minus_x) : sigmoid_minus_x;
        bce += cpu_bce_term(logit, x);
        double* share = &dh[(size_t)(r ? std::min(i / r->block_cols, blocks - 1) : 0) * d.h3];
        for (int k = 0; k < d.h3; k++) share[k] += delta * row[k];
    }
    for (int j = 0; j < d.z; j++) grad[j] = 0.0;
    for (int block = 0; block < blocks; block++)
        for (int k = 0; k < d.h3; k++)
            if (pre[k] > 0.0) {
                const double dh_k = r ? r->dh3(dh[(size_t)block * d.h3 + k]) : dh[(size_t)block * d.h3 + k];
                for (int j = 0; j < d.z; j++) grad[j] += dh_k * fc3_w_backward[(size_t)k * d.z + j];
            }
    return bce;
}
