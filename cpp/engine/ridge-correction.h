// KVCMAS's default estimator (a reduced-rank ridge map per edge and layer) applied in the core: from a reader's
// base view of a shared span it builds the low-rank correction the attention kernel adds, without handing the
// base rows to Python and back. The maps themselves are fitted in Python (kvcmas_cpp.sharing.estimators) and
// copied in once per fitted edge.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/kv-cache.h"

namespace kvcmas {

class Model;

// The fitted maps of one edge (span, reader): per layer, for K and for V, delta(x) = (x - mu_x)·proj·vt + mu_y on
// rows x of width kd = n_kv_dim in the span's canonical frame (keys rotated at positions 0..n-1). As factors:
// A = [(x - mu_x)·proj, 1] [n][rank + 1] and B = [vt; mu_y] [rank + 1][kd]. Layers without a map (layer 0
// always) are not corrected. rows (0: every row) is the span rows [0, rows) the maps were fitted on: a map fitted
// on a span's first rows extrapolates badly past them, so rows after them get no delta from it. Immutable once
// filled, so concurrent readers need no lock.
class RidgeMaps {
  public:
    struct Map {
        std::vector<float> mu_x;  // [kd]
        std::vector<float> proj;  // [kd][rank]
        std::vector<float> b;     // [rank + 1][kd]: vt, then mu_y as the last row
    };

    // Throws kvcmas::Error unless n_layer, n_kv_dim > 0 and 0 < rank < cpu::kMaxCorrectionRank.
    RidgeMaps(int n_layer, int n_kv_dim, int rank);

    // Sets layer il's maps from row-major arrays: mu_x [kd], proj [kd][rank], vt [rank][kd], mu_y [kd], K then V.
    void set_layer(int il, const float * mu_x_k, const float * proj_k, const float * vt_k, const float * mu_y_k,
                   const float * mu_x_v, const float * proj_v, const float * vt_v, const float * mu_y_v);

    int         n_layer() const { return static_cast<int>(k_.size()); }
    int         n_kv_dim() const { return n_kv_dim_; }
    int         rank() const { return rank_; }  // of the map; its factors have rank() + 1 columns (the offset)
    int32_t     rows() const { return rows_; }  // span rows [0, rows) the maps apply to; 0: every row
    void        set_rows(int32_t rows);         // throws kvcmas::Error when rows < 0
    bool        has_layer(int il) const { return !k_[static_cast<size_t>(il)].b.empty(); }
    const Map & k(int il) const { return k_[static_cast<size_t>(il)]; }
    const Map & v(int il) const { return v_[static_cast<size_t>(il)]; }
    size_t      bytes() const;  // memory held by the maps

  private:
    int              n_kv_dim_;
    int              rank_;
    int32_t          rows_ = 0;
    std::vector<Map> k_, v_;  // [n_layer]; an empty Map: layer not corrected
};

// The correction a reader applies to a shared span: positions [pos, pos + n) of sequence `seq` are its base view
// (read as attention reads them: stored rows, the segment's correction added), their keys are taken to the
// canonical frame, and the maps give per layer A = [(x - mu_x)·proj, 1], B = [vt; mu_y], with B_k rotated to the
// span's stored frame (its first row's keys rotated at position frame0). prev (may be null), the correction the
// base view already carries relative to the stored rows, is concatenated in front along the rank axis, so the
// result corrects the stored rows to base + this edge's delta; its rows must cover n. Rows i >= maps.rows() (when
// set) get no delta from the maps (their A columns are zero): prev alone corrects them. Layers where neither part
// has factors stay empty. Throws kvcmas::Error on bad shapes, positions outside seq, or a total rank over
// cpu::kMaxCorrectionRank (fold prev first). The caller holds the model's lock (Model::ridge_correction
// takes it); the rows are read by the model's backend (Backend::ridge_rows).
std::shared_ptr<KvCorrection> ridge_correction(Model & model, const RidgeMaps & maps, int32_t seq, int32_t pos,
                                               int32_t n, int32_t frame0, const KvCorrection * prev);

}  // namespace kvcmas
