// AVX2 + FMA + F16C dequantization (compiled with -mavx2 -mfma -mf16c; called only after the run-time check).
// Same products in the same order as quants.cpp; each is exact in f32, so results are bit-identical to it.
#include <immintrin.h>

#include <cstring>

#include "backend/cpu/matmul-impl.h"

namespace kvcmas::cpu::detail {
namespace {

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// 16 packed bytes of nibbles -> 32 bytes: element j < 16 from the low nibble of byte j, j >= 16 from the high one.
inline __m256i unpack_nibbles_32(const uint8_t * qs) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
    const __m256i b = _mm256_set_m128i(_mm_srli_epi16(q, 4), q);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
}

// The 32 bits of qh -> 32 bytes, byte j = 0x10 if bit j is set, else 0.
inline __m256i expand_bits_32(uint32_t qh) {
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    __m256i       v    = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), shuf);
    const __m256i bit  = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
    v                  = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

// 32 signed / unsigned bytes -> 4 × 8 floats q·scale (+ offset when HasOffset) stored to dst[32]. Without an
// offset nothing is added, so that -0 stays -0 as in the reference.
template <bool Signed, bool HasOffset = true>
inline void bytes_to_f32(__m256i v, __m256 scale, __m256 offset, float * dst) {
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    const __m128i parts[4] = { lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8) };
    for (int p = 0; p < 4; ++p) {
        const __m256i i32 = Signed ? _mm256_cvtepi8_epi32(parts[p]) : _mm256_cvtepu8_epi32(parts[p]);
        // d·q first, then the offset: the product is exact, so fusing or not gives the same value.
        const __m256  y   = _mm256_mul_ps(_mm256_cvtepi32_ps(i32), scale);
        _mm256_storeu_ps(dst + 8 * p, HasOffset ? _mm256_add_ps(y, offset) : y);
    }
}

void dequant_f32(const void * src, float * dst, int64_t n) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

void dequant_f16(const void * src, float * dst, int64_t n) {
    const auto * s = static_cast<const uint16_t *>(src);
    int64_t      i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s + i))));
    }
    for (; i < n; ++i) {
        dst[i] = h2f(s[i]);
    }
}

void dequant_bf16(const void * src, float * dst, int64_t n) {
    const auto * s = static_cast<const uint16_t *>(src);
    int64_t      i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(s + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
    for (; i < n; ++i) {
        uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
        std::memcpy(dst + i, &bits, 4);
    }
}

void dequant_q4_0(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ4_0 *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        const __m256i q = _mm256_sub_epi8(unpack_nibbles_32(b[i].qs), _mm256_set1_epi8(8));
        bytes_to_f32<true, false>(q, _mm256_set1_ps(h2f(b[i].d)), _mm256_setzero_ps(), dst);
    }
}

void dequant_q4_1(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ4_1 *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        bytes_to_f32<false>(unpack_nibbles_32(b[i].qs), _mm256_set1_ps(h2f(b[i].d)), _mm256_set1_ps(h2f(b[i].m)), dst);
    }
}

void dequant_q5_0(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ5_0 *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        uint32_t qh;
        std::memcpy(&qh, b[i].qh, 4);
        __m256i q = _mm256_or_si256(unpack_nibbles_32(b[i].qs), expand_bits_32(qh));
        q         = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
        bytes_to_f32<true, false>(q, _mm256_set1_ps(h2f(b[i].d)), _mm256_setzero_ps(), dst);
    }
}

void dequant_q5_1(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ5_1 *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        uint32_t qh;
        std::memcpy(&qh, b[i].qh, 4);
        const __m256i q = _mm256_or_si256(unpack_nibbles_32(b[i].qs), expand_bits_32(qh));
        bytes_to_f32<false>(q, _mm256_set1_ps(h2f(b[i].d)), _mm256_set1_ps(h2f(b[i].m)), dst);
    }
}

void dequant_q8_0(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ8_0 *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b[i].qs));
        bytes_to_f32<true, false>(q, _mm256_set1_ps(h2f(b[i].d)), _mm256_setzero_ps(), dst);
    }
}

// Q4_K / Q5_K: sub-block pairs (2c, 2c+1) share 32 bytes of qs; HasHigh adds bit j of qh for sub-block j.
template <typename Block, bool HasHigh>
void dequant_k4(const void * src, float * dst, int64_t n) {
    const auto *  b    = static_cast<const Block *>(src);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < n / 256; ++i) {
        const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
        __m256i     qh = _mm256_setzero_si256();
        if constexpr (HasHigh) {
            qh = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b[i].qh));
        }
        const ScalesMinsK4 sm = k4_scales_mins(b[i].scales);
        for (int c = 0; c < 4; ++c) {
            const __m256i q   = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b[i].qs + 32 * c));
            __m256i       v[2] = { _mm256_and_si256(q, mask), _mm256_and_si256(_mm256_srli_epi16(q, 4), mask) };
            for (int s = 0; s < 2; ++s, dst += 32) {
                const int j = 2 * c + s;
                if constexpr (HasHigh) {
                    const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
                    const __m256i hb  = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                    v[s]              = _mm256_or_si256(v[s], _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
                }
                const float d1 = d * static_cast<float>(sm.b[j]), m1 = dmin * static_cast<float>(sm.b[8 + j]);
                bytes_to_f32<false>(v[s], _mm256_set1_ps(d1), _mm256_set1_ps(-m1), dst);
            }
        }
    }
}

void dequant_q6_k(const void * src, float * dst, int64_t n) {
    const auto *  b    = static_cast<const BlockQ6_K *>(src);
    const __m256i mask = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    for (int64_t i = 0; i < n / 256; ++i) {
        const float d = h2f(b[i].d);
        for (int h = 0; h < 2; ++h) {
            const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b[i].ql + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b[i].ql + 64 * h + 32));
            const __m256i qh  = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(b[i].qh + 32 * h));
            const __m256i lo[4] = { _mm256_and_si256(ql0, mask), _mm256_and_si256(ql1, mask),
                                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), mask),
                                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), mask) };
            const __m256i hi[4] = { _mm256_and_si256(qh, three), _mm256_and_si256(_mm256_srli_epi16(qh, 2), three),
                                    _mm256_and_si256(_mm256_srli_epi16(qh, 4), three),
                                    _mm256_and_si256(_mm256_srli_epi16(qh, 6), three) };
            for (int s = 0; s < 4; ++s, dst += 32) {
                const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo[s], _mm256_slli_epi16(hi[s], 4)),
                                                  _mm256_set1_epi8(32));
                // Two 16-element groups with their own scale: convert each half separately.
                const int   g  = 8 * h + 2 * s;
                const float d0 = d * static_cast<float>(b[i].scales[g]);
                const float d1 = d * static_cast<float>(b[i].scales[g + 1]);
                const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
                const __m256 s0 = _mm256_set1_ps(d0), s1 = _mm256_set1_ps(d1);
                _mm256_storeu_ps(dst + 0, _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0))));
                _mm256_storeu_ps(dst + 8, _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8)))));
                _mm256_storeu_ps(dst + 16, _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1))));
                _mm256_storeu_ps(dst + 24, _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8)))));
            }
        }
    }
}

}  // namespace

DequantFn dequant_fn_avx2(GgmlType type) {
    switch (type) {
        case GgmlType::F32: return dequant_f32;
        case GgmlType::F16: return dequant_f16;
        case GgmlType::BF16: return dequant_bf16;
        case GgmlType::Q4_0: return dequant_q4_0;
        case GgmlType::Q4_1: return dequant_q4_1;
        case GgmlType::Q5_0: return dequant_q5_0;
        case GgmlType::Q5_1: return dequant_q5_1;
        case GgmlType::Q8_0: return dequant_q8_0;
        case GgmlType::Q4_K: return dequant_k4<BlockQ4_K, false>;
        case GgmlType::Q5_K: return dequant_k4<BlockQ5_K, true>;
        case GgmlType::Q6_K: return dequant_q6_k;
        default: return dequant_fn_lowbit(type);  // portable kernels only
    }
}

}  // namespace kvcmas::cpu::detail
