// Architectures: each one is a file (llama.cpp, qwen2.cpp, qwen3.cpp, gemma3.cpp, ...) that says what it reads
// from the GGUF file beyond the common keys, which weights its layer has, and how its layer is strung together
// from the steps of decoder.h; registry.cpp lists them by name. Adding an architecture is one file plus a registry
// line; its general.architecture name lives in engine/gguf-names.h (the converter's constants.py and the tests
// check that both lists and the registry agree).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/tensor-loader.h"
#include "gguf/gguf-file.h"

namespace kvcmas {

class KvCache;
class LoraAdapter;

// How one layer rotates its queries and keys.
enum class LayerRope : uint8_t {
    Global,   // rope.freq_base with the file's scaling
    Sliding,  // rope.freq_base_swa, unscaled (gemma3's sliding layers)
    None,     // no rotation (smollm3's every 4th layer): keys do not depend on their position
};

// Hyperparameters, read from GGUF metadata ("<arch>.*" keys) and tensor shapes; an architecture's configure()
// sets what its files leave implicit.
struct ModelParams {
    std::string arch;  // a registered architecture (engine/arch/registry.cpp)
    int64_t     n_vocab     = 0;
    int64_t     n_ctx_train = 0;
    int64_t     n_embd      = 0;
    int64_t     n_layer     = 0;
    int64_t     n_head      = 0;
    int64_t     n_head_kv   = 0;
    int64_t     head_dim    = 0;
    int64_t     n_ff        = 0;
    int64_t     n_rot       = 0;
    float       rms_eps     = 1e-5f;
    bool        tied_output = false;

    // RoPE. Scaling: "none", "linear" (positions times rope_scale), "llama3" (rope_freqs tensor), "yarn",
    // "longrope" (rope_factors_long / _short tensors).
    double      rope_base      = 10000.0;
    double      rope_base_swa  = 10000.0;  // LayerRope::Sliding layers
    double      rope_scale     = 1.0;      // linear scaling: positions are multiplied by this
    std::string rope_scaling   = "none";
    double      rope_factor    = 1.0;  // yarn / longrope: context extension factor
    int64_t     rope_orig_ctx  = 0;    // yarn / longrope: context the model was trained at before extension
    double      yarn_beta_fast = 32.0;
    double      yarn_beta_slow = 1.0;
    // The rotated dims of queries and keys are scaled by this (yarn / longrope "attention factor"), through the
    // cos/sin tables of the global layers; stored keys carry it, and shifting them (a pure rotation) stays exact.
    double rope_attn_factor = 1.0;
    // yarn: the ramp's ends rounded out to whole dims (llama.cpp, transformers' default); gpt-oss does not round.
    bool                   yarn_truncate = true;
    bool                   rope_neox = false;  // set by the architecture: rotate (i, i + n_rot/2), else (2i, 2i + 1)
    std::vector<LayerRope> layer_rope;         // [n_layer]

    // M-RoPE (qwen2vl): rotated pairs per position component (temporal, height, width; the 4th is unused), in
    // frequency order; pair j of a query or key rotates by the component its section names. Empty: one position.
    // A text token's three components are equal, so its rotation is plain RoPE at that position.
    std::vector<int64_t> rope_sections;

    // Per layer: attend only to the last this many positions (sliding-window attention; 0: all positions).
    // From "<arch>.attention.sliding_window" and, when only some layers slide, "...sliding_window_pattern".
    std::vector<int64_t> layer_window;

    // Attention scores are q·k times attn_scale (0: 1/sqrt(head_dim)).
    double attn_scale = 0.0;
    // Embedding hook: token embeddings are multiplied by this (gemma: sqrt(n_embd)).
    float embd_scale = 1.0f;
    // Output hook: logits = c·tanh(logits / c) when c > 0 ("<arch>.final_logit_softcapping").
    float logit_softcap = 0.0f;

    // Mixture of experts (0: a dense feed-forward).
    int64_t n_expert      = 0;
    int64_t n_expert_used = 0;
    int64_t n_ff_exp      = 0;  // rows of one expert's gate/up
};

// One layer's weights in backend memory. The common ones first; the optional ones stay empty where the
// architecture has none, and decoder.h's steps skip what is empty.
struct LayerWeights {
    backend::Buffer attn_norm, ffn_norm;   // [n_embd] pre-norms (olmo2 has neither)
    backend::Weight wq, wk, wv, wo;        // [n_embd, n_head*hd] [n_embd, n_kv*hd] x2, [n_head*hd, n_embd]
    backend::Buffer bq, bk, bv;            // attention biases [n_head*hd] [n_kv*hd] [n_kv*hd]
    backend::Weight w_gate, w_up, w_down;  // [n_embd, n_ff] x2, [n_ff, n_embd]

    // Q/K RMSNorm before RoPE: [head_dim] per head (qwen3, gemma3) or [n_head*hd] / [n_kv*hd] over the whole
    // projection (olmo2).
    backend::Buffer q_norm, k_norm;
    // RMSNorm of the attention / feed-forward output before it joins the residual (gemma3, olmo2) [n_embd].
    backend::Buffer attn_post_norm, ffn_post_norm;

    // Mixture of experts: router [n_embd, n_expert]; experts' gate/up [n_embd, n_ff_exp] and down [n_ff_exp,
    // n_embd], one Weight per expert (views of the file's 3-D tensors).
    backend::Weight              router;
    std::vector<backend::Weight> exp_gate, exp_up, exp_down;

    // gpt-oss: the output projection's bias [n_embd]; per query head an attention sink logit [n_head]; the router's
    // bias [n_expert]; the experts' biases, gate/up [n_expert][n_ff_exp] and down [n_expert][n_embd].
    backend::Buffer bo, attn_sinks, router_bias, exp_gate_bias, exp_up_bias, exp_down_bias;
};

// The state of one forward pass: the batch's activations in backend memory and what attention reads.
struct ForwardState {
    ForwardState(backend::Backend & be_, const ModelParams & p_, const std::vector<backend::Rope> & ropes_,
                 KvCache & kv_, const backend::KvStore & store_, int64_t n_)
        : be(be_), p(p_), ropes(ropes_), kv(kv_), store(store_), shape{}, n(n_) {}

    // The rotation of layer il, and its cos/sin tables for this batch's queries and keys.
    const backend::Rope & rope(int il) const { return ropes[rope_index(il)]; }
    size_t rope_index(int il) const { return static_cast<size_t>(p.layer_rope[static_cast<size_t>(il)]); }

    struct RopeTables {
        backend::Buffer cos_q, sin_q, cos_k, sin_k;  // [n][n_rot/2]: RoPE of queries, of keys
    };

    backend::Backend &                 be;
    const ModelParams &                p;
    const std::vector<backend::Rope> & ropes;  // indexed by LayerRope
    KvCache &                          kv;
    backend::KvStore                   store;
    backend::AttentionShape            shape;
    int64_t                            n = 0;  // tokens of the batch
    // [n][n_embd] x2, [n][n_head*hd], [n][kd] x2, [n][n_head*hd], [n][n_embd], [n][n_ff] x2
    backend::Buffer                  x, xn, q, k, v, att, tmp, g, u;
    std::vector<RopeTables>          rope_tables;      // indexed by LayerRope; empty where no layer uses it
    std::vector<backend::KvSlotRef>  slots;            // [n] where each token's K/V row goes
    std::vector<int32_t>             seq_ids;          // distinct sequences, by first appearance
    std::vector<backend::QueryBlock> blocks;           // consecutive tokens of one sequence
    std::vector<backend::RunTable>   tables;           // [seq_ids.size()] runs of the current layer
    int64_t                          max_visible = 0;  // most KV rows a query sees
    std::vector<int32_t>             positions;        // [n] host: each token's position
    // Adapters: the batch's rows per adapter in use (their sequences' scales), and the layer being run.
    struct LoraRows {
        const LoraAdapter *  adapter = nullptr;
        std::vector<int32_t> rows;
        std::vector<float>   scales;
    };
    std::vector<LoraRows> lora;
    int                   layer = 0;
};

struct Architecture {
    const char * name;
    // Sets what the architecture fixes beyond the common GGUF keys (RoPE pairing, per-layer RoPE and windows,
    // hooks), reading its own keys from f; called after the common keys.
    void (*configure)(ModelParams & p, const gguf::GgufFile & f);
    // Reads layer il's weights (names under blk.<il>.) into L, in backend memory.
    void (*load_layer)(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L);
    // Runs layer il on st.x in place.
    void (*forward_layer)(ForwardState & st, int il, const LayerWeights & L);
};

// The architecture registered as `name` ("llama", "qwen2", ...), or null.
const Architecture * find_architecture(const std::string & name);
// The registered names, in registry order; and comma-separated, for messages.
std::vector<std::string> registered_architectures();
std::string              architecture_names();

}  // namespace kvcmas
