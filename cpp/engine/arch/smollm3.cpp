// smollm3 (SmolLM3): the llama layer, with every 4th layer (il % 4 == 3) attending without RoPE, as llama.cpp
// runs it (its files carry no per-layer key for this; transformers' default no_rope_layer_interval is 4).
#include "engine/arch/decoder.h"
#include "engine/gguf-names.h"

namespace kvcmas {

static constexpr int kNoRopeInterval = 4;

static void configure(ModelParams & p, const gguf::GgufFile &) {
    p.rope_neox = false;
    for (size_t il = 0; il < p.layer_rope.size(); ++il) {
        if ((il + 1) % kNoRopeInterval == 0) {
            p.layer_rope[il] = LayerRope::None;
        }
    }
}

static void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L) {
    decoder::load_layer(loader, be, p, il, L, false);
}

static void forward_layer(ForwardState & st, int il, const LayerWeights & L) {
    decoder::attention_block(st, il, L);  // layer il's RoPE: none on the no-RoPE layers
    decoder::ffn_block(st, L, decoder::Gate::Silu);
}

extern const Architecture kArchSmollm3 = { gguf_names::kArchSmollm3, configure, load_layer, forward_layer };

}  // namespace kvcmas
