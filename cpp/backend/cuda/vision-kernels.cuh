// The vision towers' ops on the device (Backend::layer_norm, activate, segment_attention, rotate_half_rows,
// avg_pool_rms_norm of backend.h, same contracts; device addresses, f32). Launched on the default stream; each
// throws kvcmas::Error when its launch fails.
#pragma once

#include <cstdint>

#include "backend/activation.h"

namespace kvcmas::cuda {

// One block per row; mean and variance summed in f64 over the row.
void layer_norm(const float * x, const float * w, const float * b, float * y, int64_t n_rows, int64_t n, float eps);
// x [n] = act(x) (· mul [n] when mul is not null), element-wise.
void activate(Activation act, float * x, const float * mul, int64_t n);
// A warp per (row, head) with an online softmax over its segment's keys, 32 keys at a time (one per lane), the
// output's hd <= 256 columns spread over the lanes. seg: the segment bounds [n_seg + 1] in device memory.
void segment_attention(const float * q, const float * k, const float * v, float * out, int64_t n_rows, int64_t E,
                       int64_t H, const int64_t * seg, int n_seg);
// One block per row.
void rotate_half_rows(float * x, const float * cos_t, const float * sin_t, int64_t n_rows, int64_t H, int64_t hd);
// One block per output row: the k x k window's mean, then the row's RMS norm (f64 sum of squares).
void avg_pool_rms_norm(const float * x, const float * w, float * y, int64_t n_img, int64_t G, int64_t k, int64_t E,
                       float eps);

}  // namespace kvcmas::cuda
