// The attention kernel with AVX2/FMA intrinsics; called only when the CPU has them (see attention.cpp).
// Scores of 8 keys are computed at once (8 accumulators, reduced together), softmax uses a vectorized exp, and
// values are accumulated in registers. Each score and each output depends only on the keys' order, not on how the
// keys are split into runs, so a forked or shared sequence computes exactly what a contiguous one does.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#define KC_ATTN_NS portable_in_avx2
#include "backend/cpu/attention-impl.h"
#include "backend/cpu/simd-avx2.h"

namespace kvcmas::cpu {

namespace {

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s        = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s        = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Lane k of the result = sum of the 8 lanes of a[k] (the same tree for every k).
inline __m256 reduce8(const __m256 a[8]) {
    const __m256 t01 = _mm256_hadd_ps(a[0], a[1]);
    const __m256 t23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t45 = _mm256_hadd_ps(a[4], a[5]);
    const __m256 t67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0  = _mm256_hadd_ps(t01, t23);  // [a0 a1 a2 a3 (low halves) | a0 a1 a2 a3 (high halves)]
    const __m256 u1  = _mm256_hadd_ps(t45, t67);
    const __m256 lo  = _mm256_permute2f128_ps(u0, u1, 0x20);
    const __m256 hi  = _mm256_permute2f128_ps(u0, u1, 0x31);
    return _mm256_add_ps(lo, hi);
}

// 8 stored KV elements as f32: f32 loaded as is, f16 converted with F16C (exact).
inline __m256 load8(const float * p) {
    return _mm256_loadu_ps(p);
}
inline __m256 load8(const uint16_t * p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
}

// Scores of 8 keys whose head slices start at k[0..7] (each hd elements), against q (hd floats).
template <typename T>
inline __m256 scores8(const float * q, const T * const k[8], int n_chunks) {
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) {
        acc[r] = _mm256_setzero_ps();
    }
    for (int c = 0; c < n_chunks; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + 8 * c);
        for (int r = 0; r < 8; ++r) {
            acc[r] = _mm256_fmadd_ps(qc, load8(k[r] + 8 * c), acc[r]);
        }
    }
    return reduce8(acc);
}

// oh[0, 8*NC) += Σ_t p[t] · v[t][0, 8*NC) for m rows of v (stride row_stride); NC known at compile time keeps the
// accumulators in registers.
template <int NC>
inline void accumulate_values(const float * p, const float * v0, int64_t row_stride, int64_t m, float * oh) {
    __m256 acc[NC];
    for (int c = 0; c < NC; ++c) {
        acc[c] = _mm256_loadu_ps(oh + 8 * c);
    }
    for (int64_t t = 0; t < m; ++t) {
        const __m256  pt = _mm256_set1_ps(p[t]);
        const float * v  = v0 + t * row_stride;
        for (int c = 0; c < NC; ++c) {
            acc[c] = _mm256_fmadd_ps(pt, load8(v + 8 * c), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) {
        _mm256_storeu_ps(oh + 8 * c, acc[c]);
    }
}

// Up to 8 stored rows (head slices of hd elements at src[t * stride], t < n) as f32 in dst [8][hd]; rows n..7 are
// zero. f16 rows are converted exactly, so the arithmetic on dst is the arithmetic on the stored values.
template <typename T>
inline void rows_to_f32(const T * src, int64_t stride, int n, int hd, float * dst) {
    for (int t = 0; t < 8; ++t) {
        float * d = dst + t * hd;
        if (t >= n) {
            std::memset(d, 0, sizeof(float) * static_cast<size_t>(hd));
        } else if constexpr (std::is_same_v<T, float>) {
            std::memcpy(d, src + t * stride, sizeof(float) * static_cast<size_t>(hd));
        } else {
            for (int c = 0; c < hd; c += 8) {
                _mm256_storeu_ps(d + c, load8(src + t * stride + c));
            }
        }
    }
}

// Asks for the head slices (hd elements) of the first n rows at base (stride elements): at this context length
// decode reads the KV cache from memory once per token, and a head's rows are strided, so the hardware prefetcher
// alone leaves attention waiting on loads. T0: into L1 (keys about to be read); T1: into L2 (values, read after
// the softmax).
template <typename T, int Hint>
inline void prefetch_rows(const T * base, int64_t stride, int64_t n, int hd) {
    const int64_t bytes = static_cast<int64_t>(hd) * static_cast<int64_t>(sizeof(T));
    for (int64_t t = 0; t < n; ++t) {
        const char * row = reinterpret_cast<const char *>(base + t * stride);
        for (int64_t off = 0; off < bytes; off += 64) {
            _mm_prefetch(row + off, static_cast<_mm_hint>(Hint));
        }
    }
}

// nq consecutive queries of one sequence over the same runs: query i sees the first n_visible0 + i rows. The query
// heads that read one KV head (GQA) are processed together, up to kMaxAttentionBlock (query, head) rows at a time:
// keys and values are walked once per pass, so they are read from L1 instead of L2 for every query and head, and
// f16 rows are converted to f32 once per pass. The arithmetic of each (query, head) is the same whatever else
// shares its pass, so results are bit-identical to nq separate calls, for any head range.
// T: the stored element type (float for F32, uint16_t for F16); hd is a multiple of 8, at most 512.
template <typename T>
void attend_block_t(const AttentionShape & shape, const Rope & rope, const float * q, int64_t q_stride, int nq,
                    const KvRun * runs, int n_runs, int64_t n_visible0, int h_begin, int h_end, float * out,
                    int64_t out_stride, float * scratch, int64_t n_visible_min) {
    constexpr bool kF32     = std::is_same_v<T, float>;
    const int      hd       = shape.head_dim;
    const int      n_chunks = hd / 8;
    const int      group    = shape.n_head / shape.n_head_kv;
    const int      per_pass = std::max(1, std::min(group, kMaxAttentionBlock / nq));  // heads per pass
    const int64_t  n_max    = std::max(n_visible0 + nq - 1, n_visible_min);
    const int64_t  ld       = (n_max + 15) / 8 * 8;  // score row stride, room for a padded group
    const int      max_rows = nq * per_pass;
    float *        q_rot    = scratch;                                        // [rows][hd]
    float *        score    = scratch + static_cast<int64_t>(max_rows) * hd;  // [rows][ld]
    float          kbuf[8 * 512];  // a group of 8 keys as f32 (converted, or the zero-padded last group)
    float          vbuf[8 * 64];   // 8 value rows of one 64-float output chunk as f32 (f16 rows)
    const __m256   vscale = _mm256_set1_ps(shape.scale);
    portable_in_avx2::ScoreCorrection corr[kMaxAttentionBlock];
    int                               h0 = h_begin;
    while (h0 < h_end) {
        // A pass: heads [h0, h1) of one KV head; row r = i * n_h + (h - h0) is query i, head h.
        const int     kv_head = h0 / group;
        const int     h1      = std::min({ h_end, (kv_head + 1) * group, h0 + per_pass });
        const int     n_h     = h1 - h0;
        const int     rows    = nq * n_h;
        const int64_t kv_off  = static_cast<int64_t>(kv_head) * hd;
        const auto    q_row = [&](int r) { return q + (r / n_h) * q_stride + static_cast<int64_t>(h0 + r % n_h) * hd; };
        const auto    out_row = [&](int r) {
            return out + (r / n_h) * out_stride + static_cast<int64_t>(h0 + r % n_h) * hd;
        };
        const auto causal  = [&](int r) { return n_visible0 + r / n_h; };  // the query's position + 1
        const auto visible = [&](int r) { return std::max(causal(r), n_visible_min); };
        // First key a row attends: its window's start (keys before it are scored with the group and ignored).
        const auto first = [&](int r) {
            return shape.window > 0 ? std::max<int64_t>(0, causal(r) - shape.window) : int64_t{ 0 };
        };
        int64_t seen         = 0;
        bool    have_rot     = false;
        int32_t cached_shift = 0;
        for (int r = 0; r < rows; ++r) {
            corr[r].reset();
        }
        if (n_runs > 0) {
            prefetch_rows<T, _MM_HINT_T0>(static_cast<const T *>(runs[0].k) + kv_off, shape.row_stride,
                                          std::min<int64_t>(runs[0].n, n_max), hd);
        }
        for (int ir = 0; ir < n_runs && seen < n_max; ++ir) {
            const KvRun & run     = runs[ir];
            const bool    shifted = run.shift != 0;
            // Keys of the next run into L1 while this one is scored, this run's values into L2 for the second pass.
            const int64_t n_next = ir + 1 < n_runs ? std::min<int64_t>(runs[ir + 1].n, n_max - seen - run.n) : 0;
            if (n_next > 0) {
                prefetch_rows<T, _MM_HINT_T0>(static_cast<const T *>(runs[ir + 1].k) + kv_off, shape.row_stride, n_next,
                                              hd);
            }
            prefetch_rows<T, _MM_HINT_T1>(static_cast<const T *>(run.v) + kv_off, shape.row_stride,
                                          std::min<int64_t>(run.n, n_max - seen), hd);
            if (shifted && (!have_rot || run.shift != cached_shift)) {
                for (int r = 0; r < rows; ++r) {
                    std::memcpy(q_rot + r * hd, q_row(r), sizeof(float) * static_cast<size_t>(hd));
                    rope.apply(q_rot + r * hd, 1, hd, -static_cast<double>(run.shift));
                }
                cached_shift = run.shift;
                have_rot     = true;
            }
            const int64_t n     = std::min<int64_t>(run.n, n_max - seen);
            const T *     run_k = static_cast<const T *>(run.k) + kv_off;
            const float * k[8];
            for (int64_t j = 0; j < n; j += 8) {
                const int in_group = static_cast<int>(std::min<int64_t>(8, n - j));
                if (kF32 && in_group == 8) {
                    for (int t = 0; t < 8; ++t) {
                        k[t] = reinterpret_cast<const float *>(run_k + (j + t) * shape.row_stride);
                    }
                } else {  // f16 rows converted once for all rows of the pass; a partial group padded with zeros
                    rows_to_f32(run_k + j * shape.row_stride, shape.row_stride, in_group, hd, kbuf);
                    for (int t = 0; t < 8; ++t) {
                        k[t] = kbuf + t * hd;
                    }
                }
                for (int r = 0; r < rows; ++r) {
                    if (seen + j >= visible(r)) {
                        continue;  // the whole group is in this query's future
                    }
                    const float * qq = shifted ? q_rot + r * hd : q_row(r);
                    // Rows past n are written into the padding of the score row and never read.
                    _mm256_storeu_ps(score + r * ld + seen + j, _mm256_mul_ps(scores8(qq, k, n_chunks), vscale));
                }
            }
            if (run.rank > 0) {
                for (int r = 0; r < rows; ++r) {
                    const int64_t m = std::min<int64_t>(n, visible(r) - seen);
                    if (m > 0) {
                        const float * qq = shifted ? q_rot + r * hd : q_row(r);
                        portable_in_avx2::add_score_corrections(run, corr[r].get(run, qq, hd, shape.row_stride, kv_off),
                                                                m, shape.scale, score + r * ld + seen);
                    }
                }
            }
            seen += n;
        }
        // Softmax of each row over its visible keys.
        float inv[kMaxAttentionBlock];
        for (int r = 0; r < rows; ++r) {
            // The row from its first attended key: groups of 8 start there, as in a call that holds only its window.
            float *       row = score + r * ld + first(r);
            const int64_t nv  = visible(r) - first(r);
            float         mx  = -INFINITY;
            for (int64_t j = 0; j < nv; ++j) {
                mx = std::max(mx, row[j]);
            }
            const float sink  = shape.sinks != nullptr ? shape.sinks[h0 + r % n_h] : -INFINITY;
            mx                = std::max(mx, sink);
            const __m256 vmax = _mm256_set1_ps(mx);
            __m256       vsum = _mm256_setzero_ps();
            int64_t      j    = 0;
            for (; j + 8 <= nv; j += 8) {
                const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(row + j), vmax));
                _mm256_storeu_ps(row + j, e);
                vsum = _mm256_add_ps(vsum, e);
            }
            if (j < nv) {
                float tmp[8] = { 0 };
                std::memcpy(tmp, row + j, sizeof(float) * static_cast<size_t>(nv - j));
                __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(tmp), vmax));
                _mm256_storeu_ps(tmp, e);
                for (int64_t t = nv - j; t < 8; ++t) {
                    tmp[t] = 0.0f;
                }
                e = _mm256_loadu_ps(tmp);
                std::memcpy(row + j, tmp, sizeof(float) * static_cast<size_t>(nv - j));
                vsum = _mm256_add_ps(vsum, e);
            }
            inv[r] = 1.0f / (hsum(vsum) + (shape.sinks != nullptr ? std::exp(sink - mx) : 0.0f));
        }
        // Values: 8 chunks (64 floats) of each row's output at a time, accumulated run by run in out. f32 rows are
        // read in place for a whole run; f16 rows are converted 8 at a time into vbuf, once for all rows of the pass
        // (the accumulation order over keys is the same either way).
        for (int c0 = 0; c0 < n_chunks; c0 += 8) {
            const int nc = std::min(8, n_chunks - c0);
            for (int r = 0; r < rows; ++r) {
                std::memset(out_row(r) + 8 * c0, 0, sizeof(float) * 8 * static_cast<size_t>(nc));
            }
            int64_t done = 0;
            for (int ir = 0; ir < n_runs && done < n_max; ++ir) {
                const KvRun & run   = runs[ir];
                const int64_t n     = std::min<int64_t>(run.n, n_max - done);
                const T *     run_v = static_cast<const T *>(run.v) + kv_off + 8 * c0;
                const int64_t piece = kF32 ? n : 8;
                for (int64_t t0 = 0; t0 < n; t0 += piece) {
                    const int64_t tn = std::min<int64_t>(piece, n - t0);
                    const float * v0;
                    int64_t       v_stride;
                    if constexpr (kF32) {
                        v0       = run_v + t0 * shape.row_stride;
                        v_stride = shape.row_stride;
                    } else {
                        for (int64_t t = 0; t < tn; ++t) {
                            for (int c = 0; c < nc; ++c) {
                                _mm256_storeu_ps(vbuf + t * 64 + 8 * c,
                                                 load8(run_v + (t0 + t) * shape.row_stride + 8 * c));
                            }
                        }
                        v0       = vbuf;
                        v_stride = 64;
                    }
                    for (int r = 0; r < rows; ++r) {
                        const int64_t m  = std::min<int64_t>(tn, visible(r) - done - t0);
                        const int64_t s0 = std::max<int64_t>(0, first(r) - done - t0);  // rows before the window
                        if (m <= s0) {
                            continue;
                        }
                        const float * p  = score + r * ld + done + t0 + s0;
                        const float * vr = v0 + s0 * v_stride;
                        float *       oh = out_row(r) + 8 * c0;
                        if (nc == 8) {
                            accumulate_values<8>(p, vr, v_stride, m - s0, oh);
                        } else {
                            for (int c = 0; c < nc; ++c) {  // uncommon head sizes: one chunk at a time
                                accumulate_values<1>(p, vr + 8 * c, v_stride, m - s0, oh + 8 * c);
                            }
                        }
                    }
                }
                done += n;
            }
        }
        for (int r = 0; r < rows; ++r) {
            float *      oh   = out_row(r);
            const __m256 vinv = _mm256_set1_ps(inv[r]);
            for (int c = 0; c < n_chunks; ++c) {
                _mm256_storeu_ps(oh + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(oh + 8 * c), vinv));
            }
            portable_in_avx2::add_output_corrections(runs, n_runs, first(r), visible(r), score + r * ld, hd,
                                                     shape.row_stride, kv_off, inv[r], oh);
        }
        h0 = h1;
    }
}

}  // namespace

void attend_block_avx2(const AttentionShape & shape, const Rope & rope, const float * q, int64_t q_stride, int nq,
                       const KvRun * runs, int n_runs, int64_t n_visible0, int h_begin, int h_end, float * out,
                       int64_t out_stride, float * scratch, int64_t n_visible_min) {
    const int hd = shape.head_dim;
    if (hd % 8 != 0 || hd > 512) {
        for (int i = 0; i < nq; ++i) {
            portable_in_avx2::attend(shape, rope, q + i * q_stride, runs, n_runs,
                                     std::max(n_visible0 + i, n_visible_min), h_begin, h_end, out + i * out_stride,
                                     scratch, n_visible0 + i);
        }
        return;
    }
    if (shape.kv_type == KvType::F16) {
        attend_block_t<uint16_t>(shape, rope, q, q_stride, nq, runs, n_runs, n_visible0, h_begin, h_end, out,
                                 out_stride, scratch, n_visible_min);
    } else {
        attend_block_t<float>(shape, rope, q, q_stride, nq, runs, n_runs, n_visible0, h_begin, h_end, out, out_stride,
                              scratch, n_visible_min);
    }
}

void fp32_to_fp16_row_f16c(const float * src, uint16_t * dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + i), h);
    }
    for (; i < n; ++i) {
        dst[i] = fp32_to_fp16(src[i]);
    }
}

void fp16_to_fp32_row_f16c(const uint16_t * src, float * dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(dst + i, load8(src + i));
    }
    for (; i < n; ++i) {
        dst[i] = fp16_to_fp32(src[i]);
    }
}

}  // namespace kvcmas::cpu
