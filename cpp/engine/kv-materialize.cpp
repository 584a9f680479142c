#include "engine/kv-materialize.h"

#include <vector>

#include "common/error.h"
#include "engine/model.h"

namespace kvcmas {

int32_t materialize_last_segment(Model & model, int32_t seq) {
    KvCache &                      kv   = model.kv();
    const std::vector<KvSegment> & segs = kv.seq_segments(seq);
    KC_CHECK(!segs.empty(), "materialize: sequence %d holds no rows", seq);
    const KvSegment seg = segs.back();  // a copy: keeps the span and the correction alive while rows are copied
    const int32_t   len = kv.seq_length(seq);
    kv.seq_truncate(seq, len - seg.n);
    std::vector<KvSlot> slots;
    try {
        slots = kv.append(seq, seg.n);
    } catch (...) {
        kv.seq_append_span(seq, seg.span, seg.begin, seg.n, seg.corr);  // as it was
        throw;
    }

    const KvLayout &     layout = kv.pool().layout();
    const ModelParams &  p      = model.params();
    const cpu::Rope &    rope   = model.rope();
    const int64_t        kd     = layout.n_kv_dim;
    const int            n_kv = static_cast<int>(p.n_head_kv), hd = static_cast<int>(p.head_dim);
    const KvCorrection * corr = seg.corr != nullptr && seg.corr->rank > 0 ? seg.corr.get() : nullptr;
    KvSpan &             src  = *seg.span;
    const int32_t        n    = seg.n;
    model.thread_pool().run([&](int ith, int nth) {
        long long l0, l1;
        cpu::split_range(layout.n_layer, ith, nth, l0, l1);
        std::vector<float> k(static_cast<size_t>(kd)), v(static_cast<size_t>(kd));
        std::vector<float> cs(static_cast<size_t>(rope.n_rot / 2)), sn(static_cast<size_t>(rope.n_rot / 2));
        for (long long il = l0; il < l1; ++il) {
            const int                   layer = static_cast<int>(il);
            const KvCorrection::Layer * cl    = nullptr;
            if (corr != nullptr && !corr->layers[static_cast<size_t>(il)].a_k.empty()) {
                cl = &corr->layers[static_cast<size_t>(il)];
            }
            int64_t cached_shift = 0;
            bool    have_angles  = false;
            for (int32_t i = 0; i < n; ++i) {
                cpu::kv_load_row(layout.kv_type, src.k_row(layer, seg.begin + i), k.data(), kd);
                cpu::kv_load_row(layout.kv_type, src.v_row(layer, seg.begin + i), v.data(), kd);
                if (cl != nullptr) {
                    const int     r  = corr->rank;
                    const float * ak = &cl->a_k[static_cast<size_t>(i) * r];
                    const float * av = &cl->a_v[static_cast<size_t>(i) * r];
                    for (int c = 0; c < r; ++c) {
                        const float * bk = &cl->b_k[static_cast<size_t>(c) * kd];
                        const float * bv = &cl->b_v[static_cast<size_t>(c) * kd];
                        for (int64_t d = 0; d < kd; ++d) {
                            k[d] += ak[c] * bk[d];
                            v[d] += av[c] * bv[d];
                        }
                    }
                }
                const KvSlot & slot = slots[static_cast<size_t>(i)];
                // From the frame the source row's key is rotated at to the one of its new slot; constant over
                // consecutive rows, so the angles are computed once.
                const int64_t shift =
                    static_cast<int64_t>(slot.frame_pos) - (static_cast<int64_t>(src.frame0()) + seg.begin + i);
                if (shift != 0) {
                    if (!have_angles || shift != cached_shift) {
                        rope.angles(static_cast<double>(shift), cs.data(), sn.data());
                        cached_shift = shift;
                        have_angles  = true;
                    }
                    rope.apply_cs(k.data(), n_kv, hd, cs.data(), sn.data());
                }
                cpu::kv_store_row(layout.kv_type, k.data(), slot.span->k_row(layer, slot.row), kd);
                cpu::kv_store_row(layout.kv_type, v.data(), slot.span->v_row(layer, slot.row), kd);
            }
        }
    });
    return n;
}

}  // namespace kvcmas
