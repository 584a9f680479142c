// qwen3 (Qwen3 dense): the qwen2 layer without Q/K/V biases and with a per-head RMSNorm of Q and K before RoPE.
#include "engine/arch/decoder.h"
#include "engine/gguf-names.h"

namespace kvcmas {

static void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L) {
    decoder::AttentionLayout attn;
    attn.qk_norm = decoder::QkNorm::PerHead;
    decoder::load_attention(loader, be, p, il, L, attn);
    decoder::load_ffn(loader, be, p, il, L, decoder::FfnLayout{});
}

static void forward_layer(ForwardState & st, int il, const LayerWeights & L) {
    decoder::attention_block(st, il, L);  // Q/K norm between the projections and RoPE
    decoder::ffn_block(st, L, decoder::Gate::Silu);
}

extern const Architecture kArchQwen3 = { gguf_names::kArchQwen3, decoder::configure_neox_rope, load_layer,
                                         forward_layer };

}  // namespace kvcmas
