#include "backend/cpu/quants-mxfp4.h"

#include "backend/cpu/cpu-features.h"

namespace kvcmas::cpu::detail {
namespace {

void dequant_mxfp4(const void * src, float * dst, int64_t n) {
    const auto * b = static_cast<const BlockMXFP4 *>(src);
    for (int64_t i = 0; i < n / 32; ++i, dst += 32) {
        const float d = mxfp4_scale(b[i].e);
        for (int l = 0; l < 16; ++l) {
            dst[l]      = d * static_cast<float>(kMxfp4Values[b[i].qs[l] & 0x0F]);
            dst[l + 16] = d * static_cast<float>(kMxfp4Values[b[i].qs[l] >> 4]);
        }
    }
}

// Decode: per block the integer table values dotted with x (4 partial sums), then times the block's scale.
void dot_mxfp4_rows(const void * w_row, const DecodeActs & a, int nt, int64_t n, float * out, int64_t os) {
    const auto * b      = static_cast<const BlockMXFP4 *>(w_row);
    float        acc[4] = { 0, 0, 0, 0 };
    for (int64_t i = 0; i < n / 32; ++i) {
        const float d = mxfp4_scale(b[i].e);
        for (int t = 0; t < nt; ++t) {
            const float * x    = a.x + t * a.ldx + 32 * i;
            float         s[4] = { 0, 0, 0, 0 };
            for (int l = 0; l < 16; ++l) {
                s[l % 2] += static_cast<float>(kMxfp4Values[b[i].qs[l] & 0x0F]) * x[l];
                s[2 + l % 2] += static_cast<float>(kMxfp4Values[b[i].qs[l] >> 4]) * x[l + 16];
            }
            acc[t] += d * ((s[0] + s[1]) + (s[2] + s[3]));
        }
    }
    for (int t = 0; t < nt; ++t) {
        out[t * os] = acc[t];
    }
}

}  // namespace

DequantFn dequant_fn_mxfp4(GgmlType type) {
    return type == GgmlType::MXFP4 ? dequant_mxfp4 : nullptr;
}

RowDotFn row_dot_fn_mxfp4(GgmlType type) {
    if (type != GgmlType::MXFP4) {
        return nullptr;
    }
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        return dot_mxfp4_rows_avx2;
    }
#endif
    return dot_mxfp4_rows;
}

}  // namespace kvcmas::cpu::detail
