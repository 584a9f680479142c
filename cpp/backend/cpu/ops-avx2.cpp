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

// gelu_tanh_mul (ops.cpp) as a sigmoid: 0.5 (1 + tanh z) = 1 / (1 + e^(-2z)), so one vector exp per 8 values
// instead of a scalar tanh each (Gemma's GeGLU runs it on every feed-forward row of a prefill).
void gelu_tanh_mul_avx2(const float * gate, const float * up, float * y, int64_t n) {
    constexpr float k   = 0.7978845608028654f;  // sqrt(2 / pi)
    const __m256    c1  = _mm256_set1_ps(-2.0f * k);
    const __m256    c3  = _mm256_set1_ps(-2.0f * k * 0.044715f);
    const __m256    one = _mm256_set1_ps(1.0f);
    int64_t         i   = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g     = _mm256_loadu_ps(gate + i);
        const __m256 minus = _mm256_mul_ps(g, _mm256_fmadd_ps(c3, _mm256_mul_ps(g, g), c1));  // -2z
        const __m256 e     = exp_avx2(minus);
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; ++i) {
        const float g = gate[i];
        y[i]          = g / (1.0f + std::exp(-2.0f * k * (g + 0.044715f * g * g * g))) * up[i];
    }
}

// dot_f32 (ops.cpp) with the 8 partial sums in one register: the same order of additions, fused multiply-adds.
float dot_f32_avx2(const float * a, const float * b, int64_t n) {
    __m256        acc = _mm256_setzero_ps();
    const int64_t n8  = n - n % 8;
    for (int64_t i = 0; i < n8; i += 8) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    for (int64_t i = n8; i < n; ++i) {
        lanes[i - n8] += a[i] * b[i];
    }
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

}  // namespace kvcmas::cpu
