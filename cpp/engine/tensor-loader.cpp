#include "engine/tensor-loader.h"

#include <cmath>

#include "backend/cpu/quants.h"
#include "common/error.h"

namespace kvcmas {

void TensorLoader::check_weight_type(const gguf::TensorInfo & t, int64_t row) const {
    const char *           path = file_.path().c_str();
    const GgmlTypeTraits * tr   = ggml_type_traits(static_cast<uint32_t>(t.type));
    // Files sold as Q3_K_M, Q2_K, IQ4_XS ... hold types without kernels here: say which files do run.
    KC_CHECK(tr != nullptr && tr->weight,
             "%s: tensor '%s' has type %s, which kvcmas does not run (its weight types: %s); a Q4_K_M, Q5_K_M, "
             "Q6_K or Q8_0 file of the model works",
             path, t.name.c_str(), ggml_type_name(static_cast<uint32_t>(t.type)), ggml_weight_type_names());
    KC_CHECK(row % tr->block == 0, "%s: tensor '%s' has type %s, whose rows are whole %lld-element blocks, not %lld",
             path, t.name.c_str(), tr->name, static_cast<long long>(tr->block), static_cast<long long>(row));
}

cpu::WeightView TensorLoader::matrix(const std::string & name, int64_t n_in, int64_t n_out) const {
    const char *             path = file_.path().c_str();
    const gguf::TensorInfo * t    = file_.find_tensor(name);
    KC_CHECK(t != nullptr, "%s: tensor '%s' is missing", path, name.c_str());
    int64_t inner = 1;
    for (size_t i = 0; i + 1 < t->ne.size(); ++i) {
        inner *= t->ne[i];
    }
    KC_CHECK(t->ne.size() >= 2 && inner == n_in && t->ne.back() == n_out,
             "%s: tensor '%s' should have shape [%lld, %lld] (%lld rows of %lld elements)", path, name.c_str(),
             static_cast<long long>(n_in), static_cast<long long>(n_out), static_cast<long long>(n_out),
             static_cast<long long>(n_in));
    check_weight_type(*t, n_in);
    return cpu::WeightView{ t->type, t->data, n_in, n_out, ggml_row_bytes(t->type, n_in) };
}

cpu::WeightView TensorLoader::matrices(const std::string & name, int64_t n_in, int64_t n_out, int64_t n_mat) const {
    const char *             path = file_.path().c_str();
    const gguf::TensorInfo * t    = file_.find_tensor(name);
    KC_CHECK(t != nullptr, "%s: tensor '%s' is missing", path, name.c_str());
    KC_CHECK(t->ne.size() == 3 && t->ne[0] == n_in && t->ne[1] == n_out && t->ne[2] == n_mat,
             "%s: tensor '%s' should have shape [%lld, %lld, %lld] (%lld matrices of %lld rows of %lld elements)", path,
             name.c_str(), static_cast<long long>(n_in), static_cast<long long>(n_out), static_cast<long long>(n_mat),
             static_cast<long long>(n_mat), static_cast<long long>(n_out), static_cast<long long>(n_in));
    check_weight_type(*t, n_in);
    return cpu::WeightView{ t->type, t->data, n_in, n_out * n_mat, ggml_row_bytes(t->type, n_in) };
}

std::vector<float> TensorLoader::vector_f32(const std::string & name, int64_t n, bool required) const {
    const char *             path = file_.path().c_str();
    const gguf::TensorInfo * t    = file_.find_tensor(name);
    if (t == nullptr) {
        KC_CHECK(!required, "%s: tensor '%s' is missing", path, name.c_str());
        return {};
    }
    KC_CHECK(t->n_elements() == n, "%s: tensor '%s' should have %lld elements, has %lld", path, name.c_str(),
             static_cast<long long>(n), static_cast<long long>(t->n_elements()));
    check_weight_type(*t, t->ne[0]);
    std::vector<float> out(static_cast<size_t>(n));
    cpu::dequantize_row(t->type, t->data, out.data(), n);
    for (int64_t i = 0; i < n; ++i) {
        KC_CHECK(std::isfinite(out[static_cast<size_t>(i)]), "%s: tensor '%s' holds a non-finite value", path,
                 name.c_str());
    }
    return out;
}

}  // namespace kvcmas
