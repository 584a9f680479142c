// Small AVX2/FMA helpers shared by the *-avx2.cpp kernels (include only from files compiled with -mavx2 -mfma).
#pragma once

#include <immintrin.h>

namespace kvcmas::cpu {

// e^x per lane for x in [-87, 88] (clamped outside): Cephes-style range reduction and degree-6 polynomial,
// about 1e-7 relative error.
inline __m256 exp_avx2(__m256 x) {
    x               = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 fx       = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx              = _mm256_floor_ps(fx);
    x               = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x               = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y        = _mm256_set1_ps(1.9875691500e-4f);
    y               = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y               = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y               = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y               = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y               = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 xx = _mm256_mul_ps(x, x);
    y               = _mm256_fmadd_ps(y, xx, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace kvcmas::cpu
