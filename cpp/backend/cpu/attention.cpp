#include <algorithm>
#include <vector>
#define KC_ATTN_NS portable
#include "backend/cpu/attention-impl.h"
#include "backend/cpu/cpu-features.h"
#include "common/error.h"

namespace kvcmas::cpu {

#ifdef KC_X86
void attend_block_avx2(const AttentionShape & shape, const Rope & rope, const float * q, int64_t q_stride, int nq,
                       const KvRun * runs, int n_runs, int64_t n_visible0, int h_begin, int h_end, float * out,
                       int64_t out_stride, float * scratch, int64_t n_visible_min);
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

int runs_from_row(const AttentionShape & shape, const KvRun * runs, int n_runs, int64_t first, KvRun * out) {
    const int64_t row_bytes = shape.row_stride * static_cast<int64_t>(kv_type_size(shape.kv_type));
    int           n_out     = 0;
    int64_t       at        = 0;  // row index of runs[i]'s first row
    for (int i = 0; i < n_runs; ++i) {
        const KvRun & r = runs[i];
        if (at + r.n > first) {
            KvRun         t    = r;
            const int64_t skip = std::max<int64_t>(0, first - at);
            if (skip > 0) {
                t.k = static_cast<const uint8_t *>(r.k) + skip * row_bytes;
                t.v = static_cast<const uint8_t *>(r.v) + skip * row_bytes;
                t.n = static_cast<int32_t>(r.n - skip);
                if (r.rank > 0) {
                    t.a_k = r.a_k + skip * r.rank;
                    t.a_v = r.a_v + skip * r.rank;
                }
            }
            out[n_out++] = t;
        }
        at += r.n;
    }
    return n_out;
}

namespace {

// Runs and visible count with the rows no query of a block sees (those before its first query's window) dropped,
// so a long sequence's window reads only its own rows. The kernels still apply each query's window.
struct WindowedRuns {
    const KvRun * runs;
    int           n_runs;
    int64_t       n_visible0;
};

WindowedRuns skip_rows_before_window(const AttentionShape & shape, const KvRun * runs, int n_runs, int64_t n_visible0) {
    const int64_t first = shape.window > 0 ? std::max<int64_t>(0, n_visible0 - shape.window) : 0;
    if (first == 0) {
        return WindowedRuns{ runs, n_runs, n_visible0 };
    }
    thread_local std::vector<KvRun> kept;  // per thread: blocks run concurrently
    kept.resize(static_cast<size_t>(n_runs));
    const int n = runs_from_row(shape, runs, n_runs, first, kept.data());
    return WindowedRuns{ kept.data(), n, n_visible0 - first };
}

}  // namespace

void attend_block(const AttentionShape & shape, const Rope & rope, const float * q, int64_t q_stride, int nq,
                  const KvRun * all_runs, int n_all_runs, int64_t n_all_visible0, int h_begin, int h_end, float * out,
                  int64_t out_stride, float * scratch, int64_t n_all_visible_min) {
    const WindowedRuns w          = skip_rows_before_window(shape, all_runs, n_all_runs, n_all_visible0);
    const KvRun *      runs       = w.runs;
    const int          n_runs     = w.n_runs;
    const int64_t      n_visible0 = w.n_visible0;
    // in the kept rows' numbering (rows before the first query's window dropped)
    const int64_t n_visible_min = std::max<int64_t>(0, n_all_visible_min - (n_all_visible0 - n_visible0));
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        attend_block_avx2(shape, rope, q, q_stride, nq, runs, n_runs, n_visible0, h_begin, h_end, out, out_stride,
                          scratch, n_visible_min);
        return;
    }
#endif
    for (int i = 0; i < nq; ++i) {
        portable::attend(shape, rope, q + i * q_stride, runs, n_runs, std::max(n_visible0 + i, n_visible_min), h_begin,
                         h_end, out + i * out_stride, scratch, n_visible0 + i);
    }
}

int64_t attention_scratch_floats(const AttentionShape & shape, int64_t n_visible) {
    // Portable kernel: q_rot [n_head * head_dim], scores [n_visible + 16] (+16: padded groups), one converted row
    // [head_dim]; the AVX2 kernel runs attend() as a block of one query.
    const int64_t portable = static_cast<int64_t>(shape.n_head) * shape.head_dim + n_visible + 16 + shape.head_dim;
    return std::max(portable, block_kernel_floats(shape, 1, n_visible));
}

void attend(const AttentionShape & shape, const Rope & rope, const float * q, const KvRun * all_runs, int n_all_runs,
            int64_t n_all_visible, int h_begin, int h_end, float * out, float * scratch) {
    const WindowedRuns w         = skip_rows_before_window(shape, all_runs, n_all_runs, n_all_visible);
    const KvRun *      runs      = w.runs;
    const int          n_runs    = w.n_runs;
    const int64_t      n_visible = w.n_visible0;
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        attend_block_avx2(shape, rope, q, 0, 1, runs, n_runs, n_visible, h_begin, h_end, out, 0, scratch, 0);
        return;
    }
#endif
    portable::attend(shape, rope, q, runs, n_runs, n_visible, h_begin, h_end, out, scratch);
}

}  // namespace kvcmas::cpu
