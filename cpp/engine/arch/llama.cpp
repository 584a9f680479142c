// llama (Llama 1-3, SmolLM, Mistral-style GQA): pre-norm layers, RoPE on interleaved pairs (2i, 2i + 1) as
// llama.cpp stores Q/K, no attention biases, SwiGLU feed-forward.
#include "engine/arch/decoder.h"
#include "engine/gguf-names.h"

namespace kvcmas {

static void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L) {
    decoder::load_layer(loader, be, p, il, L, false);
}

static void forward_layer(ForwardState & st, int il, const LayerWeights & L) {
    decoder::attention_block(st, il, L);
    decoder::ffn_block(st, L, decoder::Gate::Silu);
}

extern const Architecture kArchLlama = { gguf_names::kArchLlama, decoder::configure_paired_rope, load_layer,
                                         forward_layer };

}  // namespace kvcmas
