// Private to cpu/: the GGUF block structs, the activation view of the decode path, and the kernel entry
// points shared by the portable files (quants.cpp, matmul.cpp) and the AVX2 files (quants-avx2.cpp,
// matmul-avx2.cpp). The *_avx2 functions exist only on x86 builds (KC_X86) and may only be called once
// cpu_features().avx2_fma_f16c is true.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "backend/cpu/matmul.h"
#include "common/ggml-types.h"

namespace kvcmas::cpu::detail {

// A grow-only, 64-byte aligned scratch buffer; one per thread, reused across calls (no allocation per matmul).
class ScratchBuffer {
  public:
    ~ScratchBuffer() { std::free(data_); }
    void * get(size_t bytes) {
        if (bytes > capacity_) {
            std::free(data_);
            capacity_ = (bytes + 63) & ~size_t(63);
            data_     = std::aligned_alloc(64, capacity_);
            if (data_ == nullptr) {
                capacity_ = 0;
                throw std::bad_alloc();
            }
        }
        return data_;
    }

  private:
    void * data_     = nullptr;
    size_t capacity_ = 0;
};

// ---- weight blocks (ggml layouts; f16 scales stored as raw bits) -------------------------------------------------
// Elements j < 16 of a 32-block live in the low nibbles of qs[j], elements j >= 16 in the high nibbles of qs[j-16];
// for 5-bit types bit j of the little-endian 32-bit qh is element j's bit 4.
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };                      // x = d·(q - 8)
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };                   // x = d·q + m
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };       // x = d·(q - 16)
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };    // x = d·q + m
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };                       // x = d·q
// 256-element super-blocks of 8 sub-blocks of 32, each with a 6-bit scale and min packed into scales[12]
// (see get_scale_min_k4). qs[32c + l] holds sub-block 2c (low nibble) and 2c+1 (high nibble), element l.
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };               // x = d·sc·q - dmin·m
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };  // bit j of qh[l]: sub-block j
// Two halves of 128; in half h element l takes ql[64h + l%64] (nibble l/64) and qh[32h + l%32] (bits 2·(l/32)).
// 16 groups of 16 elements with an int8 scale each; x = d·scale·(q - 32).
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };

static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ5_0) == 22, "block layout");
static_assert(sizeof(BlockQ5_1) == 24 && sizeof(BlockQ8_0) == 34, "block layout");
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "block layout");

// The low-bit types (quants-lowbit.cpp). Q2_K / Q3_K: 16 groups of 16; group g reads 2 bits (shift 2·((g % 8) / 2))
// of qs[32·(g / 8) + 16·(g % 2) + l]; Q3_K's third bit is bit g / 2 of hmask[16·(g % 2) + l] (clear: q - 4), its
// 6-bit scales are nibble g / 8 of scales[g % 8] and bits 2·(g / 4) of scales[8 + g % 4].
struct BlockQ2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };    // x = d·(sc & 15)·q - dmin·(sc >> 4)
struct BlockQ3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };  // x = d·(sc - 32)·q
// IQ4: nibbles (as in the 32-blocks above) index the grid kIq4Grid; IQ4_XS has 8 sub-blocks of 32 with 6-bit scales
// (low 4 bits: nibble j % 2 of scales_l[j / 2]; high 2 bits: bits 2j of scales_h).
struct BlockIQ4_NL { uint16_t d; uint8_t qs[16]; };                                       // x = d·grid[q]
struct BlockIQ4_XS { uint16_t d, scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };      // x = d·(sc - 32)·grid[q]
inline constexpr int8_t kIq4Grid[16] = { -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113 };

static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110, "block layout");
static_assert(sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136, "block layout");

// Group g's 6-bit scale of a Q3_K block (x = d·(scale - 32)·q).
inline int q3_k_scale(const BlockQ3_K & b, int g) {
    return ((b.scales[g % 8] >> (4 * (g / 8))) & 0x0F) | (((b.scales[8 + g % 4] >> (2 * (g / 4))) & 3) << 4);
}

// Sub-block j's 6-bit scale of an IQ4_XS block (x = d·(scale - 32)·grid[q]).
inline int iq4_xs_scale(const BlockIQ4_XS & b, int j) {
    return ((b.scales_l[j / 2] >> (4 * (j % 2))) & 0x0F) | (((b.scales_h >> (2 * j)) & 3) << 4);
}

// Scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
inline void get_scale_min_k4(int j, const uint8_t * s, uint8_t & sc, uint8_t & m) {
    if (j < 4) {
        sc = s[j] & 63;
        m  = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        m  = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// All 8 scales (b[0..7]) and mins (b[8..15]) of a Q4_K / Q5_K super-block, as get_scale_min_k4 reads them one by one,
// unpacked with whole-word masks: sub-blocks 0-3 keep the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks
// 4-7 take a nibble of bytes 8-11 and, as bits 4-5, the top 2 bits of bytes 0-3 / 4-7.
struct ScalesMinsK4 {
    uint8_t b[16];
};
inline ScalesMinsK4 k4_scales_mins(const uint8_t * s) {
    uint32_t u[3];
    std::memcpy(u, s, 12);
    const uint32_t lo6 = 0x3F3F3F3Fu, lo4 = 0x0F0F0F0Fu, lo2 = 0x03030303u;
    const uint32_t w[4] = { u[0] & lo6, (u[2] & lo4) | (((u[0] >> 6) & lo2) << 4), u[1] & lo6,
                            ((u[2] >> 4) & lo4) | (((u[1] >> 6) & lo2) << 4) };
    ScalesMinsK4   out;
    std::memcpy(out.b, w, 16);
    return out;
}

// ---- decode activations -------------------------------------------------------------------------------------------
// nt f32 rows x + t·ldx; for the types whose blocks carry a min (has_block_min: Q4_1, Q5_1, Q4_K, Q5_K) also their
// sums per 32 elements, block_sums[t·ld_sums + i] = Σ x[t][32i .. 32i+31] (computed once per call, so that the
// min term m·Σx costs one multiply per block instead of 32); block_sums is nullptr for the other types.
struct DecodeActs {
    const float * x;
    int64_t       ldx;
    const float * block_sums;
    int64_t       ld_sums;
};
bool has_block_min(GgmlType type);

// ---- kernel signatures ---------------------------------------------------------------------------------------------
// n elements (whole blocks) of a weight row to f32.
using DequantFn = void (*)(const void * src, float * dst, int64_t n);
// Decode: one weight row of n elements against nt (1..4) activation rows; writes out[t·out_stride] =
// dequantize(w_row)·x_t, with f32 products and sums (only the order of the additions differs between kernels).
using RowDotFn = void (*)(const void * w_row, const DecodeActs & act, int nt, int64_t n, float * out,
                          int64_t out_stride);
// Prefill: y[t·ldy + r] = Σ_k x[t·ldx + k]·w[r·ldw + k] for t < nt, r < nr, k < n (w rows 32-byte aligned when
// ldw % 8 == 0).
using GemmTileFn = void (*)(const float * w, int64_t ldw, int nr, const float * x, int64_t ldx, int nt, int64_t n,
                            float * y, int64_t ldy);

// Q2_K, Q3_K, IQ4_NL and IQ4_XS (quants-lowbit.cpp): portable kernels, which the AVX2 selectors return too (their
// fast decode is their 8-bit activation kernel).
// nullptr for other types.
DequantFn dequant_fn_lowbit(GgmlType type);
RowDotFn  row_dot_fn_lowbit(GgmlType type);

// Portable kernels (quants.cpp / matmul.cpp). nullptr for unsupported types.
DequantFn dequant_fn_scalar(GgmlType type);
RowDotFn  row_dot_fn_scalar(GgmlType type);
void      gemm_tile_scalar(const float * w, int64_t ldw, int nr, const float * x, int64_t ldx, int nt, int64_t n,
                           float * y, int64_t ldy);

#if defined(KC_X86)
// AVX2 + FMA + F16C kernels (quants-avx2.cpp / matmul-avx2.cpp).
DequantFn dequant_fn_avx2(GgmlType type);
RowDotFn  row_dot_fn_avx2(GgmlType type);
void      gemm_tile_avx2(const float * w, int64_t ldw, int nr, const float * x, int64_t ldx, int nt, int64_t n,
                         float * y, int64_t ldy);
// The prefill kernels' packed weight layout: rows of w (nr × n, row stride ldw) in panels of kGemmPanelRows rows,
// panel p at p·kGemmPanelRows·n, element [k][r] at k·kGemmPanelRows + r, missing rows zero; 64-byte aligned. The
// buffer is the calling thread's, valid until its next call.
constexpr int kGemmPanelRows = 16;
const float * pack_panels_avx2(const float * w, int64_t ldw, int nr, int64_t n);
#endif
#if defined(KC_AVX512)
// AVX-512 F/BW/DQ/VL (matmul-avx512.cpp): same contract as gemm_tile_avx2; only once cpu_features().avx512.
void gemm_tile_avx512(const float * w, int64_t ldw, int nr, const float * x, int64_t ldx, int nt, int64_t n, float * y,
                      int64_t ldy);
// The packed-panel GEMM of float weights (matmul-packed-avx512.cpp): y = x · wᵀ as matmul() computes it (x
// [n_tok][w.n_in], y [n_tok][w.n_out]), for the types gemm_packed_avx512_supports (F32, F16, BF16); the same bits
// at any thread count and n_tok; only once cpu_features().avx512.
bool gemm_packed_avx512_supports(GgmlType type);
void gemm_packed_avx512(const WeightView & w, const float * x, float * y, int64_t n_tok, ThreadPool & pool);
#endif

}  // namespace kvcmas::cpu::detail
