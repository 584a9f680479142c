// qwen3moe (Qwen3 MoE, e.g. Qwen3-30B-A3B): the qwen3 attention and, in every layer, top-k routed SwiGLU experts
// (ffn_gate_inp router, ffn_{gate,up,down}_exps) with softmax routing weights renormalized over the chosen experts
// (as llama.cpp runs it), no shared expert.
#include "common/error.h"
#include "engine/arch/decoder.h"
#include "engine/gguf-names.h"

namespace kvcmas {

static void configure(ModelParams & p, const gguf::GgufFile & f) {
    namespace names     = gguf_names;
    const std::string a = p.arch + ".";
    p.rope_neox         = true;
    p.n_expert          = f.get_int(a + names::kArchKeyExpertCount);
    p.n_expert_used     = f.get_int(a + names::kArchKeyExpertUsedCount);
    p.n_ff_exp          = f.get_int(a + names::kArchKeyExpertFeedForwardLength);
    KC_CHECK(p.n_expert > 0 && p.n_expert <= 1024 && p.n_expert_used > 0 && p.n_expert_used <= p.n_expert,
             "%s: expert_count %lld / expert_used_count %lld out of range", f.path().c_str(),
             static_cast<long long>(p.n_expert), static_cast<long long>(p.n_expert_used));
    KC_CHECK(p.n_ff_exp > 0 && p.n_ff_exp <= (1 << 20), "%s: expert_feed_forward_length %lld out of range",
             f.path().c_str(), static_cast<long long>(p.n_ff_exp));
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
