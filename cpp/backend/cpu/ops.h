// Small element-wise and row kernels of the forward pass (portable code; the compiler vectorizes them).
#pragma once

#include <cstdint>
#include <vector>

namespace kvcmas::cpu {

// y[i] = x[i] / sqrt(mean(x²) + eps) * w[i] for one row of n.
void rms_norm(const float * x, const float * w, float * y, int64_t n, float eps);

// Σ a[i]·b[i] in f32, summed in a fixed order (8 interleaved partial sums; AVX2 where the CPU has it): the same
// result on every call on one machine.
float dot_f32(const float * a, const float * b, int64_t n);

// y[i] = silu(gate[i]) * up[i]
void silu_mul(const float * gate, const float * up, float * y, int64_t n);

// y[i] = gelu_tanh(gate[i]) * up[i] (GELU's tanh approximation, as gemma's hidden_activation gelu_pytorch_tanh)
void gelu_tanh_mul(const float * gate, const float * up, float * y, int64_t n);

// RoPE of one position, applied to n_head vectors of head_dim floats laid out one after another.
// Rotates the first n_rot dims of each head by angle pos * inv_freq[j] for pair j; neox pairs dims (j, j + n_rot/2),
// otherwise (2j, 2j + 1) as llama.cpp's llama models store Q/K. inv_freq has n_rot/2 entries.
struct Rope {
    int                n_rot = 0;
    bool               neox  = false;
    std::vector<float> inv_freq;  // [n_rot/2]; includes frequency factors and linear scaling

    // Rotates by position `pos` (may be negative, to undo a rotation).
    void apply(float * x, int n_head, int head_dim, double pos) const;

    // cos/sin [n_rot/2] of position pos, for apply_cs (positions repeat across layers: compute them once).
    void angles(double pos, float * cos_out, float * sin_out) const;
    void apply_cs(float * x, int n_head, int head_dim, const float * cos_v, const float * sin_v) const;
};

}  // namespace kvcmas::cpu
