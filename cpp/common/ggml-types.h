// Tensor element types as GGUF files number them (the ggml_type enum), with their block layout.
// One home for these facts on the C++ side; python/kvcmas_cpp/gguf_constants.py mirrors them and a test checks both.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvcmas {

enum class GgmlType : uint32_t {
    F32    = 0,
    F16    = 1,
    Q4_0   = 2,
    Q4_1   = 3,
    Q5_0   = 6,
    Q5_1   = 7,
    Q8_0   = 8,
    Q8_1   = 9,
    Q2_K   = 10,
    Q3_K   = 11,
    Q4_K   = 12,
    Q5_K   = 13,
    Q6_K   = 14,
    Q8_K   = 15,
    IQ4_NL = 20,
    IQ4_XS = 23,
    BF16   = 30,
    MXFP4  = 39,
};

struct GgmlTypeTraits {
    const char * name;    // "q4_K", as llama.cpp names it
    int64_t      block;   // elements per block (1 for plain float types)
    size_t       bytes;   // bytes per block
    bool         weight;  // supported as a model weight by this engine
};

// Traits of a raw type id read from a file; nullptr when the id is unknown to kvcmas.
const GgmlTypeTraits * ggml_type_traits(uint32_t type_id);

// Name of a type id for messages ("q4_K", or "type 42" when unknown).
const char * ggml_type_name(uint32_t type_id);

// The types this engine runs as weights, for messages: "f32, f16, bf16, q4_0, ...".
const char * ggml_weight_type_names();

// Bytes taken by n elements of a known type; throws kvcmas::Error if n is not a multiple of the block size or
// the size overflows.
size_t ggml_row_bytes(GgmlType type, int64_t n);

}  // namespace kvcmas
