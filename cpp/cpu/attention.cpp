#include <algorithm>
#define KC_ATTN_NS portable
#include "cpu/attention-impl.h"
#include "cpu/cpu-features.h"

namespace kvcmas::cpu {

#ifdef KC_X86
void attend_avx2(const AttentionShape & shape, const Rope & rope, const float * q, const KvRun * runs, int n_runs,
                 int64_t n_visible, int h_begin, int h_end, float * out, float * scratch);
#endif

int64_t attention_scratch_floats(const AttentionShape & shape, int64_t n_visible) {
    return static_cast<int64_t>(shape.n_head) * shape.head_dim + n_visible + 8;  // +8: vector tails
}

void attend(const AttentionShape & shape, const Rope & rope, const float * q, const KvRun * runs, int n_runs,
            int64_t n_visible, int h_begin, int h_end, float * out, float * scratch) {
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        attend_avx2(shape, rope, q, runs, n_runs, n_visible, h_begin, h_end, out, scratch);
        return;
    }
#endif
    portable::attend(shape, rope, q, runs, n_runs, n_visible, h_begin, h_end, out, scratch);
}

}  // namespace kvcmas::cpu
