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

}  // namespace

void attend_avx2(const AttentionShape & shape, const Rope & rope, const float * q, const KvRun * runs, int n_runs,
                 int64_t n_visible, int h_begin, int h_end, float * out, float * scratch) {
    const int hd = shape.head_dim;
    if (hd % 8 != 0 || hd > 512) {
        portable_in_avx2::attend(shape, rope, q, runs, n_runs, n_visible, h_begin, h_end, out, scratch);
        return;
    }
    const int     n_chunks = hd / 8;
    const int     group    = shape.n_head / shape.n_head_kv;
    float *       q_rot    = scratch;                                               // [n_head * hd]
    float *       score    = scratch + static_cast<int64_t>(shape.n_head) * hd;     // [n_visible rounded up to 8]
    float         pad[8 * 512];                                                      // last partial group of keys
    const __m256  vscale   = _mm256_set1_ps(shape.scale);
    for (int h = h_begin; h < h_end; ++h) {
        const int64_t kv_off       = static_cast<int64_t>(h / group) * hd;
        const float * qh           = q + static_cast<int64_t>(h) * hd;
        int64_t       seen         = 0;
        bool          have_rot     = false;
        int32_t       cached_shift = 0;
        portable_in_avx2::ScoreCorrection corr;
        for (int r = 0; r < n_runs && seen < n_visible; ++r) {
            const KvRun & run = runs[r];
            const float * qq  = qh;
            if (run.shift != 0) {
                if (!have_rot || run.shift != cached_shift) {
                    std::memcpy(q_rot, qh, sizeof(float) * static_cast<size_t>(hd));
                    rope.apply(q_rot, 1, hd, -static_cast<double>(run.shift));
                    cached_shift = run.shift;
                    have_rot     = true;
                }
                qq = q_rot;
            }
            const int64_t n = std::min<int64_t>(run.n, n_visible - seen);
            const float * k[8];
            int64_t       j = 0;
            for (; j + 8 <= n; j += 8) {
                for (int t = 0; t < 8; ++t) {
                    k[t] = run.k + (j + t) * shape.row_stride + kv_off;
                }
                _mm256_storeu_ps(score + seen + j, _mm256_mul_ps(scores8(qq, k, n_chunks), vscale));
            }
            if (j < n) {  // copy the last keys into a zero-padded group: same arithmetic, no reads past the run
                std::memset(pad, 0, sizeof(float) * 8 * static_cast<size_t>(hd));
                for (int t = 0; t < 8; ++t) {
                    if (j + t < n) {
                        std::memcpy(pad + t * hd, run.k + (j + t) * shape.row_stride + kv_off,
                                    sizeof(float) * static_cast<size_t>(hd));
                    }
                    k[t] = pad + t * hd;
                }
                float tmp[8];
                _mm256_storeu_ps(tmp, _mm256_mul_ps(scores8(qq, k, n_chunks), vscale));
                std::memcpy(score + seen + j, tmp, sizeof(float) * static_cast<size_t>(n - j));
            }
            if (run.rank > 0) {
                portable_in_avx2::add_score_corrections(run, corr.get(run, qq, hd, shape.row_stride, kv_off), n,
                                                        shape.scale, score + seen);
            }
            seen += n;
        }
        // Softmax over score[0, seen).
        float mx = -INFINITY;
        for (int64_t j = 0; j < seen; ++j) {
            mx = std::max(mx, score[j]);
        }
        const __m256 vmax = _mm256_set1_ps(mx);
        __m256       vsum = _mm256_setzero_ps();
        int64_t      j    = 0;
        for (; j + 8 <= seen; j += 8) {
            const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(score + j), vmax));
            _mm256_storeu_ps(score + j, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        if (j < seen) {
            float tmp[8] = { 0 };
            std::memcpy(tmp, score + j, sizeof(float) * static_cast<size_t>(seen - j));
            __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(tmp), vmax));
            _mm256_storeu_ps(tmp, e);
            for (int64_t t = seen - j; t < 8; ++t) {
                tmp[t] = 0.0f;
            }
            e = _mm256_loadu_ps(tmp);
            std::memcpy(score + j, tmp, sizeof(float) * static_cast<size_t>(seen - j));
            vsum = _mm256_add_ps(vsum, e);
        }
        const __m256 vinv = _mm256_set1_ps(1.0f / hsum(vsum));
        // Values: 8 chunks (64 floats) of the output in registers at a time.
        float * oh = out + static_cast<int64_t>(h) * hd;
        for (int c0 = 0; c0 < n_chunks; c0 += 8) {
            const int nc = std::min(8, n_chunks - c0);
            __m256    acc[8];
            for (int c = 0; c < 8; ++c) {
                acc[c] = _mm256_setzero_ps();
            }
            int64_t done = 0;
            for (int r = 0; r < n_runs && done < seen; ++r) {
                const KvRun & run = runs[r];
                const int64_t n   = std::min<int64_t>(run.n, seen - done);
                const float * v0 = run.v + kv_off + 8 * c0;
                if (nc == 8) {  // the common head sizes (64, 128, ...): a fixed trip count keeps acc in registers
                    for (int64_t t = 0; t < n; ++t) {
                        const __m256  p = _mm256_set1_ps(score[done + t]);
                        const float * v = v0 + t * shape.row_stride;
                        for (int c = 0; c < 8; ++c) {
                            acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
                        }
                    }
                } else {
                    for (int64_t t = 0; t < n; ++t) {
                        const __m256  p = _mm256_set1_ps(score[done + t]);
                        const float * v = v0 + t * shape.row_stride;
                        for (int c = 0; c < nc; ++c) {
                            acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), acc[c]);
                        }
                    }
                }
                done += n;
            }
            for (int c = 0; c < nc; ++c) {
                _mm256_storeu_ps(oh + 8 * (c0 + c), _mm256_mul_ps(acc[c], vinv));
            }
        }
        portable_in_avx2::add_output_corrections(runs, n_runs, seen, score, hd, shape.row_stride, kv_off,
                                                 _mm256_cvtss_f32(vinv), oh);
    }
}

}  // namespace kvcmas::cpu
