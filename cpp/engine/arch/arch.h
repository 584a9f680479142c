// Architectures: each one is a file (llama.cpp, qwen2.cpp) that says what its layer reads from the GGUF file and
// how its layer is built from backend ops; registry.cpp lists them by name. Adding an architecture is one file
// plus a registry line (and shared building blocks in decoder.h when it reuses them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/tensor-loader.h"

namespace kvcmas {

struct ModelParams;
class KvCache;

// One layer's weights in backend memory. Architectures use the fields they need; the rest stay empty.
struct LayerWeights {
    backend::Buffer attn_norm, ffn_norm;   // [n_embd]
    backend::Weight wq, wk, wv, wo;        // [n_embd, n_head*hd] [n_embd, n_kv*hd] x2, [n_head*hd, n_embd]
    backend::Buffer bq, bk, bv;            // attention biases [n_head*hd] [n_kv*hd] [n_kv*hd]
    backend::Weight w_gate, w_up, w_down;  // [n_embd, n_ff] x2, [n_ff, n_embd]
};

// The state of one forward pass: the batch's activations in backend memory and what attention reads.
struct ForwardState {
    ForwardState(backend::Backend & be_, const ModelParams & p_, const backend::Rope & rope_, KvCache & kv_,
                 const backend::KvStore & store_, int64_t n_)
        : be(be_), p(p_), rope(rope_), kv(kv_), store(store_), shape{}, n(n_) {}

    backend::Backend &      be;
    const ModelParams &     p;
    const backend::Rope &   rope;
    KvCache &               kv;
    backend::KvStore        store;
    backend::AttentionShape shape;
    int64_t                 n = 0;  // tokens of the batch
    // [n][n_embd] x2, [n][n_head*hd], [n][kd] x2, [n][n_head*hd], [n][n_embd], [n][n_ff] x2
    backend::Buffer                  x, xn, q, k, v, att, tmp, g, u;
    backend::Buffer                  cos_q, sin_q, cos_k, sin_k;  // [n][n_rot/2]: RoPE of queries, of keys
    std::vector<backend::KvSlotRef>  slots;                       // [n] where each token's K/V row goes
    std::vector<int32_t>             seq_ids;                     // distinct sequences, by first appearance
    std::vector<backend::QueryBlock> blocks;                      // consecutive tokens of one sequence
    std::vector<backend::RunTable>   tables;                      // [seq_ids.size()] runs of the current layer
    int64_t                          max_visible = 0;             // most KV rows a query sees
};

struct Architecture {
    const char * name;
    // Sets what the architecture fixes beyond the GGUF keys (RoPE pairing, biases); called after the common keys.
    void (*configure)(ModelParams & p);
    // Reads layer il's weights (names under blk.<il>.) into L, in backend memory.
    void (*load_layer)(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L);
    // Runs layer il on st.x in place.
    void (*forward_layer)(ForwardState & st, int il, const LayerWeights & L);
};

// The architecture registered as `name` ("llama", "qwen2"), or null.
const Architecture * find_architecture(const std::string & name);
// The registered names, comma-separated, for messages.
std::string architecture_names();

}  // namespace kvcmas
