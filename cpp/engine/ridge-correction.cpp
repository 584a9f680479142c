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

void RidgeMaps::set_rows(int32_t rows) {
    KC_CHECK(rows >= 0, "RidgeMaps: rows %d must be >= 0 (0: every row)", rows);
    rows_ = rows;
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

// A map as it applies to the stored rows of one run of the view. The run's keys reach the canonical frame by a
// rotation R(s) (s = run shift - pos) and carry the run's correction a·B; since R is orthogonal,
//   (R(s)(x + a·B) - mu)·proj = (x - R(-s)mu)·(R(-s)proj) + a·(B·R(-s)proj),
// so the map reads the stored rows directly: no rotated or corrected copy of the view is made, and a run's
// correction costs rank_run x rank per row instead of rank_run x kd.
struct RunMap {
    int64_t            shift  = 0;        // s; 0 for values
    const float *      b      = nullptr;  // the run's B (K or V side), null without a correction
    int                b_rank = 0;
    std::vector<float> mu;    // [kd]       R(-s) mu_x
    std::vector<float> proj;  // [kd][rank] R(-s) proj, column-wise
    std::vector<float> m;     // [b_rank][rank] B · R(-s) proj
};

void make_run_map(const RidgeMaps::Map & map, int rank, int64_t kd, const cpu::Rope * rope, int n_head_kv, int head_dim,
                  int64_t shift, const float * b, int b_rank, RunMap & out) {
    out.shift  = shift;
    out.b      = b;
    out.b_rank = b_rank;
    out.mu     = map.mu_x;
    out.proj   = map.proj;
    if (rope != nullptr && shift != 0) {
        rope->apply(out.mu.data(), n_head_kv, head_dim, static_cast<double>(-shift));
        std::vector<float> col(static_cast<size_t>(kd));
        for (int c = 0; c < rank; ++c) {
            for (int64_t d = 0; d < kd; ++d) {
                col[static_cast<size_t>(d)] = out.proj[static_cast<size_t>(d * rank + c)];
            }
            rope->apply(col.data(), n_head_kv, head_dim, static_cast<double>(-shift));
            for (int64_t d = 0; d < kd; ++d) {
                out.proj[static_cast<size_t>(d * rank + c)] = col[static_cast<size_t>(d)];
            }
        }
    }
    out.m.assign(static_cast<size_t>(b_rank) * rank, 0.0f);
    for (int q = 0; q < b_rank; ++q) {
        float * mq = &out.m[static_cast<size_t>(q) * rank];
        for (int64_t d = 0; d < kd; ++d) {
            const float   bd = b[q * kd + d];
            const float * p  = &out.proj[static_cast<size_t>(d * rank)];
            for (int c = 0; c < rank; ++c) {
                mq[c] += bd * p[c];
            }
        }
    }
}

const RunMap & run_map(std::vector<RunMap> & cache, const RidgeMaps::Map & map, int rank, int64_t kd,
                       const cpu::Rope * rope, int n_head_kv, int head_dim, int64_t shift, const float * b,
                       int b_rank) {
    for (const RunMap & r : cache) {
        if (r.shift == shift && r.b == b && r.b_rank == b_rank) {
            return r;
        }
    }
    cache.emplace_back();
    make_run_map(map, rank, kd, rope, n_head_kv, head_dim, shift, b, b_rank, cache.back());
    return cache.back();
}

// Layer il's ridge jobs for the view's runs covering positions [pos, pos + n): A_k, A_v columns [col, col + rank
// + 1) of rows with stride a_stride (host). The run maps are kept in cache_k / cache_v, which outlive the jobs.
void ridge_layer_jobs(const RidgeMaps & maps, int il, const cpu::Rope & rope, int n_head_kv, int head_dim,
                      const backend::RunTable & table, int32_t pos, int32_t n, float * a_k, float * a_v,
                      int64_t a_stride, std::vector<RunMap> & cache_k, std::vector<RunMap> & cache_v,
                      std::vector<backend::RidgeJob> & jobs) {
    const int              rank = maps.rank();
    const int64_t          kd   = static_cast<int64_t>(n_head_kv) * head_dim;
    const RidgeMaps::Map & mk   = maps.k(il);
    const RidgeMaps::Map & mv   = maps.v(il);
    cache_k.clear();
    cache_v.clear();
    cache_k.reserve(table.runs.size());  // jobs point into the caches: no reallocation while they are made
    cache_v.reserve(table.runs.size());
    jobs.clear();
    int64_t at = 0;  // sequence position of the run's first row
    for (const backend::KvRunRef & r : table.runs) {
        const int64_t j0 = std::max<int64_t>(0, pos - at), j1 = std::min<int64_t>(r.n, pos + n - at);
        if (j0 < j1) {
            const backend::Factors * f      = r.corr >= 0 ? table.corrs[static_cast<size_t>(r.corr)] : nullptr;
            const int                b_rank = f != nullptr ? f->rank : 0;
            const int64_t            shift  = static_cast<int64_t>(r.shift) - pos;
            const RunMap &           rk     = run_map(cache_k, mk, rank, kd, &rope, n_head_kv, head_dim, shift,
                                                      f != nullptr ? f->host_b_k : nullptr, b_rank);
            const RunMap &           rv     = run_map(cache_v, mv, rank, kd, nullptr, n_head_kv, head_dim, 0,
                                                      f != nullptr ? f->host_b_v : nullptr, b_rank);
            const int64_t            i0     = at + j0 - pos;
            for (const bool values : { false, true }) {
                const RunMap &    rm = values ? rv : rk;
                backend::RidgeJob job;
                job.run        = r;
                job.f          = f;
                job.values     = values;
                job.j0         = static_cast<int32_t>(j0);
                job.j1         = static_cast<int32_t>(j1);
                job.mu         = rm.mu.data();
                job.proj       = rm.proj.data();
                job.m          = rm.m.data();
                job.b_rank     = rm.b_rank;
                job.out        = (values ? a_v : a_k) + i0 * a_stride;
                job.out_stride = a_stride;
                jobs.push_back(job);
            }
        }
        at += r.n;
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
    // the rows the maps apply to (fitted range); the A rows after them stay zero
    const int32_t n_map = maps.rows() > 0 ? std::min(n, maps.rows()) : n;
    const int     rank  = prev_rank + map_rank;
    KC_CHECK(rank <= cpu::kMaxCorrectionRank,
             "ridge_correction: total rank %d (previous %d + %d) is over the kernel's limit %d: fold the previous "
             "correction first",
             rank, prev_rank, map_rank, cpu::kMaxCorrectionRank);

    auto out      = std::make_shared<KvCorrection>();
    out->n_rows   = n;
    out->rank     = rank;
    out->n_kv_dim = static_cast<int32_t>(kd);
    out->layers.resize(static_cast<size_t>(layout.n_layer));

    const int                      n_kv = static_cast<int>(p.n_head_kv), hd = static_cast<int>(p.head_dim);
    const size_t                   na = static_cast<size_t>(n) * rank, nb = static_cast<size_t>(rank) * kd;
    const backend::KvStore         store = kv.pool().store();
    backend::RunTable              table;
    std::vector<RunMap>            cache_k, cache_v;
    std::vector<backend::RidgeJob> jobs;
    for (int il = 0; il < layout.n_layer; ++il) {
        const bool has_prev = prev != nullptr && !prev->layers[static_cast<size_t>(il)].a_k.empty();
        const bool has_map  = maps.has_layer(il);
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
            kv.runs(seq, il, table);
            const cpu::Rope & rope = model.rope(il);
            ridge_layer_jobs(maps, il, rope, n_kv, hd, table, pos, n_map, &l.a_k[static_cast<size_t>(col)],
                             &l.a_v[static_cast<size_t>(col)], rank, cache_k, cache_v, jobs);
            model.backend().ridge_rows(store, il, jobs.data(), static_cast<int>(jobs.size()), maps.rank());
            const RidgeMaps::Map & mk = maps.k(il);
            const RidgeMaps::Map & mv = maps.v(il);
            float *                bk = &l.b_k[static_cast<size_t>(col) * kd];
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
    return out;
}

}  // namespace kvcmas
