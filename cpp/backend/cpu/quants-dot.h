// Private to cpu/: the 8-bit activation path of the decode matmul. Activations are quantized per 32 elements in two
// 8-bit passes, and each weight block is dotted with them in integers (AVX2 maddubs / madd, or AVX-VNNI vpdpbusd);
// the block's integer sum is then scaled by d_w·d_x in f32.
//
// Two passes: q = round(x / d) with d = max|x| / 127 (GGUF's Q8_0 rounding), then the residual x - d·q (|.| <= d/2)
// as qr = round((x - d·q)·256 / d), saturated to ±127. So x̂ = (d / 256)·(256·q + qr): about 15 bits per value
// against Q8_0's 8, and the integer sum Σ q_w·(256·q + qr) is formed before the one conversion to f32 (a shift or a
// madd by 256, one more maddubs / vpdpbusd per block). With a single pass (Q8_0 alone, what llama.cpp does) the
// default model kept the exact top-1 on 94.5% of real-text positions, with a second pass on outlier blocks only 97.8%;
// the error is spread over all blocks, so every block gets it (docs/quant-kernels.md).
//
// The result equals dequantize(w)·x̂ to the f32 rounding of the scaled sums, so the error against the exact product
// is the activation rounding alone: |x - x̂| <= s = d / 256 per element (d / 512 unless the residual saturated), and
// per row |Δy| <= Σ_blocks s_b·Σ_{k in b} |w_k - m_b|, m_b the block's min term (weights with a min take m·Σx from
// the exact sums of x).
#pragma once

#include <cstdint>

#include "common/ggml-types.h"

namespace kvcmas::cpu::detail {

constexpr int kQ8Block = 32;  // activation elements per scale

// nt activation rows quantized per 32: row t's first-pass int8 values q + t·ldq, its residual values qr + t·ldq, the
// step of the combined value 256·q + qr per 32 elements, d + t·ld_blocks (max|x| / (127·256)), the exact f32
// sums of its original values per 32, block_sums + t·ld_blocks (for weights with a per-block min, whose min term m·Σx
// is taken from the exact sums), and the sums of the quantized values x̂ per 16 elements, group_sums + 2t·ld_blocks
// (Q6_K's offset: Σ(q - 32)·x̂ = Σq·x̂ - 32·Σx̂ lets its unsigned quants go straight into maddubs / vpdpbusd).
// The one-pass kernels (Activations::Q8Fast) read only the first pass q with its own step, d1 + t·ld_blocks
// (max|x| / 127), and the sums per 16 of that pass's values, group_sums1 + 2t·ld_blocks.
struct Q8Acts {
    const int8_t * q;
    const int8_t * qr;
    const float *  d;
    const float *  block_sums;
    const float *  group_sums;
    int64_t        ldq;
    int64_t        ld_blocks;
    const float *  d1;
    const float *  group_sums1;
};

// One weight row of n elements against nt (1..4) quantized activation rows: out[t·out_stride] = Σ_blocks
// d_w·d_x·Σ q_w·q_x (+ min terms).
using RowDotQ8Fn = void (*)(const void * w_row, const Q8Acts & act, int nt, int64_t n, float * out, int64_t out_stride);

// The 8-bit kernels of these types prefetch their own weights, a fixed distance ahead of each super-block
// (kWeightPrefetchBytes, quants-dot-avx2-impl.h): the caller requests only the first that many bytes of a row range.
inline bool q8_kernel_prefetches(GgmlType type) {
    return type == GgmlType::Q4_K || type == GgmlType::Q5_K || type == GgmlType::Q6_K;
}
constexpr int64_t kQ8KernelPrefetchBytes = 2048;

// Only AVX2 kernels exist: without AVX2 (or for f32 / f16 / bf16 weights) the decode path keeps f32 activations.
#if defined(KC_X86)
// AVX2 kernels (quants-dot-avx2.cpp); nullptr for types without an integer kernel (f32, f16, bf16).
RowDotQ8Fn row_dot_q8_fn_avx2(GgmlType type);
// One-pass kernels (Activations::Q8Fast's decode): Σ_blocks d_w·d1·Σ q_w·q (+ min terms), x̂ = d1·q per 32
// (|x - x̂| <= d1 / 2, llama.cpp's Q8_0 rounding), one vpdpbusd / maddubs per 32 weights and token instead of two.
// Only Q4_K, Q5_K and Q6_K (nullptr for the other types). The AVX2, AVX-VNNI and AVX512-VNNI versions give the same
// bits: their int32 sums are exact and their f32 steps per output the same, in the same order (the zmm kernel's
// lanes 0-7 / 8-15 are the ymm kernels' two accumulators).
RowDotQ8Fn row_dot_q8_onepass_fn_avx2(GgmlType type);
#if defined(KC_AVXVNNI)
// The same kernels with AVX-VNNI (quants-dot-avxvnni.cpp); only once cpu_features().avx_vnni is true.
RowDotQ8Fn row_dot_q8_fn_avxvnni(GgmlType type);
RowDotQ8Fn row_dot_q8_onepass_fn_avxvnni(GgmlType type);
#endif
#if defined(KC_AVX512VNNI)
// The one-pass kernels on 512-bit vectors (quants-dot-avx512vnni.cpp); only once cpu_features().avx512_vnni.
RowDotQ8Fn row_dot_q8_onepass_fn_avx512vnni(GgmlType type);
// The two-pass (default q8) kernels of Q4_K, Q5_K and Q6_K on 512-bit vectors, nullptr for the other types: the
// same bits as the AVX-VNNI / AVX2 ones (exact int32 sums, the same f32 steps per lane in the same order).
RowDotQ8Fn row_dot_q8_kquant_fn_avx512vnni(GgmlType type);
#endif
// Quantizes n (a multiple of 32) f32 values x into q[n], the residual qr[n], the combined step d[n/32] (d_x / 256),
// sums[n/32] (Σ of the f32 values) and group_sums[n/16] (Σ of the quantized values per 16: step·Σ(256·q + qr), the
// integer sum exact, one rounding). Rounding: x·(1/d_x) in f32 to nearest, ties to even; the residual x - d_x·q is
// rounded once to f32, then (x - d_x·q)·(256/d_x) to nearest and saturated to ±127. Where d1 is given, also the
// first pass's step d1[n/32] (d_x) and group_sums1[n/16] (d_x·Σq per 16, the integer sum exact, one rounding).
void quantize_q8_avx2(const float * x, int64_t n, int8_t * q, int8_t * qr, float * d, float * sums, float * group_sums,
                      float * d1 = nullptr, float * group_sums1 = nullptr);
#endif

}  // namespace kvcmas::cpu::detail
