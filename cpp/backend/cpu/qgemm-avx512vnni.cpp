// The integer prefill GEMM (compiled with -mavx512f/bw/dq/vl/vnni; called only after the run-time check). Contract,
// number formats and error: qgemm.h.
#include <immintrin.h>

#include <cstring>

#define KC_QGEMM_NS avx512vnni
#include "backend/cpu/qgemm-impl.h"

// GCC 12 flags the undefined pass-through operand inside _mm512_cvtepi32_ps (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace kvcmas::cpu::detail {
namespace avx512vnni {

// A panel's 16 rows are the int32 lanes of a zmm; a micro tile is the unit's two panels (32 rows) and up to kMicroT
// tokens.
constexpr int kMicroT = 6;  // tokens per micro tile: 12 int32 + 12 f32 accumulators of 32 zmm

inline float h2f(uint16_t h) {
    return _cvtsh_ss(h);
}

// 16 vectors of 16 dwords: r[i] dword j -> out[j] dword i. In place.
inline void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; ++i) {
        b[2 * i]     = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        b[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // a[4i + m], 128-bit lane L: rows 4i .. 4i + 3 of column 4L + m.
    for (int i = 0; i < 4; ++i) {
        a[4 * i]     = _mm512_unpacklo_epi64(b[4 * i], b[4 * i + 2]);
        a[4 * i + 1] = _mm512_unpackhi_epi64(b[4 * i], b[4 * i + 2]);
        a[4 * i + 2] = _mm512_unpacklo_epi64(b[4 * i + 1], b[4 * i + 3]);
        a[4 * i + 3] = _mm512_unpackhi_epi64(b[4 * i + 1], b[4 * i + 3]);
    }
    for (int m = 0; m < 4; ++m) {
        const __m512i s0 = _mm512_shuffle_i32x4(a[m], a[4 + m], 0x88),
                      s1 = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0x88);
        const __m512i s2 = _mm512_shuffle_i32x4(a[m], a[4 + m], 0xDD),
                      s3 = _mm512_shuffle_i32x4(a[8 + m], a[12 + m], 0xDD);
        r[m]             = _mm512_shuffle_i32x4(s0, s1, 0x88);
        r[8 + m]         = _mm512_shuffle_i32x4(s0, s1, 0xDD);
        r[4 + m]         = _mm512_shuffle_i32x4(s2, s3, 0x88);
        r[12 + m]        = _mm512_shuffle_i32x4(s2, s3, 0xDD);
    }
}

// ---- unpacking ----------------------------------------------------------------------------------------------------
// Each weight type gives the 32 integer quants of its 32-element block b of a row as int16 in element order, and the
// f32 factors of a whole row (scale per group, min per 32-block).

struct Q4K {
    static constexpr int  kGroup  = 32;
    static constexpr bool kHasMin = true;
    static constexpr bool kSuper  = true;  // factors per 256-element super-block
    static __m512i        quants(const void * row, int64_t b) {
        const auto & blk = static_cast<const BlockQ4_K *>(row)[b / 8];
        return _mm512_cvtepu8_epi16(k4_nibbles(blk.qs, static_cast<int>(b % 8)));
    }
    // Super-block i's 16 factors of one row: d·sc_j (j < 8), then the mins dmin·m_j; stored at factor_at(.., i, j).
    template <typename Block>
    static __m512 k4_factors(const void * row, int64_t i) {
        const auto &       blk = static_cast<const Block *>(row)[i];
        const ScalesMinsK4 sm  = k4_scales_mins(blk.scales);
        const __m512       v =
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(sm.b))));
        return _mm512_mul_ps(v, _mm512_insertf32x8(_mm512_set1_ps(h2f(blk.d)), _mm256_set1_ps(h2f(blk.dmin)), 1));
    }
    static __m512  factors(const void * row, int64_t i) { return k4_factors<BlockQ4_K>(row, i); }
    static float * factor_at(float * scale, float * min, int64_t i, int j) {
        return j < 8 ? scale + 16 * (8 * i + j) : min + 16 * (8 * i + j - 8);
    }
};

struct Q5K {
    static constexpr int  kGroup  = 32;
    static constexpr bool kHasMin = true;
    static constexpr bool kSuper  = true;
    static __m512i        quants(const void * row, int64_t b) {
        const auto & blk = static_cast<const BlockQ5_K *>(row)[b / 8];
        return _mm512_cvtepu8_epi16(q5k_bytes(blk, static_cast<int>(b % 8)));
    }
    static __m512  factors(const void * row, int64_t i) { return Q4K::k4_factors<BlockQ5_K>(row, i); }
    static float * factor_at(float * scale, float * min, int64_t i, int j) { return Q4K::factor_at(scale, min, i, j); }
};

// Q6_K (qgemm-impl.h: q6k_bytes): groups of 16 (group 2b + e / 16 uses scales[(2b) % 16 + e / 16]).
struct Q6K {
    static constexpr int  kGroup  = 16;
    static constexpr bool kHasMin = false;
    static constexpr bool kSuper  = true;
    static __m512i        quants(const void * row, int64_t b) {
        const auto & blk = static_cast<const BlockQ6_K *>(row)[b / 8];
        return _mm512_sub_epi16(_mm512_cvtepu8_epi16(q6k_bytes(blk, static_cast<int>(b % 8))), _mm512_set1_epi16(32));
    }
    // Super-block i's 16 factors of one row, d·scale_g.
    static __m512 factors(const void * row, int64_t i) {
        const auto & blk = static_cast<const BlockQ6_K *>(row)[i];
        const __m512 sc =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(blk.scales))));
        return _mm512_mul_ps(sc, _mm512_set1_ps(h2f(blk.d)));
    }
    static float * factor_at(float * scale, float *, int64_t i, int j) { return scale + 16 * (16 * i + j); }
};

// The 32-element block types: x = d·(q - Offset) (+ m with a min). Q8_0's quants are signed bytes; the others keep
// elements 0..15 in the low nibbles of qs and 16..31 in the high ones, and the 5-bit types bit j of qh as element j's
// bit 4.
template <typename Block, int Offset, bool High, bool Min>
struct Block32 {
    static constexpr int  kGroup  = 32;
    static constexpr bool kHasMin = Min;
    static constexpr bool kSuper  = false;  // factors per block, by factors() below
    static __m512i        quants(const void * row, int64_t b) {
        const Block & blk = static_cast<const Block *>(row)[b];
        if constexpr (sizeof(blk.qs) == 32) {
            return _mm512_cvtepi8_epi16(load256(blk.qs));
        } else {
            const __m128i v   = _mm_loadu_si128(reinterpret_cast<const __m128i *>(blk.qs));
            const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
            __m512i       q   = _mm512_cvtepu8_epi16(nib);
            if constexpr (High) {
                uint32_t bits;
                std::memcpy(&bits, blk.qh, 4);
                q = _mm512_mask_add_epi16(q, static_cast<__mmask32>(bits), q, _mm512_set1_epi16(16));
            }
            return _mm512_sub_epi16(q, _mm512_set1_epi16(Offset));
        }
    }
    static void factors(const void * row, int64_t n, float * scale, float * min) {
        const auto * blk = static_cast<const Block *>(row);
        for (int64_t b = 0; b < n / 32; ++b) {
            scale[16 * b] = h2f(blk[b].d);
            if constexpr (Min) {
                min[16 * b] = -h2f(blk[b].m);  // subtracted: w = d·q + m
            }
        }
    }
};

template <typename Q>
void pack_factors(const WeightView & w, int64_t r0, int nr, float * scale, float * min);

// Unpacks rows [r0, r0 + nr) (nr <= 16) of w into one panel: quants at q (n / 2 vectors), factors at scale / min
// (missing rows: zero quants and factors).
template <typename Q>
void pack_panel(const WeightView & w, int64_t r0, int nr, int16_t * q, float * scale, float * min) {
    const auto *  base = static_cast<const char *>(w.data) + r0 * static_cast<int64_t>(w.row_bytes);
    const int64_t nb   = w.n_in / 32;
    for (int64_t b = 0; b < nb; ++b) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
            r[i] = i < nr ? Q::quants(base + i * static_cast<int64_t>(w.row_bytes), b) : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int i = 0; i < 16; ++i) {
            _mm512_store_si512(q + 32 * (16 * b + i), r[i]);
        }
    }
    pack_factors<Q>(w, r0, nr, scale, min);
}

// A panel's f32 factors (layout: Panels) of rows [r0, r0 + nr) of w.
template <typename Q>
void pack_factors(const WeightView & w, int64_t r0, int nr, float * scale, float * min) {
    const auto *  base      = static_cast<const char *>(w.data) + r0 * static_cast<int64_t>(w.row_bytes);
    const int64_t nb        = w.n_in / 32;
    const int64_t row_bytes = static_cast<int64_t>(w.row_bytes);
    if constexpr (Q::kSuper) {  // the 16 factors of each row's super-block, transposed like the quants
        for (int64_t i = 0; i < w.n_in / 256; ++i) {
            __m512i r[16];
            for (int k = 0; k < 16; ++k) {
                r[k] = k < nr ? _mm512_castps_si512(Q::factors(base + k * row_bytes, i)) : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int j = 0; j < 16; ++j) {
                _mm512_store_si512(Q::factor_at(scale, min, i, j), r[j]);
            }
        }
    } else {
        std::memset(scale, 0, static_cast<size_t>(16 * nb) * sizeof(float));
        if (Q::kHasMin) {
            std::memset(min, 0, static_cast<size_t>(16 * nb) * sizeof(float));
        }
        for (int k = 0; k < nr; ++k) {
            Q::factors(base + k * row_bytes, w.n_in, scale + k, min + k);
        }
    }
}

// ---- the micro tile -------------------------------------------------------------------------------------------------

// acc[t][u] -= min_u(block b)·sums[t·ld] (the min term of one 32-block, from the exact sums of x).
template <int T, int NP>
inline void subtract_mins(__m512 (&acc)[T][NP], const float * const * min, const float * sums, int64_t ld, int64_t b) {
    for (int t = 0; t < T; ++t) {
        const __m512 sum = _mm512_set1_ps(sums[t * ld]);
        for (int u = 0; u < NP; ++u) {
            acc[t][u] = _mm512_fnmadd_ps(_mm512_load_ps(min[u] + 16 * b), sum, acc[t][u]);
        }
    }
}

// A micro tile's results: token t, panel u's rows r < nr at y[t·ldy + 16u + r].
template <int T, int NP>
inline void store_tile(const __m512 (&acc)[T][NP], float * y, int64_t ldy, int nr) {
    for (int u = 0; u < NP; ++u) {
        const int       rn   = nr - kPanelRows * u;
        const __mmask16 mask = rn >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << rn) - 1);
        for (int t = 0; t < T; ++t) {
            _mm512_mask_storeu_ps(y + t * ldy + kPanelRows * u, mask, acc[t][u]);
        }
    }
}

inline __m512i bcast_pair(const int16_t * v) {
    int32_t pair;
    std::memcpy(&pair, v, 4);
    return _mm512_set1_epi32(pair);
}

// y[t·ldy + r] = Σ_groups cvt(Σ_k q·v)·(factor·step) - Σ_blocks min·sum, for T tokens (activation rows t0 ..) and the
// rows r < nr of NP panels.
template <typename Q, int T, int NP>
void micro(const Panels & p, const Acts16 & a, int64_t n, float * y, int64_t ldy, int nr) {
    constexpr int G = Q::kGroup;
    __m512        acc[T][NP];
    for (int t = 0; t < T; ++t) {
        for (int u = 0; u < NP; ++u) {
            acc[t][u] = _mm512_setzero_ps();
        }
    }
    const int64_t nb = n / 32;
    for (int64_t b = 0; b < nb; ++b) {
        for (int g = 0; g < 32 / G; ++g) {
            const int64_t kp0 = 16 * b + g * (G / 2);
            __m512i       s[T][NP];
            for (int t = 0; t < T; ++t) {
                for (int u = 0; u < NP; ++u) {
                    s[t][u] = _mm512_setzero_si512();  // a zeroing idiom: no execution port
                }
            }
#pragma GCC unroll 16
            for (int kp = 0; kp < G / 2; ++kp) {
                __m512i wq[NP];
                for (int u = 0; u < NP; ++u) {
                    wq[u] = _mm512_load_si512(p.q[u] + 32 * (kp0 + kp));
                }
#pragma GCC unroll 6
                for (int t = 0; t < T; ++t) {
                    const __m512i x = bcast_pair(a.v + t * a.ldv + 2 * (kp0 + kp));
                    for (int u = 0; u < NP; ++u) {
                        s[t][u] = _mm512_dpwssd_epi32(s[t][u], wq[u], x);
                    }
                }
            }
            const int64_t gi = b * (32 / G) + g;
            for (int t = 0; t < T; ++t) {
                const __m512 step = _mm512_set1_ps(a.step[t * a.ld_blocks + b]);
                for (int u = 0; u < NP; ++u) {
                    const __m512 f = _mm512_mul_ps(_mm512_load_ps(p.scale[u] + 16 * gi), step);
                    acc[t][u]      = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t][u]), f, acc[t][u]);
                }
            }
        }
        if constexpr (Q::kHasMin) {
            subtract_mins<T, NP>(acc, p.min, a.sums + b, a.ld_blocks, b);
        }
    }
    store_tile<T, NP>(acc, y, ldy, nr);
}

template <typename Q, int NP>
using MicroFn = void (*)(const Panels &, const Acts16 &, int64_t, float *, int64_t, int);

template <typename Q, int NP>
struct MicroTable {
    static constexpr MicroFn<Q, NP> fn[kMicroT + 1] = { nullptr,         micro<Q, 1, NP>, micro<Q, 2, NP>,
                                                        micro<Q, 3, NP>, micro<Q, 4, NP>, micro<Q, 5, NP>,
                                                        micro<Q, 6, NP> };
};
static_assert(kMicroT == 6, "micro tiles of up to 6 tokens");

// The kernel set of qgemm-impl.h.
struct Kernels {
    static void join(const int8_t * q, const int8_t * qr, int16_t * v, int64_t n) {
        for (int64_t k = 0; k < n; k += 32) {
            const __m512i hi = _mm512_slli_epi16(_mm512_cvtepi8_epi16(load256(q + k)), 8);
            _mm512_storeu_si512(v + k, _mm512_add_epi16(hi, _mm512_cvtepi8_epi16(load256(qr + k))));
        }
    }
    template <typename Q>
    static void tiles(const Panels & p, int np, const Acts16 & a, int64_t n, float * y, int64_t ldy, int nr,
                      int64_t n_tok) {
        for (int64_t t0 = 0; t0 < n_tok; t0 += kMicroT) {
            const int    nt = static_cast<int>(n_tok - t0 < kMicroT ? n_tok - t0 : kMicroT);
            const Acts16 at{ a.v + t0 * a.ldv, a.step + t0 * a.ld_blocks, a.sums + t0 * a.ld_blocks, a.ldv,
                             a.ld_blocks };
            if (np == 2) {
                MicroTable<Q, 2>::fn[nt](p, at, n, y + t0 * ldy, ldy, nr);
            } else {
                MicroTable<Q, 1>::fn[nt](p, at, n, y + t0 * ldy, ldy, nr);
            }
        }
    }
};

// ---- the one-pass prefill (qgemm.h: qgemm_onepass_avx512vnni; qgemm-impl.h: Acts8, Panels8) ----------------------
// Rows [r0, r0 + nr) (nr <= 16) of w as one one-pass panel (two 32-element blocks per transpose).
template <typename Q>
void pack_panel8(const WeightView & w, int64_t r0, int nr, uint8_t * q, float * scale, float * min) {
    const auto * base = static_cast<const char *>(w.data) + r0 * static_cast<int64_t>(w.row_bytes);
    for (int64_t b = 0; b < w.n_in / 32; b += 2) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
            const char * row = base + i * static_cast<int64_t>(w.row_bytes);
            r[i] = i < nr
                       ? _mm512_inserti64x4(_mm512_castsi256_si512(Bytes<Q>::get(row, b)), Bytes<Q>::get(row, b + 1), 1)
                       : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int j = 0; j < 16; ++j) {
            _mm512_store_si512(q + 64 * (8 * b + j), r[j]);
        }
    }
    pack_factors<Q>(w, r0, nr, scale, min);
}

inline __m512i bcast_quad(const int8_t * v) {
    int32_t quad;
    std::memcpy(&quad, v, 4);
    return _mm512_set1_epi32(quad);
}

// As micro() for the one-pass panels and activations.
template <typename Q, int T, int NP>
void micro8(const Panels8 & p, const Acts8 & a, int64_t n, float * y, int64_t ldy, int nr) {
    constexpr int G = Q::kGroup, kOffset = Bytes<Q>::kOffset;
    __m512        acc[T][NP];
    for (int t = 0; t < T; ++t) {
        for (int u = 0; u < NP; ++u) {
            acc[t][u] = _mm512_setzero_ps();
        }
    }
    for (int64_t gi = 0; gi < n / G; ++gi) {
        const int64_t b = gi * G / 32;
        __m512i       s[T][NP];
        for (int t = 0; t < T; ++t) {
            for (int u = 0; u < NP; ++u) {
                s[t][u] = kOffset == 0 ? _mm512_setzero_si512()
                                       : _mm512_set1_epi32(kOffset * a.start[2 * a.ld_blocks * t + gi]);
            }
        }
#pragma GCC unroll 8
        for (int kq = 0; kq < G / 4; ++kq) {
            const int64_t k = gi * G + 4 * kq;
            __m512i       wq[NP];
            for (int u = 0; u < NP; ++u) {
                wq[u] = _mm512_load_si512(p.q[u] + 16 * k);
            }
#pragma GCC unroll 6
            for (int t = 0; t < T; ++t) {
                const __m512i x = bcast_quad(a.v + t * a.ldv + k);
                for (int u = 0; u < NP; ++u) {
                    s[t][u] = _mm512_dpbusd_epi32(s[t][u], wq[u], x);
                }
            }
        }
        for (int t = 0; t < T; ++t) {
            const __m512 d = _mm512_set1_ps(a.d[t * a.ld_blocks + b]);
            for (int u = 0; u < NP; ++u) {
                const __m512 f = _mm512_mul_ps(_mm512_load_ps(p.scale[u] + 16 * gi), d);
                acc[t][u]      = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t][u]), f, acc[t][u]);
            }
        }
        if constexpr (Q::kHasMin) {  // G == 32: one min per group
            subtract_mins<T, NP>(acc, p.min, a.sums + b, a.ld_blocks, b);
        }
    }
    store_tile<T, NP>(acc, y, ldy, nr);
}

template <typename Q, int NP>
using Micro8Fn = void (*)(const Panels8 &, const Acts8 &, int64_t, float *, int64_t, int);

template <typename Q, int NP>
struct Micro8Table {
    static constexpr Micro8Fn<Q, NP> fn[kMicroT + 1] = { nullptr,          micro8<Q, 1, NP>, micro8<Q, 2, NP>,
                                                         micro8<Q, 3, NP>, micro8<Q, 4, NP>, micro8<Q, 5, NP>,
                                                         micro8<Q, 6, NP> };
};
// The one-pass kernel set of qgemm-impl.h: every token against a unit's panels, kMicroT tokens x both panels at a time.
struct Kernels8 {
    template <typename Q>
    static void tiles(const Panels8 & p, int np, const Acts8 & a, int64_t n, float * y, int64_t ldy, int nr,
                      int64_t n_tok) {
        for (int64_t t0 = 0; t0 < n_tok; t0 += kMicroT) {
            const int   nt = static_cast<int>(n_tok - t0 < kMicroT ? n_tok - t0 : kMicroT);
            const Acts8 at = a.from(t0);
            if (np == 2) {
                Micro8Table<Q, 2>::fn[nt](p, at, n, y + t0 * ldy, ldy, nr);
            } else {
                Micro8Table<Q, 1>::fn[nt](p, at, n, y + t0 * ldy, ldy, nr);
            }
        }
    }
};

}  // namespace avx512vnni

void qgemm_avx512vnni(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                      ThreadPool & pool) {
    avx512vnni::qgemm<avx512vnni::Kernels>(w, y, n_mats, x, n_tok, pool);
}

void qgemm_onepass_avx512vnni(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                              ThreadPool & pool) {
    avx512vnni::qgemm_onepass<avx512vnni::Kernels8>(w, y, n_mats, x, n_tok, pool);
}

}  // namespace kvcmas::cpu::detail
