// MXFP4 (the OCP microscaling FP4 format; gpt-oss's expert weights, GGML type 39): blocks of 32 elements, one E8M0
// exponent byte e and 16 bytes of 4-bit e2m1 codes (byte l: element l in the low nibble, element l + 16 in the high
// one). Element = kMxfp4Values[code] · 2^(e - 128): the table holds the e2m1 values doubled (integers), so the
// scale is halved, as llama.cpp stores and reads them.
#pragma once

#include <cmath>
#include <cstdint>

#include "backend/cpu/matmul-impl.h"

namespace kvcmas::cpu {

struct BlockMXFP4 {
    uint8_t e;
    uint8_t qs[16];
};
static_assert(sizeof(BlockMXFP4) == 17, "MXFP4 block layout");

inline constexpr int8_t kMxfp4Values[16] = { 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12 };

// 2^(e - 128), exact for every byte (e < 2 gives the subnormals 2^-128 and 2^-127).
inline float mxfp4_scale(uint8_t e) {
    return std::ldexp(1.0f, static_cast<int>(e) - 128);
}

namespace detail {

// The kernels of MXFP4 (portable dequantization for prefill tiles; decode row dot, AVX2 where the CPU has it), or
// nullptr for any other type.
DequantFn dequant_fn_mxfp4(GgmlType type);
RowDotFn  row_dot_fn_mxfp4(GgmlType type);

#ifdef KC_X86
void dot_mxfp4_rows_avx2(const void * w_row, const DecodeActs & a, int nt, int64_t n, float * out, int64_t os);
#endif

}  // namespace detail
}  // namespace kvcmas::cpu
