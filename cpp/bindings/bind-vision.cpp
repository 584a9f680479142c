// Python view of the vision encoder: `_core.VisionEncoder(path, n_threads)` with its hyper-parameters, the
// preprocessing settings recorded in the file, and `encode(pixels) -> [n_tokens, n_embd_out]`.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "common/error.h"
#include "vision/vision-encoder.h"

namespace nb = nanobind;

namespace kvcmas::py {

using PixelArray = nb::ndarray<const float, nb::ndim<3>, nb::c_contig, nb::device::cpu>;
using FloatOut   = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

static FloatOut encode(vision::VisionEncoder & enc, PixelArray pixels) {
    auto * out = new std::vector<float>();
    try {
        nb::gil_scoped_release release;
        *out = enc.encode(pixels.data(), static_cast<int64_t>(pixels.shape(0)), static_cast<int64_t>(pixels.shape(1)),
                          static_cast<int64_t>(pixels.shape(2)));
    } catch (...) {
        delete out;
        throw;
    }
    const size_t cols = static_cast<size_t>(enc.n_output_embd());
    const size_t rows = out->size() / cols;
    nb::capsule  owner(out, [](void * p) noexcept { delete static_cast<std::vector<float> *>(p); });
    return FloatOut(out->data(), { rows, cols }, owner);
}

static const char * activation_name(vision::Activation a) {
    switch (a) {
        case vision::Activation::GeluErf:
            return "gelu";
        case vision::Activation::GeluTanh:
            return "gelu_pytorch_tanh";
        case vision::Activation::QuickGelu:
            return "quick_gelu";
        case vision::Activation::Silu:
            return "silu";
    }
    return "?";
}

void bind_vision(nb::module_ & m) {
    using vision::VisionEncoder;
    nb::class_<VisionEncoder>(
        m, "VisionEncoder",
        "A CLIP / SigLIP vision tower with its LLaVA or Gemma 3 projector, loaded from an mmproj GGUF.")
        .def(nb::init<const std::string &, int>(), nb::arg("path"), nb::arg("n_threads") = 0,
             nb::call_guard<nb::gil_scoped_release>())
        .def("encode", &encode, nb::arg("pixels"),
             "pixels: float32 [3, image_size, image_size] (preprocessed) -> float32 [n_tokens, n_embd_out]")
        .def_prop_ro("path", [](const VisionEncoder & e) { return e.file().path(); })
        .def_prop_ro("n_threads", &VisionEncoder::n_threads)
        .def_prop_ro("image_size", [](const VisionEncoder & e) { return e.params().image_size; })
        .def_prop_ro("patch_size", [](const VisionEncoder & e) { return e.params().patch_size; })
        .def_prop_ro("n_embd", [](const VisionEncoder & e) { return e.params().n_embd; })
        .def_prop_ro("n_ff", [](const VisionEncoder & e) { return e.params().n_ff; })
        .def_prop_ro("n_layer", [](const VisionEncoder & e) { return e.params().n_layer; })
        .def_prop_ro("n_head", [](const VisionEncoder & e) { return e.params().n_head; })
        .def_prop_ro("n_tokens", [](const VisionEncoder & e) { return e.params().n_output_tokens(); })
        .def_prop_ro("n_embd_out", &VisionEncoder::n_output_embd)
        .def_prop_ro("has_class_token", [](const VisionEncoder & e) { return e.params().class_token; })
        .def_prop_ro("has_projector", [](const VisionEncoder & e) { return e.params().projector; })
        .def_prop_ro("hidden_act", [](const VisionEncoder & e) { return activation_name(e.params().act); })
        .def_prop_ro("projector_act", [](const VisionEncoder & e) { return activation_name(e.params().projector_act); })
        .def_prop_ro("image_mean", [](const VisionEncoder & e) { return e.params().image_mean; })
        .def_prop_ro("image_std", [](const VisionEncoder & e) { return e.params().image_std; })
        .def_prop_ro("resize_mode", [](const VisionEncoder & e) { return e.params().resize_mode; })
        .def_prop_ro("resize_size", [](const VisionEncoder & e) { return e.params().resize_size; })
        .def_prop_ro("resample", [](const VisionEncoder & e) { return e.params().resample; })
        .def_prop_ro(
            "projector_type",
            [](const VisionEncoder & e) {
                return std::string(!e.params().projector ? "" : e.params().gemma3_projector ? "gemma3" : "mlp");
            })
        .def_prop_ro("pool_kernel", [](const VisionEncoder & e) { return e.params().pool_kernel; })
        .def_prop_ro("rescale_factor", [](const VisionEncoder & e) { return e.params().rescale_factor; })
        .def_prop_ro("model_type", [](const VisionEncoder & e) { return e.params().model_type; });
}

}  // namespace kvcmas::py
