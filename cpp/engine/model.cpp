#include "engine/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "common/error.h"
#include "engine/gguf-names.h"
#include "engine/kv-materialize.h"
#include "engine/ridge-correction.h"
#include "engine/tensor-loader.h"

namespace kvcmas {

namespace names = gguf_names;

Model::Model(const std::string & path, int n_threads, int n_ctx, size_t kv_budget_bytes, cpu::KvType kv_type,
             const std::string & device, cpu::Activations activations)
    : file_(std::make_unique<gguf::GgufFile>(path)), kv_type_(kv_type) {
    load_params();
    KC_CHECK(kv_type == cpu::KvType::F32 || kv_type == cpu::KvType::F16, "unknown KV type %d",
             static_cast<int>(kv_type));
    if (n_ctx <= 0) {
        n_ctx = static_cast<int>(std::min<int64_t>(p_.n_ctx_train > 0 ? p_.n_ctx_train : 8192, 8192));
    }
    KC_CHECK(n_ctx <= (1 << 24), "n_ctx %d is too large", n_ctx);
    n_ctx_ = n_ctx;
    make_ropes();
    backend_ = backend::make_backend(device, n_threads);
    backend_->set_activations(activations);
    load_weights();
    KvLayout layout{ static_cast<int>(p_.n_layer), static_cast<int>(p_.n_head_kv * p_.head_dim), kv_type };
    if (kv_budget_bytes == 0) {
        const size_t blocks = static_cast<size_t>((n_ctx + kKvBlockRows - 1) / kKvBlockRows) + 1;
        kv_budget_bytes     = 4 * blocks * static_cast<size_t>(layout.n_layer) * 2 * kKvBlockRows * layout.n_kv_dim *
                              cpu::kv_type_size(kv_type);
    }
    kv_ = std::make_unique<KvCache>(*backend_, layout, kv_budget_bytes, n_ctx);
}

Model::~Model() = default;

void Model::load_params() {
    const gguf::GgufFile & f = *file_;
    p_.arch                  = f.get_string(names::kKeyArchitecture);
    arch_                    = find_architecture(p_.arch);
    KC_CHECK(arch_ != nullptr, "%s: unsupported architecture '%s' (kvcmas runs %s)", f.path().c_str(), p_.arch.c_str(),
             architecture_names().c_str());
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
    load_rope_scaling();
    load_sliding_window();
    p_.layer_rope.assign(static_cast<size_t>(p_.n_layer), LayerRope::Global);
    p_.rope_base_swa = f.get_float(a + names::kArchKeyRopeFreqBaseSwa, p_.rope_base_swa);
    p_.logit_softcap = static_cast<float>(f.get_float(a + names::kArchKeyFinalLogitSoftcapping, 0.0));
    KC_CHECK(std::isfinite(p_.logit_softcap) && p_.logit_softcap >= 0.0f, "%s: final_logit_softcapping %g is invalid",
             path, static_cast<double>(p_.logit_softcap));
    arch_->configure(p_, f);
    KC_CHECK(std::isfinite(p_.rope_base_swa) && p_.rope_base_swa > 1.0, "%s: rope.freq_base_swa %g out of range", path,
             p_.rope_base_swa);
    KC_CHECK(p_.layer_rope.size() == static_cast<size_t>(p_.n_layer) &&
                 p_.layer_window.size() == static_cast<size_t>(p_.n_layer),
             "%s: architecture %s set per-layer settings for the wrong layer count", path, p_.arch.c_str());
    const gguf::TensorInfo * emb = f.find_tensor(names::kTensorTokenEmbd);
    KC_CHECK(emb != nullptr, "%s: tensor '%s' is missing", path, names::kTensorTokenEmbd);
    KC_CHECK(emb->ne.size() == 2 && emb->ne[0] == p_.n_embd, "%s: tensor '%s' has the wrong shape", path,
             names::kTensorTokenEmbd);
    p_.n_vocab     = emb->ne[1];
    p_.tied_output = f.find_tensor(names::kTensorOutput) == nullptr;
}

void Model::load_rope_scaling() {
    const gguf::GgufFile & f    = *file_;
    const std::string      a    = p_.arch + ".";
    const char *           path = f.path().c_str();
    const gguf::Value *    st   = f.find(a + names::kArchKeyRopeScalingType);
    if (st == nullptr) {
        // llama.cpp's phi3 files carry LongRoPE as the two factor tensors without a scaling type
        if (f.find_tensor(names::kTensorRopeFactorsLong) != nullptr) {
            p_.rope_scaling = "longrope";
        }
    } else {
        p_.rope_scaling = st->type == gguf::ValueType::STRING ? st->str : std::string("?");
    }
    const std::string & type = p_.rope_scaling;
    KC_CHECK(type == "none" || type == "linear" || type == "llama3" || type == "yarn" || type == "longrope",
             "%s: rope scaling '%s' is not supported (none, linear, llama3, yarn, longrope)", path, type.c_str());
    if (type == "linear" || type == "yarn") {
        p_.rope_factor = f.get_float(a + names::kArchKeyRopeScalingFactor);
        KC_CHECK(std::isfinite(p_.rope_factor) && p_.rope_factor > 0.0, "%s: rope.scaling.factor %g out of range", path,
                 p_.rope_factor);
        if (type == "linear") {
            p_.rope_scale = 1.0 / p_.rope_factor;
        }
    }
    if (type == "yarn" || type == "longrope") {
        p_.rope_orig_ctx = f.get_int(a + names::kArchKeyRopeScalingOrigCtx, p_.n_ctx_train);
        KC_CHECK(p_.rope_orig_ctx > 0 && p_.rope_orig_ctx <= (int64_t{ 1 } << 31),
                 "%s: rope.scaling.original_context_length %lld out of range", path,
                 static_cast<long long>(p_.rope_orig_ctx));
    }
    if (type == "yarn") {
        p_.yarn_beta_fast = f.get_float(a + names::kArchKeyRopeScalingYarnBetaFast, 32.0);
        p_.yarn_beta_slow = f.get_float(a + names::kArchKeyRopeScalingYarnBetaSlow, 1.0);
        // YaRN's mscale (0.1 ln(factor) + 1) unless the file names its own factor
        const double mscale = p_.rope_factor > 1.0 ? 0.1 * std::log(p_.rope_factor) + 1.0 : 1.0;
        p_.rope_attn_factor = f.get_float(a + names::kArchKeyRopeScalingAttnFactor, mscale);
    }
    if (type == "longrope") {
        // factor: the extension the long factors were fitted for; attention factor as LongRoPE defines it
        const double factor = static_cast<double>(p_.n_ctx_train) / static_cast<double>(p_.rope_orig_ctx);
        const double scale =
            factor <= 1.0 ? 1.0 : std::sqrt(1.0 + std::log(factor) / std::log(static_cast<double>(p_.rope_orig_ctx)));
        p_.rope_factor      = factor;
        p_.rope_attn_factor = f.get_float(a + names::kArchKeyRopeScalingAttnFactor, scale);
    }
    KC_CHECK(std::isfinite(p_.rope_attn_factor) && p_.rope_attn_factor > 0.0 && std::isfinite(p_.yarn_beta_fast) &&
                 std::isfinite(p_.yarn_beta_slow),
             "%s: rope scaling parameters out of range", path);
}

// The inverse frequencies of one kind of layer.
void Model::make_ropes() {
    const gguf::GgufFile & f    = *file_;
    const char *           path = f.path().c_str();
    const int64_t          half = p_.n_rot / 2;
    const TensorLoader     loader(f);
    ropes_.assign(3, cpu::Rope{});
    // llama3: per-frequency divisors; longrope: the long factors when the context reaches past the original one
    // (as llama.cpp picks them: one choice for the whole context, so a span reads the same at any position).
    const char * factor_name = names::kTensorRopeFreqs;
    if (p_.rope_scaling == "longrope") {
        factor_name = n_ctx_ > p_.rope_orig_ctx ? names::kTensorRopeFactorsLong : names::kTensorRopeFactorsShort;
    }
    const std::vector<float> factors = loader.vector_f32(factor_name, half, p_.rope_scaling == "longrope");
    for (size_t j = 0; j < factors.size(); ++j) {
        KC_CHECK(std::isfinite(factors[j]) && factors[j] > 0.0f, "%s: %s[%zu] = %g is invalid", path, factor_name, j,
                 static_cast<double>(factors[j]));
    }
    for (const LayerRope kind : { LayerRope::Global, LayerRope::Sliding }) {
        cpu::Rope & r = ropes_[static_cast<size_t>(kind)];
        r.n_rot       = static_cast<int>(p_.n_rot);
        r.neox        = p_.rope_neox;
        r.inv_freq.resize(static_cast<size_t>(half));
        const bool   global = kind == LayerRope::Global;
        const double base   = global ? p_.rope_base : p_.rope_base_swa;
        // YaRN ramp between interpolated (j >= high) and extrapolated (j <= low) frequencies
        double low = 0.0, high = 0.0;
        if (global && p_.rope_scaling == "yarn") {
            const double dim  = static_cast<double>(p_.n_rot);
            const auto   corr = [&](double rotations) {
                return dim * std::log(static_cast<double>(p_.rope_orig_ctx) / (rotations * 2.0 * M_PI)) /
                       (2.0 * std::log(base));
            };
            low  = corr(p_.yarn_beta_fast);
            high = corr(p_.yarn_beta_slow);
            if (p_.yarn_truncate) {
                low  = std::floor(low);
                high = std::ceil(high);
            }
            low  = std::max(0.0, low);
            high = std::min(dim - 1.0, high);
            if (low == high) {
                high += 0.001;
            }
        }
        for (int64_t j = 0; j < half; ++j) {
            double inv = std::pow(base, -2.0 * static_cast<double>(j) / static_cast<double>(p_.n_rot));
            if (global && !factors.empty()) {
                inv /= factors[static_cast<size_t>(j)];
            }
            if (global && p_.rope_scaling == "yarn") {
                const double ramp   = std::min(1.0, std::max(0.0, (static_cast<double>(j) - low) / (high - low)));
                const double extrap = 1.0 - ramp;
                inv                 = inv / p_.rope_factor * (1.0 - extrap) + inv * extrap;
            }
            r.inv_freq[static_cast<size_t>(j)] = static_cast<float>(global ? inv * p_.rope_scale : inv);
        }
    }
    ropes_[static_cast<size_t>(LayerRope::None)].neox = p_.rope_neox;  // n_rot 0: rotates nothing
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

void Model::load_weights() {
    const TensorLoader loader(*file_);
    const int64_t      E    = p_.n_embd;
    const auto         load = [&](const cpu::WeightView & w) {
        return backend_->upload_weight(w.type, w.data, w.n_in, w.n_out, w.row_bytes);
    };
    tok_embd_    = load(loader.matrix(names::kTensorTokenEmbd, E, p_.n_vocab));
    output_      = p_.tied_output ? tok_embd_ : load(loader.matrix(names::kTensorOutput, E, p_.n_vocab));
    output_norm_ = backend::upload_floats(*backend_, loader.vector_f32(names::kTensorOutputNorm, E, true));
    // A backend that copies the weights (the CPU one, onto huge pages) no longer reads the mapping's pages: they are
    // dropped after every layer, so the process never holds both copies of the whole file.
    const bool copied = tok_embd_.data != loader.matrix(names::kTensorTokenEmbd, E, p_.n_vocab).data;
    layers_.resize(static_cast<size_t>(p_.n_layer));
    for (int64_t il = 0; il < p_.n_layer; ++il) {
        if (copied) {
            file_->release_resident();
        }
        arch_->load_layer(loader, *backend_, p_, static_cast<int>(il), layers_[static_cast<size_t>(il)]);
    }
    if (copied) {
        file_->release_resident();
    }
}

std::vector<float> Model::decode(const Batch & batch) {
    std::lock_guard<std::mutex> lock(mutex_);
    KC_CHECK(!batch.items.empty(), "decode: the batch is empty");
    KC_CHECK(batch.rope_offsets == nullptr || !p_.rope_sections.empty(),
             "decode: M-RoPE offsets given, but architecture '%s' has one position per token", p_.arch.c_str());
    std::map<int32_t, int32_t> count, length, fill;  // per sequence: items, rows before, reserved rows they fill
    std::vector<int32_t>       order;                // sequences by first appearance
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
    for (const auto & [first, end] : batch.bidirectional) {
        KC_CHECK(first >= 0 && first < end && end <= static_cast<int64_t>(batch.items.size()),
                 "decode: bidirectional span [%lld, %lld) is outside the batch's %zu items",
                 static_cast<long long>(first), static_cast<long long>(end), batch.items.size());
        for (int64_t i = first + 1; i < end; ++i) {
            KC_CHECK(batch.items[static_cast<size_t>(i)].seq == batch.items[static_cast<size_t>(first)].seq,
                     "decode: bidirectional span [%lld, %lld) holds items of several sequences",
                     static_cast<long long>(first), static_cast<long long>(end));
        }
    }
    for (int32_t s : order) {
        const auto r = reserved_.find(s);
        fill[s]      = r == reserved_.end() ? 0 : std::min(count[s], static_cast<int32_t>(r->second.size()));
        KC_CHECK(static_cast<int64_t>(length[s]) + count[s] - fill[s] <= kv_->n_ctx_max(),
                 "context overflow: sequence %d has %d tokens, %d more exceed n_ctx = %d", s, length[s],
                 count[s] - fill[s], kv_->n_ctx_max());
    }
    std::vector<float> logits;
    try {
        std::map<int32_t, std::vector<KvSlot>> seq_slots;
        for (int32_t s : order) {
            if (count[s] > fill[s]) {
                seq_slots[s] = kv_->append(s, count[s] - fill[s]);
            }
        }
        std::vector<KvSlot>        slots;
        std::vector<int32_t>       positions;
        std::map<int32_t, int32_t> used;
        for (const BatchItem & it : batch.items) {
            const int32_t i = used[it.seq]++;
            if (i < fill[it.seq]) {
                const auto & row = reserved_[it.seq][static_cast<size_t>(i)];
                slots.push_back(row.first);
                positions.push_back(row.second);
            } else {
                slots.push_back(seq_slots[it.seq][static_cast<size_t>(i - fill[it.seq])]);
                positions.push_back(length[it.seq] + i - fill[it.seq]);
            }
        }
        for (const auto & [first, end] : batch.bidirectional) {
            for (int64_t i = first + 1; i < end; ++i) {
                KC_CHECK(positions[static_cast<size_t>(i)] == positions[static_cast<size_t>(i - 1)] + 1,
                         "decode: bidirectional span [%lld, %lld) is not at consecutive positions",
                         static_cast<long long>(first), static_cast<long long>(end));
            }
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
    for (int32_t s : order) {
        if (fill[s] > 0) {
            auto & rows = reserved_[s];
            rows.erase(rows.begin(), rows.begin() + fill[s]);
            if (rows.empty()) {
                reserved_.erase(s);
            }
        }
    }
    return logits;
}

// M-RoPE: pair j rotates by component c(j) of (pos + offsets[0], pos + offsets[1], pos + offsets[2]), c(j) the
// section (p.rope_sections) pair j falls in.
void Model::mrope_angles(const cpu::Rope & rope, int32_t pos, const int32_t * offsets, float * cos_out,
                         float * sin_out) const {
    const int64_t      half = p_.n_rot / 2;
    std::vector<float> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
    int64_t            j = 0;
    for (int comp = 0; comp < 3; ++comp) {
        rope.angles(static_cast<double>(pos) + offsets[comp], c.data(), s.data());
        for (int64_t end = j + p_.rope_sections[static_cast<size_t>(comp)]; j < end; ++j) {
            cos_out[j] = c[static_cast<size_t>(j)];
            sin_out[j] = s[static_cast<size_t>(j)];
        }
    }
}

void Model::forward(const Batch & batch, const std::vector<KvSlot> & slots, const std::vector<int32_t> & positions,
                    std::vector<float> & logits) {
    backend::Backend & be = *backend_;
    const int64_t      n  = static_cast<int64_t>(batch.items.size());
    const int64_t      E = p_.n_embd, H = p_.n_head, hd = p_.head_dim, KVH = p_.n_head_kv, F = p_.n_ff;
    const int64_t      qd = H * hd, kd = KVH * hd, half = p_.n_rot / 2;
    const auto         floats = [&](int64_t count) { return backend::Buffer(be, sizeof(float) * count); };

    ForwardState st(be, p_, ropes_, *kv_, kv_->pool().store(), n);
    const double scale = p_.attn_scale > 0.0 ? p_.attn_scale : 1.0 / std::sqrt(static_cast<double>(hd));
    st.shape           = cpu::AttentionShape{ static_cast<int>(H),       static_cast<int>(KVH),
                                              static_cast<int>(hd),      kd,
                                              static_cast<float>(scale), kv_type_ };
    st.x               = floats(n * E);
    st.xn              = floats(n * E);
    st.q               = floats(n * qd);
    st.k               = floats(n * kd);
    st.v               = floats(n * kd);
    st.att             = floats(n * qd);
    st.tmp             = floats(n * E);
    st.g               = floats(n * F);
    st.u               = floats(n * F);

    std::vector<int32_t> tokens(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
        const BatchItem & it           = batch.items[static_cast<size_t>(i)];
        tokens[static_cast<size_t>(i)] = it.embd_row >= 0 ? -1 : it.token;
    }
    be.embed_rows(tok_embd_, tokens.data(), n, st.x.f32());
    if (p_.embd_scale != 1.0f) {
        be.scale(st.x.f32(), p_.embd_scale, n * E);  // embedding hook (gemma): token embeddings only
    }
    for (int64_t i = 0; i < n; ++i) {
        const BatchItem & it = batch.items[static_cast<size_t>(i)];
        if (it.embd_row >= 0) {
            be.upload(st.x.f32() + i * E, batch.embd + static_cast<int64_t>(it.embd_row) * E, sizeof(float) * E);
        }
    }

    // RoPE angles per kind of layer in use: queries at their positions, keys at their frame positions (equal
    // unless a span is shared).
    st.rope_tables.resize(ropes_.size());
    for (size_t r = 0; r < ropes_.size(); ++r) {
        if (std::find(p_.layer_rope.begin(), p_.layer_rope.end(), static_cast<LayerRope>(r)) == p_.layer_rope.end() ||
            ropes_[r].n_rot == 0) {
            continue;
        }
        std::vector<float> cq(n * half), sq(n * half), ck(n * half), sk(n * half);
        for (int64_t i = 0; i < n; ++i) {
            if (!p_.rope_sections.empty() && batch.rope_offsets != nullptr) {
                mrope_angles(ropes_[r], positions[i], &batch.rope_offsets[i * 3], &cq[i * half], &sq[i * half]);
                mrope_angles(ropes_[r], slots[i].frame_pos, &batch.rope_offsets[i * 3], &ck[i * half], &sk[i * half]);
                continue;
            }
            ropes_[r].angles(static_cast<double>(positions[i]), &cq[i * half], &sq[i * half]);
            ropes_[r].angles(static_cast<double>(slots[i].frame_pos), &ck[i * half], &sk[i * half]);
        }
        // yarn / longrope scale the rotated dims of q and k (not the rest of a partial rotation): stored keys keep
        // the factor, and a shift, a pure rotation, commutes with it
        if (static_cast<LayerRope>(r) == LayerRope::Global && p_.rope_attn_factor != 1.0) {
            const float f = static_cast<float>(p_.rope_attn_factor);
            for (std::vector<float> * t : { &cq, &sq, &ck, &sk }) {
                for (float & x : *t) {
                    x *= f;
                }
            }
        }
        st.rope_tables[r].cos_q = backend::upload_floats(be, cq);
        st.rope_tables[r].sin_q = backend::upload_floats(be, sq);
        st.rope_tables[r].cos_k = backend::upload_floats(be, ck);
        st.rope_tables[r].sin_k = backend::upload_floats(be, sk);
    }
    // Distinct sequences, and blocks of consecutive items of one sequence (a prompt): attention reads each key
    // once per block.
    std::map<int32_t, int32_t> seq_index;
    std::vector<int64_t>       visible_min(static_cast<size_t>(n), 0);  // a bidirectional span's items: its end
    for (const auto & [first, end] : batch.bidirectional) {
        for (int64_t i = first; i < end; ++i) {
            visible_min[static_cast<size_t>(i)] = positions[static_cast<size_t>(end - 1)] + 1;
        }
    }
    for (int64_t i = 0; i < n; ++i) {
        const int32_t s   = batch.items[static_cast<size_t>(i)].seq;
        auto          ins = seq_index.emplace(s, static_cast<int32_t>(st.seq_ids.size()));
        if (ins.second) {
            st.seq_ids.push_back(s);
        }
        const int     table = ins.first->second;
        const int64_t vmin  = visible_min[static_cast<size_t>(i)];
        st.max_visible      = std::max<int64_t>({ st.max_visible, positions[i] + 1, vmin });
        st.slots.push_back(slots[static_cast<size_t>(i)].ref);
        backend::QueryBlock * last = st.blocks.empty() ? nullptr : &st.blocks.back();
        if (last != nullptr && last->nq < cpu::kMaxAttentionBlock && last->table == table &&
            positions[last->first] + last->nq == positions[i] && last->n_visible_min == vmin) {
            ++last->nq;
        } else {
            st.blocks.push_back(backend::QueryBlock{ i, 1, positions[i] + 1, table, vmin });
        }
    }
    st.tables.resize(st.seq_ids.size());
    // The rows of each adapter in use, in batch order, with their sequences' scales.
    std::map<int32_t, size_t> lora_index;
    for (int64_t i = 0; i < n; ++i) {
        const auto ad = seq_adapters_.find(batch.items[static_cast<size_t>(i)].seq);
        if (ad == seq_adapters_.end()) {
            continue;
        }
        const auto ins = lora_index.emplace(ad->second.first, st.lora.size());
        if (ins.second) {
            st.lora.push_back(ForwardState::LoraRows{ adapters_.at(ad->second.first).get(), {}, {} });
        }
        st.lora[ins.first->second].rows.push_back(static_cast<int32_t>(i));
        st.lora[ins.first->second].scales.push_back(ad->second.second);
    }

    for (int64_t il = 0; il < p_.n_layer; ++il) {
        st.layer = static_cast<int>(il);
        arch_->forward_layer(st, static_cast<int>(il), layers_[static_cast<size_t>(il)]);
    }

    int64_t n_out = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (batch.items[static_cast<size_t>(i)].want_logits) {
            be.rms_norm(st.x.f32() + i * E, output_norm_.f32(), st.xn.f32() + n_out * E, 1, E, p_.rms_eps);
            ++n_out;
        }
    }
    logits.assign(static_cast<size_t>(n_out * p_.n_vocab), 0.0f);
    if (n_out > 0) {
        backend::Buffer out = floats(n_out * p_.n_vocab);
        be.matmul(output_, st.xn.f32(), out.f32(), n_out);
        be.download(logits.data(), out.data(), logits.size() * sizeof(float));
    }
    if (p_.logit_softcap > 0.0f) {  // output hook: c·tanh(logits / c)
        const float c = p_.logit_softcap;
        for (float & l : logits) {
            l = c * std::tanh(l / c);
        }
    }
}

void Model::read_kv(int32_t seq, int32_t pos, int32_t n, float * k_out, float * v_out) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int32_t               len = kv_->seq_length(seq);
    KC_CHECK(pos >= 0 && n >= 0 && static_cast<int64_t>(pos) + n <= len,
             "positions [%d, %d) are outside sequence %d (length %d)", pos, pos + n, seq, len);
    check_filled(seq, pos, n, "read_kv");
    const int64_t             kd    = p_.n_head_kv * p_.head_dim;
    const backend::KvStore    store = kv_->pool().store();
    const cpu::AttentionShape shape{
        static_cast<int>(p_.n_head), static_cast<int>(p_.n_head_kv), static_cast<int>(p_.head_dim), kd, 1.0f, kv_type_
    };
    backend::RunTable table;
    for (int il = 0; il < p_.n_layer; ++il) {
        kv_->runs(seq, il, table);
        int64_t at = 0;  // sequence position of the run's first row
        for (size_t r = 0; r < table.runs.size(); ++r) {
            const int64_t j0 = std::max<int64_t>(0, pos - at);
            const int64_t j1 = std::min<int64_t>(table.runs[r].n, static_cast<int64_t>(pos) + n - at);
            if (j0 < j1) {
                const int64_t out_row = static_cast<int64_t>(il) * n + (at + j0 - pos);
                backend_->kv_read(rope(il), shape, store, il, table, static_cast<int>(r), static_cast<int32_t>(j0),
                                  static_cast<int32_t>(j1), k_out + out_row * kd, v_out + out_row * kd);
            }
            at += table.runs[r].n;
        }
    }
}

#define KC_LOCKED std::lock_guard<std::mutex> lock(mutex_)

int32_t Model::seq_new() {
    KC_LOCKED;
    return kv_->seq_new();
}
int32_t Model::seq_fork(int32_t src) {
    KC_LOCKED;
    const auto r = reserved_.find(src);
    KC_CHECK(r == reserved_.end(), "seq_fork: sequence %d has %d reserved rows not yet computed", src,
             r == reserved_.end() ? 0 : static_cast<int>(r->second.size()));
    const int32_t child = kv_->seq_fork(src);
    const auto    ad    = seq_adapters_.find(src);
    if (ad != seq_adapters_.end()) {
        seq_adapters_[child] = ad->second;
    }
    return child;
}
void Model::seq_truncate(int32_t seq, int32_t n) {
    KC_LOCKED;
    kv_->seq_truncate(seq, n);
    const auto r = reserved_.find(seq);
    if (r != reserved_.end()) {
        auto & rows = r->second;
        while (!rows.empty() && rows.back().second >= n) {
            rows.pop_back();
        }
        if (rows.empty()) {
            reserved_.erase(r);
        }
    }
}
void Model::seq_remove(int32_t seq) {
    KC_LOCKED;
    kv_->seq_remove(seq);
    reserved_.erase(seq);
    seq_adapters_.erase(seq);
}
void Model::seq_reserve(int32_t seq, int32_t n) {
    KC_LOCKED;
    KC_CHECK(kv_->seq_exists(seq), "seq_reserve: no sequence with id %d", seq);
    KC_CHECK(n > 0, "seq_reserve: n must be > 0, got %d", n);
    const int32_t length = kv_->seq_length(seq);
    KC_CHECK(static_cast<int64_t>(length) + n <= kv_->n_ctx_max(),
             "context overflow: sequence %d has %d tokens, %d more exceed n_ctx = %d", seq, length, n,
             kv_->n_ctx_max());
    const std::vector<KvSlot> slots = kv_->append(seq, n);
    auto &                    rows  = reserved_[seq];
    for (int32_t i = 0; i < n; ++i) {
        rows.emplace_back(slots[static_cast<size_t>(i)], length + i);
    }
}
int32_t Model::seq_reserved(int32_t seq) {
    KC_LOCKED;
    const auto r = reserved_.find(seq);
    return r == reserved_.end() ? 0 : static_cast<int32_t>(r->second.size());
}
void Model::check_filled(int32_t seq, int32_t pos, int32_t n, const char * what) const {
    const auto r = reserved_.find(seq);
    if (r == reserved_.end()) {
        return;
    }
    for (const auto & row : r->second) {
        KC_CHECK(row.second < pos || row.second >= pos + n,
                 "%s: position %d of sequence %d is reserved and not yet computed", what, row.second, seq);
    }
}
int32_t Model::seq_length(int32_t seq) {
    KC_LOCKED;
    return kv_->seq_length(seq);
}
bool Model::seq_exists(int32_t seq) {
    KC_LOCKED;
    return kv_->seq_exists(seq);
}
size_t Model::n_seqs() {
    KC_LOCKED;
    return kv_->n_seqs();
}
KvSegment Model::seq_span(int32_t seq, int32_t pos, int32_t n) {
    KC_LOCKED;
    check_filled(seq, pos, n, "seq_span");
    return kv_->seq_span(seq, pos, n);
}
void Model::seq_append_span(int32_t seq, KvSegment rows, std::shared_ptr<const KvCorrection> corr, int32_t corr_row0) {
    KC_LOCKED;
    kv_->seq_append_span(seq, std::move(rows), std::move(corr), corr_row0);
}
std::vector<SegmentInfo> Model::seq_segments(int32_t seq) {
    KC_LOCKED;
    std::vector<SegmentInfo>          out;
    std::vector<const KvCorrection *> counted;  // a correction read by several segments is held once
    int32_t                           pos0 = 0;
    const std::vector<KvSegment> &    segs = kv_->seq_segments(seq);
    for (const KvSegment & seg : segs) {
        const long own_refs =
            std::count_if(segs.begin(), segs.end(), [&](const KvSegment & s) { return s.span == seg.span; });
        size_t corr_bytes = 0;
        if (seg.corr != nullptr && std::find(counted.begin(), counted.end(), seg.corr.get()) == counted.end()) {
            counted.push_back(seg.corr.get());
            corr_bytes = seg.corr->bytes();
        }
        out.push_back(SegmentInfo{ pos0, seg.n, pos0 - seg.frame, seg.span.use_count() > own_refs, corr_bytes });
        pos0 += seg.n;
    }
    return out;
}
size_t Model::kv_bytes_in_use() const {
    return kv_->pool().bytes_in_use();  // the pool's own lock
}
size_t Model::kv_budget() const {
    return kv_->pool().budget_bytes();
}
size_t Model::kv_block_bytes() const {
    return kv_->pool().block_bytes();
}
size_t Model::kv_bytes_allocated() const {
    return kv_->pool().bytes_allocated();
}
size_t Model::kv_trim() {
    KC_LOCKED;
    return kv_->pool_trim();
}
std::shared_ptr<KvCorrection> Model::ridge_correction(const RidgeMaps & maps, int32_t seq, int32_t pos, int32_t n,
                                                      int32_t frame0, const KvCorrection * prev) {
    KC_LOCKED;
    check_filled(seq, pos, n, "ridge_correction");
    return kvcmas::ridge_correction(*this, maps, seq, pos, n, frame0, prev);
}
int32_t Model::materialize_last_segment(int32_t seq) {
    KC_LOCKED;
    if (kv_->seq_exists(seq) && !kv_->seq_segments(seq).empty()) {
        const int32_t n = kv_->seq_segments(seq).back().n;
        check_filled(seq, kv_->seq_length(seq) - n, n, "materialize");
    }
    return kvcmas::materialize_last_segment(*this, seq);
}

int32_t Model::load_adapter(const std::string & path) {
    KC_LOCKED;  // the backend is not used by two threads at once
    auto ad                  = std::make_shared<const LoraAdapter>(path, *file_, p_, *backend_);
    adapters_[next_adapter_] = std::move(ad);
    return next_adapter_++;
}
void Model::unload_adapter(int32_t id) {
    KC_LOCKED;
    KC_CHECK(adapters_.count(id) != 0, "unload_adapter: no adapter with id %d", id);
    for (const auto & [seq, ad] : seq_adapters_) {
        KC_CHECK(ad.first != id, "unload_adapter: adapter %d is in use by sequence %d", id, seq);
    }
    adapters_.erase(id);
}
std::shared_ptr<const LoraAdapter> Model::adapter(int32_t id) {
    KC_LOCKED;
    const auto it = adapters_.find(id);
    KC_CHECK(it != adapters_.end(), "no adapter with id %d", id);
    return it->second;
}
void Model::seq_set_adapter(int32_t seq, int32_t id, float scale) {
    KC_LOCKED;
    KC_CHECK(kv_->seq_exists(seq), "seq_set_adapter: no sequence with id %d", seq);
    if (id < 0) {
        seq_adapters_.erase(seq);
        return;
    }
    KC_CHECK(adapters_.count(id) != 0, "seq_set_adapter: no adapter with id %d", id);
    KC_CHECK(std::isfinite(scale), "seq_set_adapter: the scale must be finite, got %g", static_cast<double>(scale));
    seq_adapters_[seq] = { id, scale };
}
std::pair<int32_t, float> Model::seq_adapter(int32_t seq) {
    KC_LOCKED;
    KC_CHECK(kv_->seq_exists(seq), "seq_adapter: no sequence with id %d", seq);
    const auto it = seq_adapters_.find(seq);
    return it == seq_adapters_.end() ? std::make_pair(-1, 0.0f) : it->second;
}

#undef KC_LOCKED

}  // namespace kvcmas
