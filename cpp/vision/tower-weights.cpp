#include "vision/tower-weights.h"

#include <cstring>

#include "common/error.h"

namespace kvcmas::vision {

std::unique_ptr<backend::Backend> make_tower_backend(const std::string & path, const std::string & name,
                                                     int n_threads) {
    try {
        return backend::make_backend(name, n_threads);
    } catch (const Error & e) {
        fail("%s: cannot run the vision tower on backend '%s': %s", path.c_str(), name.c_str(), e.what());
    }
}

backend::Weight upload_matrix(backend::Backend & be, const TensorLoader & loader, const std::string & name,
                              int64_t n_in, int64_t n_out) {
    const auto v = loader.matrix(name, n_in, n_out);
    return be.upload_weight(v.type, v.data, v.n_in, v.n_out, v.row_bytes);
}

backend::Buffer upload_vector(backend::Backend & be, const TensorLoader & loader, const std::string & name, int64_t n,
                              bool required) {
    return backend::upload_floats(be, loader.vector_f32(name, n, required));
}

int64_t patch_columns(const backend::Backend & be, int64_t n_in) {
    return be.name() == "cpu" ? n_in : (n_in + 31) / 32 * 32;
}

backend::Weight upload_f32_matrix(backend::Backend & be, std::vector<float> rows, int64_t n_in, int64_t n_out,
                                  int64_t cols, std::vector<float> & keep) {
    if (cols == n_in) {
        keep = std::move(rows);
    } else {
        keep.assign(static_cast<size_t>(n_out * cols), 0.0f);
        for (int64_t r = 0; r < n_out; ++r) {
            std::memcpy(&keep[static_cast<size_t>(r * cols)], &rows[static_cast<size_t>(r * n_in)],
                        static_cast<size_t>(n_in) * sizeof(float));
        }
    }
    return be.upload_weight(GgmlType::F32, keep.data(), cols, n_out, static_cast<size_t>(cols) * sizeof(float));
}

backend::Buffer upload_padded_rows(backend::Backend & be, const float * rows, int64_t n, int64_t n_in, int64_t cols) {
    backend::Buffer buf(be, static_cast<size_t>(n * cols) * sizeof(float));
    if (cols == n_in) {
        be.upload(buf.data(), rows, buf.bytes());
        return buf;
    }
    std::vector<float> padded(static_cast<size_t>(n * cols), 0.0f);
    for (int64_t r = 0; r < n; ++r) {
        std::memcpy(&padded[static_cast<size_t>(r * cols)], rows + r * n_in, static_cast<size_t>(n_in) * sizeof(float));
    }
    be.upload(buf.data(), padded.data(), buf.bytes());
    return buf;
}

void linear(backend::Backend & be, const backend::Weight & w, const backend::Buffer & b, const float * x, float * y,
            int64_t n_tok) {
    be.matmul(w, x, y, n_tok);
    if (b.data() != nullptr) {
        be.add_bias(y, b.f32(), n_tok, w.n_out);
    }
}

void QkvRows::project(backend::Backend & be, const backend::Weight & wq, const backend::Buffer & bq,
                      const backend::Weight & wk, const backend::Buffer & bk, const backend::Weight & wv,
                      const backend::Buffer & bv, const float * xn, int64_t n, int64_t E) {
    const size_t bytes = static_cast<size_t>(n * E) * sizeof(float);
    for (backend::Buffer * buf : { &q, &k, &v }) {
        if (buf->bytes() < bytes) {  // grown when too small, kept otherwise
            buf->reset();
            *buf = backend::Buffer(be, bytes);
        }
    }
    linear(be, wq, bq, xn, q.f32(), n);
    linear(be, wk, bk, xn, k.f32(), n);
    linear(be, wv, bv, xn, v.f32(), n);
}

}  // namespace kvcmas::vision
