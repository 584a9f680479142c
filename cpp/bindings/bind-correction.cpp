// Python view of KVCMAS's core-side corrections: the ridge maps of a fitted edge and the call that turns a reader's
// base view of a shared span into a ready KvCorrection, a materialized (copied) alternative to a fused segment, and
// read access to a correction's factors (tests, folding over-rank chains in numpy).
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/tuple.h>

#include <optional>

#include "bindings/bindings.h"
#include "common/error.h"
#include "engine/kv-materialize.h"
#include "engine/model.h"
#include "engine/ridge-correction.h"

namespace nb = nanobind;

namespace kvcmas::py {

namespace {

using Vec     = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Mat     = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Mat2Out = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

void check_vec(const Vec & x, size_t n, const char * name) {
    KC_CHECK(x.shape(0) == n, "RidgeMaps.set_layer: %s must have %zu floats, got %zu", name, n,
             static_cast<size_t>(x.shape(0)));
}

void check_mat(const Mat & x, size_t rows, size_t cols, const char * name) {
    KC_CHECK(x.shape(0) == rows && x.shape(1) == cols, "RidgeMaps.set_layer: %s must be [%zu, %zu], got [%zu, %zu]",
             name, rows, cols, static_cast<size_t>(x.shape(0)), static_cast<size_t>(x.shape(1)));
}

void set_layer(RidgeMaps & maps, int il, Vec mu_x_k, Mat proj_k, Mat vt_k, Vec mu_y_k, Vec mu_x_v, Mat proj_v, Mat vt_v,
               Vec mu_y_v) {
    const size_t kd = static_cast<size_t>(maps.n_kv_dim()), r = static_cast<size_t>(maps.rank());
    check_vec(mu_x_k, kd, "mu_x_k");
    check_mat(proj_k, kd, r, "proj_k");
    check_mat(vt_k, r, kd, "vt_k");
    check_vec(mu_y_k, kd, "mu_y_k");
    check_vec(mu_x_v, kd, "mu_x_v");
    check_mat(proj_v, kd, r, "proj_v");
    check_mat(vt_v, r, kd, "vt_v");
    check_vec(mu_y_v, kd, "mu_y_v");
    maps.set_layer(il, mu_x_k.data(), proj_k.data(), vt_k.data(), mu_y_k.data(), mu_x_v.data(), proj_v.data(),
                   vt_v.data(), mu_y_v.data());
}

Mat2Out copy_out(const std::vector<float> & src, size_t rows, size_t cols) {
    auto *      data = new std::vector<float>(src);
    nb::capsule owner(data, [](void * p) noexcept { delete static_cast<std::vector<float> *>(p); });
    return Mat2Out(data->data(), { rows, cols }, owner);
}

}  // namespace

void bind_correction(nb::module_ & m) {
    nb::class_<RidgeMaps>(m, "RidgeMaps",
                          "A fitted edge's ridge maps per layer (K and V): delta(x) = (x - mu_x)·proj·vt + mu_y in "
                          "the span's canonical frame; layers never set are not corrected.")
        .def(nb::init<int, int, int>(), nb::arg("n_layer"), nb::arg("n_kv_dim"), nb::arg("rank"))
        .def("set_layer", &set_layer, nb::arg("layer"), nb::arg("mu_x_k"), nb::arg("proj_k"), nb::arg("vt_k"),
             nb::arg("mu_y_k"), nb::arg("mu_x_v"), nb::arg("proj_v"), nb::arg("vt_v"), nb::arg("mu_y_v"),
             "Layer il's maps: mu_x [kd], proj [kd, rank], vt [rank, kd], mu_y [kd], for K then V (float32).")
        .def_prop_ro("rank", &RidgeMaps::rank)
        .def_prop_rw("rows", &RidgeMaps::rows, &RidgeMaps::set_rows,
                     "span rows [0, rows) the maps apply to (their fitted range); 0: every row")
        .def_prop_ro("n_layer", &RidgeMaps::n_layer)
        .def_prop_ro("bytes", &RidgeMaps::bytes, "memory held by the maps");

    m.def(
        "ridge_correction",
        [](Model & model, const RidgeMaps & maps, int32_t seq, int32_t pos, int32_t n, int32_t frame0,
           std::shared_ptr<KvCorrection> prev) {
            nb::gil_scoped_release release;
            return model.ridge_correction(maps, seq, pos, n, frame0, prev.get());
        },
        nb::arg("model"), nb::arg("maps"), nb::arg("seq"), nb::arg("pos"), nb::arg("n"), nb::arg("frame0"),
        nb::arg("prev").none() = nb::none(),
        "The KvCorrection of a reader whose base view of a shared span is positions [pos, pos + n) of seq: the "
        "maps' factors from that view (keys in the canonical frame), B_k rotated to the span's stored frame frame0, "
        "after prev's factors along the rank axis (prev: the correction the view already carries).");

    m.def(
        "seq_materialize_last",
        [](Model & model, int32_t seq) {
            nb::gil_scoped_release release;
            return model.materialize_last_segment(seq);
        },
        nb::arg("model"), nb::arg("seq"),
        "Replaces seq's last segment (a shared span read by reference, maybe corrected) by a private copy of its "
        "rows as attention reads them; returns the rows copied.");

    m.def(
        "correction_layer",
        [](const KvCorrection & c, int il) -> std::optional<std::tuple<Mat2Out, Mat2Out, Mat2Out, Mat2Out>> {
            KC_CHECK(il >= 0 && static_cast<size_t>(il) < c.layers.size(),
                     "correction_layer: layer %d outside [0, %zu)", il, c.layers.size());
            const KvCorrection::Layer & l = c.layers[static_cast<size_t>(il)];
            if (l.a_k.empty()) {
                return std::nullopt;
            }
            const size_t n = static_cast<size_t>(c.n_rows), r = static_cast<size_t>(c.rank),
                         w = static_cast<size_t>(c.n_kv_dim);
            return std::make_tuple(copy_out(l.a_k, n, r), copy_out(l.b_k, r, w), copy_out(l.a_v, n, r),
                                   copy_out(l.b_v, r, w));
        },
        nb::arg("correction"), nb::arg("layer"),
        "Copies of layer il's factors (A_k [n, r], B_k [r, kd], A_v, B_v), or None when the layer is uncorrected.");
}

}  // namespace kvcmas::py
