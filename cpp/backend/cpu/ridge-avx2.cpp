// The ridge map's row product with AVX2/FMA; called only when the CPU has them (see cpu-backend.cpp).
#include <cstdint>

#include "backend/cpu/simd-avx2.h"

namespace kvcmas::cpu {

// out[i * out_stride + c] = Σ_d (x[i * kd + d] - mu[d]) · proj[d * rank + c] for i < n, c < rank.
void ridge_rows_avx2(const float * x, int64_t n, int64_t kd, const float * mu, const float * proj, int rank,
                     float * out, int64_t out_stride) {
    const int full = rank / 8 * 8;
    int64_t   i    = 0;
    for (; i + 4 <= n; i += 4) {  // four rows per pass: each load of proj feeds four FMAs
        const float * x0 = x + i * kd;
        const float * x1 = x0 + kd;
        const float * x2 = x1 + kd;
        const float * x3 = x2 + kd;
        for (int c0 = 0; c0 < full; c0 += 8) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
            __m256 a3 = _mm256_setzero_ps();
            for (int64_t d = 0; d < kd; ++d) {
                const __m256 p = _mm256_loadu_ps(proj + d * rank + c0);
                a0             = _mm256_fmadd_ps(_mm256_set1_ps(x0[d] - mu[d]), p, a0);
                a1             = _mm256_fmadd_ps(_mm256_set1_ps(x1[d] - mu[d]), p, a1);
                a2             = _mm256_fmadd_ps(_mm256_set1_ps(x2[d] - mu[d]), p, a2);
                a3             = _mm256_fmadd_ps(_mm256_set1_ps(x3[d] - mu[d]), p, a3);
            }
            _mm256_storeu_ps(out + i * out_stride + c0, a0);
            _mm256_storeu_ps(out + (i + 1) * out_stride + c0, a1);
            _mm256_storeu_ps(out + (i + 2) * out_stride + c0, a2);
            _mm256_storeu_ps(out + (i + 3) * out_stride + c0, a3);
        }
    }
    for (; i < n; ++i) {
        const float * xi = x + i * kd;
        for (int c0 = 0; c0 < full; c0 += 8) {
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < kd; ++d) {
                a = _mm256_fmadd_ps(_mm256_set1_ps(xi[d] - mu[d]), _mm256_loadu_ps(proj + d * rank + c0), a);
            }
            _mm256_storeu_ps(out + i * out_stride + c0, a);
        }
    }
    if (full < rank) {  // the last rank % 8 columns
        for (i = 0; i < n; ++i) {
            const float * xi = x + i * kd;
            float *       o  = out + i * out_stride;
            for (int c = full; c < rank; ++c) {
                o[c] = 0.0f;
            }
            for (int64_t d = 0; d < kd; ++d) {
                const float xd = xi[d] - mu[d];
                for (int c = full; c < rank; ++c) {
                    o[c] += xd * proj[d * rank + c];
                }
            }
        }
    }
}

}  // namespace kvcmas::cpu
