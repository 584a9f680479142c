// Python view of the vision encoder: `_core.VisionEncoder(path, n_threads, backend)` with its hyper-parameters, the
// preprocessing settings recorded in the file, and `encode(pixels) -> [n_tokens, n_embd_out]`.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "common/error.h"
#include "vision/qwen-vision-encoder.h"
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

using PixelBatch = nb::ndarray<const float, nb::ndim<4>, nb::c_contig, nb::device::cpu>;

static FloatOut encode_batch(vision::VisionEncoder & enc, PixelBatch pixels) {
    auto * out = new std::vector<float>();
    try {
        nb::gil_scoped_release release;
        *out = enc.encode_batch(pixels.data(), static_cast<int64_t>(pixels.shape(0)),
                                static_cast<int64_t>(pixels.shape(1)), static_cast<int64_t>(pixels.shape(2)),
                                static_cast<int64_t>(pixels.shape(3)));
    } catch (...) {
        delete out;
        throw;
    }
    const size_t cols = static_cast<size_t>(enc.n_output_embd());
    nb::capsule  owner(out, [](void * p) noexcept { delete static_cast<std::vector<float> *>(p); });
    return FloatOut(out->data(), { out->size() / cols, cols }, owner);
}

using PatchArray = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

static FloatOut encode_patches(vision::QwenVisionEncoder & enc, PatchArray patches, int64_t grid_h, int64_t grid_w) {
    auto * out = new std::vector<float>();
    try {
        nb::gil_scoped_release release;
        *out = enc.encode(patches.data(), static_cast<int64_t>(patches.shape(0)),
                          static_cast<int64_t>(patches.shape(1)), grid_h, grid_w);
    } catch (...) {
        delete out;
        throw;
    }
    const size_t cols = static_cast<size_t>(enc.params().n_embd_out);
    nb::capsule  owner(out, [](void * p) noexcept { delete static_cast<std::vector<float> *>(p); });
    return FloatOut(out->data(), { out->size() / cols, cols }, owner);
}

static void bind_qwen_vision(nb::module_ & m) {
    using vision::QwenVisionEncoder;
    nb::class_<QwenVisionEncoder>(m, "QwenVisionEncoder",
                                  "Qwen2.5-VL's vision tower and patch merger, loaded from an mmproj GGUF.")
        .def(nb::init<const std::string &, int, const std::string &>(), nb::arg("path"), nb::arg("n_threads") = 0,
             nb::arg("backend") = "cpu", nb::call_guard<nb::gil_scoped_release>(),
             "backend: the backend that runs the tower ('cpu', 'cuda', 'cuda:N'); one this build or machine cannot "
             "run is refused naming it")
        .def("encode", &encode_patches, nb::arg("patches"), nb::arg("grid_h"), nb::arg("grid_w"),
             "patches: float32 [grid_h * grid_w, 3 * 2 * P * P] in the processor's order -> float32 "
             "[grid_h * grid_w / merge^2, n_embd_out]")
        .def_prop_ro("path", [](const QwenVisionEncoder & e) { return e.file().path(); })
        .def_prop_ro("n_threads", &QwenVisionEncoder::n_threads)
        .def_prop_ro("backend", &QwenVisionEncoder::backend_name)
        .def_prop_ro("patch_size", [](const QwenVisionEncoder & e) { return e.params().patch_size; })
        .def_prop_ro("temporal_patch_size", [](const QwenVisionEncoder & e) { return e.params().temporal_patch_size; })
        .def_prop_ro("merge_size", [](const QwenVisionEncoder & e) { return e.params().merge_size; })
        .def_prop_ro("window_size", [](const QwenVisionEncoder & e) { return e.params().window_size; })
        .def_prop_ro("n_embd", [](const QwenVisionEncoder & e) { return e.params().n_embd; })
        .def_prop_ro("n_layer", [](const QwenVisionEncoder & e) { return e.params().n_layer; })
        .def_prop_ro("n_head", [](const QwenVisionEncoder & e) { return e.params().n_head; })
        .def_prop_ro("n_embd_out", [](const QwenVisionEncoder & e) { return e.params().n_embd_out; })
        .def_prop_ro("full_attention", [](const QwenVisionEncoder & e) { return e.params().full_attention; })
        .def_prop_ro("min_pixels", [](const QwenVisionEncoder & e) { return e.params().min_pixels; })
        .def_prop_ro("max_pixels", [](const QwenVisionEncoder & e) { return e.params().max_pixels; })
        .def_prop_ro("image_mean", [](const QwenVisionEncoder & e) { return e.params().image_mean; })
        .def_prop_ro("image_std", [](const QwenVisionEncoder & e) { return e.params().image_std; });
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
    bind_qwen_vision(m);
    using vision::VisionEncoder;
    nb::class_<VisionEncoder>(
        m, "VisionEncoder",
        "A CLIP / SigLIP vision tower with its LLaVA or Gemma 3 projector, loaded from an mmproj GGUF.")
        .def(nb::init<const std::string &, int, const std::string &>(), nb::arg("path"), nb::arg("n_threads") = 0,
             nb::arg("backend") = "cpu", nb::call_guard<nb::gil_scoped_release>(),
             "backend: the backend that runs the tower ('cpu', 'cuda', 'cuda:N'); one this build or machine cannot "
             "run is refused naming it")
        .def("encode", &encode, nb::arg("pixels"),
             "pixels: float32 [3, image_size, image_size] (preprocessed) -> float32 [n_tokens, n_embd_out]")
        .def("encode_batch", &encode_batch, nb::arg("pixels"),
             "pixels: float32 [n, 3, image_size, image_size] -> float32 [n * n_tokens, n_embd_out], the n images' "
             "rows in order (one batched tower pass; the same values as n encode calls)")
        .def_prop_ro("max_batch", [](const VisionEncoder &) { return VisionEncoder::kMaxBatch; })
        .def_prop_ro("path", [](const VisionEncoder & e) { return e.file().path(); })
        .def_prop_ro("n_threads", &VisionEncoder::n_threads)
        .def_prop_ro("backend", &VisionEncoder::backend_name)
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
