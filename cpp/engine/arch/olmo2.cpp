// olmo2 (OLMo 2): no pre-norms; RMSNorm of the attention and feed-forward outputs before each joins the residual,
// Q/K RMSNorm over the whole projection (not per head) before NeoX RoPE, SwiGLU.
#include "engine/arch/decoder.h"
#include "engine/gguf-names.h"

namespace kvcmas {

static void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L) {
    decoder::AttentionLayout attn;
    attn.pre_norm  = false;
    attn.post_norm = true;
    attn.qk_norm   = decoder::QkNorm::Whole;
    decoder::load_attention(loader, be, p, il, L, attn);
    decoder::FfnLayout ffn;
    ffn.pre_norm  = false;
    ffn.post_norm = true;
    decoder::load_ffn(loader, be, p, il, L, ffn);
}

static void forward_layer(ForwardState & st, int il, const LayerWeights & L) {
    decoder::attention_block(st, il, L);  // input x itself; output post-normed
    decoder::ffn_block(st, L, decoder::Gate::Silu);
}

extern const Architecture kArchOlmo2 = { gguf_names::kArchOlmo2, decoder::configure_neox_rope, load_layer,
                                         forward_layer };

}  // namespace kvcmas
