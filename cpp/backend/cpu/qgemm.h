// Private to cpu/: the integer prefill GEMM of the 8-bit activation path (Activations::Q8, n_tok at or above the
// decode threshold) for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K weights.
//
// The activations are quantized exactly as on the decode path (quants-dot.h: per 32 elements, two 8-bit passes), and
// each value's two passes are joined into one 16-bit integer v = 256·q + qr (|v| <= 32639), x̂ = step·v. Weight
// rows are unpacked once per call to 16-bit integer quants (offsets applied, so every weight is an integer times one
// float per group, less a min: Q4_K / Q5_K d·sc_j per 32 and the min dmin·m_j, Q6_K d·scale_g per 16, the 32-element
// block types d and, for Q4_1 / Q5_1, the min m), in panels of 16 rows where one 512-bit vector holds two adjacent
// elements of each row; every token then runs against them with AVX512-VNNI vpdpwssd (16-bit pairs summed into int32
// lanes), or on AVX2 CPUs with vpmaddwd + vpaddd (the same integer sums, 8 rows per ymm). A group's integer sum
// (|Σ| <= 32·128·32639 < 2^31: nothing overflows) is converted to f32 once and scaled by weight-factor · step.
//
// So the result is dequantize(w)·x̂ for the same x̂ as the decode path, to f32 rounding: the error against the exact
// product is the decode path's activation rounding bound (quants-dot.h). Each output is computed by one thread in a
// fixed order: the bits do not depend on the thread count or on the other tokens of the call, nor on the instruction
// set (the integer sums are exact and the f32 steps per output are the same, in the same order).
#pragma once

#include <cstdint>

#include "backend/cpu/matmul.h"

namespace kvcmas::cpu::detail {

// Whether the integer GEMM handles weights of `type`.
inline bool qgemm_type(GgmlType type) {
    switch (type) {
        case GgmlType::Q4_0:
        case GgmlType::Q4_1:
        case GgmlType::Q5_0:
        case GgmlType::Q5_1:
        case GgmlType::Q8_0:
        case GgmlType::Q4_K:
        case GgmlType::Q5_K:
        case GgmlType::Q6_K:
            return true;
        default:
            return false;
    }
}

// y[i] [n_tok][w[i].n_out] = x̂ · dequantize(w[i])ᵀ for x [n_tok][n_in] f32 and n_mats (<= kMaxMatmulMulti) matrices
// with the same n_in (a layer's Q, K, V; its gate and up): x is quantized once, and the 32-row units of all the
// matrices are shared out in one parallel job. Only for types that qgemm_type accepts.
using QgemmFn = void (*)(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                         ThreadPool & pool);

// Whether the one-pass GEMM (Activations::Q8Fast: qgemm_onepass_avx512vnni, qgemm_onepass_avx2) handles `type`.
inline bool qgemm_onepass_type(GgmlType type) {
    return type == GgmlType::Q4_K || type == GgmlType::Q5_K || type == GgmlType::Q6_K;
}

#if defined(KC_AVX512VNNI)
// With AVX512-VNNI: only once cpu_features().avx512_vnni.
void qgemm_avx512vnni(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                      ThreadPool & pool);
// The one-pass variant of Activations::Q8Fast, for the types qgemm_onepass_type accepts: the activations take only
// the decode path's first 8-bit pass, x̂ = d·q per 32 (d = max|x| / 127, llama.cpp's Q8_0 rounding: |x - x̂| <= d/2),
// against unsigned 8-bit weight quants with vpdpbusd (4 products per int32 lane, twice vpdpwssd's); Q6_K's -32 is
// taken out of the int32 sums with the activations' sums per 16. The result is dequantize(w)·x̂ to f32 rounding;
// each output is one thread's, in a fixed order: the bits do not depend on the thread count.
void qgemm_onepass_avx512vnni(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                              ThreadPool & pool);
#endif
#if defined(KC_X86)
// With AVX2 (vpmaddwd): only once cpu_features().qgemm_avx2. The same bits as qgemm_avx512vnni.
void qgemm_avx2(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok, ThreadPool & pool);
// qgemm_onepass_avx512vnni's AVX2 twin (vpmaddubsw + vpmaddwd): the same bits. Only once cpu_features().qgemm_avx2.
void qgemm_onepass_avx2(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                        ThreadPool & pool);
#endif

}  // namespace kvcmas::cpu::detail
