// llama (Llama 1-3, SmolLM, Mistral-style GQA): pre-norm layers, RoPE on interleaved pairs (2i, 2i + 1) as
// llama.cpp stores Q/K, no attention biases, SwiGLU feed-forward.
#include "engine/arch/decoder.h"
#include "engine/model.h"

namespace kvcmas {

static void configure(ModelParams & p) {
    p.rope_neox    = false;
    p.has_qkv_bias = false;
}

static void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L) {
    decoder::load_layer(loader, be, p, il, L, false);
}

static void forward_layer(ForwardState & st, int il, const LayerWeights & L) {
    decoder::attention_block(st, il, L);
    decoder::swiglu_ffn_block(st, L);
}

extern const Architecture kArchLlama = { "llama", configure, load_layer, forward_layer };

}  // namespace kvcmas
