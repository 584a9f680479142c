#include "vision/vision-ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

namespace kvcmas::vision {

bool parse_activation(const char * name, Activation & out) {
    struct Entry {
        const char * name;
        Activation   act;
    };
    static const Entry kEntries[] = {
        { "gelu", Activation::GeluErf },         { "gelu_pytorch_tanh", Activation::GeluTanh },
        { "gelu_new", Activation::GeluTanh },    { "gelu_fast", Activation::GeluTanh },
        { "quick_gelu", Activation::QuickGelu }, { "silu", Activation::Silu },
        { "swish", Activation::Silu },
    };
    for (const Entry & e : kEntries) {
        if (std::strcmp(name, e.name) == 0) {
            out = e.act;
            return true;
        }
    }
    return false;
}

void layer_norm(const float * x, const float * w, const float * b, float * y, int64_t n, float eps) {
    // Two passes in double: features of a ViT reach magnitudes where a one-pass f32 variance loses digits.
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        sum += x[i];
    }
    const double mean = sum / static_cast<double>(n);
    double       sq   = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        const double d = x[i] - mean;
        sq += d * d;
    }
    const float scale = static_cast<float>(1.0 / std::sqrt(sq / static_cast<double>(n) + eps));
    const float m     = static_cast<float>(mean);
    for (int64_t i = 0; i < n; ++i) {
        y[i] = (x[i] - m) * scale * w[i] + b[i];
    }
}

void activate(Activation act, float * x, int64_t n) {
    switch (act) {
        case Activation::GeluErf:
            for (int64_t i = 0; i < n; ++i) {
                x[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * 0.70710678118654752f));
            }
            return;
        case Activation::GeluTanh:
            // 0.5 x (1 + tanh(u)) == x / (1 + exp(-2u)): one expf instead of tanhf (which calls expm1f), ~2x faster;
            // exp overflowing to inf for very negative x gives the correct limit -0.
            for (int64_t i = 0; i < n; ++i) {
                const float v = x[i];
                const float u = 0.79788456080286536f * (v + 0.044715f * v * v * v);
                x[i]          = v / (1.0f + std::exp(-2.0f * u));
            }
            return;
        case Activation::QuickGelu:
            for (int64_t i = 0; i < n; ++i) {
                x[i] = x[i] / (1.0f + std::exp(-1.702f * x[i]));
            }
            return;
        case Activation::Silu:
            for (int64_t i = 0; i < n; ++i) {
                x[i] = x[i] / (1.0f + std::exp(-x[i]));
            }
            return;
    }
}

void softmax(float * x, int64_t n) {
    float mx = x[0];
    for (int64_t i = 1; i < n; ++i) {
        mx = x[i] > mx ? x[i] : mx;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        x[i] = std::exp(x[i] - mx);
        sum += x[i];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t i = 0; i < n; ++i) {
        x[i] *= inv;
    }
}

void linear(const cpu::WeightView & w, const std::vector<float> & b, const float * x, float * y, int64_t n_tok,
            cpu::ThreadPool & pool) {
    cpu::matmul(w, x, y, n_tok, pool);
    if (b.empty()) {
        return;
    }
    const int64_t n = w.n_out;
    pool.run([&](int ith, int nth) {
        long long t0, t1;
        cpu::split_range(n_tok, ith, nth, t0, t1);
        for (long long t = t0; t < t1; ++t) {
            float * row = y + t * n;
            for (int64_t i = 0; i < n; ++i) {
                row[i] += b[static_cast<size_t>(i)];
            }
        }
    });
}

int encoder_threads(int n_threads) {
    if (n_threads > 0) {
        return n_threads;
    }
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(std::min(hw, 64u));
}

}  // namespace kvcmas::vision
