// The low-bit weight types of llama.cpp's smaller files (Q2_K, Q3_K, IQ4_NL, IQ4_XS: what Q2_K, Q3_K_M and IQ4_XS
// files hold, IQ4_NL being their stand-in for rows that are not whole 256-element blocks): portable kernels,
// dequantization bit-identical to gguf-py's and an f32-activation decode row dot over each block dequantized.
// Prefill dequantizes tiles for the GEMM like every other type; all four also have 8-bit activation decode kernels
// (quants-dot-avx2-impl.h).
#include <cstdint>

#include "backend/cpu/matmul-impl.h"
#include "backend/cpu/quants-mxfp4.h"
#include "backend/cpu/quants.h"

namespace kvcmas::cpu::detail {
namespace {

constexpr int kQK = 256;  // elements of a K-quant / IQ4_XS block

void dequant_q2_k(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ2_K *>(src);
    for (int64_t i = 0; i < n / kQK; ++i) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        // group g of 16 (scales[g]): half g / 8 of qs, bit pair (g % 8) / 2, bytes 16·(g % 2) ..
        for (int g = 0; g < 16; ++g, dst += 16) {
            const uint8_t   sc = b[i].scales[g];
            const float     dl = d * static_cast<float>(sc & 0x0F), ml = dmin * static_cast<float>(sc >> 4);
            const uint8_t * q  = b[i].qs + 32 * (g / 8) + 16 * (g % 2);
            const int       sh = 2 * ((g % 8) / 2);
            for (int l = 0; l < 16; ++l) {
                dst[l] = dl * static_cast<float>((q[l] >> sh) & 3) - ml;
            }
        }
    }
}

void dequant_q3_k(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockQ3_K *>(src);
    for (int64_t i = 0; i < n / kQK; ++i) {
        const float d = fp16_to_fp32(b[i].d);
        for (int g = 0; g < 16; ++g, dst += 16) {
            const float     dl  = d * static_cast<float>(q3_k_scale(b[i], g) - 32);
            const uint8_t * q   = b[i].qs + 32 * (g / 8) + 16 * (g % 2);
            const uint8_t * hm  = b[i].hmask + 16 * (g % 2);
            const int       sh  = 2 * ((g % 8) / 2);
            const int       bit = g / 2;  // hmask bit of this group's elements
            for (int l = 0; l < 16; ++l) {
                const int v = ((q[l] >> sh) & 3) - (((hm[l] >> bit) & 1) ? 0 : 4);
                dst[l]      = dl * static_cast<float>(v);
            }
        }
    }
}

// One 32-element IQ4 block: 16 bytes of nibbles (low: elements 0-15, high: 16-31) on the grid, times scale.
void iq4_block32(float scale, const uint8_t * qs, float * dst) {
    for (int l = 0; l < 16; ++l) {
        dst[l]      = scale * static_cast<float>(kIq4Grid[qs[l] & 0x0F]);
        dst[l + 16] = scale * static_cast<float>(kIq4Grid[qs[l] >> 4]);
    }
}

void dequant_iq4_nl(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockIQ4_NL *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        iq4_block32(fp16_to_fp32(b[i].d), b[i].qs, dst);
    }
}

void dequant_iq4_xs(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockIQ4_XS *>(src);
    for (int64_t i = 0; i < n / kQK; ++i) {
        const float d = fp16_to_fp32(b[i].d);
        for (int j = 0; j < 8; ++j, dst += 32) {
            iq4_block32(d * static_cast<float>(iq4_xs_scale(b[i], j) - 32), b[i].qs + 16 * j, dst);
        }
    }
}

// Decode: the row dequantized 256 elements at a time (whole blocks), each chunk dotted with every token's x.
template <typename Block, int kBlockElems, DequantFn Dequant>
void dot_dequantized_rows(const void * w_row, const DecodeActs & a, int nt, int64_t n, float * out, int64_t os) {
    float        acc[4] = { 0, 0, 0, 0 };
    float        w[kQK];
    const auto * blocks = static_cast<const Block *>(w_row);
    for (int64_t k0 = 0; k0 < n; k0 += kQK) {
        const int64_t m = n - k0 < kQK ? n - k0 : kQK;  // IQ4_NL rows may end in a shorter chunk of 32-blocks
        Dequant(blocks + k0 / kBlockElems, w, m);
        for (int t = 0; t < nt; ++t) {
            const float * x    = a.x + t * a.ldx + k0;
            float         s[4] = { 0, 0, 0, 0 };
            for (int64_t l = 0; l < m; l += 4) {
                for (int u = 0; u < 4; ++u) {
                    s[u] += w[l + u] * x[l + u];
                }
            }
            acc[t] += (s[0] + s[1]) + (s[2] + s[3]);
        }
    }
    for (int t = 0; t < nt; ++t) {
        out[t * os] = acc[t];
    }
}

}  // namespace

DequantFn dequant_fn_lowbit(GgmlType type) {
    switch (type) {
        case GgmlType::Q2_K: return dequant_q2_k;
        case GgmlType::Q3_K: return dequant_q3_k;
        case GgmlType::IQ4_NL: return dequant_iq4_nl;
        case GgmlType::IQ4_XS: return dequant_iq4_xs;
        default: return dequant_fn_mxfp4(type);  // quants-mxfp4.cpp
    }
}

RowDotFn row_dot_fn_lowbit(GgmlType type) {
    switch (type) {
        case GgmlType::Q2_K: return dot_dequantized_rows<BlockQ2_K, kQK, dequant_q2_k>;
        case GgmlType::Q3_K: return dot_dequantized_rows<BlockQ3_K, kQK, dequant_q3_k>;
        case GgmlType::IQ4_NL: return dot_dequantized_rows<BlockIQ4_NL, 32, dequant_iq4_nl>;
        case GgmlType::IQ4_XS: return dot_dequantized_rows<BlockIQ4_XS, kQK, dequant_iq4_xs>;
        default: return row_dot_fn_mxfp4(type);  // quants-mxfp4.cpp
    }
}

}  // namespace kvcmas::cpu::detail
