// AVX2 + FMA + F16C matrix-product kernels (compiled with -mavx2 -mfma -mf16c; called only after the run-time
// check): decode dot products of f32 activations straight from the stored blocks, and the f32 register-blocked tile
// kernel of the prefill path.
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

#include "backend/cpu/matmul-impl.h"

namespace kvcmas::cpu::detail {
namespace {

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s        = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s        = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256i loadu256(const void * p) { return _mm256_loadu_si256(static_cast<const __m256i *>(p)); }

// ---- decode dot products: one weight row × NT f32 activation rows ---------------------------------------------------
// Quantized rows: each 32-element (sub-)block is unpacked to 4 × 8 f32 lanes of its integer quants (offsets such as
// Q4_0's -8 applied in the integer domain, so the lanes hold the exact values), dotted with x in f32, and the block
// sum is scaled by the block's f32 scale; a per-block min m adds m·Σx with Σx from DecodeActs::block_sums. This is
// dequantize(w)·x up to the order of the f32 additions.

template <int NT>
struct XRows {
    const float * p[NT];
    explicit XRows(const DecodeActs & a) {
        for (int t = 0; t < NT; ++t) {
            p[t] = a.x + t * a.ldx;
        }
    }
};

template <int NT>
void dot_f32(const void * w_row, const DecodeActs & a, int64_t n, float * out, int64_t os) {
    const auto *  w = static_cast<const float *>(w_row);
    XRows<NT>     x(a);
    // Independent accumulators per token to cover FMA latency; as many for every NT, so a token's sum is added in
    // the same order however many tokens share the pass (a sequence's logits do not depend on its batch).
    constexpr int U = 2;
    __m256        acc[NT][U];
    for (int t = 0; t < NT; ++t) {
        for (int u = 0; u < U; ++u) {
            acc[t][u] = _mm256_setzero_ps();
        }
    }
    int64_t i = 0;
    for (; i + 8 * U <= n; i += 8 * U) {
        for (int u = 0; u < U; ++u) {
            const __m256 wv = _mm256_loadu_ps(w + i + 8 * u);
            for (int t = 0; t < NT; ++t) {
                acc[t][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.p[t] + i + 8 * u), acc[t][u]);
            }
        }
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 wv = _mm256_loadu_ps(w + i);
        for (int t = 0; t < NT; ++t) {
            acc[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.p[t] + i), acc[t][0]);
        }
    }
    for (int t = 0; t < NT; ++t) {
        for (int u = 1; u < U; ++u) {
            acc[t][0] = _mm256_add_ps(acc[t][0], acc[t][u]);
        }
        float s = hsum(acc[t][0]);
        for (int64_t k = i; k < n; ++k) {
            s += w[k] * x.p[t][k];
        }
        out[t * os] = s;
    }
}

// F16 and BF16 rows: widen 8 elements at a time to f32, then as dot_f32.
inline __m256 load_f16x8(const uint16_t * p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}
inline __m256 load_bf16x8(const uint16_t * p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline float bf16_scalar(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float          f;
    std::memcpy(&f, &bits, 4);
    return f;
}

template <int NT, bool BF>
void dot_half(const void * w_row, const DecodeActs & a, int64_t n, float * out, int64_t os) {
    const auto *  w = static_cast<const uint16_t *>(w_row);
    XRows<NT>     x(a);
    constexpr int U = 2;  // as dot_f32: the same for every NT
    __m256        acc[NT][U];
    for (int t = 0; t < NT; ++t) {
        for (int u = 0; u < U; ++u) {
            acc[t][u] = _mm256_setzero_ps();
        }
    }
    int64_t i = 0;
    for (; i + 8 * U <= n; i += 8 * U) {
        for (int u = 0; u < U; ++u) {
            const __m256 wv = BF ? load_bf16x8(w + i + 8 * u) : load_f16x8(w + i + 8 * u);
            for (int t = 0; t < NT; ++t) {
                acc[t][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.p[t] + i + 8 * u), acc[t][u]);
            }
        }
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 wv = BF ? load_bf16x8(w + i) : load_f16x8(w + i);
        for (int t = 0; t < NT; ++t) {
            acc[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.p[t] + i), acc[t][0]);
        }
    }
    for (int t = 0; t < NT; ++t) {
        for (int u = 1; u < U; ++u) {
            acc[t][0] = _mm256_add_ps(acc[t][0], acc[t][u]);
        }
        float s = hsum(acc[t][0]);
        for (int64_t k = i; k < n; ++k) {
            s += (BF ? bf16_scalar(w[k]) : h2f(w[k])) * x.p[t][k];
        }
        out[t * os] = s;
    }
}
template <int NT>
void dot_f16(const void * w, const DecodeActs & a, int64_t n, float * o, int64_t os) {
    dot_half<NT, false>(w, a, n, o, os);
}
template <int NT>
void dot_bf16(const void * w, const DecodeActs & a, int64_t n, float * o, int64_t os) {
    dot_half<NT, true>(w, a, n, o, os);
}

// ---- quantized rows: unpacking ----------------------------------------------------------------------------------
// The quants are widened straight from memory, 8 bytes to 8 dword lanes (one shuffle per 8 elements, the scarce
// resource here); nibbles and high bits are then picked out with shifts and masks in the dword lanes, which every
// integer pipe runs.

// Bytes p[0..7] zero- / sign-extended to 8 dwords.
inline __m256i u8x8_epi32(const uint8_t * p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
}
inline __m256i i8x8_epi32(const int8_t * p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
}
inline __m256 u8x8_to_ps(const uint8_t * p) { return _mm256_cvtepi32_ps(u8x8_epi32(p)); }

// Bit `Bit` of every dword of v moved to bit 4 (0x10 or 0).
template <int Bit>
inline __m256i bit_to_0x10(__m256i v) {
    const __m256i moved = Bit >= 4 ? _mm256_srli_epi32(v, Bit - 4) : _mm256_slli_epi32(v, 4 - Bit);
    return _mm256_and_si256(moved, _mm256_set1_epi32(0x10));
}

// Elements 0..31 of a nibble block (element j < 16: low nibble of qs[j], j >= 16: high nibble of qs[j - 16]) as
// dwords in element order, 8 per vector.
inline void nibbles_epi32(const uint8_t * qs, __m256i q[4]) {
    const __m256i lo = u8x8_epi32(qs), hi = u8x8_epi32(qs + 8), mask = _mm256_set1_epi32(0x0F);
    q[0]             = _mm256_and_si256(lo, mask);
    q[1]             = _mm256_and_si256(hi, mask);
    q[2]             = _mm256_srli_epi32(lo, 4);
    q[3]             = _mm256_srli_epi32(hi, 4);
}

// Bit j of the little-endian 32 bits at qh, for j = 8p + lane, moved to bit 4 of q[p]'s lanes and or-ed in.
inline void or_high_bits(const uint8_t * qh, __m256i q[4]) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    const __m256i shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i b      = _mm256_set1_epi32(static_cast<int>(bits << 4));  // bit j at bit j + 4 (j < 28)
    const __m256i b_hi   = _mm256_set1_epi32(static_cast<int>(bits >> 4));  // bit j at bit j - 4 (j >= 4)
    const __m256i m      = _mm256_set1_epi32(0x10);
    q[0] = _mm256_or_si256(q[0], _mm256_and_si256(_mm256_srlv_epi32(b, shifts), m));
    q[1] = _mm256_or_si256(q[1], _mm256_and_si256(_mm256_srlv_epi32(b_hi, shifts), m));
    q[2] = _mm256_or_si256(q[2], _mm256_and_si256(_mm256_srlv_epi32(b_hi, _mm256_add_epi32(shifts, _mm256_set1_epi32(8))), m));
    q[3] = _mm256_or_si256(q[3], _mm256_and_si256(_mm256_srlv_epi32(b_hi, _mm256_add_epi32(shifts, _mm256_set1_epi32(16))), m));
}

// Integer dwords minus Offset, to f32 (exact: small integers).
template <int Offset>
inline __m256 epi32_to_ps_minus(__m256i q) {
    return _mm256_cvtepi32_ps(Offset != 0 ? _mm256_sub_epi32(q, _mm256_set1_epi32(Offset)) : q);
}
template <int Offset>
inline void epi32_to_ps(const __m256i q[4], __m256 f[4]) {
    for (int p = 0; p < 4; ++p) {
        f[p] = epi32_to_ps_minus<Offset>(q[p]);
    }
}

// Σ_l q[l]·x[l] over 32 elements as 8 lanes, per token; x rows offset by k.
template <int NT>
inline void dot32(const __m256 q[4], const XRows<NT> & x, int64_t k, __m256 s[NT]) {
    for (int t = 0; t < NT; ++t) {
        const float * xt = x.p[t] + k;
        const __m256  a  = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xt + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(xt)));
        const __m256  b  = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xt + 24), _mm256_mul_ps(q[2], _mm256_loadu_ps(xt + 16)));
        s[t]             = _mm256_add_ps(a, b);
    }
}

// ---- quantized rows: the 32-element block types -------------------------------------------------------------------
// quants() gives the 32 integer values of (w - m)/d as f32 (m = 0 without a min; offsets applied as integers).
template <typename Block, int Offset, bool HasHigh, bool HasMin>
struct Q32 {
    static constexpr bool kHasMin = HasMin;
    static inline void    quants(const Block & b, __m256 f[4]) {
        if constexpr (std::is_same_v<Block, BlockQ8_0>) {
            for (int p = 0; p < 4; ++p) {
                f[p] = _mm256_cvtepi32_ps(i8x8_epi32(b.qs + 8 * p));
            }
        } else {
            __m256i q[4];
            nibbles_epi32(b.qs, q);
            if constexpr (HasHigh) {
                or_high_bits(b.qh, q);
            }
            epi32_to_ps<Offset>(q, f);
        }
    }
    // d in lane 0; the min in lane 0 of `m` (d and m are adjacent f16s, converted in one op).
    static inline __m128 scales(const Block & b, __m128 & m) {
        if constexpr (HasMin) {
            uint32_t dm;
            std::memcpy(&dm, &b.d, 4);
            const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
            m              = _mm_movehdup_ps(v);
            return v;
        } else {
            m = _mm_setzero_ps();
            return _mm_cvtph_ps(_mm_cvtsi32_si128(b.d));
        }
    }
};

// Two blocks per step with separate accumulators (and min sums), so that the FMA latency chains overlap.
template <typename Q, typename Block, int NT>
void dot_q32(const void * w_row, const DecodeActs & a, int64_t n, float * out, int64_t os) {
    const auto * b = static_cast<const Block *>(w_row);
    XRows<NT>    x(a);
    __m256       acc[NT][2];
    __m128       corr[NT][2];  // Σ m·Σx in lane 0
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        corr[t][0] = corr[t][1] = _mm_setzero_ps();
    }
    const int64_t nb   = n / 32;
    const auto    step = [&](int64_t i, int u) {
        __m256 q[4], s[NT];
        Q::quants(b[i], q);
        __m128       m;
        const __m256 d = _mm256_broadcastss_ps(Q::scales(b[i], m));
        dot32<NT>(q, x, 32 * i, s);
        for (int t = 0; t < NT; ++t) {
            acc[t][u] = _mm256_fmadd_ps(s[t], d, acc[t][u]);
            if constexpr (Q::kHasMin) {
                corr[t][u] = _mm_fmadd_ss(m, _mm_load_ss(a.block_sums + t * a.ld_sums + i), corr[t][u]);
            }
        }
    };
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        step(i, 0);
        step(i + 1, 1);
    }
    if (i < nb) {
        step(i, 0);
    }
    for (int t = 0; t < NT; ++t) {
        out[t * os] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) + _mm_cvtss_f32(_mm_add_ss(corr[t][0], corr[t][1]));
    }
}

template <int NT>
void dot_q8_0(const void * w, const DecodeActs & a, int64_t n, float * o, int64_t os) {
    dot_q32<Q32<BlockQ8_0, 0, false, false>, BlockQ8_0, NT>(w, a, n, o, os);
}
template <int NT>
void dot_q4_0(const void * w, const DecodeActs & a, int64_t n, float * o, int64_t os) {
    dot_q32<Q32<BlockQ4_0, 8, false, false>, BlockQ4_0, NT>(w, a, n, o, os);
}
template <int NT>
void dot_q4_1(const void * w, const DecodeActs & a, int64_t n, float * o, int64_t os) {
    dot_q32<Q32<BlockQ4_1, 0, false, true>, BlockQ4_1, NT>(w, a, n, o, os);
}
template <int NT>
void dot_q5_0(const void * w, const DecodeActs & a, int64_t n, float * o, int64_t os) {
    dot_q32<Q32<BlockQ5_0, 16, true, false>, BlockQ5_0, NT>(w, a, n, o, os);
}
template <int NT>
void dot_q5_1(const void * w, const DecodeActs & a, int64_t n, float * o, int64_t os) {
    dot_q32<Q32<BlockQ5_1, 0, true, true>, BlockQ5_1, NT>(w, a, n, o, os);
}

// ---- quantized rows: K-quants ---------------------------------------------------------------------------------------

// Q4_K / Q5_K: sub-block j's dot is scaled by d·sc_j (the f32 product dequantization uses); the mins add
// -(dmin·m_j)·Σx_j, eight sub-blocks at once in vector lanes.
template <typename Block, bool HasHigh, int NT, int C>
inline void k4_chunk(const Block & blk, const __m256i * qh, const float * dsc, const XRows<NT> & x, int64_t k0,
                     __m256 acc[NT][2]) {
    // qs[32C + l]: low nibble = sub-block 2C, high nibble = sub-block 2C + 1, element l.
    __m256i raw[4], q[2][4];
    for (int p = 0; p < 4; ++p) {
        raw[p]  = u8x8_epi32(blk.qs + 32 * C + 8 * p);
        q[0][p] = _mm256_and_si256(raw[p], _mm256_set1_epi32(0x0F));
        q[1][p] = _mm256_srli_epi32(raw[p], 4);
        if constexpr (HasHigh) {
            q[0][p] = _mm256_or_si256(q[0][p], bit_to_0x10<2 * C>(qh[p]));
            q[1][p] = _mm256_or_si256(q[1][p], bit_to_0x10<2 * C + 1>(qh[p]));
        }
    }
    for (int u = 0; u < 2; ++u) {
        __m256 f[4], s[NT];
        epi32_to_ps<0>(q[u], f);
        dot32<NT>(f, x, k0 + 32 * (2 * C + u), s);
        const __m256 scale = _mm256_broadcast_ss(dsc + 2 * C + u);
        for (int t = 0; t < NT; ++t) {
            acc[t][u] = _mm256_fmadd_ps(s[t], scale, acc[t][u]);
        }
    }
}

template <typename Block, bool HasHigh, int NT>
void dot_k4(const void * w_row, const DecodeActs & a, int64_t n, float * out, int64_t os) {
    const auto * b = static_cast<const Block *>(w_row);
    XRows<NT>    x(a);
    __m256       acc[NT][2], corr[NT];
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = acc[t][1] = corr[t] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n / 256; ++i) {
        const ScalesMinsK4 sm = k4_scales_mins(b[i].scales);
        alignas(32) float  dsc[8];
        _mm256_store_ps(dsc, _mm256_mul_ps(_mm256_set1_ps(h2f(b[i].d)), u8x8_to_ps(sm.b)));
        const __m256 dmn = _mm256_mul_ps(_mm256_set1_ps(h2f(b[i].dmin)), u8x8_to_ps(sm.b + 8));
        __m256i      qh[4];  // qh[l] for l = 8p + lane, bit j = sub-block j's bit 4
        if constexpr (HasHigh) {
            for (int p = 0; p < 4; ++p) {
                qh[p] = u8x8_epi32(b[i].qh + 8 * p);
            }
        }
        const int64_t k0 = 256 * i;
        k4_chunk<Block, HasHigh, NT, 0>(b[i], qh, dsc, x, k0, acc);
        k4_chunk<Block, HasHigh, NT, 1>(b[i], qh, dsc, x, k0, acc);
        k4_chunk<Block, HasHigh, NT, 2>(b[i], qh, dsc, x, k0, acc);
        k4_chunk<Block, HasHigh, NT, 3>(b[i], qh, dsc, x, k0, acc);
        for (int t = 0; t < NT; ++t) {
            corr[t] = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(a.block_sums + t * a.ld_sums + 8 * i), corr[t]);
        }
    }
    for (int t = 0; t < NT; ++t) {
        out[t * os] = hsum(_mm256_sub_ps(_mm256_add_ps(acc[t][0], acc[t][1]), corr[t]));
    }
}
template <int NT>
void dot_q4_k(const void * w, const DecodeActs & a, int64_t n, float * o, int64_t os) {
    dot_k4<BlockQ4_K, false, NT>(w, a, n, o, os);
}
template <int NT>
void dot_q5_k(const void * w, const DecodeActs & a, int64_t n, float * o, int64_t os) {
    dot_k4<BlockQ5_K, true, NT>(w, a, n, o, os);
}

// Q6_K, half h, 32-element chunk C (elements 128h + 32C + l): low 4 bits from the nibble C/2 of ql[64h + 32(C%2) + l],
// high 2 bits from bits 2C of qh[32h + l]; value q - 32. Its two 16-element groups have scales d·scale[8h + 2C + 0/1].
template <int NT, int C>
inline void q6_chunk(const uint8_t * ql, const __m256i * qh, const float * dsc, const XRows<NT> & x, int64_t k,
                     __m256 acc[NT][2]) {
    __m256 f[4];
    for (int p = 0; p < 4; ++p) {
        const __m256i l  = u8x8_epi32(ql + 32 * (C % 2) + 8 * p);
        const __m256i lo = C / 2 == 0 ? _mm256_and_si256(l, _mm256_set1_epi32(0x0F)) : _mm256_srli_epi32(l, 4);
        const __m256i hi = _mm256_and_si256(C <= 2 ? _mm256_slli_epi32(qh[p], 4 - 2 * C) : _mm256_srli_epi32(qh[p], 2),
                                            _mm256_set1_epi32(0x30));
        f[p]             = epi32_to_ps_minus<32>(_mm256_or_si256(lo, hi));
    }
    const __m256 s0 = _mm256_broadcast_ss(dsc + 2 * C), s1 = _mm256_broadcast_ss(dsc + 2 * C + 1);
    for (int t = 0; t < NT; ++t) {
        const float * xt = x.p[t] + k + 32 * C;
        const __m256  va = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xt + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xt)));
        const __m256  vb = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xt + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(xt + 16)));
        acc[t][0]        = _mm256_fmadd_ps(va, s0, acc[t][0]);
        acc[t][1]        = _mm256_fmadd_ps(vb, s1, acc[t][1]);
    }
}

template <int NT>
void dot_q6_k(const void * w_row, const DecodeActs & a, int64_t n, float * out, int64_t os) {
    const auto * b = static_cast<const BlockQ6_K *>(w_row);
    XRows<NT>    x(a);
    __m256       acc[NT][2];
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n / 256; ++i) {
        alignas(32) float dsc[16];
        const __m256      d = _mm256_set1_ps(h2f(b[i].d));
        _mm256_store_ps(dsc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(i8x8_epi32(b[i].scales))));
        _mm256_store_ps(dsc + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(i8x8_epi32(b[i].scales + 8))));
        for (int h = 0; h < 2; ++h) {
            __m256i qh[4];
            for (int p = 0; p < 4; ++p) {
                qh[p] = u8x8_epi32(b[i].qh + 32 * h + 8 * p);
            }
            const uint8_t * ql = b[i].ql + 64 * h;
            const int64_t   k  = 256 * i + 128 * h;
            q6_chunk<NT, 0>(ql, qh, dsc + 8 * h, x, k, acc);
            q6_chunk<NT, 1>(ql, qh, dsc + 8 * h, x, k, acc);
            q6_chunk<NT, 2>(ql, qh, dsc + 8 * h, x, k, acc);
            q6_chunk<NT, 3>(ql, qh, dsc + 8 * h, x, k, acc);
        }
    }
    for (int t = 0; t < NT; ++t) {
        out[t * os] = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
    }
}

#define KC_ROW_DOT(name)                                                                                         \
    void name##_rows(const void * w, const DecodeActs & a, int nt, int64_t n, float * o, int64_t os) {          \
        switch (nt) {                                                                                            \
            case 1: name<1>(w, a, n, o, os); break;                                                              \
            case 2: name<2>(w, a, n, o, os); break;                                                              \
            case 3: name<3>(w, a, n, o, os); break;                                                              \
            default: name<4>(w, a, n, o, os); break;                                                             \
        }                                                                                                        \
    }
KC_ROW_DOT(dot_f32)
KC_ROW_DOT(dot_f16)
KC_ROW_DOT(dot_bf16)
KC_ROW_DOT(dot_q8_0)
KC_ROW_DOT(dot_q4_0)
KC_ROW_DOT(dot_q4_1)
KC_ROW_DOT(dot_q5_0)
KC_ROW_DOT(dot_q5_1)
KC_ROW_DOT(dot_q4_k)
KC_ROW_DOT(dot_q5_k)
KC_ROW_DOT(dot_q6_k)
#undef KC_ROW_DOT

// ---- prefill tile kernel ----------------------------------------------------------------------------------------

// Outer-product (broadcast) form, as BLIS does it: the weight tile is packed into panels of 16 rows laid out
// [k][16], so one k step loads 2 vectors of weights (L1-resident panel) and broadcasts one activation per token
// (streamed from L2): 12 FMAs per 8 loads, and only 6 floats per 12 FMAs come from L2.
constexpr int     kPanelVecs = 2;  // vectors of 8 weight rows per packed panel
constexpr int     kPanelRows = 8 * kPanelVecs;
constexpr int     kMicroT    = 6;  // tokens per micro tile: 6 × 2 accumulators + 2 weights + 1 broadcast = 15 ymm
constexpr int64_t kBlockK    = 256;  // k block: a panel slice of it is 16 KiB, half of L1
constexpr int     kBlockT    = 96;  // token block: its k-block slice of activations (96 KiB) stays in L2

// yt[r] (+)= v[r / 8][r % 8] for r < nr.
inline void store_panel_row(float * yt, const __m256 * v, int nr, bool accumulate) {
    if (nr == kPanelRows) {
#pragma GCC unroll 4
        for (int i = 0; i < kPanelVecs; ++i) {
            const __m256 r = accumulate ? _mm256_add_ps(v[i], _mm256_loadu_ps(yt + 8 * i)) : v[i];
            _mm256_storeu_ps(yt + 8 * i, r);
        }
        return;
    }
    alignas(32) float tmp[kPanelRows];
#pragma GCC unroll 4
    for (int i = 0; i < kPanelVecs; ++i) {
        _mm256_store_ps(tmp + 8 * i, v[i]);
    }
    for (int r = 0; r < nr; ++r) {
        yt[r] = accumulate ? yt[r] + tmp[r] : tmp[r];
    }
}

// y[t·ldy + r] (+)= Σ_k x[t·ldx + k] · panel[k·kPanelRows + r] for t < NT, r < nr (≤ kPanelRows).
template <int NT>
void micro_bcast(const float * panel, const float * x, int64_t ldx, int64_t kn, float * y, int64_t ldy, int nr,
                 bool accumulate) {
    __m256 c[NT][kPanelVecs];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
#pragma GCC unroll 4
        for (int i = 0; i < kPanelVecs; ++i) {
            c[t][i] = _mm256_setzero_ps();
        }
    }
    for (int64_t k = 0; k < kn; ++k) {
        __m256 b[kPanelVecs];
#pragma GCC unroll 4
        for (int i = 0; i < kPanelVecs; ++i) {
            b[i] = _mm256_load_ps(panel + kPanelRows * k + 8 * i);
        }
#pragma GCC unroll 8
        for (int t = 0; t < NT; ++t) {
            const __m256 a = _mm256_broadcast_ss(x + t * ldx + k);
#pragma GCC unroll 4
            for (int i = 0; i < kPanelVecs; ++i) {
                c[t][i] = _mm256_fmadd_ps(a, b[i], c[t][i]);
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
        store_panel_row(y + t * ldy, c[t], nr, accumulate);
    }
}

using MicroFn = void (*)(const float *, const float *, int64_t, int64_t, float *, int64_t, int, bool);
constexpr MicroFn kMicroAll[] = { nullptr,        micro_bcast<1>, micro_bcast<2>, micro_bcast<3>,
                                  micro_bcast<4>, micro_bcast<5>, micro_bcast<6> };
static_assert(kMicroT <= 6, "micro tiles of up to 6 tokens");
const MicroFn * const kMicro = kMicroAll;

// A grow-only 64-byte aligned per-thread buffer for the packed panels.
struct PanelBuffer {
    float * data     = nullptr;
    size_t  capacity = 0;
    ~PanelBuffer() { std::free(data); }
    float * get(size_t floats) {
        if (floats > capacity) {
            std::free(data);
            capacity = (floats + 15) & ~size_t(15);
            data     = static_cast<float *>(std::aligned_alloc(64, capacity * sizeof(float)));
            if (data == nullptr) {
                capacity = 0;
                throw std::bad_alloc();
            }
        }
        return data;
    }
};
thread_local PanelBuffer tl_panels;

// Transposes the 8×8 block v (rows) in place into columns.
inline void transpose8(__m256 v[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
    const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
    const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    v[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    v[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    v[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    v[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    v[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    v[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    v[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    v[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// dst[k·16 + r] = rows[r·ld + k] for r < rn (≤ 16), zero for rn ≤ r < 16; k < n. Whole 8×8 blocks transposed in
// registers (contiguous loads and stores), the k tail element by element.
void pack_panel(const float * rows, int64_t ld, int rn, int64_t n, float * dst) {
    const int64_t n8 = n & ~int64_t(7);
    for (int h = 0; h < 2; ++h) {
        for (int64_t k = 0; k < n8; k += 8) {
            __m256 v[8];
            for (int r = 0; r < 8; ++r) {
                const int row = 8 * h + r;
                v[r]          = row < rn ? _mm256_loadu_ps(rows + row * ld + k) : _mm256_setzero_ps();
            }
            transpose8(v);
            for (int j = 0; j < 8; ++j) {
                _mm256_store_ps(dst + (k + j) * kPanelRows + 8 * h, v[j]);
            }
        }
    }
    for (int64_t k = n8; k < n; ++k) {
        for (int r = 0; r < kPanelRows; ++r) {
            dst[k * kPanelRows + r] = r < rn ? rows[r * ld + k] : 0.0f;
        }
    }
}

}  // namespace

const float * pack_panels_avx2(const float * w, int64_t ldw, int nr, int64_t n) {
    static_assert(kPanelRows == kGemmPanelRows, "packed panel layout");
    const int n_panels = (nr + kPanelRows - 1) / kPanelRows;
    float *   packed   = tl_panels.get(static_cast<size_t>(n_panels) * kPanelRows * static_cast<size_t>(n));
    for (int p = 0; p < n_panels; ++p) {
        float *   dst = packed + static_cast<size_t>(p) * kPanelRows * static_cast<size_t>(n);
        const int rn  = nr - p * kPanelRows < kPanelRows ? nr - p * kPanelRows : kPanelRows;
        pack_panel(w + p * kPanelRows * ldw, ldw, rn, n, dst);
    }
    return packed;
}

void gemm_tile_avx2(const float * w, int64_t ldw, int nr, const float * x, int64_t ldx, int nt, int64_t n, float * y,
                    int64_t ldy) {
    const int     n_panels = (nr + kPanelRows - 1) / kPanelRows;
    const float * packed   = pack_panels_avx2(w, ldw, nr, n);
    // k blocks outer, then token blocks (their activation slice stays in L2 across all panels), then panels (a
    // panel slice stays in L1 across the token block), then micro tiles.
    for (int64_t k0 = 0; k0 < n; k0 += kBlockK) {
        const int64_t kn = n - k0 < kBlockK ? n - k0 : kBlockK;
        for (int tb = 0; tb < nt; tb += kBlockT) {
            const int te = nt - tb < kBlockT ? nt : tb + kBlockT;
            for (int p = 0; p < n_panels; ++p) {
                const float * panel =
                    packed + static_cast<size_t>(p) * kPanelRows * static_cast<size_t>(n) + k0 * kPanelRows;
                const int rn = nr - p * kPanelRows < kPanelRows ? nr - p * kPanelRows : kPanelRows;
                for (int t0 = tb; t0 < te; t0 += kMicroT) {
                    const int tn = te - t0 < kMicroT ? te - t0 : kMicroT;
                    kMicro[tn](panel, x + t0 * ldx + k0, ldx, kn, y + t0 * ldy + p * kPanelRows, ldy, rn, k0 > 0);
                }
            }
        }
    }
}

RowDotFn row_dot_fn_avx2(GgmlType type) {
    switch (type) {
        case GgmlType::F32: return dot_f32_rows;
        case GgmlType::F16: return dot_f16_rows;
        case GgmlType::BF16: return dot_bf16_rows;
        case GgmlType::Q4_0: return dot_q4_0_rows;
        case GgmlType::Q4_1: return dot_q4_1_rows;
        case GgmlType::Q5_0: return dot_q5_0_rows;
        case GgmlType::Q5_1: return dot_q5_1_rows;
        case GgmlType::Q8_0: return dot_q8_0_rows;
        case GgmlType::Q4_K: return dot_q4_k_rows;
        case GgmlType::Q5_K: return dot_q5_k_rows;
        case GgmlType::Q6_K: return dot_q6_k_rows;
        default: return row_dot_fn_lowbit(type);  // portable kernels only
    }
}

}  // namespace kvcmas::cpu::detail
