// AVX2/FMA row kernels of the vision towers (compiled with -mavx2 -mfma; called after a run-time check).
#include <immintrin.h>

#include <cstdint>

#include "backend/cpu/simd-avx2.h"
#include "backend/cpu/vision-kernels.h"

namespace kvcmas::cpu {

// softmax() of vision-kernels.h with the vectorized exp (about 1e-7 relative error); the sum in f32 lanes.
void softmax_avx2(float * x, int64_t n) {
    __m256  vmax = _mm256_set1_ps(x[0]);
    int64_t i    = 0;
    for (; i + 8 <= n; i += 8) {
        vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + i));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float mx = lanes[0];
    for (int j = 1; j < 8; ++j) {
        mx = lanes[j] > mx ? lanes[j] : mx;
    }
    for (int64_t j = i; j < n; ++j) {
        mx = x[j] > mx ? x[j] : mx;
    }
    const __m256 vm   = _mm256_set1_ps(mx);
    __m256       vsum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_store_ps(lanes, vsum);
    double sum = 0.0;
    for (float l : lanes) {
        sum += l;
    }
    for (int64_t j = i; j < n; ++j) {
        alignas(32) float one[8] = { x[j] - mx };
        _mm256_store_ps(one, exp_avx2(_mm256_load_ps(one)));
        x[j] = one[0];
        sum += one[0];
    }
    const __m256 inv = _mm256_set1_ps(static_cast<float>(1.0 / sum));
    for (i = 0; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    }
    for (int64_t j = i; j < n; ++j) {
        x[j] *= static_cast<float>(1.0 / sum);
    }
}

// activate() of vision-kernels.h for the activations made of one exp (GeluTanh, QuickGelu, Silu: x / (1 + e^(-g(x)))),
// with the vectorized exp; false (nothing done) for the others.
bool activate_avx2(Activation act, float * x, int64_t n) {
    if (act != Activation::GeluTanh && act != Activation::QuickGelu && act != Activation::Silu) {
        return false;
    }
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t      i   = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        __m256       g;  // e^(-g) is the exp each activation takes
        if (act == Activation::GeluTanh) {
            const __m256 v3 = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
            const __m256 u =
                _mm256_mul_ps(_mm256_set1_ps(0.79788456080286536f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), v3, v));
            g = _mm256_mul_ps(_mm256_set1_ps(2.0f), u);
        } else if (act == Activation::QuickGelu) {
            g = _mm256_mul_ps(_mm256_set1_ps(1.702f), v);
        } else {
            g = v;
        }
        const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(x + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
    }
    if (i < n) {
        activate_portable(act, x + i, n - i);
    }
    return true;
}

}  // namespace kvcmas::cpu
