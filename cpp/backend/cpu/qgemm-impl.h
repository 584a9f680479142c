// The driver of the integer prefill GEMM (qgemm.h), shared by its instruction-set files: included by
// qgemm-avx512vnni.cpp and qgemm-avx2.cpp, each inside its own namespace (KC_QGEMM_NS) so that the two compilations
// never merge. The file defines what is declared below: its weight types (Q4K, Q5K, Q6K, Block32: kGroup, elements
// per factor; kHasMin, a min per 32-block), pack_panel, and a kernel set K (K::join, K::tiles) for qgemm<K>.
// Every output is one thread's, computed in a fixed order by K::tiles: the bits do not depend on the thread count.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <cstdint>

#include "backend/cpu/matmul-impl.h"
#include "backend/cpu/qgemm.h"
#include "backend/cpu/quants-dot.h"

#ifndef KC_QGEMM_NS
#error "define KC_QGEMM_NS before including qgemm-impl.h"
#endif

namespace kvcmas::cpu::detail {
namespace KC_QGEMM_NS {

constexpr int     kPanelRows  = 16;  // weight rows per panel
constexpr int     kUnitPanels = 2;   // panels per work unit (32 rows)
constexpr int64_t kUnitRows   = kPanelRows * kUnitPanels;

// The activations of one call: v[t·ldv + k] = 256·q + qr (x̂ = step·v), and per 32 elements (t·ld_blocks + b) the
// step and the exact sum of x (for the min term of Q4_1, Q5_1, Q4_K and Q5_K).
struct Acts16 {
    const int16_t * v;
    const float *   step;
    const float *   sums;
    int64_t         ldv;
    int64_t         ld_blocks;
};

// One work unit's weights, unpacked: panel p's quants at q[p] (k-pair kp at q[p] + 32·kp: the two elements 2kp,
// 2kp + 1 of rows 0..15, row r at int16 2r and 2r + 1), its f32 factors per group g at scale[p] + 16·g (row r at
// + r), and for types with a min, the min factor per 32-block b at min[p] + 16·b (subtracted: w = factor·q - min).
struct Panels {
    const int16_t * q[kUnitPanels];
    const float *   scale[kUnitPanels];
    const float *   min[kUnitPanels];
};

// The weight types, defined by the including file.
struct Q4K;
struct Q5K;
struct Q6K;
template <typename Block, int Offset, bool High, bool Min>
struct Block32;  // the 32-element block types: x = d·(q - Offset) (+ m with a min); High: a 5th bit in qh
using Q40 = Block32<BlockQ4_0, 8, false, false>;
using Q41 = Block32<BlockQ4_1, 0, false, true>;
using Q50 = Block32<BlockQ5_0, 16, true, false>;
using Q51 = Block32<BlockQ5_1, 0, true, true>;
using Q80 = Block32<BlockQ8_0, 0, false, false>;

// ---- K-quant blocks as bytes (AVX2; each file widens them to int16) ------------------------------------------------

inline __m256i load256(const void * p) {
    return _mm256_loadu_si256(static_cast<const __m256i *>(p));
}

// Q4_K / Q5_K sub-block j's 4-bit quants (qs[32C + l] holds element l of sub-blocks 2C, low nibble, and 2C + 1).
inline __m256i k4_nibbles(const uint8_t * qs, int j) {
    return _mm256_and_si256(_mm256_srl_epi16(load256(qs + 32 * (j / 2)), _mm_cvtsi32_si128(4 * (j % 2))),
                            _mm256_set1_epi8(0x0F));
}

// Q5_K sub-block j's 5-bit quants: bit j of qh[l] is element l's 0x10 (a 16-bit shift: for j < 8 the bit that lands
// on bit 0 of each byte comes from the same byte).
inline __m256i q5k_bytes(const BlockQ5_K & blk, int j) {
    const __m256i hi = _mm256_slli_epi16(
        _mm256_and_si256(_mm256_srl_epi16(load256(blk.qh), _mm_cvtsi32_si128(j)), _mm256_set1_epi8(0x01)), 4);
    return _mm256_or_si256(k4_nibbles(blk.qs, j), hi);
}

// Q6_K block k = 4h + C of a super-block (half h, chunk C): element e takes nibble C / 2 of ql[64h + 32(C % 2) + e]
// and bits 2C of qh[32h + e]: the unsigned 6-bit quants (w = d·scale·(q - 32); groups of 16).
inline __m256i q6k_bytes(const BlockQ6_K & blk, int k) {
    const int     h = k / 4, c = k % 4;
    const __m256i lo =
        _mm256_and_si256(_mm256_srl_epi16(load256(blk.ql + 64 * h + 32 * (c % 2)), _mm_cvtsi32_si128(4 * (c / 2))),
                         _mm256_set1_epi8(0x0F));
    const __m256i hi =
        _mm256_and_si256(_mm256_srl_epi16(load256(blk.qh + 32 * h), _mm_cvtsi32_si128(2 * c)), _mm256_set1_epi8(0x03));
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
}

// Unpacks rows [r0, r0 + nr) (nr <= 16) of w into one panel (layout: Panels): quants at q, factors at scale / min
// (missing rows: zero quants and factors). Defined by the including file.
template <typename Q>
void pack_panel(const WeightView & w, int64_t r0, int nr, int16_t * q, float * scale, float * min);

// The including file's kernel set K gives
//   K::join(q, qr, v, n)                          the two passes of n activations joined into v = 256·q + qr;
//   K::tiles<Q>(p, np, a, n, y, ldy, nr, n_tok)   every token against a unit's np panels (nr rows) in its micro tiles.

inline thread_local ScratchBuffer tl_panels;  // a work unit's unpacked panels
inline thread_local ScratchBuffer tl_quant;   // one activation row's two passes (quantize_q8_avx2's outputs)
inline thread_local ScratchBuffer tl_acts;    // the call's activations (caller thread)

// x [n_tok][n_in] -> the 16-bit activations, tokens shared out over the pool.
template <typename K>
Acts16 quantize_acts16(const float * x, int64_t n_in, int64_t n_tok, ThreadPool & pool) {
    const int64_t nb     = n_in / 32;
    const size_t  vbytes = (static_cast<size_t>(n_tok * n_in) * sizeof(int16_t) + 63) & ~size_t(63);
    char *        buf  = static_cast<char *>(tl_acts.get(vbytes + 2 * static_cast<size_t>(n_tok * nb) * sizeof(float)));
    auto *        v    = reinterpret_cast<int16_t *>(buf);
    auto *        step = reinterpret_cast<float *>(buf + vbytes);
    float *       sums = step + n_tok * nb;
    pool.run([&](int ith, int nth) {
        char * scratch = static_cast<char *>(tl_quant.get(2 * static_cast<size_t>(n_in) + 2 * sizeof(float) * nb));
        auto * q       = reinterpret_cast<int8_t *>(scratch);
        auto * qr      = q + n_in;
        auto * groups  = reinterpret_cast<float *>(scratch + 2 * n_in);  // unused here: Q6_K's offset is in its quants
        for (int64_t t = ith; t < n_tok; t += nth) {
            quantize_q8_avx2(x + t * n_in, n_in, q, qr, step + t * nb, sums + t * nb, groups);
            K::join(q, qr, v + t * n_in, n_in);
        }
    });
    return Acts16{ v, step, sums, n_in, nb };
}

// A panel's bytes for rows of n elements: quants (16 int16 per element), factors (16 floats per group), mins (16
// floats per 32-block).
template <typename Q>
size_t panel_bytes(int64_t n) {
    return static_cast<size_t>(16 * n) * sizeof(int16_t) +
           static_cast<size_t>(16 * (n / Q::kGroup + n / 32)) * sizeof(float);
}

// Work unit `unit` of matrix w (rows 32·unit ..): its panels unpacked into buf, then every token against them.
template <typename K, typename Q>
void run_unit(const WeightView & w, const Acts16 & a, float * y, int64_t n_tok, int64_t unit, char * buf) {
    const int64_t n = w.n_in, r0 = unit * kUnitRows;
    const int     nr = static_cast<int>(w.n_out - r0 < kUnitRows ? w.n_out - r0 : kUnitRows);
    const int     np = (nr + kPanelRows - 1) / kPanelRows;
    Panels        p{};
    for (int u = 0; u < np; ++u) {
        char *    at    = buf + u * panel_bytes<Q>(n);
        auto *    q     = reinterpret_cast<int16_t *>(at);
        auto *    scale = reinterpret_cast<float *>(at + static_cast<size_t>(16 * n) * sizeof(int16_t));
        float *   min   = scale + 16 * (n / Q::kGroup);
        const int rn    = nr - kPanelRows * u < kPanelRows ? nr - kPanelRows * u : kPanelRows;
        pack_panel<Q>(w, r0 + kPanelRows * u, rn, q, scale, min);
        p.q[u]     = q;
        p.scale[u] = scale;
        p.min[u]   = min;
    }
    K::template tiles<Q>(p, np, a, n, y + r0, w.n_out, nr, n_tok);
}

struct UnitKernel {
    void (*run)(const WeightView &, const Acts16 &, float *, int64_t, int64_t, char *);
    size_t panel_bytes;  // per panel, for this matrix's rows
};

template <typename K, typename Q>
UnitKernel unit_kernel(int64_t n) {
    return { run_unit<K, Q>, panel_bytes<Q>(n) };
}

// Only for the types qgemm_type() accepts.
template <typename K>
UnitKernel select_unit(GgmlType type, int64_t n) {
    switch (type) {
        case GgmlType::Q4_0:
            return unit_kernel<K, Q40>(n);
        case GgmlType::Q4_1:
            return unit_kernel<K, Q41>(n);
        case GgmlType::Q5_0:
            return unit_kernel<K, Q50>(n);
        case GgmlType::Q5_1:
            return unit_kernel<K, Q51>(n);
        case GgmlType::Q8_0:
            return unit_kernel<K, Q80>(n);
        case GgmlType::Q4_K:
            return unit_kernel<K, Q4K>(n);
        case GgmlType::Q5_K:
            return unit_kernel<K, Q5K>(n);
        default:
            return unit_kernel<K, Q6K>(n);
    }
}

// The 32-row work units of n_mats matrices handed out to the pool's threads from a counter: run(m, unit, buf) for
// each unit of matrix m, buf a thread's buf_bytes of scratch for the unit's unpacked panels.
template <typename Run>
void run_units(const WeightView * w, int n_mats, ThreadPool & pool, size_t buf_bytes, const Run & run) {
    int64_t first_unit[kMaxMatmulMulti + 1];  // global number of each matrix's first unit; [n_mats] = total
    first_unit[0] = 0;
    for (int i = 0; i < n_mats; ++i) {
        first_unit[i + 1] = first_unit[i] + (w[i].n_out + kUnitRows - 1) / kUnitRows;
    }
    std::atomic<int64_t> next{ 0 };
    pool.run([&](int, int) {
        char * buf = static_cast<char *>(tl_panels.get(buf_bytes));
        int    m   = 0;
        for (;;) {
            const int64_t unit = next.fetch_add(1, std::memory_order_relaxed);
            if (unit >= first_unit[n_mats]) {
                return;
            }
            while (unit >= first_unit[m + 1]) {
                ++m;
            }
            run(m, unit - first_unit[m], buf);
        }
    });
}

// The contract of qgemm_avx512vnni / qgemm_avx2 (qgemm.h) with kernel set K.
template <typename K>
void qgemm(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok, ThreadPool & pool) {
    const Acts16 a = quantize_acts16<K>(x, w[0].n_in, n_tok, pool);
    UnitKernel   k[kMaxMatmulMulti];
    size_t       buf_bytes = 0;
    for (int i = 0; i < n_mats; ++i) {
        k[i]      = select_unit<K>(w[i].type, w[i].n_in);
        buf_bytes = k[i].panel_bytes * kUnitPanels > buf_bytes ? k[i].panel_bytes * kUnitPanels : buf_bytes;
    }
    run_units(w, n_mats, pool, buf_bytes,
              [&](int m, int64_t unit, char * buf) { k[m].run(w[m], a, y[m], n_tok, unit, buf); });
}

// ---- the one-pass GEMM (qgemm.h: Activations::Q8Fast) -------------------------------------------------------------
// Activations in one 8-bit pass, x̂ = d·q (d = max|x| / 127 per 32, decode's first pass), weights as unsigned bytes,
// vpdpbusd (4 byte products summed into an int32 lane). A panel's quad kq holds elements 4kq .. 4kq + 3 of its 16
// rows (row r at bytes 4r ..); Q6_K's -32 is taken out with the activations' sums per 16 (the int32 sums start at
// -32·Σq), Q4_K / Q5_K's min as on the 16-bit path, from the exact sums of x.

struct Acts8 {
    const int8_t *  v;      // v[t·ldv + k] = q
    const float *   d;      // per 32 elements (t·ld_blocks + b): x̂ = d·q
    const float *   sums;   // per 32 elements: the exact Σx (min term)
    const int32_t * start;  // per 16 elements (t·2·ld_blocks + g): -Offset·Σq, the group's int32 sums' start
    int64_t         ldv;
    int64_t         ld_blocks;

    Acts8 from(int64_t t0) const {  // the activations of tokens t0 ..
        return { v + t0 * ldv, d + t0 * ld_blocks, sums + t0 * ld_blocks, start + 2 * t0 * ld_blocks, ldv, ld_blocks };
    }
};

// The K-quant types' unsigned quants of 32-element block b (as bytes), and their offset (w = factor·(q - Offset)).
template <typename Q>
struct Bytes;
template <>
struct Bytes<Q4K> {
    static constexpr int kOffset = 0;
    static __m256i       get(const void * row, int64_t b) {
        return k4_nibbles(static_cast<const BlockQ4_K *>(row)[b / 8].qs, static_cast<int>(b % 8));
    }
};
template <>
struct Bytes<Q5K> {
    static constexpr int kOffset = 0;
    static __m256i       get(const void * row, int64_t b) {
        return q5k_bytes(static_cast<const BlockQ5_K *>(row)[b / 8], static_cast<int>(b % 8));
    }
};
template <>
struct Bytes<Q6K> {
    static constexpr int kOffset = 32;
    static __m256i       get(const void * row, int64_t b) {
        return q6k_bytes(static_cast<const BlockQ6_K *>(row)[b / 8], static_cast<int>(b % 8));
    }
};

inline thread_local ScratchBuffer tl_acts8;

inline Acts8 quantize_acts8(const float * x, int64_t n_in, int64_t n_tok, ThreadPool & pool) {
    const int64_t nb     = n_in / 32;
    const size_t  vbytes = (static_cast<size_t>(n_tok * n_in) + 63) & ~size_t(63);
    char *        buf    = static_cast<char *>(tl_acts8.get(vbytes + 4 * static_cast<size_t>(n_tok * nb) * 4));
    auto *        v      = reinterpret_cast<int8_t *>(buf);
    auto *        d      = reinterpret_cast<float *>(buf + vbytes);
    float *       sums   = d + n_tok * nb;
    auto *        start  = reinterpret_cast<int32_t *>(sums + n_tok * nb);
    pool.run([&](int ith, int nth) {
        char * scratch = static_cast<char *>(tl_quant.get(static_cast<size_t>(n_in) + 2 * sizeof(float) * nb));
        auto * qr      = reinterpret_cast<int8_t *>(scratch);
        auto * groups  = reinterpret_cast<float *>(scratch + n_in);  // unused: the sums per 16 of x̂ of two passes
        for (int64_t t = ith; t < n_tok; t += nth) {
            int8_t * q = v + t * n_in;
            quantize_q8_avx2(x + t * n_in, n_in, q, qr, d + t * nb, sums + t * nb, groups);
            for (int64_t b = 0; b < nb; ++b) {
                d[t * nb + b] *= 256;  // the step of 256·q + qr -> of q (exact: a power of two)
            }
            for (int64_t g = 0; g < 2 * nb; ++g) {
                int32_t s = 0;
                for (int e = 0; e < 16; ++e) {
                    s += q[16 * g + e];
                }
                start[2 * nb * t + g] = -s;  // times the offset in the tile
            }
        }
    });
    return Acts8{ v, d, sums, start, n_in, nb };
}

// A one-pass panel: quants (16 bytes per element), factors and mins as on the 16-bit path.
template <typename Q>
size_t panel8_bytes(int64_t n) {
    return static_cast<size_t>(16 * n) + static_cast<size_t>(16 * (n / Q::kGroup + n / 32)) * sizeof(float);
}

struct Panels8 {
    const uint8_t * q[kUnitPanels];
    const float *   scale[kUnitPanels];
    const float *   min[kUnitPanels];
};

// Unit `unit` of w (rows 32·unit ..): its panels unpacked into buf, then every token against them.
// The including file's one-pass kernel set K8 gives K8::tiles<Q>(p, np, a, n, y, ldy, nr, n_tok) (as K::tiles), and
// it defines pack_panel8<Q>(w, r0, nr, q, scale, min): a panel's quad kq at q + 64·kq holds elements 4kq .. 4kq + 3
// of rows 0..15 (row r at bytes 4r ..), its factors as on the 16-bit path.
template <typename Q>
void pack_panel8(const WeightView & w, int64_t r0, int nr, uint8_t * q, float * scale, float * min);

template <typename K8, typename Q>
void run_unit8(const WeightView & w, const Acts8 & a, float * y, int64_t n_tok, int64_t unit, char * buf) {
    const int64_t n = w.n_in, r0 = unit * kUnitRows;
    const int     nr = static_cast<int>(w.n_out - r0 < kUnitRows ? w.n_out - r0 : kUnitRows);
    const int     np = (nr + kPanelRows - 1) / kPanelRows;
    Panels8       p{};
    for (int u = 0; u < np; ++u) {
        char *    at    = buf + u * panel8_bytes<Q>(n);
        auto *    q     = reinterpret_cast<uint8_t *>(at);
        auto *    scale = reinterpret_cast<float *>(at + 16 * n);
        float *   min   = scale + 16 * (n / Q::kGroup);
        const int rn    = nr - kPanelRows * u < kPanelRows ? nr - kPanelRows * u : kPanelRows;
        pack_panel8<Q>(w, r0 + kPanelRows * u, rn, q, scale, min);
        p.q[u]     = q;
        p.scale[u] = scale;
        p.min[u]   = min;
    }
    K8::template tiles<Q>(p, np, a, n, y + r0, w.n_out, nr, n_tok);
}

using Unit8Fn = void (*)(const WeightView &, const Acts8 &, float *, int64_t, int64_t, char *);

// The contract of qgemm_onepass_avx512vnni / qgemm_onepass_avx2 (qgemm.h) with kernel set K8.
template <typename K8>
void qgemm_onepass(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                   ThreadPool & pool) {
    const Acts8 a = quantize_acts8(x, w[0].n_in, n_tok, pool);
    Unit8Fn     run[kMaxMatmulMulti];
    for (int i = 0; i < n_mats; ++i) {
        run[i] = w[i].type == GgmlType::Q6_K   ? run_unit8<K8, Q6K>
                 : w[i].type == GgmlType::Q5_K ? run_unit8<K8, Q5K>
                                               : run_unit8<K8, Q4K>;
    }
    const size_t buf_bytes = kUnitPanels * panel8_bytes<Q6K>(w[0].n_in);  // the largest of the three types'
    run_units(w, n_mats, pool, buf_bytes,
              [&](int m, int64_t unit, char * buf) { run[m](w[m], a, y[m], n_tok, unit, buf); });
}

}  // namespace KC_QGEMM_NS
}  // namespace kvcmas::cpu::detail
