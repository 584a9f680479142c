// The 8-bit activation kernels, included by quants-dot-avx2.cpp (KC_Q8_VNNI 0: maddubs + madd) and by
// quants-dot-avxvnni.cpp (KC_Q8_VNNI 1: AVX-VNNI vpdpbusd, the same sums in one instruction). Layouts:
// matmul-impl.h; contract: quants-dot.h.
//
// Every weight block is unpacked to 32 bytes of integer quants in element order, multiplied with both passes of the
// activation bytes by maddubs (unsigned × signed bytes -> pairs summed into int16) and summed to int32 lanes by madd
// (or both at once by vpdpbusd); the first pass's sums are weighted by 256 (madd by 256, or a shift) and added to the
// residual's. Weights with signed quants (offsets such as Q4_0's -8 applied first) go through |w| and sign(x, w);
// Q6_K keeps its unsigned quants and subtracts its offset through the activations' sums per 16.
// Nothing overflows: |pair| <= 2·128·127 (Q8_0) in int16, and the int32 lanes stay below 2^25.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstring>

#include "backend/cpu/matmul-impl.h"
#include "backend/cpu/quants-dot.h"

#ifndef KC_Q8_VNNI
#error "define KC_Q8_VNNI (0 or 1) before including quants-dot-avx2-impl.h"
#endif

namespace kvcmas::cpu::detail {
namespace KC_Q8_NS {

inline float h2f(uint16_t h) {
    return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s        = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s        = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s        = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s        = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline __m256i load256(const void * p) {
    return _mm256_loadu_si256(static_cast<const __m256i *>(p));
}
inline __m128i load128(const void * p) {
    return _mm_loadu_si128(static_cast<const __m128i *>(p));
}

// Σ of 4 adjacent products u·(256·s + r) per int32 lane (u unsigned bytes, s and r signed bytes: the two passes).
inline __m256i dot_u8_i8x2(__m256i u, __m256i s, __m256i r) {
#if KC_Q8_VNNI
    const __m256i hi = _mm256_slli_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s), 8);
    return _mm256_dpbusd_avx_epi32(hi, u, r);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(256)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(u, r), _mm256_set1_epi16(1)));
#endif
}

// The K-quant kernels (two-pass and one-pass; q8_kernel_prefetches) prefetch their own weights: each super-block
// requests the lines kWeightPrefetchBytes ahead of it (into the next rows, which the same thread computes next).
// Interleaved with the arithmetic, the requests keep the memory stream busy while the core computes; one burst per row
// (decode_rows' prefetch for the other types) left the two one after the other (docs/prefill-kernels.md, Round 5).
constexpr int64_t kWeightPrefetchBytes = kQ8KernelPrefetchBytes;
template <typename Block>
inline void prefetch_ahead(const Block * blk) {
    const char * p = reinterpret_cast<const char *>(blk) + kWeightPrefetchBytes;
    for (size_t o = 0; o < sizeof(Block); o += 64) {
        __builtin_prefetch(p + o);
    }
}

// Activation rows of one call: row t's bytes of both passes and per-32 steps.
template <int NT>
struct Q8Rows {
    const int8_t * q[NT];
    const int8_t * qr[NT];
    const float *  d[NT];
    const float *  sums[NT];
    const float *  groups[NT];
    explicit Q8Rows(const Q8Acts & a) {
        for (int t = 0; t < NT; ++t) {
            q[t]      = a.q + t * a.ldq;
            qr[t]     = a.qr + t * a.ldq;
            d[t]      = a.d + t * a.ld_blocks;
            sums[t]   = a.block_sums != nullptr ? a.block_sums + t * a.ld_blocks : nullptr;
            groups[t] = a.group_sums != nullptr ? a.group_sums + 2 * t * a.ld_blocks : nullptr;
        }
    }
};

// ---- 32-element block types -------------------------------------------------------------------------------------

// 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0..15) then high nibbles (16..31).
inline __m256i nibbles32(const uint8_t * qs) {
    const __m128i v = load128(qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// Bit j of the little-endian 32 bits at qh as 0x10 in byte j.
inline __m256i high_bits32(const uint8_t * qh) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    // Byte j takes source byte j / 8 (each 128-bit lane holds all four), then tests its bit j % 8.
    const __m256i pick  = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), pick);
    const __m256i bit   = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
    const __m256i set   = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// quants(b): the block's 32 integer quants as bytes (signed when kSigned: w = d·q; else w = d·q + m).
struct Q4_0 {
    using Block                   = BlockQ4_0;
    static constexpr bool kSigned = true;
    static constexpr bool kHasMin = false;
    static __m256i        quants(const Block & b) { return _mm256_sub_epi8(nibbles32(b.qs), _mm256_set1_epi8(8)); }
};
struct Q4_1 {
    using Block                   = BlockQ4_1;
    static constexpr bool kSigned = false;
    static constexpr bool kHasMin = true;
    static __m256i        quants(const Block & b) { return nibbles32(b.qs); }
};
struct Q5_0 {
    using Block                   = BlockQ5_0;
    static constexpr bool kSigned = true;
    static constexpr bool kHasMin = false;
    static __m256i        quants(const Block & b) {
        return _mm256_sub_epi8(_mm256_or_si256(nibbles32(b.qs), high_bits32(b.qh)), _mm256_set1_epi8(16));
    }
};
struct Q5_1 {
    using Block                   = BlockQ5_1;
    static constexpr bool kSigned = false;
    static constexpr bool kHasMin = true;
    static __m256i        quants(const Block & b) { return _mm256_or_si256(nibbles32(b.qs), high_bits32(b.qh)); }
};
struct Q8_0 {
    using Block                   = BlockQ8_0;
    static constexpr bool kSigned = true;
    static constexpr bool kHasMin = false;
    static __m256i        quants(const Block & b) { return load256(b.qs); }
};

// IQ4: the nibbles index the format's signed grid (one byte shuffle per 32 quants).
inline __m256i iq4_quants(const uint8_t * qs) {
    const __m128i grid = load128(kIq4Grid);
    return _mm256_shuffle_epi8(_mm256_set_m128i(grid, grid), nibbles32(qs));
}
struct IQ4_NL {
    using Block                   = BlockIQ4_NL;
    static constexpr bool kSigned = true;
    static constexpr bool kHasMin = false;
    static __m256i        quants(const Block & b) { return iq4_quants(b.qs); }
};

template <typename Q>
float block_min(const typename Q::Block & b) {
    if constexpr (Q::kHasMin) {
        return h2f(b.m);
    } else {
        (void)b;
        return 0.0f;
    }
}

// Two blocks per step into separate accumulators, so that the FMA latency chains overlap.
template <typename Q, int NT>
void dot_q32(const void * w_row, const Q8Acts & a, int64_t n, float * out, int64_t os) {
    const auto * b = static_cast<const typename Q::Block *>(w_row);
    Q8Rows<NT>   x(a);
    __m256       acc[NT][2];
    float        corr[NT];
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        corr[t]               = 0.0f;
    }
    const auto step = [&](int64_t i, int u) {
        const __m256i q  = Q::quants(b[i]);
        const __m256i qa = Q::kSigned ? _mm256_sign_epi8(q, q) : q;
        const float   dw = h2f(b[i].d);
        for (int t = 0; t < NT; ++t) {
            __m256i xq = load256(x.q[t] + 32 * i), xr = load256(x.qr[t] + 32 * i);
            if constexpr (Q::kSigned) {
                xq = _mm256_sign_epi8(xq, q);
                xr = _mm256_sign_epi8(xr, q);
            }
            const __m256 s = _mm256_cvtepi32_ps(dot_u8_i8x2(qa, xq, xr));
            acc[t][u]      = _mm256_fmadd_ps(s, _mm256_set1_ps(dw * x.d[t][i]), acc[t][u]);
            if constexpr (Q::kHasMin) {
                corr[t] += block_min<Q>(b[i]) * x.sums[t][i];
            }
        }
    };
    const int64_t nb = n / 32;
    int64_t       i  = 0;
    for (; i + 2 <= nb; i += 2) {
        step(i, 0);
        step(i + 1, 1);
    }
    if (i < nb) {
        step(i, 0);
    }
    for (int t = 0; t < NT; ++t) {
        out[t * os] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) + corr[t];
    }
}

// ---- K-quants --------------------------------------------------------------------------------------------------

// Q4_K / Q5_K: qs[32C + l] holds element l of sub-block 2C (low nibble) and 2C + 1 (high nibble); Q5_K's bit 4 of
// sub-block j, element l is bit j of qh[l]. Sub-block j adds (d·sc_j·d_x,j)·Σq·x_q - (dmin·m_j)·Σx_j.

// Bit J of every byte of v moved to 0x10 (16-bit shifts: the bit that lands on 4 comes from the same byte).
template <int J>
inline __m256i bit_to_0x10(__m256i v) {
    const __m256i moved = J < 4 ? _mm256_slli_epi16(v, 4 - J) : (J > 4 ? _mm256_srli_epi16(v, J - 4) : v);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

template <typename Block, bool HasHigh, int NT, int C>
inline void k4_pair(const Block & blk, __m256i qh, const float * scale, const Q8Rows<NT> & x, int64_t k0,
                    __m256 acc[NT][2]) {
    const __m256i v  = load256(blk.qs + 32 * C);
    __m256i       lo = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
    __m256i       hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
    if constexpr (HasHigh) {
        lo = _mm256_or_si256(lo, bit_to_0x10<2 * C>(qh));
        hi = _mm256_or_si256(hi, bit_to_0x10<2 * C + 1>(qh));
    }
    for (int t = 0; t < NT; ++t) {
        const int8_t * xq = x.q[t] + k0 + 64 * C;
        const int8_t * xr = x.qr[t] + k0 + 64 * C;
        const __m256   s0 = _mm256_cvtepi32_ps(dot_u8_i8x2(lo, load256(xq), load256(xr)));
        const __m256   s1 = _mm256_cvtepi32_ps(dot_u8_i8x2(hi, load256(xq + 32), load256(xr + 32)));
        acc[t][0]         = _mm256_fmadd_ps(s0, _mm256_broadcast_ss(scale + 8 * t + 2 * C), acc[t][0]);
        acc[t][1]         = _mm256_fmadd_ps(s1, _mm256_broadcast_ss(scale + 8 * t + 2 * C + 1), acc[t][1]);
    }
}

template <typename Block, bool HasHigh, int NT>
void dot_k4(const void * w_row, const Q8Acts & a, int64_t n, float * out, int64_t os) {
    const auto * b = static_cast<const Block *>(w_row);
    Q8Rows<NT>   x(a);
    __m256       acc[NT][2], corr[NT];
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = acc[t][1] = corr[t] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n / 256; ++i) {
        prefetch_ahead(b + i);
        const __m128i sm  = load128(k4_scales_mins(b[i].scales).b);
        const __m256  dsc = _mm256_mul_ps(_mm256_set1_ps(h2f(b[i].d)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
        const __m256  dmn = _mm256_mul_ps(_mm256_set1_ps(h2f(b[i].dmin)),
                                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
        alignas(32) float scale[8 * NT];  // d·sc_j·d_x,j per token
        for (int t = 0; t < NT; ++t) {
            _mm256_store_ps(scale + 8 * t, _mm256_mul_ps(dsc, _mm256_loadu_ps(x.d[t] + 8 * i)));
            corr[t] = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(x.sums[t] + 8 * i), corr[t]);
        }
        const __m256i qh = HasHigh ? load256(reinterpret_cast<const uint8_t *>(&b[i]) + 16) : _mm256_setzero_si256();
        const int64_t k0 = 256 * i;
        k4_pair<Block, HasHigh, NT, 0>(b[i], qh, scale, x, k0, acc);
        k4_pair<Block, HasHigh, NT, 1>(b[i], qh, scale, x, k0, acc);
        k4_pair<Block, HasHigh, NT, 2>(b[i], qh, scale, x, k0, acc);
        k4_pair<Block, HasHigh, NT, 3>(b[i], qh, scale, x, k0, acc);
    }
    for (int t = 0; t < NT; ++t) {
        out[t * os] = hsum(_mm256_sub_ps(_mm256_add_ps(acc[t][0], acc[t][1]), corr[t]));
    }
}
static_assert(offsetof(BlockQ5_K, qh) == 16, "Q5_K: qh follows d, dmin and scales");

template <int NT>
void dot_q4_k(const void * w, const Q8Acts & a, int64_t n, float * o, int64_t os) {
    dot_k4<BlockQ4_K, false, NT>(w, a, n, o, os);
}
template <int NT>
void dot_q5_k(const void * w, const Q8Acts & a, int64_t n, float * o, int64_t os) {
    dot_k4<BlockQ5_K, true, NT>(w, a, n, o, os);
}

// Q6_K, half h (elements 128h + 32C + e, chunk C = 0..3): low 4 bits from nibble C/2 of ql[64h + 32(C%2) + e], high
// 2 bits from bits 2C of qh[32h + e]; w = d·scale_g·(q - 32) with g = 8h + 2C for e < 16, 8h + 2C + 1 for e >= 16.
// The unsigned q (0..63) go into the byte products as they are, and the offset comes from the activations' sums per
// 16: Σ_g d·scale_g·(Σ q·x̂ - 32·Σ x̂). A chunk's int32 lanes 0-3 sum its first group, lanes 4-7 its second, so one
// vector of per-lane factors (d·scale_g·d_x) scales both.
template <int NT, int C>
inline void q6_chunk(__m256i q, __m256 dsc, const Q8Rows<NT> & x, int64_t k, int64_t kb, __m256 acc[NT][2]) {
    const __m256 lane_scale = _mm256_permutevar8x32_ps(
        dsc, _mm256_setr_epi32(2 * C, 2 * C, 2 * C, 2 * C, 2 * C + 1, 2 * C + 1, 2 * C + 1, 2 * C + 1));
    for (int t = 0; t < NT; ++t) {
        const __m256i si = dot_u8_i8x2(q, load256(x.q[t] + k + 32 * C), load256(x.qr[t] + k + 32 * C));
        acc[t][C % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si),
                                        _mm256_mul_ps(lane_scale, _mm256_broadcast_ss(x.d[t] + kb + C)), acc[t][C % 2]);
    }
}

// Q6_K block blk's factors d·scale_g (dsc[0]: groups 0-7, dsc[1]: 8-15), and offset[t] += Σ_g d·scale_g·Σx̂_g from
// the activations' sums per 16 of this block, groups[t] (16 per token).
template <int NT>
inline void q6_scales_offset(const BlockQ6_K & blk, const float * const * groups, __m256 dsc[2], __m256 offset[NT]) {
    const __m256  d   = _mm256_set1_ps(h2f(blk.d));
    const __m128i sc8 = load128(blk.scales);
    dsc[0]            = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
    dsc[1]            = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))));
    for (int t = 0; t < NT; ++t) {
        offset[t] = _mm256_fmadd_ps(dsc[0], _mm256_loadu_ps(groups[t]), offset[t]);
        offset[t] = _mm256_fmadd_ps(dsc[1], _mm256_loadu_ps(groups[t] + 8), offset[t]);
    }
}

// Q6_K block blk, half h: the unsigned quants (0..63) of its chunks 0..3.
inline void q6_half_quants(const BlockQ6_K & blk, int h, __m256i q[4]) {
    const __m256i   m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const uint8_t * ql  = blk.ql + 64 * h;
    const __m256i   ql0 = load256(ql), ql1 = load256(ql + 32), qh = load256(blk.qh + 32 * h);
    q[0] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2));
    q[1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m2));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2));
}

template <int NT>
void dot_q6_k(const void * w_row, const Q8Acts & a, int64_t n, float * out, int64_t os) {
    const auto * b = static_cast<const BlockQ6_K *>(w_row);
    Q8Rows<NT>   x(a);
    __m256       acc[NT][2], offset[NT];
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = acc[t][1] = offset[t] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n / 256; ++i) {
        const float * groups[NT];
        for (int t = 0; t < NT; ++t) {
            groups[t] = x.groups[t] + 16 * i;
        }
        prefetch_ahead(b + i);
        __m256 dsc[2];
        q6_scales_offset<NT>(b[i], groups, dsc, offset);
        for (int h = 0; h < 2; ++h) {
            __m256i q[4];
            q6_half_quants(b[i], h, q);
            const int64_t k = 256 * i + 128 * h, kb = 8 * i + 4 * h;
            q6_chunk<NT, 0>(q[0], dsc[h], x, k, kb, acc);
            q6_chunk<NT, 1>(q[1], dsc[h], x, k, kb, acc);
            q6_chunk<NT, 2>(q[2], dsc[h], x, k, kb, acc);
            q6_chunk<NT, 3>(q[3], dsc[h], x, k, kb, acc);
        }
    }
    for (int t = 0; t < NT; ++t) {
        out[t * os] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) - 32.0f * hsum(offset[t]);
    }
}

// Signed quants q of the 32 weights over activation block k, against every token's two passes:
// acc[t][u] += Σ|q|·sign(x, q) · scale · d_x,k, with scale per int32 lane (lanes 0-3 sum elements 0-15, 4-7 the rest).
template <int NT>
inline void signed_block32(__m256i q, __m256 scale, const Q8Rows<NT> & x, int64_t k, __m256 acc[NT][2], int u) {
    const __m256i qa = _mm256_sign_epi8(q, q);
    for (int t = 0; t < NT; ++t) {
        const __m256i xq = _mm256_sign_epi8(load256(x.q[t] + 32 * k), q);
        const __m256i xr = _mm256_sign_epi8(load256(x.qr[t] + 32 * k), q);
        const __m256  s  = _mm256_cvtepi32_ps(dot_u8_i8x2(qa, xq, xr));
        acc[t][u]        = _mm256_fmadd_ps(s, _mm256_mul_ps(scale, _mm256_set1_ps(x.d[t][k])), acc[t][u]);
    }
}

// 256-element super-blocks of eight 32-element sub-blocks (activation blocks 8i .. 8i + 7):
// step(block, c, x, k, acc, u) adds sub-block c's products over activation block k into acc[t][u] (two accumulators,
// so that the FMA latency chains overlap).
template <typename Block, int NT, typename Step>
void dot_super256(const void * w_row, const Q8Acts & a, int64_t n, float * out, int64_t os, Step step) {
    const auto * b = static_cast<const Block *>(w_row);
    Q8Rows<NT>   x(a);
    __m256       acc[NT][2];
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n / 256; ++i) {
        for (int c = 0; c < 8; ++c) {
            step(b[i], c, x, 8 * i + c, acc, c % 2);
        }
    }
    for (int t = 0; t < NT; ++t) {
        out[t * os] = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
    }
}

// Super-blocks with signed quants: sub(block, c, q, scale) gives sub-block c's quants and per-lane scale.
template <typename Block, int NT, typename Sub>
void dot_signed_sub32(const void * w_row, const Q8Acts & a, int64_t n, float * out, int64_t os, Sub sub) {
    dot_super256<Block, NT>(w_row, a, n, out, os,
                            [sub](const Block & b, int c, const Q8Rows<NT> & x, int64_t k, __m256 acc[NT][2], int u) {
                                __m256i q;
                                __m256  scale;
                                sub(b, c, q, scale);
                                signed_block32<NT>(q, scale, x, k, acc, u);
                            });
}

// Q2_K / Q3_K: the 2-bit values of sub-block c (groups 2c and 2c + 1), bits 2·(c % 4) of qs[32·(c / 4) ..].
inline __m256i two_bit_plane(const uint8_t * qs, int c) {
    return _mm256_and_si256(_mm256_srl_epi16(load256(qs + 32 * (c / 4)), _mm_cvtsi32_si128(2 * (c % 4))),
                            _mm256_set1_epi8(0x03));
}

// One factor per 16-element group of a sub-block: int32 lanes 0-3 sum its first group, lanes 4-7 its second.
inline __m256 two_group_scales(float first, float second) {
    return _mm256_set_m128(_mm_set1_ps(second), _mm_set1_ps(first));
}

// Q3_K: the 2-bit values plus the third bit c of hmask[0 .. 32] (clear: q - 4); q in [-4, 3].
template <int NT>
void dot_q3_k(const void * w_row, const Q8Acts & a, int64_t n, float * out, int64_t os) {
    dot_signed_sub32<BlockQ3_K, NT>(w_row, a, n, out, os, [](const BlockQ3_K & b, int c, __m256i & q, __m256 & sc) {
        const __m256i hi =
            _mm256_and_si256(_mm256_srl_epi16(load256(b.hmask), _mm_cvtsi32_si128(c)), _mm256_set1_epi8(0x01));
        q = _mm256_sub_epi8(_mm256_add_epi8(two_bit_plane(b.qs, c), _mm256_slli_epi16(hi, 2)), _mm256_set1_epi8(4));
        const float d = h2f(b.d);
        sc            = two_group_scales(d * static_cast<float>(q3_k_scale(b, 2 * c) - 32),
                                         d * static_cast<float>(q3_k_scale(b, 2 * c + 1) - 32));
    });
}

// Q2_K: the 2-bit values unsigned (q in [0, 3]) and x = d·sc·q - dmin·m per group, so each group's min needs the sum
// of its 16 activations: a second dot with all-ones weights gives it per lane from the same quantized activations.
template <int NT>
void dot_q2_k(const void * w_row, const Q8Acts & a, int64_t n, float * out, int64_t os) {
    dot_super256<BlockQ2_K, NT>(
        w_row, a, n, out, os,
        [](const BlockQ2_K & b, int c, const Q8Rows<NT> & x, int64_t k, __m256 acc[NT][2], int u) {
            const __m256i q = two_bit_plane(b.qs, c), ones = _mm256_set1_epi8(0x01);
            const float   d = h2f(b.d), dmin = h2f(b.dmin);
            const int     s0 = b.scales[2 * c], s1 = b.scales[2 * c + 1];
            const __m256  scale = two_group_scales(d * static_cast<float>(s0 & 15), d * static_cast<float>(s1 & 15));
            const __m256  mins =
                two_group_scales(dmin * static_cast<float>(s0 >> 4), dmin * static_cast<float>(s1 >> 4));
            for (int t = 0; t < NT; ++t) {
                const __m256i xq = load256(x.q[t] + 32 * k), xr = load256(x.qr[t] + 32 * k);
                const __m256  dx  = _mm256_set1_ps(x.d[t][k]);
                const __m256  dot = _mm256_cvtepi32_ps(dot_u8_i8x2(q, xq, xr));
                const __m256  sum = _mm256_cvtepi32_ps(dot_u8_i8x2(ones, xq, xr));
                acc[t][u]         = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, dx), acc[t][u]);
                acc[t][u]         = _mm256_fnmadd_ps(sum, _mm256_mul_ps(mins, dx), acc[t][u]);
            }
        });
}

// IQ4_XS: sub-block c is IQ4_NL's 32-block with the scale d·(sc_c - 32).
template <int NT>
void dot_iq4_xs(const void * w_row, const Q8Acts & a, int64_t n, float * out, int64_t os) {
    dot_signed_sub32<BlockIQ4_XS, NT>(w_row, a, n, out, os, [](const BlockIQ4_XS & b, int c, __m256i & q, __m256 & sc) {
        q  = iq4_quants(b.qs + 16 * c);
        sc = _mm256_set1_ps(h2f(b.d) * static_cast<float>(iq4_xs_scale(b, c) - 32));
    });
}

template <int NT>
void dot_iq4_nl(const void * w, const Q8Acts & a, int64_t n, float * o, int64_t os) {
    dot_q32<IQ4_NL, NT>(w, a, n, o, os);
}
template <int NT>
void dot_q4_0(const void * w, const Q8Acts & a, int64_t n, float * o, int64_t os) {
    dot_q32<Q4_0, NT>(w, a, n, o, os);
}
template <int NT>
void dot_q4_1(const void * w, const Q8Acts & a, int64_t n, float * o, int64_t os) {
    dot_q32<Q4_1, NT>(w, a, n, o, os);
}
template <int NT>
void dot_q5_0(const void * w, const Q8Acts & a, int64_t n, float * o, int64_t os) {
    dot_q32<Q5_0, NT>(w, a, n, o, os);
}
template <int NT>
void dot_q5_1(const void * w, const Q8Acts & a, int64_t n, float * o, int64_t os) {
    dot_q32<Q5_1, NT>(w, a, n, o, os);
}
template <int NT>
void dot_q8_0(const void * w, const Q8Acts & a, int64_t n, float * o, int64_t os) {
    dot_q32<Q8_0, NT>(w, a, n, o, os);
}

#define KC_ROW_DOT_Q8(name)                                                                               \
    inline void name##_rows(const void * w, const Q8Acts & a, int nt, int64_t n, float * o, int64_t os) { \
        switch (nt) {                                                                                     \
            case 1:                                                                                       \
                name<1>(w, a, n, o, os);                                                                  \
                break;                                                                                    \
            case 2:                                                                                       \
                name<2>(w, a, n, o, os);                                                                  \
                break;                                                                                    \
            case 3:                                                                                       \
                name<3>(w, a, n, o, os);                                                                  \
                break;                                                                                    \
            default:                                                                                      \
                name<4>(w, a, n, o, os);                                                                  \
                break;                                                                                    \
        }                                                                                                 \
    }
KC_ROW_DOT_Q8(dot_q4_0)
KC_ROW_DOT_Q8(dot_q4_1)
KC_ROW_DOT_Q8(dot_q5_0)
KC_ROW_DOT_Q8(dot_q5_1)
KC_ROW_DOT_Q8(dot_q8_0)
KC_ROW_DOT_Q8(dot_q4_k)
KC_ROW_DOT_Q8(dot_q5_k)
KC_ROW_DOT_Q8(dot_q6_k)
KC_ROW_DOT_Q8(dot_q2_k)
KC_ROW_DOT_Q8(dot_q3_k)
KC_ROW_DOT_Q8(dot_iq4_nl)
KC_ROW_DOT_Q8(dot_iq4_xs)
#undef KC_ROW_DOT_Q8

// The kernel of `type`, nullptr for types without one.
inline RowDotQ8Fn row_dot_q8_fn(GgmlType type) {
    switch (type) {
        case GgmlType::Q4_0:
            return dot_q4_0_rows;
        case GgmlType::Q4_1:
            return dot_q4_1_rows;
        case GgmlType::Q5_0:
            return dot_q5_0_rows;
        case GgmlType::Q5_1:
            return dot_q5_1_rows;
        case GgmlType::Q8_0:
            return dot_q8_0_rows;
        case GgmlType::Q4_K:
            return dot_q4_k_rows;
        case GgmlType::Q5_K:
            return dot_q5_k_rows;
        case GgmlType::Q6_K:
            return dot_q6_k_rows;
        case GgmlType::Q2_K:
            return dot_q2_k_rows;
        case GgmlType::Q3_K:
            return dot_q3_k_rows;
        case GgmlType::IQ4_NL:
            return dot_iq4_nl_rows;
        case GgmlType::IQ4_XS:
            return dot_iq4_xs_rows;
        default:
            return nullptr;
    }
}

}  // namespace KC_Q8_NS
}  // namespace kvcmas::cpu::detail
