// AVX2 kernels of the 8-bit activation path (compiled with -mavx2 -mfma -mf16c; called only after the run-time
// check): the maddubs + madd instance of quants-dot-avx2-impl.h, and the activation quantizer.
#define KC_Q8_VNNI 0
#define KC_Q8_NS avx2
#include "backend/cpu/quants-dot-avx2-impl.h"
#include "backend/cpu/quants-dot-onepass-impl.h"

namespace kvcmas::cpu::detail {
using avx2::hmax;
using avx2::hsum;

namespace {

// 32 f32 values v · inv rounded to nearest (ties to even) as int8 in element order (saturated to ±127), stored at q;
// the rounded values are also returned as f32 in r.
inline void round_to_i8(const __m256 v[4], float inv, int8_t * q, __m256 r[4]) {
    __m256i i32[4];
    for (int p = 0; p < 4; ++p) {
        r[p] = _mm256_round_ps(_mm256_mul_ps(v[p], _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        i32[p] = _mm256_cvtps_epi32(r[p]);
    }
    // packs work per 128-bit lane: the bytes come out in dword order 0,4,1,5,2,6,3,7; permute back. They saturate to
    // [-128, 127]; -128 is raised to -127 so that the kernels' sign trick cannot overflow.
    const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
    const __m256i i8 = _mm256_max_epi8(_mm256_packs_epi16(i16a, i16b), _mm256_set1_epi8(-127));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(q),
                        _mm256_permutevar8x32_epi32(i8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

inline float abs_max(const __m256 v[4]) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return hmax(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], m), _mm256_and_ps(v[1], m)),
                              _mm256_max_ps(_mm256_and_ps(v[2], m), _mm256_and_ps(v[3], m))));
}

}  // namespace

void quantize_q8_avx2(const float * x, int64_t n, int8_t * q, int8_t * qr, float * d, float * sums, float * group_sums,
                      float * d1, float * group_sums1) {
    for (int64_t b = 0; b < n / kQ8Block; ++b) {
        __m256 v[4], r[4];
        for (int p = 0; p < 4; ++p) {
            v[p] = _mm256_loadu_ps(x + 32 * b + 8 * p);
        }
        sums[b]         = hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        const float dx  = abs_max(v) / 127.0f;
        const float inv = dx != 0.0f ? 1.0f / dx : 0.0f;
        round_to_i8(v, inv, q + 32 * b, r);
        if (d1 != nullptr) {  // |Σq| <= 16·127: exact in f32
            d1[b]                  = dx;
            group_sums1[2 * b]     = hsum(_mm256_add_ps(r[0], r[1])) * dx;
            group_sums1[2 * b + 1] = hsum(_mm256_add_ps(r[2], r[3])) * dx;
        }
        // Integer sums of each 16: exact in f32 (|256·Σq + Σqr| < 2^20).
        __m256 sum16[2] = { _mm256_mul_ps(_mm256_add_ps(r[0], r[1]), _mm256_set1_ps(256.0f)),
                            _mm256_mul_ps(_mm256_add_ps(r[2], r[3]), _mm256_set1_ps(256.0f)) };
        for (int p = 0; p < 4; ++p) {
            v[p] = _mm256_fnmadd_ps(_mm256_set1_ps(dx), r[p], v[p]);  // x - d·q, rounded once
        }
        round_to_i8(v, 256.0f * inv, qr + 32 * b, r);
        // The saturated residual as stored (round_to_i8 returns it unsaturated).
        for (int p = 0; p < 4; ++p) {
            r[p] = _mm256_max_ps(_mm256_min_ps(r[p], _mm256_set1_ps(127.0f)), _mm256_set1_ps(-127.0f));
        }
        sum16[0]              = _mm256_add_ps(sum16[0], _mm256_add_ps(r[0], r[1]));
        sum16[1]              = _mm256_add_ps(sum16[1], _mm256_add_ps(r[2], r[3]));
        d[b]                  = dx * (1.0f / 256.0f);
        group_sums[2 * b]     = hsum(sum16[0]) * d[b];
        group_sums[2 * b + 1] = hsum(sum16[1]) * d[b];
    }
}

RowDotQ8Fn row_dot_q8_fn_avx2(GgmlType type) {
    return avx2::row_dot_q8_fn(type);
}

RowDotQ8Fn row_dot_q8_onepass_fn_avx2(GgmlType type) {
    return avx2::row_dot_q8_onepass_fn(type);
}

}  // namespace kvcmas::cpu::detail
