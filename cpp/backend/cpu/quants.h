// Block formats of quantized GGUF weights and their conversion to f32. Layouts follow the GGUF specification
// (the ggml block structs); every block starts with its f16 scale(s), as in the files.
#pragma once

#include <cstdint>

#include "common/ggml-types.h"

namespace kvcmas::cpu {

// IEEE half / bfloat16 conversions (exact, scalar).
float    fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
float    bf16_to_fp32(uint16_t h);

// Converts n elements of `type` starting at src (whole blocks: n % block == 0) into dst[n] f32, bit-identical to
// gguf-py's dequantize (and so to ggml's). Supported: every type with GgmlTypeTraits::weight == true. Throws
// kvcmas::Error for others, for a partial block, or for src not 2-byte aligned (blocks hold f16 fields).
void dequantize_row(GgmlType type, const void * src, float * dst, int64_t n);

}  // namespace kvcmas::cpu
