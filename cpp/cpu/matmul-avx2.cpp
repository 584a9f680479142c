// AVX2 + FMA + F16C matrix-product kernels (compiled with -mavx2 -mfma -mf16c; called only after the run-time
// check): 8-bit activation quantization, decode dot products straight from the stored blocks (integer products
// via maddubs / madd, as llama.cpp does), and the f32 register-blocked tile kernel of the prefill path.
#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <new>
#include <cstring>

#include "cpu/matmul-impl.h"



namespace kvcmas::cpu::detail {
namespace {

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s        = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s        = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s         = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s         = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

inline __m256i loadu256(const void * p) { return _mm256_loadu_si256(static_cast<const __m256i *>(p)); }

// Σ over pairs of u8 × s8 -> 8 int32 lanes (no saturation for |u| < 128 or u·s pair sums below 2^15).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline __m256i unpack_nibbles_32(const uint8_t * qs) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i *>(qs));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

inline __m256i expand_bits_32(const uint8_t * qh_bytes) {
    uint32_t qh;
    std::memcpy(&qh, qh_bytes, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    __m256i       v    = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), shuf);
    const __m256i bit  = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
    v                  = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

// ---- activation quantization --------------------------------------------------------------------------------------

// Rounds 32 floats (4 vectors, already scaled) to nearest-even int8, in element order.
inline __m256i round_pack_32(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    const __m256i i0 = _mm256_cvtps_epi32(v0), i1 = _mm256_cvtps_epi32(v1);
    const __m256i i2 = _mm256_cvtps_epi32(v2), i3 = _mm256_cvtps_epi32(v3);
    const __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
    const __m256i p   = _mm256_packs_epi16(p01, p23);
    // pack works per 128-bit lane: fix the order of the 32-bit groups
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline float amax_32(const float * x, __m256 v[4]) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256       m    = _mm256_setzero_ps();
    for (int p = 0; p < 4; ++p) {
        v[p] = _mm256_loadu_ps(x + 8 * p);
        m    = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[p]));
    }
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s        = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s        = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Sums of the int8 values in each 16-byte half of q (as two int32s).
inline void sum_halves_i8(__m256i q, int & lo, int & hi) {
    const __m256i s16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
    const __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
    __m128i       a   = _mm256_castsi256_si128(s32), b = _mm256_extracti128_si256(s32, 1);
    a                 = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
    a                 = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1));
    b                 = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0x4E));
    b                 = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0xB1));
    lo                = _mm_cvtsi128_si32(a);
    hi                = _mm_cvtsi128_si32(b);
}

}  // namespace

void quantize_act_q8_avx2(const float * x, void * dst, int64_t n) {
    auto * out = static_cast<ActQ8 *>(dst);
    for (int64_t i = 0; i < n / 32; ++i, x += 32) {
        __m256      v[4];
        const float amax = amax_32(x, v);
        const float d    = amax / 127.0f;
        const float id   = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 s   = _mm256_set1_ps(id);
        const __m256i q  = round_pack_32(_mm256_mul_ps(v[0], s), _mm256_mul_ps(v[1], s), _mm256_mul_ps(v[2], s),
                                         _mm256_mul_ps(v[3], s));
        _mm256_storeu_si256(reinterpret_cast<__m256i *>(out[i].q), q);
        int lo, hi;
        sum_halves_i8(q, lo, hi);
        out[i].d  = d;
        out[i].ds = d * static_cast<float>(lo + hi);
    }
}

void quantize_act_q8k_avx2(const float * x, void * dst, int64_t n) {
    auto * out = static_cast<ActQ8K *>(dst);
    for (int64_t i = 0; i < n / 256; ++i, x += 256) {
        float amax = 0.0f;
        for (int c = 0; c < 8; ++c) {
            __m256 v[4];
            amax = std::fmax(amax, amax_32(x + 32 * c, v));
        }
        const float  d  = amax / 127.0f;
        const float  id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 s  = _mm256_set1_ps(id);
        for (int c = 0; c < 8; ++c) {
            const float * xc = x + 32 * c;
            const __m256i q  = round_pack_32(
                _mm256_mul_ps(_mm256_loadu_ps(xc), s), _mm256_mul_ps(_mm256_loadu_ps(xc + 8), s),
                _mm256_mul_ps(_mm256_loadu_ps(xc + 16), s), _mm256_mul_ps(_mm256_loadu_ps(xc + 24), s));
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(out[i].q + 32 * c), q);
            int lo, hi;
            sum_halves_i8(q, lo, hi);
            out[i].bsums[2 * c]     = static_cast<int16_t>(lo);
            out[i].bsums[2 * c + 1] = static_cast<int16_t>(hi);
        }
        out[i].d = d;
    }
}

namespace {

// ---- decode dot products: one weight row × NT activation rows -------------------------------------------------------

template <typename A, int NT>
struct ActRows {
    const A * a[NT];
    ActRows(const void * act, size_t stride) {
        for (int t = 0; t < NT; ++t) {
            a[t] = reinterpret_cast<const A *>(static_cast<const char *>(act) + t * stride);
        }
    }
};

template <int NT>
void dot_f32(const void * w_row, const void * act, size_t stride, int64_t n, float * out, int64_t os) {
    const auto *          w = static_cast<const float *>(w_row);
    ActRows<float, NT>    x(act, stride);
    constexpr int         U = NT == 1 ? 4 : 2;  // independent accumulators per token to cover FMA latency
    __m256                acc[NT][U];
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
                acc[t][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.a[t] + i + 8 * u), acc[t][u]);
            }
        }
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 wv = _mm256_loadu_ps(w + i);
        for (int t = 0; t < NT; ++t) {
            acc[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.a[t] + i), acc[t][0]);
        }
    }
    for (int t = 0; t < NT; ++t) {
        for (int u = 1; u < U; ++u) {
            acc[t][0] = _mm256_add_ps(acc[t][0], acc[t][u]);
        }
        float s = hsum(acc[t][0]);
        for (int64_t k = i; k < n; ++k) {
            s += w[k] * x.a[t][k];
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
inline float f16_scalar(uint16_t h) { return _cvtsh_ss(h); }
inline float bf16_scalar(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float          f;
    std::memcpy(&f, &bits, 4);
    return f;
}

template <int NT, bool BF>
void dot_half(const void * w_row, const void * act, size_t stride, int64_t n, float * out, int64_t os) {
    const auto *       w = static_cast<const uint16_t *>(w_row);
    ActRows<float, NT> x(act, stride);
    constexpr int      U = NT == 1 ? 4 : 2;
    __m256             acc[NT][U];
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
                acc[t][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.a[t] + i + 8 * u), acc[t][u]);
            }
        }
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 wv = BF ? load_bf16x8(w + i) : load_f16x8(w + i);
        for (int t = 0; t < NT; ++t) {
            acc[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.a[t] + i), acc[t][0]);
        }
    }
    for (int t = 0; t < NT; ++t) {
        for (int u = 1; u < U; ++u) {
            acc[t][0] = _mm256_add_ps(acc[t][0], acc[t][u]);
        }
        float s = hsum(acc[t][0]);
        for (int64_t k = i; k < n; ++k) {
            s += (BF ? bf16_scalar(w[k]) : f16_scalar(w[k])) * x.a[t][k];
        }
        out[t * os] = s;
    }
}
template <int NT>
void dot_f16(const void * w, const void * a, size_t s, int64_t n, float * o, int64_t os) {
    dot_half<NT, false>(w, a, s, n, o, os);
}
template <int NT>
void dot_bf16(const void * w, const void * a, size_t s, int64_t n, float * o, int64_t os) {
    dot_half<NT, true>(w, a, s, n, o, os);
}

// The 32-element block types. Per block: unsigned q (0..15 / 0..31; |w| with the sign moved onto the activations
// for Q8_0) times the 8-bit activations, scaled by d_w·d_x; the weight offset (Q4_0/Q5_0: -off·d_w) or min
// (Q4_1/Q5_1: m) times d_x·Σq_x is a scalar term. Two blocks per step with separate accumulators, so that the
// FMA latency chains overlap.
template <typename Block, int Kind, int Offset, bool HasHigh>
struct Q32 {
    static constexpr bool kHasOffset = Kind != 0;
    // Kind 0: x = d·q (signed int8, Q8_0); 1: x = d·(q - Offset); 2: x = d·q + m.
    static inline __m256i unsigned_q(const Block & b) {
        if constexpr (Kind == 0) {
            const __m256i w = loadu256(b.qs);
            return _mm256_sign_epi8(w, w);
        } else {
            __m256i q = unpack_nibbles_32(b.qs);
            if constexpr (HasHigh) {
                q = _mm256_or_si256(q, expand_bits_32(b.qh));
            }
            return q;
        }
    }
    static inline __m256i activations(const Block & b, const ActQ8 & a) {
        const __m256i x = loadu256(a.q);
        if constexpr (Kind == 0) {
            return _mm256_sign_epi8(x, loadu256(b.qs));
        } else {
            return x;
        }
    }
    // dw = d in lane 0; off = the offset term's factor in lane 0 (m, or -Offset·d).
    static inline void scales(const Block & b, __m128 & dw, __m128 & off) {
        if constexpr (Kind == 2) {
            uint32_t dm;  // d and m are adjacent f16s
            std::memcpy(&dm, &b.d, 4);
            dw  = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));
            off = _mm_movehdup_ps(dw);
        } else {
            dw  = _mm_cvtph_ps(_mm_cvtsi32_si128(b.d));
            off = _mm_mul_ss(dw, _mm_set_ss(-static_cast<float>(Offset)));
        }
    }
};

template <typename Q, typename Block, int NT>
void dot_q32(const void * w_row, const void * act, size_t stride, int64_t n, float * out, int64_t os) {
    const auto *       b = static_cast<const Block *>(w_row);
    ActRows<ActQ8, NT> x(act, stride);
    __m256             acc[NT][2];
    __m128             corr[NT][2];  // scalar sums in lane 0, kept in registers (explicit intrinsics)
    for (int t = 0; t < NT; ++t) {
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        corr[t][0] = corr[t][1] = _mm_setzero_ps();
    }
    const int64_t nb   = n / 32;
    const auto    step = [&](int64_t i, int u) {
        const __m256i q = Q::unsigned_q(b[i]);
        // d (and m) in vector lanes: one conversion, no round trips through scalar registers.
        __m128 dw, off;
        Q::scales(b[i], dw, off);
        for (int t = 0; t < NT; ++t) {
            const __m256i p     = dot_u8s8(q, Q::activations(b[i], x.a[t][i]));
            const __m128  scale = _mm_mul_ss(dw, _mm_load_ss(&x.a[t][i].d));
            acc[t][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcastss_ps(scale), acc[t][u]);
            if constexpr (Q::kHasOffset) {
                corr[t][u] = _mm_fmadd_ss(off, _mm_load_ss(&x.a[t][i].ds), corr[t][u]);
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
void dot_q8_0(const void * w, const void * a, size_t s, int64_t n, float * o, int64_t os) {
    dot_q32<Q32<BlockQ8_0, 0, 0, false>, BlockQ8_0, NT>(w, a, s, n, o, os);
}
template <int NT>
void dot_q4_0(const void * w, const void * a, size_t s, int64_t n, float * o, int64_t os) {
    dot_q32<Q32<BlockQ4_0, 1, 8, false>, BlockQ4_0, NT>(w, a, s, n, o, os);
}
template <int NT>
void dot_q4_1(const void * w, const void * a, size_t s, int64_t n, float * o, int64_t os) {
    dot_q32<Q32<BlockQ4_1, 2, 0, false>, BlockQ4_1, NT>(w, a, s, n, o, os);
}
template <int NT>
void dot_q5_0(const void * w, const void * a, size_t s, int64_t n, float * o, int64_t os) {
    dot_q32<Q32<BlockQ5_0, 1, 16, true>, BlockQ5_0, NT>(w, a, s, n, o, os);
}
template <int NT>
void dot_q5_1(const void * w, const void * a, size_t s, int64_t n, float * o, int64_t os) {
    dot_q32<Q32<BlockQ5_1, 2, 0, true>, BlockQ5_1, NT>(w, a, s, n, o, os);
}

// Q4_K / Q5_K: integer sums Σ_j sc_j·(q_j·x_j) over a super-block, mins via the activation block sums.
template <typename Block, bool HasHigh, int NT>
void dot_k4(const void * w_row, const void * act, size_t stride, int64_t n, float * out, int64_t os) {
    const auto *        b = static_cast<const Block *>(w_row);
    ActRows<ActQ8K, NT> x(act, stride);
    const __m256i       mask = _mm256_set1_epi8(0x0F);
    __m256              acc[NT];
    float               corr[NT];
    for (int t = 0; t < NT; ++t) {
        acc[t]  = _mm256_setzero_ps();
        corr[t] = 0.0f;
    }
    for (int64_t i = 0; i < n / 256; ++i) {
        uint8_t sc[8], mn[8];
        for (int j = 0; j < 8; ++j) {
            get_scale_min_k4(j, b[i].scales, sc[j], mn[j]);
        }
        __m256i qh = _mm256_setzero_si256();
        if constexpr (HasHigh) {
            qh = loadu256(b[i].qh);
        }
        __m256i sumi[NT];
        for (int t = 0; t < NT; ++t) {
            sumi[t] = _mm256_setzero_si256();
        }
        for (int c = 0; c < 4; ++c) {
            const __m256i qs = loadu256(b[i].qs + 32 * c);
            __m256i       q[2] = { _mm256_and_si256(qs, mask), _mm256_and_si256(_mm256_srli_epi16(qs, 4), mask) };
            for (int s = 0; s < 2; ++s) {
                const int j = 2 * c + s;
                if constexpr (HasHigh) {
                    const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
                    const __m256i hb  = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                    q[s]              = _mm256_or_si256(q[s], _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
                }
                const __m256i scv = _mm256_set1_epi16(sc[j]);
                for (int t = 0; t < NT; ++t) {
                    const __m256i p16 = _mm256_maddubs_epi16(q[s], loadu256(x.a[t][i].q + 32 * j));
                    sumi[t]           = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p16, scv));
                }
            }
        }
        const float d = h2f(b[i].d), dmin = h2f(b[i].dmin);
        for (int t = 0; t < NT; ++t) {
            const ActQ8K & a    = x.a[t][i];
            int            summ = 0;
            for (int j = 0; j < 8; ++j) {
                summ += mn[j] * (a.bsums[2 * j] + a.bsums[2 * j + 1]);
            }
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_set1_ps(d * a.d), acc[t]);
            corr[t] += dmin * a.d * static_cast<float>(summ);
        }
    }
    for (int t = 0; t < NT; ++t) {
        out[t * os] = hsum(acc[t]) - corr[t];
    }
}
template <int NT>
void dot_q4_k(const void * w, const void * a, size_t s, int64_t n, float * o, int64_t os) {
    dot_k4<BlockQ4_K, false, NT>(w, a, s, n, o, os);
}
template <int NT>
void dot_q5_k(const void * w, const void * a, size_t s, int64_t n, float * o, int64_t os) {
    dot_k4<BlockQ5_K, true, NT>(w, a, s, n, o, os);
}

// Q6_K: unsigned 6-bit q times activations with the int8 group scales in madd; the -32 offset via block sums.
template <int NT>
void dot_q6_k(const void * w_row, const void * act, size_t stride, int64_t n, float * out, int64_t os) {
    const auto *        b = static_cast<const BlockQ6_K *>(w_row);
    ActRows<ActQ8K, NT> x(act, stride);
    const __m256i       mask = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3);
    __m256              acc[NT];
    for (int t = 0; t < NT; ++t) {
        acc[t] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n / 256; ++i) {
        __m256i sumi[NT];
        for (int t = 0; t < NT; ++t) {
            sumi[t] = _mm256_setzero_si256();
        }
        for (int h = 0; h < 2; ++h) {
            const __m256i ql0 = loadu256(b[i].ql + 64 * h), ql1 = loadu256(b[i].ql + 64 * h + 32);
            const __m256i qh  = loadu256(b[i].qh + 32 * h);
            const __m256i lo[4] = { _mm256_and_si256(ql0, mask), _mm256_and_si256(ql1, mask),
                                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), mask),
                                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), mask) };
            for (int s = 0; s < 4; ++s) {
                const __m256i hi  = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), three);
                const __m256i q   = _mm256_or_si256(lo[s], _mm256_slli_epi16(hi, 4));
                const int     g   = 8 * h + 2 * s;
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(b[i].scales[g + 1]), _mm_set1_epi16(b[i].scales[g]));
                for (int t = 0; t < NT; ++t) {
                    const __m256i p16 = _mm256_maddubs_epi16(q, loadu256(x.a[t][i].q + 128 * h + 32 * s));
                    sumi[t]           = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p16, scv));
                }
            }
        }
        const float d = h2f(b[i].d);
        for (int t = 0; t < NT; ++t) {
            const ActQ8K & a    = x.a[t][i];
            int            offs = 0;
            for (int g = 0; g < 16; ++g) {
                offs += b[i].scales[g] * a.bsums[g];
            }
            const __m256 v = _mm256_sub_ps(_mm256_cvtepi32_ps(sumi[t]),
                                           _mm256_setr_ps(32.0f * static_cast<float>(offs), 0, 0, 0, 0, 0, 0, 0));
            acc[t]         = _mm256_fmadd_ps(v, _mm256_set1_ps(d * a.d), acc[t]);
        }
    }
    for (int t = 0; t < NT; ++t) {
        out[t * os] = hsum(acc[t]);
    }
}

#define KC_ROW_DOT(name)                                                                                         \
    void name##_rows(const void * w, const void * a, size_t s, int nt, int64_t n, float * o, int64_t os) {      \
        switch (nt) {                                                                                            \
            case 1: name<1>(w, a, s, n, o, os); break;                                                           \
            case 2: name<2>(w, a, s, n, o, os); break;                                                           \
            case 3: name<3>(w, a, s, n, o, os); break;                                                           \
            default: name<4>(w, a, s, n, o, os); break;                                                          \
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

void gemm_tile_avx2(const float * w, int64_t ldw, int nr, const float * x, int64_t ldx, int nt, int64_t n,
                    float * y, int64_t ldy) {
    const int n_panels = (nr + kPanelRows - 1) / kPanelRows;
    float *   packed   = tl_panels.get(static_cast<size_t>(n_panels) * kPanelRows * static_cast<size_t>(n));
    // Pack: panel p holds rows 16p.. as [k][16], missing rows zero.
    for (int p = 0; p < n_panels; ++p) {
        float *   dst = packed + static_cast<size_t>(p) * kPanelRows * static_cast<size_t>(n);
        const int rn  = nr - p * kPanelRows < kPanelRows ? nr - p * kPanelRows : kPanelRows;
        pack_panel(w + p * kPanelRows * ldw, ldw, rn, n, dst);
    }
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
        default: return nullptr;
    }
}

}  // namespace kvcmas::cpu::detail
