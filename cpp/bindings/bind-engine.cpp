// Python view of the engine: a Model with its sequences (KV slots) and a batched decode call.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "backend/cpu/cpu-features.h"
#include "bindings/bindings.h"
#include "common/error.h"
#include "engine/model.h"

namespace nb = nanobind;

namespace kvcmas::py {

using IntArray  = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BoolArray = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using EmbdArray = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using FloatOut  = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

using OffsetArray = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

static FloatOut decode(Model & m, IntArray seqs, IntArray tokens, BoolArray want_logits, std::optional<EmbdArray> embd,
                       std::optional<IntArray> embd_rows, std::optional<IntArray> bidirectional,
                       std::optional<OffsetArray> rope_offsets) {
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
    if (bidirectional) {
        KC_CHECK(bidirectional->shape(0) % 2 == 0, "decode: bidirectional must hold (first, end) pairs");
        for (size_t i = 0; i < bidirectional->shape(0); i += 2) {
            batch.bidirectional.emplace_back((*bidirectional)(i), (*bidirectional)(i + 1));
        }
    }
    if (rope_offsets) {
        KC_CHECK(rope_offsets->shape(0) == n && rope_offsets->shape(1) == 3,
                 "decode: rope_offsets must be [n_items, 3] (temporal, height, width offsets)");
        batch.rope_offsets = rope_offsets->data();
    }
    std::vector<float> * logits = new std::vector<float>();
    try {
        nb::gil_scoped_release release;
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

// "f32" | "f16" -> the KV storage type; anything else is an error naming the option.
static cpu::KvType parse_kv_type(const std::string & name) {
    if (name == "f32") {
        return cpu::KvType::F32;
    }
    if (name == "f16") {
        return cpu::KvType::F16;
    }
    fail("kv_type must be 'f32' or 'f16', got '%s'", name.c_str());
}

// Rows of a span handed to Python (an uncorrected segment of the sequence they were shared from, with the frame
// its keys are rotated at): keeps the rows alive (the model is kept alive by nanobind's keep_alive).
struct SharedSpan {
    KvSegment rows;
};

using Mat3Out = nb::ndarray<nb::numpy, float, nb::ndim<3>>;
using Mat2    = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Mat2Out = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

template <size_t N, typename Out>
static Out owned_array(std::vector<float> * data, const size_t (&shape)[N]) {
    nb::capsule owner(data, [](void * p) noexcept { delete static_cast<std::vector<float> *>(p); });
    return Out(data->data(), N, shape, owner);
}

static std::pair<Mat3Out, Mat3Out> seq_kv(Model & m, int32_t seq, int32_t pos, int32_t n) {
    const ModelParams & p  = m.params();
    const size_t        kd = static_cast<size_t>(p.n_head_kv * p.head_dim);
    KC_CHECK(n >= 0, "seq_kv: n must be >= 0");
    const size_t total = static_cast<size_t>(p.n_layer) * static_cast<size_t>(n) * kd;
    auto *       k     = new std::vector<float>(total);
    auto *       v     = new std::vector<float>(total);
    try {
        nb::gil_scoped_release release;
        m.read_kv(seq, pos, n, k->data(), v->data());
    } catch (...) {
        delete k;
        delete v;
        throw;
    }
    const size_t shape[3] = { static_cast<size_t>(p.n_layer), static_cast<size_t>(n), kd };
    return { owned_array<3, Mat3Out>(k, shape), owned_array<3, Mat3Out>(v, shape) };
}

static void set_factor(std::vector<float> & dst, Mat2 src, size_t rows, size_t cols, const char * name) {
    KC_CHECK(src.shape(0) == rows && src.shape(1) == cols,
             "KvCorrection.set_layer: %s must be [%zu, %zu], got [%zu, %zu]", name, rows, cols,
             static_cast<size_t>(src.shape(0)), static_cast<size_t>(src.shape(1)));
    dst.assign(src.data(), src.data() + rows * cols);
}

void bind_engine(nb::module_ & m) {
    m.def(
        "backends",
        []() {
            nb::dict out;
            for (const std::string & name : backend::compiled_backends()) {
                std::string why;
                const bool  ok    = backend::backend_usable(name, &why);
                out[name.c_str()] = nb::make_tuple(ok, ok ? std::string() : why);
            }
            return out;
        },
        "The backends compiled into this build: {name: (usable here, why not)}; 'cpu' always, 'cuda' with "
        "KVCMAS_CUDA=ON.");
    m.def(
        "cpu_features",
        [] {
            nb::dict d;
            d["avx2_fma_f16c"] = cpu::cpu_features().avx2_fma_f16c;
            d["avx_vnni"]      = cpu::cpu_features().avx_vnni;
            d["avx512"]        = cpu::cpu_features().avx512;
            d["avx512_vnni"]   = cpu::cpu_features().avx512_vnni;
            d["qgemm_avx2"]    = cpu::cpu_features().qgemm_avx2;
            return d;
        },
        "Instruction sets the kernels use on this machine (after KVCMAS_FORCE_SCALAR).");
    m.def(
        "architectures", []() { return registered_architectures(); },
        "The GGUF general.architecture values the engine runs (engine/arch/registry.cpp).");
    nb::class_<SharedSpan>(m, "SharedSpan", "Rows of KV stored once, readable by any sequence of the same model.")
        .def_prop_ro("n", [](const SharedSpan & s) { return s.rows.n; })
        .def_prop_ro(
            "frame0", [](const SharedSpan & s) { return s.rows.frame; }, "the position its first key is rotated at")
        .def(
            "slice",
            [](const SharedSpan & s, int32_t first, int32_t n) {
                KC_CHECK(first >= 0 && n > 0 && first <= s.rows.n - n,
                         "SharedSpan.slice: rows [%d, %d + %d) are outside the span's %d rows", first, first, n,
                         s.rows.n);
                return SharedSpan{ KvSegment{ s.rows.span, s.rows.begin + first, n, s.rows.frame + first, nullptr,
                                              0 } };
            },
            nb::arg("first"), nb::arg("n"), nb::keep_alive<0, 1>(),
            "Rows [first, first + n) of this span, the same stored rows (no copy).");

    nb::class_<KvCorrection>(m, "KvCorrection",
                             "Low-rank K/V correction of n_rows rows: K + A_k·B_k, V + A_v·B_v per layer, in the "
                             "frame the keys are stored in.")
        .def(
            "__init__",
            [](KvCorrection * c, int32_t n_rows, int32_t rank, int32_t n_kv_dim, int32_t n_layer) {
                KC_CHECK(n_rows > 0 && rank > 0 && rank <= cpu::kMaxCorrectionRank && n_kv_dim > 0 && n_layer > 0,
                         "KvCorrection: n_rows, rank (<= %d), n_kv_dim and n_layer must be positive",
                         cpu::kMaxCorrectionRank);
                new (c) KvCorrection();
                c->n_rows   = n_rows;
                c->rank     = rank;
                c->n_kv_dim = n_kv_dim;
                c->layers.resize(static_cast<size_t>(n_layer));
            },
            nb::arg("n_rows"), nb::arg("rank"), nb::arg("n_kv_dim"), nb::arg("n_layer"))
        .def(
            "set_layer",
            [](KvCorrection & c, int32_t il, Mat2 a_k, Mat2 b_k, Mat2 a_v, Mat2 b_v) {
                KC_CHECK(!c.sealed, "KvCorrection.set_layer: the correction is in use by a sequence");
                KC_CHECK(il >= 0 && static_cast<size_t>(il) < c.layers.size(),
                         "KvCorrection.set_layer: layer %d "
                         "outside [0, %zu)",
                         il, c.layers.size());
                const size_t          r = static_cast<size_t>(c.rank), n = static_cast<size_t>(c.n_rows),
                                      w = static_cast<size_t>(c.n_kv_dim);
                KvCorrection::Layer & l = c.layers[static_cast<size_t>(il)];
                set_factor(l.a_k, a_k, n, r, "a_k");
                set_factor(l.b_k, b_k, r, w, "b_k");
                set_factor(l.a_v, a_v, n, r, "a_v");
                set_factor(l.b_v, b_v, r, w, "b_v");
            },
            nb::arg("layer"), nb::arg("a_k"), nb::arg("b_k"), nb::arg("a_v"), nb::arg("b_v"))
        .def_ro("n_rows", &KvCorrection::n_rows)
        .def_ro("rank", &KvCorrection::rank)
        .def_prop_ro("bytes", &KvCorrection::bytes, "memory held by the factors");

    nb::class_<Model>(m, "Model")
        .def(
            "__init__",
            [](Model * self, const std::string & path, int n_threads, int n_ctx, size_t kv_budget,
               const std::string & kv_type, const std::string & device, const std::string & activations) {
                const cpu::KvType      type = parse_kv_type(kv_type);
                const cpu::Activations act  = parse_activations(activations);
                nb::gil_scoped_release release;
                new (self) Model(path, n_threads, n_ctx, kv_budget, type, device, act);
            },
            nb::arg("path"), nb::arg("n_threads") = 0, nb::arg("n_ctx") = 0, nb::arg("kv_budget") = 0,
            nb::arg("kv_type") = "f32", nb::arg("device") = "cpu", nb::arg("activations") = "q8")
        .def_prop_ro("device", &Model::backend_name, "the backend the model runs on: 'cpu' or 'cuda'")
        .def_prop_ro("device_description", &Model::device_description)
        .def_prop_ro("arch", [](const Model & m) { return m.params().arch; })
        .def_prop_ro(
            "rope_sections", [](const Model & m) { return m.params().rope_sections; },
            "M-RoPE rotated pairs per temporal / height / width position (empty: one position)")
        .def_prop_ro("n_vocab", [](const Model & m) { return m.params().n_vocab; })
        .def_prop_ro("n_ctx_train", [](const Model & m) { return m.params().n_ctx_train; })
        .def_prop_ro("n_layer", [](const Model & m) { return m.params().n_layer; })
        .def_prop_ro("n_embd", [](const Model & m) { return m.params().n_embd; })
        .def_prop_ro("n_head", [](const Model & m) { return m.params().n_head; })
        .def_prop_ro("n_head_kv", [](const Model & m) { return m.params().n_head_kv; })
        .def_prop_ro("head_dim", [](const Model & m) { return m.params().head_dim; })
        .def_prop_ro("n_ff", [](const Model & m) { return m.params().n_ff; })
        .def_prop_ro(
            "layer_window", [](const Model & m) { return m.params().layer_window; },
            "per layer: the positions a query attends to (sliding window), 0 for all")
        .def_prop_ro("n_threads", &Model::n_threads)
        .def_prop_ro("n_ctx", &Model::n_ctx)
        .def_prop_ro("kv_bytes_in_use", &Model::kv_bytes_in_use)
        .def_prop_ro("kv_budget", &Model::kv_budget)
        .def_prop_ro("kv_bytes_allocated", &Model::kv_bytes_allocated,
                     "bytes of KV block memory held, in use or kept free for reuse")
        .def_prop_ro("kv_block_bytes", &Model::kv_block_bytes,
                     "bytes of one KV block: kv_block_rows rows of K and V, every layer, in kv_type")
        .def_prop_ro(
            "kv_block_rows", [](const Model &) { return kKvBlockRows; },
            "rows (tokens) per KV block: sequences and spans allocate KV memory in whole blocks")
        .def("kv_trim", &Model::kv_trim,
             "Returns the memory of free KV blocks to the system; returns the bytes released.")
        .def_prop_ro("kv_type", [](const Model & m) { return m.kv_type() == cpu::KvType::F16 ? "f16" : "f32"; })
        .def_prop_ro("activations", [](const Model & m) { return activations_name(m.activations()); })
        // Sequence bookkeeping is cheap: the model takes its lock without the GIL being released.
        .def("seq_new", &Model::seq_new)
        .def("seq_fork", &Model::seq_fork, nb::arg("src"))
        .def("seq_truncate", &Model::seq_truncate, nb::arg("seq"), nb::arg("n"))
        .def("seq_remove", &Model::seq_remove, nb::arg("seq"))
        .def("seq_length", &Model::seq_length, nb::arg("seq"))
        .def("seq_exists", &Model::seq_exists, nb::arg("seq"))
        .def("seq_reserve", &Model::seq_reserve, nb::arg("seq"), nb::arg("n"))
        .def("seq_reserved", &Model::seq_reserved, nb::arg("seq"))
        .def_prop_ro("n_seqs", &Model::n_seqs)
        .def(
            "load_adapter",
            [](Model & m, const std::string & path) {
                nb::gil_scoped_release release;
                return m.load_adapter(path);
            },
            nb::arg("path"), "Loads a LoRA adapter file checked against this model; returns its id.")
        .def("unload_adapter", &Model::unload_adapter, nb::arg("id"))
        .def(
            "adapter_info",
            [](Model & m, int32_t id) {
                const std::shared_ptr<const LoraAdapter> ad = m.adapter(id);
                nb::dict                                 d;
                d["path"]     = ad->path();
                d["alpha"]    = ad->alpha();
                d["n_pairs"]  = ad->n_pairs();
                d["max_rank"] = ad->max_rank();
                d["bytes"]    = ad->bytes();
                return d;
            },
            nb::arg("id"), "An adapter's file, alpha, adapted matrices (n_pairs), largest rank and backend bytes.")
        .def("seq_set_adapter", &Model::seq_set_adapter, nb::arg("seq"), nb::arg("id"), nb::arg("scale") = 1.0f,
             "Runs seq's next items with adapter id (-1: none) at `scale`; forks inherit it.")
        .def("seq_adapter", &Model::seq_adapter, nb::arg("seq"), "(adapter id or -1, scale) of seq")
        .def(
            "seq_share",
            [](Model & m, int32_t s, int32_t pos, int32_t n) { return SharedSpan{ m.seq_span(s, pos, n) }; },
            nb::arg("seq"), nb::arg("pos"), nb::arg("n"), nb::keep_alive<0, 1>(),
            "The stored rows behind positions [pos, pos + n) of seq, to append to other sequences without copying.")
        .def(
            "seq_append_shared",
            [](Model & m, int32_t s, const SharedSpan & span, std::shared_ptr<KvCorrection> corr, int32_t corr_row0) {
                m.seq_append_span(s, span.rows, std::move(corr), corr_row0);
            },
            nb::arg("seq"), nb::arg("span"), nb::arg("correction").none() = nb::none(), nb::arg("corr_row0") = 0,
            "Appends a shared span to seq at its end position, optionally with a low-rank correction whose rows "
            "[corr_row0, corr_row0 + n) correct its n rows (one correction can serve several pieces of a span).")
        .def("seq_kv", &seq_kv, nb::arg("seq"), nb::arg("pos"), nb::arg("n"),
             "Materialized KV [n_layer, n, n_kv_dim] (float32, also for an f16 cache) of positions [pos, pos + n): "
             "keys at their positions, corrections added.")
        .def(
            "seq_segments",
            [](Model & m, int32_t s) {
                nb::list out;
                for (const SegmentInfo & seg : m.seq_segments(s)) {
                    nb::dict d;
                    d["pos"]        = seg.pos;
                    d["n"]          = seg.n;
                    d["shift"]      = seg.shift;
                    d["shared"]     = seg.shared;
                    d["corr_bytes"] = seg.corr_bytes;
                    out.append(d);
                }
                return out;
            },
            nb::arg("seq"))
        .def(
            "rope_rotate",
            [](Model & m, Mat2 x, double shift, int layer) {
                const ModelParams & p  = m.params();
                const size_t        kd = static_cast<size_t>(p.n_head_kv * p.head_dim);
                KC_CHECK(x.shape(1) == kd, "rope_rotate: rows must have n_head_kv * head_dim = %zu floats", kd);
                KC_CHECK(layer >= 0 && layer < p.n_layer, "rope_rotate: layer %d out of range [0, %lld)", layer,
                         static_cast<long long>(p.n_layer));
                auto * out = new std::vector<float>(x.data(), x.data() + x.shape(0) * kd);
                for (size_t i = 0; i < x.shape(0); ++i) {
                    m.rope(layer).apply(out->data() + i * kd, static_cast<int>(p.n_head_kv),
                                        static_cast<int>(p.head_dim), shift);
                }
                const size_t shape[2] = { static_cast<size_t>(x.shape(0)), kd };
                return owned_array<2, Mat2Out>(out, shape);
            },
            nb::arg("x"), nb::arg("shift"), nb::arg("layer") = 0,
            "Rotates key rows [n, n_head_kv * head_dim] by `shift` positions with layer `layer`'s RoPE.")
        .def("decode", &decode, nb::arg("seqs"), nb::arg("tokens"), nb::arg("want_logits"),
             nb::arg("embd") = nb::none(), nb::arg("embd_rows") = nb::none(), nb::arg("bidirectional") = nb::none(),
             nb::arg("rope_offsets") = nb::none(),
             "Appends items to sequences and returns the logits [n_wanted, n_vocab] of the flagged items. "
             "bidirectional: int32 (first, end) item-range pairs whose items attend to each other (Gemma 3 images). "
             "rope_offsets [n, 3] (M-RoPE models): added to each item's position for its temporal, height and width "
             "rotation.");
}

}  // namespace kvcmas::py
