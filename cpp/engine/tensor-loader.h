// Reads weights out of a GGUF file by name, checking shape and type: the one loader of the text model and the
// vision tower. Matrices stay in the file's mapping (the caller hands them to its backend); vectors are converted
// to f32 host arrays.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/cpu/matmul.h"
#include "gguf/gguf-file.h"

namespace kvcmas {

class TensorLoader {
  public:
    explicit TensorLoader(const gguf::GgufFile & file) : file_(file) {}

    // A matrix of n_out rows of n_in elements in a weight type. Tensors of more than two dimensions count their
    // leading ones as the row (a 4-D convolution kernel [P, P, 3, E] is E rows of 3·P·P). Throws kvcmas::Error
    // naming the file and tensor when it is missing, shaped otherwise or of a type kvcmas cannot compute with.
    cpu::WeightView matrix(const std::string & name, int64_t n_in, int64_t n_out) const;

    // A stack of n_mat matrices of n_out rows of n_in elements (GGUF [n_in, n_out, n_mat]: a MoE layer's experts),
    // as one matrix of n_mat * n_out rows, matrix m's rows from m * n_out on.
    cpu::WeightView matrices(const std::string & name, int64_t n_in, int64_t n_out, int64_t n_mat) const;

    // The n elements of a tensor (any shape) as f32. A missing tensor is an error when `required`, an empty result
    // otherwise; a wrong element count, an unusable type or a non-finite value are errors.
    std::vector<float> vector_f32(const std::string & name, int64_t n, bool required) const;

    const gguf::GgufFile & file() const { return file_; }

  private:
    // Throws kvcmas::Error naming the tensor (and the types kvcmas runs) unless its type is a weight type whose
    // blocks tile rows of `row` elements.
    void check_weight_type(const gguf::TensorInfo & t, int64_t row) const;

    const gguf::GgufFile & file_;
};

}  // namespace kvcmas
