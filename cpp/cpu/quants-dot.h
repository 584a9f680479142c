// Private to cpu/: the 8-bit activation path of the decode matmul. Activations are quantized per 32 elements
// (q = round(x / d), d = max|x| / 127, as GGUF's Q8_0 does) and each weight block is dotted with them in integers
// (AVX2 maddubs / madd); the block's integer sum is then scaled by d_w·d_x in f32. The result equals
// dequantize(w)·dequantize_q8(x) exactly up to the f32 rounding of those scaled sums, so the error against the
// exact product is the activation rounding alone: |Δy_row| <= Σ_blocks (d_x,b / 2)·Σ_{k in b} |w_k|.
#pragma once

#include <cstdint>

#include "common/ggml-types.h"

namespace kvcmas::cpu::detail {

constexpr int kQ8Block = 32;  // activation elements per scale

// nt activation rows quantized per 32: row t's int8 values q + t·ldq, its scales d + t·ld_blocks (one per 32) and
// the exact f32 sums of its original values per 32, block_sums + t·ld_blocks (for weights with a per-block min,
// whose min term m·Σx is taken from the exact sums).
struct Q8Acts {
    const int8_t * q;
    const float *  d;
    const float *  block_sums;
    int64_t        ldq;
    int64_t        ld_blocks;
};

// Quantizes n (a multiple of 32) f32 values x into q[n], d[n/32] and sums[n/32] (Σ of the f32 values).
using QuantizeQ8Fn = void (*)(const float * x, int64_t n, int8_t * q, float * d, float * sums);

// One weight row of n elements against nt (1..4) quantized activation rows: out[t·out_stride] = Σ_blocks
// d_w·d_x·Σ q_w·q_x (+ min terms).
using RowDotQ8Fn = void (*)(const void * w_row, const Q8Acts & act, int nt, int64_t n, float * out,
                            int64_t out_stride);

// Only AVX2 kernels exist: without AVX2 (or for f32 / f16 / bf16 weights) the decode path keeps f32 activations.
#if defined(KC_X86)
// AVX2 kernels (quants-dot-avx2.cpp); nullptr for types without an integer kernel (f32, f16, bf16). The quantizer
// rounds x / d to nearest, ties to even (x·(1/d) in f32, then the default rounding mode).
RowDotQ8Fn row_dot_q8_fn_avx2(GgmlType type);
void       quantize_q8_avx2(const float * x, int64_t n, int8_t * q, float * d, float * sums);
#endif

}  // namespace kvcmas::cpu::detail
