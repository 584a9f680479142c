#include "engine/kv-cache.h"

#include <algorithm>

#include "common/error.h"

namespace kvcmas {

KvBlockPool::KvBlockPool(backend::Backend & backend, KvLayout layout, size_t budget_bytes)
    : layout_(layout),
      elem_bytes_(cpu::kv_type_size(layout.kv_type)),
      block_bytes_(static_cast<size_t>(layout.n_layer) * 2 * kKvBlockRows * static_cast<size_t>(layout.n_kv_dim) *
                   elem_bytes_),
      budget_bytes_(budget_bytes),
      backend_(backend) {
    KC_CHECK(layout.n_layer > 0 && layout.n_kv_dim > 0, "KV layout needs layers and a row width");
}

KvBlockPool::~KvBlockPool() {
    for (uint8_t * p : blocks_) {
        if (p != nullptr) {
            backend_.kv_block_free(p, block_bytes_);
        }
    }
}

int32_t KvBlockPool::allocate() {
    std::lock_guard<std::mutex> lock(mutex_);
    KC_CHECK((n_used_ + 1) * block_bytes() <= budget_bytes_,
             "KV cache budget exhausted: %zu of %zu bytes in use, a block needs %zu more", n_used_ * block_bytes(),
             budget_bytes_, block_bytes());
    int32_t id;
    if (!free_.empty()) {
        id = free_.back();
        if (blocks_[static_cast<size_t>(id)] == nullptr) {  // trimmed: allocate again (may throw; then no change)
            blocks_[static_cast<size_t>(id)] = backend_.kv_block_alloc(block_bytes_);
            ++n_mapped_;
        }
        free_.pop_back();
    } else {
        uint8_t * p = backend_.kv_block_alloc(block_bytes_);
        try {
            blocks_.push_back(p);
        } catch (...) {
            backend_.kv_block_free(p, block_bytes_);
            throw;
        }
        id = static_cast<int32_t>(blocks_.size() - 1);
        ++n_mapped_;
    }
    ++n_used_;
    return id;
}

backend::KvStore KvBlockPool::store() const {
    return backend::KvStore{ &blocks_, layer_stride(), v_offset(), row_bytes(), layout_.n_kv_dim, layout_.kv_type };
}

size_t KvBlockPool::trim() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t                      released = 0;
    for (int32_t id : free_) {
        uint8_t *& mem = blocks_[static_cast<size_t>(id)];
        if (mem != nullptr) {
            backend_.kv_block_free(mem, block_bytes_);
            mem = nullptr;
            --n_mapped_;
            released += block_bytes_;
        }
    }
    return released;
}

size_t KvBlockPool::bytes_allocated() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return n_mapped_ * block_bytes_;
}

void KvBlockPool::release(int32_t block) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(block);
    --n_used_;
}

size_t KvBlockPool::bytes_in_use() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return n_used_ * block_bytes();
}

KvSpan::~KvSpan() {
    for (int32_t b : blocks_) {
        pool_.release(b);
    }
}

void KvSpan::resize(int32_t n) {
    const size_t need = static_cast<size_t>((n + kKvBlockRows - 1) / kKvBlockRows);
    const size_t had  = blocks_.size();
    try {
        while (blocks_.size() < need) {
            blocks_.push_back(pool_.allocate());
        }
    } catch (...) {
        while (blocks_.size() > had) {  // all or nothing
            pool_.release(blocks_.back());
            blocks_.pop_back();
        }
        throw;
    }
    while (blocks_.size() > need) {
        pool_.release(blocks_.back());
        blocks_.pop_back();
    }
    n_rows_ = n;
}

void KvSpan::append_runs(int32_t begin, int32_t n, int32_t shift, int32_t corr, int32_t corr_row0,
                         backend::RunTable & out) const {
    int32_t row = begin;
    while (row < begin + n) {
        const int32_t in_block = row % kKvBlockRows;
        const int32_t take     = std::min(kKvBlockRows - in_block, begin + n - row);
        out.runs.push_back(backend::KvRunRef{ blocks_[static_cast<size_t>(row / kKvBlockRows)], in_block, take, shift,
                                              corr, corr >= 0 ? corr_row0 + row - begin : 0 });
        row += take;
    }
}

size_t KvCorrection::bytes() const {
    size_t n = 0;
    for (const Layer & l : layers) {
        n += (l.a_k.size() + l.b_k.size() + l.a_v.size() + l.b_v.size()) * sizeof(float);
    }
    return n;
}

void KvCorrection::validate(const KvLayout & layout) const {
    KC_CHECK(rank >= 0 && rank <= cpu::kMaxCorrectionRank, "correction rank %d outside [0, %d]", rank,
             cpu::kMaxCorrectionRank);
    KC_CHECK(n_rows >= 0, "correction of %d rows", n_rows);
    KC_CHECK(n_kv_dim == layout.n_kv_dim, "correction row width %d, the model's KV rows have %d", n_kv_dim,
             layout.n_kv_dim);
    KC_CHECK(layers.size() == static_cast<size_t>(layout.n_layer), "correction has %zu layers, the model %d",
             layers.size(), layout.n_layer);
    const size_t na = static_cast<size_t>(n_rows) * rank, nb = static_cast<size_t>(rank) * n_kv_dim;
    for (size_t il = 0; il < layers.size(); ++il) {
        const Layer & l     = layers[il];
        const bool    empty = l.a_k.empty() && l.b_k.empty() && l.a_v.empty() && l.b_v.empty();
        KC_CHECK(empty || (l.a_k.size() == na && l.a_v.size() == na && l.b_k.size() == nb && l.b_v.size() == nb),
                 "correction layer %zu: factors must be A [%d x %d] and B [%d x %d] for both K and V", il, n_rows, rank,
                 rank, n_kv_dim);
    }
}

void KvCorrection::bind(backend::Backend & backend) const {
    sealed = true;
    std::lock_guard<std::mutex> lock(bind_mutex_);
    for (const Binding & b : bindings_) {
        if (b.backend == &backend) {
            return;
        }
    }
    Binding b{ &backend, {} };
    b.layers.resize(layers.size());
    for (size_t il = 0; il < layers.size(); ++il) {
        const Layer & l = layers[il];
        if (rank > 0 && !l.a_k.empty()) {
            b.layers[il] =
                backend.upload_factors(rank, n_rows, n_kv_dim, l.a_k.data(), l.b_k.data(), l.a_v.data(), l.b_v.data());
        }
    }
    bindings_.push_back(std::move(b));
}

const backend::Factors * KvCorrection::factors(const backend::Backend & backend, int il) const {
    std::lock_guard<std::mutex> lock(bind_mutex_);
    for (const Binding & b : bindings_) {
        if (b.backend == &backend) {
            return b.layers[static_cast<size_t>(il)].get();
        }
    }
    fail("internal: a correction read by a backend it was not bound to");
}

KvCache::KvCache(backend::Backend & backend, KvLayout layout, size_t budget_bytes, int32_t n_ctx_max)
    : backend_(backend), pool_(backend, layout, budget_bytes), n_ctx_max_(n_ctx_max) {}

std::vector<KvSegment> & KvCache::segments(int32_t seq) {
    auto it = seqs_.find(seq);
    KC_CHECK(it != seqs_.end(), "no sequence with id %d", seq);
    return it->second;
}

const std::vector<KvSegment> & KvCache::segments(int32_t seq) const {
    auto it = seqs_.find(seq);
    KC_CHECK(it != seqs_.end(), "no sequence with id %d", seq);
    return it->second;
}

int32_t KvCache::seq_new() {
    const int32_t id = next_id_++;
    seqs_[id];
    return id;
}

int32_t KvCache::seq_fork(int32_t src) {
    std::vector<KvSegment> copy = segments(src);
    const int32_t          id   = next_id_++;
    seqs_[id]                   = std::move(copy);
    return id;
}

int32_t KvCache::seq_length(int32_t seq) const {
    int32_t n = 0;
    for (const KvSegment & s : segments(seq)) {
        n += s.n;
    }
    return n;
}

void KvCache::seq_truncate(int32_t seq, int32_t n) {
    std::vector<KvSegment> & segs = segments(seq);
    const int32_t            len  = seq_length(seq);
    KC_CHECK(n >= 0 && n <= len, "cannot truncate sequence %d of length %d to %d", seq, len, n);
    int32_t kept = 0;
    size_t  i    = 0;
    for (; i < segs.size() && kept + segs[i].n <= n; ++i) {
        kept += segs[i].n;
    }
    if (i < segs.size() && kept < n) {
        segs[i].n = n - kept;
        ++i;
    }
    segs.resize(i);
    // The own span (the one this sequence writes to; it may back several of its segments): when no one else holds
    // it, drop its rows past the last one kept, giving whole unused blocks back now.
    for (size_t j = segs.size(); j-- > 0;) {
        if (segs[j].span->writer != seq) {
            continue;
        }
        KvSpan * own  = segs[j].span.get();
        long     refs = 0;
        int32_t  end  = 0;
        for (const KvSegment & s : segs) {
            if (s.span.get() == own) {
                ++refs;
                end = std::max(end, s.begin + s.n);
            }
        }
        if (segs[j].span.use_count() == refs) {
            own->resize(end);
        }
        break;
    }
}

void KvCache::seq_remove(int32_t seq) {
    KC_CHECK(seqs_.erase(seq) == 1, "no sequence with id %d", seq);
}

std::vector<KvSlot> KvCache::append(int32_t seq, int32_t n) {
    std::vector<KvSegment> & segs = segments(seq);
    const int32_t            len  = seq_length(seq);
    KC_CHECK(n >= 0 && static_cast<int64_t>(len) + n <= n_ctx_max_,
             "sequence %d would hold %lld tokens, over the context size %d", seq, static_cast<long long>(len) + n,
             n_ctx_max_);
    std::vector<KvSlot> slots;
    if (n == 0) {
        return slots;
    }
    bool in_place = false;
    if (!segs.empty()) {
        KvSegment & last   = segs.back();
        KvSpan &    span   = *last.span;
        const bool  at_end = last.begin + last.n == span.n_rows();
        if (span.writer == seq && at_end) {
            in_place = true;
        } else if (last.span.use_count() == 1 && (span.writer == seq || span.writer == -1) &&
                   last.frame == len - last.n) {
            // Sole reader whose frame matches its positions: drop rows past its view and keep writing there.
            span.resize(last.begin + last.n);
            span.writer = seq;
            in_place    = true;
        }
    }
    if (!in_place) {
        // Rows after a shared piece go on in the sequence's own span when it has one left at its end, in a new
        // segment whose frame is their positions (keys rotated as in a fresh span). A fresh span per run of
        // computed rows would leave most of its blocks empty when few rows sit between reused pieces.
        std::shared_ptr<KvSpan> own;
        for (size_t i = segs.size(); i-- > 0;) {
            const KvSegment & s = segs[i];
            if (s.span->writer == seq && s.corr == nullptr && s.begin + s.n == s.span->n_rows()) {
                own = s.span;
                break;
            }
        }
        if (own == nullptr) {
            own         = std::make_shared<KvSpan>(pool_);
            own->writer = seq;
        }
        const int32_t begin = own->n_rows();
        segs.push_back(KvSegment{ std::move(own), begin, 0, len, nullptr, 0 });  // frame = positions: no shift
    }
    KvSegment &   last = segs.back();
    KvSpan &      span = *last.span;
    const int32_t row0 = span.n_rows();
    try {
        span.resize(row0 + n);
    } catch (...) {
        if (!in_place) {
            segs.pop_back();
        }
        throw;
    }
    last.n += n;
    for (int32_t i = 0; i < n; ++i) {
        slots.push_back(KvSlot{ span.slot(row0 + i), last.frame + (row0 - last.begin) + i });
    }
    return slots;
}

void KvCache::runs(int32_t seq, int layer, backend::RunTable & out) const {
    out.clear();
    int32_t pos0 = 0;
    for (const KvSegment & s : segments(seq)) {
        // Row begin + i sits at position pos0 + i and was rotated at frame + i.
        const int32_t            shift = pos0 - s.frame;
        const backend::Factors * f     = s.corr != nullptr ? s.corr->factors(backend_, layer) : nullptr;
        int32_t                  corr  = -1;
        if (f != nullptr) {
            corr = static_cast<int32_t>(out.corrs.size());
            out.corrs.push_back(f);
        }
        s.span->append_runs(s.begin, s.n, shift, corr, s.corr_row0, out);
        pos0 += s.n;
    }
}

KvSegment KvCache::seq_span(int32_t seq, int32_t pos, int32_t n) const {
    const std::vector<KvSegment> & segs = segments(seq);
    int32_t                        pos0 = 0;
    for (const KvSegment & s : segs) {
        if (pos >= pos0 && pos < pos0 + s.n) {
            KC_CHECK(n > 0 && pos + n <= pos0 + s.n, "positions [%d, %d) of sequence %d do not lie in one stored span",
                     pos, pos + n, seq);
            KC_CHECK(s.corr == nullptr,
                     "positions [%d, %d) of sequence %d are corrected: they have no exact rows "
                     "to share",
                     pos, pos + n, seq);
            return KvSegment{ s.span, s.begin + (pos - pos0), n, s.frame + (pos - pos0), nullptr, 0 };
        }
        pos0 += s.n;
    }
    fail("positions [%d, %d) are outside sequence %d (length %d)", pos, pos + n, seq, pos0);
}

void KvCache::seq_append_span(int32_t seq, KvSegment rows, std::shared_ptr<const KvCorrection> corr,
                              int32_t corr_row0) {
    std::vector<KvSegment> & segs = segments(seq);
    KC_CHECK(rows.span != nullptr, "no span given");
    const int32_t begin = rows.begin, n = rows.n;
    KC_CHECK(begin >= 0 && n > 0 && begin + n <= rows.span->n_rows(), "rows [%d, %d) are outside the span (%d rows)",
             begin, begin + n, rows.span->n_rows());
    const int32_t len = seq_length(seq);
    KC_CHECK(static_cast<int64_t>(len) + n <= n_ctx_max_,
             "sequence %d would hold %lld tokens, over the context size %d", seq, static_cast<long long>(len) + n,
             n_ctx_max_);
    if (corr != nullptr) {
        corr->validate(pool_.layout());
        KC_CHECK(corr_row0 >= 0 && static_cast<int64_t>(corr_row0) + n <= corr->n_rows,
                 "the correction covers %d rows, the span part reads its rows [%d, %lld)", corr->n_rows, corr_row0,
                 static_cast<long long>(corr_row0) + n);
        corr->bind(backend_);
    } else {
        KC_CHECK(corr_row0 == 0, "a correction row offset (%d) without a correction", corr_row0);
    }
    rows.corr      = std::move(corr);
    rows.corr_row0 = corr_row0;
    segs.push_back(std::move(rows));
}

}  // namespace kvcmas
