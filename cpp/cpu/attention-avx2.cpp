// The attention kernel with AVX2/FMA intrinsics; called only when the CPU has them (see attention.cpp).
// Scores of 8 keys are computed at once (8 accumulators, reduced together), softmax uses a vectorized exp, and
// values are accumulated in registers. Each score and each output depends only on the keys' order, not on how the
// keys are split into runs, so a forked or shared sequence computes exactly what a contiguous one does.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#define KC_ATTN_NS portable_in_avx2
#include "cpu/attention-impl.h"
#include "cpu/simd-avx2.h"

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

// Scores of 8 keys whose head slices start at k[0..7] (each hd floats), against q (hd floats).
inline __m256 scores8(const float * q, const float * const k[8], int n_chunks) {
    __m256 acc[8];
    for (int r = 0; r < 8; ++r) {
        acc[r] = _mm256_setzero_ps();
    }
    for (int c = 0; c < n_chunks; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + 8 * c);
        for (int r = 0; r < 8; ++r) {
            acc[r] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[r] + 8 * c), acc[r]);
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
            acc[c] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * c), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) {
        _mm256_storeu_ps(oh + 8 * c, acc[c]);
    }
}

}  // namespace

// nq consecutive queries of one sequence over the same runs: query i sees the first n_visible0 + i rows. Keys and
// values are walked once per group of queries, so they are read from L1 instead of L2 for every query; the
// arithmetic per query is the same as for a single query, so results are bit-identical to nq separate calls.
void attend_block_avx2(const AttentionShape & shape, const Rope & rope, const float * q, int64_t q_stride, int nq,
                       const KvRun * runs, int n_runs, int64_t n_visible0, int h_begin, int h_end, float * out,
                       int64_t out_stride, float * scratch) {
    const int hd = shape.head_dim;
    if (hd % 8 != 0 || hd > 512) {
        for (int i = 0; i < nq; ++i) {
            portable_in_avx2::attend(shape, rope, q + i * q_stride, runs, n_runs, n_visible0 + i, h_begin, h_end,
                                     out + i * out_stride, scratch);
        }
        return;
    }
    const int     n_chunks = hd / 8;
    const int     group    = shape.n_head / shape.n_head_kv;
    const int64_t n_max    = n_visible0 + nq - 1;
    const int64_t ld       = (n_max + 15) / 8 * 8;  // score row stride, room for a padded group
    float *       q_rot    = scratch;                 // [nq][hd]
    float *       score    = scratch + static_cast<int64_t>(nq) * hd;  // [nq][ld]
    float         pad[8 * 512];                       // last partial group of keys
    const __m256  vscale = _mm256_set1_ps(shape.scale);
    portable_in_avx2::ScoreCorrection corr[kMaxAttentionBlock];
    for (int h = h_begin; h < h_end; ++h) {
        const int64_t kv_off       = static_cast<int64_t>(h / group) * hd;
        int64_t       seen         = 0;
        bool          have_rot     = false;
        int32_t       cached_shift = 0;
        for (int i = 0; i < nq; ++i) {
            corr[i].reset();
        }
        for (int r = 0; r < n_runs && seen < n_max; ++r) {
            const KvRun & run     = runs[r];
            const bool    shifted = run.shift != 0;
            if (shifted && (!have_rot || run.shift != cached_shift)) {
                for (int i = 0; i < nq; ++i) {
                    std::memcpy(q_rot + i * hd, q + i * q_stride + static_cast<int64_t>(h) * hd,
                                sizeof(float) * static_cast<size_t>(hd));
                    rope.apply(q_rot + i * hd, 1, hd, -static_cast<double>(run.shift));
                }
                cached_shift = run.shift;
                have_rot     = true;
            }
            const int64_t n = std::min<int64_t>(run.n, n_max - seen);
            const float * k[8];
            for (int64_t j = 0; j < n; j += 8) {
                const bool partial = j + 8 > n;
                for (int t = 0; t < 8; ++t) {
                    k[t] = run.k + (j + t) * shape.row_stride + kv_off;
                }
                if (partial) {  // copy the last keys into a zero-padded group: same arithmetic, no reads past the run
                    std::memset(pad, 0, sizeof(float) * 8 * static_cast<size_t>(hd));
                    for (int t = 0; t < 8; ++t) {
                        if (j + t < n) {
                            std::memcpy(pad + t * hd, k[t], sizeof(float) * static_cast<size_t>(hd));
                        }
                        k[t] = pad + t * hd;
                    }
                }
                for (int i = 0; i < nq; ++i) {
                    if (seen + j >= n_visible0 + i) {
                        continue;  // the whole group is in this query's future
                    }
                    const float * qq = shifted ? q_rot + i * hd : q + i * q_stride + static_cast<int64_t>(h) * hd;
                    // Rows past n are written into the padding of the score row and never read.
                    _mm256_storeu_ps(score + i * ld + seen + j, _mm256_mul_ps(scores8(qq, k, n_chunks), vscale));
                }
            }
            if (run.rank > 0) {
                for (int i = 0; i < nq; ++i) {
                    const int64_t m = std::min<int64_t>(n, n_visible0 + i - seen);
                    if (m > 0) {
                        const float * qq = shifted ? q_rot + i * hd : q + i * q_stride + static_cast<int64_t>(h) * hd;
                        portable_in_avx2::add_score_corrections(
                            run, corr[i].get(run, qq, hd, shape.row_stride, kv_off), m, shape.scale,
                            score + i * ld + seen);
                    }
                }
            }
            seen += n;
        }
        // Softmax of each query's row over its visible keys.
        float inv[kMaxAttentionBlock];
        for (int i = 0; i < nq; ++i) {
            float *       row = score + i * ld;
            const int64_t nv  = n_visible0 + i;
            float         mx  = -INFINITY;
            for (int64_t j = 0; j < nv; ++j) {
                mx = std::max(mx, row[j]);
            }
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
            inv[i] = 1.0f / hsum(vsum);
        }
        // Values: 8 chunks (64 floats) of each query's output at a time, accumulated run by run in out.
        for (int c0 = 0; c0 < n_chunks; c0 += 8) {
            const int nc = std::min(8, n_chunks - c0);
            for (int i = 0; i < nq; ++i) {
                std::memset(out + i * out_stride + static_cast<int64_t>(h) * hd + 8 * c0, 0,
                            sizeof(float) * 8 * static_cast<size_t>(nc));
            }
            int64_t done = 0;
            for (int r = 0; r < n_runs && done < n_max; ++r) {
                const KvRun & run = runs[r];
                const int64_t n   = std::min<int64_t>(run.n, n_max - done);
                const float * v0  = run.v + kv_off + 8 * c0;
                for (int i = 0; i < nq; ++i) {
                    const int64_t m = std::min<int64_t>(n, n_visible0 + i - done);
                    if (m <= 0) {
                        continue;
                    }
                    const float * p  = score + i * ld + done;
                    float *       oh = out + i * out_stride + static_cast<int64_t>(h) * hd + 8 * c0;
                    if (nc == 8) {
                        accumulate_values<8>(p, v0, shape.row_stride, m, oh);
                    } else {
                        for (int c = 0; c < nc; ++c) {  // uncommon head sizes: one chunk at a time
                            accumulate_values<1>(p, v0 + 8 * c, shape.row_stride, m, oh + 8 * c);
                        }
                    }
                }
                done += n;
            }
        }
        for (int i = 0; i < nq; ++i) {
            float * oh = out + i * out_stride + static_cast<int64_t>(h) * hd;
            const __m256 vinv = _mm256_set1_ps(inv[i]);
            for (int c = 0; c < n_chunks; ++c) {
                _mm256_storeu_ps(oh + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(oh + 8 * c), vinv));
            }
            portable_in_avx2::add_output_corrections(runs, n_runs, n_visible0 + i, score + i * ld, hd, shape.row_stride,
                                                     kv_off, inv[i], oh);
        }
    }
}

}  // namespace kvcmas::cpu
