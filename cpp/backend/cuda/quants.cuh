// Device-side reading of GGUF weight rows in their stored formats: load8<T>(row, k0, out) gives the 8 consecutive
// f32 values k0..k0+7 (k0 % 8 == 0) of a row, with the same arithmetic as cpu/quants.cpp's dequantize_row (exact
// for F32/F16/BF16/Q8_0 and the 4/5/6-bit formats: f32 products of the f16 scales and small integers).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

namespace kvcmas::cuda {

__device__ __forceinline__ float h2f(uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
}

__device__ __forceinline__ uint16_t ld16(const uint8_t * p) {  // unaligned-safe 16-bit load
    return static_cast<uint16_t>(p[0] | (p[1] << 8));
}

// GGML type ids (common/ggml-types.h) as template arguments.
enum : int { kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13,
             kQ6_K = 14, kBF16 = 30 };

template <int T> __device__ __forceinline__ void load8(const uint8_t * row, int64_t k0, float * o);

template <> __device__ __forceinline__ void load8<kF32>(const uint8_t * row, int64_t k0, float * o) {
    const float4 a = reinterpret_cast<const float4 *>(row)[k0 / 4];
    const float4 b = reinterpret_cast<const float4 *>(row)[k0 / 4 + 1];
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}

template <> __device__ __forceinline__ void load8<kF16>(const uint8_t * row, int64_t k0, float * o) {
    const uint4      u = reinterpret_cast<const uint4 *>(row)[k0 / 8];  // rows of F16 are 16-byte aligned (n % 32)
    const uint32_t   w[4] = { u.x, u.y, u.z, u.w };
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[2 * i]     = h2f(static_cast<uint16_t>(w[i] & 0xFFFF));
        o[2 * i + 1] = h2f(static_cast<uint16_t>(w[i] >> 16));
    }
}

template <> __device__ __forceinline__ void load8<kBF16>(const uint8_t * row, int64_t k0, float * o) {
    const uint4    u    = reinterpret_cast<const uint4 *>(row)[k0 / 8];
    const uint32_t w[4] = { u.x, u.y, u.z, u.w };
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[2 * i]     = __uint_as_float(w[i] << 16);
        o[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
}

template <> __device__ __forceinline__ void load8<kQ8_0>(const uint8_t * row, int64_t k0, float * o) {
    const uint8_t * b = row + (k0 / 32) * 34;
    const float     d = h2f(ld16(b));
    const int8_t *  q = reinterpret_cast<const int8_t *>(b + 2) + (k0 % 32);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        o[i] = static_cast<float>(q[i]) * d;
    }
}

template <> __device__ __forceinline__ void load8<kQ4_0>(const uint8_t * row, int64_t k0, float * o) {
    const uint8_t * b  = row + (k0 / 32) * 18;
    const float     d  = h2f(ld16(b));
    const int       j  = static_cast<int>(k0 % 32);
    const uint8_t * qs = b + 2 + (j & 15);
    const int       sh = j < 16 ? 0 : 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        o[i] = d * static_cast<float>(((qs[i] >> sh) & 0x0F) - 8);
    }
}

template <> __device__ __forceinline__ void load8<kQ4_1>(const uint8_t * row, int64_t k0, float * o) {
    const uint8_t * b  = row + (k0 / 32) * 20;
    const float     d = h2f(ld16(b)), m = h2f(ld16(b + 2));
    const int       j  = static_cast<int>(k0 % 32);
    const uint8_t * qs = b + 4 + (j & 15);
    const int       sh = j < 16 ? 0 : 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        o[i] = d * static_cast<float>((qs[i] >> sh) & 0x0F) + m;
    }
}

__device__ __forceinline__ uint32_t ld32(const uint8_t * p) {
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
           (static_cast<uint32_t>(p[3]) << 24);
}

template <> __device__ __forceinline__ void load8<kQ5_0>(const uint8_t * row, int64_t k0, float * o) {
    const uint8_t * b  = row + (k0 / 32) * 22;
    const float     d  = h2f(ld16(b));
    const uint32_t  qh = ld32(b + 2);
    const int       j  = static_cast<int>(k0 % 32);
    const uint8_t * qs = b + 6 + (j & 15);
    const int       sh = j < 16 ? 0 : 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int q = ((qs[i] >> sh) & 0x0F) | (((qh >> (j + i)) & 1) << 4);
        o[i]        = d * static_cast<float>(q - 16);
    }
}

template <> __device__ __forceinline__ void load8<kQ5_1>(const uint8_t * row, int64_t k0, float * o) {
    const uint8_t * b = row + (k0 / 32) * 24;
    const float     d = h2f(ld16(b)), m = h2f(ld16(b + 2));
    const uint32_t  qh = ld32(b + 4);
    const int       j  = static_cast<int>(k0 % 32);
    const uint8_t * qs = b + 8 + (j & 15);
    const int       sh = j < 16 ? 0 : 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int q = ((qs[i] >> sh) & 0x0F) | (((qh >> (j + i)) & 1) << 4);
        o[i]        = d * static_cast<float>(q) + m;
    }
}

// Scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4).
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t * s, int & sc, int & m) {
    if (j < 4) {
        sc = s[j] & 63;
        m  = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        m  = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

template <> __device__ __forceinline__ void load8<kQ4_K>(const uint8_t * row, int64_t k0, float * o) {
    const uint8_t * b = row + (k0 / 256) * 144;  // d, dmin, scales[12], qs[128]
    const int       e = static_cast<int>(k0 % 256), j = e / 32, l = e % 32;
    int             sc, m;
    scale_min_k4(j, b + 4, sc, m);
    const float     d1 = h2f(ld16(b)) * static_cast<float>(sc), m1 = h2f(ld16(b + 2)) * static_cast<float>(m);
    const uint8_t * q  = b + 16 + 32 * (j / 2) + l;
    const int       sh = 4 * (j % 2);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        o[i] = d1 * static_cast<float>((q[i] >> sh) & 0x0F) - m1;
    }
}

template <> __device__ __forceinline__ void load8<kQ5_K>(const uint8_t * row, int64_t k0, float * o) {
    const uint8_t * b = row + (k0 / 256) * 176;  // d, dmin, scales[12], qh[32], qs[128]
    const int       e = static_cast<int>(k0 % 256), j = e / 32, l = e % 32;
    int             sc, m;
    scale_min_k4(j, b + 4, sc, m);
    const float     d1 = h2f(ld16(b)) * static_cast<float>(sc), m1 = h2f(ld16(b + 2)) * static_cast<float>(m);
    const uint8_t * qh = b + 16 + l;
    const uint8_t * q  = b + 48 + 32 * (j / 2) + l;
    const int       sh = 4 * (j % 2);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int v = ((q[i] >> sh) & 0x0F) | (((qh[i] >> j) & 1) << 4);
        o[i]        = d1 * static_cast<float>(v) - m1;
    }
}

template <> __device__ __forceinline__ void load8<kQ6_K>(const uint8_t * row, int64_t k0, float * o) {
    const uint8_t * b  = row + (k0 / 256) * 210;  // ql[128], qh[64], scales[16] (int8), d
    const int       e  = static_cast<int>(k0 % 256), h = e / 128, l0 = e % 128;
    const float     d  = h2f(ld16(b + 208));
    const uint8_t * ql = b + 64 * h;
    const uint8_t * qh = b + 128 + 32 * h;
    const int8_t *  sc = reinterpret_cast<const int8_t *>(b + 192) + 8 * h;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int l = l0 + i;
        const int q = ((ql[l % 64] >> (4 * (l / 64))) & 0x0F) | (((qh[l % 32] >> (2 * (l / 32))) & 3) << 4);
        o[i]        = d * static_cast<float>(sc[l / 16]) * static_cast<float>(q - 32);
    }
}

}  // namespace kvcmas::cuda

#include "backend/cuda/mxfp4.cuh"  // load8<kMXFP4>

namespace kvcmas::cuda {

// Calls f.template operator()<T>() for the runtime type id; false for a type the kernels do not read.
template <typename F> inline bool dispatch_type(int type, F && f) {
    switch (type) {
        case kF32: f.template operator()<kF32>(); return true;
        case kF16: f.template operator()<kF16>(); return true;
        case kBF16: f.template operator()<kBF16>(); return true;
        case kQ8_0: f.template operator()<kQ8_0>(); return true;
        case kQ4_0: f.template operator()<kQ4_0>(); return true;
        case kQ4_1: f.template operator()<kQ4_1>(); return true;
        case kQ5_0: f.template operator()<kQ5_0>(); return true;
        case kQ5_1: f.template operator()<kQ5_1>(); return true;
        case kQ4_K: f.template operator()<kQ4_K>(); return true;
        case kQ5_K: f.template operator()<kQ5_K>(); return true;
        case kQ6_K: f.template operator()<kQ6_K>(); return true;
        case kMXFP4: f.template operator()<kMXFP4>(); return true;
        default: return false;
    }
}

}  // namespace kvcmas::cuda
