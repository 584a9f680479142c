// A decoder-only transformer loaded from GGUF (the architectures of engine/arch), its KV cache on a backend, and
// the forward pass built from backend ops.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/arch/arch.h"
#include "engine/kv-cache.h"
#include "engine/lora-adapter.h"
#include "gguf/gguf-file.h"

namespace kvcmas {

// One token (or embedding vector) of a batch.
struct BatchItem {
    int32_t seq;          // sequence it is appended to
    int32_t token;        // token id, or -1 when embd_row is used
    int32_t embd_row;     // row of Batch::embd holding its input vector, or -1
    bool    want_logits;  // return its logits
};

struct Batch {
    std::vector<BatchItem> items;                  // a sequence's items appear in the order they are appended
    const float *          embd        = nullptr;  // [n_embd_rows][n_embd] input vectors (images later)
    int64_t                n_embd_rows = 0;
    // Bidirectional spans: item ranges [first, end) of one sequence at consecutive positions whose items attend to
    // each other, not only to earlier ones (Gemma 3's image tokens). A span is computed in one batch.
    std::vector<std::pair<int64_t, int64_t>> bidirectional;
    // M-RoPE (models with rope_sections): [items][3] added to each item's sequence position to give its temporal,
    // height and width positions (an image's grid; text after an image is shifted by the same amount in all
    // three). Null: zero. The same offsets rotate the item's key, so a shared span read at another position (a
    // uniform shift) stays exact.
    const int32_t * rope_offsets = nullptr;
};

// What a sequence's segment is, for accounting and tests.
struct SegmentInfo {
    int32_t pos;         // position of its first row in the sequence
    int32_t n;           // rows
    int32_t shift;       // RoPE shift its keys are read with
    bool    shared;      // its span is held by another sequence (or a shared handle) too
    size_t  corr_bytes;  // host memory of its correction's factors (0: none, or counted at an earlier segment)
};

class RidgeMaps;

// A loaded model on a backend. Thread-safe: every public method takes the model's lock (one forward pass or
// sequence operation at a time), except the read-only properties of the file.
class Model {
  public:
    // Loads `path` onto `device` ("cpu", "cuda" or "cuda:N"; see backend::make_backend). n_threads: CPU threads
    // (<= 0: all cores, at most 64). n_ctx: most tokens a sequence may hold (<= 0: min(n_ctx_train, 8192)).
    // kv_budget_bytes: memory all KV blocks may take (0: enough for 4 full sequences). kv_type: how K and V rows
    // are stored (F16 halves their memory; attention still computes in f32). Throws kvcmas::Error naming the file
    // and problem, or the device and why it cannot be used. activations: what the decode steps' matmuls over
    // quantized weights multiply with (Q8: 8-bit activations, integer dot products, llama.cpp's speed; F32: exact,
    // the logits transformers computes); backends without an 8-bit path always run F32.
    Model(const std::string & path, int n_threads, int n_ctx, size_t kv_budget_bytes,
          cpu::KvType kv_type = cpu::KvType::F32, const std::string & device = "cpu",
          cpu::Activations activations = cpu::Activations::Q8);
    ~Model();

    const ModelParams &    params() const { return p_; }
    const gguf::GgufFile & file() const { return *file_; }
    int                    n_threads() const { return backend_->n_threads(); }
    std::string            backend_name() const { return backend_->name(); }
    std::string            device_description() const { return backend_->device(); }
    // The rotation of layer il's keys (architectures may rotate layers differently, or not at all).
    const cpu::Rope & rope(int il) const { return ropes_[static_cast<size_t>(p_.layer_rope[static_cast<size_t>(il)])]; }
    cpu::KvType       kv_type() const { return kv_type_; }
    cpu::Activations  activations() const { return backend_->activations(); }

    // Runs the batch: appends every item to its sequence and returns the logits of the items with want_logits,
    // in batch order, as [n_wanted][n_vocab]. A sequence's items fill its reserved rows first (seq_reserve), in
    // position order, and append after that. Validates all ids, sequences and context sizes before changing any
    // state; on failure the sequences keep their previous length and reserved rows.
    std::vector<float> decode(const Batch & batch);

    // The KV that attention uses for positions [pos, pos + n) of seq, materialized: stored rows converted to f32,
    // corrections added, keys rotated at their positions in seq. k_out and v_out are host [n_layer][n][n_head_kv *
    // head_dim]. The reference for tests and for measuring how a reused span deviates from an exact one.
    void read_kv(int32_t seq, int32_t pos, int32_t n, float * k_out, float * v_out);

    // Sequences (see KvCache for the contracts).
    int32_t   seq_new();
    int32_t   seq_fork(int32_t src);
    void      seq_truncate(int32_t seq, int32_t n);
    void      seq_remove(int32_t seq);
    int32_t   seq_length(int32_t seq);
    bool      seq_exists(int32_t seq);
    size_t    n_seqs();
    int32_t   n_ctx() const { return n_ctx_; }
    KvSegment seq_span(int32_t seq, int32_t pos, int32_t n);
    void seq_append_span(int32_t seq, KvSegment rows, std::shared_ptr<const KvCorrection> corr, int32_t corr_row0 = 0);
    std::vector<SegmentInfo> seq_segments(int32_t seq);
    // Reserves n rows at seq's end (positions length..length+n-1) for later decode items of seq to compute: spans
    // may be appended after them, so a prompt whose computed rows lie between reused spans runs in one forward pass
    // (each filled row attends to the positions before it, reserved rows filled earlier in position order
    // included). Until filled the rows hold nothing: seq_fork, and seq_span, read_kv, ridge_correction and
    // materialize_last_segment over them, are refused. Throws past n_ctx or the KV budget (nothing changed).
    void    seq_reserve(int32_t seq, int32_t n);
    int32_t seq_reserved(int32_t seq);  // rows of seq reserved and not yet filled

    // KV memory: bytes of blocks in use, the budget, bytes held (in use or free), and trim (returns bytes freed).
    size_t kv_bytes_in_use() const;
    size_t kv_budget() const;
    size_t kv_bytes_allocated() const;
    size_t kv_trim();
    // KV block geometry, the pool's: bytes of one block (kKvBlockRows rows of K and V, every layer, in kv_type).
    size_t kv_block_bytes() const;

    // Adapters (engine/lora-adapter.h). load_adapter checks `path` against this model and returns the adapter's
    // id (nothing loaded on error). A sequence uses one adapter (or none, -1) with a scale, set by seq_set_adapter
    // and inherited by forks; decode runs each of its items with it. unload_adapter refuses an adapter a sequence
    // still uses.
    int32_t                            load_adapter(const std::string & path);
    void                               unload_adapter(int32_t id);
    std::shared_ptr<const LoraAdapter> adapter(int32_t id);
    void                               seq_set_adapter(int32_t seq, int32_t id, float scale);
    std::pair<int32_t, float>          seq_adapter(int32_t seq);

    // The sharing layer's core ops (engine/ridge-correction.h, engine/kv-materialize.h), under the lock.
    std::shared_ptr<KvCorrection> ridge_correction(const RidgeMaps & maps, int32_t seq, int32_t pos, int32_t n,
                                                   int32_t frame0, const KvCorrection * prev);
    int32_t                       materialize_last_segment(int32_t seq);

  private:
    friend std::shared_ptr<KvCorrection> ridge_correction(Model &, const RidgeMaps &, int32_t, int32_t, int32_t,
                                                          int32_t, const KvCorrection *);
    friend int32_t                       materialize_last_segment(Model &, int32_t);

    // Throws unless positions [pos, pos + n) of seq hold computed rows (none of them reserved and not yet filled).
    void check_filled(int32_t seq, int32_t pos, int32_t n, const char * what) const;

    void load_params();
    void load_rope_scaling();
    void load_sliding_window();
    void make_ropes();  // after n_ctx_ is known (longrope picks its factors by it)
    void load_weights();
    void forward(const Batch & batch, const std::vector<KvSlot> & slots, const std::vector<int32_t> & positions,
                 std::vector<float> & logits);
    // cos/sin [n_rot/2] of an M-RoPE item at sequence position pos with its 3 offsets (Batch::rope_offsets).
    void mrope_angles(const cpu::Rope & rope, int32_t pos, const int32_t * offsets, float * cos_out,
                      float * sin_out) const;
    // For the engine's helpers that run under the lock.
    KvCache &          kv() { return *kv_; }
    backend::Backend & backend() { return *backend_; }

    std::unique_ptr<gguf::GgufFile>   file_;
    ModelParams                       p_;
    const Architecture *              arch_ = nullptr;
    std::vector<cpu::Rope>            ropes_;  // indexed by LayerRope
    cpu::KvType                       kv_type_;
    int32_t                           n_ctx_ = 0;
    std::unique_ptr<backend::Backend> backend_;  // declared before what it holds memory for: destroyed last
    backend::Weight                   tok_embd_;
    backend::Weight                   output_;
    backend::Buffer                   output_norm_;
    std::vector<LayerWeights>         layers_;
    std::unique_ptr<KvCache>          kv_;
    // Per sequence: its reserved rows not yet filled, in position order (where each goes, its position).
    std::map<int32_t, std::deque<std::pair<KvSlot, int32_t>>> reserved_;
    // Loaded adapters by id, and each sequence's adapter and scale (sequences without one are absent).
    std::map<int32_t, std::shared_ptr<const LoraAdapter>> adapters_;
    int32_t                                               next_adapter_ = 0;
    std::map<int32_t, std::pair<int32_t, float>>          seq_adapters_;
    std::mutex                                            mutex_;
};

}  // namespace kvcmas
