#include "engine/arch/decoder.h"

#include <algorithm>
#include <vector>

#include "common/error.h"
#include "engine/gguf-names.h"
#include "engine/kv-cache.h"
#include "engine/lora-adapter.h"

namespace kvcmas::decoder {

namespace names = gguf_names;

void configure_neox_rope(ModelParams & p, const gguf::GgufFile &) {
    p.rope_neox = true;
}

void configure_paired_rope(ModelParams & p, const gguf::GgufFile &) {
    p.rope_neox = false;
}

void configure_experts(ModelParams & p, const gguf::GgufFile & f) {
    const std::string a = p.arch + ".";
    p.n_expert          = f.get_int(a + names::kArchKeyExpertCount);
    p.n_expert_used     = f.get_int(a + names::kArchKeyExpertUsedCount);
    p.n_ff_exp          = f.get_int(a + names::kArchKeyExpertFeedForwardLength);
    KC_CHECK(p.n_expert > 0 && p.n_expert <= 1024 && p.n_expert_used > 0 && p.n_expert_used <= p.n_expert,
             "%s: expert_count %lld / expert_used_count %lld out of range", f.path().c_str(),
             static_cast<long long>(p.n_expert), static_cast<long long>(p.n_expert_used));
    KC_CHECK(p.n_ff_exp > 0 && p.n_ff_exp <= (1 << 20), "%s: expert_feed_forward_length %lld out of range",
             f.path().c_str(), static_cast<long long>(p.n_ff_exp));
}

std::string block_name(int il, const char * suffix) {
    return names::kBlockPrefix + std::to_string(il) + "." + suffix;
}

backend::Weight upload(backend::Backend & be, const cpu::WeightView & w) {
    return be.upload_weight(w.type, w.data, w.n_in, w.n_out, w.row_bytes);
}

backend::Buffer load_norm(const TensorLoader & loader, backend::Backend & be, const std::string & name, int64_t n,
                          bool required) {
    return backend::upload_floats(be, loader.vector_f32(name, n, required));
}

// Rows [r0, r0 + n) of a fused weight, as a weight of its own.
static backend::Weight upload_rows(backend::Backend & be, const cpu::WeightView & w, int64_t r0, int64_t n) {
    const cpu::WeightView part{ w.type, static_cast<const uint8_t *>(w.data) + static_cast<size_t>(r0) * w.row_bytes,
                                w.n_in, n, w.row_bytes };
    return upload(be, part);
}

void load_attention(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il, LayerWeights & L,
                    const AttentionLayout & layout) {
    const int64_t E = p.n_embd, hd = p.head_dim, qd = p.n_head * hd, kd = p.n_head_kv * hd;
    if (layout.pre_norm) {
        L.attn_norm = load_norm(loader, be, block_name(il, names::kBlkAttnNorm), E, true);
    }
    if (layout.fused_qkv) {
        const cpu::WeightView qkv = loader.matrix(block_name(il, names::kBlkAttnQkv), E, qd + 2 * kd);
        L.wq                      = upload_rows(be, qkv, 0, qd);
        L.wk                      = upload_rows(be, qkv, qd, kd);
        L.wv                      = upload_rows(be, qkv, qd + kd, kd);
    } else {
        L.wq = upload(be, loader.matrix(block_name(il, names::kBlkAttnQ), E, qd));
        L.wk = upload(be, loader.matrix(block_name(il, names::kBlkAttnK), E, kd));
        L.wv = upload(be, loader.matrix(block_name(il, names::kBlkAttnV), E, kd));
    }
    L.wo = upload(be, loader.matrix(block_name(il, names::kBlkAttnOutput), qd, E));
    // Biases: required where the architecture has them; a llama file never carries them.
    L.bq = load_norm(loader, be, block_name(il, names::kBlkAttnQBias), qd, layout.qkv_bias);
    L.bk = load_norm(loader, be, block_name(il, names::kBlkAttnKBias), kd, layout.qkv_bias);
    L.bv = load_norm(loader, be, block_name(il, names::kBlkAttnVBias), kd, layout.qkv_bias);
    if (layout.qk_norm != QkNorm::None) {
        const bool whole = layout.qk_norm == QkNorm::Whole;
        L.q_norm         = load_norm(loader, be, block_name(il, names::kBlkAttnQNorm), whole ? qd : hd, true);
        L.k_norm         = load_norm(loader, be, block_name(il, names::kBlkAttnKNorm), whole ? kd : hd, true);
    }
    if (layout.post_norm) {
        L.attn_post_norm = load_norm(loader, be, block_name(il, names::kBlkAttnPostNorm), E, true);
    }
}

void load_ffn(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il, LayerWeights & L,
              const FfnLayout & layout) {
    const int64_t E = p.n_embd, F = p.n_ff;
    if (layout.pre_norm) {
        L.ffn_norm = load_norm(loader, be, block_name(il, names::kBlkFfnNorm), E, true);
    }
    if (layout.fused_gate_up) {
        const cpu::WeightView gate_up = loader.matrix(block_name(il, names::kBlkFfnUp), E, 2 * F);
        L.w_gate                      = upload_rows(be, gate_up, 0, F);
        L.w_up                        = upload_rows(be, gate_up, F, F);
    } else {
        L.w_gate = upload(be, loader.matrix(block_name(il, names::kBlkFfnGate), E, F));
        L.w_up   = upload(be, loader.matrix(block_name(il, names::kBlkFfnUp), E, F));
    }
    L.w_down = upload(be, loader.matrix(block_name(il, names::kBlkFfnDown), F, E));
    if (layout.post_norm) {
        L.ffn_post_norm = load_norm(loader, be, block_name(il, names::kBlkFfnPostNorm), E, true);
    }
}

void load_experts(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il, LayerWeights & L,
                  const MoeLayout & layout) {
    const int64_t E = p.n_embd, F = p.n_ff_exp, X = p.n_expert;
    L.ffn_norm = load_norm(
        loader, be, block_name(il, layout.norm_post_attention ? names::kBlkAttnPostNorm : names::kBlkFfnNorm), E, true);
    L.router = upload(be, loader.matrix(block_name(il, names::kBlkFfnGateInp), E, X));
    if (layout.biases) {
        L.router_bias   = load_norm(loader, be, block_name(il, names::kBlkFfnGateInpBias), X, true);
        L.exp_gate_bias = load_norm(loader, be, block_name(il, names::kBlkFfnGateExpsBias), X * F, true);
        L.exp_up_bias   = load_norm(loader, be, block_name(il, names::kBlkFfnUpExpsBias), X * F, true);
        L.exp_down_bias = load_norm(loader, be, block_name(il, names::kBlkFfnDownExpsBias), X * E, true);
    }
    const cpu::WeightView gate = loader.matrices(block_name(il, names::kBlkFfnGateExps), E, F, X);
    const cpu::WeightView up   = loader.matrices(block_name(il, names::kBlkFfnUpExps), E, F, X);
    const cpu::WeightView down = loader.matrices(block_name(il, names::kBlkFfnDownExps), F, E, X);
    for (int64_t e = 0; e < X; ++e) {  // the 3-D tensors are one matrix per expert, one after another
        L.exp_gate.push_back(upload_rows(be, gate, e * F, F));
        L.exp_up.push_back(upload_rows(be, up, e * F, F));
        L.exp_down.push_back(upload_rows(be, down, e * E, E));
    }
}

void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il, LayerWeights & L,
                bool with_qkv_bias) {
    AttentionLayout attn;
    attn.qkv_bias = with_qkv_bias;
    load_attention(loader, be, p, il, L, attn);
    load_ffn(loader, be, p, il, L, FfnLayout{});
}

const float * attention_input(ForwardState & st, const LayerWeights & L) {
    if (L.attn_norm.data() == nullptr) {
        return st.x.f32();
    }
    st.be.rms_norm(st.x.f32(), L.attn_norm.f32(), st.xn.f32(), st.n, st.p.n_embd, st.p.rms_eps);
    return st.xn.f32();
}

void qkv_projections(ForwardState & st, const LayerWeights & L, const float * in) {
    const ModelParams & p = st.p;
    const int64_t       n = st.n, qd = p.n_head * p.head_dim, kd = p.n_head_kv * p.head_dim;
    adapted_matmul(st, in,
                   { { LoraTarget::Q, &L.wq, st.q.f32() },
                     { LoraTarget::K, &L.wk, st.k.f32() },
                     { LoraTarget::V, &L.wv, st.v.f32() } });
    if (L.bq.data() != nullptr) {
        st.be.add_bias(st.q.f32(), L.bq.f32(), n, qd);
        st.be.add_bias(st.k.f32(), L.bk.f32(), n, kd);
        st.be.add_bias(st.v.f32(), L.bv.f32(), n, kd);
    }
}

void qk_norm(ForwardState & st, const LayerWeights & L) {
    if (L.q_norm.data() == nullptr) {
        return;
    }
    const ModelParams & p = st.p;
    const int64_t       n = st.n, hd = p.head_dim, qd = p.n_head * hd, kd = p.n_head_kv * hd;
    // In place, row by row: a row is one head (per-head norm) or the whole projection.
    const int64_t q_width = static_cast<int64_t>(L.q_norm.bytes() / sizeof(float));
    const int64_t k_width = static_cast<int64_t>(L.k_norm.bytes() / sizeof(float));
    st.be.rms_norm(st.q.f32(), L.q_norm.f32(), st.q.f32(), n * qd / q_width, q_width, p.rms_eps);
    st.be.rms_norm(st.k.f32(), L.k_norm.f32(), st.k.f32(), n * kd / k_width, k_width, p.rms_eps);
}

void rope_and_store(ForwardState & st, int il) {
    const ForwardState::RopeTables & t = st.rope_tables[st.rope_index(il)];
    st.be.rope_kv_write(st.rope(il), st.shape, st.q.f32(), st.k.f32(), st.v.f32(), st.n, t.cos_q.f32(), t.sin_q.f32(),
                        t.cos_k.f32(), t.sin_k.f32(), st.store, il, st.slots.data());
}

void attend(ForwardState & st, int il, const LayerWeights & L) {
    for (size_t s = 0; s < st.seq_ids.size(); ++s) {
        st.kv.runs(st.seq_ids[s], il, st.tables[s]);
    }
    backend::AttentionShape shape = st.shape;
    shape.window                  = st.p.layer_window[static_cast<size_t>(il)];  // sliding-window layers: > 0
    shape.sinks                   = L.attn_sinks.f32();                          // null where L has none
    st.be.attention(shape, st.rope(il), st.store, il, st.q.f32(), st.att.f32(), st.n, st.blocks.data(),
                    static_cast<int>(st.blocks.size()), st.tables.data(), st.max_visible);
}

// x += rms_norm(y) (post_norm set) or y.
static void add_residual(ForwardState & st, const backend::Buffer & post_norm, float * y) {
    const int64_t E = st.p.n_embd;
    if (post_norm.data() != nullptr) {
        st.be.rms_norm(y, post_norm.f32(), y, st.n, E, st.p.rms_eps);
    }
    st.be.add(st.x.f32(), y, st.n * E);
}

void attention_output(ForwardState & st, const LayerWeights & L) {
    adapted_matmul(st, st.att.f32(), { { LoraTarget::Output, &L.wo, st.tmp.f32() } });
    if (L.bo.data() != nullptr) {
        st.be.add_bias(st.tmp.f32(), L.bo.f32(), st.n, st.p.n_embd);
    }
    add_residual(st, L.attn_post_norm, st.tmp.f32());
}

void attention_block(ForwardState & st, int il, const LayerWeights & L) {
    qkv_projections(st, L, attention_input(st, L));
    qk_norm(st, L);
    rope_and_store(st, il);
    attend(st, il, L);
    attention_output(st, L);
}

void ffn_block(ForwardState & st, const LayerWeights & L, Gate gate) {
    backend::Backend &  be = st.be;
    const ModelParams & p  = st.p;
    const int64_t       n = st.n, E = p.n_embd;
    const float *       in = st.x.f32();
    if (L.ffn_norm.data() != nullptr) {
        be.rms_norm(st.x.f32(), L.ffn_norm.f32(), st.xn.f32(), n, E, p.rms_eps);
        in = st.xn.f32();
    }
    adapted_matmul(st, in, { { LoraTarget::Gate, &L.w_gate, st.g.f32() }, { LoraTarget::Up, &L.w_up, st.u.f32() } });
    if (gate == Gate::Silu) {
        be.swiglu(st.g.f32(), st.u.f32(), n, p.n_ff);
    } else if (gate == Gate::SwigluOai) {
        be.swiglu_oai(st.g.f32(), st.u.f32(), n, p.n_ff, kOaiAlpha, kOaiLimit);
    } else {
        be.geglu_tanh(st.g.f32(), st.u.f32(), n, p.n_ff);
    }
    adapted_matmul(st, st.g.f32(), { { LoraTarget::Down, &L.w_down, st.tmp.f32() } });
    add_residual(st, L.ffn_post_norm, st.tmp.f32());
}

}  // namespace kvcmas::decoder

namespace kvcmas::decoder {

void moe_ffn_block(ForwardState & st, const LayerWeights & L, bool norm, Gate gate) {
    backend::Backend &  be = st.be;
    const ModelParams & p  = st.p;
    const int64_t       n = st.n, E = p.n_embd, F = p.n_ff_exp, X = p.n_expert;
    const int           k      = static_cast<int>(p.n_expert_used);
    const auto          floats = [&](int64_t count) { return backend::Buffer(be, sizeof(float) * count); };
    be.rms_norm(st.x.f32(), L.ffn_norm.f32(), st.xn.f32(), n, E, p.rms_eps);
    std::vector<int32_t> ids(static_cast<size_t>(n * k));
    std::vector<float>   weights(static_cast<size_t>(n * k));
    {
        backend::Buffer logits = floats(n * X);
        be.matmul(L.router, st.xn.f32(), logits.f32(), n);
        if (L.router_bias.data() != nullptr) {
            be.add_bias(logits.f32(), L.router_bias.f32(), n, X);
        }
        be.moe_route(logits.f32(), n, static_cast<int>(X), k, norm, ids.data(), weights.data());
    }
    // The routed (token, expert) pairs grouped by expert (experts in index order, each one's tokens in token order):
    // rows[first[e]..first[e+1]) are the tokens of expert e, scales their weights.
    std::vector<int64_t> first(static_cast<size_t>(X + 1), 0);
    for (int64_t i = 0; i < n * k; ++i) {
        ++first[static_cast<size_t>(ids[static_cast<size_t>(i)]) + 1];
    }
    for (int64_t e = 0; e < X; ++e) {
        first[static_cast<size_t>(e + 1)] += first[static_cast<size_t>(e)];
    }
    std::vector<int32_t> rows(static_cast<size_t>(n * k));
    std::vector<float>   scales(static_cast<size_t>(n * k));
    {
        std::vector<int64_t> at(first.begin(), first.end() - 1);
        for (int64_t i = 0; i < n * k; ++i) {
            const int64_t slot                = at[static_cast<size_t>(ids[static_cast<size_t>(i)])]++;
            rows[static_cast<size_t>(slot)]   = static_cast<int32_t>(i / k);
            scales[static_cast<size_t>(slot)] = weights[static_cast<size_t>(i)];
        }
    }
    // Experts in chunks of about kChunkRows routed rows (whole experts, in index order): each chunk's activations stay
    // in cache between its steps, and each step is one grouped call (one parallel job for all the chunk's experts,
    // not one per expert and matrix). Chunks in index order keep each token's experts summed in index order.
    constexpr int64_t            kChunkRows = 256;
    std::vector<int64_t>         chunk_end;  // expert after each chunk's last
    int64_t                      most = 0;   // rows of the largest chunk
    std::vector<backend::Weight> w(static_cast<size_t>(2 * X));
    for (int64_t e = 0, e0 = 0; e < X; ++e) {
        w[static_cast<size_t>(2 * e)]     = L.exp_gate[static_cast<size_t>(e)];
        w[static_cast<size_t>(2 * e + 1)] = L.exp_up[static_cast<size_t>(e)];
        const int64_t m                   = first[static_cast<size_t>(e + 1)] - first[static_cast<size_t>(e0)];
        if (m >= kChunkRows || e + 1 == X) {
            chunk_end.push_back(e + 1);
            most = std::max(most, m);
            e0   = e + 1;
        }
    }
    backend::Buffer xg = floats(most * E), g = floats(most * F), u = floats(most * F), out = floats(most * E);
    be.upload(st.tmp.data(), std::vector<float>(static_cast<size_t>(n * E), 0.0f).data(), sizeof(float) * n * E);
    int64_t e0 = 0;
    for (const int64_t e1 : chunk_end) {
        const int64_t r0 = first[static_cast<size_t>(e0)], m = first[static_cast<size_t>(e1)] - r0;
        if (m == 0) {
            e0 = e1;
            continue;
        }
        std::vector<int64_t> at(static_cast<size_t>(e1 - e0 + 1));  // the chunk's experts' first rows, from 0
        for (int64_t e = e0; e <= e1; ++e) {
            at[static_cast<size_t>(e - e0)] = first[static_cast<size_t>(e)] - r0;
        }
        const int n_groups = static_cast<int>(e1 - e0);
        be.gather_rows(st.xn.f32(), rows.data() + r0, m, E, xg.f32());
        {
            float * const gu[2] = { g.f32(), u.f32() };
            be.matmul_experts(w.data() + 2 * e0, 2, n_groups, at.data(), xg.f32(), gu);
        }
        const auto expert_bias = [&](const backend::Buffer & bias, float * y, int64_t width) {
            for (int64_t e = e0; e < e1; ++e) {  // expert e's rows of the stacked biases
                const int64_t b = at[static_cast<size_t>(e - e0)], me = at[static_cast<size_t>(e - e0 + 1)] - b;
                if (me > 0) {
                    be.add_bias(y + b * width, bias.f32() + e * width, me, width);
                }
            }
        };
        if (L.exp_gate_bias.data() != nullptr) {
            expert_bias(L.exp_gate_bias, g.f32(), F);
            expert_bias(L.exp_up_bias, u.f32(), F);
        }
        if (gate == Gate::SwigluOai) {
            be.swiglu_oai(g.f32(), u.f32(), m, F, kOaiAlpha, kOaiLimit);
        } else {
            be.swiglu(g.f32(), u.f32(), m, F);
        }
        {
            float * const down[1] = { out.f32() };
            be.matmul_experts(L.exp_down.data() + e0, 1, n_groups, at.data(), g.f32(), down);
        }
        if (L.exp_down_bias.data() != nullptr) {
            expert_bias(L.exp_down_bias, out.f32(), E);
        }
        be.add_scaled_rows(st.tmp.f32(), out.f32(), rows.data() + r0, scales.data() + r0, m, E);
        e0 = e1;
    }
    be.add(st.x.f32(), st.tmp.f32(), n * E);
}

}  // namespace kvcmas::decoder
