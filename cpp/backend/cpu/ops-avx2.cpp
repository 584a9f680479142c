// Row kernels of the forward pass with AVX2/FMA; called only when the CPU has them (see ops.cpp).
#include <cmath>

#include "backend/cpu/simd-avx2.h"

namespace kvcmas::cpu {

void silu_mul_avx2(const float * gate, const float * up, float * y, int64_t n) {
    int64_t      i   = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; ++i) {
        y[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
}

}  // namespace kvcmas::cpu
