// phi3 (Phi-3, Phi-3.5, Phi-4-mini): fused QKV (attn_qkv) and gate/up (ffn_up holds gate rows then up rows),
// NeoX RoPE, possibly partial (rope.dimension_count < head size) and LongRoPE-scaled (rope_factors_long/_short).
#include "engine/arch/decoder.h"
#include "engine/gguf-names.h"

namespace kvcmas {

static void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L) {
    decoder::AttentionLayout attn;
    attn.fused_qkv = true;
    decoder::load_attention(loader, be, p, il, L, attn);
    decoder::FfnLayout ffn;
    ffn.fused_gate_up = true;
    decoder::load_ffn(loader, be, p, il, L, ffn);
}

static void forward_layer(ForwardState & st, int il, const LayerWeights & L) {
    decoder::attention_block(st, il, L);
    decoder::ffn_block(st, L, decoder::Gate::Silu);
}

extern const Architecture kArchPhi3 = { gguf_names::kArchPhi3, decoder::configure_neox_rope, load_layer,
                                        forward_layer };

}  // namespace kvcmas
