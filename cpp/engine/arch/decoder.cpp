#include "engine/arch/decoder.h"

#include "engine/gguf-names.h"
#include "engine/kv-cache.h"
#include "engine/model.h"

namespace kvcmas::decoder {

namespace names = gguf_names;

static backend::Weight upload(backend::Backend & be, const cpu::WeightView & w) {
    return be.upload_weight(w.type, w.data, w.n_in, w.n_out, w.row_bytes);
}

void load_layer(const TensorLoader & loader, backend::Backend & be, const ModelParams & p, int il, LayerWeights & L,
                bool with_qkv_bias) {
    const int64_t     E = p.n_embd, qd = p.n_head * p.head_dim, kd = p.n_head_kv * p.head_dim;
    const std::string bl = names::kBlockPrefix + std::to_string(il) + ".";
    L.attn_norm          = backend::upload_floats(be, loader.vector_f32(bl + names::kBlkAttnNorm, E, true));
    L.ffn_norm           = backend::upload_floats(be, loader.vector_f32(bl + names::kBlkFfnNorm, E, true));
    L.wq                 = upload(be, loader.matrix(bl + names::kBlkAttnQ, E, qd));
    L.wk                 = upload(be, loader.matrix(bl + names::kBlkAttnK, E, kd));
    L.wv                 = upload(be, loader.matrix(bl + names::kBlkAttnV, E, kd));
    L.wo                 = upload(be, loader.matrix(bl + names::kBlkAttnOutput, qd, E));
    L.w_gate             = upload(be, loader.matrix(bl + names::kBlkFfnGate, E, p.n_ff));
    L.w_up               = upload(be, loader.matrix(bl + names::kBlkFfnUp, E, p.n_ff));
    L.w_down             = upload(be, loader.matrix(bl + names::kBlkFfnDown, p.n_ff, E));
    L.bq                 = backend::upload_floats(be, loader.vector_f32(bl + names::kBlkAttnQBias, qd, with_qkv_bias));
    L.bk                 = backend::upload_floats(be, loader.vector_f32(bl + names::kBlkAttnKBias, kd, with_qkv_bias));
    L.bv                 = backend::upload_floats(be, loader.vector_f32(bl + names::kBlkAttnVBias, kd, with_qkv_bias));
}

void attention_block(ForwardState & st, int il, const LayerWeights & L) {
    backend::Backend &  be = st.be;
    const ModelParams & p  = st.p;
    const int64_t       n = st.n, E = p.n_embd, qd = p.n_head * p.head_dim, kd = p.n_head_kv * p.head_dim;
    be.rms_norm(st.x.f32(), L.attn_norm.f32(), st.xn.f32(), n, E, p.rms_eps);
    {
        const backend::Weight qkv[3] = { L.wq, L.wk, L.wv };
        float * const         out[3] = { st.q.f32(), st.k.f32(), st.v.f32() };
        be.matmul_multi(qkv, out, 3, st.xn.f32(), n);
    }
    if (L.bq.data() != nullptr) {
        be.add_bias(st.q.f32(), L.bq.f32(), n, qd);
        be.add_bias(st.k.f32(), L.bk.f32(), n, kd);
        be.add_bias(st.v.f32(), L.bv.f32(), n, kd);
    }
    be.rope_kv_write(st.rope, st.shape, st.q.f32(), st.k.f32(), st.v.f32(), n, st.cos_q.f32(), st.sin_q.f32(),
                     st.cos_k.f32(), st.sin_k.f32(), st.store, il, st.slots.data());
    for (size_t s = 0; s < st.seq_ids.size(); ++s) {
        st.kv.runs(st.seq_ids[s], il, st.tables[s]);
    }
    backend::AttentionShape shape = st.shape;
    shape.window                  = p.layer_window[static_cast<size_t>(il)];  // sliding-window layers: > 0
    be.attention(shape, st.rope, st.store, il, st.q.f32(), st.att.f32(), n, st.blocks.data(),
                 static_cast<int>(st.blocks.size()), st.tables.data(), st.max_visible);
    be.matmul(L.wo, st.att.f32(), st.tmp.f32(), n);
    be.add(st.x.f32(), st.tmp.f32(), n * E);
}

void swiglu_ffn_block(ForwardState & st, const LayerWeights & L) {
    backend::Backend &  be = st.be;
    const ModelParams & p  = st.p;
    const int64_t       n = st.n, E = p.n_embd;
    be.rms_norm(st.x.f32(), L.ffn_norm.f32(), st.xn.f32(), n, E, p.rms_eps);
    {
        const backend::Weight gate_up[2] = { L.w_gate, L.w_up };
        float * const         out[2]     = { st.g.f32(), st.u.f32() };
        be.matmul_multi(gate_up, out, 2, st.xn.f32(), n);
    }
    be.swiglu(st.g.f32(), st.u.f32(), n, p.n_ff);
    be.matmul(L.w_down, st.g.f32(), st.tmp.f32(), n);
    be.add(st.x.f32(), st.tmp.f32(), n * E);
}

}  // namespace kvcmas::decoder
