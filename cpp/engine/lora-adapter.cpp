#include "engine/lora-adapter.h"

#include <cmath>
#include <cstring>
#include <map>

#include "common/error.h"
#include "engine/gguf-names.h"
#include "engine/tensor-loader.h"

namespace kvcmas {

namespace names = gguf_names;

namespace {

// The base matrix each target adapts, by its name under blk.<il>. (".weight" included).
struct TargetName {
    LoraTarget   target;
    const char * weight;
};
constexpr TargetName kTargetNames[kLoraTargets] = {
    { LoraTarget::Q, names::kBlkAttnQ },      { LoraTarget::K, names::kBlkAttnK },
    { LoraTarget::V, names::kBlkAttnV },      { LoraTarget::Output, names::kBlkAttnOutput },
    { LoraTarget::Gate, names::kBlkFfnGate }, { LoraTarget::Up, names::kBlkFfnUp },
    { LoraTarget::Down, names::kBlkFfnDown },
};
constexpr char kWeightSuffix[] = ".weight";

bool ends_with(const std::string & s, const char * suffix) {
    const size_t n = std::strlen(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

std::string target_list() {
    std::string out;
    for (const TargetName & t : kTargetNames) {
        const std::string w = t.weight;
        out += (out.empty() ? "" : ", ") + w.substr(0, w.size() - std::strlen(kWeightSuffix));
    }
    return out;
}

// The layer and target of a base tensor name "blk.<il>.<target>.weight"; false when it is not one.
bool parse_target(const std::string & base, int & il, LoraTarget & target) {
    const std::string prefix = names::kBlockPrefix;
    if (base.compare(0, prefix.size(), prefix) != 0) {
        return false;
    }
    const size_t dot = base.find('.', prefix.size());
    if (dot == std::string::npos || dot == prefix.size() || dot - prefix.size() > 6) {
        return false;
    }
    const std::string digits = base.substr(prefix.size(), dot - prefix.size());
    if (digits.find_first_not_of("0123456789") != std::string::npos) {
        return false;
    }
    il                     = std::stoi(digits);
    const std::string rest = base.substr(dot + 1);
    for (const TargetName & t : kTargetNames) {
        if (rest == t.weight) {
            target = t.target;
            return true;
        }
    }
    return false;
}

// The matmul a target adapts in the forward pass (decoder.h's steps): n_in, n_out.
void target_shape(const ModelParams & p, LoraTarget t, int64_t & n_in, int64_t & n_out) {
    const int64_t E = p.n_embd, qd = p.n_head * p.head_dim, kd = p.n_head_kv * p.head_dim, F = p.n_ff;
    switch (t) {
        case LoraTarget::Q:
            n_in = E, n_out = qd;
            break;
        case LoraTarget::K:
        case LoraTarget::V:
            n_in = E, n_out = kd;
            break;
        case LoraTarget::Output:
            n_in = qd, n_out = E;
            break;
        case LoraTarget::Gate:
        case LoraTarget::Up:
            n_in = E, n_out = F;
            break;
        case LoraTarget::Down:
            n_in = F, n_out = E;
            break;
    }
}

// How the factors of a target whose base matrix is of type `base` are stored (LoraPair).
backend::LoraFactorType factor_type_over(GgmlType base) {
    switch (base) {
        case GgmlType::F32:
            return backend::LoraFactorType::F32;
        case GgmlType::F16:
        case GgmlType::BF16:
            return backend::LoraFactorType::F16;
        default:
            return backend::LoraFactorType::I8;
    }
}

}  // namespace

LoraAdapter::LoraAdapter(const std::string & path, const gguf::GgufFile & base, const ModelParams & p,
                         backend::Backend & be)
    : path_(path) {
    const gguf::GgufFile f(path);
    const char *         where  = path.c_str();
    const gguf::Value *  type   = f.find(names::kKeyType);
    const std::string    type_s = type == nullptr                         ? std::string("(absent)")
                                  : type->type == gguf::ValueType::STRING ? type->str
                                                                          : "(not a string)";
    KC_CHECK(type_s == names::kTypeAdapter, "%s: not a LoRA adapter: %s is '%s', an adapter file has '%s'", where,
             names::kKeyType, type_s.c_str(), names::kTypeAdapter);
    const gguf::Value * kind = f.find(names::kKeyAdapterType);
    KC_CHECK(kind != nullptr && kind->type == gguf::ValueType::STRING && kind->str == names::kAdapterTypeLora,
             "%s: adapter type '%s' is not supported (kvcmas loads '%s' adapters)", where,
             kind == nullptr ? "(absent)" : kind->str.c_str(), names::kAdapterTypeLora);
    const std::string arch = f.get_string(names::kKeyArchitecture);
    KC_CHECK(arch == p.arch, "%s: the adapter is for architecture '%s', the base model %s is '%s'", where, arch.c_str(),
             base.path().c_str(), p.arch.c_str());
    const gguf::Value * alpha = f.find(names::kKeyAdapterLoraAlpha);
    KC_CHECK(alpha != nullptr && (alpha->type == gguf::ValueType::FLOAT32 || alpha->type == gguf::ValueType::FLOAT64 ||
                                  alpha->type == gguf::ValueType::UINT32 || alpha->type == gguf::ValueType::INT32),
             "%s: %s is missing (the update's scale is alpha / rank)", where, names::kKeyAdapterLoraAlpha);
    alpha_ = static_cast<float>(f.get_float(names::kKeyAdapterLoraAlpha));
    KC_CHECK(std::isfinite(alpha_) && alpha_ > 0.0f, "%s: %s = %g must be a positive number", where,
             names::kKeyAdapterLoraAlpha, static_cast<double>(alpha_));

    // Pair the tensors by target, every one checked before anything is read.
    struct Found {
        const gguf::TensorInfo * a = nullptr;
        const gguf::TensorInfo * b = nullptr;
        int                      il;
        LoraTarget               target;
    };
    std::map<std::string, Found> found;  // by base tensor name
    for (const gguf::TensorInfo & t : f.tensors()) {
        const bool is_a = ends_with(t.name, names::kLoraSuffixA), is_b = ends_with(t.name, names::kLoraSuffixB);
        KC_CHECK(is_a || is_b, "%s: tensor '%s' is not a LoRA factor (names end in %s / %s)", where, t.name.c_str(),
                 names::kLoraSuffixA, names::kLoraSuffixB);
        const std::string name = t.name.substr(0, t.name.size() - std::strlen(names::kLoraSuffixA));
        Found &           e    = found[name];
        KC_CHECK(parse_target(name, e.il, e.target),
                 "%s: tensor '%s' adapts '%s', which kvcmas does not adapt (targets: blk.<layer>.{%s}.weight)", where,
                 t.name.c_str(), name.c_str(), target_list().c_str());
        KC_CHECK(
            e.il < p.n_layer,
            "%s: tensor '%s' adapts layer %d, and the base model %s has %lld layers: the adapter is for another model",
            where, t.name.c_str(), e.il, base.path().c_str(), static_cast<long long>(p.n_layer));
        (is_a ? e.a : e.b) = &t;
    }
    KC_CHECK(!found.empty(), "%s: the adapter holds no LoRA tensors", where);
    layers_.resize(static_cast<size_t>(p.n_layer));
    const TensorLoader loader(f);
    for (const auto & [name, e] : found) {
        KC_CHECK(e.a != nullptr && e.b != nullptr, "%s: tensor '%s%s' has no '%s%s' beside it", where, name.c_str(),
                 e.a != nullptr ? names::kLoraSuffixA : names::kLoraSuffixB, name.c_str(),
                 e.a != nullptr ? names::kLoraSuffixB : names::kLoraSuffixA);
        const std::string &      weight = name;
        const gguf::TensorInfo * w      = base.find_tensor(weight);
        KC_CHECK(w != nullptr, "%s: the adapter adapts '%s', which the base model %s does not have", where,
                 weight.c_str(), base.path().c_str());
        const int64_t n_in = w->ne[0], n_out = w->ne.size() == 2 ? w->ne[1] : -1;
        int64_t       want_in = 0, want_out = 0;
        target_shape(p, e.target, want_in, want_out);
        KC_CHECK(n_in == want_in && n_out == want_out,
                 "%s: the adapter adapts '%s', which the base model %s stores fused or shaped otherwise than the "
                 "matmul kvcmas runs ([%lld, %lld]); adapters of this architecture's '%s' are not supported",
                 where, weight.c_str(), base.path().c_str(), static_cast<long long>(want_in),
                 static_cast<long long>(want_out), weight.c_str());
        const auto &a = e.a->ne, &b = e.b->ne;
        KC_CHECK(a.size() == 2 && b.size() == 2 && a[0] == n_in && b[1] == n_out && a[1] == b[0] && a[1] >= 1 &&
                     a[1] <= 65536,
                 "%s: '%s' [%lld, %lld] and '%s' [%lld, %lld] do not fit '%s' [%lld, %lld] of the base model (LoRA "
                 "wants A [n_in, rank] and B [rank, n_out], GGUF order)",
                 where, e.a->name.c_str(), static_cast<long long>(a[0]),
                 static_cast<long long>(a.size() > 1 ? a[1] : 1), e.b->name.c_str(), static_cast<long long>(b[0]),
                 static_cast<long long>(b.size() > 1 ? b[1] : 1), weight.c_str(), static_cast<long long>(n_in),
                 static_cast<long long>(n_out));
        auto pair   = std::make_unique<LoraPair>();
        pair->rank  = static_cast<int>(a[1]);
        pair->n_in  = n_in;
        pair->n_out = n_out;
        pair->type  = factor_type_over(w->type);
        backend::upload_lora_factor(be, loader.vector_f32(e.a->name, n_in * pair->rank, true).data(), pair->rank, n_in,
                                    pair->type, pair->a, pair->a_scale);
        const std::vector<float> b_rows = loader.vector_f32(e.b->name, n_out * pair->rank, true);  // [n_out][rank]
        std::vector<float>       b_t(b_rows.size());
        for (int64_t o = 0; o < n_out; ++o) {
            for (int c = 0; c < pair->rank; ++c) {
                b_t[static_cast<size_t>(c * n_out + o)] = b_rows[static_cast<size_t>(o * pair->rank + c)];
            }
        }
        backend::upload_lora_b(be, b_t.data(), pair->rank, n_out, pair->type, pair->b_t, pair->b_scale);
        bytes_ += pair->a.bytes() + pair->b_t.bytes() + pair->a_scale.bytes() + pair->b_scale.bytes();
        max_rank_ = std::max(max_rank_, pair->rank);
        ++n_pairs_;
        layers_[static_cast<size_t>(e.il)][static_cast<size_t>(e.target)] = std::move(pair);
    }
}

const LoraPair * LoraAdapter::pair(int il, LoraTarget t) const {
    return layers_[static_cast<size_t>(il)][static_cast<size_t>(t)].get();
}

void adapted_matmul(ForwardState & st, const float * in, std::initializer_list<LoraOutput> outputs) {
    const int       n_mats = static_cast<int>(outputs.size());
    backend::Weight w[kLoraTargets];
    float *         y[kLoraTargets];
    int             m = 0;
    for (const LoraOutput & out : outputs) {
        w[m]   = *out.w;
        y[m++] = out.y;
    }
    if (st.lora.empty()) {  // the base alone, as the decoder runs it without adapters
        if (n_mats == 1) {
            st.be.matmul(w[0], in, y[0], st.n);
        } else {
            st.be.matmul_multi(w, y, n_mats, in, st.n);
        }
        return;
    }
    // Reused between calls (a decode step makes hundreds): the groups of every output, then the products over them.
    thread_local std::vector<backend::LoraGroup>   groups;
    thread_local std::vector<backend::LoraProduct> products;
    groups.clear();
    products.clear();
    groups.reserve(outputs.size() * st.lora.size());  // no reallocation below: products point into it
    for (const LoraOutput & out : outputs) {
        const size_t first = groups.size();
        for (const ForwardState::LoraRows & lr : st.lora) {
            const LoraPair * pr = lr.adapter->pair(st.layer, out.target);
            if (pr == nullptr) {
                continue;
            }
            groups.push_back(backend::LoraGroup{ pr->a.data(), pr->b_t.data(), pr->type, pr->a_scale.f32(),
                                                 pr->b_scale.f32(), pr->rank,
                                                 lr.adapter->alpha() / static_cast<float>(pr->rank), lr.rows.data(),
                                                 lr.scales.data(), static_cast<int64_t>(lr.rows.size()) });
        }
        if (groups.size() > first) {
            products.push_back(
                backend::LoraProduct{ out.y, out.w->n_out, &groups[first], static_cast<int>(groups.size() - first) });
        }
    }
    st.be.matmul_multi_lora(w, y, n_mats, in, st.n, products.data(), static_cast<int>(products.size()));
}

}  // namespace kvcmas
