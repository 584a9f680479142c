#include "engine/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include "common/error.h"
#include "cpu/quants.h"
#include "engine/gguf-names.h"

namespace kvcmas {

namespace names = gguf_names;

static int default_threads(int n_threads) {
    if (n_threads > 0) {
        return n_threads;
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(std::min(hw, 64u));
}

Model::Model(const std::string & path, int n_threads, int n_ctx, size_t kv_budget_bytes, cpu::KvType kv_type)
    : file_(std::make_unique<gguf::GgufFile>(path)), pool_(default_threads(n_threads)) {
    load_params();
    load_weights();
    if (n_ctx <= 0) {
        n_ctx = static_cast<int>(std::min<int64_t>(p_.n_ctx_train > 0 ? p_.n_ctx_train : 8192, 8192));
    }
    KC_CHECK(n_ctx <= (1 << 24), "n_ctx %d is too large", n_ctx);
    KC_CHECK(kv_type == cpu::KvType::F32 || kv_type == cpu::KvType::F16, "unknown KV type %d",
             static_cast<int>(kv_type));
    KvLayout layout{ static_cast<int>(p_.n_layer), static_cast<int>(p_.n_head_kv * p_.head_dim), kv_type };
    if (kv_budget_bytes == 0) {
        const size_t blocks = static_cast<size_t>((n_ctx + kKvBlockRows - 1) / kKvBlockRows) + 1;
        kv_budget_bytes     = 4 * blocks * static_cast<size_t>(layout.n_layer) * 2 * kKvBlockRows * layout.n_kv_dim *
                              cpu::kv_type_size(kv_type);
    }
    kv_ = std::make_unique<KvCache>(layout, kv_budget_bytes, n_ctx);
}

void Model::load_params() {
    const gguf::GgufFile & f = *file_;
    p_.arch                  = f.get_string(names::kKeyArchitecture);
    KC_CHECK(p_.arch == names::kArchLlama || p_.arch == names::kArchQwen2,
             "%s: unsupported architecture '%s' (kvcmas runs llama and qwen2)", f.path().c_str(), p_.arch.c_str());
    const std::string a = p_.arch + ".";
    p_.n_embd           = f.get_int(a + names::kArchKeyEmbeddingLength);
    p_.n_layer          = f.get_int(a + names::kArchKeyBlockCount);
    p_.n_ff             = f.get_int(a + names::kArchKeyFeedForwardLength);
    p_.n_head           = f.get_int(a + names::kArchKeyHeadCount);
    p_.n_head_kv        = f.get_int(a + names::kArchKeyHeadCountKv, p_.n_head);
    p_.n_ctx_train      = f.get_int(a + names::kArchKeyContextLength, 0);
    p_.rms_eps          = static_cast<float>(f.get_float(a + names::kArchKeyRmsEps));
    p_.rope_base        = f.get_float(a + names::kArchKeyRopeFreqBase, 10000.0);
    const char * path   = f.path().c_str();
    KC_CHECK(p_.n_embd > 0 && p_.n_embd <= (1 << 16), "%s: embedding_length %lld out of range", path,
             static_cast<long long>(p_.n_embd));
    KC_CHECK(p_.n_layer > 0 && p_.n_layer <= 1024, "%s: block_count %lld out of range", path,
             static_cast<long long>(p_.n_layer));
    KC_CHECK(p_.n_ff > 0 && p_.n_ff <= (1 << 20), "%s: feed_forward_length %lld out of range", path,
             static_cast<long long>(p_.n_ff));
    KC_CHECK(p_.n_head > 0 && p_.n_head <= 1024 && p_.n_head_kv > 0 && p_.n_head % p_.n_head_kv == 0,
             "%s: head_count %lld / head_count_kv %lld are not a valid grouping", path,
             static_cast<long long>(p_.n_head), static_cast<long long>(p_.n_head_kv));
    p_.head_dim = f.get_int(a + names::kArchKeyKeyLength, p_.n_embd / p_.n_head);
    KC_CHECK(
        p_.head_dim > 0 && p_.head_dim <= 1024 && f.get_int(a + names::kArchKeyValueLength, p_.head_dim) == p_.head_dim,
        "%s: head size %lld unsupported (keys and values must share it)", path, static_cast<long long>(p_.head_dim));
    p_.n_rot = f.get_int(a + names::kArchKeyRopeDimensionCount, p_.head_dim);
    KC_CHECK(p_.n_rot > 0 && p_.n_rot <= p_.head_dim && p_.n_rot % 2 == 0,
             "%s: rope.dimension_count %lld must be even and at most the head size %lld", path,
             static_cast<long long>(p_.n_rot), static_cast<long long>(p_.head_dim));
    KC_CHECK(std::isfinite(p_.rms_eps) && p_.rms_eps > 0.0f && p_.rms_eps < 1.0f,
             "%s: layer_norm_rms_epsilon %g out of range", path, static_cast<double>(p_.rms_eps));
    KC_CHECK(std::isfinite(p_.rope_base) && p_.rope_base > 1.0, "%s: rope.freq_base %g out of range", path,
             p_.rope_base);
    if (const gguf::Value * st = f.find(a + names::kArchKeyRopeScalingType)) {
        const std::string type = st->type == gguf::ValueType::STRING ? st->str : std::string("?");
        if (type == "linear") {
            const double factor = f.get_float(a + names::kArchKeyRopeScalingFactor);
            KC_CHECK(std::isfinite(factor) && factor > 0.0, "%s: rope.scaling.factor %g out of range", path, factor);
            p_.rope_scale = 1.0 / factor;
        } else {
            // llama3-style scaling is carried by the rope_freqs tensor; only yarn & co are unsupported.
            KC_CHECK(type == "none" || type == "llama3", "%s: rope scaling '%s' is not supported", path, type.c_str());
        }
    }
    load_sliding_window();
    p_.rope_neox                 = p_.arch == names::kArchQwen2;
    p_.has_qkv_bias              = p_.arch == names::kArchQwen2;
    const gguf::TensorInfo * emb = f.find_tensor(names::kTensorTokenEmbd);
    KC_CHECK(emb != nullptr, "%s: tensor '%s' is missing", path, names::kTensorTokenEmbd);
    KC_CHECK(emb->ne.size() == 2 && emb->ne[0] == p_.n_embd, "%s: tensor '%s' has the wrong shape", path,
             names::kTensorTokenEmbd);
    p_.n_vocab     = emb->ne[1];
    p_.tied_output = f.find_tensor(names::kTensorOutput) == nullptr;

    rope_.n_rot = static_cast<int>(p_.n_rot);
    rope_.neox  = p_.rope_neox;
    rope_.inv_freq.resize(static_cast<size_t>(p_.n_rot / 2));
    const std::vector<float> factors = vector_f32(names::kTensorRopeFreqs, p_.n_rot / 2, false);
    for (int64_t j = 0; j < p_.n_rot / 2; ++j) {
        double inv = std::pow(p_.rope_base, -2.0 * static_cast<double>(j) / static_cast<double>(p_.n_rot));
        if (!factors.empty()) {
            KC_CHECK(std::isfinite(factors[j]) && factors[j] > 0.0f, "%s: rope_freqs.weight[%lld] = %g is invalid",
                     path, static_cast<long long>(j), static_cast<double>(factors[j]));
            inv /= factors[j];
        }
        rope_.inv_freq[static_cast<size_t>(j)] = static_cast<float>(inv * p_.rope_scale);
    }
}

void Model::load_sliding_window() {
    const gguf::GgufFile & f    = *file_;
    const std::string      a    = p_.arch + ".";
    const char *           path = f.path().c_str();
    p_.layer_window.assign(static_cast<size_t>(p_.n_layer), 0);
    if (f.find(a + names::kArchKeySlidingWindow) == nullptr) {
        return;
    }
    const int64_t window = f.get_int(a + names::kArchKeySlidingWindow);
    KC_CHECK(window > 0 && window <= (int64_t{ 1 } << 31), "%s: %s%s = %lld out of range", path, a.c_str(),
             names::kArchKeySlidingWindow, static_cast<long long>(window));
    const gguf::Value * pattern = f.find(a + names::kArchKeySlidingWindowPattern);
    for (int64_t il = 0; il < p_.n_layer; ++il) {
        bool windowed = true;  // no pattern: every layer
        if (pattern != nullptr && pattern->type == gguf::ValueType::ARRAY &&
            pattern->array_type == gguf::ValueType::BOOL) {
            KC_CHECK(static_cast<int64_t>(pattern->ints.size()) == p_.n_layer,
                     "%s: %s%s has %zu entries for %lld layers", path, a.c_str(), names::kArchKeySlidingWindowPattern,
                     pattern->ints.size(), static_cast<long long>(p_.n_layer));
            windowed = pattern->ints[static_cast<size_t>(il)] != 0;
        } else if (pattern != nullptr) {
            // llama.cpp's integer form: in every group of n layers the last one attends to everything (0: none).
            const int64_t n = f.get_int(a + names::kArchKeySlidingWindowPattern);
            KC_CHECK(n >= 0 && n <= p_.n_layer, "%s: %s%s = %lld is neither a bool per layer nor a layer period", path,
                     a.c_str(), names::kArchKeySlidingWindowPattern, static_cast<long long>(n));
            windowed = n == 0 || il % n < n - 1;
        }
        p_.layer_window[static_cast<size_t>(il)] = windowed ? window : 0;
    }
}

cpu::WeightView Model::weight(const std::string & name, int64_t n_in, int64_t n_out) const {
    const gguf::TensorInfo * t = file_->find_tensor(name);
    KC_CHECK(t != nullptr, "%s: tensor '%s' is missing", file_->path().c_str(), name.c_str());
    KC_CHECK(t->ne.size() == 2 && t->ne[0] == n_in && t->ne[1] == n_out,
             "%s: tensor '%s' should have shape [%lld, %lld]", file_->path().c_str(), name.c_str(),
             static_cast<long long>(n_in), static_cast<long long>(n_out));
    const GgmlTypeTraits * tr = ggml_type_traits(static_cast<uint32_t>(t->type));
    KC_CHECK(tr != nullptr && tr->weight, "%s: tensor '%s' has type %s, which kvcmas cannot use as a weight",
             file_->path().c_str(), name.c_str(), ggml_type_name(static_cast<uint32_t>(t->type)));
    return cpu::WeightView{ t->type, t->data, n_in, n_out, ggml_row_bytes(t->type, n_in) };
}

std::vector<float> Model::vector_f32(const std::string & name, int64_t n, bool required) const {
    const gguf::TensorInfo * t = file_->find_tensor(name);
    if (t == nullptr) {
        KC_CHECK(!required, "%s: tensor '%s' is missing", file_->path().c_str(), name.c_str());
        return {};
    }
    KC_CHECK(t->n_elements() == n && t->ne.size() == 1, "%s: tensor '%s' should have %lld elements",
             file_->path().c_str(), name.c_str(), static_cast<long long>(n));
    const GgmlTypeTraits * tr = ggml_type_traits(static_cast<uint32_t>(t->type));
    KC_CHECK(tr != nullptr && tr->weight && n % tr->block == 0, "%s: tensor '%s' has unusable type %s",
             file_->path().c_str(), name.c_str(), ggml_type_name(static_cast<uint32_t>(t->type)));
    std::vector<float> out(static_cast<size_t>(n));
    cpu::dequantize_row(t->type, t->data, out.data(), n);
    return out;
}

void Model::load_weights() {
    const int64_t E = p_.n_embd, qd = p_.n_head * p_.head_dim, kd = p_.n_head_kv * p_.head_dim;
    tok_embd_    = weight(names::kTensorTokenEmbd, E, p_.n_vocab);
    output_      = p_.tied_output ? tok_embd_ : weight(names::kTensorOutput, E, p_.n_vocab);
    output_norm_ = vector_f32(names::kTensorOutputNorm, E, true);
    layers_.resize(static_cast<size_t>(p_.n_layer));
    for (int64_t il = 0; il < p_.n_layer; ++il) {
        Layer &           L  = layers_[static_cast<size_t>(il)];
        const std::string bl = names::kBlockPrefix + std::to_string(il) + ".";
        L.attn_norm          = vector_f32(bl + names::kBlkAttnNorm, E, true);
        L.ffn_norm           = vector_f32(bl + names::kBlkFfnNorm, E, true);
        L.wq                 = weight(bl + names::kBlkAttnQ, E, qd);
        L.wk                 = weight(bl + names::kBlkAttnK, E, kd);
        L.wv                 = weight(bl + names::kBlkAttnV, E, kd);
        L.wo                 = weight(bl + names::kBlkAttnOutput, qd, E);
        L.w_gate             = weight(bl + names::kBlkFfnGate, E, p_.n_ff);
        L.w_up               = weight(bl + names::kBlkFfnUp, E, p_.n_ff);
        L.w_down             = weight(bl + names::kBlkFfnDown, p_.n_ff, E);
        L.bq                 = vector_f32(bl + names::kBlkAttnQBias, qd, p_.has_qkv_bias);
        L.bk                 = vector_f32(bl + names::kBlkAttnKBias, kd, p_.has_qkv_bias);
        L.bv                 = vector_f32(bl + names::kBlkAttnVBias, kd, p_.has_qkv_bias);
    }
}

std::vector<float> Model::decode(const Batch & batch) {
    KC_CHECK(!batch.items.empty(), "decode: the batch is empty");
    std::map<int32_t, int32_t> count, length;  // per sequence: new rows, rows before
    std::vector<int32_t>       order;          // sequences by first appearance
    for (const BatchItem & it : batch.items) {
        KC_CHECK(kv_->seq_exists(it.seq), "decode: no sequence with id %d", it.seq);
        if (it.embd_row >= 0) {
            KC_CHECK(it.embd_row < batch.n_embd_rows && batch.embd != nullptr,
                     "decode: embedding row %d out of range (%lld rows)", it.embd_row,
                     static_cast<long long>(batch.n_embd_rows));
        } else {
            KC_CHECK(it.token >= 0 && it.token < p_.n_vocab, "decode: token id %d out of range [0, %lld)", it.token,
                     static_cast<long long>(p_.n_vocab));
        }
        if (count[it.seq]++ == 0) {
            order.push_back(it.seq);
            length[it.seq] = kv_->seq_length(it.seq);
        }
    }
    for (int32_t s : order) {
        KC_CHECK(static_cast<int64_t>(length[s]) + count[s] <= kv_->n_ctx_max(),
                 "context overflow: sequence %d has %d tokens, %d more exceed n_ctx = %d", s, length[s], count[s],
                 kv_->n_ctx_max());
    }
    std::vector<float> logits;
    try {
        std::map<int32_t, std::vector<KvSlot>> seq_slots;
        for (int32_t s : order) {
            seq_slots[s] = kv_->append(s, count[s]);
        }
        std::vector<KvSlot>        slots;
        std::vector<int32_t>       positions;
        std::map<int32_t, int32_t> used;
        for (const BatchItem & it : batch.items) {
            const int32_t i = used[it.seq]++;
            slots.push_back(seq_slots[it.seq][static_cast<size_t>(i)]);
            positions.push_back(length[it.seq] + i);
        }
        forward(batch, slots, positions, logits);
    } catch (...) {
        for (int32_t s : order) {
            if (kv_->seq_exists(s) && kv_->seq_length(s) > length[s]) {
                kv_->seq_truncate(s, length[s]);
            }
        }
        throw;
    }
    return logits;
}

static void add_rows(float * x, const float * y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        x[i] += y[i];
    }
}

void Model::forward(const Batch & batch, const std::vector<KvSlot> & slots, const std::vector<int32_t> & positions,
                    std::vector<float> & logits) {
    const int64_t n = static_cast<int64_t>(batch.items.size());
    const int64_t E = p_.n_embd, H = p_.n_head, hd = p_.head_dim, KVH = p_.n_head_kv, F = p_.n_ff;
    const int64_t qd = H * hd, kd = KVH * hd, half = p_.n_rot / 2;

    std::vector<float> x(n * E), xn(n * E), q(n * qd), k(n * kd), v(n * kd), att(n * qd), tmp(n * E);
    std::vector<float> g(n * F), u(n * F);
    for (int64_t i = 0; i < n; ++i) {
        const BatchItem & it = batch.items[static_cast<size_t>(i)];
        if (it.embd_row >= 0) {
            std::memcpy(&x[i * E], batch.embd + static_cast<int64_t>(it.embd_row) * E, sizeof(float) * E);
        } else {
            const uint8_t * row = static_cast<const uint8_t *>(tok_embd_.data) + tok_embd_.row_bytes * it.token;
            cpu::dequantize_row(tok_embd_.type, row, &x[i * E], E);
        }
    }
    // RoPE angles: queries at their positions, keys at their frame positions (equal unless a span is shared).
    std::vector<float> cq(n * half), sq(n * half), ck(n * half), sk(n * half);
    for (int64_t i = 0; i < n; ++i) {
        rope_.angles(static_cast<double>(positions[i]), &cq[i * half], &sq[i * half]);
        rope_.angles(static_cast<double>(slots[i].frame_pos), &ck[i * half], &sk[i * half]);
    }
    // Distinct sequences, their runs, and each item's index among them.
    std::map<int32_t, int32_t> seq_index;
    std::vector<int32_t>       seq_ids;
    std::vector<int32_t>       item_seq(n);
    int64_t                    max_visible = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int32_t s   = batch.items[static_cast<size_t>(i)].seq;
        auto          ins = seq_index.emplace(s, static_cast<int32_t>(seq_ids.size()));
        if (ins.second) {
            seq_ids.push_back(s);
        }
        item_seq[i] = ins.first->second;
        max_visible = std::max<int64_t>(max_visible, positions[i] + 1);
    }
    std::vector<std::vector<cpu::KvRun>> runs(seq_ids.size());
    const cpu::KvType                    kv_type = kv_->pool().layout().kv_type;
    const cpu::AttentionShape            shape{ static_cast<int>(H),
                                                static_cast<int>(KVH),
                                                static_cast<int>(hd),
                                                kd,
                                                static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))),
                                                kv_type };
    // Blocks of consecutive items of one sequence (a prompt): attention reads each key once per block.
    struct QueryBlock {
        int64_t first;
        int     n;
    };
    std::vector<QueryBlock> blocks;
    for (int64_t i = 0; i < n; ++i) {
        QueryBlock * last = blocks.empty() ? nullptr : &blocks.back();
        if (last != nullptr && last->n < cpu::kMaxAttentionBlock && item_seq[last->first] == item_seq[i] &&
            positions[last->first] + last->n == positions[i]) {
            ++last->n;
        } else {
            blocks.push_back(QueryBlock{ i, 1 });
        }
    }
    const int     nth            = pool_.size();
    const int64_t scratch_floats = cpu::attention_block_scratch_floats(shape, cpu::kMaxAttentionBlock, max_visible);
    std::vector<float> scratch(static_cast<size_t>(scratch_floats * nth));

    for (int64_t il = 0; il < p_.n_layer; ++il) {
        const Layer & L = layers_[static_cast<size_t>(il)];
        for (int64_t i = 0; i < n; ++i) {
            cpu::rms_norm(&x[i * E], L.attn_norm.data(), &xn[i * E], E, p_.rms_eps);
        }
        {
            const cpu::WeightView qkv[3] = { L.wq, L.wk, L.wv };
            float * const         out[3] = { q.data(), k.data(), v.data() };
            cpu::matmul_multi(qkv, out, 3, xn.data(), n, pool_);
        }
        // Biases, RoPE and the KV write, token by token; a decode step's few tokens are not worth a pool round.
        const auto finish_qkv = [&](long long b, long long e) {
            for (long long i = b; i < e; ++i) {
                float * qi = &q[i * qd];
                float * ki = &k[i * kd];
                float * vi = &v[i * kd];
                if (p_.has_qkv_bias) {
                    add_rows(qi, L.bq.data(), qd);
                    add_rows(ki, L.bk.data(), kd);
                    add_rows(vi, L.bv.data(), kd);
                }
                rope_.apply_cs(qi, static_cast<int>(H), static_cast<int>(hd), &cq[i * half], &sq[i * half]);
                rope_.apply_cs(ki, static_cast<int>(KVH), static_cast<int>(hd), &ck[i * half], &sk[i * half]);
                const KvSlot & slot = slots[static_cast<size_t>(i)];
                cpu::kv_store_row(kv_type, ki, slot.span->k_row(static_cast<int>(il), slot.row), kd);
                cpu::kv_store_row(kv_type, vi, slot.span->v_row(static_cast<int>(il), slot.row), kd);
            }
        };
        if (n < pool_.size() * 4) {
            finish_qkv(0, n);
        } else {
            pool_.run([&](int ith, int nth_) {
                long long b, e;
                cpu::split_range(n, ith, nth_, b, e);
                finish_qkv(b, e);
            });
        }
        for (size_t s = 0; s < seq_ids.size(); ++s) {
            kv_->runs(seq_ids[s], static_cast<int>(il), runs[s]);
        }
        cpu::AttentionShape layer_shape = shape;
        layer_shape.window              = p_.layer_window[static_cast<size_t>(il)];
        const long long n_tasks         = static_cast<long long>(blocks.size()) * H;  // (block, head) pairs
        pool_.run([&](int ith, int nth_) {
            long long b, e;
            cpu::split_range(n_tasks, ith, nth_, b, e);
            float * scr = &scratch[static_cast<size_t>(ith) * scratch_floats];
            for (long long t = b; t < e;) {
                const QueryBlock & blk = blocks[static_cast<size_t>(t / H)];
                const int          h0  = static_cast<int>(t % H);
                const int          h1  = static_cast<int>(std::min<long long>(H, h0 + (e - t)));
                const auto &       r   = runs[static_cast<size_t>(item_seq[blk.first])];
                cpu::attend_block(layer_shape, rope_, &q[blk.first * qd], qd, blk.n, r.data(),
                                  static_cast<int>(r.size()), positions[blk.first] + 1, h0, h1, &att[blk.first * qd],
                                  qd, scr);
                t += h1 - h0;
            }
        });
        cpu::matmul(L.wo, att.data(), tmp.data(), n, pool_);
        add_rows(x.data(), tmp.data(), n * E);
        for (int64_t i = 0; i < n; ++i) {
            cpu::rms_norm(&x[i * E], L.ffn_norm.data(), &xn[i * E], E, p_.rms_eps);
        }
        {
            const cpu::WeightView gate_up[2] = { L.w_gate, L.w_up };
            float * const         out[2]     = { g.data(), u.data() };
            cpu::matmul_multi(gate_up, out, 2, xn.data(), n, pool_);
        }
        if (n < pool_.size() * 4) {  // element-wise: a decode step's few rows are not worth a pool round
            cpu::silu_mul(g.data(), u.data(), g.data(), n * F);
        } else {
            pool_.run([&](int ith, int nth_) {
                long long b, e;
                cpu::split_range(n, ith, nth_, b, e);
                cpu::silu_mul(&g[b * F], &u[b * F], &g[b * F], (e - b) * F);
            });
        }
        cpu::matmul(L.w_down, g.data(), tmp.data(), n, pool_);
        add_rows(x.data(), tmp.data(), n * E);
    }
    std::vector<float> last;
    for (int64_t i = 0; i < n; ++i) {
        if (batch.items[static_cast<size_t>(i)].want_logits) {
            last.resize(last.size() + E);
            cpu::rms_norm(&x[i * E], output_norm_.data(), &last[last.size() - E], E, p_.rms_eps);
        }
    }
    const int64_t n_out = static_cast<int64_t>(last.size()) / E;
    logits.assign(static_cast<size_t>(n_out * p_.n_vocab), 0.0f);
    if (n_out > 0) {
        cpu::matmul(output_, last.data(), logits.data(), n_out, pool_);
    }
}

void Model::read_kv(int32_t seq, int32_t pos, int32_t n, float * k_out, float * v_out) {
    const int32_t len = kv_->seq_length(seq);
    KC_CHECK(pos >= 0 && n >= 0 && static_cast<int64_t>(pos) + n <= len,
             "positions [%d, %d) are outside sequence %d (length %d)", pos, pos + n, seq, len);
    const int64_t           kd = p_.n_head_kv * p_.head_dim;
    const int               hd = static_cast<int>(p_.head_dim), n_kv = static_cast<int>(p_.n_head_kv);
    const cpu::KvType       kv_type   = kv_->pool().layout().kv_type;
    const int64_t           row_bytes = kd * static_cast<int64_t>(cpu::kv_type_size(kv_type));
    std::vector<cpu::KvRun> runs;
    for (int il = 0; il < p_.n_layer; ++il) {
        kv_->runs(seq, il, runs);
        int64_t at = 0;  // sequence position of the run's first row
        for (const cpu::KvRun & r : runs) {
            for (int32_t j = 0; j < r.n; ++j) {
                const int64_t p = at + j;
                if (p < pos || p >= pos + n) {
                    continue;
                }
                float * k = k_out + (static_cast<int64_t>(il) * n + (p - pos)) * kd;
                float * v = v_out + (static_cast<int64_t>(il) * n + (p - pos)) * kd;
                cpu::kv_load_row(kv_type, static_cast<const uint8_t *>(r.k) + j * row_bytes, k, kd);
                cpu::kv_load_row(kv_type, static_cast<const uint8_t *>(r.v) + j * row_bytes, v, kd);
                for (int32_t c = 0; c < r.rank; ++c) {
                    const float ak = r.a_k[j * r.rank + c], av = r.a_v[j * r.rank + c];
                    for (int64_t d = 0; d < kd; ++d) {
                        k[d] += ak * r.b_k[c * kd + d];
                        v[d] += av * r.b_v[c * kd + d];
                    }
                }
                if (r.shift != 0) {
                    rope_.apply(k, n_kv, hd, static_cast<double>(r.shift));
                }
            }
            at += r.n;
        }
    }
}

}  // namespace kvcmas
