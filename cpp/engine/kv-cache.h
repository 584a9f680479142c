// KV cache: fixed-size blocks from one pool, spans of rows stored once, and sequences that read spans through a
// table of segments. Attention never sees a contiguous per-sequence buffer: it reads the run table a sequence's
// segments give (block ids and rows, see backend/backend.h), which is what lets a span be shared by many
// sequences at different positions. Block memory belongs to the backend (host pages, or device memory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "backend/backend.h"

namespace kvcmas {

constexpr int32_t kKvBlockRows = 32;  // rows (tokens) per block

struct KvLayout {
    int         n_layer  = 0;
    int         n_kv_dim = 0;                 // n_head_kv * head_dim: elements in one K (or V) row
    cpu::KvType kv_type  = cpu::KvType::F32;  // element type of the stored rows
};

// Blocks of KV memory: block b holds, for every layer il, K rows then V rows:
// [n_layer][2][kKvBlockRows][n_kv_dim] elements of layout.kv_type. Allocation fails with kvcmas::Error once the
// byte budget is used up.
// allocate/release are thread-safe: spans handed to Python may be freed by any thread, outside the model's lock.
// release never touches blocks_, and allocate (which may grow it), trim and store() all run under the model's
// lock, so reading block addresses on the hot path takes no lock of its own.
// Freed blocks keep their memory for reuse until trim() hands it back (the CPU backend maps each block as pages of
// its own, not heap chunks, so giving them back really lowers the process's resident memory).
class KvBlockPool {
  public:
    KvBlockPool(backend::Backend & backend, KvLayout layout, size_t budget_bytes);
    ~KvBlockPool();
    KvBlockPool(const KvBlockPool &)             = delete;
    KvBlockPool & operator=(const KvBlockPool &) = delete;
    int32_t       allocate();
    void          release(int32_t block);
    // The blocks as backend ops address them.
    backend::KvStore store() const;
    size_t           block_bytes() const { return block_bytes_; }
    size_t           bytes_in_use() const;
    // Bytes of block memory held, in use or free (what the pool adds to the process's memory).
    size_t bytes_allocated() const;
    // Returns the memory of every free block to the system; returns the bytes released.
    size_t trim();
    size_t budget_bytes() const { return budget_bytes_; }
    size_t elem_bytes() const { return elem_bytes_; }
    // Byte offsets inside a block: between layers, and from a K row to its V row.
    int64_t layer_stride() const { return 2LL * kKvBlockRows * layout_.n_kv_dim * static_cast<int64_t>(elem_bytes_); }
    int64_t v_offset() const { return static_cast<int64_t>(kKvBlockRows) * layout_.n_kv_dim * elem_bytes_; }
    int64_t row_bytes() const { return static_cast<int64_t>(layout_.n_kv_dim) * elem_bytes_; }
    const KvLayout & layout() const { return layout_; }

  private:
    KvLayout           layout_;
    size_t             elem_bytes_;
    size_t             block_bytes_;
    size_t             budget_bytes_;
    mutable std::mutex mutex_;  // guards n_used_, free_ and the growth of blocks_
    size_t             n_used_ = 0;
    backend::Backend & backend_;

    // index = block id; a free block's memory is kept for reuse until trim() (then null, allocated again on reuse)
    std::vector<uint8_t *> blocks_;
    std::vector<int32_t>   free_;
    size_t                 n_mapped_ = 0;
};

struct KvCorrection;

// Rows of KV stored once. The position a row's key is rotated at (its frame position) is kept by the segments that
// read it (KvSegment::frame): one span can hold runs written at unrelated positions. Destroyed (blocks returned to
// the pool) when the last segment referring to it goes.
class KvSpan {
  public:
    explicit KvSpan(KvBlockPool & pool) : pool_(pool) {}
    ~KvSpan();
    KvSpan(const KvSpan &)             = delete;
    KvSpan & operator=(const KvSpan &) = delete;

    int32_t n_rows() const { return n_rows_; }
    // Grows the span to n rows (allocating blocks) or shrinks it (releasing whole unused blocks).
    void resize(int32_t n);
    // Where row `row` is stored (every layer has the row at the same place of its block).
    backend::KvSlotRef slot(int32_t row) const {
        return backend::KvSlotRef{ blocks_[static_cast<size_t>(row / kKvBlockRows)], row % kKvBlockRows };
    }
    // Appends the runs covering rows [begin, begin + n) to out, with the given shift; corr (index into out.corrs,
    // or -1) corrects these rows, its factor row corr_row0 belonging to row `begin`.
    void append_runs(int32_t begin, int32_t n, int32_t shift, int32_t corr, int32_t corr_row0,
                     backend::RunTable & out) const;

    int32_t writer = -1;  // the sequence that may append to this span in place; -1: nobody (frozen)

  private:
    KvBlockPool &        pool_;
    int32_t              n_rows_ = 0;
    std::vector<int32_t> blocks_;
};

// A low-rank correction of the keys and values of n_rows consecutive rows (KVCMAS): in layer il the rows read as
// K + A_k·B_k and V + A_v·B_v, with A [n_rows][rank] and B [rank][n_kv_dim] row-major, expressed in the frame the
// keys are stored in (the span's frame). Layers with empty factors are not corrected. Immutable once built, so
// any number of sequences can share it. The factors live on the host; bind() gives a backend its copy (the CPU
// backend reads the host arrays in place), made once when the first sequence of that backend reads it.
struct KvCorrection {
    struct Layer {
        std::vector<float> a_k, b_k, a_v, b_v;
    };
    int32_t            n_rows   = 0;
    int32_t            rank     = 0;
    int32_t            n_kv_dim = 0;
    std::vector<Layer> layers;          // [n_layer]
    mutable bool       sealed = false;  // set once a sequence reads it: from then on it must not change

    size_t bytes() const;  // memory held by the factors (host)
    // Checks shapes against a KV layout; throws kvcmas::Error naming the first problem.
    void validate(const KvLayout & layout) const;
    // Seals the correction and makes sure `backend` holds its factors. Callers hold that backend's model lock.
    void bind(backend::Backend & backend) const;
    // Layer il's factors on `backend` (bound before), or null for an uncorrected layer.
    const backend::Factors * factors(const backend::Backend & backend, int il) const;

  private:
    struct Binding {
        const backend::Backend *                             backend;
        std::vector<std::shared_ptr<const backend::Factors>> layers;
    };
    mutable std::mutex           bind_mutex_;  // models of one backend on different threads may bind it at once
    mutable std::vector<Binding> bindings_;
};

// Rows [begin, begin + n) of a span, read by a sequence at positions [pos0, pos0 + n), where pos0 is the number of
// rows of the segments before it; row begin + i holds a key rotated at frame position frame + i. corr, when set,
// corrects these rows: its row corr_row0 + i is the segment's row i (several segments may read one correction at
// different offsets, e.g. the reused pieces between recomputed rows).
struct KvSegment {
    std::shared_ptr<KvSpan>             span;
    int32_t                             begin = 0;
    int32_t                             n     = 0;
    int32_t                             frame = 0;
    std::shared_ptr<const KvCorrection> corr;
    int32_t                             corr_row0 = 0;
};

// Where one new row of a sequence goes.
struct KvSlot {
    backend::KvSlotRef ref;
    int32_t            frame_pos;  // the position its key is rotated at
};

// Sequences (ids >= 0) over a block pool. Positions of a sequence are 0..length-1, in segment order.
class KvCache {
  public:
    KvCache(backend::Backend & backend, KvLayout layout, size_t budget_bytes, int32_t n_ctx_max);

    int32_t seq_new();
    // A new sequence reading the same rows as src (no copy); both can grow independently afterwards.
    int32_t seq_fork(int32_t src);
    // Keeps the first n rows of seq (n <= length).
    void    seq_truncate(int32_t seq, int32_t n);
    void    seq_remove(int32_t seq);
    bool    seq_exists(int32_t seq) const { return seqs_.count(seq) != 0; }
    int32_t seq_length(int32_t seq) const;
    size_t  n_seqs() const { return seqs_.size(); }
    int32_t n_ctx_max() const { return n_ctx_max_; }

    // Extends seq by n rows and returns where each goes (positions length..length+n-1). Rows are written in place
    // at the end of a span the sequence alone may append to (after shared pieces too: the sequence's own span goes
    // on in a new segment, keys rotated at their positions); otherwise a new span starts (a fork never writes into
    // rows another sequence reads). Throws kvcmas::Error past n_ctx_max or the memory budget.
    std::vector<KvSlot> append(int32_t seq, int32_t n);

    // The runs of layer il that seq reads, in position order, with the corrections they name.
    void runs(int32_t seq, int layer, backend::RunTable & out) const;

    // Sharing spans between sequences (cross-agent KV reuse).
    // The span rows behind positions [pos, pos + n) of seq, which must lie in one segment and be uncorrected (the
    // returned segment's corr is null). The sequence keeps appending after them without touching them.
    KvSegment seq_span(int32_t seq, int32_t pos, int32_t n) const;
    // Appends rows (a segment of another sequence, from seq_span; no copy) to seq, optionally corrected by rows
    // [corr_row0, corr_row0 + rows.n) of corr. Throws past n_ctx_max or outside the span's or correction's rows.
    void seq_append_span(int32_t seq, KvSegment rows, std::shared_ptr<const KvCorrection> corr, int32_t corr_row0 = 0);
    // The segments of seq (for accounting and tests).
    const std::vector<KvSegment> & seq_segments(int32_t seq) const { return segments(seq); }

    const KvBlockPool & pool() const { return pool_; }
    // Hands the memory of free blocks back to the system (KvBlockPool::trim); the caller holds the model's lock.
    size_t pool_trim() { return pool_.trim(); }

  private:
    std::vector<KvSegment> &       segments(int32_t seq);
    const std::vector<KvSegment> & segments(int32_t seq) const;

    backend::Backend &                        backend_;
    KvBlockPool                               pool_;
    int32_t                                   n_ctx_max_;
    int32_t                                   next_id_ = 0;
    std::map<int32_t, std::vector<KvSegment>> seqs_;
};

}  // namespace kvcmas
