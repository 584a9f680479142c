// Body of the attention kernel, compiled twice: portable (attention.cpp) and with AVX2/FMA (attention-avx2.cpp).
// Written so the compiler vectorizes it: 8 independent accumulators per dot product.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "backend/cpu/attention.h"
#include "backend/cpu/quants.h"

namespace kvcmas::cpu::KC_ATTN_NS {

// A head slice of a stored KV row as f32: f32 rows are used in place, f16 rows are converted into buf [n].
static inline const float * head_f32(const float * p, float * /*buf*/, int /*n*/) {
    return p;
}
static inline const float * head_f32(const uint16_t * p, float * buf, int n) {
    for (int i = 0; i < n; ++i) {
        buf[i] = fp16_to_fp32(p[i]);
    }
    return buf;
}

static inline float dot(const float * a, const float * b, int n) {
    float acc[8] = { 0, 0, 0, 0, 0, 0, 0, 0 };
    int   i      = 0;
    for (; i + 8 <= n; i += 8) {
        for (int l = 0; l < 8; ++l) {
            acc[l] += a[i + l] * b[i + l];
        }
    }
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; ++i) {
        s += a[i] * b[i];
    }
    return s;
}

static inline void axpy(float a, const float * x, float * y, int n) {
    for (int i = 0; i < n; ++i) {
        y[i] += a * x[i];
    }
}

// (q·B_kᵀ) for the run's key correction, cached while B_k and the rotation of q stay the same.
struct ScoreCorrection {
    const float * b     = nullptr;
    int32_t       shift = 0;
    float         qb[kMaxCorrectionRank];

    void reset() { b = nullptr; }

    const float * get(const KvRun & run, const float * qq, int hd, int64_t hd_kv, int64_t kv_off) {
        if (b != run.b_k || shift != run.shift) {
            for (int r = 0; r < run.rank; ++r) {
                qb[r] = dot(qq, run.b_k + r * hd_kv + kv_off, hd);
            }
            b     = run.b_k;
            shift = run.shift;
        }
        return qb;
    }
};

// score[j] += scale · (q·B_kᵀ)·a_k[j] for the first n keys of a corrected run.
static inline void add_score_corrections(const KvRun & run, const float * qb, int64_t n, float scale, float * score) {
    for (int64_t j = 0; j < n; ++j) {
        score[j] += scale * dot(qb, run.a_k + j * run.rank, run.rank);
    }
}

// out[0, hd) += factor · Σ over corrected runs of (Σ_j p_j a_v[j])·B_v, for the keys [n_first, n_seen) whose weights
// are p[n_first, n_seen). Consecutive runs sharing B_v (one corrected segment) are summed before the product with B_v.
static void add_output_corrections(const KvRun * runs, int n_runs, int64_t n_first, int64_t n_seen, const float * p,
                                   int hd, int64_t hd_kv, int64_t kv_off, float factor, float * out) {
    float         pa[kMaxCorrectionRank];
    const float * group_b = nullptr;
    int           group_r = 0;
    auto          flush   = [&]() {
        for (int r = 0; r < group_r; ++r) {
            axpy(factor * pa[r], group_b + r * hd_kv + kv_off, out, hd);
        }
        group_b = nullptr;
    };
    int64_t seen = 0;
    for (int i = 0; i < n_runs && seen < n_seen; ++i) {
        const KvRun & run = runs[i];
        const int64_t n   = std::min<int64_t>(run.n, n_seen - seen);
        const int64_t j0  = std::clamp<int64_t>(n_first - seen, 0, n);  // rows before the window: not attended
        if (run.rank > 0 && j0 < n) {
            if (run.b_v != group_b) {
                if (group_b != nullptr) {
                    flush();
                }
                group_b = run.b_v;
                group_r = run.rank;
                std::fill(pa, pa + group_r, 0.0f);
            }
            for (int64_t j = j0; j < n; ++j) {
                axpy(p[seen + j], run.a_v + j * run.rank, pa, run.rank);
            }
        }
        seen += n;
    }
    if (group_b != nullptr) {
        flush();
    }
}

// T: the stored element type (float for F32, uint16_t for F16).
template <typename T>
static void attend_t(const AttentionShape & shape, const Rope & rope, const float * q, const KvRun * runs, int n_runs,
                     int64_t n_visible, int h_begin, int h_end, float * out, float * scratch, int64_t n_causal) {
    const int hd      = shape.head_dim;
    const int group   = shape.n_head / shape.n_head_kv;
    float *   q_rot   = scratch;                                            // [n_head * hd], q re-rotated for a shift
    float *   score   = scratch + static_cast<int64_t>(shape.n_head) * hd;  // [n_visible]
    float *   row_buf = score + n_visible + 16;                             // [hd], an f16 head slice as f32
    // Keys [first, n_visible) are attended (all with no window); scores before first are computed and ignored.
    // (n_causal: the query's own position + 1, which the window ends at, when it sees further: a bidirectional span)
    const int64_t first = shape.window > 0 ? std::max<int64_t>(0, n_causal - shape.window) : 0;
    for (int h = h_begin; h < h_end; ++h) {
        const int64_t kv_off = static_cast<int64_t>(h / group) * hd;
        // Pass 1: scores of every visible key.
        int64_t         seen         = 0;
        int32_t         cached_shift = 0;
        bool            have_rot     = false;
        ScoreCorrection corr;
        const float *   qh = q + static_cast<int64_t>(h) * hd;
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
            const T *     k = static_cast<const T *>(run.k) + kv_off;
            for (int64_t j = 0; j < n; ++j) {
                score[seen + j] = dot(qq, head_f32(k + j * shape.row_stride, row_buf, hd), hd) * shape.scale;
            }
            if (run.rank > 0) {
                add_score_corrections(run, corr.get(run, qq, hd, shape.row_stride, kv_off), n, shape.scale,
                                      score + seen);
            }
            seen += n;
        }
        // Softmax.
        float mx = -INFINITY;
        for (int64_t j = first; j < seen; ++j) {
            mx = std::max(mx, score[j]);
        }
        if (shape.sinks != nullptr) {
            mx = std::max(mx, shape.sinks[h]);
        }
        float sum = shape.sinks != nullptr ? std::exp(shape.sinks[h] - mx) : 0.0f;
        for (int64_t j = first; j < seen; ++j) {
            score[j] = std::exp(score[j] - mx);
            sum += score[j];
        }
        const float inv = 1.0f / sum;
        // Pass 2: weighted sum of values.
        float * oh = out + static_cast<int64_t>(h) * hd;
        std::memset(oh, 0, sizeof(float) * static_cast<size_t>(hd));
        seen = 0;
        for (int r = 0; r < n_runs && seen < n_visible; ++r) {
            const KvRun & run = runs[r];
            const int64_t n   = std::min<int64_t>(run.n, n_visible - seen);
            const T *     v   = static_cast<const T *>(run.v) + kv_off;
            for (int64_t j = std::clamp<int64_t>(first - seen, 0, n); j < n; ++j) {
                axpy(score[seen + j], head_f32(v + j * shape.row_stride, row_buf, hd), oh, hd);
            }
            seen += n;
        }
        add_output_corrections(runs, n_runs, first, seen, score, hd, shape.row_stride, kv_off, 1.0f, oh);
        for (int i = 0; i < hd; ++i) {
            oh[i] *= inv;
        }
    }
}

static void attend(const AttentionShape & shape, const Rope & rope, const float * q, const KvRun * runs, int n_runs,
                   int64_t n_visible, int h_begin, int h_end, float * out, float * scratch, int64_t n_causal = -1) {
    n_causal = n_causal < 0 ? n_visible : n_causal;
    if (shape.kv_type == KvType::F16) {
        attend_t<uint16_t>(shape, rope, q, runs, n_runs, n_visible, h_begin, h_end, out, scratch, n_causal);
    } else {
        attend_t<float>(shape, rope, q, runs, n_runs, n_visible, h_begin, h_end, out, scratch, n_causal);
    }
}

}  // namespace kvcmas::cpu::KC_ATTN_NS
