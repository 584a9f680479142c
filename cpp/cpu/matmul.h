// Matrix products of a weight matrix stored in any supported GGUF type with f32 activations.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/ggml-types.h"
#include "cpu/threadpool.h"

namespace kvcmas::cpu {

// A weight matrix as GGUF stores it: n_out rows, each of n_in elements of `type` (ggml shape [n_in, n_out]),
// rows row_bytes apart. n_in is a multiple of the type's block size.
struct WeightView {
    GgmlType     type;
    const void * data;
    int64_t      n_in;
    int64_t      n_out;
    size_t       row_bytes;
};

// y = x · wᵀ:  x [n_tok][n_in] f32 row-major (row stride n_in), y [n_tok][n_out] f32 row-major (row stride n_out).
// Splits the output rows over the pool (chunks from a shared counter). Small n_tok (decode: below 12 tokens for
// float weights, 16 for quantized ones) runs dot products straight from the stored format, up to 4 tokens per
// pass over a row; larger n_tok (prefill) dequantizes tiles of w once into 16-row panels and runs a
// register-blocked f32 kernel (6 tokens × 16 rows) over all tokens.
// Results agree with (dequantize_row(w) · x) within f32 rounding for float weights; for quantized weights the
// decode path quantizes the activations to 8 bits (per 32 elements, per 256 for the K-quants), as llama.cpp does.
// Weight data must be 2-byte aligned (4 for f32); x and y need no alignment. Throws kvcmas::Error on a bad view.
void matmul(const WeightView & w, const float * x, float * y, int64_t n_tok, ThreadPool & pool);

// Same contract, plain reference implementation (dequantize each row, f64 accumulation); for tests.
void matmul_reference(const WeightView & w, const float * x, float * y, int64_t n_tok);

}  // namespace kvcmas::cpu
