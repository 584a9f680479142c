// The matrix-product driver (decode / prefill paths, work split over the pool), the portable kernels it falls back
// on, and the reference implementation.
#include "backend/cpu/matmul.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "common/error.h"
#include "backend/cpu/cpu-features.h"
#include "backend/cpu/matmul-impl.h"
#include "backend/cpu/qgemm.h"
#include "backend/cpu/quants-dot.h"
#include "backend/cpu/quants.h"

namespace kvcmas::cpu {
namespace detail {

bool has_block_min(GgmlType type) {
    return type == GgmlType::Q4_1 || type == GgmlType::Q5_1 || type == GgmlType::Q4_K || type == GgmlType::Q5_K;
}

// ---- portable kernels ---------------------------------------------------------------------------------------------
// Same arithmetic as the AVX2 kernels (f32 activations, exact integer quants in f32, block scales applied to block
// sums); only the order of the f32 additions differs.

namespace {

// Σ_l q[l]·x[l] over n (a multiple of 4) elements, four partial sums.
float dot_q_x(const int * q, const float * x, int n) {
    float s[4] = { 0, 0, 0, 0 };
    for (int l = 0; l < n; l += 4) {
        for (int u = 0; u < 4; ++u) {
            s[u] += static_cast<float>(q[l + u]) * x[l + u];
        }
    }
    return (s[0] + s[1]) + (s[2] + s[3]);
}

const float * x_row(const DecodeActs & a, int t) {
    return a.x + t * a.ldx;
}

// Float rows: converts a weight row chunk to f32, then plain dot products.
template <typename Conv>
void dot_float_rows(const void * w_row, const DecodeActs & a, int nt, int64_t n, float * out, int64_t os, Conv conv) {
    for (int t = 0; t < nt; ++t) {
        const float * x    = x_row(a, t);
        float         s[4] = { 0, 0, 0, 0 };
        int64_t       k    = 0;
        for (; k + 4 <= n; k += 4) {
            for (int u = 0; u < 4; ++u) {
                s[u] += conv(w_row, k + u) * x[k + u];
            }
        }
        for (; k < n; ++k) {
            s[0] += conv(w_row, k) * x[k];
        }
        out[t * os] = (s[0] + s[1]) + (s[2] + s[3]);
    }
}

void dot_f32_rows(const void * w, const DecodeActs & a, int nt, int64_t n, float * o, int64_t os) {
    dot_float_rows(w, a, nt, n, o, os, [](const void * p, int64_t k) { return static_cast<const float *>(p)[k]; });
}
void dot_f16_rows(const void * w, const DecodeActs & a, int nt, int64_t n, float * o, int64_t os) {
    dot_float_rows(w, a, nt, n, o, os,
                   [](const void * p, int64_t k) { return fp16_to_fp32(static_cast<const uint16_t *>(p)[k]); });
}
void dot_bf16_rows(const void * w, const DecodeActs & a, int nt, int64_t n, float * o, int64_t os) {
    dot_float_rows(w, a, nt, n, o, os,
                   [](const void * p, int64_t k) { return bf16_to_fp32(static_cast<const uint16_t *>(p)[k]); });
}

// 32-element block types: unpack the integer values q (w = d·q, or d·q + m with a min), dot with x per token,
// scale by d; the min adds m·Σx.
template <typename Block, bool HasMin, typename Unpack>
void dot_q32_rows(const void * w_row, const DecodeActs & a, int nt, int64_t n, float * out, int64_t os, Unpack unpack) {
    const auto * b      = static_cast<const Block *>(w_row);
    float        acc[4] = { 0, 0, 0, 0 }, corr[4] = { 0, 0, 0, 0 };
    for (int64_t i = 0; i < n / 32; ++i) {
        int q[32];
        unpack(b[i], q);
        const float d = fp16_to_fp32(b[i].d);
        for (int t = 0; t < nt; ++t) {
            acc[t] += d * dot_q_x(q, x_row(a, t) + 32 * i, 32);
            if constexpr (HasMin) {
                corr[t] += fp16_to_fp32(b[i].m) * a.block_sums[t * a.ld_sums + i];
            }
        }
    }
    for (int t = 0; t < nt; ++t) {
        out[t * os] = acc[t] + corr[t];
    }
}

template <int Offset, typename Block>
void unpack_nibbles(const Block & b, int * q) {
    for (int j = 0; j < 16; ++j) {
        q[j]      = (b.qs[j] & 0x0F) - Offset;
        q[j + 16] = (b.qs[j] >> 4) - Offset;
    }
}
template <int Offset, typename Block>
void unpack_5bit(const Block & b, int * q) {
    uint32_t qh;
    std::memcpy(&qh, b.qh, 4);
    unpack_nibbles<0>(b, q);
    for (int j = 0; j < 32; ++j) {
        q[j] = (q[j] | static_cast<int>(((qh >> j) & 1) << 4)) - Offset;
    }
}

void dot_q4_0_rows(const void * w, const DecodeActs & a, int nt, int64_t n, float * o, int64_t os) {
    dot_q32_rows<BlockQ4_0, false>(w, a, nt, n, o, os, unpack_nibbles<8, BlockQ4_0>);
}
void dot_q4_1_rows(const void * w, const DecodeActs & a, int nt, int64_t n, float * o, int64_t os) {
    dot_q32_rows<BlockQ4_1, true>(w, a, nt, n, o, os, unpack_nibbles<0, BlockQ4_1>);
}
void dot_q5_0_rows(const void * w, const DecodeActs & a, int nt, int64_t n, float * o, int64_t os) {
    dot_q32_rows<BlockQ5_0, false>(w, a, nt, n, o, os, unpack_5bit<16, BlockQ5_0>);
}
void dot_q5_1_rows(const void * w, const DecodeActs & a, int nt, int64_t n, float * o, int64_t os) {
    dot_q32_rows<BlockQ5_1, true>(w, a, nt, n, o, os, unpack_5bit<0, BlockQ5_1>);
}
void dot_q8_0_rows(const void * w, const DecodeActs & a, int nt, int64_t n, float * o, int64_t os) {
    dot_q32_rows<BlockQ8_0, false>(w, a, nt, n, o, os, [](const BlockQ8_0 & b, int * q) {
        for (int j = 0; j < 32; ++j) {
            q[j] = b.qs[j];
        }
    });
}

// Q4_K / Q5_K: sub-block j contributes (d·sc_j)·Σq·x - (dmin·m_j)·Σx.
template <typename Block, bool HasHigh>
void dot_k4_rows(const void * w_row, const DecodeActs & a, int nt, int64_t n, float * out, int64_t os) {
    const auto * b      = static_cast<const Block *>(w_row);
    float        acc[4] = { 0, 0, 0, 0 }, corr[4] = { 0, 0, 0, 0 };
    for (int64_t i = 0; i < n / 256; ++i) {
        const float d = fp16_to_fp32(b[i].d), dmin = fp16_to_fp32(b[i].dmin);
        for (int j = 0; j < 8; ++j) {
            uint8_t sc, m;
            get_scale_min_k4(j, b[i].scales, sc, m);
            const uint8_t * qs = b[i].qs + 32 * (j / 2);
            int             q[32];
            for (int l = 0; l < 32; ++l) {
                q[l] = (qs[l] >> (4 * (j % 2))) & 0x0F;
                if constexpr (HasHigh) {
                    q[l] |= ((b[i].qh[l] >> j) & 1) << 4;
                }
            }
            const float dsc = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
            for (int t = 0; t < nt; ++t) {
                acc[t] += dsc * dot_q_x(q, x_row(a, t) + 256 * i + 32 * j, 32);
                corr[t] += dm * a.block_sums[t * a.ld_sums + 8 * i + j];
            }
        }
    }
    for (int t = 0; t < nt; ++t) {
        out[t * os] = acc[t] - corr[t];
    }
}
void dot_q4_k_rows(const void * w, const DecodeActs & a, int nt, int64_t n, float * o, int64_t os) {
    dot_k4_rows<BlockQ4_K, false>(w, a, nt, n, o, os);
}
void dot_q5_k_rows(const void * w, const DecodeActs & a, int nt, int64_t n, float * o, int64_t os) {
    dot_k4_rows<BlockQ5_K, true>(w, a, nt, n, o, os);
}

// Q6_K: group g of 16 contributes (d·scale_g)·Σ(q - 32)·x.
void dot_q6_k_rows(const void * w_row, const DecodeActs & a, int nt, int64_t n, float * out, int64_t os) {
    const auto * b      = static_cast<const BlockQ6_K *>(w_row);
    float        acc[4] = { 0, 0, 0, 0 };
    for (int64_t i = 0; i < n / 256; ++i) {
        const float d = fp16_to_fp32(b[i].d);
        for (int h = 0; h < 2; ++h) {
            const uint8_t * ql = b[i].ql + 64 * h;
            const uint8_t * qh = b[i].qh + 32 * h;
            int             q[128];
            for (int l = 0; l < 128; ++l) {
                q[l] = (((ql[l % 64] >> (4 * (l / 64))) & 0x0F) | (((qh[l % 32] >> (2 * (l / 32))) & 3) << 4)) - 32;
            }
            for (int g = 0; g < 8; ++g) {
                const float dsc = d * static_cast<float>(b[i].scales[8 * h + g]);
                for (int t = 0; t < nt; ++t) {
                    acc[t] += dsc * dot_q_x(q + 16 * g, x_row(a, t) + 256 * i + 128 * h + 16 * g, 16);
                }
            }
        }
    }
    for (int t = 0; t < nt; ++t) {
        out[t * os] = acc[t];
    }
}

}  // namespace

RowDotFn row_dot_fn_scalar(GgmlType type) {
    switch (type) {
        case GgmlType::F32:
            return dot_f32_rows;
        case GgmlType::F16:
            return dot_f16_rows;
        case GgmlType::BF16:
            return dot_bf16_rows;
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
        default:
            return row_dot_fn_lowbit(type);
    }
}

void gemm_tile_scalar(const float * w, int64_t ldw, int nr, const float * x, int64_t ldx, int nt, int64_t n, float * y,
                      int64_t ldy) {
    for (int t = 0; t < nt; ++t) {
        for (int r = 0; r < nr; ++r) {
            const float * wr   = w + r * ldw;
            const float * xt   = x + t * ldx;
            float         s[4] = { 0, 0, 0, 0 };
            int64_t       k    = 0;
            for (; k + 4 <= n; k += 4) {
                for (int u = 0; u < 4; ++u) {
                    s[u] += wr[k + u] * xt[k + u];
                }
            }
            for (; k < n; ++k) {
                s[0] += wr[k] * xt[k];
            }
            y[t * ldy + r] = (s[0] + s[1]) + (s[2] + s[3]);
        }
    }
}

}  // namespace detail

namespace {

using namespace detail;

// Token counts below this take the decode path (dot products straight from the stored format, each weight row
// read once per 4 tokens); from here on dequantizing row tiles to f32 once for the packed GEMM wins. Measured on
// Zen 3 (1 thread, 1536 × 576/768 weights): unpacking quants to f32 costs more per token than widening halves,
// so the quantized types cross over earlier, nibble types first.
// With 8-bit activations the integer dot products stay ahead of dequantize + f32 GEMM up to here (the server's
// batched decode step over up to 16 sequences reads each weight row once for all of them).
constexpr int64_t kQ8DecodeMaxTokens = 17;

int64_t decode_max_tokens(GgmlType type, bool q8) {
    if (q8) {
        return kQ8DecodeMaxTokens;
    }
    switch (type) {
        case GgmlType::F32:
        case GgmlType::F16:
        case GgmlType::BF16:
            return 12;
        case GgmlType::Q8_0:
            return 10;
        case GgmlType::Q4_K:
        case GgmlType::Q5_K:
        case GgmlType::Q6_K:
            return 8;
        default:
            return 6;
    }
}

struct Kernels {
    DequantFn  dequant;
    RowDotFn   row_dot;
    GemmTileFn gemm_tile;
};

Kernels select_kernels(GgmlType type) {
#if defined(KC_X86)
    if (cpu_features().avx2_fma_f16c) {
#if defined(KC_AVX512)
        if (cpu_features().avx512) {
            return { dequant_fn_avx2(type), row_dot_fn_avx2(type), gemm_tile_avx512 };
        }
#endif
        return { dequant_fn_avx2(type), row_dot_fn_avx2(type), gemm_tile_avx2 };
    }
#endif
    return { dequant_fn_scalar(type), row_dot_fn_scalar(type), gemm_tile_scalar };
}

thread_local ScratchBuffer tl_tile_buffer;  // prefill: dequantized weight tile
thread_local ScratchBuffer tl_sums_buffer;  // decode: per-32 sums of the activations (caller thread)
thread_local ScratchBuffer tl_q8_buffer;    // decode: 8-bit activations and their scales (caller thread)

// The integer kernel of `type` when act asks for 8-bit activations and the CPU runs it; nullptr otherwise.
// Q8Fast takes the one-pass kernels where the type has them (Q4_K, Q5_K, Q6_K).
RowDotQ8Fn select_q8_kernel(GgmlType type, Activations act) {
#if defined(KC_X86)
    if (act == Activations::Q8Fast && cpu_features().avx2_fma_f16c && qgemm_onepass_type(type)) {
#    if defined(KC_AVX512VNNI)
        if (cpu_features().avx512_vnni) {
            return row_dot_q8_onepass_fn_avx512vnni(type);
        }
#    endif
#    if defined(KC_AVXVNNI)
        if (cpu_features().avx_vnni) {
            return row_dot_q8_onepass_fn_avxvnni(type);
        }
#    endif
        return row_dot_q8_onepass_fn_avx2(type);
    }
    if (act != Activations::F32 && cpu_features().avx2_fma_f16c) {
#    if defined(KC_AVX512VNNI)
        if (cpu_features().avx512_vnni && q8_kernel_prefetches(type)) {  // the K-quants' 512-bit two-pass kernels
            return row_dot_q8_kquant_fn_avx512vnni(type);
        }
#    endif
#    if defined(KC_AVXVNNI)
        if (cpu_features().avx_vnni) {
            return row_dot_q8_fn_avxvnni(type);
        }
#    endif
        return row_dot_q8_fn_avx2(type);
    }
#endif
    (void) type;
    (void) act;
    return nullptr;
}

// x [n_tok][n_in] quantized per 32 into the caller thread's scratch buffer.
Q8Acts quantize_acts(int64_t n_in, const float * x, int64_t n_tok) {
    const int64_t nb      = n_in / kQ8Block;
    const size_t  qbytes  = (static_cast<size_t>(n_tok * n_in) + 63) & ~size_t(63);
    const size_t  fbytes  = static_cast<size_t>(n_tok * nb) * sizeof(float);
    char *        buf     = static_cast<char *>(tl_q8_buffer.get(2 * qbytes + 7 * fbytes));
    auto *        q       = reinterpret_cast<int8_t *>(buf);
    auto *        qr      = reinterpret_cast<int8_t *>(buf + qbytes);
    auto *        d       = reinterpret_cast<float *>(buf + 2 * qbytes);
    float *       sums    = d + n_tok * nb;
    float *       groups  = sums + n_tok * nb;  // 2·nb per token
    float *       d1      = groups + 2 * n_tok * nb;
    float *       groups1 = d1 + n_tok * nb;  // 2·nb per token
#if defined(KC_X86)
    for (int64_t t = 0; t < n_tok; ++t) {
        quantize_q8_avx2(x + t * n_in, n_in, q + t * n_in, qr + t * n_in, d + t * nb, sums + t * nb,
                         groups + 2 * t * nb, d1 + t * nb, groups1 + 2 * t * nb);
    }
#else
    (void) x;
#endif
    return Q8Acts{ q, qr, d, sums, groups, n_in, nb, d1, groups1 };
}

// The integer GEMM (backend/cpu/qgemm.h) that runs the prefill of `type` with 8-bit activations (act) on this CPU,
// or nullptr: the f32 prefill.
QgemmFn integer_prefill(GgmlType type, Activations act) {
    if (!qgemm_type(type)) {
        return nullptr;
    }
#if defined(KC_AVX512VNNI)
    if (cpu_features().avx512_vnni) {
        return act == Activations::Q8Fast && qgemm_onepass_type(type) ? qgemm_onepass_avx512vnni : qgemm_avx512vnni;
    }
#endif
#if defined(KC_X86)
    if (cpu_features().qgemm_avx2) {
        return act == Activations::Q8Fast && qgemm_onepass_type(type) ? qgemm_onepass_avx2 : qgemm_avx2;
    }
#endif
    return nullptr;
}

void check_weight(const WeightView & w, const char * what) {
    const GgmlTypeTraits * t = ggml_type_traits(static_cast<uint32_t>(w.type));
    KC_CHECK(t != nullptr && t->weight, "%s: %s is not a supported weight type", what,
             ggml_type_name(static_cast<uint32_t>(w.type)));
    KC_CHECK(w.n_in > 0 && w.n_out >= 0, "%s: bad weight shape [%lld, %lld]", what, static_cast<long long>(w.n_in),
             static_cast<long long>(w.n_out));
    KC_CHECK(w.n_in % t->block == 0, "%s: n_in %lld is not a multiple of the %s block size %lld", what,
             static_cast<long long>(w.n_in), t->name, static_cast<long long>(t->block));
    KC_CHECK(w.row_bytes >= ggml_row_bytes(w.type, w.n_in), "%s: row_bytes %zu is smaller than a %s row of %lld", what,
             w.row_bytes, t->name, static_cast<long long>(w.n_in));
    // Blocks are read through their structs: f32 needs 4-byte alignment, MXFP4 (bytes only) none, everything else 2.
    const size_t align = w.type == GgmlType::F32 ? 4 : w.type == GgmlType::MXFP4 ? 1 : 2;
    KC_CHECK(w.n_out == 0 ||
                 (w.data != nullptr && reinterpret_cast<uintptr_t>(w.data) % align == 0 && w.row_bytes % align == 0),
             "%s: %s weight data must be %zu-byte aligned", what, t->name, align);
}

// Activations of the decode path for weights of type `type` (n_in columns): x itself, plus its sums per 32 elements
// for the types with a per-block min (computed here, on the caller's thread, into its scratch buffer).
DecodeActs decode_acts(bool need_sums, int64_t n_in, const float * x, int64_t n_tok) {
    DecodeActs act{ x, n_in, nullptr, n_in / 32 };
    if (need_sums) {
        auto * sums =
            static_cast<float *>(tl_sums_buffer.get(static_cast<size_t>(n_tok * act.ld_sums) * sizeof(float)));
        for (int64_t t = 0; t < n_tok; ++t) {
            for (int64_t i = 0; i < act.ld_sums; ++i) {
                const float * xb = x + t * n_in + 32 * i;
                float         s  = 0.0f;
                for (int l = 0; l < 32; ++l) {
                    s += xb[l];
                }
                sums[t * act.ld_sums + i] = s;
            }
        }
        act.block_sums = sums;
    }
    return act;
}

// One matrix of a decode job: its weights, kernels and output.
struct DecodeTarget {
    const WeightView * w;
    Kernels            k;
    float *            y;
    RowDotQ8Fn         q8;  // integer kernel over the 8-bit activations, or nullptr: f32 activations
};

// Rows of the decode path are handed out from one shared counter in guided portions: each grab takes 1/kGuidedShare
// of the rows a thread would still get (left / (kGuidedShare · nth)), in multiples of kDecodeRowUnit, so a thread
// streams long contiguous runs of weight rows (its prefetch stays on rows it computes itself) while the shrinking
// portions at the end keep the threads finishing together, and a descheduled thread holds at most 1/kGuidedShare of
// a thread's share.
constexpr int64_t kDecodeRowUnit = 16;  // rows: 64 bytes of f32 outputs, the smallest portion
constexpr int64_t kGuidedShare   = 8;

// Rows [r0, r1) of one matrix of a decode job, for all n_tok tokens.
void decode_rows(const DecodeTarget & m, const DecodeActs & act, const Q8Acts & q8, int64_t n_tok, int64_t r0,
                 int64_t r1) {
    // Weights stream from memory once per token: before a row is computed, its cache lines and those of the next
    // kPrefetchBytes - row_bytes bytes are requested (the hardware prefetcher alone lags here). About 4 KiB in flight
    // serves both widths measured (one thread, weights beyond L2): 1536-wide rows (~0.9 KiB) gain from ~4 rows of
    // look-ahead, while 8960-wide ones (~5 KiB) ran 10-20% slower with any look-ahead past their own row. Only rows
    // of [r0, r1): the rows after r1 are another thread's when several share the matrix.
    constexpr int64_t  kPrefetchBytes = 4096;
    const WeightView & w              = *m.w;
    const auto *       base           = static_cast<const char *>(w.data);
    const auto         row_bytes      = static_cast<int64_t>(w.row_bytes);
    const int64_t      ahead          = std::max<int64_t>(0, kPrefetchBytes - row_bytes);
    const int64_t      end            = r1 * row_bytes;
    int64_t            fetched        = r0 * row_bytes;  // byte offset up to which prefetches were issued
    // Kernels that prefetch ahead themselves (the K-quants' 8-bit ones) need only the start of the range.
    const bool own_prefetch = m.q8 != nullptr && q8_kernel_prefetches(w.type);
    for (; own_prefetch && fetched < std::min(end, r0 * row_bytes + kQ8KernelPrefetchBytes); fetched += 64) {
        __builtin_prefetch(base + fetched);
    }
    for (int64_t r = r0; r < r1; ++r) {
        for (const int64_t want = std::min(end, (r + 1) * row_bytes + ahead); !own_prefetch && fetched < want;
             fetched += 64) {
            __builtin_prefetch(base + fetched);
        }
        if (m.q8 != nullptr) {
            for (int64_t t0 = 0; t0 < n_tok; t0 += 4) {
                const int    nt = static_cast<int>(n_tok - t0 < 4 ? n_tok - t0 : 4);
                const Q8Acts group{ q8.q + t0 * q8.ldq,
                                    q8.qr + t0 * q8.ldq,
                                    q8.d + t0 * q8.ld_blocks,
                                    q8.block_sums + t0 * q8.ld_blocks,
                                    q8.group_sums + 2 * t0 * q8.ld_blocks,
                                    q8.ldq,
                                    q8.ld_blocks,
                                    q8.d1 + t0 * q8.ld_blocks,
                                    q8.group_sums1 + 2 * t0 * q8.ld_blocks };
                m.q8(base + r * w.row_bytes, group, nt, w.n_in, m.y + t0 * w.n_out + r, w.n_out);
            }
            continue;
        }
        for (int64_t t0 = 0; t0 < n_tok; t0 += 4) {
            const int        nt = static_cast<int>(n_tok - t0 < 4 ? n_tok - t0 : 4);
            const DecodeActs group{ act.x + t0 * act.ldx, act.ldx,
                                    act.block_sums ? act.block_sums + t0 * act.ld_sums : nullptr, act.ld_sums };
            m.k.row_dot(base + r * w.row_bytes, group, nt, w.n_in, m.y + t0 * w.n_out + r, w.n_out);
        }
    }
}

// The decode path for several matrices with the same activations, as one parallel job (the pool synchronizes once
// for all of them): their rows, numbered one matrix after the other, are handed out in guided portions (above).
void matmul_decode(const DecodeTarget * mats, int n_mats, const float * x, int64_t n_tok, ThreadPool & pool,
                   const DecodeHook * hook = nullptr) {
    const int64_t n_pre = hook != nullptr ? hook->n_pre : 0;

    bool need_sums = false, need_q8 = false;
    for (int i = 0; i < n_mats; ++i) {
        need_sums = need_sums || (mats[i].q8 == nullptr && has_block_min(mats[i].w->type));
        need_q8   = need_q8 || mats[i].q8 != nullptr;
    }
    const DecodeActs act = decode_acts(need_sums, mats[0].w->n_in, x, n_tok);
    const Q8Acts     q8  = need_q8 ? quantize_acts(mats[0].w->n_in, x, n_tok) : Q8Acts{};
    const int        nth = pool.size();
    if (nth == 1) {
        for (int64_t j = 0; j < n_pre; ++j) {
            hook->pre(j);
        }
        for (int i = 0; i < n_mats; ++i) {
            decode_rows(mats[i], act, q8, n_tok, 0, mats[i].w->n_out);
            if (hook != nullptr) {
                hook->post(i, 0, mats[i].w->n_out);
            }
        }
        return;
    }
    // The counter numbers the hook's pre items [0, n_pre) first, then the rows.
    int64_t first_row[kMaxMatmulMulti + 1];  // number of each matrix's first row; [n_mats] = total
    first_row[0] = n_pre;
    for (int i = 0; i < n_mats; ++i) {
        first_row[i + 1] = first_row[i] + mats[i].w->n_out;
    }
    const int64_t total = first_row[n_mats];
    // Its own cache line: the threads write it at every grab, and read the job's other state.
    struct alignas(64) Counter {
        std::atomic<int64_t> next{ 0 };
    } counter;
    std::atomic<int64_t> pre_done{ 0 };  // pre items finished
    pool.run([&](int, int) {
        int     m = 0;
        int64_t c = counter.next.load(std::memory_order_relaxed);
        for (;;) {
            if (c >= total) {
                return;
            }
            if (c < n_pre) {
                if (counter.next.compare_exchange_weak(c, c + 1, std::memory_order_relaxed)) {
                    hook->pre(c);
                    pre_done.fetch_add(1, std::memory_order_release);
                    c = counter.next.load(std::memory_order_relaxed);
                }
                continue;
            }
            while (c >= first_row[m + 1]) {
                ++m;
            }
            int64_t take = (total - c) / (kGuidedShare * nth);
            take         = (take + kDecodeRowUnit - 1) / kDecodeRowUnit * kDecodeRowUnit;
            take         = std::max(take, kDecodeRowUnit);
            take         = std::min(take, first_row[m + 1] - c);  // within one matrix
            if (!counter.next.compare_exchange_weak(c, c + take, std::memory_order_relaxed)) {
                continue;  // c now holds the current value
            }
            decode_rows(mats[m], act, q8, n_tok, c - first_row[m], c + take - first_row[m]);
            if (hook != nullptr) {
                // Every pre item was handed out before this row; the last ones may still be running elsewhere.
                while (pre_done.load(std::memory_order_acquire) < n_pre) {
                    std::this_thread::yield();
                }
                hook->post(m, c - first_row[m], c + take - first_row[m]);
            }
            c = counter.next.load(std::memory_order_relaxed);
        }
    });
}

void matmul_prefill(const WeightView & w, const float * x, float * y, int64_t n_tok, ThreadPool & pool,
                    const Kernels & k) {
    // Row tiles of up to 64 rows (four 16-row panels of the AVX2 kernel); each tile is dequantized once and all
    // tokens run against it. Tiles are handed out from a shared counter; their size is picked so that every thread
    // gets the same number of panels (192 rows on 2 threads: 4 tiles of 48, not 3 of 64).
    const int64_t ldw               = (w.n_in + 7) & ~int64_t(7);
    const int64_t panels            = (w.n_out + 15) / 16;
    const int64_t panels_per_thread = (panels + pool.size() - 1) / pool.size();
    int64_t       tile_panels       = 4;
    while (tile_panels > 1 && panels_per_thread % tile_panels != 0) {
        --tile_panels;
    }
    const int64_t        tile_rows  = 16 * tile_panels;
    const bool           direct_f32 = w.type == GgmlType::F32;
    std::atomic<int64_t> next{ 0 };
    const auto *         base = static_cast<const char *>(w.data);
    pool.run([&](int, int) {
        float * tile =
            direct_f32 ? nullptr
                       : static_cast<float *>(tl_tile_buffer.get(static_cast<size_t>(tile_rows * ldw) * sizeof(float)));
        for (;;) {
            const int64_t r0 = next.fetch_add(tile_rows, std::memory_order_relaxed);
            if (r0 >= w.n_out) {
                return;
            }
            const int     nr = static_cast<int>(r0 + tile_rows < w.n_out ? tile_rows : w.n_out - r0);
            const float * wt;
            int64_t       ld;
            if (direct_f32) {
                wt = reinterpret_cast<const float *>(base + r0 * w.row_bytes);
                ld = static_cast<int64_t>(w.row_bytes / sizeof(float));
            } else {
                for (int r = 0; r < nr; ++r) {
                    k.dequant(base + (r0 + r) * w.row_bytes, tile + r * ldw, w.n_in);
                }
                wt = tile;
                ld = ldw;
            }
            k.gemm_tile(wt, ld, nr, x, w.n_in, static_cast<int>(n_tok), w.n_in, y + r0, w.n_out);
        }
    });
}

}  // namespace

void matmul(const WeightView & w, const float * x, float * y, int64_t n_tok, ThreadPool & pool, Activations act) {
    check_weight(w, "matmul");
    KC_CHECK(n_tok >= 0 && n_tok <= (int64_t(1) << 30), "matmul: bad token count %lld", static_cast<long long>(n_tok));
    if (n_tok == 0 || w.n_out == 0) {
        return;
    }
    const Kernels k = select_kernels(w.type);
    KC_CHECK(k.dequant != nullptr && k.row_dot != nullptr, "matmul: no kernel for %s",
             ggml_type_name(static_cast<uint32_t>(w.type)));
    const RowDotQ8Fn q8 = select_q8_kernel(w.type, act);
    if (n_tok < decode_max_tokens(w.type, q8 != nullptr)) {
        const DecodeTarget m{ &w, k, y, q8 };
        matmul_decode(&m, 1, x, n_tok, pool);
    } else if (const QgemmFn qgemm = q8 != nullptr ? integer_prefill(w.type, act) : nullptr; qgemm != nullptr) {
        qgemm(&w, &y, 1, x, n_tok, pool);
    } else {
#if defined(KC_AVX512)
        if (cpu_features().avx512 && gemm_packed_avx512_supports(w.type)) {
            gemm_packed_avx512(w, x, y, n_tok, pool);
            return;
        }
#endif
        matmul_prefill(w, x, y, n_tok, pool, k);
    }
}

void matmul_multi(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                  ThreadPool & pool, Activations act) {
    KC_CHECK(n_mats >= 1 && n_mats <= kMaxMatmulMulti, "matmul_multi: %d matrices, at most %d", n_mats,
             kMaxMatmulMulti);
    KC_CHECK(n_tok >= 0 && n_tok <= (int64_t(1) << 30), "matmul_multi: bad token count %lld",
             static_cast<long long>(n_tok));
    DecodeTarget mats[kMaxMatmulMulti];
    bool         decode = n_tok > 0;
    for (int i = 0; i < n_mats; ++i) {
        check_weight(w[i], "matmul_multi");
        KC_CHECK(w[i].n_in == w[0].n_in, "matmul_multi: matrix %d has %lld inputs, matrix 0 has %lld", i,
                 static_cast<long long>(w[i].n_in), static_cast<long long>(w[0].n_in));
        mats[i] = DecodeTarget{ &w[i], select_kernels(w[i].type), y[i], select_q8_kernel(w[i].type, act) };
        KC_CHECK(mats[i].k.dequant != nullptr && mats[i].k.row_dot != nullptr, "matmul_multi: no kernel for %s",
                 ggml_type_name(static_cast<uint32_t>(w[i].type)));
        decode = decode && n_tok < decode_max_tokens(w[i].type, mats[i].q8 != nullptr) && w[i].n_out > 0;
    }
    // Prefill of them all by the integer GEMM: one quantization of x, one parallel job (where every type takes the
    // same GEMM: the CPU picks it, and Q8Fast's one-pass GEMM takes only the K-quants).
    QgemmFn integer = n_tok > 0 ? integer_prefill(w[0].type, act) : nullptr;
    for (int i = 0; i < n_mats; ++i) {
        if (mats[i].q8 == nullptr || integer_prefill(w[i].type, act) != integer || w[i].n_out == 0 ||
            n_tok < decode_max_tokens(w[i].type, true)) {
            integer = nullptr;
        }
    }
    if (integer != nullptr) {
        integer(w, y, n_mats, x, n_tok, pool);
        return;
    }
    if (!decode) {  // prefill (or an empty matrix): each product on its own, exactly as matmul() runs it
        for (int i = 0; i < n_mats; ++i) {
            matmul(w[i], x, y[i], n_tok, pool, act);
        }
        return;
    }
    matmul_decode(mats, n_mats, x, n_tok, pool);
}

bool matmul_multi_hooked(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                         ThreadPool & pool, Activations act, const DecodeHook & hook) {
    KC_CHECK(n_mats >= 1 && n_mats <= kMaxMatmulMulti, "matmul_multi: %d matrices, at most %d", n_mats,
             kMaxMatmulMulti);
    DecodeTarget mats[kMaxMatmulMulti];
    bool         decode = n_tok > 0;
    for (int i = 0; i < n_mats; ++i) {
        check_weight(w[i], "matmul_multi");
        mats[i] = DecodeTarget{ &w[i], select_kernels(w[i].type), y[i], select_q8_kernel(w[i].type, act) };
        decode  = decode && w[i].n_in == w[0].n_in && mats[i].k.dequant != nullptr && mats[i].k.row_dot != nullptr &&
                  n_tok < decode_max_tokens(w[i].type, mats[i].q8 != nullptr) && w[i].n_out > 0;
    }
    if (!decode) {
        matmul_multi(w, y, n_mats, x, n_tok, pool, act);
        return false;
    }
    matmul_decode(mats, n_mats, x, n_tok, pool, &hook);
    return true;
}

void matmul_reference(const WeightView & w, const float * x, float * y, int64_t n_tok) {
    check_weight(w, "matmul_reference");
    KC_CHECK(n_tok >= 0, "matmul_reference: bad token count %lld", static_cast<long long>(n_tok));
    const DequantFn    dequant = dequant_fn_scalar(w.type);
    std::vector<float> row(static_cast<size_t>(w.n_in));
    for (int64_t r = 0; r < w.n_out; ++r) {
        dequant(static_cast<const char *>(w.data) + r * w.row_bytes, row.data(), w.n_in);
        for (int64_t t = 0; t < n_tok; ++t) {
            double acc = 0.0;
            for (int64_t i = 0; i < w.n_in; ++i) {
                acc += static_cast<double>(row[static_cast<size_t>(i)]) * static_cast<double>(x[t * w.n_in + i]);
            }
            y[t * w.n_out + r] = static_cast<float>(acc);
        }
    }
}

}  // namespace kvcmas::cpu
