// fp32 -> bf16 conversion v1: one thread per element.
//
// How vae.cu converts its weights at load. Each warp reads 128 contiguous
// bytes and writes 64: coalesced, but every thread moves only 6 bytes, so a
// 64M-element tensor takes 64M threads and 64M 2-byte stores.
//
// Build and run:  make -C dev convert_v1 && ./dev/convert_v1
#include "common.h"

using namespace vae;

__global__ void convert_scalar_kernel(bf16* dst, const float* src, size_t n) {
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2bfloat16(src[i]);
}

void convert_v1(const ConvertArgs& a) {
    convert_scalar_kernel<<<unsigned((a.n + 255) / 256), 256>>>(a.dst, a.src, a.n);
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_convert_driver({{"convert_v1_scalar", convert_v1}}) ? 0 : 1;
}
