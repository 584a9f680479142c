// qwen2 (Qwen2 / Qwen2.5): the llama layer with Q/K/V biases (required) and NeoX RoPE pairing (i, i + n_rot/2).
#include "engine/arch/decoder.h"
#include "engine/gguf-names.h"

namespace kvcmas {

static void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L) {
    decoder::load_layer(loader, be, p, il, L, true);
}

static void forward_layer(ForwardState & st, int il, const LayerWeights & L) {
    decoder::attention_block(st, il, L);  // adds the biases L holds
    decoder::ffn_block(st, L, decoder::Gate::Silu);
}

extern const Architecture kArchQwen2 = { gguf_names::kArchQwen2, decoder::configure_neox_rope, load_layer,
                                         forward_layer };

}  // namespace kvcmas
