// Building blocks of a decoder layer shared by the architectures (as llama.cpp's build_attn / build_ffn): loaders
// for the weights, and the steps of the attention and feed-forward blocks, each a short sequence of backend ops on
// a ForwardState. An architecture file strings the steps together; a step whose optional weights are empty in
// LayerWeights does nothing.
#pragma once

#include <string>

#include "engine/arch/arch.h"

namespace kvcmas::decoder {

// ---- configuring: the RoPE pairing of architectures that need nothing else

void configure_neox_rope(ModelParams & p, const gguf::GgufFile & f);    // (i, i + n_rot/2), HF's rotate-half
void configure_paired_rope(ModelParams & p, const gguf::GgufFile & f);  // (2i, 2i + 1), llama.cpp's llama
// n_expert, n_expert_used, n_ff_exp from the file's expert_* keys (required), checked.
void configure_experts(ModelParams & p, const gguf::GgufFile & f);

// ---- loading

// "blk.<il>." + suffix.
std::string     block_name(int il, const char * suffix);
backend::Weight upload(backend::Backend & be, const cpu::WeightView & w);
// A norm's weight of n floats (empty when absent and not required).
backend::Buffer load_norm(const TensorLoader & loader, backend::Backend & be, const std::string & name, int64_t n,
                          bool required);

enum class QkNorm {
    None,
    PerHead,  // [head_dim], the same for every head (qwen3, gemma3)
    Whole,    // [n_head*hd] / [n_kv*hd] over the whole projection (olmo2)
};

struct AttentionLayout {
    bool   pre_norm  = true;   // attn_norm.weight
    bool   post_norm = false;  // post_attention_norm.weight
    bool   qkv_bias  = false;  // attn_{q,k,v}.bias, required
    bool   fused_qkv = false;  // one attn_qkv.weight [n_embd, qd + 2 kd] (Q rows, then K, then V)
    QkNorm qk_norm   = QkNorm::None;
};

struct FfnLayout {
    bool pre_norm      = true;   // ffn_norm.weight
    bool post_norm     = false;  // post_ffw_norm.weight
    bool fused_gate_up = false;  // one ffn_up.weight [n_embd, 2 n_ff] (gate rows, then up)
};

void load_attention(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il, LayerWeights & L,
                    const AttentionLayout & layout);
void load_ffn(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il, LayerWeights & L,
              const FfnLayout & layout);

// ---- attention steps, in order

// The attention's input: rms_norm(x) into st.xn when L has attn_norm, else x itself.
const float * attention_input(ForwardState & st, const LayerWeights & L);
// q, k, v = input · W (+ biases when L has them).
void qkv_projections(ForwardState & st, const LayerWeights & L, const float * in);
// RMSNorm of q and k (per head or whole, by the width of L.q_norm) when L has them.
void qk_norm(ForwardState & st, const LayerWeights & L);
// q and k rotated with layer il's RoPE; k and v stored in layer il's KV rows.
void rope_and_store(ForwardState & st, int il);
// st.att = attention of q over each sequence's run table in layer il (shifts, corrections and window fused), with
// L's attention sinks when it has them.
void attend(ForwardState & st, int il, const LayerWeights & L);
// x += post_norm(att · Wo + bo) (the bias when L has bo, the norm when L has attn_post_norm).
void attention_output(ForwardState & st, const LayerWeights & L);

// All of the above in order.
void attention_block(ForwardState & st, int il, const LayerWeights & L);

// ---- feed-forward

enum class Gate {
    Silu,       // SwiGLU
    GeluTanh,   // GeGLU with the tanh approximation of GELU (gemma)
    SwigluOai,  // gpt-oss's clamped SwiGLU: alpha kOaiAlpha, limit kOaiLimit, (up + 1) (Backend::swiglu_oai)
};
inline constexpr float kOaiAlpha = 1.702f;
inline constexpr float kOaiLimit = 7.0f;

// x += post_norm(w_down · (act(w_gate · h) * (w_up · h))), h = rms_norm(x) when L has ffn_norm, else x.
void ffn_block(ForwardState & st, const LayerWeights & L, Gate gate);

// Routed experts (qwen3moe): the router's top-k experts of each token (softmax, normalized when norm), each chosen
// expert's SwiGLU over the tokens routed to it (only those experts' weights are read), summed with the routing
// weights: x += Σ_j w_j · down_e(silu(gate_e · h) * (up_e · h)), h = rms_norm(x). With biases (gpt-oss) the router
// and every expert projection add theirs; gate picks the activation (Silu or SwigluOai).
struct MoeLayout {
    bool norm_post_attention = false;  // the pre-norm is named post_attention_norm.weight (gpt-oss), not ffn_norm
    bool biases              = false;  // ffn_gate_inp.bias and ffn_{gate,up,down}_exps.bias, required
};
void load_experts(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il, LayerWeights & L,
                  const MoeLayout & layout = MoeLayout{});
void moe_ffn_block(ForwardState & st, const LayerWeights & L, bool norm, Gate gate = Gate::Silu);

// Norms, Q/K/V/O projections and the SwiGLU feed-forward of a llama-style layer; with_qkv_bias: Q/K/V biases are
// required.
void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il, LayerWeights & L,
                bool with_qkv_bias);

}  // namespace kvcmas::decoder
