// gpt-oss (OpenAI's open-weight MoE): sliding-window layers (even) alternating with full ones (odd) unless the file
// lists the pattern, attention with q/k/v/o biases and a learned sink logit per head (it joins the softmax's
// denominator), NeoX RoPE with YaRN whose ramp is not rounded to whole dims (the reference implementation's), and in
// every layer top-k routed experts with router and expert biases, softmax over the chosen experts' logits, and the
// clamped SwiGLU ((up + 1) · gate · sigmoid(1.702 gate), gate <= 7, |up| <= 7). The pre-FFN norm is named
// post_attention_norm, as llama.cpp names it.
#include "engine/arch/decoder.h"
#include "engine/gguf-names.h"

namespace kvcmas {

static void configure(ModelParams & p, const gguf::GgufFile & f) {
    namespace names     = gguf_names;
    const std::string a = p.arch + ".";
    p.rope_neox         = true;
    p.yarn_truncate     = false;
    decoder::configure_experts(p, f);
    // llama.cpp's files give the window only: even layers slide, odd ones see everything
    if (f.find(a + names::kArchKeySlidingWindow) != nullptr &&
        f.find(a + names::kArchKeySlidingWindowPattern) == nullptr) {
        const int64_t window = p.layer_window.empty() ? 0 : p.layer_window[0];
        for (size_t il = 0; il < p.layer_window.size(); ++il) {
            p.layer_window[il] = il % 2 == 0 ? window : 0;
        }
    }
}

static void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L) {
    namespace names = gguf_names;
    decoder::AttentionLayout attn;
    attn.qkv_bias = true;
    decoder::load_attention(loader, be, p, il, L, attn);
    L.bo         = decoder::load_norm(loader, be, decoder::block_name(il, names::kBlkAttnOutputBias), p.n_embd, true);
    L.attn_sinks = decoder::load_norm(loader, be, decoder::block_name(il, names::kBlkAttnSinks), p.n_head, true);
    decoder::MoeLayout moe;
    moe.norm_post_attention = true;
    moe.biases              = true;
    decoder::load_experts(loader, be, p, il, L, moe);
}

static void forward_layer(ForwardState & st, int il, const LayerWeights & L) {
    decoder::attention_block(st, il, L);
    decoder::moe_ffn_block(st, L, true, decoder::Gate::SwigluOai);
}

extern const Architecture kArchGptOss = { gguf_names::kArchGptOss, configure, load_layer, forward_layer };

}  // namespace kvcmas
