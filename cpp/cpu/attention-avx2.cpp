// The attention kernel compiled for AVX2/FMA; called only when the CPU has them (see attention.cpp).
#include <algorithm>
#define KC_ATTN_NS avx2
#include "cpu/attention-impl.h"

namespace kvcmas::cpu {

void attend_avx2(const AttentionShape & shape, const Rope & rope, const float * q, const KvRun * runs, int n_runs,
                 int64_t n_visible, int h_begin, int h_end, float * out, float * scratch) {
    avx2::attend(shape, rope, q, runs, n_runs, n_visible, h_begin, h_end, out, scratch);
}

}  // namespace kvcmas::cpu
