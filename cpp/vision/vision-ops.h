// Row kernels of the vision transformer that the text engine does not need (portable code; the compiler
// vectorises the loops).
#pragma once

#include <cstdint>
#include <vector>

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

// x[i] = act(x[i]) in place, for n values.
void activate(Activation act, float * x, int64_t n);

// x[i] = exp(x[i] - max) / Σ exp(x[j] - max): a numerically safe softmax of one row, in place.
void softmax(float * x, int64_t n);

// y [n_tok, w.n_out] = x · wᵀ + b (b may be empty), on the pool.
void linear(const cpu::WeightView & w, const std::vector<float> & b, const float * x, float * y, int64_t n_tok,
            cpu::ThreadPool & pool);

// Threads of an encoder's pool: n_threads when positive, else all cores (at most 64).
int encoder_threads(int n_threads);

}  // namespace kvcmas::vision
