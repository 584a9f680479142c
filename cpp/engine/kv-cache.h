// KV cache: fixed-size blocks from one pool, spans of rows stored once, and sequences that read spans through a
// table of segments. Attention never sees a contiguous per-sequence buffer: it reads the runs a sequence's
// segments point at (see cpu/attention.h), which is what lets a span be shared by many sequences at different
// positions (forks now, cross-agent shared context next).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cpu/attention.h"

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
// release never touches blocks_, and allocate (which may grow it), trim and data() all run under the model's lock,
// so data() on the hot path takes no lock of its own.
// Freed blocks keep their memory for reuse until trim() hands it back to the operating system (blocks are mapped
// pages of their own, not heap chunks, so giving them back really lowers the process's resident memory).
class KvBlockPool {
  public:
    KvBlockPool(KvLayout layout, size_t budget_bytes);
    int32_t   allocate();
    void      release(int32_t block);
    uint8_t * data(int32_t block) { return blocks_[static_cast<size_t>(block)].get(); }
    size_t    block_bytes() const { return block_bytes_; }
    size_t    bytes_in_use() const;
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
    struct BlockMemoryDeleter {
        size_t bytes;
        void   operator()(uint8_t * p) const;
    };
    using BlockMemory = std::unique_ptr<uint8_t[], BlockMemoryDeleter>;
    BlockMemory map_block() const;

    // index = block id; a free block's memory is kept for reuse until trim() (then null, mapped again on reuse)
    std::vector<BlockMemory> blocks_;
    std::vector<int32_t>     free_;
    size_t                   n_mapped_ = 0;
};

struct KvCorrection;

// Rows of KV stored once. Row i holds keys rotated at frame position frame0 + i. Destroyed (blocks returned to
// the pool) when the last segment referring to it goes.
class KvSpan {
  public:
    KvSpan(KvBlockPool & pool, int32_t frame0) : pool_(pool), frame0_(frame0) {}
    ~KvSpan();
    KvSpan(const KvSpan &)             = delete;
    KvSpan & operator=(const KvSpan &) = delete;

    int32_t n_rows() const { return n_rows_; }
    int32_t frame0() const { return frame0_; }
    // Grows the span to n rows (allocating blocks) or shrinks it (releasing whole unused blocks).
    void resize(int32_t n);
    // Where row `row` of layer il is stored: n_kv_dim elements of the pool's kv_type.
    void * k_row(int layer, int32_t row);
    void * v_row(int layer, int32_t row);
    // Appends the runs covering rows [begin, begin + n) of layer il to out, with the given shift; corr (may be
    // null) corrects these rows, its row 0 being row `begin`.
    void append_runs(int layer, int32_t begin, int32_t n, int32_t shift, const KvCorrection * corr,
                     std::vector<cpu::KvRun> & out) const;

    int32_t writer = -1;  // the sequence that may append to this span in place; -1: nobody (frozen)

  private:
    KvBlockPool &        pool_;
    int32_t              frame0_;
    int32_t              n_rows_ = 0;
    std::vector<int32_t> blocks_;
};

// A low-rank correction of the keys and values of n_rows consecutive rows (KVCMAS): in layer il the rows read as
// K + A_k·B_k and V + A_v·B_v, with A [n_rows][rank] and B [rank][n_kv_dim] row-major, expressed in the frame the
// keys are stored in (the span's frame). Layers with empty factors are not corrected. Immutable once built, so
// any number of sequences can share it.
struct KvCorrection {
    struct Layer {
        std::vector<float> a_k, b_k, a_v, b_v;
    };
    int32_t            n_rows   = 0;
    int32_t            rank     = 0;
    int32_t            n_kv_dim = 0;
    std::vector<Layer> layers;          // [n_layer]
    mutable bool       sealed = false;  // set once a sequence reads it: from then on it must not change

    size_t bytes() const;  // memory held by the factors
    // Checks shapes against a KV layout; throws kvcmas::Error naming the first problem.
    void validate(const KvLayout & layout) const;
};

// Rows [begin, begin + n) of a span, read by a sequence at positions [pos0, pos0 + n), where pos0 is the number of
// rows of the segments before it. corr, when set, corrects these rows (its row i is the segment's row i).
struct KvSegment {
    std::shared_ptr<KvSpan>             span;
    int32_t                             begin = 0;
    int32_t                             n     = 0;
    std::shared_ptr<const KvCorrection> corr;
};

// Where one new row of a sequence goes.
struct KvSlot {
    KvSpan * span;
    int32_t  row;
    int32_t  frame_pos;  // the position its key is rotated at
};

// Sequences (ids >= 0) over a block pool. Positions of a sequence are 0..length-1, in segment order.
class KvCache {
  public:
    KvCache(KvLayout layout, size_t budget_bytes, int32_t n_ctx_max);

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
    // at the end of a span the sequence alone may append to; otherwise a new span starts (a fork never writes
    // into rows another sequence reads). Throws kvcmas::Error past n_ctx_max or the memory budget.
    std::vector<KvSlot> append(int32_t seq, int32_t n);

    // The runs of layer il that seq reads, in position order.
    void runs(int32_t seq, int layer, std::vector<cpu::KvRun> & out) const;

    // Sharing spans between sequences (cross-agent KV reuse).
    // The span rows behind positions [pos, pos + n) of seq, which must lie in one segment; `begin` receives the
    // first row. The sequence keeps appending after them without touching them.
    std::shared_ptr<KvSpan> seq_span(int32_t seq, int32_t pos, int32_t n, int32_t & begin) const;
    // Appends rows [begin, begin + n) of span to seq (no copy), optionally corrected. Throws past n_ctx_max.
    void seq_append_span(int32_t seq, std::shared_ptr<KvSpan> span, int32_t begin, int32_t n,
                         std::shared_ptr<const KvCorrection> corr);
    // The segments of seq (for accounting and tests).
    const std::vector<KvSegment> & seq_segments(int32_t seq) const { return segments(seq); }

    const KvBlockPool & pool() const { return pool_; }
    // Hands the memory of free blocks back to the system (KvBlockPool::trim); the caller holds the model's lock.
    size_t pool_trim() { return pool_.trim(); }

  private:
    std::vector<KvSegment> &       segments(int32_t seq);
    const std::vector<KvSegment> & segments(int32_t seq) const;

    KvBlockPool                               pool_;
    int32_t                                   n_ctx_max_;
    int32_t                                   next_id_ = 0;
    std::map<int32_t, std::vector<KvSegment>> seqs_;
};

}  // namespace kvcmas
