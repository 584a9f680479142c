// AVX512-VNNI one-pass kernels of the 8-bit decode path (compiled with -mavx512f/bw/dq/vl -mavx512vnni; called only
// after the run-time check): quants-dot-onepass-impl.h on 512-bit vectors. Its 256-bit helpers come from
// quants-dot-avx2-impl.h in the maddubs form (KC_Q8_VNNI 0: this file has no AVX-VNNI flag).
// GCC 12 flags the undefined upper half of _mm512_castps256_ps512 inside _mm512_insert* (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#define KC_Q8_VNNI 0
#define KC_Q8_ZMM 1
#define KC_Q8_NS avx512vnni
#include "backend/cpu/quants-dot-avx2-impl.h"
#include "backend/cpu/quants-dot-onepass-impl.h"

namespace kvcmas::cpu::detail {

RowDotQ8Fn row_dot_q8_onepass_fn_avx512vnni(GgmlType type) {
    return avx512vnni::row_dot_q8_onepass_fn(type);
}

RowDotQ8Fn row_dot_q8_kquant_fn_avx512vnni(GgmlType type) {
    return avx512vnni::row_dot_q8_vec_fn<2>(type);
}

}  // namespace kvcmas::cpu::detail
