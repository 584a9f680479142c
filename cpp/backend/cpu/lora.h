// The CPU backend's LoRA op (Backend::lora_add, backend.h): every product's low-rank updates in one pool round of
// whole (product, group) pairs per thread where they split evenly, else in two: the A products (t = A x) split over
// the threads by rank row, then the B products by blocks of outputs. On the decode path the adapted matmuls run
// them inside the base matmul's own parallel job instead (matmul_multi_lora). Each value is computed by one thread in
// a fixed order, so a row's result does not depend on the batch, the other products of the call, the thread count or
// the path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/cpu/matmul.h"

namespace kvcmas::backend {
struct LoraGroup;
struct LoraProduct;
enum class LoraFactorType : uint8_t;
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
    struct Whole {  // one group of one product: its items down[d0, d1), up[u0, u1), its A products t
        size_t                     d0, d1, u0, u1;
        const backend::LoraGroup * g;
        float *                    t;
    };
    std::vector<float>   t;
    std::vector<Whole>   whole;
    std::vector<Down>    down;
    std::vector<Up>      up;
    std::vector<size_t>  product_wholes;  // product p's groups are whole[product_wholes[p], product_wholes[p + 1])
    std::vector<int64_t> down_cost, up_cost, whole_cost;  // running sums of each list's multiply-adds
};

void lora_add(const float * x, int64_t n_in, const backend::LoraProduct * products, int n_products, ThreadPool & pool,
              LoraScratch & scratch);

// matmul_multi (matmul.h) of w[0..n_mats), then lora_add of the products (each product's y one of y[m]): on the
// decode path in one parallel job, the A products handed out first, each output block's B products added by the
// thread that computed its base values right after; the same bits as the two calls one after the other.
void matmul_multi_lora(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                       const backend::LoraProduct * products, int n_products, ThreadPool & pool, Activations act,
                       LoraScratch & scratch);

// Rows [n_rows][width] of a factor as `type` stores them (host memory): the bytes, and for I8 each row's scale
// (absmax / 127, values rounded to the nearest step).
void encode_lora_rows(const float * rows, int64_t n_rows, int64_t width, backend::LoraFactorType type,
                      std::vector<uint8_t> & bytes, std::vector<float> & scales);

// The row kernels (exposed for the AVX2 file): dot of a factor row's stored values (F32, F16, I8 unscaled) with x
// [n], and y[o] += s · Σ_c t[c] · B[c][o] (b_t's stored values, at backend::lora_b_index) for o in [o0, o1), each
// element with fused multiply-adds over c in order, then fused into y, so that how [o0, o1) is cut does not change
// any element.
float lora_dot(const void * a_row, backend::LoraFactorType type, const float * x, int64_t n);
void lora_up(const float * t, int rank, const void * b_t, backend::LoraFactorType type, int64_t o0, int64_t o1, float s,
             float * y);

}  // namespace kvcmas::cpu
