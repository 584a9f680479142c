#include <algorithm>
#define KC_ATTN_NS portable
#include "cpu/attention-impl.h"
#include "cpu/cpu-features.h"

namespace kvcmas::cpu {

#ifdef KC_X86
void attend_block_avx2(const AttentionShape & shape, const Rope & rope, const float * q, int64_t q_stride, int nq,
                       const KvRun * runs, int n_runs, int64_t n_visible0, int h_begin, int h_end, float * out,
                       int64_t out_stride, float * scratch);
#endif

int64_t attention_block_scratch_floats(const AttentionShape & shape, int nq, int64_t n_visible_max) {
    return static_cast<int64_t>(nq) * (shape.head_dim + (n_visible_max + 15) / 8 * 8) +
           attention_scratch_floats(shape, n_visible_max);
}

void attend_block(const AttentionShape & shape, const Rope & rope, const float * q, int64_t q_stride, int nq,
                  const KvRun * runs, int n_runs, int64_t n_visible0, int h_begin, int h_end, float * out,
                  int64_t out_stride, float * scratch) {
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        attend_block_avx2(shape, rope, q, q_stride, nq, runs, n_runs, n_visible0, h_begin, h_end, out, out_stride,
                          scratch);
        return;
    }
#endif
    for (int i = 0; i < nq; ++i) {
        portable::attend(shape, rope, q + i * q_stride, runs, n_runs, n_visible0 + i, h_begin, h_end,
                         out + i * out_stride, scratch);
    }
}

int64_t attention_scratch_floats(const AttentionShape & shape, int64_t n_visible) {
    return static_cast<int64_t>(shape.n_head) * shape.head_dim + n_visible + 16;  // +16: padded groups
}

void attend(const AttentionShape & shape, const Rope & rope, const float * q, const KvRun * runs, int n_runs,
            int64_t n_visible, int h_begin, int h_end, float * out, float * scratch) {
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        attend_block_avx2(shape, rope, q, 0, 1, runs, n_runs, n_visible, h_begin, h_end, out, 0, scratch);
        return;
    }
#endif
    portable::attend(shape, rope, q, runs, n_runs, n_visible, h_begin, h_end, out, scratch);
}

}  // namespace kvcmas::cpu
