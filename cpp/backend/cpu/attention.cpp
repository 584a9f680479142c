#include <algorithm>
#define KC_ATTN_NS portable
#include "common/error.h"
#include "backend/cpu/attention-impl.h"
#include "backend/cpu/cpu-features.h"

namespace kvcmas::cpu {

#ifdef KC_X86
void attend_block_avx2(const AttentionShape & shape, const Rope & rope, const float * q, int64_t q_stride, int nq,
                       const KvRun * runs, int n_runs, int64_t n_visible0, int h_begin, int h_end, float * out,
                       int64_t out_stride, float * scratch);
void fp32_to_fp16_row_f16c(const float * src, uint16_t * dst, int64_t n);
void fp16_to_fp32_row_f16c(const uint16_t * src, float * dst, int64_t n);
#endif

size_t kv_type_size(KvType type) {
    switch (type) {
        case KvType::F32:
            return sizeof(float);
        case KvType::F16:
            return sizeof(uint16_t);
    }
    fail("unknown KV type %d", static_cast<int>(type));
}

void kv_store_row(KvType type, const float * src, void * dst, int64_t n) {
    if (type == KvType::F32) {
        std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(n));
        return;
    }
    uint16_t * d = static_cast<uint16_t *>(dst);
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        fp32_to_fp16_row_f16c(src, d, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; ++i) {
        d[i] = fp32_to_fp16(src[i]);
    }
}

void kv_load_row(KvType type, const void * src, float * dst, int64_t n) {
    if (type == KvType::F32) {
        std::memcpy(dst, src, sizeof(float) * static_cast<size_t>(n));
        return;
    }
    const uint16_t * s = static_cast<const uint16_t *>(src);
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        fp16_to_fp32_row_f16c(s, dst, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; ++i) {
        dst[i] = fp16_to_fp32(s[i]);
    }
}

// The AVX2 kernel's scratch: (query, head) rows of one pass (nq queries × the heads of a KV head that fit in
// kMaxAttentionBlock rows), each a rotated query [head_dim] and a score row padded to whole groups of 8.
static int64_t block_kernel_floats(const AttentionShape & shape, int nq, int64_t n_visible_max) {
    const int group    = shape.n_head / shape.n_head_kv;
    const int per_pass = std::max(1, std::min(group, kMaxAttentionBlock / std::max(nq, 1)));
    return static_cast<int64_t>(nq) * per_pass * (shape.head_dim + (n_visible_max + 15) / 8 * 8);
}

int64_t attention_block_scratch_floats(const AttentionShape & shape, int nq, int64_t n_visible_max) {
    return block_kernel_floats(shape, nq, n_visible_max) + attention_scratch_floats(shape, n_visible_max);
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
    // Portable kernel: q_rot [n_head * head_dim], scores [n_visible + 16] (+16: padded groups), one converted row
    // [head_dim]; the AVX2 kernel runs attend() as a block of one query.
    const int64_t portable = static_cast<int64_t>(shape.n_head) * shape.head_dim + n_visible + 16 + shape.head_dim;
    return std::max(portable, block_kernel_floats(shape, 1, n_visible));
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
