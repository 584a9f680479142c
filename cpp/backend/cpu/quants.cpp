// Portable (scalar) dequantization of every weight type, and the run-time dispatch to the AVX2 versions.
// The products are ordered as in gguf-py's reference (e.g. (d·sc)·q - dmin·m), and each is exact in f32, so the
// result is bit-identical to it whether or not the compiler fuses multiply-adds.
#include "backend/cpu/quants.h"

#include <cmath>
#include <cstring>

#include "common/error.h"
#include "backend/cpu/cpu-features.h"
#include "backend/cpu/matmul-impl.h"

namespace kvcmas::cpu {

float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp  = (h >> 10) & 0x1Fu;
    const uint32_t mant = h & 0x3FFu;
    uint32_t       bits;
    if (exp == 0x1F) {  // inf / nan (payload kept)
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp == 0) {  // zero / subnormal: mant · 2^-24, exact in f32
        const float v = static_cast<float>(mant) * 0x1p-24f;
        std::memcpy(&bits, &v, 4);
        bits |= sign;
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t fp32_to_fp16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t       ax   = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) {
        return static_cast<uint16_t>(sign | 0x7E00u);  // quiet nan
    }
    if (ax >= 0x477FF000u) {  // >= 65520 rounds to inf (inf included)
        return static_cast<uint16_t>(sign | 0x7C00u);
    }
    if (ax < 0x38800000u) {  // below the smallest normal half: multiples of 2^-24, round to nearest even
        float v;
        std::memcpy(&v, &ax, 4);
        return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(v * 0x1p24f)));
    }
    ax += 0xFFFu + ((ax >> 13) & 1u);  // round to nearest even on the 13 dropped bits
    return static_cast<uint16_t>(sign | ((ax - (112u << 23)) >> 13));
}

float bf16_to_fp32(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float          f;
    std::memcpy(&f, &bits, 4);
    return f;
}

namespace detail {
namespace {

void dequant_f32(const void * src, float * dst, int64_t n) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

void dequant_f16(const void * src, float * dst, int64_t n) {
    const auto * s = static_cast<const uint16_t *>(src);
    for (int64_t i = 0; i < n; ++i) {
        dst[i] = fp16_to_fp32(s[i]);
    }
}

void dequant_bf16(const void * src, float * dst, int64_t n) {
    const auto * s = static_cast<const uint16_t *>(src);
    for (int64_t i = 0; i < n; ++i) {
        dst[i] = bf16_to_fp32(s[i]);
    }
}

void dequant_q4_0(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ4_0 *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < 16; ++j) {
            dst[j]      = d * static_cast<float>((b[i].qs[j] & 0x0F) - 8);
            dst[j + 16] = d * static_cast<float>((b[i].qs[j] >> 4) - 8);
        }
    }
}

void dequant_q4_1(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ4_1 *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        const float d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
        for (int j = 0; j < 16; ++j) {
            dst[j]      = d * static_cast<float>(b[i].qs[j] & 0x0F) + m;
            dst[j + 16] = d * static_cast<float>(b[i].qs[j] >> 4) + m;
        }
    }
}

template <typename Block>
inline uint32_t load_qh(const Block & b) {
    uint32_t qh;
    std::memcpy(&qh, b.qh, 4);
    return qh;
}

void dequant_q5_0(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ5_0 *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        const float    d  = fp16_to_fp32(b[i].d);
        const uint32_t qh = load_qh(b[i]);
        for (int j = 0; j < 16; ++j) {
            const int lo = (b[i].qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
            const int hi = (b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            dst[j]       = d * static_cast<float>(lo - 16);
            dst[j + 16]  = d * static_cast<float>(hi - 16);
        }
    }
}

void dequant_q5_1(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ5_1 *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        const float    d = fp16_to_fp32(b[i].d), m = fp16_to_fp32(b[i].m);
        const uint32_t qh = load_qh(b[i]);
        for (int j = 0; j < 16; ++j) {
            const int lo = (b[i].qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
            const int hi = (b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            dst[j]       = d * static_cast<float>(lo) + m;
            dst[j + 16]  = d * static_cast<float>(hi) + m;
        }
    }
}

void dequant_q8_0(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ8_0 *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < 32; ++j) {
            dst[j] = static_cast<float>(b[i].qs[j]) * d;
        }
    }
}

void dequant_q4_k(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ4_K *>(src);
    for (int64_t i = 0; i < n / 256; ++i) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        for (int j = 0; j < 8; ++j, dst += 32) {
            uint8_t sc, m;
            get_scale_min_k4(j, b[i].scales, sc, m);
            const float     d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
            const uint8_t * q  = b[i].qs + 32 * (j / 2);
            const int       sh = 4 * (j % 2);
            for (int l = 0; l < 32; ++l) {
                dst[l] = d1 * static_cast<float>((q[l] >> sh) & 0x0F) - m1;
            }
        }
    }
}

void dequant_q5_k(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ5_K *>(src);
    for (int64_t i = 0; i < n / 256; ++i) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        for (int j = 0; j < 8; ++j, dst += 32) {
            uint8_t sc, m;
            get_scale_min_k4(j, b[i].scales, sc, m);
            const float     d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
            const uint8_t * q  = b[i].qs + 32 * (j / 2);
            const int       sh = 4 * (j % 2);
            for (int l = 0; l < 32; ++l) {
                const int v = ((q[l] >> sh) & 0x0F) | (((b[i].qh[l] >> j) & 1) << 4);
                dst[l]      = d1 * static_cast<float>(v) - m1;
            }
        }
    }
}

void dequant_q6_k(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ6_K *>(src);
    for (int64_t i = 0; i < n / 256; ++i) {
        const float d = fp16_to_fp32(b[i].d);
        for (int h = 0; h < 2; ++h, dst += 128) {
            const uint8_t * ql = b[i].ql + 64 * h;
            const uint8_t * qh = b[i].qh + 32 * h;
            for (int l = 0; l < 128; ++l) {
                const int   q  = ((ql[l % 64] >> (4 * (l / 64))) & 0x0F) | (((qh[l % 32] >> (2 * (l / 32))) & 3) << 4);
                const float d1 = d * static_cast<float>(b[i].scales[8 * h + l / 16]);
                dst[l]         = d1 * static_cast<float>(q - 32);
            }
        }
    }
}

}  // namespace

DequantFn dequant_fn_scalar(GgmlType type) {
    switch (type) {
        case GgmlType::F32: return dequant_f32;
        case GgmlType::F16: return dequant_f16;
        case GgmlType::BF16: return dequant_bf16;
        case GgmlType::Q4_0: return dequant_q4_0;
        case GgmlType::Q4_1: return dequant_q4_1;
        case GgmlType::Q5_0: return dequant_q5_0;
        case GgmlType::Q5_1: return dequant_q5_1;
        case GgmlType::Q8_0: return dequant_q8_0;
        case GgmlType::Q4_K: return dequant_q4_k;
        case GgmlType::Q5_K: return dequant_q5_k;
        case GgmlType::Q6_K: return dequant_q6_k;
        default: return dequant_fn_lowbit(type);
    }
}

}  // namespace detail

void dequantize_row(GgmlType type, const void * src, float * dst, int64_t n) {
    const GgmlTypeTraits * t = ggml_type_traits(static_cast<uint32_t>(type));
    KC_CHECK(t != nullptr && t->weight, "dequantize_row: %s is not a supported weight type",
             ggml_type_name(static_cast<uint32_t>(type)));
    KC_CHECK(n >= 0 && n % t->block == 0, "dequantize_row: %lld elements of %s is not a whole number of blocks",
             static_cast<long long>(n), t->name);
    KC_CHECK(type == GgmlType::F32 || type == GgmlType::MXFP4 || reinterpret_cast<uintptr_t>(src) % 2 == 0,
             "dequantize_row: %s data must be 2-byte aligned", t->name);
    detail::DequantFn fn = detail::dequant_fn_scalar(type);
#if defined(KC_X86)
    if (cpu_features().avx2_fma_f16c) {
        fn = detail::dequant_fn_avx2(type);
    }
#endif
    KC_CHECK(fn != nullptr, "dequantize_row: no kernel for %s", t->name);
    fn(src, dst, n);
}

}  // namespace kvcmas::cpu
