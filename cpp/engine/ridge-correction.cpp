#include "engine/ridge-correction.h"

#include <algorithm>
#include <cstring>

#include "common/error.h"
#include "engine/model.h"

namespace kvcmas {

RidgeMaps::RidgeMaps(int n_layer, int n_kv_dim, int rank) : n_kv_dim_(n_kv_dim), rank_(rank) {
    KC_CHECK(n_layer > 0 && n_kv_dim > 0, "RidgeMaps: n_layer (%d) and n_kv_dim (%d) must be positive", n_layer,
             n_kv_dim);
    KC_CHECK(rank > 0 && rank < cpu::kMaxCorrectionRank, "RidgeMaps: rank %d outside [1, %d)", rank,
             cpu::kMaxCorrectionRank);
    k_.resize(static_cast<size_t>(n_layer));
    v_.resize(static_cast<size_t>(n_layer));
}

static RidgeMaps::Map make_map(int kd, int rank, const float * mu_x, const float * proj, const float * vt,
                               const float * mu_y) {
    const size_t   w = static_cast<size_t>(kd), r = static_cast<size_t>(rank);
    RidgeMaps::Map m;
    m.mu_x.assign(mu_x, mu_x + w);
    m.proj.assign(proj, proj + w * r);
    m.b.resize((r + 1) * w);
    std::memcpy(m.b.data(), vt, sizeof(float) * r * w);
    std::memcpy(m.b.data() + r * w, mu_y, sizeof(float) * w);
    return m;
}

void RidgeMaps::set_layer(int il, const float * mu_x_k, const float * proj_k, const float * vt_k, const float * mu_y_k,
                          const float * mu_x_v, const float * proj_v, const float * vt_v, const float * mu_y_v) {
    KC_CHECK(il >= 0 && il < n_layer(), "RidgeMaps.set_layer: layer %d outside [0, %d)", il, n_layer());
    k_[static_cast<size_t>(il)] = make_map(n_kv_dim_, rank_, mu_x_k, proj_k, vt_k, mu_y_k);
    v_[static_cast<size_t>(il)] = make_map(n_kv_dim_, rank_, mu_x_v, proj_v, vt_v, mu_y_v);
}

size_t RidgeMaps::bytes() const {
    size_t n = 0;
    for (const std::vector<Map> * side : { &k_, &v_ }) {
        for (const Map & m : *side) {
            n += (m.mu_x.size() + m.proj.size() + m.b.size()) * sizeof(float);
        }
    }
    return n;
}

namespace {

// The rows of positions [pos, pos + n) of one layer as attention reads them (stored rows in f32, the run's
// correction added), keys rotated to the canonical frame (position pos -> 0). k_out, v_out: [n][kd].
void read_canonical(const cpu::Rope & rope, cpu::KvType kv_type, int n_head_kv, int head_dim,
                    const std::vector<cpu::KvRun> & runs, int32_t pos, int32_t n, float * k_out, float * v_out) {
    const int64_t      kd        = static_cast<int64_t>(n_head_kv) * head_dim;
    const int64_t      row_bytes = kd * static_cast<int64_t>(cpu::kv_type_size(kv_type));
    const int          half      = rope.n_rot / 2;
    std::vector<float> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
    int64_t            cached_shift = 0;
    bool               have_angles  = false;
    int64_t            at           = 0;  // sequence position of the run's first row
    for (const cpu::KvRun & r : runs) {
        const int64_t j0 = std::max<int64_t>(0, pos - at), j1 = std::min<int64_t>(r.n, pos + n - at);
        // A run's keys sit at their positions after r.shift; the canonical frame is that minus pos. Constant over
        // a run, so the angles are computed once per run, not per row.
        const int64_t shift = static_cast<int64_t>(r.shift) - pos;
        for (int64_t j = j0; j < j1; ++j) {
            const int64_t i = at + j - pos;
            float *       k = k_out + i * kd;
            float *       v = v_out + i * kd;
            cpu::kv_load_row(kv_type, static_cast<const uint8_t *>(r.k) + j * row_bytes, k, kd);
            cpu::kv_load_row(kv_type, static_cast<const uint8_t *>(r.v) + j * row_bytes, v, kd);
            for (int32_t c = 0; c < r.rank; ++c) {
                const float   ak = r.a_k[j * r.rank + c], av = r.a_v[j * r.rank + c];
                const float * bk = r.b_k + c * kd;
                const float * bv = r.b_v + c * kd;
                for (int64_t d = 0; d < kd; ++d) {
                    k[d] += ak * bk[d];
                    v[d] += av * bv[d];
                }
            }
            if (shift != 0) {
                if (!have_angles || shift != cached_shift) {
                    rope.angles(static_cast<double>(shift), cs.data(), sn.data());
                    cached_shift = shift;
                    have_angles  = true;
                }
                rope.apply_cs(k, n_head_kv, head_dim, cs.data(), sn.data());
            }
        }
        at += r.n;
    }
}

// a_out[i * a_stride + c] = ((x_i - mu_x) · proj)[c] for c < rank, then 1 (the offset column).
void ridge_a(const RidgeMaps::Map & m, int rank, const float * x, int32_t n, int64_t kd, float * a_out,
             int64_t a_stride, float * centred) {
    for (int32_t i = 0; i < n; ++i) {
        const float * xi  = x + static_cast<int64_t>(i) * kd;
        float *       out = a_out + static_cast<int64_t>(i) * a_stride;
        for (int64_t d = 0; d < kd; ++d) {
            centred[d] = xi[d] - m.mu_x[static_cast<size_t>(d)];
        }
        std::fill(out, out + rank, 0.0f);
        for (int64_t d = 0; d < kd; ++d) {  // rank-wide inner loop: vectorizes, no reduction across iterations
            const float   xd = centred[d];
            const float * p  = m.proj.data() + d * rank;
            for (int c = 0; c < rank; ++c) {
                out[c] += xd * p[c];
            }
        }
        out[rank] = 1.0f;
    }
}

}  // namespace

std::shared_ptr<KvCorrection> ridge_correction(Model & model, const RidgeMaps & maps, int32_t seq, int32_t pos,
                                               int32_t n, int32_t frame0, const KvCorrection * prev) {
    KvCache &           kv     = model.kv();
    const KvLayout &    layout = kv.pool().layout();
    const ModelParams & p      = model.params();
    const int64_t       kd     = layout.n_kv_dim;
    KC_CHECK(maps.n_layer() == layout.n_layer && maps.n_kv_dim() == layout.n_kv_dim,
             "ridge_correction: maps for %d layers of width %d, the model has %d layers of width %d", maps.n_layer(),
             maps.n_kv_dim(), layout.n_layer, layout.n_kv_dim);
    const int32_t len = kv.seq_length(seq);
    KC_CHECK(pos >= 0 && n > 0 && static_cast<int64_t>(pos) + n <= len,
             "ridge_correction: positions [%d, %d) are outside sequence %d (length %d)", pos, pos + n, seq, len);
    int prev_rank = 0;
    if (prev != nullptr) {
        prev->validate(layout);
        KC_CHECK(prev->n_rows >= n, "ridge_correction: the previous correction covers %d rows, the span %d",
                 prev->n_rows, n);
        prev_rank = prev->rank;
    }
    const int map_rank = maps.rank() + 1;  // the map's rank plus the offset column
    const int rank     = prev_rank + map_rank;
    KC_CHECK(rank <= cpu::kMaxCorrectionRank,
             "ridge_correction: total rank %d (previous %d + %d) is over the kernel's limit %d: fold the previous "
             "correction first",
             rank, prev_rank, map_rank, cpu::kMaxCorrectionRank);

    auto out      = std::make_shared<KvCorrection>();
    out->n_rows   = n;
    out->rank     = rank;
    out->n_kv_dim = static_cast<int32_t>(kd);
    out->layers.resize(static_cast<size_t>(layout.n_layer));

    const cpu::Rope & rope = model.rope();
    const int         n_kv = static_cast<int>(p.n_head_kv), hd = static_cast<int>(p.head_dim);
    const size_t      na = static_cast<size_t>(n) * rank, nb = static_cast<size_t>(rank) * kd;
    model.thread_pool().run([&](int ith, int nth) {
        long long l0, l1;
        cpu::split_range(layout.n_layer, ith, nth, l0, l1);
        std::vector<cpu::KvRun> runs;
        std::vector<float>      xk, xv, centred(static_cast<size_t>(kd));
        for (long long il = l0; il < l1; ++il) {
            const bool has_prev = prev != nullptr && !prev->layers[static_cast<size_t>(il)].a_k.empty();
            const bool has_map  = maps.has_layer(static_cast<int>(il));
            if (!has_prev && !has_map) {
                continue;
            }
            KvCorrection::Layer & l = out->layers[static_cast<size_t>(il)];
            l.a_k.assign(na, 0.0f);
            l.a_v.assign(na, 0.0f);
            l.b_k.assign(nb, 0.0f);
            l.b_v.assign(nb, 0.0f);
            int col = 0;  // parts are concatenated in order (previous, then this edge's) and zero-padded at the end
            if (has_prev) {
                const KvCorrection::Layer & pl = prev->layers[static_cast<size_t>(il)];
                for (int32_t i = 0; i < n; ++i) {
                    std::memcpy(&l.a_k[static_cast<size_t>(i) * rank], &pl.a_k[static_cast<size_t>(i) * prev_rank],
                                sizeof(float) * prev_rank);
                    std::memcpy(&l.a_v[static_cast<size_t>(i) * rank], &pl.a_v[static_cast<size_t>(i) * prev_rank],
                                sizeof(float) * prev_rank);
                }
                std::memcpy(l.b_k.data(), pl.b_k.data(), sizeof(float) * prev_rank * kd);
                std::memcpy(l.b_v.data(), pl.b_v.data(), sizeof(float) * prev_rank * kd);
                col = prev_rank;
            }
            if (has_map) {
                xk.resize(static_cast<size_t>(n) * kd);
                xv.resize(static_cast<size_t>(n) * kd);
                kv.runs(seq, static_cast<int>(il), runs);
                read_canonical(rope, layout.kv_type, n_kv, hd, runs, pos, n, xk.data(), xv.data());
                const RidgeMaps::Map & mk = maps.k(static_cast<int>(il));
                const RidgeMaps::Map & mv = maps.v(static_cast<int>(il));
                ridge_a(mk, maps.rank(), xk.data(), n, kd, &l.a_k[static_cast<size_t>(col)], rank, centred.data());
                ridge_a(mv, maps.rank(), xv.data(), n, kd, &l.a_v[static_cast<size_t>(col)], rank, centred.data());
                float * bk = &l.b_k[static_cast<size_t>(col) * kd];
                std::memcpy(bk, mk.b.data(), sizeof(float) * map_rank * kd);
                std::memcpy(&l.b_v[static_cast<size_t>(col) * kd], mv.b.data(), sizeof(float) * map_rank * kd);
                // Canonical-frame key deltas to the stored frame: a constant RoPE shift is linear on the row width
                // and commutes with the row-wise A, so rotating the rows of B_k by frame0 suffices.
                if (frame0 != 0) {
                    for (int c = 0; c < map_rank; ++c) {
                        rope.apply(bk + static_cast<int64_t>(c) * kd, n_kv, hd, static_cast<double>(frame0));
                    }
                }
            }
        }
    });
    return out;
}

}  // namespace kvcmas
