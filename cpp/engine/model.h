// A decoder-only transformer loaded from GGUF (architectures llama and qwen2), its KV cache and the forward pass.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cpu/matmul.h"
#include "cpu/ops.h"
#include "cpu/threadpool.h"
#include "engine/kv-cache.h"
#include "gguf/gguf-file.h"

namespace kvcmas {

// Hyperparameters, all read from GGUF metadata ("<arch>.*" keys) and tensor shapes.
struct ModelParams {
    std::string arch;  // "llama" | "qwen2"
    int64_t     n_vocab      = 0;
    int64_t     n_ctx_train  = 0;
    int64_t     n_embd       = 0;
    int64_t     n_layer      = 0;
    int64_t     n_head       = 0;
    int64_t     n_head_kv    = 0;
    int64_t     head_dim     = 0;
    int64_t     n_ff         = 0;
    int64_t     n_rot        = 0;
    float       rms_eps      = 1e-5f;
    double      rope_base    = 10000.0;
    double      rope_scale   = 1.0;    // linear scaling: positions are multiplied by this
    bool        rope_neox    = false;  // qwen2: rotate (i, i + n_rot/2); llama: (2i, 2i + 1)
    bool        has_qkv_bias = false;
    bool        tied_output  = false;
    // Per layer: attend only to the last this many positions (sliding-window attention; 0: all positions).
    // From "<arch>.attention.sliding_window" and, when only some layers slide, "...sliding_window_pattern".
    std::vector<int64_t> layer_window;
};

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
};

class Model {
  public:
    // Loads `path`. n_ctx: most tokens a sequence may hold (<= 0: min(n_ctx_train, 8192)). kv_budget_bytes: memory
    // all KV blocks may take (0: enough for 4 full sequences). kv_type: how K and V rows are stored (F16 halves
    // their memory; attention still computes in f32). Throws kvcmas::Error naming the file and problem.
    Model(const std::string & path, int n_threads, int n_ctx, size_t kv_budget_bytes,
          cpu::KvType kv_type = cpu::KvType::F32);

    const ModelParams &    params() const { return p_; }
    const gguf::GgufFile & file() const { return *file_; }
    int                    n_threads() const { return pool_.size(); }
    KvCache &              kv() { return *kv_; }
    std::mutex &           mutex() { return mutex_; }  // callers hold it around kv() and decode()
    // The compute threads, for core-side jobs outside decode (corrections, copies); run them under mutex().
    cpu::ThreadPool & thread_pool() { return pool_; }

    // Runs the batch: appends every item to its sequence and returns the logits of the items with want_logits,
    // in batch order, as [n_wanted][n_vocab]. Validates all ids, sequences and context sizes before changing any
    // state; on failure the sequences keep their previous length.
    std::vector<float> decode(const Batch & batch);

    // The KV that attention uses for positions [pos, pos + n) of seq, materialized: stored rows converted to f32,
    // corrections added, keys rotated at their positions in seq. k_out and v_out are [n_layer][n][n_head_kv *
    // head_dim]. The reference for tests and for measuring how a reused span deviates from an exact one.
    void read_kv(int32_t seq, int32_t pos, int32_t n, float * k_out, float * v_out);

    const cpu::Rope & rope() const { return rope_; }
    cpu::KvType       kv_type() const { return kv_->pool().layout().kv_type; }

  private:
    struct Layer {
        std::vector<float> attn_norm, ffn_norm;   // [n_embd]
        cpu::WeightView    wq, wk, wv, wo;        // [n_embd, n_head*hd] [n_embd, n_kv*hd] x2, [n_head*hd, n_embd]
        std::vector<float> bq, bk, bv;            // qwen2 biases [n_head*hd] [n_kv*hd] [n_kv*hd]
        cpu::WeightView    w_gate, w_up, w_down;  // [n_embd, n_ff] x2, [n_ff, n_embd]
    };

    void               load_params();
    void               load_sliding_window();
    void               load_weights();
    cpu::WeightView    weight(const std::string & name, int64_t n_in, int64_t n_out) const;
    std::vector<float> vector_f32(const std::string & name, int64_t n, bool required) const;
    void forward(const Batch & batch, const std::vector<KvSlot> & slots, const std::vector<int32_t> & positions,
                 std::vector<float> & logits);

    std::unique_ptr<gguf::GgufFile> file_;
    ModelParams                     p_;
    cpu::Rope                       rope_;
    cpu::WeightView                 tok_embd_;
    cpu::WeightView                 output_;
    std::vector<float>              output_norm_;
    std::vector<Layer>              layers_;
    cpu::ThreadPool                 pool_;
    std::unique_ptr<KvCache>        kv_;
    std::mutex                      mutex_;
};

}  // namespace kvcmas
