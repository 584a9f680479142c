// qwen3moe (Qwen3 MoE, e.g. Qwen3-30B-A3B): the qwen3 attention and, in every layer, top-k routed SwiGLU experts
// (ffn_gate_inp router, ffn_{gate,up,down}_exps) with softmax routing weights renormalized over the chosen experts
// (as llama.cpp runs it), no shared expert.
#include "engine/arch/decoder.h"
#include "engine/gguf-names.h"

namespace kvcmas {

static void configure(ModelParams & p, const gguf::GgufFile & f) {
    p.rope_neox = true;
    decoder::configure_experts(p, f);
}

static void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L) {
    decoder::AttentionLayout attn;
    attn.qk_norm = decoder::QkNorm::PerHead;
    decoder::load_attention(loader, be, p, il, L, attn);
    decoder::load_experts(loader, be, p, il, L);
}

static void forward_layer(ForwardState & st, int il, const LayerWeights & L) {
    decoder::attention_block(st, il, L);
    decoder::moe_ffn_block(st, L, true);
}

extern const Architecture kArchQwen3Moe = { gguf_names::kArchQwen3Moe, configure, load_layer, forward_layer };

}  // namespace kvcmas
