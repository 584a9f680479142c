// What both vision encoders do to put an mmproj file's tensors and their activations on a backend: weights uploaded
// with Backend::upload_weight (the CPU backend reads the mapped file in place), vectors as buffers, and the
// linear layer as the backend's matmul plus bias.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/tensor-loader.h"

namespace kvcmas::vision {

// The backend by name, refused with the encoder's file named: an unknown name, or one this build or machine
// cannot run.
std::unique_ptr<backend::Backend> make_tower_backend(const std::string & path, const std::string & name, int n_threads);

// Matrix `name` (n_out rows of n_in, any weight type of the file) in backend memory.
backend::Weight upload_matrix(backend::Backend & be, const TensorLoader & loader, const std::string & name,
                              int64_t n_in, int64_t n_out);
// Vector `name` of n floats in a buffer; an empty buffer when it is absent and not required.
backend::Buffer upload_vector(backend::Backend & be, const TensorLoader & loader, const std::string & name, int64_t n,
                              bool required);

// Columns a patch-embedding weight of n_in columns takes on `be`: n_in on the CPU (its matmul reads any width, and
// the bits stay those of the unpadded product), else n_in rounded up to 32 (a device's kernels read rows of a
// multiple of 32; the padding is zeros in the weight and in the patches).
int64_t patch_columns(const backend::Backend & be, int64_t n_in);
// An f32 matrix [n_out][n_in] (host, outlives the weight on the CPU: held in `keep`) in backend memory with
// `cols` >= n_in columns, zero-padded.
backend::Weight upload_f32_matrix(backend::Backend & be, std::vector<float> rows, int64_t n_in, int64_t n_out,
                                  int64_t cols, std::vector<float> & keep);
// Rows [n][n_in] (host) into a new buffer of rows of `cols` >= n_in floats, zero-padded.
backend::Buffer upload_padded_rows(backend::Backend & be, const float * rows, int64_t n, int64_t n_in, int64_t cols);

// y [n_tok][w.n_out] = x · wᵀ + b (b empty: no bias), backend addresses.
void linear(backend::Backend & be, const backend::Weight & w, const backend::Buffer & b, const float * x, float * y,
            int64_t n_tok);

// The Q, K and V rows [n][E] of a block's attention, in buffers kept across calls (an encoder's calls are
// serialised; fresh buffers per layer would cost page faults on every encode).
struct QkvRows {
    backend::Buffer q, k, v;
    // q, k, v = xn · w{q,k,v}ᵀ + b{q,k,v} for n rows of width E (biases may be empty).
    void project(backend::Backend & be, const backend::Weight & wq, const backend::Buffer & bq,
                 const backend::Weight & wk, const backend::Buffer & bk, const backend::Weight & wv,
                 const backend::Buffer & bv, const float * xn, int64_t n, int64_t E);
};

}  // namespace kvcmas::vision
