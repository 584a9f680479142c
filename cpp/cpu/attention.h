// Attention of one query token over KV stored in runs (contiguous pieces of blocks, possibly of shared spans).
#pragma once

#include <cstdint>

#include "cpu/ops.h"

namespace kvcmas::cpu {

// A run of n consecutive KV rows. Row r of K starts at k + r * row_stride (floats), same for V; a row holds
// n_head_kv * head_dim floats. The keys were rotated at (their sequence position - shift): a run taken from a span
// stored in its own frame has shift = (position of its first row in the sequence) - (its index in the span).
struct KvRun {
    const float * k;
    const float * v;
    int32_t       n;
    int32_t       shift;
};

struct AttentionShape {
    int     n_head;
    int     n_head_kv;
    int     head_dim;
    int64_t row_stride;  // floats between consecutive KV rows
    float   scale;       // usually 1/sqrt(head_dim)
};

// Floats of scratch memory attend() needs for n_visible keys.
int64_t attention_scratch_floats(const AttentionShape & shape, int64_t n_visible);

// out [n_head][head_dim] = softmax(scale · q·Kᵀ) · V over the first n_visible rows of the runs, in order.
// q [n_head][head_dim] is rotated at the query's position; for runs with shift != 0 a copy of q is rotated by
// -shift (RoPE is a rotation: <R(a)q, R(b)k> = <R(a-s)q, R(b-s)k>), so shared KV is never copied or re-rotated.
// Query head h reads KV head h / (n_head / n_head_kv) (GQA). Only heads [h_begin, h_end) are computed, so one
// token's heads can be spread over threads.
void attend(const AttentionShape & shape, const Rope & rope, const float * q, const KvRun * runs, int n_runs,
            int64_t n_visible, int h_begin, int h_end, float * out, float * scratch);

}  // namespace kvcmas::cpu
