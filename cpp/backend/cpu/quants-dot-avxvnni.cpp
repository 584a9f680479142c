// AVX-VNNI kernels of the 8-bit activation path (compiled with -mavx2 -mfma -mf16c -mavxvnni; called only after the
// run-time check): the vpdpbusd instance of quants-dot-avx2-impl.h.
#define KC_Q8_VNNI 1
#define KC_Q8_NS avxvnni
#include "backend/cpu/quants-dot-avx2-impl.h"
#include "backend/cpu/quants-dot-onepass-impl.h"

namespace kvcmas::cpu::detail {

RowDotQ8Fn row_dot_q8_fn_avxvnni(GgmlType type) {
    return avxvnni::row_dot_q8_fn(type);
}

RowDotQ8Fn row_dot_q8_onepass_fn_avxvnni(GgmlType type) {
    return avxvnni::row_dot_q8_onepass_fn(type);
}

}  // namespace kvcmas::cpu::detail
