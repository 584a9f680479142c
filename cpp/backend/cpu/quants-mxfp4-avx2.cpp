// MXFP4's decode row dot with AVX2: a block's 32 codes looked up in the value table with one byte shuffle per
// nibble half, widened to f32 and dotted with x by FMA, then scaled by the block's power of two.
#include <immintrin.h>

#include "backend/cpu/quants-mxfp4.h"

namespace kvcmas::cpu::detail {

namespace {

float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

__m256 widen(__m128i bytes) {  // the low 8 int8 lanes as f32
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

}  // namespace

void dot_mxfp4_rows_avx2(const void * w_row, const DecodeActs & a, int nt, int64_t n, float * out, int64_t os) {
    const auto *  b     = static_cast<const BlockMXFP4 *>(w_row);
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i *>(kMxfp4Values));
    const __m128i low4  = _mm_set1_epi8(0x0F);
    __m256        acc[4];
    for (int t = 0; t < 4; ++t) {
        acc[t] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n / 32; ++i) {
        const __m128i q  = _mm_loadu_si128(reinterpret_cast<const __m128i *>(b[i].qs));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, low4));                     // elements 0-15
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low4));  // 16-31
        const __m256  w0 = widen(lo), w1 = widen(_mm_srli_si128(lo, 8));
        const __m256  w2 = widen(hi), w3 = widen(_mm_srli_si128(hi, 8));
        const __m256  d = _mm256_set1_ps(mxfp4_scale(b[i].e));
        for (int t = 0; t < nt; ++t) {
            const float * x = a.x + t * a.ldx + 32 * i;
            __m256        s = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
            s               = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), s);
            s               = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), s);
            s               = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), s);
            acc[t]          = _mm256_fmadd_ps(d, s, acc[t]);
        }
    }
    for (int t = 0; t < nt; ++t) {
        out[t * os] = hsum(acc[t]);
    }
}

}  // namespace kvcmas::cpu::detail
