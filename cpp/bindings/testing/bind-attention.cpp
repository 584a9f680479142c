// Test entry point for the attention kernel: runs attend() on KV given as numpy arrays, so tests can compare the
// fused corrected kernel with a materializing numpy reference.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>

#include "bindings/bindings.h"
#include "bindings/testing/testing.h"
#include "common/error.h"
#include "backend/cpu/attention.h"

namespace nb = nanobind;

namespace kvcmas::py {

using Mat    = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Mat16  = nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;  // f16 bits
using MatOut = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

namespace {

// Rows given to the kernel are used in place: no implicit conversion (a converted copy would die with the cast).
template <typename M>
M rows_arg(nb::handle h, const char * name, const char * dtype) {
    try {
        return nb::cast<M>(h, false);
    } catch (const nb::cast_error &) {
        fail("attend_test: %s must be a C-contiguous 2-d %s array", name, dtype);
    }
}

struct TestRun {
    Mat                k, v;
    int32_t            shift = 0;
    std::optional<Mat> a_k, b_k, a_v, b_v;
};

MatOut attend_test(Mat q, const std::vector<nb::dict> & runs, int n_head_kv, int n_rot, bool neox, double rope_base,
                   int64_t n_visible, const std::string & kv_type, int64_t window) {
    const int64_t n_head = static_cast<int64_t>(q.shape(0)), hd = static_cast<int64_t>(q.shape(1));
    KC_CHECK(n_head_kv > 0 && n_head % n_head_kv == 0, "attend_test: n_head %lld not a multiple of n_head_kv %d",
             static_cast<long long>(n_head), n_head_kv);
    KC_CHECK(n_rot > 0 && n_rot % 2 == 0 && n_rot <= hd, "attend_test: bad n_rot %d", n_rot);
    KC_CHECK(hd <= 1024, "attend_test: head_dim %lld over 1024", static_cast<long long>(hd));
    KC_CHECK(kv_type == "f32" || kv_type == "f16", "attend_test: kv_type must be 'f32' or 'f16', got '%s'",
             kv_type.c_str());
    const bool    f16 = kv_type == "f16";
    const int64_t kd  = n_head_kv * hd;
    cpu::Rope     rope;
    rope.n_rot = n_rot;
    rope.neox  = neox;
    for (int j = 0; j < n_rot / 2; ++j) {
        rope.inv_freq.push_back(static_cast<float>(std::pow(rope_base, -2.0 * j / n_rot)));
    }
    std::vector<cpu::KvRun> kv_runs;
    int64_t                 total = 0;
    for (const nb::dict & d : runs) {
        // f16: k and v hold the bits of IEEE halves (numpy float16 viewed as uint16).
        size_t       rows = 0, k_cols = 0, v_rows = 0, v_cols = 0;
        const void * k_data = nullptr;
        const void * v_data = nullptr;
        if (f16) {
            Mat16 k = rows_arg<Mat16>(d["k"], "k", "uint16"), v = rows_arg<Mat16>(d["v"], "v", "uint16");
            rows = k.shape(0), k_cols = k.shape(1), v_rows = v.shape(0), v_cols = v.shape(1);
            k_data = k.data(), v_data = v.data();
        } else {
            Mat k = rows_arg<Mat>(d["k"], "k", "float32"), v = rows_arg<Mat>(d["v"], "v", "float32");
            rows = k.shape(0), k_cols = k.shape(1), v_rows = v.shape(0), v_cols = v.shape(1);
            k_data = k.data(), v_data = v.data();
        }
        KC_CHECK(k_cols == static_cast<size_t>(kd) && v_cols == static_cast<size_t>(kd) && rows == v_rows,
                 "attend_test: k and v must be [n, %lld]", static_cast<long long>(kd));
        cpu::KvRun r{ k_data, v_data, static_cast<int32_t>(rows),
                      d.contains("shift") ? nb::cast<int32_t>(d["shift"]) : 0 };
        if (d.contains("a_k")) {
            Mat a_k = rows_arg<Mat>(d["a_k"], "a_k", "float32"), a_v = rows_arg<Mat>(d["a_v"], "a_v", "float32");
            Mat b_k = rows_arg<Mat>(d["b_k"], "b_k", "float32"), b_v = rows_arg<Mat>(d["b_v"], "b_v", "float32");
            const size_t rank = a_k.shape(1);
            KC_CHECK(rank > 0 && rank <= static_cast<size_t>(cpu::kMaxCorrectionRank) && a_k.shape(0) == rows &&
                         a_v.shape(0) == rows && a_v.shape(1) == rank && b_k.shape(0) == rank && b_v.shape(0) == rank &&
                         b_k.shape(1) == static_cast<size_t>(kd) && b_v.shape(1) == static_cast<size_t>(kd),
                     "attend_test: factors must be A [n, r] and B [r, %lld]", static_cast<long long>(kd));
            r.rank = static_cast<int32_t>(rank);
            r.a_k  = a_k.data();
            r.a_v  = a_v.data();
            r.b_k  = b_k.data();
            r.b_v  = b_v.data();
        }
        total += r.n;
        kv_runs.push_back(r);
    }
    KC_CHECK(window >= 0, "attend_test: window %lld is negative", static_cast<long long>(window));
    KC_CHECK(n_visible > 0 && n_visible <= total, "attend_test: n_visible %lld outside [1, %lld]",
             static_cast<long long>(n_visible), static_cast<long long>(total));
    const cpu::AttentionShape shape{ static_cast<int>(n_head),
                                     n_head_kv,
                                     static_cast<int>(hd),
                                     kd,
                                     static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))),
                                     f16 ? cpu::KvType::F16 : cpu::KvType::F32,
                                     window };
    std::vector<float>        scratch(static_cast<size_t>(cpu::attention_scratch_floats(shape, n_visible)));
    auto *                    out = new std::vector<float>(static_cast<size_t>(n_head * hd));
    cpu::attend(shape, rope, q.data(), kv_runs.data(), static_cast<int>(kv_runs.size()), n_visible, 0,
                static_cast<int>(n_head), out->data(), scratch.data());
    nb::capsule owner(out, [](void * p) noexcept { delete static_cast<std::vector<float> *>(p); });
    return MatOut(out->data(), { static_cast<size_t>(n_head), static_cast<size_t>(hd) }, owner);
}

}  // namespace

void bind_attention(nb::module_ & m) {
    m.def("attend_test", &attend_test, nb::arg("q"), nb::arg("runs"), nb::arg("n_head_kv"), nb::arg("n_rot"),
          nb::arg("neox"), nb::arg("rope_base"), nb::arg("n_visible"), nb::arg("kv_type") = "f32",
          nb::arg("window") = 0,
          "Attention of one query [n_head, head_dim] over runs of KV (dicts: k, v, shift, optional a_k/b_k/a_v/b_v "
          "low-rank corrections); the kernel the engine uses, for tests. kv_type 'f16': k and v are uint16 arrays "
          "holding IEEE half bits. window > 0: only the last `window` of the n_visible rows are attended.");
}

}  // namespace kvcmas::py
