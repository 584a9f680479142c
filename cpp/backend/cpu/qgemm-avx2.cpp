// The integer prefill GEMM with AVX2 (compiled with -mavx2 -mfma -mf16c; called only after the run-time check), for
// CPUs without AVX512-VNNI. Contract, number formats and error: qgemm.h. The panels have the layout of the AVX-512
// file (qgemm-impl.h: Panels), a 16-row panel is two ymm of 8 rows, and each pair product is vpmaddwd + vpaddd
// where AVX512-VNNI has one vpdpwssd: the same exact int32 sums, then the same f32 steps per output, so the same bits.
#include <immintrin.h>

#include <cstring>

#define KC_QGEMM_NS avx2
#include "backend/cpu/qgemm-impl.h"

namespace kvcmas::cpu::detail {
namespace avx2 {

// Tokens per micro tile (one panel, 16 rows): 6 int32 sums + 6 f32 accumulators, 2 weight vectors and a broadcast
// fit the 16 ymm (4 tokens spill, and ran 15% slower).
constexpr int kMicroT = 3;

inline float h2f(uint16_t h) {
    return _cvtsh_ss(h);
}

inline __m128i load128(const void * p) {
    return _mm_loadu_si128(static_cast<const __m128i *>(p));
}

// The 32 int16 quants of a block: elements 0..15 and 16..31.
struct Quants {
    __m256i lo, hi;
};

// 32 bytes to int16, less `offset`.
template <bool Signed>
inline Quants widen(__m256i bytes, int16_t offset) {
    const __m128i a = _mm256_castsi256_si128(bytes), b = _mm256_extracti128_si256(bytes, 1);
    const __m256i o = _mm256_set1_epi16(offset);
    if constexpr (Signed) {
        return { _mm256_sub_epi16(_mm256_cvtepi8_epi16(a), o), _mm256_sub_epi16(_mm256_cvtepi8_epi16(b), o) };
    } else {
        return { _mm256_sub_epi16(_mm256_cvtepu8_epi16(a), o), _mm256_sub_epi16(_mm256_cvtepu8_epi16(b), o) };
    }
}

// ---- unpacking ----------------------------------------------------------------------------------------------------
// Each type gives the 32 integer quants of its 32-element block b of a row, and the f32 factors of a whole row
// (factors(row, n, scale, min, stride): factor g at scale[stride·g], min of block b at min[stride·b]); each factor is
// computed as the AVX-512 file computes it (one f32 product of the same operands).

// Q4_K / Q5_K super-block factors: d·sc_j per 32, the mins dmin·m_j.
template <typename Block>
void k4_factors(const void * row, int64_t n, float * scale, float * min, int64_t stride) {
    const auto * blk = static_cast<const Block *>(row);
    for (int64_t i = 0; i < n / 256; ++i) {
        const ScalesMinsK4 sm = k4_scales_mins(blk[i].scales);
        const float        d = h2f(blk[i].d), dmin = h2f(blk[i].dmin);
        for (int j = 0; j < 8; ++j) {
            scale[stride * (8 * i + j)] = static_cast<float>(sm.b[j]) * d;
            min[stride * (8 * i + j)]   = static_cast<float>(sm.b[8 + j]) * dmin;
        }
    }
}

struct Q4K {
    static constexpr int  kGroup  = 32;
    static constexpr bool kHasMin = true;
    static Quants         quants(const void * row, int64_t b) {
        const auto & blk = static_cast<const BlockQ4_K *>(row)[b / 8];
        return widen<false>(k4_nibbles(blk.qs, static_cast<int>(b % 8)), 0);
    }
    static void factors(const void * row, int64_t n, float * scale, float * min, int64_t stride) {
        k4_factors<BlockQ4_K>(row, n, scale, min, stride);
    }
};

struct Q5K {
    static constexpr int  kGroup  = 32;
    static constexpr bool kHasMin = true;
    static Quants         quants(const void * row, int64_t b) {
        const auto & blk = static_cast<const BlockQ5_K *>(row)[b / 8];
        return widen<false>(q5k_bytes(blk, static_cast<int>(b % 8)), 0);
    }
    static void factors(const void * row, int64_t n, float * scale, float * min, int64_t stride) {
        k4_factors<BlockQ5_K>(row, n, scale, min, stride);
    }
};

// Q6_K (qgemm-impl.h: q6k_bytes): groups of 16 (d·scale_g).
struct Q6K {
    static constexpr int  kGroup  = 16;
    static constexpr bool kHasMin = false;
    static Quants         quants(const void * row, int64_t b) {
        const auto & blk = static_cast<const BlockQ6_K *>(row)[b / 8];
        return widen<false>(q6k_bytes(blk, static_cast<int>(b % 8)), 32);
    }
    static void factors(const void * row, int64_t n, float * scale, float *, int64_t stride) {
        const auto * blk = static_cast<const BlockQ6_K *>(row);
        for (int64_t i = 0; i < n / 256; ++i) {
            const float d = h2f(blk[i].d);
            for (int g = 0; g < 16; ++g) {
                scale[stride * (16 * i + g)] = static_cast<float>(blk[i].scales[g]) * d;
            }
        }
    }
};

// The 32-element block types: x = d·(q - Offset) (+ m with a min). Q8_0's quants are signed bytes; the others keep
// elements 0..15 in the low nibbles of qs and 16..31 in the high ones, and the 5-bit types bit j of qh as element j's
// bit 4.
template <typename Block, int Offset, bool High, bool Min>
struct Block32 {
    static constexpr int  kGroup  = 32;
    static constexpr bool kHasMin = Min;
    static Quants         quants(const void * row, int64_t b) {
        const Block & blk = static_cast<const Block *>(row)[b];
        if constexpr (sizeof(blk.qs) == 32) {
            return widen<true>(load256(blk.qs), 0);
        } else {
            const __m128i v = load128(blk.qs), m = _mm_set1_epi8(0x0F);
            Quants        q =
                widen<false>(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m)), Offset);
            if constexpr (High) {
                uint32_t bits;
                std::memcpy(&bits, blk.qh, 4);
                const __m256i lane = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                       16384, static_cast<int16_t>(-32768));
                const __m256i add  = _mm256_set1_epi16(16);
                const __m256i lo   = _mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits & 0xFFFF)), lane);
                const __m256i hi   = _mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(bits >> 16)), lane);
                q.lo               = _mm256_add_epi16(q.lo, _mm256_and_si256(_mm256_cmpeq_epi16(lo, lane), add));
                q.hi               = _mm256_add_epi16(q.hi, _mm256_and_si256(_mm256_cmpeq_epi16(hi, lane), add));
            }
            return q;
        }
    }
    static void factors(const void * row, int64_t n, float * scale, float * min, int64_t stride) {
        const auto * blk = static_cast<const Block *>(row);
        for (int64_t b = 0; b < n / 32; ++b) {
            scale[stride * b] = h2f(blk[b].d);
            if constexpr (Min) {
                min[stride * b] = -h2f(blk[b].m);  // subtracted: w = d·q + m
            }
        }
    }
};

// 8 vectors of 8 dwords: r[i] dword j -> out[j] dword i. In place.
inline void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i]     = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // u[4h + c], 128-bit lane L: rows 4h .. 4h + 3 of column 4L + c.
    for (int h = 0; h < 2; ++h) {
        u[4 * h]     = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        r[c]     = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
        r[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
}

template <typename Q>
void pack_factors(const WeightView & w, int64_t r0, int nr, float * scale, float * min);

// Unpacks rows [r0, r0 + nr) (nr <= 16) of w into one panel: quants at q, factors at scale / min (missing rows: zero
// quants and factors).
template <typename Q>
void pack_panel(const WeightView & w, int64_t r0, int nr, int16_t * q, float * scale, float * min) {
    const auto *  base      = static_cast<const char *>(w.data) + r0 * static_cast<int64_t>(w.row_bytes);
    const int64_t row_bytes = static_cast<int64_t>(w.row_bytes);
    const int64_t nb        = w.n_in / 32;
    for (int64_t b = 0; b < nb; ++b) {
        // Rows 8h .. 8h + 7: lo holds k-pairs 0..7 of the block (one dword each), hi 8..15.
        for (int h = 0; h < 2; ++h) {
            __m256i lo[8], hi[8];
            for (int i = 0; i < 8; ++i) {
                const int r = 8 * h + i;
                if (r < nr) {
                    const Quants v = Q::quants(base + r * row_bytes, b);
                    lo[i]          = v.lo;
                    hi[i]          = v.hi;
                } else {
                    lo[i] = hi[i] = _mm256_setzero_si256();
                }
            }
            transpose8(lo);
            transpose8(hi);
            for (int kp = 0; kp < 8; ++kp) {
                _mm256_store_si256(reinterpret_cast<__m256i *>(q + 32 * (16 * b + kp) + 16 * h), lo[kp]);
                _mm256_store_si256(reinterpret_cast<__m256i *>(q + 32 * (16 * b + 8 + kp) + 16 * h), hi[kp]);
            }
        }
    }
    pack_factors<Q>(w, r0, nr, scale, min);
}

// A panel's f32 factors (layout: Panels) of rows [r0, r0 + nr) of w.
template <typename Q>
void pack_factors(const WeightView & w, int64_t r0, int nr, float * scale, float * min) {
    const auto *  base      = static_cast<const char *>(w.data) + r0 * static_cast<int64_t>(w.row_bytes);
    const int64_t row_bytes = static_cast<int64_t>(w.row_bytes);
    std::memset(scale, 0, static_cast<size_t>(16 * (w.n_in / Q::kGroup)) * sizeof(float));
    if (Q::kHasMin) {
        std::memset(min, 0, static_cast<size_t>(16 * (w.n_in / 32)) * sizeof(float));
    }
    for (int k = 0; k < nr; ++k) {
        Q::factors(base + k * row_bytes, w.n_in, scale + k, min + k, 16);
    }
}

// ---- the micro tile -------------------------------------------------------------------------------------------------

// One group's sums into a micro tile: acc[t][u] += cvt(s[t][u])·(factor_u·step[t·ld]), the factors of the panel's
// rows 8u .. 8u + 7 at scale + 8u.
template <int T>
inline void add_group(__m256 (&acc)[T][2], const __m256i (&s)[T][2], const float * scale, const float * step,
                      int64_t ld) {
    for (int t = 0; t < T; ++t) {
        const __m256 st = _mm256_set1_ps(step[t * ld]);
        for (int u = 0; u < 2; ++u) {
            const __m256 f = _mm256_mul_ps(_mm256_load_ps(scale + 8 * u), st);
            acc[t][u]      = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t][u]), f, acc[t][u]);
        }
    }
}

// One 32-block's min term: acc[t][u] -= min_u·sums[t·ld] (the exact sums of x).
template <int T>
inline void subtract_mins(__m256 (&acc)[T][2], const float * min, const float * sums, int64_t ld) {
    for (int t = 0; t < T; ++t) {
        const __m256 sum = _mm256_set1_ps(sums[t * ld]);
        for (int u = 0; u < 2; ++u) {
            acc[t][u] = _mm256_fnmadd_ps(_mm256_load_ps(min + 8 * u), sum, acc[t][u]);
        }
    }
}

// A micro tile's results: token t's rows r < nr (<= 16) of one panel at y[t·ldy + r].
template <int T>
inline void store_tile(const __m256 (&acc)[T][2], float * y, int64_t ldy, int nr) {
    for (int t = 0; t < T; ++t) {
        if (nr >= 16) {
            _mm256_storeu_ps(y + t * ldy, acc[t][0]);
            _mm256_storeu_ps(y + t * ldy + 8, acc[t][1]);
        } else {
            alignas(32) float out[16];
            _mm256_store_ps(out, acc[t][0]);
            _mm256_store_ps(out + 8, acc[t][1]);
            std::memcpy(y + t * ldy, out, static_cast<size_t>(nr) * sizeof(float));
        }
    }
}

inline __m256i bcast_pair(const int16_t * v) {
    int32_t pair;
    std::memcpy(&pair, v, 4);
    return _mm256_set1_epi32(pair);
}

// y[t·ldy + r] for T tokens and the rows r < nr (<= 16) of one panel: per group, the integer sums of pair products
// (vpmaddwd + vpaddd), then acc += cvt(Σ)·(factor·step); per 32-block, acc -= min·sum (the AVX-512 file's steps).
template <typename Q, int T>
void micro(const int16_t * wq, const float * scale, const float * min, const Acts16 & a, int64_t n, float * y,
           int64_t ldy, int nr) {
    constexpr int G = Q::kGroup;
    __m256        acc[T][2];
    for (int t = 0; t < T; ++t) {
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    }
    const int64_t nb = n / 32;
    for (int64_t b = 0; b < nb; ++b) {
        for (int g = 0; g < 32 / G; ++g) {
            const int64_t kp0 = 16 * b + g * (G / 2);
            __m256i       s[T][2];
            for (int t = 0; t < T; ++t) {
                s[t][0] = s[t][1] = _mm256_setzero_si256();
            }
            // Not unrolled fully: GCC then reassociates the sums into a tree of stored products (2x slower).
#pragma GCC unroll 2
            for (int kp = 0; kp < G / 2; ++kp) {
                const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i *>(wq + 32 * (kp0 + kp)));
                const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i *>(wq + 32 * (kp0 + kp) + 16));
                for (int t = 0; t < T; ++t) {
                    const __m256i x = bcast_pair(a.v + t * a.ldv + 2 * (kp0 + kp));
                    s[t][0]         = _mm256_add_epi32(s[t][0], _mm256_madd_epi16(w0, x));
                    s[t][1]         = _mm256_add_epi32(s[t][1], _mm256_madd_epi16(w1, x));
                }
            }
            const int64_t gi = b * (32 / G) + g;
            add_group<T>(acc, s, scale + 16 * gi, a.step + b, a.ld_blocks);
        }
        if constexpr (Q::kHasMin) {
            subtract_mins<T>(acc, min + 16 * b, a.sums + b, a.ld_blocks);
        }
    }
    store_tile<T>(acc, y, ldy, nr);
}

template <typename Q>
using MicroFn = void (*)(const int16_t *, const float *, const float *, const Acts16 &, int64_t, float *, int64_t, int);

template <typename Q>
struct MicroTable {
    static constexpr MicroFn<Q> fn[kMicroT + 1] = { nullptr, micro<Q, 1>, micro<Q, 2>, micro<Q, 3> };
};
static_assert(kMicroT == 3, "micro tiles of up to 3 tokens");

// The kernel set of qgemm-impl.h.
struct Kernels {
    static void join(const int8_t * q, const int8_t * qr, int16_t * v, int64_t n) {
        for (int64_t k = 0; k < n; k += 16) {
            const __m256i hi = _mm256_slli_epi16(_mm256_cvtepi8_epi16(load128(q + k)), 8);
            _mm256_storeu_si256(reinterpret_cast<__m256i *>(v + k),
                                _mm256_add_epi16(hi, _mm256_cvtepi8_epi16(load128(qr + k))));
        }
    }
    // Panel by panel, kMicroT tokens at a time (the panel's quants stay in L2 over the tokens).
    template <typename Q>
    static void tiles(const Panels & p, int np, const Acts16 & a, int64_t n, float * y, int64_t ldy, int nr,
                      int64_t n_tok) {
        for (int u = 0; u < np; ++u) {
            const int rn = nr - kPanelRows * u < kPanelRows ? nr - kPanelRows * u : kPanelRows;
            for (int64_t t0 = 0; t0 < n_tok; t0 += kMicroT) {
                const int    nt = static_cast<int>(n_tok - t0 < kMicroT ? n_tok - t0 : kMicroT);
                const Acts16 at{ a.v + t0 * a.ldv, a.step + t0 * a.ld_blocks, a.sums + t0 * a.ld_blocks, a.ldv,
                                 a.ld_blocks };
                MicroTable<Q>::fn[nt](p.q[u], p.scale[u], p.min[u], at, n, y + t0 * ldy + kPanelRows * u, ldy, rn);
            }
        }
    }
};

// ---- the one-pass GEMM (qgemm.h: qgemm_onepass_avx2; qgemm-impl.h: Acts8, Panels8) --------------------------------
// vpmaddubsw (unsigned weight byte x signed activation byte, adjacent pairs summed to int16: |Σ| <= 2·63·127, no
// saturation) over two quads, the two int16 sums added (<= 32004) and widened by vpmaddwd with ones: the exact int32
// sums of the AVX-512 file's vpdpbusd, then its f32 steps: the same bits.

constexpr int kMicroT8 = 2;  // tokens per one-pass micro tile: 4 int32 + 4 f32 accumulators, 4 weight vectors

// Rows [r0, r0 + nr) (nr <= 16) of w as one one-pass panel (qgemm-impl.h: pack_panel8).
template <typename Q>
void pack_panel8(const WeightView & w, int64_t r0, int nr, uint8_t * q, float * scale, float * min) {
    const auto *  base      = static_cast<const char *>(w.data) + r0 * static_cast<int64_t>(w.row_bytes);
    const int64_t row_bytes = static_cast<int64_t>(w.row_bytes);
    for (int64_t b = 0; b < w.n_in / 32; ++b) {
        for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7: r[j] becomes their quad j of the block
            __m256i r[8];
            for (int i = 0; i < 8; ++i) {
                const int row = 8 * h + i;
                r[i]          = row < nr ? Bytes<Q>::get(base + row * row_bytes, b) : _mm256_setzero_si256();
            }
            transpose8(r);
            for (int j = 0; j < 8; ++j) {
                _mm256_store_si256(reinterpret_cast<__m256i *>(q + 64 * (8 * b + j) + 32 * h), r[j]);
            }
        }
    }
    pack_factors<Q>(w, r0, nr, scale, min);
}

inline __m256i bcast_quad(const int8_t * v) {
    int32_t quad;
    std::memcpy(&quad, v, 4);
    return _mm256_set1_epi32(quad);
}

// As micro() for one one-pass panel (wq: its quads) and T tokens.
template <typename Q, int T>
void micro8(const uint8_t * wq, const float * scale, const float * min, const Acts8 & a, int64_t n, float * y,
            int64_t ldy, int nr) {
    constexpr int G = Q::kGroup, kOffset = Bytes<Q>::kOffset;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256        acc[T][2];
    for (int t = 0; t < T; ++t) {
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    }
    for (int64_t gi = 0; gi < n / G; ++gi) {
        const int64_t b = gi * G / 32;
        __m256i       s[T][2];
        for (int t = 0; t < T; ++t) {
            s[t][0] = s[t][1] =
                kOffset == 0 ? _mm256_setzero_si256() : _mm256_set1_epi32(kOffset * a.start[2 * a.ld_blocks * t + gi]);
        }
        for (int k = static_cast<int>(gi * G); k < (gi + 1) * G; k += 8) {  // two quads
            const __m256i w00 = _mm256_load_si256(reinterpret_cast<const __m256i *>(wq + 16 * k));
            const __m256i w01 = _mm256_load_si256(reinterpret_cast<const __m256i *>(wq + 16 * k + 32));
            const __m256i w10 = _mm256_load_si256(reinterpret_cast<const __m256i *>(wq + 16 * k + 64));
            const __m256i w11 = _mm256_load_si256(reinterpret_cast<const __m256i *>(wq + 16 * k + 96));
            for (int t = 0; t < T; ++t) {
                const __m256i x0 = bcast_quad(a.v + t * a.ldv + k), x1 = bcast_quad(a.v + t * a.ldv + k + 4);
                const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(w00, x0), _mm256_maddubs_epi16(w10, x1));
                const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(w01, x0), _mm256_maddubs_epi16(w11, x1));
                s[t][0]          = _mm256_add_epi32(s[t][0], _mm256_madd_epi16(p0, ones));
                s[t][1]          = _mm256_add_epi32(s[t][1], _mm256_madd_epi16(p1, ones));
            }
        }
        add_group<T>(acc, s, scale + 16 * gi, a.d + b, a.ld_blocks);
        if constexpr (Q::kHasMin) {  // G == 32: one min per group
            subtract_mins<T>(acc, min + 16 * b, a.sums + b, a.ld_blocks);
        }
    }
    store_tile<T>(acc, y, ldy, nr);
}

template <typename Q>
using Micro8Fn = void (*)(const uint8_t *, const float *, const float *, const Acts8 &, int64_t, float *, int64_t, int);

template <typename Q>
struct Micro8Table {
    static constexpr Micro8Fn<Q> fn[kMicroT8 + 1] = { nullptr, micro8<Q, 1>, micro8<Q, 2> };
};
static_assert(kMicroT8 == 2, "one-pass micro tiles of up to 2 tokens");

// The one-pass kernel set of qgemm-impl.h: panel by panel, kMicroT8 tokens at a time.
struct Kernels8 {
    template <typename Q>
    static void tiles(const Panels8 & p, int np, const Acts8 & a, int64_t n, float * y, int64_t ldy, int nr,
                      int64_t n_tok) {
        for (int u = 0; u < np; ++u) {
            const int rn = nr - kPanelRows * u < kPanelRows ? nr - kPanelRows * u : kPanelRows;
            for (int64_t t0 = 0; t0 < n_tok; t0 += kMicroT8) {
                const int nt = static_cast<int>(n_tok - t0 < kMicroT8 ? n_tok - t0 : kMicroT8);
                Micro8Table<Q>::fn[nt](p.q[u], p.scale[u], p.min[u], a.from(t0), n, y + t0 * ldy + kPanelRows * u, ldy,
                                       rn);
            }
        }
    }
};

}  // namespace avx2

void qgemm_avx2(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                ThreadPool & pool) {
    avx2::qgemm<avx2::Kernels>(w, y, n_mats, x, n_tok, pool);
}

void qgemm_onepass_avx2(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                        ThreadPool & pool) {
    avx2::qgemm_onepass<avx2::Kernels8>(w, y, n_mats, x, n_tok, pool);
}

}  // namespace kvcmas::cpu::detail
