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
        kv.seq_append_span(seq, seg, seg.corr, seg.corr_row0);  // as it was
        throw;
    }

    // The segment's runs (the same blocks in every layer; only the correction's factors differ by layer), and per
    // row the RoPE shift from the frame its source key is rotated at to the one of its new slot.
    const ModelParams &             p     = model.params();
    const backend::KvStore          store = kv.pool().store();
    const cpu::AttentionShape       shape{ static_cast<int>(p.n_head),
                                           static_cast<int>(p.n_head_kv),
                                           static_cast<int>(p.head_dim),
                                           store.n_kv_dim,
                                           1.0f,
                                           store.kv_type };
    const int32_t                   n = seg.n;
    std::vector<int64_t>            shifts(static_cast<size_t>(n));
    std::vector<backend::KvSlotRef> dst(static_cast<size_t>(n));
    for (int32_t i = 0; i < n; ++i) {
        const KvSlot & slot            = slots[static_cast<size_t>(i)];
        dst[static_cast<size_t>(i)]    = slot.ref;
        shifts[static_cast<size_t>(i)] = static_cast<int64_t>(slot.frame_pos) - (static_cast<int64_t>(seg.frame) + i);
    }
    backend::RunTable table;
    for (int il = 0; il < static_cast<int>(p.n_layer); ++il) {
        table.clear();
        const backend::Factors * f = seg.corr != nullptr ? seg.corr->factors(model.backend(), il) : nullptr;
        if (f != nullptr) {
            table.corrs.push_back(f);
        }
        seg.span->append_runs(seg.begin, n, 0, f != nullptr ? 0 : -1, seg.corr_row0, table);
        model.backend().kv_copy(model.rope(il), shape, store, il, table, 0, static_cast<int>(table.runs.size()),
                                shifts.data(), dst.data());
    }
    return n;
}

}  // namespace kvcmas
