#include "backend/cpu/ops.h"

#include <cmath>

#include "backend/cpu/cpu-features.h"

namespace kvcmas::cpu {

void rms_norm(const float * x, const float * w, float * y, int64_t n, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        sum += static_cast<double>(x[i]) * x[i];
    }
    const float scale = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) {
        y[i] = x[i] * scale * w[i];
    }
}

#ifdef KC_X86
float dot_f32_avx2(const float * a, const float * b, int64_t n);
#endif

float dot_f32(const float * a, const float * b, int64_t n) {
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        return dot_f32_avx2(a, b, n);
    }
#endif
    float         acc[8] = {};
    const int64_t n8     = n - n % 8;
    for (int64_t i = 0; i < n8; i += 8) {
        for (int l = 0; l < 8; ++l) {
            acc[l] += a[i + l] * b[i + l];
        }
    }
    for (int64_t i = n8; i < n; ++i) {
        acc[i - n8] += a[i] * b[i];
    }
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

#ifdef KC_X86
void silu_mul_avx2(const float * gate, const float * up, float * y, int64_t n);
void gelu_tanh_mul_avx2(const float * gate, const float * up, float * y, int64_t n);
#endif

void silu_mul(const float * gate, const float * up, float * y, int64_t n) {
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        silu_mul_avx2(gate, up, y, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        y[i]          = g / (1.0f + std::exp(-g)) * up[i];
    }
}

void gelu_tanh_mul(const float * gate, const float * up, float * y, int64_t n) {
#ifdef KC_X86
    if (cpu_features().avx2_fma_f16c) {
        gelu_tanh_mul_avx2(gate, up, y, n);
        return;
    }
#endif
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    for (int64_t i = 0; i < n; ++i) {
        const float g = gate[i];
        y[i]          = 0.5f * g * (1.0f + std::tanh(k * (g + 0.044715f * g * g * g))) * up[i];
    }
}

void Rope::angles(double pos, float * cos_out, float * sin_out) const {
    for (int j = 0; j < n_rot / 2; ++j) {
        const double angle = pos * static_cast<double>(inv_freq[static_cast<size_t>(j)]);
        cos_out[j]         = static_cast<float>(std::cos(angle));
        sin_out[j]         = static_cast<float>(std::sin(angle));
    }
}

void Rope::apply(float * x, int n_head, int head_dim, double pos) const {
    float cs[512], sn[512];  // n_rot/2 <= 512: checked when the model is loaded
    angles(pos, cs, sn);
    apply_cs(x, n_head, head_dim, cs, sn);
}

void Rope::apply_cs(float * x, int n_head, int head_dim, const float * cos_v, const float * sin_v) const {
    const int half = n_rot / 2;
    for (int j = 0; j < half; ++j) {
        const float  c     = cos_v[j];
        const float  s     = sin_v[j];
        const int    i0    = neox ? j : 2 * j;
        const int    i1    = neox ? j + half : 2 * j + 1;
        for (int h = 0; h < n_head; ++h) {
            float *     v  = x + static_cast<int64_t>(h) * head_dim;
            const float a  = v[i0];
            const float b  = v[i1];
            v[i0]          = a * c - b * s;
            v[i1]          = a * s + b * c;
        }
    }
}

}  // namespace kvcmas::cpu
