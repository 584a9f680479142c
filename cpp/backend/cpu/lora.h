// The CPU backend's LoRA op (Backend::lora_add, backend.h): every product's low-rank updates in two pool rounds, the
// A products (t = A x) first, split over the threads by rank row, then the B products split by
// blocks of outputs. Each value is computed by one thread in a fixed order, so a row's result does not depend on the
// batch, the other products of the call or the thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "common/ggml-types.h"

namespace kvcmas::backend {
struct LoraGroup;
struct LoraProduct;
}  // namespace kvcmas::backend

namespace kvcmas::cpu {

class ThreadPool;

// What one call plans and computes, kept between calls so that a decode step allocates nothing.
struct LoraScratch {
    struct Down {  // t[i · rank + c] = A[c] · x[rows[i]] for the group's rows i
        const backend::LoraGroup * g;
        int                        c;
        float *                    t;
    };
    struct Up {  // y[rows[i]][o] += s_i · Σ_c t[i · rank + c] · b_t[c][o] for o in [o0, o1), the group's rows i
        const backend::LoraGroup * g;
        const float *              t;
        float *                    y;
        int64_t                    n_out, o0, o1;
    };
    std::vector<float>   t;
    std::vector<Down>    down;
    std::vector<Up>      up;
    std::vector<int64_t> down_cost, up_cost;  // running sums of each list's multiply-adds
};

void lora_add(const float * x, int64_t n_in, const backend::LoraProduct * products, int n_products, ThreadPool & pool,
              LoraScratch & scratch);

// The row kernels (exposed for the AVX2 file): dot of a factor row (F32 or F16) with x [n], and y[o] += s · Σ_c
// t[c] · b_t[c · n_out + o] for o in [o0, o1), each element with fused multiply-adds over c in order, then fused
// into y, so that how [o0, o1) is cut does not change any element.
float lora_dot(const void * a_row, GgmlType type, const float * x, int64_t n);
void lora_up(const float * t, int rank, const void * b_t, GgmlType type, int64_t n_out, int64_t o0, int64_t o1, float s,
             float * y);

}  // namespace kvcmas::cpu
