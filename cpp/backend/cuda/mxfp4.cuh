// MXFP4 weight rows on the device (layout and values: backend/cpu/quants-mxfp4.h): load8<kMXFP4>, included by
// quants.cuh after the primary template.
#pragma once

namespace kvcmas::cuda {

enum : int { kMXFP4 = 39 };

static __device__ __constant__ const int8_t kMxfp4Table[16] = {
    0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
};

template <>
__device__ __forceinline__ void load8<kMXFP4>(const uint8_t * row, int64_t k0, float * o) {
    const uint8_t * b  = row + (k0 / 32) * 17;
    const float     d  = ldexpf(1.0f, static_cast<int>(b[0]) - 128);
    const int       j  = static_cast<int>(k0 % 32);
    const uint8_t * qs = b + 1 + (j & 15);
    const int       sh = j < 16 ? 0 : 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        o[i] = d * static_cast<float>(kMxfp4Table[(qs[i] >> sh) & 0x0F]);
    }
}

}  // namespace kvcmas::cuda
