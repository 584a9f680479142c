// Attention of one query token over KV stored in runs (contiguous pieces of blocks, possibly of shared spans).
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/cpu/ops.h"

namespace kvcmas::cpu {

// How KV rows are stored: f32, or IEEE half (half the memory and bandwidth; keys and values are rounded to nearest
// even on write, attention converts them back to f32 and computes in f32).
enum class KvType : int32_t { F32 = 0, F16 = 1 };

size_t kv_type_size(KvType type);  // bytes per element

// dst [n] (KV storage type) = src [n] f32, rounded to nearest even for F16 (F16C when the CPU has it).
void kv_store_row(KvType type, const float * src, void * dst, int64_t n);
// dst [n] f32 = src [n] stored as `type` (exact).
void kv_load_row(KvType type, const void * src, float * dst, int64_t n);

// A run of n consecutive KV rows. Row r of K starts at element k + r * row_stride, same for V; a row holds
// n_head_kv * head_dim elements of the AttentionShape's kv_type (float, or uint16_t IEEE halves for F16). The keys were
// rotated at (their sequence position - shift): a run taken from a span stored in its own frame has shift = (position
// of its first row in the sequence) - (its index in the span).
//
// A run may carry a low-rank correction of its keys and values (KVCMAS): the keys attention uses are
// K + A_k·B_k and the values V + A_v·B_v, where row j of the run has factor rows a_k + j * rank (and a_v likewise)
// and B_k, B_v are [rank][n_head_kv * head_dim] (row-major), in the frame the keys are stored in. The kernel never
// forms K + A_k·B_k: scores gain (q·B_kᵀ)·a_k[j] and outputs gain (Σ_j p_j a_v[j])·B_v, per KV head.
struct KvRun {
    const void *  k;
    const void *  v;
    int32_t       n;
    int32_t       shift;
    int32_t       rank = 0;  // 0: no correction
    const float * a_k  = nullptr;
    const float * a_v  = nullptr;
    const float * b_k  = nullptr;
    const float * b_v  = nullptr;
};

struct AttentionShape {
    int     n_head;
    int     n_head_kv;
    int     head_dim;
    int64_t row_stride;             // elements between consecutive KV rows
    float   scale;                  // usually 1/sqrt(head_dim)
    KvType  kv_type = KvType::F32;  // element type of every run's k and v (correction factors are always f32)
    // Sliding-window attention: > 0: a query that sees n_visible rows attends only to the last `window` of them
    // (rows [n_visible - window, n_visible), as a sequence position p attends to keys in (p - window, p]); rows
    // before are skipped, whatever run (shared span, corrected segment) holds them. 0: all n_visible rows.
    int64_t window = 0;
    // Attention sinks (gpt-oss): per query head a logit [n_head] (backend address) that joins the softmax's
    // denominator and no value, so a head may attend to nothing; null: none.
    const float * sinks = nullptr;
};

constexpr int kMaxCorrectionRank = 256;
constexpr int kMaxAttentionBlock = 16;  // queries per attend_block() call

// Floats of scratch memory attend() needs for n_visible keys.
int64_t attention_scratch_floats(const AttentionShape & shape, int64_t n_visible);

// out [n_head][head_dim] = softmax(scale · q·Kᵀ) · V over the first n_visible rows of the runs, in order.
// q [n_head][head_dim] is rotated at the query's position; for runs with shift != 0 a copy of q is rotated by
// -shift (RoPE is a rotation: <R(a)q, R(b)k> = <R(a-s)q, R(b-s)k>), so shared KV is never copied or re-rotated.
// Query head h reads KV head h / (n_head / n_head_kv) (GQA). Only heads [h_begin, h_end) are computed, so one
// token's heads can be spread over threads.
void attend(const AttentionShape & shape, const Rope & rope, const float * q, const KvRun * runs, int n_runs,
            int64_t n_visible, int h_begin, int h_end, float * out, float * scratch);

// nq (<= kMaxAttentionBlock) consecutive query tokens of one sequence: query i, row i of q (row stride q_stride
// floats, laid out like attend()'s q), sees the first max(n_visible0 + i, n_visible_min) rows (n_visible_min: the
// end of a bidirectional span; a window still starts at n_visible0 + i - window); its output goes to row i of out
// (stride out_stride). Bit-identical to nq attend() calls, but each key and value is read once per block of queries.
void attend_block(const AttentionShape & shape, const Rope & rope, const float * q, int64_t q_stride, int nq,
                  const KvRun * runs, int n_runs, int64_t n_visible0, int h_begin, int h_end, float * out,
                  int64_t out_stride, float * scratch, int64_t n_visible_min = 0);

// Floats of scratch memory attend_block() needs.
int64_t attention_block_scratch_floats(const AttentionShape & shape, int nq, int64_t n_visible_max);

// The runs from row `first` on (first < total rows): whole runs before it dropped, the run holding it advanced to
// it (k, v and correction rows moved, shift kept: the rows keep their rotation frame). Returns the count in out.
int runs_from_row(const AttentionShape & shape, const KvRun * runs, int n_runs, int64_t first, KvRun * out);

}  // namespace kvcmas::cpu
