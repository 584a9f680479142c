// gemma3 (Gemma 3 text): sliding-window layers interleaved with global ones (5:1 unless the file lists the
// pattern), each kind with its own RoPE base (rope.freq_base_swa, default 10000, unscaled, on sliding layers),
// per-head Q/K RMSNorm, RMSNorm before and after attention and feed-forward, GeGLU with tanh-GELU, embeddings
// times sqrt(n_embd), tied output. Norm weights are stored as (1 + w), as llama.cpp's converter writes them.
#include <cmath>

#include "engine/arch/decoder.h"
#include "engine/gguf-names.h"

namespace kvcmas {

static constexpr int64_t kSlidingPeriod = 6;  // llama.cpp's gemma3 files: every 6th layer is global

static void configure(ModelParams & p, const gguf::GgufFile & f) {
    namespace names     = gguf_names;
    const std::string a = p.arch + ".";
    p.rope_neox         = true;
    p.embd_scale        = static_cast<float>(std::sqrt(static_cast<double>(p.n_embd)));
    // llama.cpp: 1/sqrt(head size), except Gemma 3 27B (62 layers), which scales by n_embd / n_head
    // (transformers' query_pre_attn_scalar)
    const int64_t scalar = p.n_layer == 62 ? p.n_embd / p.n_head : p.head_dim;
    p.attn_scale         = 1.0 / std::sqrt(static_cast<double>(scalar));
    if (f.find(a + names::kArchKeySlidingWindow) != nullptr &&
        f.find(a + names::kArchKeySlidingWindowPattern) == nullptr) {
        const int64_t window = p.layer_window.empty() ? 0 : p.layer_window[0];
        for (size_t il = 0; il < p.layer_window.size(); ++il) {
            p.layer_window[il] = static_cast<int64_t>(il) % kSlidingPeriod < kSlidingPeriod - 1 ? window : 0;
        }
    }
    for (size_t il = 0; il < p.layer_window.size(); ++il) {
        p.layer_rope[il] = p.layer_window[il] > 0 ? LayerRope::Sliding : LayerRope::Global;
    }
}

static void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il,
                       LayerWeights & L) {
    decoder::AttentionLayout attn;
    attn.post_norm = true;
    attn.qk_norm   = decoder::QkNorm::PerHead;
    decoder::load_attention(loader, be, p, il, L, attn);
    decoder::FfnLayout ffn;
    ffn.post_norm = true;
    decoder::load_ffn(loader, be, p, il, L, ffn);
}

static void forward_layer(ForwardState & st, int il, const LayerWeights & L) {
    decoder::attention_block(st, il, L);
    decoder::ffn_block(st, L, decoder::Gate::GeluTanh);
}

extern const Architecture kArchGemma3 = { gguf_names::kArchGemma3, configure, load_layer, forward_layer };

}  // namespace kvcmas
