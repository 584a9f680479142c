// Test entry point for the attention kernel: runs attend() on KV given as numpy arrays, so tests can compare the
// fused corrected kernel with a materializing numpy reference.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <cmath>

#include "bindings/bindings.h"
#include "common/error.h"
#include "cpu/attention.h"

namespace nb = nanobind;

namespace kvcmas::py {

using Mat    = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using MatOut = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

namespace {

struct TestRun {
    Mat                k, v;
    int32_t            shift = 0;
    std::optional<Mat> a_k, b_k, a_v, b_v;
};

MatOut attend_test(Mat q, const std::vector<nb::dict> & runs, int n_head_kv, int n_rot, bool neox,
                   double rope_base, int64_t n_visible) {
    const int64_t n_head = static_cast<int64_t>(q.shape(0)), hd = static_cast<int64_t>(q.shape(1));
    KC_CHECK(n_head_kv > 0 && n_head % n_head_kv == 0, "attend_test: n_head %lld not a multiple of n_head_kv %d",
             static_cast<long long>(n_head), n_head_kv);
    KC_CHECK(n_rot > 0 && n_rot % 2 == 0 && n_rot <= hd, "attend_test: bad n_rot %d", n_rot);
    const int64_t      kd = n_head_kv * hd;
    cpu::Rope          rope;
    rope.n_rot = n_rot;
    rope.neox  = neox;
    for (int j = 0; j < n_rot / 2; ++j) {
        rope.inv_freq.push_back(static_cast<float>(std::pow(rope_base, -2.0 * j / n_rot)));
    }
    std::vector<cpu::KvRun> kv_runs;
    int64_t                 total = 0;
    for (const nb::dict & d : runs) {
        Mat k = nb::cast<Mat>(d["k"]), v = nb::cast<Mat>(d["v"]);
        KC_CHECK(k.shape(1) == static_cast<size_t>(kd) && v.shape(1) == static_cast<size_t>(kd) &&
                     k.shape(0) == v.shape(0),
                 "attend_test: k and v must be [n, %lld]", static_cast<long long>(kd));
        cpu::KvRun r{ k.data(), v.data(), static_cast<int32_t>(k.shape(0)),
                      d.contains("shift") ? nb::cast<int32_t>(d["shift"]) : 0 };
        if (d.contains("a_k")) {
            Mat a_k = nb::cast<Mat>(d["a_k"]), a_v = nb::cast<Mat>(d["a_v"]);
            Mat b_k = nb::cast<Mat>(d["b_k"]), b_v = nb::cast<Mat>(d["b_v"]);
            const size_t rank = a_k.shape(1);
            KC_CHECK(rank > 0 && rank <= static_cast<size_t>(cpu::kMaxCorrectionRank) && a_k.shape(0) == k.shape(0) &&
                         a_v.shape(0) == k.shape(0) && a_v.shape(1) == rank && b_k.shape(0) == rank &&
                         b_v.shape(0) == rank && b_k.shape(1) == static_cast<size_t>(kd) &&
                         b_v.shape(1) == static_cast<size_t>(kd),
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
    KC_CHECK(n_visible > 0 && n_visible <= total, "attend_test: n_visible %lld outside [1, %lld]",
             static_cast<long long>(n_visible), static_cast<long long>(total));
    const cpu::AttentionShape shape{ static_cast<int>(n_head), n_head_kv, static_cast<int>(hd), kd,
                                     static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd))) };
    std::vector<float> scratch(static_cast<size_t>(cpu::attention_scratch_floats(shape, n_visible)));
    auto *             out = new std::vector<float>(static_cast<size_t>(n_head * hd));
    cpu::attend(shape, rope, q.data(), kv_runs.data(), static_cast<int>(kv_runs.size()), n_visible, 0,
                static_cast<int>(n_head), out->data(), scratch.data());
    nb::capsule owner(out, [](void * p) noexcept { delete static_cast<std::vector<float> *>(p); });
    return MatOut(out->data(), { static_cast<size_t>(n_head), static_cast<size_t>(hd) }, owner);
}

}  // namespace

void bind_attention(nb::module_ & m) {
    m.def("attend_test", &attend_test, nb::arg("q"), nb::arg("runs"), nb::arg("n_head_kv"), nb::arg("n_rot"),
          nb::arg("neox"), nb::arg("rope_base"), nb::arg("n_visible"),
          "Attention of one query [n_head, head_dim] over runs of KV (dicts: k, v, shift, optional a_k/b_k/a_v/b_v "
          "low-rank corrections); the kernel the engine uses, for tests.");
}

}  // namespace kvcmas::py
