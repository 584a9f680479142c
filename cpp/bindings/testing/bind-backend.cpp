// The backends' ops one by one on host arrays, for tests/test_backend_ops.py: each call uploads its inputs, runs
// one op on the chosen backend and downloads the result. KV rows live in a one-layer block store of the backend.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "bindings/bindings.h"
#include "bindings/testing/testing.h"
#include "common/error.h"

namespace nb = nanobind;

namespace kvcmas::py {
namespace {

using F2    = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F1    = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I1    = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I64_1 = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U8    = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Out2  = nb::ndarray<nb::numpy, float, nb::ndim<2>>;

constexpr int32_t kRows = 32;  // rows per block, as the engine's KV cache

Out2 out2(std::vector<float> && v, size_t rows, size_t cols) {
    auto *      p = new std::vector<float>(std::move(v));
    nb::capsule owner(p, [](void * q) noexcept { delete static_cast<std::vector<float> *>(q); });
    return Out2(p->data(), { rows, cols }, owner);
}

cpu::KvType kv_type_of(const std::string & name) {
    KC_CHECK(name == "f32" || name == "f16", "kv_type must be 'f32' or 'f16', got '%s'", name.c_str());
    return name == "f16" ? cpu::KvType::F16 : cpu::KvType::F32;
}

// (row0, n, shift, corr): n rows from stored row row0, keys read with `shift`, corrected by corrs[corr] (-1: none)
// whose factor row 0 belongs to the run's first row.
using RunSpec  = std::tuple<int32_t, int32_t, int32_t, int32_t>;
using CorrSpec = std::tuple<F2, F2, F2, F2>;  // a_k [n][r], b_k [r][kd], a_v, b_v

struct Ops {
    std::unique_ptr<backend::Backend> be;
    explicit Ops(const std::string & device, int n_threads) : be(backend::make_backend(device, n_threads)) {}

    backend::Buffer put(const float * p, size_t n) {
        backend::Buffer b(*be, n * sizeof(float));
        be->upload(b.data(), p, n * sizeof(float));
        return b;
    }
    std::vector<float> get(const backend::Buffer & b, size_t n) {
        std::vector<float> out(n);
        be->download(out.data(), b.data(), n * sizeof(float));
        return out;
    }
};

// A weight of GGUF type type_id from its raw row bytes.
backend::Weight weight_of(Ops & o, uint32_t type_id, U8 data, int64_t n_in, int64_t n_out) {
    const GgmlTypeTraits * tr = ggml_type_traits(type_id);
    KC_CHECK(tr != nullptr && tr->weight, "type %u is not a weight type", type_id);
    const GgmlType type = static_cast<GgmlType>(type_id);
    const size_t   rb   = ggml_row_bytes(type, n_in);
    KC_CHECK(data.shape(0) == rb * static_cast<size_t>(n_out), "weight data: %zu bytes, expected %zu",
             static_cast<size_t>(data.shape(0)), rb * static_cast<size_t>(n_out));
    return o.be->upload_weight(type, data.data(), n_in, n_out, rb);
}

// lora_add's group (a [rank][n_in], b [n_out][rank], rows, scales) and a product (y, its groups).
using LoraGroupSpec   = std::tuple<F2, F2, I1, F1>;
using LoraProductSpec = std::pair<F2, std::vector<LoraGroupSpec>>;

// Backend::lora_add on copies of x and each product's y, the factors stored as factor_type; the ys after.
// With weights (type_id, one matrix's row bytes per product): Backend::matmul_multi_lora instead, each product's y
// the output of its matrix (its initial values unused), products without groups left out of the call.
std::vector<Out2> lora_products(Ops & o, F2 x, const std::vector<LoraProductSpec> & specs,
                                const std::string & factor_type, uint32_t type_id = 0,
                                const std::vector<U8> * weights = nullptr) {
    KC_CHECK(factor_type == "f32" || factor_type == "f16" || factor_type == "i8",
             "lora_add: factor_type must be 'f32', 'f16' or 'i8', got '%s'", factor_type.c_str());
    const backend::LoraFactorType                type = factor_type == "f16"  ? backend::LoraFactorType::F16
                                                        : factor_type == "i8" ? backend::LoraFactorType::I8
                                                                              : backend::LoraFactorType::F32;
    const size_t                                 n = x.shape(0), n_in = x.shape(1);
    std::vector<backend::Buffer>                 bufs, ys;
    std::vector<std::vector<backend::LoraGroup>> gs(specs.size());
    for (size_t p = 0; p < specs.size(); ++p) {
        const auto & [y, groups] = specs[p];
        const size_t n_out       = y.shape(1);
        KC_CHECK(y.shape(0) == n, "lora_add: x and y must have the same rows");
        std::vector<bool> used(n, false);
        for (const auto & [a, b, rows, scales] : groups) {
            const size_t r = a.shape(0);
            KC_CHECK(r > 0 && a.shape(1) == n_in && b.shape(0) == n_out && b.shape(1) == r,
                     "lora_add: a [rank, n_in] and b [n_out, rank]");
            KC_CHECK(rows.shape(0) == scales.shape(0), "lora_add: one scale per row");
            for (size_t i = 0; i < rows.shape(0); ++i) {
                KC_CHECK(rows(i) >= 0 && static_cast<size_t>(rows(i)) < n && !used[rows(i)],
                         "lora_add: rows must be distinct rows of x");
                used[rows(i)] = true;
            }
            bufs.emplace_back();
            bufs.emplace_back();
            backend::upload_lora_factor(*o.be, a.data(), static_cast<int64_t>(r), static_cast<int64_t>(n_in), type,
                                        bufs[bufs.size() - 2], bufs.back());
            std::vector<float> b_t(n_out * r);  // the op takes B transposed
            for (size_t i = 0; i < n_out; ++i) {
                for (size_t c = 0; c < r; ++c) {
                    b_t[c * n_out + i] = b.data()[i * r + c];
                }
            }
            bufs.emplace_back();
            bufs.emplace_back();
            backend::upload_lora_b(*o.be, b_t.data(), static_cast<int>(r), static_cast<int64_t>(n_out), type,
                                   bufs[bufs.size() - 2], bufs.back());
            const size_t k = bufs.size();  // a, a's scales, b_t, b_t's scales
            gs[p].push_back(backend::LoraGroup{ bufs[k - 4].data(), bufs[k - 2].data(), type, bufs[k - 3].f32(),
                                                bufs[k - 1].f32(), static_cast<int>(r), 1.0f, rows.data(),
                                                scales.data(), static_cast<int64_t>(rows.shape(0)) });
        }
        ys.push_back(o.put(y.data(), n * n_out));
    }
    std::vector<backend::LoraProduct> products;
    for (size_t p = 0; p < specs.size(); ++p) {
        if (weights == nullptr || !gs[p].empty()) {
            products.push_back(backend::LoraProduct{ ys[p].f32(), static_cast<int64_t>(specs[p].first.shape(1)),
                                                     gs[p].data(), static_cast<int>(gs[p].size()) });
        }
    }
    backend::Buffer bx = o.put(x.data(), n * n_in);
    if (weights == nullptr) {
        o.be->lora_add(bx.f32(), static_cast<int64_t>(n_in), products.data(), static_cast<int>(products.size()));
    } else {
        KC_CHECK(weights->size() == specs.size() && !specs.empty() && specs.size() <= 7,
                 "matmul_lora: one weight per product, 1-7 of them");
        std::vector<backend::Weight> w;
        std::vector<float *>         yp;
        for (size_t p = 0; p < specs.size(); ++p) {
            w.push_back(weight_of(o, type_id, (*weights)[p], static_cast<int64_t>(n_in),
                                  static_cast<int64_t>(specs[p].first.shape(1))));
            yp.push_back(ys[p].f32());
        }
        o.be->matmul_multi_lora(w.data(), yp.data(), static_cast<int>(w.size()), bx.f32(), static_cast<int64_t>(n),
                                products.data(), static_cast<int>(products.size()));
        for (const backend::Weight & wi : w) {
            o.be->free_weight(wi);
        }
    }
    std::vector<Out2> out;
    for (size_t p = 0; p < specs.size(); ++p) {
        const size_t n_out = specs[p].first.shape(1);
        out.push_back(out2(o.get(ys[p], n * n_out), n, n_out));
    }
    return out;
}

// A gated activation op (swiglu, geglu_tanh: g = act(g) * u, [rows][n] in place) on copies of g and u.
Out2 gated(Ops & o, void (backend::Backend::*op)(float *, const float *, int64_t, int64_t), F2 g, F2 u) {
    const size_t r = g.shape(0), n = g.shape(1);
    KC_CHECK(u.shape(0) == r && u.shape(1) == n, "g and u must have one shape");
    backend::Buffer bg = o.put(g.data(), r * n), bu = o.put(u.data(), r * n);
    (o.be.get()->*op)(bg.f32(), bu.f32(), static_cast<int64_t>(r), static_cast<int64_t>(n));
    return out2(o.get(bg, r * n), r, n);
}

// A one-layer KV block store on the backend holding rows k, v [n_rows][kd] (stored as kv_type), plus room for
// `extra` more rows after them.
struct Store {
    backend::Backend &     be;
    std::vector<uint8_t *> blocks;
    size_t                 block_bytes;
    backend::KvStore       view;

    Store(backend::Backend & b, cpu::KvType type, int64_t kd, const float * k, const float * v, int64_t n_rows,
          int64_t extra)
        : be(b) {
        const int64_t es    = static_cast<int64_t>(cpu::kv_type_size(type));
        view.layer_stride   = 2 * kRows * kd * es;
        view.v_offset       = kRows * kd * es;
        view.row_bytes      = kd * es;
        view.n_kv_dim       = kd;
        view.kv_type        = type;
        block_bytes         = static_cast<size_t>(view.layer_stride);
        const int64_t total = n_rows + extra;
        for (int64_t i = 0; i < (total + kRows - 1) / kRows; ++i) {
            blocks.push_back(be.kv_block_alloc(block_bytes));
        }
        view.blocks = &blocks;
        std::vector<uint8_t> row(static_cast<size_t>(view.row_bytes));
        for (int64_t r = 0; r < n_rows; ++r) {
            uint8_t * dst = blocks[static_cast<size_t>(r / kRows)] + (r % kRows) * view.row_bytes;
            cpu::kv_store_row(type, k + r * kd, row.data(), kd);
            be.upload(dst, row.data(), row.size());
            cpu::kv_store_row(type, v + r * kd, row.data(), kd);
            be.upload(dst + view.v_offset, row.data(), row.size());
        }
    }
    ~Store() {
        for (uint8_t * p : blocks) {
            be.kv_block_free(p, block_bytes);
        }
    }
    // Rows [r0, r0 + n) as f32 (K, then V).
    std::pair<std::vector<float>, std::vector<float>> read(int64_t r0, int64_t n) {
        const int64_t        kd = view.n_kv_dim;
        std::vector<float>   k(static_cast<size_t>(n * kd)), v(static_cast<size_t>(n * kd));
        std::vector<uint8_t> row(static_cast<size_t>(view.row_bytes));
        for (int64_t i = 0; i < n; ++i) {
            const int64_t   r   = r0 + i;
            const uint8_t * src = blocks[static_cast<size_t>(r / kRows)] + (r % kRows) * view.row_bytes;
            be.download(row.data(), src, row.size());
            cpu::kv_load_row(view.kv_type, row.data(), &k[static_cast<size_t>(i * kd)], kd);
            be.download(row.data(), src + view.v_offset, row.size());
            cpu::kv_load_row(view.kv_type, row.data(), &v[static_cast<size_t>(i * kd)], kd);
        }
        return { std::move(k), std::move(v) };
    }
};

// Factors of the given corrections on the backend (kept alive by `keep`), and the run table of the specs, runs
// split at block boundaries.
backend::RunTable make_table(backend::Backend & be, const std::vector<RunSpec> & runs,
                             const std::vector<CorrSpec> & corrs, int64_t kd,
                             std::vector<std::shared_ptr<const backend::Factors>> & keep) {
    backend::RunTable t;
    for (const CorrSpec & c : corrs) {
        const F2 & a_k = std::get<0>(c);
        const F2 & b_k = std::get<1>(c);
        const F2 & a_v = std::get<2>(c);
        const F2 & b_v = std::get<3>(c);
        const int  r   = static_cast<int>(a_k.shape(1));
        KC_CHECK(r > 0 && r <= cpu::kMaxCorrectionRank && b_k.shape(0) == static_cast<size_t>(r) &&
                     b_k.shape(1) == static_cast<size_t>(kd) && a_v.shape(0) == a_k.shape(0) &&
                     a_v.shape(1) == a_k.shape(1) && b_v.shape(0) == b_k.shape(0) && b_v.shape(1) == b_k.shape(1),
                 "correction factors must be A [n, r] and B [r, kd] for K and V");
        keep.push_back(be.upload_factors(r, static_cast<int32_t>(a_k.shape(0)), kd, a_k.data(), b_k.data(), a_v.data(),
                                         b_v.data()));
        t.corrs.push_back(keep.back().get());
    }
    for (const RunSpec & s : runs) {
        const int32_t row0 = std::get<0>(s), n = std::get<1>(s), shift = std::get<2>(s), corr = std::get<3>(s);
        KC_CHECK(row0 >= 0 && n > 0 && corr >= -1 && corr < static_cast<int32_t>(corrs.size()), "bad run spec");
        if (corr >= 0) {
            KC_CHECK(static_cast<size_t>(n) <= std::get<0>(corrs[static_cast<size_t>(corr)]).shape(0),
                     "a run's correction covers fewer rows than the run");
        }
        for (int32_t r = row0; r < row0 + n;) {
            const int32_t take = std::min(kRows - r % kRows, row0 + n - r);
            t.runs.push_back(backend::KvRunRef{ r / kRows, r % kRows, take, shift, corr, corr >= 0 ? r - row0 : 0 });
            r += take;
        }
    }
    return t;
}

cpu::Rope make_rope(int n_rot, bool neox, F1 inv_freq) {
    KC_CHECK(n_rot > 0 && n_rot % 2 == 0 && inv_freq.shape(0) == static_cast<size_t>(n_rot / 2),
             "rope: inv_freq must have n_rot / 2 entries");
    cpu::Rope r;
    r.n_rot = n_rot;
    r.neox  = neox;
    r.inv_freq.assign(inv_freq.data(), inv_freq.data() + n_rot / 2);
    return r;
}

cpu::AttentionShape make_shape(int n_head, int n_head_kv, int head_dim, cpu::KvType type) {
    KC_CHECK(n_head > 0 && n_head_kv > 0 && n_head % n_head_kv == 0 && head_dim > 0 && head_dim <= 1024,
             "bad attention shape");
    return cpu::AttentionShape{ n_head,
                                n_head_kv,
                                head_dim,
                                static_cast<int64_t>(n_head_kv) * head_dim,
                                static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim))),
                                type };
}

}  // namespace

void bind_backend(nb::module_ & m) {
    nb::class_<Ops>(m, "BackendOps", "One backend's ops on host arrays, for tests (see tests/test_backend_ops.py).")
        .def(nb::init<const std::string &, int>(), nb::arg("device") = "cpu", nb::arg("n_threads") = 1)
        .def_prop_ro("name", [](const Ops & o) { return o.be->name(); })
        .def_prop_ro("device_description", [](const Ops & o) { return o.be->device(); })
        .def(
            "free_bytes", [](Ops & o) { return o.be->free_bytes(); },
            "device memory free now (the CPU backend: 0, its memory is the process's)")
        .def(
            "set_activations", [](Ops & o, const std::string & act) { o.be->set_activations(parse_activations(act)); },
            nb::arg("activations"),
            "'q8' or 'f32': the activations of the backend's matmuls (the CPU backend; others keep theirs).")
        .def(
            "try_alloc", [](Ops & o, size_t bytes) { backend::Buffer b(*o.be, bytes); }, nb::arg("bytes"),
            "Allocates and frees `bytes` of backend memory (raises when the device cannot hold them).")
        .def(
            "matmul",
            [](Ops & o, uint32_t type_id, U8 data, int64_t n_in, int64_t n_out, F2 x) {
                KC_CHECK(x.shape(1) == static_cast<size_t>(n_in), "x must have n_in columns");
                const int64_t   n  = static_cast<int64_t>(x.shape(0));
                backend::Weight w  = weight_of(o, type_id, data, n_in, n_out);
                backend::Buffer bx = o.put(x.data(), static_cast<size_t>(n * n_in));
                backend::Buffer by(*o.be, static_cast<size_t>(n * n_out) * sizeof(float));
                o.be->matmul(w, bx.f32(), by.f32(), n);
                auto y = o.get(by, static_cast<size_t>(n * n_out));
                o.be->free_weight(w);
                return out2(std::move(y), static_cast<size_t>(n), static_cast<size_t>(n_out));
            },
            nb::arg("type_id"), nb::arg("data"), nb::arg("n_in"), nb::arg("n_out"), nb::arg("x"),
            "y [n_tok, n_out] = x [n_tok, n_in] · Wᵀ for a weight W of GGUF type type_id (raw row bytes).")
        .def(
            "matmul_multi",
            [](Ops & o, uint32_t type_id, std::vector<U8> datas, int64_t n_in, std::vector<int64_t> n_outs, F2 x,
               std::vector<uint32_t> type_ids) {
                KC_CHECK(datas.size() == n_outs.size() && !datas.empty() && datas.size() <= 7, "1-7 matrices");
                KC_CHECK(type_ids.empty() || type_ids.size() == datas.size(), "type_ids: one per matrix");
                const int64_t                n = static_cast<int64_t>(x.shape(0));
                std::vector<backend::Weight> w;
                std::vector<backend::Buffer> ys;
                std::vector<float *>         yp;
                for (size_t i = 0; i < datas.size(); ++i) {
                    w.push_back(weight_of(o, type_ids.empty() ? type_id : type_ids[i], datas[i], n_in, n_outs[i]));
                    ys.emplace_back(*o.be, static_cast<size_t>(n * n_outs[i]) * sizeof(float));
                    yp.push_back(ys.back().f32());
                }
                backend::Buffer bx = o.put(x.data(), static_cast<size_t>(n * n_in));
                o.be->matmul_multi(w.data(), yp.data(), static_cast<int>(w.size()), bx.f32(), n);
                nb::list out;
                for (size_t i = 0; i < datas.size(); ++i) {
                    out.append(out2(o.get(ys[i], static_cast<size_t>(n * n_outs[i])), static_cast<size_t>(n),
                                    static_cast<size_t>(n_outs[i])));
                    o.be->free_weight(w[i]);
                }
                return out;
            },
            nb::arg("type_id"), nb::arg("datas"), nb::arg("n_in"), nb::arg("n_outs"), nb::arg("x"),
            nb::arg("type_ids") = std::vector<uint32_t>{},
            "[y_i = x · W_iᵀ] for weights of type type_id, or of type_ids[i] (a layer's mix of types).")
        .def(
            "matmul_experts",
            [](Ops & o, uint32_t type_id, std::vector<U8> datas, int64_t n_in, std::vector<int64_t> n_outs,
               std::vector<int64_t> first, F2 x) {
                const size_t n_mats = n_outs.size();
                KC_CHECK(n_mats >= 1 && n_mats <= 7 && !first.empty() && datas.size() == (first.size() - 1) * n_mats,
                         "matmul_experts: n_groups x (1-7) matrices, first of n_groups + 1 entries");
                const int64_t n = static_cast<int64_t>(x.shape(0));
                KC_CHECK(first.front() == 0 && first.back() == n, "matmul_experts: first must run from 0 to %lld",
                         static_cast<long long>(n));
                std::vector<backend::Weight> w;
                for (size_t i = 0; i < datas.size(); ++i) {
                    w.push_back(weight_of(o, type_id, datas[i], n_in, n_outs[i % n_mats]));
                }
                std::vector<backend::Buffer> ys;
                std::vector<float *>         yp;
                for (size_t i = 0; i < n_mats; ++i) {
                    ys.emplace_back(*o.be, static_cast<size_t>(n * n_outs[i]) * sizeof(float));
                    yp.push_back(ys.back().f32());
                }
                backend::Buffer bx = o.put(x.data(), static_cast<size_t>(n * n_in));
                o.be->matmul_experts(w.data(), static_cast<int>(n_mats), static_cast<int>(first.size() - 1),
                                     first.data(), bx.f32(), yp.data());
                nb::list out;
                for (size_t i = 0; i < n_mats; ++i) {
                    out.append(out2(o.get(ys[i], static_cast<size_t>(n * n_outs[i])), static_cast<size_t>(n),
                                    static_cast<size_t>(n_outs[i])));
                }
                for (const backend::Weight & wi : w) {
                    o.be->free_weight(wi);
                }
                return out;
            },
            nb::arg("type_id"), nb::arg("datas"), nb::arg("n_in"), nb::arg("n_outs"), nb::arg("first"), nb::arg("x"),
            "Grouped expert products: group g's rows [first[g], first[g+1]) of x times its n_mats matrices "
            "datas[g * n_mats + i] into the same rows of output i.")
        .def(
            "embed_rows",
            [](Ops & o, uint32_t type_id, U8 data, int64_t n_in, int64_t n_out, I1 tokens) {
                const int64_t n = static_cast<int64_t>(tokens.shape(0));
                for (int64_t i = 0; i < n; ++i) {
                    KC_CHECK(tokens(i) >= -1 && tokens(i) < n_out, "token %d out of range", tokens(i));
                }
                backend::Weight    w = weight_of(o, type_id, data, n_in, n_out);
                std::vector<float> zeros(static_cast<size_t>(n * n_in), 0.0f);
                backend::Buffer    bx = o.put(zeros.data(), zeros.size());
                o.be->embed_rows(w, tokens.data(), n, bx.f32());
                o.be->free_weight(w);
                return out2(o.get(bx, zeros.size()), static_cast<size_t>(n), static_cast<size_t>(n_in));
            },
            nb::arg("type_id"), nb::arg("data"), nb::arg("n_in"), nb::arg("n_out"), nb::arg("tokens"))
        .def(
            "rms_norm",
            [](Ops & o, F2 x, F1 w, float eps) {
                const size_t r = x.shape(0), n = x.shape(1);
                KC_CHECK(w.shape(0) == n, "w must have x's width");
                backend::Buffer bx = o.put(x.data(), r * n), bw = o.put(w.data(), n), by(*o.be, r * n * 4);
                o.be->rms_norm(bx.f32(), bw.f32(), by.f32(), static_cast<int64_t>(r), static_cast<int64_t>(n), eps);
                return out2(o.get(by, r * n), r, n);
            },
            nb::arg("x"), nb::arg("w"), nb::arg("eps"))
        .def(
            "add_bias",
            [](Ops & o, F2 y, F1 b) {
                const size_t r = y.shape(0), n = y.shape(1);
                KC_CHECK(b.shape(0) == n, "b must have y's width");
                backend::Buffer by = o.put(y.data(), r * n), bb = o.put(b.data(), n);
                o.be->add_bias(by.f32(), bb.f32(), static_cast<int64_t>(r), static_cast<int64_t>(n));
                return out2(o.get(by, r * n), r, n);
            },
            nb::arg("y"), nb::arg("b"))
        .def(
            "add",
            [](Ops & o, F2 x, F2 y) {
                const size_t r = x.shape(0), n = x.shape(1);
                KC_CHECK(y.shape(0) == r && y.shape(1) == n, "x and y must have one shape");
                backend::Buffer bx = o.put(x.data(), r * n), by = o.put(y.data(), r * n);
                o.be->add(bx.f32(), by.f32(), static_cast<int64_t>(r * n));
                return out2(o.get(bx, r * n), r, n);
            },
            nb::arg("x"), nb::arg("y"))
        .def(
            "swiglu", [](Ops & o, F2 g, F2 u) { return gated(o, &backend::Backend::swiglu, g, u); }, nb::arg("g"),
            nb::arg("u"))
        .def(
            "geglu_tanh", [](Ops & o, F2 g, F2 u) { return gated(o, &backend::Backend::geglu_tanh, g, u); },
            nb::arg("g"), nb::arg("u"))
        .def(
            "swiglu_oai",
            [](Ops & o, F2 g, F2 u, float alpha, float limit) {
                const size_t r = g.shape(0), n = g.shape(1);
                KC_CHECK(u.shape(0) == r && u.shape(1) == n, "g and u must have one shape");
                backend::Buffer bg = o.put(g.data(), r * n), bu = o.put(u.data(), r * n);
                o.be->swiglu_oai(bg.f32(), bu.f32(), static_cast<int64_t>(r), static_cast<int64_t>(n), alpha, limit);
                return out2(o.get(bg, r * n), r, n);
            },
            nb::arg("g"), nb::arg("u"), nb::arg("alpha"), nb::arg("limit"))
        .def(
            "scale",
            [](Ops & o, F2 x, float s) {
                const size_t    r = x.shape(0), n = x.shape(1);
                backend::Buffer bx = o.put(x.data(), r * n);
                o.be->scale(bx.f32(), s, static_cast<int64_t>(r * n));
                return out2(o.get(bx, r * n), r, n);
            },
            nb::arg("x"), nb::arg("s"))
        .def(
            "moe_route",
            [](Ops & o, F2 logits, int k, bool norm) {
                const size_t n = logits.shape(0), x = logits.shape(1);
                KC_CHECK(k > 0 && static_cast<size_t>(k) <= x, "moe_route: k must be in [1, n_expert]");
                backend::Buffer      bl = o.put(logits.data(), n * x);
                std::vector<int32_t> ids(n * static_cast<size_t>(k));
                std::vector<float>   w(n * static_cast<size_t>(k));
                o.be->moe_route(bl.f32(), static_cast<int64_t>(n), static_cast<int>(x), k, norm, ids.data(), w.data());
                std::vector<float> id_f(ids.begin(), ids.end());  // small ints, exact as floats
                return nb::make_tuple(out2(std::move(id_f), n, static_cast<size_t>(k)),
                                      out2(std::move(w), n, static_cast<size_t>(k)));
            },
            nb::arg("logits"), nb::arg("k"), nb::arg("norm"))
        .def(
            "gather_add_rows",
            [](Ops & o, F2 src, I1 rows, F2 dst, I1 dst_rows, F1 scales) {
                const size_t n = rows.shape(0), width = src.shape(1);
                KC_CHECK(dst.shape(1) == width && dst_rows.shape(0) == n && scales.shape(0) == n,
                         "gather_add_rows: shapes disagree");
                for (size_t i = 0; i < n; ++i) {
                    KC_CHECK(rows(i) >= 0 && static_cast<size_t>(rows(i)) < src.shape(0) && dst_rows(i) >= 0 &&
                                 static_cast<size_t>(dst_rows(i)) < dst.shape(0),
                             "gather_add_rows: row out of range");
                }
                backend::Buffer bs = o.put(src.data(), src.shape(0) * width),
                                bd = o.put(dst.data(), dst.shape(0) * width);
                backend::Buffer bg(*o.be, std::max<size_t>(n * width, 1) * sizeof(float));
                o.be->gather_rows(bs.f32(), rows.data(), static_cast<int64_t>(n), static_cast<int64_t>(width),
                                  bg.f32());
                o.be->add_scaled_rows(bd.f32(), bg.f32(), dst_rows.data(), scales.data(), static_cast<int64_t>(n),
                                      static_cast<int64_t>(width));
                return nb::make_tuple(out2(o.get(bg, n * width), n, width),
                                      out2(o.get(bd, dst.shape(0) * width), dst.shape(0), width));
            },
            nb::arg("src"), nb::arg("rows"), nb::arg("dst"), nb::arg("dst_rows"), nb::arg("scales"),
            "gather_rows of src, then add_scaled_rows of those rows into dst: (gathered, dst after).")
        .def(
            "lora_add",
            [](Ops & o, F2 x, F2 y, const std::vector<LoraGroupSpec> & groups, const std::string & factor_type) {
                return lora_products(o, x, { { y, groups } }, factor_type)[0];
            },
            nb::arg("x"), nb::arg("y"), nb::arg("groups"), nb::arg("factor_type") = "f32",
            "y after y[r] += s · B (A x[r]) for each group (a, b, rows, scales) and each of its rows r (scale s), the "
            "factors stored as factor_type ('f32', 'f16' or 'i8').")
        .def(
            "lora_add_products",
            [](Ops & o, F2 x, const std::vector<LoraProductSpec> & products, const std::string & factor_type) {
                return lora_products(o, x, products, factor_type);
            },
            nb::arg("x"), nb::arg("products"), nb::arg("factor_type") = "f32",
            "lora_add of several products (y, groups) of one x in one call: the list of the ys after.")
        .def(
            "matmul_lora_products",
            [](Ops & o, uint32_t type_id, const std::vector<U8> & datas, F2 x,
               const std::vector<LoraProductSpec> & products,
               const std::string & factor_type) { return lora_products(o, x, products, factor_type, type_id, &datas); },
            nb::arg("type_id"), nb::arg("datas"), nb::arg("x"), nb::arg("products"), nb::arg("factor_type") = "f32",
            "matmul_multi_lora: y_p = x · W_pᵀ (W_p of GGUF type type_id, raw row bytes datas[p]) plus product p's "
            "groups' updates (y_p's shape from products[p]): the list of the ys.")
        .def(
            "rope_kv_write",
            [](Ops & o, int n_head, int n_head_kv, int head_dim, const std::string & kv_type, int n_rot, bool neox,
               F1 inv_freq, F2 q, F2 k, F2 v, I64_1 pos_q, I64_1 pos_k) {
                const cpu::KvType         type  = kv_type_of(kv_type);
                const cpu::AttentionShape shape = make_shape(n_head, n_head_kv, head_dim, type);
                const cpu::Rope           rope  = make_rope(n_rot, neox, inv_freq);
                const int64_t n = static_cast<int64_t>(q.shape(0)), qd = static_cast<int64_t>(n_head) * head_dim,
                              kd = shape.row_stride, half = n_rot / 2;
                KC_CHECK(q.shape(1) == static_cast<size_t>(qd) && k.shape(0) == q.shape(0) &&
                             k.shape(1) == static_cast<size_t>(kd) && v.shape(0) == k.shape(0) &&
                             v.shape(1) == k.shape(1) && pos_q.shape(0) == q.shape(0) && pos_k.shape(0) == q.shape(0),
                         "rope_kv_write: q [n, n_head·hd], k, v [n, kd], positions [n]");
                std::vector<float> cq(n * half), sq(n * half), ck(n * half), sk(n * half);
                for (int64_t i = 0; i < n; ++i) {
                    rope.angles(static_cast<double>(pos_q(i)), &cq[i * half], &sq[i * half]);
                    rope.angles(static_cast<double>(pos_k(i)), &ck[i * half], &sk[i * half]);
                }
                Store store(*o.be, type, kd, nullptr, nullptr, 0, n);
                auto  bq = o.put(q.data(), n * qd), bk = o.put(k.data(), n * kd), bv = o.put(v.data(), n * kd);
                auto  bcq = o.put(cq.data(), cq.size()), bsq = o.put(sq.data(), sq.size());
                auto  bck = o.put(ck.data(), ck.size()), bsk = o.put(sk.data(), sk.size());
                std::vector<backend::KvSlotRef> slots;
                for (int64_t i = 0; i < n; ++i) {
                    slots.push_back(
                        backend::KvSlotRef{ static_cast<int32_t>(i / kRows), static_cast<int32_t>(i % kRows) });
                }
                o.be->rope_kv_write(rope, shape, bq.f32(), bk.f32(), bv.f32(), n, bcq.f32(), bsq.f32(), bck.f32(),
                                    bsk.f32(), store.view, 0, slots.data());
                auto rows = store.read(0, n);
                return std::make_tuple(out2(o.get(bq, n * qd), n, qd), out2(std::move(rows.first), n, kd),
                                       out2(std::move(rows.second), n, kd));
            },
            nb::arg("n_head"), nb::arg("n_head_kv"), nb::arg("head_dim"), nb::arg("kv_type"), nb::arg("n_rot"),
            nb::arg("neox"), nb::arg("inv_freq"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("pos_q"),
            nb::arg("pos_k"), "(q rotated, K rows as stored, V rows as stored), all f32.")
        .def(
            "attention",
            [](Ops & o, int n_head, int n_head_kv, int head_dim, const std::string & kv_type, int n_rot, bool neox,
               F1 inv_freq, F2 q, F2 k, F2 v, std::vector<RunSpec> runs, std::vector<CorrSpec> corrs,
               int64_t n_visible0, std::optional<F1> sinks) {
                const cpu::KvType   type  = kv_type_of(kv_type);
                cpu::AttentionShape shape = make_shape(n_head, n_head_kv, head_dim, type);
                backend::Buffer     bsinks;
                if (sinks) {
                    KC_CHECK(sinks->shape(0) == static_cast<size_t>(n_head), "sinks: one logit per query head");
                    bsinks      = o.put(sinks->data(), n_head);
                    shape.sinks = bsinks.f32();
                }
                const cpu::Rope rope = make_rope(n_rot, neox, inv_freq);
                const int64_t   nq = static_cast<int64_t>(q.shape(0)), qd = static_cast<int64_t>(n_head) * head_dim,
                                kd = shape.row_stride;
                KC_CHECK(q.shape(1) == static_cast<size_t>(qd) && k.shape(1) == static_cast<size_t>(kd) &&
                             v.shape(0) == k.shape(0) && v.shape(1) == k.shape(1) && nq >= 1,
                         "attention: q [nq, n_head·hd], k, v [rows, kd]");
                int64_t total = 0;
                for (const RunSpec & s : runs) {
                    KC_CHECK(std::get<0>(s) + std::get<1>(s) <= static_cast<int32_t>(k.shape(0)),
                             "a run reaches past the rows given");
                    total += std::get<1>(s);
                }
                KC_CHECK(n_visible0 >= 1 && n_visible0 + nq - 1 <= total, "n_visible0 out of range");
                Store store(*o.be, type, kd, k.data(), v.data(), static_cast<int64_t>(k.shape(0)), 0);
                std::vector<std::shared_ptr<const backend::Factors>> keep;
                const backend::RunTable                              table = make_table(*o.be, runs, corrs, kd, keep);
                std::vector<backend::QueryBlock> blocks;  // the queries in blocks of kMaxAttentionBlock, one call
                for (int64_t first = 0; first < nq; first += cpu::kMaxAttentionBlock) {
                    const int n_block = static_cast<int>(std::min<int64_t>(cpu::kMaxAttentionBlock, nq - first));
                    blocks.push_back(backend::QueryBlock{ first, n_block, n_visible0 + first, 0 });
                }
                backend::Buffer bq = o.put(q.data(), nq * qd), bo(*o.be, nq * qd * sizeof(float));
                o.be->attention(shape, rope, store.view, 0, bq.f32(), bo.f32(), nq, blocks.data(),
                                static_cast<int>(blocks.size()), &table, n_visible0 + nq - 1);
                return out2(o.get(bo, nq * qd), nq, qd);
            },
            nb::arg("n_head"), nb::arg("n_head_kv"), nb::arg("head_dim"), nb::arg("kv_type"), nb::arg("n_rot"),
            nb::arg("neox"), nb::arg("inv_freq"), nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("runs"),
            nb::arg("corrs"), nb::arg("n_visible0"), nb::arg("sinks") = nb::none(),
            "Attention of nq consecutive queries (query i sees n_visible0 + i rows) over runs (row0, n, shift, corr) "
            "of rows k, v stored as kv_type, corrections corrs[i] = (a_k, b_k, a_v, b_v); sinks [n_head]: a sink "
            "logit per query head in the softmax's denominator.")
        .def(
            "kv_read",
            [](Ops & o, int n_head_kv, int head_dim, const std::string & kv_type, int n_rot, bool neox, F1 inv_freq,
               F2 k, F2 v, std::vector<RunSpec> runs, std::vector<CorrSpec> corrs) {
                const cpu::KvType         type  = kv_type_of(kv_type);
                const cpu::AttentionShape shape = make_shape(n_head_kv, n_head_kv, head_dim, type);
                const cpu::Rope           rope  = make_rope(n_rot, neox, inv_freq);
                const int64_t             kd    = shape.row_stride;
                Store store(*o.be, type, kd, k.data(), v.data(), static_cast<int64_t>(k.shape(0)), 0);
                std::vector<std::shared_ptr<const backend::Factors>> keep;
                const backend::RunTable                              table = make_table(*o.be, runs, corrs, kd, keep);
                int64_t                                              total = 0;
                for (const backend::KvRunRef & r : table.runs) {
                    total += r.n;
                }
                std::vector<float> ko(static_cast<size_t>(total * kd)), vo(static_cast<size_t>(total * kd));
                int64_t            at = 0;
                for (size_t r = 0; r < table.runs.size(); ++r) {
                    o.be->kv_read(rope, shape, store.view, 0, table, static_cast<int>(r), 0, table.runs[r].n,
                                  &ko[static_cast<size_t>(at * kd)], &vo[static_cast<size_t>(at * kd)]);
                    at += table.runs[r].n;
                }
                return std::make_pair(out2(std::move(ko), total, kd), out2(std::move(vo), total, kd));
            },
            nb::arg("n_head_kv"), nb::arg("head_dim"), nb::arg("kv_type"), nb::arg("n_rot"), nb::arg("neox"),
            nb::arg("inv_freq"), nb::arg("k"), nb::arg("v"), nb::arg("runs"), nb::arg("corrs"))
        .def(
            "kv_copy",
            [](Ops & o, int n_head_kv, int head_dim, const std::string & kv_type, int n_rot, bool neox, F1 inv_freq,
               F2 k, F2 v, std::vector<RunSpec> runs, std::vector<CorrSpec> corrs, I64_1 shifts) {
                const cpu::KvType         type  = kv_type_of(kv_type);
                const cpu::AttentionShape shape = make_shape(n_head_kv, n_head_kv, head_dim, type);
                const cpu::Rope           rope  = make_rope(n_rot, neox, inv_freq);
                const int64_t             kd = shape.row_stride, n_src = static_cast<int64_t>(k.shape(0));
                const int64_t             n_out = static_cast<int64_t>(shifts.shape(0));
                Store                     store(*o.be, type, kd, k.data(), v.data(), n_src, n_out + kRows);
                std::vector<std::shared_ptr<const backend::Factors>> keep;
                const backend::RunTable                              table = make_table(*o.be, runs, corrs, kd, keep);
                int64_t                                              total = 0;
                for (const backend::KvRunRef & r : table.runs) {
                    total += r.n;
                }
                KC_CHECK(total == n_out, "kv_copy: one shift per row of the runs (%lld rows)",
                         static_cast<long long>(total));
                const int64_t                   dst0 = (n_src + kRows - 1) / kRows * kRows;  // a fresh block
                std::vector<backend::KvSlotRef> slots;
                for (int64_t i = 0; i < n_out; ++i) {
                    slots.push_back(backend::KvSlotRef{ static_cast<int32_t>((dst0 + i) / kRows),
                                                        static_cast<int32_t>((dst0 + i) % kRows) });
                }
                o.be->kv_copy(rope, shape, store.view, 0, table, 0, static_cast<int>(table.runs.size()), shifts.data(),
                              slots.data());
                auto rows = store.read(dst0, n_out);
                return std::make_pair(out2(std::move(rows.first), n_out, kd), out2(std::move(rows.second), n_out, kd));
            },
            nb::arg("n_head_kv"), nb::arg("head_dim"), nb::arg("kv_type"), nb::arg("n_rot"), nb::arg("neox"),
            nb::arg("inv_freq"), nb::arg("k"), nb::arg("v"), nb::arg("runs"), nb::arg("corrs"), nb::arg("shifts"),
            "The runs' rows copied (corrected, keys rotated by shifts[i]) into fresh rows, read back as f32.")
        .def(
            "ridge_rows",
            [](Ops & o, const std::string & kv_type, F2 k, F2 v, RunSpec run, std::vector<CorrSpec> corrs, bool values,
               int32_t j0, int32_t j1, F1 mu, F2 proj, F2 mm) {
                const cpu::KvType type = kv_type_of(kv_type);
                const int64_t     kd   = static_cast<int64_t>(k.shape(1));
                const int         rank = static_cast<int>(proj.shape(1));
                KC_CHECK(mu.shape(0) == static_cast<size_t>(kd) && proj.shape(0) == static_cast<size_t>(kd) &&
                             rank > 0 && rank < cpu::kMaxCorrectionRank &&
                             (mm.shape(0) == 0 || mm.shape(1) == static_cast<size_t>(rank)),
                         "ridge_rows: mu [kd], proj [kd, rank], m [b_rank, rank]");
                KC_CHECK(std::get<0>(run) % kRows + std::get<1>(run) <= kRows, "ridge_rows: one block's run");
                KC_CHECK(0 <= j0 && j0 < j1 && j1 <= std::get<1>(run), "ridge_rows: rows [j0, j1) of the run");
                Store store(*o.be, type, kd, k.data(), v.data(), static_cast<int64_t>(k.shape(0)), 0);
                std::vector<std::shared_ptr<const backend::Factors>> keep;
                const backend::RunTable table = make_table(*o.be, { run }, corrs, kd, keep);
                backend::RidgeJob       job;
                job.run    = table.runs[0];
                job.f      = job.run.corr >= 0 ? table.corrs[static_cast<size_t>(job.run.corr)] : nullptr;
                job.values = values;
                job.j0     = j0;
                job.j1     = j1;
                job.mu     = mu.data();
                job.proj   = proj.data();
                job.m      = mm.data();
                job.b_rank = static_cast<int>(mm.shape(0));
                KC_CHECK(job.b_rank == (job.f != nullptr ? job.f->rank : 0), "ridge_rows: m needs the run's rank rows");
                std::vector<float> out(static_cast<size_t>((j1 - j0) * (rank + 1)));
                job.out        = out.data();
                job.out_stride = rank + 1;
                o.be->ridge_rows(store.view, 0, &job, 1, rank);
                return out2(std::move(out), static_cast<size_t>(j1 - j0), static_cast<size_t>(rank + 1));
            },
            nb::arg("kv_type"), nb::arg("k"), nb::arg("v"), nb::arg("run"), nb::arg("corrs"), nb::arg("values"),
            nb::arg("j0"), nb::arg("j1"), nb::arg("mu"), nb::arg("proj"), nb::arg("m"),
            "[(x_i - mu)·proj + a_i·m, 1] for rows [j0, j1) of one run's K (or V) side.")
        // ---- the vision towers' ops
        .def(
            "layer_norm",
            [](Ops & o, F2 x, F1 w, F1 b, float eps) {
                const size_t r = x.shape(0), n = x.shape(1);
                KC_CHECK(w.shape(0) == n && b.shape(0) == n, "w and b must have x's width");
                backend::Buffer bx = o.put(x.data(), r * n), bw = o.put(w.data(), n), bb = o.put(b.data(), n);
                o.be->layer_norm(bx.f32(), bw.f32(), bb.f32(), bx.f32(), static_cast<int64_t>(r),
                                 static_cast<int64_t>(n), eps);
                return out2(o.get(bx, r * n), r, n);
            },
            nb::arg("x"), nb::arg("w"), nb::arg("b"), nb::arg("eps"), "LayerNorm of each row (in place on the device).")
        .def(
            "activate",
            [](Ops & o, const std::string & act, F2 x, std::optional<F2> mul) {
                Activation a;
                KC_CHECK(parse_activation(act.c_str(), a), "unknown activation '%s'", act.c_str());
                const size_t r = x.shape(0), n = x.shape(1);
                KC_CHECK(!mul || (mul->shape(0) == r && mul->shape(1) == n), "mul must have x's shape");
                backend::Buffer bx = o.put(x.data(), r * n);
                backend::Buffer bm = mul ? o.put(mul->data(), r * n) : backend::Buffer();
                o.be->activate(a, bx.f32(), mul ? bm.f32() : nullptr, static_cast<int64_t>(r), static_cast<int64_t>(n));
                return out2(o.get(bx, r * n), r, n);
            },
            nb::arg("act"), nb::arg("x"), nb::arg("mul") = nb::none(),
            "act(x) (times mul) element-wise; act a Hugging Face name (gelu, gelu_pytorch_tanh, quick_gelu, silu).")
        .def(
            "segment_attention",
            [](Ops & o, F2 q, F2 k, F2 v, int64_t n_head, std::vector<int64_t> seg) {
                const size_t r = q.shape(0), e = q.shape(1);
                KC_CHECK(k.shape(0) == r && k.shape(1) == e && v.shape(0) == r && v.shape(1) == e,
                         "q, k, v must have one shape");
                KC_CHECK(seg.size() >= 2, "seg: at least one segment");
                backend::Buffer bq = o.put(q.data(), r * e), bk = o.put(k.data(), r * e), bv = o.put(v.data(), r * e);
                backend::Buffer bo(*o.be, r * e * sizeof(float));
                o.be->segment_attention(bq.f32(), bk.f32(), bv.f32(), bo.f32(), static_cast<int64_t>(r),
                                        static_cast<int64_t>(e), n_head, seg.data(), static_cast<int>(seg.size()) - 1);
                return out2(o.get(bo, r * e), r, e);
            },
            nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("n_head"), nb::arg("seg"),
            "Bidirectional attention within the segments [seg[s], seg[s + 1]) of the rows.")
        .def(
            "rotate_half_rows",
            [](Ops & o, F2 x, F2 cos_t, F2 sin_t, int64_t n_head) {
                const size_t r = x.shape(0), e = x.shape(1), half = cos_t.shape(1);
                KC_CHECK(cos_t.shape(0) == r && sin_t.shape(0) == r && sin_t.shape(1) == half &&
                             e == static_cast<size_t>(n_head) * 2 * half,
                         "cos_t, sin_t must be [rows, head_dim / 2]");
                backend::Buffer bx = o.put(x.data(), r * e), bc = o.put(cos_t.data(), r * half);
                backend::Buffer bs = o.put(sin_t.data(), r * half);
                o.be->rotate_half_rows(bx.f32(), bc.f32(), bs.f32(), static_cast<int64_t>(r), n_head,
                                       static_cast<int64_t>(2 * half));
                return out2(o.get(bx, r * e), r, e);
            },
            nb::arg("x"), nb::arg("cos_t"), nb::arg("sin_t"), nb::arg("n_head"),
            "Pairs (i, i + hd/2) of each head rotated by the row's angles.")
        .def(
            "avg_pool_rms_norm",
            [](Ops & o, F2 x, F1 w, int64_t n_img, int64_t grid, int64_t k, float eps) {
                const size_t e = x.shape(1);
                KC_CHECK(
                    k > 0 && grid % k == 0 && x.shape(0) == static_cast<size_t>(n_img * grid * grid) && w.shape(0) == e,
                    "x must be [n_img * grid * grid, E], k divide grid, w [E]");
                const size_t    n_out = static_cast<size_t>(n_img * (grid / k) * (grid / k));
                backend::Buffer bx = o.put(x.data(), x.shape(0) * e), bw = o.put(w.data(), e);
                backend::Buffer by(*o.be, n_out * e * sizeof(float));
                o.be->avg_pool_rms_norm(bx.f32(), bw.f32(), by.f32(), n_img, grid, k, static_cast<int64_t>(e), eps);
                return out2(o.get(by, n_out * e), n_out, e);
            },
            nb::arg("x"), nb::arg("w"), nb::arg("n_img"), nb::arg("grid"), nb::arg("k"), nb::arg("eps"),
            "k x k average pooling of each image's grid of rows, then RMSNorm.");
}

}  // namespace kvcmas::py
