// Private to cpu/: the 8-bit activation path of the decode matmul. Activations are quantized per 32 elements
// (q = round(x / d), d = max|x| / 127, as GGUF's Q8_0 does) and each weight block is dotted with them in integers
// (AVX2 maddubs / madd); the block's integer sum is then scaled by d_w·d_x in f32.
//
// Outlier blocks: hidden states carry a few channels far larger than the rest, and one such value makes d of its
// block large and the other 31 values coarse. A block whose max|x| exceeds kQ8HotRatio × the row's mean max|x| is
// therefore quantized twice: q as above, then the residual x - d·q (|.| <= d/2) as qr with its own scale dr; its
// dot product adds d_w·dr·Σ q_w·qr. Only those few blocks pay the second pass (a branch that every row of the matrix
// takes the same way).
//
// The result equals dequantize(w)·x̂ to the f32 rounding of the scaled sums, x̂ = d·q (+ dr·qr in hot blocks), so the
// error against the exact product is the activation rounding alone: per row
// |Δy| <= Σ_blocks (s_b / 2)·Σ_{k in b} |w_k - m_b|, s_b = dr_b in hot blocks, d_b elsewhere, m_b the block's min
// term (weights with a min take m·Σx from the exact sums of x).
#pragma once

#include <cstdint>

#include "common/ggml-types.h"

namespace kvcmas::cpu::detail {

constexpr int   kQ8Block    = 32;    // activation elements per scale
constexpr float kQ8HotRatio = 2.0f;  // max|x| of a block above this × the row's mean: the block gets a residual pass

// nt activation rows quantized per 32: row t's int8 values q + t·ldq, its scales d + t·ld_blocks (one per 32), the
// residual quants qr + t·ldq and scales dr + t·ld_blocks (dr = 0: no residual pass; qr is then not read), and the
// exact f32 sums of its original values per 32, block_sums + t·ld_blocks (for weights with a per-block min, whose
// min term m·Σx is taken from the exact sums).
struct Q8Acts {
    const int8_t * q;
    const float *  d;
    const int8_t * qr;
    const float *  dr;
    const float *  block_sums;
    int64_t        ldq;
    int64_t        ld_blocks;
};

// One weight row of n elements against nt (1..4) quantized activation rows: out[t·out_stride] = Σ_blocks
// d_w·d_x·Σ q_w·q_x (+ min terms).
using RowDotQ8Fn = void (*)(const void * w_row, const Q8Acts & act, int nt, int64_t n, float * out, int64_t out_stride);

// Only AVX2 kernels exist: without AVX2 (or for f32 / f16 / bf16 weights) the decode path keeps f32 activations.
#if defined(KC_X86)
// AVX2 kernels (quants-dot-avx2.cpp); nullptr for types without an integer kernel (f32, f16, bf16).
RowDotQ8Fn row_dot_q8_fn_avx2(GgmlType type);
#if defined(KC_AVXVNNI)
// The same kernels with AVX-VNNI (quants-dot-avxvnni.cpp); only once cpu_features().avx_vnni is true.
RowDotQ8Fn row_dot_q8_fn_avxvnni(GgmlType type);
#endif
// Quantizes n (a multiple of 32) f32 values x into q[n], d[n/32], the residual qr[n] / dr[n/32] and sums[n/32] (Σ of
// the f32 values). Rounding: x·(1/d) in f32 to nearest, ties to even; the residual is x - d·q rounded once.
void quantize_q8_avx2(const float * x, int64_t n, int8_t * q, float * d, int8_t * qr, float * dr, float * sums);
#endif

}  // namespace kvcmas::cpu::detail
