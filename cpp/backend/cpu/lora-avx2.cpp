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

// One output: y + s · Σ_c t[c] · B[c][o], the fused multiply-adds of the tiles' lanes.
template <LoraFactorType T>
inline float up_one(const float * t, int rank, const void * b_t, int64_t o, float s, float y) {
    float u = 0.0f;
    for (int c = 0; c < rank; ++c) {
        u = std::fma(t[c], load1<T>(b_t, backend::lora_b_index(c, o, rank)), u);
    }
    return std::fma(s, u, y);
}

// NV tiles of b_t (backend.h: lora_b_index), outputs [o, o + 8 NV) of y, o a tile's first output: their sums in
// registers over every rank row c (NV independent chains: 8 keep the multiply-add units busy where one would wait on
// each result), the tiles read in order. Every element gets the same fused multiply-adds (over c in order from zero,
// then into y), whichever tile reaches it, so how [o0, o1) is cut does not change any element.
template <LoraFactorType T, int NV>
inline void up_tiles(const float * t, int rank, const void * b_t, int64_t o, __m256 vs, float * y) {
    static_assert(backend::kLoraTile == 8, "one __m256 per tile row");
    __m256 u[NV];
    for (int k = 0; k < NV; ++k) {
        u[k] = _mm256_setzero_ps();
    }
    const int64_t first = backend::lora_b_index(0, o, rank);
    for (int c = 0; c < rank; ++c) {
        const __m256 tc = _mm256_set1_ps(t[c]);
        for (int k = 0; k < NV; ++k) {
            u[k] = _mm256_fmadd_ps(tc, load8<T>(b_t, first + (k * rank + c) * 8), u[k]);
        }
    }
    for (int k = 0; k < NV; ++k) {
        _mm256_storeu_ps(y + o + 8 * k, _mm256_fmadd_ps(vs, u[k], _mm256_loadu_ps(y + o + 8 * k)));
    }
}

template <LoraFactorType T>
void up_rows(const float * t, int rank, const void * b_t, int64_t o0, int64_t o1, float s, float * y) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t      o  = o0;
    for (; o % 8 != 0 && o < o1; ++o) {  // to a tile's start (blocks of rows start there; lora.h allows any o0)
        y[o] = up_one<T>(t, rank, b_t, o, s, y[o]);
    }
    for (; o + 64 <= o1; o += 64) {
        up_tiles<T, 8>(t, rank, b_t, o, vs, y);
    }
    for (; o + 16 <= o1; o += 16) {
        up_tiles<T, 2>(t, rank, b_t, o, vs, y);
    }
    for (; o + 8 <= o1; o += 8) {
        up_tiles<T, 1>(t, rank, b_t, o, vs, y);
    }
    for (; o < o1; ++o) {
        y[o] = up_one<T>(t, rank, b_t, o, s, y[o]);
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

void lora_up_avx2(const float * t, int rank, const void * b_t, LoraFactorType type, int64_t o0, int64_t o1, float s,
                  float * y) {
    switch (type) {
        case LoraFactorType::F16:
            return up_rows<LoraFactorType::F16>(t, rank, b_t, o0, o1, s, y);
        case LoraFactorType::I8:
            return up_rows<LoraFactorType::I8>(t, rank, b_t, o0, o1, s, y);
        default:
            return up_rows<LoraFactorType::F32>(t, rank, b_t, o0, o1, s, y);
    }
}

}  // namespace kvcmas::cpu
