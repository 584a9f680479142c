// Matrix products of a weight matrix stored in any supported GGUF type with f32 activations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "backend/cpu/threadpool.h"
#include "common/ggml-types.h"

namespace kvcmas::cpu {

// A weight matrix as GGUF stores it: n_out rows, each of n_in elements of `type` (ggml shape [n_in, n_out]),
// rows row_bytes apart. n_in is a multiple of the type's block size.
struct WeightView {
    GgmlType     type;
    const void * data;
    int64_t      n_in;
    int64_t      n_out;
    size_t       row_bytes;
};

// What the decode path multiplies quantized weights with. F32: the activations as they are (exact: every path
// computes dequantize_row(w)·x to f32 rounding). Q8: the activations quantized per 32 elements in two 8-bit passes and
// integer dot products with the stored blocks (like llama.cpp, which does one pass; faster, error bound in
// backend/cpu/quants-dot.h). Q8 applies to the decode path (n_tok below the prefill threshold) of the quantized types
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K on CPUs with AVX2, and to their prefill path too (the same quantized
// activations in an integer GEMM, backend/cpu/qgemm.h: same error bound, the same bits with AVX512-VNNI or AVX2);
// everything else runs as with F32. Q8Fast is Q8 except for the prefill of Q4_K, Q5_K and Q6_K weights where the
// integer GEMM runs: there the activations take the first 8-bit pass only (llama.cpp's accuracy, x̂ = d·q, error up
// to d/2 per element; qgemm.h: qgemm_onepass_*, the same bits with AVX512-VNNI or AVX2), for 1.1-1.6x its speed.
enum class Activations { F32, Q8, Q8Fast };

// y = x · wᵀ:  x [n_tok][n_in] f32 row-major (row stride n_in), y [n_tok][n_out] f32 row-major (row stride n_out).
// Splits the work over the pool. Small n_tok (decode: below 6-12 tokens depending on the type) runs dot products
// straight from the stored format, up to 4 tokens per pass over a row; larger n_tok dequantizes tiles of w to f32
// for a register-blocked GEMM. With act == F32 every path computes dequantize_row(w)·x with f32 products and sums,
// so a row's result agrees with it to f32 rounding (~1e-7 of Σ|w||x|) whatever n_tok, the thread count or the CPU
// path. With act == Q8 the decode path of the quantized types (up to 16 tokens) uses 8-bit activations instead
// (backend/cpu/quants-dot.h: error bound), and so does the prefill path of the types qgemm.h covers; a row's result
// does not depend on the thread count, nor on n_tok within the decode range (below 17) or within the prefill range.
void matmul(const WeightView & w, const float * x, float * y, int64_t n_tok, ThreadPool & pool,
            Activations act = Activations::F32);

// n_mats (<= kMaxMatmulMulti) products of the same activations, y[i] = x · w[i]ᵀ, every w[i] with the same n_in
// (a layer's Q, K and V; its gate and up). Each y[i] is exactly what matmul(w[i], x, y[i], n_tok, pool) computes;
// on the decode path the rows of all the matrices are shared out in one parallel job (one synchronization of the
// pool instead of n_mats, and no thread idle at the end of a small matrix).
constexpr int kMaxMatmulMulti = 7;
void          matmul_multi(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                           ThreadPool & pool, Activations act = Activations::F32);

// Work fused into matmul_multi's decode job (the LoRA op, lora.h), so that it costs no pool round of its own:
// pre(item) for item in [0, n_pre) first (work that needs only x), then post(m, r0, r1) right after rows [r0, r1) of
// y[m] have their values, on the same thread, once every pre item is done. Each call is made exactly once, on
// whichever thread: what it computes must not depend on which.
struct DecodeHook {
    int64_t                                            n_pre = 0;
    std::function<void(int64_t item)>                  pre;
    std::function<void(int m, int64_t r0, int64_t r1)> post;
};
// matmul_multi with the hook in its decode job; returns false, having run nothing of the hook, where the product
// does not take the decode path (prefill, an empty matrix).
bool matmul_multi_hooked(const WeightView * w, float * const * y, int n_mats, const float * x, int64_t n_tok,
                         ThreadPool & pool, Activations act, const DecodeHook & hook);

// Same contract, plain reference implementation (dequantize each row, f64 accumulation); for tests.
void matmul_reference(const WeightView & w, const float * x, float * y, int64_t n_tok);

}  // namespace kvcmas::cpu
