// Python view of the engine: a Model with its sequences (KV slots) and a batched decode call.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <mutex>

#include "bindings/bindings.h"
#include "common/error.h"
#include "engine/model.h"

namespace nb = nanobind;

namespace kvcmas::py {

using IntArray   = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BoolArray  = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using EmbdArray  = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using FloatOut   = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

static FloatOut decode(Model & m, IntArray seqs, IntArray tokens, BoolArray want_logits,
                       std::optional<EmbdArray> embd, std::optional<IntArray> embd_rows) {
    const size_t n = seqs.shape(0);
    KC_CHECK(tokens.shape(0) == n && want_logits.shape(0) == n,
             "decode: seqs, tokens and want_logits must have the same length (%zu, %zu, %zu)", n,
             static_cast<size_t>(tokens.shape(0)), static_cast<size_t>(want_logits.shape(0)));
    Batch batch;
    batch.items.resize(n);
    for (size_t i = 0; i < n; ++i) {
        batch.items[i] = BatchItem{ seqs(i), tokens(i), -1, want_logits(i) != 0 };
    }
    if (embd_rows) {
        KC_CHECK(embd.has_value(), "decode: embd_rows given without embd");
        KC_CHECK(embd_rows->shape(0) == n, "decode: embd_rows must have one entry per item");
        KC_CHECK(static_cast<int64_t>(embd->shape(1)) == m.params().n_embd,
                 "decode: embeddings must have n_embd = %lld columns, got %zu",
                 static_cast<long long>(m.params().n_embd), static_cast<size_t>(embd->shape(1)));
        for (size_t i = 0; i < n; ++i) {
            batch.items[i].embd_row = (*embd_rows)(i);
        }
        batch.embd        = embd->data();
        batch.n_embd_rows = static_cast<int64_t>(embd->shape(0));
    }
    std::vector<float> * logits = new std::vector<float>();
    try {
        nb::gil_scoped_release release;
        std::lock_guard<std::mutex> lock(m.mutex());
        *logits = m.decode(batch);
    } catch (...) {
        delete logits;
        throw;
    }
    const size_t n_vocab = static_cast<size_t>(m.params().n_vocab);
    const size_t rows    = logits->size() / n_vocab;
    nb::capsule  owner(logits, [](void * p) noexcept { delete static_cast<std::vector<float> *>(p); });
    return FloatOut(logits->data(), { rows, n_vocab }, owner);
}

// Sequence bookkeeping is cheap: it holds the model lock (shared with decode) without releasing the GIL.
#define KC_LOCKED(body)                           \
    std::lock_guard<std::mutex> lock(m.mutex()); \
    KvCache &                   kv = m.kv();     \
    body

void bind_engine(nb::module_ & m) {
    nb::class_<Model>(m, "Model")
        .def(
            "__init__",
            [](Model * self, const std::string & path, int n_threads, int n_ctx, size_t kv_budget) {
                nb::gil_scoped_release release;
                new (self) Model(path, n_threads, n_ctx, kv_budget);
            },
            nb::arg("path"), nb::arg("n_threads") = 0, nb::arg("n_ctx") = 0, nb::arg("kv_budget") = 0)
        .def_prop_ro("arch", [](const Model & m) { return m.params().arch; })
        .def_prop_ro("n_vocab", [](const Model & m) { return m.params().n_vocab; })
        .def_prop_ro("n_ctx_train", [](const Model & m) { return m.params().n_ctx_train; })
        .def_prop_ro("n_layer", [](const Model & m) { return m.params().n_layer; })
        .def_prop_ro("n_embd", [](const Model & m) { return m.params().n_embd; })
        .def_prop_ro("n_head", [](const Model & m) { return m.params().n_head; })
        .def_prop_ro("n_head_kv", [](const Model & m) { return m.params().n_head_kv; })
        .def_prop_ro("head_dim", [](const Model & m) { return m.params().head_dim; })
        .def_prop_ro("n_ff", [](const Model & m) { return m.params().n_ff; })
        .def_prop_ro("n_threads", &Model::n_threads)
        .def_prop_ro("n_ctx", [](Model & m) { return m.kv().n_ctx_max(); })
        .def_prop_ro("kv_bytes_in_use", [](Model & m) { return m.kv().pool().bytes_in_use(); })
        .def_prop_ro("kv_budget", [](Model & m) { return m.kv().pool().budget_bytes(); })
        .def("seq_new", [](Model & m) { KC_LOCKED(return kv.seq_new();) })
        .def("seq_fork", [](Model & m, int32_t src) { KC_LOCKED(return kv.seq_fork(src);) }, nb::arg("src"))
        .def("seq_truncate", [](Model & m, int32_t s, int32_t n) { KC_LOCKED(kv.seq_truncate(s, n);) },
             nb::arg("seq"), nb::arg("n"))
        .def("seq_remove", [](Model & m, int32_t s) { KC_LOCKED(kv.seq_remove(s);) }, nb::arg("seq"))
        .def("seq_length", [](Model & m, int32_t s) { KC_LOCKED(return kv.seq_length(s);) }, nb::arg("seq"))
        .def("seq_exists", [](Model & m, int32_t s) { KC_LOCKED(return kv.seq_exists(s);) }, nb::arg("seq"))
        .def_prop_ro("n_seqs", [](Model & m) { return m.kv().n_seqs(); })
        .def("decode", &decode, nb::arg("seqs"), nb::arg("tokens"), nb::arg("want_logits"),
             nb::arg("embd") = nb::none(), nb::arg("embd_rows") = nb::none(),
             "Appends items to sequences and returns the logits [n_wanted, n_vocab] of the flagged items.");
}

}  // namespace kvcmas::py
