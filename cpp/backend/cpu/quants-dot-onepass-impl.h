// The one-pass kernels of the 8-bit decode path (Activations::Q8Fast; contract: quants-dot.h), included after
// quants-dot-avx2-impl.h (its helpers, same KC_Q8_NS and KC_Q8_VNNI) by quants-dot-avx2.cpp, quants-dot-avxvnni.cpp
// (KC_Q8_ZMM undefined: 256-bit) and quants-dot-avx512vnni.cpp (KC_Q8_ZMM 1: 512-bit vpdpbusd).
//
// Each weight byte meets one activation byte (the first pass q alone), so a 32-weight sub-block costs one vpdpbusd
// (or maddubs + madd) per token instead of two plus a shift. The f32 steps are those of the two-pass kernels:
// a sub-block's int32 lanes are converted and multiplied by per-lane factors d_w·scale·d1 into two accumulators (even
// and odd sub-blocks / Q6_K chunks); the 512-bit kernels hold both in one vector (lanes 0-7 even, 8-15 odd), so
// every lane sees the same operations in the same order and all versions give the same bits.
#pragma once

#ifndef KC_Q8_ZMM
#define KC_Q8_ZMM 0
#endif

namespace kvcmas::cpu::detail {
namespace KC_Q8_NS {

// Σ of 4 adjacent products u·s per int32 lane (u unsigned bytes, s signed).
inline __m256i dot_u8_i8(__m256i u, __m256i s) {
#if KC_Q8_VNNI
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

#if KC_Q8_ZMM
inline __m512 join(__m256 lo, __m256 hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
inline __m512i join(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
// The int32 sums of 64 weights (sub-blocks 2C and 2C + 1) against 64 activation bytes at x, times the per-lane
// factors f, into acc.
// Passes 2: the two-pass sums Σ q·(256·x + xr) (x + the residual bytes xr), as dot_u8_i8x2 forms them.
template <int Passes>
inline __m512 fma_dot64(__m512i q, const int8_t * x, const int8_t * xr, __m512 f, __m512 acc) {
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, _mm512_loadu_si512(x));
    if constexpr (Passes == 2) {
        s = _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 8), q, _mm512_loadu_si512(xr));
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), f, acc);
}
#endif

// Per token, the two accumulators of the even and odd sub-blocks (Q6_K: chunks): two ymm, or one zmm's halves.
template <int NT>
struct PairAcc {
#if KC_Q8_ZMM
    __m512 v[NT];
    PairAcc() {
        for (int t = 0; t < NT; ++t) {
            v[t] = _mm512_setzero_ps();
        }
    }
    __m256 sum(int t) const { return _mm256_add_ps(_mm512_castps512_ps256(v[t]), _mm512_extractf32x8_ps(v[t], 1)); }
#else
    __m256 v[NT][2];
    PairAcc() {
        for (int t = 0; t < NT; ++t) {
            v[t][0] = v[t][1] = _mm256_setzero_ps();
        }
    }
    __m256 sum(int t) const { return _mm256_add_ps(v[t][0], v[t][1]); }
#endif
};

// Q4_K / Q5_K (layout: quants-dot-avx2-impl.h, k4_pair): sub-block j adds (d·sc_j·d1_j)·Σq·q_x - (dmin·m_j)·Σx_j.
template <int Passes>
inline __m256i dot_passes(__m256i u, const int8_t * x, const int8_t * xr) {
    if constexpr (Passes == 2) {
        return dot_u8_i8x2(u, load256(x), load256(xr));
    } else {
        (void)xr;
        return dot_u8_i8(u, load256(x));
    }
}

template <typename Block, bool HasHigh, int NT, int Passes>
void dot_k4_v(const void * w_row, const Q8Acts & a, int64_t n, float * out, int64_t os) {
    const auto *  b = static_cast<const Block *>(w_row);
    Q8Rows<NT>    x(a);
    const float * d1[NT];
    __m256        corr[NT];
    PairAcc<NT>   acc;
    for (int t = 0; t < NT; ++t) {
        d1[t]   = (Passes == 1 ? a.d1 : a.d) + t * a.ld_blocks;
        corr[t] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n / 256; ++i) {
        prefetch_ahead(b + i);
        const __m128i sm  = load128(k4_scales_mins(b[i].scales).b);
        const __m256  dsc = _mm256_mul_ps(_mm256_set1_ps(h2f(b[i].d)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
        const __m256  dmn = _mm256_mul_ps(_mm256_set1_ps(h2f(b[i].dmin)),
                                          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
        __m256        scale[NT];  // d·sc_j·d1_j per token
        for (int t = 0; t < NT; ++t) {
            scale[t] = _mm256_mul_ps(dsc, _mm256_loadu_ps(d1[t] + 8 * i));
            corr[t]  = _mm256_fmadd_ps(dmn, _mm256_loadu_ps(x.sums[t] + 8 * i), corr[t]);
        }
#if KC_Q8_ZMM
        // Pair c in one vector: qs[32c ..] in both halves, the upper one shifted to its high nibbles (no lane
        // crossing, so no port-5 shuffles but the factors' one permute per token).
        __m512i qh = _mm512_setzero_si512();
        if constexpr (HasHigh) {
            qh = _mm512_broadcast_i64x4(load256(reinterpret_cast<const uint8_t *>(&b[i]) + 16));
        }
        for (int c = 0; c < 4; ++c) {
            const __m512i v = _mm512_broadcast_i64x4(load256(b[i].qs + 32 * c));
            __m512i       q = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), _mm512_set1_epi8(0x0F));
            if constexpr (HasHigh) {  // bit 2c (lower half) and 2c + 1 (upper half) of qh to 0x10
                const __m512i shift = join(_mm256_set1_epi16(static_cast<short>(2 * c)),
                                           _mm256_set1_epi16(static_cast<short>(2 * c + 1)));
                q                   = _mm512_or_si512(
                    q, _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh, shift), 4), _mm512_set1_epi8(0x10)));
            }
            const __m512i pick = join(_mm256_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1));
            for (int t = 0; t < NT; ++t) {
                const __m512  f = _mm512_permutexvar_ps(pick, _mm512_castps256_ps512(scale[t]));
                const int64_t k = 256 * i + 64 * c;
                acc.v[t]        = fma_dot64<Passes>(q, x.q[t] + k, x.qr[t] + k, f, acc.v[t]);
            }
        }
#else
        __m256i qh = _mm256_setzero_si256();
        if constexpr (HasHigh) {
            qh = load256(reinterpret_cast<const uint8_t *>(&b[i]) + 16);
        }
        for (int c = 0; c < 4; ++c) {
            const __m256i v = load256(b[i].qs + 32 * c), m4 = _mm256_set1_epi8(0x0F);
            __m256i       lo = _mm256_and_si256(v, m4);
            __m256i       hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if constexpr (HasHigh) {  // bit 2c (lo) and 2c + 1 (hi) of qh to 0x10
                const __m256i bit = _mm256_set1_epi8(0x10);
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * c), 4), bit));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * c + 1), 4), bit));
            }
            const int64_t k = 256 * i + 64 * c;
            for (int t = 0; t < NT; ++t) {
                const __m256 f0 = _mm256_permutevar8x32_ps(scale[t], _mm256_set1_epi32(2 * c));
                const __m256 f1 = _mm256_permutevar8x32_ps(scale[t], _mm256_set1_epi32(2 * c + 1));
                acc.v[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_passes<Passes>(lo, x.q[t] + k, x.qr[t] + k)), f0,
                                              acc.v[t][0]);
                acc.v[t][1] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(dot_passes<Passes>(hi, x.q[t] + k + 32, x.qr[t] + k + 32)), f1, acc.v[t][1]);
            }
        }
#endif
    }
    for (int t = 0; t < NT; ++t) {
        out[t * os] = hsum(_mm256_sub_ps(acc.sum(t), corr[t]));
    }
}

// Q6_K (layout: quants-dot-avx2-impl.h, q6_chunk): chunk C of half h adds (d·scale_g·d1)·Σq·q_x per 16-group g, the
// offset -32·Σ_g d·scale_g·Σx̂_g from the first pass's sums per 16.
template <int NT, int Passes>
void dot_q6_k_v(const void * w_row, const Q8Acts & a, int64_t n, float * out, int64_t os) {
    const auto *  b = static_cast<const BlockQ6_K *>(w_row);
    Q8Rows<NT>    x(a);
    const float * d1[NT];
    __m256        offset[NT];
    PairAcc<NT>   acc;
    for (int t = 0; t < NT; ++t) {
        d1[t]     = (Passes == 1 ? a.d1 : a.d) + t * a.ld_blocks;
        offset[t] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n / 256; ++i) {
        const float * groups[NT];
        for (int t = 0; t < NT; ++t) {
            groups[t] = (Passes == 1 ? a.group_sums1 : a.group_sums) + 2 * t * a.ld_blocks + 16 * i;
        }
        __m256 dsc[2];
        q6_scales_offset<NT>(b[i], groups, dsc, offset);
        prefetch_ahead(b + i);
#if KC_Q8_ZMM
        // Half h's chunks 0|1 and 2|3 in one vector each: ql[64h ..] holds them in its low | high nibbles, and the
        // high bits come from qh broadcast to both halves, shifted per half.
        for (int h = 0; h < 2; ++h) {
            const __m512i ql = _mm512_loadu_si512(b[i].ql + 64 * h);
            const __m512i qh = _mm512_broadcast_i64x4(load256(b[i].qh + 32 * h));
            const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
            const __m512i q01 = _mm512_or_si512(
                _mm512_and_si512(ql, m4),
                _mm512_and_si512(_mm512_sllv_epi16(qh, join(_mm256_set1_epi16(4), _mm256_set1_epi16(2))), m2));
            const __m512i q23 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                _mm512_and_si512(_mm512_srlv_epi16(qh, join(_mm256_setzero_si256(), _mm256_set1_epi16(2))), m2));
            const __m512 dsc512 = _mm512_castps256_ps512(dsc[h]);
            const __m512 lane01 =
                _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), dsc512);
            const __m512 lane23 =
                _mm512_permutexvar_ps(_mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7), dsc512);
            const int64_t k = 256 * i + 128 * h, kb = 8 * i + 4 * h;
            for (int t = 0; t < NT; ++t) {
                const __m512 d4  = _mm512_castps128_ps512(_mm_loadu_ps(d1[t] + kb));
                const __m512 d01 = _mm512_permutexvar_ps(join(_mm256_set1_epi32(0), _mm256_set1_epi32(1)), d4);
                const __m512 d23 = _mm512_permutexvar_ps(join(_mm256_set1_epi32(2), _mm256_set1_epi32(3)), d4);
                acc.v[t] = fma_dot64<Passes>(q01, x.q[t] + k, x.qr[t] + k, _mm512_mul_ps(lane01, d01), acc.v[t]);
                acc.v[t] =
                    fma_dot64<Passes>(q23, x.q[t] + k + 64, x.qr[t] + k + 64, _mm512_mul_ps(lane23, d23), acc.v[t]);
            }
        }
#else
        for (int h = 0; h < 2; ++h) {
            __m256i q[4];
            q6_half_quants(b[i], h, q);
            const int64_t k = 256 * i + 128 * h, kb = 8 * i + 4 * h;
            __m256        lane[4];  // chunk c's factors: lanes 0-3 group 2c, lanes 4-7 group 2c + 1
            for (int c = 0; c < 4; ++c) {
                lane[c] = _mm256_permutevar8x32_ps(
                    dsc[h], _mm256_setr_epi32(2 * c, 2 * c, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1));
            }
            for (int t = 0; t < NT; ++t) {
                __m256 f[4];
                for (int c = 0; c < 4; ++c) {
                    f[c] = _mm256_mul_ps(lane[c], _mm256_broadcast_ss(d1[t] + kb + c));
                }
                for (int c = 0; c < 4; ++c) {
                    const __m256 s =
                        _mm256_cvtepi32_ps(dot_passes<Passes>(q[c], x.q[t] + k + 32 * c, x.qr[t] + k + 32 * c));
                    acc.v[t][c % 2] = _mm256_fmadd_ps(s, f[c], acc.v[t][c % 2]);
                }
            }
        }
#endif
    }
    for (int t = 0; t < NT; ++t) {
        out[t * os] = hsum(acc.sum(t)) - 32.0f * hsum(offset[t]);
    }
}

template <int Passes, int NT>
void dot_q4_k_v(const void * w, const Q8Acts & a, int64_t n, float * o, int64_t os) {
    dot_k4_v<BlockQ4_K, false, NT, Passes>(w, a, n, o, os);
}
template <int Passes, int NT>
void dot_q5_k_v(const void * w, const Q8Acts & a, int64_t n, float * o, int64_t os) {
    dot_k4_v<BlockQ5_K, true, NT, Passes>(w, a, n, o, os);
}
template <int Passes, int NT>
void dot_q6_k_vp(const void * w, const Q8Acts & a, int64_t n, float * o, int64_t os) {
    dot_q6_k_v<NT, Passes>(w, a, n, o, os);
}

using DotQ8Fn = void (*)(const void *, const Q8Acts &, int64_t, float *, int64_t);

// K<1..4> by the token count nt (1..4).
template <DotQ8Fn K1, DotQ8Fn K2, DotQ8Fn K3, DotQ8Fn K4>
void rows_v(const void * w, const Q8Acts & a, int nt, int64_t n, float * o, int64_t os) {
    (nt == 1 ? K1 : nt == 2 ? K2 : nt == 3 ? K3 : K4)(w, a, n, o, os);
}

// The kernel of `type` (Q4_K, Q5_K, Q6_K) with 1 or 2 activation passes, nullptr for the other types.
template <int Passes>
RowDotQ8Fn row_dot_q8_vec_fn(GgmlType type) {
    switch (type) {
        case GgmlType::Q4_K:
            return rows_v<dot_q4_k_v<Passes, 1>, dot_q4_k_v<Passes, 2>, dot_q4_k_v<Passes, 3>, dot_q4_k_v<Passes, 4>>;
        case GgmlType::Q5_K:
            return rows_v<dot_q5_k_v<Passes, 1>, dot_q5_k_v<Passes, 2>, dot_q5_k_v<Passes, 3>, dot_q5_k_v<Passes, 4>>;
        case GgmlType::Q6_K:
            return rows_v<dot_q6_k_vp<Passes, 1>, dot_q6_k_vp<Passes, 2>, dot_q6_k_vp<Passes, 3>,
                          dot_q6_k_vp<Passes, 4>>;
        default:
            return nullptr;
    }
}

// The one-pass kernels (quants-dot.h: row_dot_q8_onepass_fn_*).
inline RowDotQ8Fn row_dot_q8_onepass_fn(GgmlType type) {
    return row_dot_q8_vec_fn<1>(type);
}

}  // namespace KC_Q8_NS
}  // namespace kvcmas::cpu::detail
