// Row kernels of the vision towers that the text engine does not need (portable code the compiler vectorises, and
// AVX2 paths in vision-kernels-avx2.cpp): what the CPU backend runs for Backend::layer_norm, activate,
// segment_attention, rotate_half_rows and avg_pool_rms_norm.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/activation.h"
#include "backend/cpu/threadpool.h"

namespace kvcmas::cpu {

// y[i] = (x[i] - mean(x)) / sqrt(var(x) + eps) * w[i] + b[i] for one row of n (biased variance, as torch).
// y may alias x.
void layer_norm(const float * x, const float * w, const float * b, float * y, int64_t n, float eps);

// x[i] = act(x[i]) in place, for n values (GeluTanh, QuickGelu and Silu with a vectorized exp on AVX2 CPUs:
// about 1e-7 relative error).
void activate(Activation act, float * x, int64_t n);
// The same with the C library's exp and erf (every CPU).
void activate_portable(Activation act, float * x, int64_t n);

// x[i] = exp(x[i] - max) / Σ exp(x[j] - max): a numerically safe softmax of one row, in place.
void softmax(float * x, int64_t n);

// Multi-head attention without a mask within segments: for each segment [seg[s], seg[s + 1]) of the rows and
// each head h (columns [h·hd, (h + 1)·hd), hd = E / H), out[t] = softmax(q[t]·Kᵀ / sqrt(hd)) V over the
// segment's rows. q, k, v, out are [N][E] row-major, seg (n_seg + 1 entries) ascending from 0 to N. Short segments
// (Qwen's windows) run the fused kernel (attend_block), all segments' query blocks in one parallel job; long ones
// run, on AVX-512 CPUs, as blocks of query rows whose scores stay in cache (matmul-packed-avx512.cpp), elsewhere
// head by head as two GEMMs (scores = q·Kᵀ, out = softmax(scores)·V) through scratch (n² + 3·n·hd floats). The
// bits do not depend on the thread count.
void segment_attention(const float * q, const float * k, const float * v, float * out, int64_t E, int64_t H,
                       const int64_t * seg, int n_seg, std::vector<float> & scratch, ThreadPool & pool);

// Rows [r0, r1) of x [N][H·hd]: pair (i, i + hd/2) of each head rotated by the row's angle i, from
// cos_t, sin_t [N][hd/2].
void rotate_half_rows(float * x, const float * cos_t, const float * sin_t, int64_t r0, int64_t r1, int64_t H,
                      int64_t hd);

// Output row t of one image's k x k average pooling over its G x G grid of rows x [G·G][E] (row-major grid,
// output side G / k), each window summed in f32 and divided by k², then RMS-normalised with weight w [E]
// (sum of squares in f64): y [E].
void avg_pool_rms_row(const float * x, const float * w, float * y, int64_t t, int64_t G, int64_t k, int64_t E,
                      float eps);

}  // namespace kvcmas::cpu
