// Loss v2: one warp per image, vectorised loads, shuffle reduction.
//
// vs v1: the 784 terms of an image are summed in registers and one 5-step
// shuffle, and lane 0 writes BCE + KL: no memset, no atomics, a fixed order
// (bitwise reproducible). Each lane loads 4 logits (16 bytes) and 4 pixels
// (4 bytes) at a time: 196 groups per image, ~6 per lane. Rows are 3136 and
// 784 bytes, so every row of both arrays starts 16-byte aligned.
// The kernel lives in common.h (vae::loss_warp_kernel) because loss_v3
// measures the fused GEMM epilogue against it.
//
// Build and run:  make -C dev loss_v2 && ./dev/loss_v2
#include "common.h"

using namespace vae;

void loss_v2(const LossArgs& a) { loss_warp(a.loss, a.logits, a.pixels, a.kl, a.B); }

int main() {
    print_device_info();
    return run_loss_driver({{"loss_v2_warp", loss_v2}}) ? 0 : 1;
}
