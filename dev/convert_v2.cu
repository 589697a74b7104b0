// fp32 -> bf16 conversion v2: 16-byte loads, 8- and 16-byte stores.
//
// vec4: each thread loads one float4 (16 bytes) and stores 4 bf16 (8 bytes).
// vec8: each thread loads two float4 and stores one 16-byte uint4 of 8 bf16,
//       so both the loads and the stores are full 16-byte transactions and
//       there are 8x fewer threads than elements.
// The vector path needs 16-byte aligned src and (8 or 16)-byte aligned dst;
// the ragged tail (n not a multiple of 4 or 8) is converted element by element
// by the first threads of the same launch. Misaligned pointers (a tensor at
// an odd offset inside a bigger allocation) fall back to the scalar kernel.
//
// Build and run:  make -C dev convert_v2 && ./dev/convert_v2
#include "common.h"

using namespace vae;

__global__ void convert_scalar_kernel(bf16* dst, const float* src, size_t n) {
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2bfloat16(src[i]);
}

// VEC = 4 or 8 elements per thread; the tail [n / VEC * VEC, n) is done by
// threads 0 .. VEC-2 of the grid.
template <int VEC>
__global__ void convert_vec_kernel(bf16* dst, const float* src, size_t n) {
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    const size_t groups = n / VEC;
    if (i < groups) {
        const float4* s = reinterpret_cast<const float4*>(src) + i * (VEC / 4);
        const float4 a = s[0];
        const __nv_bfloat162 p0 = __floats2bfloat162_rn(a.x, a.y), p1 = __floats2bfloat162_rn(a.z, a.w);
        if constexpr (VEC == 4) {
            uint2 out;
            out.x = *reinterpret_cast<const unsigned*>(&p0);
            out.y = *reinterpret_cast<const unsigned*>(&p1);
            reinterpret_cast<uint2*>(dst)[i] = out;
        } else {
            const float4 b = s[1];
            const __nv_bfloat162 p2 = __floats2bfloat162_rn(b.x, b.y), p3 = __floats2bfloat162_rn(b.z, b.w);
            uint4 out;
            out.x = *reinterpret_cast<const unsigned*>(&p0);
            out.y = *reinterpret_cast<const unsigned*>(&p1);
            out.z = *reinterpret_cast<const unsigned*>(&p2);
            out.w = *reinterpret_cast<const unsigned*>(&p3);
            reinterpret_cast<uint4*>(dst)[i] = out;
        }
    }
    const size_t tail = groups * VEC + i;
    if (i < VEC - 1 && tail < n) dst[tail] = __float2bfloat16(src[tail]);
}

template <int VEC>
void convert_v2(const ConvertArgs& a) {
    const size_t dst_align = VEC * sizeof(bf16);
    if (!is_aligned(a.src, 16) || !is_aligned(a.dst, dst_align)) {
        convert_scalar_kernel<<<unsigned((a.n + 255) / 256), 256>>>(a.dst, a.src, a.n);
    } else {
        // at least VEC - 1 threads, for the tail of a tensor shorter than VEC
        const size_t threads = std::max<size_t>(a.n / VEC, VEC - 1);
        convert_vec_kernel<VEC><<<unsigned((threads + 255) / 256), 256>>>(a.dst, a.src, a.n);
    }
    cudaCheck(cudaGetLastError());
}

int main() {
    print_device_info();
    return run_convert_driver({{"convert_v2_vec4", convert_v2<4>}, {"convert_v2_vec8", convert_v2<8>}}) ? 0 : 1;
}
