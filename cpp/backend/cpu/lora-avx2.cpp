// The LoRA row kernels (lora.h) with AVX2/FMA/F16C; called only when the CPU has them (see lora.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/backend.h"
#include "backend/cpu/simd-avx2.h"

namespace kvcmas::cpu {

namespace {

using backend::LoraFactorType;

template <LoraFactorType T>
inline __m256 load8(const void * p, int64_t i) {
    if constexpr (T == LoraFactorType::F16) {
        return _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i *>(static_cast<const uint16_t *>(p) + i)));
    } else if constexpr (T == LoraFactorType::I8) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i *>(static_cast<const int8_t *>(p) + i))));
    } else {
        return _mm256_loadu_ps(static_cast<const float *>(p) + i);
    }
}

template <LoraFactorType T>
inline float load1(const void * p, int64_t i) {
    if constexpr (T == LoraFactorType::F16) {
        return _cvtsh_ss(static_cast<const uint16_t *>(p)[i]);
    } else if constexpr (T == LoraFactorType::I8) {
        return static_cast<float>(static_cast<const int8_t *>(p)[i]);
    } else {
        return static_cast<const float *>(p)[i];
    }
}

// Four accumulators over 32 columns at a time (a decode row's one dot is latency-bound with one), then 8 at a time
// into the first, then the tail into its lanes; the sums in a fixed order.
template <LoraFactorType T>
float dot_rows(const void * a_row, const float * x, int64_t n) {
    __m256  acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
            acc3 = _mm256_setzero_ps();
    int64_t i    = 0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(load8<T>(a_row, i), _mm256_loadu_ps(x + i), acc0);
        acc1 = _mm256_fmadd_ps(load8<T>(a_row, i + 8), _mm256_loadu_ps(x + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(load8<T>(a_row, i + 16), _mm256_loadu_ps(x + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(load8<T>(a_row, i + 24), _mm256_loadu_ps(x + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) {
        acc0 = _mm256_fmadd_ps(load8<T>(a_row, i), _mm256_loadu_ps(x + i), acc0);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
    for (int64_t k = i; k < n; ++k) {
        lanes[k - i] = std::fma(load1<T>(a_row, k), x[k], lanes[k - i]);
    }
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

// Sweeps of up to kSweep outputs: each rank row of b_t read in one sequential run over the sweep (a decode call's
// B product is a stream from memory: 16 rows a few bytes at a time each stall the loads), the sweep's sums kept in
// a buffer; then 8 outputs, then one by one. Every element gets the same fused multiply-adds (over c in order from
// zero, then into y), whichever way it is reached.
constexpr int64_t kSweep = 512;

template <LoraFactorType T>
void up_rows(const float * t, int rank, const void * b_t, int64_t n_out, int64_t o0, int64_t o1, float s, float * y) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t      o  = o0;
    while (o + 8 <= o1) {
        const int64_t     n = std::min(kSweep, (o1 - o) / 8 * 8);
        alignas(32) float u[kSweep];
        for (int64_t k = 0; k < n; k += 8) {
            _mm256_store_ps(u + k, _mm256_setzero_ps());
        }
        for (int c = 0; c < rank; ++c) {
            const __m256  tc  = _mm256_set1_ps(t[c]);
            const int64_t row = c * n_out + o;
            for (int64_t k = 0; k < n; k += 8) {
                _mm256_store_ps(u + k, _mm256_fmadd_ps(tc, load8<T>(b_t, row + k), _mm256_load_ps(u + k)));
            }
        }
        for (int64_t k = 0; k < n; k += 8) {
            _mm256_storeu_ps(y + o + k, _mm256_fmadd_ps(vs, _mm256_load_ps(u + k), _mm256_loadu_ps(y + o + k)));
        }
        o += n;
    }
    for (; o < o1; ++o) {
        float u = 0.0f;
        for (int c = 0; c < rank; ++c) {
            u = std::fma(t[c], load1<T>(b_t, c * n_out + o), u);
        }
        y[o] = std::fma(s, u, y[o]);
    }
}

}  // namespace

float lora_dot_avx2(const void * a_row, LoraFactorType type, const float * x, int64_t n) {
    switch (type) {
        case LoraFactorType::F16:
            return dot_rows<LoraFactorType::F16>(a_row, x, n);
        case LoraFactorType::I8:
            return dot_rows<LoraFactorType::I8>(a_row, x, n);
        default:
            return dot_rows<LoraFactorType::F32>(a_row, x, n);
    }
}

void lora_up_avx2(const float * t, int rank, const void * b_t, LoraFactorType type, int64_t n_out, int64_t o0,
                  int64_t o1, float s, float * y) {
    switch (type) {
        case LoraFactorType::F16:
            return up_rows<LoraFactorType::F16>(t, rank, b_t, n_out, o0, o1, s, y);
        case LoraFactorType::I8:
            return up_rows<LoraFactorType::I8>(t, rank, b_t, n_out, o0, o1, s, y);
        default:
            return up_rows<LoraFactorType::F32>(t, rank, b_t, n_out, o0, o1, s, y);
    }
}

}  // namespace kvcmas::cpu
