// Row kernels of the vision transformer that the text engine does not need (portable code; the compiler
// vectorises the loops).
#pragma once

#include <cstdint>
#include <vector>

#include "backend/cpu/attention.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/threadpool.h"

namespace kvcmas::vision {

// The MLP activations of the supported towers, by what they compute (Hugging Face names in parentheses).
enum class Activation {
    GeluErf,    // x * Φ(x), exact ("gelu")
    GeluTanh,   // tanh approximation ("gelu_pytorch_tanh", "gelu_new")
    QuickGelu,  // x * sigmoid(1.702 x) ("quick_gelu", OpenAI CLIP)
    Silu,       // x * sigmoid(x) ("silu")
};

// Parses a Hugging Face activation name; returns false when it is not one of the above.
bool parse_activation(const char * name, Activation & out);

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

// y [n_tok, w.n_out] = x · wᵀ + b (b may be empty), on the pool.
void linear(const cpu::WeightView & w, const std::vector<float> & b, const float * x, float * y, int64_t n_tok,
            cpu::ThreadPool & pool);

// Multi-head attention without a mask within segments: for each segment [seg[s], seg[s + 1]) of the rows and
// each head h (columns [h·hd, (h + 1)·hd), hd = E / H), out[t] = softmax(q[t]·Kᵀ / sqrt(hd)) V over the
// segment's rows. q, k, v, out are [N][E] row-major, seg ascending from 0 to N. Short segments (Qwen's windows)
// run the backend's fused kernel (cpu::attend_block), all segments' query blocks in one parallel job; long ones
// run head by head as two GEMMs (scores = q·Kᵀ, out = softmax(scores)·V) through scratch (n² + 3·n·hd floats).
void segment_attention(const float * q, const float * k, const float * v, float * out, int64_t E, int64_t H,
                       const std::vector<int64_t> & seg, std::vector<float> & scratch, cpu::ThreadPool & pool);

// Threads of an encoder's pool: n_threads when positive, else all cores (at most 64).
int encoder_threads(int n_threads);

}  // namespace kvcmas::vision
