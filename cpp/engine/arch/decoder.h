// Building blocks of a pre-norm decoder layer shared by the architectures (as llama.cpp's build_attn / build_ffn):
// each is a short sequence of backend ops on a ForwardState.
#pragma once

#include "engine/arch/arch.h"

namespace kvcmas::decoder {

// Norms, Q/K/V/O projections and the SwiGLU feed-forward of blk.<il>; with_qkv_bias: Q/K/V biases are required.
void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il, LayerWeights & L,
                bool with_qkv_bias);

// x += attention(rms_norm(x)): Q/K/V projections (+ biases when L has them), RoPE with the KV write of layer il,
// attention over each sequence's run table (shifts and corrections fused), the output projection.
void attention_block(ForwardState & st, int il, const LayerWeights & L);

// x += w_down · (silu(w_gate · rms_norm(x)) * (w_up · rms_norm(x))).
void swiglu_ffn_block(ForwardState & st, const LayerWeights & L);

}  // namespace kvcmas::decoder
