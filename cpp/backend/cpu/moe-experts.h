// The grouped expert products of a mixture-of-experts layer: every expert's matmul over its own routed rows, as one
// parallel job.
#pragma once

#include <cstdint>

#include "backend/cpu/matmul.h"
#include "backend/cpu/threadpool.h"

namespace kvcmas::cpu {

// For each group g in [0, n_groups) (an expert) with rows [first[g], first[g+1]) of x [first[n_groups]][n_in]
// (its routed rows, gathered group after group): y[i] rows [first[g], first[g+1]) = those rows · w[g·n_mats + i]ᵀ
// for i in [0, n_mats) (n_mats <= kMaxMatmulMulti; the matrices of one i share n_out, y[i] row stride = that n_out).
// Each group's rows are exactly what matmul_multi(&w[g·n_mats], .., x + first[g]·n_in, first[g+1] - first[g])
// computes (a row's result depends neither on the thread count nor on how the rows are split). With enough groups,
// whole groups are handed out to the threads from a shared counter, largest first, each computed by one thread
// (one synchronization of the pool for all of them instead of one per expert and matrix); with fewer groups than
// 2 per thread (decode), each group runs on the whole pool. A group without rows is skipped: its weights are not read.
void matmul_experts(const WeightView * w, int n_mats, int n_groups, const int64_t * first, const float * x,
                    float * const * y, ThreadPool & pool, Activations act = Activations::F32);

}  // namespace kvcmas::cpu
